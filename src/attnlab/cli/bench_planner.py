"""attnlab bench planner: the CLI face of attnlab.bench.planner (argv in, progress line, table out)."""
from __future__ import annotations

from attnlab.bench.planner import KINDS, METHODS, TOLERANCE, PlannerConfig, PlannerResult
from attnlab.bench.planner import run as run_planner

from .options import names, positive_float, positive_int, thread_count

from .bench_common import config_of, run_suite
from .common import add_force
from .common import console as new_console


def build_parser(p) -> None:
    """Add ``bench planner``'s options (--quick, --out, --force, --resume, --kinds, --dtypes, --max-n, --rounds,
    --min-sample-s, --budget-s, --threads) to the argparse parser ``p``; each defaults to PlannerConfig's."""
    d = PlannerConfig()
    p.add_argument("--quick", action="store_true", help="tiny sizes, one configuration per kind (seconds)")
    p.add_argument("--out", default=d.out, help=f"output folder (default {d.out})")
    add_force(p)
    p.add_argument("--resume", action="store_true",
                   help="keep the configurations a killed run with the same settings left in --out, measure the rest")
    p.add_argument("--kinds", type=names, default=d.kinds, help=f"comma-separated of {', '.join(KINDS)} (default all)")
    p.add_argument("--dtypes", type=names, default=d.dtypes, help="comma-separated (default float32,bfloat16)")
    p.add_argument("--max-n", type=positive_int, default=d.max_n, help=f"largest sequence length (default {d.max_n})")
    p.add_argument("--rounds", type=positive_int, default=d.rounds, help=f"interleaved rounds (median; default {d.rounds})")
    p.add_argument("--min-sample-s", type=positive_float, default=d.min_sample_s,
                   help=f"a sample repeats a short call to last this long (default {d.min_sample_s})")
    p.add_argument("--budget-s", type=positive_float, default=d.budget_s,
                   help=f"seconds one configuration's rounds may take (default {d.budget_s:g})")
    p.add_argument("--threads", type=thread_count, default=None, help="torch threads (default: torch's)")


def config_from_args(args) -> PlannerConfig:
    """The :class:`PlannerConfig` of parsed options (checked; --out is not checked here)."""
    cfg = config_of(args, PlannerConfig)
    cfg.validate()
    return cfg


def run(args) -> PlannerResult:
    """Run ``bench planner`` for parsed options with a progress line; print the table and the summary."""
    return run_suite(args, config_from_args(args), run_planner, render, title="bench planner", resumable=True)


def render(res: PlannerResult) -> None:
    """One row per configuration: each kernel's ms (or "refused"), the fastest, auto's pick, auto / fastest (auto /
    pick paired × pick / fastest) and auto / pick paired."""
    from rich.table import Table

    t = Table(title="bench planner: auto against the fastest kernel (ms, medians of interleaved rounds)")
    for col in ("config", *METHODS, "auto", "fastest", "auto's pick", "auto/fastest", "auto/pick"):
        t.add_column(col, justify="left" if col in ("config", "fastest", "auto's pick") else "right")
    for r in res.rows:
        ms = [("refused" if m in r["refused"] else "skipped" if m in r.get("skipped", {}) else f"{r['ms'][m]:.3g}")
              for m in METHODS]
        ratio = f"{r['ratio']:.2f}" if r["ratio"] <= TOLERANCE else f"[yellow]{r['ratio']:.2f}[/yellow]"
        t.add_row(r["config"], *ms, f"{r['ms']['auto']:.3g}", r["fastest"],
                  r["auto_pick"] + (" (decode)" if r["decode_path"] else ""), ratio,
                  "" if r.get("auto_over_pick") is None else f"{r['auto_over_pick']:.3f}")
    console = new_console()
    console.print(t)
    s = res.summary
    console.print(f"auto within {TOLERANCE - 1:.0%} of the fastest in {s['within_5pct']:.1%} of {s['configs']} "
                  "configurations (auto / pick paired x pick / fastest; by its pick's time "
                  f"{s['pick_within_5pct']:.1%}, "
                  f"by auto's separate median {s['raw_within_5pct']:.1%}); worst {s['worst_ratio']:.2f} "
                  f"({s['worst_config']})", markup=False, highlight=False)
    if s.get("median_auto_over_pick") is not None:
        console.print(f"auto / its pick, paired in each round: median {s['median_auto_over_pick']:.3f}, worst "
                      f"{s['worst_auto_over_pick']:.3f} ({s['paired_configs']} configurations)", markup=False,
                      highlight=False)
    for n in res.notes:
        console.print(n, markup=False, highlight=False)
    console.print(f"wrote {', '.join(res.files)}", markup=False, highlight=False)
