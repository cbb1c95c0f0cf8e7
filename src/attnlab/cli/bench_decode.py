"""attnlab bench decode: the CLI face of attnlab.bench.decode (argv in, progress line, table out)."""
from __future__ import annotations

from attnlab.bench.decode import DecodeBench, DecodeConfig, run as run_decode
from .options import names, positive_int, positive_int_list, thread_count

from .bench_common import config_of, run_suite
from .common import add_force
from .common import console as new_console


def build_parser(p) -> None:
    """Add ``bench decode``'s options (--quick, --out, --force, --seq-lens, --dtypes, --heads, --batches, --layouts,
    --rounds, --bandwidth-mib, --threads) to the argparse parser ``p``."""
    p.add_argument("--quick", action="store_true", help="S 256 and 1024, gqa/mqa, B=1 (seconds)")
    p.add_argument("--out", default=DecodeConfig.out, help=f"output folder (default {DecodeConfig.out})")
    add_force(p)
    p.add_argument("--seq-lens", type=positive_int_list, default=None,
                   help="comma-separated KV lengths (default 1024,4096,8192,32768,65536)")
    p.add_argument("--dtypes", type=names, default=None, help="comma-separated: float32, bfloat16, float16, int8 (an int8 cache, float32 queries), int8g32 (one scale per 32 channels: the HF int8 cache's format); default float32,bfloat16,int8")
    p.add_argument("--heads", type=names, default=None,
                   help="comma-separated of gqa (32/8, D=128), mha (8/8, D=64), mqa (32/1, D=128); default all")
    p.add_argument("--batches", type=positive_int_list, default=None, help="comma-separated batch sizes (default 1,8)")
    p.add_argument("--layouts", type=names, default=None,
                   help="comma-separated: contiguous, paged<page size> (default contiguous,paged16,paged64,paged256)")
    p.add_argument("--rounds", type=positive_int, default=None, help="interleaved timed rounds (median; default 9)")
    p.add_argument("--bandwidth-mib", type=positive_int, default=None,
                   help="buffer of the read-bandwidth probe, MiB (default 1024; quick 64)")
    p.add_argument("--threads", type=thread_count, default=None, help="torch threads (default: torch's current setting)")


def config_from_args(args) -> DecodeConfig:
    """The :class:`DecodeConfig` of parsed options (checked; --out is not checked here)."""
    cfg = config_of(args, DecodeConfig)
    cfg.resolved()
    return cfg


def run(args) -> DecodeBench:
    """Run ``bench decode`` for parsed options with a progress line; print every case and the targets."""
    return run_suite(args, config_from_args(args), run_decode, render, title="bench decode")


def render(res: DecodeBench) -> None:
    """One row per case: ms of attnlab and SDPA, GB/s, attnlab over the memory-bound time, speedup, error."""
    from rich.table import Table

    t = Table(title=f"decode (L=1): attnlab.attention_with_kvcache vs SDPA enable_gqa, {res.threads} threads")
    for col in ("heads", "S", "dtype", "B", "layout", "splits", "attnlab ms", "sdpa ms", "GB/s", "bandwidth GB/s",
                "x bound", "speedup", "correct"):
        t.add_column(col, justify="left" if col in ("heads", "dtype", "layout") else "right")
    for r in res.rows:
        t.add_row(r["heads"], str(r["S"]), r["dtype"], str(r["B"]), r["layout"], str(r["splits"]),
                  f"{r['attnlab_ms']:.3f}", f"{r['sdpa_ms']:.3f}", f"{r['attnlab_gbs']:.1f}",
                  f"{r['bandwidth_gbs']:.1f}", f"{r['attnlab_over_bound']:.2f}", f"{r['speedup']:.2f}x",
                  "yes" if r["correct"] else f"NO ({r['max_err']:.2g} > {r['err_budget']:.2g})")
    console = new_console()  # fits the table to --width (Note [Tables that fit]): nothing elided
    console.print(t)
    for tg in res.targets:
        console.print(f"target {tg['case']}: {'met' if tg['met'] else 'not met'} ({tg})")
    for s in res.skipped:
        console.print(f"skipped {s['case']}: {s['why']}")
    console.print(f"wrote {res.files[0] if res.files else res.out_dir}")
