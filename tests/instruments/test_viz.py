"""attnlab.viz: heatmaps, page data (dense and streamed) against float64 recomputation, escaping, CLI."""
from __future__ import annotations

import base64
import json
import math
import re

import numpy as np
import pytest
import torch
from helpers import assert_close

from attnlab import patterns as P
from attnlab import reference
from attnlab import viz
from attnlab.cli.main import main
from attnlab.diagnostics import scale_sweep
from attnlab.viz.data import _RandomEncoder

PNG = b"\x89PNG\r\n\x1a\n"
Q8 = 0.5 / 255 + 1e-6  # quantisation step of the page's 8-bit weights


def _dense(data, layer):
    T, H = data["T"], data["heads"]
    return np.frombuffer(base64.b64decode(data["dense"]["b64"][layer]), dtype=np.uint8).reshape(H, T, T) / 255.0


def _random_layers(tokens, seed=0):
    """(q, k) per layer of the random toy model recomputed with the float64 reference."""
    m = _RandomEncoder(seed)
    x = m.embed(tokens)
    out = []
    for i in range(m.num_layers):
        q, k, v = m.layer_qkv(x, i)
        o, w = reference.attention(q, k, v)
        out.append((q[0], k[0], torch.from_numpy(w[0])))
        x = m.next_x(x, torch.from_numpy(o).float(), i)
    return out


def test_png_heatmaps(tmp_path):
    w = torch.softmax(torch.randn(3, 5, 5), -1)
    for path in (viz.plot_heads(w, tmp_path / "h.png", tokens=list("abcde")),
                 viz.plot_patterns({"causal": P.causal(), "window": P.sliding_window(2)}, 17, tmp_path / "p.png"),
                 viz.plot_diagnostics(scale_sweep(d_ks=(4, 16), seq_len=8), tmp_path / "d.png")):
        assert path.read_bytes()[:8] == PNG and path.stat().st_size > 1000
    with pytest.raises(ValueError, match="weights must be"):
        viz.plot_heads(torch.zeros(2, 2, 2, 2), tmp_path / "x.png")


