"""attention_with_kvcache and the decode kernel (kernels/decode.py, csrc/decode.cpp) against the float64
reference (attnlab.reference) and PyTorch's SDPA: GQA/MQA, per-sequence lengths, paged caches of several
page sizes, appends, bottom-right causal for L = 1..16, windows, masks, softcap, ALiBi, split and thread
counts.

Tolerances (FUSED_ERROR_FACTOR, tests/helpers.py): the kernel's error against float64 may be at most that
factor times the naive same-dtype computation's (softmax(q kᵀ) v in the inputs' dtype), plus a floor of a
few ulps of the output's dtype for rows whose naive error happens to be 0.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import attnlab
from attnlab import reference
from attnlab.kernels import decode as dk
from attnlab.kernels import lse as lse_merge
from helpers import FUSED_ERROR_FACTOR, max_err

pytestmark = [pytest.mark.usefixtures("one_thread")]
needs_ext = pytest.mark.skipif(not dk.available(), reason=f"decode extension: {dk.unavailable_reason()}")


def _ref(qh, kh, vh, keep, bias=None, scale=None):
    """float64 reference on [B, H, L, D] / [B, Hkv, S, D] with a bool keep [B, 1|H, L, S] (and float bias)."""
    mask = torch.from_numpy(np.where(keep.numpy(), 0.0, -np.inf)) if bias is None else \
        bias.double().masked_fill(~keep, float("-inf"))
    out, _ = reference.attention(qh, kh, vh, attn_mask=mask, enable_gqa=True, scale=scale)
    return torch.from_numpy(out)


def _naive(qh, kh, vh, keep, bias=None, scale=None):
    """The naive computation in the inputs' dtype (the error budget's yardstick)."""
    g = qh.shape[1] // kh.shape[1]
    k, v = kh.repeat_interleave(g, 1), vh.repeat_interleave(g, 1)
    s = (qh @ k.transpose(-1, -2)) * (scale if scale is not None else qh.shape[-1] ** -0.5)
    if bias is not None:
        s = s + bias.to(s.dtype)
    s = s.masked_fill(~keep, float("-inf"))
    w = torch.softmax(s.float(), -1).nan_to_num(0.0).to(qh.dtype)
    return w @ v


def _check(out, ref, naive, what=""):
    """|out - ref| <= FUSED_ERROR_FACTOR * |naive - ref| + floor, elementwise worst."""
    eps = torch.finfo(out.dtype).eps
    budget = FUSED_ERROR_FACTOR * max_err(naive, ref) + 4 * eps * max(1.0, float(ref.abs().max()))
    err = max_err(out, ref)
    assert err <= budget, f"{what}: max error {err:.3g} > budget {budget:.3g} (naive {max_err(naive, ref):.3g})"


def _caches(B, S, Hkv, D, dtype, page=None, gen=None, poison=True):
    """(k_cache, v_cache, block_table | None) holding random keys; slots are NaN-poisoned where unused."""
    if page is None:
        k = torch.randn(B, S, Hkv, D, generator=gen).to(dtype)
        v = torch.randn(B, S, Hkv, D, generator=gen).to(dtype)
        return k, v, None
    pages = -(-S // page)
    P_ = B * pages + 3
    k = torch.full((P_, page, Hkv, D), float("nan") if poison else 0.0).to(dtype)
    v = k.clone()
    perm = torch.randperm(P_, generator=gen)[: B * pages].view(B, pages).to(torch.int32)
    return k, v, perm


def _dense_kv(k_cache, v_cache, table, S):
    """[B, Hkv, S, D] from a (maybe paged) cache, for the reference."""
    if table is None:
        return k_cache[:, :S].transpose(1, 2), v_cache[:, :S].transpose(1, 2)
    T = k_cache.shape[1]
    j = torch.arange(S)
    page = table.long()[:, j // T]
    return k_cache[page, j % T].transpose(1, 2), v_cache[page, j % T].transpose(1, 2)


def _keep(B, L, S, seqlens, causal=True, window=(-1, -1)):
    j = torch.arange(S).view(1, 1, S)
    pos = torch.arange(L).view(1, L, 1) + (seqlens - L).view(B, 1, 1)
    keep = (j < seqlens.view(B, 1, 1)).expand(B, L, S).clone()
    if causal:
        keep &= j <= pos
    if window[0] >= 0:
        keep &= j >= pos - window[0]
    if window[1] >= 0:
        keep &= j <= pos + window[1]
    return keep.unsqueeze(1)  # (B, 1, L, S)


# -- attention_with_kvcache -------------------------------------------------------------------------
@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("H,Hkv", [(4, 4), (6, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("page", [None, 16, 7], ids=["contiguous", "page16", "page7"])
def test_decode_step_appends_and_attends(dtype, H, Hkv, page):
    """One decode step with per-sequence lengths: the new k, v land at cache_seqlens[b] (through the page
    table when paged) and the query attends to the valid prefix plus itself."""
    gen = torch.Generator().manual_seed(1)
    B, S, D, L = 3, 70, 16, 1
    kc, vc, table = _caches(B, S, Hkv, D, dtype, page, gen)
    lens = torch.tensor([0, 33, 69])
    # fill the valid prefix of each sequence
    kd = torch.randn(B, S, Hkv, D, generator=gen).to(dtype)
    vd = torch.randn(B, S, Hkv, D, generator=gen).to(dtype)
    for b in range(B):
        for t in range(int(lens[b])):
            if table is None:
                kc[b, t], vc[b, t] = kd[b, t], vd[b, t]
            else:
                p = int(table[b, t // page])
                kc[p, t % page], vc[p, t % page] = kd[b, t], vd[b, t]
    q = torch.randn(B, L, H, D, generator=gen).to(dtype)
    kn = torch.randn(B, L, Hkv, D, generator=gen).to(dtype)
    vn = torch.randn(B, L, Hkv, D, generator=gen).to(dtype)
    out, lse = attnlab.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens.to(torch.int32),
                                              block_table=table, return_lse=True)
    seq = lens + L
    for b in range(B):  # the appends, exactly where flash-attn writes them
        t = int(lens[b])
        got_k = kc[b, t] if table is None else kc[int(table[b, t // page]), t % page]
        assert torch.equal(got_k, kn[b, 0])
    kd[torch.arange(B), lens] = kn[:, 0]
    vd[torch.arange(B), lens] = vn[:, 0]
    Smax = int(seq.max())
    kh, vh = kd[:, :Smax].transpose(1, 2), vd[:, :Smax].transpose(1, 2)
    keep = _keep(B, L, Smax, seq)
    qh = q.transpose(1, 2)
    ref = _ref(qh, kh, vh, keep)
    _check(out.transpose(1, 2), ref, _naive(qh, kh, vh, keep), f"{dtype} {H}/{Hkv} page={page}")
    assert out.shape == (B, L, H, D) and lse.shape == (B, H, L) and lse.dtype == torch.float32
    # the lse against float64
    s = (qh.double() @ kh.double().repeat_interleave(H // Hkv, 1).transpose(-1, -2)) / math.sqrt(D)
    ref_lse = torch.logsumexp(s.masked_fill(~keep, float("-inf")), -1)
    assert max_err(lse, ref_lse) <= 1e-4 * max(1.0, float(ref_lse.abs().max())) + FUSED_ERROR_FACTOR * (
        0 if dtype == torch.float32 else torch.finfo(dtype).eps * 8)


@needs_ext
@pytest.mark.parametrize("L", [1, 2, 5, 16])
@pytest.mark.parametrize("window", [(-1, -1), (9, -1), (3, 0)])
def test_bottom_right_causal_and_windows(L, window):
    """L new queries (speculative verification, chunked prefill): bottom-right causal, with windows,
    ALiBi and softcap, against the reference with the same mask written out."""
    gen = torch.Generator().manual_seed(L)
    B, S, H, Hkv, D = 2, 90, 4, 2, 8
    kc, vc, _ = _caches(B, S, Hkv, D, torch.float32, None, gen)
    lens = torch.tensor([40, 90 - L])
    q = torch.randn(B, L, H, D, generator=gen)
    kn, vn = torch.randn(B, L, Hkv, D, generator=gen), torch.randn(B, L, Hkv, D, generator=gen)
    slopes = torch.rand(H, generator=gen)
    kc2, vc2 = kc.clone(), vc.clone()
    out = attnlab.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, window_size=window,
                                         alibi_slopes=slopes, softcap=5.0)
    seq = lens + L
    kc2[torch.arange(B).unsqueeze(1), lens.unsqueeze(1) + torch.arange(L)] = kn
    vc2[torch.arange(B).unsqueeze(1), lens.unsqueeze(1) + torch.arange(L)] = vn
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    Smax = int(seq.max())
    kh, vh = kc2[:, :Smax].transpose(1, 2), vc2[:, :Smax].transpose(1, 2)
    keep = _keep(B, L, Smax, seq, True, window)
    qh = q.transpose(1, 2).double()
    s = (qh @ kh.double().repeat_interleave(2, 1).transpose(-1, -2)) / math.sqrt(D)
    s = 5.0 * torch.tanh(s / 5.0)
    pos = torch.arange(L).view(1, 1, L, 1) + (seq - L).view(B, 1, 1, 1)
    s = s - slopes.double().view(1, H, 1, 1) * (pos - torch.arange(Smax).view(1, 1, 1, Smax)).abs()
    ref = torch.softmax(s.masked_fill(~keep, float("-inf")), -1).nan_to_num(0.0) @ vh.double().repeat_interleave(2, 1)
    assert max_err(out.transpose(1, 2), ref) < 2e-5


@needs_ext
def test_matches_sdpa_gqa_decode():
    """Plain decode (cache full, L = 1) equals F.scaled_dot_product_attention(enable_gqa=True)."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 8, 1, 32, generator=gen)
    k, v = torch.randn(2, 2, 300, 32, generator=gen), torch.randn(2, 2, 300, 32, generator=gen)
    out = attnlab.attention_with_kvcache(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=False)
    sd = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    ref = _ref(q, k, v, torch.ones(1, 1, 1, 300, dtype=torch.bool))
    assert max_err(out.transpose(1, 2), ref) <= FUSED_ERROR_FACTOR * max(max_err(sd, ref), 1e-7)


