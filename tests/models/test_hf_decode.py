"""Hugging Face generation on attn_implementation="attnlab": every one-token step with transformers' KV cache
runs attnlab's decode kernel (kernels/decode.py) and the greedy tokens equal transformers' own sdpa, for one
prompt and for a left-padded batch."""
from __future__ import annotations

import pytest
import torch

from attnlab.kernels import decode as dk

transformers = pytest.importorskip("transformers")
from attnlab.integrations import hf  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not dk.available(), reason=f"decode extension: {dk.unavailable_reason()}")]


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("batch", ["one", "left_padded"])
def test_generate_steps_run_the_decode_kernel(batch, monkeypatch):
    hf.register_all()
    model = _llama()
    ids = torch.randint(1, 64, (1 if batch == "one" else 2, 23), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if batch == "left_padded":
        mask[1, :9] = 0
        ids[1, :9] = 0
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        ref = model.generate(ids, **kw)
    calls = []
    real = dk.decode_attention

    def counting(*a, **k):
        calls.append(a[0].shape)
        return real(*a, **k)

    monkeypatch.setattr(dk, "decode_attention", counting)
    model.set_attn_implementation("attnlab")
    with torch.no_grad():
        out = model.generate(ids, **kw)
    assert torch.equal(out, ref)
    steps = [s for s in calls if s[2] == 1]  # q [B, H, 1, D]: the one-token steps
    assert len(steps) == 2 * 7, calls  # 2 layers x the 7 steps after the prefill


def test_in_place_cache_gives_dynamic_cache_results():
    """hf.in_place_cache: the same greedy tokens as transformers' DynamicCache on sdpa and attnlab, the
    cached keys are views of one storage across steps (no per-step copy), beam search (reordering) works."""
    hf.register_all()
    model = _llama()
    ids = torch.randint(1, 64, (2, 17), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=9, do_sample=False, pad_token_id=0)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        ref = model.generate(ids, **kw)
        beams = model.generate(ids, num_beams=3, **kw)
    for impl in ("sdpa", "attnlab"):
        model.set_attn_implementation(impl)
        cache = hf.in_place_cache(model.config, 17 + 9)
        with torch.no_grad():
            out = model.generate(ids, cache=cache, **kw)
        assert torch.equal(out, ref), impl
        layer = cache.layers[0]
        assert layer.keys.data_ptr() == layer._kbuf.data_ptr() and layer._kbuf.shape[2] == 26
        with torch.no_grad():
            assert torch.equal(model.generate(ids, num_beams=3, cache=hf.in_place_cache(model.config), **kw),
                               beams), impl
    with pytest.raises(ValueError, match="capacity must be an int >= 0"):
        hf.in_place_cache(model.config, -1)
