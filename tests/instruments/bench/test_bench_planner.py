"""Smoke run of `attnlab bench planner --quick` at toy size: the table's structure, its files and resume; never
its timings (only that each row's "fastest" is the minimum of the times it measured)."""
from __future__ import annotations

import json

import pytest

from attnlab.bench import planner as bench_planner
from attnlab.cli import main as cli

pytestmark = pytest.mark.usefixtures("one_thread")
FAST = ["--rounds", "1", "--min-sample-s", "0.001", "--budget-s", "5"]


def _check_rows(rows, n_expected):
    assert len(rows) == n_expected
    kinds = {r["kind"] for r in rows}
    assert kinds == set(bench_planner.KINDS)
    for r in rows:
        measured = {m: r["ms"][m] for m in bench_planner.METHODS if m in r["ms"]}
        assert set(measured) | set(r["refused"]) | set(r["skipped"]) == set(bench_planner.METHODS)
        assert not set(measured) & (set(r["refused"]) | set(r["skipped"])) and not set(r["refused"]) & set(r["skipped"])
        assert all(t > 0 for t in r["ms"].values()) and r["ms"]["auto"] > 0
        assert r["fastest"] == min(measured, key=measured.get)
        assert r["ratio"] == pytest.approx(r["ms"]["auto"] / measured[r["fastest"]])
        assert r["auto_pick"] in measured  # auto runs a kernel that accepts the inputs
        assert r["pick_ratio"] == pytest.approx(measured[r["auto_pick"]] / measured[r["fastest"]])
        assert r["pick_ratio"] >= 1.0
        if r["kind"] == "decode":
            assert r["L"] == 1 and r["S"] == r["n"]
    assert any(r["refused"] for r in rows)  # e.g. sparse on dense inputs: kept as "refused"


def test_quick_run_writes_the_table_and_the_summary(tmp_path):
    out = tmp_path / "run"
    assert cli.main(["bench", "planner", "--quick", *FAST, "--out", str(out)]) == 0
    data = json.loads((out / "results.json").read_text())
    rows = data["rows"]
    _check_rows(rows, len(bench_planner.quick_cases()))
    s = data["summary"]
    assert s["configs"] == len(rows)
    assert s["within_5pct"] == pytest.approx(sum(r["ratio"] <= bench_planner.TOLERANCE for r in rows) / len(rows))
    assert s["worst_ratio"] == max(r["ratio"] for r in rows)
    md = (out / "report.md").read_text()
    assert "| config | sdpa | compiled | tiled | sparse | auto | fastest | auto's pick | auto/fastest |" in md
    assert sum(line.startswith("| ") for line in md.splitlines()) == len(rows) + 1
    assert "refused" in md and "load average" in md
    assert (out / "planner.png").stat().st_size > 0
    assert not (out / "results.partial.json").exists()
    # the one --out rule: a used folder needs --force (or --resume)
    assert cli.main(["bench", "planner", "--quick", *FAST, "--out", str(out)]) == 2


def test_resume_keeps_what_a_killed_run_measured(tmp_path):
    cfg = bench_planner.PlannerConfig(out=str(tmp_path), quick=True, kinds=("dense", "decode"), rounds=1,
                                      min_sample_s=0.001, budget_s=5)
    first = bench_planner.run(cfg)
    # a killed run: its partial file holds the first row only
    store = bench_planner.ResultStore(tmp_path, sections=("rows",), context=cfg.settings(), resume=True)
    kept = json.loads((tmp_path / "results.json").read_text())["rows"][0]
    (tmp_path / "results.json").unlink()
    store.state["rows"] = []
    store.add(kept)
    cfg.resume = True
    again = bench_planner.run(cfg)
    assert any("kept 1 configuration" in n for n in again.notes)
    assert again.rows[0]["samples_ms"] == first.rows[0]["samples_ms"]  # kept, not re-timed
    assert [r["config"] for r in again.rows] == [r["config"] for r in first.rows]


def test_bad_options_are_one_line(tmp_path):
    assert cli.main(["bench", "planner", "--kinds", "dense,nope", "--out", str(tmp_path)]) == 2
    with pytest.raises(ValueError, match="--max-n"):
        bench_planner.PlannerConfig(max_n=8).validate()


def test_replay_re_decides_plain_rows_by_the_size_threshold_and_keeps_the_others():
    """The offline oracle: plain dense/causal rows follow the rates' threshold, other rows their recorded pick,
    each scored by the recorded times."""
    import dataclasses

    import torch

    from attnlab.kernels import rates

    def row(config, kind, n, Hkv, ms, pick="sdpa"):
        return {"config": config, "kind": kind, "dtype": "float32", "B": 1, "H": 8, "Hkv": Hkv, "L": n, "S": n,
                "ms": ms, "auto_pick": pick}

    rows = [row("small", "dense", 512, 8, {"sdpa": 1.0, "compiled": 1.2}),      # 8 x 512^2 = 2.1M pairs
            row("large", "dense", 2048, 8, {"sdpa": 1.3, "compiled": 1.0}),     # 33.6M pairs
            row("gqa", "causal", 1024, 2, {"sdpa": 1.2, "compiled": 1.0}),      # 8.4M pairs, GQA
            row("window", "window", 1024, 8, {"sdpa": 3.0, "compiled": 1.0, "sparse": 1.1}, pick="sparse")]
    b = rates.builtin()
    r = dataclasses.replace(b, compiled_dense_min_pairs={(torch.float32, False): 1e7, (torch.float32, True): 1e7},
                            compiled_gqa_min_pairs={(torch.float32, True): 4e6})
    out = bench_planner.replay(rows, r)
    assert out["configs"] == 4 and out["misses"] == [("window", "sparse", 1.1)]
    assert out["pick_within_5pct"] == pytest.approx(3 / 4)
    never = dataclasses.replace(r, compiled_gqa_min_pairs={(torch.float32, True): None})
    assert [m[0] for m in bench_planner.replay(rows, never)["misses"]] == ["gqa", "window"]
