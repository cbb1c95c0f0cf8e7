"""Ring attention: exact attention over a sequence sharded across the ranks of a torch.distributed group.

Legend: P ranks, r this rank, B batch, H heads, L_r this rank's query/key positions, E head dim,
Ev value head dim, n the positions in one key/value piece.

Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers for Near-Infinite Context".
Each rank keeps its queries. Its keys and values are cut into pieces of at most ``block_size``
positions; piece j of every rank travels once around the ring (rank r sends to r+1, receives from
r-1) while each rank attends its queries to the piece it holds, so after P steps every query has
seen every key. Partial results over disjoint key sets merge exactly by their log-sum-exp
(Note [Merging by log-sum-exp]). The next piece is received while the current one is computed on
(``batch_isend_irecv`` posted before the compute, waited after it).

Causal masks never need a mask tensor (Note [Causal blocks]). Backward recomputes the scores block by
block from the saved output and log-sum-exp (Dao et al. 2022, FlashAttention) and rings each piece's
dK/dV partial sums along with it, so they arrive back at the piece's owner after P steps.

Memory per rank: O(L_r·(E + Ev)) plus a few pieces of n·(E + Ev), never L_r × L or the full sequence.
Time: O(L·L_r·(E + Ev)) per rank (half under causal, balanced across ranks with layout="zigzag").
"""
from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ..functional import attention_with_lse
from ..kernels.lse import acc_dtype, merge_into
from ..shapes import check_scale_range
from .layout import LAYOUTS, check_layout, chunk_sizes, shard_segments

__all__ = ["ring_attention", "RingAttentionError", "DEFAULT_BLOCK_SIZE", "comm_stats"]

#: longest key/value piece that travels in one message, and longest query chunk per kernel call
DEFAULT_BLOCK_SIZE = 1024

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class RingAttentionError(RuntimeError):
    """A collective or point-to-point operation of ring attention failed (a peer died or timed out)."""


# -- the schedule: who holds which positions, and which pieces travel ------------------------------
@dataclass(frozen=True)
class _Piece:
    """Piece j of rank ``owner``: rows [l0, l1) of the owner's local keys = global positions [g0, g1)."""

    owner: int
    l0: int
    l1: int
    g0: int

    @property
    def n(self) -> int:
        return self.l1 - self.l0

    @property
    def g1(self) -> int:
        return self.g0 + self.n


@dataclass
class _Schedule:
    rank: int
    world: int
    lengths: list[int]
    segments: list[list[tuple[int, int]]]  # per rank: global [start, end) in local order
    pieces: list[list[_Piece]]  # per rank: the same number of pieces on every rank
    causal: bool
    block: int
    group: object = None
    next_peer: int = 0  # global rank numbers for point-to-point ops
    prev_peer: int = 0

    def rows(self, piece: _Piece) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
        """(diagonal rows or None, full rows or None) of this rank's queries for a key piece.

        Note [Causal blocks]: local positions increase with the local index, so the queries that see
        all of a piece [g0, g1) are a suffix (positions >= g1), the queries that see none of it a
        prefix (positions < g0), and the rest are positions inside the piece itself, which happens
        only for this rank's own pieces: a square block with top-left causal masking (is_causal).
        """
        L_r = self.lengths[self.rank]
        if not self.causal:
            return None, (0, L_r) if L_r else None
        segs = self.segments[self.rank]
        below_g0 = sum(min(max(piece.g0 - a, 0), b - a) for a, b in segs)
        below_g1 = sum(min(max(piece.g1 - a, 0), b - a) for a, b in segs)
        diag = (below_g0, below_g1) if below_g1 > below_g0 else None
        if diag is not None and (piece.owner != self.rank or below_g1 - below_g0 != piece.n):
            raise AssertionError("ring_attention: inconsistent schedule (a piece overlaps another rank's queries)")
        full = (below_g1, L_r) if L_r > below_g1 else None
        return diag, full


