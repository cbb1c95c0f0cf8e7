"""attnlab.mechanisms: the registry, one conformance suite for every registered mechanism, exact limits.

Oracles: attnlab.reference (float64 NumPy) and torch's scaled_dot_product_attention.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import TOL, assert_close

import attnlab
import attnlab.mechanisms as M
from attnlab import reference

APPROX = ("linear", "performer", "linformer", "nystrom", "token_pruning", "hierarchical")
EXACT_METHODS = ("auto", "dense", "sdpa", "tiled", "sparse")


def instance(name: str) -> M.Mechanism:
    """A small, non-trivial configuration of every registered mechanism (approximations really approximate
    at the test sizes: few features, landmarks, kept keys, small blocks)."""
    small = {
        "linear": dict(chunk_size=8),
        "performer": dict(num_features=32, chunk_size=8),
        "linformer": dict(k=8),
        "nystrom": dict(num_landmarks=5),
        "token_pruning": dict(keep_ratio=0.5, score="key_norm", block_size=8),
        "hierarchical": dict(block_size=4),
        "sliding_window": dict(window=5),
        "dilated": dict(window=3, dilation=2),
        "strided": dict(stride=4),
        "fixed": dict(block=8, summary=2),
        "block_sparse": dict(layout=torch.tensor([[1, 0, 1], [1, 1, 0], [0, 1, 1]], dtype=torch.bool),
                             block_size=16),
        "longformer": dict(window=4, global_tokens=2),
        "bigbird": dict(block_size=8),
    }
    return M.get(name, **small.get(name, {}))


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=torch.float64).to(dtype)


def qkv(B=2, H=4, Hkv=2, L=37, S=41, E=16, Ev=12, dtype=torch.float32):
    return rand(B, H, L, E, dtype=dtype), rand(B, Hkv, S, E, dtype=dtype), rand(B, Hkv, S, Ev, dtype=dtype)


def call_inputs(mech, q, k, v, **kw):
    return M.Inputs.from_tensors(q, k, v, kw.get("attn_mask"), kw.get("is_causal", False), kw.get("dropout_p", 0.0),
                                 kw.get("enable_gqa", False), kw.get("need_weights", False))


# -- the registry -----------------------------------------------------------------------------------
def test_registry_has_every_exact_method_pattern_and_approximation():
    names = M.available()
    for n in EXACT_METHODS + APPROX + ("sliding_window", "dilated", "strided", "fixed", "block_sparse",
                                        "longformer", "bigbird"):
        assert n in names, n
    for n in names:
        s = M.get(n, **({} if n != "block_sparse" else instance(n).params())).spec
        assert isinstance(s, M.Spec)
        assert s.exact == (n not in APPROX), n


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(ValueError) as e:
        M.get("linearr")
    for n in ("linear", "performer", "dense", "sliding_window"):
        assert n in str(e.value)


def test_unknown_parameter_lists_the_valid_ones():
    with pytest.raises(TypeError) as e:
        M.get("performer", n_features=8)
    assert "num_features" in str(e.value) and "n_features" in str(e.value)
    with pytest.raises(TypeError, match="layout"):
        M.get("block_sparse")
    with pytest.raises(ValueError, match="feature_map"):
        M.get("linear", feature_map="softplus")
    with pytest.raises(ValueError, match="keep_ratio"):
        M.get("token_pruning", keep_ratio=0.0)
    with pytest.raises(ValueError, match="method"):
        M.get("sliding_window", method="fast")


def test_mechanisms_are_frozen_dataclasses():
    m = M.get("nystrom", num_landmarks=7)
    with pytest.raises(Exception):
        m.num_landmarks = 3  # type: ignore[misc]
    assert m.params() == {"num_landmarks": 7, "pinv": "iterative", "pinv_iterations": 6}


def test_resolve_names_instances_and_modules():
    q, k, v = qkv(H=2, Hkv=2)
    for n in EXACT_METHODS[:-1]:
        out = M.resolve(n)(q, k, v, is_causal=True)
        assert_close(out, attnlab.attention(q, k, v, is_causal=True, method=n), **TOL[torch.float32], what=n)
    assert isinstance(M.resolve(None), M.Mechanism)
    lin = M.get("linear")
    assert M.resolve(lin) is lin
    mod = M.get("performer").as_module()
    assert M.resolve(mod) is mod
    with pytest.raises(TypeError, match="registered name"):
        M.resolve(3)


def test_register_refuses_non_dataclasses_and_duplicates():
    class NotADataclass(M.Mechanism):
        pass

    with pytest.raises(TypeError):
        M.register("nope", M.Spec(exact=False), NotADataclass)
    with pytest.raises(ValueError, match="already registered"):
        M.register("linear", M.Spec(exact=False), type(M.get("performer")))


def test_sparse_needs_something_to_skip():
    q, k, v = qkv(H=2, Hkv=2)
    reasons = M.get("sparse").not_supported_reasons(call_inputs(None, q, k, v))
    assert reasons and "pattern" in reasons[0]
    with pytest.raises(M.UnsupportedInputs):
        M.get("sparse")(q, k, v)


# -- conformance: every registered mechanism ---------------------------------------------------------
ALL = M.available()


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_conformance_shapes_dtypes_gqa(name, dtype):
    mech = instance(name)
    q, k, v = qkv(dtype=dtype, L=37, S=41 if name != "block_sparse" else 41)
    kw = dict(enable_gqa=True)
    if name == "sparse":
        kw["attn_mask"] = torch.rand(37, 41) > 0.3
    out = mech(q, k, v, **kw)
    assert out.shape == (2, 4, 37, 12) and out.dtype == dtype
    assert torch.isfinite(out.float()).all()
    if mech.spec.weights:
        out2, w = mech(q, k, v, need_weights=True, **kw)
        assert w.shape == (2, 4, 37, 41) and w.dtype == dtype
        # out = weights @ values: the weights are the ones actually used
        vr = v.double().repeat_interleave(2, dim=1)
        tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
        assert_close(w.double() @ vr, out2, **tol, what=f"{name} weights @ v")
    else:
        with pytest.raises(M.UnsupportedInputs, match="weights"):
            mech(q, k, v, need_weights=True, **kw)


@pytest.mark.parametrize("name", ALL)
def test_conformance_leading_dims_and_3d(name):
    mech = instance(name)
    q, k, v = rand(3, 19, 8), rand(3, 23, 8), rand(3, 23, 8)
    kw = {"attn_mask": torch.rand(19, 23) > 0.3} if name == "sparse" else {}
    assert mech(q, k, v, **kw).shape == (3, 19, 8)
    q5 = rand(2, 3, 2, 19, 8)
    k5 = rand(2, 3, 2, 23, 8)
    assert mech(q5, k5, k5, **kw).shape == (2, 3, 2, 19, 8)


EXACT = tuple(n for n in ALL if n not in APPROX)


@pytest.mark.parametrize("name", EXACT)
def test_conformance_exact_mechanisms_match_the_float64_oracle(name):
    mech = instance(name)
    assert mech.spec.exact
    q, k, v = qkv(dtype=torch.float64, L=37, S=41)
    pat = mech.pattern_for()
    for is_causal in (False, True):
        mask = torch.rand(37, 41) > 0.2
        kw = dict(attn_mask=mask, is_causal=is_causal, enable_gqa=True)
        ref_mask = mask if pat is None else mask & pat.materialize(37, 41)
        want, _ = reference.attention(q, k, v, ref_mask, is_causal=is_causal, enable_gqa=True)
        assert_close(mech(q, k, v, **kw), torch.from_numpy(want), **TOL[torch.float64], what=name)


@pytest.mark.parametrize("name", ALL)
def test_conformance_claimed_key_masks_hide_masked_keys(name):
    """A masked key's content never matters: change masked keys and values, outputs stay put."""
    mech = instance(name)
    q, k, v = qkv(dtype=torch.float64)
    keep = torch.rand(2, 1, 1, 41) > 0.3
    keep[1, ..., :] = False  # one batch element with every key masked: output 0
    inputs = call_inputs(mech, q, k, v, attn_mask=keep, enable_gqa=True)
    if mech.spec.masks == "none":
        assert mech.not_supported_reasons(inputs)
        with pytest.raises(M.UnsupportedInputs, match="mask"):
            mech(q, k, v, attn_mask=keep, enable_gqa=True)
        return
    assert not mech.not_supported_reasons(inputs), mech.not_supported_reasons(inputs)
    out = mech(q, k, v, attn_mask=keep, enable_gqa=True)
    dead = ~keep[:, 0, 0, :]  # (B, S)
    k2, v2 = k.clone(), v.clone()
    k2[dead.unsqueeze(1).expand_as(k2[..., 0])] = 1e3
    v2[dead.unsqueeze(1).expand_as(v2[..., 0])] = -1e3
    out2 = mech(q, k2, v2, attn_mask=keep, enable_gqa=True)
    assert_close(out2, out, atol=1e-9, rtol=1e-9, what=f"{name}: masked keys changed the output")
    assert_close(out[1], torch.zeros_like(out[1]), atol=0, what=f"{name}: fully masked rows")


