"""Keys no query may attend have no influence (Note [Dead keys] in attnlab.shapes), and ``pattern=p`` equals
``attn_mask=p.materialize(L, S)`` (Note [One index dtype] in attnlab.patterns.mask_mod), in every method.

The oracle for dead keys is the same call with those keys replaced by 0 (a finite value), and the float64
reference on that clean input. A preallocated KV cache with NaN past its length is the case that matters.
"""
from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab import patterns as P
from attnlab import reference
from attnlab.kernels import compiled
from attnlab.shapes import prepare
from helpers import FUSED_ERROR_FACTOR, TOL, assert_close, max_err

METHODS = ["dense", "sdpa", "tiled", "sparse", "compiled", "auto"]
BLOCKED = {"tiled", "sparse", "compiled"}


def _methods():
    return [pytest.param(m, marks=pytest.mark.skipif(m == "compiled" and not compiled.available(),
                                                     reason="compiled extension not built")) for m in METHODS]


def _keep(L, S, B, H, pattern=None, is_causal=False):
    """The whole bool mask [B, H, L, S] a call applies (pattern, then top-left causal)."""
    m = torch.ones(L, S, dtype=torch.bool) if pattern is None else pattern.materialize(L, S)
    if is_causal:
        m = m & torch.ones(L, S, dtype=torch.bool).tril()
    return torch.broadcast_to(m, (B, H, L, S))


def _naive(q, k, v, keep):
    """softmax(q·kᵀ·scale masked) · v in q's dtype (PyTorch's math path): the same-dtype baseline."""
    s = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    w = torch.softmax(s.masked_fill(~keep, float("-inf")), -1).nan_to_num(0.0)
    return w @ v


# -- defect: pattern= differs from attn_mask=materialize (int32 layouts, int64 tiles) ----------------
@pytest.mark.parametrize("method", _methods())
def test_mask_mod_pattern_equals_its_materialised_mask(method):
    # i * 2**20 + j overflows int32 at i >= 2048: the layouts once saw rows >= 2048 as empty (the issue's
    # reproducer; few keys, since the overflow depends on the query index only)
    pat = P.from_mask_mod(lambda b, h, i, j: (i * 1048576 + j) >= 0)
    L, S = 2200, 24
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 2, L, 4, generator=g), torch.randn(1, 2, S, 4, generator=g), torch.randn(1, 2, S, 4, generator=g)
    mask = pat.materialize(L, S)
    assert bool(mask.all())  # the int64 truth: every pair
    for bs in ((None, 64) if method in BLOCKED else (None,)):
        got = attnlab.attention(q, k, v, pattern=pat, method=method, block_size=bs)
        want = attnlab.attention(q, k, v, attn_mask=mask, method="sdpa" if method == "sparse" else method,
                                 block_size=None if method == "sparse" else bs)
        ref = reference.attention(q.double(), k.double(), v.double())[0]
        budget = FUSED_ERROR_FACTOR * max_err(_naive(q, k, v, mask), ref) + 1e-7
        assert max_err(got, ref) <= budget and max_err(want, ref) <= budget, (bs, max_err(got, ref), budget)


# -- defect: NaN / Inf in dead keys leaks into outputs and gradients --------------------------------
CASES = {
    # name: (L, S, pattern factory (B), is_causal); each leaves keys dead inside partial blocks of 4
    "key_padding": (5, 23, lambda B: P.key_padding([7, 19][:B]), False),
    "key_padding_and_causal": (9, 23, lambda B: P.key_padding([7, 19][:B]) & P.causal(), False),
    "is_causal_L<S": (6, 23, lambda B: None, True),  # SDPA's top-left is_causal: keys >= L are dead
    "sliding_window_L<S": (5, 21, lambda B: P.sliding_window(3), False),
    "window_bottom_right": (3, 22, lambda B: P.sliding_window(4, causal=True, align="bottom_right"), False),
    "strided_interior": (4, 19, lambda B: P.strided(3, causal=False) & P.sliding_window(9), False),
    "document_no_queries": (6, 21, lambda B: P.document([3, 0, 3], kv_lengths=[5, 9, 7]), False),
}


