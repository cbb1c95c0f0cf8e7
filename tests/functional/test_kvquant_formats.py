"""int8 key transforms folded into the query (``functional.kvquant``: Note [int8 key rotation], Note [int8 key
channel smoothing]): the stored rows within half a step, the Hadamard matrix and the channel scales from their
definitions, the channel scales fixed by the first append; the decode kernel on a rotated or smoothed cache equal
to float64 on the dequantised cache within the kernel's int8 budget; the error against llama.cpp's q8_0 simulated
here from its definition (blocks of 32, fp16 scale = amax / 127, roundf); clear errors for bad fields."""
from __future__ import annotations

import math

import pytest
import torch

import attnlab
from attnlab.functional import kvquant
from attnlab.functional.kvquant import SMOOTH_ALPHA, QuantizedKV
from attnlab.kernels import decode as dk
from helpers import int_pv_error

pytestmark = [pytest.mark.usefixtures("one_thread")]
needs_ext = pytest.mark.skipif(not dk.available(), reason=f"decode extension: {dk.unavailable_reason()}")


def _q8_0(x: torch.Tensor) -> torch.Tensor:
    """ggml's quantize_row_q8_0_ref and its dequantisation, float64: per 32 channels d = amax / 127 (fp32),
    q = roundf(x / d), x ≈ q · fp16(d)."""
    xb = x.float().reshape(*x.shape[:-1], -1, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, xb / d, torch.zeros_like(xb))
    q = torch.sign(q) * torch.floor(q.abs() + 0.5)
    return (q.double() * d.half().double()).reshape(x.shape)


def _attend64(q, k, v):
    """q [B, 1, H, D], k, v [B, S, Hkv, D] -> float64 [B, 1, H, D], every key seen."""
    H, D = q.shape[2:]
    G = H // k.shape[2]
    kk = k.double().repeat_interleave(G, 2).transpose(1, 2)  # (B, H, S, D)
    vv = v.double().repeat_interleave(G, 2).transpose(1, 2)
    s = q.double().transpose(1, 2) @ kk.transpose(-1, -2) / math.sqrt(D)  # (B, H, 1, S)
    return (s.softmax(-1) @ vv).transpose(1, 2)


def _keys(seed, S=1024, Hkv=2, D=128, outliers=4, factor=20.0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, S, Hkv, D, generator=g)
    for h in range(Hkv if outliers else 0):
        k[:, :, h, torch.randperm(D, generator=g)[:outliers]] *= factor
    return k, torch.randn(1, S, Hkv, D, generator=g), torch.randn(1, 1, 4 * Hkv, D, generator=g)


def test_channel_scales_and_rows_within_half_a_step():
    """c = max(m, median_D m) ^ alpha with m the per-(head, channel) max|k| (computed here from the definition);
    every stored element is off by at most half its row's step times its channel's c."""
    k, _, _ = _keys(0, S=64, D=32)
    m = k.abs().amax(dim=(0, 1))  # (Hkv, D)
    want = torch.maximum(m, m.median(-1, keepdim=True).values) ** SMOOTH_ALPHA
    kq = QuantizedKV.quantize(k, smooth=True)
    torch.testing.assert_close(kq.channel, want, rtol=1e-6, atol=0)
    err = (kq.dequantize() - k).abs()
    bound = kq.scale.unsqueeze(-1) / 2 * kq.channel * (1 + 1e-5)
    assert bool((err <= bound).all())
    assert kq.channel[0].amax() > 5 * kq.channel[0].median()  # the outlier channels got their own scale


def test_hadamard_from_its_definition():
    """hadamard(4) is Sylvester's [[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]] / 2; D = 96 is
    three such blocks of 32, an odd D the identity; every one orthogonal within float32 rounding."""
    h4 = torch.tensor([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]], dtype=torch.float32) / 2
    assert torch.equal(kvquant.hadamard(4), h4)
    h96 = kvquant.hadamard(96)
    assert torch.equal(h96[32:64, 32:64], kvquant.hadamard(32)) and torch.equal(h96[:32, 32:], torch.zeros(32, 64))
    assert torch.equal(kvquant.hadamard(7), torch.eye(7))
    for D in (64, 96, 128):
        h = kvquant.hadamard(D).double()
        assert float((h @ h.T - torch.eye(D, dtype=torch.float64)).abs().max()) <= 4 * torch.finfo(torch.float32).eps
    for D, rows in ((2, 5), (8, 5), (24, 5), (64, 5), (128, 5), (7, 5), (128, 400), (96, 400)):
        # what the format applies is x Hᵀ: a matmul for a tiny step or many rows, else the elementwise transform
        x = torch.randn(rows, 3, D, generator=torch.Generator().manual_seed(D))
        want = x.double() @ kvquant.hadamard(D).double().T
        assert float((kvquant._rotate(x, kvquant.hadamard(D)) - want).abs().max()) \
            <= 2 * D * torch.finfo(torch.float32).eps * float(x.abs().max())


