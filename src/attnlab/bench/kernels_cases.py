"""The cases of ``bench kernels``: what is measured (config, measurements), the implementations, one
case's interleaved timing, the busy-CPU load, fresh-process peak memory and the FlexAttention probes.

Legend: B batch, H heads, n sequence length (L = S = n), D head dim, ρ fraction of (query, key) pairs kept.
"""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

import attnlab
from attnlab import patterns as P

from ..harness import interleaved
from .impls import DTYPES, make_inputs

__all__ = ["DTYPES", "TARGET_NS", "KernelsConfig", "Measurement", "Ratio", "make_case_pattern",
           "flex_block_mask", "window_mask_mod", "build_impl", "measure_case", "Contention",
           "flex_compiler", "flex_backward_reason"]

#: the lengths at which issue 14 states each target; other lengths are reported without one
TARGET_NS = {"dense": (4096, 16384), "bf16": (4096,), "window": (16384,), "sparse": (16384,), "memory": (16384,)}


@dataclass
class KernelsConfig:
    """What to measure. Defaults are the issue's targets; a test shrinks every size."""

    out: str = "reports/bench-kernels"
    B: int = 1
    H: int = 8
    D: int = 64
    dense_ns: tuple[int, ...] = (4096, 16384)
    bf16_ns: tuple[int, ...] = (4096,)
    window: int = 256
    window_ns: tuple[int, ...] = (4096, 8192, 16384, 32768, 65536)
    window_bwd_ns: tuple[int, ...] = (16384,)
    #: the baselines (SDPA is_causal, FlexAttention) are dense-cost or compile-heavy: measured up to here
    baseline_max_n: int = 16384
    sparse_n: int = 16384
    densities: tuple[float, ...] = (0.05, 0.10, 0.25)
    block_size: int = 128
    bigbird: bool = True
    memory_n: int | None = 16384
    #: attnlab methods compared on dense inputs (and for memory), and on patterns; a name not in
    #: attnlab.functional.METHODS is skipped with the reason. ("sdpa" on a pattern materialises the
    #: n x n mask and does dense work, so it is left out of the pattern cases by default.)
    methods: tuple[str, ...] = ("compiled", "tiled", "sdpa", "auto")
    pattern_methods: tuple[str, ...] = ("compiled", "sparse", "tiled", "auto")
    flex: bool = True
    contention: bool = True
    contention_threads: int = 1  # threads of the matmul-loop process
    rounds: int = 5
    #: fewer rounds (never under min_rounds) when one round of a case would take longer than this
    case_budget_s: float = 120.0
    min_rounds: int = 3
    #: a sample repeats a short call until it lasts about this long (median of per-call means)
    min_sample_s: float = 0.05
    #: an implementation whose warm-up call takes longer than this is skipped, with the reason
    max_call_s: float = 60.0
    threads: int | None = None
    seed: int = 0

    def validate(self) -> None:
        """Raise ValueError naming the field for a size, count or density that cannot be measured."""
        for name in ("B", "H", "D", "window", "sparse_n", "block_size", "rounds", "min_rounds"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"KernelsConfig.{name} must be a positive int, got {v!r}")
        for name in ("dense_ns", "bf16_ns", "window_ns", "window_bwd_ns"):
            for n in getattr(self, name):
                if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                    raise ValueError(f"KernelsConfig.{name} must hold positive ints, got {getattr(self, name)!r}")
        for r in self.densities:
            if not 0 < r <= 1:
                raise ValueError(f"KernelsConfig.densities must lie in (0, 1], got {self.densities!r}")


@dataclass
class Measurement:
    """One implementation in one case: median seconds over interleaved rounds (or why it was skipped)."""

    case: str  # e.g. "window fwd n=16384"
    section: str  # dense | bf16 | window | sparse
    impl: str  # torch:sdpa | torch:flex | attnlab:<method>
    n: int
    dtype: str
    backward: bool
    load: str  # quiet | busy (a matmul loop in another process)
    pattern: str | None = None
    density: float = 1.0  # fraction of (query, key) pairs the pattern keeps
    seconds: float | None = None
    times: list[float] = field(default_factory=list)  # seconds per call, one per round
    calls_per_sample: int = 1  # calls averaged in each round's sample (short calls are repeated)
    skipped: str | None = None
    compile_s: float | None = None  # torch:flex: first call minus the median call (compilation)
    mask_s: float | None = None  # torch:flex: building its BlockMask


@dataclass
class Ratio:
    """A headline figure computed from two medians of the same case and load (or a fitted exponent)."""

    name: str
    impl: str
    load: str
    value: float | None
    definition: str  # how it was computed, e.g. "torch:sdpa s / attnlab:sparse s"
    target: str = ""
    inputs: dict = field(default_factory=dict)  # the measured figures it came from


