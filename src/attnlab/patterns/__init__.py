"""Structured attention masks that materialise themselves, give a block layout and cost themselves.

A pattern is a predicate ``keep(i, j)`` over query positions i and key positions j (True = the pair
takes part), valid for any (L, S) without rebuilding. Passing ``pattern=p`` to ``attnlab.attention``
gives exactly what passing ``attn_mask=p.materialize(L, S)`` gives, but the kernels use
``block_layout`` to skip empty blocks and to drop the mask on full ones.

Block layouts are *conservative*: EMPTY blocks are truly empty and FULL blocks truly full; anything the
analytic bounds cannot decide is PARTIAL (computed with its mask), which is always correct.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

__all__ = [
    "Pattern", "BlockTable", "EMPTY", "PARTIAL", "FULL", "shifted", "translation_invariant",
    "causal", "sliding_window", "dilated", "strided", "fixed", "block_sparse", "longformer", "bigbird",
    "key_padding", "from_key_padding_mask", "from_hf_attention_mask", "full", "parse",
    "document", "prefix_lm", "from_mask_mod",
]

EMPTY, PARTIAL, FULL = 0, 1, 2
_INF = float("inf")


#: the largest size or offset a pattern takes: positions are int64 tensors, and a bound past any length
#: a tensor can have changes nothing
MAX_INT = 2**62


def _check_int(name: str, value, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if value > MAX_INT:
        raise ValueError(f"{name} must be <= 2**62 (positions are int64), got {value:.3g}")
    return value


class Pattern:
    """A structured mask: the predicate ``keep(i, j, L, S)`` over query positions i < L and key positions j < S.

    Subclasses implement ``keep`` and, where they can, the analytic hooks below (``bounds``,
    ``block_shape``, ``band``, ``translation_invariant``); each hook's default answers "unknown", which
    is always correct and only slower. Everything else (``materialize``, ``block_layout``, ``nnz``,
    ``density``, ``flops``, ``&``, ``|``) is derived from them.
    """

    #: leading batch size for patterns that differ per batch element (key padding), else None
    batch_size: int | None = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # A subclass written against the old private hook (before session 18 it was ``_bounds``) still
        # gets its analytic bounds used: route the public name to it.
        if "_bounds" in cls.__dict__ and "bounds" not in cls.__dict__:
            cls.bounds = cls.__dict__["_bounds"]

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

    # Old private names, kept while callers move to the public ones (session 18); do not use in new code.
    def _bounds(self, qlo, qhi, klo, khi, L, S):
        return self.bounds(qlo, qhi, klo, khi, L, S)

    def _block_shape(self):
        return self.block_shape()

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
        """int8 [ceil(L/block_q), ceil(S/block_k)]: EMPTY (0), PARTIAL (1) or FULL (2) per block."""
        block_k = block_q if block_k is None else block_k
        _check_int("block_q", block_q, 1)
        _check_int("block_k", block_k, 1)
        nq, nk = -(-L // block_q), -(-S // block_k)
        qlo = (torch.arange(nq, device=device) * block_q).unsqueeze(1)  # (nq, 1)
        klo = (torch.arange(nk, device=device) * block_k).unsqueeze(0)  # (1, nk)
        qhi = torch.clamp(qlo + block_q - 1, max=L - 1)
        khi = torch.clamp(klo + block_k - 1, max=S - 1)
        b = self.bounds(qlo, qhi, klo, khi, L, S)
        if b is None:
            any_, all_ = self._exact_bounds(L, S, block_q, block_k, device)
        else:
            any_, all_ = (torch.broadcast_to(x, (nq, nk)) for x in b)
        layout = torch.full((nq, nk), PARTIAL, dtype=torch.int8, device=device)
        layout[~any_] = EMPTY
        layout[all_ & any_] = FULL
        return layout

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

    def nnz(self, L: int, S: int) -> int:
        """Number of (query, key) pairs kept (per batch element, averaged for per-batch patterns)."""
        total, rows = 0, max(1, (1 << 22) // max(S, 1))
        j = torch.arange(S).unsqueeze(0)
        for r0 in range(0, L, rows):
            i = torch.arange(r0, min(L, r0 + rows)).unsqueeze(-1)
            m = torch.broadcast_to(self.keep(i, j, L, S), ((self.batch_size,) if self.batch_size else ()) + (i.shape[0], S))
            total += int(m.sum()) / (self.batch_size or 1)
        return int(round(total))

    def density(self, L: int, S: int) -> float:
        """Fraction of the L x S pairs that take part."""
        return self.nnz(L, S) / max(1, L * S)

    def flops(self, L: int, S: int, E: int, Ev: int | None = None) -> int:
        """Multiply-add FLOPs of exact attention restricted to the pattern (2·nnz·(E + Ev))."""
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
class _Band(Pattern):
    """Keep j - i (after alignment) within [lo, hi]; the shared core of causal and windows."""

    lo: float = -_INF
    hi: float = _INF
    align: str = "top_left"
    name: str = "band"

    def _offset(self, L, S):
        return (S - L) if self.align == "bottom_right" else 0

    def band(self, L, S):
        off = self._offset(L, S)
        return self.lo + off, self.hi + off

    def translation_invariant(self):
        return True

    def keep(self, i, j, L, S):
        lo, hi = self.band(L, S)
        d = j - i
        return (d >= lo) & (d <= hi)

    def nnz(self, L: int, S: int) -> int:
        """Kept pairs counted per row in O(L): keys [i + lo, i + hi] clipped to [0, S)."""
        return _band_nnz(*self.band(L, S), L, S)

    def bounds(self, qlo, qhi, klo, khi, L, S):
        return _band_bounds(*self.band(L, S), qlo, qhi, klo, khi)

    def __repr__(self):
        return self.name


def _band_nnz(lo: float, hi: float, L: int, S: int) -> int:
    """Pairs (i < L, j < S) with lo <= j - i <= hi, counted per row in O(L)."""
    i = torch.arange(L, dtype=torch.float64)
    first = torch.clamp(i + lo, min=0)
    last = torch.clamp(i + hi, max=S - 1)
    return int((last - first + 1).clamp(min=0).sum())


def _band_bounds(lo: float, hi: float, qlo: torch.Tensor, qhi: torch.Tensor, klo: torch.Tensor,
                khi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact (any, all) of the band lo <= j - i <= hi over blocks [qlo, qhi] x [klo, khi] (as ``Pattern.bounds``).

    Within a block j - i takes every integer in [klo - qhi, khi - qlo], so the block meets the band
    exactly when that range meets [lo, hi], and lies inside it exactly when the range does.
    """
    dmin, dmax = klo - qhi, khi - qlo
    return (dmax >= lo) & (dmin <= hi), (dmin >= lo) & (dmax <= hi)


