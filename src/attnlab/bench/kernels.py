"""attnlab bench kernels: attnlab's kernels against PyTorch SDPA and compiled FlexAttention (issue 14).

Everything is measured side by side in one process: for each case the implementations run in
interleaved rounds (the order rotates each round) and each figure is the median of its rounds, so a
slow patch on a shared machine hits every implementation alike. Ratios are computed from those
medians; nothing is compared across runs. Cases:

- dense fp32, forward and forward+backward, vs SDPA;
- bf16 forward vs SDPA in bf16 (the CPU's bf16 matrix instructions, if any, are in the header);
- causal sliding window, forward over a range of n (time exponent) and forward+backward, vs SDPA
  ``is_causal`` and vs compiled FlexAttention on the same block mask (its compile time reported apart);
- random block-sparse at several densities ρ and BigBird, as time / (ρ · dense SDPA time);
- forward+backward peak memory vs SDPA, each in a fresh process;
- every headline case again while a second process runs a loop of large matrix products.

``run(KernelsConfig(...)) -> KernelsResult``: no printing, no argv (the CLI is ``attnlab bench kernels``).
Files (written atomically): results.json, report.md, window.png, sparse.png, ratios.png.

Legend: B batch, H heads, n sequence length (L = S = n), D head dim, ρ fraction of (query, key) pairs kept.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

import attnlab
from attnlab import cpu
from attnlab import patterns as P
from attnlab.functional import METHODS

from ..report import atomic_write_json, atomic_write_text, environment, save_figure

__all__ = ["KernelsConfig", "KernelsResult", "Measurement", "Ratio", "run", "build_impl", "make_case_pattern",
           "flex_block_mask", "window_mask_mod", "compute_ratios", "fit_exponent"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
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


@dataclass
class KernelsResult:
    """Everything one run measured: the config (as a dict), the CPU and its measured matmul peaks, each
    case's measurements, fresh-process peak memory, the headline ratios, notes and the files written."""

    config: dict
    out_dir: str
    cpu: dict = field(default_factory=dict)
    cpu_summary: str = ""
    peaks_gflops: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    measurements: list[Measurement] = field(default_factory=list)
    memory: list[dict] = field(default_factory=list)
    ratios: list[Ratio] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    seconds: float = 0.0
    exit_code: int = 0


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
    g = torch.Generator().manual_seed(cfg.seed)
    qkv = [torch.randn(cfg.B, cfg.H, n, cfg.D, generator=g).to(DTYPES[dtype]) for _ in range(3)]
    return [t.requires_grad_(backward) for t in qkv]


def _call(f, inputs, backward):
    if backward:
        for t in inputs:
            t.grad = None
        f(*inputs).float().sum().backward()
    else:
        with torch.no_grad():
            f(*inputs)


# -- one case: interleaved rounds ---------------------------------------------------------------------
def _measure_case(cfg, case, section, n, dtype, backward, load, impls, pattern=None, density=1.0):
    """impls: {name: callable or a skip reason (str)} -> list[Measurement], interleaved, median."""
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
        # One more timed call each gives a round's cost, which decides how many rounds fit the case budget,
        # and each implementation's calls per sample: short calls are repeated to fill min_sample_s, so a
        # scheduler hiccup on a shared machine is averaged over many calls instead of deciding a sample.
        probe, inner = {}, {}
        for name, f in live.items():
            if ms[name].compile_s > 1.0 and not name.startswith("torch:flex"):
                probe[name] = ms[name].compile_s  # a slow call: its warm-up is a fair probe, save a call
            else:
                t0 = time.perf_counter()
                _call(f, inputs, backward)
                probe[name] = time.perf_counter() - t0
            inner[name] = max(1, min(1000, int(cfg.min_sample_s / max(probe[name], 1e-6))))
        per_round = sum(probe[nm] * inner[nm] for nm in live)
        lo = min(cfg.min_rounds, cfg.rounds)
        rounds = max(lo, min(cfg.rounds, int(cfg.case_budget_s / max(per_round, 1e-9))))
        order = list(live)
        for r in range(rounds):
            for name in order[r % len(order):] + order[:r % len(order)]:  # rotate: no implementation always first
                f, k = live[name], inner[name]
                t0 = time.perf_counter()
                for _ in range(k):
                    _call(f, inputs, backward)
                ms[name].times.append((time.perf_counter() - t0) / k)
        for name in live:
            m = ms[name]
            m.seconds = statistics.median(m.times)
            m.calls_per_sample = inner[name]
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


