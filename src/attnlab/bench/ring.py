"""attnlab bench ring: ring attention over N local processes vs one process: per-rank peak memory and time.

Every configuration runs in fresh processes (attnlab.distributed.run_local, gloo on 127.0.0.1): one
process with the whole sequence (``attnlab.attention``, i.e. PyTorch's fused SDPA here), then N
processes with ``attnlab.distributed.ring_attention`` per layout, each rank creating only its own
shard. Memory is measured inside each process as its resident-set high-water mark (VmHWM, reset via
/proc/self/clear_refs after start-up and warm-up; ``getrusage`` maxrss deltas where that is not
available) minus the resident set just before the inputs are made: "total" counts the inputs, the
"attention" column only what the call added. Large allocations are forced to mmap (mallopt) so freed
memory leaves the resident set in both. Time: wall time of the call (the slowest rank for the ring),
with the same total number of threads: one process gets T threads, each of N ranks T // N.
Target (issue 7): 4 processes at n = 32768, each rank's peak <= 0.35x the single process's.
"""
from __future__ import annotations

import ctypes
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..options import output_dir, positive_float, positive_int
from ..report import atomic_write_json, environment, save_figure

__all__ = ["build_parser", "run", "RingBenchResult"]

TARGET_RATIO = 0.35
TARGET_N, TARGET_PROCS = 32768, 4


@dataclass
class RankRecord:
    """What one process measured for one configuration: its shard of ``local_len`` positions (query, key,
    value each [B, H, local_len, E]), peak resident memory in MiB (with and without the inputs), wall time
    of the call (forward, or forward + backward), and for ring ranks the bytes sent and the time spent
    waiting on transfers."""
    config: str  # "single" | "ring-contiguous" | "ring-zigzag"
    procs: int
    rank: int
    threads: int
    local_len: int
    peak_mib: float  # high-water mark minus the resident set before the inputs
    attention_peak_mib: float  # high-water mark minus the resident set after the inputs
    inputs_mib: float
    seconds: float
    memory_method: str
    sent_mib: float = 0.0  # ring messages sent by this rank
    wait_seconds: float = 0.0  # waiting for transfers after the compute they overlap (and for slower ranks)


@dataclass
class RingBenchResult:
    """Everything one ``bench ring`` run measured: every rank's :class:`RankRecord`, one ``summary`` row
    per configuration (its worst rank's peak and the slowest rank's time, each as a ratio to the single
    process), and ``target``: whether every ring layout's worst peak is <= 0.35x the single process's
    (the issue-7 target, which ``applies`` only at n = 32768 over 4 processes)."""
    out_dir: str
    settings: dict
    records: list[RankRecord] = field(default_factory=list)
    summary: list[dict] = field(default_factory=list)
    target: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    exit_code: int = 0


def build_parser(p):
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
    p.add_argument("--threads", type=positive_int, default=None, help="total threads per configuration (default: cores)")
    p.add_argument("--timeout", type=positive_float, default=None, help="seconds per configuration (default 1800; quick 180)")
    p.add_argument("--out", default="reports/bench-ring", help="output folder (default reports/bench-ring)")


# -- measured inside each process ------------------------------------------------------------------
class _Memory:
    """Resident-set high-water mark of this process, resettable on Linux."""

    def __init__(self):
        self.method = "VmHWM"
        try:
            self.reset()
            self._status("VmHWM")
        except OSError:
            self.method = "ru_maxrss"

    @staticmethod
    def _status(field_name: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) * 1024
        raise OSError(f"{field_name} not in /proc/self/status")

    def reset(self) -> None:
        if self.method == "VmHWM":
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset the high-water mark to the current resident set (Linux >= 4.0)

    def current(self) -> int:
        if self.method == "VmHWM":
            return self._status("VmRSS")
        return self.peak()  # without /proc, the best baseline is the peak so far

    def peak(self) -> int:
        if self.method == "VmHWM":
            return self._status("VmHWM")
        r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return r if sys.platform == "darwin" else r * 1024