@pytest.mark.parametrize("name", ALL)
def test_conformance_full_masks_only_where_claimed(name):
    mech = instance(name)
    q, k, v = qkv()
    mask = torch.rand(37, 41) > 0.3
    reasons = mech.not_supported_reasons(call_inputs(mech, q, k, v, attn_mask=mask, enable_gqa=True))
    if mech.spec.masks == "any":
        assert not reasons
        assert torch.isfinite(mech(q, k, v, attn_mask=mask, enable_gqa=True)).all()
    else:
        assert reasons
        with pytest.raises(M.UnsupportedInputs):
            mech(q, k, v, attn_mask=mask, enable_gqa=True)


@pytest.mark.parametrize("name", ALL)
def test_conformance_causal_never_leaks(name):
    """Changing token j (its query, key and value) leaves every output before j unchanged."""
    mech = instance(name)
    if name == "token_pruning":
        mech = M.get("token_pruning", keep_ratio=0.3, score="key_norm", block_size=5)
    L = 37
    q, k, v = qkv(dtype=torch.float64, L=L, S=L)
    kw = {} if name != "sparse" else {"attn_mask": torch.rand(L, L) > 0.2}
    if not mech.spec.causal:
        assert mech.not_supported_reasons(call_inputs(mech, q, k, v, is_causal=True, enable_gqa=True, **kw))
        with pytest.raises(M.UnsupportedInputs, match="causal"):
            mech(q, k, v, is_causal=True, enable_gqa=True, **kw)
        return
    out = mech(q, k, v, is_causal=True, enable_gqa=True, **kw)
    for j in (0, 20, 36):
        q2, k2, v2 = q.clone(), k.clone(), v.clone()
        q2[:, :, j:] += 5 * rand(*q2[:, :, j:].shape, dtype=torch.float64)
        k2[:, :, j:] += 5 * rand(*k2[:, :, j:].shape, dtype=torch.float64)
        v2[:, :, j:] += 5 * rand(*v2[:, :, j:].shape, dtype=torch.float64)
        out2 = mech(q2, k2, v2, is_causal=True, enable_gqa=True, **kw)
        assert_close(out2[:, :, :j], out[:, :, :j], atol=1e-10, rtol=1e-9, what=f"{name}: leak from token {j}")
        if j:
            assert not torch.allclose(out2[:, :, j:], out[:, :, j:]), "the change should reach later outputs"


