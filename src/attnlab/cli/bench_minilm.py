"""attnlab bench minilm: the CLI face of attnlab.bench.minilm (argv in, progress bar, table out)."""
from __future__ import annotations

from attnlab.bench.minilm import MiniLMBench, MiniLMConfig, run as run_minilm
from .options import positive_int, thread_count

from .bench_common import run_suite
from .common import add_force
from .common import console as new_console


def build_parser(p) -> None:
    """Add ``bench minilm``'s options (--quick, --out, --batch, --tokens, --repeats, --mechanisms,
    --threads) to the argparse parser ``p``."""
    p.add_argument("--quick", action="store_true", help="batch 4 x 32 tokens, 2 repeats (seconds)")
    p.add_argument("--out", default=MiniLMConfig.out, help=f"output folder (default {MiniLMConfig.out})")
    add_force(p)
    p.add_argument("--batch", type=positive_int, default=None, help="sentences per batch (default 32; quick 4)")
    p.add_argument("--tokens", type=positive_int, default=None,
                   help="tokens per sentence incl. [CLS]/[SEP] (default 128; quick 32)")
    p.add_argument("--repeats", type=positive_int, default=None,
                   help="timed repeats per implementation (default 5; quick 2)")
    p.add_argument("--mechanisms", default="auto,tiled", help="attnlab mechanisms to time (default auto,tiled)")
    p.add_argument("--threads", type=thread_count, default=None, help="torch threads (default: torch's current setting)")


def config_from_args(args) -> MiniLMConfig:
    """The :class:`MiniLMConfig` of parsed options (checked; --out is not checked here)."""
    cfg = MiniLMConfig(out=args.out, quick=args.quick, batch=args.batch, tokens=args.tokens, repeats=args.repeats,
                       mechanisms=tuple(m.strip() for m in args.mechanisms.split(",") if m.strip()),
                       threads=args.threads)
    cfg.resolved()
    return cfg


def run(args) -> MiniLMBench:
    """Run ``bench minilm`` for parsed options with a progress bar; print the throughput table."""
    return run_suite(args, config_from_args(args), run_minilm, render, title="minilm encode")


def render(res: MiniLMBench) -> None:
    """Print one row per implementation: median seconds, sentences/s, ratios, largest difference."""
    from rich.markup import escape
    from rich.table import Table

    t = Table(title=f"MiniLM encode, batch {res.batch} x {res.tokens} tokens, {res.threads} threads "
                    "(ratios: same run, >1 = faster)")
    for col in ("impl", "median s", "sentences/s", "vs sdpa", "vs eager", "max |diff| vs sdpa"):
        t.add_column(col, justify="right" if col != "impl" else "left", no_wrap=True)

    def fmt(x, f):
        return "—" if x is None else format(x, f)

    for r in res.rows:
        t.add_row(escape(r["impl"]), f"{r['seconds']:.4f}", f"{r['sentences_per_s']:.1f}", fmt(r["ratio_vs_sdpa"], ".2f"),
                  fmt(r["ratio_vs_eager"], ".2f"), fmt(r["max_abs_diff_vs_transformers_sdpa"], ".1e"))
    console = new_console()
    console.print(t)
    for s in res.skipped:
        console.print(f"[yellow]skipped {escape(s['impl'])}: {escape(s['reason'])}")
    console.print(f"wrote {res.files[0] if res.files else res.out_dir}")
