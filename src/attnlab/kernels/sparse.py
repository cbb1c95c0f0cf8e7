"""Block-sparse attention by gathering: each query block gets exactly the key blocks its layout needs,
and PyTorch's fused kernel runs on the gathered blocks with a small edge mask.

Query blocks are grouped by how many key blocks they need, so each group is one fused call (per
chunk of at most CHUNK_BYTES) over a [G, N·H, block_q, c·block_k] problem. Empty blocks cost nothing; work and memory are O(nnz blocks).
Autograd flows through the gather (index) and the fused kernel, so training works.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import patterns as P
from .fused import sdpa
from .masks import MaskSpec

__all__ = ["gathered_attention", "plan_groups"]

CHUNK_BYTES = 16 << 20


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
    qp = F.pad(q, (0, 0, 0, nq * block_q - L)) if nq * block_q != L else q.contiguous()
    kp = F.pad(k, (0, 0, 0, nk * block_k - S)) if nk * block_k != S else k.contiguous()
    vp = F.pad(v, (0, 0, 0, nk * block_k - S)) if nk * block_k != S else v.contiguous()
    groups = plan_groups(layout)
    covered = sum(len(rows) for rows, _, _ in groups) == nq
    # (N, H, nq, bq, Ev); rows with no key at all stay 0, the others are written once, in place
    out = (q.new_empty if covered else q.new_zeros)(N, H, nq, block_q, Ev)
    for rows, cols, full in groups:
        # chunks keep each gathered K/V and each output below CHUNK_BYTES: larger fresh buffers are
        # mmap-ed and page-faulted on every call (measured: one 76 MB gather 4.7x slower than 16 MB ones)
        out_row = N * H * block_q * Ev * q.element_size()
        gather_row = N * H * cols.shape[1] * block_k * max(E, Ev) * q.element_size()
        runs = []
        for r, c, st in _runs(rows, cols):
            per = max(1, CHUNK_BYTES // (out_row if st is not None else max(out_row, gather_row)))
            runs += [(r[a:a + per], c[a:a + per], st) for a in range(0, len(r), per)]
        for r_rows, r_cols, step in runs:
            og = _attend_run(qp, kp, vp, r_rows, r_cols, step, full, mask, scale, dropout_p, block_q, block_k)
            og = og.permute(1, 2, 0, 3, 4)  # (N, H, G, bq, Ev)
            if _contiguous(r_rows):
                out[:, :, int(r_rows[0]):int(r_rows[0]) + len(r_rows)] = og
            else:
                out.index_copy_(2, r_rows.to(q.device), og)
    return out.view(N, H, nq * block_q, Ev)[:, :, :L]


def _runs(rows: torch.Tensor, cols: torch.Tensor):
    """Split a group into runs that need no gather.

    step 1: consecutive query blocks whose consecutive key blocks slide by one (a band): the keys of
    the whole run are one overlapping-window view (unfold) of the key tensor.
    step 0: query blocks that all need the same consecutive key blocks: one rectangle.
    step None: anything else, gathered by index.
    """
    G, c = cols.shape
    contiguous = bool((cols == cols[:, :1] + torch.arange(c)).all()) if G else False
    if not contiguous:
        return [(rows, cols, None)]
    out, start = [], 0
    d_rows, d_cols = rows[1:] - rows[:-1], cols[1:, 0] - cols[:-1, 0]
    for g in range(1, G + 1):
        if g == G or not (d_rows[g - 1] == 1 and d_cols[g - 1] == (d_cols[start] if g - 1 > start else d_cols[g - 1])
                          and d_cols[g - 1] in (0, 1)):
            if g - start >= 2:
                out.append((rows[start:g], cols[start:g], int(d_cols[start])))
            else:
                out.append((rows[start:g], cols[start:g], None))
            start = g
    return out


def _attend_run(qp, kp, vp, rows, cols, step, full, mask, scale, dropout_p, bq, bk):
    """Attention of one run of query blocks -> (G, N, H, bq, Ev).

    Every case hands the fused kernel a [G, N·H, rows, E] problem built from views where it can
    (batch and heads fold into one dim without a copy), so one call covers the whole run.
    """
    N, H, _, E = qp.shape
    Ev = vp.shape[-1]
    G, c = cols.shape
    dev = qp.device
    r0, k0 = int(rows[0]), int(cols[0, 0])
    ar_q, ar_k = torch.arange(bq, device=dev), torch.arange(bk, device=dev)
    i = rows.to(dev).view(G, 1, 1) * bq + ar_q.view(1, bq, 1)  # (G, bq, 1)
    j = (cols.to(dev).view(G, c, 1) * bk + ar_k.view(1, 1, bk)).view(G, 1, c * bk)  # (G, 1, c·bk)
    if step == 0:
        # one rectangle: all G·bq queries against the same c·bk keys
        qg = qp[:, :, r0 * bq:(r0 + G) * bq]  # (N, H, G·bq, E)
        kg, vg = kp[:, :, k0 * bk:(k0 + c) * bk], vp[:, :, k0 * bk:(k0 + c) * bk]
        attn_mask = None if full else _combine(*mask.block(i.view(G * bq, 1), j[0], N), qp.dtype)
        og = sdpa(qg, kg, vg, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale)  # (N, H, G·bq, Ev)
        return og.view(N, H, G, bq, Ev).permute(2, 0, 1, 3, 4)
    if _contiguous(rows):
        qg = qp[:, :, r0 * bq:(r0 + G) * bq].view(N, H, G, bq, E)
    else:
        qg = qp.view(N, H, -1, bq * E).index_select(2, rows.to(dev)).view(N, H, G, bq, E)
    m = None
    if step == 1 and bq == bk:
        # a band: keys of row g are key blocks [k0 + g, k0 + g + c): overlapping windows, no copy
        kg = kp.unfold(2, c * bk, bk)[:, :, k0:k0 + G].transpose(-1, -2)  # (N, H, G, c·bk, E)
        vg = vp.unfold(2, c * bk, bk)[:, :, k0:k0 + G].transpose(-1, -2)
        if not full and (mask.keep is None and mask.bias is None and _translation_invariant(mask.pattern)
                         and (k0 + G - 1 + c) * bk <= mask.S):
            m = _combine(*mask.block(i[:1], j[:1], N), qp.dtype)[0]  # (1, 1, bq, c·bk): same for every row
    else:
        # anything else: gather the key blocks each query block needs (index_select copies whole blocks)
        idx = cols.to(dev).reshape(-1)
        kg = kp.view(N, H, -1, bk * E).index_select(2, idx).view(N, H, G, c * bk, E)
        vg = vp.view(N, H, -1, bk * Ev).index_select(2, idx).view(N, H, G, c * bk, Ev)
    if not full and m is None:
        m = _fold_mask(_combine(*mask.block(i, j, N), qp.dtype), N, H)  # (G, N·H|1, bq, c·bk)
    og = sdpa(_fold(qg), _fold(kg), _fold(vg), attn_mask=m, dropout_p=dropout_p, scale=scale)  # (G, N·H, bq, Ev)
    return og.view(G, N, H, bq, Ev)


def _fold(x):
    """(N, H, G, ...) -> (G, N·H, ...): a view, since N's stride is H times H's."""
    N, H, G = x.shape[:3]
    return x.movedim(2, 0).reshape(G, N * H, *x.shape[3:])


def _fold_mask(m, N, H):
    """(G, N|1, H|1, bq, k) -> (G, N·H|1, bq, k)."""
    if m.shape[1] == 1 and m.shape[2] == 1:
        return m.squeeze(2)
    return m.expand(m.shape[0], N, H, *m.shape[3:]).reshape(m.shape[0], N * H, *m.shape[3:])


def _contiguous(rows: torch.Tensor) -> bool:
    return int(rows[-1]) - int(rows[0]) + 1 == len(rows)


def _translation_invariant(p) -> bool:
    """True when keep(i, j) depends on j - i only (bands and their combinations)."""
    if p is None:
        return True
    if isinstance(p, P._Band):
        return True
    if isinstance(p, P._Combine):
        return _translation_invariant(p.a) and _translation_invariant(p.b)
    return False


def _combine(keep, bias, dtype):
    """One SDPA mask from keep (bool) and bias (float): bool when there is no bias."""
    if bias is None:
        return keep
    b = bias.to(dtype)
    return b if keep is None else b.masked_fill(~keep, float("-inf"))
