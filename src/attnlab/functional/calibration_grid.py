"""The calibration grid's measurements (``functional.calibration``): what it measures, its sizes
(``CalibrationConfig``) and errors, inputs, ratios of interleaved timings, the fits of the size thresholds, and
the training and decode steps of the grid.

The grid (each case timed against the others it decides between, interleaved rounds, medians):

1. the compiled kernel on dense fp32 at each block shape of ``planner.COMPILED_BLOCK_SPEED`` → its
   relative speed per pair (the fastest 1.0), and its best tiles' GFLOP/s (``KERNEL_GFLOPS["compiled"]``);
2. the gathered sparse kernel on a causal sliding window at each block edge of ``SPARSE_BLOCK_SPEED``
   → GFLOP/s of the pairs it computes;
3. SDPA, the tiled and the dense kernel on the same dense fp32 call → their GFLOP/s (``KERNEL_GFLOPS``:
   the built-in ``Kernel.gflops`` are estimates from another machine);
4. per dtype and size (``dense_ns``, the last one ``n``), dense and causal, MHA and GQA (``plain_heads``
   query heads on ``plain_heads`` or ``gqa_kv_heads`` key/value heads: Note [The plain grid's heads]), the
   compiled kernel against SDPA → ``COMPILED_DENSE_MIN_PAIRS`` (MHA) and ``COMPILED_GQA_MIN_PAIRS``: per
   dtype and mask (dense, causal), the calls' pairs (H·n²) from which the compiled kernel is at least
   ``MARGIN`` faster (Note [No margin for SDPA]), by a line fitted to log(speed ratio) over log(pairs)
   (``_least_pairs``; None: it never wins), and ``COMPILED_DENSE_DTYPES``: the dtypes where it wins both
   MHA cases at the largest size (``bench planner`` showed the choice turns on the size: on a 2-core Zen 5
   the compiled kernel ran dense bf16 1.4-2.3x SDPA from n = 1024 but about half SDPA's speed at 8 x 512²).
   Note [Calibration against the sweep]: one fit for dense and causal together, MHA alone, and ratios of
   medians of 5 rounds disagreed with ``bench planner`` by 9-16 % under ``ONEDNN_MAX_CPU_ISA=AVX2`` (bf16:
   causal's ratios pulled dense's line under MARGIN, "never" where the sweep had the compiled kernel
   1.10-1.13x SDPA from 8 x 2048²; GQA, which SDPA runs on copied K/V, won from 2 x 8 x 512² where MHA lost).
   So each mask kind and MHA/GQA has its own line, and every ratio is the median of per-round ratios (each
   round times the two kernels back to back, so a load change between rounds cancels) over at least
   ``min_rounds``. What pairing cannot fix: under a load above the core count (2.8 on 2 cores) every 2-thread
   call waits for a descheduled thread, so calls shorter than the scheduler's 4 ms tick read whole ticks (a
   0.3 ms decode call and its SDPA both 8.00 ms, an fp32 512² call 8.0 against 11.6 ms), ratios collapse
   towards 1 and under MARGIN, and the file would say SDPA everywhere: the grid refuses such samples
   (Note [Tick-bound samples] in ``functional.calibration``);
5. on the same window, the compiled and the sparse kernel at their chosen blocks → ``SPARSE_OVER_COMPILED``:
   the compiled kernel's speed per computed pair over the sparse kernel's;
6. per dtype, plain decode calls (one query, ``decode_heads`` heads, MHA and GQA, cache lengths
   ``decode_ns``) on the decode path against SDPA → ``DECODE_OVER_SDPA``: SDPA's time over the decode
   path's at each length, and ``DECODE_MIN_KEYS``: the length from which the decode path wins, where a
   line fitted to log(ratio) over log(S) crosses 1 (``_least_keys``; Note [Plain MHA decode] in
   ``attnlab.kernels.planner``); the same for the plain steps → ``STEP_OVER_SDPA``, ``STEP_MIN_KEYS`` (each door
   its own crossing: Note [Each door its crossing]). The lengths span the sweep's
   (1024 ... 8192: the fit is not extrapolated below the shortest, and on the AMX Xeon bf16 MHA's two doors
   measured 0.74 and 1.08 at 1024, 0.84 and 1.10 at 2048, so a grid from 2048 sent the sweep's S 1024 to the
   decode path at 1.34x SDPA's time; on the Zen
   machine the decode path went from 0.73x SDPA at 2048 to 1.29x at 8192). One ratio per dtype and heads,
   the geometric mean over the lengths, could not follow that: it said "SDPA" (0.97-0.99) where the sweep's
   4096 measured the decode path 1.16x, or "decode path" where S = 1024 ran SDPA 1.2x faster.

Note [The plain grid's heads]: 4) ran on the grid's ``heads`` (4; GQA 4 on 1) and the AVX2 sweep then
missed 4 of its 62 calls by 10-14 %: on one key/value head SDPA's GQA copy is a quarter of the sweep's
(B = 2, H = 8 on Hkv = 2), and fp32 GQA measured at most 1.08x SDPA at 4 x 2048², fitting "never" where the
sweep's 2 x 8 x 1024² ran the compiled kernel 1.14x; bf16 MHA's points, 4 x 1024² (0.95x) and 4 x 2048²
(1.10x), put the threshold above the sweep's 8 x 1024² (1.10x). 4) now runs 8 query heads, on 8 or 2
key/value heads (the group size of the sweep's GQA and of common models; pairs 8n², so n = 1024 is 8.4M
pairs, the sweep's point): with samples of at least ``min_sample_s`` the larger calls cost about 10 % more.

Without the compiled extension only 2) and 3) are measured (the others keep the built-in table's values);
without the decode extension 6) is skipped.

Legend: H heads, L query length, S key length, D head dim; n the grid's sequence length.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

import torch

from .. import kernels as K
from ..kernels import planner
from ..kernels.spec import Request
from ..shapes import prepare

__all__ = ["kernel_call", "decode_ratios", "train_ratios", "MARGIN", "CalibrationConfig", "TooNoisy",
           "Preempted", "Cancelled", "Tick"]

# Note [No margin for SDPA]: the compiled kernel takes a plain dense/causal call where it measured faster than
# SDPA at all (MARGIN = 1), not by a safety margin. The planner's promise is "the fastest kernel", judged
# within 5 %: where the two are within 5 % of each other either pick keeps it, so a margin can only turn
# calls the compiled kernel wins by 5-13 % over to SDPA. With MARGIN = 1.05 the quiet AVX2 sweep
# (ONEDNN_MAX_CPU_ISA=AVX2, 62 calls) picked within 5 % in 91.9 % of them: every miss a causal call the
# compiled kernel ran 1.06-1.15x faster while the grid measured it 1.00-1.04x; refitted from the same
# calibration's measurements with MARGIN = 1 (``bench.planner.replay``), 98.4 % (natively 96.8 -> 98.4 %).
#: the speed ratio over SDPA from which the compiled kernel takes plain dense/causal calls of a dtype
MARGIN = 1.0


class TooNoisy(RuntimeError):
    """The calibration's samples were tick-bound or scattered (Note [Tick-bound samples]): nothing was fitted
    or written."""


class Preempted(RuntimeError):
    """The process's own work ran while the background grid timed (Note [Calibration yields]): the grid stopped
    at its next clock reading; nothing was fitted or written."""


class Cancelled(RuntimeError):
    """The calibration was cancelled (its ``cancel`` event was set: the interpreter is exiting, Note [Calibration
    at exit]) before it finished: nothing was fitted or written."""


@dataclass(frozen=True)
class CalibrationConfig:
    """The grid's sizes: q, k, v [1, heads, n, dim]; ``window`` for the band cases; ``dtypes`` for 4) and 6);
    decode: q [1, decode_heads, 1, dim] against K/V of each length in ``decode_ns`` (GQA: 4 query heads per
    key/value head)."""

    n: int = 2048
    heads: int = 4
    dense_ns: tuple = (512, 1024)  # smaller sizes of 4), below n
    # 4)'s head layouts (Note [The plain grid's heads]): MHA plain_heads x plain_heads, GQA plain_heads query heads
    # on gqa_kv_heads key/value heads
    plain_heads: int = 8
    gqa_kv_heads: int = 2
    dim: int = 64
    window: int = 256
    dtypes: tuple = (torch.float32, torch.bfloat16)
    decode_heads: int = 8
    decode_ns: tuple = (1024, 2048, 4096, 8192)
    # 7) forward + backward (Note [Plan the pass that runs]): plain_heads x plain_heads MHA at these lengths
    train_ns: tuple = (512, 1024, 2048)
    # each sample spans many 4 ms scheduler ticks: on a shared machine a 20 ms sample is quantised to them
    # (bench planner's rounds under a load of 4-6 on 2 cores read 8.00, 16.02, 20.04 ms)
    # (Note [Calibration against the sweep]: 5 rounds' medians moved a ratio by 10 %; 9 rounds, never fewer
    # than 5, fit the 60 s budget on 2 cores)
    rounds: int = 9
    min_rounds: int = 5
    min_sample_s: float = 0.05
    budget_s: float = 50.0


Tick = Callable[[int, int, str], None]


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


# Note [One size past the grid]: the plain grid measures n up to 2048 (its budget), the sweep's plain calls reach
# 4096. On the AMX Xeon the bf16 causal MHA ratios rose 0.66, 0.85, 0.96 over n = 512, 1024, 2048; the line
# stopped at 2048 under MARGIN, so the fit said "never", and the sweep's n = 4096 ran the compiled kernel 1.11x
# SDPA with auto on SDPA (its worst miss; the headline's busy bf16 causal forward at n 4096, 0.78x the fastest).
# So a rising line is followed one doubling of n past the grid (4x its pairs): a crossing there is kept. Not
# further: a line through three sizes says little about 16x their pairs, and SDPA, the default, keeps those.
#: how far past the grid's largest pairs a rising fit's crossing is kept (one doubling of n)
EXTRAPOLATE_PAIRS = 4.0


def _least_pairs(points: list[tuple[float, float]]) -> float | None:
    """The pairs from which the compiled kernel is ``MARGIN`` faster than SDPA, from ``points`` = [(pairs,
    SDPA's time / the compiled kernel's)] over the grid's sizes of one mask kind (Note [Calibration against the
    sweep]): a least-squares line of log(ratio) against log(pairs) (one noisy size moves it less than it moves a
    per-size verdict), where it crosses log(MARGIN). Never below the smallest size measured (SDPA, the default,
    keeps the small calls the grid did not measure). Above the largest, a rising line is followed as far as
    ``EXTRAPOLATE_PAIRS`` times its pairs (Note [One size past the grid]); None when it crosses later, or falls."""
    xs = [math.log(p) for p, _ in points]
    ys = [math.log(r) for _, r in points]
    lo, hi = min(xs), max(xs)
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var > 0 else 0.0
    at = lambda x: my + slope * (x - mx)  # noqa: E731
    target = math.log(MARGIN)
    if at(hi) < target:
        if slope <= 0 or target - at(hi) > slope * math.log(EXTRAPOLATE_PAIRS):
            return None
        return float(math.exp(mx + (target - my) / slope))  # past the largest size, within one doubling of n
    if at(lo) >= target:
        return float(min(p for p, _ in points))
    return float(math.exp(mx + (target - my) / slope))  # slope > 0 here: it crosses between lo and hi


# Note [SDPA keeps decode by a margin]: the plain-decode rule serves three doors, and the grid times the calls of
# one, ``attention()``'s direct calls. At the KV-cache door and the HF step a plain step is one extension call on
# the decode kernel, but checks, views and SDPA on SDPA's side: per call, in one harness on the AMX Xeon (MHA 8 x
# 64, S 2048-8192, 9 interleaved rounds, hot / after a 64 MiB pass), that side took 1.08-1.24x / 1.14-1.47x the
# time of ``DECODE.step``, while SDPA called direct took 0.81-1.05x / 0.92-0.98x. Multi-head decode sits at that
# tie (the grid's ratios 0.98, 1.05, 0.98 over S 2048-8192 in fp32), so the fit's verdict flipped between runs,
# and on SDPA's side bench decode's cold MHA rows at S 4096 ran 0.73-0.84x SDPA at the KV-cache door where the
# decode kernel had run 1.00x. So SDPA keeps a plain decode call only where it measured DECODE_MARGIN faster: in
# a tie the decode kernel, which ``attention()`` runs within that margin and the other doors run faster. Since
# Note [Each door its crossing] the grid times both doors and fits each its own crossing, so the cross-door case
# above no longer rests on the margin; it stays as the tie-break at each door (the sweep that met 95 % at kernel
# code 89bfdd6a8a55 was fitted with it).
#: how much faster SDPA must measure (SDPA's time over the decode path's under 1 / this) to keep plain decode
DECODE_MARGIN = 1.05


def _least_keys(points: list[tuple[int, float]]) -> float | None:
    """The cache length from which the decode path takes plain decode calls, from ``points`` = [(S, SDPA's time /
    the decode path's)] (step 6): where a least-squares line of log(ratio) against log(S) crosses
    -log(DECODE_MARGIN) (Note [SDPA keeps decode by a margin]), never outside the lengths measured: 0.0 (every
    length) when the line is over it at the shortest and at the longest length (the one-length case included:
    its verdict), None (never) when it is under it at the longest (the threshold model has no "up to": a line
    falling with S that wins only short caches keeps SDPA). Not extrapolated below the shortest length: a busy
    grid measured bf16 MHA at 1.00-1.10x where a quiet one measured 10x, and its line's extrapolation sent caches
    under 1615 keys to SDPA."""
    xs = [math.log(n) for n, _ in points]
    ys = [math.log(r) + math.log(DECODE_MARGIN) for _, r in points]  # 0: SDPA exactly DECODE_MARGIN faster
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


# Note [Each door its crossing]: step 6 times plain decode calls at the two doors that take them, and each door
# gets its own crossing: SDPA's time over the decode path's for ``attention(q, k, v)``'s prepared calls (each
# kernel's direct path, Note [Calibrate what runs]), fitted to ``Rates.decode_min_keys``; and for the plain steps of
# the KV-cache API and the HF step on a heads-first cache (``DECODE.step``, the one-call step, against
# ``SDPA.step``, its checks in the extension and SDPA on views: csrc Notes [One-call decode step], [SDPA steps]),
# fitted to ``Rates.step_min_keys``. The doors' fixed costs differ, so their crossings do. On the AMX Xeon (H 8,
# D 64, hot, 9 paired rounds) SDPA over the decode path read, at S 1024 / 2048 / 4096 / 8192:
#   attention's calls  fp32 MHA 0.89 / 0.95 / 1.02 / 0.97   bf16 MHA 0.69 / 0.70 / 0.96 / 0.84
#   the steps          fp32 MHA 1.35 / 1.25 / 1.20 / 1.11   bf16 MHA 1.06 / 1.08 / 1.24 / 0.99
# (GQA: the decode path faster at both, 1.03-3.6x). SDPA's step pays 12-20 us more than SDPA on the caller's
# tensors (the views of the cache, sliced and transposed back), and the decode path's direct call 6-12 us more
# than its step (the transposes and a Python layer). One rule fitted between the doors (the geometric mean of
# the two ratios, the stop before this one) sent fp32 MHA to the decode path at both, and ``bench planner``'s
# ``attention`` decode calls ran 1.07-1.21x the fastest kernel's time at S 1024 and 4096 in three sweeps. The
# rule is still one function, ``Rates.plain_decode_on_sdpa``, which every door asks with its own door
# (tests/functional/test_one_decode_rule.py); a table without the steps' crossing (written before it) gives the
# steps ``attention``'s.
def _decode_ratios(cfg: CalibrationConfig, timed_rounds, step, ratio=None) -> tuple[dict, dict]:
    """({(dtype, gqa): {S: SDPA's time over the decode path's at cache length S}} for ``attention``'s calls, the same
    for the plain steps) over ``cfg.decode_ns`` (step 6; Note [Each door its crossing]). The steps' dict lacks a
    key where no extension build takes the step."""
    calls_out, steps_out = {}, {}
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
                case = f"{'gqa' if gqa else 'mha'} {name} S={S}"
                calls[f"decode {case}"] = _kernel_call(q, k, v, K.DECODE, enable_gqa=gqa)[0]
                calls[f"{K.SDPA.name} {case}"] = _kernel_call(q, k, v, K.SDPA, enable_gqa=gqa)[0]
                # the steps: q [1, 1, H, D], the cache [1, S, Hkv, D], views of heads-first storage
                qf, kc, vc, sc = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), D ** -0.5
                steps = K.DECODE.step(qf, kc, vc, None, None, S, None, False, sc) is not None
                if steps:  # (None: no extension build for this CPU takes the step)
                    calls[f"decode step {case}"] = lambda qf=qf, kc=kc, vc=vc, S=S, sc=sc: K.DECODE.step(
                        qf, kc, vc, None, None, S, None, False, sc)
                    calls[f"{K.SDPA.name} step {case}"] = lambda qf=qf, kc=kc, vc=vc, S=S, sc=sc: K.SDPA.step(
                        qf, kc, vc, None, None, S, sc)
                cases.append((gqa, S, case, steps))
        t = timed_rounds(calls) if calls else {}
        r = ratio or _ratio
        for gqa, S, c, steps in cases:
            calls_out.setdefault((dt, gqa), {})[S] = r(t, f"{K.SDPA.name} {c}", f"decode {c}")
            if steps:
                steps_out.setdefault((dt, gqa), {})[S] = r(t, f"{K.SDPA.name} step {c}", f"decode step {c}")
        step(f"decode path vs sdpa, {name}")
    return calls_out, steps_out


kernel_call, decode_ratios, train_ratios = _kernel_call, _decode_ratios, _train_ratios
