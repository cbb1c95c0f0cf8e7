"""The plan cache (Note [Plan cache] in attnlab.functional.plancache): a repeated call skips the checks and
the planning, gets the plan a fresh one would make and the same output; anything that changes the plan
misses; the cache is bounded and holds no caller's tensor."""
from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch

import attnlab
from attnlab import patterns as P
from attnlab.functional import plancache, planner
from attnlab.shapes import prepare

pytestmark = pytest.mark.usefixtures("one_thread")

WIN = P.sliding_window(5, causal=True)
BLOCKS = P.sliding_window(left=3, right=9)


def _inputs(B=2, H=4, L=19, S=19, E=16, Hkv=None, dtype=torch.float32, grad=False, layout="contiguous"):
    Hkv = Hkv or H
    q, k, v = torch.randn(B, H, L, E), torch.randn(B, Hkv, S, E), torch.randn(B, Hkv, S, E)
    if layout == "transposed":  # [B, L, H, E] storage read as [B, H, L, E]: other strides, same shapes
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    q, k, v = (t.to(dtype).requires_grad_(grad) for t in (q, k, v))
    return q, k, v


CASES = [
    ({}, {}),
    ({}, {"is_causal": True}),
    ({"L": 7, "S": 23}, {"is_causal": True}),  # dead suffix keys: the live view is cut
    ({"dtype": torch.bfloat16}, {}),
    ({"dtype": torch.float64}, {"scale": 0.3}),
    ({"Hkv": 2}, {"enable_gqa": True, "is_causal": True}),
    ({"grad": True}, {"is_causal": True}),
    ({"layout": "transposed"}, {}),
    ({"L": 40, "S": 40}, {"pattern": WIN}),
    ({"L": 40, "S": 40}, {"pattern": BLOCKS, "method": "sparse", "block_size": 8}),
    ({}, {"softcap": 5.0}),
    ({}, {"need_weights": True}),
    ({}, {"method": "tiled", "block_size": 7}),
    ({}, {"strict": True, "is_causal": True}),
    ({"L": 1, "S": 33}, {}),
    ({"L": 0}, {}),
]


def _sig(q, k, v, kw):
    return plancache.signature(q, k, v, kw.get("attn_mask"), kw.get("dropout_p", 0.0), kw.get("is_causal", False),
                               kw.get("scale"), kw.get("enable_gqa", False), kw.get("pattern"), kw.get("softcap"),
                               kw.get("alibi_slopes"), kw.get("method", "auto"), kw.get("need_weights", False),
                               kw.get("strict", False), kw.get("block_size"))


def _fresh_plan(q, k, v, kw):
    p = prepare(q, k, v, kw.get("attn_mask"), kw.get("dropout_p", 0.0), kw.get("is_causal", False), kw.get("scale"),
                kw.get("enable_gqa", False), kw.get("pattern"), softcap=kw.get("softcap")).live()
    return planner.plan(p, kw.get("method", "auto"), kw.get("need_weights", False), kw.get("strict", False),
                        kw.get("block_size"), costs=False)


def _same(a, b):
    if isinstance(a, tuple):
        return all(_same(x, y) for x, y in zip(a, b))
    return torch.equal(a, b)


@pytest.mark.parametrize("shape_kw,kw", CASES, ids=[str(c) for c in range(len(CASES))])
def test_a_hit_runs_the_fresh_plan_with_the_same_result(shape_kw, kw):
    plancache.clear()
    q, k, v = _inputs(**shape_kw)
    first = attnlab.attention(q, k, v, **kw)  # a miss: planned and cached
    assert plancache.stats()["misses"] == 1 and plancache.stats()["entries"] == 1
    q2, k2, v2 = _inputs(**shape_kw)  # new tensors of the same signature (other values)
    with torch.no_grad():
        for a, b in ((q, q2), (k, k2), (v, v2)):
            b.copy_(a)
    second = attnlab.attention(q2, k2, v2, **kw)  # a hit
    assert plancache.stats()["hits"] == 1
    assert _same(first, second)
    cached = plancache.get(_sig(q2, k2, v2, kw))[1]
    assert dataclasses.asdict(cached) == dataclasses.asdict(_fresh_plan(q2, k2, v2, kw))
    if shape_kw.get("grad"):
        second.sum().backward()
        assert q2.grad is not None and torch.isfinite(q2.grad).all()


def test_cached_plans_equal_fresh_ones_over_many_varied_calls():
    plancache.clear()
    g = torch.Generator().manual_seed(3)
    seen = 0
    for i in range(60):
        L, S = (int(x) for x in torch.randint(1, 40, (2,), generator=g))
        shape_kw, kw = CASES[i % (len(CASES) - 1)]
        shape_kw = {**shape_kw, "L": shape_kw.get("L", L), "S": shape_kw.get("S", S)}
        if kw.get("need_weights") is None and kw.get("pattern") is None:
            shape_kw["S"] = shape_kw["L"] if shape_kw.get("Hkv") else shape_kw["S"]
        q, k, v = _inputs(**shape_kw)
        for _ in range(2):
            attnlab.attention(q, k, v, **kw)
        hit = plancache.get(_sig(q, k, v, kw))
        assert hit is not None
        assert dataclasses.asdict(hit[1]) == dataclasses.asdict(_fresh_plan(q, k, v, kw))
        seen += 1
    assert seen == 60 and plancache.stats()["hits"] >= 60


