"""Block-sparse attention by gathering: each query block gets exactly the key blocks its layout needs,
and PyTorch's fused kernel runs on the gathered blocks with a small edge mask.

Query blocks are grouped by how many key blocks they need, so each group is one fused call over a
[G·N, H, block_q, c·block_k] problem. Empty blocks cost nothing; work and memory are O(nnz blocks).
Autograd flows through the gather (index) and the fused kernel, so training works.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import patterns as P
from .fused import sdpa
from .masks import MaskSpec

__all__ = ["gathered_attention", "plan_groups"]


def plan_groups(layout: torch.Tensor):
    """[(rows [G], key_blocks [G, c], all_full: bool)] grouping query blocks by key-block count."""
    nonempty = layout != P.EMPTY
    counts = nonempty.sum(1)
    groups = []
    for c in sorted(set(counts.tolist()) - {0}):
        rows = (counts == c).nonzero().squeeze(1)
        cols = nonempty[rows].nonzero()[:, 1].view(len(rows), c)  # row-major, so rows stay grouped
        full = bool((layout[rows.unsqueeze(1), cols] == P.FULL).all())
        groups.append((rows, cols, full))
    return groups


def gathered_attention(q, k, v, mask: MaskSpec, scale: float, dropout_p: float = 0.0,
                       block_q: int = 128, block_k: int = 128):
    """q [N, H, L, E], k [N, H, S, E], v [N, H, S, Ev] -> out [N, H, L, Ev]."""
    N, H, L, E = q.shape
    S, Ev = k.shape[2], v.shape[-1]
    nq, nk = -(-L // block_q), -(-S // block_k)
    layout = mask.layout(block_q, block_k, device="cpu")
    qp = F.pad(q, (0, 0, 0, nq * block_q - L)).view(N, H, nq, block_q, E)
    kp = F.pad(k, (0, 0, 0, nk * block_k - S)).view(N, H, nk, block_k, E)
    vp = F.pad(v, (0, 0, 0, nk * block_k - S)).view(N, H, nk, block_k, Ev)
    dev = q.device
    ar_q = torch.arange(block_q, device=dev)
    ar_k = torch.arange(block_k, device=dev)
    rows_all, outs = [], []
    for rows, cols, full in plan_groups(layout):
        G, c = cols.shape
        rows_d, cols_d = rows.to(dev), cols.to(dev)
        qg = qp[:, :, rows_d].permute(2, 0, 1, 3, 4).reshape(G * N, H, block_q, E)  # (G·N, H, bq, E)
        kg = kp[:, :, cols_d].permute(2, 0, 1, 3, 4, 5).reshape(G * N, H, c * block_k, E)  # (G·N, H, c·bk, E)
        vg = vp[:, :, cols_d].permute(2, 0, 1, 3, 4, 5).reshape(G * N, H, c * block_k, Ev)
        attn_mask = None
        if not full:
            i = (rows_d.view(G, 1, 1) * block_q + ar_q.view(1, block_q, 1))  # (G, bq, 1)
            j = (cols_d.view(G, c, 1) * block_k + ar_k.view(1, 1, block_k)).view(G, 1, c * block_k)
            keep, bias = mask.block(i, j, N)  # (G, N|1, H|1, bq, c·bk)
            attn_mask = _to_sdpa_mask(keep, bias, G, N, q.dtype)
        og = sdpa(qg, kg, vg, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale)  # (G·N, H, bq, Ev)
        rows_all.append(rows_d)
        outs.append(og.view(G, N, H, block_q, Ev))
    out = torch.zeros(nq, N, H, block_q, Ev, dtype=q.dtype, device=dev)
    if outs:
        out = out.index_copy(0, torch.cat(rows_all), torch.cat(outs))  # query blocks with no keys stay 0
    return out.permute(1, 2, 0, 3, 4).reshape(N, H, nq * block_q, Ev)[:, :, :L]


def _to_sdpa_mask(keep, bias, G, N, dtype):
    if bias is not None:
        m = bias.to(dtype)
        if keep is not None:
            m = m.masked_fill(~keep, float("-inf"))
    else:
        m = keep
    n_dim, h_dim = m.shape[1], m.shape[2]
    m = m.expand(G, N, h_dim, *m.shape[3:]) if n_dim != N else m
    return m.reshape(G * N, h_dim, *m.shape[3:])
