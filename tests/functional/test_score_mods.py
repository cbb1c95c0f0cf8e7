"""Soft-capping and ALiBi as arguments of attnlab.attention (issue 14): every method that declares them
against the float64 reference (and FlexAttention's score_mod as a second, independent formula); the
methods that do not declare them refuse, naming the argument; bad values are clear errors.

The formula (Note [Score modifications], attnlab/kernels/masks.py; flash-attn's): with x = q·kᵀ·scale,
score = softcap·tanh(x / softcap) − slope·|i + S − L − j| + attn_mask, then masks.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnlab
from attnlab import kernels
from attnlab import patterns as P
from attnlab import reference
from attnlab.kernels import planner
from attnlab.kernels import compiled
from attnlab.nn import MultiHeadAttention
from attnlab.positional import ALiBi, alibi_slopes
from attnlab.shapes import AttentionInputError
from helpers import FUSED_ERROR_FACTOR, TOL, assert_close, max_err

pytestmark = pytest.mark.usefixtures("one_thread")

F64 = TOL[torch.float64]
METHODS = attnlab.METHODS[1:]
HAS_EXT = compiled.available()


def _qkv(B=2, H=4, Hkv=None, L=13, S=13, E=8, Ev=6, dtype=torch.float64, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    Hkv = H if Hkv is None else Hkv
    q = torch.randn(B, H, L, E, generator=g, dtype=dtype)
    k = torch.randn(B, Hkv, S, E, generator=g, dtype=dtype)
    v = torch.randn(B, Hkv, S, Ev, generator=g, dtype=dtype)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


def _slopes(H, B=None):
    s = alibi_slopes(H) * 4  # steeper than the paper's so the bias matters at these lengths
    return s if B is None else s.unsqueeze(0) * torch.linspace(0.5, 1.5, B, dtype=torch.float64).unsqueeze(1)


def _declares(method: str, softcap: bool, alibi: str | None) -> bool:
    s = kernels.get(method)
    return (not softcap or s.softcap) and (alibi is None or (s.alibi != "no" and alibi in s.alibi_shapes))


def _skip_unbuilt(method):
    if method == "compiled" and not HAS_EXT:
        pytest.skip(f"compiled extension: {compiled.unavailable_reason()}")
    if method in kernels.METHODS and kernels.get(method).spec.max_queries is not None:  # its score mods: tests/kernels/test_decode.py
        pytest.skip(f"method={method!r} takes decode shapes only (tests/kernels/test_decode.py covers its score mods)")


# name -> (shapes for _qkv, attention kwargs besides the modifications, softcap, slope rows B or None)
CASES = {
    "softcap": (dict(), dict(), 1.5, None),
    "alibi": (dict(), dict(), None, None),
    "both": (dict(), dict(), 2.0, None),
    "both causal": (dict(), dict(is_causal=True), 2.0, None),
    "both bool mask": (dict(), dict(attn_mask="bool"), 2.0, None),
    "both window": (dict(L=29, S=29), dict(pattern=P.sliding_window(5, causal=True)), 2.0, None),
    "both gqa": (dict(H=4, Hkv=2), dict(enable_gqa=True), 2.0, None),
    "alibi L<S causal": (dict(L=7, S=23), dict(is_causal=True), None, None),
    "both L>S": (dict(L=23, S=7), dict(), 1.0, None),
    "alibi L>S": (dict(L=23, S=7), dict(), None, None),  # |i + S − L − j| folds here: the offset matters
    "alibi per batch": (dict(), dict(is_causal=True), None, 2),
}


def _case(name, dtype=torch.float64):
    shapes, kw, cap, rows = CASES[name]
    q, k, v = _qkv(dtype=dtype, **shapes)
    kw = dict(kw)
    if kw.get("attn_mask") == "bool":
        m = torch.rand(q.shape[-2], k.shape[-2], generator=torch.Generator().manual_seed(1)) > 0.3
        m[2] = False  # a row with no key: output 0
        kw["attn_mask"] = m
    slopes = None if name == "softcap" else _slopes(q.shape[1], q.shape[0] if rows else None)
    return q, k, v, kw, cap, slopes


def _reference(q, k, v, kw, cap, slopes):
    kw = dict(kw)
    pat = kw.pop("pattern", None)
    if pat is not None:
        kw["attn_mask"] = pat.materialize(q.shape[-2], k.shape[-2])
    return reference.attention(q, k, v, softcap=cap, alibi_slopes=slopes, **kw)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("method", METHODS)
def test_each_declaring_method_matches_the_float64_reference(method, case):
    q, k, v, kw, cap, slopes = _case(case)
    alibi = None if slopes is None else "[H]" if slopes.dim() == 1 else "[B, H]"
    if not _declares(method, cap is not None, alibi):
        with pytest.raises(ValueError, match=r"softcap=|alibi_slopes") as e:
            attnlab.attention(q, k, v, method=method, softcap=cap, alibi_slopes=slopes, **kw)
        assert f"method={method!r}" in str(e.value)
        return
    _skip_unbuilt(method)
    ro, rw = _reference(q, k, v, kw, cap, slopes)
    bs = 8 if kernels.get(method).blocked else None  # blocks that do not divide 13, 23 or 29
    out = attnlab.attention(q, k, v, method=method, softcap=cap, alibi_slopes=slopes, block_size=bs, **kw)
    assert_close(out, ro, **F64, what=f"{method} {case}")
    if kernels.get(method).weights != "no":
        _, w = attnlab.attention(q, k, v, method=method, softcap=cap, alibi_slopes=slopes, block_size=bs,
                                 need_weights=True, **kw)
        assert_close(w, rw, **F64, what=f"{method} {case} weights")


@settings(max_examples=30, deadline=None)
@given(B=st.sampled_from([1, 2]), H=st.sampled_from([1, 3]), L=st.sampled_from([1, 3, 17]),
       S=st.sampled_from([1, 5, 17]), causal=st.booleans(), cap=st.sampled_from([None, 0.5, 4.0]),
       slopes=st.sampled_from(["none", "[H]", "[B, H]"]), block=st.sampled_from([1, 3, 16]),
       method=st.sampled_from(["tiled", "compiled", "dense"]), seed=st.integers(0, 2**16))
def test_random_shapes_and_blocks_match_the_reference(B, H, L, S, causal, cap, slopes, block, method, seed):
    if slopes == "[B, H]" and not _declares(method, cap is not None, slopes):
        method = "tiled"  # the compiled kernel refuses per-batch slopes (tested above)
    if method == "compiled" and not HAS_EXT:
        method = "tiled"
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, 4, generator=g, dtype=torch.float64)
    k = torch.randn(B, H, S, 4, generator=g, dtype=torch.float64) * 2
    v = torch.randn(B, H, S, 3, generator=g, dtype=torch.float64)
    # float32 slopes (the compiled kernel reads them as float32, as flash-attn does), compared in float64
    sl = None if slopes == "none" else torch.rand(H if slopes == "[H]" else (B, H), generator=g).double()
    ro, _ = reference.attention(q, k, v, is_causal=causal, softcap=cap, alibi_slopes=sl)
    out = attnlab.attention(q, k, v, is_causal=causal, softcap=cap, alibi_slopes=sl, method=method,
                            block_size=block if method != "dense" else None)
    assert_close(out, ro, **F64, what=f"{method} block {block}")


@pytest.mark.parametrize("case", ["both", "both causal", "both window", "alibi L<S causal"])
def test_lse_matches_the_modified_scores(case):
    q, k, v, kw, cap, slopes = _case(case)
    out, lse = attnlab.attention_with_lse(q, k, v, softcap=cap, alibi_slopes=slopes, **kw)
    # the log-sum-exp written out in torch, from the formula (not from attnlab.reference)
    L, S = q.shape[-2], k.shape[-2]
    x = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = (cap * torch.tanh(x / cap) if cap else x) - slopes.view(-1, 1, 1) * (
        torch.arange(L).view(-1, 1) + S - L - torch.arange(S)).abs()
    keep = torch.ones(L, S, dtype=torch.bool)
    if kw.get("is_causal"):
        keep &= torch.ones(L, S, dtype=torch.bool).tril()
    if "pattern" in kw:
        keep &= kw["pattern"].materialize(L, S)
    s = s.masked_fill(~keep, float("-inf"))
    assert_close(lse, torch.logsumexp(s, -1), **F64, what=f"lse {case}")
    assert_close(out, torch.softmax(s, -1) @ v, **F64, what=f"out {case}")


@pytest.mark.parametrize("case", ["softcap", "alibi", "both causal", "both gqa", "both L>S"])
def test_flex_attention_score_mod_agrees_with_the_reference(case):
    """A second, independent statement of the formulas: FlexAttention's score_mod (eager, CPU)."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    q, k, v, kw, cap, slopes = _case(case)
    L, S = q.shape[-2], k.shape[-2]
    sl = slopes if slopes is not None else torch.zeros(q.shape[1], dtype=torch.float64)

    def score_mod(score, b, h, i, j):  # score is already q·k·scale
        if cap is not None:
            score = cap * torch.tanh(score / cap)
        return score - sl[h] * (i + S - L - j).abs()

    mask_mod = (lambda b, h, i, j: j <= i) if kw.get("is_causal") else None
    bm = flex.create_block_mask(mask_mod, None, None, L, S, device="cpu") if mask_mod else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without torch.compile()": the eager path is the point
        try:
            ours_flex = flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm,
                                            enable_gqa=kw.get("enable_gqa", False))
        except Exception as e:  # noqa: BLE001 - an eager CPU FlexAttention this torch lacks is not our failure
            pytest.skip(f"FlexAttention eager on CPU: {type(e).__name__}: {e}")
    ro, _ = _reference(q, k, v, kw, cap, slopes)
    assert_close(ours_flex, ro, **F64, what=f"flex vs reference {case}")
    assert_close(attnlab.attention(q, k, v, softcap=cap, alibi_slopes=slopes, **kw), ours_flex, **F64,
                 what=f"attnlab vs flex {case}")


