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
writes a partial report with plots; ``--resume`` reuses every configuration already measured with the
same settings and measures only the rest.

Legend: B batch, H heads, n sequence length (L = S = n), D head dim.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ..options import nonneg_int, output_dir, positive_float, positive_int
from ..report import format_bytes

__all__ = ["build_parser", "run", "measure_job", "fit_exponent", "TUTORIAL_TABLE", "REFERENCE"]

REFERENCE = "torch_sdpa"
FULL_LENGTHS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
QUICK_LENGTHS = (128, 256, 512)
LRA_LENGTHS = (1024, 2048, 3072, 4096)
QUICK_LRA_LENGTHS = (128, 256)
#: the tutorial's "Why This Matters for Production" table: n -> (operations, latency, memory) as printed
TUTORIAL_TABLE = {128: ("1M", "<1ms", "64KB"), 512: ("17M", "5-10ms", "1MB"), 2048: ("270M", "50-100ms", "16MB"),
                  4096: ("1B", "200-400ms", "67MB")}


def build_parser(p):
    """Add ``bench all``'s options (--out, --quick, --mechanisms, --lengths, shapes, repeats, budgets,
    --isolation, --threads, the LRA and production tables, --resume, --force, --no-progress) to the
    argparse parser ``p``."""
    p.add_argument("--out", default=None, help="output folder (default reports/bench-all)")
    p.add_argument("--quick", action="store_true", help="small grid, one worker process, seconds")
    p.add_argument("--mechanisms", default=None,
                   help="comma-separated (default: torch_sdpa, naive and every registered mechanism)")
    p.add_argument("--lengths", default=None, help="comma-separated sequence lengths (default 128..65536)")
    p.add_argument("--batch", type=positive_int, default=1, help="batch size")
    p.add_argument("--heads", type=positive_int, default=4, help="heads")
    p.add_argument("--head-dim", type=positive_int, default=64, help="head dim")
    p.add_argument("--repeats", type=positive_int, default=None, help="timed repeats after warm-up (default 5; quick 3)")
    p.add_argument("--warmup", type=nonneg_int, default=1, help="untimed calls before the timed repeats")
    p.add_argument("--time-budget", type=positive_float, default=None,
                   help="seconds one configuration may take (warm-up + repeats; default 60, quick 5)")
    p.add_argument("--memory-budget", type=positive_float, default=None,
                   help="GiB one configuration may use (default: half of this machine's available memory)")
    p.add_argument("--isolation", choices=("config", "suite"), default=None,
                   help="config: a fresh process per configuration (default); suite: one worker process, peak "
                        "memory reset between configurations (quick's default)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads in the workers (default: all cores)")
    p.add_argument("--no-lra", action="store_true", help="skip the LRA-style training-efficiency table")
    p.add_argument("--lra-lengths", default=None, help="lengths of the LRA-style table (default 1024,2048,3072,4096)")
    p.add_argument("--no-production", action="store_true", help="skip the tutorial's production table")
    p.add_argument("--production-lengths", default=None,
                   help="lengths of the production table (default the tutorial's 128,512,2048,4096; quick 128,512)")
    p.add_argument("--resume", action="store_true",
                   help="reuse the configurations a killed or finished run in --out already measured with the same "
                        "settings (results.partial.json, else results.json); measure only the rest")
    p.add_argument("--force", action="store_true",
                   help="replace the earlier run an --out folder holds (without it, such a folder is refused)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


# -- the worker: one process measures the jobs it is given ---------------------------------------------
def _inputs(n, B, H, D, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, n, D, generator=g) for _ in range(3)]  # q, k, v: (B, H, n, D)


def _cost(mech: str, n: int, B: int, H: int, D: int) -> tuple[int | None, int | None]:
    """(FLOPs, intermediate bytes) from the cost model: the mechanism's own flops()/memory(); for
    torch_sdpa and naive, dense attention's 2·n²·(D + Dv) FLOPs."""
    if mech in (REFERENCE, "naive"):
        return B * H * 2 * n * n * 2 * D, (B * H * 3 * n * n * 4 if mech == "naive" else B * H * n * D * 4)
    from attnlab.experiments._common import make_mechanism

    try:
        m = make_mechanism(mech, n)
        return B * H * int(m.flops(n, n, D, D)), B * H * int(m.memory(n, n, D, D))
    except Exception:
        return None, None


