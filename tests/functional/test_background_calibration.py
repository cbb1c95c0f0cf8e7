"""Note [Background calibration]: the lazy calibration starts in a daemon thread for the first long call only,
once per process, never at import, never with ATTNLAB_CALIBRATION=off or a calibration file already there; its
rates become current at the next call that plans."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import warnings

import pytest

from attnlab.functional import calibration, plancache
from attnlab.kernels import rates


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """Calibration on, an empty cache folder, no background thread yet; the grid replaced by a fake that
    records its calls and returns the built-in table (the real one takes ~45 s)."""
    calls = []
    done = threading.Event()

    def fake():
        calls.append(threading.current_thread().name)
        fitted = rates.builtin()
        rates.save(fitted, {"fake": 1.0}, reload_now=False)
        done.set()
        return fitted

    monkeypatch.setenv("ATTNLAB_CALIBRATION", "on")
    monkeypatch.setenv("ATTNLAB_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "_calibrate_in_background", fake)
    monkeypatch.setattr(calibration, "_BACKGROUND", None)
    rates.reload()
    yield calls, done
    monkeypatch.undo()
    rates.reload()


def test_short_calls_never_start_it(fresh):
    calls, _ = fresh
    for s in (0.0, 1e-6, calibration.LONG_CALL_S * 0.99):
        assert calibration.note_call(s) is None
    assert calibration.background() is None and calls == [] and not rates.cache_path().exists()
    assert calibration.state()["background"] == "not started"


def test_the_first_long_call_starts_it_once_and_the_next_plan_takes_its_rates(fresh, monkeypatch):
    calls, done = fresh
    # the thread waits for `go`: a fake that finished before the second note_call would be handed over by it
    # (a race seen on a busy machine)
    go, fake = threading.Event(), calibration._calibrate_in_background
    monkeypatch.setattr(calibration, "_calibrate_in_background", lambda: (go.wait(30), fake())[1])
    t = calibration.note_call(calibration.LONG_CALL_S)
    assert isinstance(t, threading.Thread) and t.daemon and calibration.background() is t
    assert calibration.note_call(10 * calibration.LONG_CALL_S) is None  # once per process
    go.set()
    t.join(30)
    assert done.is_set() and calls == ["attnlab-calibration"]
    assert rates.cache_path().exists() and calibration.state()["background"] == "finished"
    assert rates.current().source.startswith("built-in")  # not yet: handed over at the next call that plans
    plancache.put(("sig",), None, None)
    assert calibration.note_call(0.0) is None
    assert rates.current().source.startswith("calibrated on this CPU in the background")
    assert plancache.stats()["entries"] == 0  # plans made with the old rates are forgotten


def test_off_or_an_existing_file_never_starts_it(fresh, monkeypatch):
    calls, _ = fresh
    rates.save(rates.builtin())  # a calibration file for this machine: nothing to do
    assert calibration.note_call(100.0) is None
    rates.cache_path().unlink()
    rates.reload()
    monkeypatch.setenv("ATTNLAB_CALIBRATION", "off")
    rates.reload()
    assert calibration.note_call(100.0) is None
    assert calibration.background() is None and calls == []


def test_a_failing_calibration_is_one_warning_and_the_table_stays(fresh, monkeypatch):
    def broken():
        raise RuntimeError("no cores today")

    monkeypatch.setattr(calibration, "_calibrate_in_background", broken)
    with pytest.warns(RuntimeWarning, match="background calibration failed .*no cores today"):
        t = calibration.note_call(calibration.LONG_CALL_S)
        t.join(30)
    assert calibration.note_call(0.0) is None and rates.current().source.startswith("built-in")


def test_a_busy_machine_keeps_the_table_without_a_file_or_a_warning(fresh, monkeypatch):
    """Note [Tick-bound samples]: the grid refusing to fit on a busy machine is no failure: nothing is written
    and the uncalibrated table stays."""
    def busy():
        raise calibration.TooNoisy("the machine is too busy to calibrate (injected)")

    monkeypatch.setattr(calibration, "_calibrate_in_background", busy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = calibration.note_call(calibration.LONG_CALL_S)
        t.join(30)
    assert not t.is_alive() and not rates.cache_path().exists()
    assert calibration.note_call(0.0) is None and rates.current().source.startswith("built-in")


def test_never_at_import(tmp_path):
    """A fresh interpreter importing attnlab (and planning a short call) starts no thread and writes no file."""
    code = ("import threading, torch, attnlab\n"
            "q = torch.randn(1, 2, 16, 8)\n"
            "attnlab.attention(q, q, q)\n"
            "from attnlab.functional import calibration\n"
            "assert calibration.background() is None, calibration.background()\n"
            "assert not any(t.name == 'attnlab-calibration' for t in threading.enumerate())\n"
            "print('ok')\n")
    env = {**os.environ, "ATTNLAB_CALIBRATION": "on", "ATTNLAB_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    assert list(tmp_path.iterdir()) == []


# -- Note [Calibration at exit] ----------------------------------------------------------------------
_EXITS = """
import pathlib, sys, time
from attnlab.functional import calibration
from attnlab.kernels import rates
rates.TABLES = pathlib.Path(sys.argv[3])             # no shipped table: a fresh install of an unrecorded class
t = calibration.note_call(calibration.LONG_CALL_S)   # the real grid, in its daemon thread
time.sleep(float(sys.argv[1]))                        # the thread is inside a timing now
print("running" if t is not None and t.is_alive() else "not running", flush=True)
sys.exit(int(sys.argv[2]))                            # the script ends with the grid mid-way
"""


def test_a_process_that_exits_during_the_background_calibration_exits_with_its_own_status(tmp_path):
    """Before the fix: "terminate called without an active exception", SIGABRT, exit 134, 3 times out of 3.
    Each run must have exited while the thread was running (else it proves nothing), with its own status, and
    left no calibration file (a cancelled grid writes nothing)."""
    script = tmp_path / "exits.py"
    script.write_text(_EXITS)
    runs = []
    for i in range(10):
        cache = tmp_path / f"cache{i}"
        env = dict(os.environ, ATTNLAB_CALIBRATION="on", ATTNLAB_CACHE_DIR=str(cache), OMP_NUM_THREADS="1")
        status = 3 if i % 2 else 0
        r = subprocess.run([sys.executable, str(script), "0.3", str(status), str(tmp_path / "no-tables")], env=env,
                           capture_output=True, text=True, timeout=180)
        runs.append((r.returncode, status, r.stdout.strip(), r.stderr.strip()[-300:]))
        assert not any(cache.glob("*.json")) if cache.exists() else True
    assert all(out == "running" for _, _, out, _ in runs), runs
    assert all(rc == status for rc, status, _, _ in runs), runs


def test_a_hold_cancels_a_running_grid_and_starts_none(fresh, monkeypatch):
    """Note [Calibration held]: `attnlab bench` holds the background grid; a running one is cancelled (nothing
    written) and joined, none starts inside the hold, and state() / explain say so."""
    import torch

    import attnlab

    started = threading.Event()

    def slow():  # a grid that runs until cancelled, as the real one stops at its next clock reading
        started.set()
        while not calibration._CANCEL.wait(0.01):
            pass
        raise calibration.Cancelled("cancelled")

    monkeypatch.setattr(calibration, "_calibrate_in_background", slow)
    t = calibration.note_call(calibration.LONG_CALL_S)
    assert t is not None and started.wait(10) and calibration.state()["background"] == "running"
    q = torch.randn(1, 2, 8, 4)
    assert "background calibration: running" in str(attnlab.explain(q, q, q))
    with calibration.held("attnlab bench is timing"):
        assert not t.is_alive() and not rates.cache_path().exists()
        assert calibration.note_call(100.0) is None
        assert calibration.state()["background"].startswith("cancelled (attnlab bench is timing)")
    assert "background calibration: cancelled" in str(attnlab.explain(q, q, q))


def test_bench_holds_the_background_grid(monkeypatch):
    from attnlab.cli import _suites

    seen = []
    monkeypatch.setattr(calibration, "note_call", lambda s: seen.append(calibration._HELD[:]))
    args = type("A", (), {})()
    args._suite_run = lambda a: calibration.note_call(100.0)
    _suites.run_suite(args)
    assert seen == [["attnlab bench is timing"]] and calibration._HELD == []