def test_what_changes_the_plan_misses(monkeypatch):
    q, k, v = _inputs()
    base = _sig(q, k, v, {})
    variants = {
        "dtype": _sig(*(t.to(torch.bfloat16) for t in (q, k, v)), {}),
        "requires_grad": _sig(q.clone().requires_grad_(), k, v, {}),
        "shape": _sig(*_inputs(L=20, S=20), {}),
        "strides": _sig(*_inputs(layout="transposed"), {}),
        "causal": _sig(q, k, v, {"is_causal": True}),
        "pattern": _sig(q, k, v, {"pattern": WIN}),
        "other pattern": _sig(q, k, v, {"pattern": P.sliding_window(5, causal=True)}),
        "scale": _sig(q, k, v, {"scale": 0.5}),
        "softcap": _sig(q, k, v, {"softcap": 2.0}),
        "method": _sig(q, k, v, {"method": "tiled"}),
        "block_size": _sig(q, k, v, {"method": "tiled", "block_size": 8}),
        "weights": _sig(q, k, v, {"need_weights": True}),
        "strict": _sig(q, k, v, {"strict": True}),
        "dropout": _sig(q, k, v, {"dropout_p": 0.1}),
    }
    with torch.no_grad():
        variants["grad mode"] = _sig(q, k, v, {})
    monkeypatch.setenv("ATTNLAB_EXT_GEMM", "mkl")
    variants["ATTNLAB_EXT_GEMM"] = _sig(q, k, v, {})
    monkeypatch.delenv("ATTNLAB_EXT_GEMM")
    before = torch.get_num_threads()
    torch.set_num_threads(before + 1)
    try:
        variants["threads"] = _sig(q, k, v, {})
    finally:
        torch.set_num_threads(before)
    assert _sig(q, k, v, {}) == base  # the same call again: the same signature
    for name, sig in variants.items():
        assert sig is not None and sig != base, name
    assert len(set(variants.values())) == len(variants)
    # a scale or flag of another type is a different call (True == 1, but is_causal=1 must still raise)
    assert _sig(q, k, v, {"is_causal": 1}) is None
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        attnlab.attention(q, k, v, is_causal=1)


@pytest.mark.parametrize("kw", [
    {"attn_mask": torch.ones(19, 19, dtype=torch.bool)},
    {"attn_mask": torch.zeros(19, 19)},
    {"alibi_slopes": torch.ones(4)},
    {"pattern": P.key_padding(torch.tensor([19, 11]))},  # a tensor inside: its content may change in place
])
def test_calls_that_read_values_are_not_cached(kw):
    q, k, v = _inputs()
    assert _sig(q, k, v, kw) is None
    plancache.clear()
    attnlab.attention(q, k, v, **kw)
    assert plancache.stats()["entries"] == 0


def test_a_mask_changed_in_place_changes_the_result():
    """The reason masks are not cached: the same tensor, other values, another plan (dead keys) and result."""
    q, k, v = _inputs(B=1, H=1, L=5, S=5, E=4)
    mask = torch.ones(5, 5, dtype=torch.bool)
    a = attnlab.attention(q, k, v, attn_mask=mask)
    mask[:, 2:] = False
    b = attnlab.attention(q, k, v, attn_mask=mask)
    ref = attnlab.reference.attention(q.double(), k.double(), v.double(), attn_mask=mask)[0]
    assert not torch.allclose(a, b)
    torch.testing.assert_close(b.double(), torch.as_tensor(ref), rtol=1e-5, atol=1e-6)


def test_bounded_and_holds_no_tensor():
    plancache.clear()
    for L in range(1, plancache.MAX_ENTRIES + 20):
        attnlab.attention(*_inputs(B=1, H=1, L=L, S=1, E=2))
    assert plancache.stats()["entries"] == plancache.MAX_ENTRIES
    q, k, v = _inputs()
    refs = [weakref.ref(t) for t in (q, k, v)]
    attnlab.attention(q, k, v)
    attnlab.attention(q, k, v)
    del q, k, v
    gc.collect()
    assert all(r() is None for r in refs)


def test_live_costs_nothing_without_a_mask():
    """No mask, no pattern: prepare(...).live() and the run plan do no work in L·S (meta tensors of
    2^31 tokens would take minutes and terabytes otherwise), and the live view keeps the checked sizes."""
    q = torch.empty(1, 1, 2**31, 8, device="meta")
    p = prepare(q, q, q)
    live = p.live()
    assert live.dead is None and live.info is p.info and live.key_range == (0, 2**31, 2**31)
    assert planner.plan(live, costs=False, device="cpu").method in attnlab.METHODS


