"""attnlab.nn.MultiHeadAttention against nn.MultiheadAttention and a float64 oracle built from the
module's own weights (attnlab.reference)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_close
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import attnlab
from attnlab import patterns as P
from attnlab import reference
from attnlab.nn import LayerCache, MultiHeadAttention

EXACT = ("dense", "tiled", "sdpa", "sparse", "auto")


def oracle(m: MultiHeadAttention, query, key=None, value=None, keep=None, is_causal=False, bias=None):
    """float64 NumPy multi-head attention from m's weights: out [B, L, E], weights [B, H, L, S]."""
    key = query if key is None else key
    value = key if value is None else value

    def lin(x, layer):
        w = layer.weight.detach().double().numpy()
        b = layer.bias.detach().double().numpy() if layer.bias is not None else 0.0
        return x.detach().double().numpy() @ w.T + b

    B, L, _ = query.shape
    S = key.shape[1]
    H, Hkv, D, Dv = m.num_heads, m.num_kv_heads, m.head_dim, m.value_head_dim
    q = lin(query, m.q_proj).reshape(B, L, H, D).transpose(0, 2, 1, 3)
    k = lin(key, m.k_proj).reshape(B, S, Hkv, D).transpose(0, 2, 1, 3)
    v = lin(value, m.v_proj).reshape(B, S, Hkv, Dv).transpose(0, 2, 1, 3)
    mask = None
    if keep is not None:
        mask = np.asarray(keep)
    if bias is not None:
        mask = np.where(mask, bias, -np.inf) if mask is not None else bias
    out, w = reference.attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=m.scale, enable_gqa=True)
    y = out.transpose(0, 2, 1, 3).reshape(B, L, H * Dv)
    return lin(torch.from_numpy(y), m.out_proj), w


# -- parity with nn.MultiheadAttention -----------------------------------------------------------
@pytest.mark.parametrize("separate", [False, True])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("method", ["dense", "tiled", "auto"])
def test_from_torch_matches_nn_multihead_attention(separate, bias, method):
    E, H = 24, 4
    kd = 10 if separate else None
    tm = nn.MultiheadAttention(E, H, bias=bias, batch_first=True, kdim=kd, vdim=kd)
    m = MultiHeadAttention.from_torch(tm, mechanism=method)
    x = torch.randn(3, 7, E)
    kv = torch.randn(3, 9, kd or E)
    kpm = torch.zeros(3, 9, dtype=torch.bool)
    kpm[1, 5:] = True
    kpm[2, :2] = True
    for avg in (True, False):
        ref_out, ref_w = tm(x, kv, kv, key_padding_mask=kpm, need_weights=True, average_attn_weights=avg)
        out, w = m(x, kv, kv, key_padding_mask=kpm, need_weights=True, average_attn_weights=avg)
        assert_close(out, ref_out, atol=1e-6, what=f"output avg={avg}")
        assert_close(w, ref_w, atol=1e-6, what=f"weights avg={avg}")
    # masked keys get exactly zero weight
    assert float(w[1, :, :, 5:].detach().abs().max()) == 0.0


def test_from_torch_attn_mask_polarity_and_float_mask():
    """torch's bool attn_mask is True = masked; attnlab's is True = takes part (SDPA's)."""
    E, H, L = 16, 2, 6
    tm = nn.MultiheadAttention(E, H, batch_first=True)
    m = MultiHeadAttention.from_torch(tm, mechanism="dense")
    x = torch.randn(2, L, E)
    torch_mask = torch.triu(torch.ones(L, L, dtype=torch.bool), 1)  # True = not allowed
    ref_out, ref_w = tm(x, x, x, attn_mask=torch_mask, average_attn_weights=False)
    out, w = m(x, attn_mask=~torch_mask, need_weights=True, average_attn_weights=False)
    assert_close(out, ref_out, atol=1e-6, what="bool mask output")
    assert_close(w, ref_w, atol=1e-6, what="bool mask weights")
    out_c, _ = m(x, is_causal=True)
    assert_close(out_c, ref_out, atol=1e-6, what="is_causal output")
    fmask = torch.randn(L, L)
    ref_out, _ = tm(x, x, x, attn_mask=fmask)
    out, _ = m(x, attn_mask=fmask)
    assert_close(out, ref_out, atol=1e-6, what="float mask output")


