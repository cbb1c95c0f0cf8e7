"""Hierarchical attention (H-Transformer-1D style): exact nearby, pooled further away, coarser with distance.

Legend: N batch, H heads, L queries, S keys, b block size, ℓ level, c_ℓ = b·2^ℓ segment length,
Kt keys seen by one query block, E head dim, Ev value dim.

Queries are cut into blocks of b. A query block qb sees
  level "near": the raw keys of key blocks qb-1, qb, qb+1 — exact attention there;
  level ℓ >= 0:  pooled segments of c_ℓ keys (mean key, mean value, count n) whose parent segment at
                 level ℓ+1 neighbours the query's, but which do not neighbour it themselves.
Every key is covered exactly once (Note [Hierarchical coverage]). A pooled segment enters the softmax
with score q·k̄·s + log n, i.e. as n copies of its mean key; its weight is shared evenly by its keys,
so the effective weights over the S keys are well defined (need_weights returns them).
Each query block sees 3b raw keys and at most 3 segments per level: O(L·(b + log(S/b))·D) time.
(Zhu & Soricut 2021, H-Transformer-1D, arXiv:2107.11906; the partition is the H-matrix one.)

# Note [Hierarchical coverage]: let m_ℓ = ⌊j / c_ℓ⌋ and p_ℓ = ⌊i_block / 2^ℓ⌋ (key and query segment
# at level ℓ; level "near" uses ℓ = 0 with raw keys). "Near at ℓ" means |m_ℓ − p_ℓ| <= 1, and near at ℓ
# implies near at ℓ+1. A key is raw if near at 0; otherwise it lies in the one pooled segment of the
# level just below the first level where it is near. With ``levels`` limited, the top pooled level takes
# every segment that is not near (no parent condition), so nothing is dropped.
# Causal: pooled segments that are not near and lie after the query block are dropped; those before
# it end before the block starts, so a query never sees a later key, raw or pooled.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import Inputs, Mechanism, Spec, register
from ..kernels.dense import masked_softmax

__all__ = ["Hierarchical"]


def _auto_levels(nqb: int, nkb: int) -> int:
    """Pooled levels needed until every segment is near every query block (p = m = 0 at the top)."""
    n = max(nqb, nkb, 1)
    return max(0, math.ceil(math.log2(n))) if n > 1 else 0


@register("hierarchical", Spec(
    exact=False, causal=True, masks="key", weights=True, dropout=True,
    time="O(L·(b + log(S/b))·D)", memory="O(L·(b + log(S/b)))",
    paper="Zhu & Soricut 2021, H-Transformer-1D (arXiv:2107.11906)",
    summary="exact in a local window of blocks, mean-pooled keys/values at coarser levels for the far context",
    error_band=1.5))  # Note [Error bands] in mechanisms/__init__.py: max 0.96 measured
@dataclass(frozen=True)
class Hierarchical(Mechanism):
    """block_size: b, the local block (raw keys of the query's block and its two neighbours);
    levels: pooled levels (None: as many as the sequence needs, so every key is covered; fewer makes
    the top level cover all the rest at its resolution); 0 gives block-local attention only."""

    block_size: int = 64
    levels: int | None = None

    def __post_init__(self):
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {self.block_size!r}")
        if self.levels is not None and (isinstance(self.levels, bool) or not isinstance(self.levels, int)
                                        or self.levels < 0):
            raise ValueError(f"levels must be None or an int >= 0, got {self.levels!r}")

    def _plan(self, L: int, S: int, is_causal: bool, device):
        """Index tables: which bank rows each query block sees. Returns (idx [nqb, Kt], valid [nqb, Kt],
        segments per level, columns per level)."""
        b = self.block_size
        nqb, nkb = -(-L // b), -(-S // b)
        auto = _auto_levels(nqb, nkb)
        nlev = auto if self.levels is None else min(self.levels, auto)
        qb = torch.arange(nqb, device=device)
        # raw near keys: blocks qb-1, qb, qb+1 -> token indices
        nb = qb.unsqueeze(1) + torch.arange(-1, 2, device=device)  # (nqb, 3)
        tok = (nb.unsqueeze(-1) * b + torch.arange(b, device=device)).reshape(nqb, 3 * b)  # (nqb, 3b)
        raw_valid = (tok >= 0) & (tok < S)
        idx, valid = [tok.clamp(0, max(nkb * b - 1, 0))], [raw_valid]
        offset, sizes, ncols = nkb * b, [], []
        for lev in range(nlev):
            c = b << lev
            n_l = -(-S // c)
            sizes.append(n_l)
            p = torch.div(qb, 1 << lev, rounding_mode="floor")  # (nqb,)
            if lev == nlev - 1 and nlev < auto:
                m = torch.arange(n_l, device=device).expand(nqb, n_l)  # top: every segment
                ok = (m - p.unsqueeze(1)).abs() > 1
            else:
                parent = torch.div(p, 2, rounding_mode="floor")
                m = (2 * parent.unsqueeze(1) + torch.arange(-2, 4, device=device))  # children of parent±1
                ok = ((m - p.unsqueeze(1)).abs() > 1) & (m >= 0) & (m < n_l)
            if is_causal:
                ok = ok & (m < p.unsqueeze(1))
            idx.append(offset + m.clamp(0, n_l - 1))
            valid.append(ok)
            ncols.append(m.shape[1])
            offset += n_l
        return torch.cat(idx, 1), torch.cat(valid, 1), sizes, ncols

    def _forward(self, q, k, v, *, key_keep, attn_mask, is_causal, scale, dropout_p, need_weights):
        cd = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        qf, kf, vf = q.to(cd), k.to(cd), v.to(cd)
        N, H, L, E = q.shape
        S, Ev = k.shape[-2], v.shape[-1]
        b = self.block_size
        nqb, nkb = -(-L // b), -(-S // b)
        idx, valid, sizes, ncols = self._plan(L, S, is_causal, q.device)
        # 1) the bank: raw keys, then pooled (mean) keys of each level; bias = log(count) per row
        keep = torch.ones(1, 1, S, dtype=torch.bool, device=q.device) if key_keep is None else key_keep
        keep_p = F.pad(keep, (0, nkb * b - S))  # (N|1, H|1, nkb·b), padding is not kept
        kp = F.pad(kf, (0, 0, 0, nkb * b - S))  # (N, H, nkb·b, E)
        vp = F.pad(vf, (0, 0, 0, nkb * b - S))
        wk = keep_p.to(cd)
        banks_k, banks_v = [kp], [vp]
        bias = [torch.where(keep_p, 0.0, float("-inf")).to(cd)]  # raw rows: 0 or -inf
        counts = []
        T = nkb * b
        for lev, n_l in enumerate(sizes):
            c = b << lev
            pad = n_l * c - T
            # sums over segments of c keys, from the raw (masked) keys
            ks = F.pad(kp * wk.unsqueeze(-1), (0, 0, 0, pad)).view(N, H, n_l, c, E).sum(3)
            vs = F.pad(vp * wk.unsqueeze(-1), (0, 0, 0, pad)).view(N, H, n_l, c, Ev).sum(3)
            n = F.pad(wk, (0, pad)).view(*wk.shape[:2], n_l, c).sum(3)  # (N|1, H|1, n_l)
            banks_k.append(ks / n.clamp_min(1).unsqueeze(-1))
            banks_v.append(vs / n.clamp_min(1).unsqueeze(-1))
            bias.append(torch.where(n > 0, torch.log(n.clamp_min(1)), float("-inf")))
            counts.append(n)
        bank_k = torch.cat(banks_k, 2)  # (N, H, Tb, E)
        bank_v = torch.cat(banks_v, 2)
        bank_b = torch.cat([x.expand(N, H, x.shape[-1]) for x in bias], 2)  # (N, H, Tb)
        # 2) gather per query block: [N, H, nqb, Kt, ·]
        kg = bank_k[:, :, idx]  # (N, H, nqb, Kt, E)
        vg = bank_v[:, :, idx]  # (N, H, nqb, Kt, Ev)
        bg = bank_b[:, :, idx]  # (N, H, nqb, Kt)
        qb_ = F.pad(qf, (0, 0, 0, nqb * b - L)).view(N, H, nqb, b, E)  # (N, H, nqb, b, E)
        scores = torch.einsum("nhqie,nhqke->nhqik", qb_, kg) * scale + bg.unsqueeze(3)  # (N, H, nqb, b, Kt)
        keep_m = valid.unsqueeze(1).expand(nqb, b, valid.shape[1]).clone()  # (nqb, b, Kt)
        if is_causal:
            qpos = (torch.arange(nqb, device=q.device).unsqueeze(1) * b + torch.arange(b, device=q.device))
            raw = idx[:, : 3 * b]  # (nqb, 3b) token positions
            keep_m[:, :, : 3 * b] &= raw.unsqueeze(1) <= qpos.unsqueeze(2)
        probs = masked_softmax(scores, keep_m)  # (N, H, nqb, b, Kt)
        attn = F.dropout(probs, dropout_p) if dropout_p > 0 else probs
        out = torch.einsum("nhqik,nhqke->nhqie", attn, vg).reshape(N, H, nqb * b, Ev)[:, :, :L]
        w = self._weights(probs, idx, counts, keep_p, sizes, ncols, N, H, L, S) if need_weights else None
        return out.to(q.dtype), (w.to(q.dtype) if w is not None else None)

    def _weights(self, probs, idx, counts, keep_p, sizes, ncols_per_level, N, H, L, S):
        """Effective weights [N, H, L, S]: raw weights in place; a segment's weight split evenly over its
        kept keys."""
        b = self.block_size
        nqb, Kt = idx.shape
        T = keep_p.shape[-1]
        w = torch.zeros(N, H, nqb, b, T, dtype=probs.dtype, device=probs.device)
        raw = idx[:, : 3 * b]
        w.scatter_add_(4, raw.view(1, 1, nqb, 1, 3 * b).expand(N, H, nqb, b, 3 * b), probs[..., : 3 * b])
        col, offset = 3 * b, T
        for lev, n_l in enumerate(sizes):
            c = b << lev
            ncols = ncols_per_level[lev]
            seg = idx[:, col: col + ncols] - offset  # (nqb, ncols)
            ws = torch.zeros(N, H, nqb, b, n_l, dtype=probs.dtype, device=probs.device)
            ws.scatter_add_(4, seg.view(1, 1, nqb, 1, ncols).expand(N, H, nqb, b, ncols), probs[..., col: col + ncols])
            per_key = ws / counts[lev].clamp_min(1).view(*counts[lev].shape[:2], 1, 1, n_l)
            spread = per_key.repeat_interleave(c, dim=-1)[..., :T]  # (N, H, nqb, b, T)
            w = w + spread * keep_p.view(*keep_p.shape[:2], 1, 1, T).to(w.dtype)
            col += ncols
            offset += n_l
        return w.reshape(N, H, nqb * b, T)[:, :, :L, :S]

    def flops(self, L, S, E, Ev=None):
        Ev = E if Ev is None else Ev
        b = self.block_size
        nlev = _auto_levels(-(-L // b), -(-S // b)) if self.levels is None else self.levels
        return 2 * L * (3 * b + 6 * nlev) * (E + Ev) + 2 * S * (E + Ev) * max(nlev, 1)

    def memory(self, L, S, E, Ev=None, element_size=4):
        Ev = E if Ev is None else Ev
        b = self.block_size
        nlev = _auto_levels(-(-L // b), -(-S // b)) if self.levels is None else self.levels
        kt = 3 * b + 6 * nlev
        return (3 * L * kt + (L // b + 1) * kt * (E + Ev) + 2 * S * (E + Ev)) * element_size
