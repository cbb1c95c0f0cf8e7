"""The cost model's rates: the planner's built-in table, or a calibration measured on this CPU.

Note [Calibrated rates]: ``attnlab calibrate`` (the grid of ``attnlab.functional.calibration``) times the
kernels on this CPU and writes the rates the planner compares kernels by (``RATE_NAMES``) to one JSON file
per machine key (CPU model and flags, thread count, torch and attnlab versions) in ``ATTNLAB_CACHE_DIR`` or
``$XDG_CACHE_HOME/attnlab`` (``~/.cache/attnlab``), written atomically. The planner reads it on its first
plan that compares rates (never at import) and after ``reload()``; without a file it uses the built-in
table. A file that does not parse, or whose key is another machine's, is ignored with one warning (the
next ``attnlab calibrate`` rewrites it). ``ATTNLAB_CALIBRATION=off`` always uses the built-in table
(the tests run so). Rates only choose among kernels that accept a call: every choice gives the same
result up to the chosen kernel's rounding. A rate the file lacks (one written before it was fitted)
keeps the built-in value.

This module reads and writes rates and nothing else: it measures nothing and imports nothing above
``kernels/``. Whoever keeps state made with the rates (the plan cache) registers ``on_change`` and is told
when they change. The background calibration (Note [Background calibration]) lives with the grid, in
``attnlab.functional.calibration``.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import cpu
from ..files import atomic_write_text
from ..version import __version__

__all__ = ["Rates", "RATE_NAMES", "FORMAT", "current", "reload", "make_current", "on_change", "machine_key",
           "cache_dir", "cache_path", "save", "builtin", "calibration_enabled", "ISA_ENV_VARS", "as_json", "shipped",
           "shipped_tables", "nearest_class", "TABLES", "save_table"]

#: the calibration file's format: 2 = DECODE_OVER_SDPA per cache length and DECODE_MIN_KEYS (format 1 had one
#: ratio per dtype and heads, the geometric mean over the lengths); a file of another format is ignored with one
#: warning and rewritten by the next ``attnlab calibrate``
FORMAT = 2
#: the rates a calibration fits, by the built-in table's constant names (COMPILED_DENSE_MIN_PAIRS has no constant:
#: the built-in table has none, and a file without it, written before it was fitted, still loads)
#: the mask kinds of a COMPILED_DENSE_MIN_PAIRS key ("<dtype> <kind>") and whether each is causal
_MASK_KINDS = dict(dense=False, causal=True)
RATE_NAMES = ("SPARSE_BLOCK_SPEED", "COMPILED_BLOCK_SPEED", "COMPILED_DENSE_DTYPES", "SPARSE_OVER_COMPILED",
              "COMPILED_DENSE_MIN_PAIRS", "COMPILED_GQA_MIN_PAIRS", "COMPILED_TRAIN_MIN_PAIRS", "KERNEL_GFLOPS",
              "DECODE_OVER_SDPA", "DECODE_MIN_KEYS", "STEP_OVER_SDPA", "STEP_MIN_KEYS")
#: the head layouts of a DECODE_OVER_SDPA / DECODE_MIN_KEYS (STEP_...) key ("<dtype> <heads>") and whether each is GQA
_HEAD_KINDS = dict(mha=False, gqa=True)


# -- the built-in table: what the planner uses where no calibration measured this CPU ---------------------
#: fused-kernel speed (GFLOP/s) at query blocks of this many rows, measured on the 2-core reference
#: machine (B·H batches of [block, ~block + 256] problems); relative values choose a band's block size
SPARSE_BLOCK_SPEED = {32: 49.0, 64: 60.0, 128: 65.0, 256: 77.0}
#: the compiled kernel's relative speed (dense fp32, B=1, H=8, D=64, n=4096, both cores, MKL tiles) at each
#: (block_q, block_k): larger tiles run faster per pair, smaller ones skip more of a band's empty area.
#: With brgemm tiles, one thread on the busy machine: 0.77 / 0.93 / 0.90 / 0.88 / 0.96 of SDPA per pair; the
#: causal 256-window at n=4096 ran 81 ms at 64x64 and 104 ms at 128x128 (both threads), so 64x64 stays.
COMPILED_BLOCK_SPEED = {(64, 64): 0.69, (128, 128): 0.78, (128, 256): 0.83, (256, 256): 0.9, (256, 512): 1.0}
#: auto prefers the gathered kernel only when it computes this many times less than the compiled one
#: (its narrow key blocks fit patterns like fixed; per pair it is slower, see issue 14's figures)
SPARSE_OVER_COMPILED = 2.0
#: dtypes for which auto runs plain dense / causal inputs (no other mask) on the compiled kernel rather
#: than SDPA: measured no faster than SDPA for fp32 and bf16
COMPILED_DENSE_DTYPES: tuple = ()
#: plain decode calls (few queries, no mask but causal) of these dtypes with one query head per key/value head
#: run on SDPA rather than the decode path, where no calibration timed both (Note [Plain MHA decode] in
#: ``kernels.planner``)
PLAIN_MHA_DECODE_ON_SDPA = (torch.float32,)


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
    kernel_gflops: {kernel name: GFLOP/s measured on plain dense float32 calls} for the kernels whose rate is
    one number (``Kernel.rate``: sdpa, tiled, dense; compiled: its best tiles, scaled per tile shape by
    ``compiled_block_speed``); a kernel missing here keeps its built-in ``Kernel.gflops``.
    decode_over_sdpa: {(dtype, gqa): {cache length S: SDPA's time over the decode path's on plain decode calls
    (few queries, no mask but causal)}}, measured at a few cache lengths (what ``explain`` quotes);
    decode_min_keys: {(dtype, gqa): the cache length from which the decode path beats SDPA on those calls,
    fitted to ``decode_over_sdpa``'s ratios (0: at every length; None: at none)}; a key missing here falls back
    on ``decode_sdpa_dtypes`` (``plain_decode_on_sdpa``; Note [Plain MHA decode]). These two are ``attention``'s
    door: its repeated calls run each kernel direct.
    step_over_sdpa, step_min_keys: the same for the plain steps of the KV-cache API and the HF step (the one-call
    decode step against SDPA's step: Note [Each door its crossing] in ``functional.calibration_grid``); a key
    missing here falls back on ``decode_min_keys``.
    compiled_gqa_min_pairs: as ``compiled_dense_min_pairs`` for GQA calls (fewer key/value heads than query
    heads, ``enable_gqa``): SDPA copies K/V per query head there and the compiled kernel reads them in place,
    so it wins from smaller calls (``bench planner``: 1.15x SDPA at 2 x 8 x 512² fp32 GQA where MHA of the same
    pairs lost); a key missing here falls back on ``compiled_dense_min_pairs``.
    decode_sdpa_dtypes: the uncalibrated default, ``PLAIN_MHA_DECODE_ON_SDPA`` (Note [Plain MHA decode]).
    compiled_train_min_pairs: as ``compiled_dense_min_pairs`` for calls that will run a backward (inputs that
    require grad: Note [Plan the pass that runs]), measured on forward + backward; a key missing here falls back
    on the forward's thresholds.
    """

    sparse_block_speed: dict
    compiled_block_speed: dict
    compiled_dense_dtypes: tuple
    sparse_over_compiled: float
    source: str
    measured: dict = field(default_factory=dict, compare=False)  # the calibration's own record (timings)
    compiled_dense_min_pairs: dict = field(default_factory=dict)
    kernel_gflops: dict = field(default_factory=dict)
    decode_over_sdpa: dict = field(default_factory=dict)
    compiled_gqa_min_pairs: dict = field(default_factory=dict)
    decode_sdpa_dtypes: tuple = PLAIN_MHA_DECODE_ON_SDPA
    decode_min_keys: dict = field(default_factory=dict)
    compiled_train_min_pairs: dict = field(default_factory=dict)
    step_over_sdpa: dict = field(default_factory=dict)
    step_min_keys: dict = field(default_factory=dict)

    def dense_threshold(self, dtype: torch.dtype, causal: bool = False, gqa: bool = False,
                        grad: bool = False) -> tuple[bool, float | None]:
        """(measured, pairs): whether a calibration or a shipped table measured the compiled kernel against SDPA
        for such calls, and from how many pairs it wins (None: never). ``grad``: calls that run a backward
        (Note [Plan the pass that runs]), by the forward + backward threshold where one was measured."""
        key = (dtype, bool(causal))
        if grad and key in self.compiled_train_min_pairs:
            return True, self.compiled_train_min_pairs[key]
        if gqa and key in self.compiled_gqa_min_pairs:
            return True, self.compiled_gqa_min_pairs[key]
        if key in self.compiled_dense_min_pairs:
            return True, self.compiled_dense_min_pairs[key]
        return False, None

    def compiled_dense_wins(self, dtype: torch.dtype, pairs: int, causal: bool = False, gqa: bool = False,
                            grad: bool = False) -> bool:
        """Whether the compiled kernel is faster than SDPA on a plain dense (or ``causal``) call of ``dtype``
        with ``pairs`` = B·H·L·S (query, key) pairs (``gqa``: fewer key/value heads than query heads): by the
        measured size threshold where the calibration fitted one (GQA's own where it has one), else by
        ``compiled_dense_dtypes`` alone; ``grad``: for calls that will run a backward (``dense_threshold``).
        (The planner's plain-input rule.)"""
        measured, least = self.dense_threshold(dtype, causal, gqa, grad)
        if measured:
            return least is not None and pairs >= least
        return dtype in self.compiled_dense_dtypes

    def _decode_rule(self, dtype: torch.dtype, gqa: bool, step: bool) -> tuple[dict, dict]:
        """(min keys, ratios) of the door: the steps' where the calibration timed them, else ``attention``'s."""
        if step and (dtype, bool(gqa)) in self.step_min_keys:
            return self.step_min_keys, self.step_over_sdpa
        return self.decode_min_keys, self.decode_over_sdpa

    def plain_decode_on_sdpa(self, dtype: torch.dtype, gqa: bool, S: int, step: bool = False) -> bool:
        """Whether SDPA runs a plain decode call (few queries against a KV cache of ``S`` keys, no mask but
        causal) of ``dtype`` faster than the decode path at its door (``step``: a plain step of the KV-cache API
        or the HF step; else ``attention``'s call): by the cache length fitted to the ratios measured at that
        door where the calibration timed them (``step_min_keys`` / ``decode_min_keys``: SDPA below it; a step
        falls back on ``attention``'s), else the built-in default (``decode_sdpa_dtypes``, multi-head only:
        under GQA SDPA has no way to read K/V heads in place that matches the decode path's)."""
        key = (dtype, bool(gqa))
        least_keys, _ = self._decode_rule(dtype, gqa, step)
        if key in least_keys:
            least = least_keys[key]
            return least is None or S < least
        return not gqa and dtype in self.decode_sdpa_dtypes

    def decode_evidence(self, dtype: torch.dtype, gqa: bool, S: int, step: bool = False) -> str | None:
        """What decided ``plain_decode_on_sdpa`` for a cache of ``S`` keys at that door, in words: the fitted
        length and the measured ratio at the length nearest S (in log S), or None where no calibration measured
        this key."""
        key = (dtype, bool(gqa))
        least_keys, ratios = self._decode_rule(dtype, gqa, step)
        if key not in least_keys:
            return None
        least, pts = least_keys[key], ratios.get(key, {})
        rule = ("the decode path at no length" if least is None else "the decode path at every length" if least == 0
                else f"the decode path from S = {least:.0f}")
        if not pts:
            return f"fitted: {rule}"
        near = min(pts, key=lambda n: abs(math.log(max(n, 1) / max(S, 1))))
        every = ", ".join(f"{r:.2f}x at {n}" for n, r in sorted(pts.items()))
        return (f"SDPA's time / the decode path's measured {pts[near]:.2f}x at S = {near}, the length nearest "
                f"{S} ({every}); fitted: {rule}")