class _Contention:
    """A second CPU-bound process (a loop of 1024^3 matrix products) for the duration of a with-block."""

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


# -- memory: fresh processes ---------------------------------------------------------------------------
def _peak_child(spec: dict, timeout: float = 1800) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()))
    r = subprocess.run([sys.executable, "-m", "attnlab.bench._kernels_child", json.dumps(spec)], capture_output=True,
                       text=True, timeout=timeout, env=env)
    if r.returncode != 0:
        return {"skipped": (r.stderr.strip().splitlines() or ["failed"])[-1][:200]}
    return json.loads(r.stdout.strip().splitlines()[-1])


# -- the run ---------------------------------------------------------------------------------------------
def _flex_compiler():
    """torch.compile(flex_attention), or (None, reason) when it cannot run here."""
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError as e:
        return None, f"FlexAttention is not available in torch {torch.__version__}: {e}"
    try:
        import torch._dynamo

        # each case's mask_mod is a new graph: allow more than the default 8 before dynamo falls back
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))
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


def _flex_backward_reason(timeout: float = 600) -> str | None:
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


def _plan_cases(cfg: KernelsConfig):
    """[(case, section, n, dtype, backward, kind, headline)]: kind None = dense, else a case pattern."""
    cases = []
    for n in cfg.dense_ns:
        cases.append((f"dense fp32 fwd n={n}", "dense", n, "float32", False, None, True))
        cases.append((f"dense fp32 fwd+bwd n={n}", "dense", n, "float32", True, None, True))
    for n in cfg.bf16_ns:
        cases.append((f"dense bf16 fwd n={n}", "bf16", n, "bfloat16", False, None, True))
    for n in cfg.window_ns:
        cases.append((f"window fwd n={n}", "window", n, "float32", False, "window", n in cfg.window_bwd_ns))
    for n in cfg.window_bwd_ns:
        cases.append((f"window fwd+bwd n={n}", "window", n, "float32", True, "window", True))
    for bwd in (False, True):
        cases.append((f"sparse {'fwd+bwd' if bwd else 'fwd'} n={cfg.sparse_n}", "sparse", cfg.sparse_n, "float32",
                      bwd, "sparse", True))
    return cases


def _impls_for(cfg, section, n, kind, pattern, flex, flex_reason, block_mask=None, flex_bwd_reason=None):
    impls: dict = {}
    baseline_ok = n <= cfg.baseline_max_n
    if section in ("dense", "bf16"):
        impls["torch:sdpa"] = build_impl("torch:sdpa")
    elif section == "window":
        impls["torch:sdpa"] = build_impl("torch:sdpa", causal=True) if baseline_ok else \
            f"SDPA is_causal measured only up to baseline_max_n={cfg.baseline_max_n}"
        if not cfg.flex:
            impls["torch:flex"] = "FlexAttention disabled (flex=False)"
        elif flex is None:
            impls["torch:flex"] = flex_reason
        elif not baseline_ok:
            impls["torch:flex"] = f"FlexAttention measured only up to baseline_max_n={cfg.baseline_max_n}"
        elif flex_bwd_reason:
            impls["torch:flex"] = flex_bwd_reason
        else:
            impls["torch:flex"] = build_impl("torch:flex", block_mask=block_mask, compiled_flex=flex)
    for m in (cfg.methods if pattern is None else cfg.pattern_methods):
        name = f"attnlab:{m}"
        if m not in METHODS:
            impls[name] = f"method={m!r} is not in attnlab.functional.METHODS (not built or not merged here)"
        elif pattern is None and m == "sparse":
            impls[name] = "dense inputs: nothing for the sparse kernel to skip (attnlab refuses it)"
        elif pattern is not None and m == "sdpa" and n > cfg.baseline_max_n:
            impls[name] = f"materialises the n x n mask and does dense work: measured only up to {cfg.baseline_max_n}"
        else:
            impls[name] = build_impl(name, pattern=pattern)
    return impls


