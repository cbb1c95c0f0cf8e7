"""Block-sparse attention by gathering: each query block gets exactly the key blocks its layout needs,
and PyTorch's fused kernel runs on them with a small edge mask.

Query blocks are grouped by how many key blocks they need and split into runs (bands, rectangles,
gathers); each run is one fused call over a [G, N·H, block_q, c·block_k] problem, cut into chunks of at
most CHUNK_BYTES. Empty blocks cost nothing; work and memory are O(non-empty blocks).

Training (CPU, no dropout) goes through ``_SparseFunction``: it saves only q, k, v, out and the
log-sum-exp and adds each run's fused-backward gradients straight into dq, dk, dv. Otherwise autograd
flows through the views, gathers and SDPA.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import patterns as P
from . import fused as _fused
from .fused import sdpa
from .masks import MaskSpec
from .kernel import Kernel, causal_blocks, nonempty_blocks
from .spec import KernelSpec, Request, Tiling, io_bytes

__all__ = ["gathered_attention", "plan_groups", "SPEC", "KERNEL", "SparseKernel", "sparse_block", "DEFAULT_SPARSE_BLOCK"]


def _peak(r: Request, t: Tiling | None) -> int:
    """Gathered key/value blocks per query block, the visited scores (float32) and the lse per row."""
    bq, bk = (t.block_q, t.block_k) if t is not None else (128, 128)
    blocks = t.blocks if t is not None else None
    gathered = blocks * bk if blocks is not None else -(-r.L // bq) * max(r.S, 1)
    computed = t.computed(r.L, r.S) if t is not None else r.L * r.S
    return (io_bytes(r) + r.N * r.H * gathered * (r.E + r.Ev) * r.element_size + computed * 4
            + r.N * r.H * r.L * 4)


def _flops(r: Request, t: Tiling | None) -> int:
    computed = t.computed(r.L, r.S) if t is not None else r.L * r.S
    return r.N * r.H * computed * 2 * (r.E + r.Ev)


# no softcap or ALiBi: each run is one SDPA call, which takes neither (its edge masks cover partial blocks only)
SPEC = KernelSpec("sparse", "only the non-empty key blocks of a mask, gathered through the fused kernel",
                  dropout=True, needs_sparsity=True, blocked=True, peak_bytes=_peak, flops=_flops)

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
    training = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    N, H, L, _ = q.shape
    if 0 in (N, H, L, k.shape[2]):  # nothing to attend (and block views cannot fold a zero batch)
        return _connected(q.new_zeros(N, H, L, v.shape[-1]), q, k, v)
    if mask.bias_finer_than(q.dtype):  # the fused kernel takes the mask in q's dtype: Note [Bias precision]
        return gathered_attention(q.float(), k.float(), v.float(), mask, scale, dropout_p, block_q,
                                  block_k).to(q.dtype)
    if training and dropout_p == 0.0 and _fused.HAS_CPU_FLASH and q.device.type == "cpu" \
            and q.shape[-1] == v.shape[-1] and not (mask.bias is not None and mask.bias.requires_grad):
        try:
            return _SparseFunction.apply(q, k, v, mask, scale, block_q, block_k)
        except _NoFlash:
            pass  # the private op refused these inputs: the autograd path below
    # inference (chunked), dropout, or no fused CPU op: autograd through the views, gathers and SDPA
    out, _ = _forward(q, k, v, mask, scale, dropout_p, block_q, block_k, chunked="forward" if not training else False,
                      with_lse=False)
    return _connected(out, q, k, v) if training else out


def _connected(out, q, k, v):
    """``out`` joined to the autograd graph of q, k, v when no run wrote into it (every block empty):
    its gradient is 0. Sums of empty slices add exactly 0, whatever q, k, v hold (even Inf or NaN)."""
    if out.requires_grad or not torch.is_grad_enabled():
        return out
    return out + (q[..., :0].sum() + k[..., :0].sum() + v[..., :0].sum()).to(out.dtype)


def _plan_runs(q, k, v, mask, block_q, block_k, chunked):
    """[(rows, cols, step, full)] covering every query block with a key block once each."""
    N, H, L, E = q.shape
    S, Ev = k.shape[2], v.shape[-1]
    layout = mask.layout(block_q, block_k, device="cpu")
    runs = []
    for rows, cols, full in plan_groups(layout):
        # chunks keep each gathered K/V and each output below CHUNK_BYTES: larger fresh buffers are
        # mmap-ed and page-faulted on every call (measured: one 76 MB gather 4.7x slower than 16 MB ones).
        # Not under autograd through the views (chunked=False): each chunk's backward would materialise
        # full-size gradients of k and v. The autograd Function chunks both passes ("backward" also counts
        # each run's key/value gradients).
        out_row = N * H * block_q * Ev * q.element_size()
        gather_row = N * H * cols.shape[1] * block_k * max(E, Ev) * q.element_size()
        for r, c, st in _runs(rows, cols):
            # a run's key/value side is a copy when gathered, and always in the backward (its gradients)
            copies_kv = st is None or chunked == "backward"
            per = max(1, CHUNK_BYTES // max(1, max(out_row, gather_row) if copies_kv else out_row))
            per = per if chunked else len(r)
            runs += [(r[a:a + per], c[a:a + per], st, full) for a in range(0, len(r), per)]
    return runs


def _padded(x, n, b):
    return F.pad(x, (0, 0, 0, n * b - x.shape[2])) if n * b != x.shape[2] else x.contiguous()


def _forward(q, k, v, mask, scale, dropout_p, bq, bk, chunked, with_lse):
    """(out [N, H, L, Ev], lse [N, H, nq·bq] (float32, float64 for float64) or None). With lse, each run goes through the private
    CPU flash op (which returns it); otherwise through SDPA (dropout, any device)."""
    N, H, L, E = q.shape
    S, Ev = k.shape[2], v.shape[-1]
    nq, nk = -(-L // bq), -(-S // bk)
    qp, kp, vp = _padded(q, nq, bq), _padded(k, nk, bk), _padded(v, nk, bk)
    runs = _plan_runs(q, k, v, mask, bq, bk, chunked)
    covered = sum(len(r[0]) for r in runs) == nq
    # (N, H, nq, bq, Ev); rows with no key at all stay 0, the others are written once, in place
    out = (q.new_empty if covered else q.new_zeros)(N, H, nq, bq, Ev)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32  # what the fused op returns
    lse = torch.full((N, H, nq, bq), float("-inf"), dtype=lse_dtype, device=q.device) if with_lse else None
    for rows, cols, step, full in runs:
        qg, kg, vg, m = _run_inputs(qp, kp, vp, rows, cols, step, full, mask, bq, bk, additive=with_lse)
        if with_lse:
            r = _fused.flash_cpu_with_lse(qg, kg, vg, m, False, scale)
            if r is None:
                raise _NoFlash
            og, lg = r
            dead = _dead_rows(m)
            if dead is not None:
                og = og.masked_fill(dead.unsqueeze(-1), 0.0)
                lg = lg.masked_fill(dead, float("-inf"))
            _put_rows(lse, rows, _unfold_rows(lg.unsqueeze(-1), step, N, H, len(rows), bq).squeeze(-1))
        else:
            og = sdpa(qg, kg, vg, attn_mask=m, dropout_p=dropout_p, scale=scale)
        _put_rows(out, rows, _unfold_rows(og, step, N, H, len(rows), bq))
    return out.view(N, H, nq * bq, Ev)[:, :, :L], lse


def _unfold_rows(x, step, N, H, G, bq):
    """A run's result -> (N, H, G, bq, ...): rectangles are (N, H, G·bq, ...), the rest (G, N·H, bq, ...)."""
    if step == 0:
        return x.view(N, H, G, bq, *x.shape[3:])
    return x.view(G, N, H, bq, *x.shape[3:]).permute(1, 2, 0, *range(3, x.dim() + 1))


