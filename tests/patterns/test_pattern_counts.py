"""Closed-form pair counts (``Pattern.nnz``) for dilated, strided, fixed, Longformer and BigBird, against the
materialised mask's count (the oracle), over many (L, S, parameters); and that a pattern which says it
``counts_analytically`` never evaluates more than O(L + S) pairs (issue 25: `attnlab list` spent 3.7 s
counting these pair by pair at 4096 x 4096).
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnlab import patterns as P

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SIZES = st.integers(1, 90)  # past one 64-row strip and a few blocks, awkward sizes included


@st.composite
def counted(draw):
    """(pattern, L, S): one of the patterns with a closed-form count, with drawn parameters."""
    L, S = draw(SIZES), draw(SIZES)
    kind = draw(st.sampled_from(["dilated", "strided", "fixed", "longformer", "bigbird", "combined"]))
    if kind == "dilated":
        pat = P.dilated(draw(st.integers(0, 40)), draw(st.integers(1, 12)), causal=draw(st.booleans()))
    elif kind == "strided":
        pat = P.strided(draw(st.integers(1, 30)), causal=draw(st.booleans()))
    elif kind == "fixed":
        block = draw(st.integers(1, 40))
        pat = P.fixed(block, draw(st.integers(0, block)), causal=draw(st.booleans()))
    elif kind == "longformer":
        toks = draw(st.one_of(st.integers(0, 5), st.lists(st.integers(0, 120), max_size=6)))
        pat = P.longformer(draw(st.integers(0, 30)), toks)
    elif kind == "bigbird":
        pat = P.bigbird(draw(st.integers(1, 20)), draw(st.integers(1, 5)), draw(st.integers(0, 3)),
                        draw(st.integers(0, 3)), seed=draw(st.integers(0, 9)))
    else:  # translation-invariant combinations count per diagonal, an | with global tokens by inclusion-exclusion
        a = P.dilated(draw(st.integers(0, 9)), draw(st.integers(1, 4)), causal=draw(st.booleans()))
        b = P.strided(draw(st.integers(1, 9)), causal=draw(st.booleans()))
        pat = draw(st.sampled_from([a | b, a & b, P.longformer(0, [1, 7]) | b, a | P.causal("bottom_right")]))
    return pat, L, S


@SETTINGS
@given(counted())
def test_closed_form_counts_equal_the_materialised_mask(prob):
    pat, L, S = prob
    assert pat.nnz(L, S) == int(pat.materialize(L, S).sum()), (pat, L, S)


@pytest.mark.parametrize("pat", [P.dilated(64, 2), P.dilated(5, 7, causal=True), P.strided(64), P.strided(9, causal=False),
                                 P.fixed(64, 8), P.fixed(7, 3, causal=False), P.longformer(128, 1),
                                 P.longformer(5, [0, 100, 2000]), P.bigbird(64), P.bigbird(5, 3, 2, 2, seed=3)], ids=repr)
@pytest.mark.parametrize("L,S", [(1, 1), (1, 300), (300, 1), (257, 300), (1000, 999)])
def test_counts_at_sizes_past_many_blocks(pat, L, S):
    assert pat.nnz(L, S) == int(pat.materialize(L, S).sum())
    assert pat.density(L, S) == pat.nnz(L, S) / (L * S)


@pytest.mark.parametrize("pat", [P.dilated(64, 2), P.strided(64), P.fixed(64, 8), P.longformer(128, 1), P.bigbird(64),
                                 P.strided(3) | P.dilated(2, 5), P.shifted(P.strided(5), 3)], ids=repr)
def test_an_analytic_count_evaluates_at_most_o_l_plus_s_pairs(pat, monkeypatch):
    """What `attnlab list` relies on to show their cost at 4096 x 4096 in milliseconds: ``keep`` is asked
    about at most a few (L + S) pairs (per global token for Longformer), never the L·S grid."""
    assert pat.counts_analytically()
    evaluated = []
    for cls in {type(p) for p in _parts(pat)}:
        orig = cls.keep
        monkeypatch.setattr(cls, "keep", lambda self, i, j, L, S, _orig=orig: _counting(_orig, self, i, j, L, S, evaluated))
    L, S = 3000, 4096  # L < S: shifted needs L + offset <= S
    pat.nnz(L, S)
    assert sum(evaluated) <= 4 * (L + S), sum(evaluated)


def _parts(p):
    yield p
    for name in ("a", "b", "inner"):
        if hasattr(p, name):
            yield from _parts(getattr(p, name))


def _counting(orig, self, i, j, L, S, evaluated):
    m = orig(self, i, j, L, S)
    evaluated.append(torch.broadcast_shapes(i.shape, j.shape).numel())
    return m


def test_patterns_that_count_pair_by_pair_say_so():
    """A per-batch or mask_mod pattern makes no claim it cannot keep."""
    assert not (P.dilated(3, 2) | P.key_padding([5, 3])).counts_analytically()
    assert not P.from_mask_mod(lambda b, h, q, k: (q + k) % 3 == 0).counts_analytically()
    assert P.sliding_window(4).counts_analytically() and P.document([3, 4]).counts_analytically()
