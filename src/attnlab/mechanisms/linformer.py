"""Linformer: project keys and values along the sequence to k rows, then attend exactly over those.

Legend: N batch, H heads, L queries, S keys, k projected length, E head dim, Ev value dim.

    out = softmax(Q (P_K K)ᵀ · scale) (P_V V),   P_K, P_V: [k, S]       (Wang et al. 2020, arXiv:2006.04768)

Cost O(L·k·D + k·S·D) time, O(L·k) memory. With k = S and identity projections it is exact attention.
The projections here are fixed: Gaussian N(0, 1/k) drawn from ``seed`` (one [k, S] matrix per S, the
paper's JL choice), segment means (row r averages keys ⌊r·S/k⌋..: rows sum to 1, so each projected
key/value is a mean — far better than Gaussian on untrained inputs), or the identity. ``as_module(max_len)`` gives learnable projections (initialised from the fixed ones).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..caches import ByteLRU
from ..kernels.dense import masked_softmax
from . import Inputs, Mechanism, MechanismModule, Spec, _prepare, register

__all__ = ["Linformer", "LinformerModule"]

PROJECTIONS = ("random", "mean", "identity")


#: the seeded projections kept for reuse weigh at most this together (one [k, S] float64 matrix each)
PROJECTION_CACHE_BYTES = 64 << 20
_PROJECTIONS = ByteLRU("mechanisms.linformer projections", PROJECTION_CACHE_BYTES, max_entries=64)


def _gaussian(seed: int, k: int, S: int, which: int) -> torch.Tensor:
    def draw():
        g = torch.Generator().manual_seed(seed * 2 + which)
        return torch.randn(k, S, generator=g, dtype=torch.float64) / k ** 0.5

    return _PROJECTIONS.get_or_compute((seed, k, S, which), draw)


def linformer_attention(q, k, v, proj_k, proj_v, scale, dropout_p=0.0):
    """q [N, H, L, E], k [N, H, S, E], v [N, H, S, Ev], proj_* [k, S] -> out [N, H, L, Ev]."""
    kp = torch.einsum("rs,nhse->nhre", proj_k, k)  # (N, H, k, E)
    vp = torch.einsum("rs,nhse->nhre", proj_v, v)  # (N, H, k, Ev)
    scores = torch.matmul(q, kp.transpose(-2, -1)) * scale  # (N, H, L, k)
    p = masked_softmax(scores, None)
    if dropout_p > 0:
        p = torch.nn.functional.dropout(p, dropout_p)
    return torch.matmul(p, vp)


@register("linformer", Spec(
    exact=False, causal=False, masks="none", weights=False, dropout=True,
    time="O(L·k·D + k·S·D)", memory="O(L·k)",
    paper="Wang et al. 2020, Linformer: Self-Attention with Linear Complexity (arXiv:2006.04768)",
    summary="keys/values projected along the sequence to k rows (fixed random, identity, or learned)",
    error_band=12.0))  # Note [Error bands] in mechanisms/__init__.py: max 10.6 measured (k = 4), median 6.3
@dataclass(frozen=True)
class Linformer(Mechanism):
    """k: projected length; projection: "random" (N(0, 1/k), from ``seed``), "mean" (segment means) or
    "identity" (needs k = S);
    share_kv: one projection for keys and values (the paper's 'key-value sharing')."""

    k: int = 64
    projection: str = "random"
    share_kv: bool = False
    seed: int = 0

    def __post_init__(self):
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"k must be an int >= 1, got {self.k!r}")
        if self.projection not in PROJECTIONS:
            raise ValueError(f"projection must be one of {PROJECTIONS}, got {self.projection!r}")

    def _extra_reasons(self, inputs: Inputs) -> list[str]:
        if self.projection == "identity" and self.k != inputs.S:
            return [f"linformer: projection='identity' needs k == S, got k={self.k}, S={inputs.S}"]
        return []

    def projections(self, S: int, device=None, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """The fixed (P_K, P_V) for S keys, each [k, S] ([S, S] for "identity", [min(k, S), S] for "mean"),
        in ``dtype`` on ``device``. "random" is the same for a given (seed, k, S) on every call, and P_V
        is P_K when ``share_kv``."""
        if self.projection == "identity":
            e = torch.eye(S, device=device, dtype=dtype)
            return e, e
        if self.projection == "mean":
            k = min(self.k, S)
            seg = torch.div(torch.arange(S, device=device) * k, S, rounding_mode="floor")  # (S,)
            p = torch.nn.functional.one_hot(seg, k).T.to(dtype)  # (k, S)
            p = p / p.sum(1, keepdim=True)
            return p, p
        pk = _gaussian(self.seed, self.k, S, 0).to(device=device, dtype=dtype)
        pv = pk if self.share_kv else _gaussian(self.seed, self.k, S, 1).to(device=device, dtype=dtype)
        return pk, pv

    def _forward(self, q, k, v, *, key_keep, attn_mask, is_causal, scale, dropout_p, need_weights, proj=None):
        cd = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        S = k.shape[-2]
        pk, pv = self.projections(S, q.device, cd) if proj is None else (proj[0].to(cd), proj[1].to(cd))
        out = linformer_attention(q.to(cd), k.to(cd), v.to(cd), pk, pv, scale, dropout_p)
        return out.to(q.dtype), None

    def flops(self, L, S, E, Ev=None):
        Ev = E if Ev is None else Ev
        return 2 * self.k * S * (E + Ev) + 2 * L * self.k * (E + Ev)

    def memory(self, L, S, E, Ev=None, element_size=4):
        Ev = E if Ev is None else Ev
        return (3 * L * self.k + self.k * (E + Ev) + 2 * self.k * S) * element_size

    def as_module(self, max_len: int | None = None, learned: bool = True) -> "LinformerModule":
        """nn.Module with projections [k, max_len] as parameters (learned=True) or buffers.

        For a sequence of S <= max_len keys the first S columns are used (the same as zero-padding the
        sequence to max_len, which is how the paper handles shorter inputs)."""
        if max_len is None:
            raise TypeError("Linformer.as_module needs max_len (the longest sequence the projections cover)")
        return LinformerModule(self, max_len, learned)


class LinformerModule(MechanismModule):
    """Linformer with its [k, max_len] projections as parameters (learned) or buffers (fixed)."""

    def __init__(self, mechanism: Linformer, max_len: int, learned: bool = True):
        super().__init__(mechanism)
        if mechanism.projection == "identity" and mechanism.k != max_len:
            raise ValueError(f"projection='identity' needs k == max_len, got k={mechanism.k}, max_len={max_len}")
        pk, pv = mechanism.projections(max_len, dtype=torch.float32)
        self.max_len = max_len
        if learned:
            self.proj_k = nn.Parameter(pk.clone())
            self.proj_v = self.proj_k if mechanism.share_kv else nn.Parameter(pv.clone())
        else:
            self.register_buffer("proj_k", pk.clone())
            self.register_buffer("proj_v", pv.clone())

    def forward(self, query, key, value, *, attn_mask=None, is_causal=False, scale=None, dropout_p=0.0,
                enable_gqa=False, need_weights=False):
        S = key.shape[-2]
        if S > self.max_len:
            raise ValueError(f"key has S={S} positions but this Linformer's projections cover max_len="
                             f"{self.max_len}")
        m = self.mechanism
        if m.projection == "identity" and S != self.max_len:
            raise ValueError(f"projection='identity' needs S == max_len={self.max_len}, got S={S}")
        p = _prepare(_AnyS(m), query, key, value, attn_mask, is_causal, scale, dropout_p, enable_gqa,
                     need_weights)
        out, _ = m._forward(p.q, p.k, p.v, key_keep=None, attn_mask=None, is_causal=False, scale=p.scale,
                            dropout_p=p.dropout_p if self.training else 0.0, need_weights=False,
                            proj=(self.proj_k[:, :S], self.proj_v[:, :S]))
        return out.reshape(p.out_shape)


class _AnyS:
    """Spec check for the module: the identity-projection length rule is checked against max_len."""

    def __init__(self, m: Linformer):
        self.m = m

    def not_supported_reasons(self, inputs):
        return [r for r in self.m.not_supported_reasons(inputs) if "identity" not in r]

    def __repr__(self):
        return repr(self.m)
