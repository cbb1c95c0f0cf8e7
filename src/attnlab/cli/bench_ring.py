"""attnlab bench ring: the CLI face of attnlab.bench.ring (argv in, progress line, per-rank table out)."""
from __future__ import annotations

from attnlab.bench.ring import TARGET_N, TARGET_PROCS, RingBenchResult, RingConfig, run as run_ring
from .options import positive_float, positive_int, thread_count

from .bench_common import run_suite
from .common import add_force
from .common import console as new_console


def build_parser(p) -> None:
    """Add ``bench ring``'s options (--procs, --quick, sizes, --layouts, --no-causal, --backward,
    --block-size, --threads, --timeout, --out) to the argparse parser ``p``."""
    p.add_argument("--procs", type=positive_int, default=4, help="ranks in the ring (default 4)")
    p.add_argument("--quick", action="store_true", help="toy size: finishes in seconds")
    p.add_argument("--seq-len", type=positive_int, default=None, help="sequence length n (default 32768; quick 512)")
    p.add_argument("--batch", type=positive_int, default=1, help="batch size")
    p.add_argument("--heads", type=positive_int, default=None, help="heads (default 4; quick 2)")
    p.add_argument("--head-dim", type=positive_int, default=None, help="head dim (default 64; quick 16)")
    p.add_argument("--layouts", nargs="+", default=["contiguous", "zigzag"], choices=["contiguous", "zigzag"],
                   help="how the sequence is split over the ranks")
    p.add_argument("--no-causal", action="store_true", help="full attention instead of causal")
    p.add_argument("--backward", action="store_true", help="measure forward + backward (training step)")
    p.add_argument("--block-size", type=positive_int, default=None, help="ring piece size (default: ring_attention's)")
    p.add_argument("--threads", type=thread_count, default=None, help="total threads per configuration (default: cores)")
    p.add_argument("--timeout", type=positive_float, default=None, help="seconds per configuration (default 1800; quick 180)")
    p.add_argument("--out", default=RingConfig.out, help=f"output folder (default {RingConfig.out})")
    add_force(p)


def config_from_args(args) -> RingConfig:
    """The :class:`RingConfig` of parsed options (checked; --out is not checked here)."""
    cfg = RingConfig(out=args.out, procs=args.procs, quick=args.quick, seq_len=args.seq_len, batch=args.batch,
                     heads=args.heads, head_dim=args.head_dim, layouts=tuple(args.layouts), causal=not args.no_causal,
                     backward=args.backward, block_size=args.block_size, threads=args.threads, timeout=args.timeout)
    cfg.settings()
    return cfg


def run(args) -> RingBenchResult:
    """Run ``bench ring`` for parsed options with a progress line; print every rank and the target."""
    return run_suite(args, config_from_args(args), run_ring, render, title="bench ring")


def render(result: RingBenchResult) -> None:
    """Print every rank's memory, time and traffic beside the single process, and the issue-7 target."""
    from rich.table import Table

    t = Table(title=f"attnlab bench ring (n={result.settings['n']}, {result.settings['procs']} processes)")
    for col in ("config", "rank", "threads", "positions", "peak MiB", "attention MiB", "peak / one process",
                "seconds", "time / one process", "sent MiB", "waiting s"):
        t.add_column(col, justify="right" if col != "config" else "left")
    single = next(r for r in result.records if r.config == "single")
    for r in result.records:
        t.add_row(r.config, str(r.rank), str(r.threads), str(r.local_len), f"{r.peak_mib:.1f}",
                  f"{r.attention_peak_mib:.1f}", f"{r.peak_mib / single.peak_mib:.3f}" if single.peak_mib else "-",
                  f"{r.seconds:.3f}", f"{r.seconds / single.seconds:.2f}" if single.seconds else "-",
                  f"{r.sent_mib:.1f}", f"{r.wait_seconds:.3f}")
    console = new_console()
    console.print(t)
    tg = result.target
    console.print(f"worst rank peak / one process: {tg['worst_peak_ratio']:.3f} (target <= {tg['ratio']} at "
                  f"n={TARGET_N}, {TARGET_PROCS} processes: {'met' if tg['met'] else 'not met'}"
                  f"{'' if tg['applies'] else '; this run is not that configuration'})")
    console.print(f"wrote {result.out_dir}/ring.json and ring.png")