def full() -> Pattern:
    """Every pair takes part (the identity for &)."""
    return _Band(name="full()")


def causal(align: str = "top_left") -> Pattern:
    """Key j visible to query i when j <= i (top_left, PyTorch's is_causal) or j <= i + S - L
    (bottom_right, the KV-cache convention)."""
    if align not in ("top_left", "bottom_right"):
        raise ValueError(f"align must be 'top_left' or 'bottom_right', got {align!r}")
    return _Band(hi=0, align=align, name=f"causal(align={align!r})")


def sliding_window(window: int | None = None, causal: bool = False, align: str = "top_left", *,
                   left: int | None = None, right: int | None = None) -> Pattern:
    """Local attention (Beltagy et al. 2020; Child et al. 2019), in one of two spellings.

    ``sliding_window(window, causal=False)``: keys within ``window`` positions on each side of the
    query; with ``causal=True`` the query's own token and the ``window`` previous ones.

    ``sliding_window(left=l, right=r)`` (keyword-only), as flash-attn's ``window_size=(l, r)`` and
    xformers' local masks write it: key j visible to query i when ``i - l <= j <= i + r``.
    ``sliding_window(window=w)`` is ``left=w, right=w``; ``causal=True`` is ``left=w, right=0``.
    Any l, r with ``l + r >= 0`` is allowed, including ``l < r`` (look ahead further than back) and a
    negative side, which makes an offset window: ``left=-2, right=5`` keeps keys i+2 .. i+5.
    An unbounded side is ``None`` (flash-attn writes it as -1; here -1 is the offset "one past i").

    ``align="bottom_right"`` shifts i by S - L (the KV-cache convention, like ``causal``).
    """
    if align not in ("top_left", "bottom_right"):
        raise ValueError(f"align must be 'top_left' or 'bottom_right', got {align!r}")
    if left is None and right is None:
        if window is None:
            raise ValueError("sliding_window needs window=, or left= and/or right= (None = unbounded side); "
                             "for no window at all use patterns.full()")
        _check_int("window", window, 0)
        name = f"sliding_window({window}, causal={causal}" + (f", align={align!r})" if align != "top_left" else ")")
        return _Band(lo=-window, hi=0 if causal else window, align=align, name=name)
    if window is not None:
        raise ValueError(f"sliding_window: give either window={window} or left=/right=, not both")
    if causal:
        raise ValueError("sliding_window: causal=True goes with window=; with left=/right= write right=0")
    for nm, v in (("left", left), ("right", right)):
        if v is not None:
            _check_int(nm, v, -(2**62))
    if left is not None and right is not None and left + right < 0:
        raise ValueError(f"sliding_window: left={left}, right={right} keeps no key (need left + right >= 0: "
                         f"keys i - left .. i + right); an unbounded side is None, not -1")
    lo = -_INF if left is None else -left
    hi = _INF if right is None else right
    name = f"sliding_window(left={left}, right={right}" + (f", align={align!r})" if align != "top_left" else ")")
    return _Band(lo=lo, hi=hi, align=align, name=name)


