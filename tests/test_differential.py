"""Property-based differential test: every exact method against the float64 reference, edges included.

Hypothesis draws ranks 3-5, zero-size batch / heads / L / S, L = 1, GQA, scale <= 0, bool and float
masks (float32 masks with bfloat16 inputs too), fully masked rows, and keys removed for every query by
the mask whose key and value rows hold NaN or ±Inf (they must not leak). Dtypes float64, float32 and
bfloat16.

Tolerance, the way PyTorch budgets its fused kernels: a method's error against the float64 reference may
be at most ERROR_FACTOR times the error of the naive computation in the input's own dtype
(softmax(q kᵀ·scale + mask) v with every op in that dtype) against the same reference, plus a floor
of a few units in the last place of the output for cases where the naive computation happens to be
exact.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attnlab
from attnlab import reference
from attnlab.functional import METHODS

EXACT = tuple(m for m in ("dense", "sdpa", "tiled", "sparse", "auto", "compiled") if m in METHODS)
#: a method's error vs float64 may be this factor times the naive same-dtype computation's error
#: (PyTorch's rule for its fused attention kernels; the house FUSED_ERROR_FACTOR)
ERROR_FACTOR = 3.0
#: floor in units of the dtype's eps times max(1, |reference|): the output's own rounding plus summation
FLOOR_EPS = 8


@st.composite
def cases(draw):
    rank = draw(st.sampled_from([3, 4, 4, 5]))
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
    Hkv = draw(st.integers(0, 2))
    groups = draw(st.sampled_from([1, 1, 2, 3])) if Hkv else 1
    H = Hkv * groups
    lead = [draw(st.integers(0, 2)) for _ in range(rank - 3)]
    L = draw(st.sampled_from([0, 1, 1, 2, 5, 17, 33]))
    S = draw(st.sampled_from([0, 1, 3, 8, 17, 40]))
    E = draw(st.integers(1, 12))
    Ev = draw(st.sampled_from([E, E, draw(st.integers(1, 12))]))
    scale = draw(st.sampled_from([None, None, 0.7, 0.0, -0.4, 2.0]))
    is_causal = draw(st.booleans())
    mask_kind = draw(st.sampled_from(["none", "bool", "float"]))
    mask_full = draw(st.booleans())  # [*lead, H, L, S] rather than [L, S]
    poison = draw(st.sampled_from([None, float("nan"), float("inf"), float("-inf")]))
    block = draw(st.sampled_from([None, 4, 16]))
    seed = draw(st.integers(0, 2**31 - 1))
    return dict(rank=rank, dtype=dtype, H=H, Hkv=Hkv, lead=lead, L=L, S=S, E=E, Ev=Ev, scale=scale,
                is_causal=is_causal, mask_kind=mask_kind, mask_full=mask_full, poison=poison, block=block,
                seed=seed)


def _build(c):
    g = torch.Generator().manual_seed(c["seed"])
    lead, L, S = c["lead"], c["L"], c["S"]
    q = torch.randn(*lead, c["H"], L, c["E"], generator=g, dtype=torch.float64)
    k = torch.randn(*lead, c["Hkv"], S, c["E"], generator=g, dtype=torch.float64)
    v = torch.randn(*lead, c["Hkv"], S, c["Ev"], generator=g, dtype=torch.float64)
    mshape = (*lead, c["H"], L, S) if c["mask_full"] else (L, S)
    mask = dead = None
    if c["mask_kind"] != "none":
        keep = torch.rand(mshape, generator=g) > 0.3
        if L and S:
            keep[..., 0, :] = False  # a fully masked row: output 0
        dead = torch.rand(S, generator=g) < 0.3  # keys no query may see (padding)
        keep = keep & ~dead
        if c["mask_kind"] == "bool":
            mask = keep
        else:
            bias = torch.randn(mshape, generator=g, dtype=torch.float64) * 3
            mask = bias.masked_fill(~keep, float("-inf"))
            # float32 masks with bfloat16 inputs stay float32 (issue 13); else the inputs' dtype
            mask = mask.to(torch.float32 if c["dtype"] == torch.bfloat16 else c["dtype"])
    q, k, v = q.to(c["dtype"]), k.to(c["dtype"]), v.to(c["dtype"])
    clean_k, clean_v = k, v
    if dead is not None and c["poison"] is not None and bool(dead.any()):
        # what dead keys hold must not matter: the reference sees zeros there, attnlab sees poison
        k, v = k.clone(), v.clone()
        k[..., dead, :] = c["poison"]
        v[..., dead, :] = c["poison"]
    return q, k, v, clean_k, clean_v, mask


def _naive(q, k, v, mask, is_causal, scale, gqa):
    """softmax(q kᵀ·scale + mask) v with every op in q's dtype; masked scores -inf, empty rows 0."""
    if gqa:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
    L, S, E = q.shape[-2], k.shape[-2], q.shape[-1]
    s = (q @ k.transpose(-2, -1)) * (1 / math.sqrt(E) if scale is None else scale)
    keep = torch.ones(L, S, dtype=torch.bool)
    if is_causal:
        keep = keep.tril()
    if mask is not None and mask.dtype == torch.bool:
        keep = keep & mask
    elif mask is not None:
        s = s + mask.to(q.dtype)
    s = s.masked_fill(~keep, float("-inf"))
    m = s.amax(-1, keepdim=True) if S else torch.zeros(*s.shape[:-1], 1, dtype=s.dtype)
    p = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
    d = p.sum(-1, keepdim=True)
    return (p / torch.where(d == 0, torch.ones_like(d), d)) @ v


