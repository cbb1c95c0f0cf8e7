"""attnlab.flex_attention (issue 24) against torch's FlexAttention eager reference, in float64.

Oracles: torch's public ``flex_attention`` run without compile (forward and lse; it refuses backward on
CPU) and, for gradients, ``math_attention`` from ``torch._higher_order_ops.flex_attention``: the dense
vmap-based math that ``flex_attention`` itself runs without compile, differentiated by autograd (its lse
and max_scores are in log2 units: times ln 2 here). Score_mods and mask_mods follow PyTorch's
test_flex_attention and attention-gym. The kinds the trace proves (Note [score_mod by its trace]) are asserted too.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch._higher_order_ops.flex_attention import math_attention
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_block_mask, noop_mask
from torch.nn.attention.flex_attention import flex_attention as torch_flex

import attnlab
from attnlab import patterns as P
from attnlab.functional import flex
from attnlab.kernels import compiled as compiled_kernel
from attnlab.shapes import AttentionInputError
from helpers import TOL, assert_close

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]

F64 = TOL[torch.float64]
#: how a relative bias runs: one table per offset in the compiled kernel, or (without it) the kept blocks
RELATIVE = "relative" if compiled_kernel.available() else "kept blocks"
B, H, L, E = 2, 3, 37, 8  # 37: blocks of 16 leave a partial edge block


def _qkv(B=B, H=H, L=L, S=L, Hkv=None, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    Hkv = H if Hkv is None else Hkv
    ts = (torch.randn(B, H, L, E, generator=g, dtype=torch.float64),
          torch.randn(B, Hkv, S, E, generator=g, dtype=torch.float64),
          torch.randn(B, Hkv, S, 5, generator=g, dtype=torch.float64))
    return tuple(t.requires_grad_(grad) for t in ts)


# -- score_mods: name -> (factory(H, L) -> (score_mod, captured tensors), kind the probe must find) ------
def _identity(H, L):
    return (lambda s, b, h, q, k: s), []


def _times_two(H, L):
    return (lambda s, b, h, q, k: s * 2), []


def _rel_bias(H, L):
    return (lambda s, b, h, q, k: s + (q - k)), []


def _rel_causal(H, L):  # a mask written as a score_mod (-inf): affine with a -inf bias
    return (lambda s, b, h, q, k: torch.where(q >= k, s + (q - k) * 0.1, float("-inf"))), []


def _alibi(H, L):  # learned per-head slopes
    slopes = (torch.rand(H, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) * 0.5).requires_grad_()
    return (lambda s, b, h, q, k: s - slopes[h] * (q - k).abs()), [slopes]


def _t5(H, L):  # T5-style: a learned [H, buckets] table indexed by the clamped relative position
    table = torch.randn(H, 17, dtype=torch.float64, generator=torch.Generator().manual_seed(4)).requires_grad_()
    return (lambda s, b, h, q, k: s + table[h, torch.clamp(q - k, -8, 8) + 8]), [table]


def _rel_table(H, L):  # a learned relative-position table indexed by q_idx - kv_idx
    table = torch.randn(4 * L, dtype=torch.float64, generator=torch.Generator().manual_seed(5)).requires_grad_()
    return (lambda s, b, h, q, k: s * 0.5 + table[q - k + 2 * L]), [table]


def _sinks(H, L):  # attention sinks: the first key gets a learned per-head logit
    sink = torch.randn(H, dtype=torch.float64, generator=torch.Generator().manual_seed(6)).requires_grad_()
    return (lambda s, b, h, q, k: torch.where(k == 0, s + sink[h], s)), [sink]


def _softcap(H, L):
    return (lambda s, b, h, q, k: 2.5 * torch.tanh(s / 2.5)), []


def _softcap_bias(H, L):
    table = torch.randn(4 * L, dtype=torch.float64, generator=torch.Generator().manual_seed(7)).requires_grad_()
    return (lambda s, b, h, q, k: 2.5 * torch.tanh(s / 2.5) + table[q - k + 2 * L]), [table]


def _tanh_gate(H, L):  # non-affine, reads a learned per-head gate
    gate = torch.randn(H, dtype=torch.float64, generator=torch.Generator().manual_seed(8)).requires_grad_()
    return (lambda s, b, h, q, k: s + gate[h] * torch.tanh(s)), [gate]


def _head_scale(H, L):  # affine, but the factor varies per head: general
    hs = (torch.rand(H, dtype=torch.float64, generator=torch.Generator().manual_seed(9)) + 0.5).requires_grad_()
    return (lambda s, b, h, q, k: s * hs[h]), [hs]


def _squared(H, L):
    return (lambda s, b, h, q, k: s * s), []


def _leaky(H, L):  # piecewise linear: where(score > 0, ...)
    return (lambda s, b, h, q, k: torch.where(s > 0, s, 0.25 * s)), []


def _trig(H, L):
    return (lambda s, b, h, q, k: torch.sin(s) + torch.cos(b.to(s.dtype) + h)), []


SCORE_MODS = {
    "none": (None, "none"), "identity": (_identity, "identity"), "times_two": (_times_two, "affine"),
    "rel_bias": (_rel_bias, "affine"), "rel_causal": (_rel_causal, "affine"), "alibi": (_alibi, "affine"),
    "t5": (_t5, "affine"), "rel_table": (_rel_table, "affine"), "sinks": (_sinks, "affine"),
    "softcap": (_softcap, "softcap"), "softcap_bias": (_softcap_bias, "softcap"), "tanh_gate": (_tanh_gate, "general"),
    "head_scale": (_head_scale, "general"), "squared": (_squared, "general"), "leaky": (_leaky, "general"),
    "trig": (_trig, "general"),
}

DOC = torch.tensor([0] * 10 + [1] * 15 + [2] * 12)  # document ids of the L = 37 tokens
MASK_MODS = {
    "none": None,
    "causal": lambda b, h, q, k: q >= k,
    "sliding_window": lambda b, h, q, k: (q >= k) & (q - k <= 6),
    "prefix_lm": lambda b, h, q, k: (k < 9) | (q >= k),
    "document": lambda b, h, q, k: (DOC[q] == DOC[k]) & (q >= k),
}


def _mod(name, H=H, L=L):
    factory, kind = SCORE_MODS[name]
    if factory is None:
        return None, [], kind
    sm, captured = factory(H, L)
    return sm, captured, kind


def _block_mask(mask_mod, L=L, S=L, B=None, H=None, block=16):
    return None if mask_mod is None else create_block_mask(mask_mod, B, H, L, S, device="cpu", BLOCK_SIZE=block)


def _oracle(q, k, v, score_mod, mask_mod, scale=None):
    """torch's eager FlexAttention math: (out, lse, max_scores) in natural log units, differentiable."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    sm = score_mod or (lambda s, b, h, qi, ki: s)
    out, lse2, max2 = math_attention(q, k, v, sm, (mask_mod or noop_mask,), scale, {})
    return out, lse2 * math.log(2), max2 * math.log(2)


