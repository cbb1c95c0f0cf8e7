"""Masks that keep (i, j) by the offset j - i: causal, sliding windows, dilated and strided windows, prefix LM.

Legend: query i < L, key j < S. Every constructor returns a ``Pattern`` that materialises to a bool
[L, S] mask for any (L, S); ``align="bottom_right"`` measures j - i from the diagonal j = i + S - L.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import _INF, MAX_INT, Pattern, _check_align, _check_bool, _check_int, _diagonal_pairs


@dataclass(frozen=True, eq=False)
class _Band(Pattern):
    """Keep j - i (after alignment) within [lo, hi]; the shared core of causal and windows."""

    lo: float = -_INF
    hi: float = _INF
    align: str = "top_left"
    name: str = "band"

    def band(self, L, S):
        off = _diagonal_offset(self.align, L, S)
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

    def counts_analytically(self):
        return True

    def bounds(self, qlo, qhi, klo, khi, L, S):
        return _band_bounds(*self.band(L, S), qlo, qhi, klo, khi)

    def __repr__(self):
        return self.name


def _diagonal_offset(align: str, L: int, S: int) -> int:
    """Where j - i = 0 lies for this alignment: 0 (top_left, PyTorch's is_causal) or S - L (bottom_right)."""
    return (S - L) if align == "bottom_right" else 0


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
    """Every pair takes part: materialises to all-True [L, S]; the identity for ``&``."""
    return _Band(name="full()")


def causal(align: str = "top_left") -> Pattern:
    """Key j visible to query i when j <= i (top_left, PyTorch's ``is_causal``) or j <= i + S - L
    (bottom_right, the KV-cache convention: the last query sees every key).

    Materialises to ``torch.ones(L, S, dtype=torch.bool).tril(diagonal)`` with diagonal 0 or S - L;
    ``band(L, S)`` is ``(-inf, diagonal)``. Raises ValueError for another ``align``.
    """
    _check_align(align)
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

    Materialises to bool [L, S] with ``-left <= j - i <= right``; counting and block layouts are
    analytic (O(L) and O(blocks)), so the kernels visit only the diagonal strip of blocks.
    """
    _check_align(align)
    _check_bool("causal", causal)
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

    def translation_invariant(self):
        return True  # keep depends on j - i only: one mask block serves a whole diagonal

    def keep(self, i, j, L, S):
        lo, hi = self._limits()
        d = j - i
        return (d >= lo) & (d <= hi) & (torch.remainder(d, self.dilation) == 0)

    def bounds(self, qlo, qhi, klo, khi, L, S):
        # any (exact): the block's j - i range [klo - qhi, khi - qlo], clipped to the window, holds a
        # multiple of dilation; all: the window covers the range and every offset counts (dilation 1)
        lo, hi = self._limits()
        a = torch.clamp(klo - qhi, min=lo)
        b = torch.clamp(khi - qlo, max=hi)
        any_ = torch.div(b, self.dilation, rounding_mode="floor") * self.dilation >= a
        _, all_ = _band_bounds(lo, hi, qlo, qhi, klo, khi)
        return any_, all_ & (self.dilation == 1)

    def nnz(self, L: int, S: int) -> int:
        """Kept pairs in O(min(window, (L + S) / dilation)): the diagonals j - i = k·dilation for k in
        [-window, window] ([-window, 0] when causal) that meet the grid, each weighed by its length."""
        if L <= 0 or S <= 0:
            return 0
        dil = self.dilation
        k_lo = max(-self.window, -((L - 1) // dil))  # diagonals below -(L - 1) or above S - 1 are empty
        k_hi = min(0 if self.causal else self.window, (S - 1) // dil)
        if k_lo > k_hi:
            return 0
        return int(_diagonal_pairs(torch.arange(k_lo, k_hi + 1) * dil, L, S).sum())

    def counts_analytically(self):
        return True

    def __repr__(self):
        return f"dilated({self.window}, {self.dilation}, causal={self.causal})"


def dilated(window: int, dilation: int, causal: bool = False) -> Pattern:
    """Dilated window (Beltagy et al. 2020): ``window`` keys on each side, ``dilation`` apart, so
    (i, j) is kept when ``|j - i| <= window * dilation`` and ``dilation`` divides j - i (with ``causal``,
    j <= i only). Materialises to bool [L, S]; blocks are bounded by the undilated window."""
    _check_int("window", window, 0)
    _check_int("dilation", dilation, 1)
    _check_bool("causal", causal)
    if window * dilation > MAX_INT:
        raise ValueError(f"dilated: window * dilation (the window's reach in positions) must be <= 2**62, got "
                         f"window={window} * dilation={dilation} = {window * dilation:.3g}")
    return _Dilated(window, dilation, causal)


@dataclass(frozen=True, eq=False)
class _Strided(Pattern):
    stride: int
    causal: bool

    def translation_invariant(self):
        return True  # keep depends on i - j only

    def keep(self, i, j, L, S):
        d = i - j
        local = d.abs() < self.stride
        column = torch.remainder(d, self.stride) == 0
        m = local | column
        return m & (d >= 0) if self.causal else m

    def bounds(self, qlo, qhi, klo, khi, L, S):
        # Over a block, d = i - j takes every integer in [qlo - khi, qhi - klo]; causal keeps d >= 0 only.
        # any: that range meets the local band |d| < stride or holds a multiple of stride (exact).
        # all: the whole range lies in the band (or stride is 1), which is conservative: a range that
        # leaves the band by exactly one multiple is reported PARTIAL.
        st = self.stride
        dlo, dhi = qlo - khi, qhi - klo
        lo = torch.clamp(dlo, min=0) if self.causal else dlo
        near = (lo <= st - 1) & (dhi >= -(st - 1))
        column = torch.div(dhi, st, rounding_mode="floor") * st >= lo
        any_ = (lo <= dhi) & (near | column)
        floor = 0 if self.causal else -(st - 1)
        all_ = (dlo >= floor) & ((dhi <= st - 1) | (st == 1))
        return any_, all_

    def __repr__(self):
        return f"strided({self.stride}, causal={self.causal})"


def strided(stride: int, causal: bool = True) -> Pattern:
    """Sparse Transformer strided pattern (Child et al. 2019): the previous ``stride`` tokens plus
    every ``stride``-th token before them: (i, j) kept when ``|i - j| < stride`` or ``stride`` divides
    i - j (and j <= i when ``causal``). Materialises to bool [L, S]."""
    _check_int("stride", stride, 1)
    _check_bool("causal", causal)
    return _Strided(stride, causal)


@dataclass(frozen=True, eq=False)
class _PrefixLM(Pattern):
    """Keys before ``prefix_len`` are seen by every query; after it, causal (j <= i + offset)."""

    prefix_len: int
    align: str

    def keep(self, i, j, L, S):
        return (j < self.prefix_len) | (j - i <= _diagonal_offset(self.align, L, S))

    def bounds(self, qlo, qhi, klo, khi, L, S):
        # exact: the pair most likely kept is (qhi, klo), the least likely (qlo, khi)
        off = _diagonal_offset(self.align, L, S)
        return (klo < self.prefix_len) | (klo - qhi <= off), (khi < self.prefix_len) | (khi - qlo <= off)

    def counts_analytically(self):
        return True

    def nnz(self, L: int, S: int) -> int:
        """Kept pairs in O(L): query i sees keys up to max(i + offset, prefix_len - 1)."""
        i = torch.arange(L)
        last = torch.clamp(torch.maximum(i + _diagonal_offset(self.align, L, S), torch.tensor(self.prefix_len - 1)), max=S - 1)
        return int((last + 1).clamp(min=0).sum())

    def __repr__(self):
        return f"prefix_lm({self.prefix_len}" + (f", align={self.align!r})" if self.align != "top_left" else ")")


def prefix_lm(prefix_len: int, align: str = "top_left") -> Pattern:
    """Prefix language model (UniLM, Dong et al. 2019; T5's prefix LM, Raffel et al. 2020): the first
    ``prefix_len`` keys are visible to every query (bidirectional prefix), later keys causally.
    Equivalent to ``causal(align) | (key < prefix_len)``; materialises to bool [L, S]; block bounds
    are exact and O(blocks)."""
    _check_int("prefix_len", prefix_len, 0)
    _check_align(align)
    return _PrefixLM(prefix_len, align)
