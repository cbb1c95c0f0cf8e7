"""The issue-14 patterns: sliding_window(left=, right=), document, prefix_lm and from_mask_mod.

Oracles are plain Python loops over (i, j) written from each definition; block layouts are checked
against the materialised mask (EMPTY and FULL exact, not merely conservative); ``pattern=p`` against the
float64 reference given ``attn_mask=p.materialize(L, S)``.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import attnlab
from attnlab import kernels
from attnlab import functional as F_
from attnlab import patterns as P
from attnlab import reference
from helpers import TOL, assert_close


def loop_mask(fn, L, S):
    return torch.tensor([[bool(fn(i, j)) for j in range(S)] for i in range(L)], dtype=torch.bool).reshape(L, S)


def doc_oracle(q_lengths, k_lengths, causal, align):
    """keep(i, j) for packed documents, from per-document offsets computed with a Python loop."""
    qdoc, kdoc, qloc, kloc = {}, {}, {}, {}
    pos = 0
    for d, n in enumerate(q_lengths):
        for t in range(n):
            qdoc[pos + t], qloc[pos + t] = d, t
        pos += n
    pos = 0
    for d, n in enumerate(k_lengths):
        for t in range(n):
            kdoc[pos + t], kloc[pos + t] = d, t
        pos += n

    def fn(i, j):
        d = qdoc[i]
        if kdoc[j] != d:
            return False
        if not causal:
            return True
        shift = k_lengths[d] - q_lengths[d] if align == "bottom_right" else 0
        return kloc[j] <= qloc[i] + shift
    return fn


def random_lengths(rng, n_docs, allow_zero=True):
    return [rng.randint(0 if allow_zero else 1, 7) for _ in range(n_docs)]


# -- definitions ---------------------------------------------------------------------------------------
def cases():
    """(pattern, oracle(i, j), L, S) with awkward sizes."""
    rng = random.Random(14)
    out = []
    for left, right in [(2, 2), (0, 3), (3, 0), (1, 4), (-2, 5), (4, -1), (0, 0), (None, 2), (3, None), (-3, 3)]:
        for L, S in [(11, 11), (7, 13), (13, 7)]:
            lo = -float("inf") if left is None else -left
            hi = float("inf") if right is None else right
            out.append((P.sliding_window(left=left, right=right),
                        lambda i, j, lo=lo, hi=hi: lo <= j - i <= hi, L, S))
    out.append((P.sliding_window(left=2, right=1, align="bottom_right"), lambda i, j: -2 <= j - i - 4 <= 1, 3, 7))
    for _ in range(6):
        ql = random_lengths(rng, rng.randint(1, 5))
        kl = ql if rng.random() < 0.5 else random_lengths(rng, len(ql))
        for causal in (False, True):
            align = rng.choice(["top_left", "bottom_right"])
            if sum(ql) and sum(kl):
                out.append((P.document(ql, causal=causal, kv_lengths=kl, align=align),
                            doc_oracle(ql, kl, causal, align), sum(ql), sum(kl)))
    for plen in (0, 1, 4, 20):
        for L, S in [(9, 9), (6, 11), (11, 6)]:
            out.append((P.prefix_lm(plen), lambda i, j, p=plen: j < p or j <= i, L, S))
    out.append((P.prefix_lm(2, align="bottom_right"), lambda i, j: j < 2 or j <= i + 3, 5, 8))
    return out


CASES = cases()


@pytest.mark.parametrize("idx", range(len(CASES)), ids=lambda i: f"{CASES[i][0]!r}-{CASES[i][2]}x{CASES[i][3]}")
def test_materialize_and_nnz_match_definition(idx):
    pat, fn, L, S = CASES[idx]
    expect = loop_mask(fn, L, S)
    assert torch.equal(pat.materialize(L, S), expect), repr(pat)
    assert pat.nnz(L, S) == int(expect.sum()), repr(pat)


def exact_any_all(m, bq, bk):
    L, S = m.shape[-2:]
    nq, nk = -(-L // bq), -(-S // bk)
    a = torch.zeros(nq * bq, nk * bk, dtype=torch.bool)
    f = torch.ones(nq * bq, nk * bk, dtype=torch.bool)
    a[:L, :S], f[:L, :S] = m, m
    return a.view(nq, bq, nk, bk).any(3).any(1), f.view(nq, bq, nk, bk).all(3).all(1)


@pytest.mark.parametrize("idx", range(len(CASES)), ids=lambda i: f"{CASES[i][0]!r}-{CASES[i][2]}x{CASES[i][3]}")
def test_block_layout_is_exact(idx):
    """Analytic bounds: EMPTY exactly where the block keeps nothing, FULL exactly where it keeps all."""
    pat, _, L, S = CASES[idx]
    m = pat.materialize(L, S)
    for bq, bk in [(1, 1), (2, 3), (3, 2), (4, 4), (5, 1), (16, 16)]:
        lay = pat.block_layout(L, S, bq, bk)
        any_, all_ = exact_any_all(m, bq, bk)
        assert torch.equal(lay != P.EMPTY, any_), (repr(pat), bq, bk)
        assert torch.equal(lay == P.FULL, all_ & any_), (repr(pat), bq, bk)


def test_document_layout_exact_on_random_shapes():
    """Many documents (including empty ones) at long lengths, random block shapes."""
    rng = random.Random(3)
    for _ in range(25):
        ql = [rng.randint(0, 40) for _ in range(rng.randint(1, 12))]
        kl = ql if rng.random() < 0.5 else [rng.randint(0, 40) for _ in ql]
        if not sum(ql) or not sum(kl):
            continue
        pat = P.document(ql, causal=rng.random() < 0.5, kv_lengths=kl, align=rng.choice(["top_left", "bottom_right"]))
        L, S = sum(ql), sum(kl)
        m = pat.materialize(L, S)
        bq, bk = rng.randint(1, 33), rng.randint(1, 33)
        lay = pat.block_layout(L, S, bq, bk)
        any_, all_ = exact_any_all(m, bq, bk)
        assert torch.equal(lay != P.EMPTY, any_), (repr(pat), bq, bk)
        assert torch.equal(lay == P.FULL, all_ & any_), (repr(pat), bq, bk)
        assert pat.nnz(L, S) == int(m.sum())


# -- from_mask_mod -----------------------------------------------------------------------------------
def _mods():
    doc_ids = torch.tensor([0] * 5 + [1] * 3 + [2] * 9)  # lengths 5, 3, 9

    def document_causal(b, h, q, k):
        return (doc_ids[q] == doc_ids[k]) & (k <= q)

    return [
        (lambda b, h, q, k: q >= k, P.causal(), 17, 17),
        (lambda b, h, q, k: (q - k <= 3) & (k - q <= 5), P.sliding_window(left=3, right=5), 17, 12),
        (lambda b, h, q, k: (k < 4) | (k <= q), P.prefix_lm(4), 13, 17),
        (document_causal, P.document([5, 3, 9], causal=True), 17, 17),
        (lambda b, h, q, k: (q - k).abs() <= 2, P.sliding_window(2), 9, 9),
    ]


@pytest.mark.parametrize("idx", range(len(_mods())))
def test_from_mask_mod_equals_named_pattern(idx):
    fn, named, L, S = _mods()[idx]
    pat = P.from_mask_mod(fn)
    assert torch.equal(pat.materialize(L, S), named.materialize(L, S))
    assert pat.nnz(L, S) == named.nnz(L, S)
    for bq, bk in [(1, 1), (3, 2), (4, 4), (8, 5), (32, 32)]:
        assert torch.equal(pat.block_layout(L, S, bq, bk), named.block_layout(L, S, bq, bk)), (bq, bk)


def test_from_mask_mod_is_evaluated_on_tensors_and_cached():
    calls = []

    def fn(b, h, q, k):
        calls.append(tuple(torch.broadcast_shapes(q.shape, k.shape)))
        return k <= q

    pat = P.from_mask_mod(fn)
    assert calls == [(1, 1)]  # construction checks the function once on a 1 x 1 grid
    calls.clear()
    lay = pat.block_layout(64, 64, 8, 8)
    n = len(calls)
    assert n >= 1 and all(len(s) == 2 and s[0] * s[1] > 64 for s in calls)  # whole slices, not elements
    assert torch.equal(pat.block_layout(64, 64, 8, 8), lay) and len(calls) == n  # cached
    coarse = pat.block_layout(64, 64, 16, 32)  # a multiple of a cached shape: pooled, not re-evaluated
    assert len(calls) == n
    assert torch.equal(coarse, P.causal().block_layout(64, 64, 16, 32))
    lay[0, 0] = P.EMPTY  # callers (MaskSpec) may edit what they get; the cache must not change
    assert pat.block_layout(64, 64, 8, 8)[0, 0] == P.PARTIAL


def test_from_mask_mod_per_batch():
    lengths = torch.tensor([7, 3, 0])

    def pad(b, h, q, k):
        return k < lengths[b]

    pat = P.from_mask_mod(pad, B=3)
    assert pat.batch_size == 3
    assert torch.equal(pat.materialize(5, 8), P.key_padding([7, 3, 0], max_len=8).materialize(5, 8))
    q, k, v = (torch.randn(3, 2, n, 4, dtype=torch.float64) for n in (5, 8, 8))
    ro, _ = reference.attention(q, k, v, attn_mask=pat.materialize(5, 8))
    for method in ("dense", "sdpa", "tiled", "sparse"):
        out = attnlab.attention(q, k, v, pattern=pat, method=method, block_size=4)
        assert_close(out, ro, **TOL[torch.float64], what=method)


@pytest.mark.parametrize("bad,err,match", [
    (lambda: P.from_mask_mod(3), TypeError, "callable"),
    (lambda: P.from_mask_mod(lambda b, h, q, k: q >= k, H=8), ValueError, "per-head"),
    (lambda: P.from_mask_mod(lambda b, h, q, k: q >= k, B=0), ValueError, "B must be"),
    (lambda: P.from_mask_mod(lambda b, h, q, k: (q - k).float()).materialize(3, 3), TypeError, "bool"),
    (lambda: P.from_mask_mod(lambda b, h, q, k: torch.ones(2, 2, 2, dtype=torch.bool)).materialize(3, 3),
     ValueError, "broadcast"),
    (lambda: P.sliding_window(left=1, right=-2), ValueError, "left \\+ right"),
    (lambda: P.sliding_window(4, left=1), ValueError, "not both"),
    (lambda: P.sliding_window(left=1, right=1, causal=True), ValueError, "right=0"),
    (lambda: P.sliding_window(), ValueError, "window="),
    (lambda: P.sliding_window(left=1.5, right=1), TypeError, "left"),
    (lambda: P.document([3, -1]), ValueError, "lengths"),
    (lambda: P.document([[3, 1]]), ValueError, "lengths"),
    (lambda: P.document([3, 1], kv_lengths=[4]), ValueError, "kv_lengths"),
    (lambda: P.document([3, 1]).materialize(5, 4), ValueError, "L=5"),
    (lambda: P.prefix_lm(-1), ValueError, "prefix_len"),
])
def test_bad_arguments_name_the_argument(bad, err, match):
    with pytest.raises(err, match=match):
        bad()


def test_backward_compatible_spellings_and_parse():
    assert torch.equal(P.sliding_window(3).materialize(9, 9), P.sliding_window(left=3, right=3).materialize(9, 9))
    assert torch.equal(P.sliding_window(3, True).materialize(9, 9), P.sliding_window(left=3, right=0).materialize(9, 9))
    assert torch.equal(P.sliding_window(left=None, right=0).materialize(6, 9), P.causal().materialize(6, 9))
    for pat in [P.sliding_window(left=-2, right=5), P.sliding_window(2, causal=True, align="bottom_right"),
                P.document([3, 0, 4], causal=True), P.document([2, 3], kv_lengths=[4, 1], align="bottom_right"),
                P.prefix_lm(3), P.prefix_lm(2, align="bottom_right")]:
        L, S = (5, 5) if "kv_lengths" in repr(pat) else (7, 7)
        assert torch.equal(P.parse(repr(pat)).materialize(L, S), pat.materialize(L, S)), repr(pat)


# -- pattern= through attention equals attn_mask=materialize(...) -------------------------------------
def _methods():
    return [m for m in F_.METHODS if m != "auto"]


ATTN = [
    (P.sliding_window(left=1, right=3), 11, 11),
    (P.sliding_window(left=-1, right=4), 13, 10),
    (P.sliding_window(left=5, right=0) & P.prefix_lm(3), 12, 12),
    (P.document([4, 0, 6, 1], causal=True), 11, 11),
    (P.document([3, 5], kv_lengths=[6, 2], causal=True, align="bottom_right"), 8, 8),
    (P.prefix_lm(4), 10, 13),
    (P.from_mask_mod(lambda b, h, q, k: ((q + k) % 3) == 0, name="mod3"), 9, 11),
]


@pytest.mark.parametrize("idx", range(len(ATTN)), ids=lambda i: repr(ATTN[i][0]))
@pytest.mark.parametrize("method", _methods())
def test_attention_with_pattern_equals_reference(idx, method):
    pat, L, S = ATTN[idx]
    q, k, v = (torch.randn(2, 3, n, 5, dtype=torch.float64) for n in (L, S, S))
    m = pat.materialize(L, S)
    ro, _ = reference.attention(q, k, v, attn_mask=m)
    refused = attnlab.explain(q, k, v, pattern=pat, block_size=4).refused.get(method)
    if refused and method == "compiled":  # the extension is optional (no compiler, ATTNLAB_NO_EXT=1)
        pytest.skip(f"method='compiled' refused here: {refused}")
    if refused and kernels.get(method).spec.max_queries is not None:
        pytest.skip(f"method={method!r} takes decode shapes only (tests/kernels/test_decode.py runs its patterns)")
    out = attnlab.attention(q, k, v, pattern=pat, method=method, block_size=4)
    assert_close(out, ro, **TOL[torch.float64], what=f"{method} {pat!r}")


@pytest.mark.parametrize("pat", [P.sliding_window(left=9, right=2), P.sliding_window(left=-3, right=12),
                                 P.document([40, 17, 0, 39], causal=True), P.prefix_lm(30)], ids=repr)
def test_sparse_and_tiled_gradients_on_longer_inputs(pat):
    """Long enough for the sparse kernel's bands, rectangles and gathers; gradients against dense."""
    L = S = 96
    q, k, v = (torch.randn(1, 2, n, 4, dtype=torch.float64, requires_grad=True) for n in (L, S, S))
    m = pat.materialize(L, S)
    ro, _ = reference.attention(q, k, v, attn_mask=m)
    gd = torch.autograd.grad(attnlab.attention(q, k, v, attn_mask=m, method="dense").sum(), (q, k, v))
    for method in ("sparse", "tiled"):
        out = attnlab.attention(q, k, v, pattern=pat, method=method, block_size=8)
        assert_close(out, ro, **TOL[torch.float64], what=method)
        g = torch.autograd.grad(out.sum(), (q, k, v))
        for a, b in zip(g, gd):
            assert_close(a, b, atol=1e-10, what=f"{method} grad")


def test_numpy_oracle_for_document_mask():
    """An independent numpy construction of the varlen mask (flash-attn cu_seqlens style)."""
    ql, causal = [3, 5, 1, 6], True
    cu = np.concatenate([[0], np.cumsum(ql)])
    n = int(cu[-1])
    m = np.zeros((n, n), dtype=bool)
    for a, b in zip(cu[:-1], cu[1:]):
        m[a:b, a:b] = np.tril(np.ones((b - a, b - a), dtype=bool)) if causal else True
    assert np.array_equal(P.document(ql, causal=causal).materialize(n, n).numpy(), m)
