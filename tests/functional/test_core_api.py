"""Bad input, explain(), strict mode and the probe (weights on demand)."""
from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab import patterns as P
from attnlab import reference
from attnlab.kernels import compiled
from helpers import assert_close

q4 = torch.randn(2, 4, 8, 16)


@pytest.mark.parametrize("args,kw,err,match", [
    ((q4.numpy(), q4, q4), {}, TypeError, "query must be a torch.Tensor"),
    ((q4, q4.long(), q4), {}, TypeError, "key must be a floating tensor"),
    ((q4, q4.double(), q4), {}, TypeError, "same dtype|share one dtype"),
    ((q4, q4[0], q4[0]), {}, ValueError, "same rank"),
    ((q4, torch.randn(2, 4, 8, 15), q4), {}, ValueError, "E=16.*E=15"),
    ((q4, q4, torch.randn(2, 4, 9, 16)), {}, ValueError, "S=8.*S=9"),
    ((q4, torch.randn(3, 4, 8, 16), torch.randn(3, 4, 8, 16)), {}, ValueError, "batch dim"),
    ((q4, torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)), {}, ValueError, "enable_gqa=True"),
    ((q4, torch.randn(2, 3, 8, 16), torch.randn(2, 3, 8, 16)), {"enable_gqa": True}, ValueError, "multiple"),
    ((q4, q4, q4), {"attn_mask": torch.ones(7, 8, dtype=torch.bool)}, ValueError, r"attn_mask \[7, 8\]"),
    ((q4, q4, q4), {"attn_mask": torch.ones(8, 8, dtype=torch.int32)}, TypeError, "attn_mask must be bool"),
    ((q4, q4, q4), {"attn_mask": torch.ones(1, 2, 3, 4, 8, 8, dtype=torch.bool)}, ValueError, "broadcast"),
    ((q4, q4, q4), {"dropout_p": 1.5}, ValueError, "dropout_p"),
    ((q4, q4, q4), {"scale": float("nan")}, ValueError, "scale"),
    ((q4, q4, q4), {"is_causal": 1}, TypeError, "is_causal"),
    ((q4, q4, q4), {"method": "flash"}, ValueError, "method must be one of"),
    ((q4, q4, q4), {"pattern": torch.ones(8, 8)}, TypeError, "pattern must be"),
    ((torch.randn(8), torch.randn(8), torch.randn(8)), {}, ValueError, "rank >= 2"),
])
def test_bad_input_names_the_argument(args, kw, err, match):
    with pytest.raises(err, match=match):
        attnlab.attention(*args, **kw)


def test_explain_auto_rules():
    q = torch.randn(1, 8, 1024, 64)
    assert attnlab.explain(q, q, q).method == "sdpa"
    assert attnlab.explain(q, q, q, is_causal=True).method == "sdpa"
    # a pattern with empty blocks goes to attnlab's compiled kernel when built, else the gathered one
    skipper = "compiled" if compiled.available(q) else "sparse"
    plan = attnlab.explain(q, q, q, pattern=P.sliding_window(128, causal=True))
    assert plan.method == skipper and plan.density < 0.5
    assert plan.flops[skipper] < plan.flops["sdpa"] / 2
    assert "tiled" in str(plan) and "sparse" in str(plan) and "compiled" in str(plan)
    # strict refuses what materialises L×S
    s = attnlab.explain(q, q, q, pattern=P.sliding_window(128), strict=True)
    assert "dense" in s.refused and "sdpa" in s.refused and s.method == skipper
    with pytest.raises(ValueError, match="strict"):
        attnlab.attention(q, q, q, method="dense", strict=True)
    w = attnlab.explain(q, q, q, need_weights=True)
    assert w.method in ("dense", "tiled") and "sdpa" in w.refused
    big = torch.randn(1, 8, 4096, 64)
    assert attnlab.explain(big, big, big, need_weights=True).method == "tiled"
    assert attnlab.explain(q, q, q, dropout_p=0.1).method == "sdpa"
    # predicted memory: tiled is far below dense at long lengths
    p = attnlab.explain(big, big, big, method="tiled")
    assert p.peak_bytes["tiled"] * 5 < p.peak_bytes["dense"]