def run(config: KernelsConfig | None = None, progress: Callable[[int, int, str], None] | None = None) -> KernelsResult:
    """Measure every case of ``config`` (quiet, then busy) and write the report; returns what it measured.

    ``progress(done, total, label)`` is called before each case and once at the end.
    """
    cfg = config or KernelsConfig()
    cfg.validate()
    t_start = time.perf_counter()
    old_threads = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out)
    res = KernelsResult(config=asdict(cfg), out_dir=str(out), env=environment())
    try:
        peak_n = 1024 if max(cfg.dense_ns + cfg.window_ns + (cfg.sparse_n,)) >= 2048 else 256
        res.peaks_gflops = cpu.matmul_peaks((torch.float32, torch.bfloat16), n=peak_n, seconds=0.5)
        res.cpu, res.cpu_summary = cpu.INFO.as_dict(), cpu.summary(peaks=False)
        flex, flex_reason = _flex_compiler() if cfg.flex else (None, "FlexAttention disabled (flex=False)")
        cases = _plan_cases(cfg)
        busy = [c for c in cases if c[6]] if cfg.contention else []
        total = len(cases) + len(busy) + (1 if cfg.memory_n else 0)
        flex_bwd_reason = None
        if flex is not None and any(c[4] for c in cases):
            if progress:
                progress(0, total, "probing FlexAttention backward (separate process)")
            flex_bwd_reason = _flex_backward_reason()
        done = 0
        sparse_pats = _sparse_patterns(cfg)
        masks: dict = {}

        def one(c, load):
            case, section, n, dtype, bwd, kind, _ = c
            if section == "sparse":
                return _measure_sparse(cfg, case, n, bwd, load, sparse_pats, flex, flex_reason, masks,
                                       flex_bwd_reason if bwd else None)
            pattern = make_case_pattern("window", n, window=cfg.window) if kind == "window" else None
            bm = None
            if kind == "window" and flex is not None and n <= cfg.baseline_max_n:
                bm = _mask_for(masks, ("window", n), pattern, n, cfg.block_size, window_mask_mod(cfg.window))
            impls = _impls_for(cfg, section, n, kind, pattern, flex, flex_reason, bm, flex_bwd_reason if bwd else None)
            dens = pattern.density(n, n) if pattern is not None else 1.0
            ms = _measure_case(cfg, case, section, n, dtype, bwd, load, impls, pattern, dens)
            for m in ms:
                if m.impl == "torch:flex" and m.seconds and ("window", n) in masks:
                    m.mask_s = masks[("window", n)][1]
            return ms

        for c in cases:
            if progress:
                progress(done, total, f"quiet · {c[0]}")
            res.measurements += one(c, "quiet")
            done += 1
            _save(res, out)
        if busy:
            with _Contention(cfg.contention_threads):
                for c in busy:
                    if progress:
                        progress(done, total, f"busy · {c[0]}")
                    res.measurements += one(c, "busy")
                    done += 1
                    _save(res, out)
        if cfg.memory_n:
            if progress:
                progress(done, total, f"memory (fresh processes) · n={cfg.memory_n}")
            res.memory = _measure_memory(cfg)
            done += 1
        if flex is None:
            res.notes.append(f"FlexAttention not measured: {flex_reason}")
        elif flex_bwd_reason:
            res.notes.append(f"FlexAttention forward+backward not measured: {flex_bwd_reason}")
        res.ratios = compute_ratios(res, cfg)
        res.seconds = time.perf_counter() - t_start
        res.files = _write(res, out)
        if progress:
            progress(total, total, "done")
        return res
    finally:
        torch.set_num_threads(old_threads)


def _mask_for(masks, key, pattern, n, bs, mask_mod=None):
    if key not in masks:
        t0 = time.perf_counter()
        bm = flex_block_mask(pattern, n, bs, mask_mod)
        masks[key] = (bm, time.perf_counter() - t0)
    return masks[key][0]


