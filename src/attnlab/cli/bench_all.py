"""attnlab bench all: the CLI face of attnlab.bench.mechanisms (argv in, progress bar, summary out)."""
from __future__ import annotations

from attnlab.bench.mechanisms import AllConfig, AllResult, run as run_all
from attnlab.harness import fmt
from .options import nonneg_int, positive_float, positive_int, positive_int_list, thread_count

from .bench_common import run_suite
from .common import console as new_console


def _names(text: str) -> tuple[str, ...]:
    return tuple(m.strip() for m in text.split(",") if m.strip())


def _lengths(text: str) -> tuple[int, ...]:
    return tuple(sorted(positive_int_list(text)))


def build_parser(p) -> None:
    """Add ``bench all``'s options (--out, --quick, --mechanisms, --lengths, shapes, repeats, budgets,
    --isolation, --threads, the LRA and production tables, --resume, --force, --no-progress) to the
    argparse parser ``p``."""
    p.add_argument("--out", default=None, help=f"output folder (default {AllConfig.out})")
    p.add_argument("--quick", action="store_true", help="small grid, one worker process, seconds")
    p.add_argument("--mechanisms", type=_names, default=None,
                   help="comma-separated (default: torch_sdpa, naive and every registered mechanism)")
    p.add_argument("--lengths", type=_lengths, default=None, help="comma-separated sequence lengths (default 128..65536)")
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
    p.add_argument("--threads", type=thread_count, default=None, help="torch threads in the workers (default: all cores)")
    p.add_argument("--no-lra", action="store_true", help="skip the LRA-style training-efficiency table")
    p.add_argument("--lra-lengths", type=_lengths, default=None,
                   help="lengths of the LRA-style table (default 1024,2048,3072,4096)")
    p.add_argument("--no-production", action="store_true", help="skip the tutorial's production table")
    p.add_argument("--production-lengths", type=_lengths, default=None,
                   help="lengths of the production table (default the tutorial's 128,512,2048,4096; quick 128,512)")
    p.add_argument("--resume", action="store_true",
                   help="reuse the configurations a killed or finished run in --out already measured with the same "
                        "settings (results.partial.json, else results.json); measure only the rest")
    p.add_argument("--force", action="store_true",
                   help="replace the earlier run an --out folder holds (without it, such a folder is refused)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def config_from_args(args) -> AllConfig:
    """The :class:`AllConfig` of parsed options, checked (an unknown mechanism fails here, before --out is
    looked at: --force removes an earlier run only once every other option is known good)."""
    cfg = AllConfig(out=args.out or AllConfig.out, quick=args.quick, mechanisms=args.mechanisms, lengths=args.lengths,
                    batch=args.batch, heads=args.heads, head_dim=args.head_dim, repeats=args.repeats,
                    warmup=args.warmup, time_budget=args.time_budget, memory_budget_gib=args.memory_budget,
                    isolation=args.isolation, threads=args.threads, lra=not args.no_lra, lra_lengths=args.lra_lengths,
                    production=not args.no_production, production_lengths=args.production_lengths,
                    resume=args.resume)
    cfg.settings()
    return cfg


def run(args) -> AllResult:
    """Run ``bench all`` for parsed options with a progress bar; print the exponents per mechanism."""
    cfg = config_from_args(args)
    args.out = cfg.out
    return run_suite(args, cfg, run_all, render, title="bench all", resumable=True, progress=not args.no_progress)


def render(res: AllResult) -> None:
    """Print where the report is, the matrix-product peak, and each mechanism's fitted exponents."""
    from rich.markup import escape

    d = res.data
    lines = [escape(n) for n in res.notes]
    lines.append(f"[bold]bench all[/bold] -> {escape(res.out_dir)}/report.md  (matmul peak {fmt(d['matmul_gflops'])} "
                 f"GFLOP/s, {d['isolation']} isolation, {res.wall_s:.0f} s; measured {d['measured_this_session']}, "
                 f"reused {d['reused']})")
    if res.interrupted:
        lines.append(f"[bold red]{escape(res.interrupted)}[/bold red]: partial report written; `--resume` with the "
                     "same options continues where this stopped")
    for m in d["mechanisms"]:
        f = d["fits"].get(m, {})
        stop = d["stopped"].get(m)
        lines.append(f"  {escape(m):<16} time ∝ n^{fmt(f.get('time'))}, memory ∝ n^{fmt(f.get('memory'))}"
                     + (f"  [{escape(stop)}]" if stop else ""))
    new_console().print("\n".join(lines))