_CURRENT: Rates | None = None
#: called with no argument whenever the current rates change (``on_change``)
_LISTENERS: list = []


def builtin() -> Rates:
    """The planner's built-in table (this module's constants, measured on the reference machine)."""
    return Rates(dict(SPARSE_BLOCK_SPEED), dict(COMPILED_BLOCK_SPEED), tuple(COMPILED_DENSE_DTYPES),
                 float(SPARSE_OVER_COMPILED),
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


def _from_json(doc: dict, path: Path, source: str | None = None) -> Rates:
    """Rates from a calibration file's JSON (``source``: a shipped table's, whose key is its CPU class, not this
    machine), or ValueError naming what is wrong."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"not a format-{FORMAT} calibration file")
    if source is None and doc.get("key") != machine_key():
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
    least, least_gqa = _min_pairs(r, "COMPILED_DENSE_MIN_PAIRS"), _min_pairs(r, "COMPILED_GQA_MIN_PAIRS")
    least_train = _min_pairs(r, "COMPILED_TRAIN_MIN_PAIRS")
    gflops = {str(n): float(g) for n, g in r.get("KERNEL_GFLOPS", {}).items()}
    if any(not (g > 0 and g < float("inf")) for g in gflops.values()):
        raise ValueError("KERNEL_GFLOPS must be finite and > 0")
    decode, decode_keys = _decode_rule(r, "DECODE")
    steps, step_keys = _decode_rule(r, "STEP")
    when = doc.get("created", "?")
    return Rates(sbs, cbs, dtypes, soc, source or f"calibrated on this CPU {when} ({path})", doc.get("measured", {}),
                 compiled_dense_min_pairs=least, kernel_gflops=gflops, decode_over_sdpa=decode,
                 compiled_gqa_min_pairs=least_gqa, decode_min_keys=decode_keys, compiled_train_min_pairs=least_train,
                 step_over_sdpa=steps, step_min_keys=step_keys)


def _decode_rule(r: dict, door: str) -> tuple[dict, dict]:
    """(ratios, min keys) from a file's ``<door>_OVER_SDPA`` and ``<door>_MIN_KEYS`` entries, or ValueError."""
    ratios = {key: {int(n): float(x) for n, x in per_length.items()}
              for key, per_length in _decode_keys(r, f"{door}_OVER_SDPA").items()}
    if any(n < 1 or not (x > 0 and x < float("inf")) for pts in ratios.values() for n, x in pts.items()):
        raise ValueError(f"{door}_OVER_SDPA must be {{cache length >= 1: ratio finite and > 0}} per key")
    least = {key: None if x is None else float(x) for key, x in _decode_keys(r, f"{door}_MIN_KEYS").items()}
    if any(x is not None and not (x >= 0 and x < float("inf")) for x in least.values()):
        raise ValueError(f"{door}_MIN_KEYS must be finite and >= 0, or null (never)")
    return ratios, least


def _decode_keys(r: dict, field_name: str) -> dict:
    """{(dtype, gqa): value} from a file's ``field_name`` entry keyed "<dtype> mha|gqa", or ValueError."""
    out = {}
    for name, value in r.get(field_name, {}).items():
        dt, _, heads = name.partition(" ")
        if heads not in _HEAD_KINDS:
            raise ValueError(f"{field_name} keys are '<dtype> mha|gqa', got {name!r}")
        out[(_dtype(dt), _HEAD_KINDS[heads])] = value
    return out


def _min_pairs(r: dict, field_name: str) -> dict:
    """{(dtype, causal): pairs or None} from a file's ``field_name`` entry, or ValueError naming what is wrong."""
    least = {}
    for name, p in r.get(field_name, {}).items():
        dt, _, kind = name.partition(" ")
        if kind not in _MASK_KINDS:
            raise ValueError(f"{field_name} keys are '<dtype> dense|causal', got {name!r}")
        least[(_dtype(dt), _MASK_KINDS[kind])] = None if p is None else float(p)
    if any(p is not None and not (p >= 0 and p < float("inf")) for p in least.values()):
        raise ValueError(f"{field_name} must be finite and >= 0, or null (never)")
    return least


def as_json(rates: Rates) -> dict:
    """Every fitted rate of ``rates`` by its ``RATE_NAMES`` name, as the calibration file holds them: keys as
    strings ("<dtype> dense|causal", "<dtype> mha|gqa", "128x256", a cache length), None for "never"."""
    return {"SPARSE_BLOCK_SPEED": {str(b): s for b, s in rates.sparse_block_speed.items()},
            "COMPILED_BLOCK_SPEED": {f"{b[0]}x{b[1]}": s for b, s in rates.compiled_block_speed.items()},
            "COMPILED_DENSE_DTYPES": [str(d).removeprefix("torch.") for d in rates.compiled_dense_dtypes],
            "SPARSE_OVER_COMPILED": rates.sparse_over_compiled,
            "COMPILED_DENSE_MIN_PAIRS": {f"{str(d).removeprefix('torch.')} {'causal' if c else 'dense'}": p
                                         for (d, c), p in rates.compiled_dense_min_pairs.items()},
            "COMPILED_GQA_MIN_PAIRS": {f"{str(d).removeprefix('torch.')} {'causal' if c else 'dense'}": p
                                       for (d, c), p in rates.compiled_gqa_min_pairs.items()},
            "COMPILED_TRAIN_MIN_PAIRS": {f"{str(d).removeprefix('torch.')} {'causal' if c else 'dense'}": p
                                         for (d, c), p in rates.compiled_train_min_pairs.items()},
            "KERNEL_GFLOPS": dict(rates.kernel_gflops),
            "DECODE_OVER_SDPA": {f"{str(d).removeprefix('torch.')} {'gqa' if g else 'mha'}":
                                 {str(n): x for n, x in pts.items()} for (d, g), pts in rates.decode_over_sdpa.items()},
            "DECODE_MIN_KEYS": {f"{str(d).removeprefix('torch.')} {'gqa' if g else 'mha'}": x
                                for (d, g), x in rates.decode_min_keys.items()},
            "STEP_OVER_SDPA": {f"{str(d).removeprefix('torch.')} {'gqa' if g else 'mha'}":
                               {str(n): x for n, x in pts.items()} for (d, g), pts in rates.step_over_sdpa.items()},
            "STEP_MIN_KEYS": {f"{str(d).removeprefix('torch.')} {'gqa' if g else 'mha'}": x
                              for (d, g), x in rates.step_min_keys.items()}}


def save(rates: Rates, measured: dict | None = None, path: Path | None = None, *, reload_now: bool = True) -> Path:
    """Write ``rates`` as this machine's calibration (atomically), make them current (unless not
    ``reload_now``: the background thread leaves that to the calling thread) and return the path."""
    path = path or cache_path()
    doc = {"format": FORMAT, "key": machine_key(), "created": time.strftime("%Y-%m-%d %H:%M:%S"),
           "rates": as_json(rates), "measured": measured or {}}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(doc, indent=1, sort_keys=True))
    if reload_now:
        reload()
    return path