def measure_job(job: dict) -> dict:
    """Run one measurement in this process. job: {"kind": "attn"|"train"|"matmul", ...}; returns a record.

    Peak memory is the growth of this process's peak RSS over its RSS once inputs exist (after freed
    memory was returned to the OS and the peak reset), so allocator caches and the interpreter do not count.
    """
    import torch

    from attnlab.experiments import _common as C

    rec = dict(job)
    try:
        if job["kind"] == "matmul":
            N = job.get("size", 1024)
            a, b = torch.randn(N, N), torch.randn(N, N)
            for _ in range(2):
                a @ b
            ts = []
            for _ in range(job.get("repeats", 5)):
                t0 = time.perf_counter()
                a @ b
                ts.append(time.perf_counter() - t0)
            rec["gflops"] = 2 * N ** 3 / min(ts) / 1e9
            return rec
        n, B = job["n"], job["B"]
        if job["kind"] == "attn":
            H, D = job["H"], job["D"]
            q, k, v = _inputs(n, B, H, D)
            fn = C.attention_fn(job["mechanism"], n)
            call = lambda: fn(q, k, v)  # noqa: E731
        else:  # one training step of a small classifier (LRA Table 2 style)
            cfg = C.RunConfig(name="bench", task="bench", seq_len=n, d_model=job.get("d_model", 64), num_heads=2,
                              head_dim=32, num_layers=job.get("layers", 2), attention=job["mechanism"])
            from attnlab.data import TaskData

            data = TaskData("bench", torch.randint(1, 16, (B, n)), torch.randint(0, 10, (B,)), 16, 10)
            model = C.build_model(cfg, data)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            ids, tgt = data.inputs, data.targets

            def call():
                loss = torch.nn.functional.cross_entropy(model(ids), tgt)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        with torch.no_grad() if job["kind"] == "attn" else torch.enable_grad():
            C.reset_peak_rss()
            rss0 = C.rss_bytes()
            warm = []
            for _ in range(max(1, job.get("warmup", 1))):
                t0 = time.perf_counter()
                out = call()
                warm.append(time.perf_counter() - t0)
                del out
            budget = job.get("time_budget", 60.0)
            reps = max(1, min(job.get("repeats", 5), int(budget / max(warm[-1], 1e-9)) - len(warm)))
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                out = call()
                ts.append(time.perf_counter() - t0)
                del out
            rec["peak_bytes"] = max(0, C.peak_rss_bytes() - rss0)
        rec.update(time_s=statistics.median(ts), times_s=ts, warmup_s=warm, repeats_done=reps)
        if job["kind"] == "attn":
            rec["flops"], rec["model_bytes"] = _cost(job["mechanism"], n, B, job["H"], job["D"])
            rec["gflops"] = rec["flops"] / rec["time_s"] / 1e9 if rec["flops"] else None
        else:
            rec["steps_per_s"] = 1.0 / rec["time_s"]
    except Exception as e:  # a mechanism that refuses these inputs: record why
        rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return rec


def _worker_main(argv: list[str]) -> int:
    """``python -m attnlab.bench.mechanisms --worker [--threads N]``: one JSON job per stdin line, one
    ``RESULT {...}`` line per job on stdout."""
    import signal

    import torch

    # Ctrl-C reaches the whole process group: the driver handles it (and kills this worker), so that an
    # interrupt never shows up as a measurement ("worker exited ..."). If the driver dies, so do we.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if "--threads" in argv:
        torch.set_num_threads(int(argv[argv.index("--threads") + 1]))
    for line in sys.stdin:
        if not line.strip():
            continue
        rec = measure_job(json.loads(line))
        rec["threads"] = torch.get_num_threads()
        print("RESULT " + json.dumps(rec), flush=True)
    return 0


class _Worker:
    """A measuring Python process. ``isolation="config"`` starts a fresh one per job."""

    def __init__(self, threads: int | None):
        import attnlab

        env = dict(os.environ)
        src = str(Path(attnlab.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        cmd = [sys.executable, "-m", "attnlab.bench.mechanisms", "--worker"]
        if threads:
            cmd += ["--threads", str(threads)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env, bufsize=1)

    def measure(self, job: dict, timeout: float) -> dict:
        import select

        try:
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return {**job, "error": f"worker died: {self._stderr()}"}
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close(kill=True)
                return {**job, "error": f"timed out after {timeout:.0f} s"}
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 1.0))
            if not ready:
                if self.proc.poll() is not None:
                    return {**job, "error": f"worker exited with code {self.proc.returncode}: {self._stderr()}"}
                continue
            line = self.proc.stdout.readline()
            if not line:
                self.proc.wait()
                return {**job, "error": f"worker exited with code {self.proc.returncode}: {self._stderr()}"}
            if line.startswith("RESULT "):
                return json.loads(line[7:])

    def _stderr(self) -> str:
        try:
            self.proc.wait(timeout=5)
            return (self.proc.stderr.read() or "").strip()[-300:]
        except Exception:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self, kill: bool = False) -> None:
        if self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdout, self.proc.stderr):
            try:
                f.close()
            except Exception:
                pass