def _put_rows(dst, rows, x):
    """dst[:, :, rows] = x for a run's query blocks (a slice when they are consecutive)."""
    if _contiguous(rows):
        dst[:, :, int(rows[0]):int(rows[0]) + len(rows)] = x
    else:
        dst.index_copy_(2, rows.to(dst.device), x)


def _take_rows(src, rows, step, N, H, bq):
    """The run's rows of a [N, H, nq·bq, D] tensor, shaped like the run's queries."""
    G = len(rows)
    x = src.view(N, H, -1, bq * src.shape[-1])
    x = x[:, :, int(rows[0]):int(rows[0]) + G] if _contiguous(rows) else x.index_select(2, rows.to(src.device))
    x = x.reshape(N, H, G, bq, src.shape[-1])
    return x.reshape(N, H, G * bq, -1) if step == 0 else _fold(x)


def _dead_rows(m):
    """Rows of an additive mask with no finite entry (no key left): [.., bq] bool, or None."""
    if m is None:
        return None
    dead = ~torch.isfinite(m).any(-1)
    return dead if bool(dead.any()) else None


class _NoFlash(Exception):
    """The private CPU flash op is missing or refused a run's inputs."""


class _SparseFunction(torch.autograd.Function):
    """Sparse attention whose backward stores only q, k, v, out and the log-sum-exp: per run, the fused
    CPU backward (given the *global* out and lse) yields that run's gradients, which are added straight
    into dq, dk, dv. Training memory is O(n·d) and no full-size gradient is built per run."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale, bq, bk):
        out, lse = _forward(q, k, v, mask, scale, 0.0, bq, bk, chunked="forward", with_lse=True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask, ctx.scale, ctx.bq, ctx.bk = mask, scale, bq, bk
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        mask, scale, bq, bk = ctx.mask, ctx.scale, ctx.bq, ctx.bk
        N, H, L, E = q.shape
        S, Ev = k.shape[2], v.shape[-1]
        nq, nk = -(-L // bq), -(-S // bk)
        qp, kp, vp = _padded(q, nq, bq), _padded(k, nk, bk), _padded(v, nk, bk)
        op, dop = _padded(out, nq, bq), _padded(dout.to(q.dtype), nq, bq)
        lse_b = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, float("inf")))  # dead rows: p = 0
        lse_b = lse_b.view(N, H, nq * bq, 1)
        acc = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        dq = torch.zeros(N, H, nq, bq, E, dtype=acc, device=q.device)
        dk = torch.zeros(N, H, nk, bk, E, dtype=acc, device=q.device)
        dv = torch.zeros(N, H, nk, bk, Ev, dtype=acc, device=q.device)
        for rows, cols, step, full in _plan_runs(q, k, v, mask, bq, bk, chunked="backward"):
            G, c = cols.shape
            qg, kg, vg, m = _run_inputs(qp, kp, vp, rows, cols, step, full, mask, bq, bk, additive=True)
            og, dog = _take_rows(op, rows, step, N, H, bq), _take_rows(dop, rows, step, N, H, bq)
            lg = _take_rows(lse_b, rows, step, N, H, bq).squeeze(-1)
            gq, gk, gv = _fused.flash_cpu_backward(dog, qg, kg, vg, og, lg, m, scale)
            _put_rows(dq, rows, _unfold_rows(gq, step, N, H, G, bq).to(acc))
            if step == 0:  # one rectangle of key blocks [k0, k0 + c)
                k0 = int(cols[0, 0])
                dk[:, :, k0:k0 + c] += gk.view(N, H, c, bk, E)
                dv[:, :, k0:k0 + c] += gv.view(N, H, c, bk, Ev)
                continue
            gk = gk.view(G, N, H, c, bk, E).permute(1, 2, 0, 3, 4, 5)  # (N, H, G, c, bk, E)
            gv = gv.view(G, N, H, c, bk, Ev).permute(1, 2, 0, 3, 4, 5)
            if step == 1 and bq == bk:  # a band: row g's j-th key block is k0 + g + j
                k0 = int(cols[0, 0])
                for j in range(c):
                    dk[:, :, k0 + j:k0 + j + G] += gk[:, :, :, j]
                    dv[:, :, k0 + j:k0 + j + G] += gv[:, :, :, j]
            else:
                idx = cols.to(q.device).reshape(-1)
                dk.index_add_(2, idx, gk.reshape(N, H, G * c, bk, E).to(acc))
                dv.index_add_(2, idx, gv.reshape(N, H, G * c, bk, Ev).to(acc))
        dq = dq.view(N, H, nq * bq, E)[:, :, :L].to(q.dtype)
        dk = dk.view(N, H, nk * bk, E)[:, :, :S].to(k.dtype)
        dv = dv.view(N, H, nk * bk, Ev)[:, :, :S].to(v.dtype)
        return dq, dk, dv, None, None, None, None


def _runs(rows: torch.Tensor, cols: torch.Tensor):
    """Split a group into runs that need no gather.

    step 1: consecutive query blocks whose consecutive key blocks slide by one (a band): the keys of
    the whole run are one overlapping-window view (unfold) of the key tensor.
    step 0: query blocks that all need the same consecutive key blocks (or one query block alone):
    one rectangle.
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
            # a lone query block with consecutive key blocks is a rectangle of one row: a slice, no copy
            step = int(d_cols[start]) if g - start >= 2 else 0
            out.append((rows[start:g], cols[start:g], step))
            start = g
    return out