@pytest.mark.parametrize("method", [m for m in METHODS if kernels.get(m).softcap])
def test_gradcheck_float64_through_softcap_and_alibi(method):
    _skip_unbuilt(method)
    q, k, v = _qkv(B=1, H=2, L=6, S=9, E=3, Ev=2, requires_grad=True)
    m = torch.rand(6, 9, generator=torch.Generator().manual_seed(3)) > 0.3
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float64)
    for kw in (dict(softcap=0.8), dict(softcap=0.8, alibi_slopes=slopes, is_causal=True),
               dict(softcap=1.3, alibi_slopes=slopes, attn_mask=m)):
        assert torch.autograd.gradcheck(
            lambda q, k, v: attnlab.attention(q, k, v, method=method, block_size=4, **kw), (q, k, v)), kw


@pytest.mark.parametrize("method", [m for m in METHODS if kernels.get(m).softcap])
def test_float32_gradients_match_float64_autograd_of_the_reference_formula(method):
    _skip_unbuilt(method)
    q, k, v = _qkv(B=2, H=2, L=37, S=41, E=16, Ev=8, dtype=torch.float32, requires_grad=True)
    slopes = torch.tensor([0.3, 0.05])
    kw = dict(softcap=3.0, alibi_slopes=slopes, is_causal=True)
    out = attnlab.attention(q, k, v, method=method, block_size=16, **kw)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = attnlab.attention(q64, k64, v64, method="dense", **kw)  # autograd through tanh, float64
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), g.double())
    for name, a, b in zip("qkv", grads, ref_grads):
        assert_close(a, b, **TOL[torch.float32], what=f"{method} d{name}")


