"""attnlab.attention against the float64 reference and PyTorch's SDPA, for every method."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import attnlab
from attnlab import patterns as P
from attnlab import reference
from helpers import FUSED_ERROR_FACTOR, TOL, assert_close, max_err

EXACT = ["dense", "sdpa", "tiled", "sparse"]
F64 = TOL[torch.float64]


def rand(*shape, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype)


def run(method, q, k, v, **kw):
    if method == "sparse" and kw.get("attn_mask") is None and kw.get("pattern") is None and not kw.get("is_causal"):
        kw = dict(kw, pattern=P.full())  # sparse needs something to skip; full() keeps everything
    return attnlab.attention(q, k, v, method=method, **kw)


@settings(max_examples=40, deadline=None)
@given(
    B=st.sampled_from([1, 2]), H=st.sampled_from([1, 3]), L=st.sampled_from([1, 3, 17]),
    S=st.sampled_from([1, 5, 17]), E=st.sampled_from([1, 4, 8]), Ev=st.sampled_from([2, 5]),
    causal=st.booleans(), mask_kind=st.sampled_from(["none", "bool", "float"]),
    method=st.sampled_from(EXACT), block=st.sampled_from([1, 3, 4, 16]), seed=st.integers(0, 2**16),
)
def test_matches_reference(B, H, L, S, E, Ev, causal, mask_kind, method, block, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, E, generator=g, dtype=torch.float64)
    k = torch.randn(B, H, S, E, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, S, Ev, generator=g, dtype=torch.float64)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(L, S, generator=g) > 0.3
    elif mask_kind == "float":
        mask = torch.randn(H, L, S, generator=g, dtype=torch.float64)
    ro, rw = reference.attention(q, k, v, attn_mask=mask, is_causal=causal)
    if method == "sparse" and mask is None and not causal:
        out = attnlab.attention(q, k, v, pattern=P.full(), method="sparse", block_size=block)
    else:
        out = attnlab.attention(q, k, v, attn_mask=mask, is_causal=causal, method=method, block_size=block)
    assert_close(out, ro, **F64, what=f"{method} output")
    if method in ("dense", "tiled"):
        _, w = attnlab.attention(q, k, v, attn_mask=mask, is_causal=causal, method=method, block_size=block,
                                 need_weights=True)
        assert_close(w, rw, **F64, what=f"{method} weights")


@pytest.mark.parametrize("shape", [(17, 8), (3, 17, 8), (2, 3, 143, 8), (2, 2, 3, 5, 4)])
def test_leading_dims_and_auto_match_torch_sdpa(shape):
    q = torch.randn(*shape)
    k = torch.randn(*shape[:-2], 9, shape[-1])
    v = torch.randn(*shape[:-2], 9, 5)
    for causal in (False, True):
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        for method in ("auto", "dense", "tiled"):
            out = attnlab.attention(q, k, v, is_causal=causal, method=method)
            assert_close(out, ref, atol=1e-5, rtol=1e-5, what=f"{method} causal={causal} {shape}")


@pytest.mark.parametrize("mask_shape", [(17, 9), (1, 9), (3, 17, 9), (2, 1, 17, 9), (2, 3, 1, 9)])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_mask_broadcasting_like_pytorch(mask_shape, kind):
    q, k, v = torch.randn(2, 3, 17, 8), torch.randn(2, 3, 9, 8), torch.randn(2, 3, 9, 4)
    m = torch.rand(mask_shape) > 0.2 if kind == "bool" else torch.randn(mask_shape)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    for method in EXACT:
        out = attnlab.attention(q, k, v, attn_mask=m, method=method, block_size=4)
        assert_close(out, ref, atol=1e-5, rtol=1e-5, what=f"{method} mask {mask_shape}")


def test_causal_and_mask_are_anded():
    q, k, v = rand(1, 2, 6, 4), rand(1, 2, 6, 4), rand(1, 2, 6, 3)
    m = torch.rand(6, 6) > 0.3
    ro, _ = reference.attention(q, k, v, attn_mask=m & torch.ones(6, 6, dtype=torch.bool).tril())
    for method in EXACT:
        assert_close(attnlab.attention(q, k, v, attn_mask=m, is_causal=True, method=method, block_size=2), ro,
                     **F64, what=method)


def test_gqa_matches_torch():
    q, k, v = torch.randn(2, 6, 17, 8), torch.randn(2, 2, 13, 8), torch.randn(2, 2, 13, 5)
    ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, is_causal=True)
    for method in EXACT:
        out = attnlab.attention(q, k, v, enable_gqa=True, is_causal=True, method=method, block_size=4)
        assert_close(out, ref, atol=1e-5, rtol=1e-5, what=method)


def test_scale_argument():
    q, k, v = rand(1, 1, 5, 4), rand(1, 1, 7, 4), rand(1, 1, 7, 2)
    for s in (1.0, 0.01, 3.0):
        ro, _ = reference.attention(q, k, v, scale=s)
        for method in EXACT:
            assert_close(run(method, q, k, v, scale=s), ro, **F64, what=f"{method} scale={s}")


@pytest.mark.parametrize("method", EXACT)
def test_fully_masked_rows_give_zero_not_nan(method):
    q, k, v = rand(1, 2, 5, 4), rand(1, 2, 7, 4), rand(1, 2, 7, 3)
    m = torch.rand(5, 7) > 0.5
    m[2] = False
    out = attnlab.attention(q, k, v, attn_mask=m, method=method, block_size=3)
    assert not torch.isnan(out).any()
    assert torch.equal(out[..., 2, :], torch.zeros_like(out[..., 2, :]))
    fm = torch.zeros(5, 7, dtype=torch.float64).masked_fill(~m, float("-inf"))
    out2 = attnlab.attention(q, k, v, attn_mask=fm, method=method, block_size=3)
    assert_close(out2, out, **F64, what="float -inf mask")
    if method in ("dense", "tiled"):
        _, w = attnlab.attention(q, k, v, attn_mask=m, method=method, need_weights=True, block_size=3)
        assert torch.equal(w[..., 2, :], torch.zeros_like(w[..., 2, :]))


@pytest.mark.parametrize("method", EXACT)
def test_nan_in_padded_values_changes_nothing(method):
    q, k, v = rand(2, 2, 6, 4), rand(2, 2, 9, 4), rand(2, 2, 9, 3)
    lengths = torch.tensor([9, 5])
    pat = P.key_padding(lengths)
    clean = attnlab.attention(q, k, v, pattern=pat, method=method, block_size=4)
    v_nan = v.clone()
    v_nan[1, :, 5:] = float("nan")
    k_big = k.clone()
    k_big[1, :, 5:] = float("nan")
    k_big[1, :, 6] = float("inf")
    dirty = attnlab.attention(q, k_big, v_nan, pattern=pat, method=method, block_size=4)
    assert torch.equal(clean, dirty) or max_err(clean, dirty) < 1e-12
    keep = ~(torch.arange(9) >= lengths.unsqueeze(1))  # (B, S)
    dirty2 = attnlab.attention(q, k, v_nan, attn_mask=keep[:, None, None, :], method=method, block_size=4)
    assert_close(dirty2, clean, **F64, what="bool mask padding")


@pytest.mark.parametrize("method", EXACT)
def test_extreme_logits_stay_finite(method):
    q, k, v = rand(1, 2, 9, 4) * 1e2, rand(1, 2, 9, 4) * 1e2, rand(1, 2, 9, 3)
    m = torch.full((9, 9), 1e4, dtype=torch.float64)
    m[:, ::2] = -1e4
    out = attnlab.attention(q, k, v, attn_mask=m, method=method, block_size=4)
    assert torch.isfinite(out).all()
    ro, _ = reference.attention(q, k, v, attn_mask=m)
    assert_close(out, ro, atol=1e-9, rtol=1e-9, what=method)


@pytest.mark.parametrize("method", EXACT)
def test_weights_properties(method):
    q, k, v = rand(2, 3, 11, 4), rand(2, 3, 13, 4), rand(2, 3, 13, 2)
    m = torch.rand(11, 13) > 0.4
    m[:, 0] = True
    if method in ("sdpa", "sparse"):
        with pytest.raises(ValueError, match="weights"):
            attnlab.attention(q, k, v, attn_mask=m, method=method, need_weights=True)
        return
    _, w = attnlab.attention(q, k, v, attn_mask=m, method=method, need_weights=True, block_size=4)
    assert (w >= 0).all()
    assert_close(w.sum(-1), torch.ones(2, 3, 11, dtype=torch.float64), atol=1e-12, what="row sums")
    assert (w[..., ~m] == 0).all()


@pytest.mark.parametrize("L,S", [(0, 5), (5, 0), (0, 0)])
@pytest.mark.parametrize("method", EXACT)
def test_empty_inputs_like_torch(L, S, method):
    q, k, v = torch.randn(2, 3, L, 4), torch.randn(2, 3, S, 4), torch.randn(2, 3, S, 6)
    ref = F.scaled_dot_product_attention(q, k, v)
    out = attnlab.attention(q, k, v, method=method, pattern=P.full() if method == "sparse" else None)
    assert out.shape == ref.shape
    assert torch.equal(out, ref)


def test_lse_and_merge_partials_equal_full_attention():
    q, k, v = rand(2, 3, 10, 4), rand(2, 3, 14, 4), rand(2, 3, 14, 5)
    full, lse = attnlab.attention_with_lse(q, k, v)
    s = q @ k.transpose(-1, -2) / 2.0
    assert_close(lse, torch.logsumexp(s, -1), **F64, what="lse")
    o1, l1 = attnlab.attention_with_lse(q, k[:, :, :6], v[:, :, :6])
    o2, l2 = attnlab.attention_with_lse(q, k[:, :, 6:], v[:, :, 6:])
    merged, lm = attnlab.merge_partials(o1, l1, o2, l2)
    assert_close(merged, full, **F64, what="merged")
    assert_close(lm, lse, **F64, what="merged lse")
    # an empty side contributes nothing
    oe, le = attnlab.attention_with_lse(q, k[:, :, :0], v[:, :, :0])
    m2, _ = attnlab.merge_partials(full, lse, oe, le)
    assert_close(m2, full, **F64, what="merge with empty")
    # the fp32 fused path gives the same lse
    o32, l32 = attnlab.attention_with_lse(q.float(), k.float(), v.float(), is_causal=True)
    ro, _ = reference.attention(q, k, v, is_causal=True)
    assert_close(o32, ro, atol=1e-5, rtol=1e-5, what="fused lse output")
    causal_s = s.masked_fill(~torch.ones(10, 14, dtype=torch.bool).tril(), float("-inf"))
    assert_close(l32, torch.logsumexp(causal_s, -1), atol=1e-5, rtol=1e-5, what="fused lse")


def test_dropout_is_unbiased_and_zero_p_is_exact():
    q, k, v = torch.randn(1, 1, 4, 8), torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 3)
    ref = F.scaled_dot_product_attention(q, k, v)
    for method in ("dense", "sdpa"):
        assert_close(attnlab.attention(q, k, v, dropout_p=0.0, method=method), ref, atol=1e-6, what=method)
        outs = torch.stack([attnlab.attention(q, k, v, dropout_p=0.5, method=method) for _ in range(3000)])
        assert not torch.allclose(outs[0], ref)
        assert_close(outs.mean(0), ref, atol=0.08, what=f"{method} dropout mean")
    with pytest.raises(ValueError, match="dropout"):
        attnlab.attention(q, k, v, dropout_p=0.1, method="tiled")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("method", EXACT)
def test_low_precision_error_budget(dtype, method):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 143, 16, generator=g) for _ in range(3))
    ro, _ = reference.attention(q, k, v, is_causal=True)
    naive = torch.softmax((q.to(dtype) @ k.to(dtype).transpose(-1, -2)) / 4.0 +
                          torch.full((143, 143), float("-inf")).triu(1).to(dtype), -1) @ v.to(dtype)
    budget = FUSED_ERROR_FACTOR * max_err(naive, ro) + 1e-6
    out = attnlab.attention(q.to(dtype), k.to(dtype), v.to(dtype), is_causal=True, method=method, block_size=32)
    assert out.dtype == dtype
    assert max_err(out, ro) <= budget, f"{method} {dtype}: {max_err(out, ro):.3g} > budget {budget:.3g}"


@pytest.mark.parametrize("method", ["tiled", "sparse", "dense"])
def test_gradcheck_float64(method):
    q = rand(1, 2, 5, 3).requires_grad_()
    k = rand(1, 2, 7, 3).requires_grad_()
    v = rand(1, 2, 7, 2).requires_grad_()
    m = torch.rand(5, 7) > 0.3
    m[3] = False

    def f(q, k, v):
        return attnlab.attention(q, k, v, attn_mask=m, is_causal=False, method=method, block_size=2)

    assert torch.autograd.gradcheck(f, (q, k, v))

    def g(q, k, v):
        return attnlab.attention(q, k, v, pattern=P.sliding_window(2, causal=True), method=method, block_size=3)

    assert torch.autograd.gradcheck(g, (q, k, v))


def test_gradients_match_torch_sdpa_fp32():
    q, k, v = (torch.randn(2, 4, 37, 16, requires_grad=True) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    gq, gk, gv = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for method in EXACT:
        out = attnlab.attention(q, k, v, is_causal=True, method=method, block_size=8)
        aq, ak, av = torch.autograd.grad(out.square().sum(), (q, k, v))
        for a, b, n in ((aq, gq, "dq"), (ak, gk, "dk"), (av, gv, "dv")):
            assert_close(a, b, atol=1e-4, rtol=1e-4, what=f"{method} {n}")


@pytest.mark.parametrize("engine", ["auto", "torch"])
def test_tiled_engines_agree_with_reference(engine, monkeypatch):
    """The tiled kernel per tile uses PyTorch's fused CPU op (auto) or plain tensor ops (torch)."""
    from attnlab.kernels import tiled

    monkeypatch.setattr(tiled, "ENGINE", engine)
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 2e-5)):
        q, k, v = (torch.randn(2, 3, n, 8, dtype=dtype, requires_grad=True) for n in (37, 29, 29))
        m = torch.rand(37, 29) > 0.3
        m[5] = False
        ro, _ = reference.attention(q, k, v, attn_mask=m, is_causal=True)
        out = attnlab.attention(q, k, v, attn_mask=m, is_causal=True, method="tiled", block_size=8)
        assert_close(out, ro, atol=tol, rtol=tol, what=f"{engine} {dtype}")
        g = torch.autograd.grad(out.square().sum(), (q, k, v))
        gd = torch.autograd.grad(attnlab.attention(q, k, v, attn_mask=m, is_causal=True, method="dense").square().sum(),
                                 (q, k, v))
        for a, b in zip(g, gd):
            assert_close(a, b, atol=tol * 10, rtol=tol * 10, what=f"{engine} {dtype} grad")
    q = torch.randn(1, 2, 5, 3, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 7, 3, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 7, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v: attnlab.attention(
        q, k, v, pattern=P.sliding_window(2, causal=True), method="tiled", block_size=2), (q, k, v))