# Note [Shipped rate tables]: a fresh install has no calibration file, and the built-in table (one reference
# machine's, forward only) left the compiled kernel's 1.3-1.5x on the table on an AMX Xeon until someone ran
# `attnlab calibrate`. So the package ships the calibration of every CPU class a record was made on
# (``tables/<class key>.json``, written by ``attnlab verify``'s calibration stage: the same grid, the same file
# format, keyed by class instead of machine). Without a calibration file the planner takes this CPU's class's
# table; a CPU of no recorded class takes the nearest recorded class that loads the same build (the same
# avx512f / avx2, which decide the extension variant and oneDNN's kernels) and shares the most path flags, and
# says so in its source (``explain``, ``attnlab info``); with no such class, the built-in table. Thread counts
# may differ from the table's (2): the ratios it holds are of kernels on the same threads, which move together.
# A calibration, in the background or by `attnlab calibrate`, refines: it replaces the table for this machine.
#: the shipped tables' folder (tests point it elsewhere)
TABLES = Path(__file__).resolve().parent / "tables"


def shipped_tables(where: Path | None = None) -> dict[str, dict]:
    """{class key: table document} of the tables shipped in ``where`` (default ``TABLES``)."""
    out = {}
    for p in sorted(Path(where or TABLES).glob("*.json")):
        try:
            doc = json.loads(p.read_text())
            out[doc["class"]["key"]] = dict(doc, _path=str(p))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def nearest_class(mine: dict, keys: dict[str, dict]) -> str | None:
    """The table for class ``mine`` (``cpu.cpu_class()``): its own key, else the class that loads the same build
    (same avx512f and avx2) sharing the most path flags (ties: fewest flags it lacks), else None."""
    if mine["key"] in keys:
        return mine["key"]
    have = set(mine["flags"])
    same_build = [k for k, d in keys.items()
                  if {"avx512f", "avx2"} & set(d["class"]["flags"]) == {"avx512f", "avx2"} & have]
    if not same_build:
        return None
    return max(same_build, key=lambda k: (len(have & set(keys[k]["class"]["flags"])),
                                          -len(set(keys[k]["class"]["flags"]) - have), k))


