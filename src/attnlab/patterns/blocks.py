"""Block-granular masks: block tables (block_sparse, BigBird), the Sparse Transformer's fixed pattern, Longformer.

Legend: query i < L, key j < S; nq = ceil(L / block_size) query blocks, nk = ceil(S / block_size) key
blocks. Every constructor returns a ``Pattern`` that materialises to a bool [L, S] mask.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .bands import sliding_window
from .base import Pattern, _check_bool, _check_int, _index


@dataclass(frozen=True, eq=False)
class _Fixed(Pattern):
    block: int
    summary: int
    causal: bool

    def keep(self, i, j, L, S):
        same = torch.div(i, self.block, rounding_mode="floor") == torch.div(j, self.block, rounding_mode="floor")
        summ = torch.remainder(j, self.block) >= self.block - self.summary
        m = same | summ
        return m & (j <= i) if self.causal else m

    def bounds(self, qlo, qhi, klo, khi, L, S):
        b, c = self.block, self.summary
        # own block: the block indices t both ranges cover; under causal the lowest such t decides, since
        # every t above it leaves a whole block of queries after its first key
        t = torch.maximum(torch.div(qlo, b, rounding_mode="floor"), torch.div(klo, b, rounding_mode="floor"))
        own = t <= torch.minimum(torch.div(qhi, b, rounding_mode="floor"), torch.div(khi, b, rounding_mode="floor"))
        if self.causal:
            own = own & (torch.maximum(klo, t * b) <= torch.minimum(qhi, t * b + b - 1))
        # summary columns: the first position p >= klo with p mod b >= b - c, if it is in range
        kh = torch.minimum(khi, qhi) if self.causal else khi
        first = torch.where(torch.remainder(klo, b) >= b - c, klo, torch.div(klo, b, rounding_mode="floor") * b + b - c)
        summ = (first <= kh) if c > 0 else torch.zeros_like(own)
        # all: conservative (PARTIAL is always correct): every key is a summary column of one block, or
        # queries and keys share one block; and under causal no key comes after a query
        same_block = torch.div(klo, b, rounding_mode="floor") == torch.div(khi, b, rounding_mode="floor")
        all_summ = same_block & (torch.remainder(klo, b) >= b - c) if c > 0 else torch.zeros_like(own)
        all_own = same_block & (torch.div(qlo, b, rounding_mode="floor") == torch.div(klo, b, rounding_mode="floor")) \
            & (torch.div(qhi, b, rounding_mode="floor") == torch.div(klo, b, rounding_mode="floor"))
        all_ = all_summ | all_own
        if self.causal:
            all_ = all_ & (khi <= qlo)
        return own | summ, all_

    def nnz(self, L: int, S: int) -> int:
        """Kept pairs in O(L), row by row: the query's own block plus the summary columns outside it,
        among the keys j < e it may see (e = S, or min(i + 1, S) when causal)."""
        if L <= 0 or S <= 0:
            return 0
        b, c = self.block, self.summary
        i = torch.arange(L)  # (L,)
        e = torch.clamp(i + 1, max=S) if self.causal else torch.full_like(i, S)  # keys j < e are visible

        def summaries(x):  # summary columns (j % b >= b - c) among keys [0, x): c per whole block + a tail
            return torch.div(x, b, rounding_mode="floor") * c + (torch.remainder(x, b) - (b - c)).clamp(min=0)

        start = torch.div(i, b, rounding_mode="floor") * b  # first key of the query's own block
        end = torch.minimum(start + b, e)  # visible keys of the own block: [start, end)
        own = (end - start).clamp(min=0)
        before = summaries(torch.minimum(start, e))  # summary columns before the own block
        after = summaries(e) - summaries(end)  # ... and after it (end >= min(start, e))
        return int((own + before + after).sum())

    def counts_analytically(self):
        return True

    def block_shape(self):
        # a query block per fixed block; key blocks as wide as the summary's alignment, so own-block and
        # summary keys fall in separate key blocks and the rest are empty
        return self.block, math.gcd(self.block, self.summary)

    def __repr__(self):
        return f"fixed({self.block}, {self.summary}, causal={self.causal})"


def fixed(block: int, summary: int, causal: bool = True) -> Pattern:
    """Sparse Transformer fixed pattern (Child et al. 2019): each token sees its own block of
    ``block`` tokens plus the last ``summary`` positions of every block: (i, j) kept when
    ``i // block == j // block`` or ``j % block >= block - summary`` (and j <= i when ``causal``).

    Materialises to bool [L, S]; ``block_shape()`` is ``(block, gcd(block, summary))``, at which the
    layout is exact; raises ValueError when ``summary > block``.
    """
    _check_int("block", block, 1)
    _check_int("summary", summary, 0)
    _check_bool("causal", causal)
    if summary > block:
        raise ValueError(f"summary ({summary}) must be <= block ({block})")
    return _Fixed(block, summary, causal)


@dataclass(frozen=True, eq=False)
class BlockTable(Pattern):
    """A block-granular pattern: pair (i, j) is kept when ``table(nq, nk)[i // block_size, j // block_size]``.

    Subclasses implement ``table``; the table grows by a rule, so one pattern serves any (L, S). Its
    block layout at ``block_shape() == (block_size, block_size)`` is exact with no PARTIAL block, and
    ``bounds`` is exact for any block shape (a 2-D prefix sum over the table).
    ``block_sparse`` and ``bigbird`` are block tables.
    """

    block_size: int
    name: str = "block_table"

    def table(self, nq: int, nk: int, device: torch.device | str | None) -> torch.Tensor:
        """Bool [nq, nk]: which (block_size x block_size) blocks are kept, for nq query and nk key blocks."""
        raise NotImplementedError

    def keep(self, i, j, L, S):
        bs = self.block_size
        t = self.table(-(-L // bs), -(-S // bs), i.device)
        return t[torch.div(i, bs, rounding_mode="floor"), torch.div(j, bs, rounding_mode="floor")]

    def block_shape(self):
        return self.block_size, self.block_size

    def nnz(self, L: int, S: int) -> int:
        """Kept pairs in O(nq·nk): each kept table cell counts its block's area, the last row and column
        of blocks clipped to L and S."""
        if L <= 0 or S <= 0:
            return 0
        bs = self.block_size
        nq, nk = -(-L // bs), -(-S // bs)
        t = self.table(nq, nk, "cpu").to(torch.float64)  # (nq, nk)
        rows = torch.clamp(L - torch.arange(nq, dtype=torch.float64) * bs, max=bs)  # (nq,) clipped heights
        cols = torch.clamp(S - torch.arange(nk, dtype=torch.float64) * bs, max=bs)  # (nk,) clipped widths
        return int(rows @ t @ cols)

    def counts_analytically(self):
        return True

    def bounds(self, qlo, qhi, klo, khi, L, S):
        bs = self.block_size
        t = self.table(-(-L // bs), -(-S // bs), qlo.device)
        # table cells each caller block touches: [bq0, bq1] x [bk0, bk1]. Counting the kept cells with
        # a 2-D prefix sum makes any block size (finer or coarser than the table's) cost O(cells).
        bq0, bq1 = torch.div(qlo, bs, rounding_mode="floor"), torch.div(qhi, bs, rounding_mode="floor")
        bk0, bk1 = torch.div(klo, bs, rounding_mode="floor"), torch.div(khi, bs, rounding_mode="floor")
        c = torch.nn.functional.pad(t.to(torch.int32).cumsum(0).cumsum(1), (1, 0, 1, 0))
        kept = c[bq1 + 1, bk1 + 1] - c[bq0, bk1 + 1] - c[bq1 + 1, bk0] + c[bq0, bk0]
        return kept > 0, kept == (bq1 - bq0 + 1) * (bk1 - bk0 + 1)

    def __repr__(self):
        return self.name


@dataclass(frozen=True, eq=False, repr=False)
class _Layout(BlockTable):
    layout: torch.Tensor = field(default=None)  # type: ignore[assignment]

    def table(self, nq, nk, device):
        lq, lk = self.layout.shape
        if nq > lq or nk > lk:
            raise ValueError(
                f"block_sparse layout {list(self.layout.shape)} with block_size {self.block_size} covers "
                f"{lq * self.block_size} queries x {lk * self.block_size} keys, but attention asked for "
                f"{nq} x {nk} blocks"
            )
        return self.layout[:nq, :nk].to(device)


def block_sparse(layout: torch.Tensor, block_size: int) -> Pattern:
    """Keep the (block_size x block_size) blocks where ``layout`` is True (as in DeepSpeed's and Triton's
    block-sparse attention).

    ``layout``: bool (or 0/1) [nq, nk], copied; it must cover the problem (nq·block_size >= L and
    nk·block_size >= S, else attention raises ValueError naming both shapes). Materialises to bool
    [L, S]; block layouts at block_size are exact, in O(nq·nk).
    """
    _check_int("block_size", block_size, 1)
    if not isinstance(layout, torch.Tensor) or layout.dim() != 2:
        raise ValueError(f"layout must be a 2-D tensor [n_query_blocks, n_key_blocks], got {layout!r:.60}")
    return _Layout(block_size=block_size, name=f"block_sparse({list(layout.shape)}, {block_size})",
                   layout=layout.bool().clone())


@dataclass(frozen=True, eq=False)
class _Global(Pattern):
    """Keep rows and columns of the global tokens: (i, j) kept when i or j is one of ``tokens``."""

    _global_tokens = True  # no annotation: a class constant, not a dataclass field
    tokens: tuple[int, ...]

    def keep(self, i, j, L, S):
        t = torch.tensor(self.tokens, dtype=torch.long, device=i.device)
        return torch.isin(i, t) | torch.isin(j, t)

    def bounds(self, qlo, qhi, klo, khi, L, S):
        t = torch.tensor(self.tokens, device=qlo.device).view(1, 1, -1)
        q_has = ((t >= qlo.unsqueeze(-1)) & (t <= qhi.unsqueeze(-1))).any(-1)  # (nq, 1)
        k_has = ((t >= klo.unsqueeze(-1)) & (t <= khi.unsqueeze(-1))).any(-1)  # (1, nk)
        # a block is all-global when every query row in it is global
        n_q = ((t >= qlo.unsqueeze(-1)) & (t <= qhi.unsqueeze(-1))).sum(-1)
        n_k = ((t >= klo.unsqueeze(-1)) & (t <= khi.unsqueeze(-1))).sum(-1)
        q_all = n_q == (qhi - qlo + 1)
        k_all = n_k == (khi - klo + 1)
        return q_has | k_has, q_all | k_all

    def nnz(self, L: int, S: int) -> int:
        """Kept pairs in O(g): every column of the gq global rows, every row of the gk global columns,
        their gq·gk crossings once."""
        if L <= 0 or S <= 0:
            return 0
        gq, gk = sum(t < L for t in self.tokens), sum(t < S for t in self.tokens)
        return gq * S + gk * L - gq * gk

    def counts_analytically(self):
        return True

    def __repr__(self):
        return f"global({list(self.tokens)[:4]}{'...' if len(self.tokens) > 4 else ''})"


#: most global tokens a Longformer pattern takes (as a count or as positions): each block's bounds compare
#: against every one of them, O(blocks x tokens) per layout; the paper uses a CLS token or a question's
MAX_GLOBAL_TOKENS = 4096


def longformer(window: int, global_tokens: int | list[int] | tuple[int, ...] = 1) -> Pattern:
    """Longformer (Beltagy et al. 2020): a sliding window of ``window`` keys on each side, plus global
    tokens (an int n for the first n positions, or explicit positions) that see and are seen by all.

    Equivalent to ``sliding_window(window) | global rows and columns``; materialises to bool [L, S].
    Global positions past L or S simply never occur. At most ``MAX_GLOBAL_TOKENS`` global tokens (their
    block bounds cost O(blocks x tokens)); positions are ints in [0, 2**62].
    """
    w = sliding_window(window)
    if isinstance(global_tokens, int) and not isinstance(global_tokens, bool):
        _check_int("global_tokens", global_tokens, 0, MAX_GLOBAL_TOKENS,
                   "each global token costs every block's bounds a comparison; give positions for sparse ones")
        toks = tuple(range(global_tokens))
    else:
        if isinstance(global_tokens, (str, bytes, bool)) or not hasattr(global_tokens, "__iter__"):
            raise TypeError(f"global_tokens must be an int count or a list of positions, got {global_tokens!r:.40}")
        toks = list(global_tokens)
        if len(toks) > MAX_GLOBAL_TOKENS:
            raise ValueError(f"global_tokens lists {len(toks)} positions; at most {MAX_GLOBAL_TOKENS} are supported")
        toks = tuple(sorted({_check_int(f"global_tokens[{n}]", _index(t), 0)
                             for n, t in enumerate(toks)}))
    return w | _Global(toks) if toks else w


@dataclass(frozen=True, eq=False, repr=False)
class _BigBird(BlockTable):
    window_blocks: int = 3
    global_blocks: int = 1
    random_blocks: int = 1
    seed: int = 0

    def table(self, nq, nk, device):
        bq = torch.arange(nq).unsqueeze(1)
        bk = torch.arange(nk).unsqueeze(0)
        half = (self.window_blocks - 1) // 2
        t = (bk - bq).abs() <= half
        t |= (bq < self.global_blocks) | (bk < self.global_blocks)
        if self.random_blocks and nk:
            g = torch.Generator().manual_seed(self.seed)
            r = torch.rand(nq, nk, generator=g).argsort(dim=1)[:, : min(self.random_blocks, nk)]
            t[torch.arange(nq).unsqueeze(1), r] = True
        return t.to(device)


def bigbird(block_size: int, window_blocks: int = 3, global_blocks: int = 1, random_blocks: int = 1,
            seed: int = 0) -> Pattern:
    """BigBird (Zaheer et al. 2020) at block granularity: ``window_blocks`` centred blocks, the first
    ``global_blocks`` blocks as global rows and columns, and ``random_blocks`` random key blocks per
    query block (seeded, so one (L, S) always gives one mask).

    A block table: the kept blocks form a bool [nq, nk] table grown for each (L, S); the mask it
    materialises is bool [L, S] and its layout at ``block_size`` is exact. The random blocks are drawn
    per (nq, nk), so the table for a longer sequence is not an extension of a shorter one's.
    """
    _check_int("block_size", block_size, 1)
    _check_int("window_blocks", window_blocks, 1)
    _check_int("global_blocks", global_blocks, 0)
    _check_int("random_blocks", random_blocks, 0)
    _check_int("seed", seed, 0, 2**64 - 1, "torch.Generator seeds are 64-bit")
    return _BigBird(block_size=block_size, window_blocks=window_blocks, global_blocks=global_blocks,
                    random_blocks=random_blocks, seed=seed,
                    name=f"bigbird({block_size}, {window_blocks}, {global_blocks}, {random_blocks}, seed={seed})")
