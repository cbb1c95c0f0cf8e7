"""attnlab.capture (run_with_cache, hooks, head ablation and patching) on all-MiniLM-L6-v2, checked against
Hugging Face's eager BertModel on the same weights and against interventions done by editing weights."""
from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_close

from attnlab import capture as C
from attnlab.models import minilm

transformers = pytest.importorskip("transformers")
# MiniLM and HF BertModel loads (tests/conftest.py: MiniLM tests are slow); inference only, tiny batches
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread", "no_grad")]

SENTENCES = ["The quick brown fox jumps over the lazy dog.", "Attention, please."]  # the second one is padded
FP32_FACTOR = 3.0  # as tests/models/test_minilm.py: error against float64 at most 3x HF eager's own float32 error


@pytest.fixture(scope="module")
def batch(minilm_model):
    return minilm_model.tokenize(SENTENCES)


@pytest.fixture(scope="module")
def cached(minilm_model, batch):
    return C.run_with_cache(minilm_model, batch["input_ids"], batch["attention_mask"])


def test_names_and_shapes_are_as_documented(minilm_model, batch, cached):
    out, cache = cached
    B, T = batch["input_ids"].shape
    # names=None: every attention activation and every layer point of MiniLM's 6 blocks
    assert len(cache) == 6 * (len(C.ACTIVATIONS) + len(C.LAYER_POINTS)) and cache.modules[3] == "layers.3.self_attn"
    shapes = {"q": (B, 12, T, 32), "k": (B, 12, T, 32), "v": (B, 12, T, 32), "scores": (B, 12, T, T),
              "weights": (B, 12, T, T), "z": (B, 12, T, 32), "out": (B, T, 384)}
    for i in range(6):
        for kind, shape in shapes.items():
            assert tuple(cache[f"blocks.{i}.attn.{kind}"].shape) == shape, (i, kind)
    assert out.attentions is None  # caching weights does not change what the caller asked for
    with pytest.raises(ValueError, match="blocks"):
        cache["layers.0.q"]
    with pytest.raises(ValueError, match="6 attention modules"):
        cache["blocks.6.attn.q"]


def test_cached_weights_equal_hf_eager_attentions(minilm_model, hf_bert, batch, cached):
    _, cache = cached
    hf32 = hf_bert
    hf64 = copy.deepcopy(hf32).double()
    kw = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_attentions=True)
    a32, a64 = hf32(**kw).attentions, hf64(**kw).attentions
    real = batch["attention_mask"].bool()[:, None, :, None]  # HF's rows of padded queries are not comparable
    for i in range(6):
        ours = cache[f"blocks.{i}.attn.weights"].double().masked_fill(~real, 0)
        ref = a64[i].masked_fill(~real, 0)
        budget = FP32_FACTOR * float((a32[i].double().masked_fill(~real, 0) - ref).abs().max())
        assert_close(ours, ref, max(budget, torch.finfo(torch.float32).eps), what=f"layer {i} weights vs HF float64")
    # the cached q, k reproduce the weights: softmax(scores) in float64
    for i in (0, 5):
        sm = torch.softmax(cache[f"blocks.{i}.attn.scores"].double(), -1).masked_fill(~real, 0)
        w = cache[f"blocks.{i}.attn.weights"].double().masked_fill(~real, 0)
        assert_close(w, sm, 1e-6, what=f"layer {i}: weights vs softmax(cached scores)")
        assert torch.isinf(cache[f"blocks.{i}.attn.scores"][1, :, :, batch["attention_mask"][1] == 0]).all()


def test_cache_draws_in_viz_show(minilm_model, batch, cached, tmp_path):
    from attnlab import viz

    _, cache = cached
    assert [w.shape for w in cache.weights()] == [cache[f"blocks.{i}.attn.weights"].shape for i in range(6)]
    show = getattr(viz, "show", None)
    if show is None:
        pytest.skip("attnlab.viz.show is not on this branch")
    show(cache, batch["tokens"][0]).save(tmp_path / "cache.html")
    assert (tmp_path / "cache.html").stat().st_size > 0
    _, only_q = C.run_with_cache(minilm_model, batch["input_ids"], names=["blocks.0.attn.q"])
    with pytest.raises(ValueError, match="no weights were cached"):
        only_q.weights()


