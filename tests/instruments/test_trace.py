"""attnlab.trace and `attnlab trace`: every step checked against independent computations
(float64 reference, torch.softmax, nn.MultiheadAttention)."""
from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest
import torch
from helpers import assert_close

from attnlab import reference
from attnlab import trace as tr
from attnlab.cli.main import main

ATOL = 1e-12


def _w(step):
    return np.asarray(step.value, dtype=np.float64)


def test_example_steps_match_reference_and_are_ordered():
    t = tr.trace_example(seed=3)
    assert t.names() == ["X", "W_Q", "W_K", "W_V", "Q", "K", "V", "scores", "scaled", "masked", "weights",
                         "output", "concat", "W_O", "projected"]
    inp = tr.example_inputs(seed=3)
    assert t.labels == ["I", "love", "machine", "learning"]
    assert inp["X"].shape == (4, 8) and inp["W_Q"].shape == (8, 4)
    q, k, v = (inp["X"] @ inp[n] for n in ("W_Q", "W_K", "W_V"))
    assert_close(_w(t.step("Q")), q, ATOL, what="Q")
    assert_close(_w(t.step("scores")), q @ k.T, ATOL, what="scores")
    assert_close(_w(t.step("scaled")), q @ k.T / 2.0, ATOL, what="scaled = scores / sqrt(4)")
    out, w = reference.attention(q, k, v)
    assert_close(_w(t.step("weights")), w, ATOL, what="weights")
    assert_close(_w(t.step("output")), out, ATOL, what="output")
    assert_close(_w(t.step("projected")), out @ inp["W_O"], ATOL, what="projected")
    assert_close(_w(t.step("weights")).sum(-1), np.ones(4), 1e-12, what="row sums")
    # shapes of the tutorial's summary table
    assert t.step("X").shape == (4, 8) and t.step("Q").shape == (4, 4) and t.step("weights").shape == (4, 4)


def test_example_seed_changes_numbers_and_is_repeatable():
    a, b, c = tr.trace_example(seed=1), tr.trace_example(seed=1), tr.trace_example(seed=2)
    assert np.array_equal(_w(a.step("weights")), _w(b.step("weights")))
    assert not np.array_equal(_w(a.step("X")), _w(c.step("X")))


def test_two_head_example_equals_torch_multihead_attention():
    t = tr.trace_example(seed=0, num_heads=2)
    inp = tr.example_inputs(seed=0, num_heads=2)
    mha = torch.nn.MultiheadAttention(8, 2, bias=False, batch_first=True).double()
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.tensor(np.concatenate([inp["W_Q"].T, inp["W_K"].T, inp["W_V"].T])))
        mha.out_proj.weight.copy_(torch.tensor(inp["W_O"].T))
    x = torch.tensor(inp["X"])[None]
    out, w = mha(x, x, x, need_weights=True, average_attn_weights=False)
    assert t.step("weights").per_head and t.step("weights").shape == (2, 4, 4)
    assert_close(_w(t.step("weights")), w[0], 1e-12, what="per-head weights vs nn.MultiheadAttention")
    assert_close(_w(t.step("projected")), out[0], 1e-12, what="projected vs nn.MultiheadAttention")
    assert t.step("concat").shape == (4, 8)


def test_scores_start_matches_torch_softmax():
    s = [[1.2, 0.8, 0.5, 0.9], [0.6, 1.5, 0.3, 0.7], [0.4, 0.7, 1.8, 0.6], [1.1, 0.9, 0.4, 1.6]]
    t = tr.trace_scores(s, d_k=4)
    expect = torch.softmax(torch.tensor(s, dtype=torch.float64) / math.sqrt(4), dim=-1)
    assert_close(_w(t.step("scaled")), np.array(s) / 2, ATOL, what="scaled")
    assert_close(_w(t.step("weights")), expect, 1e-12, what="weights")
    assert "output" not in t.names()


def test_causal_mask_and_json_nulls(tmp_path):
    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(5, 3)), rng.normal(size=(5, 3)), rng.normal(size=(5, 2))
    for name, a in (("q", q), ("k", k)):
        np.save(tmp_path / f"{name}.npy", a)
    (tmp_path / "v.json").write_text(json.dumps(v.tolist()))
    out = tmp_path / "t.json"
    code = main(["trace", "--q", str(tmp_path / "q.npy"), "--k", str(tmp_path / "k.npy"), "--v",
                 str(tmp_path / "v.json"), "--causal", "--format", "json", "--out", str(out)])
    assert code == 0
    d = json.loads(out.read_text())
    ref_out, ref_w = reference.attention(q, k, v, is_causal=True)
    assert_close(np.array(d["steps"]["weights"]["value"]), ref_w, 1e-12, what="causal weights")
    assert_close(np.array(d["steps"]["output"]["value"]), ref_out, 1e-12, what="causal output")
    masked = d["steps"]["masked"]["value"]
    assert masked[0][1] is None and masked[1][0] is not None  # -inf written as null
    assert d["order"].index("scores") < d["order"].index("scaled") < d["order"].index("weights") < d["order"].index("output")


