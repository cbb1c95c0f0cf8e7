"""A query row with no key to attend returns 0, never NaN, in every method and at every query length: the decode
kernel's short query blocks (L = 2..16) once returned NaN for such a row whenever every other row of its tile
weighed every key (csrc/decode.cpp: the rows' shared P @ V pass read the dead row's unexponentiated -inf scores).

The oracle is the float64 reference (``attnlab.reference``: a row with no key is 0); live rows are held to the
fused-kernel budget of tests/helpers.py (FUSED_ERROR_FACTOR times the naive same-dtype error, plus a floor), dead
rows must be exactly 0. The decode kernel is also driven directly with paged and int8 caches.
"""
from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab import patterns as P
from attnlab import reference
from attnlab.functional import METHODS
from attnlab.functional.kvcache import QuantizedKV
from attnlab.kernels import decode as dk
from helpers import FUSED_ERROR_FACTOR, max_err

pytestmark = [pytest.mark.usefixtures("one_thread")]
needs_decode = pytest.mark.skipif(not dk.available(), reason=f"decode extension: {dk.unavailable_reason()}")

EXACT = [m for m in ("dense", "sdpa", "tiled", "sparse", "compiled", "auto") if m in METHODS]
FLOOR = {torch.float32: 1e-6, torch.bfloat16: 4e-3}


