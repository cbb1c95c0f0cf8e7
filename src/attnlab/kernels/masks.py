"""One description of everything besides q·kᵀ·scale that shapes a score: causal, a pattern, a user bool
or float mask, ALiBi slopes and tanh soft-capping.

Kernels never see the user's arguments; they ask a ``MaskSpec`` for the keep/bias of a block of
queries x keys (ALiBi included, computed from positions), for the block layout (which blocks are empty,
partial or full), and to soft-cap a block of scores (``cap``).

Note [Score modifications]: one formula for every kernel, flash-attn's (``flash_attn_func(softcap=,
alibi_slopes=)``): with x = q·kᵀ·scale,
    score[n, h, i, j] = softcap·tanh(x / softcap)  -  slope[n, h]·|i + S − L − j|  +  bias[n, h, i, j]
then masked entries become -inf. Soft-capping comes first (only the product is capped); ALiBi counts
query i at position i + S − L, so queries line up with the last L keys (as a KV cache does).

Tensors inside are 4-D: [N, H, L, S] with N the flattened batch (each dim may be 1 to broadcast).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import patterns as P

__all__ = ["MaskSpec"]


@dataclass
class MaskSpec:
    """Everything that masks the scores of one call, for [N, H, L, S] (N = B, the flattened batch): a
    pattern (causal included), a user bool mask ``keep`` and a user float mask ``bias``, both 4-D and
    broadcastable. Kernels ask it for one block's keep/bias (``block``) and for block layouts."""

    L: int
    S: int
    pattern: P.Pattern | None = None  # includes causal when is_causal was given
    keep: torch.Tensor | None = None  # user bool mask, 4-D broadcastable, True = takes part
    bias: torch.Tensor | None = None  # user float mask, 4-D broadcastable, added to the scores
    softcap: float | None = None  # > 0: x -> softcap·tanh(x / softcap) on the scaled product (Note [Score modifications])
    alibi: torch.Tensor | None = None  # ALiBi slopes [N|1, H], float32 or float64
    #: a relative bias table [H, L + S - 1]: rel_bias[h, j - i + L - 1] added to query i's score for key j
    #: (flex_attention's score_mod proved a function of (h, kv_idx - q_idx): Note [Relative bias table])
    rel_bias: torch.Tensor | None = None
    #: attention sinks [H]: one logit per query head in the softmax denominator, masks nothing (Note [Attention
    #: sinks] in ``kernels.lse``); may require grad
    sinks: torch.Tensor | None = None
    # layouts already built for this call: the planner costs block shapes and the kernel then asks again
    _layouts: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def is_trivial(self) -> bool:
        """No mask or bias at all (not even causal or ALiBi): every (query, key) pair takes part as
        its (maybe soft-capped) product."""
        return (self.pattern is None and self.keep is None and self.bias is None and self.alibi is None
                and self.rel_bias is None)

    def softcap_for(self, dtype: torch.dtype) -> float | None:
        """The soft-cap in effect for scores computed in ``dtype``: None when off, and when ``softcap``
        exceeds the dtype's largest finite value.

        # Note [Soft-cap at infinity]: c·tanh(x / c) -> x as c -> inf, so a cap past the compute dtype's range
        # is the identity; computed literally it became inf there and inf·tanh(x / inf) = inf·0 = NaN in every
        # kernel (softcap=3.5e38 with float32 inputs, which compute in float32; half types too). Caps just
        # inside the range lose nothing that matters: x / c is subnormal for |x| < c·2^-126, an absolute score
        # error of at most c·2^-150 (7e-8 at c = 1e38). tests/functional/test_score_mods.py checks both.
        """
        if self.softcap is None or self.softcap > torch.finfo(dtype).max:
            return None
        return self.softcap

    def cap(self, s: torch.Tensor) -> torch.Tensor:
        """Scaled products s (any shape) soft-capped when ``softcap`` is set (Note [Score modifications]),
        in s's dtype (Note [Soft-cap at infinity])."""
        c = self.softcap_for(s.dtype)
        return s if c is None else torch.tanh(s / c) * c

    def alibi_bias(self, i: torch.Tensor, j: torch.Tensor, g: int = 0) -> torch.Tensor:
        """-slope·|i + S − L − j| for query positions i [*G, bq, 1] and key positions j [*G, 1, bk]:
        [*G, N|1, H, bq, bk] in the slopes' dtype (g = len(G))."""
        d = (i + (self.S - self.L) - j).abs().to(self.alibi.dtype).unsqueeze(g).unsqueeze(g)  # (*G, 1, 1, bq, bk)
        return -self.alibi.view(*self.alibi.shape, 1, 1) * d

    def bias_finer_than(self, dtype: torch.dtype) -> bool:
        """True when ``dtype`` is a half type and the float mask is finer (a float32 bias with bfloat16
        inputs), or ALiBi is given (its bias is float32 at least): a kernel that would round it to
        ``dtype`` must compute in float32 instead.

        # Note [Bias precision]: a bias of magnitude b loses up to b·2^-9 in bfloat16 (0.1 at b = 50),
        # a logit error no accumulation in float32 can undo; the dense kernel keeps it in float32.
        """
        eps = torch.finfo(dtype).eps
        if eps <= torch.finfo(torch.float32).eps:  # half inputs only
            return False
        # ALiBi's bias reaches slope·(L + S) and is computed in float32 (as flash-attn does)
        return self.alibi is not None or (self.bias is not None and torch.finfo(self.bias.dtype).eps < eps)

    def block(self, i: torch.Tensor, j: torch.Tensor, N: int):
        """keep, bias for query positions i [..., bq, 1] and key positions j [..., 1, bk].

        Leading dims of i/j are 'block group' dims G (possibly none). Returns tensors shaped
        [*G, N|1, H|1, bq, bk] (or None). Positions past L or S are clamped for evaluation and
        keys past S are dropped (keep False).
        """
        ic = i.clamp(max=max(self.L - 1, 0))
        jc = j.clamp(max=max(self.S - 1, 0))
        keep = (j < self.S) if bool((j >= self.S).any()) else None
        g = i.dim() - 2  # number of group dims
        if keep is not None:
            keep = keep.unsqueeze(g).unsqueeze(g)  # [*G, 1, 1, 1, bk]
        if self.pattern is not None:
            m = self.pattern.keep(ic, jc, self.L, self.S)
            if self.pattern.batch_size:
                m = torch.movedim(m, 0, g).unsqueeze(g + 1)  # [*G, N, 1, bq, bk]
            else:
                m = m.unsqueeze(g).unsqueeze(g)  # [*G, 1, 1, bq, bk]
            keep = m if keep is None else keep & m
        if self.keep is not None:
            keep = self._gather(self.keep, ic, jc, g) if keep is None else keep & self._gather(self.keep, ic, jc, g)
        bias = self._gather(self.bias, ic, jc, g) if self.bias is not None else None
        if self.alibi is not None:
            a = self.alibi_bias(ic, jc, g)
            bias = a if bias is None else bias + a
        return keep, bias

    @staticmethod
    def _gather(m: torch.Tensor, i, j, g):
        ii = i if m.shape[-2] != 1 else torch.zeros_like(i)
        jj = j if m.shape[-1] != 1 else torch.zeros_like(j)
        x = m[:, :, ii, jj]  # [N|1, H|1, *G, bq, bk]
        for _ in range(g):
            x = torch.movedim(x, 2, 0)
        return x

    def layout(self, block_q: int, block_k: int, device=None) -> torch.Tensor:
        """int8 [nq, nk] of EMPTY/PARTIAL/FULL blocks for the combined mask (conservative). Read-only: it is
        built once per block shape and device and shared."""
        key = (block_q, block_k, str(torch.device(device)) if device is not None else None)
        if key not in self._layouts:
            self._layouts[key] = self._layout(block_q, block_k, device)
        return self._layouts[key]

    def _layout(self, block_q: int, block_k: int, device=None) -> torch.Tensor:
        nq, nk = -(-self.L // block_q), -(-self.S // block_k)
        if self.pattern is not None:
            lay = self.pattern.block_layout(self.L, self.S, block_q, block_k, device=device)
        else:
            lay = torch.full((nq, nk), P.FULL, dtype=torch.int8, device=device)
        if self.S % block_k and nk:
            lay[:, -1] = torch.where(lay[:, -1] == P.FULL, P.PARTIAL, lay[:, -1]).to(torch.int8)
        if self.keep is not None and self.keep.device.type == "meta":
            # no values to read (a meta mask describes a call): no block is known empty or full
            lay = torch.where(lay == P.FULL, torch.ones_like(lay), lay)
        elif self.keep is not None:
            k = self.keep.any(0).any(0) if self.keep.shape[0] * self.keep.shape[1] != 1 else self.keep[0, 0]
            k_all = self.keep.all(0).all(0) if self.keep.shape[0] * self.keep.shape[1] != 1 else self.keep[0, 0]
            any_, all_ = _block_reduce(torch.broadcast_to(k, (self.L, self.S)), block_q, block_k, "any"), \
                _block_reduce(torch.broadcast_to(k_all, (self.L, self.S)), block_q, block_k, "all")
            any_, all_ = any_.to(lay.device), all_.to(lay.device)
            lay = torch.where(~any_, torch.zeros_like(lay), lay)
            lay = torch.where((lay == P.FULL) & ~all_, torch.ones_like(lay), lay)
        if self.bias is not None or self.alibi is not None:  # every block adds its bias
            lay = torch.where(lay == P.FULL, torch.ones_like(lay), lay)
        return lay


def _block_reduce(m: torch.Tensor, bq: int, bk: int, how: str) -> torch.Tensor:
    L, S = m.shape
    nq, nk = -(-L // bq), -(-S // bk)
    fill = how == "all"
    x = torch.full((nq * bq, nk * bk), fill, dtype=torch.bool, device=m.device)
    x[:L, :S] = m
    x = x.view(nq, bq, nk, bk)
    return x.any(3).any(1) if how == "any" else x.all(3).all(1)
