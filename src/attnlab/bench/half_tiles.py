"""Half-type tiles of the compiled kernel: bf16 vs its own fp32 vs SDPA, and the bf16 GEMM rate, in one run.

What issue 22's item 4 asks of a CPU without AMX: the compiled kernel's bf16 dense forward at n = 4096 at
least 1.6x its own fp32 and at least 0.5 of the bf16 GEMM rate (``torch.matmul`` measured in the same run).
Every implementation runs once per round (repeated within the round to at least ``sample_seconds``, so that a
shared CPU's scheduling quantum of ~16 ms does not round the short calls), the rounds interleaved (the order
rotates), and each figure is the median over rounds, so a neighbour's load falls on all of them alike; the
report is in ratios. The GEMM rate is the best round's (what the CPU reaches: the fraction of it is then
conservative), its median beside it.

``run(HalfTilesConfig(...)) -> dict``: measures and returns the figures (no printing, no files);
``python -m attnlab.cli.half_tiles [--quick] [--fp16]`` prints them as JSON.

Legend: B batch, H heads, n sequence length (L = S = n), E head dim; inputs [B, H, n, E] = [1, 8, n, 64].
Compiled back ends (``ATTNLAB_EXT_GEMM``, read at each call, so they compare side by side): ``auto`` and any
of ``kernels.compiled.GEMM_SETTINGS`` listed in ``backends``.
"""
from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

import attnlab

from ..kernels import compiled as ck

__all__ = ["HalfTilesConfig", "run", "gemm_rate"]


@dataclass(frozen=True)
class HalfTilesConfig:
    """ns: sequence lengths; rounds: interleaved rounds (medians over them); threads: torch threads;
    backends: ATTNLAB_EXT_GEMM values under which the compiled half types run (each its own row);
    half: the half dtypes measured; backward: also forward + backward; gemm_n: the GEMM's square size;
    sample_seconds: each sample repeats its call to at least this long."""
    ns: tuple[int, ...] = (1024, 4096)
    rounds: int = 7
    threads: int = 2
    B: int = 1
    H: int = 8
    E: int = 64
    backends: tuple[str, ...] = ("auto", "mkl")
    half: tuple[str, ...] = ("bfloat16",)
    backward: bool = True
    gemm_n: int = 2048
    sample_seconds: float = 0.25


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def gemm_rate(dtype: torch.dtype, n: int = 2048, reps: int = 3) -> float:
    """GFLOP/s of ``torch.matmul`` on [n, n] @ [n, n] in ``dtype`` (the best of ``reps`` after a warm-up)."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b
    return 2 * n ** 3 / min(_timed(lambda: a @ b) for _ in range(reps)) / 1e9


def _calls(cfg: HalfTilesConfig, n: int):
    """{name: (function, flops)} for one sequence length: each call runs one forward (or forward + backward)."""

    def inputs(dtype, grad):
        g = torch.Generator().manual_seed(n)
        return [torch.randn(cfg.B, cfg.H, n, cfg.E, generator=g).to(dtype).requires_grad_(grad) for _ in range(3)]

    def compiled(q, k, v, gemm):
        old = os.environ.get("ATTNLAB_EXT_GEMM")
        os.environ["ATTNLAB_EXT_GEMM"] = gemm
        try:
            return attnlab.attention(q, k, v, method="compiled")
        finally:
            if old is None:
                os.environ.pop("ATTNLAB_EXT_GEMM")
            else:
                os.environ["ATTNLAB_EXT_GEMM"] = old

    impls = {"sdpa fp32": (torch.float32, F.scaled_dot_product_attention),
             "compiled fp32": (torch.float32, lambda q, k, v: compiled(q, k, v, "auto"))}
    for h in cfg.half:
        dt, short = getattr(torch, h), {"bfloat16": "bf16", "float16": "fp16"}.get(h, h)
        impls[f"sdpa {short}"] = (dt, F.scaled_dot_product_attention)
        for be in cfg.backends:
            impls[f"compiled {short} {be}"] = (dt, lambda q, k, v, be=be: compiled(q, k, v, be))
    flops = 4 * cfg.B * cfg.H * n * n * cfg.E
    out = {}
    for name, (dt, f) in impls.items():
        q, k, v = inputs(dt, False)
        out[f"fwd {name}"] = ((lambda f=f, q=q, k=k, v=v: f(q, k, v)), flops)
        if cfg.backward:
            qg, kg, vg = inputs(dt, True)
            dout = torch.randn_like(qg.detach())

            def step(f=f, q=qg, k=kg, v=vg, d=dout):
                f(q, k, v).backward(d)
                q.grad = k.grad = v.grad = None
            out[f"fwd+bwd {name}"] = (step, 3.5 * flops)  # backward: 5 products to the forward's 2
    return out


def run(config: HalfTilesConfig = HalfTilesConfig()) -> dict:
    """Median seconds and GFLOP/s of every call, GEMM rates, and the ratios against SDPA and the GEMMs."""

    old_threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        res = {"config": asdict(config), "torch": torch.__version__, "extension": ck.capability(),
               "backends": {str(d).replace("torch.", ""): ck.gemm_backend(d, config.E, config.E, 512)
                            for d in (torch.float32, torch.bfloat16, torch.float16)},
               "gemm_gflops": {}, "seconds": {}, "gflops": {}, "samples": {}, "ratios": {}}
        gemm = {"float32": [], "bfloat16": []}
        for n in config.ns:
            calls = _calls(config, n)
            names = list(calls)
            times = {k: [] for k in names}
            reps = {}

            def sample(k, count):
                f, _ = calls[k]
                with torch.set_grad_enabled(not k.startswith("fwd ")):
                    return _timed(lambda: [f() for _ in range(count)]) / count
            for k in names:  # warm-up (layouts, oneDNN kernels), then the repeats per sample
                sample(k, 1)
                reps[k] = max(1, math.ceil(config.sample_seconds / max(sample(k, 1), 1e-6)))
            for r in range(config.rounds):
                order = names[r % len(names):] + names[:r % len(names)]
                for k in order:
                    times[k].append(sample(k, reps[k]))
                for dt in gemm:
                    gemm[dt].append(gemm_rate(getattr(torch, dt), config.gemm_n, reps=1))
            for k in names:
                med = statistics.median(times[k])
                res["seconds"][f"{k} n={n}"] = med
                res["gflops"][f"{k} n={n}"] = calls[k][1] / med / 1e9
                res["samples"][f"{k} n={n}"] = times[k]
        res["gemm_gflops"] = {dt: max(v) for dt, v in gemm.items()}
        res["gemm_gflops_median"] = {dt: statistics.median(v) for dt, v in gemm.items()}
        s, g = res["seconds"], res["gemm_gflops"]["bfloat16"]
        for key in list(s):
            parts = key.split()
            if parts[1] != "compiled" or parts[2] == "fp32":
                continue
            mode, n = parts[0], parts[-1]
            short = parts[2]
            res["ratios"][key] = {
                "vs compiled fp32": s[f"{mode} compiled fp32 {n}"] / s[key],
                f"vs sdpa {short}": s[f"{mode} sdpa {short} {n}"] / s[key],
                "vs sdpa fp32": s[f"{mode} sdpa fp32 {n}"] / s[key],
                "of bf16 gemm rate": res["gflops"][key] / g,
            }
        return res
    finally:
        torch.set_num_threads(old_threads)

