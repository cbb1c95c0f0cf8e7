"""The decode kernel's run-time options (kernels/decode.py): a bf16 cache's scores on VDPBF16PS or widened
to fp32 (csrc Note [Decode bf16 scores]) and the software prefetch level (Note [Decode prefetch]).

Both score paths run here on a CPU with avx512_bf16 (the VDPBF16PS one is skipped, with the reason, on a CPU
without it), each against the float64 reference with the budget of tests/functional/test_kvcache.py: at most
FUSED_ERROR_FACTOR times the naive bf16 computation's error, plus a few bf16 ulps. Head dims that are not a
multiple of 32 take the masked last chunk; key counts that are not a multiple of the tile take the padded rows.
The prefetch level changes timing only: the three modes give the same bits.
"""
from __future__ import annotations

import pytest
import torch

from attnlab import reference
from attnlab.kernels import decode as dk
from helpers import FUSED_ERROR_FACTOR, max_err

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not dk.available(), reason=f"decode extension: {dk.unavailable_reason()}")]


@pytest.fixture(params=[True, False], ids=["vdpbf16ps", "widened"])
def bf16_scores(request):
    """Runs the test with the VDPBF16PS scores on, then off; restores the process's setting."""
    before = dk.bf16_dot()
    dk.set_bf16_dot(request.param)
    try:
        if request.param and not dk.bf16_dot():
            pytest.skip("this CPU lacks avx512_bf16 (or the decode build is not AVX-512): no VDPBF16PS path")
        assert dk.bf16_dot() == request.param
        yield request.param
    finally:
        dk.set_bf16_dot(before)


@pytest.fixture
def restore_prefetch():
    before = dk.prefetch_mode()
    yield
    dk.set_prefetch_mode(before)