def test_rotated_rows_within_half_a_step():
    """The stored rows are k Rᵀ within half their step (round to nearest), and dequantize() rotates back."""
    k, _, _ = _keys(2, S=64, D=64)
    kq = QuantizedKV.quantize(k, rotate=True)
    r = kvquant.hadamard(64).double()
    stored = QuantizedKV(kq.data, kq.scale).dequantize().double()
    assert bool(((stored - k.double() @ r.T).abs() <= kq.scale.unsqueeze(-1).double() / 2 * (1 + 1e-5)).all())
    torch.testing.assert_close(kq.dequantize().double(), stored @ r, rtol=0, atol=1e-5 * float(k.abs().max()))


def test_error_against_q8_0():
    """GQA 8/2, D 128, S 1024, 3 seeds, decode output against float64: on keys with 4 outlier channels (20x),
    per-token int8 is worse than q8_0 (the issue's gap) and the rotated and the smoothed caches at most q8_0's
    (measured 0.40x and 0.26x at S 4096: experiments/kvquant.py); on Gaussian keys neither transform changes the
    per-token format's error by more than 10 % (a rotated Gaussian is Gaussian; the median floor leaves ordinary
    channels at one scale)."""
    rel = lambda a, b: float((a - b).norm() / b.norm())
    for outliers in (4, 0):
        e = {"q8_0": 0.0, "row": 0.0, "rotate": 0.0, "smooth": 0.0}
        for seed in range(3):
            k, v, q = _keys(seed, outliers=outliers)
            ref = _attend64(q, k, v)
            vr = QuantizedKV.quantize(v).dequantize().double()
            e["q8_0"] += rel(_attend64(q, _q8_0(k), _q8_0(v)), ref)
            e["row"] += rel(_attend64(q, QuantizedKV.quantize(k).dequantize(), vr), ref)
            e["rotate"] += rel(_attend64(q, QuantizedKV.quantize(k, rotate=True).dequantize(), vr), ref)
            e["smooth"] += rel(_attend64(q, QuantizedKV.quantize(k, smooth=True).dequantize(), vr), ref)
        if outliers:
            assert e["row"] > 1.2 * e["q8_0"] and e["rotate"] <= e["q8_0"] and e["smooth"] <= e["q8_0"], e
        else:
            assert e["rotate"] <= 1.1 * e["row"] and e["smooth"] <= 1.1 * e["row"], e


@needs_ext
@pytest.mark.parametrize("flags", [{"rotate": True}, {"smooth": True}, {"rotate": True, "smooth": True}],
                         ids=["rotate", "smooth", "both"])
