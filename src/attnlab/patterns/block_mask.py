"""Block masks without the L x S grid: ``create_block_mask``, torch ``BlockMask`` <-> patterns, ``adjust``, text.

Legend: B batch, H heads, L = Q_LEN queries, S = KV_LEN keys; blocks of bq x bk (BLOCK_SIZE), nq =
ceil(L / bq) query blocks, nk = ceil(S / bk) key blocks; codes EMPTY / PARTIAL / FULL per block.

``create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, BLOCK_SIZE)`` returns what
``torch.nn.attention.flex_attention.create_block_mask`` returns, equal in kv_num_blocks, kv_indices,
full_kv_num_blocks and full_kv_indices, without evaluating mask_mod on the L x S grid:

1) quadtree over the block grid: a tile of 2^k x 2^k blocks is classified by evaluating mask_mod once
   on *intervals* (``patterns.intervals``: q_idx in [qlo, qhi], kv_idx in [klo, khi]); a proof of FULL
   or EMPTY settles the whole tile, anything else splits it in four. A band, causal, a prefix or a
   document mask leaves O(L / block) undecided tiles per level.
2) an undecided single block is evaluated at 8 pairs (its corners, its centre and three neighbouring
   pairs, which tell periodic masks apart): a kept and a dropped pair prove it PARTIAL;
3) a block whose probes agree is split into 8 x 8 sub-tiles, classified by intervals again; only the
   sub-tiles they leave open (those a boundary line crosses) are evaluated pair by pair.
A mask_mod the interval table cannot read (Python control flow on a tensor, an unknown op) is evaluated on
the grid in strips, as torch does but in O(strip) memory. Every answer is exact: FULL and EMPTY come from
sound interval bounds or from every pair, PARTIAL from two witnesses (Note [Sound intervals]).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from . import intervals as _iv
from .bands import full, sliding_window
from .base import EMPTY, FULL, PARTIAL, Pattern, _broadcast_shape, _check_int
from .mask_mod import _HeadIndex, _HeadUsed, from_mask_mod

try:  # torch >= 2.5
    from torch.nn.attention.flex_attention import BlockMask
except ImportError:  # pragma: no cover - older torch: attnlab patterns only
    BlockMask = None

__all__ = ["create_block_mask", "BlockMaskPattern", "from_block_mask", "to_block_mask", "adjust", "block_codes", "as_band",
           "torch_layout",
           "block_mask_text", "block_mask_stats", "BuildStats"]

#: pairs per slice when blocks are evaluated pair by pair (about 1M: in cache between the mask's ops)
_PAIRS = 1 << 20
_TILE_MEMO_BYTES = 1 << 26  # Note [PARTIAL tiles evaluated once]
#: sub-tile edge of Note [PARTIAL tiles by sub-tiles]
_TILE_SUB = 16


@dataclass
class BuildStats:
    """How ``create_block_mask`` found the blocks: ``how`` "intervals" or "grid" (and why), tiles
    classified by intervals, blocks proved PARTIAL by probes, blocks evaluated pair by pair, pairs evaluated."""

    how: str = "intervals"
    interval_tiles: int = 0
    probed_blocks: int = 0
    evaluated_blocks: int = 0
    pairs: int = 0
    reads: set = field(default_factory=set)

    def __str__(self):
        return (f"{self.how}: {self.interval_tiles} tiles by intervals, {self.probed_blocks} blocks by probes, "
                f"{self.evaluated_blocks} blocks pair by pair ({self.pairs} pairs evaluated)")


def _pt(v: int) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.long)


def _exact(mask_mod, b: int, h: int, q: torch.Tensor, kv: torch.Tensor, name: str) -> torch.Tensor:
    """mask_mod on exact pairs (q, kv int64, broadcasting) as a bool tensor of their broadcast shape."""
    m = mask_mod(_pt(b), _pt(h), q, kv)
    if not isinstance(m, torch.Tensor) or m.dtype != torch.bool:
        raise TypeError(f"create_block_mask: mask_mod {name} must return a bool tensor (True = keep), got "
                        f"{getattr(m, 'dtype', type(m).__name__)}")
    return torch.broadcast_to(m, _broadcast_shape(q.shape, kv.shape))


def _blocks_exact(mask_mod, b, h, tq, tk, L, S, bq, bk, name, stats):
    """(any, all) of blocks (tq, tk) [T] by every pair, in slices of about _PAIRS pairs; padded pairs past
    L or S count as dropped (torch pads the mask with False, so an edge block is never FULL)."""
    T = tq.shape[0]
    any_ = torch.zeros(T, dtype=torch.bool)
    all_ = torch.zeros(T, dtype=torch.bool)
    step = max(1, _PAIRS // (bq * bk))
    ar_q, ar_k = torch.arange(bq), torch.arange(bk)
    for t0 in range(0, T, step):
        q = tq[t0:t0 + step, None] * bq + ar_q  # (t, bq)
        k = tk[t0:t0 + step, None] * bk + ar_k  # (t, bk)
        valid = (q < L)[:, :, None] & (k < S)[:, None, :]  # (t, bq, bk)
        m = _exact(mask_mod, b, h, q.clamp(max=L - 1)[:, :, None], k.clamp(max=S - 1)[:, None, :], name) & valid
        any_[t0:t0 + step] = m.flatten(1).any(1)
        all_[t0:t0 + step] = m.flatten(1).all(1)
        stats.pairs += m.numel()
    stats.evaluated_blocks += T
    return any_, all_


def _blocks_refined(mask_mod, b, h, tq, tk, L, S, bq, bk, name, stats, cache, sub=8):
    """(any, all) of blocks (tq, tk) [T] as ``_blocks_exact`` gives them, evaluating pairs only where
    intervals on (sub x sub) sub-tiles of each block decide nothing (a band's or a document's boundary line
    crosses ~bq / sub of a block's (bq / sub)² sub-tiles). Raises NotInterval as ``intervals.evaluate``."""
    sq, sk = min(sub, bq), min(sub, bk)
    nsq, nsk = -(-bq // sq), -(-bk // sk)
    T = tq.shape[0]
    qe = torch.clamp((tq + 1) * bq, max=L)  # (T,) end of each block, clipped to the grid
    ke = torch.clamp((tk + 1) * bk, max=S)
    q0 = (tq * bq).view(T, 1, 1) + (torch.arange(nsq) * sq).view(1, nsq, 1)  # (T, nsq, 1)
    k0 = (tk * bk).view(T, 1, 1) + (torch.arange(nsk) * sk).view(1, 1, nsk)  # (T, 1, nsk)
    q0, k0 = q0.expand(T, nsq, nsk), k0.expand(T, nsq, nsk)
    blk = torch.arange(T).view(T, 1, 1).expand(T, nsq, nsk)
    ok = (q0 < qe.view(T, 1, 1)) & (k0 < ke.view(T, 1, 1))
    q0, k0, blk = q0[ok], k0[ok], blk[ok]  # (U,) sub-tiles inside the grid
    q1 = torch.minimum(q0 + sq, qe[blk]) - 1
    k1 = torch.minimum(k0 + sk, ke[blk]) - 1
    all_s, any_s, reads = _iv.evaluate(mask_mod, b, h, q0, q1, k0, k1, cache)
    stats.reads |= reads
    stats.interval_tiles += q0.numel()
    und = (any_s & ~all_s).nonzero().view(-1)
    step = max(1, _PAIRS // (sq * sk))
    for u0 in range(0, und.numel(), step):  # undecided sub-tiles: their pairs
        u = und[u0:u0 + step]
        q = q0[u, None] + torch.arange(sq)  # (u, sq)
        k = k0[u, None] + torch.arange(sk)
        rows, cols = q1[u] - q0[u] + 1, k1[u] - k0[u] + 1  # (u,) each: the pairs inside the grid
        stats.pairs += int((rows * cols).sum())
        if bool(((rows == sq) & (cols == sk)).all()):  # no sub-tile clipped by L or S (the common case)
            m = _exact(mask_mod, b, h, q[:, :, None], k[:, None, :], name).flatten(1)  # (u, sq·sk)
            any_s[u], all_s[u] = m.any(1), m.all(1)
            continue
        valid = (q <= q1[u, None])[:, :, None] & (k <= k1[u, None])[:, None, :]
        m = _exact(mask_mod, b, h, torch.minimum(q, q1[u, None])[:, :, None],
                   torch.minimum(k, k1[u, None])[:, None, :], name)
        any_s[u] = (m & valid).flatten(1).any(1)
        all_s[u] = (m | ~valid).flatten(1).all(1)
    any_ = torch.zeros(T, dtype=torch.long).index_add_(0, blk, any_s.long()) > 0
    all_ = torch.zeros(T, dtype=torch.long).index_add_(0, blk, all_s.long()) == nsq * nsk
    # torch pads the grid with dropped pairs: a block that L or S clips is never FULL
    all_ &= (qe - tq * bq == bq) & (ke - tk * bk == bk)
    stats.evaluated_blocks += T
    return any_, all_


def _grid(mask_mod, b, h, L, S, bq, bk, name, stats):
    """(qb, kb, code) of every non-empty block by evaluating all pairs, strip by strip of query blocks."""
    nq, nk = -(-L // bq), -(-S // bk)
    rows = max(1, _PAIRS // max(1, nk * bk * bq))
    out = []
    for q0 in range(0, nq, rows):
        tq = torch.arange(q0, min(nq, q0 + rows)).repeat_interleave(nk)
        tk = torch.arange(nk).repeat(min(nq, q0 + rows) - q0)
        a, f = _blocks_exact(mask_mod, b, h, tq, tk, L, S, bq, bk, name, stats)
        keep = a
        out.append((tq[keep], tk[keep], torch.where(f[keep], FULL, PARTIAL).to(torch.int8)))
    return tuple(torch.cat(x) for x in zip(*out)) if out else (torch.zeros(0, dtype=torch.long),) * 2 + (
        torch.zeros(0, dtype=torch.int8),)


def _classify(mask_mod, b, h, L, S, bq, bk, name, stats, cache):
    """(qb, kb, code) int64 / int64 / int8 [n] of the non-empty blocks of (b, h), sorted by (qb, kb)."""
    nq, nk = -(-L // bq), -(-S // bk)
    ragged_q, ragged_k = L % bq != 0, S % bk != 0
    s = 1 << max(0, (max(nq, nk) - 1).bit_length())  # tile edge, in blocks
    tq = tk = torch.zeros(1, dtype=torch.long)
    found = []  # (qb, kb, code) pieces

    def clip_full(qb, kb):  # torch: a block clipped by L or S holds padding, so it is never FULL
        edge = torch.zeros_like(qb, dtype=torch.bool)
        if ragged_q:
            edge |= qb == nq - 1
        if ragged_k:
            edge |= kb == nk - 1
        return torch.where(edge, PARTIAL, FULL).to(torch.int8)

    while tq.numel():
        qlo, klo = tq * s * bq, tk * s * bk
        qhi, khi = torch.clamp(qlo + s * bq, max=L) - 1, torch.clamp(klo + s * bk, max=S) - 1
        try:
            all_, any_, reads = _iv.evaluate(mask_mod, b, h, qlo, qhi, klo, khi, cache)
            stats.reads |= reads
            stats.interval_tiles += tq.numel()
        except _iv.NotInterval as e:
            if s > 1 or stats.interval_tiles == 0:
                raise
            all_ = torch.zeros(tq.shape, dtype=torch.bool)
            any_ = torch.ones(tq.shape, dtype=torch.bool)
            stats.how = f"intervals, then pairs ({e})"
        full = all_ & any_
        if full.any():  # every block of a FULL tile, clipped to the grid
            fq, fk = tq[full], tk[full]
            off = torch.arange(s)
            qb = (fq[:, None, None] * s + off[None, :, None]).expand(-1, s, s)
            kb = (fk[:, None, None] * s + off[None, None, :]).expand(-1, s, s)
            ok = (qb < nq) & (kb < nk)
            qb, kb = qb[ok], kb[ok]
            found.append((qb, kb, clip_full(qb, kb)))
        und = any_ & ~all_
        tq, tk = tq[und], tk[und]
        if s == 1:
            break
        # 2) split every undecided tile in four; children past the grid are dropped
        s //= 2
        tq = (tq[:, None] * 2 + torch.tensor([0, 0, 1, 1])).view(-1)
        tk = (tk[:, None] * 2 + torch.tensor([0, 1, 0, 1])).view(-1)
        inside = (tq * s < nq) & (tk * s < nk)
        tq, tk = tq[inside], tk[inside]
    if tq.numel():
        # 3) undecided blocks: corners, centre and three neighbours as exact pairs; a kept and a dropped one prove PARTIAL
        qlo, klo = tq * bq, tk * bk
        qhi, khi = torch.clamp(qlo + bq, max=L) - 1, torch.clamp(klo + bk, max=S) - 1
        q1, k1 = torch.minimum(qlo + 1, qhi), torch.minimum(klo + 1, khi)  # neighbours: periodic masks differ there
        pq = torch.stack([qlo, qlo, qhi, qhi, (qlo + qhi) // 2, qlo, q1, qhi], 1)  # (T, 8)
        pk = torch.stack([klo, khi, klo, khi, (klo + khi) // 2, k1, klo, torch.maximum(khi - 1, klo)], 1)
        m = _exact(mask_mod, b, h, pq, pk, name)
        mixed = m.any(1) & ~m.all(1)
        stats.probed_blocks += int(mixed.sum())
        found.append((tq[mixed], tk[mixed], torch.full((int(mixed.sum()),), PARTIAL, dtype=torch.int8)))
        rest = ~mixed
        if rest.any():  # 4) agreeing probes prove nothing: intervals on sub-tiles, pairs where they cannot tell
            rq, rk = tq[rest], tk[rest]
            try:
                a, f = _blocks_refined(mask_mod, b, h, rq, rk, L, S, bq, bk, name, stats, cache)
            except _iv.NotInterval:
                a, f = _blocks_exact(mask_mod, b, h, rq, rk, L, S, bq, bk, name, stats)
            found.append((rq[a], rk[a], torch.where(f[a], FULL, PARTIAL).to(torch.int8)))
    if not found:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.int8)
    qb, kb, code = (torch.cat(x) for x in zip(*found))
    order = torch.argsort(qb * nk + kb)
    return qb[order], kb[order], code[order]


def _check_block(BLOCK_SIZE) -> tuple[int, int]:
    bs = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) and not isinstance(BLOCK_SIZE, bool) else BLOCK_SIZE
    if not (isinstance(bs, (tuple, list)) and len(bs) == 2):
        raise TypeError(f"BLOCK_SIZE must be an int or a (Q_BLOCK_SIZE, KV_BLOCK_SIZE) pair, got {BLOCK_SIZE!r}")
    return _check_int("BLOCK_SIZE[0]", bs[0], 1), _check_int("BLOCK_SIZE[1]", bs[1], 1)


def _build(mask_mod, B, H, L, S, bq, bk, stats):
    """{(b, h): (qb, kb, code)} for the (b, h) that differ, and (Bm, Hm) the mask's own batch/head extent
    (1 where mask_mod reads neither b nor h, then one entry serves all)."""
    name = getattr(mask_mod, "__name__", type(mask_mod).__name__)
    cache = _iv._Cache()
    try:
        first = _classify(mask_mod, 0, 0, L, S, bq, bk, name, stats, cache)
        Bm = B if "b" in stats.reads else 1
        Hm = H if "h" in stats.reads else 1
        out = {(0, 0): first}
        for b in range(Bm):
            for h in range(Hm):
                if (b, h) != (0, 0):
                    out[(b, h)] = _classify(mask_mod, b, h, L, S, bq, bk, name, stats, cache)
        return out, Bm, Hm
    except _iv.NotInterval as e:
        stats.how = f"grid ({e})"
        return {(b, h): _grid(mask_mod, b, h, L, S, bq, bk, name, stats) for b in range(B) for h in range(H)}, B, H


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(num [..., nq], indices [..., nq, nk]) int32 as torch orders them: the marked blocks first, in
    increasing index, then the rest (a stable descending sort of the 0/1 row)."""
    d = dense.to(torch.int32)
    return d.sum(-1).to(torch.int32), torch.argsort(d, dim=-1, descending=True, stable=True).to(torch.int32)


@dataclass(frozen=True, eq=False)
class BlockMaskPattern(Pattern):
    """A block mask as an attnlab pattern, stored as its non-empty blocks only: (i, j) is kept when its
    block is FULL, or PARTIAL and ``mask_mod`` keeps it (None: every pair of a PARTIAL block).
    ``batch``: the batch size mask_mod is evaluated at (None: b = 0 for all, the mask is shared), as
    ``from_mask_mod``'s B; a mask_mod that reads h is refused when first evaluated (patterns are shared by heads).

    ``blocks``: per batch element (one entry when shared by the batch) a triple (qb, kb, code): int64 [n]
    block coordinates sorted by (qb, kb) and int8 [n] PARTIAL / FULL; ``lengths`` the (L, S) it was built for. Memory O(kept blocks); ``codes()`` gives the dense int8 [Bm, nq, nk] grid.
    """

    blocks: tuple
    block_q: int
    block_k: int
    lengths: tuple[int, int]
    mask_mod: object = None
    name: str = "block_mask"
    batch: int | None = None
    _memo: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        if len(self.blocks) > 1 and self.batch != len(self.blocks):
            raise ValueError(f"BlockMaskPattern: {len(self.blocks)} per-batch block lists need batch={len(self.blocks)}, "
                             f"got batch={self.batch}")

    @property
    def batch_size(self):  # type: ignore[override]
        """``batch``: the leading batch size of ``materialize`` (None when shared by the batch)."""
        return self.batch

    @property
    def grid(self) -> tuple[int, int]:
        """(nq, nk): blocks along queries and keys."""
        return -(-self.lengths[0] // self.block_q), -(-self.lengths[1] // self.block_k)

    def _check(self, L, S):
        if (L, S) != tuple(self.lengths):
            raise ValueError(f"{self!r} was built for (Q_LEN, KV_LEN) = {tuple(self.lengths)}, asked for ({L}, {S}); "
                             "rebuild it, or patterns.adjust(mask, Q_LEN, KV_LEN, align=...) it")

    def codes(self) -> torch.Tensor:
        """int8 [Bm, nq, nk] EMPTY / PARTIAL / FULL (cached)."""
        hit = self._memo.get("codes")
        if hit is None:
            nq, nk = self.grid
            hit = torch.zeros(len(self.blocks), nq, nk, dtype=torch.int8)
            for x, (qb, kb, code) in enumerate(self.blocks):
                hit[x, qb, kb] = code
            self._memo["codes"] = hit
        return hit

    def inner(self) -> Pattern | None:
        """``mask_mod`` as a pattern (``from_mask_mod``: refuses one that reads h), per batch element when
        ``batch`` is set; None for no mask_mod (every pair of a PARTIAL block kept)."""
        if self.mask_mod is None:
            return None
        hit = self._memo.get("inner")
        if hit is None:
            hit = from_mask_mod(self.mask_mod, B=self.batch, name=self.name)
            self._memo["inner"] = hit
        return hit

    def keep(self, i, j, L, S):
        self._check(L, S)
        c = self.codes().to(i.device)
        cq = torch.div(i, self.block_q, rounding_mode="floor")
        ck = torch.div(j, self.block_k, rounding_mode="floor")
        shape = _broadcast_shape(i.shape, j.shape)
        if (i.dim() >= 2 and j.dim() >= 2 and i.shape[-1] == 1 and j.shape[-2] == 1
                and bool((cq == cq[..., :1, :]).all()) and bool((ck == ck[..., :1]).all())):
            # tiles inside one block each (the kernels' mask tiles, dead keys): the codes once per tile, not per
            # pair (the per-pair gather was 3x the mask_mod's own time on a document mask's partial blocks)
            cq, ck = cq[..., :1, :], ck[..., :1]
        c = c[:, cq, ck] if c.shape[0] > 1 else c[0][cq, ck]  # (Bm, *shape) or shape (or per tile)
        inner = self.inner()
        if inner is None:
            m = c != EMPTY
        elif c.numel() * 64 <= math.prod(shape) and bool((c == PARTIAL).all()):
            # codes per tile, every one PARTIAL (the kernels' mask tiles, dead keys of PARTIAL blocks): mask_mod
            # alone, without three full-size bool ops to combine it with the codes
            m = inner.keep(i, j, L, S)
            m = torch.broadcast_to(m, _broadcast_shape(c.shape, m.shape))  # a view: c's batch dim, if any
        else:
            m = (c == FULL) | ((c == PARTIAL) & inner.keep(i, j, L, S))
        if self.batch_size:
            return torch.broadcast_to(m, (self.batch_size,) + tuple(shape))
        return torch.broadcast_to(m, (m.shape[0],) + tuple(shape)) if c.dim() > len(shape) else \
            torch.broadcast_to(m, shape)

    def bounds(self, qlo, qhi, klo, khi, L, S):
        # cells each caller block touches, counted by 2-D prefix sums of the union / intersection over the batch
        self._check(L, S)
        codes = self.codes().to(qlo.device)
        bq0, bq1 = (torch.div(x, self.block_q, rounding_mode="floor") for x in (qlo, qhi))
        bk0, bk1 = (torch.div(x, self.block_k, rounding_mode="floor") for x in (klo, khi))

        def count(t):
            c = torch.nn.functional.pad(t.to(torch.int64).cumsum(0).cumsum(1), (1, 0, 1, 0))
            return c[bq1 + 1, bk1 + 1] - c[bq0, bk1 + 1] - c[bq1 + 1, bk0] + c[bq0, bk0]

        cells = (bq1 - bq0 + 1) * (bk1 - bk0 + 1)
        return count((codes != EMPTY).any(0)) > 0, count((codes == FULL).all(0)) == cells

    def block_shape(self):
        return self.block_q, self.block_k

    # Note [PARTIAL tiles evaluated once]: dead_keys and the compiled kernel's mask tiles
    # (kernels/compiled.py _pattern_layout) both need mask_mod on every pair of the PARTIAL blocks; a shared
    # mask (no ``batch``) evaluates them once, on its own block grid, and keeps them in its memo while they fit
    # in _TILE_MEMO_BYTES (a document mask at L = S = 16384: about 400 blocks, 6.5 MB; evaluated twice it was a
    # quarter of a first flex_attention call's overhead).
    def partial_tiles(self, L: int, S: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(part int64 [Np, 2] (query block, key block) of the PARTIAL blocks in row-major order, keep bool
        [Np, block_q, block_k] of their pairs, rows and keys past L or S repeating the last valid one), or None
        when the mask is per batch element, has no mask_mod, or its tiles exceed _TILE_MEMO_BYTES (Note
        [PARTIAL tiles evaluated once])."""
        self._check(L, S)
        if self.batch or self.mask_mod is None:
            return None
        hit = self._memo.get("partial_tiles")
        if hit is None:
            bq, bk = self.block_q, self.block_k
            part = (self.codes()[0] == PARTIAL).nonzero()  # (Np, 2)
            hit = False
            if len(part) * bq * bk <= _TILE_MEMO_BYTES:
                m = self._tiles_refined(part, L, S)
                if m is None:
                    i = (part[:, :1] * bq + torch.arange(bq)).clamp(max=L - 1).unsqueeze(-1)  # (Np, bq, 1)
                    j = (part[:, 1:] * bk + torch.arange(bk)).clamp(max=S - 1).unsqueeze(1)  # (Np, 1, bk)
                    m = torch.broadcast_to(self.inner().keep(i, j, L, S), (len(part), bq, bk))
                hit = part, m
            self._memo["partial_tiles"] = hit
        return hit or None

    # Note [PARTIAL tiles by sub-tiles]: a PARTIAL block of a document or band mask is mostly runs of kept or
    # dropped pairs, crossed by a few boundary lines: intervals (Note [Sound intervals] in intervals.py) on
    # sub-tiles of _TILE_SUB² pairs settle most of them, and mask_mod runs only on the pairs of the sub-tiles
    # they leave undecided (a document mask at L = S = 16384: its 340 PARTIAL blocks' 5.6M pairs were 18 ms of
    # a first call). Only where the blocks are whole (L, S multiples of the block, the block of the sub-tile)
    # and intervals cover the mask_mod without reading b or h; otherwise every pair, as before.
    def _tiles_refined(self, part: torch.Tensor, L: int, S: int) -> torch.Tensor | None:
        """keep bool [Np, block_q, block_k] of the blocks ``part`` [Np, 2] by Note [PARTIAL tiles by sub-tiles],
        or None where it does not apply."""
        bq, bk, sub = self.block_q, self.block_k, _TILE_SUB
        if L % bq or S % bk or bq % sub or bk % sub or len(part) == 0:
            return None
        nsq, nsk, n = bq // sub, bk // sub, len(part)
        q0 = (part[:, 0] * bq).view(n, 1, 1) + (torch.arange(nsq) * sub).view(1, nsq, 1)
        k0 = (part[:, 1] * bk).view(n, 1, 1) + (torch.arange(nsk) * sub).view(1, 1, nsk)
        q0, k0 = q0.expand(n, nsq, nsk).reshape(-1), k0.expand(n, nsq, nsk).reshape(-1)  # (U,) sub-tile corners
        try:
            all_s, any_s, reads = _iv.evaluate(self.mask_mod, 0, 0, q0, q0 + sub - 1, k0, k0 + sub - 1, _iv._Cache())
        except _iv.NotInterval:
            return None
        if reads:  # b or h: the pairs' path (which refuses h with its own error)
            return None
        m = all_s.view(n, nsq, 1, nsk, 1).expand(n, nsq, sub, nsk, sub).clone()  # decided sub-tiles: their value
        und = (any_s & ~all_s).nonzero().view(-1)
        if und.numel():
            ar = torch.arange(sub)
            i = (q0[und, None] + ar).unsqueeze(-1)  # (u, sub, 1)
            j = (k0[und, None] + ar).unsqueeze(1)  # (u, 1, sub)
            t, r = und // (nsq * nsk), und % (nsq * nsk)
            m[t, r // nsk, :, r % nsk, :] = torch.broadcast_to(self.inner().keep(i, j, L, S), (und.numel(), sub, sub))
        return m.view(n, bq, bk)

    def dead_keys(self, L: int, S: int) -> torch.Tensor:
        """As ``Pattern.dead_keys``, from the PARTIAL tiles of Note [PARTIAL tiles evaluated once] when kept: a
        key is live when a FULL block's column holds it, or some row of a PARTIAL block keeps it."""
        tiles = self.partial_tiles(L, S) if L > 0 and S > 0 else None
        if tiles is None:
            return super().dead_keys(L, S)
        part, m = tiles
        bk = self.block_k
        nk = self.grid[1]
        alive = (self.codes()[0] == FULL).any(0).repeat_interleave(bk)  # (nk·bk,)
        keys = (part[:, 1:] * bk + torch.arange(bk)).view(-1)  # (Np·bk,)
        seen = torch.zeros(nk * bk, dtype=torch.int32).index_add_(0, keys, m.any(1).view(-1).to(torch.int32))
        return ~(alive | (seen > 0))[:S].unsqueeze(0)

    def kept_blocks(self) -> int:
        """Non-empty blocks, summed over the batch elements it stores."""
        return sum(int(x[0].numel()) for x in self.blocks)

    def __repr__(self):
        return (f"BlockMaskPattern({self.name}, blocks {self.block_q}x{self.block_k}, (L, S) = {tuple(self.lengths)}"
                + (f", B={self.batch_size})" if self.batch_size else ")"))


def _reads_head(mask_mod) -> bool:
    """Whether mask_mod uses h at all, by one call on a 1 x 1 grid with h the stand-in that refuses every use
    (patterns.mask_mod._HeadIndex, which flex_attention's patterns evaluate with)."""
    z = torch.zeros(1, 1, dtype=torch.long)
    try:
        mask_mod(torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long).as_subclass(_HeadIndex), z, z)
    except _HeadUsed:
        return True
    except Exception:  # noqa: BLE001 - other failures are the build's to report, not this check's
        return False
    return False


def create_block_mask(mask_mod, B: int | None, H: int | None, Q_LEN: int, KV_LEN: int, device="cpu",
                      BLOCK_SIZE: int | tuple[int, int] = 128, _compile: bool = False, separate_full_blocks: bool = True,
                      compute_dq_write_order: bool = False, dq_kv_order: bool = True, *, output: str | None = None,
                      stats: BuildStats | None = None):
    """torch's ``create_block_mask`` without the Q_LEN x KV_LEN grid (the module docstring says how).

    Args:
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor`` (True = keep), written with tensor ops.
        B, H: batch and heads (None = 1, shared, as in torch); mask_mod is evaluated per (b, h) only when
            it reads b or h (found while interpreting it), otherwise once.
        Q_LEN, KV_LEN: lengths L and S. device: "cpu" only. BLOCK_SIZE: int or (Q_BLOCK, KV_BLOCK).
        output: "torch" (default when torch has ``BlockMask``): a ``BlockMask`` equal to torch's
            ``create_block_mask`` in kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices (its
            index tables are [B, H, nq, nk] int32 by torch's format: 4 such tables with the transposed ones,
            O(nq·nk) memory); "pattern": a ``BlockMaskPattern`` holding only the non-empty blocks, O(kept
            blocks) memory (the form for very long sequences; ``to_block_mask`` converts it).
        _compile: accepted for torch's signature and ignored (nothing is compiled here).
        separate_full_blocks: as torch's: False lists every non-empty block as partial (no full tables).
        compute_dq_write_order, dq_kv_order: torch's deterministic-backward metadata for its GPU kernels;
            True is refused (ValueError), as attnlab's kernels have no use for it.
        stats: a ``BuildStats`` to fill with how the blocks were found.

    Cost: O(kept blocks · log(nq)) interval evaluations for bands, causal, prefix and document masks,
    plus 8 exact pairs per boundary block; pairs only for blocks the intervals and probes leave open.
    Equivalent to torch's ``create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE)``.
    """
    if not callable(mask_mod):
        raise TypeError(f"create_block_mask: mask_mod must be callable as mask_mod(b, h, q_idx, kv_idx), got "
                        f"{type(mask_mod).__name__}")
    if device is not None and torch.device(device).type != "cpu":
        raise ValueError(f"create_block_mask: device must be 'cpu' (attnlab runs on CPU tensors), got {device!r}")
    Bn = 1 if B is None else _check_int("B", B, 1)
    Hn = 1 if H is None else _check_int("H", H, 1)
    L, S = _check_int("Q_LEN", Q_LEN, 1), _check_int("KV_LEN", KV_LEN, 1)
    bq, bk = _check_block(BLOCK_SIZE)
    if output is None:
        output = "torch" if BlockMask is not None else "pattern"
    if output not in ("torch", "pattern"):
        raise ValueError(f"create_block_mask: output must be 'torch' or 'pattern', got {output!r}")
    if output == "torch" and BlockMask is None:
        raise ValueError("create_block_mask: output='torch' needs torch >= 2.5 (torch.nn.attention.flex_attention)")
    if compute_dq_write_order:
        raise ValueError("create_block_mask: compute_dq_write_order=True builds metadata for torch's deterministic GPU "
                         "backward; attnlab's kernels do not read it: pass compute_dq_write_order=False")
    if not isinstance(separate_full_blocks, bool):
        raise TypeError(f"create_block_mask: separate_full_blocks must be a bool, got {separate_full_blocks!r}")
    stats = BuildStats() if stats is None else stats
    name = getattr(mask_mod, "__name__", type(mask_mod).__name__)
    # a pattern is shared by the heads, and flex_attention refuses one whose mask_mod reads h: refused here up
    # front at any H (issue 40, D7: H=None or 1 built it, and flex_attention refused it later)
    per_head = (f"create_block_mask: mask_mod {name} reads h; attnlab patterns are shared by the heads: use "
                "output='torch' for a per-head BlockMask")
    if output == "pattern" and _reads_head(mask_mod):
        raise ValueError(per_head)
    per, Bm, Hm = _build(mask_mod, Bn, Hn, L, S, bq, bk, stats)
    if not separate_full_blocks:
        per = {key: (qb, kb, torch.full_like(code, PARTIAL)) for key, (qb, kb, code) in per.items()}
    if output == "pattern":
        if Hm > 1 or "h" in stats.reads:
            raise ValueError(per_head)
        blocks = tuple(per[(b, 0)] for b in range(Bm))
        return BlockMaskPattern(blocks, bq, bk, (L, S), mask_mod=mask_mod, name=name, batch=Bm if Bm > 1 else None)
    nq, nk = -(-L // bq), -(-S // bk)
    codes = torch.zeros(Bm, Hm, nq, nk, dtype=torch.int8)
    for (b, h), (qb, kb, code) in per.items():
        codes[b, h, qb, kb] = code
    return _torch_from_codes(codes.expand(Bn, Hn, nq, nk), bq, bk, (L, S), mask_mod, full=separate_full_blocks)


def _torch_from_codes(codes: torch.Tensor, bq: int, bk: int, lengths, mask_mod, full: bool = True):
    """torch BlockMask from int8 codes [B, H, nq, nk], ordered as torch's create_block_mask orders them
    (``full=False``: no full-block tables, as torch's separate_full_blocks=False)."""
    kv_num, kv_idx = _ordered(codes == PARTIAL)
    full_num, full_idx = _ordered(codes == FULL) if full else (None, None)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(bq, bk), mask_mod=mask_mod,
                                    seq_lengths=tuple(lengths))


def _torch_codes(bm) -> torch.Tensor:
    """int8 [Bm, Hm, nq, nk] EMPTY / PARTIAL / FULL of a torch BlockMask (its listed blocks; nq, nk from
    its seq_lengths, so index tables narrower than nk work)."""
    t = bm.as_tuple()
    kv_num, kv_idx, full_num, full_idx = t[2], t[3], t[4], t[5]
    bq, bk = (int(x) for x in bm.BLOCK_SIZE)
    L, S = (int(x) for x in bm.seq_lengths)
    Bm, Hm, nq = kv_num.shape
    nk = max(-(-S // bk), int(kv_idx.shape[-1]))
    codes = torch.zeros(Bm, Hm, nq, nk + 1, dtype=torch.int8)  # column nk takes the unused index slots

    def put(num, idx, code):
        slot = torch.arange(idx.shape[-1]).view(1, 1, 1, -1)
        cols = torch.where(slot < num.long().unsqueeze(-1), idx.long(), nk)
        codes.scatter_(-1, cols.expand(Bm, Hm, nq, -1), code)

    put(kv_num.cpu(), kv_idx.cpu(), PARTIAL)
    if full_num is not None:
        put(full_num.cpu(), full_idx.cpu(), FULL)
    return codes[..., :nk]


def block_codes(block_mask) -> torch.Tensor:
    """int8 [Bm, Hm, nq, nk] EMPTY / PARTIAL / FULL of a torch BlockMask (the blocks it lists; nq, nk from its
    seq_lengths) or of a BlockMaskPattern ([Bm, 1, nq, nk])."""
    return _codes_of(block_mask)[0]


def _is_noop(mask_mod) -> bool:
    return mask_mod is None or getattr(mask_mod, "__name__", "") == "noop_mask"


def _reads_b(mask_mod, L: int, S: int) -> bool:
    """Whether mask_mod reads b, found by interpreting it once on the whole grid (``intervals``); a function
    the interval table cannot read is taken to read b (a per-batch pattern: slower, never wrong)."""
    try:
        z = torch.zeros(1, dtype=torch.long)
        reads = _iv.evaluate(mask_mod, 0, 0, z, z + L - 1, z, z + S - 1)[2]
    except _iv.NotInterval:
        return True
    return "b" in reads


def from_block_mask(block_mask, B: int | None = None) -> BlockMaskPattern:
    """A torch ``BlockMask`` as an attnlab pattern (``attention(..., pattern=from_block_mask(bm))``):
    its FULL blocks kept, its PARTIAL blocks through its ``mask_mod`` (all of them for torch's noop_mask),
    other blocks empty, as torch's kernels read it. Blocks that differ per head, or a mask_mod that reads h,
    are refused (ValueError: patterns are shared by the heads); blocks per batch element make a per-batch
    pattern. ``B``: the batch size of the inputs it will mask, for a mask_mod that reads b on a mask built
    with B=None (torch's kernels call it with each element's b); default the mask's own batch extent."""
    if BlockMask is None or not isinstance(block_mask, BlockMask):
        raise TypeError(f"from_block_mask: block_mask must be a torch BlockMask, got {type(block_mask).__name__}")
    codes = _torch_codes(block_mask)  # (Bm, Hm, nq, nk)
    Bm, Hm = codes.shape[:2]
    if B is not None:
        _check_int("B", B, 1)
        if Bm not in (1, B):
            raise ValueError(f"from_block_mask: the mask has batch extent {Bm}, the inputs B={B}; each must be 1 or equal")
    if Hm > 1 and not bool((codes == codes[:, :1]).all()):
        raise ValueError(f"from_block_mask: its blocks differ between its {Hm} heads; attnlab patterns are shared by "
                         "the heads (flex_attention runs such a mask on its general path)")
    codes = codes[:, 0]
    if Bm > 1 and bool((codes == codes[:1]).all()):
        codes = codes[:1]
    bq, bk = (int(x) for x in block_mask.BLOCK_SIZE)
    L, S = (int(x) for x in block_mask.seq_lengths)
    nq, nk = -(-L // bq), -(-S // bk)
    blocks = []
    for c in codes[:, :nq, :nk]:
        qb, kb = (c != EMPTY).nonzero(as_tuple=True)
        blocks.append((qb, kb, c[qb, kb]))
    mm = None if _is_noop(block_mask.mask_mod) else block_mask.mask_mod
    batch = len(blocks) if len(blocks) > 1 else None
    Bx = B if B is not None else Bm
    if batch is None and mm is not None and Bx > 1 and _reads_b(mm, L, S):
        batch = Bx
    p = BlockMaskPattern(tuple(blocks), bq, bk, (L, S), mask_mod=mm,
                         name=getattr(block_mask.mask_mod, "__name__", "mask_mod"), batch=batch)
    p.inner()  # refuse a mask_mod that reads h, or returns something else than a bool tensor, now
    return p


def to_block_mask(pattern: Pattern, L: int | None = None, S: int | None = None, BLOCK_SIZE=128):
    """A torch ``BlockMask`` from an attnlab pattern: its ``block_layout(L, S, BLOCK_SIZE)`` as full /
    partial blocks (torch's ordering), and a mask_mod that evaluates ``pattern.keep`` on the partial ones.
    A ``BlockMaskPattern`` gives its own blocks and lengths (L, S and BLOCK_SIZE may be omitted). torch's
    kernels read the blocks; its eager reference reads only mask_mod, and both agree with the pattern."""
    if BlockMask is None:
        raise ValueError("to_block_mask needs torch >= 2.5 (torch.nn.attention.flex_attention)")
    if isinstance(pattern, BlockMaskPattern):
        L = pattern.lengths[0] if L is None else L
        S = pattern.lengths[1] if S is None else S
        pattern._check(L, S)
        codes = pattern.codes()
        bq, bk = pattern.block_q, pattern.block_k
        mm = pattern.mask_mod
    else:
        if not isinstance(pattern, Pattern):
            raise TypeError(f"to_block_mask: pattern must be an attnlab Pattern, got {type(pattern).__name__}")
        if L is None or S is None:
            raise ValueError("to_block_mask: give L and S for a pattern that is not a BlockMaskPattern")
        bq, bk = _check_block(BLOCK_SIZE)
        codes = torch_layout(pattern, L, S, (bq, bk)).unsqueeze(0)
        if pattern.batch_size:
            codes = codes.expand(pattern.batch_size, -1, -1)
        mm = _pattern_mask_mod(pattern, L, S)
    if mm is None:
        from torch.nn.attention.flex_attention import noop_mask as mm
    return _torch_from_codes(codes.unsqueeze(1), bq, bk, (L, S), mm)


def torch_layout(pattern: Pattern, L: int, S: int, BLOCK_SIZE=128) -> torch.Tensor:
    """int8 [nq, nk] ``pattern.block_layout`` as torch's BlockMask would list it: torch pads the grid with
    dropped pairs, so a block that L or S clips is PARTIAL, never FULL."""
    bq, bk = _check_block(BLOCK_SIZE)
    codes = pattern.block_layout(L, S, bq, bk).clone()
    if L % bq:
        codes[-1][codes[-1] == FULL] = PARTIAL
    if S % bk:
        codes[:, -1][codes[:, -1] == FULL] = PARTIAL
    return codes


def _pattern_mask_mod(pattern: Pattern, L: int, S: int):
    """mask_mod(b, h, q_idx, kv_idx) of a pattern at (L, S): keep on the pairs, b picks the batch element."""
    def pattern_mask(b, h, q_idx, kv_idx):
        m = pattern.keep(q_idx, kv_idx, L, S)
        if pattern.batch_size:
            m = m[b]
        return m
    pattern_mask.__name__ = f"pattern_mask({pattern!r})"
    return pattern_mask


def adjust(block_mask, new_q_len: int, new_kv_len: int, align: str = "bottom_right"):
    """``block_mask`` for new lengths. ``align="top_left"``: the new grid is the old one's top-left corner
    (as torch's ``BlockMask._adjust``: query i and key j keep their positions; but a block the new lengths
    clip becomes PARTIAL, as a fresh ``create_block_mask`` gives, where torch's crop keeps it FULL). ``"bottom_right"``: the new grid
    is the old one's bottom-right corner, query i is old query i + (Q_LEN - new_q_len) and key j old key
    j + (KV_LEN - new_kv_len), which is what a mask aligned to the last key (bottom-right causal, a KV cache's
    last rows) needs. The mask_mod is shifted to match and the blocks found again (``create_block_mask``),
    so blocks need not align; a BlockMask without a mask_mod (block tables) needs block-aligned shifts.
    Returns the same kind it was given (torch BlockMask or BlockMaskPattern)."""
    if align not in ("top_left", "bottom_right"):
        raise ValueError(f"adjust: align must be 'top_left' or 'bottom_right', got {align!r}")
    torch_in = BlockMask is not None and isinstance(block_mask, BlockMask)
    if not torch_in and not isinstance(block_mask, BlockMaskPattern):
        raise TypeError(f"adjust: block_mask must be a torch BlockMask or a BlockMaskPattern, got "
                        f"{type(block_mask).__name__}")
    L, S = (int(x) for x in (block_mask.seq_lengths if torch_in else block_mask.lengths))
    _check_int("new_q_len", new_q_len, 1, L, why=f"the mask covers Q_LEN = {L} queries")
    _check_int("new_kv_len", new_kv_len, 1, S, why=f"the mask covers KV_LEN = {S} keys")
    dq, dk = (L - new_q_len, S - new_kv_len) if align == "bottom_right" else (0, 0)
    bq, bk = ((int(x) for x in block_mask.BLOCK_SIZE) if torch_in else (block_mask.block_q, block_mask.block_k))
    mm = block_mask.mask_mod
    if torch_in and _is_noop(mm) or not torch_in and mm is None:
        if dq % bq or dk % bk:
            raise ValueError(f"adjust: a mask of blocks alone (no mask_mod) shifts by whole blocks only; "
                             f"bottom_right needs Q_LEN - new_q_len = {dq} a multiple of {bq} and KV_LEN - new_kv_len "
                             f"= {dk} a multiple of {bk}")
        codes = _torch_codes(block_mask) if torch_in else block_mask.codes().unsqueeze(1)
        nq, nk = -(-new_q_len // bq), -(-new_kv_len // bk)
        c = codes[..., dq // bq:dq // bq + nq, dk // bk:dk // bk + nk]
        if torch_in:
            return _torch_from_codes(c, bq, bk, (new_q_len, new_kv_len), mm)
        blocks = []
        for x in c[:, 0]:
            qb, kb = (x != EMPTY).nonzero(as_tuple=True)
            blocks.append((qb, kb, x[qb, kb]))
        return BlockMaskPattern(tuple(blocks), bq, bk, (new_q_len, new_kv_len), None, block_mask.name,
                                batch=len(blocks) if len(blocks) > 1 else None)
    if dq or dk:
        def shifted_mask(b, h, q_idx, kv_idx, mm=mm):
            return mm(b, h, q_idx + dq, kv_idx + dk)
        shifted_mask.__name__ = f"{getattr(mm, '__name__', 'mask_mod')}[+{dq}, +{dk}]"
        new_mm = shifted_mask
    else:
        new_mm = mm
    if torch_in:
        Bm, Hm = (int(x) for x in block_mask.kv_num_blocks.shape[:2])
        return create_block_mask(new_mm, Bm, Hm, new_q_len, new_kv_len, BLOCK_SIZE=(bq, bk))
    return create_block_mask(new_mm, block_mask.batch_size, None, new_q_len, new_kv_len, BLOCK_SIZE=(bq, bk),
                             output="pattern")


# -- pictures in text -------------------------------------------------------------------------------
def _codes_of(block_mask) -> tuple[torch.Tensor, int, int, int, int]:
    """(codes int8 [Bm, Hm, nq, nk], bq, bk, L, S) of a torch BlockMask, a BlockMaskPattern or (pattern, L, S)."""
    if BlockMask is not None and isinstance(block_mask, BlockMask):
        bq, bk = (int(x) for x in block_mask.BLOCK_SIZE)
        L, S = (int(x) for x in block_mask.seq_lengths)
        return _torch_codes(block_mask)[..., :-(-L // bq), :-(-S // bk)], bq, bk, L, S
    if isinstance(block_mask, BlockMaskPattern):
        L, S = block_mask.lengths
        return block_mask.codes().unsqueeze(1), block_mask.block_q, block_mask.block_k, L, S
    raise TypeError(f"expected a torch BlockMask or a BlockMaskPattern, got {type(block_mask).__name__}")


def block_mask_stats(block_mask, E: int = 64, Ev: int | None = None) -> list[dict]:
    """Per (b, h) of the mask: blocks EMPTY / PARTIAL / FULL, the pairs the kernel computes (every pair of
    a non-empty block, edges clipped), and the FLOPs it skips against dense attention, ``2·pairs·(E + Ev)``."""
    codes, bq, bk, L, S = _codes_of(block_mask)
    Ev = E if Ev is None else Ev
    rows = torch.clamp(L - torch.arange(codes.shape[-2]) * bq, max=bq).double()  # (nq,) clipped block heights
    cols = torch.clamp(S - torch.arange(codes.shape[-1]) * bk, max=bk).double()
    out = []
    for b in range(codes.shape[0]):
        for h in range(codes.shape[1]):
            c = codes[b, h]
            computed = float(rows @ (c != EMPTY).double() @ cols)
            out.append({"b": b, "h": h, "empty": int((c == EMPTY).sum()), "partial": int((c == PARTIAL).sum()),
                        "full": int((c == FULL).sum()), "computed_pairs": int(computed),
                        "flops_skipped": int(2 * (L * S - computed) * (E + Ev)),
                        "fraction_skipped": 1.0 - computed / (L * S)})
    return out


def block_mask_text(block_mask, max_blocks: int = 64, E: int = 64) -> str:
    """A text picture per (b, h): ``#`` FULL, ``+`` PARTIAL, ``.`` EMPTY per block (rows = query blocks),
    pooled to at most ``max_blocks`` per side (a pooled cell is ``#`` or ``.`` only when every block it
    covers is, else ``+``), with counts and the FLOPs skipped. Heads with the same blocks are printed once."""
    codes, bq, bk, L, S = _codes_of(block_mask)
    nq, nk = codes.shape[-2:]
    fq, fk = max(1, -(-nq // max_blocks)), max(1, -(-nk // max_blocks))
    stats = block_mask_stats(block_mask, E=E)
    lines = [f"block mask {L} x {S} in blocks of {bq} x {bk} ({nq} x {nk} blocks"
             + (f", one character per {fq} x {fk} blocks" if fq * fk > 1 else "") + "): # full, + partial, . empty"]
    seen = {}
    for st in stats:
        c = codes[st["b"], st["h"]]
        key = (c.numel(), hash(c.numpy().tobytes()))
        if key in seen:
            lines.append(f"(b={st['b']}, h={st['h']}): as (b={seen[key][0]}, h={seen[key][1]})")
            continue
        seen[key] = (st["b"], st["h"])
        lines.append(f"(b={st['b']}, h={st['h']}): {st['full']} full, {st['partial']} partial, {st['empty']} empty; "
                     f"{100 * st['fraction_skipped']:.1f}% of pairs skipped ({st['flops_skipped']:.3g} FLOPs at E={E})")
        for r in range(0, nq, fq):
            row = []
            for k in range(0, nk, fk):
                cell = c[r:r + fq, k:k + fk]
                row.append("#" if bool((cell == FULL).all()) else "." if bool((cell == EMPTY).all()) else "+")
            lines.append("  " + "".join(row))
    return "\n".join(lines)


# -- bands, proved --------------------------------------------------------------------------------
def as_band(mask_mod, L: int, S: int, BLOCK_SIZE: int | tuple[int, int] = 128, *,
            blocks: tuple[torch.Tensor, torch.Tensor] | None = None) -> Pattern | None:
    """``sliding_window(left=, right=)`` (a band: causal, windows, their &) equal to ``mask_mod`` at every
    pair of the L x S grid (``full()`` for a band unbounded on both sides), or None when it is not one (or
    reads b or h).

    The band is read off the first and last query rows (O(S) pairs), then *proved*: the mask
    ``mask_mod != band`` is built with ``create_block_mask``'s machinery (intervals, probes, pairs only on
    undecided blocks) and must have no non-empty block. So a mask_mod that differs from the band at a single
    pair is refused, and the cost is that of evaluating the band's boundary blocks once. The band pattern then
    runs on the kernels' band paths (one mask tile per diagonal, counts in O(L)) instead of calling mask_mod.

    ``blocks``: (qb, kb) int64 [n], the only blocks where the equality must hold (a torch BlockMask's PARTIAL
    blocks: its FULL and EMPTY blocks ignore mask_mod, and the caller compares them with the band's layout
    itself). The proof then runs ``_blocks_refined`` on those blocks alone, skipping the search over the
    whole grid (Note [Bands proved once per BlockMask] in functional/flex.py)."""

    bq, bk = _check_block(BLOCK_SIZE)

    def band(lo, hi):  # unbounded on both sides is every pair (issue 40, D1: no sliding_window(None, None))
        if lo is None and hi is None:
            return full()
        return sliding_window(left=None if lo is None else -lo, right=hi)
    j = torch.arange(S)
    try:
        rows = [_exact(mask_mod, 0, 0, torch.tensor([[r]]), j.view(1, -1), "mask_mod")[0] for r in (0, L - 1)]
    except Exception:  # not evaluable on plain pairs here: not provably a band
        return None
    ranges = []
    for r in rows:
        kept = r.nonzero().view(-1)
        if kept.numel() == 0 or int(kept[-1]) - int(kept[0]) + 1 != kept.numel():
            return None  # an empty or broken row: a band's first and last rows are one range each
        ranges.append((int(kept[0]), int(kept[-1])))
    (a0, b0), (a1, b1) = ranges
    hi = b0 if b0 < S - 1 else (b1 - (L - 1) if b1 < S - 1 else None)
    lo = a1 - (L - 1) if a1 > 0 else (a0 if a0 > 0 else None)
    if lo is not None and hi is not None and hi < lo:
        return None

    def differs(b, h, q_idx, kv_idx):
        # lo <= kv_idx - q_idx <= hi, as kv_idx >= q_idx + lo: the sums are the small operands' shape (a grid
        # of pairs broadcasts (u, r, 1) against (u, 1, c)), no full-size int64 difference
        band = (kv_idx >= q_idx + lo) if lo is not None else None
        if hi is not None:
            band = (kv_idx <= q_idx + hi) if band is None else band & (kv_idx <= q_idx + hi)
        if band is None:
            return ~mask_mod(b, h, q_idx, kv_idx)
        return mask_mod(b, h, q_idx, kv_idx) != band

    stats = BuildStats()
    try:
        if blocks is None:
            per, Bm, Hm = _build(differs, 1, 1, L, S, bq, bk, stats)
            found = any(x[0].numel() for x in per.values())
        else:
            tq, tk = blocks
            if tq.numel() == 0:
                return band(lo, hi)
            try:
                # sub-tiles of 16 at block 128: fewer interval tiles than 8, fewer pairs than 32 (in a fresh
                # process at L = S = 16384, causal window: 15 ms against 20 for 8 and 28 for 32)
                any_, _ = _blocks_refined(differs, 0, 0, tq, tk, L, S, bq, bk, "mask_mod", stats, _iv._Cache(),
                                          sub=max(8, min(bq, bk) // 8))
            except _iv.NotInterval:
                any_, _ = _blocks_exact(differs, 0, 0, tq, tk, L, S, bq, bk, "mask_mod", stats)
            found = bool(any_.any())
    except Exception:
        return None
    if "b" in stats.reads or "h" in stats.reads or found:
        return None
    return band(lo, hi)