def _run_inputs(qp, kp, vp, rows, cols, step, full, mask, bq, bk, additive=False):
    """(q, k, v, mask) of one run for one fused call.

    Rectangles (step 0) are [N, H, G·bq, ·] slices; everything else is [G, N·H, bq | c·bk, ·], built from
    views where it can (batch and heads fold into one dim without a copy). ``additive``: the mask as
    float 0 / -inf (what the private op takes) instead of bool.
    """
    N, H, _, E = qp.shape
    Ev = vp.shape[-1]
    G, c = cols.shape
    dev = qp.device
    r0, k0 = int(rows[0]), int(cols[0, 0])
    ar_q, ar_k = torch.arange(bq, device=dev), torch.arange(bk, device=dev)
    i = rows.to(dev).view(G, 1, 1) * bq + ar_q.view(1, bq, 1)  # (G, bq, 1)
    j = (cols.to(dev).view(G, c, 1) * bk + ar_k.view(1, 1, bk)).view(G, 1, c * bk)  # (G, 1, c·bk)
    dtype = qp.dtype

    def fix(m):
        return _additive(m, dtype) if additive and m is not None else m

    if step == 0:
        # one rectangle: all G·bq queries against the same c·bk keys
        qg = qp[:, :, r0 * bq:(r0 + G) * bq]  # (N, H, G·bq, E)
        kg, vg = kp[:, :, k0 * bk:(k0 + c) * bk], vp[:, :, k0 * bk:(k0 + c) * bk]
        m = None if full else _combine(*mask.block(i.view(G * bq, 1), j[0], N), dtype)
        return qg, kg, vg, fix(m)
    if _contiguous(rows):
        qg = qp[:, :, r0 * bq:(r0 + G) * bq].view(N, H, G, bq, E)
    else:
        qg = qp.view(N, H, -1, bq * E).index_select(2, rows.to(dev)).view(N, H, G, bq, E)
    m = None
    if step == 1 and bq == bk:
        # a band: keys of row g are key blocks [k0 + g, k0 + g + c): overlapping windows, no copy
        span = slice(k0 * bk, (k0 + G - 1 + c) * bk)
        kg = kp[:, :, span].unfold(2, c * bk, bk).transpose(-1, -2)  # (N, H, G, c·bk, E)
        vg = vp[:, :, span].unfold(2, c * bk, bk).transpose(-1, -2)
        if not full and (mask.keep is None and mask.bias is None and P.translation_invariant(mask.pattern)
                         and (k0 + G - 1 + c) * bk <= mask.S):
            m = _combine(*mask.block(i[:1], j[:1], N), dtype)[0]  # (1, 1, bq, c·bk): same for every row
    else:
        # anything else: gather the key blocks each query block needs (index_select copies whole blocks)
        idx = cols.to(dev).reshape(-1)
        kg = kp.view(N, H, -1, bk * E).index_select(2, idx).view(N, H, G, c * bk, E)
        vg = vp.view(N, H, -1, bk * Ev).index_select(2, idx).view(N, H, G, c * bk, Ev)
    if not full and m is None:
        m = _fold_mask(_combine(*mask.block(i, j, N), dtype), N, H)  # (G, N·H|1, bq, c·bk)
    return _fold(qg), _fold(kg), _fold(vg), fix(m)