def _build_schedule(lengths: list[int], rank: int, layout: str, causal: bool, block: int) -> _Schedule:
    """Pure: the pieces and row ranges every rank uses, from the local lengths of all ranks."""
    P = len(lengths)
    total = sum(lengths)
    if layout == "contiguous":
        starts = [sum(lengths[:i]) for i in range(P)]
        segments = [[(starts[i], starts[i] + lengths[i])] for i in range(P)]
    else:
        segments = [shard_segments(total, P, i, "zigzag") for i in range(P)]
        got = [sum(b - a for a, b in s) for s in segments]
        if got != lengths:
            raise ValueError(
                f"ring_attention(layout='zigzag'): the ranks hold {lengths} positions (sum {total}), but the "
                f"zigzag layout of a length-{total} sequence over {P} ranks gives {got}; shard the sequence "
                f"with attnlab.distributed.shard_sequence(x, layout='zigzag')")
    return _Schedule(rank, P, lengths, segments, _cut_pieces(segments, block), causal, block)


def _cut_pieces(segments: list[list[tuple[int, int]]], block: int) -> list[list[_Piece]]:
    longest = max((b - a for s in segments for a, b in s), default=0)
    per_segment = max(1, math.ceil(longest / block))  # the same on every rank, so steps stay in lock-step
    pieces: list[list[_Piece]] = []
    for i, segs in enumerate(segments):
        ps, off = [], 0
        for a, b in segs:
            seg_start = off
            for size in chunk_sizes(b - a, per_segment):
                ps.append(_Piece(i, off, off + size, a + off - seg_start))
                off += size
        pieces.append(ps)
    return pieces


def _with_block(sched: _Schedule, block: int) -> _Schedule:
    """The same ranks and positions cut into pieces of at most ``block`` positions."""
    return replace(sched, pieces=_cut_pieces(sched.segments, block), block=block)


# -- communication: batched point-to-point with errors that say what failed -------------------------
_RECORDERS: list[dict] = []


@contextmanager
def comm_stats():
    """Count this process's ring traffic inside the block: a dict with ``messages`` and ``bytes`` sent,
    and ``wait_seconds``, the time spent waiting for transfers *after* the compute they overlap with
    (transfer time not hidden by compute, plus waiting for slower ranks)."""
    rec = {"messages": 0, "bytes": 0, "wait_seconds": 0.0}
    _RECORDERS.append(rec)
    try:
        yield rec
    finally:
        _RECORDERS.remove(rec)


class _Comm:
    def __init__(self, sched: _Schedule):
        self.s = sched

    def tag(self, piece: int, step: int, kind: int) -> int:
        """Distinct tags for every message of a call (gloo matches on them; NCCL matches by order)."""
        return (piece * (self.s.world + 1) + step) * 2 + kind

    def start(self, sends, recvs, what: str) -> list:
        """Post sends to the next rank and receives from the previous one as one batch.

        Each rank posts the same kinds of messages in the same order, so NCCL (which matches by
        order within a group) and gloo (which matches by tag) pair them up alike. Empty tensors are
        skipped on both sides (both know the piece sizes).
        """
        s = self.s
        ops = [dist.P2POp(dist.isend, t, s.next_peer, s.group, tag) for t, tag in sends if t.numel()]
        ops += [dist.P2POp(dist.irecv, t, s.prev_peer, s.group, tag) for t, tag in recvs if t.numel()]
        if not ops:
            return []
        for rec in _RECORDERS:
            sent = [t for t, _ in sends if t.numel()]
            rec["messages"] += len(sent)
            rec["bytes"] += sum(t.numel() * t.element_size() for t in sent)
        try:
            return dist.batch_isend_irecv(ops)
        except RuntimeError as e:
            raise self.error(what, e) from e

    def wait(self, works: list, what: str) -> None:
        t0 = time.perf_counter()
        for w in works:
            try:
                w.wait()
            except RuntimeError as e:
                raise self.error(what, e) from e
        for rec in _RECORDERS:
            rec["wait_seconds"] += time.perf_counter() - t0

    def error(self, what: str, e: BaseException) -> RingAttentionError:
        s = self.s
        cause = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return RingAttentionError(
            f"ring_attention: rank {s.rank} of {s.world} could not {what} (it sends to global rank "
            f"{s.next_peer} and receives from global rank {s.prev_peer}). A rank probably died, raised, or "
            f"stopped calling ring_attention, or the process group's timeout ran out. "
            f"Cause: {type(e).__name__}: {cause}")