def _grads(out, inputs, seed=1):
    g = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(seed))
    return torch.autograd.grad(out, inputs, g, allow_unused=True)


# -- the probe --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(SCORE_MODS))
def test_probe_finds_each_score_mods_kind(name):
    sm, _, kind = _mod(name)
    assert flex.probe_score_mod(sm, B, H, L, L).kind == kind
    q, k, v = _qkv()
    plan = attnlab.flex_plan(q, k, v, sm)
    assert plan.path == ("general" if kind == "general" else "attention"), str(plan)


@pytest.mark.parametrize("fn, kind", [
    (lambda s, b, h, q, k: torch.clamp(s, -50, 50), "general"),  # affine near 0 only
    (lambda s, b, h, q, k: -s, "general"),  # a negative factor does not fold into scale
    (lambda s, b, h, q, k: s + 0.0, "identity"),
    (lambda s, b, h, q, k: 30 * torch.tanh(s / 30) - (q - k).abs() * 0.1, "softcap"),
    # 4.5·tanh(s / 3) is cap·tanh(A·s) with cap 4.5, A = 1/3: soft-capping with the factor A·cap = 1.5 folded into
    # scale (the sampling probe refused it; the trace proves it, and the output equals torch's below)
    (lambda s, b, h, q, k: 3 * torch.tanh(s / 3) * 1.5, "softcap"),
    (lambda s, b, h, q, k: s + 1e-3 * s * s, "general"),  # slight curvature
])
def test_probe_is_not_fooled(fn, kind):
    r = flex.probe_score_mod(fn, 2, 3, 40, 40)
    assert r.kind == kind, r.reason
    q, k, v = _qkv()
    with torch.no_grad():
        assert_close(attnlab.flex_attention(q, k, v, fn), torch_flex(q, k, v, fn), **F64, what=r.reason)


# -- forward and lse against torch's flex_attention ---------------------------------------------------
# every score_mod with no mask and the document mask; every mask with a few score_mods
FORWARD = sorted({(n, m) for n in SCORE_MODS for m in ("none", "document")}
                 | {(n, m) for n in ("none", "t5", "softcap_bias", "tanh_gate", "rel_causal") for m in MASK_MODS})
GRADS = sorted({(n, m) for n in SCORE_MODS if n != "none" for m in ("causal", "document")}
               | {(n, "none") for n in ("alibi", "t5", "tanh_gate", "softcap_bias", "sinks")})


@pytest.mark.parametrize("name, mask", FORWARD)
def test_output_and_lse_match_torch_flex_attention(name, mask):
    sm, _, _ = _mod(name)
    q, k, v = _qkv()
    bm = _block_mask(MASK_MODS[mask])
    with torch.no_grad():
        ref, ref_aux = torch_flex(q, k, v, score_mod=sm, block_mask=bm, return_aux=AuxRequest(lse=True))
        out, aux = attnlab.flex_attention(q, k, v, score_mod=sm, block_mask=bm, return_aux=AuxRequest(lse=True))
    assert_close(out, ref, **F64, what=f"{name}/{mask} out")
    assert_close(aux.lse, ref_aux.lse, **F64, what=f"{name}/{mask} lse")
    assert aux.max_scores is None and aux.lse.dtype == torch.float64


