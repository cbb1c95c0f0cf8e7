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
Files (written atomically): results.json, report.md, window.png, sparse.png, ratios.png. The cases and
their timing live in :mod:`attnlab.bench.kernels_cases`, the ratios and report in
:mod:`attnlab.bench.kernels_report`.

Legend: B batch, H heads, n sequence length (L = S = n), D head dim, ρ fraction of (query, key) pairs kept.
"""
from __future__ import annotations
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from attnlab import cpu
from attnlab.functional import METHODS

from ..harness import threads
from ..resources import check_memory
from ..report import environment
from .fit import fit_exponent
from .impls import peak_in_fresh_process
from .kernels_cases import (DTYPES, TARGET_NS, Contention, KernelsConfig, Measurement, Ratio,
                            build_impl, flex_backward_reason, flex_block_mask, flex_compiler, make_case_pattern,
                            measure_case, window_mask_mod)
from .kernels_report import KernelsResult, compute_ratios, save_partial

__all__ = ["KernelsConfig", "KernelsResult", "Measurement", "Ratio", "run", "build_impl", "make_case_pattern",
           "flex_block_mask", "window_mask_mod", "compute_ratios", "fit_exponent", "DTYPES", "TARGET_NS"]


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

    ``progress(done, total, label)`` is called before each case and once at the end. Raises ValueError
    for a config that cannot be measured (see :meth:`KernelsConfig.validate`) or whose longest length
    would not fit in memory, before anything is measured.
    """
    cfg = config or KernelsConfig()
    cfg.validate()
    n = max((*cfg.dense_ns, *cfg.bf16_ns, *cfg.window_ns, *cfg.window_bwd_ns, cfg.sparse_n, cfg.memory_n or 0))
    # query, key, value, output and their gradients, float32 [B, H, n, D], at the longest length timed
    check_memory(f"a length of {n} (--dense-ns, --window-ns, --sparse-n, --memory-n)", 8 * 4 * cfg.B * cfg.H * n * cfg.D,
                 "float32 inputs, outputs and gradients at that length")
    with threads(cfg.threads):
        return _run(cfg, progress)


def _run(cfg: KernelsConfig, progress) -> KernelsResult:
    t_start = time.perf_counter()
    out = Path(cfg.out)
    res = KernelsResult(config=asdict(cfg), out_dir=str(out), env=environment())
    peak_n = 1024 if max(cfg.dense_ns + cfg.window_ns + (cfg.sparse_n,)) >= 2048 else 256
    res.peaks_gflops = cpu.matmul_peaks((torch.float32, torch.bfloat16), n=peak_n, seconds=0.5)
    res.cpu, res.cpu_summary = cpu.INFO.as_dict(), cpu.summary(peaks=False)
    flex, flex_reason = flex_compiler() if cfg.flex else (None, "FlexAttention disabled (flex=False)")
    cases = _plan_cases(cfg)
    busy = [c for c in cases if c[6]] if cfg.contention else []
    total = len(cases) + len(busy) + (1 if cfg.memory_n else 0)
    flex_bwd_reason = None
    if flex is not None and any(c[4] for c in cases):
        if progress:
            progress(0, total, "probing FlexAttention backward (separate process)")
        flex_bwd_reason = flex_backward_reason()
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
        ms = measure_case(cfg, case, section, n, dtype, bwd, load, impls, pattern, dens)
        for m in ms:
            if m.impl == "torch:flex" and m.seconds and ("window", n) in masks:
                m.mask_s = masks[("window", n)][1]
        return ms

    def sweep(todo, load):
        nonlocal done
        for c in todo:
            if progress:
                progress(done, total, f"{load} · {c[0]}")
            res.measurements += one(c, load)
            done += 1
            save_partial(res, out)

    sweep(cases, "quiet")
    if busy:
        with Contention(cfg.contention_threads):
            sweep(busy, "busy")
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
    res.write()
    if progress:
        progress(total, total, "done")
    return res


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
    ms = measure_case(cfg, case, "sparse", n, "float32", bwd, load, impls)
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
            try:
                row["peak_bytes"] = peak_in_fresh_process(spec, timeout=1800)["peak_bytes"]
            except RuntimeError as e:  # recorded in the report; the other implementations go on
                row["skipped"] = str(e)[:200]
        rows.append(row)
    return rows
