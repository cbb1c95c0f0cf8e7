"""Hook points of ``MultiHeadAttention``: read or replace an activation while a model runs.

Like TransformerLens' ``HookPoint``, but in plain Python so the module tree and state dict do not change.
Each ``MultiHeadAttention`` has ``hooks``, an :class:`AttentionHooks`, with these points (legend: B batch,
H heads, Hkv key/value heads, L queries, S keys, D head dim, Dv value head dim, E embed_dim):

    q        [B, H, L, D]     projected queries (after rotary positions)
    k        [B, Hkv, S, D]   projected keys (after rotary positions; cached keys included)
    v        [B, Hkv, S, Dv]  projected values
    weights  [B, H, L, S]     attention weights as the mechanism computed them (read only)
    z        [B, H, L, Dv]    per-head output, weights · V, before the heads are merged
    out      [B, L, E]        the layer's output after W_O

    >>> handle = mha.hooks.add("z", lambda z, ctx: z * keep_mask)   # returns a replacement
    >>> handle.remove()

A hook is ``fn(tensor, ctx) -> tensor | None``: returning a tensor replaces the activation (same shape,
checked), returning None only reads it. ``ctx`` is a :class:`HookContext` describing the call (masks,
causal flag, cache offset), enough to recompute masked scores. Registering a ``weights`` hook makes the
layer compute weights on every call (``need_weights=True`` internally; the caller still gets None unless
it asked), so it needs a mechanism that can return weights. With no hook registered nothing runs.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = ["AttentionHooks", "HookContext", "HookHandle", "POINTS"]

POINTS = ("q", "k", "v", "weights", "z", "out")
_READ_ONLY = ("weights",)  # the output is computed from the kernel's own weights; replacing them would lie


@dataclass
class HookContext:
    """One call of a ``MultiHeadAttention``, as its hooks see it.

    module: the attention module. point: which hook point. key_padding_mask: bool [B, S] (True = ignore) or
    None, as passed. attn_mask: the call's attn_mask (tensor, Pattern or None), as passed. pattern: the
    module's own pattern (or None). is_causal: the call's flag. offset: cached keys before this call.
    scale: the score scale the kernel uses (1/sqrt(D) when the module's ``scale`` is None).
    """

    module: Any
    point: str
    key_padding_mask: torch.Tensor | None
    attn_mask: Any
    pattern: Any
    is_causal: bool
    offset: int
    scale: float


class HookHandle:
    """Returned by :meth:`AttentionHooks.add`; ``remove()`` unregisters the hook (idempotent)."""

    def __init__(self, hooks: "AttentionHooks", point: str, key: int):
        self._hooks, self._point, self._key = hooks, point, key

    def remove(self) -> None:
        """Unregister the hook; calling it again does nothing."""
        self._hooks.remove(self._point, self._key)

    def __enter__(self) -> "HookHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


class AttentionHooks:
    """The hook points of one attention module (see the module docstring for names and shapes)."""

    _keys = itertools.count()

    def __init__(self):
        self._fns: dict[str, dict[int, Callable]] = {p: {} for p in POINTS}
        self._count = 0  # hooks registered; checked on every forward, so kept as a number (~60 ns, not ~500)

    def add(self, point: str, fn: Callable) -> HookHandle:
        """Call ``fn(tensor, ctx)`` at ``point`` on every call until the handle is removed."""
        if point not in POINTS:
            raise ValueError(f"unknown hook point {point!r}; points: {', '.join(POINTS)}")
        if not callable(fn):
            raise TypeError(f"hook must be callable fn(tensor, ctx), got {type(fn).__name__}")
        key = next(self._keys)
        self._fns[point][key] = fn
        self._count += 1
        return HookHandle(self, point, key)

    def remove(self, point: str, key: int) -> None:
        """Unregister the hook ``key`` (from its handle) at ``point``; an unknown or removed one is ignored.
        ``HookHandle.remove()`` is the usual way to call this."""
        if self._fns.get(point, {}).pop(key, None) is not None:
            self._count -= 1

    def clear(self) -> None:
        """Remove every hook."""
        for fns in self._fns.values():
            fns.clear()
        self._count = 0

    def __bool__(self) -> bool:
        return self._count > 0

    def has(self, point: str) -> bool:
        """Whether a hook is registered at ``point``, so the layer computes that activation only when asked
        (a ``weights`` hook makes it ask the mechanism for weights)."""
        return bool(self._fns[point])

    def run(self, point: str, x: torch.Tensor, ctx: HookContext) -> torch.Tensor:
        """Pass ``x`` through the hooks at ``point`` in registration order; a replacement must keep the shape."""
        fns = self._fns[point]
        if not fns:
            return x
        ctx.point = point
        for fn in list(fns.values()):
            r = fn(x, ctx)
            if r is None:
                continue
            if point in _READ_ONLY:
                raise ValueError(f"the {point!r} hook point is read only: a hook there must return None")
            if not isinstance(r, torch.Tensor) or r.shape != x.shape:
                raise ValueError(f"a hook at {point!r} returned {getattr(r, 'shape', type(r).__name__)}; it must "
                                 f"return None or a tensor of the same shape {list(x.shape)}")
            x = r
        return x

    def __repr__(self) -> str:
        n = {p: len(f) for p, f in self._fns.items() if f}
        return f"AttentionHooks({n})"