@needs_ext
@pytest.mark.parametrize("page", [1, 16, 64, 256])
def test_paged_equals_contiguous(page):
    """The same keys read through a page table of any page size give the contiguous cache's result,
    bit for bit at one split (the same tiles in the same order); unused slots are NaN and never read."""
    gen = torch.Generator().manual_seed(page)
    B, S, H, Hkv, D = 2, 300, 4, 2, 16
    lens = torch.tensor([300, 123])
    kd, vd = torch.randn(B, S, Hkv, D, generator=gen), torch.randn(B, S, Hkv, D, generator=gen)
    q = torch.randn(B, 1, H, D, generator=gen)
    kc, vc, table = _caches(B, S, Hkv, D, torch.float32, page, gen)
    j = torch.arange(S)
    pg = table.long()[:, j // page]
    kc[pg, j % page], vc[pg, j % page] = kd, vd
    for b in range(B):  # poison past the length: must not be read
        t = torch.arange(int(lens[b]), S)
        kc[table.long()[b, t // page], t % page] = float("nan")
    outp = attnlab.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table, num_splits=1)
    outc = attnlab.attention_with_kvcache(q, kd, vd, cache_seqlens=lens, num_splits=1)
    assert torch.equal(outp, outc)
    assert not outp.isnan().any()


@needs_ext
def test_cache_layout_views_write_through():
    """attnlab's [B, Hkv, S, D] cache passed as a transpose(1, 2) view: the append lands in the original."""
    kc, vc = torch.zeros(1, 2, 10, 4), torch.zeros(1, 2, 10, 4)
    kn, vn = torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4)
    attnlab.attention_with_kvcache(torch.randn(1, 1, 2, 4), kc.transpose(1, 2), vc.transpose(1, 2), kn, vn,
                                   cache_seqlens=3)
    assert torch.equal(kc[0, :, 3], kn[0, 0]) and torch.equal(vc[0, :, 3], vn[0, 0])
    assert kc[0, :, 4:].abs().sum() == 0 and kc[0, :, :3].abs().sum() == 0


@needs_ext
def test_empty_sequence_is_zero_with_lse_neg_inf():
    """A sequence with no key (cache_seqlens 0, nothing appended) gets output 0 and lse -inf, never NaN."""
    out, lse = attnlab.attention_with_kvcache(torch.randn(2, 1, 2, 4), torch.randn(2, 8, 1, 4),
                                              torch.randn(2, 8, 1, 4), cache_seqlens=torch.tensor([0, 3]),
                                              return_lse=True)
    assert torch.equal(out[0], torch.zeros(1, 2, 4)) and bool(torch.isneginf(lse[0]).all())
    assert torch.isfinite(out[1]).all()


def test_errors_name_the_argument():
    q, kc, vc = torch.randn(2, 1, 4, 8), torch.zeros(2, 10, 2, 8), torch.zeros(2, 10, 2, 8)
    kn, vn = torch.randn(2, 1, 2, 8), torch.randn(2, 1, 2, 8)
    with pytest.raises(attnlab.AttentionInputError, match="overflows.*sequence 1.*capacity is 10"):
        attnlab.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=torch.tensor([3, 10]))
    with pytest.raises(attnlab.AttentionInputError, match=r"cache_seqlens \[3\] must be \[B\] = \[2\]"):
        attnlab.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=torch.tensor([1, 2, 3]))
    with pytest.raises(attnlab.AttentionInputError, match="cache_seqlens must be >= 0"):
        attnlab.attention_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor([1, -2]))
    with pytest.raises(attnlab.AttentionInputError, match="overflows.*sequence 0.*cache_seqlens=9.*capacity is 10"):
        attnlab.attention_with_kvcache(q, kc, vc, torch.randn(2, 2, 2, 8), torch.randn(2, 2, 2, 8), cache_seqlens=9)
    with pytest.raises(attnlab.AttentionInputError, match="cache_seqlens must be >= 0, got -1"):
        attnlab.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=-1)
    with pytest.raises(attnlab.AttentionInputError, match="give cache_seqlens"):
        attnlab.attention_with_kvcache(q, kc, vc, kn, vn)
    with pytest.raises(attnlab.AttentionInputError, match="k and v"):
        attnlab.attention_with_kvcache(q, kc, vc, kn, None, cache_seqlens=1)
    pool = torch.zeros(5, 4, 2, 8)
    table = torch.tensor([[0, 1, 2], [3, 4, 9]], dtype=torch.int32)
    with pytest.raises(attnlab.AttentionInputError, match=r"block_table\[1, 2\] = 9 points outside the pool of 5"):
        attnlab.attention_with_kvcache(q, pool, pool.clone(), kn, vn, cache_seqlens=torch.tensor([1, 8]),
                                       block_table=table)
    # an out-of-pool entry past the sequence's length is never used: fine
    attnlab.attention_with_kvcache(q, pool, pool.clone(), cache_seqlens=torch.tensor([1, 7]), block_table=table)
    with pytest.raises(attnlab.AttentionInputError, match="multiple of the caches' kv heads"):
        attnlab.attention_with_kvcache(torch.randn(2, 1, 3, 8), kc, vc, cache_seqlens=1)
    with pytest.raises(attnlab.AttentionInputError, match="inference only"):
        attnlab.attention_with_kvcache(q.requires_grad_(), kc, vc, cache_seqlens=1)
    with pytest.raises(attnlab.AttentionDtypeError, match="share one dtype"):
        attnlab.attention_with_kvcache(torch.randn(2, 1, 4, 8), kc.bfloat16(), vc.bfloat16(), cache_seqlens=1)


