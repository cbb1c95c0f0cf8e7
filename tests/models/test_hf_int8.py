"""The int8 KV cache for transformers (``integrations.hf_int8``, Note [HF int8 cache]) on a tiny random Llama (no
download): a prefill and single-token steps through the int8 cache give every layer's attention output equal to
float64 attention on K/V quantised here from the format's definition (Hadamard rotation from Sylvester's
construction, symmetric per-row int8, round to nearest), within the int8 decode kernel's budget; greedy generate
runs on it; misuse refuses with one line."""
from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attnlab.integrations import hf_int8
from attnlab.kernels import decode as dk

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not dk.available(), reason=f"decode extension: {dk.unavailable_reason()}")]


def _sylvester(D: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < D:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(D)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """Symmetric per-row int8 round trip (scale = max|row| / 127, round to nearest), float64."""
    s = x.abs().amax(-1, keepdim=True) / 127
    return torch.where(s > 0, torch.round(x / torch.where(s > 0, s, 1)), 0) * s


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(cfg).eval()


def test_steps_match_float64_on_the_quantised_cache():
    """Per layer and call (prefill of 20, then 4 steps), the attention output through the int8 cache against
    float64 attention on the keys (rotated, rounded per row, rotated back) and values (rounded per row) the
    layer got, bottom-right causal. Budget (tests/functional/test_kvcache_int8.py): a score is off by the int16
    query's rounding, half a step of max|q'| D^-1/2 / 32767 per element times |k'|_1, plus 2 (D + 2) eps |q| |k|
    D^-1/2 for float32 (the rotation of q and k included), a probability by twice that relative, an output by that
    times max|v| plus 2 eps max|v|; twice that. The rotated keys are quantised as Sylvester's Hadamard defines them."""
    model = _model()
    name = hf_int8.register()
    model.set_attn_implementation(name)
    fn = transformers.AttentionInterface._global_mapping[name]
    seen = []

    def spy(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        out, w = fn(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
        kc, vc, n = key._attnlab_int8
        seen.append((query.detach().double(), kc, vc, n, out.detach().double(), float(scaling)))
        return out, w

    transformers.AttentionInterface.register("attnlab_int8_spy", spy)
    transformers.AttentionMaskInterface.register("attnlab_int8_spy", transformers.masking_utils.sdpa_mask)
    model.config._attn_implementation = "attnlab_int8_spy"  # the int8 function itself, watched
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(1))
    cache = hf_int8.int8_cache(None)
    with torch.no_grad():
        model(ids[:, :20], cache=cache)
        for t in range(20, 24):
            model(ids[:, t:t + 1], cache=cache)
    assert len(seen) == 2 * 5 and cache.get_seq_length() == 24
    eps = torch.finfo(torch.float32).eps
    for q, kc, vc, n, out, scale in seen:
        H, L, D = q.shape[1:]
        G = H // kc.shape[2]
        r = _sylvester(D)
        stored = kc.data[:, :n].double() * kc.scale[:, :n, :, None].double()  # (B, n, Hkv, D): k Rᵀ, rounded
        k = stored @ r  # the keys the cache stands for
        v = vc.data[:, :n].double() * vc.scale[:, :n, :, None].double()
        kk, vv = k.repeat_interleave(G, 2).transpose(1, 2), v.repeat_interleave(G, 2).transpose(1, 2)  # (B, H, n, D)
        s = q @ kk.transpose(-1, -2) * scale  # (B, H, L, n)
        s = s.masked_fill(torch.arange(n) > torch.arange(L).unsqueeze(1) + (n - L), float("-inf"))
        want = (s.softmax(-1) @ vv).transpose(1, 2)  # (B, L, H, D)
        qr = q @ r.T
        step = float(qr.abs().amax()) * scale / 32767
        ds = step / 2 * float(stored.abs().sum(-1).max()) \
            + 2 * (D + 2) * eps * float(q.norm(dim=-1).max() * k.norm(dim=-1).max()) * scale
        tol = 2 * (2 * ds + 2 * eps) * float(v.abs().max())
        assert float((out - want).abs().max()) <= tol


def test_layer_stores_rounded_rotated_rows():
    """An Int8Layer's update stores k Rᵀ rounded per row (keys) and v rounded per row (values), R Sylvester's
    Hadamard: every element within half a step of the float64 definition plus the float32 rotation's rounding
    (D eps |k|), and the storage grows past its capacity keeping the rows."""
    layer = hf_int8._int8_classes()[0](capacity=4)
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(1, 2, 6, 16, generator=g) * 3, torch.randn(1, 2, 6, 16, generator=g)
    layer.update(k[:, :, :3], v[:, :, :3])
    layer.update(k[:, :, 3:], v[:, :, 3:])
    assert layer.get_seq_length() == 6 and layer.keys.shape == (1, 2, 6, 16)
    kc, vc = layer.k_cache, layer.v_cache
    rot = k.transpose(1, 2).double() @ _sylvester(16).T  # (1, 6, 2, 16)
    stored = kc.data[:, :6].double() * kc.scale[:, :6, :, None].double()
    slack = 16 * torch.finfo(torch.float32).eps * float(k.abs().max())
    assert float((stored - rot).abs().max()) <= float(kc.scale.max()) / 2 * (1 + 1e-5) + slack
    torch.testing.assert_close(vc.data[:, :6].double() * vc.scale[:, :6, :, None].double(),
                               _rows(v.transpose(1, 2).double()), rtol=0, atol=1e-6)


def test_generate_and_misuse():
    """greedy generate on the int8 cache advances it by the new tokens; the cache refuses a model on another
    implementation and bad arguments, each in one line."""
    model = _model()
    model.set_attn_implementation(hf_int8.register())
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(2))
    cache = hf_int8.int8_cache(model.config)
    out = model.generate(ids, cache=cache, max_new_tokens=5, do_sample=False, min_new_tokens=5)
    assert out.shape == (1, 17) and cache.get_seq_length() == 16
    model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="int8_cache: the model runs attn_implementation='sdpa'") as e:
        hf_int8.int8_cache(model.config)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="int8_cache: capacity"):
        hf_int8.int8_cache(None, -1)
    with pytest.raises(TypeError, match="int8_cache: rotate must be a bool"):
        hf_int8.int8_cache(None, rotate="yes")


def test_padded_batch_takes_the_dequantised_cache():
    """A left-padded batch carries a mask, so each call attends through "attnlab" on the dequantised int8 cache
    (Note [HF int8 cache]): generate runs, the cache holds every position's int8 rows (the padded sequence's
    real tokens included) and advances by the new tokens. (The dequantised path's numbers are "attnlab"'s own,
    tested in tests/models/test_hf_decode.py; the rows it reads are test_layer_stores_rounded_rotated_rows'.)"""
    model = _model()
    model.set_attn_implementation(hf_int8.register())
    ids = torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0  # sequence 1 is left-padded by 3
    cache = hf_int8.int8_cache(model.config)
    out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=4, do_sample=False, min_new_tokens=4,
                         pad_token_id=0)
    assert out.shape == (2, 13) and cache.get_seq_length() == 12
    kc = cache.layers[0].k_cache
    assert kc.data.dtype == torch.int8 and kc.rotation is not None and bool(kc.scale[1, 3:12].gt(0).all())
