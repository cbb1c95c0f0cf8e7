"""attnlab registered with transformers' AttentionInterface: HF's own BertModel (MiniLM weights) and a
tiny random Llama (causal, GQA, HF's KV cache) run on attnlab and reproduce HF's own output."""
from __future__ import annotations

import pytest
import torch
from helpers import assert_close

from attnlab import patterns as P

transformers = pytest.importorskip("transformers")
from attnlab.integrations import hf  # noqa: E402

SENTENCES = ["Hello world!", "The quick brown fox jumps over the lazy dog.", "Attention, please."]


pytestmark = pytest.mark.usefixtures("one_thread", "no_grad")  # inference on tiny batches


@pytest.fixture(scope="module")
def bert(hf_bert, minilm_model):
    """(HF BertModel, attnlab MiniLM, a tokenized batch); the tests switch HF's attention implementation."""
    hf.register_all()
    return hf_bert, minilm_model, minilm_model.tokenize(SENTENCES)


def _run(m, batch, impl, **kw):
    m.set_attn_implementation(impl)
    with torch.no_grad():
        return m(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **kw)


def test_registered_names():
    names = hf.register_all()
    for n in ("attnlab", "attnlab_tiled", "attnlab_sparse", "attnlab_dense", "attnlab_sdpa"):
        assert n in names
    assert hf.registered()["attnlab_tiled"] == ("tiled", None)
    from transformers import AttentionInterface

    assert "attnlab_tiled" in AttentionInterface._global_mapping


@pytest.mark.parametrize("impl", ["attnlab", "attnlab_dense", "attnlab_tiled", "attnlab_sdpa", "attnlab_sparse"])
def test_exact_mechanisms_reproduce_hf_bert(bert, impl):
    """Within the spread of HF's own two exact implementations (see Note [MiniLM fp32 budget])."""
    m, _, batch = bert
    eager = _run(m, batch, "eager").last_hidden_state
    sdpa = _run(m, batch, "sdpa").last_hidden_state
    ours = _run(m, batch, impl).last_hidden_state
    spread = float((eager - sdpa).abs().max())
    assert_close(ours, sdpa, atol=3 * spread + 1e-6, what=impl)


def test_attention_weights_through_the_interface(bert):
    """Weights through HF's interface, budgeted against a float64 run of the same model.

    Note [HF weights budget]: the weights of layer i depend on the hidden states of layers < i, so
    float32 rounding compounds with depth and differs by CPU (1e-6 at layer 0, ~7e-6 at layer 3 seen).
    The budget is therefore the error of HF's own float32 eager weights against a float64 run, times 4,
    per layer (PyTorch's way of budgeting a fused kernel against the naive same-dtype computation).
    """
    import copy

    m, _, batch = bert
    ref = _run(m, batch, "eager", output_attentions=True).attentions
    m64 = copy.deepcopy(m).double()
    oracle = _run(m64, batch, "eager", output_attentions=True).attentions
    got = _run(m, batch, "attnlab_tiled", output_attentions=True).attentions
    assert got is not None and len(got) == 6
    for layer, (a, b, o) in enumerate(zip(got, ref, oracle)):
        naive = float((b.double() - o).abs().max())
        err = float((a.double() - o).abs().max())
        assert err <= 4 * naive + 1e-7, f"layer {layer}: tiled weights err {err:.3g} vs eager fp32 err {naive:.3g}"


def test_approximate_and_pattern_mechanisms_match_attnlab_minilm(bert):
    """The same mechanism through HF and through attnlab.models.minilm gives the same model output."""
    m, ours, batch = bert
    a = _run(m, batch, "attnlab_performer").last_hidden_state
    ours.set_mechanism("performer")
    b = ours(batch["input_ids"], batch["attention_mask"]).last_hidden_state
    assert_close(a, b, atol=1e-5, what="performer")
    hf.register("attnlab_test_local", "sparse", P.sliding_window(2))
    a = _run(m, batch, "attnlab_test_local").last_hidden_state
    ours.set_mechanism("sparse", P.sliding_window(2))
    b = ours(batch["input_ids"], batch["attention_mask"]).last_hidden_state
    ours.set_mechanism("auto")
    assert_close(a, b, atol=1e-5, what="sliding window pattern")
    exact = _run(m, batch, "sdpa").last_hidden_state
    assert float((a - exact).abs().max()) > 1e-3  # the window really restricted attention


def test_causal_gqa_llama_with_hf_cache():
    from transformers import LlamaConfig, LlamaForCausalLM

    hf.register_all()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 50, (2, 11))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    model.set_attn_implementation("sdpa")
    ref = model(input_ids=ids, attention_mask=mask).logits
    ref_gen = model.generate(ids[:1], max_new_tokens=6, do_sample=False, pad_token_id=0)
    for impl in ("attnlab", "attnlab_tiled", "attnlab_dense"):
        model.set_attn_implementation(impl)
        out = model(input_ids=ids, attention_mask=mask).logits
        keep = mask.bool()
        assert_close(out[keep], ref[keep], atol=1e-5, what=f"llama {impl}")
        assert torch.equal(model.generate(ids[:1], max_new_tokens=6, do_sample=False, pad_token_id=0), ref_gen)


def test_bad_registration():
    with pytest.raises(TypeError, match="pattern must be an attnlab Pattern"):
        hf.register("attnlab_bad", "dense", pattern="window")
    with pytest.raises(ValueError, match="unknown|valid"):
        hf.register("attnlab_bad", "no_such_mechanism")


def test_t5_position_bias_is_added():
    """Note [HF position bias]: T5 passes its relative position bias as ``position_bias``, which had been dropped
    (logits 0.18 off eager). A tiny random T5 (no download), encoder and decoder: attnlab's logits against eager's
    within 4x sdpa's own distance from eager (float32 rounding, plus an eps floor), and the same greedy tokens
    through the decoder's cache (the steps take the bias as a float mask)."""
    import copy

    from transformers import T5Config, T5ForConditionalGeneration

    hf.register("attnlab")
    torch.manual_seed(0)
    cfg = T5Config(vocab_size=97, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                   relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    base = T5ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # a bias large enough to matter (T5's init is small)
        for m in base.modules():
            if getattr(m, "has_relative_attention_bias", False):
                m.relative_attention_bias.weight.normal_(0, 2.0)
    src, dec = torch.randint(3, 97, (2, 12)), torch.randint(3, 97, (2, 7))
    mask = torch.ones_like(src)
    mask[1, :3] = 0  # a padded row: the bias meets a bool mask
    out, toks = {}, {}
    for impl in ("eager", "sdpa", "attnlab"):
        m = copy.deepcopy(base)
        m.set_attn_implementation(impl)
        with torch.no_grad():
            out[impl] = m(input_ids=src, attention_mask=mask, decoder_input_ids=dec).logits
            toks[impl] = m.generate(src, attention_mask=mask, max_new_tokens=8, do_sample=False).tolist()
    spread = float((out["sdpa"] - out["eager"]).abs().max())
    floor = 16 * torch.finfo(torch.float32).eps * float(out["eager"].abs().max())
    err = float((out["attnlab"] - out["eager"]).abs().max())
    assert err <= 4 * spread + floor, (err, spread, floor)
    assert float((out["eager"] - out["eager"].mean()).abs().max()) > 100 * (4 * spread + floor)  # the bias matters
    assert toks["attnlab"] == toks["eager"]
