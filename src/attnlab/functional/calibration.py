"""The calibration: measure the kernels on this CPU and fit the planner's rates (Note [Calibrated rates]
in ``attnlab.kernels.rates``), in the foreground (``attnlab calibrate``, ``attnlab.bench.calibrate``) or in
the background of the first long call (Note [Background calibration]). What the grid measures, step by step,
its sizes (``CalibrationConfig``) and errors: ``functional.calibration_grid``.

Note [Background calibration]: without a calibration file, the first call predicted to take at least
``LONG_CALL_S`` (``note_call``, given the call's predicted seconds) starts the grid in a daemon thread,
once per process: never at import, never for a short call, never with ``ATTNLAB_CALIBRATION=off`` or a
file already there. The thread measures only while the process is idle, never beside the user's work
(Note [Calibration yields]), writes the file atomically and hands the fitted rates over; the next call that
plans (a plan-cache miss) makes them current (``rates.make_current``, which clears the plan cache) on its
own thread (a cached plan made with the old rates runs the same result, up to its kernel's rounding, until
then). A failure in the thread is one warning; the built-in table stays.

Only ``calibrate()`` measures, never an import.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import threading
import time
import warnings
from typing import Callable

import torch

from .. import kernels as K
from .. import patterns as P
from ..kernels import rates
from ..kernels.spec import Tiling
from ..shapes import prepare
from ..timing import interleaved
from .calibration_grid import (MARGIN, CalibrationConfig, Cancelled, Preempted, Tick, TooNoisy,  # noqa: F401
                               _decode_ratios, _dense_flops, _kernel_call, _least_keys, _least_pairs, _qkv,
                               _ratio, _ratio_spread, _train_ratios)

__all__ = ["CalibrationConfig", "calibrate", "MARGIN", "note_call", "seconds_for", "background", "state",
           "LONG_CALL_S", "ASSUMED_FLOPS", "TooNoisy", "Cancelled", "Preempted", "held", "MIN_CPU_SHARE",
           "CPU_CLOCK", "TICK_S", "TICK_TOL_S", "TICK_BOUND_TICKS", "MAX_TICK_SHARE", "MAX_RATIO_SPREAD", "CLOCK"]

#: a call predicted to take at least this long starts the background calibration (Note [Background calibration])
LONG_CALL_S = 1.0
#: FLOP/s that turn a call's FLOPs into its predicted seconds where nothing is measured yet (``seconds_for``):
#: about half of a 2-core AVX-512 machine's fp32 GEMM rate, so that only calls of ~10^11 FLOPs count as long
ASSUMED_FLOPS = 1e11

# Note [Tick-bound samples]: under a load above the core count a 2-thread call waits for its descheduled
# thread, and samples read whole scheduler ticks (``bench planner`` under a load of 4-6 on 2 cores: 8.00,
# 16.02, 20.04 ms, a 0.3 ms decode call and its SDPA both 8.00 ms). Their ratios collapse towards 1, under
# MARGIN, and a file fitted from them says "SDPA everywhere". So the grid refuses to fit (``TooNoisy``:
# nothing is written, the planner keeps what it had) when
# - a step's samples are whole ticks: at least MAX_TICK_SHARE of them within TICK_TOL_S of a multiple of
#   TICK_S, counting samples of at most TICK_BOUND_TICKS ticks (where one tick is 4 % of a sample or more,
#   near MARGIN; on a quiet machine a sample lands there by chance 1 time in 40; busy, 8.00 ms read 8.00 to
#   8.04), or any sample reads 0 (a clock coarser than the call);
# - the process got under MIN_CPU_SHARE of its threads' cores during a step (CPU time over wall time times
#   threads): the rest went to other processes, whose load distorts each kernel differently (a grid under a
#   load of 7 on 2 cores ran every kernel 3-5x slower, the compiled kernel's small GQA calls 0.62x SDPA's
#   speed where a quiet one measured 1.01x);
# - or the per-round ratios of the compared kernels scatter: the median over the grid's comparisons of their
#   interquartile range over their median is above MAX_RATIO_SPREAD (each round times both kernels back to
#   back, so a steady load cancels in a ratio; one that comes and goes within rounds does not).
#: the scheduler tick (CONFIG_HZ = 250) that tick-bound samples are multiples of
TICK_S = 0.004
#: how close to a whole number of ticks a tick-bound sample reads, and the longest sample counted (in ticks)
TICK_TOL_S, TICK_BOUND_TICKS = 5e-5, 25
#: the share of a step's samples (of at least 8) that may read whole ticks
MAX_TICK_SHARE = 0.6
#: the median relative interquartile range of the per-round ratios above which the fit is refused. Not lower:
#: with one other CPU-bound process on the 2 cores (the common busy case) the grid scattered by 38 % and its
#: rates still replayed (``bench.planner.replay``) at 98.4 % within 5 % on the quiet sweep, as the quiet
#: calibration's did; at 0.25 that machine could never calibrate. The load-7 grid above scattered less and is
#: refused by MIN_CPU_SHARE.
MAX_RATIO_SPREAD = 0.6
#: the clock the grid times with (the tests give a coarse or jittery one: Note [Tick-bound samples])
CLOCK = time.perf_counter
#: the process's CPU seconds (all threads), for the share of the cores a step got; the tests give a slow one
CPU_CLOCK = time.process_time
#: the least share of ``torch.get_num_threads()`` cores' time a step's process may get (over steps of at least
#: 0.2 s): the grid calibrated under a load of 6-8 on 2 cores got 26 % and fitted rates that sent 8 of the 62
#: sweep's calls to the slower kernel (one other CPU-bound process leaves about 67 %)
MIN_CPU_SHARE = 0.5


def _tick_bound(t: dict, label: str, tick_s: float = TICK_S) -> str | None:
    """Why the samples of one step (``t``: {name: Timing}) are tick-bound, or None (Note [Tick-bound samples])."""
    samples = [x * tm.calls_per_sample for tm in t.values() for x in tm.times]  # each sample's wall time
    if any(s <= 0 for s in samples):
        return f"{label}: a sample read 0 s (the clock is coarser than the call)"
    hits = sum(1 <= round(s / tick_s) <= TICK_BOUND_TICKS and abs(s - round(s / tick_s) * tick_s) <= TICK_TOL_S
               for s in samples)
    if len(samples) >= 8 and hits >= MAX_TICK_SHARE * len(samples):
        return f"{label}: {hits} of {len(samples)} samples are whole {tick_s * 1e3:g} ms scheduler ticks"
    return None


def calibrate(cfg: CalibrationConfig | None = None, tick: Tick | None = None, save: bool = True,
              cancel: threading.Event | None = None, busy: Callable[[], bool] | None = None):
    """Measure the grid, fit the rates, and (``save``) write them as this machine's calibration.

    Returns (rates.Rates, measured: {case: seconds per call}, path or None). ``tick(done, total, label)``
    reports progress. Without the compiled extension only the sparse, SDPA, tiled and dense kernels' rates
    are measured (the others keep the built-in table's values). Raises ``TooNoisy`` (nothing written) when
    the samples are tick-bound or scattered (Note [Tick-bound samples]), and ``Cancelled`` (nothing written)
    within one sample of ``cancel`` being set, and ``Preempted`` (nothing written) within one sample of ``busy()``
    turning true (read at most every ``BUSY_POLL_S``: Note [Calibration yields])."""
    cfg = cfg or CalibrationConfig()
    base_clock = CLOCK
    polled = [-float("inf")]

    def clock() -> float:  # read between samples: the point where a cancelled or preempted calibration stops
        if cancel is not None and cancel.is_set():
            raise Cancelled("the calibration was cancelled; nothing written")
        now = base_clock()
        if busy is not None and now - polled[0] >= BUSY_POLL_S:
            polled[0] = now
            if busy():
                raise Preempted("this process's own work ran during the calibration; nothing written")
        return now

    tick = tick or (lambda *a: None)
    base = rates.builtin()
    have_ext = K.COMPILED.unavailable_reason() is None
    have_decode = have_ext and K.DECODE.unavailable_reason() is None
    sizes = tuple(sorted({m for m in cfg.dense_ns if m < cfg.n} | {cfg.n}))
    H4, kv_gqa = cfg.plain_heads, min(cfg.gqa_kv_heads, cfg.plain_heads)
    head_kinds = (False, True) if kv_gqa < H4 else (False,)  # Note [The plain grid's heads]
    total = 2 + (2 + len(head_kinds) * len(cfg.dtypes) * len(sizes) + len(cfg.dtypes) * len(cfg.train_ns)
                 if have_ext else 0) + (len(cfg.dtypes) if have_decode else 0)
    done, measured = 0, {}
    budget = cfg.budget_s / total

    spreads = []  # of the per-round ratios of every comparison (Note [Tick-bound samples])

    def timings(calls):
        cpu0, wall0 = CPU_CLOCK(), clock()
        t = interleaved(calls, rounds=cfg.rounds, min_rounds=min(cfg.min_rounds, cfg.rounds),
                        min_sample_s=cfg.min_sample_s, budget_s=budget, clock=clock)
        cpu, wall = CPU_CLOCK() - cpu0, clock() - wall0
        why = _tick_bound(t, f"timing {', '.join(calls)}")
        share = cpu / (wall * torch.get_num_threads()) if wall >= 0.2 else 1.0
        if not why and share < MIN_CPU_SHARE:
            why = (f"timing {', '.join(calls)}: this process got {share:.0%} of {torch.get_num_threads()} cores' "
                   f"time, under {MIN_CPU_SHARE:.0%}: other processes took the rest")
        if why:
            raise TooNoisy(f"the machine is too busy to calibrate ({why}); nothing written, the planner keeps "
                           f"{rates.current().source.split(' (')[0]}: rerun on a quieter machine")
        for name, tm in t.items():
            measured[name] = tm.median
        return t

    def ratio(t, slow, fast):
        spreads.append(_ratio_spread(t, slow, fast))
        return _ratio(t, slow, fast)

    def timed(calls):
        return {name: tm.median for name, tm in timings(calls).items()}

    def step(label):
        nonlocal done
        done += 1
        tick(done, total, label)

    n, scale = cfg.n, cfg.dim ** -0.5
    q, k, v = _qkv(cfg, torch.float32)
    band = P.sliding_window(cfg.window, causal=True)
    dense_flops = _dense_flops(cfg.heads, n, n, cfg.dim)
    gflops = {}
    with torch.no_grad():
        # 1) the compiled kernel's speed per pair at each block shape (dense: every shape computes n^2 pairs)
        block_speed = dict(base.compiled_block_speed)
        if have_ext:
            shapes = [b for b in base.compiled_block_speed if b[0] <= n and b[1] <= n]
            pd = prepare(q, k, v, None, 0.0, False, scale).live()
            t = timed({f"compiled {b[0]}x{b[1]} dense float32": (
                lambda b=b: K.COMPILED.run(pd, Tiling(*b))) for b in shapes})
            fastest = min(t.values())
            block_speed.update({b: fastest / t[f"compiled {b[0]}x{b[1]} dense float32"] for b in shapes})
            gflops[K.COMPILED.name] = dense_flops / fastest / 1e9
            step("compiled kernel block shapes")
        # 2) the sparse kernel's GFLOP/s at each block edge, on the band
        sp, cc, sd = K.SPARSE, K.COMPILED, K.SDPA
        runs = {bs: _kernel_call(q, k, v, sp, pattern=band, block_size=bs) for bs in base.sparse_block_speed}
        t = timed({f"{sp.name} {bs} window float32": run for bs, (run, _) in runs.items()})
        sparse_speed = {bs: plan.flops[sp.name] / t[f"{sp.name} {bs} window float32"] / 1e9
                        for bs, (_, plan) in runs.items()}
        step("sparse kernel block edges")
        # 3) the kernels whose rate is one number, on the dense call
        one_rate = (K.SDPA, K.TILED, K.DENSE)
        t = timed({f"{kk.name} dense float32": _kernel_call(q, k, v, kk)[0] for kk in one_rate})
        gflops.update({kk.name: dense_flops / t[f"{kk.name} dense float32"] / 1e9 for kk in one_rate})
        step("sdpa, tiled and dense kernels")
        dense_dtypes, soc, min_pairs, decode = base.compiled_dense_dtypes, base.sparse_over_compiled, {}, {}
        gqa_pairs, train_pairs = {}, {}
        if have_ext:
            # 4) the compiled kernel against SDPA on plain inputs, per dtype and size
            dense_dtypes = []
            for dt in cfg.dtypes:
                name = str(dt).removeprefix("torch.")
                for gqa in head_kinds:
                    points = {False: [], True: []}  # causal: [(pairs, SDPA's time / the compiled kernel's)]
                    heads = " gqa" if gqa else ""
                    for size in sizes:
                        qd, kd, vd = _qkv(dataclasses.replace(cfg, n=size), dt, kv_gqa if gqa else None, H4)
                        label = {c: f"{'causal' if c else 'dense'} {name}{heads} n={size}" for c in (False, True)}
                        calls = {f"{kk.name} {label[c]}": _kernel_call(qd, kd, vd, kk, is_causal=c, enable_gqa=gqa)[0]
                                 for c in (False, True) for kk in (sd, cc)}
                        t = timings(calls)
                        ratios = {c: ratio(t, f"{sd.name} {label[c]}", f"{cc.name} {label[c]}") for c in (False, True)}
                        for c, r in ratios.items():
                            points[c].append((H4 * size * size, r))
                        if not gqa and size == cfg.n and min(ratios.values()) >= MARGIN:
                            dense_dtypes.append(dt)
                        step(f"compiled vs sdpa, {name}{heads}, n={size}")
                    # a line per mask kind (Note [Calibration against the sweep])
                    (gqa_pairs if gqa else min_pairs).update({(dt, c): _least_pairs(points[c]) for c in (False, True)})
            # 7) the same on forward + backward, what a call whose inputs require grad runs (Note [Plan the pass
            # that runs]): SDPA's and the compiled kernel's autograd through the public API, MHA
            train_pairs = _train_ratios(cfg, timings, step, ratio)
            # 5) compiled against sparse per computed pair, each at its chosen blocks
            runs = {kk: _kernel_call(q, k, v, kk, pattern=band) for kk in (cc, sp)}
            t = timed({f"{kk.name} chosen window float32": run for kk, (run, _) in runs.items()})
            speed = {kk: plan.flops[kk.name] / t[f"{kk.name} chosen window float32"] for kk, (_, plan) in runs.items()}
            soc = speed[cc] / speed[sp]
            step("compiled vs sparse on a window")
        decode_keys, steps, step_keys = {}, {}, {}
        if have_decode:
            # 6) plain decode calls: the decode path against SDPA, MHA and GQA, per dtype and cache length, at
            # attention's door and the steps' (Note [Each door its crossing])
            decode, steps = _decode_ratios(cfg, timings, step, ratio)
            decode_keys = {key: _least_keys(list(pts.items())) for key, pts in decode.items()}
            step_keys = {key: _least_keys(list(pts.items())) for key, pts in steps.items()}
    spread = sorted(spreads)[len(spreads) // 2] if spreads else 0.0
    if spread > MAX_RATIO_SPREAD:
        raise TooNoisy(f"the machine is too busy to calibrate (the kernels' per-round speed ratios scatter by "
                       f"{spread:.0%} of their median, over {MAX_RATIO_SPREAD:.0%}); nothing written, the planner "
                       f"keeps {rates.current().source.split(' (')[0]}: rerun on a quieter machine")
    fitted = rates.Rates(sparse_speed, block_speed, tuple(dense_dtypes), float(soc), "calibrated on this CPU",
                         compiled_dense_min_pairs=min_pairs, kernel_gflops=gflops, decode_over_sdpa=decode,
                         compiled_gqa_min_pairs=gqa_pairs, decode_min_keys=decode_keys,
                         compiled_train_min_pairs=train_pairs, step_over_sdpa=steps, step_min_keys=step_keys)
    path = rates.save(fitted, measured) if save else None
    return (rates.current() if save else fitted), measured, path


# -- in the background (Note [Background calibration]) ------------------------------------------------
# Note [Calibration at exit]: the background calibration runs torch ops in a daemon thread. When the interpreter
# finalises while such a thread is inside a pybind call, the thread dies in ``PyThread_exit_thread`` on its way
# back to the GIL; that forced unwind through C++ frames ends in ``std::terminate`` ("terminate called without
# an active exception", SIGABRT, exit 134: 3 times out of 3 for a script whose last call started the grid).
# So the thread never outlives the interpreter: ``_stop_at_exit`` (atexit, registered when the thread starts;
# it runs after the main thread's code and before finalisation) sets the cancel event and joins the thread.
# The grid checks the event at every clock reading, i.e. between samples (each at most ``min_sample_s`` of
# calls, or one call), so the join waits one sample; it writes nothing (the file is written atomically at the
# end or not at all), and the process exits with its own status.
_BACKGROUND: threading.Thread | None = None
_BACKGROUND_LOCK = threading.Lock()
_PENDING: rates.Rates | None = None  # fitted by the background thread, made current by the next note_call
_CANCEL = threading.Event()
#: how long the exit waits for the background thread to stop (it stops within one sample; a guard only)
EXIT_JOIN_S = 120.0


def seconds_for(flops: float) -> float:
    """A call's predicted seconds from its FLOPs at ``ASSUMED_FLOPS`` (for ``note_call`` before the cost model
    predicts times itself)."""
    return flops / ASSUMED_FLOPS


# Note [Calibration yields]: the grid keeps two cores busy for about 50 s. Started by the first long call and run
# beside it, it competed with the user's work unseen: on SmolLM2 (transformers, attn_implementation="attnlab") an
# 8,000-token prompt's first layer is such a call (predicted 1.5 s), and the grid then shared the 2 cores with the
# other 29 layers: on a CPU class with no shipped table that prefill took 38.4 s, the next one 23.1 s (2 cores, one
# process each: with this yield 17.8 and 17.6 s, with ATTNLAB_CALIBRATION=off 18.7 and 16.3 s). So the thread
# yields to its own process:
# - it starts timing only once the process's other Python threads (the user's: torch's pool threads only help the
#   Python thread that made the call, and that one runs too) have used under IDLE_SHARE of a core for IDLE_S
#   (``_wait_idle``; /proc counts CPU time in 10 ms ticks, so a poll that saw one tick was not idle);
# - while it times, those threads' CPU time is read between samples (at most every BUSY_POLL_S); more than
#   BUSY_CPU_S since the last reading (the user's work is back) stops the grid (``Preempted``: nothing written),
#   and it waits for the next idle spell and starts over, at most MAX_PREEMPTIONS times, then gives up (the
#   built-in or shipped table stays; ``attnlab calibrate`` measures in the foreground).
# A script whose last long call is its last work therefore never calibrates in the background (its exit cancels the
# waiting thread: Note [Calibration at exit]); an interactive session does, between its calls. ``state()`` (``attnlab
# info``, ``explain``'s rates line) says whether the thread waits, runs, was interrupted, or gave up. The CPU times
# are read from /proc (Linux); where they cannot be read the process counts as idle (the grid runs as before).
#: the idle spell the grid waits for: the other threads' CPU under IDLE_SHARE of one core for IDLE_S seconds
IDLE_S, IDLE_SHARE, IDLE_POLL_S = 0.25, 0.1, 0.05
#: while timing: the other threads' CPU seconds since the last reading (every BUSY_POLL_S at most) that stop the grid
BUSY_CPU_S, BUSY_POLL_S = 0.02, 0.05
#: the grid starts over this many times after being stopped by the process's work, then gives up
MAX_PREEMPTIONS = 5
_PREEMPTIONS: list[int] = [0]
_PHASE: list[str] = ["waiting"]  # "waiting" (for an idle spell), "running", "gave up"


def _others_cpu(me: int | None) -> float | None:
    """CPU seconds used so far by this process's Python threads other than native thread ``me``; None where
    /proc cannot be read (Note [Calibration yields])."""
    tick = _CLK_TCK
    total, read = 0.0, False
    for t in threading.enumerate():
        tid = t.native_id
        if tid is None or tid == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # a thread that just ended, or no /proc
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime + stime, in clock ticks
        read = True
    return total if read else None


try:
    _CLK_TCK = os.sysconf("SC_CLK_TCK")
except (AttributeError, ValueError, OSError):
    _CLK_TCK = 100


def _wait_idle(me: int | None) -> None:
    """Return once the other threads have been idle for IDLE_S (Note [Calibration yields]); ``Cancelled`` when the
    cancel event is set meanwhile."""
    last, quiet = _others_cpu(me), 0.0
    while quiet < IDLE_S:
        if _CANCEL.wait(IDLE_POLL_S):
            raise Cancelled("the calibration was cancelled while it waited; nothing written")
        now = _others_cpu(me)
        if now is None or last is None:
            return
        quiet = quiet + IDLE_POLL_S if now - last <= IDLE_SHARE * IDLE_POLL_S else 0.0
        last = now


def _busy(me: int | None) -> Callable[[], bool]:
    """calibrate()'s ``busy``: whether the other threads used more than BUSY_CPU_S since the previous reading."""
    last = [_others_cpu(me)]

    def busy() -> bool:
        now = _others_cpu(me)
        was, last[0] = last[0], now
        return now is not None and was is not None and now - was > BUSY_CPU_S

    return busy


