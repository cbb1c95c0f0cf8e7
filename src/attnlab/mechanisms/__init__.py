"""attnlab.mechanisms: exact and approximate attention behind one signature, in one registry.

Every mechanism is a small frozen dataclass of its own hyperparameters. Calling it runs attention:

    mech(query, key, value, *, attn_mask=None, is_causal=False, scale=None, dropout_p=0.0,
         enable_gqa=False, need_weights=False) -> out | (out, weights)

with query [B, H, L, E], key [B, Hkv, S, E], value [B, Hkv, S, Ev] (any number of leading dims, as in
``attnlab.attention``). Each class declares a :class:`Spec` (exact or approximate, causal support, which
masks, weights, dropout, the papers) and answers ``flops(L, S, E, Ev)``, ``memory(L, S, E, Ev)`` and
``not_supported_reasons(inputs)``.

    >>> import attnlab.mechanisms as M
    >>> M.available()                     # every registered name
    >>> lin = M.get("linear", feature_map="relu")
    >>> out = M.resolve("performer")(q, k, v, is_causal=True)

Unknown names and unknown parameters raise and list the valid ones; nothing swallows ``**kwargs``.

State (random features, learned projections): the dataclasses are stateless and deterministic (random
features and projections are drawn from their ``seed`` and cached). ``mech.as_module()`` returns an
``nn.Module`` with the same call signature; for Performer it holds the features as a buffer and can
redraw them, for Linformer it holds learnable projections (``as_module(max_len=...)``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch
from torch import nn

from ..shapes import AttentionInputs, Prepared, check_attention_inputs, prepare, shape_str

__all__ = [
    "Spec", "Inputs", "Mechanism", "MechanismModule", "register", "get", "available", "resolve", "describe",
    "specs", "UnsupportedInputs", "needs_params",
]

#: mask kinds a mechanism can declare: no attn_mask at all, masks that depend on the key only
#: (key padding: shape [..., 1, S]), or any [..., L, S] mask
MASK_KINDS = ("none", "key", "any")


@dataclass(frozen=True)
class Spec:
    """What a mechanism can do, declared as data (xformers-style).

    exact: output equals softmax attention (restricted to its pattern, for pattern mechanisms).
    causal: supports ``is_causal=True`` (and never lets a query see a later key).
    masks: "none" | "key" (bool key-padding masks [..., 1, S]) | "any" (bool or float [..., L, S]).
    weights: can return attention weights [..., L, S] with ``need_weights=True``.
    dropout: supports ``dropout_p > 0``.
    time / memory: the asymptotic cost in words; ``Mechanism.flops`` / ``.memory`` give numbers.
    paper: where it comes from.
    error_band: approximations only: the relative Frobenius error of the output expected at most on
    ``attnlab check``'s cases (N(0, 1) query/key/value, head dim up to 64, budgets sized to about L/4 by
    ``attnlab.conformance.sized_instance``); ``check`` says whether each run fell inside it. None: none declared.
    """

    exact: bool
    causal: bool = True
    masks: str = "any"
    weights: bool = True
    dropout: bool = False
    time: str = "O(L·S·D)"
    memory: str = "O(L·S)"
    paper: str = ""
    summary: str = ""
    kind: str = "approximate"  # "exact" | "pattern" | "approximate"
    error_band: float | None = None

    def __post_init__(self):
        if self.masks not in MASK_KINDS:
            raise ValueError(f"Spec.masks must be one of {MASK_KINDS}, got {self.masks!r}")
        if self.error_band is not None and (self.exact or not self.error_band > 0):
            raise ValueError(f"Spec.error_band is for approximations, a number > 0; got {self.error_band!r} "
                             f"(exact={self.exact})")


# Note [Error bands]: an approximation's ``Spec.error_band`` is read from measurement, not theory: docs/
# mechanisms.md's "Measured here" (random N(0, 1) inputs: most approximations near 0.8 relative
# Frobenius error, Performer above 4 at scale·|q|² ≈ 8, untrained Gaussian Linformer 10.3 at k = 16), and
# `attnlab check`'s own cases (random, causal, key padding, masks, L != S, L = 1, GQA, bf16) over six
# shapes (L 17..200, E 4..64) and three seeds: the band is that maximum with a margin of about
# 1.3-1.6x, so a run outside it is a regression or a regime the band does not cover (E > 64, a budget
# far below L/4), and `check` says so.


class UnsupportedInputs(ValueError):
    """A mechanism was called with inputs its spec does not cover; the message lists the reasons."""


@dataclass(frozen=True)
class Inputs:
    """A description of one attention call, enough to decide support without running it."""

    L: int
    S: int
    E: int
    Ev: int
    H: int = 1
    Hkv: int = 1
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    mask: str = "none"  # "none" | "key" | "any"
    mask_dtype: torch.dtype | None = None
    is_causal: bool = False
    dropout_p: float = 0.0
    need_weights: bool = False

    @classmethod
    def from_tensors(cls, query, key, value, attn_mask=None, is_causal=False, dropout_p=0.0,
                     enable_gqa=False, need_weights=False, scale=None) -> "Inputs":
        """Describe a call from its tensors (query [..., L, E], key [..., S, E], value [..., S, Ev]),
        validating them as ``attnlab.attention`` does."""
        info = check_attention_inputs(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        return cls._from_info(info, attn_mask, is_causal, dropout_p, need_weights)

    @classmethod
    def _from_info(cls, info: AttentionInputs, attn_mask, is_causal, dropout_p, need_weights) -> "Inputs":
        kind, mdt = "none", None
        if attn_mask is not None:
            mdt = attn_mask.dtype
            kind = "key" if (attn_mask.dim() < 2 or attn_mask.shape[-2] == 1) else "any"
        return cls(info.L, info.S, info.E, info.Ev, info.H, info.Hkv, info.dtype, info.device.type, kind, mdt,
                   bool(is_causal), float(dropout_p), bool(need_weights))


# -- the mechanism base ------------------------------------------------------------------------------
class Mechanism:
    """Base of every registered mechanism (subclasses are frozen dataclasses of hyperparameters).

    Subclasses implement ``_forward(q, k, v, key_keep, attn_mask, is_causal, scale, dropout_p,
    need_weights)`` on 4-D tensors (q [B, H, L, E], k [B, H, S, E], v [B, H, S, Ev]; see ``_prepare``)
    or override ``__call__`` entirely (exact ones).
    """

    name: ClassVar[str] = ""
    spec: ClassVar[Spec]

    # -- declared support ------------------------------------------------------------------------
    def not_supported_reasons(self, inputs: Inputs) -> list[str]:
        """Why this mechanism cannot run ``inputs`` (empty list: it can)."""
        s, r = self.spec, []
        if inputs.is_causal and not s.causal:
            r.append(f"{self.name}: is_causal=True is not supported")
        if inputs.mask != "none":
            if s.masks == "none":
                r.append(f"{self.name}: attn_mask is not supported")
            elif s.masks == "key" and inputs.mask != "key":
                r.append(f"{self.name}: only key-padding masks of shape [..., 1, S] are supported, "
                         "not a full [..., L, S] attn_mask")
            elif s.masks == "key" and inputs.mask_dtype is not None and inputs.mask_dtype != torch.bool:
                r.append(f"{self.name}: only bool key masks are supported, got {inputs.mask_dtype}")
        if inputs.need_weights and not s.weights:
            r.append(f"{self.name}: cannot return attention weights (need_weights=True)")
        if inputs.dropout_p > 0 and not s.dropout:
            r.append(f"{self.name}: dropout_p > 0 is not supported")
        r.extend(self._extra_reasons(inputs))
        return r

    def _extra_reasons(self, inputs: Inputs) -> list[str]:
        return []

    def supports(self, inputs: Inputs) -> bool:
        """True when ``not_supported_reasons(inputs)`` is empty."""
        return not self.not_supported_reasons(inputs)

    # -- cost model (per batch element and head) ---------------------------------------------------
    def flops(self, L: int, S: int, E: int, Ev: int | None = None) -> int:
        """Multiply-add FLOPs (2 per MAC) of one call for one batch element and head."""
        Ev = E if Ev is None else Ev
        return 2 * L * S * (E + Ev)

    def memory(self, L: int, S: int, E: int, Ev: int | None = None, element_size: int = 4) -> int:
        """Peak bytes of intermediates (beyond inputs and output) for one batch element and head."""
        return 3 * L * S * element_size

    def pattern_for(self):
        """The attnlab.patterns.Pattern this mechanism restricts attention to (exact ones), else None."""
        return None

    # -- params ----------------------------------------------------------------------------------
    def params(self) -> dict[str, Any]:
        """The mechanism's hyperparameters as {name: value}."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    def as_module(self) -> nn.Module:
        """An nn.Module with the same call signature (stateless wrapper; stateful mechanisms override)."""
        return MechanismModule(self)

    # -- running ---------------------------------------------------------------------------------
    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                 attn_mask: torch.Tensor | None = None, is_causal: bool = False, scale: float | None = None,
                 dropout_p: float = 0.0, enable_gqa: bool = False, need_weights: bool = False):
        c = _prepare(self, query, key, value, attn_mask, is_causal, scale, dropout_p, enable_gqa, need_weights)
        p, key_keep, mask = c.prepared, c.key_keep, c.mask
        S = p.info.S
        if p.info.L == 0 or S == 0:  # nothing to attend: output 0, graph kept connected
            out, w = p.empty_result()
            out = out.reshape(p.out_shape)
            return (out, w.reshape(p.out_shape[:-1] + (S,))) if need_weights else out
        out, w = self._forward(p.q, p.k, p.v, key_keep=key_keep, attn_mask=mask, is_causal=is_causal,
                               scale=p.info.scale, dropout_p=p.dropout_p, need_weights=need_weights)
        out = out.reshape(p.out_shape)
        if need_weights:
            return out, w.reshape(p.out_shape[:-1] + (S,))
        return out

    def _forward(self, q, k, v, *, key_keep, attn_mask, is_causal, scale, dropout_p, need_weights):
        raise NotImplementedError


