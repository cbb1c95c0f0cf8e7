"""Shared test helpers: per-dtype tolerances in one place and a comparison that names the worst element."""
from __future__ import annotations

import numpy as np
import torch

# Absolute/relative tolerances against the float64 reference, per dtype.
TOL = {
    torch.float64: dict(atol=1e-10, rtol=1e-9),
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
}
# A tiled/fused kernel's error against float64 may be at most this factor times the error of the naive
# same-dtype computation (PyTorch's own rule for its fused kernels), plus a floor for exact-zero cases.
FUSED_ERROR_FACTOR = 3.0


def assert_close(actual, expected, atol: float, rtol: float = 0.0, what: str = "") -> None:
    a = np.asarray(actual.detach().cpu().double() if isinstance(actual, torch.Tensor) else actual, dtype=np.float64)
    e = np.asarray(expected.detach().cpu().double() if isinstance(expected, torch.Tensor) else expected, dtype=np.float64)
    assert a.shape == e.shape, f"{what} shape {a.shape} != expected {e.shape}"
    if a.size == 0:
        return
    nan_a, nan_e = np.isnan(a), np.isnan(e)
    assert not nan_a.any() or (nan_a == nan_e).all(), f"{what}: NaN at {np.argwhere(nan_a & ~nan_e)[:3].tolist()}"
    err = np.abs(a - e)
    bound = atol + rtol * np.abs(e)
    bad = err > bound
    if bad.any():
        idx = np.unravel_index(np.argmax(err - bound), err.shape)
        raise AssertionError(f"{what} mismatch: {int(bad.sum())} of {a.size} elements; worst at {idx}: "
                             f"actual {a[idx]!r} expected {e[idx]!r} (|err| {err[idx]:.3g} > {bound[idx]:.3g})")


def max_err(a, b) -> float:
    a = torch.as_tensor(np.asarray(a)) if not isinstance(a, torch.Tensor) else a
    b = torch.as_tensor(np.asarray(b)) if not isinstance(b, torch.Tensor) else b
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
