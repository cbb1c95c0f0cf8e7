"""attnlab bench core: attnlab's methods vs torch SDPA vs naive attention, side by side in one run.

Time: median of repeats after a warm-up, implementations interleaved per configuration. Peak memory:
each configuration in a fresh process (attnlab.bench._child). Configurations predicted to exceed the
time or memory budget are skipped and listed with the reason. Writes results.json, report.md and
log-log plots with every ratio against SDPA measured in the same run.

``run(CoreConfig(...)) -> Result``: no printing, no argv (the CLI is ``attnlab bench core``).

Legend: B batch, H heads, n sequence length (L = S = n), E head dim.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable

import torch

from .. import cpu
from ..harness import markdown_table, pyplot, save_plot, time_call
from ..report import atomic_write_json, atomic_write_text, environment, line_styles, render_markdown_file
from .fit import fit_exponent
from .impls import build_call, make_inputs, pattern_density, peak_in_fresh_process

__all__ = ["CoreConfig", "Record", "Result", "run", "time_call", "fit_exponent", "peak_bytes"]

PATTERNS = {
    "sliding_window_256": {"name": "sliding_window", "window": 256, "causal": True},
    "bigbird": {"name": "bigbird", "block_size": 128, "window_blocks": 3, "global_blocks": 1, "random_blocks": 1},
    "block_sparse_10pct": {"name": "block_sparse", "block_size": 128, "keep": 0.1},
}


@dataclass
class Record:
    """One measurement of one implementation at one configuration (a row of results.json and report.md).

    ``section`` is "dense", "pattern", "train" (forward + backward) or "memory" (peak bytes measured in a
    fresh process, ``seconds`` unset). Inputs are query, key, value of shape [B, H, n, E] =
    [1, 8, n, 64]. ``gflops`` counts only the work the pattern keeps (``density`` of the n x n scores,
    halved for dense causal); ``ratio_vs_sdpa`` is SDPA's time over this one in the same run.
    """
    section: str
    impl: str
    n: int
    dtype: str
    causal: bool
    pattern: str | None = None
    backward: bool = False
    seconds: float | None = None
    peak_bytes: int | None = None
    gflops: float | None = None  # achieved, counting only the work the pattern needs
    ratio_vs_sdpa: float | None = None  # sdpa time / this time (>1: faster than SDPA)
    density: float = 1.0
    # patterns: this time / (density x SDPA's dense non-causal fp32 time at the same n); target <= 1.5
    vs_density_dense: float | None = None


@dataclass
class Result:
    """Everything one ``bench core`` run measured, as written to ``<out_dir>/results.json``.

    ``skipped`` lists the configurations predicted to exceed the time or memory budget, each with its
    reason; ``peak_gflops`` is the matrix-product GFLOP/s per dtype measured in the same run;
    ``exponents`` the fitted log-log slope of time (or memory) against n per implementation (n >= 1024);
    ``complete`` is False while a run is in progress or was killed (what it had measured is kept, for
    ``--resume``); ``exit_code`` is what the CLI should exit with.
    """
    out_dir: str
    records: list[Record] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)
    peak_gflops: dict = field(default_factory=dict)
    exponents: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    settings: dict = field(default_factory=dict)
    complete: bool = False
    notes: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    exit_code: int = 0

    def write(self) -> list[str]:
        """Write results.json, time.png, memory.png (when memory was measured), report.md and its HTML
        into ``out_dir``, atomically; returns the files (also kept in ``files``)."""
        _write(self, Path(self.out_dir))
        return self.files


@dataclass
class CoreConfig:
    """What ``bench core`` measures. ``quick``: n in (128, 256), float32 only, budgets of 1 s and 2 GiB;
    otherwise n from 256 up to ``max_n`` (at least 256), float32 and bfloat16, under ``time_budget``
    seconds per call and ``mem_budget_gib``. ``memory``: measure peak memory in fresh processes.
    ``resume``: keep what an earlier run with the same settings left in ``out`` and measure the rest."""
    out: str = "reports/bench-core"
    quick: bool = False
    max_n: int = 65536
    time_budget: float = 20.0
    mem_budget_gib: float = 12.0
    memory: bool = True
    resume: bool = False

    def validate(self) -> None:
        """Raise ValueError naming the option for a setting that cannot be measured."""
        if not self.quick and self.max_n < 256:
            raise ValueError(f"--max-n must be >= 256, the shortest length measured, got {self.max_n}")
        for name in ("time_budget", "mem_budget_gib"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"--{name.replace('_', '-')} must be a positive number, got {v!r}")

    def settings(self) -> dict:
        """The settings a ``resume`` must match (as stored in results.json)."""
        return dict(quick=self.quick, max_n=self.max_n, time_budget=self.time_budget,
                    mem_budget_gib=self.mem_budget_gib, memory=self.memory)


def _flops(n, causal, density, B=1, H=8, D=64):
    return 4 * B * H * n * n * D * density * (0.5 if causal and density == 1.0 else 1.0)


def _predict_bytes(impl, n, dtype_bytes, B=1, H=8, D=64, density=1.0, backward=False):
    """Rough peak bytes, used only to skip what would not fit (the real peak is measured)."""
    io = 6 * B * H * n * D * dtype_bytes * (2 if backward else 1)
    if impl == "naive":
        return io + B * H * n * n * 4 * (4 if backward else 3)
    if impl == "dense":
        return io + B * H * n * n * 4 * 3
    if density < 1.0:
        # sparse: forward in chunks of <= 16 MiB; backward keeps the gathered key/value blocks (~ρ·n² rows·D)
        return io + 2 * 16 * 2**20 + (B * H * density * n * n * 2 * D * 4 / 128 if backward else 0)
    # sdpa, auto (delegates) and tiled: O(n·D) plus tiles and the log-sum-exp
    return io + B * H * n * (D + 3) * 4 + 3 * B * H * 512 * 512 * 4


def peak_bytes(spec: dict, timeout: float = 600) -> int | None:
    """Extra peak resident bytes of one attention call, measured in a fresh process.

    spec: {"impl": "sdpa"|"auto"|"tiled"|"naive"|"dense", "n", "dtype", "causal", "backward", "B", "H", "D",
    "pattern"} as in ``attnlab.bench.impls.build_call``. RuntimeError with the child's stderr if it fails.
    """
    return peak_in_fresh_process(spec, timeout=timeout)["peak_bytes"]


def run(config: CoreConfig, *, progress: Callable[[int, int, str], None] | None = None) -> Result:
    """Measure everything ``config`` asks for and write the report; returns the :class:`Result`.

    Times sdpa, auto, tiled and naive attention on query, key, value of shape [1, 8, n, 64] for n from
    256 to ``max_n`` (128 and 256 when ``quick``), float32 and bfloat16 (float32 only when quick), causal
    and not; then attnlab's sparse patterns (sliding window, BigBird, 10% block-sparse; quick skips
    BigBird) against SDPA's dense call, and forward + backward with a causal sliding window. Calls
    predicted to exceed the time or memory budget are skipped with the reason. With ``memory``, peak
    memory of forward + backward is measured in a fresh process per configuration. Each finished
    configuration is saved to ``<out>/results.json`` at once (so a killed run can resume); at the end
    writes results.json, time.png, memory.png and report.md to ``out``. ``progress(done, total, label)``
    is called before each configuration and once at the end. Raises ValueError for an invalid config
    and for a ``resume`` whose earlier results cannot be read or were taken with other settings.
    """
    config.validate()
    out = Path(config.out)
    res = Result(out_dir=str(out), env=environment())
    quick = config.quick
    res.settings = config.settings()
    done = _previous(out, res.settings, res.notes) if config.resume else {}
    ns = [128, 256] if quick else [n for n in (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
                                    if n <= config.max_n]
    dtypes = ["float32"] if quick else ["float32", "bfloat16"]
    reps = 2 if quick else 3
    budget_t, budget_m = (1.0, 2.0) if quick else (config.time_budget, config.mem_budget_gib)
    # a resumed run keeps the peaks its kept measurements were taken beside
    res.peak_gflops = dict(done.get("peak_gflops", {})) if done else {}
    for d in dtypes:
        if d not in res.peak_gflops:
            res.peak_gflops[d] = cpu.matmul_peak(getattr(torch, d), n=512 if quick else 2048, refresh=True)
    if "float32" not in res.peak_gflops:
        res.peak_gflops["float32"] = cpu.matmul_peak(torch.float32, n=512, refresh=True)

    def skip(reason, **cfg):
        res.skipped.append(dict(cfg, reason=reason))

    def reuse(key) -> Record | None:
        """A record the resumed run already measured (kept as measured, not re-timed)."""
        old = done.get(key)
        if old is not None:
            res.records.append(old)
        return old

    def measure(section, impls, n, dtype, causal, pattern=None, backward=False):
        spec0 = dict(n=n, dtype=dtype, causal=causal, pattern=PATTERNS.get(pattern), backward=backward)
        density = pattern_density(spec0["pattern"], n) if pattern else 1.0
        flops = _flops(n, causal, density) * (3.5 if backward else 1.0)
        sdpa_time = None
        mine: list[Record] = []
        inputs = None
        for impl in impls:
            old = reuse((section, impl, n, dtype, causal, pattern, backward))
            if old is not None:
                mine.append(old)
                sdpa_time = old.seconds if impl == "sdpa" else sdpa_time
                continue
            eff = 0.15 if impl == "naive" else 0.4 if impl == "tiled" else 0.6
            work = _flops(n, causal and impl != "naive", 1.0 if impl in ("sdpa", "naive") else density)
            # fused kernels upcast half types internally: only the naive path runs at the dtype's matmul peak
            peak = res.peak_gflops[dtype] if impl == "naive" else res.peak_gflops["float32"]
            pred_t = work * (3.5 if backward else 1) / (peak * 1e9 * eff)
            limit_t = budget_t * (4 if impl == "sdpa" else 1)  # the baseline gets more room, so ratios exist
            el = 2 if dtype == "bfloat16" else 4
            pred_m = _predict_bytes(impl, n, el, density=density, backward=backward) / 2**30
            cfg = dict(section=section, impl=impl, n=n, dtype=dtype, causal=causal, pattern=pattern)
            if pred_t > limit_t:
                skip(f"predicted {pred_t:.1f} s per call > time budget {limit_t} s", **cfg)
                continue
            if pred_m > budget_m:
                skip(f"predicted {pred_m:.1f} GiB > memory budget {budget_m} GiB", **cfg)
                continue
            f = build_call(dict(spec0, impl=impl))
            inputs = make_inputs(spec0) if inputs is None else inputs
            if backward:
                def call(f=f):
                    for t in inputs:
                        t.grad = None
                    f(*inputs).float().sum().backward()
            else:
                def call(f=f):
                    with torch.no_grad():
                        f(*inputs)
            secs = time_call(call, repeats=reps if pred_t < 2 else 1)
            rec = Record(section, impl, n, dtype, causal, pattern, backward, secs, density=density,
                         gflops=flops / secs / 1e9)
            if impl == "sdpa":
                sdpa_time = secs
            res.records.append(rec)
            mine.append(rec)
        for r in mine:
            if sdpa_time and r.seconds:
                r.ratio_vs_sdpa = sdpa_time / r.seconds
        _save(res, out)  # each finished configuration lands on disk: a killed run keeps it

    configs = []
    for dtype in dtypes:
        for causal in (False, True):
            for n in ns:
                configs.append(("dense", ["sdpa", "auto", "tiled", "naive"], n, dtype, causal, None, False))
    pats = ["sliding_window_256", "block_sparse_10pct"] if quick else list(PATTERNS)
    for pat in pats:
        for n in ns:
            causal = pat == "sliding_window_256"
            configs.append(("pattern", ["sdpa", "auto"], n, "float32", causal, pat, False))
    for n in ns:
        configs.append(("train", ["sdpa", "auto"], n, "float32", True, "sliding_window_256", True))

    mem_jobs = []
    if config.memory:
        mem_ns = [256] if quick else [n for n in (1024, 4096, 16384) if n <= config.max_n]
        sw_ns = [512] if quick else [n for n in (4096, 16384, 65536) if n <= config.max_n]
        mem_jobs = [("memory", impl, n, None, True) for n in mem_ns for impl in ("sdpa", "tiled", "naive")]
        mem_jobs += [("memory", "auto", n, "sliding_window_256", True) for n in sw_ns]
    total = len(configs) + len(mem_jobs)
    for i, c in enumerate(configs):
        if progress:
            progress(i, total, f"{c[0]} n={c[2]} {c[3]} causal={c[4]} {c[5] or ''}".strip())
        measure(*c)
    for i, (section, impl, n, pat, bwd) in enumerate(mem_jobs):
        if progress:
            progress(len(configs) + i, total, f"memory (fresh process) {impl} n={n} {pat or ''}".strip())
        dens = pattern_density(PATTERNS[pat], n) if pat else 1.0
        pred = _predict_bytes(impl, n, 4, density=dens, backward=bwd) / 2**30
        cfg = dict(section=section, impl=impl, n=n, dtype="float32", causal=True, pattern=pat)
        if pred > budget_m * 2:
            skip(f"predicted {pred:.1f} GiB > memory budget", **cfg)
        elif reuse((section, impl, n, "float32", True, pat, bwd)) is None:
            spec = dict(impl=impl, n=n, dtype="float32", causal=True, backward=bwd, pattern=PATTERNS.get(pat))
            res.records.append(Record(section, impl, n, "float32", True, pat, bwd, peak_bytes=peak_bytes(spec)))
            _save(res, out)

    res.complete = True
    _density_ratios(res)
    _exponents(res)
    res.write()
    if progress:
        progress(total, total, "done")
    return res


def _key(r: Record):
    return (r.section, r.impl, r.n, r.dtype, r.causal, r.pattern, r.backward)


def _save(res: Result, out: Path):
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "results.json", asdict(res))


def _previous(out: Path, settings: dict, notes: list[str]) -> dict:
    """Records of an earlier run in ``out`` with the same settings, by configuration."""
    path = out / "results.json"
    if not path.exists():
        notes.append(f"--resume: no {path}; measuring everything")
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--resume: cannot read {path} ({e}); delete it, or rerun without --resume and with "
                         f"--force to measure everything again") from None
    if not isinstance(data, dict):
        raise ValueError(f"--resume: {path} is not a bench core results file; delete it or pass --force")
    if data.get("settings") != settings:
        raise ValueError(f"--resume: {path} was measured with settings {data.get('settings')}, this run has "
                         f"{settings}; use another --out or the same settings")
    names = {f.name for f in fields(Record)}
    recs = [Record(**{k: v for k, v in r.items() if k in names}) for r in data.get("records", [])]
    notes.append(f"--resume: keeping {len(recs)} measurements from {path}")
    return {**{_key(r): r for r in recs}, "peak_gflops": data.get("peak_gflops", {})}


def _density_ratios(res: Result):
    dense = {r.n: r.seconds for r in res.records if r.section == "dense" and r.impl == "sdpa"
             and r.dtype == "float32" and not r.causal and r.seconds}
    for r in res.records:
        if r.section == "pattern" and r.impl != "sdpa" and r.seconds and r.n in dense:
            r.vs_density_dense = r.seconds / (r.density * dense[r.n])


def _exponents(res: Result):
    groups: dict[str, list] = {}
    for r in res.records:
        if r.seconds is not None and r.n >= 1024:
            groups.setdefault(f"time {r.section} {r.impl} {r.dtype} causal={r.causal} {r.pattern or ''}".strip(), []) \
                .append((r.n, r.seconds))
        if r.peak_bytes:
            groups.setdefault(f"memory {r.impl} {r.pattern or ''}".strip(), []).append((r.n, r.peak_bytes))
    res.exponents = {k: fit_exponent(*zip(*v)) for k, v in groups.items() if len(v) >= 2}


def _n_ticks(ax, ns) -> None:
    """One tick per measured n, labelled 256, 1k, 64k (the default log ticks overlap or vanish)."""
    from matplotlib.ticker import FixedLocator, NullLocator

    if not ns:
        return
    ax.xaxis.set_major_locator(FixedLocator(ns))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n) for n in ns], fontsize=8)


def _write(res: Result, out: Path):
    plt = pyplot()

    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "results.json", asdict(res))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    # one style per label across the three panels (sdpa looks the same everywhere)
    every = sorted({f"{r.impl} {r.pattern or ''}{' fwd+bwd' if r.backward else ''}" for r in res.records
                    if r.seconds is not None})
    style = dict(zip(every, line_styles(len(every))))
    for ax, (title, pick) in zip(axes, [
        ("fp32 forward, dense inputs", lambda r: r.section == "dense" and r.dtype == "float32" and not r.causal),
        ("fp32 forward, causal", lambda r: r.section == "dense" and r.dtype == "float32" and r.causal),
        ("patterns (forward) and training (fwd+bwd)", lambda r: r.section in ("pattern", "train")),
    ]):
        lines: dict[str, list] = {}
        for r in res.records:
            if r.seconds is not None and pick(r):
                lines.setdefault(f"{r.impl} {r.pattern or ''}{' fwd+bwd' if r.backward else ''}", []).append((r.n, r.seconds))
        for label, pts in sorted(lines.items()):
            x, y = zip(*sorted(pts))
            ax.loglog(x, y, label=label, **style[label])
        ax.set_title(title)
        ax.set_xlabel("sequence length n")
        ax.set_ylabel("seconds per call")
        _n_ticks(ax, sorted({p[0] for pts in lines.values() for p in pts}))
        ax.grid(True, which="both", alpha=0.3)
        if lines:
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    save_plot(fig, out / "time.png")
    mem = [r for r in res.records if r.peak_bytes]
    if mem:
        fig, ax = plt.subplots(figsize=(6, 4.5))
        lines = {}
        for r in mem:
            lines.setdefault(f"{r.impl} {r.pattern or ''} fwd+bwd", []).append((r.n, r.peak_bytes / 2**20))
        for (label, pts), st in zip(sorted(lines.items()), line_styles(len(lines))):
            x, y = zip(*sorted(pts))
            ax.loglog(x, y, label=label, **st)
        _n_ticks(ax, sorted({p[0] for pts in lines.values() for p in pts}))
        ax.set_xlabel("sequence length n")
        ax.set_ylabel("peak extra memory (MiB)")
        ax.set_title("peak memory, forward + backward (fresh process each)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        save_plot(fig, out / "memory.png")
    atomic_write_text(out / "report.md", _markdown(res))
    render_markdown_file(out / "report.md", "attnlab bench core")
    res.files = [str(out / f) for f in ("results.json", "time.png", "memory.png", "report.md") if (out / f).exists()]


def _markdown(res: Result) -> str:
    lines = ["# attnlab bench core", "", f"Machine: {res.env.get('cpu')} · {res.env.get('threads')} threads · "
             f"torch {res.env.get('torch')}", "", f"CPU: {cpu.summary(peaks=False)}", "",
             "Matrix-product peak measured in this run (best of repeated products): " +
             ", ".join(f"{k} {v:.1f} GFLOP/s" for k, v in res.peak_gflops.items()), "",
             "`time/(ρ·dense)`: a pattern's time over its density ρ times SDPA's dense (non-causal) time at the same n.",
             "", "![time](time.png)", ""]
    if any(r.peak_bytes for r in res.records):  # memory.png is drawn only then
        lines += ["![memory](memory.png)", ""]
    lines.append("")

    def num(x, spec):
        return "" if x is None else format(x, spec)

    rows = [[r.section, r.impl, r.pattern or "", r.dtype, r.causal, r.n, r.backward,
             num(None if r.seconds is None else r.seconds * 1e3, ".2f"), num(r.gflops, ".1f"),
             num(r.ratio_vs_sdpa, ".2f"), num(r.vs_density_dense, ".2f"),
             num(None if r.peak_bytes is None else r.peak_bytes / 2**20, ".1f")] for r in res.records]
    lines.append(markdown_table(["section", "impl", "pattern", "dtype", "causal", "n", "fwd+bwd", "ms", "GFLOP/s",
                                 "× SDPA speed", "time/(ρ·dense)", "peak MiB"], rows))
    lines += ["", "## Fitted exponents (log-log slope in n, n >= 1024)", ""]
    lines += [f"- {k}: {v:.2f}" for k, v in sorted(res.exponents.items()) if v is not None]
    lines += ["", "## Skipped", ""] + [f"- {s['impl']} n={s['n']} {s.get('pattern') or ''} {s['dtype']}: {s['reason']}"
                                       for s in res.skipped]
    return "\n".join(lines) + "\n"
