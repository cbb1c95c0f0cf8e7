"""attnlab.bench as a library (issue 15): configs in, result dataclasses out, no argv and no printing.

The suites' numbers are checked by the other test_bench_* files through the CLI; here the library face:
a suite runs from its config alone, reports progress through the callback, writes its files and prints
nothing; bad configs fail before anything is measured, naming the option; nothing in the package parses
arguments or prints (checked on the source, so a new print anywhere in bench/ fails here).
"""
from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest

import attnlab.bench as bench_pkg
from attnlab.bench import core, generate, layers, mechanisms, ring
from attnlab.bench.fit import extrapolate, fit_exponent

BENCH = Path(bench_pkg.__file__).parent


def _calls(tree: ast.AST, name: str) -> list[int]:
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
            and n.func.id == name]


@pytest.mark.parametrize("path", sorted(BENCH.glob("*.py")), ids=lambda p: p.name)
def test_bench_modules_neither_print_nor_parse_argv(path):
    tree = ast.parse(path.read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "argparse" not in imported, f"{path.name} imports argparse: options belong in attnlab/cli/"
    assert not _calls(tree, "print"), f"{path.name} prints at lines {_calls(tree, 'print')}: render in attnlab/cli/"
    from_cli = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
                and ("cli" in n.module.split(".") or "_common" in n.module.split("."))]
    assert not from_cli, f"{path.name} imports {from_cli}: the library never reaches up into the CLI"


def test_generate_runs_from_its_config_alone_and_prints_nothing(tmp_path, capsys):
    seen = []
    res = generate.run(generate.GenerateConfig(out=str(tmp_path), quick=True, contexts=(16, 24), new_tokens=3,
                                               threads=1),
                       progress=lambda done, total, label: seen.append((done, total, label)))
    out, err = capsys.readouterr()
    assert out == "" and err == ""
    assert isinstance(res, generate.GenerateBench) and res.exit_code == 0
    assert [r["context"] for r in res.rows] == [16, 24] and all(r["same_tokens"] for r in res.rows)
    assert [Path(f).name for f in res.files] == ["generate.json", "generate.png"]
    assert json.loads((tmp_path / "generate.json").read_text())["rows"] == json.loads(json.dumps(res.rows))
    dones = [d for d, _, _ in seen]
    assert dones == sorted(dones) and seen[-1][:2] == (8, 8)  # 2 contexts x (cache, no cache) x 2 timings
    # the result writes its own files: again, elsewhere, the same record without measuring anything
    res.out_dir = str(tmp_path / "again")
    assert [Path(f).name for f in res.write()] == ["generate.json", "generate.png"]
    assert (json.loads((tmp_path / "again" / "generate.json").read_text())
            == json.loads((tmp_path / "generate.json").read_text()))


@pytest.mark.parametrize("config, option", [
    (core.CoreConfig(max_n=128), "--max-n"),
    (core.CoreConfig(time_budget=float("nan")), "--time-budget"),
    (generate.GenerateConfig(new_tokens=1), "--new-tokens"),
    (generate.GenerateConfig(contexts=(8,), new_tokens=16), "every context must exceed --new-tokens"),
    (generate.GenerateConfig(d_model=30, heads=4), "--d-model 30"),
    (ring.RingConfig(procs=1), "--procs"),
    (ring.RingConfig(seq_len=5, procs=4), "too short"),
    (layers.LayersConfig(layers=["transformer"]), "--layers"),
    (layers.LayersConfig(kernel=4), "odd kernel"),
    (mechanisms.AllConfig(mechanisms=("warp_drive",)), "--mechanisms"),
    (mechanisms.AllConfig(lengths=(0, 8)), "--lengths"),
])
def test_bad_configs_fail_before_measuring_and_name_the_option(config, option, tmp_path):
    config.out = str(tmp_path / "never")
    run = {core.CoreConfig: core.run, generate.GenerateConfig: generate.run, ring.RingConfig: ring.run,
           layers.LayersConfig: layers.run, mechanisms.AllConfig: mechanisms.run}[type(config)]
    with pytest.raises(ValueError, match=option.replace("-", r"\-").replace("(", r"\(")):
        run(config)
    assert not (tmp_path / "never").exists()


def test_all_config_lists_the_valid_mechanisms():
    import attnlab.mechanisms as M

    with pytest.raises(ValueError) as e:
        mechanisms.AllConfig(mechanisms=("warp_drive",)).settings()
    assert all(name in str(e.value) for name in ("torch_sdpa", "naive", *M.available()))
    s = mechanisms.AllConfig(quick=True, mechanisms=("linear",)).settings()
    assert s["mechs"] == ["torch_sdpa", "linear"] and s["isolation"] == "suite" and s["lengths"] == [128, 256, 512]


def test_fit_exponent_and_extrapolate_recover_power_laws():
    ns = [256, 1024, 4096]
    assert fit_exponent(ns, [7e-9 * n ** 1.5 for n in ns]) == pytest.approx(1.5)
    assert fit_exponent([256, 1024, 4096], [1.0, 2.0, 32.0], min_n=1024) == pytest.approx(2.0)  # 2 points >= 1024
    assert fit_exponent([256, 256], [1.0, 2.0]) is None and fit_exponent([8, 16], [0.0, -1.0]) is None
    # the exponent of the last two points, never below 1 (a flat start must not hide a budget)
    assert extrapolate([(128, 1.0), (256, 4.0)], 512) == pytest.approx(16.0)
    assert extrapolate([(128, 1.0), (256, 1.0)], 1024) == pytest.approx(4.0)
    assert extrapolate([(128, 3.0)], 256) == pytest.approx(12.0)  # one point: n² by default
    assert extrapolate([], 256) is None
    assert math.isclose(extrapolate([(100, 2.0)], 100), 2.0)


def test_cli_face_renders_progress_on_stderr_and_the_result_on_stdout(tmp_path, capsys):
    from attnlab.cli import main as cli

    argv = ["bench", "layers", "--quick", "--layers", "attention,gru", "--ns", "8,16", "--ds", "8", "--no-memory"]
    assert cli.main(argv + ["--out", str(tmp_path / "a")]) == 0
    out, err = capsys.readouterr()
    lines = err.splitlines()  # not a terminal: one progress line per step, then the tables on stdout
    assert lines and all(line.startswith("[") and "bench layers" in line for line in lines)
    assert lines[-1].startswith("[8/8]") and "crossover" in out
    assert cli.main(argv + ["--json", "--out", str(tmp_path / "b")]) == 0
    out, _ = capsys.readouterr()
    assert json.loads(out)["rows"] == json.loads((tmp_path / "b" / "layers.json").read_text())["rows"]