def _calibrate_in_background() -> rates.Rates:
    """The thread's work: the grid, saved without making it current (``note_call`` does); it yields to the
    process's own work (``Preempted``: Note [Calibration yields])."""
    fitted, measured, _ = calibrate(save=False, cancel=_CANCEL, busy=_busy(threading.get_native_id()))
    rates.save(fitted, measured, reload_now=False)
    return fitted


def _thread_body() -> None:
    global _PENDING
    me = threading.get_native_id()
    try:
        while True:
            _PHASE[0] = "waiting"
            _wait_idle(me)
            _PHASE[0] = "running"
            try:
                fitted = _calibrate_in_background()
                break
            except Preempted:
                _PREEMPTIONS[0] += 1
                if _PREEMPTIONS[0] > MAX_PREEMPTIONS:
                    _PHASE[0] = "gave up"
                    return
    except (TooNoisy, Cancelled):  # a busy machine, or the process is exiting: the built-in table stays
        return
    except Exception as e:  # noqa: BLE001 - a background failure must not reach the user's call
        warnings.warn(f"attnlab: the background calibration failed ({type(e).__name__}: {e}); the planner keeps "
                      "its built-in table (run `attnlab calibrate` to measure this CPU)", RuntimeWarning)
        return
    _PENDING = dataclasses.replace(fitted, source=f"calibrated on this CPU in the background ({rates.cache_path()})")