def test_cli_scores_json_stable_names(capsys):
    code = main(["trace", "--scores", "[[1.2,0.8],[0.6,1.5]]", "--d-k", "4", "--format", "json"])
    assert code == 0
    d = json.loads(capsys.readouterr().out)
    for name in ("scores", "scaled", "weights"):
        assert name in d["steps"], name
    expect = torch.softmax(torch.tensor([[1.2, 0.8], [0.6, 1.5]], dtype=torch.float64) / 2, dim=-1)
    assert_close(np.array(d["steps"]["weights"]["value"]), expect, 1e-12, what="weights")
    assert d["options"] == {"scale": "sqrt", "softmax": True, "cosine": False, "causal": False}


def test_scale_modes_divide_by_1_sqrt_dk_and_dk():
    rng = np.random.default_rng(1)
    q, k = rng.normal(size=(4, 16)), rng.normal(size=(6, 16))
    raw = q @ k.T
    for mode, div in (("none", 1.0), ("sqrt", 4.0), ("dk", 16.0)):
        t = tr.trace_qkv(q, k, options=tr.TraceOptions(scale=mode))
        assert_close(_w(t.step("scaled")), raw / div, 1e-12, what=f"scale={mode}")


def test_no_scale_saturates_at_large_dk_and_comparison_says_so():
    rng = np.random.default_rng(2)
    q, k, v = rng.normal(size=(32, 256)), rng.normal(size=(32, 256)), rng.normal(size=(32, 8))
    t = tr.trace_qkv(q, k, v, options=tr.TraceOptions(scale="none"))
    base = tr.trace_qkv(q, k, v)
    sat_none = t.step("weights").stats["saturated_fraction"]
    sat_sqrt = base.step("weights").stats["saturated_fraction"]
    assert sat_none >= 0.3 and sat_sqrt == 0.0
    assert t.step("weights").stats["mean_max_weight"] > 0.8 > 0.5 > base.step("weights").stats["mean_max_weight"]
    rows = {r["measure"]: r for r in t.comparison}
    g = rows["gradient norm reaching scores (mean)"]
    assert g["scale=none"] < g["standard"]
    assert rows["saturated rows (max ≥ 0.99)"]["scale=none"] == pytest.approx(sat_none)


def test_no_softmax_weights_are_the_scaled_scores():
    rng = np.random.default_rng(3)
    q, k, v = rng.normal(size=(4, 4)), rng.normal(size=(5, 4)), rng.normal(size=(5, 3))
    t = tr.trace_qkv(q, k, v, options=tr.TraceOptions(softmax=False))
    w = q @ k.T / 2
    assert_close(_w(t.step("weights")), w, 1e-12, what="weights without softmax")
    assert_close(_w(t.step("output")), w @ v, 1e-12, what="output without softmax")
    assert (w < 0).any() and t.step("weights").stats["negative_fraction"] > 0
    assert any("no longer a weighted average" in n for n in t.notes)


def test_cosine_ignores_magnitude():
    rng = np.random.default_rng(4)
    q, k = rng.normal(size=(3, 4)), rng.normal(size=(5, 4))
    opts = tr.TraceOptions(cosine=True)
    a = tr.trace_qkv(q, k, options=opts)
    b = tr.trace_qkv(q * np.array([[10.0], [0.1], [3.0]]), k * 7.0, options=opts)
    assert_close(_w(a.step("weights")), _w(b.step("weights")), 1e-12, what="cosine weights under rescaling")
    qn = q / np.linalg.norm(q, axis=1, keepdims=True)
    kn = k / np.linalg.norm(k, axis=1, keepdims=True)
    assert_close(_w(a.step("scores")), qn @ kn.T, 1e-12, what="cosine scores")
    rows = {r["measure"]: r for r in a.comparison}
    assert rows["change in row 0 when |q_0| is ×10"]["scale=sqrt, cosine"] < 1e-12
    assert rows["change in row 0 when |q_0| is ×10"]["standard"] > 1e-3


def test_summary_shapes_flops_bytes_and_variance():
    t = tr.trace_summary(256, 96, 4, seed=0)
    E, L, H, D = 64, 96, 4, 256
    s = {st.name: st for st in t.steps}
    assert s["scores"].shape == (1, H, L, L) and s["Q"].shape == (1, H, L, E) and s["projected"].shape == (1, L, D)
    assert s["scores"].flops == 2 * H * L * L * E and s["output"].flops == 2 * H * L * L * E
    assert s["Q"].flops == 2 * L * D * D
    assert s["weights"].bytes == H * L * L * 4
    # Var(q·k) = d_k for unit-variance q, k: a statistical check on one seeded draw (±30%)
    assert 0.7 * E < s["scores"].stats["var"] < 1.3 * E
    assert 0.7 < s["scaled"].stats["var"] < 1.3
    assert s["weights"].stats["mean_entropy"] <= math.log(L) + 1e-9
    assert t.meta["score_matrix_bytes_per_layer"] == H * L * L * 4


