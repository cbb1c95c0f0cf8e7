"""The int8 KV cache of attention_with_kvcache (``QuantizedKV``; csrc/decode.cpp Note [Decode int8 cache]):
quantisation within its bound, the kernel's folded scales within fp32 rounding of decoding the dequantised
fp32 cache, appends quantised where flash-attn writes them, the error budget against fp32 relative to a bf16
cache's (Note [int8 KV error budget]), and clear errors for mismatched scales."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attnlab
from attnlab import reference
from attnlab.functional.kvcache import INT8_ERROR_BUDGET, QuantizedKV
from attnlab.kernels import decode as dk
from attnlab.functional import kvquant
from helpers import check_int8_searched, int_pv_error, max_err

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


def _paged_caches(kq: QuantizedKV, vq: QuantizedKV, page):
    """(kq, vq, None) for page None, else both caches moved into pools of `page` tokens (data and scales under
    one shuffled block table) and that table."""
    if page is None:
        return kq, vq, None
    gen = lambda: torch.Generator().manual_seed(1)  # noqa: E731  (the same pages for every tensor)
    kd, table = _paged(kq.data, page, gen())
    ks, _ = _paged(kq.scale.unsqueeze(-1), page, gen())
    vd, _ = _paged(vq.data, page, gen())
    vs, _ = _paged(vq.scale.unsqueeze(-1), page, gen())
    return (QuantizedKV(kd, ks[..., 0].contiguous(), kq.channel, kq.rotation),
            QuantizedKV(vd, vs[..., 0].contiguous(), vq.channel, vq.rotation), table)


def _vnni_same_bits(kq: QuantizedKV, vq: QuantizedKV, page, gen) -> None:
    """Outputs and lse of a decode call (B 2, S 90, GQA 6/2, 3 queries, per-sequence lengths) through int8 caches
    kq, vq [2, 90, 2, D] (paged by ``page``), equal bit for bit with the VNNI scores on and off."""
    kq, vq, table = _paged_caches(kq, vq, page)
    q = torch.randn(2, 3, 6, kq.shape[3], generator=gen)
    lens = torch.tensor([90 - 3, 41])
    run = lambda: attnlab.attention_with_kvcache(q, kq, vq, cache_seqlens=lens, block_table=table,  # noqa: E731
                                                 return_lse=True)
    try:
        a = run()
        dk.set_vnni(False)
        assert not dk.vnni()
        b = run()
    finally:
        dk.set_vnni(True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def _q16_score_error(q: torch.Tensor, k: torch.Tensor) -> float:
    """The most the kernel's int16 query moves a score (csrc Note [Decode int8 scores]): each element of
    q · D^-1/2 is off by at most half its row's step max|q_row| D^-1/2 / 32767, so a score by that times
    the key's L1 norm. q [.., D], k (the dequantised keys) [.., D]."""
    D = q.shape[-1]
    step = float(q.float().abs().amax()) * D ** -0.5 / 32767
    return step / 2 * float(k.float().abs().sum(-1).max())


