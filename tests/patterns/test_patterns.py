"""Patterns against loop-written definitions; block layouts are conservative; pattern= equals attn_mask=."""
from __future__ import annotations

import itertools

import pytest
import torch

import attnlab
from attnlab import patterns as P
from attnlab import reference
from helpers import TOL, assert_close


def loop_mask(fn, L, S):
    return torch.tensor([[bool(fn(i, j, L, S)) for j in range(S)] for i in range(L)], dtype=torch.bool).reshape(L, S)


BB_TABLE_CACHE = {}


def definitions():
    """(pattern, oracle(i, j, L, S)) pairs written from the papers' definitions, one loop at a time."""
    layout = torch.tensor([[1, 0, 1], [0, 1, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.bool)
    return [
        (P.causal(), lambda i, j, L, S: j <= i),
        (P.causal("bottom_right"), lambda i, j, L, S: j <= i + S - L),
        (P.sliding_window(2), lambda i, j, L, S: abs(i - j) <= 2),
        (P.sliding_window(3, causal=True), lambda i, j, L, S: 0 <= i - j <= 3),
        (P.dilated(2, 3), lambda i, j, L, S: abs(i - j) <= 6 and (i - j) % 3 == 0),
        (P.dilated(2, 2, causal=True), lambda i, j, L, S: 0 <= i - j <= 4 and (i - j) % 2 == 0),
        (P.strided(3), lambda i, j, L, S: j <= i and (i - j < 3 or (i - j) % 3 == 0)),
        (P.fixed(4, 1), lambda i, j, L, S: j <= i and (i // 4 == j // 4 or j % 4 == 3)),
        (P.fixed(4, 2, causal=False), lambda i, j, L, S: i // 4 == j // 4 or j % 4 >= 2),
        (P.block_sparse(layout, 3), lambda i, j, L, S: bool(layout[i // 3, j // 3])),
        (P.longformer(1, [0, 5]), lambda i, j, L, S: abs(i - j) <= 1 or i in (0, 5) or j in (0, 5)),
        (P.longformer(2, 1), lambda i, j, L, S: abs(i - j) <= 2 or i == 0 or j == 0),
        (P.sliding_window(1) | P.causal(), lambda i, j, L, S: abs(i - j) <= 1 or j <= i),
        (P.sliding_window(4) & P.causal(), lambda i, j, L, S: 0 <= i - j <= 4),
    ]


@pytest.mark.parametrize("idx", range(len(definitions())))
@pytest.mark.parametrize("L,S", [(11, 11), (7, 12), (12, 7), (1, 5)])
def test_materialize_matches_definition(idx, L, S):
    pat, fn = definitions()[idx]
    if "block_sparse" in repr(pat) and (L > 12 or S > 9):
        return
    assert torch.equal(pat.materialize(L, S), loop_mask(fn, L, S)), repr(pat)
    assert pat.density(L, S) == pytest.approx(loop_mask(fn, L, S).float().mean().item())


def test_bigbird_definition():
    pat = P.bigbird(block_size=2, window_blocks=3, global_blocks=1, random_blocks=1, seed=7)
    m = pat.materialize(12, 12)
    table = m[::2, ::2]
    for bi, bj in itertools.product(range(6), range(6)):
        block = m[2 * bi:2 * bi + 2, 2 * bj:2 * bj + 2]
        assert block.all() or not block.any()  # block granular
        if abs(bi - bj) <= 1 or bi == 0 or bj == 0:
            assert table[bi, bj]
    # each query block gets at least its window + global + (up to) one random block, and no more
    extra = table.sum(1) - torch.tensor([sum(abs(bi - bj) <= 1 or bi == 0 or bj == 0 for bj in range(6))
                                         for bi in range(6)])
    assert ((extra == 0) | (extra == 1)).all()
    assert torch.equal(m, P.bigbird(2, 3, 1, 1, seed=7).materialize(12, 12))  # seeded: reproducible


ALL = [p for p, _ in definitions()] + [P.bigbird(2, 3, 1, 2, seed=1), P.key_padding([9, 4, 0])]


@pytest.mark.parametrize("pat", ALL, ids=repr)
@pytest.mark.parametrize("bq,bk", [(1, 1), (2, 3), (4, 4), (5, 2), (16, 16)])
def test_block_layout_is_conservative_and_exact_where_it_claims(pat, bq, bk):
    L, S = 11, 9
    if "block_sparse" in repr(pat):
        L, S = 12, 9
    m = pat.materialize(L, S)
    if pat.batch_size:
        m_any, m_all = m.any(0)[0], m.all(0)[0]
    else:
        m_any = m_all = m
    lay = pat.block_layout(L, S, bq, bk)
    assert lay.shape == (-(-L // bq), -(-S // bk))
    for qi, ki in itertools.product(range(lay.shape[0]), range(lay.shape[1])):
        blk_any = m_any[qi * bq:(qi + 1) * bq, ki * bk:(ki + 1) * bk]
        blk_all = m_all[qi * bq:(qi + 1) * bq, ki * bk:(ki + 1) * bk]
        if lay[qi, ki] == P.EMPTY:
            assert not blk_any.any(), (qi, ki)
        if lay[qi, ki] == P.FULL:
            assert blk_all.all(), (qi, ki)


def test_band_layouts_are_tight():
    """Analytic bounds should not waste work: a sliding window marks exactly the blocks it touches."""
    pat = P.sliding_window(8, causal=True)
    lay = pat.block_layout(64, 64, 8, 8)
    m = pat.materialize(64, 64).view(8, 8, 8, 8)
    assert torch.equal(lay != P.EMPTY, m.any(3).any(1))
    assert torch.equal(lay == P.FULL, m.all(3).all(1))


@pytest.mark.parametrize("pat", ALL, ids=repr)
@pytest.mark.parametrize("method", ["dense", "sdpa", "tiled", "sparse"])
def test_pattern_equals_materialized_mask(pat, method):
    L, S = (12, 9) if "block_sparse" in repr(pat) else (11, 9)
    B = pat.batch_size or 2
    q, k, v = (torch.randn(B, 2, n, 4, dtype=torch.float64) for n in (L, S, S))
    m = pat.materialize(L, S)
    ro, _ = reference.attention(q, k, v, attn_mask=m)
    out_p = attnlab.attention(q, k, v, pattern=pat, method=method, block_size=4)
    out_m = attnlab.attention(q, k, v, attn_mask=m, method=method, block_size=4)
    assert_close(out_p, ro, **TOL[torch.float64], what=f"{method} pattern")
    assert_close(out_m, out_p, **TOL[torch.float64], what=f"{method} pattern vs mask")


def test_converters_polarity():
    kpm = torch.tensor([[False, False, True], [False, True, True]])  # nn.MultiheadAttention: True = ignore
    hf = torch.tensor([[1, 1, 0], [1, 0, 0]])  # Hugging Face: 1 = attend
    a = P.from_key_padding_mask(kpm).materialize(2, 3)
    b = P.from_hf_attention_mask(hf).materialize(2, 3)
    c = P.key_padding([2, 1]).materialize(2, 3)
    assert a.shape == (2, 1, 2, 3)
    assert torch.equal(a, b) and torch.equal(a, c)
    assert torch.equal(a[1, 0, 0], torch.tensor([True, False, False]))


def test_flops_and_density_follow_nnz():
    pat = P.sliding_window(4, causal=True)
    n = 64
    nnz = int(pat.materialize(n, n).sum())
    assert pat.nnz(n, n) == nnz
    assert pat.flops(n, n, 16, 8) == 2 * nnz * (16 + 8)


@pytest.mark.parametrize("bad,err", [
    (lambda: P.sliding_window(-1), ValueError),
    (lambda: P.sliding_window(2.5), TypeError),
    (lambda: P.dilated(2, 0), ValueError),
    (lambda: P.fixed(4, 5), ValueError),
    (lambda: P.block_sparse(torch.ones(3), 2), ValueError),
    (lambda: P.causal("middle"), ValueError),
    (lambda: P.key_padding([3, -1]), ValueError),
    (lambda: P.from_key_padding_mask(torch.ones(2, 3, dtype=torch.long)), TypeError),
    (lambda: P.causal() & torch.ones(2, 2), TypeError),
    (lambda: P.block_sparse(torch.ones(2, 2), 2).materialize(8, 4), ValueError),
])
def test_bad_pattern_arguments(bad, err):
    with pytest.raises(err):
        bad()


def test_pattern_batch_mismatch_is_refused():
    q = torch.randn(3, 2, 4, 8)
    with pytest.raises(ValueError, match="batch size"):
        attnlab.attention(q, q, q, pattern=P.key_padding([4, 2]))


@pytest.mark.parametrize("pat", [P.sliding_window(9, causal=True), P.sliding_window(5), P.longformer(4, 2),
                                 P.sliding_window(7) & P.key_padding([90, 61]), P.bigbird(8, 3, 1, 1, seed=3),
                                 P.causal() | P.sliding_window(3),
                                 # translation invariant but not bands: the kernel reuses one mask block per diagonal
                                 P.dilated(5, 3, causal=True), P.dilated(4, 2), P.strided(6), P.strided(5, causal=False)],
                         ids=repr)
@pytest.mark.parametrize("L,S", [(96, 96), (101, 90)])
def test_sparse_runs_bands_rectangles_and_gathers(pat, L, S):
    """Long enough that the sparse kernel uses band views, rectangles and gathers; values and grads exact."""
    q, k, v = (torch.randn(2, 2, n, 4, dtype=torch.float64, requires_grad=True) for n in (L, S, S))
    m = pat.materialize(L, S)
    ro, _ = reference.attention(q, k, v, attn_mask=m)
    out = attnlab.attention(q, k, v, pattern=pat, method="sparse", block_size=8)
    assert_close(out, ro, **TOL[torch.float64], what="sparse")
    g = torch.autograd.grad(out.sum(), (q, k, v))
    gd = torch.autograd.grad(attnlab.attention(q, k, v, attn_mask=m, method="dense").sum(), (q, k, v))
    for a, b in zip(g, gd):
        assert_close(a, b, atol=1e-10, what="grad")


@pytest.mark.parametrize("bq,bk", [(1, 1), (2, 3), (3, 2), (5, 5), (8, 4), (16, 16)])
def test_block_table_layouts_are_tight(bq, bk):
    """Block tables (BigBird, block_sparse) give exact layouts at any block size, finer or coarser."""
    g = torch.Generator().manual_seed(3)
    pats = [P.bigbird(2, 3, 1, 1, seed=4), P.block_sparse(torch.rand(7, 6, generator=g) < 0.4, 2)]
    L, S = 13, 11
    for pat in pats:
        m = pat.materialize(L, S)
        x = torch.zeros(-(-L // bq) * bq, -(-S // bk) * bk, dtype=torch.bool)
        x[:L, :S] = m
        lay = pat.block_layout(L, S, bq, bk)
        blocks = x.view(lay.shape[0], bq, lay.shape[1], bk)
        assert torch.equal(lay != P.EMPTY, blocks.any(3).any(1)), repr(pat)
        y = torch.ones_like(x)
        y[:L, :S] = m
        assert torch.equal(lay == P.FULL, y.view_as(blocks).all(3).all(1)), repr(pat)


@pytest.mark.parametrize("pat", [P.causal(), P.causal("bottom_right"), P.sliding_window(3), P.full(),
                                 P.sliding_window(2, causal=True, align="bottom_right"), P.bigbird(3, 3, 1, 1, seed=5),
                                 P.block_sparse(torch.rand(6, 6, generator=torch.Generator().manual_seed(2)) < 0.5, 3)],
                         ids=repr)
@pytest.mark.parametrize("L,S", [(1, 1), (7, 12), (12, 7), (16, 16), (0, 5)])
def test_fast_nnz_equals_materialised_count(pat, L, S):
    """Bands and block tables count kept pairs arithmetically; the count must equal the mask's."""
    assert pat.nnz(L, S) == int(pat.materialize(L, S).sum())


@pytest.mark.parametrize("block,summary,causal", [(4, 1, True), (4, 2, False), (6, 4, True), (5, 0, False),
                                                  (8, 8, True)])
@pytest.mark.parametrize("bq,bk", [(1, 1), (2, 3), (4, 2), (8, 1), (12, 4)])
def test_fixed_layouts_are_analytic_and_tight(block, summary, causal, bq, bk):
    """fixed's layout comes from its own bounds (no L×S pass) and marks exactly the blocks it touches."""
    pat = P.fixed(block, summary, causal)
    L, S = 23, 19
    nq, nk = -(-L // bq), -(-S // bk)
    qlo, klo = (torch.arange(nq) * bq).unsqueeze(1), (torch.arange(nk) * bk).unsqueeze(0)
    assert pat.bounds(qlo, (qlo + bq - 1).clamp(max=L - 1), klo, (klo + bk - 1).clamp(max=S - 1), L, S) is not None
    x = torch.zeros(nq * bq, nk * bk, dtype=torch.bool)
    x[:L, :S] = pat.materialize(L, S)
    assert torch.equal(pat.block_layout(L, S, bq, bk) != P.EMPTY, x.view(nq, bq, nk, bk).any(3).any(1))


@pytest.mark.parametrize("causal", [True, False])
def test_fixed_pattern_skips_work_on_narrow_key_blocks(causal):
    """Every query block of fixed touches every 64-key block (a summary column in each), so square blocks
    skip nothing; the planner takes narrow key blocks instead, and values and gradients stay exact."""
    pat = P.fixed(64, 8, causal)
    L = 2048
    q, k, v = (torch.randn(1, 2, L, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    plan = attnlab.explain(q, k, v, pattern=pat)
    bq, bk = plan.block_size
    assert plan.method == "sparse" and bk < bq and bq % 64 == 0
    square = attnlab.explain(q, k, v, pattern=pat, block_size=64)
    assert plan.flops["sparse"] < square.flops["sparse"] / 2
    out = attnlab.attention(q, k, v, pattern=pat)
    ro, _ = reference.attention(q, k, v, attn_mask=pat.materialize(L, L))
    assert_close(out, ro, **TOL[torch.float64], what="fixed, narrow key blocks")
    g = torch.autograd.grad(out.sum(), (q, k, v))
    gd = torch.autograd.grad(attnlab.attention(q, k, v, attn_mask=pat.materialize(L, L), method="dense").sum(),
                             (q, k, v))
    for a, b in zip(g, gd):
        assert_close(a, b, atol=1e-10, what="grad")