# -- the kernel: splits, merge, threads --------------------------------------------------------------
@needs_ext
def test_split_merge_is_the_lse_merge():
    """Note [Decode schedule]: the kernel's n-ary merge of its splits equals folding kernels/lse.merge over
    the partials it returns (Note [Merging by log-sum-exp]), including splits that see no key."""
    gen = torch.Generator().manual_seed(5)
    B, H, Hkv, L, S, D = 2, 4, 2, 3, 700, 16
    q = torch.randn(B, H, L, D, generator=gen)
    k, v = torch.randn(B, S, Hkv, D, generator=gen), torch.randn(B, S, Hkv, D, generator=gen)
    seq = torch.tensor([700, 90])  # the second: 3 tiles of 32 keys, one per split, leaving splits 3 and 4 empty
    out, lse, po, pl = dk.decode_attention(q, k, v, scale=0.25, seqlens=seq, right=0, splits=5,
                                           return_partials=True)
    mo, ml = po[0], pl[0]
    for s in range(1, 5):
        mo, ml = lse_merge.merge(mo, ml, po[s], pl[s])
    assert bool(torch.isneginf(pl[3:, 1]).all()) and bool(torch.isfinite(pl[:3, 1]).all())
    assert max_err(out, mo) < 1e-6 and max_err(lse, ml) < 1e-5