@dataclass(frozen=True, eq=False)
class _Dilated(Pattern):
    window: int
    dilation: int
    causal: bool

    def _limits(self):
        # the window's reach in positions: j - i in [lo, hi], then only every dilation-th of those
        reach = self.window * self.dilation
        return -reach, 0 if self.causal else reach

    def keep(self, i, j, L, S):
        lo, hi = self._limits()
        d = j - i
        return (d >= lo) & (d <= hi) & (torch.remainder(d, self.dilation) == 0)

    def bounds(self, qlo, qhi, klo, khi, L, S):
        any_, all_ = _band_bounds(*self._limits(), qlo, qhi, klo, khi)
        return any_, all_ & (self.dilation == 1)

    def __repr__(self):
        return f"dilated({self.window}, {self.dilation}, causal={self.causal})"


def dilated(window: int, dilation: int, causal: bool = False) -> Pattern:
    """Dilated window: ``window`` keys on each side, ``dilation`` apart (Beltagy et al. 2020)."""
    _check_int("window", window, 0)
    _check_int("dilation", dilation, 1)
    return _Dilated(window, dilation, causal)


@dataclass(frozen=True, eq=False)
class _Strided(Pattern):
    stride: int
    causal: bool

    def keep(self, i, j, L, S):
        d = i - j
        local = d.abs() < self.stride
        column = torch.remainder(d, self.stride) == 0
        m = local | column
        return m & (d >= 0) if self.causal else m

    def bounds(self, qlo, qhi, klo, khi, L, S):
        if not self.causal:
            return None
        any_, all_ = _band_bounds(-_INF, 0, qlo, qhi, klo, khi)
        return any_, all_ & (self.stride == 1)

    def __repr__(self):
        return f"strided({self.stride}, causal={self.causal})"


def strided(stride: int, causal: bool = True) -> Pattern:
    """Sparse Transformer strided pattern (Child et al. 2019): the previous ``stride`` tokens plus
    every ``stride``-th token before them."""
    _check_int("stride", stride, 1)
    return _Strided(stride, causal)


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

    def block_shape(self):
        # a query block per fixed block; key blocks as wide as the summary's alignment, so own-block and
        # summary keys fall in separate key blocks and the rest are empty
        return self.block, math.gcd(self.block, self.summary)

    def __repr__(self):
        return f"fixed({self.block}, {self.summary}, causal={self.causal})"