def test_unbatched_input_matches_torch():
    tm = nn.MultiheadAttention(12, 3, batch_first=True)
    m = MultiHeadAttention.from_torch(tm)
    x = torch.randn(5, 12)
    ref, _ = tm(x, x, x)
    out, _ = m(x)
    assert out.shape == (5, 12)
    assert_close(out, ref, atol=1e-6, what="unbatched")


# -- GQA, MQA, cross-attention, d_k != d_v, scale ---------------------------------------------------
@pytest.mark.parametrize("method", EXACT)
@pytest.mark.parametrize("kv_heads", [1, 2, 6])
def test_grouped_query_attention_against_oracle(method, kv_heads):
    m = MultiHeadAttention(36, 6, num_kv_heads=kv_heads, mechanism=method)
    x = torch.randn(2, 17, 36)
    out, _ = m(x, is_causal=True)
    ref, _ = oracle(m, x, is_causal=True)
    assert_close(out, ref, atol=2e-5, rtol=2e-5, what=f"{method} Hkv={kv_heads}")
    assert m.k_proj.out_features == kv_heads * 6


def test_cross_attention_with_different_dims_and_value_head_dim():
    m = MultiHeadAttention(20, 4, kdim=7, vdim=11, head_dim=3, value_head_dim=9, mechanism="dense")
    q, k, v = torch.randn(2, 5, 20), torch.randn(2, 13, 7), torch.randn(2, 13, 11)
    kpm = torch.zeros(2, 13, dtype=torch.bool)
    kpm[0, 10:] = True
    out, w = m(q, k, v, key_padding_mask=kpm, need_weights=True, average_attn_weights=False)
    ref, ref_w = oracle(m, q, k, v, keep=~kpm.view(2, 1, 1, 13).numpy())
    assert out.shape == (2, 5, 20) and w.shape == (2, 4, 5, 13)
    assert_close(out, ref, atol=2e-6, what="cross output")
    assert_close(w, ref_w, atol=2e-6, what="cross weights")


@pytest.mark.parametrize("scale", [1.0, 1.0 / 8.0, None])
def test_scale_override(scale):
    m = MultiHeadAttention(16, 2, scale=scale, mechanism="tiled")
    x = torch.randn(2, 9, 16)
    out, w = m(x, need_weights=True, average_attn_weights=False)
    ref, ref_w = oracle(m, x)
    assert_close(out, ref, atol=2e-6, what=f"scale={scale}")
    assert_close(w, ref_w, atol=2e-6, what=f"weights scale={scale}")


def test_pattern_and_attn_mask_and_padding_compose():
    m = MultiHeadAttention(16, 4, pattern=P.sliding_window(2), mechanism="sparse")
    x = torch.randn(2, 11, 16)
    kpm = torch.zeros(2, 11, dtype=torch.bool)
    kpm[1, 8:] = True
    am = torch.rand(11, 11) > 0.2
    out, _ = m(x, attn_mask=am, key_padding_mask=kpm, is_causal=True)
    keep = (P.sliding_window(2) & P.causal()).materialize(11, 11).numpy() & am.numpy()
    keep = keep[None, None] & ~kpm.numpy()[:, None, None, :]
    ref, _ = oracle(m, x, keep=keep)
    assert_close(out, ref, atol=2e-6, what="composed masks")