def test_summary_samples_rows_for_long_inputs():
    t = tr.trace_summary(64, 3000, 2, sample_rows=64)
    assert t.meta["stats_rows_sampled"] == 64
    assert t.step("scores").shape == (1, 2, 3000, 3000)
    assert t.step("weights").stats["mean_max_weight"] > 0


def test_summary_note_states_bytes_in_the_tables_units():
    """The note under the table gave 4.366e+05 TiB where the table says 426.3 PiB: one formatter for both."""
    t = tr.trace_summary(768, 100_000_000, 12)
    note = next(n for n in t.notes if "score tensor holds" in n)
    assert "426.3 PiB" in note and "e+" not in note, note


def test_renderers_escape_labels_and_cut_large_matrices():
    rng = np.random.default_rng(5)
    labels = ["<b>x</b>", "a|b", "c", "d"]
    t = tr.trace_qkv(rng.normal(size=(4, 20)), rng.normal(size=(4, 20)), labels=labels)
    h = tr.to_html(t)
    assert "<b>x</b>" not in h and "&lt;b&gt;x&lt;/b&gt;" in h
    md = tr.to_markdown(t, max_show=5)
    assert "a\\|b" in md and "…" in md  # 20 columns cut to 5
    assert "<b>" not in md  # the tokens line too (it had been raw)
    c = tr.check_table("# <b>x</b>\n[[0.3, 0.7],[0.6, 0.4]]", tr.trace_qkv(np.eye(2), np.eye(2), np.eye(2),
                                                                        labels=["<b>x</b>", "y"]))
    cm = tr.check_markdown(c)
    assert "<b>" not in cm and "&lt;b&gt;x&lt;/b&gt;" in cm
    from rich.console import Console

    buf = io.StringIO()
    Console(file=buf, width=200).print(tr.to_rich(t))
    assert "weights" in buf.getvalue()
    d = json.loads(tr.to_json(t))
    assert len(d["steps"]["Q"]["value"][0]) == 20  # JSON keeps everything


@pytest.mark.parametrize("argv, needle", [
    (["--scores", "[[1,2],[3]]", "--d-k", "2"], "not rectangular"),
    (["--scores", "[[1,2],[3,"], "JSON matrix"),
    (["--scores", "[]", "--d-k", "2"], "empty"),
    (["--scores", "[[1, NaN]]", "--d-k", "2"], "NaN"),
    (["--scores", "[[1,2]]"], "--d-k"),
    (["--q", "[[1,2]]", "--k", "[[1,2,3]]"], "same number of columns"),
    (["--q", "[[1,2]]", "--k", "[[1,2]]", "--v", "[[1],[2]]"], "one row per key"),
    (["--q", "[[1,2]]"], "go together"),
    (["--q", "missing.npy", "--k", "[[1,2]]"], "not found"),
    (["--example", "--scores", "[[1]]"], "choose one"),
    (["--example", "--heads", "3"], "--heads"),
    (["--scores", "[[1,2]]", "--d-k", "0"], "--d-k"),
    (["--scores", "[[1,2]]", "--d-k", "2", "--cosine"], "cosine"),
])
def test_bad_input_exit_2_without_traceback(argv, needle, capsys):
    code = main(["trace", *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert needle in err and "Traceback" not in err


def test_npy_with_three_dims_is_refused(tmp_path, capsys):
    np.save(tmp_path / "q.npy", np.zeros((2, 2, 2)))
    assert main(["trace", "--q", str(tmp_path / "q.npy"), "--k", "[[1,2]]"]) == 2
    assert "2-D" in capsys.readouterr().err


def test_cli_formats_and_failure_switches(tmp_path, capsys):
    for fmt in ("markdown", "html", "rich"):
        out = tmp_path / f"t.{fmt}"
        assert main(["trace", "--example", "--scale", "none", "--format", fmt, "--out", str(out)]) == 0
        text = out.read_text()
        assert "what changes vs standard attention" in text
    assert main(["trace", "--example", "--heads", "2", "--format", "json", "--png", str(tmp_path / "w.png")]) == 0
    assert (tmp_path / "w.png").read_bytes()[:4] == b"\x89PNG"
    capsys.readouterr()
    assert main(["trace", "--summary", "--d-model", "64", "--seq-len", "32", "--heads", "2", "--format", "json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["source"] == "summary" and d["steps"]["scores"]["shape"] == [1, 2, 32, 32]
