"""attnlab.patterns.create_block_mask against torch's create_block_mask (the oracle: it evaluates every pair),
conversions between torch BlockMask and patterns, adjust, and the pictures (issue 24 item 4).

Masks follow attention-gym (causal, sliding window, prefix-LM, document, their &) plus ones chosen to reach
each step of the build: a mask the interval table cannot read (grid), a one-pair hole whose corner probes
all agree (pairs evaluated), non-monotone captured ids (range table), per-batch and per-head masks.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import and_masks, noop_mask, or_masks
from torch.nn.attention.flex_attention import create_block_mask as torch_cbm

import attnlab
from attnlab import patterns as P
from attnlab import reference, viz
from attnlab.patterns import intervals
from helpers import TOL, assert_close

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

F64 = TOL[torch.float64]


def _docs(n, seed=0, mean=60):
    """Document ids [n] of random lengths (some shorter than a block, some longer)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 2 * mean, (n,), generator=g)
    lens = lens[: int((lens.cumsum(0) < n).sum())]
    lens = torch.cat([lens, torch.tensor([n - int(lens.sum())])])
    return torch.repeat_interleave(torch.arange(len(lens)), lens)


DOC = _docs(1200)
PERM_DOC = torch.randperm(int(DOC.max()) + 1, generator=torch.Generator().manual_seed(1))[DOC]  # not monotone


def causal(b, h, q, kv):
    return q >= kv


def sliding_window(b, h, q, kv):
    return (q - kv).abs() <= 150


def sliding_causal(b, h, q, kv):
    return (q >= kv) & (q - kv <= 150)


def prefix_lm(b, h, q, kv):
    return (kv <= 77) | (q >= kv)


def document(b, h, q, kv):
    return DOC[q] == DOC[kv]


def shuffled_document(b, h, q, kv):
    return PERM_DOC[q] == PERM_DOC[kv]


causal_window_document = and_masks(causal, sliding_window, document)

PREFIX = torch.tensor([5, 300, 0])


def per_batch_prefix(b, h, q, kv):
    return (kv < PREFIX[b]) | (q >= kv)


def per_head_window(b, h, q, kv):
    return (q >= kv) & (q - kv <= 40 + 90 * h)


def one_hole(b, h, q, kv):  # every probe of the block with the hole agrees: its pairs must be evaluated
    return (q != 203) | (kv != 150)


def dilated(b, h, q, kv):  # % of an index difference: intervals give up inside a period, probes decide
    return ((q - kv) % 3 == 0) & (q >= kv)


def with_python_float(b, h, q, kv):  # torch.sin is outside the interval table: the grid, in strips
    return torch.sin(q.double() * 0.01) > torch.cos(kv.double() * 0.02)


MASKS = {
    "causal": (causal, None, None), "sliding_window": (sliding_window, None, None),
    "sliding_causal": (sliding_causal, 1, 1), "prefix_lm": (prefix_lm, 2, 2), "document": (document, None, None),
    "causal_window_document": (causal_window_document, None, None),
    "shuffled_document": (shuffled_document, None, None), "per_batch_prefix": (per_batch_prefix, 3, 2),
    "per_head_window": (per_head_window, 1, 3), "one_hole": (one_hole, None, None), "dilated": (dilated, None, None),
    "noop": (noop_mask, 2, None), "or": (or_masks(prefix_lm, sliding_window), None, None),
    "sin": (with_python_float, None, None),
}
SHAPES = [(1000, 1000, 128), (997, 1200, (64, 32)), (1200, 700, 100)]