def _view(flat: torch.Tensor, *shape: int) -> torch.Tensor:
    return flat[: math.prod(shape)].view(*shape)


# -- forward ---------------------------------------------------------------------------------------
def _row_chunks(rows: tuple[int, int] | None, block: int):
    if rows is None:
        return
    for a in range(rows[0], rows[1], block):
        yield a, min(rows[1], a + block)


def _attend_piece(q, cur, piece: _Piece, sched: _Schedule, scale: float, out, lse, E: int) -> None:
    if piece.n == 0:
        return
    diag, full = sched.rows(piece)
    kp, vp = cur[..., :E], cur[..., E:]  # (B, H, n, E), (B, H, n, Ev)
    if diag is not None:
        a, b = diag
        o, l = attention_with_lse(q[:, :, a:b], kp, vp, is_causal=True, scale=scale)
        merge_into(out[:, :, a:b], lse[:, :, a:b], o, l)
    for a, b in _row_chunks(full, sched.block):
        o, l = attention_with_lse(q[:, :, a:b], kp, vp, scale=scale)
        merge_into(out[:, :, a:b], lse[:, :, a:b], o, l)


def _ring_forward(q, k, v, sched: _Schedule, scale: float, comm: _Comm):
    B, H, L_r, E = q.shape
    Ev = v.shape[-1]
    D = E + Ev
    P, r = sched.world, sched.rank
    acc = acc_dtype(q.dtype)
    out = torch.zeros(B, H, L_r, Ev, dtype=acc, device=q.device)
    lse = torch.full((B, H, L_r), float("-inf"), dtype=acc, device=q.device)
    maxn = max((p.n for ps in sched.pieces for p in ps), default=0)
    # two flat buffers: the piece being computed on (and sent on), and the one being received
    flat = [torch.empty(B * H * maxn * D, dtype=k.dtype, device=k.device) for _ in range(min(P, 2))]
    for j, mine in enumerate(sched.pieces[r]):
        slot = 0
        cur = _view(flat[slot], B, H, mine.n, D)  # (B, H, n, E + Ev): keys and values travel as one message
        cur[..., :E].copy_(k[:, :, mine.l0:mine.l1])
        cur[..., E:].copy_(v[:, :, mine.l0:mine.l1])
        for t in range(P):
            piece = sched.pieces[(r - t) % P][j]
            works, nxt = [], None
            if t < P - 1:
                incoming = sched.pieces[(r - t - 1) % P][j]
                nxt = _view(flat[1 - slot], B, H, incoming.n, D)
                what = f"exchange key/value piece {j} at ring step {t}"
                works = comm.start([(cur, comm.tag(j, t, 0))], [(nxt, comm.tag(j, t, 0))], what)
            _attend_piece(q, cur, piece, sched, scale, out, lse, E)  # overlaps with the transfer
            comm.wait(works, f"exchange key/value piece {j} at ring step {t}")
            if nxt is not None:
                cur, slot = nxt, 1 - slot
    return out.to(q.dtype), lse


