"""attnlab.capture on Hugging Face transformers models (tiny random BERT, GPT-2 and Llama configs, no
download): run_with_cache equals the eager attention weights, and hooks, ablation and patching act on the
model's own heads through attnlab's AttentionInterface (Note [HF hooked attention])."""
from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_close

transformers = pytest.importorskip("transformers")
from attnlab import capture as C  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "no_grad")

V, T = 61, 9


def _bert():
    cfg = transformers.BertConfig(vocab_size=V, hidden_size=24, num_hidden_layers=2, num_attention_heads=3,
                                  intermediate_size=37, max_position_embeddings=32)
    return transformers.BertModel(cfg).eval()


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=V, n_embd=24, n_layer=2, n_head=3, n_positions=32)
    return transformers.GPT2Model(cfg).eval()


def _llama():  # grouped-query attention (4 query heads, 2 key/value heads) and rotary positions
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaModel(cfg).eval()


MODELS = {"bert": _bert, "gpt2": _gpt2, "llama": _llama}


def _inputs(pad: bool):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (2, T), generator=g)
    mask = torch.ones_like(ids)
    if pad:
        mask[1, T - 3:] = 0  # right padding on the second sequence
    return {"input_ids": ids, "attention_mask": mask}


@pytest.fixture(params=list(MODELS), scope="module")
def model(request):
    torch.manual_seed(0)
    return request.param, MODELS[request.param]()


def _eager(m, inputs, dtype=None):
    m = copy.deepcopy(m).to(dtype) if dtype is not None else m
    old = m.config._attn_implementation
    m.set_attn_implementation("eager")
    try:
        return m(**inputs, output_attentions=True)
    finally:
        m.set_attn_implementation(old)


@pytest.mark.parametrize("pad", [False, True])
def test_run_with_cache_equals_eager_weights(model, pad):
    """Per layer, the cached weights are within 4x the error of HF's own float32 eager weights against a
    float64 eager run of the same model (Note [HF weights budget] in tests/models/test_hf.py); the model
    keeps its default implementation (sdpa) before and after."""
    name, m = model
    inputs = _inputs(pad)
    before = m.config._attn_implementation
    out, cache = C.run_with_cache(m, **inputs)
    assert m.config._attn_implementation == before
    ref = _eager(m, inputs)
    oracle = _eager(m, inputs, torch.float64)
    assert len(cache.modules) == len(ref.attentions) == 2
    for i, (b, o) in enumerate(zip(ref.attentions, oracle.attentions)):
        a = cache[f"blocks.{i}.attn.weights"]
        assert a.shape == b.shape
        naive = float((b.double() - o).abs().max())
        err = float((a.double() - o).abs().max())
        assert err <= 4 * naive + 1e-7, f"{name} layer {i}: err {err:.3g} vs eager fp32 err {naive:.3g}"
        # scores recomputed from the cached q, k and the model's mask give the same weights
        s = cache[f"blocks.{i}.attn.scores"]
        assert_close(torch.softmax(s.double(), -1).nan_to_num(0.0) * (b > 0), b * (b > 0), atol=1e-5,
                     what=f"{name} scores {i}")
    # the output is the model's: caching changed nothing but rounding
    spread = float((ref.last_hidden_state - oracle.last_hidden_state).abs().max())
    assert_close(out.last_hidden_state, ref.last_hidden_state, atol=4 * spread + 1e-6, what=f"{name} output")
    H = m.config.num_attention_heads
    assert cache["blocks.0.attn.z"].shape[:3] == (2, H, T)
    assert cache["blocks.0.attn.out"].shape == (2, T, m.config.hidden_size)


def test_hooks_ablate_and_patch_act_on_the_model(model):
    name, m = model
    inputs = _inputs(False)
    _, cache = C.run_with_cache(m, **inputs)
    # a hook replacing z by itself is the identity (against a run that computes no weights either, so the
    # same kernel runs); zeroing z of every head in layer 1 equals zero ablation
    base = C.run_with_hooks(m, **inputs, fwd_hooks=[("blocks.1.attn.z", lambda z, ctx: None)])
    same = C.run_with_hooks(m, **inputs, fwd_hooks=[("blocks.1.attn.z", lambda z, ctx: z.clone())])
    assert_close(same.last_hidden_state, base.last_hidden_state, atol=0, what=f"{name} identity hook")
    H = m.config.num_attention_heads
    with C.ablate_heads(m, layer=1, heads=list(range(H))):
        abl = m(**inputs).last_hidden_state
    zeroed = C.run_with_hooks(m, **inputs, fwd_hooks=[("blocks.1.attn.z", lambda z, ctx: torch.zeros_like(z))])
    assert_close(abl, zeroed.last_hidden_state, atol=0, what=f"{name} ablate vs zero hook")
    assert float((abl - base.last_hidden_state).abs().max()) > 1e-4  # the ablation really changed the output
    # patching a head from another input: the patched run's z for that head is the source's
    other = {"input_ids": (inputs["input_ids"] + 7) % V, "attention_mask": inputs["attention_mask"]}
    _, src = C.run_with_cache(m, **other)
    with C.patch_heads(m, layer=0, heads=[1], source=src):
        _, patched = C.run_with_cache(m, **inputs, names=["blocks.0.attn.z"])
    z = patched["blocks.0.attn.z"]
    assert_close(z[:, 1], src["blocks.0.attn.z"][:, 1], atol=0, what=f"{name} patched head")
    assert_close(z[:, 0], cache["blocks.0.attn.z"][:, 0], atol=1e-6, what=f"{name} unpatched head")
    assert m.config._attn_implementation == "sdpa"


def test_causal_mean_ablation_on_gpt2_is_a_prefix_mean():
    """GPT-2's causal attention: the mean-ablated head's z at position t is the mean of z over 0..t."""
    torch.manual_seed(0)
    m = _gpt2()
    inputs = {"input_ids": _inputs(False)["input_ids"][:1]}
    _, cache = C.run_with_cache(m, **inputs)
    z = cache["blocks.1.attn.z"][:, 2]  # (1, T, Dv)
    expect = torch.cumsum(z, 1) / torch.arange(1, T + 1).view(1, T, 1)
    with C.ablate_heads(m, layer=1, heads=[2], how="mean"):
        _, ab = C.run_with_cache(m, **inputs, names=["blocks.1.attn.z"])
    assert_close(ab["blocks.1.attn.z"][:, 2], expect, atol=1e-6, what="prefix mean")


def test_a_model_without_attention_modules_is_refused():
    with pytest.raises(ValueError, match="no attention module to capture"):
        C.run_with_cache(torch.nn.Linear(3, 3), torch.ones(1, 3))
