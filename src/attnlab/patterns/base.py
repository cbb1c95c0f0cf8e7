"""The Pattern base class (a mask as a predicate, with its analytic hooks), ``&`` / ``|`` and ``shifted``.

Legend: L query length, S key length, B batch; a block is rows [qlo, qhi] x columns [klo, khi].
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch

EMPTY, PARTIAL, FULL = 0, 1, 2
_INF = float("inf")


#: the largest size or offset a pattern takes: positions are int64 tensors, and a bound past any length
#: a tensor can have changes nothing
MAX_INT = 2**62


def _big(value: int) -> str:
    """An int for a message: as written up to 20 digits, else in scientific notation."""
    return str(value) if abs(value) < 10**20 else f"{value:.3g}"


def _broadcast_shape(*shapes) -> tuple[int, ...]:
    """The broadcast of shapes, as ``torch.broadcast_shapes``, whose first call imports torch._refs and sympy
    (0.3-1.4 s in a fresh process, on the first flex_attention call: tests/functional/test_flex.py
    test_first_call_imports_no_compiler_stack)."""
    n = max(len(x) for x in shapes)
    out = []
    for dims in zip(*[(1,) * (n - len(x)) + tuple(x) for x in shapes]):
        big = {d for d in dims if d != 1}
        if len(big) > 1:
            raise ValueError(f"shapes {[tuple(x) for x in shapes]} do not broadcast")
        out.append(big.pop() if big else 1)
    return tuple(out)


def _check_int(name: str, value, minimum: int = 0, maximum: int = MAX_INT, why: str = "positions are int64") -> int:
    """``value`` checked as an int (not a bool) in [minimum, maximum]; the error names ``name``, the value
    and the allowed range."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r:.40} ({type(value).__name__})")
    hi = "2**62" if maximum == MAX_INT else _big(maximum)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum} (an int in [{_big(minimum)}, {hi}]), got {_big(value)}")
    if value > maximum:
        raise ValueError(f"{name} must be <= {hi} (an int in [{_big(minimum)}, {hi}]; {why}), got {_big(value)}")
    return value


def _index(x):
    """An integer-like value (int, numpy integer, 0-d integer tensor) as an int; anything else unchanged,
    for ``_check_int`` to refuse by name."""
    if isinstance(x, bool) or isinstance(x, int):
        return x
    try:
        return int(operator.index(x))
    except TypeError:
        return x


