"""Rotary embedding inside attention_with_kvcache (flash-attn's rotary_cos / rotary_sin / rotary_interleaved):
q and the new k rotated at positions cache_seqlens + i, against rotating by hand (attnlab's RotaryEmbedding
for the half-split pairing, complex multiplication for the interleaved one) then SDPA and the float64
reference."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attnlab
from attnlab import reference
from attnlab.functional.kvcache import Rotary
from attnlab.positional.rotary import RotaryEmbedding
from helpers import FUSED_ERROR_FACTOR, max_err

pytestmark = [pytest.mark.usefixtures("one_thread")]


def _tables(rd: int, n: int):
    """cos, sin [n, rd/2] of RoPE at positions 0..n-1 (attnlab's RotaryEmbedding angles)."""
    rope = RotaryEmbedding(rd)
    cos, sin = rope.cos_sin(torch.arange(n), torch.float32)  # (n, rd), halves duplicated
    return cos[:, : rd // 2].contiguous(), sin[:, : rd // 2].contiguous()


def _by_hand(x: torch.Tensor, pos: torch.Tensor, rd: int, interleaved: bool) -> torch.Tensor:
    """x [B, n, h, D] at positions pos [B, n], first rd features rotated, in float64."""
    x = x.double()
    B, n = pos.shape
    out = x.clone()
    if interleaved:  # pairs (2i, 2i+1) as complex numbers times exp(i·p·θ_i)
        theta = 10000.0 ** (-torch.arange(0, rd, 2, dtype=torch.float64) / rd)  # (rd/2,)
        rot = torch.polar(torch.ones(B, n, 1, rd // 2, dtype=torch.float64), pos.double()[..., None, None] * theta)
        z = torch.view_as_complex(x[..., :rd].reshape(*x.shape[:3], rd // 2, 2).contiguous()) * rot
        out[..., :rd] = torch.view_as_real(z).flatten(-2)
    else:
        rope = RotaryEmbedding(x.shape[-1], rotary_dim=rd)
        for b in range(B):
            out[b] = rope.rotate(x[b].transpose(0, 1), pos[b]).transpose(0, 1)  # (n, h, D)
    return out


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("rd,L,causal", [(16, 1, True), (8, 3, True), (16, 2, False)],
                         ids=["full_decode", "partial_L3", "noncausal_L2"])
def test_rotary_matches_rotating_by_hand(interleaved, rd, L, causal):
    """The appended keys are the rotated new k; the output equals SDPA (and float64) on q rotated by hand
    at cache_seqlens + i (causal) or cache_seqlens for every query (not causal: flash-attn's rule)."""
    gen = torch.Generator().manual_seed(rd + L)
    B, S, H, Hkv, D = 2, 60, 4, 2, 16
    kc, vc = torch.randn(B, S, Hkv, D, generator=gen), torch.randn(B, S, Hkv, D, generator=gen)
    kc0 = kc.clone()
    lens = torch.tensor([5, 40])
    q = torch.randn(B, L, H, D, generator=gen)
    kn, vn = torch.randn(B, L, Hkv, D, generator=gen), torch.randn(B, L, Hkv, D, generator=gen)
    cos, sin = _tables(rd, 64)
    out = attnlab.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, is_causal=causal,
                                         rotary=Rotary(cos, sin, interleaved))
    kpos = lens.view(B, 1) + torch.arange(L)
    qpos = kpos if causal else lens.view(B, 1).expand(B, L)
    kr, qr = _by_hand(kn, kpos, rd, interleaved), _by_hand(q, qpos, rd, interleaved)
    for b in range(B):
        got = kc[b, int(lens[b]): int(lens[b]) + L]
        assert max_err(got, kr[b]) < 1e-5
        assert torch.equal(kc[b, : int(lens[b])], kc0[b, : int(lens[b])])  # the prefix stays as it was
    for b in range(B):
        n = int(lens[b]) + L
        kh = kc[b: b + 1, :n].transpose(1, 2).double()  # (1, Hkv, n, D): the cache after the append
        vh = vc[b: b + 1, :n].transpose(1, 2).double()
        qh = qr[b: b + 1].transpose(1, 2)  # (1, H, L, D)
        keep = torch.ones(L, n, dtype=torch.bool)
        if causal:
            keep = torch.arange(n).view(1, n) <= torch.arange(L).view(L, 1) + n - L
        sd = F.scaled_dot_product_attention(qh.float(), kh.float(), vh.float(), attn_mask=keep, enable_gqa=True)
        ref, _ = reference.attention(qh, kh, vh, attn_mask=torch.zeros(L, n, dtype=torch.float64).masked_fill(
            ~keep, float("-inf")), enable_gqa=True)
        ref = torch.from_numpy(ref)
        got = out[b: b + 1].transpose(1, 2)
        assert max_err(got, ref) <= FUSED_ERROR_FACTOR * max(max_err(sd, ref), 1e-6), (b, max_err(got, ref))


def test_flash_attn_names_and_pairs_are_the_same_call():
    gen = torch.Generator().manual_seed(1)
    q, kn, vn = torch.randn(1, 1, 2, 8, generator=gen), torch.randn(1, 1, 2, 8, generator=gen), torch.randn(1, 1, 2, 8)
    cos, sin = _tables(8, 20)
    outs = []
    for kw in (dict(rotary=Rotary(cos, sin, True)), dict(rotary=(cos, sin), rotary_interleaved=True),
               dict(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=True)):
        kc, vc = torch.zeros(1, 20, 2, 8), torch.zeros(1, 20, 2, 8)
        outs.append((attnlab.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=7, **kw), kc))
    for o, kc in outs[1:]:
        assert torch.equal(o, outs[0][0]) and torch.equal(kc, outs[0][1])


def test_rotary_errors():
    q, kc, vc = torch.randn(1, 1, 2, 8), torch.zeros(1, 20, 2, 8), torch.zeros(1, 20, 2, 8)
    kn = torch.randn(1, 1, 2, 8)
    cos, sin = _tables(8, 10)
    with pytest.raises(attnlab.AttentionInputError, match="give k, v"):
        attnlab.attention_with_kvcache(q, kc, vc, cache_seqlens=3, rotary=(cos, sin))
    with pytest.raises(attnlab.AttentionInputError, match=r"covers positions < 10.*position 12"):
        attnlab.attention_with_kvcache(q, kc, vc, kn, kn, cache_seqlens=12, rotary=(cos, sin))
    with pytest.raises(attnlab.AttentionInputError, match="not both"):
        attnlab.attention_with_kvcache(q, kc, vc, kn, kn, cache_seqlens=1, rotary=(cos, sin), rotary_cos=cos,
                                       rotary_sin=sin)
    with pytest.raises(attnlab.AttentionInputError, match="give both"):
        attnlab.attention_with_kvcache(q, kc, vc, kn, kn, cache_seqlens=1, rotary_cos=cos)
    with pytest.raises(attnlab.AttentionInputError, match=r"rotary_dim = 2 x 6 must be in \(0, D=8\]"):
        c6 = torch.zeros(10, 6)
        attnlab.attention_with_kvcache(q, kc, vc, kn, kn, cache_seqlens=1, rotary=(c6, c6))
    with pytest.raises(attnlab.AttentionInputError, match="one shape"):
        attnlab.attention_with_kvcache(q, kc, vc, kn, kn, cache_seqlens=1, rotary=(cos, sin[:5]))