def _err(a, ref):
    return float((a.double() - ref).abs().max()) if a.numel() else 0.0


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_every_exact_method_matches_the_float64_reference(c):
    q, k, v, ck, cv, mask = _build(c)
    gqa = c["H"] != c["Hkv"]
    kw = dict(attn_mask=mask, is_causal=c["is_causal"], scale=c["scale"], enable_gqa=gqa)
    ref = torch.from_numpy(reference.attention(q, ck, cv, **kw)[0])
    naive = _err(_naive(q, ck, cv, mask, c["is_causal"], c["scale"], gqa), ref)
    eps = torch.finfo(c["dtype"]).eps
    floor = FLOOR_EPS * eps * max(1.0, float(ref.abs().max()) if ref.numel() else 1.0)
    budget = ERROR_FACTOR * naive + floor
    ran = []
    for method in EXACT:
        try:
            attnlab.explain(q, k, v, **kw, method=method, block_size=c["block"])
        except ValueError as e:
            assert "cannot run these inputs" in str(e), e  # a documented refusal (sparse with no mask)
            continue
        out = attnlab.attention(q, k, v, **kw, method=method, block_size=c["block"])
        assert out.shape == ref.shape and out.dtype == q.dtype, (method, out.shape, ref.shape)
        assert not torch.isnan(out).any(), f"{method}: NaN ({c})"
        err = _err(out, ref)
        assert err <= budget, f"{method}: error {err:.3g} > {ERROR_FACTOR} x naive {naive:.3g} + {floor:.3g} ({c})"
        ran.append(method)
    assert "dense" in ran and "tiled" in ran


@pytest.mark.parametrize("method", EXACT)
def test_the_naive_budget_is_not_vacuous(method):
    # the same budget catches a real error: a key dropped from the softmax
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 9, 8, generator=g) for _ in range(3))
    ref = torch.from_numpy(reference.attention(q, k, v)[0])
    budget = ERROR_FACTOR * _err(_naive(q, k, v, None, False, None, False), ref) + FLOOR_EPS * torch.finfo(torch.float32).eps * 4
    keep = torch.ones(9, 9, dtype=torch.bool)
    keep[:, 4] = False
    out = attnlab.attention(q, k, v, attn_mask=keep, method=method)
    assert _err(out, ref) > 100 * budget
