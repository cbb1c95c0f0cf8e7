"""Sequence layouts: which positions of a length-L sequence each of P ranks holds, and how to undo it.

Legend: L sequence length, P world size (ranks in the group), r a rank, c_i the size of chunk i.

- ``"contiguous"``: ``torch.tensor_split`` of the sequence into P chunks; rank r holds chunk r.
- ``"zigzag"``: ``tensor_split`` into 2P chunks; rank r holds chunks r and 2P-1-r (in that order).
  Under a causal mask the early chunk is cheap and the late one expensive, so every rank does the
  same causal work (Brandon et al. 2023, "Striped attention"; Zhu, ring-flash-attention, zigzag).

Lengths that do not divide evenly are split as ``torch.tensor_split`` does: the first L mod k chunks
get one more position. A rank's positions are always increasing, which ring attention relies on.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["LAYOUTS", "chunk_sizes", "shard_segments", "shard_sequence", "unshard_sequence",
           "gather_sequence", "check_layout"]

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: str) -> str:
    """``layout`` itself if it is one of LAYOUTS ("contiguous", "zigzag"); otherwise ValueError."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def chunk_sizes(seq_len: int, chunks: int) -> list[int]:
    """Sizes of ``torch.tensor_split(range(seq_len), chunks)``: the first seq_len % chunks get one more."""
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    base, extra = divmod(seq_len, chunks)
    return [base + (1 if i < extra else 0) for i in range(chunks)]


def shard_segments(seq_len: int, world_size: int, rank: int, layout: str = "contiguous") -> list[tuple[int, int]]:
    """Global [start, end) ranges of the positions ``rank`` holds, in its local order (increasing)."""
    check_layout(layout)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    if seq_len < 0:
        raise ValueError(f"seq_len must be >= 0, got {seq_len}")
    nchunks = world_size if layout == "contiguous" else 2 * world_size
    sizes = chunk_sizes(seq_len, nchunks)
    starts = [sum(sizes[:i]) for i in range(nchunks + 1)]
    ids = [rank] if layout == "contiguous" else [rank, 2 * world_size - 1 - rank]
    return [(starts[i], starts[i + 1]) for i in ids]


def _check_dim(dim, ndim: int, what: str) -> None:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {dim!r}")
    if not -ndim <= dim < ndim:
        raise ValueError(f"dim={dim} is out of range for {what} (valid: {-ndim} .. {ndim - 1})")


def _rank_and_world(rank, world_size, group):
    if rank is None or world_size is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("shard_sequence: pass rank= and world_size=, or initialise torch.distributed "
                             "(dist.init_process_group) so they can be read from the group")
        rank = dist.get_rank(group) if rank is None else rank
        world_size = dist.get_world_size(group) if world_size is None else world_size
    return int(rank), int(world_size)


def shard_sequence(x: torch.Tensor, rank: int | None = None, world_size: int | None = None, *,
                   group=None, layout: str = "contiguous", dim: int = -2) -> torch.Tensor:
    """This rank's shard of the full sequence ``x`` along ``dim`` (default -2: [B, H, L, E] -> [B, H, L_r, E]).

    ``rank``/``world_size`` default to the rank and size of ``group`` (the default process group).
    Differentiable (it is ``narrow``/``cat``). Equivalent to
    ``torch.cat([x.narrow(dim, a, b - a) for a, b in shard_segments(L, P, r, layout)], dim)``.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    _check_dim(dim, x.dim(), f"x {list(x.shape)}")
    rank, world_size = _rank_and_world(rank, world_size, group)
    segs = shard_segments(x.shape[dim], world_size, rank, layout)
    parts = [x.narrow(dim, a, b - a) for a, b in segs]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def unshard_sequence(shards: list[torch.Tensor] | tuple[torch.Tensor, ...], *, layout: str = "contiguous",
                     dim: int = -2) -> torch.Tensor:
    """Inverse of ``shard_sequence`` in one process: the shards of ranks 0..P-1 -> the full sequence.

    shards[r]: [..., L_r, ...] along ``dim`` (e.g. [B, H, L_r, E]) -> [..., L, ...] with L = Σ L_r, every
    position back in global order. Raises ValueError if a shard's length is not what ``layout`` gives
    that rank for length L.
    """
    check_layout(layout)
    if not shards:
        raise ValueError("unshard_sequence: need at least one shard")
    for r, s in enumerate(shards):
        if not isinstance(s, torch.Tensor):
            raise TypeError(f"unshard_sequence: shard {r} must be a torch.Tensor, got {type(s).__name__}")
        _check_dim(dim, s.dim(), f"shard {r} {list(s.shape)}")
    P = len(shards)
    L = sum(s.shape[dim] for s in shards)
    pieces: list[tuple[int, torch.Tensor]] = []
    for r, s in enumerate(shards):
        segs = shard_segments(L, P, r, layout)
        want = sum(b - a for a, b in segs)
        if s.shape[dim] != want:
            raise ValueError(f"unshard_sequence: shard {r} has length {s.shape[dim]} along dim {dim}, but the "
                             f"{layout!r} layout of a length-{L} sequence over {P} ranks gives it {want}")
        off = 0
        for a, b in segs:
            pieces.append((a, s.narrow(dim, off, b - a)))
            off += b - a
    pieces.sort(key=lambda t: t[0])
    return torch.cat([p for _, p in pieces], dim)


def gather_sequence(x: torch.Tensor, *, group=None, layout: str = "contiguous", dim: int = -2) -> torch.Tensor:
    """Collective inverse of ``shard_sequence``: every rank passes its shard and gets the full sequence.

    Shards may differ in length along ``dim`` (uneven splits); all other dims must agree. The result
    is detached (it is for inspection and results, not for backpropagation).
    """
    check_layout(layout)
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("gather_sequence needs an initialised torch.distributed process group")
    P = dist.get_world_size(group)
    dim = dim % x.dim()
    x = x.detach()
    n = torch.tensor([x.shape[dim]], dtype=torch.int64, device=x.device)
    lengths = [torch.zeros_like(n) for _ in range(P)]
    dist.all_gather(lengths, n, group=group)
    lengths = [int(t.item()) for t in lengths]
    longest = max(lengths)
    pad = list(x.shape)
    pad[dim] = longest - x.shape[dim]
    padded = torch.cat([x, x.new_zeros(pad)], dim).contiguous() if pad[dim] else x.contiguous()
    bufs = [torch.empty_like(padded) for _ in range(P)]
    dist.all_gather(bufs, padded, group=group)
    return unshard_sequence([b.narrow(dim, 0, n_r) for b, n_r in zip(bufs, lengths)], layout=layout, dim=dim)