# -- gradients: q, k, v and every captured tensor -----------------------------------------------------
@pytest.mark.parametrize("name, mask", GRADS)
def test_gradients_match_torch_eager_math(name, mask):
    sm, captured, _ = _mod(name)
    q, k, v = _qkv(grad=True)
    mm = MASK_MODS[mask]
    inputs = (q, k, v, *captured)
    ref = _oracle(q, k, v, sm, mm)[0]
    want = _grads(ref, inputs)
    out = attnlab.flex_attention(q, k, v, score_mod=sm, block_mask=_block_mask(mm))
    assert_close(out, ref, **F64, what=f"{name}/{mask} out")
    got = _grads(out, inputs)
    for what, a, e in zip(["dq", "dk", "dv"] + [f"d captured {i}" for i in range(len(captured))], got, want):
        assert a is not None, f"{name}/{mask}: no gradient for {what}"
        assert_close(a, e, **F64, what=f"{name}/{mask} {what}")


@pytest.mark.parametrize("name", ["alibi", "tanh_gate"])
def test_lse_and_max_scores_are_differentiable_and_match(name):
    sm, captured, _ = _mod(name)
    q, k, v = _qkv(grad=True)
    mm = MASK_MODS["sliding_window"]
    out, aux = attnlab.flex_attention(q, k, v, sm, _block_mask(mm), return_aux=AuxRequest(lse=True, max_scores=True))
    ro, rl, rm = _oracle(q, k, v, sm, mm)
    assert_close(aux.lse, rl, **F64, what="lse")
    assert_close(aux.max_scores, rm, **F64, what="max_scores")
    inputs = (q, k, v, *captured)
    g = torch.autograd.grad((out.sum() + (aux.lse * torch.linspace(-1, 1, L, dtype=torch.float64)).sum()), inputs)
    w = torch.autograd.grad((ro.sum() + (rl * torch.linspace(-1, 1, L, dtype=torch.float64)).sum()), inputs)
    for i, (a, e) in enumerate(zip(g, w)):
        assert_close(a, e, **F64, what=f"grad {i} through out and lse")


def test_gradcheck_captured_tensors_float64():
    q, k, v = (t[:1, :2, :7] for t in _qkv())
    table = torch.randn(2, 17, dtype=torch.float64, requires_grad=True)
    gate = torch.randn(2, dtype=torch.float64, requires_grad=True)
    bm = _block_mask(MASK_MODS["causal"], L=7, S=7, block=4)

    def affine(table):
        return attnlab.flex_attention(q, k, v, lambda s, b, h, qi, ki: s + table[h, torch.clamp(qi - ki, -8, 8) + 8], bm)

    def general(gate):
        return attnlab.flex_attention(q, k, v, lambda s, b, h, qi, ki: s + gate[h] * torch.tanh(s), bm)
    assert torch.autograd.gradcheck(affine, (table,))
    assert torch.autograd.gradcheck(general, (gate,))


# -- block masks --------------------------------------------------------------------------------------
def test_attnlab_patterns_and_torch_block_masks_agree():
    q, k, v = _qkv()
    sm, _, _ = _mod("t5")
    causal = MASK_MODS["causal"]
    ref = _oracle(q, k, v, sm, causal)[0]
    for bm in (P.causal(), P.from_mask_mod(causal), _block_mask(causal, block=8)):
        for mod in (sm, _mod("tanh_gate")[0]):
            expect = ref if mod is sm else _oracle(q, k, v, mod, causal)[0]
            with torch.no_grad():
                assert_close(attnlab.flex_attention(q, k, v, mod, bm, block_size=16), expect, **F64, what=repr(bm))


def test_per_head_and_per_batch_masks_take_the_general_path():
    q, k, v = _qkv()
    per_head = lambda b, h, qi, ki: (qi - ki).abs() <= 2 + 3 * h  # noqa: E731
    per_batch = lambda b, h, qi, ki: ki <= qi + b * 5  # noqa: E731
    for mm, Bm, Hm in ((per_head, None, H), (per_batch, B, None)):
        bm = _block_mask(mm, B=Bm, H=Hm)
        with torch.no_grad():
            out = attnlab.flex_attention(q, k, v, _mod("alibi")[0], bm)
        assert_close(out, _oracle(q, k, v, _mod("alibi")[0], mm)[0], **F64, what="per-head/batch mask")
    assert attnlab.flex_plan(q, k, v, block_mask=_block_mask(per_head, H=H)).path == "general"


