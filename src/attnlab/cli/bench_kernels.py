"""attnlab bench kernels: the CLI face of attnlab.bench.kernels (argv in, progress line, summary out)."""
from __future__ import annotations

from attnlab.bench.kernels import KernelsConfig, KernelsResult, run as run_kernels
from .options import nonneg_int, positive_int, positive_int_list, thread_count

from .bench_common import run_suite
from .common import add_force


def _ints(text: str) -> tuple[int, ...]:
    return tuple(positive_int_list(text))


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"expected comma-separated numbers, got {text!r}") from None


QUICK = dict(dense_ns=(1024,), bf16_ns=(1024,), window_ns=(1024, 2048, 4096), window_bwd_ns=(2048,), sparse_n=2048,
             memory_n=2048, rounds=3, baseline_max_n=4096)


def build_parser(p):
    """Options of ``attnlab bench kernels``; each defaults to KernelsConfig's (the issue-14 sizes)."""
    d = KernelsConfig()
    p.add_argument("--out", default=d.out, help=f"output folder (default {d.out})")
    add_force(p)
    p.add_argument("--quick", action="store_true", help="small sizes (n <= 4096): minutes, for a first look")
    p.add_argument("--dense-ns", type=_ints, help=f"dense fp32 lengths (default {','.join(map(str, d.dense_ns))})")
    p.add_argument("--bf16-ns", type=_ints, help=f"bf16 lengths (default {','.join(map(str, d.bf16_ns))})")
    p.add_argument("--window", type=positive_int, help=f"causal sliding window (default {d.window})")
    p.add_argument("--window-ns", type=_ints, help=f"window lengths (default {','.join(map(str, d.window_ns))})")
    p.add_argument("--window-bwd-ns", type=_ints, help="window lengths also timed forward+backward")
    p.add_argument("--sparse-n", type=positive_int, help=f"block-sparse length (default {d.sparse_n})")
    p.add_argument("--densities", type=_floats, help="block-sparse densities (default 0.05,0.1,0.25)")
    p.add_argument("--memory-n", type=nonneg_int, help=f"fwd+bwd peak-memory length, 0 = skip (default {d.memory_n})")
    p.add_argument("--baseline-max-n", type=positive_int, help="largest n for SDPA is_causal / FlexAttention in the window sweep")
    p.add_argument("--methods", help=f"attnlab methods on dense inputs (default {','.join(d.methods)})")
    p.add_argument("--pattern-methods", help=f"attnlab methods on patterns (default {','.join(d.pattern_methods)})")
    p.add_argument("--rounds", type=positive_int, help=f"interleaved rounds per case (default {d.rounds})")
    p.add_argument("--no-flex", action="store_true", help="skip compiled FlexAttention")
    p.add_argument("--no-contention", action="store_true", help="skip the busy-CPU repeat")
    p.add_argument("--threads", type=thread_count, help="torch threads (default: torch's)")


def config_from_args(args) -> KernelsConfig:
    """KernelsConfig from parsed options: --quick's sizes first, then every option given explicitly."""
    kw = dict(QUICK) if args.quick else {}
    for name in ("dense_ns", "bf16_ns", "window", "window_ns", "window_bwd_ns", "sparse_n", "densities",
                 "baseline_max_n", "rounds", "threads"):
        v = getattr(args, name)
        if v is not None:
            kw[name] = v
    if args.memory_n is not None:
        kw["memory_n"] = args.memory_n or None
    for name in ("methods", "pattern_methods"):
        v = getattr(args, name)
        if v is not None:
            kw[name] = tuple(m.strip() for m in v.split(",") if m.strip())
    return KernelsConfig(out=args.out, flex=not args.no_flex, contention=not args.no_contention, **kw)


def run(args):
    """Run ``bench kernels`` for parsed options with a progress bar; print the CPU, the peaks and every ratio."""
    cfg = config_from_args(args)
    cfg.validate()
    return run_suite(args, cfg, run_kernels, render, title="bench kernels")


def render(res: KernelsResult) -> None:
    """Print the CPU, its measured matmul peaks and every headline ratio (quiet and busy)."""
    print(f"cpu: {res.cpu_summary}")
    print("matmul peak: " + ", ".join(f"{k} {v:.1f} GFLOP/s" for k, v in res.peaks_gflops.items()))
    for r in res.ratios:
        if r.value is not None and r.load in ("quiet", "busy"):
            print(f"  {r.impl:<18} {r.load:<5} {r.name}: {r.value:.2f} {('(target ' + r.target + ')') if r.target else ''}")
    print(f"wrote {', '.join(res.files)}")