def _naive_bf16(q, k, v, cap, slopes, causal):
    """The whole formula in bfloat16 (what a careless port would compute): the error budget's base."""
    L, S = q.shape[-2], k.shape[-2]
    x = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
    x = cap * torch.tanh(x / cap)
    d = (torch.arange(L).view(-1, 1) + S - L - torch.arange(S)).abs().to(q.dtype)
    x = x - slopes.to(q.dtype).view(-1, 1, 1) * d
    if causal:
        x = x.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(x, -1) @ v


@pytest.mark.parametrize("method", [m for m in METHODS if kernels.get(m).softcap])
def test_bf16_within_the_naive_bf16_spread(method):
    _skip_unbuilt(method)
    q, k, v = _qkv(B=1, H=4, L=143, S=143, E=32, Ev=32)
    slopes = _slopes(4)
    ro, _ = reference.attention(q, k, v, is_causal=True, softcap=5.0, alibi_slopes=slopes)
    naive = _naive_bf16(q.bfloat16(), k.bfloat16(), v.bfloat16(), 5.0, slopes, True)
    budget = FUSED_ERROR_FACTOR * max_err(naive, ro) + 1e-6
    out = attnlab.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), is_causal=True, softcap=5.0,
                            alibi_slopes=slopes, method=method, block_size=32)
    assert out.dtype == torch.bfloat16
    assert max_err(out, ro) <= budget, f"{method}: {max_err(out, ro):.3g} > budget {budget:.3g}"