def _assert_same(ours, theirs, what):
    a, t = ours.as_tuple(), theirs.as_tuple()
    assert tuple(a[:2]) == tuple(t[:2]), f"{what}: seq_lengths / BLOCK_SIZE {a[:2]} != {t[:2]}"
    for name, x, y in zip(("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"), a[2:6], t[2:6]):
        if x is None or y is None:
            assert x is None and y is None, f"{what}: {name} {x} != {y}"
            continue
        assert x.shape == y.shape and x.dtype == y.dtype, f"{what}: {name} {x.shape} {x.dtype} != {y.shape} {y.dtype}"
        if not torch.equal(x, y):
            bad = (x != y).nonzero()[0].tolist()
            raise AssertionError(f"{what}: {name} differs first at {bad}: {x[tuple(bad)]} != {y[tuple(bad)]}")


@pytest.mark.parametrize("L, S, block", SHAPES)
@pytest.mark.parametrize("name", sorted(MASKS))
def test_equals_torch_create_block_mask(name, L, S, block):
    fn, B, H = MASKS[name]
    if name in ("document", "causal_window_document", "shuffled_document"):
        L = S = 1200  # the ids cover 1200 positions
    st = P.BuildStats()
    ours = P.create_block_mask(fn, B, H, L, S, BLOCK_SIZE=block, stats=st)
    _assert_same(ours, torch_cbm(fn, B, H, L, S, device="cpu", BLOCK_SIZE=block), f"{name} {L}x{S} block {block}")
    if name == "sin":
        assert st.how.startswith("grid"), st
    elif name == "one_hole":
        assert st.evaluated_blocks >= 1, st  # the block whose probes all agree is evaluated pair by pair
    elif name not in ("dilated", "shuffled_document"):  # periodic / unsorted ids: intervals prove less
        assert st.how == "intervals" and st.evaluated_blocks == 0, st  # no pair beyond the probes


def test_torch_keywords():
    # attention-gym passes _compile=True; separate_full_blocks=False lists every block as partial
    for fn in (sliding_causal, causal_window_document):
        ours = P.create_block_mask(fn, None, 2, 1200, 1200, "cpu", 64, _compile=True, separate_full_blocks=False)
        theirs = torch_cbm(fn, None, 2, 1200, 1200, device="cpu", BLOCK_SIZE=64, separate_full_blocks=False)
        assert ours.full_kv_num_blocks is None and theirs.full_kv_num_blocks is None
        _assert_same(ours, theirs, f"{fn} separate_full_blocks=False")
    with pytest.raises(ValueError, match="compute_dq_write_order"):
        P.create_block_mask(causal, None, None, 8, 8, compute_dq_write_order=True)


def test_block_size_one_and_tiny_lengths():
    for fn in (causal, sliding_causal, prefix_lm, one_hole):
        for L, S, bs in ((1, 1, 1), (7, 3, 1), (3, 300, 2), (43, 37, 1)):
            _assert_same(P.create_block_mask(fn, None, None, L, S, BLOCK_SIZE=bs),
                         torch_cbm(fn, None, None, L, S, device="cpu", BLOCK_SIZE=bs), f"{fn.__name__} {L}x{S}/{bs}")