def test_need_weights_tiled_second_pass_large_is_exact():
    q, k, v = (torch.randn(1, 2, 300, 8, dtype=torch.float64) for _ in range(3))
    ro, rw = reference.attention(q, k, v, is_causal=True)
    out, w = attnlab.attention(q, k, v, is_causal=True, method="tiled", need_weights=True, block_size=64)
    assert_close(out, ro, atol=1e-10, what="out")
    assert_close(w, rw, atol=1e-12, what="weights")


@pytest.mark.parametrize("pattern", [None, P.sliding_window(3, causal=True), P.key_padding([11, 6])], ids=repr)
def test_probe_answers_match_dense_weights(pattern):
    q, k = torch.randn(2, 3, 13, 4, dtype=torch.float64), torch.randn(2, 3, 11, 4, dtype=torch.float64)
    mask = pattern.materialize(13, 11) if pattern is not None else None
    _, w = reference.attention(q, k, k, attn_mask=mask)
    w = torch.tensor(w)
    pr = attnlab.probe(q, k, pattern=pattern, block_size=4)
    ent = -(torch.where(w > 0, w * w.log(), torch.zeros_like(w))).sum(-1)
    assert_close(pr.entropy(), ent, atol=1e-10, what="entropy")
    assert_close(pr.max_weight(), w.amax(-1), atol=1e-12, what="max")
    assert_close(pr.column_sums(), w.sum(-2), atol=1e-10, what="column sums")
    assert_close(pr.sink_mass(), w[..., 0], atol=1e-12, what="sink")
    vals, idx = pr.topk(3)
    tv = w.topk(3, dim=-1)
    assert_close(vals, tv.values, atol=1e-12, what="topk values")
    assert_close(w.gather(-1, idx), tv.values, atol=1e-12, what="topk indices")
    sel = pr.weights(heads=[2], rows=slice(3, 7))
    assert_close(sel, w[:, 2:3, 3:7], atol=1e-12, what="selected weights")
    hist, edges = pr.distance_histogram([0, 1, 4])
    d = (torch.arange(11).view(1, -1) - torch.arange(13).view(-1, 1)).abs()
    b = torch.bucketize(d, edges, right=True) - 1
    expect = torch.stack([(w * (b == i)).sum((-1, -2)) / 13 for i in range(3)], -1)
    assert_close(hist, expect, atol=1e-12, what="distance histogram")


def test_causal_block_count_matches_the_layout():
    """explain() counts plain causal blocks arithmetically; the count must equal the pattern's layout."""
    import itertools

    from attnlab.kernels.planner import causal_blocks as _causal_blocks
    for L, S, bq, bk in itertools.product([1, 5, 17, 130], [1, 7, 129], [1, 4, 16], [1, 3, 16]):
        lay = P.causal().block_layout(L, S, bq, bk)
        assert _causal_blocks(L, S, bq, bk) == int((lay != P.EMPTY).sum()), (L, S, bq, bk)


def test_sparse_block_size_follows_the_pattern():
    """Block tables run at their own block size; a narrow band gets a smaller block than a wide one
    (less computed area per kept pair), and both results still match the dense reference."""
    q = torch.randn(1, 2, 1024, 16)
    bb = P.bigbird(64, 3, 1, 1)
    assert attnlab.explain(q, q, q, pattern=bb, method="sparse").block_size == (64, 64)
    narrow = attnlab.explain(q, q, q, pattern=P.sliding_window(8), method="sparse").block_size[0]
    wide = attnlab.explain(q, q, q, pattern=P.sliding_window(400, causal=True), method="sparse").block_size[0]
    assert narrow < wide
    for pat in (bb, P.sliding_window(8)):
        out = attnlab.attention(q, q, q, pattern=pat, method="sparse")
        ref = attnlab.attention(q, q, q, attn_mask=pat.materialize(1024, 1024), method="dense")
        assert_close(out, ref, atol=1e-5, rtol=1e-5, what=repr(pat))