@pytest.mark.parametrize("pattern", [
    P.bigbird(4, 3, 1, 1, seed=2),
    P.sliding_window(5, causal=True),
    P.block_sparse(torch.rand(10, 10, generator=torch.Generator().manual_seed(1)) < 0.3, 4) & P.key_padding([37, 20]),
    P.strided(6) | P.sliding_window(2),
], ids=repr)
def test_sparse_in_small_chunks_matches_reference_with_gradients(pattern, monkeypatch):
    """Force the sparse kernel to split every group into chunks of one query block: gathered runs, bands
    and rectangles must still cover every row once, with per-batch masks; gradients still match."""
    from attnlab.kernels import sparse
    monkeypatch.setattr(sparse, "CHUNK_BYTES", 1)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 37, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 3, 37, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 3, 37, 6, generator=g, dtype=torch.float64, requires_grad=True)
    mask = pattern.materialize(37, 37)
    ro, _ = reference.attention(q.detach(), k.detach(), v.detach(), attn_mask=mask)
    with torch.no_grad():  # chunks are for inference; under autograd each run is one call
        chunked = attnlab.attention(q, k, v, pattern=pattern, method="sparse", block_size=4)
    assert_close(chunked, ro, **F64, what="chunked sparse output")
    out = attnlab.attention(q, k, v, pattern=pattern, method="sparse", block_size=4)
    assert_close(out, ro, **F64, what="sparse output under autograd")
    w = torch.randn_like(out)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref_out = attnlab.attention(q, k, v, attn_mask=mask, method="dense")
    ref_grads = torch.autograd.grad((ref_out * w).sum(), (q, k, v))
    for a, b, name in zip(grads, ref_grads, "qkv"):
        assert_close(a, b, **F64, what=f"chunked sparse d{name}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_sparse_training_function_matches_dense_gradients(dtype, monkeypatch):
    """Training through the sparse kernel's own autograd Function (bands, rectangles, gathered runs,
    bool and float masks, per-batch padding, a fully masked row) gives dense attention's gradients."""
    from attnlab.kernels import sparse

    used = []
    real = sparse._SparseFunction.backward
    monkeypatch.setattr(sparse._SparseFunction, "backward",
                        staticmethod(lambda ctx, d: used.append(1) or real(ctx, d)))
    g = torch.Generator().manual_seed(5)
    L = S = 45
    bias = torch.randn(3, L, S, generator=g, dtype=dtype)
    keep = torch.rand(L, S, generator=g) > 0.2
    keep[7] = False  # a query row with no key
    cases = [
        dict(pattern=P.sliding_window(6, causal=True)),
        dict(pattern=P.bigbird(4, 3, 1, 1, seed=3) & P.key_padding([45, 30])),
        dict(pattern=P.sliding_window(9), attn_mask=bias),
        dict(pattern=P.longformer(3, [0, 20]), attn_mask=keep),
        dict(pattern=P.causal() & P.strided(5)),
    ]
    tol = F64 if dtype == torch.float64 else dict(atol=2e-5, rtol=2e-5)
    for kw in cases:
        q = torch.randn(2, 3, L, 8, generator=g, dtype=dtype, requires_grad=True)
        k = torch.randn(2, 3, S, 8, generator=g, dtype=dtype, requires_grad=True)
        v = torch.randn(2, 3, S, 8, generator=g, dtype=dtype, requires_grad=True)
        w = torch.randn(2, 3, L, 8, generator=g, dtype=dtype)
        n_used = len(used)
        out = attnlab.attention(q, k, v, method="sparse", block_size=4, **kw)
        grads = torch.autograd.grad((out * w).sum(), (q, k, v))
        assert len(used) == n_used + 1, "the sparse autograd Function did not run"
        mask = kw["pattern"].materialize(L, S)
        m = kw.get("attn_mask")
        full = mask if m is None else (mask & m if m.dtype == torch.bool else m.masked_fill(~mask, float("-inf")))
        ref = attnlab.attention(q, k, v, attn_mask=full, method="dense")
        assert_close(out, ref, **tol, what=f"{kw} output")
        for a, b, name in zip(grads, torch.autograd.grad((ref * w).sum(), (q, k, v)), "qkv"):
            assert_close(a, b, **tol, what=f"{kw} d{name}")


@pytest.mark.parametrize("masked", ["pattern", "mask"])
def test_lse_of_a_fully_masked_call_stays_on_the_graph(masked):
    """Every key masked: attention_with_lse's output had been a fresh zero tensor, off the graph (backward raised;
    in a larger graph q, k, v got no gradient from it). Now as attention's: zeros joined to the inputs, zero
    gradients; lse -inf, or with sinks each head's sink (float64 reference: logaddexp(-inf, s) = s), whose
    gradient is the count of its rows."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g, requires_grad=True) for _ in range(3))
    kw = dict(pattern=P.key_padding([0])) if masked == "pattern" else dict(attn_mask=torch.zeros(5, 5, dtype=torch.bool))
    out, lse = attnlab.attention_with_lse(q, k, v, **kw)
    assert out.requires_grad and not out.any() and bool((lse == float("-inf")).all())
    out.sum().backward()
    assert all(t.grad is not None and not t.grad.any() for t in (q, k, v))
    s = torch.tensor([0.5, -1.25], dtype=torch.float64, requires_grad=True)
    out, lse = attnlab.attention_with_lse(q.detach().double(), k.detach().double(), v.detach().double(), sinks=s, **kw)
    assert torch.equal(lse, s.detach().view(1, 2, 1).expand(1, 2, 5))
    lse.sum().backward()
    assert torch.equal(s.grad, torch.tensor([5.0, 5.0], dtype=torch.float64))