# -- backward --------------------------------------------------------------------------------------
def _grad_block(q, dout, lse, delta, kp, vp, dq, dk_p, dv_p, a: int, b: int, diag0: int | None, scale: float):
    """FlashAttention backward for query rows [a, b) against one key piece, accumulating in place.

    With P = exp(S - lse): dV += Pᵀ dO; dS = P ∘ (dO Vᵀ - rowsum(dO ∘ O)); dQ += dS K·scale; dK += dSᵀ Q·scale.
    ``diag0`` is the first row of the piece's own (diagonal) rows: row i sees key j when j <= i - diag0.
    """
    acc = dq.dtype
    qc, doc = q[:, :, a:b].to(acc), dout[:, :, a:b].to(acc)  # (B, H, m, E), (B, H, m, Ev)
    s = torch.matmul(qc, kp.transpose(-2, -1)).mul_(scale)  # (B, H, m, n)
    if diag0 is not None:
        i = torch.arange(a - diag0, b - diag0, device=q.device).unsqueeze(-1)
        j = torch.arange(kp.shape[-2], device=q.device).unsqueeze(0)
        s.masked_fill_(j > i, float("-inf"))
    p = s.sub_(lse[:, :, a:b].unsqueeze(-1)).exp_()  # (B, H, m, n), in place: one score block less
    dv_p.add_(torch.matmul(p.transpose(-2, -1), doc))
    ds = torch.matmul(doc, vp.transpose(-2, -1)).sub_(delta[:, :, a:b].unsqueeze(-1)).mul_(p)  # (B, H, m, n)
    dq[:, :, a:b].add_(torch.matmul(ds, kp), alpha=scale)
    dk_p.add_(torch.matmul(ds.transpose(-2, -1), qc), alpha=scale)


def _grad_piece(q, dout, lse, delta, cur, piece: _Piece, sched: _Schedule, scale, dq, part, E: int) -> None:
    if piece.n == 0:
        return
    diag, full = sched.rows(piece)
    acc = dq.dtype
    kp, vp = cur[..., :E].to(acc), cur[..., E:].to(acc)
    dk_p, dv_p = part[..., :E], part[..., E:]
    rows = max(1, min(sched.block, 256))  # keeps the [B, H, rows, n] score blocks small
    for a, b in _row_chunks(diag, rows):
        _grad_block(q, dout, lse, delta, kp, vp, dq, dk_p, dv_p, a, b, diag[0], scale)
    for a, b in _row_chunks(full, rows):
        _grad_block(q, dout, lse, delta, kp, vp, dq, dk_p, dv_p, a, b, None, scale)


