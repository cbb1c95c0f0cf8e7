"""The kernels' declarations, the one planner and the one log-sum-exp merge (issue 15, "one way in").

The declarations are checked against what the planner and the kernels actually do: a kernel that
declares no dropout is refused with dropout, a kernel declared to return weights returns the dense
oracle's weights, and so on. The merge is checked against the float64 reference over the union of keys.
"""
from __future__ import annotations

import pytest
import torch

import attnlab
import attnlab.mechanisms as M
from attnlab import kernels, reference, shapes
from attnlab import patterns as P
from attnlab.kernels import planner
from attnlab.kernels.lse import merge, merge_into
from attnlab.nn import MultiHeadAttention
from helpers import TOL, assert_close


def _q(*shape, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype)


def test_methods_are_the_declared_kernels():
    assert planner.METHODS == ("auto",) + tuple(s.name for s in kernels.KERNELS)
    assert attnlab.METHODS == planner.METHODS
    for s in kernels.KERNELS:
        assert kernels.get(s.name) is s
    with pytest.raises(ValueError, match="unknown kernel"):
        kernels.get("nope")


@pytest.mark.parametrize("spec", kernels.KERNELS, ids=lambda s: s.name)
def test_planner_refuses_exactly_what_each_kernel_declares(spec):
    """Each declared limit shows up as a refusal of that kernel, and only declared limits do."""
    q = _q(1, 2, 32, 8, dtype=torch.float32)
    pat = P.sliding_window(4, causal=True)
    plain = attnlab.explain(q, q, q, pattern=pat).refused.get(spec.name)
    ext = spec.needs_extension and plain is not None  # extension not built here: every case refuses it
    cases = {
        "dropout": (dict(pattern=pat, dropout_p=0.1), not spec.dropout),
        "weights": (dict(pattern=pat, need_weights=True), spec.weights == "no"),
        "mask grad": (dict(attn_mask=torch.randn(32, 32, requires_grad=True)), not spec.float_mask_grad),
        "nothing sparse": (dict(), spec.needs_sparsity),
        "strict": (dict(pattern=pat, strict=True), spec.materializes != "never"),
    }
    for what, (kw, refused) in cases.items():
        got = attnlab.explain(q, q, q, **kw).refused.get(spec.name)
        assert (got is not None) == (refused or ext), (spec.name, what, got)


@pytest.mark.parametrize("name", ["dense", "tiled"])
def test_kernels_declared_to_return_weights_return_the_oracles(name):
    assert kernels.get(name).weights != "no"
    q, k, v = _q(1, 2, 20, 4), _q(1, 2, 13, 4, seed=1), _q(1, 2, 13, 3, seed=2)
    mask = P.sliding_window(5).materialize(20, 13)
    out, w = attnlab.attention(q, k, v, pattern=P.sliding_window(5), method=name, need_weights=True, block_size=4)
    ro, rw = reference.attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, torch.as_tensor(ro), atol=1e-12, rtol=0)
    torch.testing.assert_close(w, torch.as_tensor(rw), atol=1e-12, rtol=0)


def test_registry_capabilities_come_from_the_declarations():
    specs = M.specs()
    for name in ("dense", "sdpa", "tiled", "sparse"):
        k = kernels.get(name)
        assert specs[name].weights == (k.weights != "no") and specs[name].dropout == k.dropout, name
    # the registry refuses what the planner refuses, with the planner's words
    inputs = M.Inputs(L=8, S=8, E=4, Ev=4, dropout_p=0.1)
    why = M.get("tiled").not_supported_reasons(inputs)
    assert why and "no dropout" in why[0]
    assert not M.get("dense").not_supported_reasons(inputs)


def test_no_fast_path_skips_the_planner(monkeypatch):
    calls = []
    real = planner.plan
    monkeypatch.setattr(planner, "plan", lambda *a, **kw: calls.append(a[1]) or real(*a, **kw))
    q = _q(1, 2, 8, 4, dtype=torch.float32)
    attnlab.attention(q, q, q)
    attnlab.attention(q, q, q, is_causal=True)
    assert calls == ["auto", "auto"]


@pytest.mark.parametrize("mechanism", ["auto", "tiled", "sliding_window"])
def test_multihead_attention_validates_once_per_call(mechanism, monkeypatch):
    counted = []
    real = shapes.check_attention_inputs
    monkeypatch.setattr(shapes, "check_attention_inputs", lambda *a, **kw: counted.append(1) or real(*a, **kw))
    mha = MultiHeadAttention(16, 2, mechanism=mechanism)
    x = torch.randn(2, 9, 16)
    mha(x, x, x, key_padding_mask=torch.zeros(2, 9, dtype=torch.bool))
    assert len(counted) == 1


