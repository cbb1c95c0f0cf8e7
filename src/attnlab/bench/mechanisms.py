"""attnlab bench all: every registered mechanism and pattern x sequence length, measured side by side.

For each (mechanism, n): median forward time after warm-up, peak memory (RSS growth, each
configuration in a fresh process by default), FLOPs from the mechanism's cost model and the achieved
GFLOP/s against a matrix-product peak measured in the same run, and every figure as a ratio to
``torch.nn.functional.scaled_dot_product_attention`` measured in the same run. Lengths grow from 128 to
65536 until the predicted time or memory would pass the budget (and the report says where and why).
Also: fitted exponents of time and memory in n, the tutorial's production table regenerated, and an
LRA-style training-efficiency table (Tay et al. 2020, Table 2). Writes reports/bench-all/.

Long runs survive being killed: every finished configuration lands atomically in
``results.partial.json`` (and a partial ``report.md``) before the next one starts; Ctrl-C or SIGTERM
writes a partial report with plots; ``resume`` reuses every configuration already measured with the
same settings and measures only the rest.

``run(AllConfig(...)) -> AllResult``: no printing, no argv (the CLI is ``attnlab bench all``). The jobs
and workers live in :mod:`attnlab.bench.all_jobs`, the analysis and report in :mod:`attnlab.bench.all_report`.

Legend: B batch, H heads, n sequence length (L = S = n), D head dim.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..harness import ResultStore, environment_record, remove_partial, write_report
from ..harness.store import PARTIAL
from ..resources import memory_budget
from ..report import atomic_write_text, format_bytes
from .all_jobs import REFERENCE, Runner, attention_callable, mechanism_cost, mechanism_names, measure_job
from .all_report import TUTORIAL_TABLE, analyse, markdown, plots, write_csv
from .fit import extrapolate, fit_exponent

__all__ = ["AllConfig", "AllResult", "run", "measure_job", "fit_exponent", "TUTORIAL_TABLE", "REFERENCE",
           "FULL_LENGTHS", "QUICK_LENGTHS", "LRA_LENGTHS", "QUICK_LRA_LENGTHS"]

FULL_LENGTHS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
QUICK_LENGTHS = (128, 256, 512)
LRA_LENGTHS = (1024, 2048, 3072, 4096)
QUICK_LRA_LENGTHS = (128, 256)


@dataclass
class AllConfig:
    """What ``bench all`` measures. None means the default, which ``quick`` shrinks: ``mechanisms``
    (torch_sdpa, naive and every registered one; torch_sdpa is always added), ``lengths`` (128..65536;
    quick 128..512), ``repeats`` (5; quick 3), ``time_budget`` seconds per configuration (60; quick 5),
    ``memory_budget_gib`` (``attnlab.resources.memory_budget()``: half of the available memory),
    ``isolation`` ("config": a fresh process per configuration; quick "suite": one worker),
    ``lra_lengths`` (1024..4096; quick 128, 256) and ``production_lengths`` (the tutorial's; quick 128,
    512); ``lra`` / ``production`` switch those tables. ``threads``: torch threads in the workers.
    ``resume``: reuse what an earlier run in ``out`` measured."""
    out: str = "reports/bench-all"
    quick: bool = False
    mechanisms: tuple[str, ...] | None = None
    lengths: tuple[int, ...] | None = None
    batch: int = 1
    heads: int = 4
    head_dim: int = 64
    repeats: int | None = None
    warmup: int = 1
    time_budget: float | None = None
    memory_budget_gib: float | None = None
    isolation: str | None = None
    threads: int | None = None
    lra: bool = True
    lra_lengths: tuple[int, ...] | None = None
    production: bool = True
    production_lengths: tuple[int, ...] | None = None
    resume: bool = False

    def settings(self) -> dict:
        """Every setting with its default filled in; ValueError naming the option for a bad one (an
        unknown mechanism lists the valid names). Checked before anything is measured."""
        q = self.quick
        mechs = list(self.mechanisms) if self.mechanisms else mechanism_names()
        if REFERENCE not in mechs:
            mechs = [REFERENCE] + mechs  # every ratio needs it
        lengths = sorted(self.lengths) if self.lengths else list(QUICK_LENGTHS if q else FULL_LENGTHS)
        for name, v in (("--batch", self.batch), ("--heads", self.heads), ("--head-dim", self.head_dim)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        for name, vs in (("--lengths", lengths), ("--lra-lengths", self.lra_lengths or ()),
                         ("--production-lengths", self.production_lengths or ())):
            if any(v < 1 for v in vs):
                raise ValueError(f"{name} must be positive, got {list(vs)}")
        if self.isolation not in (None, "config", "suite"):
            raise ValueError(f"--isolation must be config or suite, got {self.isolation!r}")
        for m in mechs:  # unknown names fail before anything runs
            if m not in (REFERENCE, "naive"):
                try:
                    attention_callable(m, max(lengths))
                except (ValueError, TypeError) as e:
                    raise ValueError(f"--mechanisms: {e}") from None
        repeats = self.repeats if self.repeats is not None else (3 if q else 5)
        if repeats < 1 or self.warmup < 0:
            raise ValueError(f"--repeats must be >= 1 and --warmup >= 0, got {repeats} and {self.warmup}")
        lra = [] if not self.lra else sorted(self.lra_lengths or (QUICK_LRA_LENGTHS if q else LRA_LENGTHS))
        prod = [] if not self.production else sorted(self.production_lengths or ([128, 512] if q else TUTORIAL_TABLE))
        return dict(quick=q, isolation=self.isolation or ("suite" if q else "config"), B=self.batch, H=self.heads,
                    D=self.head_dim, repeats=repeats, warmup=self.warmup,
                    tbudget=self.time_budget if self.time_budget is not None else (5.0 if q else 60.0),
                    mbudget=int(self.memory_budget_gib * 2**30) if self.memory_budget_gib else memory_budget()[0],
                    mechs=mechs, lengths=lengths, lra_lengths=lra, prod_lengths=prod, why=None, threads=self.threads)


@dataclass
class AllResult:
    """One ``bench all`` run: ``data`` is what results.json holds (records with their ratios to SDPA,
    fits, stopped mechanisms, the production and LRA tables, the environment); ``paths`` the report
    files; ``interrupted`` why a run stopped early (then ``exit_code`` is 130 and the report partial)."""
    out_dir: str
    data: dict
    files: list[str] = field(default_factory=list)
    paths: dict = field(default_factory=dict)
    interrupted: str | None = None
    notes: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    exit_code: int = 0

    def write(self) -> dict:
        """Write the plots, results.csv and report.md into ``out_dir``; a complete run also results.json
        and report.html (and its partial file goes), an interrupted one keeps results.partial.json as
        the record. Atomic files; returns the paths (also kept in ``paths``)."""
        out = Path(self.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.files = self.data["files"] = plots(out, self.data) + [write_csv(out, self.data)]
        md = markdown(self.data)
        if self.interrupted is None:
            self.paths = write_report(out, self.data, md, f"attnlab {out.name} report")
            remove_partial(out)
        else:
            atomic_write_text(out / "report.md", md)
            self.paths = {"partial": str(out / PARTIAL), "report": str(out / "report.md")}
            self.data["exit_code"] = self.exit_code
        self.data["paths"] = self.paths
        return self.paths


class _Interrupted(Exception):
    """SIGTERM, turned into an exception so that the partial report still gets written."""


class _Session:
    """The store of one run plus this session's counts (measured, reused) and name."""

    def __init__(self, out: Path, resume: bool, context: dict, settings: dict):
        self.store = ResultStore(out, sections=("records", "production", "lra"), context=context, resume=resume)
        old = self.store.previous or {}
        self.store.state.update(sessions=list(old.get("sessions", [])), stopped={},
                                matmul=[m for m in old.get("matmul_runs", old.get("matmul", []))
                                        if isinstance(m, dict) and m.get("gflops")])
        self.name = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self.store.state["sessions"].append(self.name)
        self.settings, self.out = settings, out
        self.reused = self.measured = 0

    def measure(self, runner: Runner, job: dict, section: str) -> dict:
        """One configuration: the stored record when resuming found one with the same settings, else a
        fresh measurement. Either way it is on disk (with a partial report) before this returns."""
        rec = self.store.lookup(job)
        if rec is not None:
            rec["reused"] = True
            self.reused += 1
        else:
            rec = runner.measure(job)
            rec["session"] = self.name
            rec.pop("reused", None)
            self.measured += 1
        self.store.add(rec, section, job=job)
        res = self.result(complete=False)
        res["files"], res["interrupted"] = [], None
        atomic_write_text(self.out / "report.md", markdown(res))
        return rec

    def matmul(self, runner: Runner, job: dict, when: str) -> None:
        """The matrix-product peak now (every session measures its own; the largest counts)."""
        self.store.add({**runner.measure(job), "session": self.name, "when": when}, "matmul")

    def result(self, complete: bool) -> dict:
        """The report's data from what the store holds now (a finished run, or part of one)."""
        s = self.settings
        st = json.loads(json.dumps(self.store.state))  # analysis annotates records: never the stored ones
        peaks = sorted((m for m in st["matmul"] if m.get("gflops")), key=lambda m: -m["gflops"])
        peak = dict(peaks[0]) if peaks else {"size": None, "gflops": None}
        peak["other_measurement_gflops"] = peaks[1]["gflops"] if len(peaks) > 1 else None
        res = analyse(st["records"], s["mechs"], s["lengths"], peak, dict(st["stopped"]), st["production"],
                      st["lra"], s["lra_lengths"])
        threads_seen = [r.get("threads") for r in st["records"] + st["lra"] + st["matmul"] if r.get("threads")]
        res.update({"suite": "all", "quick": s["quick"], "isolation": s["isolation"],
                    "shape": {"B": s["B"], "H": s["H"], "D": s["D"]}, "repeats": s["repeats"], "warmup": s["warmup"],
                    "time_budget_s": s["tbudget"], "memory_budget_bytes": s["mbudget"], "lengths": s["lengths"],
                    "mechanisms": s["mechs"], "mechanisms_note": s["why"], "reference": REFERENCE,
                    "environment": {**environment_record(), "worker_threads": threads_seen[0] if threads_seen else None},
                    "complete": complete, "sessions": st["sessions"], "matmul_runs": st["matmul"],
                    "measured_this_session": self.measured, "reused": self.reused,
                    "resumed_from": self.store.source})
        return res