def test_quantize_within_half_a_step():
    """Per-token rows: |x - data·scale| <= scale / 2 per element (round to nearest), the scale the best of the
    candidates max|row| / m (Note [int8 scale search], float64 oracle); a zero row is exactly 0 with scale 0."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 17, 2, 24, generator=gen) * torch.rand(3, 17, 2, 1, generator=gen) * 5
    x[0, 3, 1] = 0.0
    qk = QuantizedKV.quantize(x)
    assert qk.data.dtype == torch.int8 and qk.scale.shape == (3, 17, 2)
    check_int8_searched(x, qk.data, qk.scale, kvquant.SCALE_CANDIDATES, "per-token rows")
    assert torch.equal(qk.dequantize()[0, 3, 1], torch.zeros(24)) and float(qk.scale[0, 3, 1]) == 0.0
    plain = (x / (x.abs().amax(-1, keepdim=True) / 127).clamp_min(1e-30)).round() * x.abs().amax(-1, keepdim=True) / 127
    assert float((qk.dequantize() - x).norm()) < float((plain - x).norm())  # the search found better scales here


@pytest.mark.parametrize("path", ["extension", "torch"])
@pytest.mark.parametrize("gs,D", [(32, 64), (32, 128), (64, 128), (None, 64), (None, 7)])
def test_int8_quantises_by_search(monkeypatch, path, gs, D):
    """Note [int8 scale search], in the extension's quantiser and in its torch twin (``kvquant._search``, which
    runs without the extension): every group (or row) of Gaussian, outlier, constant and tiny values within half a
    step and at the best candidate scale's error (float64 oracle, ``check_int8_searched``), rotated keys too (the
    rows of x Rᵀ, checked against the float64 rotation within its float32 rounding); inf or NaN anywhere in x
    raises before anything is returned."""
    if path == "extension" and not dk.available():
        pytest.skip(f"decode extension: {dk.unavailable_reason()}")
    if path == "torch":
        monkeypatch.setattr(kvquant.kdecode, "quantize_rows", lambda *a: None)
    gen = torch.Generator().manual_seed(D + (gs or 0))
    x = torch.randn(2, 40, 3, D, generator=gen) * 2
    x[0, :5, 0] *= 1e-30  # tiny rows: scales near the float32 floor
    x[0, 5, 1] = 0.25  # a constant row: every candidate but m = 127 is worse
    x[1, :, 2, 1] *= 30  # an outlier channel
    x[1, 7, 0] = 0.0
    for group_size in ((gs,) if gs else (None,)):
        qk = QuantizedKV.quantize(x, group_size=group_size)
        n = group_size or D
        check_int8_searched(x.reshape(*x.shape[:-1], -1, n), qk.data.reshape(*x.shape[:-1], -1, n),
                            qk.scale.reshape(*x.shape[:-1], -1), kvquant.SCALE_CANDIDATES, f"{path} gs {gs}")
        assert torch.equal(qk.data[0, 5, 1], torch.full((D,), 127, dtype=torch.int8))  # m = 127, exact there
    if D & (D - 1) == 0:  # rotated keys: x Rᵀ in float32 (the fast transform) within its rounding of float64
        qr = QuantizedKV.quantize(x, rotate=True, group_size=gs)
        rot = x.double() @ kvquant.hadamard(D).double().T
        slack = D * torch.finfo(torch.float32).eps * float(x.abs().max())
        n = gs or D
        stored = (qr.data.double().reshape(*x.shape[:-1], -1, n) * qr.scale.double().reshape(*x.shape[:-1], -1, 1))
        assert float((stored.reshape(x.shape) - rot).abs().max()) <= float(qr.scale.max()) / 2 + slack
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[1, 3, 2, D - 1] = bad
        with pytest.raises(ValueError, match="finite keys and values"):
            QuantizedKV.quantize(y, group_size=gs)


@needs_ext
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page", [None, 16, 5], ids=["contiguous", "page16", "page5"])
@pytest.mark.parametrize("H,Hkv,D", [(6, 2, 24), (4, 1, 64), (2, 2, 7)], ids=["gqa", "mqa", "odd_d"])
def test_kernel_dequantises_like_the_fp32_cache(qdtype, page, H, Hkv, D):
    """A decode step through an int8 cache (appending one token, per-sequence lengths, paged or not) matches
    the kernel on the dequantised cache in fp32 within the rounding of moving one multiplication: the int8
    path takes (q . k8) * k_scale and (p * v_scale) . v8 where the fp32 path takes q . (k8 * k_scale) and
    p . (v8 * v_scale), the same products in the same order otherwise (Note [Decode int8 cache]), except
    that with a SIMD build the scores take q rounded to int16 per row (Note [Decode int8 scores]: at most
    half a step of max|q_row| / 32767 per element, ``_q16_score_error``). Each product then moves by at
    most 2 eps relative, a score by 2 eps |q| |k| scale plus the int16 rounding, a probability by twice the
    largest score change (relative), an output by that times max|v| plus 2 eps max|v|; the budget is twice
    that, plus twice the integer P @ V's rounding where the build has it (csrc Note [Decode int8 P @ V],
    ``helpers.int_pv_error``: D = 64 here). The appended row is the quantised new k, v."""
    gen = torch.Generator().manual_seed(H * D + (page or 0))
    B, S, L = 3, 150, 1
    k0, v0 = torch.randn(B, S, Hkv, D, generator=gen), torch.randn(B, S, Hkv, D, generator=gen)
    kq, vq = QuantizedKV.quantize(k0), QuantizedKV.quantize(v0)
    kseq, vseq = kq.dequantize(), vq.scale.clone()  # key order, for the integer P @ V's bound
    kq, vq, table = _paged_caches(kq, vq, page)
    lens = torch.tensor([0, 77, S - 1])
    q = torch.randn(B, L, H, D, generator=gen).to(qdtype)
    kn, vn = torch.randn(B, L, Hkv, D, generator=gen).to(qdtype), torch.randn(B, L, Hkv, D, generator=gen).to(qdtype)
    for b in range(B):
        kseq[b, int(lens[b])] = QuantizedKV.quantize(kn[b:b + 1].float()).dequantize()[0, 0]
        vseq[b, int(lens[b])] = QuantizedKV.quantize(vn[b:b + 1].float()).scale[0, 0]
    pv = 2 * int_pv_error(q.float(), kseq, vseq, lens + L)
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
        ds = 2 * eps * float(q.norm(dim=-1).max() * kf.norm(dim=-1).max()) * D ** -0.5 + _q16_score_error(q, kf)
        tol = 2 * (2 * ds + 2 * eps) * float(vf.abs().max()) + pv
        assert max_err(out, want) <= tol, (max_err(out, want), tol)
        assert not torch.equal(kf, kq.data.float())  # the scales are not 1: the test sees them applied
    else:  # q and out in bf16: the kernel widens q and rounds out exactly as for a bf16 cache
        assert max_err(out, want) <= 2 * torch.finfo(torch.bfloat16).eps * float(want.abs().max()) + 1e-6 + pv


@needs_ext
@pytest.mark.parametrize("D", [40, 128])
def test_int16_query_on_its_grid_is_exact(D):
    """Note [Decode int8 scores]: a query whose scaled rows already lie on their int16 grid (integers n,
    max |n| = 32767, times a power of two; softmax scale 1/8) is taken exactly, so the int8 cache's result
    is then the dequantised fp32 cache's within fp32 rounding alone (no int16 term in the budget of
    test_kernel_dequantises_like_the_fp32_cache). D = 40 runs a whole step and a tail, 128 whole steps. The
    integer P @ V (csrc Note [Decode int8 P @ V]) is off here: its own rounding would hide the query's."""
    gen = torch.Generator().manual_seed(D)
    B, S, H, Hkv = 2, 97, 6, 2
    k0, v0 = torch.randn(B, S, Hkv, D, generator=gen), torch.randn(B, S, Hkv, D, generator=gen)
    kq, vq = QuantizedKV.quantize(k0), QuantizedKV.quantize(v0)
    n = torch.randint(-32767, 32768, (B, 1, H, D), generator=gen).float()
    n[..., 3] = 32767.0  # every row's max |n|: its step is exactly 2^-20 / 8
    q = n * 2.0 ** -20
    dk.set_int_pv(False)
    try:
        out = attnlab.attention_with_kvcache(q, kq, vq, is_causal=False, scale=0.125)
    finally:
        dk.set_int_pv(True)
    kf, vf = kq.dequantize(), vq.dequantize()
    want = attnlab.attention_with_kvcache(q, kf, vf, is_causal=False, scale=0.125)
    eps = torch.finfo(torch.float32).eps
    ds = 2 * eps * float(q.norm(dim=-1).max() * kf.norm(dim=-1).max()) * 0.125
    tol = 2 * (2 * ds + 2 * eps) * float(vf.abs().max())
    assert max_err(out, want) <= tol, (max_err(out, want), tol)
    assert _q16_score_error(q, kf) * 0.125 * D ** 0.5 > 20 * ds  # off the grid the int16 term would dominate


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
    kf, vf = kq.dequantize(), vq.dequantize()
    # fp32 rounding of both paths against the float64 oracle, and the kernel's int16 query (as in
    # test_kernel_dequantises_like_the_fp32_cache): a score by ds, an output by 2 ds max|v|, twice that
    eps = torch.finfo(torch.float32).eps
    ds = 2 * eps * float(q.norm(dim=-1).max() * kf.norm(dim=-1).max()) * 16 ** -0.5
    tol = 2 * (2 * ds + 2 * eps) * float(vf.abs().max())
    assert max_err(fb.transpose(1, 2), torch.from_numpy(ref)) <= tol
    if dk.available():
        tol8 = 2 * (2 * (ds + _q16_score_error(q, kf)) + 2 * eps) * float(vf.abs().max())
        assert max_err(attnlab.attention_with_kvcache(q, kq, vq, cache_seqlens=lens), fb) <= tol + tol8


