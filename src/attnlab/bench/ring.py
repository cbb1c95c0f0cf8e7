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

``run(RingConfig(...)) -> RingBenchResult``: no printing, no argv (the CLI is ``attnlab bench ring``).

Legend: B batch, H heads, n sequence length, E head dim, L_r the positions one rank holds.
"""
from __future__ import annotations

import ctypes
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

import attnlab
from attnlab.distributed import comm_stats, ring_attention, shard_segments

from ..distributed import run_local
from ..harness import peak_rss_bytes, pyplot, reset_peak_rss, rss_bytes, save_plot
from ..report import atomic_write_json, environment

__all__ = ["RingConfig", "RingBenchResult", "RankRecord", "run"]

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
    files: list[str] = field(default_factory=list)
    exit_code: int = 0

    def write(self) -> list[str]:
        """Write ring.json and ring.png into ``out_dir``, atomically; returns both paths."""
        out = Path(self.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.files = [str(out / "ring.json"), str(out / "ring.png")]
        _write(self, out)
        return self.files


@dataclass
class RingConfig:
    """What ``bench ring`` measures: query, key, value [batch, heads, n, head_dim] split over ``procs``
    ranks in each of ``layouts``. A size left None takes quick's default (n 512, 2 heads, head dim 16,
    180 s) when ``quick``, else n = 32768, 4 heads, head dim 64, 1800 s per configuration. ``threads``:
    the total per configuration (default: this process's cores); ``block_size``: ring_attention's piece
    size (None: its default)."""
    out: str = "reports/bench-ring"
    procs: int = 4
    quick: bool = False
    seq_len: int | None = None
    batch: int = 1
    heads: int | None = None
    head_dim: int | None = None
    layouts: tuple[str, ...] = ("contiguous", "zigzag")
    causal: bool = True
    backward: bool = False
    block_size: int | None = None
    threads: int | None = None
    timeout: float | None = None

    def settings(self) -> dict:
        """Every setting with its default filled in (as stored in ring.json); ValueError naming the option
        for one that cannot run."""
        q = self.quick
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

        def given(v, default):  # 0 is refused, never replaced by a default here
            return default if v is None else v

        s = dict(procs=self.procs, n=given(self.seq_len, 512 if q else TARGET_N), batch=self.batch,
                 heads=given(self.heads, 2 if q else 4), head_dim=given(self.head_dim, 16 if q else 64),
                 causal=self.causal, backward=self.backward, block_size=self.block_size,
                 threads=self.threads if self.threads is not None else cores, layouts=list(dict.fromkeys(self.layouts)),
                 timeout=given(self.timeout, 180.0 if q else 1800.0), quick=q)
        for name in ("procs", "n", "batch", "heads", "head_dim", "threads"):
            if s[name] < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {s[name]}")
        if s["procs"] < 2:
            raise ValueError(f"--procs must be >= 2 for a ring, got {s['procs']}")
        if s["n"] < 2 * s["procs"]:
            raise ValueError(f"--seq-len {s['n']} is too short for {s['procs']} ranks (need >= {2 * s['procs']})")
        if s["block_size"] is not None and s["block_size"] < 1:
            raise ValueError(f"--block-size must be >= 1, got {s['block_size']}")
        bad = [x for x in s["layouts"] if x not in ("contiguous", "zigzag")]
        if bad:
            raise ValueError(f"--layouts: unknown {bad}; choose from contiguous, zigzag")
        return s


# -- measured inside each process ------------------------------------------------------------------
class _Memory:
    """Resident-set high-water mark of this process (attnlab.harness), with the method it was read by:
    "VmHWM" where the peak can be reset, else "ru_maxrss" (the peak since start: then the baseline is
    the peak so far too)."""

    def __init__(self):
        self.method = "VmHWM" if reset_peak_rss(trim=False) else "ru_maxrss"

    def reset(self) -> None:
        reset_peak_rss(trim=False)

    def current(self) -> int:
        return rss_bytes() if self.method == "VmHWM" else peak_rss_bytes()

    def peak(self) -> int:
        return peak_rss_bytes()


def _mmap_large_allocations() -> None:
    """Fixed mmap threshold: freed large tensors leave the resident set (glibc otherwise raises it)."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


def _measure(rank: int, world: int, cfg: dict) -> dict:
    import torch.distributed as dist

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
def run(config: RingConfig, *, progress: Callable[[int, int, str], None] | None = None) -> RingBenchResult:
    """Measure one process against each ring layout; writes ring.json and ring.png to ``out``.

    Starts one process with the whole sequence (query, key, value [B, H, n, E] through
    ``attnlab.attention``), then ``procs`` processes per layout running ``ring_attention`` on their
    shards, each in fresh processes via ``attnlab.distributed.run_local`` (gloo). ``progress(done,
    total, label)`` is called before each configuration. Raises ValueError for fewer than 2 processes or
    a sequence shorter than 2 positions per rank, and RuntimeError if any rank produced non-finite outputs.
    """

    s = config.settings()
    out_dir = Path(config.out)
    result = RingBenchResult(str(out_dir), s, env=environment())
    configs = ["single"] + [f"ring-{layout}" for layout in s["layouts"]]
    for i, name in enumerate(configs):
        world = 1 if name == "single" else s["procs"]
        if progress:
            progress(i, len(configs), f"{name} ({world} process{'es' if world > 1 else ''}, n={s['n']})")
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
    result.write()
    if progress:
        progress(len(configs), len(configs), "done")
    return result


def _write(result: RingBenchResult, out_dir: Path) -> None:
    plt = pyplot()

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
    save_plot(fig, out_dir / "ring.png")