def test_long_causal_window_document_evaluates_no_grid():
    # 2^18 tokens, blocks of 128: a 2048 x 2048 block grid; the build stays O(kept blocks), with no pair
    # evaluated beyond 8 probes per boundary block (torch's would evaluate 2^36 pairs)
    n = 1 << 18
    doc = _docs(n, seed=2, mean=3000)

    def cwd(b, h, q, kv):
        return (q >= kv) & (q - kv <= 1024) & (doc[q] == doc[kv])

    st = P.BuildStats()
    p = P.create_block_mask(cwd, None, None, n, n, BLOCK_SIZE=128, output="pattern", stats=st)
    nq = n // 128
    assert st.how == "intervals" and st.pairs == 0, st
    assert st.interval_tiles < 40 * nq, st  # O(nq · levels), not O(nq²)
    # spot-check rows against the exact pairs of those blocks
    for qb in (0, 1, 777, nq - 1):
        q = torch.arange(qb * 128, qb * 128 + 128)
        kv = torch.arange(max(0, qb - 10) * 128, min(n, (qb + 2) * 128))
        m = cwd(0, 0, q[:, None], kv[None, :]).view(128, -1, 128).permute(1, 0, 2).flatten(1)  # (key blocks, pairs)
        want = torch.where(m.all(1), P.FULL, torch.where(m.any(1), P.PARTIAL, P.EMPTY))
        got = p.codes()[0, qb, kv[::128] // 128]
        assert torch.equal(got, want.to(torch.int8)), (qb, got, want)


def test_intervals_are_sound_on_random_tiles():
    # Note [Sound intervals]: on random tiles, "all" never claims a dropped pair, "not any" never drops a kept one
    g = torch.Generator().manual_seed(0)
    fns = [causal, sliding_window, prefix_lm, document, shuffled_document, dilated, one_hole, causal_window_document,
           lambda b, h, q, kv: torch.where(q > 600, kv < q // 2, (kv - 3) * 2 >= q.clamp(min=10, max=900)),
           lambda b, h, q, kv: torch.minimum(q, kv + 7) - torch.maximum(q % 64, kv) > -5]
    for fn in fns:
        qlo = torch.randint(0, 1100, (300,), generator=g)
        klo = torch.randint(0, 1100, (300,), generator=g)
        qhi = torch.clamp(qlo + torch.randint(0, 90, (300,), generator=g), max=1199)
        khi = torch.clamp(klo + torch.randint(0, 90, (300,), generator=g), max=1199)
        all_, any_, _ = intervals.evaluate(fn, 0, 0, qlo, qhi, klo, khi)
        for t in range(300):
            m = fn(torch.tensor(0), torch.tensor(0), torch.arange(qlo[t], qhi[t] + 1)[:, None],
                   torch.arange(klo[t], khi[t] + 1)[None, :])
            m = torch.broadcast_to(m, (int(qhi[t] - qlo[t] + 1), int(khi[t] - klo[t] + 1)))
            assert not bool(all_[t]) or bool(m.all()), (fn, t)
            assert bool(any_[t]) or not bool(m.any()), (fn, t)


def test_pattern_output_equals_torch_layout():
    for fn, B in ((causal_window_document, None), (per_batch_prefix, 3)):
        p = P.create_block_mask(fn, B, None, 1200, 1200, BLOCK_SIZE=64, output="pattern")
        t = torch_cbm(fn, B, None, 1200, 1200, device="cpu", BLOCK_SIZE=64)
        assert torch.equal(p.codes(), P.block_codes(t)[:, 0]), fn
        _assert_same(P.to_block_mask(p), t, "to_block_mask(pattern output)")
        assert p.batch_size == B


def test_per_head_mask_refused_as_pattern():
    with pytest.raises(ValueError, match="reads h"):
        P.create_block_mask(per_head_window, 1, 3, 300, 300, BLOCK_SIZE=64, output="pattern")


@pytest.mark.parametrize("name", ["causal", "causal_window_document", "prefix_lm", "per_batch_prefix", "one_hole"])
def test_from_block_mask_runs_attention_exactly(name):
    fn, B, _ = MASKS[name]
    B = B or 2
    L = 1200 if "document" in name else 203
    bm = torch_cbm(fn, B if name == "per_batch_prefix" else None, None, L, L, device="cpu", BLOCK_SIZE=64)
    p = P.from_block_mask(bm, B=B)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, 2, L, 8, generator=g, dtype=torch.float64) for _ in range(3))
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    mask = torch.stack([torch.broadcast_to(fn(torch.tensor(b), torch.tensor(0), i, j), (L, L)) for b in range(B)])
    want = reference.attention(q, k, v, attn_mask=mask[:, None])[0]
    assert_close(attnlab.attention(q, k, v, pattern=p), want, **F64, what=name)
    assert torch.equal(p.materialize(L, L).reshape(-1, L, L).expand(B, L, L), mask)


