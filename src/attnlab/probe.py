"""attnlab.probe: ask narrow questions about attention weights without materialising [L, S] per head.

One pass of the tiled kernel yields each query row's log-sum-exp; every question after that is a
streaming pass over key blocks where weights = exp(scores - lse) exist one block at a time:
chosen heads or rows, top-k keys per query, per-row entropy and max weight, column sums (attention
received by each key), mass on the first key (the "sink") and a histogram of attention distance.
Memory: O(L + S) per head plus one block; time: one score pass per question.
"""
from __future__ import annotations

import torch

from . import patterns as P
from .kernels import TILED as tiled  # the tiled kernel object: its block walk
from .kernels.lse import acc_dtype
from .shapes import check_block_size, prepare

__all__ = ["probe", "AttentionProbe"]


class AttentionProbe:
    """Weights-on-demand for one attention call. Shapes: ``...`` are the query's leading dims."""

    def __init__(self, query, key, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, *,
                 pattern: P.Pattern | None = None, block_size: int | None = None):
        if not isinstance(key, torch.Tensor):  # checked here: the zero value below is built from key
            raise TypeError(f"key must be a torch.Tensor, got {type(key).__name__}")
        check_block_size(block_size)
        value = key.new_zeros(*key.shape[:-1], 1)
        with torch.no_grad():
            self._p = prepare(query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa, pattern)
            self._bq, self._bk = (block_size, block_size) if block_size else tiled.DEFAULT_BLOCK
            acc = acc_dtype(self._p.q.dtype)
            self._q, self._k = self._p.q.to(acc), self._p.k.to(acc)
            _, lse = tiled.tiled_lse(self._q, self._k, self._p.v.to(acc), self._p.mask, self._p.info.scale,
                                     self._bq, self._bk)
        self.lse = lse  # (N, H, L)
        self._lse_b = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, float("inf")))
        self._lead = self._p.out_shape[:-1]  # (..., L)

    @property
    def L(self) -> int:
        """Query length L."""
        return self._p.info.L

    @property
    def S(self) -> int:
        """Key length S."""
        return self._p.info.S

    def _blocks(self, heads=None):
        """Yield (q0, q1, k0, k1, p) with p the weights of one block [N, h, bl, bk]."""
        p = self._p
        q, k, lse = self._q, self._k, self._lse_b
        if heads is not None:
            q, k, lse = q[:, heads], k[:, heads], lse[:, heads]
        layout = p.mask.layout(self._bq, self._bk)
        for q0, q1, k0, k1, kind in tiled.iter_blocks(layout, self.L, self.S, self._bq, self._bk):
            s = tiled.block_scores(q[:, :, q0:q1], k[:, :, k0:k1], _HeadView(p.mask, heads), p.info.scale,
                                    q0, q1, k0, k1, kind, p.N)
            yield q0, q1, k0, k1, s, torch.exp(s - lse[:, :, q0:q1].unsqueeze(-1))

    def _shape(self, x: torch.Tensor, last=None) -> torch.Tensor:
        """(N, H, L[, k]) -> (..., L[, k]) in the query's leading dims."""
        tail = x.shape[3:]
        return x.reshape(self._lead + tuple(tail)) if last is None else x.reshape(self._lead[:-1] + tuple(last))

    @torch.no_grad()
    def weights(self, heads: list[int] | None = None, rows: list[int] | slice | None = None) -> torch.Tensor:
        """Weights [N, h, r, S] for the chosen heads (dim 1 of the 4-D view) and query rows only."""
        p = self._p
        hs = list(range(p.info.H)) if heads is None else list(heads)
        dev = self._q.device
        rs = torch.arange(self.L, device=dev)[rows] if rows is not None else torch.arange(self.L, device=dev)
        out = torch.zeros(p.N, len(hs), len(rs), self.S, dtype=self._q.dtype, device=dev)
        q, k, lse = self._q[:, hs][:, :, rs], self._k[:, hs], self._lse_b[:, hs][:, :, rs]
        i = rs.unsqueeze(-1)
        for k0 in range(0, self.S, self._bk):
            k1 = min(self.S, k0 + self._bk)
            s = torch.matmul(q, k[:, :, k0:k1].transpose(-2, -1)) * p.info.scale
            keep, bias = _HeadView(p.mask, hs).block(i, torch.arange(k0, k1, device=dev).unsqueeze(0), p.N)
            if bias is not None:
                s = s + bias
            if keep is not None:
                s = s.masked_fill(~keep, float("-inf"))
            out[..., k0:k1] = torch.exp(s - lse.unsqueeze(-1))
        return out

    @torch.no_grad()
    def entropy(self) -> torch.Tensor:
        """Entropy of each query row's weights in nats: [..., L] (0 for a row with no key)."""
        acc = torch.zeros_like(self.lse)
        for q0, q1, _, _, s, w in self._blocks():
            acc[:, :, q0:q1] += torch.where(w > 0, w * s, torch.zeros_like(w)).sum(-1)
        h = torch.where(torch.isfinite(self.lse), self.lse - acc, torch.zeros_like(acc))
        return self._shape(h.clamp_min(0))

    @torch.no_grad()
    def max_weight(self) -> torch.Tensor:
        """Largest weight in each query row: [..., L]."""
        best = torch.zeros_like(self.lse)
        for q0, q1, _, _, _, w in self._blocks():
            best[:, :, q0:q1] = torch.maximum(best[:, :, q0:q1], w.amax(-1))
        return self._shape(best)

    @torch.no_grad()
    def topk(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, key indices) of the k most attended keys per query row: [..., L, k] each."""
        if k < 1 or k > self.S:
            raise ValueError(f"k must be in [1, S={self.S}], got {k}")
        N, H, L = self.lse.shape
        vals = torch.full((N, H, L, k), -1.0, dtype=self.lse.dtype, device=self.lse.device)
        idx = torch.zeros((N, H, L, k), dtype=torch.long, device=self.lse.device)
        for q0, q1, k0, k1, _, w in self._blocks():
            cand_v = torch.cat([vals[:, :, q0:q1], w], dim=-1)
            cand_i = torch.cat([idx[:, :, q0:q1], torch.arange(k0, k1, device=w.device).expand_as(w)], dim=-1)
            top = cand_v.topk(k, dim=-1)
            vals[:, :, q0:q1], idx[:, :, q0:q1] = top.values, cand_i.gather(-1, top.indices)
        vals = vals.clamp_min(0)
        return self._shape(vals), self._shape(idx)

    @torch.no_grad()
    def column_sums(self) -> torch.Tensor:
        """Attention received by each key, summed over query rows: [..., S]."""
        N, H, _ = self.lse.shape
        col = torch.zeros(N, H, self.S, dtype=self.lse.dtype, device=self.lse.device)
        for _, _, k0, k1, _, w in self._blocks():
            col[:, :, k0:k1] += w.sum(-2)
        return col.reshape(self._lead[:-1] + (self.S,))

    @torch.no_grad()
    def sink_mass(self) -> torch.Tensor:
        """Weight each query row puts on key 0 (the 'attention sink'): [..., L]."""
        mass = torch.zeros_like(self.lse)
        for q0, q1, k0, _, _, w in self._blocks():
            if k0 == 0:
                mass[:, :, q0:q1] = w[..., 0]
        return self._shape(mass)

    @torch.no_grad()
    def distance_histogram(self, bins: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention mass by |i - j| in bins (edges), summed over rows and averaged per row: ([..., H, nbins], edges)."""
        if bins is None:
            top = max(self.L, self.S)
            bins = [0, 1, 2, 4] + [2**e for e in range(3, max(3, top.bit_length()) + 1)]
        edges = torch.tensor(sorted(set(bins)), dtype=torch.long, device=self.lse.device)
        N, H, L = self.lse.shape
        hist = torch.zeros(N, H, len(edges), dtype=self.lse.dtype, device=self.lse.device)
        for q0, q1, k0, k1, _, w in self._blocks():
            d = (torch.arange(k0, k1, device=w.device).unsqueeze(0) - torch.arange(q0, q1, device=w.device).unsqueeze(1)).abs()  # (bl, bk)
            b = torch.bucketize(d, edges, right=True) - 1  # bin index per pair
            hist.scatter_add_(2, b.flatten().expand(N, H, -1), w.reshape(N, H, d.numel()))  # not -1: N or H may be 0
        hist = hist / max(L, 1)
        return hist.reshape(self._lead[:-2] + (H, len(edges))) if len(self._lead) >= 2 else hist[0, 0], edges


