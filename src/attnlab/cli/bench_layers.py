"""attnlab bench layers: the CLI face of attnlab.bench.layers (argv in, progress bar, tables or JSON out)."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from attnlab.bench.all_report import format_seconds
from attnlab.bench.layers import LAYERS, LayersConfig, LayersResult, run as run_layers
from .options import nonneg_int, positive_float, positive_int, thread_count

from .bench_common import run_suite
from .common import add_force
from .common import console as new_console


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return sorted(set(vals))


def build_parser(p: argparse.ArgumentParser) -> None:
    """Add ``bench layers``' options (--quick, --out, --ns, --ds, --layers, sizes, --threads, --no-memory,
    --json) to the argparse parser ``p``."""
    p.add_argument("--quick", action="store_true", help="toy sizes, runs in seconds (what the tests run)")
    p.add_argument("--out", default=LayersConfig.out, help="folder for layers.json, layers.md, PNGs")
    add_force(p)
    p.add_argument("--ns", type=_int_list, help="sequence lengths, e.g. 32,128,512")
    p.add_argument("--ds", type=_int_list, help="model widths, e.g. 32,128,512")
    p.add_argument("--layers", type=lambda s: [v.strip() for v in s.split(",") if v.strip()],
                   help=f"subset of {','.join(LAYERS)}")
    p.add_argument("--batch", type=positive_int, help="batch size")
    p.add_argument("--window", type=nonneg_int, help="attention window w (keys on each side; r = 2w+1)")
    p.add_argument("--kernel", type=positive_int, help="convolution kernel size k (odd)")
    p.add_argument("--min-time", type=positive_float, help="seconds of repetitions per measurement")
    p.add_argument("--threads", type=thread_count, help="torch intra-op threads for the run (default: torch's)")
    p.add_argument("--no-memory", action="store_true", help="skip the memory measurements")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of tables")


def config_from_args(args) -> LayersConfig:
    """The :class:`LayersConfig` of parsed options (checked; --out is not checked here)."""
    command = "attnlab bench layers" + (" --quick" if args.quick else "") + (
        f" --threads {args.threads}" if args.threads else "")
    cfg = LayersConfig(out=args.out, quick=args.quick, ns=args.ns, ds=args.ds, layers=args.layers, batch=args.batch,
                       window=args.window, kernel=args.kernel, min_time=args.min_time, threads=args.threads,
                       memory=not args.no_memory, command=command)
    cfg.resolved()
    return cfg


def run(args) -> LayersResult:
    """Run ``bench layers`` for parsed options with a progress bar; print the tables (or the JSON)."""
    show = (lambda res: print(json.dumps(asdict(res), default=str))) if args.json else render
    return run_suite(args, config_from_args(args), run_layers, show, title="bench layers")


def render(res: LayersResult) -> None:
    """Print forward time per layer and n at the largest d (ratio to GRU) and the crossover table."""
    from rich.table import Table

    cfg, rows = res.config, res.rows
    console = new_console(file=sys.stdout)
    table = Table(title="per-layer forward time (ratio to GRU at the same n, d)")
    for col in ("layer", *(f"n={n}" for n in cfg["ns"])):
        table.add_column(col, justify="right" if col != "layer" else "left")
    d = cfg["ds"][-1]
    gru = {r["n"]: r["forward_s"] for r in rows if r["layer"] == "gru" and r["d"] == d}
    for name in cfg["layers"]:
        cells = []
        for n in cfg["ns"]:
            r = next(r for r in rows if r["layer"] == name and r["n"] == n and r["d"] == d)
            cells.append(format_seconds(r["forward_s"]) + (f" ({r['forward_s'] / gru[n]:.2g}x)" if n in gru else ""))
        table.add_row(name, *cells)
    table.caption = f"d = {d}, batch {cfg['batch']}"
    console.print(table)
    ct = Table(title="crossover: self-attention cheaper than recurrence while n < n*")
    for col in ("attention", "recurrent", "timing", "d", "n*", "n*/d", "FLOP-model n*"):
        ct.add_column(col)
    for c in res.crossover:
        ct.add_row(c["attention"], c["recurrent"], c["timing"], str(c["d"]),
                   "–" if c["n_star"] is None else f"{c['n_star']:.0f}",
                   "–" if c["n_star_over_d"] is None else f"{c['n_star_over_d']:.2g}",
                   "–" if c["flop_model_n_star"] is None else f"{c['flop_model_n_star']:.0f}")
    console.print(ct)
    console.print(f"report: {res.files['markdown']}  json: {res.files['json']}  plots: "
                  f"{res.files['time_png']}, {res.files['memory_png']}")
