"""The cost model's rates: the planner's built-in table, or a calibration measured on this CPU.

Note [Calibrated rates]: ``attnlab calibrate`` (``attnlab.bench.calibrate``) times the kernels on this
CPU and writes the rates the planner compares kernels by (``RATE_NAMES``) to one JSON file per machine
key (CPU model and flags, thread count, torch and attnlab versions) in ``ATTNLAB_CACHE_DIR`` or
``$XDG_CACHE_HOME/attnlab`` (``~/.cache/attnlab``), written atomically. The planner reads it on its first
plan that compares rates (never at import) and after ``reload()``; without a file it uses the built-in
table. A file that does not parse, or whose key is another machine's, is ignored with one warning (the
next ``attnlab calibrate`` rewrites it). ``ATTNLAB_CALIBRATION=off`` always uses the built-in table
(the tests run so). Rates only choose among kernels that accept a call: every choice gives the same
result up to the chosen kernel's rounding.

Note [Background calibration]: without a calibration file, the first call predicted to take at least
``LONG_CALL_S`` (``note_call``, given the call's predicted seconds) starts ``attnlab calibrate``'s grid in
a daemon thread, once per process: never at import, never for a short call, never with
``ATTNLAB_CALIBRATION=off`` or a file already there. The thread measures beside the call that started it
(the grid's cases are timed against each other in interleaved rounds, so both feel the same contention),
writes the file atomically and hands the fitted rates over; the next call that plans (a plan-cache miss)
makes them current and clears the plan cache on its own thread (a cached plan made with the old rates
runs the same result, up to its kernel's rounding, until then). A failure in the thread is one warning;
the built-in table stays.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import cpu
from ..report import atomic_write_text

__all__ = ["Rates", "RATE_NAMES", "FORMAT", "current", "reload", "machine_key", "cache_dir", "cache_path", "save",
           "builtin", "calibration_enabled", "state", "note_call", "seconds_for", "background", "LONG_CALL_S",
           "ASSUMED_FLOPS"]

FORMAT = 1
#: the rates a calibration fits, by the planner's constant names (COMPILED_DENSE_MIN_PAIRS has no constant:
#: the built-in table has none, and a file without it, written before it was fitted, still loads)
#: the mask kinds of a COMPILED_DENSE_MIN_PAIRS key ("<dtype> <kind>") and whether each is causal
_MASK_KINDS = dict(dense=False, causal=True)
RATE_NAMES = ("SPARSE_BLOCK_SPEED", "COMPILED_BLOCK_SPEED", "COMPILED_DENSE_DTYPES", "SPARSE_OVER_COMPILED",
              "COMPILED_DENSE_MIN_PAIRS")


@dataclass(frozen=True)
class Rates:
    """The cost model's rates and where they came from.

    sparse_block_speed: {query block rows: the gathered kernel's relative speed per pair};
    compiled_block_speed: {(block_q, block_k): the compiled kernel's relative speed per pair};
    compiled_dense_dtypes: dtypes whose plain dense/causal calls run faster on the compiled kernel than on SDPA;
    sparse_over_compiled: how many times less the gathered kernel must compute to beat the compiled one.
    source: "built-in table ...", "calibration off ...", or "calibrated on this CPU ... (path)".
    compiled_dense_min_pairs: {(dtype, causal): the (query, key) pairs of a call, B·H·L·S, from which the
    compiled kernel beats SDPA on plain dense (causal False) / causal inputs of that dtype, or None: never},
    measured over a few sizes (the compiled kernel's per-call and per-tile overhead loses on small calls); empty in the
    built-in table (``compiled_dense_wins`` then falls back on ``compiled_dense_dtypes``).
    """

    sparse_block_speed: dict
    compiled_block_speed: dict
    compiled_dense_dtypes: tuple
    sparse_over_compiled: float
    source: str
    measured: dict = field(default_factory=dict, compare=False)  # the calibration's own record (timings)
    compiled_dense_min_pairs: dict = field(default_factory=dict)

    def compiled_dense_wins(self, dtype: torch.dtype, pairs: int, causal: bool = False) -> bool:
        """Whether the compiled kernel is faster than SDPA on a plain dense (or ``causal``) call of ``dtype``
        with ``pairs`` = B·H·L·S (query, key) pairs: by the measured size threshold where the calibration
        fitted one, else by ``compiled_dense_dtypes`` alone. (The planner's plain-input rule.)"""
        key = (dtype, bool(causal))
        if key in self.compiled_dense_min_pairs:
            least = self.compiled_dense_min_pairs[key]
            return least is not None and pairs >= least
        return dtype in self.compiled_dense_dtypes


_BUILTIN: Rates | None = None
_CURRENT: Rates | None = None
#: a call predicted to take at least this long starts the background calibration (Note [Background calibration])
LONG_CALL_S = 1.0
#: FLOP/s that turn a call's FLOPs into its predicted seconds where nothing is measured yet (``seconds_for``):
#: about half of a 2-core AVX-512 machine's fp32 GEMM rate, so that only calls of ~10^11 FLOPs count as long
ASSUMED_FLOPS = 1e11
_BACKGROUND: threading.Thread | None = None
_BACKGROUND_LOCK = threading.Lock()
_PENDING: Rates | None = None  # fitted by the background thread, made current by the next note_call


def builtin() -> Rates:
    """The planner's built-in table (``functional.planner``'s constants, measured on the reference machine)."""
    from . import planner

    return Rates(dict(planner.SPARSE_BLOCK_SPEED), dict(planner.COMPILED_BLOCK_SPEED),
                 tuple(planner.COMPILED_DENSE_DTYPES), float(planner.SPARSE_OVER_COMPILED),
                 "built-in table (measured on the 2-core reference machine; `attnlab calibrate` measures this CPU)")


def calibration_enabled() -> bool:
    """False when ``ATTNLAB_CALIBRATION`` is off / 0 / false / no."""
    return os.environ.get("ATTNLAB_CALIBRATION", "").strip().lower() not in ("off", "0", "false", "no")


#: environment variables that change which instructions the kernels use, so how fast they run: a calibration
#: measured under one of them set is another machine's (the key holds those set, so an unset one changes nothing)
ISA_ENV_VARS = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "ATTNLAB_EXT_GEMM")


def machine_key() -> dict:
    """What a calibration is valid for: CPU model and flags, torch's thread count, torch and attnlab versions,
    and any of ``ISA_ENV_VARS`` that is set (``ONEDNN_MAX_CPU_ISA=AVX2`` runs other kernels than AVX-512)."""
    from .. import __version__

    info = cpu.INFO
    key = {"cpu": info.model, "flags": sorted(f for f in cpu.FLAGS_THAT_MATTER if info.has(f)),
           "torch_isa": info.torch_isa, "threads": torch.get_num_threads(), "torch": torch.__version__,
           "attnlab": __version__}
    env = {k: os.environ[k] for k in ISA_ENV_VARS if os.environ.get(k)}
    if env:
        key["env"] = env
    return key


def cache_dir() -> Path:
    """``ATTNLAB_CACHE_DIR``, else ``$XDG_CACHE_HOME/attnlab``, else ``~/.cache/attnlab``."""
    if os.environ.get("ATTNLAB_CACHE_DIR"):
        return Path(os.environ["ATTNLAB_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attnlab"


def cache_path(key: dict | None = None) -> Path:
    """The calibration file for ``key`` (default: this machine's)."""
    key = key or machine_key()
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / f"calibration-{digest}.json"


def _dtype(name: str) -> torch.dtype:
    d = getattr(torch, name, None)
    if not isinstance(d, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return d


def _from_json(doc: dict, path: Path) -> Rates:
    """Rates from a calibration file's JSON, or ValueError naming what is wrong."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"not a format-{FORMAT} calibration file")
    if doc.get("key") != machine_key():
        raise ValueError("calibrated for another machine or version (key differs)")
    r = doc["rates"]
    sbs = {int(b): float(s) for b, s in r["SPARSE_BLOCK_SPEED"].items()}
    cbs = {tuple(int(x) for x in b.split("x")): float(s) for b, s in r["COMPILED_BLOCK_SPEED"].items()}
    if not sbs or not cbs or any(not (s > 0 and s < float("inf")) for s in (*sbs.values(), *cbs.values())):
        raise ValueError("speeds must be finite and > 0")
    if any(len(b) != 2 or min(b) < 16 for b in cbs):
        raise ValueError("compiled block shapes must be (block_q, block_k) of at least 16")
    soc = float(r["SPARSE_OVER_COMPILED"])
    if not (soc > 0 and soc < float("inf")):
        raise ValueError("SPARSE_OVER_COMPILED must be finite and > 0")
    dtypes = tuple(_dtype(n) for n in r["COMPILED_DENSE_DTYPES"])
    least = {}
    for name, p in r.get("COMPILED_DENSE_MIN_PAIRS", {}).items():
        dt, _, kind = name.partition(" ")
        if kind not in _MASK_KINDS:
            raise ValueError(f"COMPILED_DENSE_MIN_PAIRS keys are '<dtype> dense|causal', got {name!r}")
        least[(_dtype(dt), _MASK_KINDS[kind])] = None if p is None else float(p)
    if any(p is not None and not (p >= 0 and p < float("inf")) for p in least.values()):
        raise ValueError("COMPILED_DENSE_MIN_PAIRS must be finite and >= 0, or null (never)")
    when = doc.get("created", "?")
    return Rates(sbs, cbs, dtypes, soc, f"calibrated on this CPU {when} ({path})", doc.get("measured", {}),
                 compiled_dense_min_pairs=least)


def _to_json(rates: Rates) -> dict:
    return {"SPARSE_BLOCK_SPEED": {str(b): s for b, s in rates.sparse_block_speed.items()},
            "COMPILED_BLOCK_SPEED": {f"{b[0]}x{b[1]}": s for b, s in rates.compiled_block_speed.items()},
            "COMPILED_DENSE_DTYPES": [str(d).removeprefix("torch.") for d in rates.compiled_dense_dtypes],
            "SPARSE_OVER_COMPILED": rates.sparse_over_compiled,
            "COMPILED_DENSE_MIN_PAIRS": {f"{str(d).removeprefix('torch.')} {'causal' if c else 'dense'}": p
                                         for (d, c), p in rates.compiled_dense_min_pairs.items()}}


def save(rates: Rates, measured: dict | None = None, path: Path | None = None, *, reload_now: bool = True) -> Path:
    """Write ``rates`` as this machine's calibration (atomically), make them current (unless not
    ``reload_now``: the background thread leaves that to the calling thread) and return the path."""
    path = path or cache_path()
    doc = {"format": FORMAT, "key": machine_key(), "created": time.strftime("%Y-%m-%d %H:%M:%S"),
           "rates": _to_json(rates), "measured": measured or {}}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(doc, indent=1, sort_keys=True))
    if reload_now:
        reload()
    return path


def _load() -> Rates:
    if not calibration_enabled():
        b = builtin()
        return Rates(b.sparse_block_speed, b.compiled_block_speed, b.compiled_dense_dtypes, b.sparse_over_compiled,
                     "built-in table (ATTNLAB_CALIBRATION=off)")
    path = cache_path()
    if not path.exists():
        return builtin()
    try:
        return _from_json(json.loads(path.read_text()), path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        warnings.warn(f"attnlab: ignoring the calibration file {path}: {e}; the planner uses its built-in table "
                      "until `attnlab calibrate` rewrites it", RuntimeWarning, stacklevel=3)
        return builtin()


def current() -> Rates:
    """The rates the planner uses now (read once per process, or after ``reload``)."""
    global _CURRENT
    if _CURRENT is None:
        _CURRENT = _load()
    return _CURRENT


def reload() -> Rates:
    """Read the rates again (after a calibration, or a change of ``ATTNLAB_CALIBRATION``/``ATTNLAB_CACHE_DIR``);
    forgets cached plans, which were made with the old ones."""
    global _CURRENT, _PENDING
    from . import plancache

    _CURRENT, _PENDING = None, None
    plancache.clear()
    return current()


def seconds_for(flops: float) -> float:
    """A call's predicted seconds from its FLOPs at ``ASSUMED_FLOPS`` (for ``note_call`` before the cost model
    predicts times itself)."""
    return flops / ASSUMED_FLOPS


def _calibrate_in_background() -> Rates:
    """The thread's work: ``attnlab calibrate``'s grid, without saving (``note_call`` makes it current)."""
    # the grid lives with the instruments (it times through the public API); imported only when it runs
    from importlib import import_module

    fitted, measured, _ = import_module("attnlab.bench.calibrate").calibrate(save=False)
    save(fitted, measured, reload_now=False)
    return fitted


def _thread_body() -> None:
    global _PENDING
    try:
        fitted = _calibrate_in_background()
    except Exception as e:  # noqa: BLE001 - a background failure must not reach the user's call
        warnings.warn(f"attnlab: the background calibration failed ({type(e).__name__}: {e}); the planner keeps "
                      "its built-in table (run `attnlab calibrate` to measure this CPU)", RuntimeWarning)
        return
    _PENDING = dataclasses.replace(fitted, source=f"calibrated on this CPU in the background ({cache_path()})")


def note_call(predicted_s: float) -> threading.Thread | None:
    """Tell the calibration a call is about to run for about ``predicted_s`` seconds (Note [Background
    calibration]): makes rates fitted in the background current, and starts the background calibration
    when this is the first long call without a calibration file. Returns the thread when this call
    started it, else None. Costs one comparison for a short call."""
    global _BACKGROUND, _PENDING
    if _PENDING is not None:
        fitted, _PENDING = _PENDING, None
        _make_current(fitted)
    if predicted_s < LONG_CALL_S or _BACKGROUND is not None:
        return None
    with _BACKGROUND_LOCK:
        if _BACKGROUND is not None or not calibration_enabled() or not current().source.startswith("built-in"):
            return None
        if cache_path().exists():  # a file that did not load (it warned): `attnlab calibrate` rewrites it
            return None
        _BACKGROUND = threading.Thread(target=_thread_body, name="attnlab-calibration", daemon=True)
        _BACKGROUND.start()
        return _BACKGROUND


def background() -> threading.Thread | None:
    """The background calibration's thread if this process started one (alive or finished), else None."""
    return _BACKGROUND


def _make_current(r: Rates) -> None:
    global _CURRENT
    from . import plancache

    _CURRENT = r
    plancache.clear()


def state() -> dict:
    """For ``attnlab info``: whether calibration is on, the file for this machine, where the rates come from,
    and the background calibration's state ("not started", "running" or "finished")."""
    path = cache_path()
    bg = "not started" if _BACKGROUND is None else "running" if _BACKGROUND.is_alive() else "finished"
    return {"enabled": calibration_enabled(), "file": str(path), "exists": path.exists(),
            "source": current().source, "background": bg}
