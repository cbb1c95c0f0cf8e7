"""Hugging Face generation on attn_implementation="attnlab": every one-token step with transformers' KV cache
runs attnlab's decode kernel (kernels/decode.py; Note [HF decode step]) and the greedy tokens equal transformers'
own sdpa, for one prompt and for a left-padded batch; generate appends in place by default (Note [HF in-place
generation])."""
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
    calls = []  # the decode kernel's calls: its wrapper, or the one-call step (csrc Note [One-call decode step])
    real, real_step = dk.decode_attention, dk.decode_step

    def counting(*a, **k):
        calls.append(a[0].transpose(1, 2).shape if k.get("blhd") else a[0].shape)  # as [B, H, L, D]
        return real(*a, **k)

    def counting_step(*a, **k):
        out = real_step(*a, **k)
        if out is not None:
            calls.append(a[0].transpose(1, 2).shape)  # q [B, L, H, D] -> [B, H, L, D]
        return out

    monkeypatch.setattr(dk, "decode_attention", counting)
    monkeypatch.setattr(dk, "decode_step", counting_step)
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


def test_in_place_storage_is_never_read_before_it_is_written(monkeypatch):
    """InPlaceLayer storage is uninitialised (Note [In-place cache storage] in integrations/hf.py): with storage
    filled with NaN, greedy generation (a padded batch, the storage doubling past its capacity) gives
    DynamicCache's tokens, so no unwritten row is read."""
    hf.register_all()
    model = _llama()
    model.set_attn_implementation("attnlab")
    ids = torch.randint(1, 64, (2, 13), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding on the second row
    kw = dict(attention_mask=mask, max_new_tokens=7, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = model.generate(ids, cache_implementation="dynamic", **kw)
    monkeypatch.setattr(hf, "_storage", lambda like, *shape: torch.full(shape, float("nan"), dtype=like.dtype))
    for capacity in (20, 14):  # room for every step, and too little: the storage doubles mid-generation
        cache = hf.in_place_cache(model.config, capacity)
        with torch.no_grad():
            assert torch.equal(model.generate(ids, cache=cache, **kw), ref), capacity
        assert cache.layers[0]._kbuf.isnan().any()  # the poisoned storage was the one used


def test_generate_appends_in_place_by_default():
    """Note [HF in-place generation]: generate on an attnlab implementation, no cache passed, gets InPlaceLayers
    reserving generate's max_length - 1 positions (the keys stay views of one storage); the tokens equal sdpa's
    with transformers' own cache. sdpa models, cache_implementation="dynamic" and a user's cache are untouched."""
    hf.register_all()
    model = _llama()
    ids = torch.randint(1, 64, (2, 19), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=7, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    InPlaceLayer = hf._in_place_classes()[0]
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        ref = model.generate(ids, **kw)
    assert all(type(layer) is not InPlaceLayer for layer in ref.cache.layers)
    model.set_attn_implementation("attnlab")
    with torch.no_grad():
        out = model.generate(ids, **kw)
        dyn = model.generate(ids, cache_implementation="dynamic", **kw)
    assert torch.equal(out.sequences, ref.sequences) and torch.equal(dyn.sequences, ref.sequences)
    for layer in out.cache.layers:
        assert type(layer) is InPlaceLayer
        assert layer._kbuf.shape[2] == 19 + 7 - 1 and layer.keys.data_ptr() == layer._kbuf.data_ptr()
    assert all(type(layer) is not InPlaceLayer for layer in dyn.cache.layers)


@pytest.mark.parametrize("heads,dtype,route", [(2, torch.float32, "kernel"), (8, torch.float32, "sdpa"),
                                               (8, torch.bfloat16, "kernel")])
def test_decode_step_route(heads, dtype, route, monkeypatch):
    """Note [HF decode step]: a step goes to the decode kernel (GQA, bf16) or to SDPA (plain float32 MHA, as
    auto's Note [Plain MHA decode]) without attnlab.attention; its output [B, L, H, Dv] matches SDPA's on the
    same inputs, including a padded batch's bool mask."""
    monkeypatch.setattr(hf, "attention", lambda *a, **k: pytest.fail("a decode step planned attention()"))
    fn = hf.attention_function("auto")
    mod = torch.nn.Module().eval()
    g = torch.Generator().manual_seed(4)
    B, H, S, D = 3, 8, 37, 16
    q = torch.randn(B, H, 1, D, generator=g).to(dtype)
    k = torch.randn(B, heads, S, D, generator=g).to(dtype)
    v = torch.randn(B, heads, S, D, generator=g).to(dtype)
    mask = torch.ones(B, 1, 1, S, dtype=torch.bool)
    mask[1, ..., :11] = False  # left padding of sequence 1
    calls = []  # the decode kernel's calls: its wrapper, or the one-call step (csrc Note [One-call decode step])
    real, real_step = dk.decode_attention, dk.decode_step
    monkeypatch.setattr(dk, "decode_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))

    def counting_step(*a, **kw):
        out = real_step(*a, **kw)
        if out is not None:
            calls.append(1)
        return out
    monkeypatch.setattr(dk, "decode_step", counting_step)
    with torch.no_grad():
        for m in (None, mask):
            if m is not None and route == "sdpa":
                route = "kernel"  # a mask keeps the decode path (the planner's rule)
            calls.clear()
            out, w = fn(mod, q, k, v, m, scaling=0.3)
            assert w is None and out.shape == (B, 1, H, D) and out.is_contiguous()
            ref = torch.nn.functional.scaled_dot_product_attention(
                q.double(), k.double(), v.double(), attn_mask=m, scale=0.3, enable_gqa=heads != H)
            # fp32: summation-order rounding; bf16: the output's rounding (2^-8 relative) at |out| <= max|v| ~ 4
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(out.double(), ref.transpose(1, 2), atol=tol, rtol=tol)
            assert len(calls) == (1 if route == "kernel" else 0)


def test_soft_capped_model_generates_eager_tokens():
    """A model that soft-caps its scores (Gemma 2's attn_logit_softcapping, passed as ``softcap``; sdpa refuses
    it) gives eager's logits and greedy tokens on "attnlab", prefill and decode steps alike; a registered
    approximation that cannot soft-cap says so."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    hf.register_all()
    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                       attn_logit_softcapping=0.5, sliding_window=8)
    model = Gemma2ForCausalLM(cfg).eval()
    with torch.no_grad():  # scores of order 1 (random init gives ~1e-3, where the cap is the identity)
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(40)
            layer.self_attn.k_proj.weight.mul_(40)
    ids = torch.randint(1, 64, (1, 13), generator=torch.Generator().manual_seed(7))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    outs = {}
    for impl in ("eager", "attnlab"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            outs[impl] = model.generate(ids, **kw)
    assert torch.equal(outs["attnlab"].sequences, outs["eager"].sequences)
    model.set_attn_implementation("eager")
    for layer in model.model.layers:  # the cap matters here: without it the logits move
        layer.self_attn.attn_logit_softcapping = None
    with torch.no_grad():
        uncapped = model(ids).logits[:, -1]
    for layer in model.model.layers:
        layer.self_attn.attn_logit_softcapping = 0.5
    assert (uncapped - outs["eager"].logits[0]).abs().max() > 1e-2
    for a, b in zip(outs["attnlab"].logits, outs["eager"].logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)  # fp32 summation order
    model.set_attn_implementation("attnlab_performer")
    with torch.no_grad(), pytest.raises(ValueError, match="soft-caps.*softcap=0.5"):
        model(ids)
