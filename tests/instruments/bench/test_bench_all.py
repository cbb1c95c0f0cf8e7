"""attnlab bench all at toy size: structure, ratios and budgets of its output (never its speed)."""
import csv
import json
import os
import signal

import pytest

from attnlab.bench import all_jobs
from attnlab.bench import mechanisms as BM
from attnlab.cli.main import main


def test_fit_exponent_recovers_power_laws():
    ns = [128, 256, 1024, 4096, 16384]
    assert BM.fit_exponent(ns, [3e-7 * n ** 2 for n in ns], 1024) == pytest.approx(2.0)
    assert BM.fit_exponent(ns, [5.0 * n ** 1.5 for n in ns]) == pytest.approx(1.5)
    assert BM.fit_exponent([128], [1.0]) is None


def test_measure_job_in_process_counts_dense_flops():
    rec = BM.measure_job({"kind": "attn", "mechanism": "naive", "n": 48, "B": 2, "H": 3, "D": 8, "repeats": 2})
    assert "error" not in rec, rec.get("error")
    assert rec["flops"] == 2 * 3 * 2 * 48 * 48 * (8 + 8)
    assert rec["time_s"] > 0 and rec["peak_bytes"] >= 0 and len(rec["times_s"]) == rec["repeats_done"] == 2
    bad = BM.measure_job({"kind": "attn", "mechanism": "no_such_mechanism", "n": 8, "B": 1, "H": 1, "D": 4})
    assert "error" in bad


