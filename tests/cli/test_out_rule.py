"""One rule for every command that writes an --out (issue 21, defect 14; Note [One rule for --out] in
attnlab.resources): a folder holding another run, or a file that exists, is refused without --force, with
one line on stderr and exit 2, and nothing in it is touched. ``experiment variance``/``approximation`` and
``viz`` used to overwrite and exit 0, though their --help said such a folder is refused.
"""
from __future__ import annotations

import argparse

import pytest

from attnlab.cli import main as cli

# one cheap invocation of every command with an --out folder: the refusal comes before any work
FOLDER_COMMANDS = {
    "experiment variance": ["experiment", "variance", "--quick", "--no-minilm", "--no-progress"],
    "experiment approximation": ["experiment", "approximation", "--quick", "--no-minilm", "--no-progress"],
    "experiment scaling": ["experiment", "scaling", "--quick", "--no-progress"],
    "experiment failure-modes": ["experiment", "failure-modes", "--quick", "--no-progress"],
    "experiment long-range": ["experiment", "long-range", "--quick", "--no-progress"],
    "experiment kvquant": ["experiment", "kvquant", "--quick", "--no-kernel", "--no-progress"],
    "viz": ["viz", "the cat sat", "--model", "random"],
    "tour": ["tour", "--no-progress", "--skip", "explain,trace,variance,speed,memory,heads,viz"],
    "heads": ["heads", "--sentence", "a cat"],
    "retrieve": ["retrieve", "--embedder", "hashing", "--no-learn"],
    "bench core": ["bench", "core", "--quick", "--no-memory"],
    "bench all": ["bench", "all", "--quick"],
    "bench generate": ["bench", "generate", "--quick"],
    "bench kernels": ["bench", "kernels", "--quick"],
    "bench layers": ["bench", "layers", "--quick"],
    "bench minilm": ["bench", "minilm", "--quick"],
    "bench ring": ["bench", "ring", "--quick"],
    "bench decode": ["bench", "decode", "--quick", "--seq-lens", "64", "--rounds", "1", "--bandwidth-mib", "1"],
    "bench planner": ["bench", "planner", "--quick", "--rounds", "1"],
}
#: commands with an --out that this rule does not reach yet (none since tour took --force; may only shrink)
KNOWN: set[str] = set()


def _run(argv, capsys):
    rc = cli.main([str(a) for a in argv])
    cap = capsys.readouterr()
    return rc, [ln for ln in cap.err.splitlines() if ln.strip()]


def _commands(parser: argparse.ArgumentParser, prefix=()):
    """(command words, parser) of every leaf subcommand."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield prefix, parser
        return
    for name, p in subs[0].choices.items():
        yield from _commands(p, prefix + (name,))


def test_every_command_with_an_out_takes_force():
    seen = set()
    for words, p in _commands(cli.build_parser()):
        opts = {s for a in p._actions for s in a.option_strings}
        if "--out" in opts:
            seen.add(" ".join(words))
            if " ".join(words) not in KNOWN:
                assert "--force" in opts, f"attnlab {' '.join(words)} writes --out but has no --force"
    assert set(FOLDER_COMMANDS) | {"trace"} | KNOWN == seen  # each one is exercised below


@pytest.mark.parametrize("name", sorted(FOLDER_COMMANDS))
@pytest.mark.parametrize("marker", ["results.json", "other.json"])
def test_a_folder_holding_another_run_is_refused_without_force(name, marker, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ATTNLAB_MEMORY_BUDGET_GIB", "4")
    out = tmp_path / "used"
    out.mkdir()
    (out / marker).write_text('{"an": "earlier run"}')
    rc, err = _run(FOLDER_COMMANDS[name] + ["--out", out], capsys)
    assert rc == 2 and len(err) == 1, (rc, err)
    assert str(out) in err[0] and "--force" in err[0] and marker in err[0] and "Traceback" not in err[0], err
    assert sorted(p.name for p in out.iterdir()) == [marker]
    assert (out / marker).read_text() == '{"an": "earlier run"}'


def test_trace_refuses_an_existing_file_without_force(tmp_path, capsys):
    page = tmp_path / "trace.md"
    page.write_text("mine")
    for opt in ("--out", "--png"):
        rc, err = _run(["trace", "--example", "--format", "markdown", opt, page], capsys)
        assert rc == 2 and len(err) == 1 and opt in err[0] and "--force" in err[0], err
        assert page.read_text() == "mine"
    rc, err = _run(["trace", "--example", "--format", "markdown", "--out", page, "--force"], capsys)
    assert rc == 0, err
    assert "weights" in page.read_text().lower() and page.read_text() != "mine"


def test_force_replaces_and_a_fresh_or_unrelated_folder_needs_nothing(tmp_path, capsys):
    out = tmp_path / "viz"
    rc, err = _run(["viz", "the cat sat", "--model", "random", "--out", out], capsys)  # a new folder
    assert rc == 0, err
    first = (out / "index.html").read_text()
    rc, err = _run(["viz", "the dog ran", "--model", "random", "--out", out], capsys)  # the rerun: refused
    assert rc == 2 and "--force" in err[0] and (out / "index.html").read_text() == first
    rc, err = _run(["viz", "the dog ran", "--model", "random", "--out", out, "--force"], capsys)
    assert rc == 0, err
    assert (out / "index.html").read_text() != first and "dog" in (out / "index.html").read_text()
    notes = tmp_path / "notes"  # a folder holding no run (no results, no JSON, no page) is fine as it is
    notes.mkdir()
    (notes / "README.txt").write_text("mine")
    rc, err = _run(["viz", "the cat sat", "--model", "random", "--out", notes], capsys)
    assert rc == 0 and (notes / "README.txt").read_text() == "mine" and (notes / "index.html").exists()


@pytest.mark.slow  # runs the quick variance experiment twice (seconds each)
def test_variance_refuses_its_own_earlier_run_and_force_replaces_it(tmp_path, capsys):
    argv = ["experiment", "variance", "--quick", "--no-minilm", "--no-progress", "--d-k", "16,32", "--out", tmp_path]
    assert _run(argv, capsys)[0] == 0
    before = (tmp_path / "results.json").read_text()
    rc, err = _run(argv, capsys)
    assert rc == 2 and "holds an earlier run" in err[0] and "--resume" not in err[0]  # variance does not resume
    assert (tmp_path / "results.json").read_text() == before
    assert _run(argv + ["--force"], capsys)[0] == 0