def _masks(kind: str, L: int, S: int, g: torch.Generator):
    """(attn_mask, pattern, dead rows [L] bool) for a mask kind; every kind kills rows 0 and L // 2 and keeps
    every key for the other rows but where the kind itself removes some."""
    dead = torch.zeros(L, dtype=torch.bool)
    dead[0] = True
    dead[L // 2] = True
    keep = ~dead.view(L, 1).expand(L, S).clone()
    if kind == "bool":
        return keep, None, dead
    if kind == "float":
        return torch.zeros(L, S).masked_fill(~keep, float("-inf")), None, dead
    if kind == "random":  # a random mask too (rows mixing masked and live keys) besides the dead rows
        return keep & (torch.rand(L, S, generator=g) < 0.8), None, dead
    if kind == "dead_columns":  # keys no row sees, and the dead rows
        cols = torch.rand(S, generator=g) < 0.3
        return keep & ~cols, None, dead
    if kind == "pattern":  # a band pattern AND the dead rows' mask
        return keep, P.sliding_window(S // 2, causal=True), dead
    raise ValueError(kind)


def _reference(q, k, v, mask, pattern, gqa):
    m = mask
    if pattern is not None:
        pm = pattern.materialize(q.shape[-2], k.shape[-2])
        m = pm if m is None else (m & pm if m.dtype == torch.bool else m.masked_fill(~pm, float("-inf")))
    out, _ = reference.attention(q.double(), k.double(), v.double(), None if m is None else
                                 (m if m.dtype == torch.bool else m.double()), False, None, gqa)
    return torch.from_numpy(out)


def _naive(q, k, v, mask, pattern, gqa):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    m = mask
    if pattern is not None:
        pm = pattern.materialize(q.shape[-2], k.shape[-2])
        m = pm if m is None else (m & pm if m.dtype == torch.bool else m.masked_fill(~pm, float("-inf")))
    s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.to(s.dtype)
    return torch.softmax(s.float(), -1).nan_to_num(0.0).to(q.dtype) @ v


@pytest.mark.parametrize("method", EXACT)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", [(2, 2), (4, 1)], ids=["mha", "gqa"])
@pytest.mark.parametrize("kind", ["bool", "float", "random", "dead_columns", "pattern"])
def test_dead_rows_are_zero_at_every_query_length(method, dtype, heads, kind):
    H, Hkv = heads
    S = 200
    for L in (1, 2, 3, 5, 8, 15, 16, 17, 24, 33):
        g = torch.Generator().manual_seed(L * 7 + H)
        q = torch.randn(1, H, L, 64, generator=g).to(dtype)
        k, v = (torch.randn(1, Hkv, S, 64, generator=g).to(dtype) for _ in range(2))
        mask, pattern, dead = _masks(kind, L, S, g)
        if method == "sparse" and pattern is None:
            pattern = P.sliding_window(S, causal=False)  # sparse needs a pattern to skip work with
        with torch.no_grad():
            out = attnlab.attention(q, k, v, attn_mask=mask, pattern=pattern, method=method,
                                    enable_gqa=H != Hkv)
        assert not bool(out.isnan().any()), f"{method} L={L}: NaN"
        assert bool((out[:, :, dead] == 0).all()), f"{method} L={L}: a dead row is not 0"
        ref = _reference(q, k, v, mask, pattern, H != Hkv)
        budget = FUSED_ERROR_FACTOR * max_err(_naive(q, k, v, mask, pattern, H != Hkv), ref) + FLOOR[dtype]
        assert max_err(out, ref) <= budget, (method, L, max_err(out, ref), budget)


def _paged(x: torch.Tensor, page: int, gen: torch.Generator):
    """x [B, S, Hkv, D] -> (pool [P, page, Hkv, D], block_table) with the same rows, pages shuffled."""
    B, S = x.shape[:2]
    pages = -(-S // page)
    pool = torch.zeros(B * pages + 2, page, *x.shape[2:], dtype=x.dtype)
    table = torch.randperm(B * pages + 2, generator=gen)[: B * pages].view(B, pages).to(torch.int32)
    j = torch.arange(S)
    pool[table.long()[:, j // page], j % page] = x
    return pool, table


@needs_decode
@pytest.mark.parametrize("cache", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("page", [None, 16], ids=["contiguous", "paged16"])
@pytest.mark.parametrize("heads", [(2, 2), (6, 2)], ids=["mha", "gqa"])
def test_decode_kernel_dead_rows_with_paged_and_int8_caches(cache, page, heads):
    """decode_attention with a keep mask that kills whole rows: the dead rows' out 0 and lse -inf, the live rows
    as the float64 reference on the dequantised cache, L = 1..16, one split and several."""
    H, Hkv = heads
    B, S, D = 2, 300, 32
    for L in range(1, dk.MAX_QUERIES + 1):
        g = torch.Generator().manual_seed(L)
        k0, v0 = torch.randn(B, S, Hkv, D, generator=g), torch.randn(B, S, Hkv, D, generator=g)
        scales = {}
        if cache == "int8":
            kq, vq = QuantizedKV.quantize(k0), QuantizedKV.quantize(v0)
            k, v, kf, vf = kq.data, vq.data, kq.dequantize(), vq.dequantize()
            scales = dict(k_scale=kq.scale, v_scale=vq.scale)
        else:
            dt = torch.float32 if cache == "fp32" else torch.bfloat16
            k, v = k0.to(dt), v0.to(dt)
            kf, vf = k.float(), v.float()
        table = None
        if page is not None:
            k, table = _paged(k, page, torch.Generator().manual_seed(5))
            v, _ = _paged(v, page, torch.Generator().manual_seed(5))
            if scales:
                scales = {n: _paged(s.unsqueeze(-1), page, torch.Generator().manual_seed(5))[0][..., 0].contiguous()
                          for n, s in scales.items()}
        q = torch.randn(B, H, L, D, generator=g).to(torch.bfloat16 if cache == "bf16" else torch.float32)
        keep = torch.ones(B, H, L, S, dtype=torch.bool)
        keep[:, :, 0] = False
        keep[1, :, L // 2] = False
        for splits in (1, 3):
            out, lse = dk.decode_attention(q, k, v, scale=D ** -0.5, keep=keep, block_table=table, mask_offset=0, seqlens=S,
                                           splits=splits, **scales)
            dead = ~keep.any(-1)
            assert not bool(out.isnan().any()), (cache, L, splits)
            assert bool((out[dead] == 0).all()) and bool(torch.isneginf(lse[dead]).all()), (cache, L, splits)
            ref, _ = reference.attention(q.double(), kf.transpose(1, 2).double(), vf.transpose(1, 2).double(),
                                         keep, False, D ** -0.5, H != Hkv)
            # + a bf16 output's own rounding (half an ulp of its largest value)
            budget = _score_rounding_budget(q, kf, vf, cache) + 1e-5 + (
                float(out.abs().max()) * 2.0 ** -8 if out.dtype == torch.bfloat16 else 0.0)
            assert max_err(out, torch.from_numpy(ref)) <= budget, (cache, L, splits, max_err(out, torch.from_numpy(ref)))


def _score_rounding_budget(q, kf, vf, cache: str) -> float:
    """How far the kernel's own rounding of q moves an output: a bf16 cache's scores may take q rounded to bf16
    (VDPBF16PS: each element within 2^-9 relative), an int8 cache's take q on an int16 grid per row (within half
    a step, max|q_row| / 32767 / 2: csrc Note [Decode int8 scores]). A score then moves by at most
    delta = sum_i |dq_i| |k_i| · scale, a probability by a factor within e^(±2 delta), an output by
    (e^(2 delta) - 1) max|v|. fp32 caches: 0 (their rounding is the 1e-5 floor's)."""
    if cache == "fp32":
        return 0.0
    if cache == "bf16":
        dq = q.abs() * 2.0 ** -9
    else:
        dq = q.abs().amax(-1, keepdim=True).expand_as(q) / 32767 / 2
    scale = q.shape[-1] ** -0.5
    delta = float((dq.double().abs() @ kf.double().abs().amax((0, 1, 2)).view(-1, 1)).max()) * scale
    return (torch.tensor(2 * delta).exp().item() - 1) * float(vf.abs().max())