def _check_bool(name: str, value) -> bool:
    """``value`` checked as a bool: a string such as 'yes' or a 0/1 int is refused, naming ``name``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool (True or False), got {value!r:.40} ({type(value).__name__})")
    return value


def _check_lengths(name: str, lengths, allow_empty: bool = True) -> torch.Tensor:
    """Sequence lengths (a 1-D list or integer tensor, each in [0, 2**62]) -> int64 [n]; errors name
    ``name``, the offending entry and the allowed range, before any tensor is built from them."""
    if isinstance(lengths, torch.Tensor):
        if lengths.dim() != 1 or lengths.dtype.is_floating_point or lengths.dtype.is_complex \
                or lengths.dtype == torch.bool:
            raise ValueError(f"{name} must be a 1-D integer tensor or list, got {lengths!r:.60}")
        t = lengths.detach().to("cpu", torch.long)
        bad = ((t < 0) | (t > MAX_INT)).nonzero()
        if len(bad):
            b = int(bad[0])
            _check_int(f"{name}[{b}]", int(t[b]), 0, why="a length is a position count")
    else:
        try:
            items = list(lengths)
        except TypeError:
            raise ValueError(f"{name} must be a 1-D list or integer tensor of lengths, got "
                             f"{type(lengths).__name__}") from None
        for b, x in enumerate(items):
            x = _index(x)
            if isinstance(x, bool) or not isinstance(x, int):  # a nested list, a float: not 1-D integers
                raise ValueError(f"{name} must be a 1-D list of integer lengths, but {name}[{b}] is {x!r:.40} "
                                 f"({type(x).__name__})")
            items[b] = _check_int(f"{name}[{b}]", x, 0, why="a length is a position count")
        t = torch.tensor(items, dtype=torch.long)
    if not allow_empty and t.numel() == 0:
        raise ValueError(f"{name} must be a non-empty 1-D list of integer lengths, got {lengths!r:.80}")
    total = sum(t.tolist())  # in Python ints: an int64 sum could wrap
    if total > MAX_INT:
        raise ValueError(f"{name} must add up to at most 2**62 positions, got {_big(total)}")
    return t


_ALIGNS = ("top_left", "bottom_right")


def _check_align(align) -> str:
    if align not in _ALIGNS:
        raise ValueError(f"align must be 'top_left' or 'bottom_right', got {align!r}")
    return align


#: nnz's block grid when the pattern has no natural block shape, and the most blocks it builds
_NNZ_BLOCK, _NNZ_MAX_BLOCKS = 128, 1 << 20


def _strips(L: int, S: int):
    """Query index ranges [r] of about 4M pairs each (r x S), covering 0 .. L - 1."""
    rows = max(1, (1 << 22) // max(S, 1))
    return (torch.arange(r0, min(L, r0 + rows)) for r0 in range(0, L, rows))


def _diagonal_pairs(d: torch.Tensor, L: int, S: int) -> torch.Tensor:
    """How many pairs (i < L, j < S) of the grid lie on each diagonal j - i = d: int64, d's shape.

    Row i holds offset d when 0 <= i < L and 0 <= i + d < S, i.e. i in [max(0, -d), min(L, S - d))."""
    return (torch.clamp(S - d, max=L) - torch.clamp(-d, min=0)).clamp(min=0)


def _count_pairs(pattern: "Pattern", i: torch.Tensor, j: torch.Tensor, L: int, S: int) -> int:
    """Kept pairs of rows i [r] x columns j [c] (summed over the batch), in chunks of about 4M pairs."""
    rows = max(1, (1 << 22) // max(len(j), 1))
    return sum(pattern._count(i[r0:r0 + rows], j, L, S) for r0 in range(0, len(i), rows))


def _block_sizes(block_q, block_k) -> tuple[int, int]:
    """(block_q, block_k) checked as positive ints; block_k defaults to block_q (square blocks)."""
    block_k = block_q if block_k is None else block_k
    return _check_int("block_q", block_q, 1), _check_int("block_k", block_k, 1)


def _layout(any_: torch.Tensor, all_: torch.Tensor) -> torch.Tensor:
    """int8 block layout from per-block (any, all): EMPTY where nothing is kept, FULL where all is."""
    layout = torch.full(any_.shape, PARTIAL, dtype=torch.int8, device=any_.device)
    layout[~any_] = EMPTY
    layout[all_ & any_] = FULL
    return layout


class Pattern:
    """A structured mask: the predicate ``keep(i, j, L, S)`` over query positions i < L and key positions j < S.

    ``materialize(L, S)`` gives the bool mask [L, S] ([B, 1, L, S] for per-batch patterns, B =
    ``batch_size``) that ``attn_mask`` would take; ``block_layout`` gives int8 [ceil(L / block_q),
    ceil(S / block_k)] of EMPTY / PARTIAL / FULL, which the kernels use to skip and unmask blocks.

    Subclasses implement ``keep`` and, where they can, the analytic hooks below (``bounds``,
    ``block_shape``, ``band``, ``translation_invariant``); each hook's default answers "unknown", which
    is always correct and only slower. Everything else (``materialize``, ``block_layout``, ``nnz``,
    ``density``, ``flops``, ``&``, ``|``) is derived from them.
    """

    #: leading batch size for patterns that differ per batch element (key padding), else None
    batch_size: int | None = None
    #: True on global rows and columns (``blocks._Global``): read by ``_global_side``, which cannot import it
    _global_tokens = False

    def keep(self, i: torch.Tensor, j: torch.Tensor, L: int, S: int) -> torch.Tensor:
        """Whether query i may attend to key j in an L x S problem.

        i, j: int tensors of query and key positions that broadcast against each other (as
        ``[L, 1]`` and ``[1, S]``). Returns a bool tensor of their broadcast shape, with a leading
        ``[batch_size]`` dim when ``batch_size`` is set. True = the pair takes part.
        """
        raise NotImplementedError

    # -- analytic hooks (public: the kernels and nn plan with them) --------------------------------
    def bounds(self, qlo: torch.Tensor, qhi: torch.Tensor, klo: torch.Tensor, khi: torch.Tensor,
               L: int, S: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(any, all) for the blocks of rows [qlo, qhi] x columns [klo, khi] (inclusive), or None if unknown.

        qlo, qhi: int64 ``[nq, 1]`` first and last query row of each block, 0 <= qlo <= qhi < L;
        klo, khi: int64 ``[1, nk]`` first and last key column, 0 <= klo <= khi < S (any shapes that
        broadcast work; ``block_layout`` passes a regular grid with the last block clipped).
        Returns two bool tensors broadcastable to ``[nq, nk]``.

        Contract (conservative, so a caller may skip or unmask work on it): ``any`` False means no pair
        of the block is kept (the block is EMPTY); ``all`` True means every pair is kept (FULL). Both may
        err only on the safe side (``any`` True on an empty block, ``all`` False on a full one). For
        per-batch patterns ``any`` is over the union of the batch and ``all`` over its intersection.
        """
        return None

    def block_shape(self) -> tuple[int, int] | None:
        """(block_q, block_k) at which this pattern's block layout is exact and sparse, when it has one
        (a block table's own block; the fixed pattern's block by its summary's alignment), else None."""
        return None

    def band(self, L: int, S: int) -> tuple[float, float] | None:
        """(lo, hi) when, for this (L, S), the pattern keeps exactly the pairs with lo <= j - i <= hi, else None.

        Alignment is folded in (``causal("bottom_right")`` gives ``(-inf, S - L)``); a side may be
        +-inf; lo > hi means no pair is kept. A band lets a kernel count a query block's keys in O(1).
        """
        return None

    def translation_invariant(self) -> bool:
        """True when, for each (L, S), ``keep(i, j)`` is known to depend on j - i only (bands and their
        ``&`` / ``|``), so one mask block serves every block on the same diagonal. False = not known."""
        return False

    # -- derived ---------------------------------------------------------------------------------
    def materialize(self, L: int, S: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Bool mask [L, S] (or [batch, 1, L, S] for per-batch patterns), True = takes part."""
        i = torch.arange(L, device=device).unsqueeze(-1)  # (L, 1)
        j = torch.arange(S, device=device).unsqueeze(0)  # (1, S)
        m = self.keep(i, j, L, S)
        m = torch.broadcast_to(m, ((self.batch_size,) if self.batch_size else ()) + (L, S))
        return m.unsqueeze(1) if self.batch_size else m

    def block_layout(self, L: int, S: int, block_q: int, block_k: int | None = None,
                     device: torch.device | str | None = None) -> torch.Tensor:
        """int8 [ceil(L/block_q), ceil(S/block_k)]: EMPTY (0), PARTIAL (1) or FULL (2) per block.

        The last row and column of blocks are clipped to L and S. From ``bounds`` in O(blocks) when the
        pattern has them, else by materialising one strip of query blocks at a time (O(L·S) work,
        about 4M pairs of memory). Conservative as ``bounds`` is: PARTIAL is always a correct answer.
        """
        block_q, block_k = _block_sizes(block_q, block_k)
        b = self._bounds_on_grid(L, S, block_q, block_k, device)
        any_, all_ = self._exact_bounds(L, S, block_q, block_k, device) if b is None else b
        return _layout(any_, all_)

    def _bounds_on_grid(self, L, S, block_q, block_k, device=None):
        """``bounds`` over the regular grid of (block_q x block_k) blocks, as bool [nq, nk] each, or None."""
        nq, nk = -(-L // block_q), -(-S // block_k)
        qlo = (torch.arange(nq, device=device) * block_q).unsqueeze(1)  # (nq, 1)
        klo = (torch.arange(nk, device=device) * block_k).unsqueeze(0)  # (1, nk)
        qhi = torch.clamp(qlo + block_q - 1, max=L - 1)
        khi = torch.clamp(klo + block_k - 1, max=S - 1)
        b = self.bounds(qlo, qhi, klo, khi, L, S)
        return None if b is None else tuple(torch.broadcast_to(x, (nq, nk)) for x in b)

    def nonempty_blocks(self, L: int, S: int, block_q: int, block_k: int | None = None) -> int:
        """How many (block_q x block_k) blocks of the L x S grid ``block_layout`` marks non-EMPTY: the
        blocks a block-skipping kernel visits.

        For a band (``band(L, S)`` not None: causal, windows, their ``&``) it is counted in O(L / block_q)
        from each query block's key range, without building the [nq, nk] layout (which cost 0.3-0.7 s
        per call at n = 16384 when a planner tried several block shapes); otherwise from the layout.
        """
        block_q, block_k = _block_sizes(block_q, block_k)
        band = self.band(L, S)
        if band is None:
            return int((self.block_layout(L, S, block_q, block_k) != EMPTY).sum())
        lo, hi = band
        if lo > hi:  # an empty band (e.g. the & of two that do not meet): per-row ranges are all empty
            return 0
        q0 = torch.arange(0, L, block_q, dtype=torch.float64)  # (nq,) first row of each query block
        q1 = torch.clamp(q0 + block_q - 1, max=L - 1)
        first = torch.clamp(q0 + lo, min=0)  # first and last key any row of the block keeps
        last = torch.clamp(q1 + hi, max=S - 1)
        n = torch.floor(last / block_k) - torch.floor(first / block_k) + 1
        return int(torch.where(last >= first, n, torch.zeros_like(n)).sum())

    def _exact_bounds(self, L, S, block_q, block_k, device):
        """Any/all per block by materialising one band of query blocks at a time (O(L*S) work)."""
        nq, nk = -(-L // block_q), -(-S // block_k)
        any_ = torch.zeros(nq, nk, dtype=torch.bool, device=device)
        all_ = torch.zeros(nq, nk, dtype=torch.bool, device=device)
        j = torch.arange(nk * block_k, device=device)
        j_valid = j < S
        rows = max(1, (1 << 22) // max(1, nk * block_k * block_q))
        for q0 in range(0, nq, rows):
            q1 = min(nq, q0 + rows)
            i = torch.arange(q0 * block_q, q1 * block_q, device=device)
            i_valid = (i < L).unsqueeze(-1)
            m = self.keep(i.clamp(max=max(L - 1, 0)).unsqueeze(-1), j.clamp(max=max(S - 1, 0)).unsqueeze(0), L, S)
            if self.batch_size:
                m_any, m_all = m.any(0), m.all(0)
            else:
                m_any = m_all = torch.broadcast_to(m, (i.numel(), j.numel()))
            valid = i_valid & j_valid.unsqueeze(0)
            a = (m_any & valid).view(q1 - q0, block_q, nk, block_k)
            f = (m_all | ~valid).view(q1 - q0, block_q, nk, block_k)
            any_[q0:q1] = a.any(3).any(1)
            all_[q0:q1] = f.all(3).all(1)
        return any_, all_

    def dead_keys(self, L: int, S: int) -> torch.Tensor:
        """Bool [B|1, S] (B = ``batch_size`` for per-batch patterns): True where no query i < L keeps key j.
        Exact, never conservative: ``attnlab.attention`` never reads such a key (Note [Dead keys] in
        ``attnlab.shapes``), so a wrong True would drop a live key.

        A band (causal, windows, their ``&``) answers in O(1): its live keys are one range. Other
        translation-invariant patterns (dilated, strided) evaluate ``keep`` once per offset j - i, O(L + S).
        Otherwise from ``bounds`` on a block grid: a column of EMPTY blocks is dead, a column with a FULL
        block is live, and only the PARTIAL blocks of the remaining columns are evaluated (without bounds:
        every pair, in strips of about 4M pairs).
        """
        B = self.batch_size or 1
        if L <= 0 or S <= 0:
            return torch.ones(B, max(S, 0), dtype=torch.bool)
        band = self.band(L, S)
        if band is not None:
            lo, hi = band
            first, last = max(0.0, lo), min(S - 1.0, L - 1.0 + hi)  # keys some row i in [0, L) keeps
            dead = torch.ones(1, S, dtype=torch.bool)
            if lo <= hi and first <= last:
                dead[:, math.ceil(first):math.floor(last) + 1] = False
            return dead
        if self.translation_invariant() and not self.batch_size:
            d = torch.arange(-(L - 1), S)  # (L + S - 1,): every offset j - i of the grid
            i = (-d).clamp(min=0)  # one (i, j) pair per offset, inside the grid
            f = torch.broadcast_to(self.keep(i, i + d, L, S), d.shape)
            c = torch.nn.functional.pad(f.to(torch.int64).cumsum(0), (1, 0))  # (L + S,)
            return ~(c[L:L + S] - c[:S] > 0).unsqueeze(0)  # key j is seen from offsets j - L + 1 .. j
        return self._dead_by_blocks(L, S)

    def _dead_by_blocks(self, L: int, S: int) -> torch.Tensor:
        """``dead_keys`` from block bounds, evaluating only undecided columns' PARTIAL blocks."""
        B = self.batch_size or 1
        bq, bk = self.block_shape() or (_NNZ_BLOCK, _NNZ_BLOCK)
        if -(-L // bq) * -(-S // bk) > _NNZ_MAX_BLOCKS:
            bq = bk = _NNZ_BLOCK
        b = self._bounds_on_grid(L, S, bq, bk)
        j_all = torch.arange(S)
        if b is None:
            alive = torch.zeros(B, S, dtype=torch.bool)
            for i in _strips(L, S):
                alive |= self._keeps(i, j_all, L, S).any(-2)
            return ~alive
        any_, all_ = b  # (nq, nk): union and intersection over the batch
        empty, full = ~any_.any(0), (any_ & all_).any(0)  # (nk,): no block keeps / some block keeps all
        dead = empty[j_all // bk].unsqueeze(0).expand(B, S).clone()
        open_cols = (~empty & ~full).nonzero().view(-1)  # (m,) columns that only PARTIAL blocks decide
        if not open_cols.numel():
            return dead
        # every PARTIAL block of those columns in one vectorised keep per chunk (a loop per column called a
        # document mask_mod 64 times: 97 ms of a first flex_attention call at L = S = 16384)
        blocks = any_[:, open_cols].nonzero()  # (np, 2): query block, index into open_cols
        kbs = open_cols[blocks[:, 1]]
        seen = torch.zeros(B, S, dtype=torch.int32)  # kept pairs per key (over the open columns' blocks)
        chunk = max(1, (1 << 22) // (bq * bk))
        for c0 in range(0, len(blocks), chunk):
            qb, kb = blocks[c0:c0 + chunk, 0], kbs[c0:c0 + chunk]
            # rows past L repeat the last one (any() is unchanged); keys past S are dropped below
            i = (qb.view(-1, 1) * bq + torch.arange(bq)).clamp(max=L - 1).unsqueeze(-1)  # (C, bq, 1)
            j = kb.view(-1, 1) * bk + torch.arange(bk)  # (C, bk)
            m = self.keep(i, j.clamp(max=S - 1).unsqueeze(1), L, S)
            m = torch.broadcast_to(m, ((self.batch_size,) if self.batch_size else (1,)) + (len(qb), bq, bk))
            a = m.any(-2).to(torch.int32).reshape(m.shape[0], -1)  # (B|1, C·bk)
            inside = (j < S).view(-1)
            seen.index_add_(1, j.view(-1)[inside], a[:, inside].expand(B, -1).contiguous())
        cols = (open_cols.view(-1, 1) * bk + torch.arange(bk)).view(-1)
        cols = cols[cols < S]
        dead[:, cols] = seen[:, cols] == 0
        return dead

    def _keeps(self, i: torch.Tensor, j: torch.Tensor, L: int, S: int) -> torch.Tensor:
        """keep of rows i [r] x columns j [c] as bool [B|1, r, c]."""
        m = self.keep(i.unsqueeze(-1), j.unsqueeze(0), L, S)
        return torch.broadcast_to(m, ((self.batch_size,) if self.batch_size else (1,)) + (len(i), len(j)))

    def nnz(self, L: int, S: int) -> int:
        """Number of (query, key) pairs kept in the L x S grid (per batch element, averaged for per-batch
        patterns).

        Bands, block tables, prefix LM, documents, the fixed pattern and Longformer count analytically
        (O(L) or O(blocks)); other translation-invariant patterns (dilated, strided) evaluate ``keep``
        once per diagonal j - i and weigh it by the diagonal's length, O(L + S). Otherwise, when the
        pattern has ``bounds``, FULL blocks of a block grid count their area and only PARTIAL blocks
        are evaluated; without bounds every pair is evaluated, in strips of about 4M pairs (O(L·S)).
        ``counts_analytically()`` says which of these a pattern gets.
        """
        if L <= 0 or S <= 0:
            return 0
        if self.translation_invariant() and not self.batch_size:
            d = torch.arange(-(L - 1), S)  # (L + S - 1,): every offset j - i of the grid
            i = (-d).clamp(min=0)  # one (i, j) pair per offset, inside the grid
            kept = torch.broadcast_to(self.keep(i, i + d, L, S), d.shape)
            return int(_diagonal_pairs(d, L, S)[kept].sum())
        B = self.batch_size or 1
        bq, bk = self.block_shape() or (_NNZ_BLOCK, _NNZ_BLOCK)
        if -(-L // bq) * -(-S // bk) > _NNZ_MAX_BLOCKS:  # a very fine natural block: use a coarser grid
            bq = bk = _NNZ_BLOCK
        b = self._bounds_on_grid(L, S, bq, bk)
        if b is None:
            return int(round(sum(self._count(i, torch.arange(S), L, S) for i in _strips(L, S)) / B))
        any_, all_ = b
        rows = torch.clamp(L - torch.arange(any_.shape[0], dtype=torch.float64) * bq, max=bq)  # (nq,) clipped
        cols = torch.clamp(S - torch.arange(any_.shape[1], dtype=torch.float64) * bk, max=bk)  # (nk,)
        total = float(rows @ (any_ & all_).to(torch.float64) @ cols) * B  # FULL blocks, every batch element
        partial = any_ & ~all_
        for x in partial.any(1).nonzero().view(-1).tolist():
            i = torch.arange(x * bq, min(L, x * bq + bq))
            j = (partial[x].nonzero() * bk + torch.arange(bk)).view(-1)  # the row's PARTIAL key blocks
            total += self._count(i, j[j < S], L, S)
        return int(round(total / B))

    def _count(self, i: torch.Tensor, j: torch.Tensor, L: int, S: int) -> int:
        """Kept pairs of rows i [r] x columns j [c], summed over the batch for per-batch patterns."""
        m = self.keep(i.unsqueeze(-1), j.unsqueeze(0), L, S)
        # a keep that ignores i (or j) may return a narrower shape: count the full grid it stands for
        return int(torch.broadcast_to(m, ((self.batch_size,) if self.batch_size else ()) + (len(i), len(j))).sum())

    def counts_analytically(self) -> bool:
        """True when ``nnz`` (and so ``density`` and ``flops``) never evaluates the L·S pairs one by one:
        a closed form, O(L + S) or O(blocks). False means it may (a pattern with bounds evaluates its
        PARTIAL blocks, one without every pair): correct, only slow on large grids."""
        return self.translation_invariant() and not self.batch_size

    def density(self, L: int, S: int) -> float:
        """Fraction of the L x S pairs that take part, ``nnz(L, S) / (L·S)`` (0 for an empty grid)."""
        return self.nnz(L, S) / max(1, L * S)

    def flops(self, L: int, S: int, E: int, Ev: int | None = None) -> int:
        """FLOPs of exact attention restricted to the pattern, ``2·nnz·(E + Ev)``: one multiply-add per kept
        pair for the score (head dim E) and one per value feature (Ev, default E)."""
        Ev = E if Ev is None else Ev
        return 2 * self.nnz(L, S) * (E + Ev)

    def __and__(self, other: "Pattern") -> "Pattern":
        return _Combine("and", self, _as_pattern(other))

    def __or__(self, other: "Pattern") -> "Pattern":
        return _Combine("or", self, _as_pattern(other))


def _as_pattern(p) -> Pattern:
    if not isinstance(p, Pattern):
        raise TypeError(f"can only combine a Pattern with another Pattern, got {type(p).__name__}")
    return p


@dataclass(frozen=True, eq=False)
class _Combine(Pattern):
    op: str
    a: Pattern
    b: Pattern

    def __post_init__(self):
        ba, bb = self.a.batch_size, self.b.batch_size
        if ba and bb and ba != bb:
            raise ValueError(f"cannot combine patterns for batch sizes {ba} and {bb}")

    @property
    def batch_size(self):  # type: ignore[override]
        return self.a.batch_size or self.b.batch_size

    def keep(self, i, j, L, S):
        x, y = self.a.keep(i, j, L, S), self.b.keep(i, j, L, S)
        return (x & y) if self.op == "and" else (x | y)

    def bounds(self, qlo, qhi, klo, khi, L, S):
        ba = self.a.bounds(qlo, qhi, klo, khi, L, S)
        bb = self.b.bounds(qlo, qhi, klo, khi, L, S)
        if ba is None or bb is None:
            return None
        if self.op == "and":
            # any(a & b) is at most any(a) & any(b): conservative (PARTIAL where it over-approximates)
            return ba[0] & bb[0], ba[1] & bb[1]
        return ba[0] | bb[0], ba[1] | bb[1]

    def translation_invariant(self):
        return self.a.translation_invariant() and self.b.translation_invariant()

    def dead_keys(self, L, S):
        # exact from the parts where it can be: a key is dead in a | b iff dead in both; in a & b with a
        # side that keeps by key alone (key padding), iff dead in either. Else the general rules.
        if self.op == "or":
            return self.a.dead_keys(L, S) & self.b.dead_keys(L, S)
        if getattr(self.a, "by_key", False) or getattr(self.b, "by_key", False):
            return self.a.dead_keys(L, S) | self.b.dead_keys(L, S)
        return super().dead_keys(L, S)

    def _global_side(self):
        """(other, global) when this is ``other | global rows and columns`` (Longformer), else None."""
        if self.op != "or" or self.batch_size:
            return None
        if self.b._global_tokens:
            return self.a, self.b
        return (self.b, self.a) if self.a._global_tokens else None

    def nnz(self, L, S):
        """As ``Pattern.nnz``; ``x | global`` (Longformer) by inclusion-exclusion: nnz(x) + nnz(global)
        minus the pairs of x on the global rows and columns, O(g·(L + S)) for g global tokens."""
        parts = self._global_side()
        if parts is None or L <= 0 or S <= 0:
            return super().nnz(L, S)
        other, glob = parts
        t = torch.tensor(glob.tokens, dtype=torch.long)
        tq, tk = t[t < L], t[t < S]  # the global rows and columns inside this grid
        shared = (_count_pairs(other, tq, torch.arange(S), L, S) + _count_pairs(other, torch.arange(L), tk, L, S)
                  - _count_pairs(other, tq, tk, L, S))
        return other.nnz(L, S) + glob.nnz(L, S) - shared

    def counts_analytically(self):
        parts = self._global_side()
        if parts is not None:
            return parts[0].counts_analytically()
        return super().counts_analytically()

    def band(self, L, S):
        ba, bb = self.a.band(L, S), self.b.band(L, S)
        if ba is None or bb is None:
            return None
        (lo_a, hi_a), (lo_b, hi_b) = ba, bb
        if self.op == "and":
            return max(lo_a, lo_b), min(hi_a, hi_b)
        if lo_a > hi_a or lo_b > hi_b:  # an empty side adds nothing to the union
            return bb if lo_a > hi_a else ba
        # two integer ranges form one range when they overlap or touch; else the union has a gap
        if lo_b > hi_a + 1 or lo_a > hi_b + 1:
            return None
        return min(lo_a, lo_b), max(hi_a, hi_b)

    def __repr__(self):
        return f"({self.a!r} {'&' if self.op == 'and' else '|'} {self.b!r})"


@dataclass(frozen=True, eq=False)
class _Shifted(Pattern):
    inner: Pattern
    offset: int

    @property
    def batch_size(self):  # type: ignore[override]
        return self.inner.batch_size

    def _check(self, L, S):
        if L + self.offset > S:
            raise ValueError(f"{self!r}: query rows {self.offset} .. {self.offset + L - 1} lie outside the "
                             f"{S} x {S} square (need L + offset <= S, got L={L}, S={S})")

    def keep(self, i, j, L, S):
        self._check(L, S)
        return self.inner.keep(i + self.offset, j, S, S)

    def bounds(self, qlo, qhi, klo, khi, L, S):
        self._check(L, S)
        return self.inner.bounds(qlo + self.offset, qhi + self.offset, klo, khi, S, S)

    def band(self, L, S):
        b = self.inner.band(S, S)
        return None if b is None else (b[0] + self.offset, b[1] + self.offset)

    def translation_invariant(self):
        return self.inner.translation_invariant()

    def __repr__(self):
        return f"shifted({self.inner!r}, offset={self.offset})"


def shifted(pattern: Pattern, offset: int) -> Pattern:
    """``pattern`` as seen from query rows ``offset .. offset + L - 1`` of the full S x S square.

    Under a KV cache the L new queries are the last rows of the sequence (offset = S - L) and patterns
    are defined over absolute positions, so query row i here is row i + offset there:
    ``shifted(p, off).materialize(L, S)`` equals ``p.materialize(S, S)[..., off:off + L, :]``
    (mask [L, S], or [batch, 1, L, S] for per-batch patterns). Bounds, band and batch size carry over.
    """
    _as_pattern(pattern)
    _check_int("offset", offset, 0)
    return _Shifted(pattern, offset)


def translation_invariant(pattern: Pattern | None) -> bool:
    """True when ``pattern`` is None (no mask) or, for each (L, S), is known to keep (i, j) by j - i
    alone, so one mask block serves every block on a diagonal (see ``Pattern.translation_invariant``)."""
    return pattern is None or pattern.translation_invariant()


@dataclass(frozen=True, eq=False)
class _KeySlice(Pattern):
    inner: Pattern
    start: int
    S_full: int

    @property
    def batch_size(self):  # type: ignore[override]
        return self.inner.batch_size

    @property
    def by_key(self) -> bool:
        """Keeps by key alone when the inner pattern does (key padding)."""
        return bool(getattr(self.inner, "by_key", False))

    def key_mask(self, S: int) -> torch.Tensor:
        """The inner key-padding mask over the sliced keys, bool [B, S] (inner patterns that keep by key)."""
        return self.inner.key_mask(self.S_full)[:, self.start:self.start + S]

    def keep(self, i, j, L, S):
        return self.inner.keep(i, j + self.start, L, self.S_full)

    def bounds(self, qlo, qhi, klo, khi, L, S):
        return self.inner.bounds(qlo, qhi, klo + self.start, khi + self.start, L, self.S_full)

    def band(self, L, S):
        b = self.inner.band(L, self.S_full)
        return None if b is None else (b[0] - self.start, b[1] - self.start)

    def translation_invariant(self):
        return self.inner.translation_invariant()

    def block_shape(self):
        shape = self.inner.block_shape()
        return shape if shape is not None and self.start % shape[1] == 0 else None

    def block_layout(self, L, S, block_q, block_k=None, device=None):
        """As ``Pattern.block_layout``; a pattern without bounds whose own layout is cached (a mask_mod)
        lends its layout's columns when the slice starts on a key block (conservative on the last one)."""
        block_q, block_k = _block_sizes(block_q, block_k)
        b = self._bounds_on_grid(L, S, block_q, block_k, device)
        if b is None and self.start % block_k == 0:
            k0 = self.start // block_k
            lay = self.inner.block_layout(L, self.S_full, block_q, block_k, device=device)
            return lay[:, k0:k0 + -(-S // block_k)].clone()
        any_, all_ = self._exact_bounds(L, S, block_q, block_k, device) if b is None else b
        return _layout(any_, all_)

    def dead_keys(self, L, S):
        return self.inner.dead_keys(L, self.S_full)[:, self.start:self.start + S]

    def __repr__(self):
        return f"sliced_keys({self.inner!r}, start={self.start}, S={self.S_full})"


def sliced_keys(pattern: Pattern, start: int, S: int) -> Pattern:
    """``pattern`` over keys ``start .. start + S' - 1`` of an L x ``S`` problem, for any S' <= S - start:
    ``sliced_keys(p, start, S).materialize(L, S')`` equals ``p.materialize(L, S)[..., start:start + S']``.

    ``attnlab.attention`` runs on the live key range this way when a pattern leaves a prefix or suffix of
    keys dead (Note [Dead keys] in ``attnlab.shapes``). Bounds, band and batch size carry over, shifted.
    """
    _as_pattern(pattern)
    _check_int("start", start, 0)
    _check_int("S", S, start)
    return _KeySlice(pattern, start, S)