def shipped() -> Rates | None:
    """The shipped table for this CPU's class, or the nearest class's (Note [Shipped rate tables]), or None."""
    tables = shipped_tables()
    if not tables:
        return None
    mine = cpu.cpu_class()
    key = nearest_class(mine, tables)
    if key is None:
        return None
    doc = tables[key]
    if key == mine["key"]:
        why = f"shipped table for this CPU class, measured {doc.get('created', '?')} ({key})"
    else:
        why = (f"shipped table of the nearest recorded class {key} (this CPU's class {mine['key']} has no record; "
               "`attnlab calibrate` measures it)")
    try:
        return _from_json(doc, Path(doc["_path"]), source=why)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def save_table(rates: Rates, measured: dict | None = None, where: Path | None = None) -> Path:
    """Write ``rates`` as the shipped table of this CPU's class (``attnlab verify``'s calibration stage)."""
    cls = cpu.cpu_class()
    path = Path(where or TABLES) / f"{cls['key']}.json"
    doc = {"format": FORMAT, "class": cls, "threads": torch.get_num_threads(), "torch": torch.__version__,
           "created": time.strftime("%Y-%m-%d"), "rates": as_json(rates), "measured": measured or {}}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(doc, indent=1, sort_keys=True))
    return path


def _load() -> Rates:
    if not calibration_enabled():
        return dataclasses.replace(builtin(), source="built-in table (ATTNLAB_CALIBRATION=off)")
    path = cache_path()
    if not path.exists():
        return shipped() or builtin()
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
    tells ``on_change``'s listeners (the plan cache forgets plans made with the old ones)."""
    global _CURRENT
    _CURRENT = None
    _changed()
    return current()


def make_current(r: Rates) -> None:
    """Use ``r`` from now on (the background calibration hands its fit over so) and tell the listeners."""
    global _CURRENT
    _CURRENT = r
    _changed()


def on_change(listener) -> None:
    """Call ``listener()`` whenever the current rates change (``reload``, ``make_current``)."""
    if listener not in _LISTENERS:
        _LISTENERS.append(listener)


def _changed() -> None:
    for listener in _LISTENERS:
        listener()