def fixed(block: int, summary: int, causal: bool = True) -> Pattern:
    """Sparse Transformer fixed pattern (Child et al. 2019): each token sees its own block of
    ``block`` tokens plus the last ``summary`` positions of every block."""
    _check_int("block", block, 1)
    _check_int("summary", summary, 0)
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

    def nnz(self, L: int, S: int) -> int:
        """Kept pairs from the table in O(cells): each kept cell counts its rows x columns inside L x S."""
        bs = self.block_size
        nq, nk = -(-L // bs), -(-S // bs)
        rows = torch.clamp(L - torch.arange(nq, dtype=torch.float64) * bs, max=bs)
        cols = torch.clamp(S - torch.arange(nk, dtype=torch.float64) * bs, max=bs)
        return int(rows @ self.table(nq, nk, "cpu").to(torch.float64) @ cols) if nq and nk else 0

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
    """Keep the (block_size x block_size) blocks where ``layout`` [n_query_blocks, n_key_blocks] is True."""
    _check_int("block_size", block_size, 1)
    if not isinstance(layout, torch.Tensor) or layout.dim() != 2:
        raise ValueError(f"layout must be a 2-D tensor [n_query_blocks, n_key_blocks], got {layout!r:.60}")
    return _Layout(block_size=block_size, name=f"block_sparse({list(layout.shape)}, {block_size})",
                   layout=layout.bool().clone())


@dataclass(frozen=True, eq=False)
class _Global(Pattern):
    """Keep rows and columns of the global tokens."""

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

    def __repr__(self):
        return f"global({list(self.tokens)[:4]}{'...' if len(self.tokens) > 4 else ''})"


def longformer(window: int, global_tokens: int | list[int] | tuple[int, ...] = 1) -> Pattern:
    """Longformer (Beltagy et al. 2020): a sliding window of ``window`` keys on each side, plus global
    tokens (an int n for the first n positions, or explicit positions) that see and are seen by all."""
    w = sliding_window(window)
    if isinstance(global_tokens, int) and not isinstance(global_tokens, bool):
        _check_int("global_tokens", global_tokens, 0)
        toks = tuple(range(global_tokens))
    else:
        toks = tuple(sorted({_check_int("global_tokens[i]", int(t), 0) for t in global_tokens}))
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
    query block (seeded, so one (L, S) always gives one mask)."""
    _check_int("block_size", block_size, 1)
    _check_int("window_blocks", window_blocks, 1)
    _check_int("global_blocks", global_blocks, 0)
    _check_int("random_blocks", random_blocks, 0)
    return _BigBird(block_size=block_size, window_blocks=window_blocks, global_blocks=global_blocks,
                    random_blocks=random_blocks, seed=seed,
                    name=f"bigbird({block_size}, {window_blocks}, {global_blocks}, {random_blocks}, seed={seed})")


@dataclass(frozen=True, eq=False)
class _KeyKeep(Pattern):
    """Per-batch key mask: keep[b, j] True = key j of batch element b takes part."""

    keep_keys: torch.Tensor
    name: str = "key_padding"
    extends: bool = False  # lengths-based: keys past the stored width are padding for any S

    @property
    def batch_size(self):  # type: ignore[override]
        return self.keep_keys.shape[0]

    def _keys(self, S):
        """Bool [B, >= S]: the stored key mask, padded with False past its width when lengths-based."""
        kk = self.keep_keys
        if S > kk.shape[1]:
            if not self.extends:
                raise ValueError(f"{self.name} covers {kk.shape[1]} keys but attention has S={S}")
            kk = torch.nn.functional.pad(kk, (0, S - kk.shape[1]), value=False)
        return kk

    def keep(self, i, j, L, S):
        kk = self._keys(S).to(j.device)[:, j]  # (B, *j.shape)
        return kk & torch.ones_like(i, dtype=torch.bool)  # broadcast over i

    def bounds(self, qlo, qhi, klo, khi, L, S):
        # kept keys per batch element in [klo, khi] from a prefix count: exact for any key ranges
        kk = self._keys(S)[:, :S].to(klo.device)
        c = torch.nn.functional.pad(kk.to(torch.int64).cumsum(1), (1, 0))  # (B, S + 1)
        n = c[:, khi + 1] - c[:, klo]  # (B, *klo.shape)
        any_ = (n > 0).any(0) & torch.ones_like(qlo, dtype=torch.bool)  # union over the batch
        all_ = (n == khi - klo + 1).all(0) & torch.ones_like(qlo, dtype=torch.bool)
        return any_, all_

    def __repr__(self):
        return f"{self.name}(batch={self.keep_keys.shape[0]}, S={self.keep_keys.shape[1]})"


def key_padding(lengths: torch.Tensor | list[int], max_len: int | None = None) -> Pattern:
    """Keys j < lengths[b] take part for batch element b."""
    lengths = torch.as_tensor(lengths)
    if lengths.dim() != 1 or lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
        raise ValueError(f"lengths must be a 1-D integer tensor [batch], got {lengths!r:.60}")
    if (lengths < 0).any():
        raise ValueError(f"lengths must be >= 0, got {lengths.tolist()}")
    n = int(lengths.max()) if max_len is None and lengths.numel() else (max_len or 0)
    keep = torch.arange(n).unsqueeze(0) < lengths.unsqueeze(1)
    return _KeyKeep(keep, name="key_padding", extends=True)


def from_key_padding_mask(mask: torch.Tensor) -> Pattern:
    """From an ``nn.MultiheadAttention``-style key_padding_mask [batch, S] (True = ignore)."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        raise ValueError(f"key_padding_mask must be a 2-D tensor [batch, S], got {getattr(mask, 'shape', mask)}")
    if mask.dtype == torch.bool:
        return _KeyKeep(~mask, name="key_padding_mask")
    if mask.dtype.is_floating_point:
        raise TypeError("a float key_padding_mask is additive; pass it as attn_mask instead")
    raise TypeError(f"key_padding_mask must be bool (True = ignore), got {mask.dtype}")


def from_hf_attention_mask(mask: torch.Tensor) -> Pattern:
    """From a Hugging Face 2-D attention_mask [batch, S] (1 = attend, 0 = padding)."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        raise ValueError(f"attention_mask must be a 2-D tensor [batch, S], got {getattr(mask, 'shape', mask)}")
    return _KeyKeep(mask != 0, name="hf_attention_mask")


def _lengths(name: str, lengths) -> torch.Tensor:
    t = torch.as_tensor(lengths)
    if t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool or t.numel() == 0:
        raise ValueError(f"{name} must be a non-empty 1-D list of integer lengths, got {lengths!r:.80}")
    if (t < 0).any():
        raise ValueError(f"{name} must be >= 0, got {t.tolist()}")
    return t.to(torch.long)


@dataclass(frozen=True, eq=False)
class _Document(Pattern):
    """Block-diagonal over packed sequences: query i of document d sees keys of document d only.

    Document d holds queries [qs[d], qs[d+1]) and keys [ks[d], ks[d+1]) (cumulative offsets, flash-attn's
    cu_seqlens). Causal keeps local key index <= local query index (+ klen - qlen when bottom_right),
    i.e. j - i <= c[d] with c[d] = ks[d] - qs[d] (+ klen[d] - qlen[d]).
    """

    q_lengths: tuple[int, ...]
    k_lengths: tuple[int, ...]
    causal: bool
    align: str

    def _tables(self, device):
        ql = torch.tensor(self.q_lengths, dtype=torch.long, device=device)
        kl = torch.tensor(self.k_lengths, dtype=torch.long, device=device)
        qs = torch.nn.functional.pad(ql.cumsum(0), (1, 0))  # (D + 1,)
        ks = torch.nn.functional.pad(kl.cumsum(0), (1, 0))
        c = ks[:-1] - qs[:-1] + ((kl - ql) if self.align == "bottom_right" else 0)  # (D,)
        return ql, kl, qs, ks, c

    def _check(self, L, S):
        tq, tk = sum(self.q_lengths), sum(self.k_lengths)
        if L != tq or S != tk:
            raise ValueError(f"{self!r} packs {tq} queries x {tk} keys, but attention has L={L}, S={S}; "
                             "the lengths must add up to the sequence lengths")

    @staticmethod
    def _doc(pos, starts):
        # document of each position: the last d with starts[d] <= pos (empty documents are skipped)
        return torch.bucketize(pos, starts[1:-1], right=True)

    def keep(self, i, j, L, S):
        self._check(L, S)
        _, _, qs, ks, c = self._tables(i.device)
        di, dj = self._doc(i, qs), self._doc(j, ks)
        m = di == dj
        return m & (j - i <= c[di]) if self.causal else m

    def bounds(self, qlo, qhi, klo, khi, L, S):
        # Documents meeting both ranges lie in [d_lo, d_hi]; those strictly inside lie wholly in the block
        # on both sides, so they keep a pair exactly when they have a query and a key. The two end
        # documents are checked on their clipped ranges. Exact, O(blocks).
        self._check(L, S)
        ql, kl, qs, ks, c = self._tables(qlo.device)
        dq0, dq1, dk0, dk1 = self._doc(qlo, qs), self._doc(qhi, qs), self._doc(klo, ks), self._doc(khi, ks)
        d_lo, d_hi = torch.maximum(dq0, dk0), torch.minimum(dq1, dk1)

        def keeps(d):
            d = d.clamp(0, len(ql) - 1)
            qa, qb = torch.maximum(qlo, qs[d]), torch.minimum(qhi, qs[d + 1] - 1)
            ka, kb = torch.maximum(klo, ks[d]), torch.minimum(khi, ks[d + 1] - 1)
            m = (qa <= qb) & (ka <= kb)
            return m & (ka - qb <= c[d]) if self.causal else m

        both = ((ql > 0) & (kl > 0)).to(torch.int32)
        pre = torch.nn.functional.pad(both.cumsum(0), (1, 0))  # documents with a query and a key, before d
        inner = pre[d_hi.clamp(min=0)] - pre[(d_lo + 1).clamp(max=len(ql))] > 0
        any_ = (d_lo <= d_hi) & (keeps(d_lo) | keeps(d_hi) | ((d_hi - d_lo >= 2) & inner))
        all_ = (dq0 == dq1) & (dk0 == dk1) & (dq0 == dk0)
        if self.causal:
            all_ = all_ & (khi - qlo <= c[dq0.clamp(0, len(ql) - 1)])
        return any_, all_

    def nnz(self, L: int, S: int) -> int:
        """Kept pairs in O(L): each query counts the keys of its document it may see."""
        self._check(L, S)
        ql, kl, qs, ks, c = self._tables("cpu")
        i = torch.arange(L)
        d = self._doc(i, qs)
        if not self.causal:
            return int(kl[d].sum())
        last = torch.minimum(i + c[d], ks[d + 1] - 1)  # last visible key of each query's document
        return int((last - ks[d] + 1).clamp(min=0).sum())

    def __repr__(self):
        kv = "" if self.k_lengths == self.q_lengths else f", kv_lengths={list(self.k_lengths)}"
        al = f", align={self.align!r}" if self.align != "top_left" else ""
        return f"document({list(self.q_lengths)}, causal={self.causal}{kv}{al})"


def document(lengths, causal: bool = False, kv_lengths=None, align: str = "top_left") -> Pattern:
    """Packed variable-length sequences (xformers' BlockDiagonalMask, flash-attn's varlen cu_seqlens):
    query i of document d attends only to keys of document d. Boundaries may fall at any token.

    ``lengths``: tokens per document (queries; also keys unless ``kv_lengths`` is given); they must add
    up to L (and S). ``causal``: within each document, local key index <= local query index
    (``align="bottom_right"`` shifts it by that document's kv_len - q_len, as flash-attn >= 2.1 and
    xformers' BlockDiagonalCausalFromBottomRightMask do). Zero-length documents are allowed.
    """
    ql = _lengths("lengths", lengths)
    kl = ql if kv_lengths is None else _lengths("kv_lengths", kv_lengths)
    if kl.numel() != ql.numel():
        raise ValueError(f"kv_lengths has {kl.numel()} documents but lengths has {ql.numel()}")
    if align not in ("top_left", "bottom_right"):
        raise ValueError(f"align must be 'top_left' or 'bottom_right', got {align!r}")
    return _Document(tuple(ql.tolist()), tuple(kl.tolist()), bool(causal), align)


@dataclass(frozen=True, eq=False)
class _PrefixLM(Pattern):
    """Keys before ``prefix_len`` are seen by every query; after it, causal (j <= i + offset)."""

    prefix_len: int
    align: str

    def _offset(self, L, S):
        return (S - L) if self.align == "bottom_right" else 0

    def keep(self, i, j, L, S):
        return (j < self.prefix_len) | (j - i <= self._offset(L, S))

    def bounds(self, qlo, qhi, klo, khi, L, S):
        # exact: the pair most likely kept is (qhi, klo), the least likely (qlo, khi)
        off = self._offset(L, S)
        return (klo < self.prefix_len) | (klo - qhi <= off), (khi < self.prefix_len) | (khi - qlo <= off)

    def nnz(self, L: int, S: int) -> int:
        i = torch.arange(L)
        last = torch.clamp(torch.maximum(i + self._offset(L, S), torch.tensor(self.prefix_len - 1)), max=S - 1)
        return int((last + 1).clamp(min=0).sum())

    def __repr__(self):
        return f"prefix_lm({self.prefix_len}" + (f", align={self.align!r})" if self.align != "top_left" else ")")


def prefix_lm(prefix_len: int, align: str = "top_left") -> Pattern:
    """Prefix language model (UniLM, Dong et al. 2019; T5's prefix LM, Raffel et al. 2020): the first
    ``prefix_len`` keys are visible to every query (bidirectional prefix), later keys causally.
    Equivalent to ``causal(align) | (key < prefix_len)``."""
    _check_int("prefix_len", prefix_len, 0)
    if align not in ("top_left", "bottom_right"):
        raise ValueError(f"align must be 'top_left' or 'bottom_right', got {align!r}")
    return _PrefixLM(prefix_len, align)


@dataclass(frozen=True, eq=False)
class _MaskMod(Pattern):
    """A FlexAttention mask_mod as a pattern; block layouts found from the full grid, cached."""

    fn: object
    B: int | None
    name: str
    # (L, S, block_q, block_k, device) -> (any, all) per block; shared across calls (the function is pure)
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def batch_size(self):  # type: ignore[override]
        return self.B

    def keep(self, i, j, L, S):
        shape = torch.broadcast_shapes(i.shape, j.shape)
        zero = torch.zeros((), dtype=torch.long, device=i.device)
        b = zero if self.B is None else torch.arange(self.B, device=i.device).view(-1, *([1] * len(shape)))
        m = self.fn(b, zero, i, j)
        if not isinstance(m, torch.Tensor):
            m = torch.as_tensor(m, device=i.device)
        if m.dtype != torch.bool:
            raise TypeError(f"mask_mod {self.name} must return a bool tensor, got {m.dtype}")
        out_shape = ((self.B,) if self.B is not None else ()) + tuple(shape)
        try:
            return torch.broadcast_to(m, out_shape)
        except RuntimeError:
            raise ValueError(f"mask_mod {self.name} returned shape {list(m.shape)}, which does not broadcast to "
                             f"the index grid {list(out_shape)} (b, q_idx, kv_idx broadcast)") from None

    def block_layout(self, L: int, S: int, block_q: int, block_k: int | None = None,
                     device: torch.device | str | None = None) -> torch.Tensor:
        """As ``Pattern.block_layout``, exact, evaluated once per (L, S, block shape) and cached; a block
        shape that is a multiple of a cached one is pooled from it instead of evaluated again."""
        block_k = block_q if block_k is None else block_k
        _check_int("block_q", block_q, 1)
        _check_int("block_k", block_k, 1)
        dev = str(torch.device(device)) if device is not None else "cpu"
        key = (L, S, block_q, block_k, dev)
        if key not in self._cache:
            base = next((k for k in self._cache if k[:2] == (L, S) and k[4] == dev
                         and block_q % k[2] == 0 and block_k % k[3] == 0), None)
            if base is not None:
                any_, all_ = self._cache[base]
                self._cache[key] = (_pool(any_, block_q // base[2], block_k // base[3], "any"),
                                    _pool(all_, block_q // base[2], block_k // base[3], "all"))
            else:
                self._cache[key] = self._grid_bounds(L, S, block_q, block_k, device)
            while len(self._cache) > 32:  # bounded: a long-running process sees many shapes
                self._cache.pop(next(iter(self._cache)))
        any_, all_ = self._cache[key]
        layout = torch.full(any_.shape, PARTIAL, dtype=torch.int8, device=any_.device)
        layout[~any_] = EMPTY
        layout[all_ & any_] = FULL
        return layout

    def _slices(self, L, S, rows, device):
        """(r0, r1, mask [r1 - r0, S] or [B, r1 - r0, S]) over the grid, int32 indices, about 1M pairs each:
        small enough to stay in cache between the function's element-wise ops (measured 2-3x faster than
        4M-pair int64 slices at n = 16384)."""
        j = torch.arange(S, dtype=torch.int32, device=device).unsqueeze(0)  # (1, S)
        step = max(1, (1 << 20) // max(1, rows * S)) * rows
        for r0 in range(0, L, step):
            r1 = min(L, r0 + step)
            i = torch.arange(r0, r1, dtype=torch.int32, device=device).unsqueeze(1)  # (r, 1)
            yield r0, r1, self.keep(i, j, L, S)

    def _grid_bounds(self, L, S, block_q, block_k, device):
        """Exact (any, all) per block from the full L x S grid, slice by slice of whole query blocks."""
        nq, nk = -(-L // block_q), -(-S // block_k)
        any_ = torch.zeros(nq, nk, dtype=torch.bool, device=device)
        all_ = torch.zeros(nq, nk, dtype=torch.bool, device=device)
        for r0, r1, m in self._slices(L, S, block_q, device):
            m_any, m_all = (m.any(0), m.all(0)) if self.B is not None else (m, m)
            q0, q1 = r0 // block_q, -(-r1 // block_q)
            any_[q0:q1] = _reduce_blocks(_reduce_blocks(m_any, block_k, 1, "any"), block_q, 0, "any")
            all_[q0:q1] = _reduce_blocks(_reduce_blocks(m_all, block_k, 1, "all"), block_q, 0, "all")
        return any_, all_

    def nnz(self, L: int, S: int) -> int:
        """Kept pairs (averaged over the batch when per-batch), counted once per (L, S) and cached."""
        key = ("nnz", L, S)
        if key not in self._cache:
            total = sum(int(m.sum()) for _, _, m in self._slices(L, S, 1, "cpu"))
            self._cache[key] = int(round(total / (self.B or 1)))
        return self._cache[key]

    def __repr__(self):
        return f"from_mask_mod({self.name}" + (f", B={self.B})" if self.B is not None else ")")


def _reduce_blocks(m: torch.Tensor, b: int, dim: int, how: str) -> torch.Tensor:
    """any/all over consecutive runs of ``b`` along ``dim`` (0 or 1) of a 2-D bool tensor; a shorter last
    run is reduced on its own, so no padded copy is made."""
    n = m.shape[dim]
    nf = n // b * b
    red = torch.any if how == "any" else torch.all
    x = m.narrow(dim, 0, nf)
    full = red(x.reshape(n // b, b, m.shape[1]), 1) if dim == 0 else red(x.reshape(m.shape[0], n // b, b), 2)
    if nf == n:
        return full
    tail = red(m.narrow(dim, nf, n - nf), dim, keepdim=True)
    return torch.cat([full, tail], dim)


def _pool(x: torch.Tensor, fq: int, fk: int, how: str) -> torch.Tensor:
    """Reduce a per-block bool grid by fq x fk cells (any / all); cells past the edge are neutral."""
    nq, nk = x.shape
    mq, mk = -(-nq // fq), -(-nk // fk)
    pad = torch.full((mq * fq, mk * fk), how == "all", dtype=torch.bool, device=x.device)
    pad[:nq, :nk] = x
    v = pad.view(mq, fq, mk, fk)
    return v.any(3).any(1) if how == "any" else v.all(3).all(1)


def from_mask_mod(mask_mod, B: int | None = None, H: int | None = None, name: str | None = None) -> Pattern:
    """A pattern from a FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor`` (True = keep).

    The function is called on index tensors that broadcast against each other (never per element), so
    it must use tensor operations (``&``, ``|``, ``torch.where``, indexing a tensor by q_idx). As in
    ``torch.nn.attention.flex_attention.create_block_mask``, ``B=None`` evaluates it at b = 0 and the
    mask is shared by the whole batch; ``B=n`` evaluates b = 0 .. n-1 and the pattern is per batch
    element (its batch size must then match the input's). Heads: the mask is shared by all heads and
    evaluated at h = 0; per-head masks are not supported (pass ``H=None`` or 1, or give a per-head bool
    ``attn_mask`` instead).

    The block layout comes from evaluating the function on the full L x S grid in slices (O(L·S) work,
    vectorised), once per (L, S, block shape), and is cached on the pattern: the function must be pure.
    """
    if not callable(mask_mod):
        raise TypeError(f"mask_mod must be callable as mask_mod(b, h, q_idx, kv_idx), got {type(mask_mod).__name__}")
    if B is not None:
        _check_int("B", B, 1)
    if H is not None:
        _check_int("H", H, 1)
        if H != 1:
            raise ValueError(f"from_mask_mod: per-head masks are not supported (H={H}); use H=None (shared by all "
                             "heads) or a per-head bool attn_mask [B, H, L, S]")
    nm = name or getattr(mask_mod, "__name__", None) or type(mask_mod).__name__
    return _MaskMod(mask_mod, B, nm)


#: most calls joined by & or | in one ``parse`` spec: each join is one level of a combined pattern
#: that is evaluated recursively
MAX_PARSE_TERMS = 256

def _clip(spec: str, n: int = 60) -> str:
    """The spec for a one-line message: its first n characters."""
    return repr(spec) if len(spec) <= n else repr(spec[:n]) + f"... ({len(spec)} characters)"


_PARSEABLE = ("causal", "sliding_window", "dilated", "strided", "fixed", "longformer", "bigbird", "key_padding", "full",
              "document", "prefix_lm")


def parse(spec: str) -> Pattern:
    """Build a pattern from text such as ``"sliding_window(256, causal=True)"`` or
    ``"sliding_window(64) | causal()"`` (literal arguments only; no code is evaluated)."""
    import ast

    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"pattern spec must be a non-empty string, got {spec!r}")
    terms = spec.count("&") + spec.count("|") + 1
    if terms > MAX_PARSE_TERMS:
        raise ValueError(f"pattern spec {_clip(spec)} joins {terms} terms with & or |; at most "
                         f"{MAX_PARSE_TERMS} are supported")
    try:
        tree = ast.parse(spec.strip(), mode="eval").body
    except SyntaxError as e:
        raise ValueError(f"cannot parse pattern {_clip(spec)}: {e.msg}") from None
    except (RecursionError, MemoryError):  # nesting such as ((((...)))) past the parser's limit
        raise ValueError(f"pattern spec {_clip(spec)} is nested too deeply to parse") from None

    def build(node):
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.BitAnd, ast.BitOr)):
            a, b = build(node.left), build(node.right)
            return a & b if isinstance(node.op, ast.BitAnd) else a | b
        if isinstance(node, ast.Name):
            node = ast.Call(func=node, args=[], keywords=[])
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            raise ValueError(f"pattern {spec!r}: expected calls like sliding_window(256) joined by & or |")
        name = node.func.id
        if name not in _PARSEABLE:
            raise ValueError(f"unknown pattern {name!r}; choose from {', '.join(_PARSEABLE)}")
        try:
            args = [ast.literal_eval(a) for a in node.args]
            kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        except ValueError:
            raise ValueError(f"pattern {spec!r}: arguments must be literals") from None
        return globals()[name](*args, **kwargs)

    return build(tree)


# Old private names, kept while callers outside patterns move to the public ones (session 18).
_BlockTable = BlockTable