def test_bench_all_quick(tmp_path):
    argv = ["bench", "all", "--quick", "--mechanisms", "sdpa,linear", "--lengths", "64,128", "--threads", "1",
            "--production-lengths", "128", "--no-progress", "--out", str(tmp_path)]
    assert main(argv) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["mechanisms"][0] == "torch_sdpa" and res["isolation"] == "suite"
    grid = {(r["mechanism"], r["n"]): r for r in res["records"]}
    assert set(grid) == {(m, n) for m in ("torch_sdpa", "sdpa", "linear") for n in (64, 128)}
    for (m, n), r in grid.items():
        assert "error" not in r, r.get("error")
        ref = grid[("torch_sdpa", n)]
        assert r["time_vs_sdpa"] == pytest.approx(r["time_s"] / ref["time_s"])
        assert r["gflops"] == pytest.approx(r["flops"] / r["time_s"] / 1e9)
        assert r["fraction_of_matmul_peak"] == pytest.approx(r["gflops"] / res["matmul_gflops"])
        assert r["threads"] == 1
    assert grid[("sdpa", 64)]["flops"] == 4 * 2 * 64 * 64 * 128  # B=1, H=4, D=64: dense cost model
    assert res["fits"]["sdpa"]["points"] == 2
    lra = {(r["mechanism"], r["n"]): r for r in res["lra"]}
    assert lra[("sdpa", 128)]["speed_vs_vanilla"] == pytest.approx(1.0)
    assert all(r["steps_per_s"] > 0 for r in lra.values())
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert len(rows) == len(res["records"]) + len(res["production"]) + len(res["lra"])
    for name in ("time.png", "memory.png", "ratio.png", "lra.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    text = (tmp_path / "report.md").read_text()
    assert "Fitted exponents" in text
    # the production table: ours beside the tutorial's printed figures for n = 128
    assert {(r["mechanism"], r["n"]) for r in res["production"]} == {("naive", 128), ("torch_sdpa", 128)}
    row = next(line for line in text.splitlines() if line.startswith("| 128 | 1M |"))
    assert "<1ms" in row and "64KB" in row and "64 KiB" in row


def test_bench_all_stops_at_the_time_budget_and_says_so(tmp_path):
    argv = ["bench", "all", "--quick", "--mechanisms", "naive", "--lengths", "32,64,128", "--time-budget", "1e-9",
            "--isolation", "suite", "--threads", "1", "--no-lra", "--no-production", "--no-progress",
            "--out", str(tmp_path)]
    assert main(argv) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    for m in ("torch_sdpa", "naive"):
        assert [r["n"] for r in res["records"] if r["mechanism"] == m] == [32]
        assert res["stopped"][m].startswith("stopped before n=64")
    assert res["production"] == [] and res["lra"] == []
    assert "stopped before n=64" in (tmp_path / "report.md").read_text()


def test_bench_all_rejects_unknown_mechanism(tmp_path):
    assert main(["bench", "all", "--quick", "--mechanisms", "warp_drive", "--out", str(tmp_path)]) == 2


def _config_key(r):
    return (r.get("table", "grid"), r["kind"], r["mechanism"], r["n"])


def test_bench_all_interrupted_then_resumed_measures_nothing_twice(tmp_path, monkeypatch, capsys):
    argv = ["bench", "all", "--quick", "--mechanisms", "sdpa", "--lengths", "32,64", "--production-lengths", "32",
            "--lra-lengths", "32", "--threads", "1", "--no-progress", "--out", str(tmp_path)]
    measured = []
    stop_after = [5]  # of the 8 configurations: 4 grid, 2 production, 2 LRA

    def measure(self, job):
        if job["kind"] != "matmul" and len(measured) == stop_after[0]:
            # what finished is on disk before any handler runs, so a SIGKILL here would keep it too
            part = json.loads((tmp_path / "results.partial.json").read_text())
            assert sum(len(part[s]) for s in ("records", "production", "lra")) == stop_after[0]
            assert "Partial report" in (tmp_path / "report.md").read_text()
            os.kill(os.getpid(), signal.SIGTERM)  # `kill PID`: the driver turns it into a partial report
        rec = BM.measure_job(job)  # in this process: the worker protocol is test_bench_all_quick's
        rec["threads"] = 1
        if job["kind"] != "matmul":
            measured.append(_config_key(rec))
        return rec

    monkeypatch.setattr(all_jobs.Runner, "measure", measure)
    assert main(argv) == 130
    first = list(measured)
    assert len(first) == 5 and not (tmp_path / "results.json").exists()
    text = (tmp_path / "report.md").read_text()
    assert "Partial report" in text and "terminated" in text and "![time](time.png)" in text
    assert (tmp_path / "time.png").read_bytes()[:4] == b"\x89PNG"

    measured.clear()
    stop_after[0] = None
    assert main(argv + ["--resume"]) == 0
    second = list(measured)
    assert "reused" in capsys.readouterr().out
    assert not set(first) & set(second), "a configuration was measured twice"
    res = json.loads((tmp_path / "results.json").read_text())
    every = [_config_key(r) for s in ("records", "production", "lra") for r in res[s]]
    assert sorted(every) == sorted(first + second) and len(every) == 8
    assert res["complete"] and res["reused"] == 5 and res["measured_this_session"] == 3
    assert sum(1 for s in ("records", "production", "lra") for r in res[s] if r.get("reused")) == 5
    assert len(res["sessions"]) == 2 and len(res["matmul_runs"]) == 3  # start of each session, and the end
    assert res["matmul_gflops"] == max(m["gflops"] for m in res["matmul_runs"])
    assert not (tmp_path / "results.partial.json").exists()
    text = (tmp_path / "report.md").read_text()
    assert "Partial report" not in text and "2 sessions" in text
    for r in res["records"]:  # ratios recomputed across sessions from the raw records
        ref = next(x for x in res["records"] if x["mechanism"] == "torch_sdpa" and x["n"] == r["n"])
        assert r["time_vs_sdpa"] == pytest.approx(r["time_s"] / ref["time_s"])

    # a finished run resumed: nothing to measure; other settings: nothing reused
    measured.clear()
    assert main(argv + ["--resume"]) == 0 and measured == []
    argv[argv.index("--lengths") + 1] = "32"
    assert main(argv + ["--resume", "--no-lra", "--no-production", "--repeats", "2"]) == 0
    assert sorted(measured) == [("grid", "attn", "sdpa", 32), ("grid", "attn", "torch_sdpa", 32)]