def _mmap_large_allocations() -> None:
    """Fixed mmap threshold: freed large tensors leave the resident set (glibc otherwise raises it)."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def _measure(rank: int, world: int, cfg: dict) -> dict:
    import torch.distributed as dist

    import attnlab
    from attnlab.distributed import comm_stats, ring_attention, shard_segments

    _mmap_large_allocations()
    ring = cfg["config"] != "single"
    threads = max(1, cfg["threads"] // world) if ring else cfg["threads"]
    torch.set_num_threads(threads)
    B, H, E, n, causal = cfg["batch"], cfg["heads"], cfg["head_dim"], cfg["n"], cfg["causal"]
    layout = cfg["config"].split("-", 1)[1] if ring else "contiguous"
    L_r = sum(b - a for a, b in shard_segments(n, world, rank, layout)) if ring else n

    def call(q, k, v):
        if ring:
            return ring_attention(q, k, v, is_causal=causal, layout=layout, block_size=cfg["block_size"])
        return attnlab.attention(q, k, v, is_causal=causal)

    # warm-up at toy size: loads kernels, starts thread pools and (ring) connects the gloo pairs
    w = torch.randn(B, H, 8, E, requires_grad=cfg["backward"])
    o = call(w, w, w)
    if cfg["backward"]:
        o.sum().backward()
    del w, o
    if ring:
        dist.barrier()
    mem = _Memory()
    mem.reset()
    base = mem.current()
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(B, H, L_r, E, generator=g).requires_grad_(cfg["backward"]) for _ in range(3))
    grad = torch.randn(B, H, L_r, E, generator=g) if cfg["backward"] else None
    after_inputs = mem.current()
    if ring:
        dist.barrier()
    with comm_stats() as traffic:
        t0 = time.perf_counter()
        out = call(q, k, v)
        if grad is not None:
            out.backward(grad)
        seconds = time.perf_counter() - t0
    peak = mem.peak()
    finite = bool(torch.isfinite(out).all())
    mib = 1 / 2**20
    return dict(config=cfg["config"], procs=world if ring else 1, rank=rank, threads=threads, local_len=L_r,
                peak_mib=(peak - base) * mib, attention_peak_mib=(peak - after_inputs) * mib,
                inputs_mib=(after_inputs - base) * mib, seconds=seconds, memory_method=mem.method, finite=finite,
                sent_mib=traffic["bytes"] * mib, wait_seconds=traffic["wait_seconds"])


# -- the driver ------------------------------------------------------------------------------------
def _settings(args) -> dict:
    q = args.quick
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    def given(v, default):  # 0 is refused by the parser, never replaced by a default here
        return default if v is None else v

    s = dict(procs=args.procs, n=given(args.seq_len, 512 if q else TARGET_N), batch=args.batch,
             heads=given(args.heads, 2 if q else 4), head_dim=given(args.head_dim, 16 if q else 64),
             causal=not args.no_causal, backward=args.backward, block_size=args.block_size,
             threads=args.threads if args.threads is not None else cores, layouts=list(dict.fromkeys(args.layouts)),
             timeout=given(args.timeout, 180.0 if q else 1800.0), quick=q)
    for name in ("procs", "n", "batch", "heads", "head_dim", "threads"):
        if s[name] < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {s[name]}")
    if s["procs"] < 2:
        raise ValueError(f"--procs must be >= 2 for a ring, got {s['procs']}")
    if s["n"] < 2 * s["procs"]:
        raise ValueError(f"--seq-len {s['n']} is too short for {s['procs']} ranks (need >= {2 * s['procs']})")
    if s["block_size"] is not None and s["block_size"] < 1:
        raise ValueError(f"--block-size must be >= 1, got {s['block_size']}")
    return s


def run(args) -> RingBenchResult:
    """Run the ring benchmark with the parsed options ``args`` and return its :class:`RingBenchResult`.

    Starts one process with the whole sequence (query, key, value [B, H, n, E] through
    ``attnlab.attention``), then ``--procs`` processes per layout running ``ring_attention`` on their
    shards, each in fresh processes via ``attnlab.distributed.run_local`` (gloo). Writes ring.json and a
    plot to ``args.out`` and prints a table. Raises ValueError for fewer than 2 processes or a sequence
    shorter than 2 positions per rank, and RuntimeError if any rank produced non-finite outputs.
    """
    from rich.console import Console
    from rich.table import Table

    from ..distributed import run_local

    s = _settings(args)
    output_dir(args.out)
    out_dir = Path(args.out)
    console = Console(stderr=True)
    result = RingBenchResult(str(out_dir), s, env=environment())
    configs = ["single"] + [f"ring-{layout}" for layout in s["layouts"]]
    with console.status("") as status:
        for name in configs:
            world = 1 if name == "single" else s["procs"]
            status.update(f"bench ring: {name} ({world} process{'es' if world > 1 else ''}, n={s['n']})")
            cfg = dict(s, config=name)
            ranks = run_local(_measure, world, args=(cfg,), timeout=s["timeout"])
            for r in ranks:
                v = dict(r.value)
                if not v.pop("finite"):
                    raise RuntimeError(f"bench ring: {name} rank {r.rank} produced non-finite outputs")
                result.records.append(RankRecord(**v))
    single = next(r for r in result.records if r.config == "single")
    for name in configs:
        recs = [r for r in result.records if r.config == name]
        worst = max(recs, key=lambda r: r.peak_mib)
        slowest = max(r.seconds for r in recs)
        result.summary.append(dict(
            config=name, procs=recs[0].procs, worst_rank=worst.rank, peak_mib=worst.peak_mib,
            peak_ratio=worst.peak_mib / single.peak_mib if single.peak_mib > 0 else None,
            attention_peak_ratio=(worst.attention_peak_mib / single.attention_peak_mib
                                  if single.attention_peak_mib > 0 else None),
            seconds=slowest, time_ratio=slowest / single.seconds if single.seconds > 0 else None))
    ring_rows = [x for x in result.summary if x["config"] != "single"]
    result.target = dict(
        applies=s["n"] == TARGET_N and s["procs"] == TARGET_PROCS, ratio=TARGET_RATIO,
        worst_peak_ratio=max((x["peak_ratio"] or 0.0) for x in ring_rows),
        met=all(x["peak_ratio"] is not None and x["peak_ratio"] <= TARGET_RATIO for x in ring_rows))
    _write(result, out_dir)
    _render(result, Console(), Table)
    return result


def _write(result: RingBenchResult, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    atomic_write_json(out_dir / "ring.json", asdict(result))
    single = next(r for r in result.records if r.config == "single")
    rings = [c["config"] for c in result.summary if c["config"] != "single"]
    fig, (ax_m, ax_t) = plt.subplots(1, 2, figsize=(11, 4))
    P = result.settings["procs"]
    width = 0.8 / max(1, len(rings))
    for i, name in enumerate(rings):
        recs = sorted((r for r in result.records if r.config == name), key=lambda r: r.rank)
        xs = [r.rank + (i - (len(rings) - 1) / 2) * width for r in recs]
        ax_m.bar(xs, [r.peak_mib for r in recs], width, label=name)
        ax_t.bar(xs, [r.seconds for r in recs], width, label=name)
    ax_m.axhline(single.peak_mib, color="k", ls="--", label="one process")
    ax_m.axhline(single.peak_mib * TARGET_RATIO, color="r", ls=":", label=f"{TARGET_RATIO}x one process")
    ax_t.axhline(single.seconds, color="k", ls="--", label="one process")
    for ax, ylabel in ((ax_m, "peak memory per rank (MiB)"), (ax_t, "seconds (wall, per rank)")):
        ax.set_xticks(range(P))
        ax.set_xlabel("rank")
        ax.set_ylabel(ylabel)
        # below the axes: a legend inside would cover a bar
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    st = result.settings
    fig.suptitle(f"ring attention, {P} processes vs one: n={st['n']}, B={st['batch']}, H={st['heads']}, "
                 f"E={st['head_dim']}, {'causal' if st['causal'] else 'full'}"
                 f"{', fwd+bwd' if st['backward'] else ', forward'}")
    save_figure(fig, out_dir / "ring.png")


def _render(result: RingBenchResult, console, Table) -> None:
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
    console.print(t)
    tg = result.target
    console.print(f"worst rank peak / one process: {tg['worst_peak_ratio']:.3f} (target <= {tg['ratio']} at "
                  f"n={TARGET_N}, {TARGET_PROCS} processes: {'met' if tg['met'] else 'not met'}"
                  f"{'' if tg['applies'] else '; this run is not that configuration'})")
    console.print(f"wrote {result.out_dir}/ring.json and ring.png")