def _stop_at_exit() -> None:
    """Note [Calibration at exit]: cancel the background calibration and wait for its thread."""
    t = _BACKGROUND
    if t is not None and t.is_alive():
        _CANCEL.set()
        t.join(EXIT_JOIN_S)


# Note [Calibration held]: the background grid times kernels on the cores the user's work runs on. While the
# process times something itself (``attnlab bench``: its ratios would carry the grid's load, unseen), the grid
# is held: a running one is cancelled and joined (it writes nothing), and none starts until the hold ends.
# ``state()`` (``attnlab info``) and ``explain``'s rates line say when it runs, was cancelled, or is held.
_HELD: list[str] = []
_CANCELLED_BY: list[str] = []


@contextlib.contextmanager
def held(reason: str):
    """No background calibration inside the block (Note [Calibration held]); ``reason`` shows in ``state()``."""
    _HELD.append(reason)
    try:
        t = _BACKGROUND
        if t is not None and t.is_alive():
            _CANCEL.set()
            t.join(EXIT_JOIN_S)
            _CANCELLED_BY.append(reason)
        yield
    finally:
        _HELD.remove(reason)


def note_call(predicted_s: float) -> threading.Thread | None:
    """Tell the calibration a call is about to run for about ``predicted_s`` seconds (Note [Background
    calibration]): makes rates fitted in the background current, and starts the background calibration
    when this is the first long call without a calibration file. Returns the thread when this call
    started it, else None. Costs one comparison for a short call."""
    global _BACKGROUND, _PENDING
    if _PENDING is not None:
        fitted, _PENDING = _PENDING, None
        rates.make_current(fitted)
    if predicted_s < LONG_CALL_S or _BACKGROUND is not None or _HELD:
        return None
    with _BACKGROUND_LOCK:
        src = rates.current().source
        # a built-in table, or another class's shipped one, is worth refining; this class's shipped one is not
        # worth half a minute of the user's cores unasked (Note [Shipped rate tables])
        if _BACKGROUND is not None or not rates.calibration_enabled() or not (
                src.startswith("built-in") or src.startswith("shipped table of the nearest")):
            return None
        if rates.cache_path().exists():  # a file that did not load (it warned): `attnlab calibrate` rewrites it
            return None
        _CANCEL.clear()
        _PREEMPTIONS[0], _PHASE[0] = 0, "waiting"
        _BACKGROUND = threading.Thread(target=_thread_body, name="attnlab-calibration", daemon=True)
        atexit.register(_stop_at_exit)
        _BACKGROUND.start()
        return _BACKGROUND