# -- refusals, errors, explain --------------------------------------------------------------------
def test_refusals_name_the_argument():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"method='sdpa'.*no soft-capping \(softcap=\)"):
        attnlab.attention(q, k, v, method="sdpa", softcap=2.0)
    with pytest.raises(ValueError, match=r"method='sparse'.*no ALiBi \(alibi_slopes=\)"):
        attnlab.attention(q, k, v, method="sparse", is_causal=True, alibi_slopes=_slopes(4))
    with pytest.raises(ValueError, match=r"strict=True: ALiBi would be written out"):
        attnlab.attention(q, k, v, method="sdpa", strict=True, alibi_slopes=_slopes(4))
    if HAS_EXT:
        with pytest.raises(ValueError, match=r"alibi_slopes of shape \[H\] only, got \[B, H\]"):
            attnlab.attention(q, k, v, method="compiled", alibi_slopes=_slopes(4, 2))


BAD = [
    (dict(softcap=-1.0), AttentionInputError, r"softcap must be a finite float > 0"),
    (dict(softcap=float("nan")), AttentionInputError, r"softcap must be a finite float > 0.*nan"),
    (dict(softcap=float("inf")), AttentionInputError, r"softcap must be a finite float > 0"),
    (dict(softcap=True), TypeError, r"softcap must be a float > 0, 0.0 or None, got bool"),
    (dict(softcap=torch.tensor(2.0)), TypeError, r"softcap must be a float > 0, 0.0 or None, got Tensor"),
    (dict(alibi_slopes=torch.ones(5)), AttentionInputError, r"alibi_slopes \[5\] must be \[H\] = \[4\] or "
                                                            r"\[\*batch, H\] = \[2, 4\].*query \[2, 4, 13, 8\]"),
    (dict(alibi_slopes=torch.ones(3, 4)), AttentionInputError, r"alibi_slopes \[3, 4\] must be \[H\] = \[4\]"),
    (dict(alibi_slopes=torch.ones(4, 1)), AttentionInputError, r"alibi_slopes \[4, 1\]"),
    (dict(alibi_slopes=torch.tensor(0.5)), AttentionInputError, r"alibi_slopes \[\] must be"),
    (dict(alibi_slopes=torch.ones(4, dtype=torch.int64)), TypeError, r"alibi_slopes must be a floating tensor"),
    (dict(alibi_slopes=torch.tensor([0.5, float("nan"), 0.1, 0.2])), AttentionInputError,
     r"alibi_slopes must be finite"),
    (dict(alibi_slopes=torch.ones(4, requires_grad=True)), AttentionInputError,
     r"alibi_slopes requires grad.*alibi_slopes.detach\(\)"),
    (dict(alibi_slopes=[0.5, 0.25, 0.1, 0.1]), TypeError, r"alibi_slopes must be a torch.Tensor, got list"),
    # issue 21 (11): a float64 slope past float32's range was inf in the compiled kernel, inf·0 = NaN
    (dict(alibi_slopes=torch.tensor([1e39, 0.5, 0.1, 0.1], dtype=torch.float64)), AttentionInputError,
     r"alibi_slopes must be at most 3.40282e\+38 in magnitude.*float32.*got max \|slope\| 1e\+39"),
]


@pytest.mark.parametrize("kw,err,msg", BAD, ids=[f"{list(b[0])[0]}={b[0][list(b[0])[0]]!r}"[:40] for b in BAD])
@pytest.mark.parametrize("fn", ["attention", "attention_with_lse", "explain"])
def test_bad_values_are_clear_errors_naming_the_argument(fn, kw, err, msg):
    q, k, v = _qkv()
    with pytest.raises(err, match=msg):
        getattr(attnlab, fn)(q, k, v, **kw)


#: issue 21 (11): softcap=3.5e38 with float32 inputs is inf in float32, and inf·tanh(x / inf) = NaN in every
#: method; c·tanh(x / c) -> x as c -> inf, so a cap past the compute dtype's range is the identity (Note [Soft-cap
#: at infinity], kernels/masks.py). float64 inputs keep such a cap (finite there), which is the identity too.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("method", [m for m in METHODS if kernels.get(m).softcap])
def test_softcap_past_the_dtype_range_is_the_identity(method, dtype):
    _skip_unbuilt(method)
    q, k, v = _qkv(dtype=dtype, L=13, S=19)
    slopes = _slopes(4)
    ro, _ = reference.attention(q, k, v, is_causal=True, alibi_slopes=slopes)  # no cap
    tol = F64 if dtype == torch.float64 else TOL[dtype]
    for cap in (3.5e38, 1e38, 1e300 if dtype == torch.float64 else 3.4028236e38):
        out = attnlab.attention(q, k, v, is_causal=True, softcap=cap, alibi_slopes=slopes, method=method)
        assert_close(out, ro, **tol, what=f"{method} {dtype} softcap={cap}")


