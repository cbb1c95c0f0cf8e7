"""The calibration grid's measurements (``functional.calibration``): inputs, ratios of interleaved timings, the
fits of the size thresholds, and the training and decode steps of the grid.

Legend: H heads, L query length, S key length, D head dim; n the grid's sequence length.
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import torch

from .. import kernels as K
from ..kernels import planner
from ..kernels.spec import Request
from ..shapes import prepare

if TYPE_CHECKING:
    from .calibration import CalibrationConfig

__all__ = ["kernel_call", "decode_ratios", "train_ratios", "MARGIN"]

#: the speed ratio over SDPA from which the compiled kernel takes plain dense/causal calls of a dtype
#: (Note [No margin for SDPA] in ``functional.calibration``)
MARGIN = 1.0


def _qkv(cfg: CalibrationConfig, dtype, kv_heads: int | None = None, heads: int | None = None):
    """q [1, heads (default cfg.heads), n, dim]; k, v [1, kv_heads (default heads), n, dim]."""
    g = torch.Generator().manual_seed(0)
    heads = heads or cfg.heads
    q = torch.randn(1, heads, cfg.n, cfg.dim, generator=g).to(dtype)
    kv = kv_heads or heads
    return (q, *(torch.randn(1, kv, cfg.n, cfg.dim, generator=g).to(dtype) for _ in range(2)))


def _ratio(t: dict, slow: str, fast: str) -> float:
    """``slow``'s time over ``fast``'s: the median of the per-round ratios (Note [Calibration against the
    sweep]: ``interleaved`` times the two in the same round, so a load change between rounds cancels)."""
    a, b = t[slow].times, t[fast].times
    rs = sorted(x / y for x, y in zip(a, b))
    m = len(rs) // 2
    return rs[m] if len(rs) % 2 else math.sqrt(rs[m - 1] * rs[m])


def _ratio_spread(t: dict, slow: str, fast: str) -> float:
    """The interquartile range of the per-round ratios ``slow`` / ``fast`` over their median (0 with < 4 rounds)."""
    rs = sorted(x / y for x, y in zip(t[slow].times, t[fast].times))
    if len(rs) < 4:
        return 0.0
    q1, q3 = rs[len(rs) // 4], rs[(3 * len(rs)) // 4]
    return (q3 - q1) / rs[len(rs) // 2]


def _dense_flops(H: int, L: int, S: int, D: int) -> int:
    """The FLOPs the cost model divides by a plain dense call's rate (``Kernel.seconds``: every pair)."""
    return K.DENSE.spec.flops(Request(1, H, H, L, S, D, D), None)


def _least_pairs(points: list[tuple[float, float]]) -> float | None:
    """The pairs from which the compiled kernel is ``MARGIN`` faster than SDPA, from ``points`` = [(pairs,
    SDPA's time / the compiled kernel's)] over the grid's sizes of one mask kind (Note [Calibration against the sweep]): a least-squares
    line of log(ratio) against log(pairs) (one noisy size moves it less than it moves a per-size verdict),
    where it crosses log(MARGIN). None when the line is under it at the largest size; never below the
    smallest size measured (SDPA, the default, keeps the calls the grid did not measure)."""
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


