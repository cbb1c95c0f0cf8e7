"""The ``attnlab`` console script (``src/attnlab_launch.py``): Ctrl-C while torch imports exits 130 with one line.

The signal tests start real processes (``python -m attnlab_launch``, what the installed script runs) and
send SIGINT once torch's shared library is mapped into the process, i.e. while ``import attnlab`` is under
way. Before the launcher existed this printed a KeyboardInterrupt traceback and exited -2.
"""
import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from importlib.util import module_from_spec, spec_from_file_location
from pathlib import Path

import pytest

import attnlab

SRC = Path(attnlab.__file__).resolve().parents[1]
ROOT = SRC.parent
# attnlab_launch sits beside the package, not in it: load it from the same tree as the attnlab under test
_spec = spec_from_file_location("attnlab_launch", SRC / "attnlab_launch.py")
attnlab_launch = module_from_spec(_spec)
_spec.loader.exec_module(attnlab_launch)

ARGV = ["list", "--kind", "exact", "--json"]  # fast once imported, and prints JSON on success
POSIX_PROC = sys.platform.startswith("linux") and Path("/proc/self/maps").exists()


def _env(**extra):
    return dict(os.environ, PYTHONPATH=str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra)


def _start(sigint=signal.SIG_DFL, env=None):
    # the child's SIGINT disposition is set explicitly: a test runner started in the background inherits
    # SIG_IGN, which the launcher (rightly) keeps
    return subprocess.Popen([sys.executable, "-m", "attnlab_launch", *ARGV], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env or _env(),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, sigint))


def _interrupt_while_importing(p) -> None:
    """SIGINT as soon as libtorch is mapped (torch's import has begun), or after 20 s at the latest."""
    deadline = time.monotonic() + 20
    while p.poll() is None and time.monotonic() < deadline:
        try:
            if "libtorch_cpu" in Path(f"/proc/{p.pid}/maps").read_text():
                break
        except OSError:
            pass
        time.sleep(0.005)
    if p.poll() is None:
        p.send_signal(signal.SIGINT)


def _finish(p):
    try:
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    return p.returncode, out, [ln for ln in err.splitlines() if ln.strip()]


@pytest.mark.skipif(not POSIX_PROC, reason="watches /proc/PID/maps to send SIGINT during the import")
def test_ctrl_c_while_torch_imports_exits_130_with_one_line():
    outcomes = []
    for _ in range(5):  # torch's import takes seconds, so the first try lands inside it unless the machine stalls
        p = _start()
        _interrupt_while_importing(p)
        rc, out, err = _finish(p)
        outcomes.append((rc, err))
        if err == [attnlab_launch.interrupted_line(ARGV)]:
            assert rc == 130 and out == "", (rc, out, err)
            return
        # the import finished first: the command's own Ctrl-C line, or a run that completed
        assert (rc, len(err)) in ((130, 1), (0, 0)) and "Traceback" not in "".join(err), (rc, err)
    pytest.fail(f"SIGINT never landed during the import in 5 tries: {outcomes}")


@pytest.mark.skipif(not POSIX_PROC, reason="watches /proc/PID/maps to send SIGINT during the import")
def test_a_process_started_with_sigint_ignored_keeps_ignoring_it():
    """nohup and background jobs of a script start with SIGINT ignored; the launcher must not undo that."""
    p = _start(sigint=signal.SIG_IGN)
    _interrupt_while_importing(p)
    rc, out, err = _finish(p)
    assert rc == 0 and err == [] and '"name": "auto"' in out, (rc, err)


def test_a_broken_install_is_one_line_and_exit_1(tmp_path):
    fake = tmp_path / "attnlab"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('libtorch_cpu.so: cannot open shared object file')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(SRC)]))
    env.pop("ATTNLAB_TRACEBACK", None)
    r = subprocess.run([sys.executable, "-m", "attnlab_launch", "list"], capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode == 1 and r.stderr.splitlines() == [
        "attnlab: error: cannot import attnlab: ImportError: libtorch_cpu.so: cannot open shared object file "
        "(ATTNLAB_TRACEBACK=1 shows the traceback)"], r.stderr


def test_sigint_is_handed_back_before_the_command_runs(monkeypatch, capsys):
    """The commands' own Ctrl-C handling (checkpoints, ``interrupted_message``) needs a handler that raises
    KeyboardInterrupt: Python's, wrapped by cli.main so that the first Ctrl-C raises and later ones are ignored
    (a second one had interrupted the exit with a traceback); Python's own is back after the command."""
    import attnlab.cli.list_cmd as L

    seen = []
    monkeypatch.setattr(L, "run", lambda args: seen.append(signal.getsignal(signal.SIGINT)) or {"exit_code": 0})
    monkeypatch.setattr(sys, "argv", ["attnlab", "list"])
    before = signal.getsignal(signal.SIGINT)
    assert before is signal.default_int_handler
    assert attnlab_launch.main() == 0
    assert len(seen) == 1 and callable(seen[0]) and signal.getsignal(signal.SIGINT) is before
    try:
        with pytest.raises(KeyboardInterrupt):
            seen[0](signal.SIGINT, None)  # the first Ctrl-C raises ...
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # ... and the next ones are ignored
    finally:
        signal.signal(signal.SIGINT, before)


def test_the_console_script_is_the_launcher_and_is_installed():
    tomllib = pytest.importorskip("tomllib")
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["scripts"]["attnlab"] == "attnlab_launch:main"
    assert "attnlab_launch" in meta["tool"]["setuptools"]["py-modules"]
    assert (SRC / "attnlab_launch.py").is_file()


@pytest.mark.slow
def test_a_built_wheel_holds_the_launcher_and_its_entry_point(tmp_path):
    """A regular install gets the module: build the wheel (no C++ extension) from a copy of the sources."""
    tree = tmp_path / "tree"
    shutil.copytree(SRC, tree / "src", ignore=shutil.ignore_patterns("*.so", "__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    code = "import sys; from setuptools import build_meta as b; print(b.build_wheel(sys.argv[1]))"
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "dist")], cwd=tree, capture_output=True,
                       text=True, env=dict(os.environ, ATTNLAB_NO_BUILD_EXT="1"), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    wheel = zipfile.ZipFile(tmp_path / "dist" / r.stdout.strip().splitlines()[-1])
    names = wheel.namelist()
    assert "attnlab_launch.py" in names and "attnlab/cli/main.py" in names
    entry = wheel.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert "attnlab = attnlab_launch:main" in entry.splitlines()
