"""Shape legend, input checks and the error messages attnlab gives for bad input.

Legend used across attnlab:
    B  batch (any number of leading dims, flattened to one)     H   query heads
    Hkv key/value heads (H % Hkv == 0 under GQA)                 L   query length
    S  key/value length                                          E   query/key head dim
    Ev value head dim
Tensors follow PyTorch's scaled_dot_product_attention layout: query [..., L, E], key [..., S, E],
value [..., S, Ev]; when rank >= 3 the dim before L/S is the head dim (used by GQA).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["AttentionInputError", "AttentionDtypeError", "AttentionInputs", "check_attention_inputs",
           "check_block_size", "shape_str"]


class AttentionInputError(ValueError, RuntimeError):
    """Bad input to attention: the message names the argument and the shapes.

    A ValueError, and also a RuntimeError because that is what PyTorch's
    ``scaled_dot_product_attention`` raises for the same inputs, so drop-in code that catches
    ``RuntimeError`` around SDPA keeps working with attnlab.
    """


class AttentionDtypeError(AttentionInputError, TypeError):
    """Bad dtype (non-floating, or mixed across query/key/value); also a TypeError, as attnlab raised before."""

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def shape_str(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _require_tensor(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


@dataclass(frozen=True)
class AttentionInputs:
    """Validated attention inputs, with the sizes named by the module legend."""

    batch_shape: tuple[int, ...]  # leading dims of query (includes heads when rank >= 3)
    L: int
    S: int
    E: int
    Ev: int
    H: int  # query heads (1 when rank < 3)
    Hkv: int  # key/value heads
    scale: float
    dtype: torch.dtype
    device: torch.device

    @property
    def B(self) -> int:
        """Flattened batch size excluding heads."""
        n = 1
        for s in self.batch_shape[:-1]:
            n *= s
        return n if len(self.batch_shape) >= 1 else 1

    @property
    def groups(self) -> int:
        """Query heads per key/value head (H // Hkv; 1 when there are no heads at all)."""
        return self.H // self.Hkv if self.Hkv else 1


def check_attention_inputs(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> AttentionInputs:
    """Validate SDPA-style inputs; raise an error naming the argument and the shapes: TypeError for a
    non-tensor or a non-bool flag, ``AttentionInputError`` (ValueError and RuntimeError) for shapes and
    values, ``AttentionDtypeError`` (those and TypeError) for dtypes.

    Stricter than PyTorch in one way: query, key and value must agree on every leading dim (PyTorch
    silently broadcasts a key of another rank or batch size).
    """
    q = _require_tensor("query", query)
    k = _require_tensor("key", key)
    v = _require_tensor("value", value)
    for name, t in (("query", q), ("key", k), ("value", v)):
        if t.dtype not in _FLOAT_DTYPES:
            raise AttentionDtypeError(
                f"{name} must be a floating tensor (float16, bfloat16, float32, float64), got {t.dtype}; "
                f"convert it with {name}.float()"
            )
        if t.dim() < 2:
            raise AttentionInputError(f"{name} must have shape [..., seq, dim] (rank >= 2), got {shape_str(t)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise AttentionDtypeError(
            f"query, key and value must share one dtype, got query {q.dtype}, key {k.dtype}, value {v.dtype}"
        )
    if not (q.device == k.device == v.device):
        raise AttentionInputError(
            f"query, key and value must be on one device, got {q.device}, {k.device}, {v.device}"
        )
    if not (q.dim() == k.dim() == v.dim()):
        raise AttentionInputError(
            "query, key and value must have the same rank (attnlab does not broadcast them), got "
            f"query {shape_str(q)}, key {shape_str(k)}, value {shape_str(v)}"
        )
    L, E = q.shape[-2], q.shape[-1]
    S, Ek = k.shape[-2], k.shape[-1]
    Sv, Ev = v.shape[-2], v.shape[-1]
    if Ek != E:
        raise AttentionInputError(
            f"query and key must share the last (head) dim E: query {shape_str(q)} has E={E}, "
            f"key {shape_str(k)} has E={Ek}"
        )
    if Sv != S:
        raise AttentionInputError(
            f"key and value must share the sequence dim S: key {shape_str(k)} has S={S}, "
            f"value {shape_str(v)} has S={Sv}"
        )
    if k.shape[:-2] != v.shape[:-2]:
        raise AttentionInputError(
            f"key and value must agree on leading dims, got key {shape_str(k)} and value {shape_str(v)}"
        )
    qb, kb = tuple(q.shape[:-2]), tuple(k.shape[:-2])
    H = qb[-1] if qb else 1
    Hkv = kb[-1] if kb else 1
    if qb[:-1] != kb[:-1]:
        raise AttentionInputError(
            "query and key/value must agree on every batch dim (attnlab does not broadcast them), got "
            f"query {shape_str(q)} and key {shape_str(k)}"
        )
    if H != Hkv:
        if not enable_gqa:
            raise AttentionInputError(
                f"query has {H} heads (dim -3 of {shape_str(q)}) but key/value have {Hkv} "
                f"(dim -3 of {shape_str(k)}); for grouped-query attention pass enable_gqa=True"
            )
        if Hkv == 0 or H % Hkv != 0:
            raise AttentionInputError(
                f"with enable_gqa=True the query heads ({H}, from {shape_str(q)}) must be a multiple of "
                f"the key/value heads ({Hkv}, from {shape_str(k)})"
            )
    if not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool) or not (0.0 <= dropout_p < 1.0):
        raise AttentionInputError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"enable_gqa must be a bool, got {type(enable_gqa).__name__}")
    if scale is None:
        scale_f = 1.0 / math.sqrt(E) if E > 0 else 1.0
    else:
        if isinstance(scale, torch.Tensor) or isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
        scale_f = float(scale)
        if not math.isfinite(scale_f):
            raise AttentionInputError(f"scale must be finite, got {scale!r}")
    if attn_mask is not None:
        m = _require_tensor("attn_mask", attn_mask)
        if m.dtype != torch.bool and not m.dtype.is_floating_point:
            raise AttentionDtypeError(
                f"attn_mask must be bool (True = takes part) or floating (added to the scores), "
                f"got {m.dtype}"
            )
        if m.device != q.device:
            raise AttentionInputError(f"attn_mask is on {m.device} but query is on {q.device}")
        target = tuple(qb) + (L, S)
        if m.dim() > len(target) or m.dim() == 0:
            raise AttentionInputError(
                f"attn_mask {shape_str(m)} must broadcast to [..., L, S] = {list(target)} "
                f"(query {shape_str(q)}, key {shape_str(k)})"
            )
        for ms, ts in zip(reversed(m.shape), reversed(target)):
            if ms != ts and ms != 1:
                raise AttentionInputError(
                    f"attn_mask {shape_str(m)} does not broadcast to [..., L, S] = {list(target)} "
                    f"(query {shape_str(q)}, key {shape_str(k)})"
                )
    return AttentionInputs(
        batch_shape=qb, L=L, S=S, E=E, Ev=Ev, H=H, Hkv=Hkv, scale=scale_f, dtype=q.dtype, device=q.device
    )


def check_block_size(block_size) -> int | None:
    """``block_size`` for the tiled and sparse kernels: None (the default) or an int >= 1."""
    if block_size is None:
        return None
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"block_size must be an int >= 1 or None, got {block_size!r} ({type(block_size).__name__})")
    if block_size < 1:
        raise ValueError(f"block_size must be an int >= 1 or None, got {block_size}")
    return block_size