def test_from_block_mask_block_table_and_per_head_refusal():
    # from_kv_blocks without a mask_mod: partial blocks are kept whole, as torch's kernels read them
    kv_num = torch.tensor([[[1, 2]]], dtype=torch.int32)
    kv_idx = torch.tensor([[[[1, 0], [0, 1]]]], dtype=torch.int32)
    bm = torch.nn.attention.flex_attention.BlockMask.from_kv_blocks(kv_num, kv_idx, BLOCK_SIZE=4, seq_lengths=(8, 8))
    m = P.from_block_mask(bm).materialize(8, 8)
    want = torch.zeros(8, 8, dtype=torch.bool)
    want[:4, 4:] = True
    want[4:, :] = True
    assert torch.equal(m, want)
    with pytest.raises(ValueError, match="heads"):
        P.from_block_mask(torch_cbm(per_head_window, 1, 3, 300, 300, device="cpu", BLOCK_SIZE=64))


def test_to_block_mask_from_patterns():
    L, S = 700, 900
    for pat, fn in ((P.causal(), causal), (P.sliding_window(150) & P.causal(), sliding_causal),
                    (P.prefix_lm(78), prefix_lm)):
        _assert_same(P.to_block_mask(pat, L, S, BLOCK_SIZE=64), torch_cbm(fn, None, None, L, S, device="cpu", BLOCK_SIZE=64),
                     repr(pat))
        bm = P.to_block_mask(pat, L, S, BLOCK_SIZE=64)
        i, j = torch.arange(L)[:, None], torch.arange(S)[None, :]
        assert torch.equal(bm.mask_mod(torch.tensor(0), torch.tensor(0), i, j), pat.materialize(L, S))


def _bottom_right_causal(L, S):
    def br_causal(b, h, q, kv):
        return q + (S - L) >= kv
    return br_causal


@pytest.mark.parametrize("new", [(1, 1000), (37, 1000), (300, 700), (128, 640)])
def test_adjust_bottom_right_equals_a_fresh_mask(new):
    L, S = 1000, 1000
    bm = torch_cbm(_bottom_right_causal(L, S), None, None, L, S, device="cpu", BLOCK_SIZE=64)
    got = P.adjust(bm, *new)
    want = torch_cbm(_bottom_right_causal(*new), None, None, *new, device="cpu", BLOCK_SIZE=64)
    _assert_same(got, want, f"adjust to {new}")
    # torch's _adjust keeps the top-left corner: for the last query rows it keeps the first ones instead
    if new[0] < L:
        top = P.block_codes(bm._adjust(*new))
        assert not torch.equal(top[..., :P.block_codes(want).shape[-1]], P.block_codes(want))


def test_adjust_top_left_equals_a_fresh_mask_and_pattern_round_trip():
    # top_left keeps positions, as torch's _adjust; blocks found again, so a block the new lengths clip is
    # PARTIAL as in a fresh create_block_mask (torch's _adjust keeps it FULL)
    bm = torch_cbm(sliding_causal, None, None, 1000, 1000, device="cpu", BLOCK_SIZE=64)
    _assert_same(P.adjust(bm, 300, 500, align="top_left"),
                 torch_cbm(sliding_causal, None, None, 300, 500, device="cpu", BLOCK_SIZE=64), "top_left")
    p = P.create_block_mask(sliding_causal, None, None, 1000, 1000, BLOCK_SIZE=64, output="pattern")
    a = P.adjust(p, 333, 444)
    want = P.create_block_mask(lambda b, h, q, kv: sliding_causal(b, h, q + 667, kv + 556), None, None, 333, 444,
                               BLOCK_SIZE=64, output="pattern")
    assert torch.equal(a.codes(), want.codes()) and a.lengths == (333, 444)
    tbl = torch.nn.attention.flex_attention.BlockMask.from_kv_blocks(
        torch.tensor([[[1, 1]]], dtype=torch.int32), torch.tensor([[[[0, 1], [1, 0]]]], dtype=torch.int32),
        BLOCK_SIZE=64, seq_lengths=(128, 128))
    with pytest.raises(ValueError, match="whole blocks"):
        P.adjust(tbl, 100, 128)
    with pytest.raises(ValueError, match="new_q_len"):
        P.adjust(bm, 1001, 10)