def test_z_and_out_are_the_layer_arithmetic(minilm_model, cached):
    _, cache = cached
    for i in (0, 4):
        w, v, z = (cache[f"blocks.{i}.attn.{k}"].double() for k in ("weights", "v", "z"))
        assert_close(z, w @ v, 1e-5, what=f"layer {i}: z vs weights · V")
        B, H, T, Dv = z.shape
        out_proj = minilm_model.layers[i].self_attn.out_proj
        merged = cache[f"blocks.{i}.attn.z"].transpose(1, 2).reshape(B, T, H * Dv)
        assert torch.equal(out_proj(merged), cache[f"blocks.{i}.attn.out"])


def test_ablating_nothing_is_identity_and_a_head_matches_zeroed_w_o(minilm_model, batch):
    base = C.sentence_embeddings(minilm_model, batch)
    with C.ablate_heads(minilm_model, 2, heads=[]):
        assert torch.equal(C.sentence_embeddings(minilm_model, batch), base)
    layer, head, Dv = 2, 5, 32
    with C.ablate_heads(minilm_model, layer, heads=[head], how="zero"):
        ablated = C.sentence_embeddings(minilm_model, batch)
    # oracle: the same head removed by zeroing its W_O columns in a copy of the model
    edited = copy.deepcopy(minilm_model)
    edited.layers[layer].self_attn.out_proj.weight[:, head * Dv:(head + 1) * Dv] = 0
    assert_close(ablated, C.sentence_embeddings(edited, batch), 1e-6, what="zero ablation vs zeroed W_O")
    cos = (ablated * base).sum(-1)
    assert (cos < 1 - 1e-4).all() and (cos > 0.5).all()  # it moves the embedding, it does not destroy it
    eff = C.head_effect(minilm_model, SENTENCES, layer, [head])
    assert eff["cosine"] == pytest.approx(cos.double().tolist(), abs=1e-6) and eff["how"] == "zero"
    assert not any(m.self_attn.hooks for m in minilm_model.layers)  # every hook removed


def test_mean_ablation_matches_bias_oracle_in_float64():
    m = minilm.load(dtype=torch.float64)
    b = m.tokenize("Mean ablation keeps the head's average contribution.")
    layer, head, Dv = 3, 7, 32
    _, cache = C.run_with_cache(m, b["input_ids"], b["attention_mask"], names=[f"blocks.{layer}.attn.z"])
    mean = cache[f"blocks.{layer}.attn.z"][0, head].mean(0)  # (Dv,) over the tokens of this run
    with C.ablate_heads(m, layer, head, how="mean"):
        got = C.sentence_embeddings(m, b)
    edited = copy.deepcopy(m)
    op = edited.layers[layer].self_attn.out_proj
    cols = slice(head * Dv, (head + 1) * Dv)
    op.bias += op.weight[:, cols] @ mean  # the head's constant contribution moved into the bias
    op.weight[:, cols] = 0
    assert_close(got, C.sentence_embeddings(edited, b), 1e-12, what="mean ablation vs bias oracle (float64)")


def test_patching_with_own_activation_is_identity_and_full_patch_copies_the_layer(minilm_model, batch, cached):
    base = C.sentence_embeddings(minilm_model, batch)
    # z only: caching weights too would run the weights-returning kernel, equal to ~1 float32 ulp, not bitwise
    _, own = C.run_with_cache(minilm_model, batch["input_ids"], batch["attention_mask"], names=["blocks.1.attn.z"])
    with C.patch_heads(minilm_model, 1, heads=range(12), source=own):
        assert torch.equal(C.sentence_embeddings(minilm_model, batch), base)
    with C.patch_heads(minilm_model, 1, heads=range(12), source=cached[1]):  # from the all-activations run
        assert_close(C.sentence_embeddings(minilm_model, batch), base, 1e-6, what="patch from a weights-kernel cache")
    other = minilm_model.tokenize(["A slow green turtle walks under the busy bridge.", "Listen, everyone."])
    assert other["input_ids"].shape == batch["input_ids"].shape
    _, cache_b = C.run_with_cache(minilm_model, other["input_ids"], other["attention_mask"],
                                 names=["blocks.4.attn.z", "blocks.4.attn.out"])
    with C.patch_heads(minilm_model, 4, heads=range(12), source=cache_b):
        _, patched = C.run_with_cache(minilm_model, batch["input_ids"], batch["attention_mask"], names=["blocks.4.attn.out"])
    # every head of layer 4 from run B: the layer's output is run B's, bit for bit
    assert torch.equal(patched["blocks.4.attn.out"], cache_b["blocks.4.attn.out"])
    eff = C.head_effect(minilm_model, SENTENCES, 4, [0, 1], how=cache_b)
    assert eff["how"] == "patch" and all(c < 1 for c in eff["cosine"])
    short = minilm_model.tokenize("Hi.")
    with pytest.raises(ValueError, match="same batch and token count"):
        with C.patch_heads(minilm_model, 4, heads=[0], source=cache_b):
            minilm_model(short["input_ids"], short["attention_mask"])