def test_pattern_cost_counts_pairs():
    c = viz.pattern_cost(P.causal(), 17, E=8)
    assert c["density"] == pytest.approx(17 * 18 / 2 / 17**2)
    assert c["flops"] == 2 * (17 * 18 // 2) * 16 and c["flops_saved"] == pytest.approx(1 - c["density"])


def test_dense_page_data_matches_reference():
    text = "the cat sat on the mat , the end"
    data = viz.attention_data(text, model="random")
    assert data["mode"] == "dense" and data["tokens"] == viz.tokenize_words(text)
    layers = _random_layers(data["tokens"])
    for li, (_, _, w) in enumerate(layers):
        assert_close(_dense(data, li), w, Q8 + 2e-6, what=f"layer {li} weights")
    # head statistics are of the same weights
    w00 = layers[0][2][0]
    assert data["head_stats"][0][0]["entropy"] == pytest.approx(float(-torch.xlogy(w00, w00).sum(-1).mean()), abs=1e-4)


def test_long_input_switches_to_streaming_summaries():
    tokens = [f"w{i % 23}" for i in range(150)]
    data = viz.attention_data(" ".join(tokens), model="random", dense_max_tokens=40, topk=3)
    assert data["mode"] == "summary" and "dense" not in data
    s = data["summary"]
    T, H, k = 150, data["heads"], s["k"]
    for li, (_, _, w) in enumerate(_random_layers(tokens)):
        idx = np.frombuffer(base64.b64decode(s["idx"][li]), dtype="<u2").reshape(H, T, k)
        wts = np.frombuffer(base64.b64decode(s["w"][li]), dtype=np.uint8).reshape(H, T, k) / 255.0
        top = w.topk(k, dim=-1)
        for h in range(H):
            for i in (0, 77, 149):
                assert set(idx[h, i].tolist()) == set(top.indices[h, i].tolist()), (li, h, i)
                assert_close(np.sort(wts[h, i]), np.sort(top.values[h, i].numpy()), Q8 + 1e-5, what="top-k weights")
    assert any("streaming summaries" in n for n in data["notes"])


def test_page_escapes_user_text_and_needs_no_network():
    text = '</script><script>alert("x")</script> & <img src=x onerror=alert(1)> "q"'
    data = viz.attention_data(text, model="random")
    page = viz.render_page(data)
    assert page.count("<script") == 2 and "alert(\"x\")</script>" not in page
    assert "<img src=x" not in page and "&lt;img src=x onerror=alert(1)&gt;" in page
    blob = re.search(r'<script id="attn-data" type="application/json">(.*?)</script>', page, re.S).group(1)
    assert json.loads(blob)["text"] == text  # the data survives escaping intact
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert "default-src 'none'" in page  # CSP: the page may not fetch anything


def test_mechanism_pattern_shown_with_density():
    data = viz.attention_data("a b c d e f g h i j", model="random", mechanism="sliding_window", params={"window": 2})
    first = data["patterns"][0]
    assert first["name"].startswith("sliding_window") and first["density"] == pytest.approx(P.sliding_window(2).density(10, 10))
    grid = np.frombuffer(base64.b64decode(first["grid"]), dtype=np.uint8).reshape(10, 10)
    assert np.array_equal(grid > 0, P.sliding_window(2).materialize(10, 10).numpy())
    w = _dense(data, 0)
    assert (w[:, ~P.sliding_window(2).materialize(10, 10).numpy()] == 0).all()  # masked pairs get no weight


def test_cli_viz(tmp_path, capsys):
    out = tmp_path / "v"
    assert main(["viz", "Hello <world> & friends", "--model", "random", "--out", str(out), "--png"]) == 0
    page = (out / "index.html").read_text()
    assert "Hello &lt;world&gt; &amp; friends" in page and (out / "heads.png").read_bytes()[:8] == PNG
    for argv, needle in ((["   "], "empty"), (["hi", "--mechanism", "nope"], "unknown mechanism"),
                         (["hi", "--param", "window=2"], "--param needs --mechanism"),
                         (["hi", "--mechanism", "sliding_window", "--param", "size=2"], "size")):
        assert main(["viz", *argv, "--model", "random", "--out", str(tmp_path / "bad")]) == 2, argv
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err


def test_minilm_page_weights_match_model():
    from attnlab.trace.minilm import load_minilm

    m = load_minilm()
    text = "Attention is all you need."
    data = viz.attention_data(text, model="minilm")
    enc = m.tokenize(text)
    from attnlab.capture import capture

    with torch.no_grad(), capture(m) as cap:  # capture hooks on the real model
        out = m.forward(enc["input_ids"], enc["attention_mask"])
    att = cap.weights()
    assert out.attentions is None and len(att) == 6 and cap.names[0] == "layers.0.self_attn"
    assert data["tokens"] == enc["tokens"][0] and data["layers"] == 6 and data["heads"] == 12
    for li in (0, 5):
        assert_close(_dense(data, li), att[li][0], Q8 + 1e-6, what=f"layer {li}")
    assert math.isfinite(data["head_stats"][3][7]["entropy"])


def test_an_interrupted_png_run_leaves_no_marker(tmp_path, monkeypatch, capsys):
    """index.html is the run's marker, written last: a Ctrl-C while heads.png was drawn had left index.html alone,
    and the rerun the message suggests was refused as an earlier run. Now nothing marks the folder, and the same
    command runs again."""
    import attnlab.viz.build as B

    out = tmp_path / "v"
    real = B.plot_heads

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(B, "plot_heads", interrupted)
    assert main(["viz", "the cat sat", "--model", "random", "--out", str(out), "--png"]) == 130
    assert not (out / "index.html").exists()
    monkeypatch.setattr(B, "plot_heads", real)
    assert main(["viz", "the cat sat", "--model", "random", "--out", str(out), "--png"]) == 0
    assert (out / "index.html").exists() and (out / "heads.png").read_bytes()[:8] == PNG
