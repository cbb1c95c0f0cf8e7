"""Note [Calibration yields]: the background calibration started by a long call inside a transformers model never
times beside the process's own work (issue 43: it competed with SmolLM2's 8,000-token prefill unseen). It waits
for an idle spell, stops at its next clock reading when the work comes back, starts over, and says so."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from attnlab.functional import calibration, plancache
from attnlab.kernels import rates

transformers = pytest.importorskip("transformers")
from attnlab.integrations import hf  # noqa: E402


@pytest.fixture
def unrecorded(tmp_path, monkeypatch):
    """A fresh install on a CPU class with no shipped table: calibration on, no file, no thread yet; the grid
    replaced by ``grid`` (the real one takes ~50 s), which records when it started."""
    starts: list[float] = []
    grid = {"run": lambda: rates.builtin()}

    def fake():
        starts.append(time.perf_counter())
        fitted = grid["run"]()
        rates.save(fitted, {"fake": 1.0}, reload_now=False)
        return fitted

    monkeypatch.setenv("ATTNLAB_CALIBRATION", "on")
    monkeypatch.setenv("ATTNLAB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(rates, "TABLES", tmp_path / "no-tables")
    monkeypatch.setattr(calibration, "_calibrate_in_background", fake)
    monkeypatch.setattr(calibration, "_BACKGROUND", None)
    monkeypatch.setattr(calibration, "_CANCELLED_BY", [])
    monkeypatch.setattr(calibration, "_PENDING", None)
    rates.reload()
    plancache.clear()
    yield starts, grid
    t = calibration.background()
    if t is not None and t.is_alive():
        calibration._stop_at_exit()
    monkeypatch.undo()
    rates.reload()
    plancache.clear()


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
                      num_key_value_heads=2, max_position_embeddings=256)
    hf.register("attnlab")
    model = LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation("attnlab")
    return model


def test_a_long_call_inside_a_model_starts_the_grid_only_once_the_model_is_done(unrecorded, monkeypatch):
    starts, _ = unrecorded
    model = _tiny_llama()
    monkeypatch.setattr(calibration, "LONG_CALL_S", 0.0)  # the model's first planned attention call counts as long
    ids = torch.randint(0, 64, (1, 37), generator=torch.Generator().manual_seed(0))
    seen = set()
    with torch.inference_mode():
        t_end = time.perf_counter() + 4 * calibration.IDLE_S + 0.5
        while time.perf_counter() < t_end:  # the model keeps the process busy for a while
            model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
            seen.add(calibration.state()["background"])
        done = time.perf_counter()
    t = calibration.background()
    assert t is not None, "the long call did not start the background calibration"
    assert seen == {"waiting for this process to go idle"}, seen
    assert starts == [], "the grid timed beside the model's work"
    t.join(30)
    assert not t.is_alive() and len(starts) == 1 and starts[0] >= done + calibration.IDLE_S * 0.9
    assert calibration.state()["background"] == "finished"


def test_a_running_grid_stops_when_the_work_comes_back_and_starts_over(unrecorded):
    starts, grid = unrecorded
    stop = threading.Event()
    attempts = []

    def real_hook():  # the grid's own clock hook on a grid that times until stopped
        attempts.append(calibration._PREEMPTIONS[0])
        cfg = calibration.CalibrationConfig(n=64, dense_ns=(), heads=2, plain_heads=2, gqa_kv_heads=1, dim=8,
                                            window=16, decode_ns=(), train_ns=(), rounds=1, min_rounds=1,
                                            min_sample_s=0.01, budget_s=1e-3)
        if len(attempts) == 1:  # the first attempt: keep timing until the work below interrupts it
            busy = calibration._busy(threading.get_native_id())
            while not stop.is_set():
                try:
                    calibration.calibrate(cfg, save=False, busy=busy)
                except calibration.TooNoisy:  # its samples beside the work below: only Preempted ends the loop
                    pass
            raise AssertionError("never preempted")
        return rates.builtin()

    grid["run"] = real_hook
    t = calibration.note_call(calibration.LONG_CALL_S)
    assert t is not None
    deadline = time.perf_counter() + 20
    while not starts and time.perf_counter() < deadline:
        time.sleep(0.01)  # idle: the grid starts
    assert starts and calibration.state()["background"] == "running"
    x = torch.randn(256, 256)
    t_end = time.perf_counter() + 0.5
    while time.perf_counter() < t_end:  # the process's own work
        x = torch.tanh(x @ x)
    t.join(30)
    stop.set()
    assert not t.is_alive() and attempts == [0, 1]
    # started over once, then fitted: the file is written
    assert rates.cache_path().exists()
    assert calibration.state()["background"] == "finished (started over after 1 interruption by this process's work)"


def test_calibrate_stops_at_its_first_clock_reading_when_busy():
    cfg = calibration.CalibrationConfig(n=64, dense_ns=(), heads=2, plain_heads=2, gqa_kv_heads=1, dim=8, window=16,
                                        decode_ns=(), train_ns=(), rounds=1, min_rounds=1, min_sample_s=0.01)
    with pytest.raises(calibration.Preempted, match="nothing written"):
        calibration.calibrate(cfg, save=False, busy=lambda: True)


def test_a_grid_interrupted_too_often_gives_up_and_says_so(unrecorded, monkeypatch):
    starts, grid = unrecorded

    def always():
        raise calibration.Preempted("injected")

    grid["run"] = always
    monkeypatch.setattr(calibration, "IDLE_S", 0.0)
    t = calibration.note_call(calibration.LONG_CALL_S)
    t.join(30)
    assert len(starts) == calibration.MAX_PREEMPTIONS + 1 and not rates.cache_path().exists()
    assert calibration.state()["background"].startswith(
        f"gave up: interrupted {calibration.MAX_PREEMPTIONS + 1} times by this process's work")
    assert calibration.note_call(100.0) is None  # once per process
