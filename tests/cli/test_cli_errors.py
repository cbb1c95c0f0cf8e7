"""Every CLI failure is one line on stderr and a non-zero exit; Ctrl-C exits 130 saying what was kept.

The cases are issue 13's reproducers (an audit of bad input on every subcommand). Commands run in
this process through ``attnlab.cli.main.main``; only the Ctrl-C test starts a real process, since a
signal has to arrive while the command runs.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import attnlab
from attnlab import resources
from attnlab.cli import main as cli

LAST: dict = {}
SRC = str(Path(attnlab.__file__).resolve().parents[1])


def run(argv, capsys):
    """(exit code, stderr lines, stdout) of ``attnlab ARGV`` run in this process; the command's result is
    kept in ``LAST`` for the tests that inspect it."""
    outcome = cli.invoke([str(a) for a in argv])
    LAST["result"] = outcome.result
    cap = capsys.readouterr()
    return outcome.exit_code, [ln for ln in cap.err.splitlines() if ln.strip()], cap.out


def one_line_error(argv, capsys, *, code=2, contains=()):
    rc, err, _ = run(argv, capsys)
    assert rc == code, (argv, rc, err)
    assert len(err) == 1, err  # one line, no traceback
    assert "Traceback" not in err[0] and "error" in err[0]
    for text in contains:
        assert text in err[0], (text, err[0])
    return err[0]


@pytest.fixture
def budget(monkeypatch):
    """A memory budget that does not depend on this machine: 4 GiB."""
    monkeypatch.setenv("ATTNLAB_MEMORY_BUDGET_GIB", "4")
    return 4 * 2**30


# -- absurd sizes: checked against the memory budget before anything is allocated ------------------------
def test_explain_of_a_huge_shape_allocates_nothing(capsys, budget):
    # a billion-token query is 2 TB of float32: explain plans it on the meta device instead
    rc, err, _ = run(["explain", "--shape", "1,8,1000000000,64", "--json"], capsys)
    assert rc == 0 and err == []
    plan = LAST["result"]["plans"][0]
    assert plan["shape"] == [1, 8, 10**9, 64]
    # the prediction for the dense method holds the [B, H, L, S] float32 scores at least
    assert plan["peak_bytes"]["dense"] >= 8 * 10**18 * 4


def test_explain_pattern_layouts_over_budget_are_refused(capsys, budget):
    line = one_line_error(["explain", "--shape", "1,8,1000000000,64", "--pattern", "sliding_window(256)"], capsys,
                          contains=("--shape 1,8,1000000000,64", "memory budget of 4 GiB"))
    assert "55.5 PiB" in line  # binary units up to EiB (was "56822 TiB")


@pytest.mark.parametrize("argv, names", [
    (["list", "--cost", "1000000000000,1000000000000,64"], "--cost 1000000000000,1000000000000,64"),
    (["check", "--shape", "1,1,200000,64"], "--shape 1,1,200000,64"),
    (["check", "--kv-len", "1000000000"], "--kv-len 1000000000"),
    (["trace", "--summary", "--d-model", "200004"], "d_model=200004"),
    (["experiment", "long-range", "--quick", "--seq-len", "100000000"], "--seq-len 100000000"),
    (["experiment", "approximation", "--quick", "--n", "10000000"], "--n 10000000"),
    (["bench", "layers", "--quick", "--ns", "1000000"], "--ns 1000000"),
    (["bench", "kernels", "--quick", "--dense-ns", "10000000"], "a length of 10000000"),
    (["tour", "--memory-n", "100000"], "--memory-n 100000"),
])
def test_absurd_sizes_are_refused_before_allocating(argv, names, capsys, budget, tmp_path):
    line = one_line_error(argv + ["--out", tmp_path / "o"] if argv[0] in ("experiment", "bench", "tour") else argv, capsys,
                          contains=(names, "would need about", "memory budget of 4 GiB"))
    assert not (tmp_path / "o").exists()  # refused before anything was written


def test_list_cost_at_a_large_size_answers_at_once(capsys, monkeypatch):
    # patterns were counted pair by pair (O(L·S)): at 65536^2 that took over 5 minutes per pattern. Every
    # registered pattern now counts in closed form (issue 25), so every GFLOP is shown ...
    t0 = time.perf_counter()
    rc, err, out = run(["list", "--cost", "65536,65536,64"], capsys)
    assert rc == 0 and err == [] and time.perf_counter() - t0 < 30
    rows = {r["name"]: r for r in LAST["result"]["mechanisms"]}
    # dilated(64, 2): diagonals j - i = 2k, |k| <= 64, each 65536 - |2k| pairs long
    nnz = sum(65536 - abs(2 * k) for k in range(-64, 65))
    assert rows["dilated"]["gflop"] == pytest.approx(2 * nnz * 128 / 1e9) and "GFLOP not shown" not in out
    assert rows["sliding_window"]["gflop"] > 0 and rows["dense"]["gflop"] == pytest.approx(2 * 65536**2 * 128 / 1e9)
    # ... and one that would count pair by pair is left out, with a note, and the rest is shown
    from attnlab.patterns.bands import _Dilated

    monkeypatch.setattr(_Dilated, "counts_analytically", lambda self: False)
    rc, err, out = run(["list", "--cost", "65536,65536,64"], capsys)
    rows = {r["name"]: r for r in LAST["result"]["mechanisms"]}
    assert rc == 0 and rows["dilated"]["gflop"] is None and "GFLOP not shown for dilated" in " ".join(out.split())
    assert rows["strided"]["gflop"] is not None
    monkeypatch.undo()
    rc, _, _ = run(["list"], capsys)  # the default size counts every pattern
    assert rc == 0 and all(r["gflop"] is not None for r in LAST["result"]["mechanisms"] if r["name"] == "dilated")


def test_check_budget_counts_the_float64_scores(budget):
    from attnlab.cli.check import check_budget

    # 4 GiB holds one float64 [1, 1, 2000, 4003] score matrix (61 MiB) many times over: accepted
    check_budget((1, 1, 2000, 64))
    # one [1, 1, 20000, 40003] float64 matrix alone is 6 GiB: refused
    with pytest.raises(resources.OptionError, match="--shape 1,1,20000,64"):
        check_budget((1, 1, 20000, 64))


def test_memory_budget_reads_the_environment(monkeypatch):
    monkeypatch.setenv("ATTNLAB_MEMORY_BUDGET_GIB", "0.5")
    assert resources.memory_budget() == (2**29, "ATTNLAB_MEMORY_BUDGET_GIB")
    monkeypatch.setenv("ATTNLAB_MEMORY_BUDGET_GIB", "nan")
    with pytest.raises(resources.OptionError, match="ATTNLAB_MEMORY_BUDGET_GIB"):
        resources.memory_budget()
    monkeypatch.delenv("ATTNLAB_MEMORY_BUDGET_GIB")
    avail = resources._available_bytes()
    if avail is not None:
        assert resources.memory_budget()[0] == avail // 2


# -- input that used to end in a traceback --------------------------------------------------------------
def test_deeply_nested_scores_json(capsys):
    one_line_error(["trace", "--scores", "[" * 100000 + "]" * 100000], capsys, contains=("--scores", "nested"))


def test_huge_shape_beyond_int64(capsys):
    one_line_error(["explain", "--shape", "99999999999999999999,1,1,1"], capsys, contains=("--shape", "2^62"))


@pytest.mark.parametrize("argv", [
    ["trace", "--example", "--out", "{dir}"],
    ["trace", "--example", "--png", "{dir}"],
    ["trace", "--example", "--out", "{file}/x.html"],
    ["viz", "some words", "--model", "random", "--out", "{file}"],
    ["heads", "--no-plot", "--out", "{file}"],
    ["retrieve", "--embedder", "hashing", "--out", "{file}"],
    ["tour", "--out", "{file}"],
    ["experiment", "variance", "--quick", "--out", "{file}"],
    ["experiment", "approximation", "--quick", "--out", "{file}"],
    ["bench", "core", "--quick", "--out", "{file}"],
    ["bench", "generate", "--quick", "--out", "{file}"],
    ["bench", "layers", "--quick", "--out", "{file}"],
    ["bench", "all", "--quick", "--out", "{file}"],
])
def test_out_naming_a_file_or_a_folder_is_refused(argv, capsys, tmp_path):
    f, d = tmp_path / "afile.txt", tmp_path / "adir"
    f.write_text("keep me")
    d.mkdir()
    argv = [a.replace("{file}", str(f)).replace("{dir}", str(d)) for a in argv]
    one_line_error(argv, capsys, contains=("--out" if "--out" in argv else "--png",))
    assert f.read_text() == "keep me" and list(d.iterdir()) == []


# -- exit 0 where it should fail ---------------------------------------------------------------------------
@pytest.mark.parametrize("argv, option", [
    (["explain", "--kv-heads", "0"], "--kv-heads"),
    (["explain", "--kv-len", "-1"], "--kv-len"),
    (["check", "--kv-len", "0"], "--kv-len"),
    (["trace", "--summary", "--seq-len", "0"], "--seq-len"),
    (["trace", "--example", "--digits", "-1"], "--digits"),
    (["viz", "words", "--max-length", "0", "--out", "x"], "--max-length"),
    (["retrieve", "--steps", "-1"], "--steps"),
    (["retrieve", "--lr", "nan"], "--lr"),
    (["retrieve", "--lr", "-1"], "--lr"),
    (["retrieve", "--tau", "0"], "--tau"),
    (["experiment", "long-range", "--seq-len", "0"], "--seq-len"),
    (["experiment", "long-range", "--batch-size", "0"], "--batch-size"),
    (["experiment", "long-range", "--lr", "0"], "--lr"),
    (["experiment", "long-range", "--recall-queries", "0"], "--recall-queries"),
    (["experiment", "scaling", "--steps", "0"], "--steps"),
    (["experiment", "scaling", "--lr", "nan"], "--lr"),
    (["experiment", "variance", "--rows", "0"], "--rows"),
    (["experiment", "approximation", "--n", "0"], "--n"),
    (["bench", "core", "--max-n", "0"], "--max-n"),
    (["bench", "core", "--time-budget", "nan"], "--time-budget"),
    (["bench", "generate", "--new-tokens", "-1"], "--new-tokens"),
    (["bench", "generate", "--repeats", "0"], "--repeats"),
    (["bench", "generate", "--contexts", "0"], "--contexts"),
    (["bench", "all", "--repeats", "0"], "--repeats"),
    (["bench", "minilm", "--batch", "0"], "--batch"),
    (["bench", "ring", "--seq-len", "0"], "--seq-len"),
    (["bench", "ring", "--timeout", "nan"], "--timeout"),
    (["bench", "layers", "--min-time", "nan"], "--min-time"),
])
def test_zero_negative_and_nan_are_refused_not_replaced(argv, option, capsys):
    # before: `args.x or default` turned 0 into the default and nan went through; now argparse refuses
    one_line_error(argv, capsys, contains=(f"argument {option}", "(see attnlab"))


def test_quick_mode_keeps_given_values():
    from attnlab.cli.main import build_parser

    args = build_parser().parse_args(["bench", "generate", "--quick", "--new-tokens", "8", "--contexts", "16,32"])
    assert args.new_tokens == 8 and args.contexts == [16, 32]


def test_retrieve_fails_on_a_diverged_fit(capsys, tmp_path):
    # lr 1e30 sends the projection's loss to NaN; it used to report top-1 = 1.00 and exit 0 (--no-progress: piped,
    # retrieve says what it is doing on stderr, a line per stage, before the one error line)
    one_line_error(["retrieve", "--embedder", "hashing", "--lr", "1e30", "--no-progress", "--out", tmp_path], capsys,
                   contains=("diverged", "lr=1e+30"))
    assert not (tmp_path / "retrieve.json").exists()


def test_long_range_unknown_mechanism_lists_the_valid_ones(capsys, tmp_path):
    line = one_line_error(["experiment", "long-range", "--quick", "--mechanisms", "sdpa,bogus", "--out", tmp_path],
                          capsys, contains=("--mechanisms", "'bogus'"))
    import attnlab.mechanisms as M

    assert all(name in line for name in M.available())
    assert list(tmp_path.iterdir()) == []  # no empty report marked complete


# -- used --out folders, --resume, --force, truncated checkpoints -------------------------------------------
LONG_RANGE = ["experiment", "long-range", "--quick", "--no-progress", "--tasks", "copy", "--seq-len", "32",
              "--steps", "2", "--train-examples", "8", "--test-examples", "4", "--d-model", "32", "--layers", "1"]


def test_used_out_needs_resume_or_force_and_never_mixes(capsys, tmp_path):
    out = tmp_path / "lr"
    assert run(LONG_RANGE + ["--mechanisms", "sdpa", "--out", out], capsys)[0] == 0
    assert [r["mechanism"] for r in json.loads((out / "results.json").read_text())["runs"]] == ["sdpa"]
    # the same folder again, without --resume: refused, the first run untouched
    line = one_line_error(LONG_RANGE + ["--mechanisms", "dense", "--out", out], capsys,
                          contains=(str(out), "--resume", "--force"))
    assert "results.json" in line and (out / "checkpoints").is_dir()
    # --force: the old run's files go first, so the new report holds the new run only
    assert run(LONG_RANGE + ["--mechanisms", "dense", "--force", "--out", out], capsys)[0] == 0
    res = json.loads((out / "results.json").read_text())
    assert [r["mechanism"] for r in res["runs"]] == ["dense"] and res["complete"]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["copy-dense-seed0.pt"]
    # a truncated checkpoint: --resume names the file and what to do
    ck = out / "checkpoints" / "copy-dense-seed0.pt"
    ck.write_bytes(ck.read_bytes()[:100])
    one_line_error(LONG_RANGE + ["--mechanisms", "dense", "--resume", "--out", out], capsys,
                   contains=(str(ck), "unreadable", "delete it"))


def test_output_dir_force_removes_only_the_run_markers(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "a.pt").write_bytes(b"x")
    (tmp_path / "results.partial.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(resources.OptionError, match="holds an earlier run"):
        resources.output_dir(tmp_path, resume=False)
    assert resources.output_dir(tmp_path, resume=True) == tmp_path  # resuming keeps everything
    assert (tmp_path / "checkpoints" / "a.pt").exists()
    resources.output_dir(tmp_path, resume=False, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_bench_core_resume_from_a_corrupt_results_file(capsys, tmp_path):
    (tmp_path / "results.json").write_text('{"settings": ')
    one_line_error(["bench", "core", "--quick", "--no-memory", "--resume", "--out", tmp_path], capsys,
                   contains=(str(tmp_path / "results.json"), "--resume"))


# -- the error boundary itself ------------------------------------------------------------------------------
def test_argparse_errors_are_one_line(capsys):
    one_line_error(["explain", "--no-such-option"], capsys, contains=("error: unrecognized arguments: --no-such-option",
                                                                    "--help"))
    one_line_error(["explain", "--dtype", "int3"], capsys, contains=("attnlab explain: error: argument --dtype",))
    one_line_error(["bench"], capsys, contains=("SUITE",))


def test_unexpected_errors_are_one_line_with_their_type(capsys, monkeypatch):
    import attnlab.cli.list_cmd as L

    def boom(args):
        raise RuntimeError("deep inside\nsecond line")

    monkeypatch.setattr(L, "run", boom)
    line = one_line_error(["list"], capsys, code=1, contains=("RuntimeError: deep inside", "ATTNLAB_TRACEBACK"))
    assert "second line" not in line
    monkeypatch.setenv("ATTNLAB_TRACEBACK", "1")
    with pytest.raises(RuntimeError):
        cli.main(["list"])


def test_out_of_memory_is_one_line(capsys, monkeypatch):
    import attnlab.cli.list_cmd as L

    def oom(args):
        torch.empty(2**62, dtype=torch.uint8)  # the allocator refuses at once

    monkeypatch.setattr(L, "run", oom)
    one_line_error(["list"], capsys, code=1, contains=("not enough memory",))


def test_keyboard_interrupt_in_process(capsys, monkeypatch):
    import attnlab.cli.list_cmd as L

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(L, "run", interrupted)
    rc, err, _ = run(["list"], capsys)
    assert rc == 130 and err == ["attnlab list: interrupted; nothing was written; rerun `attnlab list` to start again"]


def test_keyboard_interrupt_stops_the_whole_tour(capsys, monkeypatch, tmp_path):
    import attnlab.tour as T

    def interrupted(*a):
        raise KeyboardInterrupt

    ran = []
    monkeypatch.setitem(T._RUN, "explain", interrupted)
    monkeypatch.setitem(T._RUN, "trace", lambda *a: ran.append("trace"))
    rc, err, _ = run(["tour", "--no-progress", "--skip", "variance,speed,memory,heads,viz", "--out", tmp_path], capsys)
    # the pieces catch a piece's failure and go on; Ctrl-C is not a failure: the tour stops
    assert rc == 130 and ran == [] and len(err) == 1 and err[0].startswith("attnlab tour: interrupted")


def test_version_and_defaults_in_help(capsys):
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"attnlab {attnlab.__version__}"
    assert cli.main(["explain", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: float32)" in text and "(default: auto)" in text


def test_every_option_has_help():
    parser = cli.build_parser()
    missing = []

    def walk(p, path):
        for a in p._actions:
            if a.help is None and a.option_strings and a.dest not in ("help", "version"):
                missing.append(f"{path} {a.option_strings[0]}")
            for name, sub in (getattr(a, "choices", None) or {}).items() if hasattr(a, "_name_parser_map") else ():
                walk(sub, f"{path} {name}")

    walk(parser, "attnlab")
    assert missing == []


# -- Ctrl-C in a real process ----------------------------------------------------------------------------------
def test_ctrl_c_exits_130_naming_the_checkpoints_and_the_resume_command(tmp_path):
    out = tmp_path / "scaling"
    steps = 1000  # the first of three runs finishes in seconds; Ctrl-C lands in a later one
    argv = ["experiment", "scaling", "--quick", "--no-progress", "--tasks", "recall", "--d-k", "16", "--seeds", "0",
            "--steps", str(steps), "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, "-m", "attnlab.cli.main", *argv], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "results.partial.json").exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.5)  # inside a later run's 1000 steps (2-25 s each, by how busy the machine is)
        assert p.poll() is None, p.communicate()
        os.killpg(p.pid, signal.SIGINT)  # what a terminal sends the foreground process group
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert p.returncode == 130, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert f"kept in {out}" in lines[0] and lines[0].endswith(f"--out {out} --resume")
    # Note [Ctrl-C between steps]: the run in progress was checkpointed at a step boundary, not lost
    states = [torch.load(ck, weights_only=True) for ck in sorted((out / "checkpoints").glob("*.pt"))]
    finished = [st for st in states if st["done"]]
    cut = [st for st in states if not st["done"]]
    assert len(finished) >= 1 and all(st["step"] == steps for st in finished)
    assert len(cut) == 1 and 0 < cut[0]["step"] < steps
