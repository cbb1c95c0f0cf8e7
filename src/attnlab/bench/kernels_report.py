"""The headline ratios of ``bench kernels`` (each from two medians of one case and load) and its report files."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from attnlab import cpu

from ..harness import markdown_table, pyplot, save_plot
from ..report import atomic_write_json, atomic_write_text
from .fit import fit_exponent
from .kernels_cases import TARGET_NS, KernelsConfig, Measurement, Ratio

__all__ = ["KernelsResult", "compute_ratios", "save_partial", "write_report"]


@dataclass
class KernelsResult:
    """Everything one run measured: the config (as a dict), the CPU and its measured matmul peaks, each
    case's measurements, fresh-process peak memory, the headline ratios, notes and the files written."""

    config: dict
    out_dir: str
    cpu: dict = field(default_factory=dict)
    cpu_summary: str = ""
    peaks_gflops: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    measurements: list[Measurement] = field(default_factory=list)
    memory: list[dict] = field(default_factory=list)
    ratios: list[Ratio] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    seconds: float = 0.0
    exit_code: int = 0

    def write(self) -> list[str]:
        """Write results.json, report.md and the plots into ``out_dir``, atomically (see
        :func:`write_report`); returns the files."""
        return write_report(self, Path(self.out_dir))


# -- ratios -----------------------------------------------------------------------------------------------
def compute_ratios(res: KernelsResult, cfg: KernelsConfig) -> list[Ratio]:
    """Headline ratios, each from two medians of one case under one load."""
    by = {(m.case, m.impl, m.load): m for m in res.measurements}
    out: list[Ratio] = []
    attn = [m for m in res.measurements if m.impl.startswith("attnlab:") and m.seconds]
    bf16_target = "≥ 1.5" if cpu.INFO.has("avx512_bf16") or cpu.INFO.has("amx_bf16") else "≥ 1.0 (no bf16 matmul ISA)"
    for m in attn:
        base_name = m.impl.split(" [")[0]
        if m.section in ("dense", "bf16", "window"):
            sd = by.get((m.case, "torch:sdpa", m.load))
            if sd and sd.seconds:
                target = {"dense": "≥ 0.95", "bf16": bf16_target, "window": "≥ 15"}[m.section] \
                    if m.n in TARGET_NS[m.section] else ""
                what = "SDPA is_causal" if m.section == "window" else "SDPA"
                out.append(Ratio(f"{m.case}: speed vs {what}", base_name, m.load, sd.seconds / m.seconds,
                                 f"torch:sdpa s / {base_name} s", target,
                                 {"torch:sdpa": sd.seconds, base_name: m.seconds}))
            fx = by.get((m.case, "torch:flex", m.load))
            if m.section == "window" and fx and fx.seconds:
                out.append(Ratio(f"{m.case}: speed vs FlexAttention (compiled)", base_name, m.load,
                                 fx.seconds / m.seconds, f"torch:flex s / {base_name} s",
                                 "≥ 1.3" if not m.backward and m.n in TARGET_NS["window"] else "",
                                 {"torch:flex": fx.seconds, base_name: m.seconds}))
        elif m.section == "sparse":
            sd = by.get((m.case, "torch:sdpa", m.load))
            if sd and sd.seconds:
                out.append(Ratio(f"{m.case} {m.pattern}: time/(ρ·dense)", base_name, m.load,
                                 m.seconds / (m.density * sd.seconds), f"{base_name} s / (ρ · torch:sdpa dense s)",
                                 "≤ 1.3" if m.n in TARGET_NS["sparse"] else "",
                                 {"torch:sdpa": sd.seconds, base_name: m.seconds, "rho": m.density}))
    for m in res.measurements:  # FlexAttention on the sparse patterns, for the table beside ours
        if m.section == "sparse" and m.impl.startswith("torch:flex") and m.seconds:
            sd = by.get((m.case, "torch:sdpa", m.load))
            if sd and sd.seconds:
                out.append(Ratio(f"{m.case} {m.pattern}: time/(ρ·dense)", "torch:flex", m.load,
                                 m.seconds / (m.density * sd.seconds), "torch:flex s / (ρ · torch:sdpa dense s)", "",
                                 {"torch:sdpa": sd.seconds, "torch:flex": m.seconds, "rho": m.density}))
    # time exponent of the causal window, forward, per implementation (quiet)
    impls = {m.impl for m in res.measurements if m.section == "window" and not m.backward}
    for impl in sorted(impls):
        pts = sorted((m.n, m.seconds) for m in res.measurements if m.section == "window" and not m.backward
                     and m.impl == impl and m.load == "quiet" and m.seconds)
        if len(pts) >= 2:
            e = fit_exponent(*zip(*pts))
            out.append(Ratio(f"window fwd time exponent n={pts[0][0]}..{pts[-1][0]}", impl, "quiet", e,
                             "least-squares slope of log s against log n", "≤ 1.05" if impl.startswith("attnlab") else "",
                             {str(n): s for n, s in pts}))
    # memory vs SDPA
    mem = {r["impl"]: r["peak_bytes"] for r in res.memory if r.get("peak_bytes")}
    for impl, b in mem.items():
        if impl != "torch:sdpa" and mem.get("torch:sdpa"):
            out.append(Ratio(f"dense fp32 fwd+bwd n={cfg.memory_n}: peak memory vs SDPA", impl, "quiet",
                             b / mem["torch:sdpa"], f"{impl} peak bytes / torch:sdpa peak bytes",
                             "≤ 1.2" if cfg.memory_n in TARGET_NS["memory"] else "",
                             {"torch:sdpa": mem["torch:sdpa"], impl: b}))
    # how much each ratio drops under load: busy / quiet of the same ratio
    quiet = {(r.name, r.impl): r for r in out if r.load == "quiet" and r.value}
    for r in [r for r in out if r.load == "busy" and r.value]:
        q = quiet.get((r.name, r.impl))
        if q:
            lower_is_better = "time/(ρ·dense)" in r.name
            kept = (q.value / r.value) if lower_is_better else (r.value / q.value)
            out.append(Ratio(f"{r.name}: kept under load", r.impl, "busy/quiet", kept,
                             "busy ratio / quiet ratio (inverted for time/(ρ·dense)); 1 = no drop", "≥ 0.8",
                             {"quiet": q.value, "busy": r.value}))
    return out


