"""Shape legend, input checks, error messages, and the one way in: ``prepare`` validates attention
inputs once and brings them to the kernels' 4-D form.

Legend used across attnlab:
    B  batch (any number of leading dims, flattened to one)     H   query heads
    Hkv key/value heads (H % Hkv == 0 under GQA)                 L   query length
    S  key/value length                                          E   query/key head dim
    Ev value head dim
Tensors follow PyTorch's scaled_dot_product_attention layout: query [..., L, E], key [..., S, E],
value [..., S, Ev]; when rank >= 3 the dim before L/S is the head dim (used by GQA).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from . import patterns as P
from .kernels.extension import transformed
from .kernels.masks import MaskSpec
from .kernels.spec import Request, check_block_size

__all__ = ["AttentionInputError", "AttentionDtypeError", "AttentionInputs", "check_attention_inputs",
           "check_block_size", "check_softcap", "check_alibi_slopes", "check_sinks", "shape_str", "Prepared", "prepare", "to4d",
           "mask4d"]


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
    """A tensor's shape as error messages show it: ``[2, 8, 128, 64]``."""
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
        check_scale_range(scale_f, q.dtype)
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


# -- the one way in: validate, flatten to 4-D, describe the mask ------------------------------------
@dataclass
class Prepared:
    """Validated attention inputs in the kernels' 4-D form (B = the query's leading dims flattened, or
    with rank 2 inputs 1; the kernels' docstrings call it N).

    ``key``/``value`` are the caller's tensors as given; ``kv_k``/``kv_v`` (and ``k``/``v``) read them with
    dead keys made harmless (Note [Dead keys]): every dead key zeroed here, only the non-finite ones inside
    the live range in ``live()``, which is what ``attnlab.attention`` runs on."""

    info: AttentionInputs
    q: torch.Tensor  # (B, H, L, E)
    key: torch.Tensor  # (B, Hkv, S, E) as given; GQA heads not repeated
    value: torch.Tensor  # (B, Hkv, S, Ev)
    mask: MaskSpec
    is_causal_only: bool  # the mask is exactly top-left causal (SDPA's is_causal)
    out_shape: tuple[int, ...]  # (..., L, Ev): the output's shape before flattening
    dropout_p: float
    mask_requires_grad: bool
    dead: torch.Tensor | None = None  # (B|1, H|1, S) bool: keys no query may attend, or None
    #: (start, stop, S) when these inputs are the live keys start .. stop - 1 of S (``live()``), else None
    key_range: tuple[int, int, int] | None = None
    _repeated: dict = field(default_factory=dict, repr=False)

    @property
    def N(self) -> int:
        """B, the flattened batch (the kernels' N)."""
        return self.q.shape[0]

    @property
    def kv_k(self) -> torch.Tensor:
        """(B, Hkv, S, E): ``key`` with dead keys made harmless (Note [Dead keys]); the compiled kernel reads it."""
        return self._clean()[0]

    @property
    def kv_v(self) -> torch.Tensor:
        """(B, Hkv, S, Ev), as ``kv_k``."""
        return self._clean()[1]

    @property
    def k(self) -> torch.Tensor:
        """(B, H, S, E): key heads repeated under GQA, built on first use (the compiled kernel reads kv_k)."""
        return self._heads("k", self.kv_k)

    @property
    def v(self) -> torch.Tensor:
        """(B, H, S, Ev), as ``k``."""
        return self._heads("v", self.kv_v)

    @property
    def dead_per_head(self) -> bool:
        """Under GQA, a key dead for only part of a key/value head's group holds a non-finite value (``k``/``v``
        are then per-head copies; a kernel reading ``kv_k`` in place cannot zero it)."""
        return self._clean()[2] is not None

    @property
    def empty(self) -> bool:
        """Nothing to attend: no query, no key, or no (batch, head) row."""
        return self.info.L == 0 or self.info.S == 0 or self.q.shape[0] * self.q.shape[1] == 0

    def empty_result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(out [B, H, L, Ev], weights [B, H, L, S]), both 0: the answer when there is nothing to attend.
        ``out`` stays joined to the inputs' graph through sums of empty slices, which are exactly 0
        whatever the inputs hold (0 * q.sum() was NaN for a query holding Inf)."""
        q, Ev, S = self.q, self.info.Ev, self.info.S
        out = torch.zeros(*q.shape[:-1], Ev, dtype=q.dtype, device=q.device)
        out = out + (q[..., :0].sum() + self.key[..., :0].sum() + self.value[..., :0].sum()).to(out.dtype)
        return out, torch.zeros(*q.shape[:-1], S, dtype=q.dtype, device=q.device)

    def _heads(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if self.info.H == self.info.Hkv:
            return t
        per_head = self._clean()[2]
        if per_head is not None:
            return per_head[0 if name == "k" else 1]
        if name not in self._repeated:
            self._repeated[name] = t.repeat_interleave(self.info.groups, dim=1)
        return self._repeated[name]

    def _clean(self):
        """(kv_k, kv_v, per-head (k, v) or None), built once (Note [Dead keys])."""
        if "clean" not in self._repeated:
            groups = self.info.groups if self.info.Hkv else 1
            self._repeated["clean"] = _harmless_dead_keys(self.key, self.value, self.dead, groups,
                                                          every=self.key_range is None)
        return self._repeated["clean"]

    def live(self) -> "Prepared":
        """These inputs restricted to the live keys: when the keys no query may attend form a prefix or a
        suffix, k, v become views of the keys between (no copy, nothing past them is read), with the mask's
        coordinates moved to match (patterns through ``patterns.sliced_keys``); dead keys left inside are
        zeroed only if they hold NaN or Inf (Note [Dead keys]). ``key_range`` records (start, stop, S).
        With ALiBi only a dead prefix is cut (its distances count from the last key). Built once."""
        if self.key_range is not None:
            return self
        if "live" not in self._repeated:
            self._repeated["live"] = self._live()
        return self._repeated["live"]

    def template(self) -> "Prepared":
        """These prepared inputs without their tensors (q, key, value None): what the plan cache keeps
        (Note [Plan cache] in ``attnlab.functional.plancache``), so no caller's tensor is held alive."""
        return Prepared(self.info, None, None, None, self.mask, self.is_causal_only, self.out_shape, self.dropout_p,
                        self.mask_requires_grad, self.dead, self.key_range)

    def rebind(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> "Prepared":
        """A ``template`` with new tensors of the same signature (shapes, strides, dtypes, devices): what
        ``prepare(query, key, value, ...)`` (``.live()`` when the template is a live view) would build.
        No check is repeated: the caller vouches for the signature (Note [Plan cache])."""
        q, k, v = to4d(query), to4d(key), to4d(value)  # (B, H, L, E), (B, Hkv, S, E|Ev)
        if self.key_range is not None and self.key_range[:2] != (0, self.key_range[2]):
            start, stop = self.key_range[:2]
            k, v = k[..., start:stop, :], v[..., start:stop, :]  # (B, Hkv, S', E|Ev): views
        return Prepared(self.info, q, k, v, self.mask, self.is_causal_only, self.out_shape, self.dropout_p,
                        self.mask_requires_grad, self.dead, self.key_range)

    def _live(self) -> "Prepared":
        S = self.info.S
        start, stop = 0, S
        if self.dead is not None and self.dead.device.type != "meta":  # a pattern's dead keys are known on meta too
            alive = ~self.dead.all(0).all(0)  # (S,): some batch element and head may see the key
            idx = alive.nonzero()
            start, stop = (int(idx[0]), int(idx[-1]) + 1) if len(idx) else (0, 0)
            if self.mask.alibi is not None:
                stop = S
            if self.mask.rel_bias is not None:  # its offsets count from key 0: no key is cut
                start, stop = 0, S
        m = self.mask
        key, value = self.key, self.value
        if (start, stop) == (0, S):
            mask, dead = m, self.dead
        else:
            key, value = key[..., start:stop, :], value[..., start:stop, :]  # (B, Hkv, S', E|Ev): views
            def cut(t):
                return t if t is None or t.shape[-1] == 1 else t[..., start:stop]

            pat = None if m.pattern is None else P.sliced_keys(m.pattern, start, S)
            mask = MaskSpec(m.L, stop - start, pattern=pat, keep=cut(m.keep), bias=cut(m.bias), softcap=m.softcap,
                            alibi=m.alibi, sinks=m.sinks)
            dead = self.dead[..., start:stop]
        if dead is not None and not bool(dead.any()):
            dead = None
        info = self.info if stop - start == S else dataclasses.replace(self.info, S=stop - start)
        return Prepared(info, self.q, key, value, mask,
                        self.is_causal_only and start == 0, self.out_shape, self.dropout_p, self.mask_requires_grad,
                        dead, (start, stop, S))

    @property
    def needs_grad(self) -> bool:
        """Autograd will call a backward: grad mode is on and q, k or v requires grad (kernels that keep extra
        tensors for their backward count them in their peak only then)."""
        return torch.is_grad_enabled() and (self.q.requires_grad or self.key.requires_grad
                                            or self.value.requires_grad)

    def request(self, need_weights: bool = False, strict: bool = False, sdpa_backend: str | None = None) -> Request:
        """These inputs as a kernel :class:`~attnlab.kernels.Request` (sizes and flags only; whether a
        kernel must copy per-head keys is asked of the live view, which is what runs)."""
        i, m = self.info, self.mask
        return Request(self.N, i.H, i.Hkv, i.L, i.S, i.E, i.Ev, self.q.dtype, self.q.device.type,
                       causal_only=self.is_causal_only,
                       pattern=m.pattern is not None and not self.is_causal_only,
                       keep_mask=m.keep is not None, float_mask=m.bias is not None,
                       float_mask_grad=self.mask_requires_grad, dropout_p=self.dropout_p,
                       need_weights=bool(need_weights), strict=bool(strict),
                       dead_per_head=self.live().dead_per_head,
                       sdpa_backend=sdpa_backend, softcap=m.softcap is not None,
                       alibi=None if m.alibi is None else "[H]" if m.alibi.shape[0] == 1 else "[B, H]",
                       needs_grad=self.needs_grad, transformed=transformed(self.q, self.key, self.value),
                       rel_bias=m.rel_bias is not None, sinks=m.sinks is not None,
                       rel_bias_grad=m.rel_bias is not None and m.rel_bias.requires_grad)


def to4d(t: torch.Tensor) -> torch.Tensor:
    """[..., T, D] -> [B, H, T, D]: rank 2 gets B = H = 1, rank 3 gets B = 1, higher ranks flatten the
    dims before the head dim into B (a view when possible)."""
    d = t.dim()
    if d == 4:
        return t
    if d == 2:
        return t.unsqueeze(0).unsqueeze(0)
    if d == 3:
        return t.unsqueeze(0)
    return t.reshape(math.prod(t.shape[:-3]), *t.shape[-3:])  # not -1: ambiguous when a dim is 0


def mask4d(m: torch.Tensor, batch_shape: tuple[int, ...]) -> torch.Tensor:
    """A validated ``attn_mask`` broadcastable to [*batch_shape, L, S] -> [B|1, H|1, L|1, S|1] (4-D,
    size-1 dims kept for broadcasting; leading dims expanded only when they differ)."""
    full_rank = len(batch_shape) + 2
    m = m.reshape((1,) * (full_rank - m.dim()) + tuple(m.shape))
    if full_rank == 2:
        return m.unsqueeze(0).unsqueeze(0)
    if full_rank == 3:
        return m.unsqueeze(0)
    lead = m.shape[:-3]
    if all(s == 1 for s in lead):
        return m.reshape(1, *m.shape[-3:])
    return m.expand(*batch_shape[:-1], *m.shape[-3:]).reshape(math.prod(batch_shape[:-1]), *m.shape[-3:])


# Note [Scalars in float32]: the kernels take scale and softcap as float32 (flash-attn's and FlexAttention's
# kernels do too), so a finite float64 value past float32's range became inf there, and a positive softcap below
# float32's smallest subnormal became 0, which means "no capping": a float32 call with scale 1e39 came back as
# zeros (auto) or NaN, and softcap 1e-46 ran uncapped, silently. Such values are refused instead, as alibi_slopes
# past float32's range are (Note [ALiBi slopes in float32]); float64 inputs keep their float64 scale. (A softcap
# past float32's largest stays: it is the identity, its limit: Note [Soft-cap at infinity], kernels/masks.py.)
_F32 = torch.finfo(torch.float32)
_F32_TINY = _F32.smallest_normal * 2.0 ** -23  # float32's smallest subnormal


def check_scale_range(scale: float, dtype: torch.dtype, where: str = "") -> None:
    """Raise naming ``scale`` where it is finite but past float32's range and the call computes in float32 (any
    dtype but float64) (Note [Scalars in float32])."""
    if dtype != torch.float64 and abs(scale) > _F32.max:
        raise AttentionInputError(f"{where}scale must be at most {_F32.max:.6g} in magnitude (float32's largest "
                                  f"value: {str(dtype).removeprefix('torch.')} inputs are computed in float32), "
                                  f"got {scale!r}")


def check_slopes_fit_float32(a: torch.Tensor) -> None:
    """Raise naming ``alibi_slopes`` where a finite slope is past float32's range (Note [ALiBi slopes in float32])."""
    if a.dtype == torch.float64 and not bool(torch.isfinite(a.to(torch.float32)).all()):
        raise AttentionInputError(f"alibi_slopes must be at most {_F32.max:.6g} in magnitude (float32's largest "
                                  f"value: ALiBi is computed in float32, as in flash-attn), got max |slope| "
                                  f"{float(a.abs().max()):.6g}")


def check_softcap(softcap) -> float | None:
    """``softcap``: None or 0.0 (off, as flash-attn's default ``softcap=0.0``) or a finite float > 0."""
    if softcap is None:
        return None
    if isinstance(softcap, (bool, torch.Tensor)) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float > 0, 0.0 or None, got {type(softcap).__name__}")
    if softcap == 0:
        return None  # flash-attn's "no capping": code ported from flash_attn_func(softcap=0.0) runs as written
    if not (math.isfinite(softcap) and softcap > 0):
        raise AttentionInputError(f"softcap must be a finite float > 0 (0.0 or None turn soft-capping off), "
                                  f"got {softcap!r}")
    if softcap < _F32_TINY:  # Note [Scalars in float32] (a cap past float32's largest is the identity: Note
        # [Soft-cap at infinity] in kernels/masks.py)
        raise AttentionInputError(f"softcap must be at least {_F32_TINY:.3g} (float32's smallest subnormal: the "
                                  f"kernels cap in float32, where it would be 0, which means no capping), got {softcap!r}")
    return float(softcap)


def check_alibi_slopes(alibi_slopes, query: torch.Tensor, info: AttentionInputs) -> torch.Tensor | None:
    """``alibi_slopes`` [H] or [*batch, H] (query's dims before L) -> [B|1, H], float32 (float64 stays);
    per-batch slopes whose rows are all equal become one row (kernels that take slopes [H] then run them).
    Raises naming the argument and the shapes: not floating, on another device, another shape,
    non-finite values, or requiring grad (no kernel differentiates the slopes)."""
    if alibi_slopes is None:
        return None
    a = _require_tensor("alibi_slopes", alibi_slopes)
    if not a.dtype.is_floating_point:
        raise AttentionDtypeError(f"alibi_slopes must be a floating tensor (float32 as in flash-attn), got {a.dtype}")
    if a.device != query.device:
        raise AttentionInputError(f"alibi_slopes is on {a.device} but query is on {query.device}")
    H, lead = info.H, tuple(query.shape[:-2])
    if tuple(a.shape) not in ((H,), lead) or (a.dim() == 0):
        raise AttentionInputError(
            f"alibi_slopes {shape_str(a)} must be [H] = [{H}] or [*batch, H] = {list(lead)} (one slope per "
            f"query head; query {shape_str(query)})")
    if a.requires_grad:
        raise AttentionInputError("alibi_slopes requires grad, but no kernel differentiates the slopes; "
                                  "pass alibi_slopes.detach()")
    if a.device.type != "meta" and not bool(torch.isfinite(a).all()):
        raise AttentionInputError(f"alibi_slopes must be finite, got {a.tolist() if a.numel() <= 16 else 'non-finite values'}")
    # Note [ALiBi slopes in float32]: the compiled kernel (like flash-attn) computes ALiBi in float32, where
    # a float64 slope past float32's range is inf and inf·0 on the aligned key is NaN; every method refuses it
    if a.device.type != "meta":
        check_slopes_fit_float32(a)
    a = a.to(torch.float64 if a.dtype == torch.float64 else torch.float32)
    N = math.prod(lead[:-1]) if len(lead) >= 2 else 1
    if a.dim() == 1 or N == 1:
        return a.reshape(1, H)
    a = a.reshape(N, H)
    if a.device.type != "meta" and bool((a == a[:1]).all()):
        return a[:1]
    return a


def check_sinks(sinks, H: int, device: torch.device, heads_of: str) -> torch.Tensor | None:
    """``sinks`` [H]: one logit per query head (Note [Attention sinks] in ``kernels.lse``), floating, finite, on the
    query's device; returned as given (it may require grad: the kernels that take sinks differentiate them).
    ``heads_of`` names where H comes from in the messages. Raises naming the argument and the shapes."""
    if sinks is None:
        return None
    t = _require_tensor("sinks", sinks)
    if not t.dtype.is_floating_point:
        raise AttentionDtypeError(f"sinks must be a floating tensor [H] (one logit per query head), got {t.dtype}")
    if t.device != device:
        raise AttentionInputError(f"sinks is on {t.device} but query is on {device}")
    if tuple(t.shape) != (H,):
        raise AttentionInputError(f"sinks {shape_str(t)} must be [H] = [{H}] (one logit per query head; {heads_of})")
    if t.device.type != "meta" and not bool(torch.isfinite(t.detach()).all()):
        raise AttentionInputError(f"sinks must be finite (a sink of -inf is no sink: pass sinks=None), got "
                                  f"{t.tolist() if t.numel() <= 16 else 'non-finite values'}")
    return t


def prepare(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
            enable_gqa=False, pattern=None, *, softcap: float | None = None,
            alibi_slopes: torch.Tensor | None = None, rel_bias: torch.Tensor | None = None,
            sinks: torch.Tensor | None = None) -> Prepared:
    """Validate inputs (``check_attention_inputs``, ``check_softcap``, ``check_alibi_slopes``) and bring
    them to the kernels' 4-D form: query [..., L, E] -> q [B, H, L, E]; key/value -> [B, Hkv, S, E|Ev] with
    dead keys zeroed (Note [Dead keys]); ``attn_mask``, ``is_causal``, ``pattern``, ``softcap`` and
    ``alibi_slopes`` (-> [B|1, H]) become one ``MaskSpec`` (Note [Score modifications]); so does ``rel_bias``,
    a relative bias table [H, L + S - 1] (``flex_attention``'s relative score_mod, Note [Relative bias
    table]), whose keys are never cut (its offsets count from key 0); and ``sinks`` [H] (``check_sinks``)."""
    info = check_attention_inputs(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    cap = check_softcap(softcap)
    slopes = check_alibi_slopes(alibi_slopes, query, info)
    sinks = check_sinks(sinks, info.H, query.device, f"query {shape_str(query)}")
    if pattern is not None and not isinstance(pattern, P.Pattern):
        raise TypeError(f"pattern must be an attnlab.patterns.Pattern, got {type(pattern).__name__}")
    q, k, v = to4d(query), to4d(key), to4d(value)  # k, v: (B, Hkv, S, E)
    N = q.shape[0]
    if pattern is not None and pattern.batch_size and pattern.batch_size != N:
        raise ValueError(
            f"pattern {pattern!r} is for batch size {pattern.batch_size}, but query {shape_str(query)} "
            f"has batch size {N}"
        )
    keep = bias = None
    if attn_mask is not None:
        m4 = mask4d(attn_mask, info.batch_shape)
        if attn_mask.dtype == torch.bool:
            keep = m4
        else:
            bias = m4
    pat = pattern
    if is_causal:
        pat = P.causal() if pat is None else (pat & P.causal())
    if rel_bias is not None and (not isinstance(rel_bias, torch.Tensor) or not rel_bias.dtype.is_floating_point
                                 or tuple(rel_bias.shape) != (info.H, info.L + info.S - 1)):
        raise AttentionInputError(f"rel_bias must be a floating tensor [H, L + S - 1] = [{info.H}, "
                                  f"{info.L + info.S - 1}], got {shape_str(rel_bias) if isinstance(rel_bias, torch.Tensor) else type(rel_bias).__name__}")
    mask = MaskSpec(info.L, info.S, pattern=pat, keep=keep, bias=bias, softcap=cap, alibi=slopes, rel_bias=rel_bias,
                    sinks=sinks)
    # ALiBi and a relative bias are biases: with one, causal is no longer the only mask (soft-capping masks nothing)
    causal_only = is_causal and pattern is None and attn_mask is None and slopes is None and rel_bias is None
    return Prepared(info, q, k, v, mask, causal_only, tuple(query.shape[:-1]) + (info.Ev,), float(dropout_p),
                    bool(attn_mask is not None and attn_mask.requires_grad), _dead_keys(mask, N))


def _dead_keys(mask: MaskSpec, N: int) -> torch.Tensor | None:
    """Bool (B|1, H|1, S): keys that no query may attend under the whole mask, or None when there are none.

    # Note [Dead keys]: keys masked for *every* query — by the pattern (key padding, causal or a window
    # with L < S, any pattern through ``Pattern.dead_keys``), a bool mask (False) or a float mask (-inf) —
    # have no influence: the result equals running on k, v with them replaced by anything finite, and
    # their gradients are 0. A preallocated KV cache with garbage (even NaN) past its length is the common
    # case. ``Prepared.live()`` cuts a dead prefix or suffix off by a view (never read); a dead key left
    # inside is read only to see whether it holds NaN or Inf, and then zeroed in a copy (0·NaN in
    # P·V, or NaN + -inf in an additive mask, would leak it). Every method runs on ``live()``.
    # Cost: a pattern alone is O(1) for bands, O(B·S) for key padding and O(L + S) for other
    # translation-invariant patterns; a user mask adds one pass over the combined [L, S] mask
    # (the mask is already that size).
    """
    L, S = mask.L, mask.S
    if L == 0 or S == 0:
        return None
    if mask.keep is None and mask.bias is None:
        if mask.pattern is None:
            return None
        d = mask.pattern.dead_keys(L, S)  # (B|1, S)
        return d.unsqueeze(1) if bool(d.any()) else None  # (B|1, 1, S)
    m = mask.keep if mask.keep is not None else mask.bias
    if m.device.type == "meta":
        return None
    alive = None
    rows = max(1, (1 << 22) // max(1, S * m.shape[0] * m.shape[1]))
    j = torch.arange(S, device=m.device).unsqueeze(0)  # (1, S)
    for r0 in range(0, L, rows):
        i = torch.arange(r0, min(L, r0 + rows), device=m.device).unsqueeze(-1)  # (r, 1)
        keep, bias = mask.block(i, j, N)  # (N|1, H|1, r, S) each, or None
        ok = None if bias is None else ~torch.isneginf(bias.detach())
        ok = keep if ok is None else ok if keep is None else keep & ok
        a = torch.broadcast_to(ok, ok.shape[:2] + (i.shape[0], S)).any(-2)  # (N|1, H|1, S)
        alive = a if alive is None else alive | a
    dead = ~alive
    return dead if bool(dead.any()) else None


def _harmless_dead_keys(k: torch.Tensor, v: torch.Tensor, dead: torch.Tensor | None, groups: int, every: bool):
    """(k, v, per-head (k, v) or None) with dead keys zeroed (Note [Dead keys]): all of them when ``every``
    (the full-S view that mechanisms read), else only when a dead row holds NaN or Inf, reading only the
    dead rows. Under GQA a key dead for only some heads of a group is zeroed in per-head copies."""
    if dead is None or k.device.type == "meta":
        return k, v, None
    dead = dead.to(k.device)
    per_head = None
    if groups > 1 and dead.shape[1] > 1:
        # GQA: k, v have H / groups heads; a key is zeroed there when dead for its whole group, and the
        # per-head copies (made only when needed) zero keys dead for only some heads of a group
        by_group = dead.view(dead.shape[0], -1, groups, dead.shape[-1])
        some = by_group.any(2) & ~by_group.all(2)  # (B|1, Hkv, S)
        if bool(some.any()) and (every or _non_finite(k, some) or _non_finite(v, some)):
            d4 = dead.unsqueeze(-1)  # (B|1, H, S, 1)
            per_head = (k.repeat_interleave(groups, dim=1).masked_fill(d4, 0),
                        v.repeat_interleave(groups, dim=1).masked_fill(d4, 0))
        dead = by_group.all(2)
    return _zeroed(k, dead, every), _zeroed(v, dead, every), per_head


def _non_finite(t: torch.Tensor, rows: torch.Tensor) -> bool:
    """Whether rows [B|1, Hkv|1, S] of t [B, Hkv, S, D] hold NaN or Inf; reads those rows only."""
    with torch.no_grad():
        sel = t[torch.broadcast_to(rows, t.shape[:-1])]  # (n, D): the selected rows, gathered
        return not bool(torch.isfinite(sel).all())


def _zeroed(t: torch.Tensor, dead: torch.Tensor, every: bool) -> torch.Tensor:
    if not bool(dead.any()) or not (every or _non_finite(t, dead)):
        return t
    return t.masked_fill(dead.unsqueeze(-1), 0)  # a copy: the caller's tensor is left as it was
