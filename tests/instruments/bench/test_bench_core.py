"""Smoke-run the core benchmark and the explain command at toy size: outputs, not times."""
from __future__ import annotations

import json

import torch

import attnlab
from attnlab.cli import main as cli


def test_bench_core_quick_writes_results(tmp_path):
    code = cli.main(["bench", "core", "--quick", "--out", str(tmp_path)])
    assert code == 0
    data = json.loads((tmp_path / "results.json").read_text())
    impls = {(r["section"], r["impl"]) for r in data["records"]}
    assert {("dense", "sdpa"), ("dense", "auto"), ("dense", "tiled"), ("dense", "naive")} <= impls
    assert ("pattern", "auto") in impls and ("train", "auto") in impls
    assert {r["pattern"] for r in data["records"] if r["section"] == "pattern"} == {"sliding_window_256", "block_sparse_10pct"}
    timed = [r for r in data["records"] if r["seconds"] is not None]
    assert timed and all(r["seconds"] > 0 for r in timed)
    assert all(r["ratio_vs_sdpa"] is not None for r in timed if r["section"] == "dense")
    dense = {r["n"]: r["seconds"] for r in timed if r["section"] == "dense" and r["impl"] == "sdpa"
             and r["dtype"] == "float32" and not r["causal"]}
    pats = [r for r in timed if r["section"] == "pattern" and r["impl"] == "auto"]
    assert pats and all(r["vs_density_dense"] == r["seconds"] / (r["density"] * dense[r["n"]]) for r in pats)
    mem = [r for r in data["records"] if r["section"] == "memory"]
    assert {r["impl"] for r in mem} == {"sdpa", "tiled", "naive", "auto"}
    assert all(r["peak_bytes"] is not None and r["peak_bytes"] >= 0 for r in mem)
    assert data["peak_gflops"]["float32"] > 0
    assert (tmp_path / "time.png").stat().st_size > 1000
    report = (tmp_path / "report.md").read_text()
    assert "× SDPA speed" in report
    assert "![time](time.png)" in report and "![memory](memory.png)" in report  # the report shows its plots


def test_explain_cli_returns_plans(capsys):
    outcome = cli.invoke(["explain", "--shape", "1,8,4096,64", "--pattern", "sliding_window(128, causal=True)"])
    assert outcome.exit_code == 0
    plan = outcome.result["plans"][0]
    # planned for this CPU (meta tensors stand for CPU ones): what attention() on real tensors picks
    q = torch.empty(1, 8, 4096, 64)
    real = attnlab.explain(q, q, q, pattern=attnlab.patterns.sliding_window(128, causal=True))
    assert plan["method"] == real.method and real.method in ("compiled", "sparse")
    assert plan["flops"][plan["method"]] < plan["flops"]["sdpa"] / 4
    assert plan["method"] in capsys.readouterr().out


def test_explain_cli_score_mods_plan_like_the_library(capsys):
    """--softcap / --alibi plan what attention(softcap=, alibi_slopes=) on real tensors would run."""
    outcome = cli.invoke(["explain", "--shape", "1,4,256,32", "--causal", "--softcap", "30", "--alibi", "--json"])
    assert outcome.exit_code == 0
    plan = outcome.result["plans"][0]
    q = torch.empty(1, 4, 256, 32)
    real = attnlab.explain(q, q, q, is_causal=True, softcap=30.0, alibi_slopes=attnlab.positional.alibi_slopes(4))
    assert plan["method"] == real.method
    assert "softcap" in plan["refused"]["sdpa"]  # SDPA has no soft-capping
    assert plan["options"]["softcap"] == 30.0 and plan["options"]["alibi_slopes"] is True
    capsys.readouterr()
    assert cli.main(["explain", "--shape", "1,4,256,32", "--softcap", "-1"]) == 2
    assert "softcap" in capsys.readouterr().err
    assert cli.main(["explain", "--shape", "256,32", "--alibi"]) == 2


def test_explain_cli_bad_input_exit_2(capsys):
    assert cli.main(["explain", "--shape", "1,x,4"]) == 2
    assert "--shape" in capsys.readouterr().err
    assert cli.main(["explain", "--pattern", "__import__('os')"]) == 2
    assert cli.main(["explain", "--shape", "1,2,8,4", "--kv-heads", "3"]) == 2


def test_bench_core_resume_keeps_finished_configurations(tmp_path, monkeypatch):
    """A killed run leaves results.json with every finished configuration; --resume re-times none of them."""
    from attnlab.bench import core

    calls = {"n": 0}
    real = core.time_call

    def dying(f, repeats=3, warmup=1):
        calls["n"] += 1
        if calls["n"] > 6:
            raise KeyboardInterrupt
        return real(f, repeats, warmup)

    monkeypatch.setattr(core, "time_call", dying)
    try:
        cli.main(["bench", "core", "--quick", "--no-memory", "--out", str(tmp_path)])
    except KeyboardInterrupt:
        pass
    partial = json.loads((tmp_path / "results.json").read_text())
    assert not partial["complete"] and partial["records"]
    kept = {(r["section"], r["impl"], r["n"], r["dtype"], r["causal"], r["pattern"]) for r in partial["records"]}

    timed = []
    monkeypatch.setattr(core, "time_call", lambda f, repeats=3, warmup=1: timed.append(1) or real(f, repeats, warmup))
    assert cli.main(["bench", "core", "--quick", "--no-memory", "--resume", "--out", str(tmp_path)]) == 0
    final = json.loads((tmp_path / "results.json").read_text())
    assert final["complete"]
    keys = [(r["section"], r["impl"], r["n"], r["dtype"], r["causal"], r["pattern"]) for r in final["records"]]
    assert len(keys) == len(set(keys)) and kept < set(keys)
    assert len(timed) == len(set(keys)) - len(kept)  # the matrix-product peak is kept too
    assert final["peak_gflops"] == partial["peak_gflops"]
    assert cli.main(["bench", "core", "--quick", "--resume", "--out", str(tmp_path)]) == 2  # other settings