def test_gqa_and_unequal_lengths():
    q, k, v = _qkv(H=4, Hkv=2, L=11, S=29, grad=True)
    bottom_right = lambda b, h, qi, ki: ki <= qi + 29 - 11  # noqa: E731
    for name in ("alibi", "tanh_gate"):
        sm, captured, _ = _mod(name, H=4)
        bm = _block_mask(bottom_right, L=11, S=29, block=8)
        out = attnlab.flex_attention(q, k, v, sm, bm, enable_gqa=True)
        ref = _oracle(q, k, v, sm, bottom_right)[0]
        assert_close(out, ref, **F64, what=f"{name} gqa out")
        for i, (a, e) in enumerate(zip(_grads(out, (q, k, v, *captured)), _grads(ref, (q, k, v, *captured)))):
            assert_close(a, e, **F64, what=f"{name} gqa grad {i}")


def test_block_lists_are_the_mask_as_in_torchs_kernels():
    """BlockMask.from_kv_blocks with no mask_mod keeps exactly its listed blocks (what the compiled kernels
    do; torch's eager math reads only mask_mod and would keep all), so the oracle is the block layout."""
    q, k, v = _qkv(B=1, H=1, L=32, S=32)
    kv_num = torch.tensor([[[1, 2, 1, 2]]], dtype=torch.int32)
    kv_idx = torch.tensor([[[[0, 0, 0, 0], [0, 1, 0, 0], [2, 0, 0, 0], [3, 1, 0, 0]]]], dtype=torch.int32)
    bm = BlockMask.from_kv_blocks(kv_num, kv_idx, BLOCK_SIZE=8, seq_lengths=(32, 32))
    layout = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 1, 0, 1]], dtype=torch.bool)
    dense = layout.repeat_interleave(8, 0).repeat_interleave(8, 1)
    for sm in (None, _mod("tanh_gate", H=1)[0]):
        ref = _oracle(q, k, v, sm, lambda b, h, qi, ki: dense[qi, ki])[0]
        with torch.no_grad():
            assert_close(attnlab.flex_attention(q, k, v, sm, bm), ref, **F64, what="from_kv_blocks")


def test_a_row_with_no_key_gives_zero_and_minus_inf():
    q, k, v = _qkv(B=1, H=1, L=9)
    mm = lambda b, h, qi, ki: (ki <= qi) & (qi != 4)  # noqa: E731
    for sm in (None, _mod("tanh_gate", H=1)[0]):
        with torch.no_grad():
            out, lse = attnlab.flex_attention(q, k, v, sm, P.from_mask_mod(mm), return_lse=True)
        assert bool((out[0, 0, 4] == 0).all()) and lse[0, 0, 4] == float("-inf")
        assert bool(torch.isfinite(lse[0, 0, :4]).all())


# -- clear errors -------------------------------------------------------------------------------------
def test_errors_name_the_argument():
    q, k, v = _qkv(L=16, S=16)
    with pytest.raises(AttentionInputError, match="query .* 4-D"):
        attnlab.flex_attention(q[0], k[0], v[0])
    with pytest.raises(AttentionInputError, match="enable_gqa"):
        attnlab.flex_attention(q, k[:, :1], v[:, :1])
    with pytest.raises(ValueError, match="kernel_options"):
        attnlab.flex_attention(q, k, v, kernel_options={"BLOCK_M": 64})
    with pytest.raises(ValueError, match="return_lse or return_aux"):
        attnlab.flex_attention(q, k, v, return_lse=True, return_aux=AuxRequest(lse=True))
    with pytest.raises(AttentionInputError, match=r"block_mask was built for .*\(32, 32\).*\(16, 16\)"):
        attnlab.flex_attention(q, k, v, block_mask=_block_mask(MASK_MODS["causal"], L=32, S=32))
    with pytest.raises(TypeError, match="block_mask must be"):
        attnlab.flex_attention(q, k, v, block_mask=torch.ones(16, 16, dtype=torch.bool))
    with pytest.raises(TypeError, match="score_mod must be callable"):
        attnlab.flex_attention(q, k, v, score_mod=3.0)
    with pytest.raises(TypeError, match="score_mod .* must return a float tensor"):
        attnlab.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: 1.0)
    with pytest.raises(ValueError, match="block_size"):
        attnlab.flex_attention(q, k, v, block_size=0)


def test_plan_names_path_and_costs():
    q, k, v = _qkv()
    plan = attnlab.flex_plan(q, k, v, _mod("t5")[0], _block_mask(MASK_MODS["causal"]))
    assert plan.path == "attention" and plan.score_mod.kind == "affine" and plan.bias == RELATIVE
    assert RELATIVE != "relative" or ("rel_bias" in plan.attention_kwargs and any("per offset" in n for n in plan.notes))
    plan = attnlab.flex_plan(q, k, v, _mod("sinks")[0], _block_mask(MASK_MODS["causal"]))
    assert plan.path == "attention" and plan.bias == "kept blocks" and "attn_mask" in plan.attention_kwargs
    assert any("L×S" in n for n in plan.notes)
    plan = attnlab.flex_plan(q, k, v, _mod("tanh_gate")[0], return_aux=AuxRequest(max_scores=True))
    assert plan.path == "general" and "general path" in str(plan)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # probing must not warn
        attnlab.flex_plan(q, k, v, _mod("softcap")[0])


