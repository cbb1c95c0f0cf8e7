"""Properties of the approximations on small random shapes (hypothesis)."""
from __future__ import annotations

import torch
from helpers import assert_close
from hypothesis import given, settings
from hypothesis import strategies as st

import attnlab.mechanisms as M
from attnlab import reference

SETTINGS = dict(max_examples=25, deadline=None, derandomize=True)


def rand(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


@settings(**SETTINGS)
@given(L=st.integers(1, 40), S=st.integers(1, 40), b=st.integers(1, 9), levels=st.one_of(st.none(), st.integers(0, 4)),
       causal=st.booleans())
def test_hierarchical_weights_are_a_distribution_that_respects_causality(L, S, b, levels, causal):
    """Effective weights: non-negative, rows sum to 1 (or 0 for a row with no visible key), zero above the
    diagonal when causal, and out = weights @ values."""
    q, k, v = rand(1, 2, L, 4, seed=1), rand(1, 2, S, 4, seed=2), rand(1, 2, S, 3, seed=3)
    out, w = M.get("hierarchical", block_size=b, levels=levels)(q, k, v, is_causal=causal, need_weights=True)
    assert (w >= 0).all()
    sums = w.sum(-1)
    visible = torch.ones(L, S, dtype=torch.bool).tril() if causal else torch.ones(L, S, dtype=torch.bool)
    expect = visible.any(-1).double().expand_as(sums)
    if levels == 0:  # block-local only: rows whose neighbourhood has no key get 0
        i, j = torch.arange(L).unsqueeze(1) // b, torch.arange(S).unsqueeze(0) // b
        expect = (visible & ((i - j).abs() <= 1)).any(-1).double().expand_as(sums)
    assert_close(sums, expect, atol=1e-12, what="row sums")
    if causal:
        assert (w[..., ~visible] == 0).all()
    assert_close(w @ v, out, atol=1e-12, what="weights @ v")


@settings(**SETTINGS)
@given(L=st.integers(1, 30), S=st.integers(1, 30), b=st.integers(1, 8), causal=st.booleans())
def test_hierarchical_with_all_levels_sees_every_key(L, S, b, causal):
    """levels=None covers every visible key (each gets positive weight), so nothing is dropped."""
    q, k, v = rand(1, 1, L, 4, seed=4), rand(1, 1, S, 4, seed=5), rand(1, 1, S, 4, seed=6)
    _, w = M.get("hierarchical", block_size=b)(q, k, v, is_causal=causal, need_weights=True)
    visible = torch.ones(L, S, dtype=torch.bool).tril() if causal else torch.ones(L, S, dtype=torch.bool)
    assert (w[0, 0][visible] > 0).all()


@settings(**SETTINGS)
@given(L=st.integers(1, 30), S=st.integers(1, 30), ratio=st.sampled_from([0.1, 0.3, 0.6, 1.0]),
       score=st.sampled_from(["attention", "key_norm"]))
def test_pruning_equals_exact_attention_over_the_keys_it_kept(L, S, ratio, score):
    """Oracle: the float64 reference restricted (by a mask) to the keys pruning kept."""
    q, k, v = rand(1, 2, L, 4, seed=7), rand(1, 2, S, 4, seed=8), rand(1, 2, S, 4, seed=9)
    mech = M.get("token_pruning", keep_ratio=ratio, score=score)
    out, w = mech(q, k, v, need_weights=True)
    kept = (w != 0).any(dim=2, keepdim=True)  # (1, 2, 1, S)
    assert (kept.sum(-1) <= mech.kept(S)).all()
    want, _ = reference.attention(q, k, v, kept.expand(1, 2, L, S))
    assert_close(out, torch.from_numpy(want), atol=1e-10, rtol=1e-9, what="pruning vs oracle on kept keys")


@settings(**SETTINGS)
@given(n=st.integers(1, 40), fmap=st.sampled_from(["elu+1", "relu"]), chunk=st.integers(1, 50))
def test_linear_weights_are_row_stochastic(n, fmap, chunk):
    q, k, v = rand(1, 1, n, 4, seed=10), rand(1, 1, n, 4, seed=11), rand(1, 1, n, 4, seed=12)
    out, w = M.get("linear", feature_map=fmap, chunk_size=chunk)(q, k, v, is_causal=True, need_weights=True)
    assert (w >= 0).all() and (w[0, 0].triu(1) == 0).all()
    sums = w.sum(-1)
    assert ((sums - 1).abs() < 1e-12).logical_or(sums == 0).all()  # relu can leave a row with nothing
    assert_close(w @ v, out, atol=1e-12, what="weights @ v")


@settings(**SETTINGS)
@given(L=st.integers(2, 30), m=st.integers(1, 30))
def test_nystrom_rows_of_effective_weights_sum_to_one(L, m):
    """A = softmax(Q̃K̃ᵀ) is row-stochastic, so A⁺·1 = 1 when A is invertible: F1·A⁺·F3·1 = 1."""
    q, k, v = 0.3 * rand(1, 1, L, 4, seed=13), 0.3 * rand(1, 1, L, 4, seed=14), rand(1, 1, L, 4, seed=15)
    _, w = M.get("nystrom", num_landmarks=m, pinv="exact")(q, k, v, need_weights=True)
    assert_close(w.sum(-1), torch.ones(1, 1, L, dtype=torch.float64), atol=1e-6, what="row sums")
