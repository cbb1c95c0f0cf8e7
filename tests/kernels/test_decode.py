"""The decode kernel as a kernel object (``kernels.DECODE``, the sixth in ``KERNELS``): its declaration, its tiling
(the key split) and cost (bytes over the read bandwidth), ``run`` on prepared inputs through every mask the
planner hands it, and ``run_cache`` on KV-cache views, each against the float64 reference
(``attnlab.reference``). The tolerance is the float64 reference's distance to the same call computed in the
inputs' dtype by PyTorch's SDPA math (a second reference), times a small factor: the numerics, not a number.
"""
from __future__ import annotations

import math

import pytest
import torch

import attnlab
from attnlab import kernels, reference
from attnlab import patterns as P
from attnlab.kernels import decode as dk
from attnlab.kernels.cacheview import UNBOUNDED, CacheCall
from attnlab.kernels.planner import plan_cache

pytestmark = pytest.mark.skipif(not dk.available(), reason=f"decode extension: {dk.unavailable_reason()}")

#: patterns a decode call carries (bottom-right aligned: the last query sees the newest key), as the kernel's key
#: range (bands), or as a bool keep read through strides (the rest)
PATTERNS = [None, P.causal("bottom_right"), P.sliding_window(7, align="bottom_right"),
            P.sliding_window(left=40, right=2, align="bottom_right"), P.prefix_lm(5, align="bottom_right"),
            P.from_mask_mod(lambda b, h, q, k: (q + k) % 3 != 1, name="mod3")]


def _budget(out_f64, q, k, v, mask, scale, gqa) -> float:
    """8x the distance between float64 and the same call in q's dtype by SDPA's math (a second reference), and
    at least 8 units of the dtype's rounding of the output's size."""
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        alt = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    alive = ~torch.isnan(alt)
    spread = (alt.double() - out_f64).abs()[alive].max().item() if alive.any() else 0.0
    return 8 * max(spread, torch.finfo(q.dtype).eps * max(1.0, out_f64.abs().max().item()))


def test_declared_as_the_sixth_kernel():
    assert kernels.KERNELS[-1] is kernels.DECODE and len(kernels.KERNELS) == 6
    s = kernels.DECODE.spec
    assert s.max_queries == dk.MAX_QUERIES and not s.backward and s.quantized_cache
    assert set(s.cache_views) == {"contiguous", "lengths", "paged"} and s.dtypes == dk.DTYPES