# -- implementations ---------------------------------------------------------------------------------
def make_case_pattern(kind: str, n: int, *, window: int = 256, density: float = 0.1, block_size: int = 128,
                      seed: int = 0) -> P.Pattern:
    """The pattern a case measures: 'window' (causal sliding window), 'block_sparse' (random blocks kept
    with probability ``density``, plus the diagonal so no query row is empty) or 'bigbird' (defaults)."""
    if kind == "window":
        return P.sliding_window(window, causal=True)
    if kind == "bigbird":
        return P.bigbird(block_size, seed=seed)
    if kind == "block_sparse":
        nb = -(-n // block_size)
        g = torch.Generator().manual_seed(seed)
        layout = (torch.rand(nb, nb, generator=g) < density) | torch.eye(nb, dtype=torch.bool)
        return P.block_sparse(layout, block_size)
    raise ValueError(f"unknown case pattern {kind!r}; choose from window, block_sparse, bigbird")


def flex_block_mask(pattern: P.Pattern, n: int, block_size: int = 128, mask_mod: Callable | None = None):
    """FlexAttention's BlockMask for ``pattern`` at L = S = n, built from attnlab's own block layout (the
    same empty / partial / full blocks, so both skip the same work). ``mask_mod(b, h, q_idx, kv_idx)``
    masks the partial blocks; by default a table lookup when every kept block is whole (block tables),
    else the pattern's own predicate."""
    from torch.nn.attention.flex_attention import BlockMask

    lay = pattern.block_layout(n, n, block_size, block_size)
    partial, full = lay == P.PARTIAL, lay == P.FULL

    def lists(sel):
        # per query block: how many key blocks are selected, and their indices first in each row
        order = torch.argsort((~sel).to(torch.int8), dim=1, stable=True).to(torch.int32)
        return sel.sum(1).to(torch.int32)[None, None], order[None, None].contiguous()

    kv_num, kv_idx = lists(partial)
    full_num, full_idx = lists(full)
    if mask_mod is None:
        if not bool(partial.any()):
            table = full  # every kept block is whole: the table is the mask

            def mask_mod(b, h, q, k):
                return table[q // block_size, k // block_size]
        else:
            def mask_mod(b, h, q, k):
                return pattern.keep(q, k, n, n)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block_size, mask_mod=mask_mod,
                                    seq_lengths=(n, n))


def window_mask_mod(window: int) -> Callable:
    """FlexAttention's mask_mod for the causal sliding window: q - window <= kv <= q."""
    def causal_window(b, h, q, k):
        return (q >= k) & (q - k <= window)
    return causal_window


def build_impl(impl: str, *, causal: bool = False, pattern: P.Pattern | None = None, block_mask=None,
               compiled_flex=None) -> Callable:
    """A callable (q, k, v) -> out for an implementation name: 'torch:sdpa' (is_causal=causal; no
    pattern: the dense or causal work a user runs without attnlab), 'torch:flex' (needs block_mask and
    compiled_flex) or 'attnlab:<method>' (``attnlab.attention(..., pattern=pattern, method=...)``)."""
    if impl == "torch:sdpa":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if impl == "torch:flex":
        return lambda q, k, v: compiled_flex(q, k, v, block_mask=block_mask)
    if impl.startswith("attnlab:"):
        method = impl.split(":", 1)[1]
        return lambda q, k, v: attnlab.attention(q, k, v, is_causal=causal and pattern is None, pattern=pattern,
                                                 method=method)
    raise ValueError(f"unknown implementation {impl!r}")


def _inputs(cfg: KernelsConfig, n: int, dtype: str, backward: bool):
    return make_inputs(dict(n=n, B=cfg.B, H=cfg.H, D=cfg.D, dtype=dtype, seed=cfg.seed, backward=backward))


def _call(f, inputs, backward):
    if backward:
        for t in inputs:
            t.grad = None
        f(*inputs).float().sum().backward()
    else:
        with torch.no_grad():
            f(*inputs)


# -- one case: interleaved rounds ---------------------------------------------------------------------
def measure_case(cfg: KernelsConfig, case: str, section: str, n: int, dtype: str, backward: bool, load: str,
                 impls: dict, pattern=None, density: float = 1.0) -> list[Measurement]:
    """One case: every implementation of ``impls`` ({name: callable (q, k, v) -> out, or the reason it is
    skipped}) on query, key, value [B, H, n, D], timed against the others in interleaved rounds
    (:func:`attnlab.harness.interleaved`, Note [Median, interleaved]); one :class:`Measurement` each.

    Each is first called once on its own: an implementation that raises, or whose call takes longer than
    ``cfg.max_call_s``, is skipped with the reason instead of stopping the case. For compiled
    FlexAttention, ``compile_s`` is that first call minus the median call."""
    inputs = _inputs(cfg, n, dtype, backward)
    ms = {name: Measurement(case, section, name, n, dtype, backward, load, repr(pattern) if pattern else None,
                            density) for name in impls}
    live = {}
    for name, f in impls.items():
        if isinstance(f, str):
            ms[name].skipped = f
            continue
        try:
            t0 = time.perf_counter()
            _call(f, inputs, backward)  # warm-up (and compilation, for compiled implementations)
            first = time.perf_counter() - t0
        except Exception as e:  # a refused method, an unsupported path: recorded, the others go on
            ms[name].skipped = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            continue
        if first > cfg.max_call_s and not name.startswith("torch:flex"):
            ms[name].skipped = f"warm-up call took {first:.1f} s > max_call_s {cfg.max_call_s} s"
            continue
        ms[name].compile_s = first  # replaced by (first - median) for compiled ones below
        live[name] = f
    if live:
        # the harness warms each up once more before its probe call: one extra call, while the first call
        # above is what decides the skips and the compile time
        timings = interleaved({name: (lambda f=f: _call(f, inputs, backward)) for name, f in live.items()},
                              rounds=cfg.rounds, min_rounds=cfg.min_rounds, min_sample_s=cfg.min_sample_s,
                              budget_s=cfg.case_budget_s)
        for name, t in timings.items():
            m = ms[name]
            m.times, m.seconds, m.calls_per_sample = t.times, t.median, t.calls_per_sample
            m.compile_s = max(0.0, m.compile_s - m.seconds) if name.startswith("torch:flex") else None
    return list(ms.values())


# -- background load -----------------------------------------------------------------------------------
_LOAD_SCRIPT = """
import os, sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
parent, end = os.getppid(), time.time() + float(sys.argv[2])
a = torch.randn(1024, 1024); b = torch.randn(1024, 1024)
while time.time() < end and os.getppid() == parent:  # never outlive the benchmark
    for _ in range(8):
        a @ b
"""


class Contention:
    """A second CPU-bound process (a loop of 1024^3 matrix products, ``threads`` threads, at most ``max_s``
    seconds) for the duration of a with-block; RuntimeError if it exits at once."""

    def __init__(self, threads: int, max_s: float = 4 * 3600):
        self.threads, self.max_s, self.proc = threads, max_s, None

    def __enter__(self):
        env = dict(os.environ, OMP_NUM_THREADS=str(self.threads), MKL_NUM_THREADS=str(self.threads))
        self.proc = subprocess.Popen([sys.executable, "-c", _LOAD_SCRIPT, str(self.threads), str(self.max_s)],
                                     env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)  # let it reach its loop
        if self.proc.poll() is not None:
            raise RuntimeError(f"the contention process exited at once (code {self.proc.returncode})")
        return self

    def __exit__(self, *exc):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return False


def flex_compiler():
    """(torch.compile(flex_attention), None), or (None, the reason) when it cannot run here."""
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError as e:
        return None, f"FlexAttention is not available in torch {torch.__version__}: {e}"
    try:
        # (``import torch._dynamo`` here would make ``torch`` a local name, unbound in the except clause above)
        dynamo = importlib.import_module("torch._dynamo")

        # each case's mask_mod is a new graph: allow more than the default 8 before dynamo falls back
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo.config, name):
                setattr(dynamo.config, name, max(64, getattr(dynamo.config, name)))
        return torch.compile(flex_attention, dynamic=False), None
    except Exception as e:
        return None, f"torch.compile(flex_attention) failed: {type(e).__name__}: {e}"


_FLEX_BWD_PROBE = """
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
q, k, v = (torch.randn(1, 1, 128, 16, requires_grad=True) for _ in range(3))
bm = create_block_mask(lambda b, h, i, j: i >= j, None, None, 128, 128, device="cpu")
torch.compile(flex_attention)(q, k, v, block_mask=bm).sum().backward()
"""


def flex_backward_reason(timeout: float = 600) -> str | None:
    """Why compiled FlexAttention cannot train here (None when it can). Probed in a separate process:
    in torch 2.13 a failed backward leaves this process's compiled flex_attention running its slow
    fallback for every later forward call, which would corrupt every Flex figure after it."""
    try:
        r = subprocess.run([sys.executable, "-c", _FLEX_BWD_PROBE], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"FlexAttention backward probe did not finish in {timeout:.0f} s"
    if r.returncode == 0:
        return None
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    err = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1] if lines else "failed")
    return f"FlexAttention backward (compiled, CPU) fails here: {err.strip()[:200]}"