def _sparse_patterns(cfg):
    pats = [(f"block_sparse ρ={r:g}", make_case_pattern("block_sparse", cfg.sparse_n, density=r,
                                                         block_size=cfg.block_size, seed=cfg.seed))
            for r in cfg.densities]
    if cfg.bigbird:
        pats.append(("bigbird", make_case_pattern("bigbird", cfg.sparse_n, block_size=cfg.block_size, seed=cfg.seed)))
    return pats


def _measure_sparse(cfg, case, n, bwd, load, pats, flex, flex_reason, masks, flex_bwd_reason=None):
    """One interleaved group: dense SDPA (the ρ·dense reference) beside every pattern x implementation."""
    impls, meta = {"torch:sdpa": build_impl("torch:sdpa")}, {}
    for label, pat in pats:
        for m in cfg.pattern_methods:
            name = f"attnlab:{m} [{label}]"
            impls[name] = (f"method={m!r} is not in attnlab.functional.METHODS (not built or not merged here)"
                           if m not in METHODS else build_impl(f"attnlab:{m}", pattern=pat))
            meta[name] = (pat, label)
        name = f"torch:flex [{label}]"
        if not cfg.flex or flex is None:
            impls[name] = flex_reason
        elif flex_bwd_reason:
            impls[name] = flex_bwd_reason
        else:
            impls[name] = build_impl("torch:flex", block_mask=_mask_for(masks, (label, n), pat, n, cfg.block_size),
                                     compiled_flex=flex)
        meta[name] = (pat, label)
    ms = _measure_case(cfg, case, "sparse", n, "float32", bwd, load, impls)
    for m in ms:
        if m.impl in meta:
            pat, label = meta[m.impl]
            m.pattern, m.density = label, pat.density(n, n)
            if m.impl.startswith("torch:flex") and m.seconds and (label, n) in masks:
                m.mask_s = masks[(label, n)][1]
    return ms


def _measure_memory(cfg):
    rows = []
    n = cfg.memory_n
    for impl in ["torch:sdpa"] + [f"attnlab:{m}" for m in cfg.methods if m != "auto"]:
        spec = dict(impl=impl, n=n, B=cfg.B, H=cfg.H, D=cfg.D, dtype="float32", backward=True, seed=cfg.seed)
        row = dict(impl=impl, n=n, case=f"dense fp32 fwd+bwd n={n}", peak_bytes=None, skipped=None)
        m = impl.split(":", 1)[1]
        if impl.startswith("attnlab:") and m not in METHODS:
            row["skipped"] = f"method={m!r} is not in attnlab.functional.METHODS"
        elif m == "sparse" and impl.startswith("attnlab:"):
            row["skipped"] = "dense inputs: nothing for the sparse kernel to skip"
        else:
            r = _peak_child(spec)
            row["peak_bytes"], row["skipped"] = r.get("peak_bytes"), r.get("skipped")
        rows.append(row)
    return rows


# -- ratios -----------------------------------------------------------------------------------------------
def fit_exponent(ns, ys) -> float | None:
    """Least-squares slope of log y against log n (None with fewer than two positive points)."""
    pts = [(math.log(n), math.log(y)) for n, y in zip(ns, ys) if y and y > 0]
    if len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    mz = sum(z for _, z in pts) / len(pts)
    den = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (z - mz) for x, z in pts) / den if den > 0 else None


