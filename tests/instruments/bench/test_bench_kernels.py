"""Smoke-run ``attnlab bench kernels`` at toy size: the files, and that every ratio is computed from the
measured medians (never the times themselves: benchmarks are not tests)."""
from __future__ import annotations

import json
import statistics
import warnings

import pytest
import torch

from attnlab import cpu, reference
from attnlab.bench import kernels as K
from attnlab.cli import main as cli
from attnlab.functional import METHODS

TINY = dict(dense_ns=(256,), bf16_ns=(256,), window=32, window_ns=(128, 256), window_bwd_ns=(256,), sparse_n=256,
            densities=(0.25,), block_size=32, memory_n=128, rounds=2, min_rounds=1, min_sample_s=0.0,
            flex=False, contention=True, baseline_max_n=256, methods=("compiled", "tiled", "sdpa"),
            pattern_methods=("compiled", "sparse", "auto"))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-kernels")
    calls = []
    res = K.run(K.KernelsConfig(out=str(out), **TINY), progress=lambda d, t, label: calls.append((d, t, label)))
    return out, res, calls


def test_writes_report_files_and_progress(tiny_run):
    out, res, calls = tiny_run
    for name in ("results.json", "report.md", "window.png", "sparse.png", "ratios.png"):
        assert (out / name).stat().st_size > (1000 if name.endswith(".png") else 100), name
    assert not list(out.glob(".*.tmp"))  # atomic writes leave no temporaries
    report = (out / "report.md").read_text()
    assert cpu.INFO.model in report and cpu.INFO.torch_isa in report  # header: CPU flags
    # the plots are shown, before the long measurement table
    assert all(report.index(f"]({name})") < report.index("## Measurements") for name in ("window.png", "sparse.png",
                                                                                         "ratios.png"))
    assert "float32" in report.split("## Headline")[0] and "GFLOP/s" in report.split("## Headline")[0]
    done = [d for d, _, _ in calls]
    assert done == sorted(done) and calls[-1][0] == calls[-1][1] and calls[-1][2] == "done"
    assert any(label.startswith("busy") for _, _, label in calls)


def test_ratios_come_from_the_measured_medians(tiny_run):
    out, res, _ = tiny_run
    data = json.loads((out / "results.json").read_text())
    ms = {(m["case"], m["impl"], m["load"]): m for m in data["measurements"]}
    for m in data["measurements"]:
        if m["seconds"] is not None:
            assert m["seconds"] == statistics.median(m["times"]) and len(m["times"]) == 2
    speed = [r for r in data["ratios"] if "speed vs SDPA" in r["name"] and r["load"] != "busy/quiet"]
    dens = [r for r in data["ratios"] if "time/(ρ·dense)" in r["name"] and r["load"] != "busy/quiet"]
    assert speed and dens
    for r in speed:
        case = r["name"].split(": speed")[0]
        a, b = ms[(case, "torch:sdpa", r["load"])], ms[(case, r["impl"], r["load"])]
        assert r["value"] == a["seconds"] / b["seconds"], r["name"]
    for r in dens:
        case, label = r["name"].split(" block_sparse")[0].split(" bigbird")[0], None
        m = next(m for m in data["measurements"] if m["impl"].startswith(r["impl"] + " [")
                 and m["load"] == r["load"] and r["name"].startswith(f"{m['case']} {m['pattern']}:"))
        sd = ms[(m["case"], "torch:sdpa", r["load"])]
        assert 0 < m["density"] < 1
        assert r["value"] == m["seconds"] / (m["density"] * sd["seconds"]), (r["name"], case, label)
    kept = [r for r in data["ratios"] if r["load"] == "busy/quiet"]
    assert kept
    for r in kept:
        q, b = r["inputs"]["quiet"], r["inputs"]["busy"]
        assert r["value"] == pytest.approx(q / b if "time/(ρ·dense)" in r["name"] else b / q)
    exps = [r for r in data["ratios"] if "exponent" in r["name"]]
    assert exps and all(r["value"] == pytest.approx(K.fit_exponent(
        [int(n) for n in r["inputs"]], list(r["inputs"].values()))) for r in exps)


def test_skips_are_explained(tiny_run):
    _, res, _ = tiny_run
    by_impl = {}
    for m in res.measurements:
        assert (m.seconds is None) == (m.skipped is not None), (m.case, m.impl, m.skipped)
        by_impl.setdefault(m.impl.split(" [")[0], []).append(m)
    if "compiled" not in METHODS:
        assert all("METHODS" in m.skipped for m in by_impl["attnlab:compiled"])
    else:  # measured, or refused with the planner's reason (no compiler, ATTNLAB_NO_EXT=1)
        assert all(m.seconds or "compiled" in m.skipped for m in by_impl["attnlab:compiled"])
    assert all(m.skipped == "FlexAttention disabled (flex=False)" for m in by_impl["torch:flex"])
    mem = {r["impl"]: r for r in res.memory}
    assert mem["torch:sdpa"]["peak_bytes"] is not None and mem["torch:sdpa"]["peak_bytes"] >= 0
    assert {m.load for m in res.measurements} == {"quiet", "busy"}


def test_flex_block_mask_matches_the_pattern():
    """The BlockMask handed to FlexAttention computes exactly the pattern's attention (eager, tiny)."""
    from torch.nn.attention.flex_attention import flex_attention

    n = 96
    q, k, v = (torch.randn(1, 2, n, 8) for _ in range(3))
    for pat, mm in [(K.make_case_pattern("window", n, window=20), K.window_mask_mod(20)),
                    (K.make_case_pattern("window", n, window=20), None),
                    (K.make_case_pattern("block_sparse", n, density=0.3, block_size=16), None),
                    (K.make_case_pattern("bigbird", n, block_size=16), None)]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # eager FlexAttention warns that it is slow
            out = flex_attention(q, k, v, block_mask=K.flex_block_mask(pat, n, 16, mm))
        ref, _ = reference.attention(q, k, v, attn_mask=pat.materialize(n, n))
        err = float((out.double() - torch.from_numpy(ref)).abs().max())
        assert err < 1e-5, (repr(pat), err)


def test_cli_runs_and_refuses_bad_input(tmp_path, capsys):
    args = ["bench", "kernels", "--out", str(tmp_path), "--dense-ns", "128", "--bf16-ns", "128", "--window", "16",
            "--window-ns", "128", "--window-bwd-ns", "128", "--sparse-n", "128", "--densities", "0.25",
            "--memory-n", "0", "--rounds", "1", "--no-flex", "--no-contention", "--baseline-max-n", "128"]
    outcome = cli.invoke(args)
    assert outcome.exit_code == 0
    res = outcome.result
    assert isinstance(res, K.KernelsResult) and (tmp_path / "report.md").exists()
    assert "cpu: " in capsys.readouterr().out
    assert cli.main(["bench", "kernels", "--out", str(tmp_path), "--densities", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "densities" in err[0]


def test_flex_compiler_names_a_missing_flex_attention(monkeypatch):
    """Where torch has no FlexAttention, the bench skips it with the reason (it raised UnboundLocalError: the
    function's own ``import torch._dynamo`` made ``torch`` a local name)."""
    import sys

    from attnlab.bench import kernels_cases

    monkeypatch.setitem(sys.modules, "torch.nn.attention.flex_attention", None)  # import fails
    fn, why = kernels_cases.flex_compiler()
    assert fn is None and "FlexAttention is not available" in why and torch.__version__ in why