@pytest.mark.parametrize("name, make, kind", [
    ("zero table", lambda: torch.zeros(80, dtype=torch.float64, requires_grad=True), "affine"),
    ("learned factor", lambda: torch.ones((), dtype=torch.float64, requires_grad=True), "general"),
    ("learned cap", lambda: torch.full((), 4.0, dtype=torch.float64, requires_grad=True), "general"),
])
def test_learned_tensors_keep_their_gradient(name, make, kind):
    """A tensor requiring grad must reach the kernel as a tensor: a zero-initialised bias table is still a
    bias (not the identity), and a learned factor or cap cannot be folded into scale / softcap as a number."""
    w = make()
    mods = {"zero table": lambda s, b, h, qi, ki: s + w[qi - ki + 40],
            "learned factor": lambda s, b, h, qi, ki: s * w,
            "learned cap": lambda s, b, h, qi, ki: w * torch.tanh(s / w)}
    sm = mods[name]
    q, k, v = _qkv()
    assert attnlab.flex_plan(q, k, v, sm).score_mod.kind == kind
    out = attnlab.flex_attention(q, k, v, sm, _block_mask(MASK_MODS["causal"]))
    ref = _oracle(q, k, v, sm, MASK_MODS["causal"])[0]
    (got,), (want,) = _grads(out, (w,)), _grads(ref, (w,))
    assert got is not None and float(want.abs().sum()) > 0
    assert_close(got, want, **F64, what=f"{name} gradient")


@pytest.mark.parametrize("name, kind", [("learned factor", "general"), ("learned per-head factor", "general"),
                                        ("learned cap", "general"), ("learned table", "affine")])
def test_learned_factors_are_general_whatever_their_value(name, kind):
    """Note [score_mod by its trace]: a factor or cap read from a tensor that requires grad is never folded into
    scale, even where its value looks like the identity's (w = 1); a learned relative table is a bias."""
    n = 211
    w = {"learned factor": torch.ones((), dtype=torch.float64), "learned per-head factor": torch.ones(2, 1),
         "learned cap": torch.full((), 1e4), "learned table": torch.zeros(2, 2 * n - 1)}[name].requires_grad_()
    mods = {"learned factor": lambda s, b, h, qi, ki: s * w,
            "learned per-head factor": lambda s, b, h, qi, ki: s * w[h, 0],
            "learned cap": lambda s, b, h, qi, ki: w * torch.tanh(s / w),
            "learned table": lambda s, b, h, qi, ki: s + w[h, qi - ki + n - 1]}
    r = flex.probe_score_mod(mods[name], 1, 2, n, n)
    assert r.kind == kind and r.reads_grad, r.reason


# -- the bias on the kept blocks only (Note [Kept-blocks bias]) ---------------------------------------
def _counting(score_mod):
    """score_mod that records each call's grid of (q_idx, kv_idx) pairs, for the calls on [.., r, c] grids (4-D
    index tensors; the classification's check call is on a (2, 1) column of pairs)."""
    calls = []

    def counted(s, b, h, q, k):
        if isinstance(q, torch.Tensor) and q.dim() == 4:  # (the trace's symbolic q is no tensor)
            calls.append(torch.broadcast_tensors(q, k)[0].numel())
        return score_mod(s, b, h, q, k)
    return counted, calls


def test_bias_is_evaluated_on_kept_blocks_only():
    L = 300
    sm, captured, _ = _mod("sinks", L=L)  # not relative (key 0 singled out): Note [Kept-blocks bias]
    counted, calls = _counting(sm)
    q, k, v = _qkv(L=L, S=L, grad=True)
    window = lambda b, h, qi, ki: (qi >= ki) & (qi - ki <= 20)  # noqa: E731
    bm = _block_mask(window, L=L, S=L, block=32)
    out = attnlab.flex_attention(q, k, v, score_mod=counted, block_mask=bm)
    grids = calls
    kept = int((P.block_codes(bm) != P.EMPTY).sum())
    assert max(grids) <= 32 * 3 * 32, grids  # one query block x its <= 2 kept key blocks (+ the edge)
    assert sum(grids) <= kept * 32 * 32 < L * L // 4, (sum(grids), kept)
    ref = _oracle(q, k, v, sm, window)[0]
    assert_close(out, ref, **F64, what="out")
    inputs = (q, k, v, *captured)
    for i, (a, e) in enumerate(zip(_grads(out, inputs), _grads(ref, inputs))):
        assert_close(a, e, **F64, what=f"grad {i}")


