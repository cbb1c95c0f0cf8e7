"""Smoke run of `attnlab bench planner --quick` at toy size: the table's structure, its files and resume; never
its timings (only that each row's "fastest" is the minimum of the times it measured, and that its ratios are the
arithmetic of its samples). The ratios' arithmetic on synthetic timings: ``test_ratios_*``, ``test_summary_*``."""
from __future__ import annotations

import json
import statistics

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
        assert r["raw_ratio"] == pytest.approx(r["ms"]["auto"] / measured[r["fastest"]])
        assert r["auto_pick"] in measured  # auto runs a kernel that accepts the inputs
        assert r["pick_ratio"] == pytest.approx(measured[r["auto_pick"]] / measured[r["fastest"]])
        assert r["pick_ratio"] >= 1.0
        # auto was timed paired with its pick: one sample each per round, the ratio the median of their quotients
        a, p = r["samples_ms"]["auto"], r["samples_ms"][r["auto_pick"]]
        assert len(a) == len(p) == len(r["samples_ms"][r["fastest"]])
        assert r["auto_over_pick"] == pytest.approx(statistics.median(x / y for x, y in zip(a, p)))
        assert r["ratio"] == pytest.approx(r["auto_over_pick"] * r["pick_ratio"])
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
    assert s["raw_within_5pct"] == pytest.approx(sum(r["raw_ratio"] <= bench_planner.TOLERANCE for r in rows) / len(rows))
    assert s["paired_configs"] == len(rows)
    assert data["settings"]["format"] == bench_planner.FORMAT
    md = (out / "report.md").read_text()
    assert ("| config | sdpa | compiled | decode | tiled | sparse | auto | fastest | auto's pick | auto/fastest | pick/fastest "
            "| auto/pick paired | auto/fastest raw |") in md
    assert "auto / its pick, paired in each round" in md and "by auto's separate median" in md
    assert "](planner.png)" in md and (out / "planner.png").exists()  # the report shows its plot
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


def test_a_row_of_the_unpaired_format_is_measured_again(tmp_path):
    """Format 1 (auto's separate median only, no "format" in its settings) is not resumed: it has no paired figure."""
    cfg = bench_planner.PlannerConfig(out=str(tmp_path), quick=True, kinds=("decode",), rounds=1,
                                      min_sample_s=0.001, budget_s=5)
    old = {k: v for k, v in cfg.settings().items() if k != "format"}
    store = bench_planner.ResultStore(tmp_path, sections=("rows",), context=old)
    case = cfg.cases()[0]
    store.add({"config": case.label, "samples_ms": {"auto": [123.0]}}, job=bench_planner.asdict(case))
    cfg.resume = True
    again = bench_planner.run(cfg)
    assert not any("kept" in n for n in again.notes)
    assert again.rows[0]["samples_ms"]["auto"] != [123.0] and again.rows[0]["auto_over_pick"] is not None


def _synthetic(ms, pick, over=None, config="c"):
    return {"config": config, "ms": ms, "auto_pick": pick, "auto_over_pick": over}


def test_ratios_multiply_the_paired_auto_over_pick_by_pick_over_fastest():
    row = _synthetic({"sdpa": 2.0, "compiled": 1.6, "tiled": 3.0, "auto": 2.4}, "sdpa", over=1.02)
    out = bench_planner.ratios(row)
    assert out["fastest"] == "compiled"
    assert out["pick_ratio"] == pytest.approx(2.0 / 1.6)
    assert out["raw_ratio"] == pytest.approx(2.4 / 1.6)  # auto's own median carries its rounds' noise
    assert out["ratio"] == pytest.approx(1.02 * 2.0 / 1.6)
    # unpaired (the pick is no kernel of METHODS, e.g. dense): the separate medians
    row = _synthetic({"sdpa": 2.0, "compiled": 1.6, "auto": 1.7}, "dense")
    out = bench_planner.ratios(row)
    assert out["pick_ratio"] is None and out["ratio"] == pytest.approx(1.7 / 1.6) == out["raw_ratio"]


def test_summary_counts_paired_raw_and_pick_figures_separately():
    rows = []
    for config, ms, pick, over in [
            ("a", {"sdpa": 1.0, "compiled": 1.5, "auto": 1.2}, "sdpa", 1.01),    # raw 1.2 misses, paired 1.01 in
            ("b", {"sdpa": 1.1, "compiled": 1.0, "auto": 1.1}, "sdpa", 1.0),     # pick 1.1 misses
            ("c", {"sdpa": 1.0, "compiled": 2.0, "auto": 1.0}, "sdpa", 0.98),    # all within
            ("d", {"sdpa": 1.0, "compiled": 1.02, "auto": 1.04}, "compiled", 1.08)]:  # auto's own cost misses
        r = _synthetic(ms, pick, over, config)
        r.update(bench_planner.ratios(r))
        r["spread"] = {"sdpa": 0.1}
        rows.append(r)
    s = bench_planner.summarize(rows)
    assert s["within_5pct"] == pytest.approx(2 / 4)  # a, c (b: 1.1 x 1.0, d: 1.02 x 1.08 = 1.1016)
    assert s["raw_within_5pct"] == pytest.approx(2 / 4)  # c, d (a: 1.2, b: 1.1)
    assert s["pick_within_5pct"] == pytest.approx(3 / 4)  # a, c, d (b: 1.1)
    assert s["worst_ratio"] == pytest.approx(1.02 * 1.08) and s["worst_config"] == "d"
    assert s["worst_raw_ratio"] == pytest.approx(1.2)
    assert s["median_auto_over_pick"] == pytest.approx(1.005) and s["worst_auto_over_pick"] == pytest.approx(1.08)
    assert s["paired_configs"] == 4


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