# -- analysis ---------------------------------------------------------------------------------------------
def fit_exponent(ns: list[int], ys: list[float], min_n: int = 0) -> float | None:
    """Least-squares slope of log y against log n over points with n >= min_n (all points if fewer than 2)."""
    pts = [(n, y) for n, y in zip(ns, ys) if y is not None and y > 0]
    big = [(n, y) for n, y in pts if n >= min_n]
    pts = big if len(big) >= 2 else pts
    if len(pts) < 2:
        return None
    xs, zs = [math.log(n) for n, _ in pts], [math.log(y) for _, y in pts]
    mx, mz = sum(xs) / len(xs), sum(zs) / len(zs)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (z - mz) for x, z in zip(xs, zs)) / den if den > 0 else None


def _available_bytes() -> int:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


def _predict(points: list[tuple[int, float]], n: int, default_exp: float = 2.0) -> float | None:
    """Extrapolate y at n from measured (n, y) points with the exponent of the last two (else n^2)."""
    pts = [(a, y) for a, y in points if y and y > 0]
    if not pts:
        return None
    if len(pts) >= 2:
        (n1, y1), (n2, y2) = pts[-2], pts[-1]
        e = max(1.0, math.log(y2 / y1) / math.log(n2 / n1)) if n2 != n1 else default_exp
    else:
        e = default_exp
    n0, y0 = pts[-1]
    return y0 * (n / n0) ** e


_fmt_bytes = format_bytes


def _fmt_time(t) -> str:
    if t is None:
        return "—"
    return f"{t * 1e3:.3g} ms" if t < 1 else f"{t:.3g} s"


# -- the driver -----------------------------------------------------------------------------------------
def default_mechanisms() -> tuple[list[str], str | None]:
    """(names, why): torch_sdpa, naive and every registered mechanism, with ``why`` None; if the registry
    cannot be listed, a fixed fallback list and the reason as ``why``."""
    from attnlab.experiments._common import mechanism_names

    names, why = mechanism_names()
    if why is not None:
        return [REFERENCE, "naive", "dense", "tiled", "pattern:sliding_window", "pattern:bigbird"], why
    return [REFERENCE, "naive"] + names, None


class _Runner:
    """Hands jobs to workers: a fresh process per job ("config") or one long-lived process ("suite")."""

    def __init__(self, isolation, threads):
        self.isolation, self.threads = isolation, threads
        self.worker: _Worker | None = None

    def measure(self, job: dict) -> dict:
        timeout = 180 + 3 * job.get("time_budget", 60)
        if self.worker is None or not self.worker.alive():
            self.worker = _Worker(self.threads)
        rec = self.worker.measure(job, timeout)
        if self.isolation == "config":
            self.close()
        return rec

    def close(self, kill: bool = False):
        if self.worker is not None:
            self.worker.close(kill=kill)
            self.worker = None


class _Interrupted(Exception):
    """SIGTERM, turned into an exception so that the partial report still gets written."""


class _Store:
    """The measurements of one output folder, kept on disk as they arrive.

    Each finished configuration is appended and ``results.partial.json`` rewritten atomically, so a run
    killed at any moment (even SIGKILL) keeps everything it finished. A configuration's identity is its
    job (mechanism, n, shape, repeats, warm-up, budget, table) plus the isolation and worker threads:
    ``--resume`` reuses a stored record only when all of these match.
    """

    SECTIONS = ("records", "production", "lra")

    def __init__(self, out: Path, resume: bool, context: dict):
        self.out, self.context = out, context
        self.partial = out / "results.partial.json"
        self.state = {"complete": False, "sessions": [], "matmul": [], "stopped": {},
                      **{s: [] for s in self.SECTIONS}}
        self.earlier: dict[str, dict] = {}
        self.earlier_other = 0  # stored records whose settings differ: measured again
        self.source = None
        if resume:
            for path in (self.partial, out / "results.json"):
                if path.exists():
                    try:
                        old = json.loads(path.read_text())
                    except (OSError, ValueError) as e:
                        raise ValueError(f"--resume: cannot read {path}: {e}") from None
                    self.source = str(path)
                    for sec in self.SECTIONS:
                        for r in old.get(sec, []):
                            if r.get("settings_key"):
                                self.earlier[r["settings_key"]] = r
                    self.state["sessions"] = list(old.get("sessions", []))
                    self.state["matmul"] = [m for m in old.get("matmul_runs", old.get("matmul", []))
                                            if isinstance(m, dict) and m.get("gflops")]
                    break
        self.session = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self.state["sessions"].append(self.session)
        self.reused = self.measured = 0
        self.settings: dict = {}

    def key(self, job: dict) -> str:
        return json.dumps({**job, **self.context}, sort_keys=True)

    def lookup(self, job: dict) -> dict | None:
        rec = self.earlier.get(self.key(job))
        return None if rec is None else json.loads(json.dumps(rec))  # a copy: analysis writes into records

    def add(self, section: str | None, rec: dict) -> None:
        if section is None:
            self.state["matmul"].append(rec)
        else:
            self.state[section].append(rec)
        self.save()

    def save(self) -> None:
        from attnlab.report import atomic_write_json

        self.out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.partial, {**self.state, "context": self.context})


