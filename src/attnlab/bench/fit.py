"""Power laws fitted to measurements: the exponent of time or memory in n, and extrapolation to plan a grid."""
from __future__ import annotations

import math

__all__ = ["fit_exponent", "extrapolate"]


def fit_exponent(ns, ys, min_n: int = 0) -> float | None:
    """Least-squares slope of log y against log n over the points with y > 0 and n >= ``min_n`` (all
    positive points when fewer than two reach ``min_n``); None with fewer than two distinct n."""
    pts = [(n, y) for n, y in zip(ns, ys) if y is not None and y > 0]
    big = [(n, y) for n, y in pts if n >= min_n]
    pts = big if len(big) >= 2 else pts
    if len(pts) < 2:
        return None
    xs, zs = [math.log(n) for n, _ in pts], [math.log(y) for _, y in pts]
    mx, mz = sum(xs) / len(xs), sum(zs) / len(zs)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (z - mz) for x, z in zip(xs, zs)) / den if den > 0 else None


def extrapolate(points: list[tuple[int, float]], n: int, default_exp: float = 2.0) -> float | None:
    """y at n from measured (n, y) points, with the exponent of the last two (at least 1; ``default_exp``
    from a single point); None without a positive point."""
    pts = [(a, y) for a, y in points if y and y > 0]
    if not pts:
        return None
    if len(pts) >= 2:
        (n1, y1), (n2, y2) = pts[-2], pts[-1]
        e = max(1.0, math.log(y2 / y1) / math.log(n2 / n1)) if n2 != n1 else default_exp
    else:
        e = default_exp
    n0, y0 = pts[-1]
    return y0 * (n / n0) ** e