def _poisoned(L, S, B, H, dtype, pattern, is_causal, bad_k, bad_v):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, H, L, 8, generator=g).to(dtype)
    k = torch.randn(B, H, S, 8, generator=g).to(dtype)
    v = torch.randn(B, H, S, 6, generator=g).to(dtype)
    keep = _keep(L, S, B, H, pattern, is_causal)
    dead = ~keep.any(-2)  # (B, H, S)
    assert bool(dead.any()), "the case must have dead keys"
    kb, vb = k.masked_fill(dead[..., None], bad_k), v.masked_fill(dead[..., None], bad_v)
    k0, v0 = k.masked_fill(dead[..., None], 0), v.masked_fill(dead[..., None], 0)
    return q, (kb, vb), (k0, v0), keep, dead


def _run(method, q, k, v, bs, **kw):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = attnlab.attention(q, k, v, method=method, block_size=bs if method in BLOCKED else None, **kw)
    (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return out, q.grad, k.grad, v.grad


#: what the dead keys hold, per dtype: NaN and Inf in both K and V between the two
POISON = {torch.float32: (float("nan"), float("inf")), torch.bfloat16: (float("-inf"), float("nan"))}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("method", _methods())
def test_dead_keys_have_no_influence(case, dtype, method):
    L, S, make, is_causal = CASES[case]
    B, H = 2, 2
    pattern = make(B)
    q, (kb, vb), (k0, v0), keep, dead = _poisoned(L, S, B, H, dtype, pattern, is_causal, *POISON[dtype])
    for bs in ((None, 4) if method in BLOCKED else (None,)):
        got = _run(method, q, kb, vb, bs, pattern=pattern, is_causal=is_causal)
        clean = _run(method, q, k0, v0, bs, pattern=pattern, is_causal=is_causal)
        for name, a, c in zip(("out", "dq", "dk", "dv"), got, clean):
            assert bool(torch.isfinite(a).all()), f"{case} {method} {dtype} bs={bs}: {name} not finite"
            # the same kernels on the same values where it matters: only rounding of dead zeros differs
            assert_close(a, c, atol=TOL[dtype]["atol"] / 8, what=f"{case} {method} bs={bs} {name}")
        assert bool((got[2][dead[..., None].expand_as(got[2])] == 0).all()), "dk must be 0 on dead keys"
        assert bool((got[3][dead[..., None].expand_as(got[3])] == 0).all()), "dv must be 0 on dead keys"
    ref = reference.attention(q.double(), k0.double(), v0.double(), attn_mask=keep)[0]
    assert_close(got[0], ref, **TOL[dtype], what=f"{case} {method} against the float64 reference")


@pytest.mark.parametrize("method", _methods())
def test_dead_keys_under_gqa_dead_for_part_of_a_group(method):
    # a per-head bool mask kills key 2 for head 0 only: k/v heads are shared by the group, so NaN there
    # needs per-head copies (kernels reading k/v in place are refused for it, with the reason)
    B, H, Hkv, L, S = 1, 2, 1, 4, 9
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(B, H, L, 8, generator=g), torch.randn(B, Hkv, S, 8, generator=g), torch.randn(B, Hkv, S, 8, generator=g)
    mask = torch.ones(B, H, L, S, dtype=torch.bool)
    mask[:, 0, :, 2] = False
    mask[:, :, :, 7:] = False  # dead for both heads: a suffix
    kb, vb = k.clone(), v.clone()
    kb[:, :, 2], vb[:, :, 7] = float("nan"), float("inf")
    k0, v0 = kb.nan_to_num(0.0, 0.0, 0.0), vb.nan_to_num(0.0, 0.0, 0.0)
    try:
        out = attnlab.attention(q, kb, vb, attn_mask=mask, enable_gqa=True, method=method)
    except ValueError as e:
        assert method == "compiled" and "group" in str(e), e
        return
    # head 0 never sees keys 2, 7, 8: as if they held 0; head 1 sees key 2's NaN, as it should
    want = reference.attention(q.double(), k0.double(), v0.double(), attn_mask=mask, enable_gqa=True)[0]
    assert bool(torch.isfinite(out[:, 0]).all())
    assert_close(out[:, 0], want[:, 0], **TOL[torch.float32], what=method)


def test_live_view_reads_no_dead_prefix_or_suffix():
    # a KV cache of 64 slots holding 20 keys: the call runs on a view of the 20 (no copy) whatever the rest
    # holds, and its weights still cover all 64 keys (0 past the length)
    B, H, L, S = 2, 2, 3, 64
    q = torch.randn(B, H, L, 8)
    k, v = torch.randn(B, H, S, 8), torch.randn(B, H, S, 8)
    k[:, :, 20:], v[:, :, 20:] = float("nan"), float("inf")
    pat = P.key_padding([20, 20]) & P.causal("bottom_right")
    p = prepare(q, k, v, pattern=pat).live()
    assert p.key_range == (0, 20, 64) and p.info.S == 20
    assert p.kv_k.data_ptr() == k.data_ptr() and p.kv_v.data_ptr() == v.data_ptr()  # views, nothing zeroed
    out, w = attnlab.attention(q, k, v, pattern=pat, need_weights=True)
    assert w.shape == (B, H, L, S) and bool((w[..., 20:] == 0).all())
    want = reference.attention(q.double(), k[:, :, :20].double(), v[:, :, :20].double(),
                               attn_mask=pat.materialize(L, S)[..., :20])[0]
    assert_close(out, want, **TOL[torch.float32])
    # a bottom-right window over the same cache: the keys before the window are a dead prefix
    win = P.sliding_window(5, causal=True, align="bottom_right")
    p = prepare(q, k[:, :, :20], v[:, :, :20], pattern=win).live()
    assert p.key_range == (20 - L - 5, 20, 20)


def test_inner_dead_keys_are_copied_only_when_non_finite():
    B, H, L, S = 2, 1, 4, 16
    q, k, v = torch.randn(B, H, L, 8), torch.randn(B, H, S, 8), torch.randn(B, H, S, 8)
    pat = P.key_padding([9, 16])  # keys 9 .. 15 are dead for element 0 only: inside the live range
    p = prepare(q, k, v, pattern=pat).live()
    assert p.key_range == (0, 16, 16) and p.kv_k is k and p.kv_v is v  # finite: no copy
    k[0, :, 12] = float("nan")
    p = prepare(q, k, v, pattern=pat).live()
    assert p.kv_k is not k and p.kv_v is v  # only the tensor holding NaN is copied
    assert bool((p.kv_k[0, :, 9:] == 0).all()) and torch.equal(p.kv_k[1], k[1])
    assert bool(torch.isnan(k[0, 0, 12]).any())  # the caller's tensor is left as it was


def test_alibi_with_a_dead_suffix_keeps_its_distances():
    # ALiBi counts distances from the last key, so only a dead prefix is cut; the suffix is zeroed instead
    B, H, L, S = 1, 2, 4, 12
    q, k, v = torch.randn(B, H, L, 8), torch.randn(B, H, S, 8), torch.randn(B, H, S, 8)
    pat = P.sliding_window(left=3, right=0, align="bottom_right") & P.key_padding([10])
    k[:, :, 10:], v[:, :, 10:] = float("nan"), float("nan")
    slopes = torch.tensor([0.5, 0.25])
    k0, v0 = k.nan_to_num(0.0), v.nan_to_num(0.0)
    want = reference.attention(q.double(), k0.double(), v0.double(), attn_mask=pat.materialize(L, S),
                               alibi_slopes=slopes.double())[0]
    for method in ("dense", "tiled", "auto"):
        out = attnlab.attention(q, k, v, pattern=pat, alibi_slopes=slopes, method=method)
        assert_close(out, want, **TOL[torch.float32], what=method)