@needs_ext
def test_split_and_thread_count_independent():
    """A fixed split count gives the same bits at 1 and 2 threads; other split counts agree within fp32
    rounding (a different order of the same sums)."""
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(1, 8, 2, 64, generator=gen)
    k, v = torch.randn(1, 1500, 2, 64, generator=gen), torch.randn(1, 1500, 2, 64, generator=gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        a = dk.decode_attention(q, k, v, scale=0.125, splits=3)[0]
        torch.set_num_threads(2)
        b = dk.decode_attention(q, k, v, scale=0.125, splits=3)[0]
    finally:
        torch.set_num_threads(before)
    assert torch.equal(a, b)
    ref = _ref(q, k.transpose(1, 2), v.transpose(1, 2), torch.ones(1, 1, 2, 1500, dtype=torch.bool), scale=0.125)
    for ns in (1, 2, 7, 40):
        o = dk.decode_attention(q, k, v, scale=0.125, splits=ns)[0]
        assert max_err(o, a) < 64 * torch.finfo(torch.float32).eps * float(ref.abs().max())


@needs_ext
def test_keep_and_bias_masks_skip_nan_values():
    """A bool keep and a float bias read through strides (broadcast over heads); a key masked for a row
    holds NaN in V and must not reach that row (Note [Decode tiles])."""
    gen = torch.Generator().manual_seed(7)
    B, H, Hkv, L, S, D = 2, 4, 2, 3, 100, 8
    q = torch.randn(B, H, L, D, generator=gen)
    k, v = torch.randn(B, S, Hkv, D, generator=gen), torch.randn(B, S, Hkv, D, generator=gen)
    keep = torch.rand(B, 1, L, S, generator=gen) > 0.3
    keep[:, :, :, 5] = False
    v[:, 5] = float("nan")
    bias = torch.randn(B, 1, L, S, generator=gen)
    out, _ = dk.decode_attention(q, k, v, scale=D ** -0.5, keep=keep, bias=bias)
    kh, vh = k.transpose(1, 2), v.transpose(1, 2).nan_to_num(0.0)
    ref = _ref(q, kh, vh, keep, bias)
    assert not out.isnan().any() and max_err(out, ref) < 1e-5


def _strategy():
    return st.tuples(st.integers(1, 3), st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3)]), st.integers(1, 16),
                     st.integers(1, 200), st.sampled_from([4, 16, 24]), st.sampled_from([None, 1, 8, 32]),
                     st.integers(0, 2**31 - 1))


@needs_ext
@settings(max_examples=12, deadline=None)
@given(_strategy())
def test_hypothesis_shapes(case):
    """Random shapes, lengths and page sizes against the float64 reference (bottom-right causal)."""
    B, (H, Hkv), L, S, D, page, seed = case
    gen = torch.Generator().manual_seed(seed)
    S = max(S, L)
    kc, vc, table = _caches(B, S, Hkv, D, torch.float32, page, gen)
    lens = torch.randint(0, S - L + 1, (B,), generator=gen)
    q = torch.randn(B, L, H, D, generator=gen)
    kn, vn = torch.randn(B, L, Hkv, D, generator=gen), torch.randn(B, L, Hkv, D, generator=gen)
    if table is not None:  # the prefix: random values in the pages
        kc.copy_(torch.randn(kc.shape, generator=gen))
        vc.copy_(torch.randn(vc.shape, generator=gen))
    out = attnlab.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, block_table=table)
    seq = lens + L
    kh, vh = _dense_kv(kc, vc, table, int(seq.max()))
    keep = _keep(B, L, int(seq.max()), seq)
    ref = _ref(q.transpose(1, 2), kh, vh, keep)
    _check(out.transpose(1, 2), ref, _naive(q.transpose(1, 2), kh, vh, keep), str(case))


def test_fallback_without_extension_agrees(monkeypatch):
    """Without the extension (or for L > MAX_QUERIES) the pure-PyTorch path gives the same result."""
    gen = torch.Generator().manual_seed(8)
    B, S, H, Hkv, D, L = 2, 40, 4, 2, 8, 2
    kc, vc, table = _caches(B, S, Hkv, D, torch.float32, 8, gen, poison=False)
    kc.copy_(torch.randn(kc.shape, generator=gen))
    vc.copy_(torch.randn(vc.shape, generator=gen))
    q = torch.randn(B, L, H, D, generator=gen)
    lens = torch.tensor([10, 38])
    slopes = torch.rand(H, generator=gen)
    kw = dict(cache_seqlens=lens, block_table=table, window_size=(6, -1), alibi_slopes=slopes)
    monkeypatch.setattr(dk, "available", lambda: False)
    fb, fl = attnlab.attention_with_kvcache(q, kc, vc, return_lse=True, **kw)
    monkeypatch.undo()
    kh, vh = _dense_kv(kc, vc, table, 38)
    keep = _keep(B, L, 38, lens, True, (6, -1))
    pos = torch.arange(L).view(1, 1, L, 1) + (lens - L).view(B, 1, 1, 1)
    bias = -slopes.view(1, H, 1, 1) * (pos - torch.arange(38).view(1, 1, 1, 38)).abs()
    ref = _ref(q.transpose(1, 2), kh, vh, keep.expand(B, H, L, 38), bias)
    assert max_err(fb.transpose(1, 2), ref) < 1e-5
    if dk.available():
        out, lse = attnlab.attention_with_kvcache(q, kc, vc, return_lse=True, **kw)
        assert max_err(out, fb) < 1e-5 and max_err(lse, fl) < 1e-4


