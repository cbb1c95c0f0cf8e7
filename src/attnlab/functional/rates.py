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
"""
from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import cpu
from ..report import atomic_write_text

__all__ = ["Rates", "RATE_NAMES", "FORMAT", "current", "reload", "machine_key", "cache_dir", "cache_path", "save",
           "builtin", "calibration_enabled", "state"]

FORMAT = 1
#: the rates a calibration fits, by the planner's constant names
RATE_NAMES = ("SPARSE_BLOCK_SPEED", "COMPILED_BLOCK_SPEED", "COMPILED_DENSE_DTYPES", "SPARSE_OVER_COMPILED")


@dataclass(frozen=True)
class Rates:
    """The cost model's rates and where they came from.

    sparse_block_speed: {query block rows: the gathered kernel's relative speed per pair};
    compiled_block_speed: {(block_q, block_k): the compiled kernel's relative speed per pair};
    compiled_dense_dtypes: dtypes whose plain dense/causal calls run faster on the compiled kernel than on SDPA;
    sparse_over_compiled: how many times less the gathered kernel must compute to beat the compiled one.
    source: "built-in table ...", "calibration off ...", or "calibrated on this CPU ... (path)".
    """

    sparse_block_speed: dict
    compiled_block_speed: dict
    compiled_dense_dtypes: tuple
    sparse_over_compiled: float
    source: str
    measured: dict = field(default_factory=dict, compare=False)  # the calibration's own record (timings)


_BUILTIN: Rates | None = None
_CURRENT: Rates | None = None


def builtin() -> Rates:
    """The planner's built-in table (``functional.planner``'s constants, measured on the reference machine)."""
    from . import planner

    return Rates(dict(planner.SPARSE_BLOCK_SPEED), dict(planner.COMPILED_BLOCK_SPEED),
                 tuple(planner.COMPILED_DENSE_DTYPES), float(planner.SPARSE_OVER_COMPILED),
                 "built-in table (measured on the 2-core reference machine; `attnlab calibrate` measures this CPU)")


def calibration_enabled() -> bool:
    """False when ``ATTNLAB_CALIBRATION`` is off / 0 / false / no."""
    return os.environ.get("ATTNLAB_CALIBRATION", "").strip().lower() not in ("off", "0", "false", "no")


def machine_key() -> dict:
    """What a calibration is valid for: CPU model and flags, torch's thread count, torch and attnlab versions."""
    from .. import __version__

    info = cpu.INFO
    return {"cpu": info.model, "flags": sorted(f for f in cpu.FLAGS_THAT_MATTER if info.has(f)),
            "torch_isa": info.torch_isa, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "attnlab": __version__}


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
    when = doc.get("created", "?")
    return Rates(sbs, cbs, dtypes, soc, f"calibrated on this CPU {when} ({path})", doc.get("measured", {}))


def _to_json(rates: Rates) -> dict:
    return {"SPARSE_BLOCK_SPEED": {str(b): s for b, s in rates.sparse_block_speed.items()},
            "COMPILED_BLOCK_SPEED": {f"{b[0]}x{b[1]}": s for b, s in rates.compiled_block_speed.items()},
            "COMPILED_DENSE_DTYPES": [str(d).removeprefix("torch.") for d in rates.compiled_dense_dtypes],
            "SPARSE_OVER_COMPILED": rates.sparse_over_compiled}


def save(rates: Rates, measured: dict | None = None, path: Path | None = None) -> Path:
    """Write ``rates`` as this machine's calibration (atomically), make them current and return the path."""
    path = path or cache_path()
    doc = {"format": FORMAT, "key": machine_key(), "created": time.strftime("%Y-%m-%d %H:%M:%S"),
           "rates": _to_json(rates), "measured": measured or {}}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(doc, indent=1, sort_keys=True))
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
    global _CURRENT
    from . import plancache

    _CURRENT = None
    plancache.clear()
    return current()


def state() -> dict:
    """For ``attnlab info``: whether calibration is on, the file for this machine, and where the rates come from."""
    path = cache_path()
    return {"enabled": calibration_enabled(), "file": str(path), "exists": path.exists(),
            "source": current().source}