def _measure(runner: _Runner, store: _Store, job: dict, section: str, prog, tid) -> dict:
    """One configuration: the stored record when ``--resume`` found one with the same settings, else a
    fresh measurement. Either way it is on disk before this returns."""
    rec = store.lookup(job)
    if rec is not None:
        rec["reused"] = True
        store.reused += 1
    else:
        rec = runner.measure(job)
        rec.update(settings_key=store.key(job), session=store.session)
        rec.pop("reused", None)
        store.measured += 1
    store.add(section, rec)
    _write_partial(store)
    prog.advance(tid, 1)
    return rec


def run(args):
    """Run ``bench all`` with the parsed options ``args`` and return the result dict.

    For each mechanism, lengths ascend until the predicted time or memory of the next one would pass the
    budget (the reason lands in the report): query, key, value are [B, H, n, D]; each record holds the
    median forward time, peak memory, FLOPs and GFLOP/s, and ratios to torch SDPA measured in the same
    run. Then the tutorial's production table (naive vs SDPA, one head, D = 64) and an LRA-style
    training-efficiency table. Every configuration is stored on disk as it finishes, so ``--resume``
    continues a killed run; Ctrl-C or SIGTERM writes a partial report and sets ``exit_code`` 130. Writes
    results.json, report.md, a CSV and plots to ``--out`` (default reports/bench-all) and renders a
    summary. Raises ValueError for an unknown mechanism or a size < 1, before anything is measured.
    """
    from attnlab.experiments import _common as C

    t0 = time.perf_counter()
    quick = bool(args.quick)
    if args.mechanisms:
        mechs, why = [m.strip() for m in args.mechanisms.split(",") if m.strip()], None
    else:
        mechs, why = default_mechanisms()
    if REFERENCE not in mechs:
        mechs = [REFERENCE] + mechs  # every ratio needs it
    lengths = sorted(C.ints_of(args.lengths, "--lengths")) if args.lengths else list(QUICK_LENGTHS if quick else FULL_LENGTHS)
    for name, v in (("--batch", args.batch), ("--heads", args.heads), ("--head-dim", args.head_dim)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    repeats = args.repeats if args.repeats is not None else (3 if quick else 5)
    tbudget = args.time_budget if args.time_budget is not None else (5.0 if quick else 60.0)
    mbudget = int(args.memory_budget * 2**30) if args.memory_budget else _available_bytes() // 2
    isolation = args.isolation or ("suite" if quick else "config")
    B, H, D = args.batch, args.heads, args.head_dim
    out = Path(args.out) if args.out else Path("reports") / "bench-all"
    for m in mechs:  # unknown names fail before anything runs
        if m not in (REFERENCE, "naive"):
            try:
                C.attention_fn(m, max(lengths))
            except (ValueError, TypeError) as e:
                raise ValueError(f"--mechanisms: {e}") from None
    # checked last, since --force removes the earlier run: only once every other option is known good
    output_dir(out, resume=bool(getattr(args, "resume", False)), force=bool(getattr(args, "force", False)))
    args.out = args.checkpoint_dir = str(out)  # Ctrl-C says it is kept and how to resume (cli.main)

    lra_lengths = [] if args.no_lra else (sorted(C.ints_of(args.lra_lengths, "--lra-lengths")) if args.lra_lengths
                                          else list(QUICK_LRA_LENGTHS if quick else LRA_LENGTHS))
    prod_ns = [] if args.no_production else (sorted(C.ints_of(args.production_lengths, "--production-lengths"))
                                             if args.production_lengths else
                                             [128, 512] if quick else sorted(TUTORIAL_TABLE))
    store = _Store(out, bool(getattr(args, "resume", False)), {"isolation": isolation, "threads": args.threads})
    if not getattr(args, "resume", False) and store.partial.exists():
        store.partial.unlink()  # a fresh run does not mix with an earlier one
    total = 2 + len(mechs) * len(lengths) + 2 * len(prod_ns) + len(mechs) * len(lra_lengths)
    stopped = store.state["stopped"]
    runner = _Runner(isolation, args.threads)
    mm_job = {"kind": "matmul", "size": 512 if quick else 2048, "repeats": 5}
    settings = dict(quick=quick, isolation=isolation, B=B, H=H, D=D, repeats=repeats, warmup=args.warmup,
                    tbudget=tbudget, mbudget=mbudget, mechs=mechs, lengths=lengths, lra_lengths=lra_lengths, why=why,
                    threads=args.threads)
    store.settings = settings
    if store.source:
        C.render([f"[bold]bench all --resume[/bold]: {len(store.earlier)} stored configuration(s) in {store.source}; "
                  "those with the same settings are reused, not measured again"])
    interrupted = None

    def on_term(signum, frame):
        raise _Interrupted(f"signal {signum}")

    import signal
    import threading

    old_term = signal.signal(signal.SIGTERM, on_term) if threading.current_thread() is threading.main_thread() else None
    try:
        with C.progress(args.no_progress) as prog:
            tid = prog.add_task("bench all", total=total)
            try:
                # the matrix-product peak of this session (every session measures its own; the largest counts)
                store.add(None, {**runner.measure(mm_job), "session": store.session, "when": "start"})
                prog.advance(tid, 1)
                # 1) the grid: lengths ascending per mechanism until a budget would be passed
                for m in mechs:
                    stopped.pop(m, None)
                    pts_t, pts_m = [], []
                    for i, n in enumerate(lengths):
                        pt, pm = _predict(pts_t, n), _predict(pts_m, n)
                        fl, mb = _cost(m, n, B, H, D)
                        pm = max(pm or 0, mb or 0) or None
                        # the reference gets 4x the time budget: every other mechanism's ratios need it
                        budget_m = tbudget * (4 if m == REFERENCE else 1)
                        if pt is not None and pt * (repeats + args.warmup) > budget_m:
                            stopped[m] = (f"stopped before n={n}: predicted {pt * (repeats + args.warmup):.3g} s for "
                                          f"{args.warmup}+{repeats} calls > time budget {budget_m:g} s")
                        elif pm is not None and pm > mbudget:
                            stopped[m] = (f"stopped before n={n}: predicted peak {_fmt_bytes(pm)} > memory budget "
                                          f"{_fmt_bytes(mbudget)}")
                        if m in stopped:
                            prog.advance(tid, len(lengths) - i)
                            break
                        job = {"kind": "attn", "mechanism": m, "n": n, "B": B, "H": H, "D": D, "repeats": repeats,
                               "warmup": args.warmup, "time_budget": budget_m}
                        rec = _measure(runner, store, job, "records", prog, tid)
                        if "error" in rec:
                            stopped[m] = f"stopped at n={n}: {rec['error']}"
                            prog.advance(tid, len(lengths) - i - 1)
                            break
                        pts_t.append((n, rec["time_s"]))
                        pts_m.append((n, rec["peak_bytes"]))
                # 2) the tutorial's production table: one head, d_k = 64
                for n in prod_ns:
                    for m in ("naive", REFERENCE):
                        _measure(runner, store, {"kind": "attn", "mechanism": m, "n": n, "B": 1, "H": 1, "D": 64,
                                                 "repeats": repeats, "warmup": args.warmup, "time_budget": tbudget,
                                                 "table": "production"}, "production", prog, tid)
                # 3) LRA-style training efficiency
                for m in mechs:
                    for n in lra_lengths:
                        _measure(runner, store, {"kind": "train", "mechanism": m, "n": n, "B": 4 if not quick else 2,
                                                 "repeats": 2 if quick else 3, "warmup": 1, "time_budget": tbudget,
                                                 "table": "lra"}, "lra", prog, tid)
                # the matrix-product peak again at the end: on a shared machine the larger counts
                store.add(None, {**runner.measure(mm_job), "session": store.session, "when": "end"})
                prog.advance(tid, 1)
            except (KeyboardInterrupt, _Interrupted) as e:
                interrupted = "interrupted (Ctrl-C)" if isinstance(e, KeyboardInterrupt) else f"terminated ({e})"
                runner.close(kill=True)
            finally:
                runner.close()
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
    res = _result(store, settings, C, complete=interrupted is None)
    res["wall_s"] = time.perf_counter() - t0
    res["interrupted"] = interrupted
    out.mkdir(parents=True, exist_ok=True)
    res["files"] = _plots(out, res) + [_csv(out, res)]
    md = _report(res)
    if interrupted is None:
        res["paths"] = C.write_results(out, res, md)
        if store.partial.exists():
            store.partial.unlink()  # results.json now holds every record (and is what --resume reads)
    else:
        from attnlab.report import atomic_write_text

        atomic_write_text(out / "report.md", md)
        res["paths"] = {"partial": str(store.partial), "report": str(out / "report.md")}
        res["exit_code"] = 130
    lines = [f"[bold]bench all[/bold] -> {out}/report.md  (matmul peak {C.fmt(res['matmul_gflops'])} GFLOP/s, "
             f"{isolation} isolation, {time.perf_counter() - t0:.0f} s; measured {store.measured}, "
             f"reused {store.reused})"]
    if interrupted:
        lines.append(f"[bold red]{interrupted}[/bold red]: partial report written; `--resume` with the same "
                     "options continues where this stopped")
    for m in mechs:
        f = res["fits"].get(m, {})
        lines.append(f"  {m:<16} time ∝ n^{C.fmt(f.get('time'))}, memory ∝ n^{C.fmt(f.get('memory'))}"
                     + (f"  [{stopped[m]}]" if m in stopped else ""))
    C.render(lines)
    res["summary_lines"] = lines
    return res


def _result(store: _Store, s: dict, C, complete: bool) -> dict:
    """The report's data from what the store holds now (a finished run, or part of one)."""
    st = json.loads(json.dumps(store.state))  # analysis annotates records: never the stored ones
    peaks = sorted((m for m in st["matmul"] if m.get("gflops")), key=lambda m: -m["gflops"])
    peak = dict(peaks[0]) if peaks else {"size": None, "gflops": None}
    peak["other_measurement_gflops"] = peaks[1]["gflops"] if len(peaks) > 1 else None
    res = _analyse(st["records"], s["mechs"], s["lengths"], peak, dict(st["stopped"]), st["production"], st["lra"],
                   s["lra_lengths"])
    threads_seen = [r.get("threads") for r in st["records"] + st["lra"] + st["matmul"] if r.get("threads")]
    res.update({"suite": "all", "quick": s["quick"], "isolation": s["isolation"],
                "shape": {"B": s["B"], "H": s["H"], "D": s["D"]}, "repeats": s["repeats"], "warmup": s["warmup"],
                "time_budget_s": s["tbudget"], "memory_budget_bytes": s["mbudget"], "lengths": s["lengths"],
                "mechanisms": s["mechs"], "mechanisms_note": s["why"], "reference": REFERENCE,
                "environment": {**C.env_record(), "worker_threads": threads_seen[0] if threads_seen else None},
                "complete": complete, "sessions": st["sessions"], "matmul_runs": st["matmul"],
                "measured_this_session": store.measured, "reused": store.reused, "resumed_from": store.source})
    return res


def _write_partial(store: _Store) -> None:
    """report.md of what is measured so far (text only; plots come at the end or on an interrupt)."""
    from attnlab.experiments import _common as C
    from attnlab.report import atomic_write_text

    res = _result(store, store.settings, C, complete=False)
    res["files"], res["interrupted"] = [], None
    atomic_write_text(store.out / "report.md", _report(res))


def _analyse(records, mechs, lengths, peak, stopped, prod, lra, lra_lengths) -> dict:
    ref = {r["n"]: r for r in records if r["mechanism"] == REFERENCE and "error" not in r}
    pk = peak.get("gflops")
    for r in records:
        if "error" in r:
            continue
        s = ref.get(r["n"])
        r["time_vs_sdpa"] = r["time_s"] / s["time_s"] if s else None
        r["memory_vs_sdpa"] = r["peak_bytes"] / s["peak_bytes"] if s and s["peak_bytes"] else None
        r["fraction_of_matmul_peak"] = r["gflops"] / pk if r.get("gflops") and pk else None
    fits = {}
    for m in mechs:
        ok = sorted((r for r in records if r["mechanism"] == m and "error" not in r), key=lambda r: r["n"])
        ns = [r["n"] for r in ok]
        fits[m] = {"time": fit_exponent(ns, [r["time_s"] for r in ok], 1024),
                   "memory": fit_exponent(ns, [r["peak_bytes"] for r in ok], 1024),
                   "time_all": fit_exponent(ns, [r["time_s"] for r in ok]),
                   "points": len(ok), "max_n": max(ns) if ns else None}
        errs = [r for r in records if r["mechanism"] == m and "error" in r]
        if errs and m not in stopped:
            stopped[m] = f"error at n={errs[0]['n']}: {errs[0]['error']}"
    vref = {r["n"]: r for r in lra if r["mechanism"] == "sdpa" and "error" not in r}
    if not vref:
        vref = {r["n"]: r for r in lra if r["mechanism"] == REFERENCE and "error" not in r}
    for r in lra:
        v = vref.get(r["n"])
        if "error" not in r and v:
            r["speed_vs_vanilla"] = r["steps_per_s"] / v["steps_per_s"]
            r["memory_vs_vanilla"] = r["peak_bytes"] / v["peak_bytes"] if v["peak_bytes"] else None
    return {"records": records, "matmul_gflops": pk, "matmul": peak, "fits": fits, "stopped": stopped,
            "production": prod, "lra": lra, "lra_lengths": lra_lengths,
            "lra_vanilla": "sdpa" if any(r["mechanism"] == "sdpa" for r in lra) else REFERENCE}


def _plots(out: Path, res) -> list[str]:
    from attnlab.experiments import _common as C
    from attnlab.report import legend_outside, line_styles

    plt = C.plt()
    files = []
    ok = [r for r in res["records"] if "error" not in r]
    for key, ylabel, fname in (("time_s", "median forward time (s)", "time.png"), ("peak_bytes", "peak memory (bytes)", "memory.png"),
                               ("time_vs_sdpa", "time / torch SDPA time", "ratio.png")):
        fig, ax = plt.subplots(figsize=(8, 5.5))
        others = [m for m in res["mechanisms"] if m != REFERENCE]
        style = dict(zip(others, line_styles(len(others))))
        style[REFERENCE] = {"color": "black", "marker": "o", "linestyle": "-"}
        for m in res["mechanisms"]:
            pts = sorted((r["n"], r[key]) for r in ok if r["mechanism"] == m and r.get(key))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], ms=3, lw=1.2, label=m, **style[m])
        if key != "time_vs_sdpa" and ok:
            n0 = min(r["n"] for r in ok)
            ys = [r[key] for r in ok if r["n"] == n0 and r.get(key)]
            if ys:
                y0 = statistics.median(ys)
                ns = sorted({r["n"] for r in ok})
                ax.plot(ns, [y0 * (n / n0) ** 2 for n in ns], "k:", lw=0.8, label="∝ n²")
                ax.plot(ns, [y0 * (n / n0) for n in ns], "k--", lw=0.8, label="∝ n")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length n")
        ax.set_ylabel(ylabel)
        sh = res["shape"]
        ax.set_title(f"B={sh['B']}, H={sh['H']}, D={sh['D']}, float32, forward", fontsize=10)
        ax.grid(alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[0]:  # an interrupted run may have nothing to label yet
            legend_outside(ax)
        files.append(C.save_plot(fig, out / fname))
    if res["lra"]:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        lstyle = dict(zip(res["mechanisms"], line_styles(len(res["mechanisms"]))))
        for m in res["mechanisms"]:
            pts = sorted((r["n"], r.get("speed_vs_vanilla"), r.get("memory_vs_vanilla")) for r in res["lra"]
                         if r["mechanism"] == m and "error" not in r)
            if pts:
                axes[0].plot([p[0] for p in pts], [p[1] for p in pts], ms=3, lw=1.2, label=m, **lstyle[m])
                axes[1].plot([p[0] for p in pts], [p[2] for p in pts], ms=3, lw=1.2, label=m, **lstyle[m])
        for ax, t in zip(axes, ("training steps/s vs vanilla", "peak memory vs vanilla")):
            ax.set_xlabel("n")
            ax.set_yscale("log")
            ax.set_title(t, fontsize=10)
        legend_outside(axes[1])
        files.append(C.save_plot(fig, out / "lra.png"))
    return files


def _csv(out: Path, res) -> str:
    import csv
    import io

    from attnlab.report import atomic_write_text

    cols = ["table", "kind", "mechanism", "n", "B", "H", "D", "time_s", "peak_bytes", "flops", "gflops",
            "fraction_of_matmul_peak", "time_vs_sdpa", "memory_vs_sdpa", "steps_per_s", "speed_vs_vanilla",
            "memory_vs_vanilla", "repeats_done", "error"]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore")
    w.writeheader()
    for r in res["records"] + res["production"] + res["lra"]:
        w.writerow({"table": r.get("table", "grid"), **r})
    atomic_write_text(out / "results.csv", buf.getvalue())
    return str(out / "results.csv")


def _report(res) -> str:
    from attnlab.experiments import _common as C

    sh = res["shape"]
    md = ["# attnlab bench all: every mechanism × sequence length", ""]
    if not res.get("complete", True):
        n_done = len(res["records"]) + len(res["production"]) + len(res["lra"])
        md += [f"> **Partial report** ({res.get('interrupted') or 'run in progress or killed'}): {n_done} "
               "configuration(s) measured so far. `attnlab bench all --resume` with the same options and `--out` "
               "measures only the rest.", ""]
    if len(res.get("sessions") or []) > 1:
        md += [f"> Measured over {len(res['sessions'])} sessions (`--resume`): {', '.join(res['sessions'])}. "
               f"{res.get('reused', 0)} configuration(s) were reused from earlier sessions, "
               f"{res.get('measured_this_session', 0)} measured in the last one; each record's `session` says when. "
               "A ratio between records of different sessions compares measurements taken at different times.", ""]
    pics = {Path(f).name for f in res.get("files") or []}
    md += [
          f"Forward pass, float32, B={sh['B']}, H={sh['H']}, D={sh['D']}, L = S = n; median of {res['repeats']} calls "
          f"after {res['warmup']} warm-up call(s). Peak memory: growth of the worker's peak RSS over its RSS once the "
          f"inputs exist ({'a fresh process per configuration' if res['isolation'] == 'config' else 'one worker process; peak reset between configurations'}). "
          f"FLOPs from each mechanism's cost model (`flops()`); GFLOP/s against a {res['matmul'].get('size')}² float32 "
          f"matrix product measured at the start of each session and at the end of the run (the largest counts): **{C.fmt(res['matmul_gflops'])} "
          f"GFLOP/s** (other: {C.fmt(res['matmul'].get('other_measurement_gflops'))}). Every ratio is to "
          f"`{REFERENCE}` (torch.nn.functional.scaled_dot_product_attention) at the same n, in the same run. "
          f"Budgets: {res['time_budget_s']:g} s per configuration ({4 * res['time_budget_s']:g} s for the reference), "
          f"{_fmt_bytes(res['memory_budget_bytes'])} memory."
          + (" **Quick mode: toy sizes.**" if res["quick"] else ""), "",
          *[x for f in ("time", "memory", "ratio") if f + ".png" in pics for x in (f"![{f}]({f}.png)", "")],
          "## Fitted exponents (log-log least squares over n ≥ 1024 where there are two such points, else all)", ""]
    rows = [[m, f["time"], f["memory"], f["time_all"], f["max_n"], res["stopped"].get(m, "")] for m, f in res["fits"].items()]
    md += [C.fmt_table(["mechanism", "time exponent", "memory exponent", "time exponent (all n)", "largest n",
                        "stopped"], rows), ""]
    md += ["## Every measurement", ""]
    rows = []
    for r in sorted(res["records"], key=lambda r: (res["mechanisms"].index(r["mechanism"]) if r["mechanism"] in res["mechanisms"] else 99, r["n"])):
        if "error" in r:
            rows.append([r["mechanism"], r["n"], "—", "—", "—", "—", "—", "—", r["error"][:80]])
        else:
            rows.append([r["mechanism"], r["n"], _fmt_time(r["time_s"]), _fmt_bytes(r["peak_bytes"]), r.get("gflops"),
                         r.get("fraction_of_matmul_peak"), r.get("time_vs_sdpa"), r.get("memory_vs_sdpa"), ""])
    md += [C.fmt_table(["mechanism", "n", "time", "peak memory", "GFLOP/s", "of matmul peak", "time vs SDPA",
                        "memory vs SDPA", "note"], rows), ""]
    if res["production"]:
        md += ["## The tutorial's production table, regenerated on this machine", "",
               "One head, d_k = 64, float32, forward only. The tutorial names no machine; its figures are shown "
               "as printed beside ours. 'naive' is softmax(QKᵀ/√d_k)V written out in PyTorch (it materialises the "
               "n×n scores, as the tutorial's memory column assumes); torch SDPA is PyTorch's fused kernel.", ""]
        rows = []
        by = {(r["mechanism"], r["n"]): r for r in res["production"]}
        for n in sorted({r["n"] for r in res["production"]}):
            ops, lat, mem = TUTORIAL_TABLE.get(n, ("—", "—", "—"))
            nv, sd = by.get(("naive", n), {}), by.get((REFERENCE, n), {})
            rows.append([n, ops, f"{n * n * 64 / 1e6:.3g}M", lat, _fmt_time(nv.get("time_s")), _fmt_time(sd.get("time_s")),
                         mem, _fmt_bytes(n * n * 4), _fmt_bytes(nv.get("peak_bytes")), _fmt_bytes(sd.get("peak_bytes"))])
        md += [C.fmt_table(["n", "tutorial ops", "n²·d_k", "tutorial latency", "measured naive", "measured torch SDPA",
                            "tutorial memory", "n²·4 B", "measured naive peak", "measured SDPA peak"], rows), ""]
    if res["lra"]:
        md += ["## LRA-style efficiency (Tay et al. 2020, Table 2 layout)", "",
               f"Training steps/s and peak memory of a 2-layer classifier (d_model 64, 2 heads) with each mechanism, "
               f"relative to vanilla attention (`{res['lra_vanilla']}`) at the same n, batch "
               f"{(res['lra'] or [{}])[0].get('B')}. Above 1 is faster / more memory.", ""]
        ns = res["lra_lengths"]
        by = {(r["mechanism"], r["n"]): r for r in res["lra"]}
        rows = []
        for m in res["mechanisms"]:
            cells_s = [by.get((m, n), {}).get("speed_vs_vanilla") for n in ns]
            cells_m = [by.get((m, n), {}).get("memory_vs_vanilla") for n in ns]
            errs = [by.get((m, n), {}).get("error") for n in ns if by.get((m, n), {}).get("error")]
            rows.append([m, *cells_s, *cells_m, (errs[0][:60] if errs else "")])
        md += [C.fmt_table(["mechanism", *[f"steps/s ×, n={n}" for n in ns], *[f"memory ×, n={n}" for n in ns], "note"], rows),
               "", *(["![lra](lra.png)", ""] if "lra.png" in pics else [])]
    if res["mechanisms_note"]:
        md += [f"Mechanism registry: {res['mechanisms_note']}", ""]
    md += ["## Environment", "", "```", *[f"{k}: {v}" for k, v in res["environment"].items() if k != "argv"], "```", ""]
    return "\n".join(md)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        sys.exit(_worker_main(sys.argv))
    from attnlab.cli.main import main

    sys.exit(main(["bench", "all", *sys.argv[1:]]))