def _grid(sess: _Session, runner: Runner, s: dict, tick: Callable[[int, str], None]) -> None:
    """Lengths ascending per mechanism until the predicted time or memory would pass the budget."""
    stopped = sess.store.state["stopped"]
    B, H, D, repeats, warmup = s["B"], s["H"], s["D"], s["repeats"], s["warmup"]
    lengths = s["lengths"]
    for m in s["mechs"]:
        stopped.pop(m, None)
        pts_t, pts_m = [], []
        for i, n in enumerate(lengths):
            pt, pm = extrapolate(pts_t, n), extrapolate(pts_m, n)
            _, mb = mechanism_cost(m, n, B, H, D)
            pm = max(pm or 0, mb or 0) or None
            # the reference gets 4x the time budget: every other mechanism's ratios need it
            budget_t = s["tbudget"] * (4 if m == REFERENCE else 1)
            if pt is not None and pt * (repeats + warmup) > budget_t:
                stopped[m] = (f"stopped before n={n}: predicted {pt * (repeats + warmup):.3g} s for "
                              f"{warmup}+{repeats} calls > time budget {budget_t:g} s")
            elif pm is not None and pm > s["mbudget"]:
                stopped[m] = (f"stopped before n={n}: predicted peak {format_bytes(pm)} > memory budget "
                              f"{format_bytes(s['mbudget'])}")
            if m in stopped:
                tick(len(lengths) - i, f"{m}: {stopped[m]}")
                break
            job = {"kind": "attn", "mechanism": m, "n": n, "B": B, "H": H, "D": D, "repeats": repeats,
                   "warmup": warmup, "time_budget": budget_t}
            rec = sess.measure(runner, job, "records")
            tick(1, f"{m} n={n}")
            if "error" in rec:
                stopped[m] = f"stopped at n={n}: {rec['error']}"
                tick(len(lengths) - i - 1, f"{m}: {stopped[m]}")
                break
            pts_t.append((n, rec["time_s"]))
            pts_m.append((n, rec["peak_bytes"]))