# -- a relative bias as one table per offset (Note [Relative bias table]) ----------------------------------
@pytest.mark.parametrize("name", ["t5", "rel_table", "softcap_bias", "alibi", "rel_causal"])
@pytest.mark.parametrize("mask", ["sliding_window", "document", "none"])
def test_relative_bias_is_one_table_per_offset(name, mask):
    """A bias of (h, q_idx - kv_idx) only is evaluated once per offset ([H, L + S - 1] pairs, never a grid
    of kept pairs) and added by the compiled kernel; output, lse and the gradients into q, k, v and the
    captured tables equal torch's eager math in float64."""
    sm, captured, _ = _mod(name, L=L)
    calls = []

    def counted(s, b, h, q, k):
        n = torch.broadcast_tensors(b, h, q, k)[0].numel()
        if isinstance(n, int):  # (not the trace's symbolic call)
            calls.append(n)
        return sm(s, b, h, q, k)
    q, k, v = _qkv(L=L, S=L, grad=True)
    bm = _block_mask(MASK_MODS[mask], L=L, S=L, block=16) if MASK_MODS[mask] else None
    plan = attnlab.flex_plan(q, k, v, counted, bm)
    assert plan.bias == RELATIVE, str(plan)
    calls.clear()
    out = attnlab.flex_attention(q, k, v, score_mod=counted, block_mask=bm)
    if RELATIVE == "relative":  # the table once per offset and the classification's check: never a grid of pairs
        bound = H * (2 * L - 1)
        assert max(calls) <= bound < L * L // 2, calls
    ref, ref_lse = _oracle(q, k, v, sm, MASK_MODS[mask])[:2]
    assert_close(out, ref, **F64, what="out")
    with torch.no_grad():  # lse under autograd takes the general path (its lse is differentiable)
        assert attnlab.flex_plan(q, k, v, sm, bm, return_lse=True).bias == RELATIVE
        lse = attnlab.flex_attention(q, k, v, score_mod=sm, block_mask=bm, return_lse=True)[1]
    assert_close(lse, ref_lse.detach(), **F64, what="lse")
    inputs = (q, k, v, *captured)
    for i, (a, e) in enumerate(zip(_grads(out, inputs), _grads(ref, inputs))):
        assert_close(a, e, **F64, what=f"grad {i}")


@pytest.mark.parametrize("score_mod", [
    lambda s, b, h, q, k: s + 0.1 * q,  # absolute query position
    lambda s, b, h, q, k: s + torch.where(k % 3 == 0, 1.0, 0.0),  # absolute key positions
    lambda s, b, h, q, k: s + b * 0.5 + (q - k),  # relative, but per batch element
    # relative but key 7 masked as -inf: passed as relative (|-inf - t| <= tolerance·inf), off by 0.32
    lambda s, b, h, q, k: s + 0.1 * (q - k) + torch.where(k == 7, float("-inf"), 0.0),
])
def test_relative_probe_refuses_absolute_biases(score_mod):
    """Biases that are not a function of (h, q_idx - kv_idx) take the kept-blocks path, and stay exact."""
    L = 53
    q, k, v = _qkv(B=2, L=L, S=L)
    plan = attnlab.flex_plan(q, k, v, score_mod)
    out = attnlab.flex_attention(q, k, v, score_mod=score_mod)
    assert_close(out, _oracle(q, k, v, score_mod, None)[0], **F64, what="out")
    assert plan.bias == "kept blocks", str(plan)


def test_bias_with_per_head_block_mask_and_empty_rows():
    # per-head BlockMask (not an attnlab pattern) with a learned bias: the kept-blocks path reads the
    # mask per (b, h); query rows 0..4 keep no key in head 1 (output 0, lse -inf as torch's)
    sm, captured, _ = _mod("alibi")
    q, k, v = _qkv(grad=True)

    def per_head(b, h, qi, ki):
        return (qi >= ki) & (qi - ki <= 4 + 6 * h) & ((h != 1) | (qi >= 5))

    bm = _block_mask(per_head, H=H)
    plan = attnlab.flex_plan(q, k, v, sm, bm)
    assert plan.path == "attention" and "kept" in " ".join(plan.notes), str(plan)
    qd, kd, vd = (t.detach() for t in (q, k, v))
    with torch.no_grad():
        ref, ref_aux = torch_flex(qd, kd, vd, score_mod=sm, block_mask=bm, return_aux=AuxRequest(lse=True))
        out, aux = attnlab.flex_attention(qd, kd, vd, score_mod=sm, block_mask=bm, return_aux=AuxRequest(lse=True))
    assert_close(out, ref, **F64, what="out")
    assert torch.equal(torch.isinf(aux.lse), torch.isinf(ref_aux.lse)) and bool(torch.isinf(aux.lse[:, 1, :5]).all())
    fin = torch.isfinite(ref_aux.lse)
    assert_close(aux.lse[fin], ref_aux.lse[fin], **F64, what="lse")
    out = attnlab.flex_attention(q, k, v, score_mod=sm, block_mask=bm)
    ref = _oracle(q, k, v, sm, per_head)[0]
    inputs = (q, k, v, *captured)
    for i, (a, e) in enumerate(zip(_grads(out, inputs), _grads(ref, inputs))):
        assert_close(a, e, **F64, what=f"grad {i}")


