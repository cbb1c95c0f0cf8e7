"""One timer for every instrument: warm-up calls, then interleaved rounds, and the median.

Note [Median, interleaved]: on a shared machine a process can be paused or starved for a while inside
one call; the median ignores such outliers where the mean does not. When several implementations are
compared, their samples are taken in rounds whose order rotates, so a slow spell of the machine falls
on all of them instead of on whichever happened to run then. Each figure is reported beside the raw
samples, never compared across runs.

Note [Paired samples]: two callables that should cost almost the same (``auto`` and the kernel it picks)
are compared best by pairs: timed back to back in every round, the order flipped each round, with the same
calls per sample, their ratio in round r (``paired_ratio``: the median over rounds) sees the same state of
the machine in numerator and denominator. A ratio of two separate medians carries the rounds' spread of
both (on the shared 2-core machine ±20-50 % a round).

Note [Pair order]: the flipped order does not cancel by itself under the median. Beside a CPU-bound process the
pair's first sample ran slower than its second, whichever callable it was: auto against the very kernel it runs
(fp32 dense, n 4096, 16 rounds, the AMX Xeon) read 1.08 in the rounds auto went first and 0.93 in the others,
each round 0.78-1.38. A median over 7 rounds (4 of one order, 3 of the other) leans towards the order with more
rounds, and the record's busy headline read auto 0.88-0.91x "the fastest" where auto ran the fastest kernel. So
``paired_ratio`` is the geometric mean of the two orders' medians, which cancels any factor the order multiplies
in (the overall median where an order has fewer than two rounds).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["Timing", "time_call", "interleaved", "paired_ratio", "median_rate"]


@dataclass
class Timing:
    """The samples of one callable: ``times`` are seconds per call (each sample the mean of
    ``calls_per_sample`` back-to-back calls); ``median`` is their median; ``first_s`` the first
    (warm-up) call, which includes any compilation."""

    times: list[float] = field(default_factory=list)
    calls_per_sample: int = 1
    first_s: float | None = None

    @property
    def median(self) -> float | None:
        """Median seconds per call, or None without samples."""
        return statistics.median(self.times) if self.times else None


def time_call(f: Callable[[], object], repeats: int = 3, warmup: int = 1, budget_s: float | None = None) -> float:
    """Median wall time in seconds of ``repeats`` calls of ``f()``, after ``warmup`` untimed calls.

    budget_s: when given, fewer timed calls (at least one) if the warm-up shows that ``repeats`` of them
    would take longer. ``time.perf_counter`` around each call; no CUDA synchronisation (attnlab measures
    on the CPU). Raises ValueError for ``repeats`` < 1 or ``warmup`` < 0."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"time_call: repeats must be >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    t0 = time.perf_counter()
    for _ in range(warmup):
        f()
    if budget_s is not None:
        once = (time.perf_counter() - t0) / max(warmup, 1)
        repeats = max(1, min(repeats, int(budget_s / max(once, 1e-9))))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return float(statistics.median(ts))


def interleaved(calls: dict[str, Callable[[], object]], *, rounds: int = 5, min_rounds: int = 3,
                min_sample_s: float = 0.05, budget_s: float = 120.0, pairs: dict[str, str] | None = None,
                clock: Callable[[], float] = time.perf_counter) -> dict[str, Timing]:
    """Time several callables against each other (Note [Median, interleaved]).

    Each callable is called once to warm up (``Timing.first_s``) and once more to probe its cost; a sample
    repeats a short call until it lasts about ``min_sample_s`` (at most 1000 calls), and the number of
    rounds is ``rounds``, lowered (never under ``min_rounds``) when a round would not fit ``budget_s``.
    Round r starts at the r-th callable, so none is always first. ``pairs`` {name: partner}: each name is
    timed right beside its partner in every round, first on even rounds and second on odd ones, both with
    the same calls per sample (Note [Paired samples]; ``paired_ratio``); a pair rotates as one callable.
    Returns {name: Timing} in the order given, sample r of each from round r. ``clock``: seconds,
    ``time.perf_counter`` (the calibration's tests give a coarse one). Exceptions from a callable propagate:
    decide what to skip before timing."""
    if rounds < 1 or min_rounds < 1:
        raise ValueError(f"interleaved: rounds and min_rounds must be >= 1, got {rounds} and {min_rounds}")
    pairs = dict(pairs or {})
    paired = list(pairs) + list(pairs.values())
    if any(n not in calls for n in paired) or len(set(paired)) != len(paired):
        raise ValueError(f"interleaved: pairs {pairs} must pair distinct names of calls ({', '.join(calls)}), "
                         "each in one pair at most")
    out = {name: Timing() for name in calls}
    if not calls:
        return out
    probe = {}
    for name, f in calls.items():
        t0 = clock()
        f()
        out[name].first_s = clock() - t0
        if out[name].first_s > 1.0:
            probe[name] = out[name].first_s  # a slow call: its warm-up is a fair probe, save a call
        else:
            t0 = clock()
            f()
            probe[name] = clock() - t0
        out[name].calls_per_sample = max(1, min(1000, int(min_sample_s / max(probe[name], 1e-6))))
    for a, b in pairs.items():  # one count for both: a sample of each spans the same stretch of the machine
        out[a].calls_per_sample = out[b].calls_per_sample = min(out[a].calls_per_sample, out[b].calls_per_sample)
    per_round = sum(probe[n] * out[n].calls_per_sample for n in calls)
    lo = min(min_rounds, rounds)
    n_rounds = max(lo, min(rounds, int(budget_s / max(per_round, 1e-9))))
    units = [(n, pairs[n]) if n in pairs else (n,) for n in calls if n not in pairs.values()]
    for r in range(n_rounds):
        for unit in units[r % len(units):] + units[:r % len(units)]:
            for name in (unit if r % 2 == 0 else unit[::-1]):
                f, k = calls[name], out[name].calls_per_sample
                t0 = clock()
                for _ in range(k):
                    f()
                out[name].times.append((clock() - t0) / k)
    return out


def paired_ratio(a: Timing, b: Timing) -> float | None:
    """a's sample / b's sample of the same round (two Timings of one ``interleaved`` call, paired there: Note
    [Paired samples]), over the rounds: the geometric mean of the median over even rounds and the median over
    odd ones, the pair's two orders (Note [Pair order]); the plain median where an order has fewer than two
    rounds. None without samples. ValueError when the counts differ."""
    if len(a.times) != len(b.times):
        raise ValueError(f"paired_ratio: {len(a.times)} and {len(b.times)} samples are not one per round each")
    if not a.times:
        return None
    rs = [x / y for x, y in zip(a.times, b.times)]
    if len(rs) < 4:
        return statistics.median(rs)
    return (statistics.median(rs[0::2]) * statistics.median(rs[1::2])) ** 0.5


def median_rate(durations: list[float]) -> float | None:
    """1 / the median of ``durations`` (events per second, e.g. training steps), None when empty.

    Throughput as 1 / median rather than count / total time, for Note [Median, interleaved]'s reason."""
    return 1.0 / statistics.median(durations) if durations else None