@dataclass(frozen=True)
class _Call:
    """A mechanism call's inputs as ``attnlab.shapes.prepare`` left them, plus the mask views mechanisms read.

    q [B, H, L, E]; k, v [B, H, S, E|Ev] (GQA heads repeated, dead keys zeroed: Note [Dead keys]);
    mask: the user's attn_mask as [B|1, H|1, L|1, S|1] (bool or float) or None; key_keep [B|1, H|1, S]
    bool (True = takes part) when it is a key-padding mask ([..., 1, S]), else None.
    """

    prepared: Prepared
    key_keep: torch.Tensor | None
    mask: torch.Tensor | None

    q = property(lambda self: self.prepared.q)
    k = property(lambda self: self.prepared.k)
    v = property(lambda self: self.prepared.v)
    scale = property(lambda self: self.prepared.info.scale)
    dropout_p = property(lambda self: self.prepared.dropout_p)
    out_shape = property(lambda self: self.prepared.out_shape)
    S = property(lambda self: self.prepared.info.S)


def _prepare(mech: Mechanism, query, key, value, attn_mask, is_causal, scale, dropout_p, enable_gqa,
             need_weights) -> _Call:
    """Validate and flatten once (``attnlab.shapes.prepare``), then refuse what the spec does not
    cover, listing why."""
    p = prepare(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    inputs = Inputs._from_info(p.info, attn_mask, is_causal, dropout_p, need_weights)
    reasons = mech.not_supported_reasons(inputs)
    if reasons:
        raise UnsupportedInputs(
            f"{mech!r} cannot run query {shape_str(query)}, key {shape_str(key)} with "
            f"is_causal={is_causal}, attn_mask={None if attn_mask is None else shape_str(attn_mask)}: "
            + "; ".join(reasons))
    m = p.mask.keep if p.mask.keep is not None else p.mask.bias  # (B|1, H|1, L|1, S|1)
    key_keep = None
    if m is not None and m.dtype == torch.bool and m.shape[-2] == 1:
        key_keep = m[..., 0, :].expand(*m.shape[:-2], p.info.S)  # (B|1, H|1, S)
    return _Call(p, key_keep, m)


class MechanismModule(nn.Module):
    """nn.Module wrapper around a mechanism: same call signature, no parameters."""

    def __init__(self, mechanism: Mechanism):
        super().__init__()
        self.mechanism = mechanism
        self.spec = mechanism.spec

    def forward(self, query, key, value, *, attn_mask=None, is_causal=False, scale=None, dropout_p=0.0,
                enable_gqa=False, need_weights=False):
        """The wrapped mechanism's call: query [..., L, E], key [..., S, E], value [..., S, Ev] ->
        out [..., L, Ev] (and weights [..., L, S] with need_weights)."""
        return self.mechanism(query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                              dropout_p=dropout_p, enable_gqa=enable_gqa, need_weights=need_weights)

    def not_supported_reasons(self, inputs: Inputs) -> list[str]:
        """The wrapped mechanism's reasons (see ``Mechanism.not_supported_reasons``)."""
        return self.mechanism.not_supported_reasons(inputs)

    def extra_repr(self) -> str:
        """The wrapped mechanism's repr, shown by ``print(module)``."""
        return repr(self.mechanism)


# -- the registry ------------------------------------------------------------------------------------
_REGISTRY: dict[str, type] = {}


def register(name: str, spec: Spec, cls: type | None = None):
    """Register a mechanism class under ``name`` with its ``spec``; usable as a class decorator.

    The class must be a dataclass (frozen recommended) subclassing :class:`Mechanism`.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    if not isinstance(spec, Spec):
        raise TypeError(f"spec must be an attnlab.mechanisms.Spec, got {type(spec).__name__}")

    def deco(c: type) -> type:
        if not (isinstance(c, type) and issubclass(c, Mechanism) and dataclasses.is_dataclass(c)):
            raise TypeError(f"{c!r} must be a dataclass subclassing attnlab.mechanisms.Mechanism")
        if name in _REGISTRY and _REGISTRY[name] is not c:
            raise ValueError(f"a mechanism named {name!r} is already registered ({_REGISTRY[name].__name__})")
        c.name = name
        c.spec = spec
        _REGISTRY[name] = c
        return c

    return deco(cls) if cls is not None else deco


def available() -> tuple[str, ...]:
    """Names of every registered mechanism, in registration order."""
    _load_builtins()
    return tuple(_REGISTRY)


def specs() -> dict[str, Spec]:
    """{name: Spec} of every registered mechanism, in registration order."""
    _load_builtins()
    return {n: c.spec for n, c in _REGISTRY.items()}


def _param_help(cls: type) -> str:
    parts = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            parts.append(f"{f.name}={f.default!r}")
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            parts.append(f"{f.name}=<default>")
        else:
            parts.append(f"{f.name} (required)")
    return ", ".join(parts) if parts else "(none)"


def get(name: str, **params: Any) -> Mechanism:
    """The mechanism ``name`` with the given hyperparameters. Unknown names/params raise, listing valid ones."""
    _load_builtins()
    if not isinstance(name, str):
        raise TypeError(f"mechanism name must be a str, got {type(name).__name__}")
    if name not in _REGISTRY:
        raise ValueError(f"unknown mechanism {name!r}; available: {', '.join(_REGISTRY)}")
    cls = _REGISTRY[name]
    valid = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(params) - valid)
    if unknown:
        raise TypeError(f"mechanism {name!r} has no parameter(s) {', '.join(map(repr, unknown))}; "
                        f"valid parameters: {_param_help(cls)}")
    missing = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING and f.name not in params]  # type: ignore[misc]
    if missing:
        raise TypeError(f"mechanism {name!r} needs parameter(s) {', '.join(missing)}; "
                        f"valid parameters: {_param_help(cls)}")
    return cls(**params)


def resolve(spec: "str | Mechanism | nn.Module | None" = "auto") -> Callable:
    """A callable with the shared signature, from a name, a mechanism instance or a mechanism module.

    ``resolve("dense")`` (and "auto", "sdpa", "tiled", "sparse") is exact ``attnlab.attention`` with that
    method; any other registered name gives that mechanism with its default hyperparameters; ``None``
    means "auto". Instances (and modules from ``as_module()``) are returned as they are.
    """
    if spec is None:
        spec = "auto"
    if isinstance(spec, str):
        return get(spec)
    if isinstance(spec, Mechanism):
        return spec
    if isinstance(spec, nn.Module) and hasattr(spec, "not_supported_reasons"):
        return spec
    raise TypeError(f"mechanism must be a registered name ({', '.join(available())}), an "
                    f"attnlab.mechanisms.Mechanism instance or its as_module(); got {type(spec).__name__}")


def describe(name_or_mech: "str | Mechanism") -> dict[str, Any]:
    """One row of ``attnlab list``: name, class, declared capabilities, parameters with defaults."""
    _load_builtins()
    if isinstance(name_or_mech, str):
        if name_or_mech not in _REGISTRY:
            raise ValueError(f"unknown mechanism {name_or_mech!r}; available: {', '.join(_REGISTRY)}")
        cls = _REGISTRY[name_or_mech]
    else:
        cls = type(name_or_mech)
    s = cls.spec
    return {
        "name": cls.name, "class": cls.__name__, "kind": s.kind, "exact": s.exact, "causal": s.causal,
        "masks": s.masks, "weights": s.weights, "dropout": s.dropout, "time": s.time, "memory": s.memory,
        "paper": s.paper, "summary": s.summary, "error_band": s.error_band, "params": _param_help(cls),
    }


def needs_params(name: str) -> bool:
    """Whether mechanism ``name`` has a parameter without a default (``get(name)`` alone would raise)."""
    _load_builtins()
    if name not in _REGISTRY:
        raise ValueError(f"unknown mechanism {name!r}; available: {', '.join(_REGISTRY)}")
    cls = _REGISTRY[name]
    return any(f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING  # type: ignore[misc]
               for f in dataclasses.fields(cls))


_LOADED = False


def _load_builtins() -> None:
    """Import the built-in mechanism modules (each registers itself) on first use."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    import importlib

    for mod in ("exact", "linear", "performer", "linformer", "nystrom", "pruning", "hierarchical"):
        try:
            importlib.import_module(f"{__name__}.{mod}")
        except ModuleNotFoundError as e:  # a mechanism still being written is simply not offered
            if e.name != f"{__name__}.{mod}":
                raise