def test_text_and_figure(tmp_path):
    bm = torch_cbm(per_head_window, 1, 3, 640, 640, device="cpu", BLOCK_SIZE=64)
    text = P.block_mask_text(bm)
    st = P.block_mask_stats(bm, E=16)
    assert len(st) == 3 and all(s["full"] + s["partial"] + s["empty"] == 100 for s in st)
    # causal window 40 at blocks of 64: the diagonal only, 10 partial blocks; pairs computed 10 · 64²
    assert st[0]["partial"] == 19 and st[0]["full"] == 0
    assert st[0]["computed_pairs"] == 19 * 64 * 64
    assert st[0]["flops_skipped"] == 2 * (640 * 640 - 19 * 64 * 64) * 32
    assert "(b=0, h=2)" in text and text.count("\n  ") == 30 and "+" in text and "#" in text
    out = viz.plot_block_mask(bm, tmp_path / "bm.png")
    assert out.stat().st_size > 1000


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="device"):
        P.create_block_mask(causal, None, None, 8, 8, device="meta")
    with pytest.raises(TypeError, match="BLOCK_SIZE"):
        P.create_block_mask(causal, None, None, 8, 8, BLOCK_SIZE="big")
    with pytest.raises(ValueError, match="output"):
        P.create_block_mask(causal, None, None, 8, 8, output="dense")
    with pytest.raises(ValueError, match="Q_LEN"):
        P.create_block_mask(causal, None, None, 0, 8)
    with pytest.raises(TypeError, match="bool tensor"):
        P.create_block_mask(lambda b, h, q, kv: torch.sin(q * 1.0), None, None, 8, 8)
    p = P.create_block_mask(causal, None, None, 100, 100, BLOCK_SIZE=32, output="pattern")
    with pytest.raises(ValueError, match="adjust"):
        p.materialize(90, 100)


def test_flex_attention_with_our_block_mask():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 2, 1200, 8, generator=g, dtype=torch.float64) for _ in range(3))
        bm = P.create_block_mask(causal_window_document, None, None, 1200, 1200, BLOCK_SIZE=64)
        i, j = torch.arange(1200)[:, None], torch.arange(1200)[None, :]
        want = reference.attention(q, k, v, attn_mask=causal_window_document(torch.tensor(0), torch.tensor(0), i, j))[0]
        assert_close(attnlab.flex_attention(q, k, v, block_mask=bm), want, **F64, what="flex with our BlockMask")


@pytest.mark.parametrize("fn, want", [
    (causal, (None, 0)), (sliding_causal, (150, 0)), (sliding_window, (150, 150)),
    (lambda b, h, q, kv: (kv - q >= -7) & (kv - q <= 300), (7, 300)),
])
def test_as_band_proves_bands(fn, want):
    L, S = 1000, 1100
    p = P.as_band(fn, L, S, BLOCK_SIZE=64)
    assert p is not None and p.band(L, S) == (-math.inf if want[0] is None else -want[0], want[1])
    i, j = torch.arange(L)[:, None], torch.arange(S)[None, :]
    assert torch.equal(p.materialize(L, S), torch.broadcast_to(fn(torch.tensor(0), torch.tensor(0), i, j), (L, S)))


@pytest.mark.parametrize("fn", [one_hole, prefix_lm, document, per_head_window,
                                lambda b, h, q, kv: (q >= kv) & ((q - kv != 500) | (q < 900))])
def test_as_band_refuses_what_is_not_one(fn):
    # a band everywhere but one pair (or one diagonal segment) must be refused: the proof sees every pair
    assert P.as_band(fn, 1000, 1000, BLOCK_SIZE=64) is None


