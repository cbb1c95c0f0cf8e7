"""Every ```python block in README.md and docs/*.md runs as written.

Each block runs in a fresh interpreter (a block is a self-contained program, with its imports). A block
whose first line is ``# <name>.py -- launch: torchrun ...`` is a distributed script: it is written to
<name>.py and started with that torchrun command (the venv's torchrun, gloo on the CPU).
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.S | re.M)
LAUNCH = re.compile(r"^#\s*(\S+\.py)\s*--\s*launch:\s*(torchrun .+)$")


def blocks():
    for path in DOCS:
        text = path.read_text()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            yield pytest.param(m.group(1), id=f"{path.relative_to(ROOT)}:{line}")


def test_the_docs_have_python_blocks():
    assert len(list(blocks())) >= 10  # a regex slip would silently test nothing


@pytest.mark.slow
@pytest.mark.parametrize("code", list(blocks()))
def test_block_runs(code, tmp_path):
    env = dict(os.environ, MPLBACKEND="Agg", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    first = code.splitlines()[0]
    launch = LAUNCH.match(first)
    if launch:
        name, command = launch.groups()
        (tmp_path / name).write_text(code)
        argv = shlex.split(command)
        torchrun = Path(sys.executable).with_name("torchrun")
        argv = [str(torchrun) if torchrun.exists() else "torchrun", *argv[1:]]
    else:
        (tmp_path / "block.py").write_text(code)
        argv = [sys.executable, "block.py"]
    r = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    for _ in range(2):
        if not (launch and _teardown_abort(r, argv)):
            break
        # gloo can abort a rank while its process group is torn down, after the work is done and printed
        # (every rank's line is on stdout): torch's teardown, not the block's. A torch-only control (no attnlab
        # import: batch_isend_irecv between neighbours, all_gather, barrier, destroy_process_group; torch
        # 2.13, 2 ranks, beside other work on 2 cores) aborted so in 5 of 21 runs, "terminate called without an
        # active exception" after the interpreter's last Python frame; the ring block in 8 of 24. attnlab's
        # own abort at exit (the background calibration's thread, Note [Calibration at exit]) is fixed, and
        # cannot be this one: the tests run with ATTNLAB_CALIBRATION=off. So the block runs again; any other
        # failure fails at once
        r = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"block failed (rc {r.returncode}):\n{code}\n--- stderr ---\n{r.stderr[-3000:]}"


def _teardown_abort(r: subprocess.CompletedProcess, argv: list[str]) -> bool:
    """A torchrun block that did its work (one stdout line per rank) but lost a rank to gloo's
    "terminate called without an active exception" on the way out."""
    nproc = int(argv[argv.index("--nproc-per-node") + 1]) if "--nproc-per-node" in argv else 1
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    return (r.returncode != 0 and "terminate called without an active exception" in r.stderr
            and len(lines) >= nproc)


def test_readme_names_every_method_and_every_command():
    """README's method table has a row per ``attnlab.METHODS`` entry and its command list names every
    subcommand ``attnlab --help`` shows (both once lagged the code: ``compiled``, ``calibrate``)."""
    import attnlab
    from attnlab.cli.main import SUBCOMMANDS

    text = (ROOT / "README.md").read_text()
    rows = set(re.findall(r"^\| `(\w+)` \|", text, re.M))
    assert set(attnlab.METHODS) <= rows, f"methods missing from README's table: {set(attnlab.METHODS) - rows}"
    section = text.split("## Command line", 1)[1]
    named = set(re.findall(r"`(\w+)`", section.strip().split("\n\n", 1)[0]))  # its first paragraph
    assert set(SUBCOMMANDS) <= named, f"commands missing from README's command list: {set(SUBCOMMANDS) - named}"