def compute_ratios(res: KernelsResult, cfg: KernelsConfig) -> list[Ratio]:
    """Headline ratios, each from two medians of one case under one load."""
    by = {(m.case, m.impl, m.load): m for m in res.measurements}
    out: list[Ratio] = []
    attn = [m for m in res.measurements if m.impl.startswith("attnlab:") and m.seconds]
    bf16_target = "≥ 1.5" if cpu.INFO.has("avx512_bf16") or cpu.INFO.has("amx_bf16") else "≥ 1.0 (no bf16 matmul ISA)"
    for m in attn:
        base_name = m.impl.split(" [")[0]
        if m.section in ("dense", "bf16", "window"):
            sd = by.get((m.case, "torch:sdpa", m.load))
            if sd and sd.seconds:
                target = {"dense": "≥ 0.95", "bf16": bf16_target, "window": "≥ 15"}[m.section] \
                    if m.n in TARGET_NS[m.section] else ""
                what = "SDPA is_causal" if m.section == "window" else "SDPA"
                out.append(Ratio(f"{m.case}: speed vs {what}", base_name, m.load, sd.seconds / m.seconds,
                                 f"torch:sdpa s / {base_name} s", target,
                                 {"torch:sdpa": sd.seconds, base_name: m.seconds}))
            fx = by.get((m.case, "torch:flex", m.load))
            if m.section == "window" and fx and fx.seconds:
                out.append(Ratio(f"{m.case}: speed vs FlexAttention (compiled)", base_name, m.load,
                                 fx.seconds / m.seconds, f"torch:flex s / {base_name} s",
                                 "≥ 1.3" if not m.backward and m.n in TARGET_NS["window"] else "",
                                 {"torch:flex": fx.seconds, base_name: m.seconds}))
        elif m.section == "sparse":
            sd = by.get((m.case, "torch:sdpa", m.load))
            if sd and sd.seconds:
                out.append(Ratio(f"{m.case} {m.pattern}: time/(ρ·dense)", base_name, m.load,
                                 m.seconds / (m.density * sd.seconds), f"{base_name} s / (ρ · torch:sdpa dense s)",
                                 "≤ 1.3" if m.n in TARGET_NS["sparse"] else "",
                                 {"torch:sdpa": sd.seconds, base_name: m.seconds, "rho": m.density}))
    for m in res.measurements:  # FlexAttention on the sparse patterns, for the table beside ours
        if m.section == "sparse" and m.impl.startswith("torch:flex") and m.seconds:
            sd = by.get((m.case, "torch:sdpa", m.load))
            if sd and sd.seconds:
                out.append(Ratio(f"{m.case} {m.pattern}: time/(ρ·dense)", "torch:flex", m.load,
                                 m.seconds / (m.density * sd.seconds), "torch:flex s / (ρ · torch:sdpa dense s)", "",
                                 {"torch:sdpa": sd.seconds, "torch:flex": m.seconds, "rho": m.density}))
    # time exponent of the causal window, forward, per implementation (quiet)
    impls = {m.impl for m in res.measurements if m.section == "window" and not m.backward}
    for impl in sorted(impls):
        pts = sorted((m.n, m.seconds) for m in res.measurements if m.section == "window" and not m.backward
                     and m.impl == impl and m.load == "quiet" and m.seconds)
        if len(pts) >= 2:
            e = fit_exponent(*zip(*pts))
            out.append(Ratio(f"window fwd time exponent n={pts[0][0]}..{pts[-1][0]}", impl, "quiet", e,
                             "least-squares slope of log s against log n", "≤ 1.05" if impl.startswith("attnlab") else "",
                             {str(n): s for n, s in pts}))
    # memory vs SDPA
    mem = {r["impl"]: r["peak_bytes"] for r in res.memory if r.get("peak_bytes")}
    for impl, b in mem.items():
        if impl != "torch:sdpa" and mem.get("torch:sdpa"):
            out.append(Ratio(f"dense fp32 fwd+bwd n={cfg.memory_n}: peak memory vs SDPA", impl, "quiet",
                             b / mem["torch:sdpa"], f"{impl} peak bytes / torch:sdpa peak bytes",
                             "≤ 1.2" if cfg.memory_n in TARGET_NS["memory"] else "",
                             {"torch:sdpa": mem["torch:sdpa"], impl: b}))
    # how much each ratio drops under load: busy / quiet of the same ratio
    quiet = {(r.name, r.impl): r for r in out if r.load == "quiet" and r.value}
    for r in [r for r in out if r.load == "busy" and r.value]:
        q = quiet.get((r.name, r.impl))
        if q:
            lower_is_better = "time/(ρ·dense)" in r.name
            kept = (q.value / r.value) if lower_is_better else (r.value / q.value)
            out.append(Ratio(f"{r.name}: kept under load", r.impl, "busy/quiet", kept,
                             "busy ratio / quiet ratio (inverted for time/(ρ·dense)); 1 = no drop", "≥ 0.8",
                             {"quiet": q.value, "busy": r.value}))
    return out


