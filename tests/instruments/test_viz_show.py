"""attnlab.viz.show: any model's attention on the viz page (Hugging Face BertModel, raw tensors, capture),
its checks on shapes and values, the inline Jupyter form, and the distance histogram against a loop."""
from __future__ import annotations

import base64
import html
import json
import re

import numpy as np
import pytest
import torch

from attnlab import viz

Q8 = 0.5 / 255 + 1e-6  # the page stores weights in 8 bits: at most half a step off


def _embedded(page_html: str) -> dict:
    blob = re.search(r'<script id="attn-data" type="application/json">(.*?)</script>', page_html, re.S).group(1)
    return json.loads(blob)


def _dense(data, layer):
    T, H = data["T"], data["heads"]
    return np.frombuffer(base64.b64decode(data["dense"]["b64"][layer]), dtype=np.uint8).reshape(H, T, T) / 255.0


def _bert():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=120, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                  intermediate_size=37, max_position_embeddings=64, attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.BertModel(cfg).eval()


def test_bert_attentions_round_trip(tmp_path):
    model = _bert()
    ids = torch.randint(0, 120, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(input_ids=ids, output_attentions=True)
    assert len(out.attentions) == 3 and out.attentions[0].shape == (2, 4, 11, 11)
    tokens = ["[CLS]"] + [f"tok{i}" for i in range(9)] + ["[SEP]"]
    page = viz.show(out.attentions, tokens, batch_index=1)
    data = _embedded(page.html)  # what the browser gets, not the Python-side dict
    assert data["tokens"] == tokens and (data["layers"], data["heads"], data["T"]) == (3, 4, 11)
    for li, a in enumerate(out.attentions):
        got = _dense(data, li)
        assert np.abs(got - a[1].double().numpy()).max() <= Q8, li
    # the model output itself is accepted too, and batch 0 differs from batch 1
    d0 = _embedded(viz.show(out, tokens).html)
    assert np.abs(_dense(d0, 0) - out.attentions[0][0].numpy()).max() <= Q8
    assert not np.array_equal(_dense(d0, 0), _dense(data, 0))
    # saved page = the same html; inline form is an iframe holding the escaped page
    path = page.save(tmp_path / "bert.html")
    assert path.read_text() == page.html
    assert page.save(tmp_path / "dir").name == "index.html"
    rep = page._repr_html_()
    assert rep.startswith("<iframe srcdoc=\"") and html.unescape(rep.split('srcdoc="')[1].split('" sandbox')[0]) == page.html
    assert "<script" not in rep  # every tag of the page is escaped inside the attribute


def test_raw_tensors_and_numpy():
    g = torch.Generator().manual_seed(2)
    w = torch.softmax(torch.randn(2, 3, 6, 6, generator=g), -1)  # (layers, H, L, S)
    toks = list("abcdef")
    for att, layers, heads in ((w, 2, 3), (w[0], 1, 3), (w[0, 1], 1, 1), (w.numpy(), 2, 3),
                               (torch.stack([w, w]).transpose(0, 1), 2, 3), ([w[0, 0]], 1, 1)):
        d = viz.show(att, toks).data
        assert (d["layers"], d["heads"]) == (layers, heads)
    d = viz.show(w, toks).data
    assert np.abs(_dense(d, 1) - w[1].numpy()).max() <= Q8


@pytest.mark.parametrize("att, tokens, err, match", [
    (torch.softmax(torch.randn(1, 2, 5, 5), -1), list("abcd"), ValueError, r"5 positions .*tokens has 4"),
    (torch.randn(2, 5, 5) * 5, list("abcde"), ValueError, r"outside \[0, 1\].*not scores or logits"),
    (torch.softmax(torch.randn(2, 5, 7), -1), list("abcde"), ValueError, r"5 queries to 7 keys"),
    (torch.zeros(5), list("abcde"), ValueError, r"got a tensor of shape \[5\]"),
    ((torch.softmax(torch.randn(1, 2, 5, 5), -1),), "abcde", TypeError, r"one str"),
    ((torch.softmax(torch.randn(1, 2, 5, 5), -1),), list("abcde"), None, None),
    ((None,), list("abcde"), ValueError, r"attentions\[0\] is None"),
    ([], list("abcde"), ValueError, r"empty"),
    ("weights", list("abcde"), TypeError, r"got str"),
    (torch.full((2, 5, 5), float("nan")), list("abcde"), ValueError, r"NaN"),
])
def test_bad_input_is_named(att, tokens, err, match):
    if err is None:
        with pytest.raises(ValueError, match=r"batch_index=3 is out of range .* batch size 1"):
            viz.show(att, tokens, batch_index=3)
        return
    with pytest.raises(err, match=match):
        viz.show(att, tokens)


def test_layers_with_different_heads_and_none_output():
    a = torch.softmax(torch.randn(2, 4, 4), -1)
    b = torch.softmax(torch.randn(3, 4, 4), -1)
    with pytest.raises(ValueError, match="layer 0 has 2, layer 1 has 3"):
        viz.show([a, b], list("abcd"))

    class Out:
        attentions = None
    with pytest.raises(ValueError, match="output_attentions=True"):
        viz.show(Out(), list("abcd"))


def test_capture_result_is_accepted():
    from attnlab.capture import capture
    from attnlab.nn import MultiHeadAttention

    torch.manual_seed(3)
    mha = MultiHeadAttention(16, 2)
    x = torch.randn(1, 5, 16)
    with capture(mha) as cap:
        mha(x, x, x)
    page = viz.show(cap, list("vwxyz"))
    assert np.abs(_dense(page.data, 0) - cap.weights()[0][0].numpy()).max() <= Q8


def test_long_input_summaries_and_histogram_match_loops():
    g = torch.Generator().manual_seed(4)
    T, H = 150, 2
    w = torch.softmax(torch.randn(H, T, T, generator=g) * 3, -1)
    d = viz.show(w, [f"w{i}" for i in range(T)], dense_max_tokens=40, topk=3).data
    assert d["mode"] == "summary" and "dense" not in d
    idx = np.frombuffer(base64.b64decode(d["summary"]["idx"][0]), dtype="<u2").reshape(H, T, 3)
    top = w.topk(3, -1)
    assert np.array_equal(np.sort(idx, -1), np.sort(top.indices.numpy(), -1))
    # distance histogram: mean mass per query by |i - j| bin, by a plain loop
    edges = d["distance"]["edges"]
    assert edges == [0, 1, 2, 4, 8, 16, 32, 64, 128]
    ref = np.zeros((H, len(edges)))
    wn = w.double().numpy()
    for i in range(T):
        for j in range(T):
            b = max(e for e in range(len(edges)) if edges[e] <= abs(i - j))
            ref[:, b] += wn[:, i, j]
    assert np.allclose(np.array(d["distance"]["hist"][0]), ref / T, atol=1e-9)
    assert np.allclose(np.array(d["distance"]["hist"][0]).sum(-1), 1.0)
    assert d["head_stats"][0][1]["entropy"] == pytest.approx(float(-torch.xlogy(w[1], w[1]).sum(-1).mean()), rel=1e-5)


def test_cli_viz_out_defaults_to_reports(tmp_path, monkeypatch):
    from attnlab.cli.main import main

    monkeypatch.chdir(tmp_path)
    assert main(["viz", "The <cat> sat, on the mat!", "--model", "random"]) == 0
    page = tmp_path / "reports" / "viz" / "random-the-cat-sat-on-the-mat" / "index.html"
    assert page.is_file() and "&lt;cat&gt;" in page.read_text()


def _sdpa_bert():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=37, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.BertModel(cfg).eval()  # transformers' default implementation (sdpa)


def test_sdpa_output_says_what_to_pass_and_the_model_is_captured():
    """transformers >= 5 runs sdpa: out.attentions is () even with output_attentions=True. show() names both
    ways out, and show(model, tokens, inputs=...) catches the weights itself (equal to an eager run's)."""
    model = _sdpa_bert()
    enc = {"input_ids": torch.randint(0, 120, (1, 7), generator=torch.Generator().manual_seed(1))}
    tokens = [f"t{i}" for i in range(7)]
    with torch.no_grad():
        out = model(**enc, output_attentions=True)
    if out.attentions:
        pytest.skip("this transformers returns sdpa weights")
    for given in (out, out.attentions, [None]):
        with pytest.raises(ValueError) as e:
            viz.show(given, tokens)
        msg = str(e.value)
        assert "viz.show(model, tokens, inputs=enc)" in msg and 'attn_implementation="eager"' in msg
        assert "output_attentions=True" in msg
    page = viz.show(model, tokens, inputs=enc)
    assert model.config._attn_implementation == "sdpa"
    model.set_attn_implementation("eager")
    with torch.no_grad():
        ref = model(**enc, output_attentions=True).attentions
    for li, a in enumerate(ref):
        assert np.abs(_dense(page.data, li) - a[0].numpy()).max() <= Q8, li
    with pytest.raises(TypeError, match="pass inputs="):
        viz.show(model, tokens)
    with pytest.raises(TypeError, match="not a model"):
        viz.show(ref, tokens, inputs=enc)


def _dense_ls(data, layer):
    L, S, H = data["T"], data["S"], data["heads"]
    return np.frombuffer(base64.b64decode(data["dense"]["b64"][layer]), dtype=np.uint8).reshape(H, L, S) / 255.0


def test_cross_attention_and_sentence_pairs():
    g = torch.Generator().manual_seed(7)
    w = torch.softmax(torch.randn(2, 3, 5, 8, generator=g), -1)  # (layers, H, L=5, S=8)
    q, k = list("abcde"), [f"k{j}" for j in range(8)]
    page = viz.show(w, q, key_tokens=k)
    data = _embedded(page.html)
    assert (data["T"], data["S"], data["tokens"], data["key_tokens"]) == (5, 8, q, k)
    assert np.abs(_dense_ls(data, 1) - w[1].numpy()).max() <= Q8
    assert data["patterns"] == [] and "5 queries × 8 keys" in page.html
    with pytest.raises(ValueError, match="cross-attention needs key_tokens"):
        viz.show(w, q)
    with pytest.raises(ValueError, match="key_tokens 7"):
        viz.show(w, q, key_tokens=k[:7])
    # summaries of a long cross-attention: the top key per query is the argmax of its row
    wl = torch.softmax(torch.randn(1, 2, 3, 200, generator=g) * 4, -1)
    d = viz.show(wl, list("xyz"), key_tokens=[str(j) for j in range(200)], dense_max_tokens=50, topk=2).data
    top = np.frombuffer(base64.b64decode(d["summary"]["idx"][0]), dtype="<u2").reshape(2, 3, 2)[..., 0]
    assert (top == wl[0].argmax(-1).numpy()).all()
    # a sentence pair in one sequence: "AB" is sentence A's queries over sentence B's keys
    ws = torch.softmax(torch.randn(1, 2, 7, 7, generator=g), -1)
    toks = ["[CLS]", "a1", "a2", "[SEP]", "b1", "b2", "[SEP]"]
    ab = viz.show(ws, toks, sentence_b_start=4, pair="AB").data
    assert (ab["tokens"], ab["key_tokens"]) == (toks[:4], toks[4:])
    assert np.abs(_dense_ls(ab, 0) - ws[0, :, :4, 4:].numpy()).max() <= Q8
    whole = viz.show(ws, toks, sentence_b_start=4).data
    assert whole["sentence_b_start"] == 4 and whole["T"] == whole["S"] == 7
    with pytest.raises(ValueError, match="sentence_b_start must be an index in 1..6"):
        viz.show(ws, toks, sentence_b_start=7, pair="AB")
    with pytest.raises(ValueError, match="needs sentence_b_start"):
        viz.show(ws, toks, pair="BA")
    with pytest.raises(ValueError, match="pair must be one of"):
        viz.show(ws, toks, sentence_b_start=4, pair="AC")
