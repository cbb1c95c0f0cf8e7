"""attnlab.positional against formulas written independently here and against transformers' own
implementations (BLOOM's ALiBi, T5's relative buckets); composition with mechanisms and patterns."""
from __future__ import annotations

import cmath
import math

import numpy as np
import pytest
import torch
from helpers import assert_close

from attnlab import patterns as P
from attnlab import positional as PE
from attnlab import reference
from attnlab.nn import MultiHeadAttention


def test_sinusoidal_matches_the_paper_formula():
    d, pos = 10, [0, 1, 7, 513, 100000]
    got = PE.sinusoidal_table(torch.tensor(pos), d, dtype=torch.float64)
    for r, p in enumerate(pos):
        for c in range(d):
            angle = p / 10000 ** ((c - c % 2) / d)
            assert got[r, c].item() == pytest.approx(math.sin(angle) if c % 2 == 0 else math.cos(angle), abs=1e-12)
    enc = PE.SinusoidalPositionalEncoding(d)
    x = torch.zeros(2, 3, d, dtype=torch.float64)
    assert_close(enc(x, offset=5), PE.sinusoidal_table(torch.arange(5, 8), d, dtype=torch.float64).expand(2, 3, d),
                 atol=0, what="offset")
    odd = PE.sinusoidal_table(torch.arange(4), 7)
    assert odd.shape == (4, 7)


def test_learned_offsets_and_limit():
    enc = PE.LearnedPositionalEmbedding(8, 4)
    x = torch.zeros(1, 3, 4)
    assert_close(enc(x, offset=5), enc.weight[5:8].unsqueeze(0), atol=0, what="learned offset")
    with pytest.raises(ValueError, match="max_len=8"):
        enc(x, offset=6)


