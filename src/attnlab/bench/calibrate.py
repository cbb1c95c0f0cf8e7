"""attnlab calibrate: measure the kernels on this CPU and fit the planner's rates (Note [Calibrated rates]
in ``attnlab.functional.rates``).

The grid (each case timed against the others it decides between, interleaved rounds, medians):

1. the compiled kernel on dense fp32 at each block shape of ``planner.COMPILED_BLOCK_SPEED`` → its
   relative speed per pair (the fastest 1.0);
2. the gathered sparse kernel on a causal sliding window at each block edge of ``SPARSE_BLOCK_SPEED``
   → GFLOP/s of the pairs it computes;
3. per dtype and size (``dense_ns``, the last one ``n``), dense and causal, the compiled kernel against
   SDPA → ``COMPILED_DENSE_MIN_PAIRS``: per dtype, the calls' pairs (H·n²) from which the compiled kernel
   is at least ``MARGIN`` faster, by a line fitted to log(speed ratio) over log(pairs) (``_least_pairs``;
   None: it never wins), and ``COMPILED_DENSE_DTYPES``: the dtypes where it wins both at the largest size
   (``bench planner`` showed the choice turns on the size: on a 2-core Zen 5 the compiled kernel ran dense
   bf16 1.4-2.3x SDPA from n = 1024 but about half SDPA's speed at 8 x 512²);
4. on the same window, the compiled and the sparse kernel at their chosen blocks → ``SPARSE_OVER_COMPILED``:
   the compiled kernel's speed per computed pair over the sparse kernel's.

Never at import: only ``calibrate()`` measures (``attnlab calibrate``, or the background thread of Note
[Background calibration] in ``attnlab.functional.rates``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from .. import patterns as P
from ..functional import planner, rates
from ..harness.timing import interleaved
from ..kernels import compiled as compiled_kernel
from ..kernels.masks import MaskSpec

__all__ = ["CalibrationConfig", "calibrate", "MARGIN"]

#: the compiled kernel takes plain dense/causal calls of a dtype only when at least this much faster than SDPA
MARGIN = 1.05


@dataclass(frozen=True)
class CalibrationConfig:
    """The grid's sizes: q, k, v [1, heads, n, dim]; ``window`` for the band cases; ``dtypes`` for 3)."""

    n: int = 2048
    heads: int = 4
    dense_ns: tuple = (512, 1024)  # smaller sizes of 3), below n
    dim: int = 64
    window: int = 256
    dtypes: tuple = (torch.float32, torch.bfloat16)
    # each sample spans many 4 ms scheduler ticks: on a shared machine a 20 ms sample is quantised to them
    # (bench planner's rounds under a load of 4-6 on 2 cores read 8.00, 16.02, 20.04 ms)
    rounds: int = 5
    min_sample_s: float = 0.05
    budget_s: float = 45.0


Tick = Callable[[int, int, str], None]


def _qkv(cfg: CalibrationConfig, dtype):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, cfg.heads, cfg.n, cfg.dim, generator=g).to(dtype) for _ in range(3))


def _least_pairs(points: list[tuple[float, float]]) -> float | None:
    """The pairs from which the compiled kernel is ``MARGIN`` faster than SDPA, from ``points`` = [(pairs,
    SDPA's time / the compiled kernel's)] over the grid's sizes, dense and causal together: a least-squares
    line of log(ratio) against log(pairs) (one noisy size moves it less than it moves a per-size verdict),
    where it crosses log(MARGIN). None when the line is under it at the largest size; never below the
    smallest size measured (SDPA, the default, keeps the calls the grid did not measure)."""
    import math

    xs = [math.log(p) for p, _ in points]
    ys = [math.log(r) for _, r in points]
    lo, hi = min(xs), max(xs)
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var > 0 else 0.0
    at = lambda x: my + slope * (x - mx)  # noqa: E731
    target = math.log(MARGIN)
    if at(hi) < target:
        return None
    if at(lo) >= target:
        return float(min(p for p, _ in points))
    return float(math.exp(mx + (target - my) / slope))  # slope > 0 here: it crosses between lo and hi