def _ring_backward(dout, q, k, v, out, lse, sched: _Schedule, scale: float, comm: _Comm):
    B, H, L_r, E = q.shape
    Ev = v.shape[-1]
    D = E + Ev
    P, r = sched.world, sched.rank
    acc = acc_dtype(q.dtype)
    delta = (dout.to(acc) * out.to(acc)).sum(dim=-1)  # (B, H, L_r): rowsum(dO ∘ O)
    dq = torch.zeros(B, H, L_r, E, dtype=acc, device=q.device)
    dk = torch.zeros(B, H, L_r, E, dtype=acc, device=q.device)
    dv = torch.zeros(B, H, L_r, Ev, dtype=acc, device=q.device)
    maxn = max((p.n for ps in sched.pieces for p in ps), default=0)
    kv_flat = [torch.empty(B * H * maxn * D, dtype=k.dtype, device=k.device) for _ in range(min(P, 2))]
    # three flat dK|dV buffers: the partial sum being sent on, the one being received, the one computed
    g_flat = [torch.empty(B * H * maxn * D, dtype=acc, device=q.device) for _ in range(3)]
    for j, mine in enumerate(sched.pieces[r]):
        slot = 0
        cur = _view(kv_flat[slot], B, H, mine.n, D)
        cur[..., :E].copy_(k[:, :, mine.l0:mine.l1])
        cur[..., E:].copy_(v[:, :, mine.l0:mine.l1])
        pending, pending_idx = None, -1  # dK|dV partial sum of the previous step's piece, for the next rank
        for t in range(P):
            piece = sched.pieces[(r - t) % P][j]
            free = [i for i in range(3) if i != pending_idx]
            sends, recvs, dkv_in, nxt = [], [], None, None
            if pending is not None:
                sends.append((pending, comm.tag(j, t, 1)))
            if t > 0:
                dkv_in = _view(g_flat[free[1]], B, H, piece.n, D)
                recvs.append((dkv_in, comm.tag(j, t, 1)))
            if t < P - 1:
                incoming = sched.pieces[(r - t - 1) % P][j]
                nxt = _view(kv_flat[1 - slot], B, H, incoming.n, D)
                sends.append((cur, comm.tag(j, t, 0)))
                recvs.append((nxt, comm.tag(j, t, 0)))
            what = f"exchange key/value piece {j} and its dK/dV partial sums at ring step {t}"
            works = comm.start(sends, recvs, what)
            part = _view(g_flat[free[0]], B, H, piece.n, D).zero_()
            _grad_piece(q, dout, lse, delta, cur, piece, sched, scale, dq, part, E)  # overlaps the transfer
            comm.wait(works, what)
            if dkv_in is not None:
                part.add_(dkv_in)
            pending, pending_idx = part, free[0]
            if nxt is not None:
                cur, slot = nxt, 1 - slot
        # the last partial sum belongs to the next rank's piece: send it home, receive ours
        if P == 1:
            home = pending
        else:
            home = _view(g_flat[[i for i in range(3) if i != pending_idx][0]], B, H, mine.n, D)
            what = f"return dK/dV of piece {j} to its owner"
            comm.wait(comm.start([(pending, comm.tag(j, P, 1))], [(home, comm.tag(j, P, 1))], what), what)
        dk[:, :, mine.l0:mine.l1] = home[..., :E]
        dv[:, :, mine.l0:mine.l1] = home[..., E:]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sched: _Schedule, scale: float):
        out, lse = _ring_forward(q, k, v, sched, scale, _Comm(sched))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.sched, ctx.scale = sched, scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        # Backward keeps five pieces in flight (two of keys/values, three of dK/dV sums) where forward
        # keeps two, so its pieces are half as long: its buffers stay near the forward's.
        sched = _with_block(ctx.sched, max(1, ctx.sched.block // 2))
        dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, sched, ctx.scale, _Comm(sched))
        return dq, dk, dv, None, None


# -- public API ------------------------------------------------------------------------------------
def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _check_local(query, key, value) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"ring_attention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"ring_attention: {name} must be 4-D [batch, heads, local_seq, dim], got {_shape(t)}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"ring_attention: {name} must be floating point ({', '.join(map(str, _DTYPES))}), "
                            f"got {t.dtype}")
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(f"ring_attention: query, key and value must share a dtype, got {query.dtype}, "
                        f"{key.dtype}, {value.dtype}")
    if not (query.device == key.device == value.device):
        raise ValueError(f"ring_attention: query, key and value must be on one device, got {query.device}, "
                         f"{key.device}, {value.device}")
    if key.shape[:2] != query.shape[:2] or value.shape[:2] != query.shape[:2]:
        raise ValueError(
            f"ring_attention: query {_shape(query)}, key {_shape(key)} and value {_shape(value)} must agree in "
            f"batch and heads (no GQA here: repeat key/value heads first, e.g. key.repeat_interleave(H // Hkv, 1))")
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(f"ring_attention: query {_shape(query)} and key {_shape(key)} must have the same head_dim")
    if not (query.shape[2] == key.shape[2] == value.shape[2]):
        raise ValueError(
            f"ring_attention: query {_shape(query)}, key {_shape(key)} and value {_shape(value)} must hold the same "
            f"positions of the sequence (self-attention over one sharded sequence: equal local lengths)")