def _additive(m, dtype):
    if m.dtype == torch.bool:
        return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, float("-inf"))
    return m


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


def _combine(keep, bias, dtype):
    """One SDPA mask from keep (bool) and bias (float): bool when there is no bias."""
    if bias is None:
        return keep
    b = bias.to(dtype)
    return b if keep is None else b.masked_fill(~keep, float("-inf"))


# -- the kernel object ------------------------------------------------------------------------------
DEFAULT_SPARSE_BLOCK = 128
SPARSE_QUERY_ROWS = 256  # query rows per block for patterns with narrow key blocks (see sparse_block)


def sparse_block(p, speeds: dict) -> tuple[int, int]:
    """The sparse kernel's (block_q, block_k): for bands (masks that depend on j - i only) the square edge
    minimising computed area / fused speed (``speeds``: {query block rows: relative speed}); for a pattern
    with a natural block shape (block tables, the fixed pattern) that shape when it computes less than
    the default; else DEFAULT_SPARSE_BLOCK square."""
    pat, mask = p.mask.pattern, p.mask
    default = (DEFAULT_SPARSE_BLOCK, DEFAULT_SPARSE_BLOCK)
    if pat is None or mask.keep is not None or mask.bias is not None or p.is_causal_only:
        return default

    def cost(bq, bk):
        speed = speeds[min(speeds, key=lambda b: abs(b - bq))]
        return nonempty_blocks(p, bq, bk) * bq * bk / speed

    if pat.translation_invariant():
        return min(((b, b) for b in speeds), key=lambda s: cost(*s))
    shape = pat.block_shape()
    if shape is None:
        return default
    if isinstance(pat, P.BlockTable):
        return shape if 32 <= shape[0] <= 512 else default
    # Query blocks: whole multiples of the pattern's, about 256 rows, since each run is one fused call and
    # small calls are slow (measured on fixed(64, 8), n = 16384, one thread: 0.39x / 0.31x / 0.29x SDPA's
    # time at 64 / 128 / 256 rows). Key blocks at least 8 wide; the shape only when it computes less.
    bq = shape[0] * -(-SPARSE_QUERY_ROWS // shape[0])
    if bq > 512:
        return default
    return min(((bq, max(8, shape[1])), default), key=lambda s: cost(*s))


class SparseKernel(Kernel):
    """The gathered block-sparse kernel's door: ``sparse_block``'s tiles over the mask's non-empty blocks;
    its rate is the fused kernel's at its query-block rows (``rates.sparse_block_speed``, GFLOP/s)."""

    def tiling(self, p, r: Request, block_size: int | None, rates) -> Tiling:
        """``block_size`` square or ``sparse_block``'s shape, with the blocks the mask leaves non-empty."""
        L, S = p.info.L, p.info.S
        bq, bk = (block_size, block_size) if block_size else sparse_block(p, rates.sparse_block_speed)
        if not (p.mask.is_trivial or p.is_causal_only) and -(-L // bq) * -(-S // bk):
            return Tiling(bq, bk, nonempty_blocks(p, bq, bk))
        return Tiling(bq, bk, causal_blocks(L, S, bq, bk) if p.is_causal_only else None)

    def rate(self, r: Request, t: Tiling | None, rates) -> tuple[float, str]:
        """The fused kernel's GFLOP/s on blocks of ``t.block_q`` rows (the nearest measured edge)."""
        speeds = rates.sparse_block_speed
        bq = t.block_q if t is not None else DEFAULT_SPARSE_BLOCK
        return float(speeds[min(speeds, key=lambda b: abs(b - bq))]), rates.source

    def run(self, p, t: Tiling | None, need_weights: bool = False, need_lse: bool = False):
        """(out, None, None)."""
        bq, bk = (t.block_q, t.block_k) if t is not None else (DEFAULT_SPARSE_BLOCK, DEFAULT_SPARSE_BLOCK)
        return gathered_attention(p.q, p.k, p.v, p.mask, p.info.scale, p.dropout_p, bq, bk), None, None


KERNEL = SparseKernel(SPEC, gflops=65.0, title="Sparse", time="O(nnz blocks·block²·D)", memory="O(nnz)",
                      why="gathered key blocks through the fused kernel")
