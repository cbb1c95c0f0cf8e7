"""attnlab experiment approximation: smoke run at toy size (its outputs, never its timings) and its metrics."""
from __future__ import annotations

import json
import math

import torch

from attnlab.cli import main as cli
from attnlab.experiments import approximation as A


def test_metrics_against_hand_computed_values():
    ref_out = torch.tensor([[[[1.0, 0.0], [0.0, 2.0]]]], dtype=torch.float64)
    w_ref = torch.tensor([[[[0.5, 0.5], [0.25, 0.75]]]], dtype=torch.float64)
    out = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]])
    w = torch.tensor([[[[1.0, 0.0], [0.25, 0.75]]]])
    e = A.errors(out, w, ref_out, w_ref)
    assert math.isclose(e["rel_fro"], 1.0 / math.sqrt(5.0), rel_tol=1e-12)
    assert math.isclose(e["cosine"], 1.0, rel_tol=1e-12)
    # KL(w || w_ref): row 0 = 1·log(1/0.5), row 1 = 0
    assert math.isclose(e["kl"], math.log(2.0) / 2, rel_tol=1e-12)
    assert A.errors(out, -w, ref_out, w_ref)["kl"] is None  # negative weights: KL undefined


def test_pareto_keeps_only_undominated_points():
    pts = [{"time_s": 1, "rel_fro": 0.5}, {"time_s": 2, "rel_fro": 0.1}, {"time_s": 3, "rel_fro": 0.2},
           {"time_s": 0.5, "rel_fro": 0.9}, {"time_s": 2, "rel_fro": 0.1}]
    front = A.pareto(pts)
    assert [(p["time_s"], p["rel_fro"]) for p in front] == [(0.5, 0.9), (1, 0.5), (2, 0.1), (2, 0.1)]


def test_exact_limits_show_zero_error_in_the_experiment_metrics():
    """At a budget that covers the sequence, the experiment's own measurement reports ~0 error."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 24, 8, generator=g) for _ in range(3))
    rows, _ = A.measure_inputs(q, k, v, [("hierarchical", "hierarchical", {"block_size": 24}, "block_size", 24),
                                         ("token_pruning", "token_pruning", {"keep_ratio": 1.0}, "keep_ratio", 1.0),
                                         ("linear", "linear", {}, "feature_map", "elu+1")], timed=False)
    by = {r["mechanism"]: r for r in rows}
    assert by["hierarchical"]["rel_fro"] < 1e-5 and by["token_pruning"]["rel_fro"] < 1e-5
    assert abs(by["hierarchical"]["kl"]) < 1e-6 and by["hierarchical"]["cosine"] > 1 - 1e-6
    assert by["linear"]["rel_fro"] > 0.05  # a real approximation is not reported as exact


def test_quick_run_writes_json_plots_and_report(tmp_path):
    out = tmp_path / "approx"
    code = cli.main(["experiment", "approximation", "--quick", "--out", str(out), "--n", "32", "--heads", "1",
                     "--head-dim", "16", "--speed-n", "128", "--minilm-tokens", "12", "--no-progress"])
    assert code == 0
    res = json.loads((out / "results.json").read_text())
    labels = {r["mechanism"] for r in res["random"]}
    assert labels == set(A.GRID)
    for r in res["random"]:
        assert r["time_s"] > 0 and 0 <= r["rel_fro"] and -1 <= r["cosine"] <= 1
        assert r["speedup_vs_sdpa"] > 0
    h = res["headline"]
    assert h["n"] == 128 and h["full"]["ratio"] > 0 and h["causal"]["ratio"] > 0
    report = (out / "report.md").read_text()
    assert "frontier" in report and "linear attention vs PyTorch SDPA" in report
    assert (out / "frontier_random.png").stat().st_size > 1000
    assert (out / "error_vs_budget_random.png").stat().st_size > 1000
    if res["minilm"]:  # MiniLM (contract 3) present: every layer measured
        assert {r["layer"] for r in res["minilm"]} == set(range(6))
        assert (out / "error_vs_budget_minilm.png").exists() and (out / "frontier_minilm.png").exists()
        assert all(r["time_s"] > 0 for r in res["minilm"] if r["layer"] == 0)
    else:
        assert res["minilm_error"]


def test_bad_arguments_are_usage_errors(capsys, tmp_path):
    assert cli.main(["experiment", "approximation", "--quick", "--n", "0", "--out", str(tmp_path)]) == 2
    assert "--n" in capsys.readouterr().err