@pytest.mark.parametrize("seed", range(24))
def test_fuzz_attention_on_the_decode_kernel_against_float64(seed):
    g = torch.Generator().manual_seed(seed)
    dtype = (torch.float32, torch.bfloat16, torch.float16)[seed % 3]
    B, Hkv = 1 + seed % 2, (1, 2, 4)[seed % 3]
    H = Hkv * (1, 2, 4)[(seed // 3) % 3]
    L = int(torch.randint(1, 17, (1,), generator=g))
    S = L + int(torch.randint(1, 300, (1,), generator=g))
    D = (16, 32, 64)[seed % 3]
    pat = PATTERNS[seed % len(PATTERNS)]
    softcap = 20.0 if seed % 4 == 1 else None
    alibi = torch.rand(H, generator=g) * 0.2 if seed % 5 == 2 else None
    keep = None
    if seed % 6 == 3:  # a padded batch's keys (the newest key kept: a dead tail would be cut, leaving S <= L)
        keep = torch.rand(B, 1, 1, S, generator=g) > 0.2
        keep[..., -1] = True
    q = torch.randn(B, H, L, D, generator=g).to(dtype)
    k, v = (torch.randn(B, Hkv, S, D, generator=g).to(dtype) for _ in range(2))
    kw = dict(enable_gqa=H != Hkv, pattern=pat, softcap=softcap, alibi_slopes=alibi, attn_mask=keep)
    with torch.no_grad():
        plan = attnlab.explain(q, k, v, method="decode", **kw)
        out = attnlab.attention(q, k, v, method="decode", **kw)
    assert plan.kernel is kernels.DECODE and plan.tiling.decode and plan.tiling.blocks >= 1
    m = keep if pat is None else (pat.materialize(L, S) if keep is None else keep & pat.materialize(L, S))
    ref, _ = reference.attention(q.double(), k.double(), v.double(), attn_mask=m, enable_gqa=H != Hkv,
                                 softcap=softcap, alibi_slopes=alibi)
    ref = torch.as_tensor(ref)
    if softcap is None and alibi is None:
        budget = _budget(ref, q, k, v, m, 1 / math.sqrt(D), H != Hkv)
    else:  # score mods: the dtype's rounding of each of S scores, summed
        budget = 8 * torch.finfo(dtype).eps * math.sqrt(S) * max(1.0, ref.abs().max().item())
    err = (out.double() - ref).abs().max().item()
    assert err <= budget, (seed, dtype, L, S, pat, err, budget)


def _flash_call(B, L, H, Hkv, S, D, dtype, g):
    q = torch.randn(B, L, H, D, generator=g).to(dtype)
    kc, vc = (torch.randn(B, S + 8, Hkv, D, generator=g).to(dtype) for _ in range(2))
    return q, kc, vc


@pytest.mark.parametrize("kind", ["contiguous", "lengths", "paged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_run_cache_on_each_view_against_float64(kind, dtype):
    g = torch.Generator().manual_seed(7)
    B, L, H, Hkv, S, D = 2, 3, 8, 2, 200, 32
    q, kc, vc = _flash_call(B, L, H, Hkv, S, D, dtype, g)
    lens = torch.tensor([S, S - 57])
    table = None
    k_view, v_view = kc, vc
    if kind == "paged":  # pages of 16 tokens in a shuffled pool
        T = 16
        pages = -(-(S + 8) // T)
        perm = torch.randperm(B * pages, generator=g)
        table = perm.view(B, pages).to(torch.int32)
        pool_k = torch.zeros(B * pages, T, Hkv, D, dtype=dtype)
        pool_v = torch.zeros_like(pool_k)
        for b in range(B):
            for p in range(pages):
                rows = slice(p * T, min((p + 1) * T, S + 8))
                n = rows.stop - rows.start
                pool_k[table[b, p], :n], pool_v[table[b, p], :n] = kc[b, rows], vc[b, rows]
        k_view, v_view = pool_k, pool_v
    seqlens = S if kind == "contiguous" else lens
    call = CacheCall(q, k_view, v_view, D ** -0.5, seqlens, table, UNBOUNDED, 0)  # bottom-right causal
    plan = plan_cache(call)
    assert plan.kernel is kernels.DECODE, plan.reason
    assert "reads no KV-cache view" in plan.refused["compiled"]
    out, lse = kernels.DECODE.run_cache(call)
    for b in range(B):
        n = S if kind == "contiguous" else int(lens[b])
        qh, kh, vh = q[b:b + 1].transpose(1, 2), kc[b:b + 1, :n].transpose(1, 2), vc[b:b + 1, :n].transpose(1, 2)
        m = P.causal("bottom_right").materialize(L, n)
        ref = torch.as_tensor(reference.attention(qh.double(), kh.double(), vh.double(), attn_mask=m,
                                                  enable_gqa=True)[0])
        budget = _budget(ref, qh, kh, vh, m, D ** -0.5, True)
        assert (out[b:b + 1].transpose(1, 2).double() - ref).abs().max().item() <= budget, (kind, b)


def test_plain_cache_call_and_attention_choose_alike():
    """One decision: the cache door and attention() send the same plain call on a heads-first cache (attnlab's
    [B, Hkv, S, D], read through a transposed view) to the same kernel."""
    g = torch.Generator().manual_seed(3)
    for dtype, Hkv, S in ((torch.float32, 8, 300), (torch.float32, 8, 9000), (torch.bfloat16, 8, 300),
                          (torch.float32, 2, 300)):
        q = torch.randn(1, 1, 8, 64, generator=g).to(dtype)
        kc = torch.randn(1, Hkv, S, 64, generator=g).to(dtype)
        call = CacheCall(q, kc.transpose(1, 2), kc.transpose(1, 2), 0.125, S)
        assert call.layout == "heads-first"
        with torch.no_grad():
            a = attnlab.explain(q.transpose(1, 2), kc, kc, enable_gqa=Hkv != 8)
        assert plan_cache(call).kernel is a.kernel, (dtype, Hkv, S)


def test_sdpa_refuses_tokens_first_caches():
    """Note [Cache layouts]: on flash-attn's tokens-first memory SDPA would read strided rows; it declares
    heads-first caches only, and the planner says so."""
    q = torch.randn(1, 1, 8, 64)
    kc = torch.randn(1, 300, 8, 64)
    call = CacheCall(q, kc, kc, 0.125, 300)
    assert call.layout == "tokens-first" and call.request().cache_layout == "tokens-first"
    plan = plan_cache(call, costs=True)
    assert plan.kernel is kernels.DECODE
    assert "heads-first" in plan.refused["sdpa"] and "Cache layouts" in plan.refused["sdpa"]
    with pytest.raises(ValueError, match="tokens-first"):
        plan_cache(call, "sdpa")
    one_head = torch.randn(1, 300, 1, 64)  # one kv head: both orders are the same memory
    assert CacheCall(q, one_head, one_head, 0.125, 300).layout == "heads-first"


def test_refusals_name_the_reason():
    q = torch.randn(1, 8, 40, 32)
    k = torch.randn(1, 8, 64, 32)
    with pytest.raises(ValueError, match="decodes 1..16 queries"):
        attnlab.attention(q, k, k, method="decode")
    q1 = torch.randn(1, 8, 1, 32, requires_grad=True)
    with pytest.raises(ValueError, match="forward only"):
        attnlab.attention(q1, k, k, method="decode")