_PEAK_SCRIPT = r"""
import resource, sys, torch
import attnlab
from attnlab.patterns import create_block_mask  # torch's evaluates the L x S grid: its peak would hide ours
torch.manual_seed(0)
B, H, L, E = 1, 4, 4096, 32
q, k, v = (torch.randn(B, H, L, E, requires_grad=True) for _ in range(3))
table = torch.randn(H, 65, requires_grad=True)
def t5(s, b, h, qi, ki):
    return s + table[h, torch.clamp(qi - ki, -32, 32) + 32]
def window(b, h, qi, ki):
    return (qi >= ki) & (qi - ki <= 128)
bm = create_block_mask(window, None, None, L, L, device="cpu", BLOCK_SIZE=128)
small = create_block_mask(window, None, None, 256, 256, device="cpu", BLOCK_SIZE=128)
attnlab.flex_attention(q[:, :, :256], k[:, :, :256], v[:, :, :256], t5, small).sum().backward()  # warm up
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
attnlab.flex_attention(q, k, v, t5, bm).sum().backward()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base), B * H * L * L * 4)
"""


@pytest.mark.slow
def test_bias_peak_memory_is_the_kept_blocks():
    # fwd+bwd at L = 4096, 4 heads, window 128: a dense float32 bias alone is 4·4096² · 4 B = 268 MB; the
    # kept blocks' bias (about 3 of 32 key blocks per row) and its gradient are a tenth of that
    import os
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    grown, dense = (int(x) for x in r.stdout.split()[-2:])
    assert grown < dense / 2, f"peak RSS grew {grown / 2**20:.0f} MB; a dense bias is {dense / 2**20:.0f} MB"


# -- a score_mod that singles out one index value (issue 24; proved from the trace since issue 40) ------------
@pytest.mark.parametrize("name, score_mod, kind, bias", [
    ("one key", lambda s, b, h, q, k: s + torch.where(k == 7, 1.0, 0.0), "affine", "kept blocks"),
    ("one query", lambda s, b, h, q, k: s + torch.where(q == 23, 2.0, 0.0), "affine", "kept blocks"),
    ("one head", lambda s, b, h, q, k: s + torch.where(h == 2, 1.5, 0.0), "affine", RELATIVE),
    ("one b", lambda s, b, h, q, k: s + torch.where(b == 1, 1.5, 0.0), "affine", "kept blocks"),
    ("relative but one offset", lambda s, b, h, q, k: s + 0.25 * (q - k) + torch.where(k - q == 5, 3.0, 0.0),
     "affine", RELATIVE),
    ("relative but one b", lambda s, b, h, q, k: s + 0.25 * (q - k) + torch.where(b == 1, 0.75, 0.0), "affine",
     "kept blocks"),
    ("relative but one key", lambda s, b, h, q, k: s - 0.25 * (q - k).abs() + torch.where(k == 30, 2.0, 0.0),
     "affine", "kept blocks"),
    ("squared on one key", lambda s, b, h, q, k: torch.where(k == 11, s * s, s), "general", None),
])
def test_probe_sees_one_index_value(name, score_mod, kind, bias):
    """Issue 24: s + where(k == 7, 1, 0) probed as the identity on 24 random points and ran without its bias.
    Every value of each index is now on a probe line; the output equals torch's eager flex_attention.
    (Biases exact in float32: a float32 bias added to the 0-dim float64 zero score stays float32, see the report.)"""
    q, k, v = _qkv()
    plan = attnlab.flex_plan(q, k, v, score_mod)
    assert plan.score_mod.kind == kind, str(plan)
    assert plan.bias == bias, str(plan)
    with torch.no_grad():
        ref = torch_flex(q, k, v, score_mod=score_mod)
        out = attnlab.flex_attention(q, k, v, score_mod=score_mod)
    assert_close(out, ref, **F64, what=name)


def test_bias_computed_in_the_score_dtype():
    """A float32 bias combined with the score after it, ``(s + x) * c``, computes in the inputs' float64 as
    torch's [B, H, L, S] score makes it (a 0-dim zero score would leave it in float32)."""
    import attnlab
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 24, 8, generator=g, dtype=torch.float64) for _ in range(3))
    x = torch.randn(24, 24, generator=g)  # float32 on purpose

    def mod(s, b, h, qi, ki):
        return (s + x[qi, ki] * 0.1) * 0.7

    got = attnlab.flex_attention(q, k, v, score_mod=mod)
    want = torch_flex(q, k, v, score_mod=mod)
    # float64 agreement: far below float32's rounding of the bias (~1e-8 relative to its size)
    assert (got - want).abs().max().item() < 1e-12


