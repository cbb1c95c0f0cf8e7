"""attnlab bench core: the CLI face of attnlab.bench.core (argv in, progress bar, table out)."""
from __future__ import annotations

from attnlab.bench.core import CoreConfig, Result, run as run_core
from .options import positive_float, positive_int

from .bench_common import run_suite
from .common import console as new_console


def build_parser(p) -> None:
    """Add ``bench core``'s options (--quick, --out, --max-n, budgets, --no-memory, --resume, --force) to
    the argparse parser ``p``; each defaults to :class:`CoreConfig`'s."""
    d = CoreConfig()
    p.add_argument("--quick", action="store_true", help="a small grid that finishes in seconds")
    p.add_argument("--out", default=d.out, help=f"output folder (default {d.out})")
    p.add_argument("--max-n", type=positive_int, default=d.max_n,
                   help=f"largest sequence length, at least 256 (default {d.max_n}; quick: 128 and 256)")
    p.add_argument("--time-budget", type=positive_float, default=d.time_budget,
                   help="skip calls predicted to exceed this (s)")
    p.add_argument("--mem-budget-gib", type=positive_float, default=d.mem_budget_gib,
                   help="skip configs predicted above this")
    p.add_argument("--no-memory", action="store_true", help="skip the fresh-process memory measurements")
    p.add_argument("--resume", action="store_true",
                   help="keep the measurements a killed run with the same settings left in --out, measure the rest")
    p.add_argument("--force", action="store_true",
                   help="replace the earlier run an --out folder holds (without it, such a folder is refused)")


def config_from_args(args) -> CoreConfig:
    """The :class:`CoreConfig` of parsed options (validated; --out is not checked here)."""
    cfg = CoreConfig(out=args.out, quick=args.quick, max_n=args.max_n, time_budget=args.time_budget,
                     mem_budget_gib=args.mem_budget_gib, memory=not args.no_memory, resume=args.resume)
    cfg.validate()
    return cfg


def run(args) -> Result:
    """Run ``bench core`` for parsed options with a progress bar; print the table of every measurement."""
    return run_suite(args, config_from_args(args), run_core, render, title="bench core", resumable=True)


def render(res: Result) -> None:
    """Print a run's measurements as a table (ratios are SDPA's time over each one's, same run)."""
    from rich.table import Table

    console = new_console()
    for note in res.notes:
        console.print(note, markup=False)
    t = Table(title="attnlab bench core — ratios are SDPA time / impl time, same run")
    for c in ("section", "impl", "pattern", "dtype", "causal", "n", "ms", "GFLOP/s", "× SDPA", "t/(ρ·dense)", "peak MiB"):
        t.add_column(c, justify="left" if c in ("section", "impl", "pattern", "dtype", "causal") else "right")
    for r in res.records:
        t.add_row(r.section + (" (bwd)" if r.backward else ""), r.impl, r.pattern or "", r.dtype, str(r.causal), str(r.n),
                  "" if r.seconds is None else f"{r.seconds * 1e3:.1f}",
                  "" if r.gflops is None else f"{r.gflops:.1f}",
                  "" if r.ratio_vs_sdpa is None else f"{r.ratio_vs_sdpa:.2f}",
                  "" if r.vs_density_dense is None else f"{r.vs_density_dense:.2f}",
                  "" if r.peak_bytes is None else f"{r.peak_bytes / 2**20:.1f}")
    console.print(t)
    console.print("matrix-product peak: " + ", ".join(f"{k} {v:.1f} GFLOP/s" for k, v in res.peak_gflops.items()))
    if res.skipped:
        console.print(f"[yellow]skipped {len(res.skipped)} configurations (see report.md for reasons)[/yellow]")
    console.print(f"wrote {res.out_dir}/results.json, time.png, report.md")