# -- files ------------------------------------------------------------------------------------------------
def _save(res: KernelsResult, out: Path):
    """Each finished case lands on disk at once: a killed run keeps what it measured."""
    atomic_write_json(out / "results.json", asdict(res))


def _write(res: KernelsResult, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    files = [out / "results.json", out / "report.md"]
    impls = sorted({m.impl.split(" [")[0] for m in res.measurements})
    colours = {name: plt.get_cmap("tab10")(i % 10) for i, name in enumerate(impls)}

    # window: time vs n, log-log, one line per implementation and load
    win = [m for m in res.measurements if m.section == "window" and not m.backward and m.seconds]
    if win:
        fig, ax = plt.subplots(figsize=(7.5, 5))
        for (impl, load) in sorted({(m.impl, m.load) for m in win}):
            pts = sorted((m.n, m.seconds) for m in win if m.impl == impl and m.load == load)
            x, y = zip(*pts)
            ax.loglog(x, y, marker="o" if load == "quiet" else "x", linestyle="-" if load == "quiet" else "--",
                      color=colours[impl], label=f"{impl} ({load})")
        ns = sorted({m.n for m in win})
        ax.set_xticks(ns)
        ax.set_xticklabels([str(n) for n in ns], rotation=30 if len(ns) > 4 else 0)
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # only the measured n are labelled
        ax.set_xlabel("sequence length n")
        ax.set_ylabel("seconds per forward call (median)")
        ax.set_title(f"causal sliding window {res.config['window']}: forward time")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        save_figure(fig, out / "window.png")
        files.append(out / "window.png")

    # sparse: time/(ρ·dense) per pattern, grouped bars (patterns on x, implementations as bars)
    sp = [r for r in res.ratios if "time/(ρ·dense)" in r.name and r.load == "quiet" and r.value]
    if sp:
        names = sorted({r.name for r in sp})
        who = sorted({r.impl for r in sp})
        fig, ax = plt.subplots(figsize=(max(7.0, 1.3 * len(names) * max(1, len(who)) / 2), 5))
        w = 0.8 / len(who)
        for k, impl in enumerate(who):
            vals = [next((r.value for r in sp if r.name == nm and r.impl == impl), float("nan")) for nm in names]
            ax.bar([i + k * w for i in range(len(names))], vals, width=w, color=colours.get(impl), label=impl)
        ax.axhline(1.3, color="black", linestyle=":", linewidth=1, label="target 1.3")
        ax.set_xticks([i + 0.4 - w / 2 for i in range(len(names))])
        ax.set_xticklabels([nm.replace(": time/(ρ·dense)", "").replace(" n=", "\nn=") for nm in names],
                           rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("time / (ρ · dense SDPA time)")
        ax.set_title("block-sparse patterns (lower is better)")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        save_figure(fig, out / "sparse.png")
        files.append(out / "sparse.png")

    # headline speed ratios, quiet vs busy, horizontal bars (one row per ratio x implementation)
    hd = [r for r in res.ratios if r.value and r.load in ("quiet", "busy") and "speed vs" in r.name]
    if hd:
        rows = sorted({(r.name, r.impl) for r in hd})
        fig, ax = plt.subplots(figsize=(9, max(3.0, 0.32 * len(rows) + 1.2)))
        for k, load in enumerate(("quiet", "busy")):
            vals = [next((r.value for r in hd if (r.name, r.impl) == row and r.load == load), 0.0) for row in rows]
            ax.barh([i + 0.4 * k for i in range(len(rows))], vals, height=0.4,
                    color=("tab:blue", "tab:orange")[k], label=load)
        ax.set_yticks([i + 0.2 for i in range(len(rows))])
        ax.set_yticklabels([f"{impl} · {name}" for name, impl in rows], fontsize=7)
        ax.set_xscale("log")
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_xlabel("speed ratio (baseline time / implementation time; > 1 = faster)")
        ax.set_title("headline speed ratios, quiet vs a busy CPU")
        ax.legend(fontsize=8)
        ax.invert_yaxis()
        save_figure(fig, out / "ratios.png")
        files.append(out / "ratios.png")
    res.files = [str(f) for f in files]
    atomic_write_text(out / "report.md", _markdown(res))
    atomic_write_json(out / "results.json", asdict(res))
    return res.files


def _fmt(x, nd=2):
    return "" if x is None else f"{x:.{nd}f}"


def _markdown(res: KernelsResult) -> str:
    c = res.config
    rounds = (f"{c['rounds']} interleaved rounds per case" if c["min_rounds"] >= c["rounds"] else
              f"{c['min_rounds']}–{c['rounds']} interleaved rounds per case (fewer for slow cases)")
    lines = ["# attnlab bench kernels", "",
             f"CPU: {res.cpu_summary}", "",
             "Measured matrix-product peak (best of repeats, this run): " +
             ", ".join(f"{k} {v:.1f} GFLOP/s" for k, v in res.peaks_gflops.items()), "",
             f"torch {res.env.get('torch')} · {res.env.get('threads')} threads · B={c['B']}, H={c['H']}, D={c['D']} · "
             f"{rounds}, median of per-call means (short calls repeated to fill {c['min_sample_s']} s) · "
             f"run took {res.seconds:.0f} s", "",
             "Busy = the same case while another process loops 1024³ matrix products "
             f"({c['contention_threads']} thread{'s' if c['contention_threads'] != 1 else ''}).", ""]
    lines += ["## Headline ratios", "",
              "Quiet and busy side by side; *kept* = busy ÷ quiet (inverted for time/(ρ·dense)), 1 = no drop. "
              "Every value divides two medians of the same case and load (results.json lists them).", "",
              "| ratio | implementation | quiet | busy | kept | target | computed as |", "|---|---|---|---|---|---|---|"]
    rows: dict = {}
    for r in res.ratios:
        if r.load == "busy/quiet":
            rows.setdefault((r.name.removesuffix(": kept under load"), r.impl), {})["kept"] = r
        else:
            rows.setdefault((r.name, r.impl), {})[r.load] = r
    for (name, impl), d in rows.items():
        first = d.get("quiet") or d.get("busy")
        if first is None:
            continue
        lines.append(f"| {name} | {impl} | {_fmt(d['quiet'].value) if 'quiet' in d else ''} | "
                     f"{_fmt(d['busy'].value) if 'busy' in d else ''} | {_fmt(d['kept'].value) if 'kept' in d else ''} | "
                     f"{first.target} | {first.definition} |")
    lines += ["", "## Measurements (median seconds)", "",
              "| case | implementation | load | ρ | median ms | rounds × calls | Flex compile s | Flex mask s | skipped because |",
              "|---|---|---|---|---|---|---|---|---|"]
    for m in res.measurements:
        lines.append(f"| {m.case} | {m.impl} | {m.load} | {_fmt(m.density, 3) if m.density < 1 else ''} | "
                     f"{_fmt(m.seconds * 1e3 if m.seconds else None)} | "
                     f"{f'{len(m.times)} × {m.calls_per_sample}' if m.times else ''} | "
                     f"{_fmt(m.compile_s, 1)} | {_fmt(m.mask_s, 2)} | {m.skipped or ''} |")
    if res.memory:
        lines += ["", "## Peak memory, forward+backward (fresh process each)", "",
                  "| case | implementation | peak MiB | skipped because |", "|---|---|---|---|"]
        for r in res.memory:
            lines.append(f"| {r['case']} | {r['impl']} | {_fmt(r['peak_bytes'] / 2**20 if r['peak_bytes'] else None, 1)} | "
                         f"{r['skipped'] or ''} |")
    if res.notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in res.notes]
    lines += ["", "Plots: " + ", ".join(Path(f).name for f in res.files if f.endswith(".png"))]
    return "\n".join(lines) + "\n"
