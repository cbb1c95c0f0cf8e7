"""The decode plan (kernels/decode.plan, DecodePlan) and what ``explain`` prints for a decode call: the
units, the head span the cache's layout gives, the key splits, the K/V bytes and the predicted time."""
from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab.kernels import decode as dk


def test_plan_counts_bytes_units_and_time(monkeypatch):
    monkeypatch.delenv("ATTNLAB_DECODE_SPLITS", raising=False)
    flash = torch.zeros(1, 4096, 8, 128)  # [B, S, Hkv, D]: a token's kv heads side by side
    own = torch.zeros(1, 8, 4096, 128).transpose(1, 2)  # attnlab's [B, Hkv, S, D] as the kernel sees it
    a = dk.plan(1, 32, 8, 4096, 128, 128, torch.float32, k=flash, bandwidth=1e10)
    b = dk.plan(1, 32, 8, 4096, 128, 128, torch.float32, k=own, bandwidth=1e10)
    assert a.head_span == 8 and b.head_span == 1 and a.groups == 4
    assert a.kv_bytes == b.kv_bytes == 8 * 4096 * 256 * 4
    assert a.predicted_seconds == pytest.approx(a.kv_bytes / 1e10)
    assert a.units == a.splits and b.units == 8 * b.splits
    assert a.splits == dk.num_splits(1, 1, 4096) and b.splits == dk.num_splits(1, 8, 4096)
    q8 = dk.plan(1, 32, 8, 4096, 128, 128, torch.int8)
    assert q8.kv_bytes == 8 * 4096 * (256 + 8) and "int8 K/V" in q8.describe() and q8.predicted_seconds is None


@pytest.mark.skipif(not dk.available(), reason=f"decode extension: {dk.unavailable_reason()}")
def test_explain_shows_the_decode_plan():
    q, k = torch.randn(1, 32, 1, 128), torch.randn(1, 8, 4096, 128)
    with torch.no_grad():
        plan = attnlab.explain(q, k, k, enable_gqa=True)
    assert plan.decode
    want = dk.plan(1, 32, 8, 4096, 128, 128, torch.float32, k=k.transpose(1, 2))
    text = plan.reason
    assert f"× {want.splits} key split" in text and f"= {want.units} units" in text, text
    assert "32 MiB of K/V" in text and "GB/s read bandwidth" in text and "no copy" in text


@pytest.mark.skipif(not dk.available(), reason=f"decode extension: {dk.unavailable_reason()}")
@pytest.mark.parametrize("hq,hkv,dtype,pattern,want", [
    (8, 8, torch.float32, None, "sdpa"),                     # Note [Plain MHA decode]
    (8, 8, torch.bfloat16, None, "decode"),                  # SDPA converts bf16: the decode kernel
    (32, 8, torch.float32, None, "decode"),                  # GQA without copies
    (8, 8, torch.float32, "window", "decode"),               # a pattern SDPA would get as an L×S mask
])
def test_plain_mha_decode_goes_to_sdpa(hq, hkv, dtype, pattern, want):
    from attnlab import patterns as P

    q = torch.randn(1, hq, 1, 64, dtype=dtype)
    k = v = torch.randn(1, hkv, 512, 64, dtype=dtype)
    pat = P.sliding_window(64) if pattern else None
    with torch.no_grad():
        plan = attnlab.explain(q, k, v, enable_gqa=hq != hkv, pattern=pat)
        out = attnlab.attention(q, k, v, enable_gqa=hq != hkv, pattern=pat)
    assert plan.method == want, plan.reason
    mask = None if pat is None else pat.materialize(1, 512)
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask,
                                                           enable_gqa=hq != hkv)
    eps = torch.finfo(dtype).eps
    assert (out.double() - ref).abs().max().item() < 64 * eps