def calibrate(cfg: CalibrationConfig | None = None, tick: Tick | None = None, save: bool = True):
    """Measure the grid, fit the rates, and (``save``) write them as this machine's calibration.

    Returns (rates.Rates, measured: {case: seconds per call}, path or None). ``tick(done, total, label)``
    reports progress. Without the compiled extension only the sparse kernel's rates are measured (the
    others keep the built-in table's values)."""
    import attnlab

    cfg = cfg or CalibrationConfig()
    tick = tick or (lambda *a: None)
    base = rates.builtin()
    have_ext = compiled_kernel.available()
    sizes = tuple(sorted({m for m in cfg.dense_ns if m < cfg.n} | {cfg.n}))
    total = 3 + len(cfg.dtypes) * len(sizes) if have_ext else 1
    done, measured = 0, {}
    budget = cfg.budget_s / total

    def timed(calls):
        t = interleaved(calls, rounds=cfg.rounds, min_rounds=1, min_sample_s=cfg.min_sample_s, budget_s=budget)
        for name, tm in t.items():
            measured[name] = tm.median
        return {name: tm.median for name, tm in t.items()}

    n, scale = cfg.n, cfg.dim ** -0.5
    q, k, v = _qkv(cfg, torch.float32)
    band = P.sliding_window(cfg.window, causal=True)
    with torch.no_grad():
        # 1) the compiled kernel's speed per pair at each block shape (dense: every shape computes n^2 pairs)
        block_speed = dict(base.compiled_block_speed)
        if have_ext:
            shapes = [b for b in base.compiled_block_speed if compiled_kernel.clip_blocks(*b, n, n) == b]
            mask = MaskSpec(n, n)
            t = timed({f"compiled {b[0]}x{b[1]} dense float32": (
                lambda b=b: compiled_kernel.compiled_attention(q, k, v, mask, scale, *b)) for b in shapes})
            fastest = min(t.values())
            block_speed.update({b: fastest / t[f"compiled {b[0]}x{b[1]} dense float32"] for b in shapes})
            done += 1
            tick(done, total, "compiled kernel block shapes")
        # 2) the sparse kernel's GFLOP/s at each block edge, on the band
        flops = {bs: attnlab.explain(q, k, v, pattern=band, method="sparse", block_size=bs).flops["sparse"]
                 for bs in base.sparse_block_speed}
        t = timed({f"sparse {bs} window float32": (lambda bs=bs: attnlab.attention(
            q, k, v, pattern=band, method="sparse", block_size=bs)) for bs in base.sparse_block_speed})
        sparse_speed = {bs: flops[bs] / t[f"sparse {bs} window float32"] / 1e9 for bs in base.sparse_block_speed}
        done += 1
        tick(done, total, "sparse kernel block edges")
        dense_dtypes, soc, min_pairs = base.compiled_dense_dtypes, base.sparse_over_compiled, {}
        if have_ext:
            # 3) the compiled kernel against SDPA on plain inputs, per dtype and size
            dense_dtypes, min_pairs = [], {}
            for dt in cfg.dtypes:
                name = str(dt).removeprefix("torch.")
                points = []
                for size in sizes:
                    qd, kd, vd = _qkv(dataclasses.replace(cfg, n=size), dt)
                    calls = {}
                    for causal in (False, True):
                        kind = "causal" if causal else "dense"
                        for m in ("sdpa", "compiled"):
                            calls[f"{m} {kind} {name} n={size}"] = (lambda m=m, c=causal, qd=qd, kd=kd, vd=vd:
                                                                     attnlab.attention(qd, kd, vd, is_causal=c, method=m))
                    t = timed(calls)
                    ratios = [t[f"sdpa {kind} {name} n={size}"] / t[f"compiled {kind} {name} n={size}"]
                              for kind in ("dense", "causal")]
                    points += [(cfg.heads * size * size, r) for r in ratios]
                    if size == cfg.n and min(ratios) >= MARGIN:
                        dense_dtypes.append(dt)
                    done += 1
                    tick(done, total, f"compiled vs sdpa, {name}, n={size}")
                least = _least_pairs(points)  # one fit for dense and causal (the file keeps a slot for each)
                min_pairs.update({(dt, False): least, (dt, True): least})
            # 4) compiled against sparse per computed pair, each at its chosen blocks
            plan = {m: attnlab.explain(q, k, v, pattern=band, method=m) for m in ("compiled", "sparse")}
            t = timed({f"{m} chosen window float32": (lambda m=m: attnlab.attention(q, k, v, pattern=band, method=m))
                       for m in ("compiled", "sparse")})
            speed = {m: plan[m].flops[m] / t[f"{m} chosen window float32"] for m in ("compiled", "sparse")}
            soc = speed["compiled"] / speed["sparse"]
            done += 1
            tick(done, total, "compiled vs sparse on a window")
    fitted = rates.Rates(sparse_speed, block_speed, tuple(dense_dtypes), float(soc), "calibrated on this CPU",
                         compiled_dense_min_pairs=min_pairs)
    path = rates.save(fitted, measured) if save else None
    return (rates.current() if save else fitted), measured, path