def test_flex_runs_a_band_block_mask_as_the_band_pattern():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 300, 8, generator=g, dtype=torch.float64) for _ in range(3))
    bm = torch_cbm(sliding_causal, None, None, 300, 300, device="cpu", BLOCK_SIZE=32)
    plan = attnlab.flex_plan(q, k, v, block_mask=bm)
    assert "proved equal to sliding_window(left=150, right=0)" in plan.mask, plan.mask
    i, j = torch.arange(300)[:, None], torch.arange(300)[None, :]
    want = reference.attention(q, k, v, attn_mask=sliding_causal(0, 0, i, j))[0]
    assert_close(attnlab.flex_attention(q, k, v, block_mask=bm), want, **F64, what="band BlockMask")
    hole = torch_cbm(one_hole, None, None, 300, 300, device="cpu", BLOCK_SIZE=32)
    assert "proved" not in attnlab.flex_plan(q, k, v, block_mask=hole).mask


def _boundary_hole(b, h, q, kv):  # sliding_causal but one pair on the band's edge, inside a PARTIAL block
    return (q >= kv) & (q - kv <= 150) & ((q != 203) | (kv != 203))


def test_as_band_on_given_blocks_sees_one_pair():
    # blocks=: the proof on the PARTIAL blocks alone (flex's BlockMask path) still sees a single pair there
    bm = torch_cbm(sliding_causal, None, None, 300, 300, device="cpu", BLOCK_SIZE=32)
    pq, pk = (P.block_codes(bm)[0, 0] == P.PARTIAL).nonzero(as_tuple=True)
    assert int(((pq == 203 // 32) & (pk == 203 // 32)).sum()) == 1
    assert P.as_band(sliding_causal, 300, 300, 32, blocks=(pq, pk)).band(300, 300) == (-150, 0)
    assert P.as_band(_boundary_hole, 300, 300, 32, blocks=(pq, pk)) is None
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 300, 8, generator=g, dtype=torch.float64) for _ in range(3))
    hole = torch_cbm(_boundary_hole, None, None, 300, 300, device="cpu", BLOCK_SIZE=32)
    assert "proved" not in attnlab.flex_plan(q, k, v, block_mask=hole).mask
    i, j = torch.arange(300)[:, None], torch.arange(300)[None, :]
    want = reference.attention(q, k, v, attn_mask=_boundary_hole(0, 0, i, j))[0]
    assert_close(attnlab.flex_attention(q, k, v, block_mask=hole), want, **F64, what="band with a hole")


def test_band_block_mask_follows_torch_on_full_blocks():
    # torch never calls mask_mod on a FULL block: a BlockMask whose FULL blocks are the band's runs as the
    # band even where its mask_mod (here: the band minus one pair inside a FULL block) would drop a pair
    from torch.nn.attention.flex_attention import BlockMask
    good = torch_cbm(sliding_causal, None, None, 300, 300, device="cpu", BLOCK_SIZE=32)
    full_hole = lambda b, h, q, kv: sliding_causal(b, h, q, kv) & ((q != 100) | (kv != 40))  # noqa: E731
    assert int(P.block_codes(good)[0, 0, 100 // 32, 40 // 32]) == P.FULL
    bm = BlockMask.from_kv_blocks(good.kv_num_blocks, good.kv_indices, good.full_kv_num_blocks,
                                  good.full_kv_indices, BLOCK_SIZE=32, mask_mod=full_hole, seq_lengths=(300, 300))
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 300, 8, generator=g, dtype=torch.float64) for _ in range(3))
    assert "proved equal to sliding_window(left=150, right=0)" in attnlab.flex_plan(q, k, v, block_mask=bm).mask
    i, j = torch.arange(300)[:, None], torch.arange(300)[None, :]
    want = reference.attention(q, k, v, attn_mask=sliding_causal(0, 0, i, j))[0]  # the pair (100, 40) kept
    assert_close(attnlab.flex_attention(q, k, v, block_mask=bm), want, **F64, what="torch's semantics on FULL blocks")


@pytest.mark.parametrize("L, S, block", [(1000, 1100, 64), (300, 257, 32), (17, 400, 16), (1024, 768, 64), (512, 512, 32)])
def test_partial_tiles_give_dead_keys_and_kernel_tiles(L, S, block):
    # Note [PARTIAL tiles evaluated once]: dead keys and the compiled kernel's mask tiles from one evaluation
    from attnlab.kernels import compiled as compiled_kernel
    from attnlab.patterns.base import Pattern
    g = torch.Generator().manual_seed(L)
    doc = torch.randint(0, 4, (max(L, S),), generator=g).sort().values
    for fn in (lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv), lambda b, h, q, kv: (kv % 7 == 0) & (q >= kv)):
        p = P.create_block_mask(fn, None, None, L, S, BLOCK_SIZE=block, output="pattern")
        i, j = torch.arange(L)[:, None], torch.arange(S)[None, :]
        want = torch.broadcast_to(fn(0, 0, i, j), (L, S))
        assert p.partial_tiles(L, S) is not None
        assert torch.equal(p.dead_keys(L, S)[0], ~want.any(0))
        assert torch.equal(Pattern.dead_keys(p, L, S), p.dead_keys(L, S))  # the generic path agrees
        visit, tid, tiles = compiled_kernel._pattern_layout(p, L, S, block, block)
        nq, nk = -(-L // block), -(-S // block)
        dense = torch.zeros(nq * block, nk * block, dtype=torch.bool)
        for qb, kb in visit[0].nonzero().tolist():
            t = tid[0, qb, kb]
            dense[qb * block:(qb + 1) * block, kb * block:(kb + 1) * block] = tiles[t].bool() if t >= 0 else True
        assert torch.equal(dense[:L, :S], want)


@pytest.mark.parametrize("L, S, block", [(1024, 768, 64), (512, 512, 32), (1000, 1100, 64)])
def test_partial_tiles_by_sub_tiles_are_the_pairs(L, S, block):
    # Note [PARTIAL tiles by sub-tiles]: intervals settle sub-tiles, mask_mod the undecided ones: every pair of
    # every PARTIAL block equals mask_mod's own (documents, a window, a mask on key residues); a ragged grid,
    # a mask intervals do not cover and one that reads b take every pair instead (None)
    g = torch.Generator().manual_seed(S)
    doc = torch.randint(0, 5, (max(L, S),), generator=g).sort().values
    whole = L % block == 0 and S % block == 0
    fns = [lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv), lambda b, h, q, kv: (q - kv).abs() <= 45,
           lambda b, h, q, kv: (kv % 7 == 0) & (q >= kv)]
    for fn in fns:
        p = P.create_block_mask(fn, None, None, L, S, BLOCK_SIZE=block, output="pattern")
        part = (p.codes()[0] == P.PARTIAL).nonzero()
        assert len(part)
        got = p._tiles_refined(part, L, S)
        assert (got is not None) == whole
        if got is None:
            continue
        i = (part[:, :1] * block + torch.arange(block)).unsqueeze(-1)
        j = (part[:, 1:] * block + torch.arange(block)).unsqueeze(1)
        want = torch.broadcast_to(fn(0, 0, i, j), got.shape)
        assert torch.equal(got, want), (got != want).nonzero()[:5]
    p = P.create_block_mask(lambda b, h, q, kv: (q >= kv) & (b >= 0), 2, None, 512, 512, BLOCK_SIZE=32, output="pattern")
    part = (p.codes()[0] == P.PARTIAL).nonzero()
    assert len(part) and p._tiles_refined(part, 512, 512) is None  # reads b
    p = P.create_block_mask(lambda b, h, q, kv: torch.sin(q.float()) >= torch.cos(kv.float()), None, None, 512, 512,
                            BLOCK_SIZE=32, output="pattern")
    part = (p.codes()[0] == P.PARTIAL).nonzero()
    assert len(part) and p._tiles_refined(part, 512, 512) is None  # sin, cos: not in the interval table