def background() -> threading.Thread | None:
    """The background calibration's thread if this process started one (alive or finished), else None."""
    return _BACKGROUND


def state() -> dict:
    """For ``attnlab info``: whether calibration is on, the file for this machine, where the rates come from,
    and the background calibration's state ("not started", "running" or "finished")."""
    path = rates.cache_path()
    n = _PREEMPTIONS[0]
    again = f" (started over after {n} interruption{'s' if n > 1 else ''} by this process's work)" if n else ""
    if _BACKGROUND is None:
        bg = "not started"
    elif _BACKGROUND.is_alive():
        bg = ("waiting for this process to go idle" + again if _PHASE[0] == "waiting" else "running" + again)
    elif _CANCELLED_BY:
        bg = f"cancelled ({_CANCELLED_BY[-1]})"
    elif _PHASE[0] == "gave up":
        bg = (f"gave up: interrupted {n} times by this process's work (`attnlab calibrate` measures in the "
              "foreground)")
    else:
        bg = "finished" + again
    if _HELD and not (_BACKGROUND is not None and _BACKGROUND.is_alive()):
        bg += f", held ({_HELD[-1]})"
    return {"enabled": rates.calibration_enabled(), "file": str(path), "exists": path.exists(),
            "source": rates.current().source, "background": bg}