def test_gradients_through_tiled_match_dense():
    torch.manual_seed(1)
    m = MultiHeadAttention(24, 4, num_kv_heads=2, mechanism="dense")
    x = torch.randn(2, 19, 24, requires_grad=True)
    out, _ = m(x, is_causal=True)
    out.square().sum().backward()
    g_ref = [p.grad.clone() for p in m.parameters()] + [x.grad.clone()]
    m.zero_grad()
    x.grad = None
    m.mechanism = "tiled"
    out, _ = m(x, is_causal=True)
    out.square().sum().backward()
    for a, b in zip([p.grad for p in m.parameters()] + [x.grad], g_ref):
        assert_close(a, b, atol=1e-5, rtol=1e-5, what="grad")


def test_registered_mechanism_by_name_is_used():
    from attnlab import mechanisms

    m = MultiHeadAttention(16, 2, mechanism="dense")
    x = torch.randn(1, 8, 16)
    ref, _ = m(x, is_causal=True)
    # a registered mechanism that takes is_causal (the registry's order follows import order)
    name = next(n for n, spec in mechanisms.specs().items() if n not in attnlab.METHODS and spec.causal)
    m.mechanism = name
    out, _ = m(x, is_causal=True)
    assert out.shape == ref.shape and torch.isfinite(out).all()


# -- KV cache at the layer level -------------------------------------------------------------------
def test_incremental_cache_equals_full_causal():
    m = MultiHeadAttention(16, 4, num_kv_heads=2, mechanism="auto").eval()
    x = torch.randn(2, 13, 16)
    full, _ = m(x, is_causal=True)
    cache = LayerCache()
    parts = [m(x[:, :5], is_causal=True, cache=cache)[0]]
    parts += [m(x[:, t: t + 1], is_causal=True, cache=cache)[0] for t in range(5, 9)]
    parts.append(m(x[:, 9:], is_causal=True, cache=cache)[0])  # a chunk of 4 after a prefix
    assert cache.length == 13
    assert_close(torch.cat(parts, 1), full, atol=1e-6, what="cached")


def test_cache_of_another_layer_is_refused():
    a, b = MultiHeadAttention(8, 2), MultiHeadAttention(8, 2)
    cache = LayerCache()
    a(torch.randn(1, 3, 8), cache=cache)
    with pytest.raises(ValueError, match="another attention layer"):
        b(torch.randn(1, 1, 8), cache=cache)


# -- bad input -------------------------------------------------------------------------------------
def test_bad_construction():
    with pytest.raises(ValueError, match="num_heads \\(5\\) must divide embed_dim \\(16\\)"):
        MultiHeadAttention(16, 5)
    with pytest.raises(ValueError, match="num_kv_heads \\(3\\) must divide num_heads \\(4\\)"):
        MultiHeadAttention(16, 4, num_kv_heads=3)
    with pytest.raises(TypeError, match="positional"):
        MultiHeadAttention(16, 4, positional="rope")