@pytest.mark.parametrize("page", [None, 16], ids=["contiguous", "page16"])
def test_kernel_reads_a_transformed_cache(page, flags):
    """A rotated / smoothed key cache through attention_with_kvcache: the first append fixes the channel scales
    (from its rows, as channel_scales defines them) and later appends keep them; the output equals float64
    attention on the dequantised cache within the int8 kernel's budget (tests/functional/test_kvcache_int8.py: a
    score off by 2 eps |q'| |k'| D^-1/2 plus the int16 query's rounding, q' = (q ⊙ c) Rᵀ and k' = data · scale
    the rows the kernel multiplies, plus the float32 rounding of q' itself, D eps |q'| |k'| D^-1/2 at most; a
    probability by twice that relative; the output by that times max|v| plus 2 eps max|v|; budget twice that;
    plus twice the integer P @ V's rounding, ``helpers.int_pv_error``)."""
    k, v, q = _keys(1, S=300, Hkv=2, D=64)
    B, S, Hkv, D = k.shape
    if page is None:
        kc, vc, table = QuantizedKV.empty(B, S, Hkv, D, **flags), QuantizedKV.empty(B, S, Hkv, D), None
    else:
        P = S // page + 1
        kc, vc = QuantizedKV.empty(P, page, Hkv, D, **flags), QuantizedKV.empty(P, page, Hkv, D)
        table = torch.randperm(P)[: -(-S // page)].view(1, -1).to(torch.int32)
    with torch.no_grad():
        attnlab.attention_with_kvcache(q, kc, vc, k[:, :100], v[:, :100], cache_seqlens=0, block_table=table)
        c0 = None if kc.channel is None else kc.channel.clone()
        if c0 is not None:
            torch.testing.assert_close(c0, kvquant.channel_scales(k[:, :100]), rtol=0, atol=0)
        out = attnlab.attention_with_kvcache(q, kc, vc, k[:, 100:], v[:, 100:], cache_seqlens=100, block_table=table)
    assert c0 is None or torch.equal(kc.channel, c0)
    stored = QuantizedKV(kc.data, kc.scale)
    if table is None:
        kf, vf, ks = kc.dequantize(), vc.dequantize(), stored.dequantize()
    else:
        rows = lambda c: c.dequantize()[table[0].long()].reshape(1, -1, Hkv, D)[:, :S]
        kf, vf, ks = rows(kc), rows(vc), rows(stored)
    want = _attend64(q, kf, vf)
    qc = kvquant.query(kc, q)
    eps = torch.finfo(torch.float32).eps
    step = float(qc.abs().amax()) * D ** -0.5 / 32767
    ds = (2 + D) * eps * float(qc.norm(dim=-1).max() * ks.norm(dim=-1).max()) * D ** -0.5 \
        + step / 2 * float(ks.abs().sum(-1).max())
    vs = vc.scale if table is None else vc.scale[table[0].long()].reshape(1, -1, Hkv)[:, :S]
    tol = 2 * (2 * ds + 2 * eps) * float(vf.abs().max()) + 2 * int_pv_error(q, kf, vs, S)
    assert float((out.double() - want).abs().max()) <= tol


def test_query_scales_each_group_by_its_head():
    """query(k_cache, q) = q ⊙ c with kv head g's scales on query heads g·G .. g·G + G - 1; the per-token
    format passes q through."""
    c = torch.arange(1.0, 7.0).view(2, 3)  # (Hkv, D)
    kc = QuantizedKV(torch.zeros(1, 4, 2, 3, dtype=torch.int8), torch.zeros(1, 4, 2), c)
    q = torch.ones(1, 1, 4, 3)
    assert torch.equal(kvquant.query(kc, q)[0, 0], torch.stack([c[0], c[0], c[1], c[1]]))
    assert kvquant.query(QuantizedKV(kc.data, kc.scale), q) is q


def test_bad_fields():
    data, scale = torch.zeros(1, 4, 2, 8, dtype=torch.int8), torch.zeros(1, 4, 2)
    for bad in (torch.zeros(8, 7), torch.eye(8, dtype=torch.float64), "hadamard"):
        with pytest.raises(attnlab.AttentionInputError, match=r"QuantizedKV\.rotation must be None or float32 "
                                                              r"\[D, D\] = \[8, 8\]") as e:
            QuantizedKV(data, scale, None, bad)
        assert "\n" not in str(e.value)
    with pytest.raises(TypeError, match="rotate must be a bool"):
        QuantizedKV.quantize(torch.zeros(1, 4, 2, 8), rotate=1)
    for bad in (torch.zeros(2, 7), torch.zeros(2, 8, dtype=torch.float64), torch.zeros(8)):
        with pytest.raises(attnlab.AttentionInputError, match=r"QuantizedKV\.channel must be None or float32 "
                                                              r"\[Hkv, D\] = \[2, 8\]") as e:
            QuantizedKV(data, scale, bad)
        assert "\n" not in str(e.value)
    with pytest.raises(TypeError, match="smooth must be a bool"):
        QuantizedKV.empty(1, 4, 2, 8, smooth="yes")
    with pytest.raises(attnlab.AttentionInputError, match="finite"):
        QuantizedKV.quantize(torch.full((1, 2, 1, 4), float("nan")), smooth=True)


def test_gathered_path_reads_a_rotated_cache():
    """More queries than the decode kernel takes (L = 20) gather the cache (kernels.cacheview: data · scale, the
    stored basis) and attend with the query hook's q Rᵀ: float64 attention on the dequantised cache with the
    original q, bottom-right causal, within float32 attention's rounding (the gathered call is attention_with_lse
    in float32: 8 D eps relative of the output's scale here)."""
    g = torch.Generator().manual_seed(4)
    B, S, Hkv, H, D, L = 1, 64, 2, 4, 32, 20
    k, v = torch.randn(B, S, Hkv, D, generator=g), torch.randn(B, S, Hkv, D, generator=g)
    q = torch.randn(B, L, H, D, generator=g)
    kc, vc = QuantizedKV.quantize(k, rotate=True), QuantizedKV.quantize(v)
    with torch.no_grad():
        out = attnlab.attention_with_kvcache(q, kc, vc, cache_seqlens=S)
    kf, vf = kc.dequantize().double(), vc.dequantize().double()
    G = H // Hkv
    s = q.double().transpose(1, 2) @ kf.repeat_interleave(G, 2).permute(0, 2, 3, 1) / math.sqrt(D)  # (B, H, L, S)
    s = s.masked_fill(torch.arange(S) > torch.arange(L).unsqueeze(1) + (S - L), float("-inf"))
    want = (s.softmax(-1) @ vf.repeat_interleave(G, 2).transpose(1, 2)).transpose(1, 2)
    tol = 8 * D * torch.finfo(torch.float32).eps * float(vf.abs().max())
    assert float((out.double() - want).abs().max()) <= tol


@pytest.mark.parametrize("flags", [{"rotate": True}, {"smooth": True}], ids=["rotated", "smoothed"])
def test_a_transformed_value_cache_is_refused(flags):
    """A rotation or channel scales transform the keys and the query to match; nothing undoes them on the values,
    so a value cache that has one had decoded values still rotated or divided (error 4.2 and 2.2 against the
    dequantised cache): refused naming v_cache, the caches unwritten (L 1 and 17, the kernel and the gathered path)."""
    g = torch.Generator().manual_seed(0)
    B, S, H, Hkv, D = 1, 32, 4, 2, 64
    for L in (1, 17):
        kc, vc = QuantizedKV.empty(B, S, Hkv, D), QuantizedKV.empty(B, S, Hkv, D, **flags)
        q, k, v = (torch.randn(B, n, h, D, generator=g) for n, h in ((L, H), (L, Hkv), (L, Hkv)))
        with pytest.raises(attnlab.AttentionInputError, match="v_cache has (a rotation|channel scales), which only a key cache"):
            attnlab.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=0)
        assert not kc.data.any() and not vc.data.any() and not kc.scale.any()


def test_a_refused_first_append_leaves_the_channel_scales_unfixed():
    """Note [Checked, then appended]: a smoothed key cache fixes its channel scales at its first append; a first
    call refused for a non-finite v had fixed them from its k all the same, so the next call ran on another cache's
    scales. Now they stay 0 until a call succeeds, and that call equals the same call on a fresh cache."""
    g = torch.Generator().manual_seed(1)
    B, S, H, Hkv, D = 1, 32, 4, 2, 64
    q, k, v = torch.randn(B, 1, H, D, generator=g), torch.randn(B, 8, Hkv, D, generator=g), torch.randn(B, 8, Hkv, D, generator=g)
    kc, vc = QuantizedKV.empty(B, S, Hkv, D, smooth=True), QuantizedKV.empty(B, S, Hkv, D)
    bad_v = v.clone()
    bad_v[0, 3, 1, 5] = float("inf")
    with pytest.raises(attnlab.AttentionInputError, match="finite keys and values only"):
        attnlab.attention_with_kvcache(q, kc, vc, k * 50, bad_v, cache_seqlens=0)
    assert not kc.channel.any() and not kc.data.any() and not vc.data.any()
    kf, vf = QuantizedKV.empty(B, S, Hkv, D, smooth=True), QuantizedKV.empty(B, S, Hkv, D)
    with torch.no_grad():
        out = attnlab.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=0)
        fresh = attnlab.attention_with_kvcache(q, kf, vf, k, v, cache_seqlens=0)
    assert torch.equal(kc.channel, kf.channel) and torch.equal(out, fresh)