def test_lse_merge_equals_attention_over_the_union():
    q, k, v = _q(2, 3, 7, 5), _q(2, 3, 12, 5, seed=1), _q(2, 3, 12, 4, seed=2)
    keep = torch.ones(7, 12, dtype=torch.bool)
    keep[2, :5] = False  # row 2 sees nothing in the first part
    keep[4, :] = False  # row 4 sees nothing at all: output 0, lse -inf
    oa, la = attnlab.attention_with_lse(q, k[:, :, :5], v[:, :, :5], attn_mask=keep[:, :5])
    ob, lb = attnlab.attention_with_lse(q, k[:, :, 5:], v[:, :, 5:], attn_mask=keep[:, 5:])
    out, lse = merge(oa, la, ob, lb)
    ro, _ = reference.attention(q, k, v, attn_mask=keep)
    torch.testing.assert_close(out, torch.as_tensor(ro), atol=1e-12, rtol=0)
    assert torch.isneginf(lse[..., 4]).all() and torch.isfinite(lse[..., :4]).all()
    full_out, full_lse = attnlab.attention_with_lse(q, k, v, attn_mask=keep)
    torch.testing.assert_close(lse, full_lse, atol=1e-12, rtol=0)
    # the accumulating form gives the same, starting from nothing seen (-inf)
    acc, acc_lse = torch.zeros_like(out), torch.full_like(lse, float("-inf"))
    merge_into(acc, acc_lse, oa, la)
    merge_into(acc, acc_lse, ob, lb)
    torch.testing.assert_close(acc, out, atol=1e-14, rtol=0)
    torch.testing.assert_close(acc_lse, lse, atol=1e-14, rtol=0)


def test_attention_with_lse_differentiates_a_float_mask_only_through_compiled():
    # of the kernels that return the log-sum-exp, only the compiled one differentiates a float mask
    from attnlab.kernels import compiled

    q = _q(1, 1, 6, 4, dtype=torch.float32)
    bias = torch.randn(6, 6, requires_grad=True)
    if not compiled.available():
        with pytest.raises(ValueError, match="log-sum-exp.*attn_mask that requires grad"):
            attnlab.attention_with_lse(q, q, q, attn_mask=bias)
        return
    out, _ = attnlab.attention_with_lse(q, q, q, attn_mask=bias)
    got = torch.autograd.grad(out.sum(), bias)[0]
    want = torch.autograd.grad(attnlab.attention(q, q, q, attn_mask=bias, method="dense").sum(), bias)[0]
    assert_close(got, want, **TOL[torch.float32], what="dbias via attention_with_lse vs dense")


def test_reasons_are_derived_from_every_field():
    """A made-up kernel that supports little: each field it lacks gives its own reason, and a request
    it covers gives none."""
    from attnlab.kernels import KernelSpec, Request

    narrow = KernelSpec("narrow", "test kernel", masks=False, causal=False, dtypes=(torch.float32,),
                        devices=("cuda",), needs_sparsity=False, unavailable=lambda r: "not built here")
    r = Request(1, 2, 2, 8, 8, 4, 4, torch.float64, "cpu", causal_only=True)
    why = narrow.not_supported_reasons(r)
    assert why[0] == "not built here" and any("CUDA tensors only (got cpu)" in w for w in why)
    assert any("float64" in w for w in why) and any("is_causal" in w for w in why)
    assert any("attn_mask" in w for w in narrow.not_supported_reasons(Request(1, 1, 1, 4, 4, 2, 2, keep_mask=True)))
    wide = KernelSpec("wide", "test kernel", weights="yes", dropout=True, float_mask_grad=True)
    assert wide.not_supported_reasons(Request(1, 1, 1, 4, 4, 2, 2, float_mask=True, float_mask_grad=True,
                                              dropout_p=0.5, need_weights=True)) == []


def test_explain_meta_tensors_as_cpu_matches_a_real_cpu_plan():
    pat = P.sliding_window(16, causal=True)
    real = attnlab.explain(*(torch.empty(1, 2, 256, 16),) * 3, pattern=pat)
    meta = torch.empty(1, 2, 256, 16, device="meta")
    planned = attnlab.explain(meta, meta, meta, pattern=pat, device="cpu")
    assert (planned.method, planned.refused, planned.flops) == (real.method, real.refused, real.flops)
    assert "compiled" in attnlab.explain(meta, meta, meta, pattern=pat).refused  # meta itself: not CPU