@pytest.mark.parametrize("path", ["kernel", "fallback"])
@pytest.mark.parametrize("lengths", ["int", "per-sequence"])
def test_page_table_outside_the_pool_is_named_and_nothing_is_written(monkeypatch, path, lengths):
    """A page-table entry outside the pool is named (entry, value, pool size) on both paths, whether the
    append writes through it (checked before writing: the pool is unchanged) or only a read reaches it
    (checked by the kernel, Note [Paged checks once]); an entry past every sequence's length is never used."""
    if path == "kernel" and not dk.available():
        pytest.skip(f"decode extension: {dk.unavailable_reason()}")
    if path == "fallback":
        monkeypatch.setattr(dk, "available", lambda: False)
    q, kn, vn = torch.randn(2, 1, 4, 8), torch.randn(2, 1, 2, 8), torch.randn(2, 1, 2, 8)
    pool = torch.zeros(5, 4, 2, 8)
    table = torch.tensor([[0, 1, 2], [3, 4, 9]], dtype=torch.int32)
    n = (lambda x: torch.tensor([x, x])) if lengths == "per-sequence" else (lambda x: x)
    kp, vp = pool.clone(), pool.clone()
    with pytest.raises(attnlab.AttentionInputError, match=r"block_table\[1, 2\] = 9 points outside the pool of 5 pages"):
        attnlab.attention_with_kvcache(q, kp, vp, kn, vn, cache_seqlens=n(8), block_table=table)  # writes via [., 2]
    assert torch.equal(kp, pool) and torch.equal(vp, pool)
    with pytest.raises(attnlab.AttentionInputError, match=r"block_table\[1, 2\] = 9 points outside the pool of 5 pages"):
        attnlab.attention_with_kvcache(q, kp, vp, cache_seqlens=n(9), block_table=table)  # 9 keys read [., 2]
    with pytest.raises(attnlab.AttentionInputError, match=r"block_table\[0, 1\] = -1 points outside"):
        attnlab.attention_with_kvcache(q, kp, vp, cache_seqlens=n(5),
                                       block_table=torch.tensor([[0, -1, 2], [3, 4, 1]], dtype=torch.int32))
    out = attnlab.attention_with_kvcache(q, kp, vp, kn, vn, cache_seqlens=n(7), block_table=table)  # 8 keys: 2 pages
    assert out.shape == (2, 1, 4, 8) and torch.isfinite(out).all()