def _int_pv_on_off(q, kq, vq, lens, table=None):
    """attention_with_kvcache through int8 caches with the integer P @ V on, then off: (on, off)."""
    run = lambda: attnlab.attention_with_kvcache(q, kq, vq, cache_seqlens=lens, block_table=table)  # noqa: E731
    try:
        dk.set_int_pv(True)
        on = run()
        dk.set_int_pv(False)
        off = run()
    finally:
        dk.set_int_pv(True)
    return on, off


@needs_ext
@pytest.mark.parametrize("page", [None, 16], ids=["contiguous", "page16"])
@pytest.mark.parametrize("H,Hkv,D,S,gs", [(8, 2, 128, 301, None), (9, 3, 64, 1000, None), (5, 5, 192, 77, None),
                                          (8, 2, 128, 301, 32), (9, 3, 64, 1000, 32), (4, 2, 192, 99, 64)],
                         ids=["gqa4-odd-tail", "smollm-gqa3", "mha", "gqa4-g32", "smollm-g32", "gqa2-g64"])
def test_integer_pv_within_its_rounding(page, H, Hkv, D, S, gs):
    """csrc Note [Decode int8 P @ V]: with the integer P @ V on (4, 2 + 1 and 1 rows a block; a tile of an odd
    number of keys; paged or not; one value scale a row, or a scale per group of 32 or 64 channels, whose chunks
    of 64 columns then take one group's weights or two) the output is the fp32 P @ V's (the same scores and
    softmax) within twice the bound of its weights' int16 rounding (``dk.int_pv_bound`` on float64
    probabilities) plus fp32 rounding of both sums; and it differs, so the path runs. Skips where the build has
    no integer P @ V."""
    if not dk.int_pv():
        pytest.skip("the decode build is not AVX-512 (or set_int_pv is off): no integer P @ V to check")
    gen = torch.Generator().manual_seed(D + S)
    B = 2
    k0, v0 = torch.randn(B, S, Hkv, D, generator=gen), torch.randn(B, S, Hkv, D, generator=gen) * 3
    if gs:
        v0[..., gs:2 * gs] *= 8  # groups far apart: the row's one grid is set by the largest
    kq, vq = QuantizedKV.quantize(k0, group_size=gs), QuantizedKV.quantize(v0, group_size=gs)
    q, lens = torch.randn(B, 1, H, D, generator=gen), torch.tensor([S, S - 45])
    bound = int_pv_error(q, kq.dequantize(), vq.scale, lens)
    kp, vp, table = _paged_caches(kq, vq, page)
    on, off = _int_pv_on_off(q, kp, vp, lens, table)
    vmax = float(vq.dequantize().abs().max())
    eps = torch.finfo(torch.float32).eps
    tol = 2 * bound + 2 * (32 + S / 32 + 2) * eps * vmax  # fp32: a tile's 32 products, S / 32 tiles summed
    assert max_err(on, off) <= tol, (max_err(on, off), tol)
    assert not torch.equal(on, off)
    assert bound < 1e-3 * vmax  # the budget stays far below the int8 cache's own error (a step of 1/254)