def run(config: AllConfig, *, progress: Callable[[int, int, str], None] | None = None) -> AllResult:
    """Measure the grid, the production table and the LRA table of ``config``; write the report.

    For each mechanism, lengths ascend until the predicted time or memory of the next one would pass the
    budget (the reason lands in the report): query, key, value are [B, H, n, D]; each record holds the
    median forward time, peak memory, FLOPs and GFLOP/s, and ratios to torch SDPA measured in the same
    run. Then the tutorial's production table (naive vs SDPA, one head, D = 64) and an LRA-style
    training-efficiency table. Every configuration is stored on disk as it finishes, so ``resume``
    continues a killed run; Ctrl-C or SIGTERM writes a partial report and sets ``exit_code`` 130. Writes
    results.json, report.md, a CSV and plots to ``out``. ``progress(done, total, label)`` is called as
    configurations finish. Raises ValueError for an unknown mechanism or a size < 1, before anything is
    measured.
    """
    t0 = time.perf_counter()
    s = config.settings()
    out = Path(config.out)
    sess = _Session(out, config.resume, {"isolation": s["isolation"], "threads": s["threads"]}, s)
    if not config.resume:
        remove_partial(out)  # a fresh run does not mix with an earlier one
    notes = []
    if sess.store.source:
        notes.append(f"bench all --resume: {len(sess.store.earlier)} stored configuration(s) in {sess.store.source}; "
                     "those with the same settings are reused, not measured again")
    total = 2 + len(s["mechs"]) * len(s["lengths"]) + 2 * len(s["prod_lengths"]) + len(s["mechs"]) * len(s["lra_lengths"])
    done = [0]

    def tick(k: int, label: str) -> None:
        done[0] += k
        if progress:
            progress(done[0], total, label)

    runner = Runner(s["isolation"], s["threads"])
    mm_job = {"kind": "matmul", "size": 512 if s["quick"] else 2048, "repeats": 5}
    interrupted = None

    def on_term(signum, frame):
        raise _Interrupted(f"signal {signum}")

    import signal
    import threading

    old_term = signal.signal(signal.SIGTERM, on_term) if threading.current_thread() is threading.main_thread() else None
    try:
        sess.matmul(runner, mm_job, "start")
        tick(1, "matrix-product peak")
        _grid(sess, runner, s, tick)
        for n in s["prod_lengths"]:  # the tutorial's production table: one head, d_k = 64
            for m in ("naive", REFERENCE):
                sess.measure(runner, {"kind": "attn", "mechanism": m, "n": n, "B": 1, "H": 1, "D": 64,
                                      "repeats": s["repeats"], "warmup": s["warmup"], "time_budget": s["tbudget"],
                                      "table": "production"}, "production")
                tick(1, f"production {m} n={n}")
        for m in s["mechs"]:  # LRA-style training efficiency
            for n in s["lra_lengths"]:
                sess.measure(runner, {"kind": "train", "mechanism": m, "n": n, "B": 2 if s["quick"] else 4,
                                      "repeats": 2 if s["quick"] else 3, "warmup": 1, "time_budget": s["tbudget"],
                                      "table": "lra"}, "lra")
                tick(1, f"LRA {m} n={n}")
        sess.matmul(runner, mm_job, "end")  # again at the end: on a shared machine the larger counts
        tick(1, "matrix-product peak")
    except (KeyboardInterrupt, _Interrupted) as e:
        interrupted = "interrupted (Ctrl-C)" if isinstance(e, KeyboardInterrupt) else f"terminated ({e})"
        runner.close(kill=True)
    finally:
        runner.close()
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
    data = sess.result(complete=interrupted is None)
    data["wall_s"] = time.perf_counter() - t0
    data["interrupted"] = interrupted
    res = AllResult(str(out), data, interrupted=interrupted, notes=notes, wall_s=data["wall_s"],
                    exit_code=0 if interrupted is None else 130)
    res.write()
    return res