@pytest.mark.parametrize("name", ALL)
def test_conformance_gradients_flow(name):
    mech = instance(name)
    q, k, v = (t.requires_grad_() for t in qkv(L=21, S=21))
    kw = {} if name != "sparse" else {"attn_mask": torch.rand(21, 21) > 0.2}
    if mech.spec.causal:
        kw["is_causal"] = True
    out = mech(q, k, v, enable_gqa=True, **kw)
    (out * rand(*out.shape)).sum().backward()
    for t, nm in ((q, "query"), (k, "key"), (v, "value")):
        assert t.grad is not None and torch.isfinite(t.grad).all(), f"{name}: {nm} grad"
        assert t.grad.abs().sum() > 0, f"{name}: no gradient reaches {nm}"


@pytest.mark.parametrize("name", ALL)
def test_conformance_cost_model(name):
    mech = instance(name)
    n0 = 48 if name == "block_sparse" else 512  # the block layout covers 48 positions
    f, mem = mech.flops(n0, n0, 64), mech.memory(n0, n0, 64)
    assert isinstance(f, int) and f > 0 and isinstance(mem, int) and mem > 0
    assert mech.flops(n0 // 2, n0, 64) <= f  # fewer queries never cost more
    if name in ("linear", "performer", "linformer", "nystrom", "hierarchical"):
        n = 16384  # sub-quadratic: far below dense at long lengths
        assert mech.flops(n, n, 64) < M.get("dense").flops(n, n, 64) / 10
        assert mech.memory(n, n, 64) < M.get("dense").memory(n, n, 64) / 10


@pytest.mark.parametrize("name", ALL)
def test_conformance_edge_shapes(name):
    """L = 1, L != S, and S = 1 run and agree with the oracle for exact ones."""
    mech = instance(name)
    for L, S in ((1, 13), (13, 1), (5, 29)):
        q, k, v = qkv(dtype=torch.float64, L=L, S=S)
        kw = {} if name != "sparse" else {"attn_mask": torch.rand(L, S) > 0.3}
        out = mech(q, k, v, enable_gqa=True, **kw)
        assert out.shape == (2, 4, L, 12) and torch.isfinite(out).all()
        if mech.spec.exact:
            pat = mech.pattern_for()
            m = kw.get("attn_mask")
            if pat is not None:
                pm = pat.materialize(L, S)
                m = pm if m is None else m & pm
            want, _ = reference.attention(q, k, v, m, enable_gqa=True)
            assert_close(out, torch.from_numpy(want), **TOL[torch.float64], what=f"{name} L={L} S={S}")


# -- exact limits of the approximations --------------------------------------------------------------
def test_linformer_identity_projection_with_k_equal_n_is_exact():
    q, k, v = qkv(dtype=torch.float64, L=29, S=29, H=2, Hkv=2)
    want, _ = reference.attention(q, k, v)
    out = M.get("linformer", k=29, projection="identity")(q, k, v)
    assert_close(out, torch.from_numpy(want), **TOL[torch.float64], what="linformer k=n")
    with pytest.raises(M.UnsupportedInputs, match="k == S"):
        M.get("linformer", k=28, projection="identity")(q, k, v)


@pytest.mark.parametrize("pinv,iters,tol", [("iterative", 40, 1e-8), ("exact", 0, 1e-8)])
def test_nystrom_with_landmarks_equal_n_matches_exact(pinv, iters, tol):
    q, k, v = qkv(dtype=torch.float64, L=23, S=23, H=2, Hkv=2)
    want, _ = reference.attention(q, k, v)
    out = M.get("nystrom", num_landmarks=23, pinv=pinv, pinv_iterations=iters)(q, k, v)
    assert_close(out, torch.from_numpy(want), atol=tol, rtol=tol, what=f"nystrom m=n ({pinv})")


def test_nystrom_error_falls_with_landmarks():
    # smooth inputs (neighbouring tokens similar), where segment means are good landmarks
    t = torch.linspace(0, 3, 64, dtype=torch.float64)
    q = torch.stack([torch.sin(t * f) for f in range(1, 9)], -1).expand(1, 2, 64, 8).contiguous()
    k = torch.stack([torch.cos(t * f) for f in range(1, 9)], -1).expand(1, 2, 64, 8).contiguous()
    v = rand(1, 2, 64, 8, dtype=torch.float64)
    want = torch.from_numpy(reference.attention(q, k, v)[0])
    errs = [float((M.get("nystrom", num_landmarks=m, pinv="exact")(q, k, v) - want).norm() / want.norm())
            for m in (2, 8, 32, 64)]
    assert errs[3] < errs[2] < errs[1] < errs[0], errs
    assert errs[3] < 1e-4 * errs[0], errs


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("score", ["attention", "key_norm"])
def test_pruning_keep_ratio_one_is_exact(is_causal, score):
    if is_causal and score == "attention":
        assert M.get("token_pruning", score=score).not_supported_reasons(
            M.Inputs(L=4, S=4, E=2, Ev=2, is_causal=True))
        return
    q, k, v = qkv(dtype=torch.float64, L=31, S=31)
    mask = torch.rand(31, 31) > 0.3
    want, _ = reference.attention(q, k, v, mask, is_causal=is_causal, enable_gqa=True)
    mech = M.get("token_pruning", keep_ratio=1.0, score=score, block_size=6)
    out = mech(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=True)
    assert_close(out, torch.from_numpy(want), **TOL[torch.float64], what="pruning keep_ratio=1")


def test_pruning_keeps_exactly_the_top_keys():
    """keep=r: the weights are non-zero on exactly r keys per (batch, head), the ones scored highest."""
    q, k, v = qkv(dtype=torch.float64, L=9, S=30)
    mech = M.get("token_pruning", keep=7, score="key_norm")
    _, w = mech(q, k, v, enable_gqa=True, need_weights=True)
    used = (w != 0).any(dim=2)  # (B, H, S)
    assert (used.sum(-1) == 7).all()
    top = k.norm(dim=-1).repeat_interleave(2, 1).topk(7, dim=-1).indices
    assert torch.equal(used, torch.zeros_like(used).scatter_(-1, top, True))


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("L,S", [(37, 37), (17, 43), (43, 17)])
def test_hierarchical_window_covering_the_sequence_is_exact(is_causal, L, S):
    q, k, v = qkv(dtype=torch.float64, L=L, S=S)
    want, _ = reference.attention(q, k, v, is_causal=is_causal, enable_gqa=True)
    out = M.get("hierarchical", block_size=max(L, S))(q, k, v, is_causal=is_causal, enable_gqa=True)
    assert_close(out, torch.from_numpy(want), **TOL[torch.float64], what="hierarchical b >= n")


def test_hierarchical_levels_zero_is_block_local_attention():
    """levels=0: raw keys of the query's block and its two neighbours only (a block-banded mask)."""
    b, L = 4, 30
    q, k, v = qkv(dtype=torch.float64, L=L, S=L)
    i = torch.arange(L)
    band = ((i.unsqueeze(1) // b) - (i.unsqueeze(0) // b)).abs() <= 1
    want, _ = reference.attention(q, k, v, band, enable_gqa=True)
    out = M.get("hierarchical", block_size=b, levels=0)(q, k, v, enable_gqa=True)
    assert_close(out, torch.from_numpy(want), **TOL[torch.float64], what="hierarchical levels=0")


def test_hierarchical_equals_attention_over_pooled_keys_it_declares():
    """Oracle for the far field: with constant keys/values inside each pooled segment, mean pooling
    loses nothing, so hierarchical attention must equal exact attention."""
    b, L = 2, 32
    base_k, base_v = rand(1, 1, L // 16, 8, dtype=torch.float64), rand(1, 1, L // 16, 8, dtype=torch.float64)
    k = base_k.repeat_interleave(16, dim=2)
    v = base_v.repeat_interleave(16, dim=2)
    k[:, :, :4] = rand(1, 1, 4, 8, dtype=torch.float64)  # raw keys near queries 0, 1: arbitrary
    v[:, :, :4] = rand(1, 1, 4, 8, dtype=torch.float64)
    q = rand(1, 1, 2, 8, dtype=torch.float64)  # queries 0 and 1 (block 0)
    want, _ = reference.attention(q, k, v)
    out = M.get("hierarchical", block_size=b)(q, k, v)
    assert_close(out, torch.from_numpy(want), **TOL[torch.float64], what="hierarchical, constant far segments")


# -- approximation quality -------------------------------------------------------------------------------
def test_performer_error_falls_as_features_grow():
    q, k, v = qkv(dtype=torch.float64, L=40, S=40, H=2, Hkv=2, E=16)
    q, k = 0.5 * q, 0.5 * k  # moderate norms: the regime where FAVOR+ is accurate
    want = torch.from_numpy(reference.attention(q, k, v)[0])

    def err(m):
        es = [float((M.get("performer", num_features=m, seed=s)(q, k, v) - want).norm() / want.norm())
              for s in range(4)]
        return sum(es) / len(es)

    e16, e64, e512 = err(16), err(64), err(512)
    assert e512 < e64 < e16, (e16, e64, e512)
    assert e512 < 0.5 * e16, (e16, e64, e512)


def test_performer_orthogonal_features_are_orthogonal_in_blocks():
    w = M.get("performer", num_features=40).omega(16, dtype=torch.float64)
    assert w.shape == (40, 16)
    unit = w / w.norm(dim=1, keepdim=True)
    g = unit[:16] @ unit[:16].T
    assert_close(g, torch.eye(16, dtype=torch.float64), atol=1e-12, what="orthogonal block")


def test_performer_kernel_estimate_is_unbiased_on_average():
    """E[φ(q)·φ(k)] = exp(q·k·s): the mean over many draws approaches the exact kernel."""
    from attnlab.mechanisms.performer import orthogonal_gaussian, positive_features

    q, k = 0.3 * rand(1, 1, 3, 8, dtype=torch.float64), 0.3 * rand(1, 1, 4, 8, dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    w = orthogonal_gaussian(4096, 8, generator=g)
    x, y = q * 0.5 ** 0.5, k * 0.5 ** 0.5
    # undo the stabilisers for this check: compute φ without them
    fx = torch.exp(x @ w.T - (x * x).sum(-1, keepdim=True) / 2)
    fy = torch.exp(y @ w.T - (y * y).sum(-1, keepdim=True) / 2)
    est = fx @ fy.transpose(-1, -2) / w.shape[0]
    assert_close(est, torch.exp(q @ k.transpose(-1, -2) * 0.5), atol=0, rtol=0.04, what="FAVOR+ kernel")
    # and the stabilised features used by the mechanism give the same normalised weights
    pq, pk = positive_features(q, w, 0.5, True), positive_features(k, w, 0.5, False)
    a = pq @ pk.transpose(-1, -2)
    assert_close(a / a.sum(-1, keepdim=True), est / est.sum(-1, keepdim=True), atol=1e-5, what="stabilised")


@pytest.mark.parametrize("fmap", ["elu+1", "relu"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_linear_matches_its_quadratic_definition(fmap, is_causal):
    """Chunked prefix sums equal the O(L·S) definition φ(Q)φ(K)ᵀ (causally masked), row-normalised."""
    q, k, v = qkv(dtype=torch.float64, L=45, S=45, H=2, Hkv=2)
    phi = (lambda x: F.elu(x) + 1) if fmap == "elu+1" else F.relu
    a = phi(q) @ phi(k).transpose(-1, -2)
    if is_causal:
        a = a.tril()
    den = a.sum(-1, keepdim=True)
    want = (a @ v) / torch.where(den == 0, torch.ones_like(den), den)
    for chunk in (1, 7, 16, 64):
        out = M.get("linear", feature_map=fmap, chunk_size=chunk)(q, k, v, is_causal=is_causal)
        assert_close(out, want, **TOL[torch.float64], what=f"linear {fmap} chunk={chunk}")


def test_linear_causal_with_more_keys_than_queries_and_fewer():
    for L, S in ((10, 30), (30, 10)):
        q, k, v = qkv(dtype=torch.float64, L=L, S=S, H=1, Hkv=1)
        a = ((F.elu(q) + 1) @ (F.elu(k) + 1).transpose(-1, -2)) * torch.ones(L, S, dtype=torch.float64).tril()
        want = (a @ v) / a.sum(-1, keepdim=True)
        out = M.get("linear", chunk_size=4)(q, k, v, is_causal=True)
        assert_close(out, want, **TOL[torch.float64], what=f"linear causal L={L} S={S}")


# -- modules: state lives in nn.Module ---------------------------------------------------------------
def test_performer_module_owns_and_redraws_its_features():
    mod = M.get("performer", num_features=16).as_module(redraw_interval=2)
    q, k, v = qkv(H=2, Hkv=2)
    o1 = mod(q, k, v)
    assert "omega" in dict(mod.named_buffers()) and mod.omega.shape == (16, 16)
    assert_close(o1, M.get("performer", num_features=16)(q, k, v), atol=1e-6, what="module = functional")
    before = mod.omega.clone()
    mod.train()
    mod(q, k, v), mod(q, k, v), mod(q, k, v)
    assert not torch.equal(before, mod.omega), "features were not redrawn in training"
    mod.eval()
    fixed = mod.omega.clone()
    mod(q, k, v)
    assert torch.equal(fixed, mod.omega)


def test_linformer_module_learns_its_projections():
    mod = M.get("linformer", k=6).as_module(max_len=40)
    assert {n for n, _ in mod.named_parameters()} == {"proj_k", "proj_v"}
    q, k, v = qkv(H=2, Hkv=2, L=11, S=33)
    out = mod(q, k, v)
    assert out.shape == (2, 2, 11, 12)
    out.sum().backward()
    assert mod.proj_k.grad[:, :33].abs().sum() > 0 and mod.proj_k.grad[:, 33:].abs().sum() == 0
    with pytest.raises(ValueError, match="max_len"):
        mod(q, rand(2, 2, 41, 16), rand(2, 2, 41, 12))


def test_linformer_module_with_full_projection_equals_functional():
    m = M.get("linformer", k=6)
    mod = m.as_module(max_len=33, learned=False)
    q, k, v = qkv(H=2, Hkv=2, L=11, S=33)
    assert_close(mod(q, k, v), m(q, k, v), atol=1e-6, what="linformer module (fixed) = functional")