_IMPORT_SCRIPT = r"""
import sys
import torch
import attnlab
from torch.nn.attention.flex_attention import and_masks
from attnlab.patterns import create_block_mask

heavy = ("torch._dynamo", "torch._inductor", "torch._refs", "torch._prims", "torch.fx.experimental.symbolic_shapes",
         "sympy")
before = {m for m in heavy if m in sys.modules}
n, H = 80, 2
doc = torch.arange(n) // 30


def causal(b, h, q, k):
    return q >= k


def window(b, h, q, k):
    return q - k <= 16


def document(b, h, q, k):
    return (doc[q] == doc[k]) & (q >= k)


table = torch.zeros(H, 2 * n - 1, requires_grad=True)
gate = torch.full((H,), 0.5, requires_grad=True)
mods = [None, lambda s, b, h, q, k: s + table[h, q - k + n - 1], lambda s, b, h, q, k: 20 * torch.tanh(s / 20),
        lambda s, b, h, q, k: s + 0.1 * q, lambda s, b, h, q, k: s + gate[h] * torch.tanh(s)]
q, k, v = (torch.randn(1, H, n, 16, requires_grad=True) for _ in range(3))
for mm in (causal, and_masks(window, causal), document):
    bm = create_block_mask(mm, None, None, n, n, BLOCK_SIZE=16)
    for sm in mods:
        attnlab.flex_plan(q, k, v, sm, bm)
        attnlab.flex_attention(q, k, v, score_mod=sm, block_mask=bm).sum().backward()
print(sorted({m for m in heavy if m in sys.modules} - before))
"""


def test_first_call_imports_no_compiler_stack():
    """A first flex_attention call (block masks, every score_mod path, forward and backward) imports none of
    torch's compiler stack: torch.broadcast_shapes' first call imported torch.fx's symbolic shapes and sympy
    (0.3-0.5 s of a first call in a fresh process); a structural check of sys.modules, not a timing."""
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _IMPORT_SCRIPT], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, OMP_NUM_THREADS="1", ATTNLAB_CALIBRATION="off"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split("\n")[-2] == "[]", r.stdout[-2000:]


# -- the classification from the trace (Note [score_mod by its trace]) ----------------------------------------
@pytest.mark.parametrize("name, fn, kind, relative", [
    ("identity", lambda s, b, h, q, k: s, "identity", False),
    ("plus 0.5", lambda s, b, h, q, k: s + 0.5, "affine", True),  # a constant: relative, trivially
    ("relative, scaled", lambda s, b, h, q, k: s * 0.5 + 0.1 * (q - k), "affine", True),
    ("large factor", lambda s, b, h, q, k: s * 3.7e9 + 0.1 * (q - k) + 0.3, "affine", True),
    ("mask as -inf", lambda s, b, h, q, k: torch.where(q >= k, s + (q - k) * 0.1, float("-inf")), "affine", True),
    ("masked_fill", lambda s, b, h, q, k: s.masked_fill(k > q, float("-inf")), "affine", True),
    ("huge factor", lambda s, b, h, q, k: s * 1e302, "affine", False),
    ("nan on one key", lambda s, b, h, q, k: torch.where(k == 5, s * float("nan"), s), "general", False),
    ("softcap", lambda s, b, h, q, k: 30 * torch.tanh(s / 30), "softcap", False),
    ("softcap, large bias", lambda s, b, h, q, k: 30 * torch.tanh(s / 30) + 0.3 + 1.1e12 * (q - k), "softcap", True),
    ("clamp", lambda s, b, h, q, k: torch.clamp(s, -50, 50), "general", False),
    ("curvature", lambda s, b, h, q, k: s + 1e-3 * s * s, "general", False),
    ("negative factor", lambda s, b, h, q, k: -s + 1.0, "general", False),
    ("float index arithmetic", lambda s, b, h, q, k: s + torch.floor(q * 0.1 - k * 0.1), "affine", False),
    ("integer index arithmetic", lambda s, b, h, q, k: s + torch.floor((3 * q - 3 * k) * 0.1), "affine", True),
    ("python control flow", lambda s, b, h, q, k: 2 * s if q.dim() >= 0 else s, "general", False),
])
def test_trace_classifies_score_mods(name, fn, kind, relative):
    """The kind, and whether the bias is proved a function of (h, kv_idx - q_idx) only: q·0.1 - k·0.1 rounds
    per pair, so it is not relative (a floor of it could differ along an offset); a function the trace cannot
    read (Python control flow, here on q's dims) is general, and every one equals torch's eager flex_attention."""
    r = flex.classify_score_mod(fn)
    assert (r.kind, r.relative) == (kind, relative), r.reason
    q, k, v = _qkv(L=24, S=24)
    if name not in ("huge factor", "large factor"):  # (scores of 1e10+ saturate both sides' softmax alike)
        with torch.no_grad():
            assert_close(attnlab.flex_attention(q, k, v, fn), torch_flex(q, k, v, fn), **F64, what=name)
