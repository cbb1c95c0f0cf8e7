"""Head statistics: exact on constructed attention patterns, and on MiniLM against Hugging Face weights."""
from __future__ import annotations

import json

import pytest
import torch

from attnlab.cli.main import main
from attnlab.diagnostics.heads import head_stats, label_head


def _synthetic():
    """One sequence [CLS] a b c d [SEP] [PAD]; head 0 -> previous token, 1 -> [CLS], 2 -> uniform, 3 -> self."""
    T, real = 7, 6
    am = torch.tensor([[1] * real + [0]])
    cls = torch.zeros(1, T, dtype=torch.bool)
    cls[0, 0] = True
    sep = torch.zeros(1, T, dtype=torch.bool)
    sep[0, 5] = True
    special = cls | sep | (am == 0)
    w = torch.zeros(1, 4, T, T, dtype=torch.float64)
    for i in range(T):
        w[0, 0, i, max(i - 1, 0)] = 1.0
        w[0, 1, i, 0] = 1.0
        w[0, 2, i, :real] = 1.0 / real
        w[0, 3, i, i] = 1.0
    return [w], am, special, cls, sep


def test_constructed_heads_get_exact_numbers_and_labels():
    stats = head_stats(*_synthetic())
    by = {s["head"]: s for s in stats}
    assert by[0]["prev"] == 1.0 and by[0]["mean_distance"] == 1.0 and by[0]["label"] == "previous-token"
    assert by[1]["cls"] == 1.0 and by[1]["label"] == "[CLS]"
    # query rows are the 4 word tokens (positions 1..4); distance to [CLS] is i
    assert by[1]["mean_distance"] == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert by[2]["norm_entropy"] == pytest.approx(1.0) and by[2]["label"] == "broad"
    assert by[2]["sep"] == pytest.approx(1 / 6) and by[2]["prev"] == pytest.approx(1 / 6)
    assert by[3]["same"] == 1.0 and by[3]["entropy"] == 0.0 and by[3]["label"] == "self"


def test_label_rules_fall_through_to_mixed():
    base = {"prev": 0.1, "next": 0.1, "same": 0.1, "cls": 0.1, "sep": 0.1, "norm_entropy": 0.5, "mean_distance": 3.0}
    assert label_head(base) == "mixed"
    assert label_head(base | {"mean_distance": 1.5}) == "local"
    assert label_head(base | {"sep": 0.6}) == "delimiter"


def test_minilm_heads_against_transformers(tmp_path):
    from test_trace_minilm import hf_model

    sents = ["The cat sat on the mat.", "Attention lets every token look at every other token."]
    out = tmp_path / "heads"
    assert main(["heads", "--sentence", sents[0], "--sentence", sents[1], "--out", str(out)]) == 0
    d = json.loads((out / "heads.json").read_text())
    assert (out / "heads.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(d["stats"]) == 6 * 12 and sum(d["counts"].values()) == 72

    hf, tok = hf_model()
    enc = tok(sents, return_tensors="pt", padding=True)
    with torch.no_grad():
        att = hf(**enc, output_attentions=True).attentions
    # previous-token attention recomputed by a plain loop over HF's weights
    for s in d["stats"][:24:5] + d["stats"][-3:]:
        li, h = s["layer"], s["head"]
        vals = []
        for b in range(2):
            n = int(enc["attention_mask"][b].sum())
            for i in range(1, n - 1):  # word pieces only, not [CLS] / [SEP]
                vals.append(float(att[li][b, h, i, i - 1]))
        assert s["prev"] == pytest.approx(sum(vals) / len(vals), abs=2e-5), (li, h)


def test_heads_bad_input(tmp_path, capsys):
    assert main(["heads", "--sentences", str(tmp_path / "none.txt"), "--out", str(tmp_path)]) == 2
    assert "not found" in capsys.readouterr().err
    (tmp_path / "empty.txt").write_text("\n  \n")
    assert main(["heads", "--sentences", str(tmp_path / "empty.txt"), "--out", str(tmp_path)]) == 2
    assert "empty" in capsys.readouterr().err
    assert main(["heads", "--sentence", "hi", "--layer", "6", "--out", str(tmp_path)]) == 2
    assert "--layer: must be an integer in [0, 5] (MiniLM has 6 layers)" in capsys.readouterr().err
