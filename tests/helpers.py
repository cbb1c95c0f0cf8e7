"""Shared test helpers: per-dtype tolerances in one place, a comparison that names the worst element, and
memory layouts (``Layout``, the hypothesis strategy ``layouts``) that give a tensor any strides with its values."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from hypothesis import strategies as st

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


# -- the int8 cache's scale search (Note [int8 scale search]) ---------------------------------------
def int8_candidate_errors(xg: torch.Tensor, candidates: int) -> torch.Tensor:
    """The oracle of Note [int8 scale search], float64: groups xg [.., n] -> the squared error of each candidate
    scale max|group| / m, m = 127, 126, ..., 128 - candidates, every element rounded to nearest: [.., candidates]
    (0 for an all-zero group)."""
    x = xg.double()
    amax = x.abs().amax(-1, keepdim=True)  # (.., 1)
    m = 127.0 - torch.arange(candidates, dtype=torch.float64)
    s = (amax / m).unsqueeze(-1)  # (.., K, 1)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = (x.unsqueeze(-2) / safe).round().clamp(-127, 127)
    return (x.unsqueeze(-2) - q * s).square().sum(-1)


def int_pv_error(q: torch.Tensor, kf: torch.Tensor, v_scale: torch.Tensor, n: torch.Tensor | int,
                 scale: float | None = None) -> float:
    """The most the decode kernel's integer P @ V moves an output element (csrc Note [Decode int8 P @ V],
    ``attnlab.kernels.decode.int_pv_bound``), from float64 softmax probabilities: q [B, L, H, D], kf the
    (dequantised) keys the scores take [B, S, Hkv, D] and v_scale each key's value scale [B, S, Hkv] (or its
    group scales [B, S, Hkv, groups]: the largest stands for the row, the kernel's one grid a row and tile), both
    in key order, n [B] (or an int) keys per sequence, bottom-right causal. An upper bound wherever the path
    runs, so a budget may add it where it does not."""
    from attnlab.kernels import decode as dk

    B, L, H, D = q.shape
    S, Hkv = kf.shape[1], kf.shape[2]
    n = torch.as_tensor(n).expand(B)
    k = kf.double().repeat_interleave(H // Hkv, 2).permute(0, 2, 1, 3)  # (B, H, S, D)
    s = q.double().transpose(1, 2) @ k.transpose(-1, -2) * (D ** -0.5 if scale is None else scale)
    j = torch.arange(S).view(1, 1, S)
    keep = (j < n.view(B, 1, 1)) & (j <= torch.arange(L).view(1, L, 1) + (n - L).view(B, 1, 1))
    p = s.masked_fill(~keep.unsqueeze(1), float("-inf")).softmax(-1).nan_to_num(0.0)
    v_scale = v_scale.amax(-1) if v_scale.dim() == 4 else v_scale
    vs = v_scale.double().repeat_interleave(H // Hkv, 2).permute(0, 2, 1).unsqueeze(2)  # (B, H, 1, S)
    return float(dk.int_pv_bound(p, vs).max())


def check_int8_searched(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, candidates: int,
                        what: str = "") -> None:
    """Groups x [.., n] (the values quantised) stored as int8 ``data`` [.., n] with one float32 ``scale`` [..]
    each: every element within half its scale's step (round to nearest, nothing clipped); the scale one of the
    candidates max|group| / m (m an integer in [128 - candidates, 127], to float32 rounding); and the group's
    squared error no larger than the best candidate's in float64, up to the rounding of the float32 errors the
    quantiser compares (n products and sums of eps each: 4 n eps relative) and of the stored float32 scale."""
    eps = torch.finfo(torch.float32).eps
    x64, s64 = x.double(), scale.double()
    dq = data.double() * s64.unsqueeze(-1)
    assert bool(((x64 - dq).abs() <= s64.unsqueeze(-1) / 2 * (1 + 4 * eps) + 1e-300).all()), f"{what}: a half step"
    amax = x64.abs().amax(-1)
    live = s64 > 0
    assert torch.equal(live, amax > 0), f"{what}: zero scales are the all-zero groups"
    m = amax[live] / s64[live]
    assert bool(((m - m.round()).abs() <= 4 * eps * m).all()), f"{what}: a scale that is not max|group| / m"
    assert bool(((m.round() <= 127) & (m.round() >= 128 - candidates)).all()), f"{what}: m out of range"
    err = (x64 - dq).square().sum(-1)
    best = int8_candidate_errors(x64, candidates).amin(-1)
    n = x.shape[-1]
    # the stored float32 scale moves each element by up to 127 eps s: the error by up to that squared n times,
    # plus twice its product with the error's root
    moved = 127 * eps * s64
    bad = err > best * (1 + 4 * n * eps) + n * moved.square() + 2 * (best * n).sqrt() * moved + 1e-300
    assert not bool(bad.any()), (f"{what}: {int(bad.sum())} groups above the best candidate's error, worst "
                                 f"{float((err / best.clamp_min(1e-300))[bad].max()):.6g}x")


# -- memory layouts ---------------------------------------------------------------------------------
# A kernel sees sizes, strides and a storage offset, nothing else: a tensor built by ``as_strided`` over
# a scratch buffer is, to it, the view that has those strides (``expand`` gives stride 0, ``.mT`` swaps
# two strides, ``x[..., ::2]`` of a wider tensor doubles one and leaves gaps, ``x[..., :n]`` leaves a gap
# after each row, a size-1 dim may carry any stride). ``Layout.apply`` builds such a tensor from given
# values, differentiably, so gradients are checked through it too; ``layouts`` draws one for a shape.
@dataclass(frozen=True)
class Layout:
    """One memory layout for a tensor of ``shape``.

    expanded: dims broadcast with stride 0 (``expand`` from size 1): they hold the values at index 0.
    order: the dims from outermost to innermost in storage (identity: row-major; last two swapped: ``.mT``).
    steps: per dim, storage holds one element of every ``step`` (``x[..., ::step]`` of a wider tensor).
    pads: per dim, unused elements after each run of it (``x[..., :n]`` of a wider tensor).
    offset: the storage offset. unit_strides: per dim, the stride a size-1 dim gets (None: its natural one).
    """

    shape: tuple[int, ...]
    expanded: tuple[int, ...] = ()
    order: tuple[int, ...] | None = None
    steps: tuple[int, ...] | None = None
    pads: tuple[int, ...] | None = None
    offset: int = 0
    unit_strides: tuple[int | None, ...] | None = None

    def __post_init__(self):
        assert all(self.shape[d] >= 2 for d in self.expanded), f"expand only dims of size >= 2: {self}"

    def _reduced(self) -> tuple[int, ...]:
        return tuple(1 if d in self.expanded else n for d, n in enumerate(self.shape))

    def _base_strides(self) -> tuple[int, ...]:
        """Strides of the stored (reduced) tensor, before ``expand``."""
        n, r = len(self.shape), self._reduced()
        order, steps, pads = self.order or tuple(range(n)), self.steps or (1,) * n, self.pads or (0,) * n
        out, acc = [0] * n, 1
        for d in reversed(order):
            out[d] = acc * steps[d]
            acc *= max(1, (r[d] - 1) * steps[d] + 1 + pads[d])
        units = self.unit_strides or (None,) * n
        return tuple(units[d] if r[d] == 1 and units[d] is not None else s for d, s in enumerate(out))

    def strides(self) -> tuple[int, ...]:
        """The strides of ``apply``'s result (0 on expanded dims)."""
        return tuple(0 if d in self.expanded else s for d, s in enumerate(self._base_strides()))

    def values(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` with each expanded dim holding its values at index 0 (what ``apply`` holds), row-major."""
        for d in self.expanded:
            t = t.narrow(d, 0, 1)
        return t.expand(self.shape).contiguous()

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor equal to ``values(t)``, in this layout; differentiable with respect to ``t``."""
        assert tuple(t.shape) == self.shape, (tuple(t.shape), self.shape)
        for d in self.expanded:
            t = t.narrow(d, 0, 1)
        r, strides = self._reduced(), self._base_strides()
        numel = self.offset + (1 + sum((n - 1) * s for n, s in zip(r, strides)) if 0 not in r else 0)
        buf = torch.as_strided_scatter(t.new_zeros(numel), t, r, strides, self.offset)
        return buf.as_strided(r, strides, self.offset).expand(self.shape)

    def is_default(self) -> bool:
        """Row-major with no gap, offset or expanded dim: what ``.contiguous()`` gives."""
        return self.strides() == tuple(torch.empty(self.shape).stride()) and not self.offset

    def __repr__(self) -> str:  # only the fields that differ from row-major, so reproducers read short
        n = len(self.shape)
        plain = dict(expanded=((),), order=(None, tuple(range(n))), steps=(None, (1,) * n), pads=(None, (0,) * n),
                     offset=(0,), unit_strides=(None, (None,) * n))
        fields = [f"{f}={getattr(self, f)!r}" for f, d in plain.items() if getattr(self, f) not in d]
        return f"Layout({', '.join([repr(self.shape)] + fields)})"

    def _repr_pretty_(self, printer, cycle):  # hypothesis' reproducers print through this
        printer.text(repr(self))

    def __str__(self) -> str:
        return f"shape {list(self.shape)} strides {list(self.strides())}" + (f" offset {self.offset}" if self.offset else "")


@st.composite
def layouts(draw, shape, *, no_expand: tuple[int, ...] = (), default_weight: int = 1) -> Layout:
    """A random layout for ``shape``: row-major (often, so shrinking ends there), or any mix of stride-0
    expands (never on ``no_expand`` dims; dims are given non-negative), a permuted storage order (``.mT``
    most often), strided and sliced dims, an offset, and odd strides on size-1 dims."""
    n = len(shape)
    no_expand = {d % n for d in no_expand} if n else set()
    if n == 0 or draw(st.sampled_from([True] * default_weight + [False] * 3)):
        return Layout(tuple(shape))
    can = [d for d in range(n) if shape[d] >= 2 and d not in no_expand]
    expanded = tuple(d for d in can if draw(st.sampled_from([False, False, True])))
    kind = draw(st.sampled_from(["row-major", "mT", "permuted"])) if n >= 2 else "row-major"
    order = tuple(range(n))
    if kind == "mT":
        order = order[:-2] + (n - 1, n - 2)
    elif kind == "permuted":
        order = tuple(draw(st.permutations(range(n))))
    steps = tuple(draw(st.sampled_from([1, 1, 1, 2, 3])) for _ in range(n))
    pads = tuple(draw(st.sampled_from([0, 0, 0, 1, 5])) for _ in range(n))
    units = tuple(draw(st.sampled_from([None, 0, 1, 7, 1000])) if shape[d] == 1 else None for d in range(n))
    return Layout(tuple(shape), expanded, order, steps, pads, draw(st.sampled_from([0, 0, 3])), units)