@needs_ext
@pytest.mark.parametrize("gs", [None, 32], ids=["per-row", "g32"])
def test_integer_pv_falls_back_where_weights_leave_its_grid(gs):
    """Values so small that a tile's largest weight p * v_scale is under 2^-100 (and a query of NaN) take the
    fp32 P @ V: the same bits with the integer P @ V on and off (one value scale a row, or one a group)."""
    gen = torch.Generator().manual_seed(5)
    k0, v0 = torch.randn(1, 200, 2, 64, generator=gen), torch.randn(1, 200, 2, 64, generator=gen) * 1e-32
    kq, vq = QuantizedKV.quantize(k0), QuantizedKV.quantize(v0, group_size=gs)
    q = torch.randn(1, 1, 8, 64, generator=gen)
    on, off = _int_pv_on_off(q, kq, vq, 200)
    assert torch.equal(on, off) and float(on.abs().max()) > 0
    q[0, 0, 3, 5] = float("nan")
    on, off = _int_pv_on_off(q, kq, vq, 200)
    assert torch.equal(on.isnan(), off.isnan()) and torch.equal(on.nan_to_num(), off.nan_to_num())


@needs_ext
@pytest.mark.parametrize("D", [40, 128])
@pytest.mark.parametrize("page", [None, 7], ids=["contiguous", "page7"])
def test_vnni_scores_give_the_same_bits(D, page):
    """Note [Decode int8 scores]: vpdpwssd sums the same int16 x int16 pairs into int32 lanes as vpmaddwd +
    vpaddd, exactly either way, so the two give the same outputs and lse bit for bit (GQA, L = 3, a tail of
    the head for D = 40, one page or pages of 7, across a tile's page boundary). At D = 128 the integer P @ V
    (csrc Note [Decode int8 P @ V]) runs too, on either instruction. Skips, with a reason, where the CPU or the
    build has no VNNI path to compare."""
    if not dk.vnni():
        pytest.skip("this CPU lacks avx512_vnni (or the decode build is not AVX-512): one path only")
    gen = torch.Generator().manual_seed(D)
    kq = QuantizedKV.quantize(torch.randn(2, 90, 2, D, generator=gen))
    vq = QuantizedKV.quantize(torch.randn(2, 90, 2, D, generator=gen))
    _vnni_same_bits(kq, vq, page, gen)


