"""The int8 KV cache of attention_with_kvcache (``QuantizedKV``; csrc/decode.cpp Note [Decode int8 cache]):
quantisation within its bound, the kernel's folded scales within fp32 rounding of decoding the dequantised
fp32 cache, appends quantised where flash-attn writes them, the error budget against fp32 relative to a bf16
cache's (Note [int8 KV error budget]), and clear errors for mismatched scales."""
from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab import reference
from attnlab.functional.kvcache import INT8_ERROR_BUDGET, QuantizedKV
from attnlab.kernels import decode as dk
from helpers import max_err

pytestmark = [pytest.mark.usefixtures("one_thread")]
needs_ext = pytest.mark.skipif(not dk.available(), reason=f"decode extension: {dk.unavailable_reason()}")


def _paged(x: torch.Tensor, page: int, gen):
    """x [B, S, Hkv, D] -> (pool [P, page, Hkv, D], block_table) holding the same rows, pages shuffled."""
    B, S = x.shape[:2]
    pages = -(-S // page)
    P_ = B * pages + 2
    pool = torch.zeros(P_, page, *x.shape[2:], dtype=x.dtype)
    table = torch.randperm(P_, generator=gen)[: B * pages].view(B, pages).to(torch.int32)
    j = torch.arange(S)
    pool[table.long()[:, j // page], j % page] = x
    return pool, table


def test_quantize_within_half_a_step():
    """|x - data·scale| <= scale / 2 per element (round to nearest), scale = max|row| / 127; a zero row is
    exactly 0 with scale 0."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 17, 2, 24, generator=gen) * torch.rand(3, 17, 2, 1, generator=gen) * 5
    x[0, 3, 1] = 0.0
    qk = QuantizedKV.quantize(x)
    assert qk.data.dtype == torch.int8 and qk.scale.shape == (3, 17, 2)
    assert torch.equal(qk.scale, x.abs().amax(-1) / 127)
    err = (qk.dequantize() - x).abs()
    assert bool((err <= qk.scale.unsqueeze(-1) / 2 * (1 + 1e-6) + 1e-30).all())
    assert torch.equal(qk.dequantize()[0, 3, 1], torch.zeros(24)) and float(qk.scale[0, 3, 1]) == 0.0


@needs_ext
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page", [None, 16, 5], ids=["contiguous", "page16", "page5"])
@pytest.mark.parametrize("H,Hkv,D", [(6, 2, 24), (4, 1, 64), (2, 2, 7)], ids=["gqa", "mqa", "odd_d"])
def test_kernel_dequantises_like_the_fp32_cache(qdtype, page, H, Hkv, D):
    """A decode step through an int8 cache (appending one token, per-sequence lengths, paged or not) matches
    the kernel on the dequantised cache in fp32 within the rounding of moving one multiplication: the int8
    path takes (q . k8) * k_scale and (p * v_scale) . v8 where the fp32 path takes q . (k8 * k_scale) and
    p . (v8 * v_scale), the same products in the same order otherwise (Note [Decode int8 cache]). Each
    product then moves by at most 2 eps relative, a score by 2 eps |q| |k| scale, a probability by twice the
    largest score change (relative), an output by that times max|v| plus 2 eps max|v|; the budget is twice
    that. The appended row is the quantised new k, v."""
    gen = torch.Generator().manual_seed(H * D + (page or 0))
    B, S, L = 3, 150, 1
    k0, v0 = torch.randn(B, S, Hkv, D, generator=gen), torch.randn(B, S, Hkv, D, generator=gen)
    kq, vq = QuantizedKV.quantize(k0), QuantizedKV.quantize(v0)
    table = None
    if page is not None:
        kd, table = _paged(kq.data, page, torch.Generator().manual_seed(1))
        ks, _ = _paged(kq.scale.unsqueeze(-1), page, torch.Generator().manual_seed(1))
        vd, _ = _paged(vq.data, page, torch.Generator().manual_seed(1))
        vs, _ = _paged(vq.scale.unsqueeze(-1), page, torch.Generator().manual_seed(1))
        kq, vq = QuantizedKV(kd, ks[..., 0].contiguous()), QuantizedKV(vd, vs[..., 0].contiguous())
    lens = torch.tensor([0, 77, S - 1])
    q = torch.randn(B, L, H, D, generator=gen).to(qdtype)
    kn, vn = torch.randn(B, L, Hkv, D, generator=gen).to(qdtype), torch.randn(B, L, Hkv, D, generator=gen).to(qdtype)
    out = attnlab.attention_with_kvcache(q, kq, vq, kn, vn, cache_seqlens=lens, block_table=table, num_splits=2)
    nq = QuantizedKV.quantize(kn)
    for b in range(B):  # the appended rows, where flash-attn writes them
        t = int(lens[b])
        p, o = (b, t) if table is None else (int(table[b, t // page]), t % page)
        assert torch.equal(kq.data[p, o], nq.data[b, 0]) and torch.equal(kq.scale[p, o], nq.scale[b, 0])
    kf, vf = kq.dequantize(), vq.dequantize()
    want = attnlab.attention_with_kvcache(q.float(), kf, vf, cache_seqlens=lens + L, block_table=table,
                                          num_splits=2)
    if qdtype == torch.float32:
        eps = torch.finfo(torch.float32).eps
        ds = 2 * eps * float(q.norm(dim=-1).max() * kf.norm(dim=-1).max()) * D ** -0.5
        tol = 2 * (2 * ds + 2 * eps) * float(vf.abs().max())
        assert max_err(out, want) <= tol, (max_err(out, want), tol)
        assert not torch.equal(kf, kq.data.float())  # the scales are not 1: the test sees them applied
    else:  # q and out in bf16: the kernel widens q and rounds out exactly as for a bf16 cache
        assert max_err(out, want) <= 2 * torch.finfo(torch.bfloat16).eps * float(want.abs().max()) + 1e-6


@needs_ext
@pytest.mark.parametrize("D,S", [(64, 300), (128, 1500)])
def test_error_budget_against_bf16(D, S):
    """Note [int8 KV error budget]: the int8 cache's RMS output error against float64 on the fp32 keys stays
    within INT8_ERROR_BUDGET times a bf16 cache's (bf16 q, K, V and output), over a few seeds."""
    B, H, Hkv = 2, 8, 2
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        k, v = torch.randn(B, S, Hkv, D, generator=gen), torch.randn(B, S, Hkv, D, generator=gen)
        q = torch.randn(B, 1, H, D, generator=gen) * (1 + 2 * seed)
        ref, _ = reference.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True)
        ref = torch.from_numpy(ref)
        o8 = attnlab.attention_with_kvcache(q, QuantizedKV.quantize(k), QuantizedKV.quantize(v), is_causal=False)
        ob = attnlab.attention_with_kvcache(q.bfloat16(), k.bfloat16(), v.bfloat16(), is_causal=False)
        rms = lambda o: float((o.transpose(1, 2).double() - ref).pow(2).mean().sqrt())  # noqa: E731
        e8, eb = rms(o8), rms(ob)
        assert e8 <= INT8_ERROR_BUDGET * eb, f"seed {seed}: int8 RMS error {e8:.3g} > {INT8_ERROR_BUDGET} x bf16's {eb:.3g}"
        assert e8 > 0  # the cache really is quantised


def test_mismatched_scales_and_caches_raise():
    data = torch.zeros(2, 10, 2, 8, dtype=torch.int8)
    with pytest.raises(attnlab.AttentionInputError, match=r"scale must be float32 \[B\|P, S\|T, Hkv\] = \[2, 10, 2\]"):
        QuantizedKV(data, torch.zeros(2, 10, 1))
    with pytest.raises(attnlab.AttentionInputError, match="scale must be float32"):
        QuantizedKV(data, torch.zeros(2, 10, 2, dtype=torch.float64))
    with pytest.raises(attnlab.AttentionDtypeError, match="data must be an int8 tensor"):
        QuantizedKV(data.float(), torch.zeros(2, 10, 2))
    q = torch.randn(2, 1, 4, 8)
    good = QuantizedKV.empty(2, 10, 2, 8)
    with pytest.raises(attnlab.AttentionInputError, match=r"v_cache: .*scale must be float32 .* got \[2, 10\]"):
        attnlab.attention_with_kvcache(q, good, (data, torch.zeros(2, 10)), cache_seqlens=1)
    with pytest.raises(attnlab.AttentionDtypeError, match="both be int8"):
        attnlab.attention_with_kvcache(q, good, torch.zeros(2, 10, 2, 8), cache_seqlens=1)
    with pytest.raises(attnlab.AttentionInputError, match="finite"):
        kn = torch.full((2, 1, 2, 8), float("inf"))
        attnlab.attention_with_kvcache(q, good, QuantizedKV.empty(2, 10, 2, 8), kn, kn, cache_seqlens=1)
    if dk.available():  # the kernel itself refuses an int8 cache without its scales
        with pytest.raises(RuntimeError, match="k_scale and v_scale go with an int8 cache"):
            dk.decode_attention(q.transpose(1, 2), data, data, scale=1.0)


def test_fallback_dequantises(monkeypatch):
    """Without the extension an int8 cache is dequantised and attended by the pure-PyTorch path: the same
    result as the kernel within fp32 rounding."""
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, 40, 2, 16, generator=gen), torch.randn(2, 40, 2, 16, generator=gen)
    q = torch.randn(2, 2, 4, 16, generator=gen)
    kq, vq = QuantizedKV.quantize(k), QuantizedKV.quantize(v)
    lens = torch.tensor([9, 40])
    monkeypatch.setattr(dk, "available", lambda: False)
    fb = attnlab.attention_with_kvcache(q, kq, vq, cache_seqlens=lens)
    monkeypatch.undo()
    keep = (torch.arange(40).view(1, 1, 40) <= torch.arange(2).view(1, 2, 1) + (lens - 2).view(2, 1, 1))
    ref, _ = reference.attention(q.transpose(1, 2), kq.dequantize().transpose(1, 2), vq.dequantize().transpose(1, 2),
                                 attn_mask=torch.zeros(2, 1, 2, 40, dtype=torch.float64).masked_fill(
                                     ~keep.unsqueeze(1), float("-inf")), enable_gqa=True)
    assert max_err(fb.transpose(1, 2), torch.from_numpy(ref)) < 1e-5
    if dk.available():
        assert max_err(attnlab.attention_with_kvcache(q, kq, vq, cache_seqlens=lens), fb) < 1e-5