def test_hooks_replace_read_and_refuse(minilm_model, batch):
    seen = []
    out = C.run_with_hooks(minilm_model, batch["input_ids"], batch["attention_mask"],
                           fwd_hooks=[("blocks.0.attn.weights", lambda w, ctx: seen.append(w.shape))])
    assert len(seen) == 1 and out.attentions is None
    with pytest.raises(ValueError, match="read only"):
        C.run_with_hooks(minilm_model, batch["input_ids"], fwd_hooks=[("blocks.0.attn.weights", lambda w, ctx: w * 2)])
    with pytest.raises(ValueError, match="same shape"):
        C.run_with_hooks(minilm_model, batch["input_ids"], fwd_hooks=[("blocks.0.attn.q", lambda q, ctx: q[:, :1])])
    with pytest.raises(ValueError, match="derived from q and k"):
        with C.hooks(minilm_model, [("blocks.0.attn.scores", lambda s, ctx: None)]):
            pass
    with pytest.raises(ValueError, match="out of range"):
        with C.ablate_heads(minilm_model, 0, heads=[12]):
            pass
    with pytest.raises(ValueError, match="how must be"):
        with C.ablate_heads(minilm_model, 0, heads=[1], how="noise"):
            pass
    assert not any(m.self_attn.hooks for m in minilm_model.layers)


def test_scores_follow_cache_offset_gqa_pattern_and_padding():
    """Generic MultiHeadAttention: GQA, a sliding-window pattern, causal decoding with a KV cache and key
    padding; softmax(cached scores) equals the layer's own weights and masked pairs are exactly -inf."""
    from attnlab import patterns as P
    from attnlab.nn import LayerCache, MultiHeadAttention

    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4, num_kv_heads=2, pattern=P.sliding_window(2)).double()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[1, 0] = True  # the first key of sequence 1 is padding
    cache = LayerCache()
    names = [C.activation_name(0, "scores"), C.activation_name(0, "weights"), C.activation_name(0, "k")]
    with C.cache_activations(mha, names) as prefill:
        mha(x[:, :5], key_padding_mask=kpm[:, :5], is_causal=True, cache=cache)
    with C.cache_activations(mha, names) as step:
        _, w = mha(x[:, 5:], key_padding_mask=kpm, is_causal=True, cache=cache, need_weights=True,
                   average_attn_weights=False)
    assert step[names[2]].shape == (2, 2, 6, 4)  # GQA keys, cache included
    assert torch.equal(step[names[1]], w)
    for got, L, off in ((prefill, 5, 0), (step, 1, 5)):
        s = got[names[0]]
        i = torch.arange(off, off + L)[:, None]
        j = torch.arange(off + L)[None, :]
        keep = (j <= i) & (i - j <= 2)  # causal and within the window
        keep = keep[None, None] & ~kpm[:, None, None, :off + L]
        assert torch.isinf(s[~keep.expand_as(s)]).all() and torch.isfinite(s[keep.expand_as(s)]).all()
        sm = torch.nan_to_num(torch.softmax(s, -1))  # a row with no key left: zeros, as attention gives
        assert_close(sm, got[names[1]], 1e-12, what=f"softmax(scores), offset {off}")