@pytest.mark.parametrize("kw", [dict(), dict(is_causal=True), dict(enable_gqa=True), dict(scale=-0.3, is_causal=True)])
def test_a_plain_sdpa_hit_runs_sdpa_directly(kw, monkeypatch):
    """A repeated plain call whose plan is SDPA runs it straight on the caller's tensors (``Kernel.direct``):
    no prepared inputs are rebuilt, and the result is SDPA's (scale <= 0 with causal included: Note
    [Causal with scale <= 0])."""
    from attnlab.shapes import Prepared

    plancache.clear()
    hq = 4
    hkv = 2 if kw.get("enable_gqa") else 4
    q = torch.randn(2, hq, 6, 8, dtype=torch.float64)
    k, v = torch.randn(2, hkv, 6, 8, dtype=torch.float64), torch.randn(2, hkv, 6, 8, dtype=torch.float64)
    first = attnlab.attention(q, k, v, method="sdpa", **kw)
    monkeypatch.setattr(Prepared, "rebind", lambda *a, **k_: pytest.fail("a direct hit rebuilt the inputs"))
    q2, k2, v2 = torch.randn_like(q), torch.randn_like(k), torch.randn_like(v)
    again = attnlab.attention(q2, k2, v2, method="sdpa", **kw)
    want = attnlab.reference.attention(q2, k2, v2, **kw)[0]  # the float64 oracle (output, weights)
    assert (again - want).abs().max().item() < 1e-12
    assert first.shape == again.shape


def test_no_direct_path_where_inputs_need_preparing():
    """Dead keys (a pattern cutting keys), a mask and non-4-D inputs keep the prepared path."""
    q = torch.randn(1, 2, 8, 4)
    for kw, shape in ((dict(pattern=P.sliding_window(2)), (1, 2, 8, 4)), (dict(), (2, 8, 4))):
        plancache.clear()
        x = q.reshape(shape)
        attnlab.attention(x, x, x, method="sdpa", **kw)
        (hit,) = [plancache.get(plancache.signature(x, x, x, None, 0.0, False, None, False, kw.get("pattern"), None,
                                                     None, "sdpa", False, False, None))]
        assert hit is not None and hit[2] is None


@pytest.mark.parametrize("kw", [dict(enable_gqa=True), dict(pattern=P.causal("bottom_right"), enable_gqa=True),
                                dict(pattern=P.sliding_window(41, causal=True, align="bottom_right"), enable_gqa=True),  # no dead key
                                dict(softcap=2.5, enable_gqa=True)])
def test_a_decode_hit_runs_the_decode_kernel_directly(kw, monkeypatch):
    """A repeated decode-shaped call (the compiled kernel's decode path) runs it straight on the caller's
    tensors (Note [Decode direct call]): no prepared inputs are rebuilt, and the result is the float64
    oracle's within fp32 rounding, for plain, bottom-right causal, sliding-window and soft-capped calls."""
    from attnlab.kernels import decode as dk
    from attnlab.shapes import Prepared

    if not dk.available():
        pytest.skip(f"decode extension: {dk.unavailable_reason()}")
    plancache.clear()
    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(2, 4, 3, 16, generator=g), torch.randn(2, 2, 43, 16, generator=g), torch.randn(2, 2, 43, 16, generator=g)
    with torch.no_grad():
        attnlab.attention(q, k, v, **kw)
        (entry,) = plancache._ENTRIES.values()
        assert entry[1].decode and entry[2] is not None
        monkeypatch.setattr(Prepared, "rebind", lambda *a, **k_: pytest.fail("a direct hit rebuilt the inputs"))
        q2, k2, v2 = torch.randn_like(q), torch.randn_like(k), torch.randn_like(v)
        again = attnlab.attention(q2, k2, v2, **kw)
    ref_kw = dict(kw)
    if "pattern" in ref_kw:
        ref_kw["attn_mask"] = ref_kw.pop("pattern").materialize(3, 43)  # (L, S) bool
    want = attnlab.reference.attention(q2.double(), k2.double(), v2.double(), **ref_kw)[0]
    assert (again.double() - torch.as_tensor(want)).abs().max().item() < 1e-5


def test_no_direct_decode_where_the_call_reads_a_mask():
    """Key padding by lengths (read from a tensor), a user mask and non-4-D inputs keep the prepared path."""
    from attnlab.kernels import decode as kvdecode

    q, k = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 29, 8)
    assert kvdecode.direct(prepare(q, k, k, enable_gqa=True).live()) is not None
    pad = P.key_padding(torch.tensor([29, 17]))
    mask = torch.rand(2, 1, 1, 29) > 0.3
    for p in (prepare(q, k, k, enable_gqa=True, pattern=pad), prepare(q, k, k, mask, enable_gqa=True),
              prepare(q[0], k[0], k[0], enable_gqa=True)):
        assert kvdecode.direct(p.live()) is None