# -- files ------------------------------------------------------------------------------------------------
def save_partial(res: KernelsResult, out: Path) -> None:
    """results.json of what is measured so far: each finished case lands on disk at once, so a killed run
    keeps what it measured."""
    atomic_write_json(out / "results.json", asdict(res))


def write_report(res: KernelsResult, out: Path) -> list[str]:
    """results.json, report.md and the plots (window.png, sparse.png, ratios.png) in ``out``; returns the
    files written (also kept in ``res.files``)."""
    import matplotlib.ticker

    plt = pyplot()

    files = [out / "results.json", out / "report.md"]
    impls = sorted({m.impl.split(" [")[0] for m in res.measurements})
    colours = {name: plt.get_cmap("tab10")(i % 10) for i, name in enumerate(impls)}

    # window: time vs n, log-log, one line per implementation and load
    win = [m for m in res.measurements if m.section == "window" and not m.backward and m.seconds]
    if win:
        fig, ax = plt.subplots(figsize=(7.5, 5))
        for (impl, load) in sorted({(m.impl, m.load) for m in win}):
            pts = sorted((m.n, m.seconds) for m in win if m.impl == impl and m.load == load)
            x, y = zip(*pts)
            ax.loglog(x, y, marker="o" if load == "quiet" else "x", linestyle="-" if load == "quiet" else "--",
                      color=colours[impl], label=f"{impl} ({load})")
        ns = sorted({m.n for m in win})
        ax.set_xticks(ns)
        ax.set_xticklabels([str(n) for n in ns], rotation=30 if len(ns) > 4 else 0)
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # only the measured n are labelled
        ax.set_xlabel("sequence length n")
        ax.set_ylabel("seconds per forward call (median)")
        ax.set_title(f"causal sliding window {res.config['window']}: forward time")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        save_plot(fig, out / "window.png")
        files.append(out / "window.png")

    # sparse: time/(ρ·dense) per pattern, grouped bars (patterns on x, implementations as bars)
    sp = [r for r in res.ratios if "time/(ρ·dense)" in r.name and r.load == "quiet" and r.value]
    if sp:
        names = sorted({r.name for r in sp})
        who = sorted({r.impl for r in sp})
        fig, ax = plt.subplots(figsize=(max(7.0, 1.3 * len(names) * max(1, len(who)) / 2), 5))
        w = 0.8 / len(who)
        for k, impl in enumerate(who):
            vals = [next((r.value for r in sp if r.name == nm and r.impl == impl), float("nan")) for nm in names]
            ax.bar([i + k * w for i in range(len(names))], vals, width=w, color=colours.get(impl), label=impl)
        ax.axhline(1.3, color="black", linestyle=":", linewidth=1, label="target 1.3")
        ax.set_xticks([i + 0.4 - w / 2 for i in range(len(names))])
        ax.set_xticklabels([nm.replace(": time/(ρ·dense)", "").replace(" n=", "\nn=") for nm in names],
                           rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("time / (ρ · dense SDPA time)")
        ax.set_title("block-sparse patterns (lower is better)")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        save_plot(fig, out / "sparse.png")
        files.append(out / "sparse.png")

    # headline speed ratios, quiet vs busy, horizontal bars (one row per ratio x implementation)
    hd = [r for r in res.ratios if r.value and r.load in ("quiet", "busy") and "speed vs" in r.name]
    if hd:
        rows = sorted({(r.name, r.impl) for r in hd})
        fig, ax = plt.subplots(figsize=(9, max(3.0, 0.32 * len(rows) + 1.2)))
        for k, load in enumerate(("quiet", "busy")):
            vals = [next((r.value for r in hd if (r.name, r.impl) == row and r.load == load), 0.0) for row in rows]
            ax.barh([i + 0.4 * k for i in range(len(rows))], vals, height=0.4,
                    color=("tab:blue", "tab:orange")[k], label=load)
        ax.set_yticks([i + 0.2 for i in range(len(rows))])
        ax.set_yticklabels([f"{impl} · {name}" for name, impl in rows], fontsize=7)
        ax.set_xscale("log")
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_xlabel("speed ratio (baseline time / implementation time; > 1 = faster)")
        ax.set_title("headline speed ratios, quiet vs a busy CPU")
        ax.legend(fontsize=8)
        ax.invert_yaxis()
        save_plot(fig, out / "ratios.png")
        files.append(out / "ratios.png")
    res.files = [str(f) for f in files]
    atomic_write_text(out / "report.md", _markdown(res))
    atomic_write_json(out / "results.json", asdict(res))
    return res.files


def _fmt(x, nd=2):
    return "" if x is None else f"{x:.{nd}f}"


def _markdown(res: KernelsResult) -> str:
    c = res.config
    rounds = (f"{c['rounds']} interleaved rounds per case" if c["min_rounds"] >= c["rounds"] else
              f"{c['min_rounds']}–{c['rounds']} interleaved rounds per case (fewer for slow cases)")
    lines = ["# attnlab bench kernels", "",
             f"CPU: {res.cpu_summary}", "",
             "Measured matrix-product peak (best of repeats, this run): " +
             ", ".join(f"{k} {v:.1f} GFLOP/s" for k, v in res.peaks_gflops.items()), "",
             f"torch {res.env.get('torch')} · {res.env.get('threads')} threads · B={c['B']}, H={c['H']}, D={c['D']} · "
             f"{rounds}, median of per-call means (short calls repeated to fill {c['min_sample_s']} s) · "
             f"run took {res.seconds:.0f} s", "",
             "Busy = the same case while another process loops 1024³ matrix products "
             f"({c['contention_threads']} thread{'s' if c['contention_threads'] != 1 else ''}).", ""]
    lines += ["## Headline ratios", "",
              "Quiet and busy side by side; *kept* = busy ÷ quiet (inverted for time/(ρ·dense)), 1 = no drop. "
              "Every value divides two medians of the same case and load (results.json lists them).", "",
              ""]
    by: dict = {}
    for r in res.ratios:
        if r.load == "busy/quiet":
            by.setdefault((r.name.removesuffix(": kept under load"), r.impl), {})["kept"] = r
        else:
            by.setdefault((r.name, r.impl), {})[r.load] = r
    rows = []
    for (name, impl), d in by.items():
        first = d.get("quiet") or d.get("busy")
        if first is not None:
            rows.append([name, impl, *(_fmt(d[k].value) if k in d else "" for k in ("quiet", "busy", "kept")),
                         first.target, first.definition])
    lines.append(markdown_table(["ratio", "implementation", "quiet", "busy", "kept", "target", "computed as"], rows))
    plots = [Path(f).name for f in res.files if str(f).endswith(".png")]
    if plots:  # shown by the report (and the docs site) beside the tables, before the long measurement table
        lines += ["", "## Plots", ""] + [x for name in plots for x in (f"![{Path(name).stem}]({name})", "")]
    lines += ["", "## Measurements (median seconds)", ""]
    rows = [[m.case, m.impl, m.load, _fmt(m.density, 3) if m.density < 1 else "",
             _fmt(m.seconds * 1e3 if m.seconds else None), f"{len(m.times)} × {m.calls_per_sample}" if m.times else "",
             _fmt(m.compile_s, 1), _fmt(m.mask_s, 2), m.skipped or ""] for m in res.measurements]
    lines.append(markdown_table(["case", "implementation", "load", "ρ", "median ms", "rounds × calls", "Flex compile s",
                                 "Flex mask s", "skipped because"], rows))
    if res.memory:
        lines += ["", "## Peak memory, forward+backward (fresh process each)", ""]
        rows = [[r["case"], r["impl"], _fmt(r["peak_bytes"] / 2**20 if r["peak_bytes"] else None, 1), r["skipped"] or ""]
                for r in res.memory]
        lines.append(markdown_table(["case", "implementation", "peak MiB", "skipped because"], rows))
    if res.notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in res.notes]
    return "\n".join(lines) + "\n"