def _least_keys(points: list[tuple[int, float]]) -> float | None:
    """The cache length from which the decode path beats SDPA on plain decode calls, from ``points`` = [(S,
    SDPA's time / the decode path's)] (step 6): where a least-squares line of log(ratio) against log(S) crosses
    0, never outside the lengths measured: 0.0 (every length) when the line is over 0 at the shortest and at
    the longest length (the one-length case included: its verdict), None (never) when it is under 0 at the
    longest (the threshold model has no "up to": a line falling with S that wins only short caches keeps
    SDPA). Not extrapolated below the shortest length: a busy grid measured bf16 MHA at 1.00-1.10x where
    a quiet one measured 10x, and its line's extrapolation sent caches under 1615 keys to SDPA."""
    xs = [math.log(n) for n, _ in points]
    ys = [math.log(r) for _, r in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var > 0 else 0.0
    if my + slope * (max(xs) - mx) < 0:
        return None
    if slope <= 0 or my + slope * (min(xs) - mx) >= 0:
        return 0.0
    return float(math.exp(mx - my / slope))  # slope > 0: it crosses between the shortest and longest lengths


def _kernel_call(q, k, v, kernel: K.Kernel, *, is_causal: bool = False, pattern=None,
                 block_size: int | None = None, enable_gqa: bool = False):
    """(run, plan): ``attention(q, k, v, ..., method=kernel.name)`` prepared and planned once, so what is
    timed is what a repeated call runs and not the checks around it: the kernel straight on q, k, v where it
    offers that (``Kernel.direct``, the plan cache's hit: Note [Decode direct call]), else its ``run`` on the
    prepared inputs. Note [Calibrate what runs]: the decode path's ``run`` rebuilds its arguments each call,
    12-25 us that a repeated ``attention`` call does not pay (H = 8, D = 64, fp32, 2 threads, load 1.2: SDPA
    over the decode path 0.84 / 0.82 / 1.18x at S = 2048 / 4096 / 8192 through ``run``, 0.94 / 0.97 / 1.25x
    direct, 0.97 / 1.02 / 1.35x through ``attention``); timed through ``run``, the grid sent S = 4096 to SDPA
    where the sweep measured the decode path 1.06x faster (Note [Plain MHA decode])."""
    p = prepare(q, k, v, None, 0.0, is_causal, None, enable_gqa, pattern).live()
    plan = planner.plan(p, kernel.name, False, False, block_size, costs=True)
    direct = plan.kernel.direct(p, plan.tiling)
    if direct is not None:
        return (lambda: direct(q, k, v)), plan
    return (lambda: plan.kernel.run(p, plan.tiling)), plan


def _train_ratios(cfg: CalibrationConfig, timings, step, ratio) -> dict:
    """Step 7: {(dtype, causal): the pairs from which the compiled kernel's forward + backward beats SDPA's}
    (``_least_pairs`` over ``train_ns``), timed through the public API with inputs that require grad."""
    import torch.nn.functional as F

    from . import attention  # the door a training call takes (function level: this module is imported by it)

    H = cfg.plain_heads
    out = {}
    for dt in cfg.dtypes:
        name = str(dt).removeprefix("torch.")
        points = {False: [], True: []}
        for n in cfg.train_ns:
            q, k, v = (x.requires_grad_() for x in _qkv(dataclasses.replace(cfg, n=n), dt, heads=H))

            def fb(run):
                def call():
                    run().float().sum().backward()
                    q.grad = k.grad = v.grad = None
                return call
            calls = {}
            for c in (False, True):
                label = f"{'causal' if c else 'dense'} {name} train n={n}"
                calls[f"sdpa {label}"] = fb(lambda c=c: F.scaled_dot_product_attention(q, k, v, is_causal=c))
                calls[f"compiled {label}"] = fb(lambda c=c: attention(q, k, v, is_causal=c, method="compiled"))
            with torch.enable_grad():
                t = timings(calls)
            for c in (False, True):
                label = f"{'causal' if c else 'dense'} {name} train n={n}"
                points[c].append((H * n * n, ratio(t, f"sdpa {label}", f"compiled {label}")))
            step(f"compiled vs sdpa forward + backward, {name}, n={n}")
        out.update({(dt, c): _least_pairs(points[c]) for c in (False, True)})
    return out


def _decode_ratios(cfg: CalibrationConfig, timed_rounds, step, ratio=None) -> dict:
    """{(dtype, gqa): {S: SDPA's time over the decode path's at cache length S}} over ``cfg.decode_ns`` (step 6)."""
    out = {}
    H, D = cfg.decode_heads, cfg.dim
    g = torch.Generator().manual_seed(1)
    for dt in cfg.dtypes:
        name, calls, cases = str(dt).removeprefix("torch."), {}, []
        for gqa in (False, True):
            Hkv = max(1, H // 4) if gqa else H
            for S in cfg.decode_ns:
                q = torch.randn(1, H, 1, D, generator=g).to(dt)
                k, v = (torch.randn(1, Hkv, S, D, generator=g).to(dt) for _ in range(2))
                if K.DECODE.name in planner.refusals(prepare(q, k, v, None, 0.0, False, None, gqa).request()):
                    continue  # e.g. a dtype the decode kernel does not take, or no extension
                run, plan = _kernel_call(q, k, v, K.DECODE, enable_gqa=gqa)
                case = f"{'gqa' if gqa else 'mha'} {name} S={S}"
                calls[f"decode {case}"] = run
                calls[f"{K.SDPA.name} {case}"] = _kernel_call(q, k, v, K.SDPA, enable_gqa=gqa)[0]
                cases.append((gqa, S, case))
        t = timed_rounds(calls)
        for gqa, S, c in cases:
            out.setdefault((dt, gqa), {})[S] = (ratio or _ratio)(t, f"{K.SDPA.name} {c}", f"decode {c}")
        step(f"decode path vs sdpa, {name}")
    return out


kernel_call, decode_ratios, train_ratios = _kernel_call, _decode_ratios, _train_ratios
