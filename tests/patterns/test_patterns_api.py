"""The patterns' public analytic API (bounds, band, translation_invariant, block_shape, nonempty_blocks,
nnz, shifted) against ``materialize``: the oracle is the dense mask, reduced by plain tensor ops or loops
over each block.

Random patterns come from every constructor and their ``&`` / ``|``; blocks are arbitrary rectangles
(not only the regular grid ``block_layout`` uses), so a bound that silently assumes a grid fails here.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnlab import patterns as P

ALIGN = st.sampled_from(["top_left", "bottom_right"])
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _partition(draw, total, n):
    """n non-negative ints adding up to total (zero-length parts allowed)."""
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=n - 1, max_size=n - 1)))
    edges = [0, *cuts, total]
    return [b - a for a, b in zip(edges, edges[1:])]


@st.composite
def leaf(draw, L, S, batch):
    """(pattern, bounds are exact for it): one constructor with drawn arguments, valid for L x S."""
    kind = draw(st.sampled_from(["causal", "window", "window_lr", "dilated", "strided", "fixed", "block_sparse",
                                 "longformer", "bigbird", "key_padding", "kp_mask", "document", "prefix_lm",
                                 "full"]))
    w = st.integers(0, 6)
    if kind == "causal":
        return P.causal(draw(ALIGN)), True
    if kind == "window":
        return P.sliding_window(draw(w), causal=draw(st.booleans()), align=draw(ALIGN)), True
    if kind == "window_lr":
        left = draw(st.one_of(st.none(), st.integers(-4, 6)))
        right = draw(st.one_of(st.none(), st.integers(-4, 6)))
        if left is not None and right is not None and left + right < 0:
            left = -right
        if left is None and right is None:
            right = 0
        return P.sliding_window(left=left, right=right, align=draw(ALIGN)), True
    if kind == "dilated":
        return P.dilated(draw(w), draw(st.integers(1, 3)), causal=draw(st.booleans())), False
    if kind == "strided":
        return P.strided(draw(st.integers(1, 4)), causal=draw(st.booleans())), False
    if kind == "fixed":
        block = draw(st.integers(1, 6))
        return P.fixed(block, draw(st.integers(0, block)), causal=draw(st.booleans())), False
    if kind == "block_sparse":
        bs = draw(st.integers(1, 5))
        nq, nk = -(-L // bs), -(-S // bs)
        bits = draw(st.lists(st.booleans(), min_size=nq * nk, max_size=nq * nk))
        return P.block_sparse(torch.tensor(bits, dtype=torch.bool).view(nq, nk), bs), True
    if kind == "longformer":
        toks = draw(st.one_of(st.integers(0, 3), st.lists(st.integers(0, 20), max_size=3)))
        return P.longformer(draw(w), toks), False  # window | global: "or" makes all conservative
    if kind == "bigbird":
        return P.bigbird(draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.integers(0, 2)),
                         draw(st.integers(0, 2)), seed=draw(st.integers(0, 5))), True
    if kind == "key_padding":
        lengths = draw(st.lists(st.integers(0, S), min_size=batch, max_size=batch))  # longer than S: refused
        return P.key_padding(lengths), True
    if kind == "kp_mask":
        bits = draw(st.lists(st.booleans(), min_size=batch * S, max_size=batch * S))
        return P.from_key_padding_mask(torch.tensor(bits, dtype=torch.bool).view(batch, S)), True
    if kind == "document":
        n = draw(st.integers(1, 4))
        return P.document(_partition(draw, L, n), causal=draw(st.booleans()), kv_lengths=_partition(draw, S, n),
                          align=draw(ALIGN)), True
    if kind == "prefix_lm":
        return P.prefix_lm(draw(st.integers(0, S + 2)), align=draw(ALIGN)), True
    return P.full(), True


@st.composite
def pattern(draw, L, S, batch, depth=2):
    """(pattern, exact): a leaf, or leaves joined by & and |, or a shifted view (exactness then unknown)."""
    if depth == 0 or draw(st.integers(0, 2)) == 0:
        return draw(leaf(L, S, batch))
    if draw(st.integers(0, 3)) == 0:
        # a shifted view of a pattern over a taller square: rows offset .. offset + L - 1 of S' x S'
        return draw(shifted(L, S, batch))
    (a, _), (b, _) = draw(pattern(L, S, batch, depth - 1)), draw(pattern(L, S, batch, depth - 1))
    return (a & b if draw(st.booleans()) else a | b), False


@st.composite
def shifted(draw, L, S, batch):
    off = draw(st.integers(0, S - L)) if S >= L else None
    if off is None:
        return draw(leaf(L, S, batch))
    inner, exact = draw(leaf(S, S, batch))
    return P.shifted(inner, off), exact


@st.composite
def problem(draw):
    L, S = draw(st.integers(1, 20)), draw(st.integers(1, 20))
    batch = draw(st.integers(1, 3))
    pat, exact = draw(pattern(L, S, batch))
    # arbitrary query and key ranges: nq row blocks against nk column blocks
    def ranges(n, count):
        out = []
        for _ in range(count):
            a, b = sorted(draw(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1))))
            out.append((a, b))
        return out
    return L, S, pat, exact, ranges(L, draw(st.integers(1, 4))), ranges(S, draw(st.integers(1, 4)))


def oracle_layout(pat, L, S, bq, bk):
    """EMPTY / PARTIAL / FULL per (bq x bk) block, by looping over the materialised mask's blocks."""
    m_any, m_all = oracle(pat, L, S)
    nq, nk = -(-L // bq), -(-S // bk)
    out = torch.empty(nq, nk, dtype=torch.int8)
    for x in range(nq):
        for y in range(nk):
            cell = (slice(x * bq, (x + 1) * bq), slice(y * bk, (y + 1) * bk))
            out[x, y] = P.FULL if m_all[cell].all() else P.PARTIAL if m_any[cell].any() else P.EMPTY
    return out


def oracle(pat, L, S):
    """(any, all) masks [L, S] from the materialised pattern: over the batch, union and intersection."""
    m = pat.materialize(L, S)
    return (m.any(0)[0], m.all(0)[0]) if pat.batch_size else (m, m)


@SETTINGS
@given(problem())
def test_bounds_are_conservative_and_exact_where_documented(prob):
    L, S, pat, exact, qr, kr = prob
    qlo = torch.tensor([a for a, _ in qr]).view(-1, 1)
    qhi = torch.tensor([b for _, b in qr]).view(-1, 1)
    klo = torch.tensor([a for a, _ in kr]).view(1, -1)
    khi = torch.tensor([b for _, b in kr]).view(1, -1)
    b = pat.bounds(qlo, qhi, klo, khi, L, S)
    if b is None:
        assert not exact, f"{pat!r} documents exact bounds but returned None"
        return
    any_, all_ = (torch.broadcast_to(x, (len(qr), len(kr))) for x in b)
    m_any, m_all = oracle(pat, L, S)
    for x, (q0, q1) in enumerate(qr):
        for y, (k0, k1) in enumerate(kr):
            blk_any = bool(m_any[q0:q1 + 1, k0:k1 + 1].any())
            blk_all = bool(m_all[q0:q1 + 1, k0:k1 + 1].all())
            where = f"{pat!r} L={L} S={S} block [{q0}, {q1}] x [{k0}, {k1}]"
            # any may over-claim and all under-claim, never the other way round
            assert any_[x, y] or not blk_any, f"any=False on a block with a kept pair: {where}"
            assert blk_all or not all_[x, y], f"all=True on a block with a dropped pair: {where}"
            if exact:
                assert bool(any_[x, y]) == blk_any, f"any not exact: {where}"
                assert bool(all_[x, y]) == blk_all, f"all not exact: {where}"


@st.composite
def sized_pattern(draw):
    L, S = draw(st.integers(1, 24)), draw(st.integers(1, 24))
    return L, S, draw(pattern(L, S, draw(st.integers(1, 2))))[0]


@SETTINGS
@given(sized_pattern())
def test_band_and_translation_invariance_match_the_mask(prob):
    L, S, pat = prob
    m = pat.materialize(L, S)
    d = torch.arange(S).view(1, S) - torch.arange(L).view(L, 1)  # (L, S): j - i
    band = pat.band(L, S)
    if band is not None:
        lo, hi = band
        assert torch.equal(torch.broadcast_to((d >= lo) & (d <= hi), m.shape), m), f"{pat!r} band {band}"
    if P.translation_invariant(pat):
        # every diagonal is constant: (i, j) and (i + 1, j + 1) agree
        assert torch.equal(m[..., 1:, 1:], m[..., :-1, :-1]), repr(pat)


def test_band_answers_for_the_documented_cases():
    inf = math.inf
    assert P.causal().band(5, 9) == (-inf, 0)
    assert P.causal("bottom_right").band(5, 9) == (-inf, 4)
    assert P.sliding_window(left=2, right=-1).band(4, 4) == (-2, -1)
    assert P.full().band(3, 3) == (-inf, inf)
    assert (P.sliding_window(3) & P.causal()).band(8, 8) == (-3, 0)
    assert (P.sliding_window(left=-3, right=5) | P.causal()).band(8, 8) is None  # a gap at j - i = 1, 2
    assert (P.sliding_window(left=-1, right=5) | P.causal()).band(8, 8) == (-inf, 5)  # touching: one range
    assert P.shifted(P.causal(), 3).band(2, 5) == (-inf, 3)
    empty = P.causal() & P.sliding_window(0, align="bottom_right")  # j <= i and j == i + 1: nothing
    assert empty.band(2, 3) == (1, 0) and empty.nonempty_blocks(2, 3, 2, 1) == 0 and empty.nnz(2, 3) == 0
    for p in (P.prefix_lm(2), P.key_padding([3]), P.block_sparse(torch.ones(2, 2), 4), P.fixed(4, 1)):
        assert p.band(8, 8) is None and not p.translation_invariant(), repr(p)
    for p in (P.dilated(2, 2), P.strided(3), P.strided(3, causal=False) & P.sliding_window(5)):
        assert p.band(8, 8) is None and p.translation_invariant(), repr(p)  # invariant, but not a band
    assert P.translation_invariant(None)


@pytest.mark.parametrize("pat", [P.block_sparse(torch.rand(5, 4, generator=torch.Generator().manual_seed(0)) > 0.5, 3),
                                 P.bigbird(4, 3, 1, 1, seed=2), P.fixed(4, 1), P.fixed(6, 4, causal=False),
                                 P.fixed(5, 0)])
def test_block_shape_layout_is_exact(pat):
    """At ``block_shape()`` the layout equals the oracle's block classes (none PARTIAL that is not)."""
    bq, bk = pat.block_shape()
    assert torch.equal(pat.block_layout(15, 12, bq, bk), oracle_layout(pat, 15, 12, bq, bk))
    assert isinstance(pat, P.BlockTable) == ("fixed" not in repr(pat))
    assert P.causal().block_shape() is None


@pytest.mark.parametrize("inner", [P.causal(), P.sliding_window(2, causal=True), P.key_padding([7, 3]),
                                   P.document([4, 3], causal=True), P.fixed(3, 1)])
@pytest.mark.parametrize("L,S,off", [(1, 7, 6), (3, 7, 4), (2, 7, 0), (7, 7, 0)])
def test_shifted_is_the_rows_of_the_square(inner, L, S, off):
    got = P.shifted(inner, off).materialize(L, S)
    assert torch.equal(got, inner.materialize(S, S)[..., off:off + L, :])
    assert P.shifted(inner, off).nnz(L, S) == round(int(got.sum()) / (inner.batch_size or 1))


def test_shifted_refuses_rows_outside_the_square_and_bad_arguments():
    with pytest.raises(ValueError, match=r"L \+ offset <= S.*L=3, S=4"):
        P.shifted(P.causal(), 2).materialize(3, 4)
    with pytest.raises(ValueError, match="offset must be >= 0"):
        P.shifted(P.causal(), -1)
    with pytest.raises(TypeError, match="Pattern"):
        P.shifted("causal", 1)


def test_a_user_pattern_plans_with_its_own_public_bounds_hook():
    """block_layout consults a subclass's ``bounds`` (the documented hook) and agrees with the oracle."""

    class Lower(P.Pattern):
        calls = 0

        def keep(self, i, j, L, S):
            return j <= i

        def bounds(self, qlo, qhi, klo, khi, L, S):
            Lower.calls += 1
            return P.causal().bounds(qlo, qhi, klo, khi, L, S)

    pat = Lower()
    lay = pat.block_layout(9, 9, 4)
    assert Lower.calls == 1 and torch.equal(lay, oracle_layout(pat, 9, 9, 4, 4))
    assert torch.equal(lay, P.causal().block_layout(9, 9, 4))


@pytest.mark.parametrize("L,S", [(61, 45), (64, 64), (7, 30)])
def test_mask_mod_layout_pooled_from_a_cached_shape_equals_the_oracle(L, S):
    """Coarser layouts are pooled from a cached finer one; edge tiles (L, S not multiples) included."""
    table = torch.rand(L, S, generator=torch.Generator().manual_seed(L * S)) < 0.05

    def fn(b, h, q, k):
        return table[q.long(), k.long()]

    pooled = P.from_mask_mod(fn)
    pooled.block_layout(L, S, 4, 3)
    for bq, bk in [(8, 6), (12, 9), (4, 3), (64, 48)]:
        assert torch.equal(pooled.block_layout(L, S, bq, bk), oracle_layout(pooled, L, S, bq, bk)), (bq, bk)


@SETTINGS
@given(sized_pattern(), st.integers(1, 9), st.integers(1, 9))
def test_nonempty_blocks_counts_the_layout(prob, bq, bk):
    """The analytic count for bands (and the layout count for the rest) against the loop oracle."""
    L, S, pat = prob
    want = int((oracle_layout(pat, L, S, bq, bk) != P.EMPTY).sum())
    if pat.band(L, S) is not None:
        assert pat.nonempty_blocks(L, S, bq, bk) == want, (pat, L, S, bq, bk)
    else:
        # conservative layouts may visit more blocks than the oracle, never fewer
        assert pat.nonempty_blocks(L, S, bq, bk) >= want, (pat, L, S, bq, bk)


def test_nonempty_blocks_of_causal_at_scale():
    """Large n: the band count agrees with the layout (which the planner no longer needs to build)."""
    for pat in (P.causal(), P.sliding_window(300, causal=True), P.sliding_window(left=-5, right=700, align="bottom_right")):
        for bq, bk in [(64, 64), (128, 32), (100, 300)]:
            assert pat.nonempty_blocks(4096, 3000, bq, bk) == int((pat.block_layout(4096, 3000, bq, bk) != P.EMPTY).sum())


@SETTINGS
@given(sized_pattern())
def test_nnz_counts_the_materialised_mask(prob):
    """nnz (analytic, block-skipping or strip by strip) against the materialised count."""
    L, S, pat = prob
    want = round(int(pat.materialize(L, S).sum()) / (pat.batch_size or 1))
    assert pat.nnz(L, S) == want, (pat, L, S)


@pytest.mark.parametrize("pat", [P.longformer(9, [0, 3, 200]), P.fixed(16, 4), P.fixed(12, 5, causal=False),
                                 P.dilated(5, 3) | P.key_padding([290, 17]), P.strided(7) & P.longformer(4, 2)])
def test_nnz_skipping_blocks_equals_the_count_at_sizes_past_one_block(pat):
    L, S = 333, 290
    assert pat.nnz(L, S) == round(int(pat.materialize(L, S).sum()) / (pat.batch_size or 1))


def test_package_reexports_its_modules_public_names():
    """``attnlab.patterns.X`` works for every public name of its modules (the split kept the flat API)."""
    import importlib

    for name in P.__all__:
        assert hasattr(P, name), name
    assert callable(P.parse) and P.parse("causal()").band(3, 3) == (-math.inf, 0)
    for mod in ("base", "bands", "blocks", "sequences", "mask_mod"):
        m = importlib.import_module(f"attnlab.patterns.{mod}")
        public = [n for n, v in vars(m).items() if not n.startswith("_") and callable(v)
                  and getattr(v, "__module__", None) == m.__name__]
        missing = [n for n in public if getattr(P, n, None) is not getattr(m, n)]
        assert not missing, f"patterns.{mod} defines {missing} but attnlab.patterns does not re-export them"


@SETTINGS
@given(st.integers(1, 30), st.integers(1, 30), st.integers(1, 6), st.booleans(), st.integers(1, 7), st.integers(1, 7))
def test_strided_and_dilated_any_is_exact(L, S, stride, causal, bq, bk):
    """Their bounds find every non-empty block and no empty one (all stays conservative)."""
    for pat in (P.strided(stride, causal=causal), P.dilated(stride + bq % 3, stride, causal=causal)):
        check_any_exact(pat, L, S, bq, bk)


def check_any_exact(pat, L, S, bq, bk):
    got, want = pat.block_layout(L, S, bq, bk), oracle_layout(pat, L, S, bq, bk)
    assert torch.equal(got != P.EMPTY, want != P.EMPTY), (pat, L, S, bq, bk)
    assert not ((got == P.FULL) & (want != P.FULL)).any()