def _paged(xs, page: int, gen):
    """tensors [B, S, Hkv, ...] -> (their page pools [P, page, Hkv, ...], one shuffled block_table [B, pages])."""
    B, S = xs[0].shape[:2]
    pages = -(-S // page)
    table = torch.randperm(B * pages, generator=gen).view(B, pages).to(torch.int32)
    pools = []
    for x in xs:
        pool = torch.zeros(B * pages, page, *x.shape[2:], dtype=x.dtype)
        for b in range(B):
            for t in range(S):
                pool[table[b, t // page], t % page] = x[b, t]
        pools.append(pool)
    return pools, table


@pytest.mark.parametrize("D", [16, 40, 64, 72, 128])
@pytest.mark.parametrize("S,L,page", [(37, 1, None), (300, 3, None), (101, 2, 7)],
                         ids=["S37", "S300-L3", "S101-page7"])
def test_bf16_scores_against_float64(bf16_scores, D, S, L, page):
    """GQA 8/2 with per-sequence lengths and bottom-right causal: either score path is within the naive bf16
    computation's error of float64."""
    gen = torch.Generator().manual_seed(D * 1000 + S)
    B, H, Hkv = 2, 8, 2
    q = torch.randn(B, H, L, D, generator=gen).bfloat16()
    k = torch.randn(B, S, Hkv, D, generator=gen).bfloat16()
    v = torch.randn(B, S, Hkv, D, generator=gen).bfloat16()
    lens = torch.tensor([S, S - 5])
    kc, vc, table = k, v, None
    if page is not None:
        (kc, vc), table = _paged((k, v), page, gen)
    scale = D ** -0.5
    out, lse = dk.decode_attention(q, kc, vc, scale=scale, block_table=table, seqlens=lens, right=0)
    j = torch.arange(S).view(1, 1, 1, S)
    pos = torch.arange(L).view(1, 1, L, 1) + (lens - L).view(B, 1, 1, 1)
    keep = (j <= pos) & (j < lens.view(B, 1, 1, 1))
    mask = torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, float("-inf"))
    kh, vh = k.transpose(1, 2), v.transpose(1, 2)
    ref = torch.from_numpy(reference.attention(q, kh, vh, attn_mask=mask, enable_gqa=True, scale=scale)[0])
    g = H // Hkv
    s = (q @ kh.repeat_interleave(g, 1).transpose(-1, -2)) * scale  # the naive computation, in bf16
    w = torch.softmax(s.float().masked_fill(~keep, float("-inf")), -1).to(torch.bfloat16)
    naive = w @ vh.repeat_interleave(g, 1)
    eps = torch.finfo(torch.bfloat16).eps
    budget = FUSED_ERROR_FACTOR * max_err(naive, ref) + 4 * eps * max(1.0, float(ref.abs().max()))
    assert max_err(out, ref) <= budget, (bf16_scores, D, S, L, page, max_err(out, ref), budget)
    # the log-sum-exp from float64 scores: the scores' rounding (bf16 inputs, fp32 sums) is all that differs
    s64 = (q.double() @ kh.double().repeat_interleave(g, 1).transpose(-1, -2)) * scale
    ref_lse = torch.logsumexp(s64.masked_fill(~keep, float("-inf")), -1)
    assert max_err(lse, ref_lse) <= 64 * torch.finfo(torch.float32).eps * max(1.0, float(s64.abs().max()))


def test_bf16_scores_paths_agree_on_exact_products():
    """Keys and queries of small integers: every product and partial sum is exact in fp32 on both paths, so
    the two give the same bits (the instruction is the dot product, not an approximation of it)."""
    if not dk.bf16_dot():
        pytest.skip("this CPU lacks avx512_bf16: one path only")
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(-3, 4, (1, 8, 1, 96), generator=gen).bfloat16()
    k = torch.randint(-3, 4, (1, 200, 2, 96), generator=gen).bfloat16()
    v = torch.randn(1, 200, 2, 96, generator=gen).bfloat16()
    try:
        a = dk.decode_attention(q, k, v, scale=1.0 / 16)  # a power of two: the moved scale rounds nothing
        dk.set_bf16_dot(False)
        b = dk.decode_attention(q, k, v, scale=1.0 / 16)
    finally:
        dk.set_bf16_dot(True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "int8"])
def test_prefetch_level_changes_no_bit(restore_prefetch, dtype):
    """Off, into L1, into L2: the same outputs and lse, bit for bit (contiguous and paged, GQA, L = 2)."""
    from attnlab.functional.kvcache import QuantizedKV

    gen = torch.Generator().manual_seed(11)
    B, H, Hkv, S, D = 2, 8, 2, 333, 64
    fdt = torch.float32 if dtype == "int8" else dtype
    q = torch.randn(B, H, 2, D, generator=gen).to(fdt)
    k = torch.randn(B, S, Hkv, D, generator=gen).to(fdt)
    v = torch.randn(B, S, Hkv, D, generator=gen).to(fdt)
    kw = {}
    if dtype == "int8":
        kq, vq = QuantizedKV.quantize(k), QuantizedKV.quantize(v)
        k, v, kw = kq.data, vq.data, dict(k_scale=kq.scale, v_scale=vq.scale)
    (kp, vp, *scales), table = _paged((k, v, *kw.values()), 16, gen)
    layouts = [(k, v, None, kw), (kp, vp, table, dict(zip(kw, scales)))]
    for kk, vv, tab, extra in layouts:
        got = []
        for mode in (0, 1, 2):
            dk.set_prefetch_mode(mode)
            assert dk.prefetch_mode() == mode
            got.append(dk.decode_attention(q, kk, vv, scale=D ** -0.5, block_table=tab,
                                           seqlens=torch.tensor([S, 200]), **extra))
        for o, lse in got[1:]:
            assert torch.equal(o, got[0][0]) and torch.equal(lse, got[0][1])
    # and the paged pool gives what the contiguous cache gives (the same schedule, the same bits)
    assert torch.equal(got[0][0], dk.decode_attention(q, k, v, scale=D ** -0.5, seqlens=torch.tensor([S, 200]),
                                                      **kw)[0])


def test_prefetch_mode_rejects_other_values(restore_prefetch):
    with pytest.raises(ValueError, match="prefetch mode must be 0"):
        dk.set_prefetch_mode(3)