@pytest.mark.skipif(not HAS_EXT, reason="compiled extension not built")
def test_compiled_direct_callers_get_the_same_softcap_and_slope_rules():
    from attnlab.kernels.masks import MaskSpec
    q, k, v = _qkv(dtype=torch.float32, B=1, H=2, L=9, S=9)
    spec = MaskSpec(9, 9)
    plain = compiled.compiled_attention(q, k, v, spec, 0.35)[0]
    huge = compiled.compiled_attention(q, k, v, spec, 0.35, softcap=3.5e38)[0]
    assert torch.equal(huge, plain)
    with pytest.raises(ValueError, match=r"alibi_slopes must be finite float32 values, \|slope\| <= 3.40282e\+38"):
        compiled.compiled_attention(q, k, v, spec, 0.35, alibi_slopes=torch.tensor([1e39, 0.5], dtype=torch.float64))


def test_explain_shows_the_choice_and_what_sdpa_pays_for_alibi():
    q, k, v = _qkv(B=1, H=4, L=64, S=64)
    p = attnlab.explain(q, k, v, alibi_slopes=_slopes(4), is_causal=True)
    text = str(p)
    assert "sparse   refused: no ALiBi (alibi_slopes=)" in text
    # 4·64·64 float64 (the inputs' dtype; float32 for float32 and half inputs) = 128 KiB
    assert p.notes["sdpa"] == "ALiBi written out as a [1, H, L, S] float mask: 128 KiB"
    assert "note: ALiBi written out" in text
    if HAS_EXT:
        assert p.method == "compiled" and "ALiBi computed there from positions" in p.reason
    p = attnlab.explain(q, k, v, softcap=3.0)
    assert "sdpa     refused: no soft-capping (softcap=)" in str(p)
    if HAS_EXT:
        assert p.method == "compiled" and "soft-capping computed inside its" in p.reason
    q2, k2, v2 = _qkv(B=3, H=4, L=16, S=16)
    p = attnlab.explain(q2, k2, v2, alibi_slopes=_slopes(4).expand(3, 4))
    assert "[B, H]" not in p.refused.get("compiled", "")  # equal rows are per-head slopes
    p = attnlab.explain(q2, k2, v2, alibi_slopes=_slopes(4, 3))
    assert "got [B, H]" in p.refused["compiled"]
    assert p.notes["sdpa"].startswith("ALiBi written out as a [B, H, L, S] float mask")
    # the peak sdpa is predicted to need includes the written-out mask, and explain says so
    p0, p1 = attnlab.explain(q, k, v, is_causal=True), attnlab.explain(q, k, v, alibi_slopes=_slopes(4))
    assert p1.peak_bytes["sdpa"] - p0.peak_bytes["sdpa"] >= 4 * 64 * 64 * 8


def test_auto_falls_back_to_tiled_for_softcap_without_the_extension(monkeypatch):
    monkeypatch.setattr(compiled, "unavailable_reason", lambda *t: "ATTNLAB_NO_EXT is set (test)")
    planner._refusals.cache_clear()
    try:
        q, k, v, kw, cap, slopes = _case("both causal")
        p = attnlab.explain(q, k, v, softcap=cap, alibi_slopes=slopes, **kw)
        assert p.method == "tiled" and "computed per tile" in p.reason
        assert p.refused["compiled"].startswith("ATTNLAB_NO_EXT")
        out = attnlab.attention(q, k, v, softcap=cap, alibi_slopes=slopes, **kw)
        assert_close(out, _reference(q, k, v, kw, cap, slopes)[0], **F64, what="auto without extension")
        out, lse = attnlab.attention_with_lse(q, k, v, softcap=cap, alibi_slopes=slopes, **kw)  # tiled's
        assert_close(out, _reference(q, k, v, kw, cap, slopes)[0], **F64, what="attention_with_lse on tiled")
        # ALiBi alone, no extension: SDPA with the bias written out (no tanh needed)
        assert attnlab.explain(q, k, v, alibi_slopes=slopes).method == "sdpa"
    finally:
        planner._refusals.cache_clear()