def _exchange_metadata(query, value, is_causal, layout, scale, block, group, rank, world) -> list[int]:
    """All-gather every rank's shapes and settings; raise the same ValueError on every rank if they disagree."""
    B, H, L_r, E = query.shape
    scale_bits = int(torch.tensor([scale], dtype=torch.float64).view(torch.int64).item())
    fields = ("batch", "heads", "head_dim", "value_dim", "dtype", "is_causal", "layout", "block_size", "scale")
    mine = [B, H, E, value.shape[-1], _DTYPES.index(query.dtype), int(is_causal), LAYOUTS.index(layout), block,
            scale_bits]
    t = torch.tensor([L_r] + mine, dtype=torch.int64, device=query.device)
    got = [torch.empty_like(t) for _ in range(world)]
    try:
        dist.all_gather(got, t, group=group)
    except RuntimeError as e:
        raise RingAttentionError(
            f"ring_attention: rank {rank} of {world} could not exchange shapes with the other ranks (a rank "
            f"probably died, raised, or did not call ring_attention, or the process group's timeout ran out). "
            f"Cause: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}") from e
    rows = [g.tolist() for g in got]
    for i, name in enumerate(fields):
        values = [row[1 + i] for row in rows]
        if len(set(values)) > 1:
            if name == "dtype":
                values = [str(_DTYPES[x]) for x in values]
            elif name == "layout":
                values = [LAYOUTS[x] for x in values]
            elif name == "scale":
                values = [torch.tensor([x]).view(torch.float64).item() for x in values]
            raise ValueError(f"ring_attention: the ranks disagree on {name}: " +
                             ", ".join(f"rank {i_r}: {x}" for i_r, x in enumerate(values)))
    return [row[0] for row in rows]


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, group=None,
                   is_causal: bool = False, scale: float | None = None, layout: str = "contiguous",
                   block_size: int | None = None) -> torch.Tensor:
    """Exact attention over a sequence whose positions are sharded across the ranks of ``group``.

    Every rank of the group calls this together (and, when training, calls backward together).

    Args:
        query: [batch, heads, L_r, head_dim], this rank's queries; key: [batch, heads, L_r, head_dim] and
            value: [batch, heads, L_r, value_dim], the keys/values of the same positions. Shard a full
            sequence with ``shard_sequence(x, layout=layout)``.
        group: the process group (default: the default group); any backend with point-to-point ops
            (gloo on CPU, NCCL on GPU).
        is_causal: position i sees position j when j <= i, in global sequence positions.
        scale: score scale, default 1/sqrt(head_dim).
        layout: how positions are assigned to ranks: "contiguous" (any local lengths, in rank order) or
            "zigzag" (``shard_sequence(..., layout="zigzag")``; balances causal work across ranks).
        block_size: most key/value positions per message and query rows per kernel call
            (default ``DEFAULT_BLOCK_SIZE``); must be equal on every rank.

    Returns: [batch, heads, L_r, value_dim], this rank's rows of the output. Equivalent to::

        full = lambda x: gather_sequence(x, layout=layout)
        shard_sequence(F.scaled_dot_product_attention(full(query), full(key), full(value),
                                                      is_causal=is_causal, scale=scale), layout=layout)

    without ever holding the full sequence. Cost per rank: time O(L·L_r·(head_dim + value_dim)),
    memory O(L_r·(head_dim + value_dim) + block_size·(head_dim + value_dim)); communication: every
    key/value position passes every rank once (and once more, with its gradient, in backward).

    Raises ``ValueError`` (on every rank) when the ranks' shapes or settings disagree, and
    ``RingAttentionError`` when a peer dies or stops responding (after the process group's timeout).
    """
    _check_local(query, key, value)
    check_layout(layout)
    if not isinstance(is_causal, bool):
        raise TypeError(f"ring_attention: is_causal must be a bool, got {is_causal!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale)):
        raise ValueError(f"ring_attention: scale must be a finite float or None, got {scale!r}")
    if scale is not None:
        check_scale_range(float(scale), query.dtype, "ring_attention: ")  # shapes' Note [Scalars in float32]
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("ring_attention needs an initialised torch.distributed process group: call "
                           "torch.distributed.init_process_group(...) or launch with torchrun "
                           "(see docs/distributed.md)")
    if block_size is None:
        block_size = DEFAULT_BLOCK_SIZE
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"ring_attention: block_size must be a positive int, got {block_size!r}")
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1]) if query.shape[-1] else 1.0
    scale = float(scale)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ValueError("ring_attention: this process is not a member of the given group")
    lengths = _exchange_metadata(query, value, is_causal, layout, scale, block_size, group, rank, world)
    sched = _build_schedule(lengths, rank, layout, bool(is_causal), block_size)
    g = group if group is not None else dist.group.WORLD
    sched.group = g
    sched.next_peer = dist.get_global_rank(g, (rank + 1) % world)
    sched.prev_peer = dist.get_global_rank(g, (rank - 1) % world)
    return _RingAttentionFunction.apply(query, key, value, sched, scale)