def test_bad_forward_inputs():
    m = MultiHeadAttention(16, 4)
    x = torch.randn(2, 5, 16)
    with pytest.raises(ValueError, match="query has 12 features .* embed_dim=16"):
        m(torch.randn(2, 5, 12))
    with pytest.raises(ValueError, match="batch first"):
        m(torch.randn(2, 5, 1, 16))
    with pytest.raises(ValueError, match=r"key_padding_mask must be \[batch, S\] = \[2, 5\]"):
        m(x, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="True = ignore"):
        m(x, key_padding_mask=torch.ones(2, 5, dtype=torch.long))
    with pytest.raises(TypeError, match="attn_mask must be bool"):
        m(x, attn_mask=torch.ones(5, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="attn_mask has shape \\[4, 5\\]"):
        m(x, attn_mask=torch.ones(4, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="vdim=16"):
        m(x, x, torch.randn(2, 5, 3))


def test_bad_mask_leaves_the_cache_untouched():
    m = MultiHeadAttention(8, 2).eval()
    cache = LayerCache()
    x = torch.randn(1, 4, 8)
    m(x, is_causal=True, cache=cache)
    with pytest.raises(ValueError, match="key_padding_mask"):
        m(x[:, :1], is_causal=True, cache=cache, key_padding_mask=torch.zeros(1, 4, dtype=torch.bool))
    assert cache.length == 4
    out, _ = m(x[:, :1], is_causal=True, cache=cache, key_padding_mask=torch.zeros(1, 5, dtype=torch.bool))
    assert cache.length == 5 and out.shape == (1, 1, 8)


@pytest.mark.parametrize("method", EXACT)
def test_nan_in_padded_keys_does_not_leak(method):
    """Note [Padded keys are zeroed] in attnlab/nn/attention.py."""
    m = MultiHeadAttention(12, 3, mechanism=method)
    q, kv = torch.randn(2, 5, 12), torch.randn(2, 7, 12)
    kpm = torch.zeros(2, 7, dtype=torch.bool)
    kpm[0, 4:] = True
    ref, _ = m(q, kv, kv, key_padding_mask=kpm)
    poisoned = kv.clone()
    poisoned[0, 4:] = float("nan")
    out, _ = m(q, poisoned, poisoned, key_padding_mask=kpm)
    assert_close(out, ref, atol=1e-6, what=f"{method} with NaN padding")


def test_permuting_key_value_pairs_changes_nothing():
    m = MultiHeadAttention(12, 3, num_kv_heads=1, mechanism="tiled")
    q, kv = torch.randn(2, 5, 12), torch.randn(2, 9, 12)
    perm = torch.randperm(9)
    a, wa = m(q, kv, kv, need_weights=True)
    b, wb = m(q, kv[:, perm], kv[:, perm], need_weights=True)
    assert_close(b, a, atol=1e-6, what="permuted keys")
    assert_close(wb, wa[:, :, perm], atol=1e-6, what="permuted weights")


@settings(max_examples=15, deadline=None)
@given(chunks=st.lists(st.integers(1, 6), min_size=1, max_size=6), window=st.integers(0, 5),
       method=st.sampled_from(["auto", "tiled", "sparse", "dense"]))
def test_any_chunking_of_cached_decoding_equals_full(chunks, window, method):
    """Positions (RoPE), causal masking and patterns stay right under a cache for any chunking."""
    from attnlab.positional import RotaryEmbedding

    torch.manual_seed(0)
    m = MultiHeadAttention(16, 4, num_kv_heads=2, mechanism=method, positional=RotaryEmbedding(4),
                           pattern=P.sliding_window(window, causal=True)).eval()
    x = torch.randn(2, sum(chunks), 16)
    full, _ = m(x, is_causal=True)
    cache, parts, t = LayerCache(), [], 0
    for c in chunks:
        parts.append(m(x[:, t: t + c], is_causal=True, cache=cache)[0])
        t += c
    assert_close(torch.cat(parts, 1), full, atol=1e-5, what=f"chunks {chunks}")


def test_mechanism_given_as_a_module_runs_and_can_be_swapped():
    """A mechanism passed as an nn.Module (``Mechanism.as_module()``) is resolved, runs like the same
    mechanism given by name, and can be replaced by a method name and back."""
    import attnlab.mechanisms as M

    torch.manual_seed(0)
    x = torch.randn(2, 5, 16)
    by_name = MultiHeadAttention(16, 2, mechanism="linear")
    by_module = MultiHeadAttention(16, 2, mechanism=M.get("linear").as_module())
    by_module.load_state_dict(by_name.state_dict())
    assert_close(by_module(x, x, x)[0], by_name(x, x, x)[0], 1e-6, 1e-6)
    by_module.mechanism = "dense"
    ref = MultiHeadAttention(16, 2, mechanism="dense")
    ref.load_state_dict(by_name.state_dict())
    assert_close(by_module(x, x, x)[0], ref(x, x, x)[0], 1e-6, 1e-6)
    by_module.mechanism = M.get("linear").as_module()
    assert_close(by_module(x, x, x)[0], by_name(x, x, x)[0], 1e-6, 1e-6)