def test_rope_matches_complex_rotation_and_is_relative():
    D = 8
    rope = PE.RotaryEmbedding(D)
    x = torch.randn(2, 3, 5, D, dtype=torch.float64)
    pos = torch.tensor([0, 3, 4, 17, 1000])
    got = rope.rotate(x, pos)
    # oracle: feature pairs (i, i + D/2) as one complex number, multiplied by e^{i p θ_i}
    xn = x.numpy()
    for t, p in enumerate(pos.tolist()):
        for i in range(D // 2):
            theta = 10000 ** (-2 * i / D)
            z = (xn[..., t, i] + 1j * xn[..., t, i + D // 2]) * cmath.exp(1j * p * theta)
            assert np.allclose(got[..., t, i].numpy(), z.real, atol=1e-12)
            assert np.allclose(got[..., t, i + D // 2].numpy(), z.imag, atol=1e-12)
    # scores depend only on the distance
    q, k = torch.randn(D, dtype=torch.float64), torch.randn(D, dtype=torch.float64)
    s1 = rope.rotate(q.view(1, D), torch.tensor([9])) @ rope.rotate(k.view(1, D), torch.tensor([4])).T
    s2 = rope.rotate(q.view(1, D), torch.tensor([105])) @ rope.rotate(k.view(1, D), torch.tensor([100])).T
    assert_close(s1, s2, atol=1e-10, what="relative")
    partial = PE.RotaryEmbedding(D, rotary_dim=4).rotate(x, pos)
    assert torch.equal(partial[..., 4:], x[..., 4:])
    with pytest.raises(ValueError, match="rotary_dim"):
        PE.RotaryEmbedding(8, rotary_dim=3)


@pytest.mark.parametrize("heads", [8, 12, 6])
def test_alibi_matches_bloom(heads):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    S = 9
    bloom = build_alibi_tensor(torch.ones(1, S), heads, torch.float32)  # (H, 1, S): slope_h * j
    slopes = bloom[:, 0, 1]
    assert_close(PE.alibi_slopes(heads), slopes, atol=1e-7, what="slopes")
    # BLOOM's bias slope*j differs from ours, -slope*(i - j), by a per-row constant: the softmax is equal
    b = PE.ALiBi(heads).bias(torch.arange(S), torch.arange(S))
    causal = torch.tril(torch.ones(S, S, dtype=torch.bool))
    ours = b.masked_fill(~causal, float("-inf")).softmax(-1)
    theirs = bloom.expand(heads, S, S).masked_fill(~causal, float("-inf")).softmax(-1)
    assert_close(ours, theirs, atol=1e-6, what="alibi softmax")


def test_t5_buckets_match_transformers():
    from transformers.models.t5.modeling_t5 import T5Attention

    rel = torch.arange(-300, 300).view(1, -1)
    for bidirectional in (True, False):
        for nb, md in ((32, 128), (8, 20)):
            ours = PE.t5_relative_bucket(rel, bidirectional, nb, md)
            theirs = T5Attention._relative_position_bucket(rel, bidirectional, nb, md)
            assert torch.equal(ours, theirs), (bidirectional, nb, md)
    t5 = PE.T5RelativeBias(4, bidirectional=True)
    b = t5.bias(torch.arange(3, 6), torch.arange(6))
    assert b.shape == (4, 3, 6)
    assert torch.equal(b[:, 0, 3], b[:, 1, 4])  # same relative distance, same bias


@pytest.mark.parametrize("method", ["dense", "tiled", "sparse", "auto"])
def test_alibi_and_t5_compose_with_patterns(method):
    """Bias + pattern through every exact method equals the float64 oracle with the bias added."""
    for pos in (PE.ALiBi(4), PE.T5RelativeBias(4)):
        m = MultiHeadAttention(16, 4, positional=pos, pattern=P.sliding_window(3), mechanism=method)
        x = torch.randn(2, 21, 16)
        with torch.no_grad():  # inference: the learned T5 bias runs through tiled/sparse too
            out, _ = m(x, is_causal=True)
            q = m.q_proj(x).view(2, 21, 4, 4).transpose(1, 2)
            k = m.k_proj(x).view(2, 21, 4, 4).transpose(1, 2)
            v = m.v_proj(x).view(2, 21, 4, 4).transpose(1, 2)
            bias = pos.bias(torch.arange(21), torch.arange(21)).double().numpy()
        keep = (P.sliding_window(3) & P.causal()).materialize(21, 21).numpy()
        o, _ = reference.attention(q, k, v, attn_mask=np.where(keep, bias, -np.inf))
        ref = m.out_proj(torch.from_numpy(o).float().transpose(1, 2).reshape(2, 21, 16))
        assert_close(out, ref, atol=2e-5, what=f"{type(pos).__name__} {method}")


def test_rope_composes_with_an_approximate_mechanism():
    from attnlab import mechanisms

    rope = PE.RotaryEmbedding(4)
    m = MultiHeadAttention(16, 4, positional=rope, mechanism="linear")
    x = torch.randn(2, 11, 16)
    out, _ = m(x, is_causal=True)
    with torch.no_grad():
        pos = torch.arange(11)
        q = rope.rotate(m.q_proj(x).view(2, 11, 4, 4).transpose(1, 2), pos)
        k = rope.rotate(m.k_proj(x).view(2, 11, 4, 4).transpose(1, 2), pos)
        v = m.v_proj(x).view(2, 11, 4, 4).transpose(1, 2)
        o = mechanisms.resolve("linear")(q, k, v, is_causal=True)
        ref = m.out_proj(o.transpose(1, 2).reshape(2, 11, 16))
    assert_close(out, ref, atol=1e-6, what="rope + linear")


def test_build_names_and_errors():
    for name in PE.NAMES:
        PE.build(name, d_model=16, num_heads=4, head_dim=4, max_len=32)
    with pytest.raises(ValueError, match="unknown positional encoding 'xpos'"):
        PE.build("xpos", d_model=16, num_heads=4, head_dim=4, max_len=32)


def test_learned_bias_trains_under_tiled_with_a_warning():
    """See Note [Learned bias and the tiled kernel] in attnlab/nn/attention.py."""
    pos = PE.T5RelativeBias(2)
    m = MultiHeadAttention(8, 2, positional=pos, mechanism="tiled")
    with pytest.warns(UserWarning, match="cannot train a learned attention bias"):
        out, _ = m(torch.randn(1, 5, 8), is_causal=True)
    out.sum().backward()
    assert pos.table.weight.grad is not None and pos.table.weight.grad.abs().sum() > 0
