"""`attnlab trace --text` on MiniLM, checked against Hugging Face transformers' BertModel."""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from helpers import assert_close

from attnlab import trace as tr
from attnlab.cli.main import main

TEXT = "The cat sat on the mat because it was tired."


@functools.lru_cache(maxsize=1)
def hf_model():
    """Hugging Face's BertModel on the same checkpoint: the independent oracle (loaded once per process)."""
    from transformers import BertModel, BertTokenizerFast

    from attnlab.models.minilm import model_path

    path = str(model_path())
    return BertModel.from_pretrained(path, attn_implementation="eager").eval(), BertTokenizerFast.from_pretrained(path)


@pytest.fixture(scope="module")
def hf():
    return hf_model()


def test_text_trace_matches_transformers(hf):
    model, tok = hf
    layer, head = 2, 5
    t = tr.trace_text(TEXT, layer=layer, head=head)
    enc = tok(TEXT, return_tensors="pt")
    assert t.labels == tok.convert_ids_to_tokens(enc["input_ids"][0])
    captured = {}
    dense = model.encoder.layer[layer].attention.output.dense  # W_O, before residual + LayerNorm
    hook = dense.register_forward_hook(lambda m, i, o: captured.setdefault("y", o.detach()))
    try:
        with torch.no_grad():
            out = model(**enc, output_attentions=True)
    finally:
        hook.remove()
    assert_close(np.asarray(t.step("weights").value), out.attentions[layer][0, head], 2e-5, what="weights vs HF")
    assert_close(np.asarray(t.step("projected").value), captured["y"][0], 2e-4, what="W_O output vs HF")
    w = np.asarray(t.step("weights").value)
    assert_close(w.sum(-1), np.ones(w.shape[0]), 1e-9, what="row sums")
    assert t.step("Q").shape == (len(t.labels), 32) and t.step("concat").shape == (len(t.labels), 384)


@pytest.mark.parametrize("argv, needle", [
    (["--text", TEXT, "--layer", "6"], "--layer: must be an integer in [0, 5] (MiniLM has 6 layers), got '6'"),
    (["--text", TEXT, "--head", "12"], "--head: must be an integer in [0, 11] (MiniLM has 12 heads per layer), got '12'"),
    (["--text", "   "], "empty"),
])
def test_text_bad_input(argv, needle, capsys):
    assert main(["trace", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_text_cli_json(tmp_path):
    out = tmp_path / "t.json"
    assert main(["trace", "--text", "I love machine learning", "--layer", "0", "--head", "2", "--format", "json",
                 "--out", str(out)]) == 0
    import json

    d = json.loads(out.read_text())
    assert d["labels"][0] == "[CLS]" and d["labels"][-1] == "[SEP]"
    assert d["meta"]["layer"] == 0 and d["meta"]["head"] == 2
    assert_close(np.array(d["steps"]["weights"]["value"]), np.array(d["meta"]["model_weights"]), 2e-5,
                 what="trace weights vs the model's own output_attentions")