# -- attention() routes decode shapes to the decode path --------------------------------------------
def _route_cases(B, L, S, gen):
    from attnlab import patterns as P
    lengths = torch.tensor([S, S // 3])[:B]
    holes = torch.rand(B, S, generator=gen) > 0.7  # True = ignore (not a prefix)
    return {
        "plain": {},
        "causal_top_left": dict(is_causal=True),
        "bottom_right": dict(pattern=P.causal("bottom_right")),
        "window": dict(pattern=P.sliding_window(7, causal=True, align="bottom_right")),
        "lengths": dict(pattern=P.key_padding(lengths)),
        "holes_and_causal": dict(pattern=P.from_key_padding_mask(holes) & P.causal("bottom_right")),
        "bool_mask": dict(attn_mask=torch.rand(B, 1, L, S, generator=gen) > 0.5),
        "float_mask": dict(attn_mask=torch.randn(1, 1, L, S, generator=gen)),
        "alibi_softcap": dict(alibi_slopes=torch.rand(4, generator=gen), softcap=3.0, is_causal=True),
    }


@needs_ext
@pytest.mark.parametrize("case", list(_route_cases(2, 3, 50, torch.Generator().manual_seed(0))))
def test_attention_routes_decode_shapes(case):
    """attnlab.attention with L <= 16 under no_grad plans the compiled kernel's decode path and agrees with
    the dense kernel (float64 on the same masks) for every mask, pattern, softcap and ALiBi."""
    gen = torch.Generator().manual_seed(9)
    B, H, Hkv, L, S, D = 2, 4, 2, 3, 50, 8
    kw = _route_cases(B, L, S, torch.Generator().manual_seed(0))[case]
    q, k, v = (torch.randn(B, h, n, D, generator=gen) for h, n in ((H, L), (Hkv, S), (Hkv, S)))
    with torch.no_grad():
        plan = attnlab.explain(q, k, v, enable_gqa=True, **kw)
        if case == "causal_top_left":  # keys past L are dead (cut by Note [Dead keys]): an L x L self-attention
            assert not plan.decode, plan
        else:
            assert plan.method == "decode" and plan.decode, plan
        out = attnlab.attention(q, k, v, enable_gqa=True, **kw)
        ref = attnlab.attention(q.double(), k.double(), v.double(), enable_gqa=True, method="dense",
                                **{a: (b.double() if isinstance(b, torch.Tensor) and b.is_floating_point() else b)
                                   for a, b in kw.items()})
    assert max_err(out, ref) < 1e-5


def test_grad_calls_do_not_take_the_decode_path():
    q = torch.randn(1, 4, 1, 8, requires_grad=True)
    k, v = torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8)
    assert not attnlab.explain(q, k, v, enable_gqa=True).decode
    attnlab.attention(q, k, v, enable_gqa=True).sum().backward()
    assert q.grad is not None
    if dk.available():
        with pytest.raises(RuntimeError, match="forward only"):
            dk.decode_attention(q, k.transpose(1, 2), v.transpose(1, 2), scale=1.0)


@pytest.mark.slow
@pytest.mark.parametrize("capability", ["AVX2", "DEFAULT"])
def test_other_decode_builds_in_subprocesses(capability):
    """The decode kernel's AVX2 (_decode_avx2) and baseline (_decode) builds, which this CPU would not load by
    itself, run the append-and-attend cases against float64, the int8 cache's dequantisation and quantiser (Note
    [int8 scale search]) and the one-call step against the full path (ATEN_CPU_CAPABILITY picks the build)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability.lower())
    probe = subprocess.run([sys.executable, "-c", "from attnlab.kernels import decode as d; print(d.capability())"],
                           capture_output=True, text=True, env=env, timeout=120)
    if probe.stdout.strip() != capability:
        pytest.skip(f"this CPU / torch cannot load the {capability} decode build (got {probe.stdout.strip()!r})")
    int8 = os.path.join(os.path.dirname(__file__), "test_kvcache_int8.py")  # its AVX2 / scalar dequantisation
    bf16 = os.path.join(os.path.dirname(__file__), "test_kvcache_bf16.py")  # widened bf16 scores, prefetch modes
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", __file__, int8, bf16,
                          "-k", "appends_and_attends or dequantises_like or int16_query or vnni or bf16_scores "
                          "or prefetch or one_call_step or quantises_by_search or within_half_a_step"],
                         capture_output=True, text=True, env=env,
                         timeout=600, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]


@pytest.mark.parametrize("quant", [False, True])
def test_one_int_length_appends_as_per_sequence_lengths(quant):
    """Note [One cache length]: an int cache_seqlens (slice append, int lengths) writes the same rows and gives
    the same output as the same lengths as a tensor [B] (index_put, per-sequence lengths)."""
    from attnlab.functional.kvcache import QuantizedKV

    g = torch.Generator().manual_seed(6)
    q = torch.randn(3, 2, 4, 8, generator=g)
    kn, vn = torch.randn(3, 2, 2, 8, generator=g), torch.randn(3, 2, 2, 8, generator=g)
    base_k, base_v = torch.randn(3, 13, 2, 8, generator=g), torch.randn(3, 13, 2, 8, generator=g)
    outs, caches = [], []
    for lens in (7, torch.tensor([7, 7, 7])):
        kc, vc = base_k.clone(), base_v.clone()
        if quant:
            kc, vc = QuantizedKV.quantize(kc), QuantizedKV.quantize(vc)
        outs.append(attnlab.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens))
        caches.append((kc.dequantize(), vc.dequantize()) if quant else (kc, vc))
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert not torch.equal(caches[0][0][:, 7:9], base_k[:, 7:9])  # the rows were written


@pytest.mark.parametrize("on_sdpa", [True, False], ids=["sdpa", "decode-path"])
def test_plain_multi_head_calls_go_where_the_planner_sends_plain_decode(monkeypatch, on_sdpa):
    """Note [Plain decode on SDPA here]: on the full path a plain fp32 multi-head call runs on SDPA where the
    rates say SDPA is faster at its cache length and on the decode path where they do not (a calibration fitted
    either way), the same result within fp32 rounding of float64; an append still lands first, and a call that
    is not plain (an lse asked, per-sequence lengths) always takes the decode path. The one-call step (csrc
    Note [One-call decode step]), the decode kernel's direct path, takes plain calls under either fit."""
    import dataclasses

    from attnlab.kernels import rates

    before = rates.current()
    least = 10**9 if on_sdpa else 0.0  # SDPA below `least` keys
    rates.make_current(dataclasses.replace(before, decode_min_keys={(torch.float32, False): least}))
    calls = []  # calls of the decode kernel's wrapper (the full path's decode path)
    real, real_step = dk.decode_attention, dk.decode_step
    monkeypatch.setattr(dk, "decode_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(dk, "decode_step", lambda *a, **kw: None)  # the full path first
    try:
        gen = torch.Generator().manual_seed(21)
        B, S, H, D = 2, 90, 4, 16
        # a heads-first cache (attnlab's [B, H, S, D], transposed): SDPA reads no other (Note [Cache layouts])
        kc, vc = (torch.randn(B, H, S, D, generator=gen).transpose(1, 2) for _ in range(2))
        q = torch.randn(B, 1, H, D, generator=gen)
        kn, vn = torch.randn(B, 1, H, D, generator=gen), torch.randn(B, 1, H, D, generator=gen)
        out = attnlab.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=60)
        assert torch.equal(kc[:, 60], kn[:, 0]) and torch.equal(vc[:, 60], vn[:, 0])
        assert len(calls) == (0 if on_sdpa else 1) or not dk.available()
        kh, vh = kc[:, :61].transpose(1, 2), vc[:, :61].transpose(1, 2)
        ref = _ref(q.transpose(1, 2), kh, vh, torch.ones(B, 1, 1, 61, dtype=torch.bool))
        assert out.shape == (B, 1, H, D) and max_err(out.transpose(1, 2), ref) < 1e-5
        calls.clear()
        for kw in (dict(return_lse=True), dict(cache_seqlens=torch.tensor([61, 61]))):
            kw = {"cache_seqlens": 61, **kw}
            got = attnlab.attention_with_kvcache(q, kc, vc, **kw)
            got = got[0] if isinstance(got, tuple) else got
            assert max_err(got.transpose(1, 2), ref) < 1e-5
        assert len(calls) == 2 or not dk.available()
        # the one-call step, the decode kernel's direct path, takes the plain calls the rule gives the decode kernel
        # on this heads-first cache, and every plain call on flash-attn's tokens-first one (Note [Plain steps on the
        # decode kernel]: SDPA declares heads-first caches only)
        stepped = []
        monkeypatch.setattr(dk, "decode_step", lambda *a, **kw: stepped.append(real_step(*a, **kw)) or stepped[-1])
        got = attnlab.attention_with_kvcache(q, kc, vc, cache_seqlens=61)
        assert len(stepped) == (0 if on_sdpa else 1) and (on_sdpa or stepped[0] is not None or not dk.available())
        assert max_err(got.transpose(1, 2), ref) < 1e-5
        got = attnlab.attention_with_kvcache(q, kc.contiguous(), vc.contiguous(), cache_seqlens=61)
        assert len(stepped) == (1 if on_sdpa else 2) and (stepped[-1] is not None or not dk.available())
        assert max_err(got.transpose(1, 2), ref) < 1e-5
    finally:
        rates.make_current(before)


# -- the one-call step (csrc Note [One-call decode step]) -----------------------------------------
def _step_case(dtype, H, Hkv, layout, L, gen):
    """(q, k_cache, v_cache, block_table, kn, vn) for a step at n0 = 37 of B = 2 sequences, capacity 64."""
    B, S, D, Dv = 2, 64, 32, 48
    k = torch.randn(B, S, Hkv, D, generator=gen).to(dtype)
    v = torch.randn(B, S, Hkv, Dv, generator=gen).to(dtype)
    table = None
    if layout == "heads-first":  # attnlab's [B, Hkv, S, D] storage passed as a view
        k, v = k.transpose(1, 2).contiguous().transpose(1, 2), v.transpose(1, 2).contiguous().transpose(1, 2)
    elif layout.startswith("page"):
        T = int(layout[4:])
        pages = -(-S // T)
        table = torch.randperm(B * pages + 2, generator=gen)[: B * pages].view(B, pages).to(torch.int32)
        kp = torch.full((B * pages + 2, T, Hkv, D), float("nan")).to(dtype)
        vp = torch.full((B * pages + 2, T, Hkv, Dv), float("nan")).to(dtype)
        j = torch.arange(S)
        kp[table.long()[:, j // T], j % T] = k
        vp[table.long()[:, j // T], j % T] = v
        k, v = kp, vp
    q = torch.randn(B, L, H, D, generator=gen).to(dtype)
    kn = torch.randn(B, L, Hkv, D, generator=gen).to(dtype)
    vn = torch.randn(B, L, Hkv, Dv, generator=gen).to(dtype)
    return q, k, v, table, kn, vn


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("H,Hkv", [(4, 4), (6, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("layout", ["contiguous", "heads-first", "page16", "page7"])
@pytest.mark.parametrize("L,causal", [(1, True), (3, True), (3, False)])
@pytest.mark.parametrize("lens", ["int", "int32 [B]", "int64 [B]"])
def test_one_call_step_is_the_full_path(monkeypatch, dtype, H, Hkv, layout, L, causal, lens):
    """A plain step through the one-call entry appends the same rows and returns the same bits as the full
    path (which calls the kernel with the same arguments), and the step was taken; both against float64. One
    length for the batch, or one per sequence (csrc Note [One-call step lengths])."""
    import dataclasses

    from attnlab.kernels import rates

    before = rates.current()  # never SDPA here: the step is what is tested
    rates.make_current(dataclasses.replace(before, decode_min_keys={(dtype, False): 0.0, (dtype, True): 0.0}))
    try:
        gen = torch.Generator().manual_seed(7)
        q, kc, vc, table, kn, vn = _step_case(dtype, H, Hkv, layout, L, gen)
        kc2, vc2 = kc.clone(), vc.clone()
        taken = []
        real_step = dk.decode_step
        monkeypatch.setattr(dk, "decode_step", lambda *a, **kw: taken.append(real_step(*a, **kw)) or taken[-1])
        n0 = 37 if lens == "int" else torch.tensor([37, 21], dtype=getattr(torch, lens.split()[0]))
        out = attnlab.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=n0, block_table=table, is_causal=causal)
        assert len(taken) == 1 and taken[0] is not None, "the plain step did not take the one-call entry"
        monkeypatch.setattr(dk, "decode_step", lambda *a, **kw: None)  # the full path
        full = attnlab.attention_with_kvcache(q, kc2, vc2, kn, vn, cache_seqlens=n0, block_table=table,
                                              is_causal=causal)
        assert torch.equal(out, full)
        assert torch.equal(kc.nan_to_num(7.0), kc2.nan_to_num(7.0)) and torch.equal(vc.nan_to_num(7.0), vc2.nan_to_num(7.0))
        seqlens = (torch.tensor([37, 37]) if lens == "int" else n0.long()) + L
        n = int(seqlens.max())
        kh, vh = _dense_kv(kc, vc, table, n)
        keep = _keep(2, L, n, seqlens, causal=causal)
        qh = q.transpose(1, 2)
        _check(out.transpose(1, 2), _ref(qh, kh, vh, keep), _naive(qh, kh, vh, keep), f"{dtype} {layout}")
    finally:
        rates.make_current(before)


@needs_ext
def test_one_call_step_declines_and_writes_nothing():
    """The one-call entry returns None, the caches untouched, for every call it does not take or input it would
    reject (the full path then runs and names the error); a call it takes writes the rows."""
    gen = torch.Generator().manual_seed(8)
    q, kc, vc, table, kn, vn = _step_case(torch.float32, 4, 2, "page16", 1, gen)
    k0, v0 = kc.clone(), vc.clone()
    same = lambda: torch.equal(kc.nan_to_num(7.0), k0.nan_to_num(7.0)) and torch.equal(vc.nan_to_num(7.0), v0.nan_to_num(7.0))  # noqa: E731
    bad_table = table.clone()
    bad_table[1, 3] = 99  # a page the read reaches (keys 48..63), not the append (key 37)
    grad_q = q.clone().requires_grad_()
    declined = {
        "overflow": (q, kc, vc, kn, vn, 64, table),
        "page outside the pool": (q, kc, vc, kn, vn, 50, bad_table),
        "int64 table": (q, kc, vc, kn, vn, 37, table.long()),
        "negative length": (q, kc, vc, kn, vn, -1, table),
        "k without v": (q, kc, vc, kn, None, 37, table),
        "k of another dtype": (q, kc, vc, kn.double(), vn.double(), 37, table),
        "k of other heads": (q, kc, vc, kn.repeat(1, 1, 2, 1), vn.repeat(1, 1, 2, 1), 37, table),
        "too many queries": (q.repeat(1, 17, 1, 1), kc, vc, None, None, 37, table),
        "strided head dim": (q[..., ::2], kc, vc, None, None, 37, table),
        "requires grad": (grad_q, kc, vc, kn, vn, 37, table),
        "int8 cache": (q, kc.to(torch.int8), vc.to(torch.int8), None, None, 37, table),
        # per-sequence lengths (csrc Note [One-call step lengths])
        "a negative length of one sequence": (q, kc, vc, kn, vn, torch.tensor([37, -1]), table),
        "one sequence overflows": (q, kc, vc, kn, vn, torch.tensor([10, 64], dtype=torch.int32), table),
        "a page outside the pool for one sequence": (q, kc, vc, kn, vn, torch.tensor([10, 50]), bad_table),
        "lengths of another dtype": (q, kc, vc, kn, vn, torch.tensor([37, 37], dtype=torch.int16), table),
        "lengths of another shape": (q, kc, vc, kn, vn, torch.tensor([37, 37, 37]), table),
        "lengths [B, 1]": (q, kc, vc, kn, vn, torch.tensor([[37], [37]]), table),
    }
    for what, (qq, k_, v_, a, b, n0, t) in declined.items():
        with torch.enable_grad():
            got = dk.decode_step(qq, k_, v_, a, b, n0, t, True, 0.25)
        assert got is None, what
        assert same(), f"{what}: the caches changed"
    with pytest.raises(attnlab.AttentionInputError, match="overflows"):  # past int64: the full path's error
        attnlab.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=2**70, block_table=table)
    assert same()
    with pytest.raises(attnlab.AttentionInputError, match="sequence 1 .*overflows|overflows: sequence 1"):
        attnlab.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=torch.tensor([10, 64]), block_table=table)
    with pytest.raises(attnlab.AttentionInputError, match=r"block_table\[1, 3\] = 99"):
        attnlab.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=torch.tensor([10, 50]), block_table=bad_table)
    assert same()
    out = dk.decode_step(q, kc, vc, kn, vn, 37, table, True, 0.25)
    assert out is not None and out.shape == (2, 1, 4, 48)
    T = kc.shape[1]
    assert torch.equal(kc[int(table[0, 37 // T]), 37 % T], kn[0, 0]) and torch.equal(vc[int(table[1, 37 // T]), 37 % T], vn[1, 0])


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_repeated_plain_decode_calls_take_the_one_call_step(monkeypatch, dtype):
    """attention()'s repeated decode call (the plan cache's direct call, kernels/decode.py) of one query
    seeing every key runs the one-call step: the same bits as the first call (decode_attention), and within
    the naive computation's budget of the float64 reference."""
    taken = []
    real_step = dk.decode_step
    monkeypatch.setattr(dk, "decode_step", lambda *a, **kw: taken.append(real_step(*a, **kw)) or taken[-1])
    gen = torch.Generator().manual_seed(31)
    q = torch.randn(2, 6, 1, 24, generator=gen).to(dtype)  # shapes of their own: a fresh plan-cache entry
    k, v = torch.randn(2, 3, 41, 24, generator=gen).to(dtype), torch.randn(2, 3, 41, 24, generator=gen).to(dtype)
    with torch.inference_mode():
        outs = [attnlab.attention(q, k, v, enable_gqa=True) for _ in range(3)]
    assert any(t is not None for t in taken), "no repeated call took the one-call step"
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    keep = torch.ones(2, 1, 1, 41, dtype=torch.bool)
    _check(outs[2], _ref(q, k, v, keep), _naive(q, k, v, keep), f"{dtype}")


def test_balanced_splits_fill_the_last_round():
    """Note [Decode balanced units]: a split count whose units leave more than 5 % of the threads' last round idle
    is raised to the least count (at most twice it, at most ``top``) that fills every round; else kept."""
    assert dk.balanced_splits(3, 3, 8, 2) == 4  # 9 units on 2 threads -> 12
    assert dk.balanced_splits(3, 3, 3, 2) == 3  # no room above: kept
    assert dk.balanced_splits(3, 2, 8, 2) == 2  # 6 units: full rounds
    assert dk.balanced_splits(8, 1, 8, 2) == 1
    assert dk.balanced_splits(9, 1, 8, 2) == 2  # 5 of 4.5 rounds (11 % idle) -> 18 units
    assert dk.balanced_splits(41, 1, 8, 2) == 1  # 21 of 20.5 rounds: 2.4 % idle, kept
    assert dk.balanced_splits(5, 2, 8, 3) == 3  # 10 units on 3 threads -> 15
    assert dk.balanced_splits(7, 5, 8, 1) == 5  # one thread: always full


@needs_ext
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("B,Hkv,S", [(1, 3, 4096), (1, 9, 2048), (2, 5, 3000), (1, 1, 700)])
def test_one_call_step_splits_as_the_full_path(B, Hkv, S, threads):
    """The one-call step (csrc decode_step) and the full path (kernels/decode.py num_splits) take the same split
    count, balanced or not (Note [Decode balanced units]): the same bits out, against float64 within fp32
    rounding, at thread counts where the balance moves the count."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(S + Hkv)
        H, D = 3 * Hkv, 32
        q = torch.randn(B, 1, H, D, generator=gen)
        # heads-first storage (transformers' and the in-place cache's): one kv head per unit
        kc = torch.randn(B, Hkv, S + 8, D, generator=gen).transpose(1, 2)
        vc = torch.randn(B, Hkv, S + 8, D, generator=gen).transpose(1, 2)
        out = dk.decode_step(q, kc, vc, None, None, S, None, False, D ** -0.5)
        assert out is not None
        ns = dk.num_splits_for(kc, B, S)
        if (B, Hkv, S, threads) == (1, 3, 4096, 2):
            assert ns == 4  # 9 units raised to 12
        full, _ = dk.decode_attention(q, kc[:, :S], vc[:, :S], scale=D ** -0.5, blhd=True)  # its own split count
        assert torch.equal(out, full), ns
        other, _ = dk.decode_attention(q, kc[:, :S], vc[:, :S], scale=D ** -0.5, splits=ns + 1, blhd=True)
        assert not torch.equal(out, other)  # the split count shows in the bits, so the equality above tests it
        ref = reference.attention(q.transpose(1, 2).double(), kc[:, :S].transpose(1, 2).double(),
                                  vc[:, :S].transpose(1, 2).double(), enable_gqa=True)[0]  # [B, H, 1, D]
        assert max_err(out.transpose(1, 2), ref) < 1e-5
    finally:
        torch.set_num_threads(old)