class _HeadView:
    """A MaskSpec restricted to some heads (and optionally some query rows)."""

    def __init__(self, mask, heads):
        self.mask, self.heads = mask, heads
        self.softcap = mask.softcap  # None: probe takes no score modifications

    def softcap_for(self, dtype):
        """The mask's soft-cap in effect in ``dtype`` (MaskSpec.softcap_for)."""
        return self.mask.softcap_for(dtype)

    def block(self, i, j, N):
        keep, bias = self.mask.block(i, j, N)
        if self.heads is not None:
            keep = keep[:, self.heads] if keep is not None and keep.shape[1] > 1 else keep
            bias = bias[:, self.heads] if bias is not None and bias.shape[1] > 1 else bias
        return keep, bias


def probe(query, key, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, *, pattern=None,
          block_size=None) -> AttentionProbe:
    """Compute each row's log-sum-exp once and return an ``AttentionProbe`` for streaming questions.

    Same arguments as ``attnlab.attention`` (no value needed). Example:
        pr = attnlab.probe(q, k, is_causal=True)
        pr.entropy(), pr.topk(5), pr.column_sums(), pr.weights(heads=[0], rows=slice(0, 8))
    """
    return AttentionProbe(query, key, attn_mask, is_causal, scale, enable_gqa, pattern=pattern,
                          block_size=block_size)