# -- nn.MultiHeadAttention ------------------------------------------------------------------------
def _spy_slopes(monkeypatch):
    """Record the alibi_slopes each prepare() in nn.attention receives."""
    from attnlab.nn import attention as nn_attention

    seen = []
    real = nn_attention.prepare

    def spy(*a, **kw):
        seen.append(kw.get("alibi_slopes"))
        return real(*a, **kw)

    monkeypatch.setattr(nn_attention, "prepare", spy)
    return seen


@pytest.mark.parametrize("mechanism", ["auto", "compiled", "tiled", "sdpa", "dense"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_mha_alibi_slopes_path_equals_the_written_out_bias(monkeypatch, mechanism, dtype):
    _skip_unbuilt(mechanism)
    torch.manual_seed(0)
    H, L = 4, 21
    m = MultiHeadAttention(32, H, positional=ALiBi(H), mechanism=mechanism).to(dtype)
    plain = MultiHeadAttention(32, H, mechanism="dense").to(dtype)
    plain.load_state_dict(m.state_dict())
    x = torch.randn(2, L, 32, dtype=dtype)
    seen = _spy_slopes(monkeypatch)
    y = m(x, is_causal=True)[0]
    given = seen[-1]  # what the last prepare() of the layer with ALiBi got
    pos = torch.arange(L)
    bias = ALiBi(H).bias(pos, pos).to(dtype).unsqueeze(0)  # (1, H, L, S): the old path's tensor
    y_old = plain(x, attn_mask=bias, is_causal=True)[0]
    assert_close(y, y_old, **TOL[dtype], what=f"{mechanism} slopes vs bias")
    takes = kernels.get(mechanism).alibi in ("native", "positions") if mechanism != "auto" else HAS_EXT
    assert (given is not None) == takes, (mechanism, seen)


def test_mha_alibi_under_a_kv_cache_uses_slopes_and_matches_the_full_pass(monkeypatch):
    from attnlab.nn import LayerCache

    torch.manual_seed(0)
    m = MultiHeadAttention(32, 4, positional=ALiBi(4), mechanism="tiled").double()
    x = torch.randn(1, 11, 32, dtype=torch.float64)
    full = m(x, is_causal=True)[0]
    seen = _spy_slopes(monkeypatch)
    cache = LayerCache()
    steps = [m(x[:, :6], is_causal=True, cache=cache)[0]]
    steps += [m(x[:, t:t + 1], is_causal=True, cache=cache)[0] for t in range(6, 11)]
    assert all(s is not None for s in seen)  # offset == S - L at every step: the kernel's formula
    assert_close(torch.cat(steps, 1), full, **F64, what="cached decode with ALiBi slopes")


def test_mha_softcap_matches_the_reference():
    torch.manual_seed(0)
    m = MultiHeadAttention(24, 3, softcap=1.5, positional=ALiBi(3)).double()
    x = torch.randn(2, 9, 24, dtype=torch.float64)
    r = m.forward_intermediates(x, is_causal=True)
    ro, _ = reference.attention(r.q, r.k, r.v, is_causal=True, softcap=1.5, alibi_slopes=ALiBi(3).slopes)
    expect = m.out_proj(torch.as_tensor(ro).transpose(1, 2).reshape(2, 9, 24))
    assert_close(r.output, expect, **F64, what="MHA softcap + ALiBi")
    assert "softcap=1.5" in repr(m)


def test_mha_softcap_errors():
    with pytest.raises(AttentionInputError, match=r"softcap must be a finite float > 0"):
        MultiHeadAttention(16, 2, softcap=-1.0)
    with pytest.raises(ValueError, match=r"softcap=2.0 needs an exact method.*takes no soft-capping"):
        MultiHeadAttention(16, 2, softcap=2.0, mechanism="linear")


def test_softcap_zero_is_off_as_in_flash_attn():
    """flash_attn_func's default softcap=0.0 means no capping; ported code must run unchanged (and exactly)."""
    torch.manual_seed(3)
    q, k, v = (torch.randn(2, 4, 11, 8, dtype=torch.float64) for _ in range(3))
    want, _ = reference.attention(q, k, v, is_causal=True)
    for method in ("dense", "tiled", "sdpa") + (("compiled",) if HAS_EXT else ()):
        got = attnlab.attention(q, k, v, is_causal=True, softcap=0.0, method=method)
        assert_close(got, torch.as_tensor(want), **F64, what=f"{method} softcap=0.0")
    assert MultiHeadAttention(16, 2, softcap=0.0).softcap is None