@needs_ext
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("page", [None, 7], ids=["contiguous", "page7"])
def test_vnni_group_scores_give_the_same_bits(D, page):
    """The group-scaled format (csrc Note [Decode int8 groups]) sums each group's int16 pairs into int32 lanes on
    vpdpwssd or on vpmaddwd + vpaddd: exact either way, so the same outputs and lse bit for bit. Skips, with a
    reason, where the CPU or the build has no VNNI path to compare."""
    if not dk.vnni():
        pytest.skip("this CPU lacks avx512_vnni (or the decode build is not AVX-512): one path only")
    gen = torch.Generator().manual_seed(D + 1)
    kq = QuantizedKV.quantize(torch.randn(2, 90, 2, D, generator=gen), rotate=True, group_size=32)
    vq = QuantizedKV.quantize(torch.randn(2, 90, 2, D, generator=gen), group_size=32)
    _vnni_same_bits(kq, vq, page, gen)


@needs_ext
@pytest.mark.parametrize("rotate", [False, True], ids=["plain", "rotated"])
@pytest.mark.parametrize("page", [None, 16, 5], ids=["contiguous", "page16", "page5"])
@pytest.mark.parametrize("H,Hkv,D", [(6, 2, 64), (4, 1, 96)], ids=["gqa", "mqa"])
def test_group_scaled_cache_dequantises_like_the_fp32_cache(rotate, page, H, Hkv, D):
    """Note [int8 KV groups] (csrc Note [Decode int8 groups]): a decode step through a cache with one scale per
    32 channels (keys rotated or not; per-sequence lengths, paged or not) matches the kernel on the dequantised
    cache in fp32 within the budget of test_kernel_dequantises_like_the_fp32_cache (a group's scale moves one
    multiplication as a row's does), plus twice the integer P @ V's rounding (csrc Note [Decode int8 P @ V],
    ``helpers.int_pv_error``: the fp32-cache call takes the fp32 P @ V)."""
    gen = torch.Generator().manual_seed(H * D + (page or 0))
    B, S = 3, 150
    k0, v0 = torch.randn(B, S, Hkv, D, generator=gen), torch.randn(B, S, Hkv, D, generator=gen)
    k0[..., :32] *= 10  # one group far above the others
    kq, vq = QuantizedKV.quantize(k0, group_size=32, rotate=rotate), QuantizedKV.quantize(v0, group_size=32)
    assert kq.scale.shape == (B, S, Hkv, D // 32) and kq.group_size == 32
    gen1 = lambda: torch.Generator().manual_seed(1)  # noqa: E731
    table = None
    if page is not None:
        kd, table = _paged(kq.data, page, gen1())
        ks, _ = _paged(kq.scale, page, gen1())
        vd, _ = _paged(vq.data, page, gen1())
        vs, _ = _paged(vq.scale, page, gen1())
        kq, vq = QuantizedKV(kd, ks, rotation=kq.rotation), QuantizedKV(vd, vs)
    lens = torch.tensor([0, 77, S - 1])
    q = torch.randn(B, 1, H, D, generator=gen)
    kn, vn = torch.randn(B, 1, Hkv, D, generator=gen), torch.randn(B, 1, Hkv, D, generator=gen)
    out = attnlab.attention_with_kvcache(q, kq, vq, kn, vn, cache_seqlens=lens, block_table=table, num_splits=2)
    kf, vf = kq.dequantize(), vq.dequantize()
    if table is None:
        pv = int_pv_error(q, kf, vq.scale, lens + 1)
    else:  # the pool's rows in sequence order
        j = torch.arange(S)
        seq = lambda x: x[table.long()[:, j // page], j % page]  # noqa: E731
        pv = int_pv_error(q, seq(kf), seq(vq.scale), lens + 1)
    want = attnlab.attention_with_kvcache(q, kf, vf, cache_seqlens=lens + 1, block_table=table, num_splits=2)
    qr = q if kq.rotation is None else q @ kq.rotation.T
    kr = kf if kq.rotation is None else kf @ kq.rotation.T
    eps = torch.finfo(torch.float32).eps
    ds = 2 * eps * float(q.norm(dim=-1).max() * kf.norm(dim=-1).max()) * D ** -0.5 + _q16_score_error(qr, kr)
    tol = 2 * (2 * ds + 2 * eps) * float(vf.abs().max()) + 2 * pv
    assert max_err(out, want) <= tol, (max_err(out, want), tol)


def test_bad_group_scales_raise():
    data = torch.zeros(2, 10, 2, 64, dtype=torch.int8)
    with pytest.raises(attnlab.AttentionInputError, match=r"scale \[2, 10, 2, 3\] has 3 groups per row.*D=64"):
        QuantizedKV(data, torch.zeros(2, 10, 2, 3))
    with pytest.raises(attnlab.AttentionInputError, match=r"scale \[2, 10, 2, 4\] has 4 groups.*multiple of 32"):
        QuantizedKV(data, torch.zeros(2, 10, 2, 4))
    with pytest.raises(ValueError, match="group_size must divide the head dim D=64"):
        QuantizedKV.quantize(torch.randn(2, 10, 2, 64), group_size=48)


# -- the group-scaled format, fuzzed against float64 ---------------------------------------------------
@needs_ext
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_group_scaled_cache_fuzzed_against_float64(data):
    """Note [int8 KV groups]: random batches, head layouts, head dims, group sizes, per-sequence lengths, appends,
    query counts, rotated or plain keys and page sizes, through ``attention_with_kvcache`` on a group-scaled int8
    cache. The oracle is float64 attention on what the cache holds after the call (its rows dequantised in
    float64, bottom-right causal over each sequence's keys). The budget is the kernel's own arithmetic: fp32
    rounding of the scores and the sum (a few eps of |q||k| D^-1/2 and of max|v|) plus the int16 query's
    rounding (csrc Note [Decode int8 scores], ``_q16_score_error``); a score error ds moves an output by at most
    2 ds max|v|; plus twice the integer P @ V's rounding (csrc Note [Decode int8 P @ V], ``helpers.int_pv_error``)."""
    B = data.draw(st.integers(1, 3), label="B")
    Hkv = data.draw(st.integers(1, 2), label="Hkv")
    H = Hkv * data.draw(st.integers(1, 3), label="group")
    D = data.draw(st.sampled_from([32, 64, 96, 128]), label="D")
    gs = data.draw(st.sampled_from([g for g in (32, 64, 96, 128) if D % g == 0]), label="group_size")
    S = data.draw(st.integers(2, 90), label="capacity")
    Lnew = data.draw(st.integers(0, 2), label="Lnew")
    L = data.draw(st.integers(1, 2), label="L")
    rotate = data.draw(st.booleans(), label="rotate")
    page = data.draw(st.sampled_from([None, 5, 16]), label="page")
    lens = torch.tensor([data.draw(st.integers(max(0, L - Lnew), S - Lnew), label=f"len{b}") for b in range(B)])
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    k0, v0 = torch.randn(B, S, Hkv, D, generator=gen), torch.randn(B, S, Hkv, D, generator=gen)
    k0[..., :32] *= data.draw(st.sampled_from([1.0, 20.0]), label="outlier")  # a group far above the others
    kq = QuantizedKV.quantize(k0, group_size=gs, rotate=rotate)
    vq = QuantizedKV.quantize(v0, group_size=gs)
    kq, vq, table = _paged_caches(kq, vq, page)
    q = torch.randn(B, L, H, D, generator=gen)
    kn, vn = (torch.randn(B, Lnew, Hkv, D, generator=gen) for _ in range(2)) if Lnew else (None, None)
    with torch.no_grad():
        out = attnlab.attention_with_kvcache(q, kq, vq, kn, vn, cache_seqlens=lens, block_table=table)
    n = lens + Lnew
    kf, vf = kq.dequantize(torch.float64), vq.dequantize(torch.float64)  # what the cache holds now
    if table is not None:  # the pool's rows back in sequence order
        j = torch.arange(int(n.max()))
        kf, vf = kf[table.long()[:, j // page], j % page], vf[table.long()[:, j // page], j % page]
        vs = vq.scale[table.long()[:, j // page], j % page]
    else:
        vs = vq.scale
    kh, vh = kf[:, : int(n.max())].transpose(1, 2), vf[:, : int(n.max())].transpose(1, 2)
    j = torch.arange(kh.shape[2]).view(1, 1, -1)
    pos = torch.arange(L).view(1, L, 1) + (n - L).view(B, 1, 1)
    keep = ((j < n.view(B, 1, 1)) & (j <= pos)).unsqueeze(1)  # (B, 1, L, S): bottom-right causal
    ref = torch.as_tensor(reference.attention(q.double().transpose(1, 2), kh, vh, attn_mask=keep,
                                              enable_gqa=True)[0])
    eps = torch.finfo(torch.float32).eps
    qr = q if kq.rotation is None else q @ kq.rotation.T
    kr = kh.float() if kq.rotation is None else kh.float() @ kq.rotation.T
    ds = 4 * eps * float(q.norm(dim=-1).max() * kh.norm(dim=-1).max()) * D ** -0.5 + _q16_score_error(qr, kr)
    pv = int_pv_error(q, kh.transpose(1, 2), vs[:, : kh.shape[2]], n)
    tol = 2 * (2 * ds + 4 * eps) * float(vh.abs().max()) + 2 * pv
    err = float((out.transpose(1, 2).double() - ref).abs().max())
    assert err <= tol, (err, tol)


# -- the scores on key columns (csrc Note [Decode int8 key columns]) ---------------------------------------
@needs_ext
@pytest.mark.parametrize("gs", [0, 32, 64], ids=["per_row", "g32", "g64"])
@pytest.mark.parametrize("page", [None, 7], ids=["contiguous", "page7"])
@pytest.mark.parametrize("H,Hkv,L,D,S", [(6, 2, 1, 64, 53), (8, 2, 1, 128, 150), (4, 2, 1, 128, 37),
                                         (8, 1, 2, 192, 90), (16, 2, 1, 64, 33)],
                         ids=["gqa3_d64", "gqa4_d128", "gqa2_d128", "mqa8_l2_d192", "gqa8_d64"])
def test_key_column_scores_against_float64(gs, page, H, Hkv, L, D, S):
    """csrc Note [Decode int8 key columns]: the AVX-512 build's scores with 16 keys in the lanes (per-row or group
    scales; 2 to 16 rows a kv head, partial key blocks, pages of 7 across a block, D 64 to 192) against float64
    attention on what the cache holds, within the kernel's own budget (fp32 rounding of the scores and the sum,
    the int16 query's rounding, twice the integer P @ V's); and the same call on the lane kernels (set_int_cols
    off) within that budget of it. The columns take G L >= 3 rows with per-row scales and >= 2 with groups, so
    gqa2_d128 per_row runs the lane kernels in both calls (a mutation of the columns fails every other case);
    skips, with a reason, where the build has no columns (``int_cols()`` False)."""
    if not dk.int_cols():
        pytest.skip("the decode build is not AVX-512 (or set_int_cols is off): no key-column scores to check")
    gen = torch.Generator().manual_seed(H * D + S + gs + (page or 0))
    B = 2
    k0, v0 = torch.randn(B, S, Hkv, D, generator=gen), torch.randn(B, S, Hkv, D, generator=gen)
    k0[..., :32] *= 8  # one group far above the others
    kq = QuantizedKV.quantize(k0, group_size=gs or None)
    vq = QuantizedKV.quantize(v0, group_size=gs or None)
    kq, vq, table = _paged_caches(kq, vq, page)
    lens = torch.tensor([S, S - 20])
    q = torch.randn(B, L, H, D, generator=gen)
    run = lambda: attnlab.attention_with_kvcache(q, kq, vq, cache_seqlens=lens, block_table=table,  # noqa: E731
                                                 num_splits=2)
    with torch.no_grad():
        cols = run()
        pv = dk.int_pv()
        dk.set_int_cols(False)
        try:
            lanes = run()
            dk.set_int_pv(False)  # both paths on the fp32 P @ V: they may differ only by the scores' fp32 order
            lanes_f = run()
            dk.set_int_cols(True)
            cols_f = run()
        finally:
            dk.set_int_cols(True)
            dk.set_int_pv(pv)
    kf, vf = kq.dequantize(torch.float64), vq.dequantize(torch.float64)
    vs = vq.scale
    if table is not None:  # the pool's rows back in sequence order
        j = torch.arange(S)
        kf, vf, vs = (x[table.long()[:, j // page], j % page] for x in (kf, vf, vs))
    kh, vh = kf.transpose(1, 2), vf.transpose(1, 2)
    jj = torch.arange(S).view(1, 1, -1)
    keep = ((jj < lens.view(B, 1, 1)) & (jj <= torch.arange(L).view(1, L, 1) + (lens - L).view(B, 1, 1))).unsqueeze(1)
    ref = torch.as_tensor(reference.attention(q.double().transpose(1, 2), kh, vh, attn_mask=keep,
                                              enable_gqa=True)[0]).transpose(1, 2)
    eps = torch.finfo(torch.float32).eps
    ds = 4 * eps * float(q.norm(dim=-1).max() * kh.norm(dim=-1).max()) * D ** -0.5 + _q16_score_error(q, kh.float())
    tol = 2 * (2 * ds + 4 * eps) * float(vh.abs().max()) + 2 * int_pv_error(q, kf, vs, lens)
    for name, out in (("columns", cols), ("lanes", lanes)):
        err = float((out.double() - ref).abs().max())
        assert err <= tol, (name, err, tol)
    assert float((cols - lanes).abs().max()) <= tol
    # the same integer sums on both: a score moves only by the fp32 order of its group terms (a few eps of
    # sum |term|, bounded by |q| |k| D^-1/2), not by the int16 query's rounding, which both share
    ds_order = 4 * eps * float(q.norm(dim=-1).max() * kh.norm(dim=-1).max()) * D ** -0.5
    tight = 2 * (2 * ds_order + 4 * eps) * float(vh.abs().max())
    assert float((cols_f - lanes_f).abs().max()) <= tight, (float((cols_f - lanes_f).abs().max()), tight)


@needs_ext
@pytest.mark.parametrize("D,gs", [(1024, 512), (1088, 544)], ids=["g512", "g544"])
def test_key_column_scores_hold_large_groups_exactly(D, gs):
    """csrc Note [Decode int8 key columns]: a lane's int32 sum holds a group's products, |q16| <= 32767 and
    |k8| <= 127 each; at the worst case (every q16 = 32767, every k8 = 127: a constant query, keys that are
    multiples of ones) 512 channels stay under 2^31 and 544 would not, so the columns take groups up to 512 and
    larger ones run on the lane kernels (on a build without the columns both run there). Both match float64
    attention on the dequantised cache within the kernel's budget (the keys' scores, 1.9 apart, and so the
    softmax, would be off by 2^32 times a key's scale after an overflow: 0.55 on the outputs here, measured
    before the bound)."""
    S, H, Hkv = 40, 4, 2
    gen = torch.Generator().manual_seed(gs)
    k0 = torch.linspace(0.2, 2.0, S).view(1, S, 1, 1) * torch.ones(1, S, Hkv, D)
    v0 = torch.randn(1, S, Hkv, D, generator=gen)
    kq, vq = QuantizedKV.quantize(k0, group_size=gs), QuantizedKV.quantize(v0, group_size=gs)
    assert int(kq.data.max()) == 127 and kq.scale.shape[-1] == 2
    q = torch.full((1, 1, H, D), 0.03)
    with torch.no_grad():
        out = attnlab.attention_with_kvcache(q, kq, vq, cache_seqlens=S)
    kf, vf = kq.dequantize(torch.float64), vq.dequantize(torch.float64)
    ref = torch.as_tensor(reference.attention(q.double().transpose(1, 2), kf.transpose(1, 2), vf.transpose(1, 2),
                                              enable_gqa=True)[0]).transpose(1, 2)
    s = float(q.norm() * kf.norm(dim=-1).max()) * D ** -0.5
    eps = torch.finfo(torch.float32).eps
    tol = 2 * (2 * (4 * eps * s + _q16_score_error(q, kf.float())) + 4 * eps) * float(vf.abs().max()) \
        + 2 * int_pv_error(q, kf, vq.scale, S)
    err = float((out.double() - ref).abs().max())
    assert err <= tol, (err, tol)
