"""Exact attention in the registry: attnlab.attention's methods and every core pattern.

What each method supports is read from the kernels' declarations (``attnlab.kernels.KERNELS``) and
refused by the one planner (``attnlab.kernels.planner``); nothing here re-codes a kernel's limits.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .. import kernels
from .. import patterns as P
from ..functional import run
from ..kernels import planner
from ..kernels.spec import Request, Tiling, io_bytes
from ..shapes import prepare
from . import Inputs, Mechanism, Spec, UnsupportedInputs, register

__all__ = [
    "Exact", "Auto", "KERNEL_MECHANISMS", *(k.title for k in kernels.KERNELS),
    "PatternMechanism", "SlidingWindow", "Dilated", "Strided", "Fixed", "BlockSparse", "Longformer", "BigBird",
]

_METHODS = planner.METHODS


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_method(method: str) -> None:
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")


class Exact(Mechanism):
    """Base of the exact mechanisms: they call ``attnlab.attention`` with a method and maybe a pattern."""

    method: str = "auto"

    def _block(self) -> int | None:
        return getattr(self, "block_size", None)

    def __call__(self, query, key, value, *, attn_mask=None, is_causal=False, scale=None, dropout_p=0.0,
                 enable_gqa=False, need_weights=False):
        # validated once: the prepared inputs describe the call for the spec check and then run
        p = prepare(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, self.pattern_for())
        inputs = Inputs._from_info(p.info, attn_mask, is_causal, dropout_p, need_weights)
        reasons = self.not_supported_reasons(inputs)
        if reasons:
            raise UnsupportedInputs(f"{self!r} cannot run these inputs: " + "; ".join(reasons))
        return run(p, method=self.method, need_weights=need_weights, strict=getattr(self, "strict", False),
                   block_size=self._block())

    def _request(self, inputs: Inputs) -> Request:
        """The inputs as a kernel request (one batch element; a mask's values are not known here)."""
        has_mask = inputs.mask != "none"
        is_bool = inputs.mask_dtype == torch.bool
        pattern = self.pattern_for() is not None
        return Request(1, inputs.H, inputs.Hkv, inputs.L, inputs.S, inputs.E, inputs.Ev, inputs.dtype,
                       inputs.device, causal_only=inputs.is_causal and not has_mask and not pattern,
                       pattern=pattern, keep_mask=has_mask and is_bool, float_mask=has_mask and not is_bool,
                       dropout_p=inputs.dropout_p, need_weights=inputs.need_weights,
                       strict=bool(getattr(self, "strict", False)))

    def not_supported_reasons(self, inputs: Inputs) -> list[str]:
        """Why attnlab.attention with this method (and pattern) cannot run ``inputs``: the planner's
        refusals, from the kernels' declarations (empty list: it can)."""
        refused = planner.refusals(self._request(inputs))
        if self.method == "auto":
            if len(refused) == len(kernels.KERNELS):
                return [f"{self.name}: no attention method can run these inputs ("
                        + "; ".join(f"{m}: {why}" for m, why in refused.items()) + ")"]
            return []
        return [f"{self.name}: method {self.method!r}: {refused[self.method]}"] if self.method in refused else []

    def flops(self, L, S, E, Ev=None):
        Ev = E if Ev is None else Ev
        pat = self.pattern_for()
        return pat.flops(L, S, E, Ev) if pat is not None else 2 * L * S * (E + Ev)

    def memory(self, L, S, E, Ev=None, element_size=4):
        """Peak bytes beyond inputs and output for one batch element and head, from the kernel's declared
        cost model (auto: the least of the kernels the planner would not refuse)."""
        Ev = E if Ev is None else Ev
        dtype = {8: torch.float64, 4: torch.float32, 2: torch.bfloat16}.get(element_size, torch.float32)
        r = Request(1, 1, 1, L, S, E, Ev, dtype, pattern=self.pattern_for() is not None)
        if self.method != "auto":
            return self._peak(kernels.get(self.method), r)
        refused = planner.refusals(r)
        return min(self._peak(k, r) for k in kernels.KERNELS if k.name not in refused)

    def _peak(self, spec, r: Request) -> int:
        t = None
        if spec.blocked:
            b = self._block()
            bq, bk = (b, b) if b else spec.default_block
            pat = self.pattern_for()
            t = Tiling(bq, bk, pat.nonempty_blocks(r.L, r.S, bq, bk) if pat is not None else None)
        return spec.peak_bytes(r, t) - io_bytes(r)


_EXACT_SPEC = dict(exact=True, causal=True, masks="any", kind="exact")


@register("auto", Spec(weights=any(k.weights != "no" for k in kernels.KERNELS),
                       dropout=any(k.dropout for k in kernels.KERNELS), time="O(L·S·D)",
                       memory="depends on the chosen method",
                       summary=f"attnlab.attention(method='auto'): picks {'/'.join(planner.METHODS[1:])}, see explain()",
                       paper="Vaswani et al. 2017, Attention Is All You Need", **_EXACT_SPEC))
@dataclass(frozen=True)
class Auto(Exact):
    """attnlab.attention with method='auto' (the planner picks the kernel; see ``explain``)."""

    strict: bool = False
    block_size: int | None = None
    method = "auto"


def _check_block_size(self) -> None:
    if self.block_size is not None:
        _check_int("block_size", self.block_size, 1)


def _kernel_mechanism(k: kernels.Kernel) -> type:
    """The exact mechanism running ``attnlab.attention(method=k.name)``, registered under the kernel's name
    with the capabilities its declaration gives (a blocked kernel takes ``block_size``)."""
    fields = [("block_size", "int | None", dataclasses.field(default=None))] if k.blocked else []
    ns = {"method": k.name, "__module__": __name__,
          "__doc__": f"attnlab.attention with method={k.name!r}: {k.summary}."}
    if k.blocked:
        ns["__post_init__"] = _check_block_size
    cls = dataclasses.make_dataclass(k.title, fields, bases=(Exact,), frozen=True, namespace=ns)
    spec = Spec(time=k.time, memory=k.memory, summary=k.summary, weights=k.weights != "no", dropout=k.dropout,
                paper=k.paper, **_EXACT_SPEC)
    return register(k.name, spec)(cls)


#: one exact mechanism per kernel of every shape, by its title: Dense, SDPA, Tiled, Sparse, Compiled (the decode
#: kernel, which takes only 1-16 queries against a KV cache in inference, is a method of ``attention`` but no
#: attention layer of its own)
KERNEL_MECHANISMS: dict[str, type] = {k.title: _kernel_mechanism(k) for k in kernels.KERNELS
                                      if k.spec.max_queries is None}
globals().update(KERNEL_MECHANISMS)


# -- patterns: exact attention restricted to a structured mask ---------------------------------------
class PatternMechanism(Exact):
    """Exact attention restricted to ``pattern_for()``; ``method`` picks attnlab.attention's kernel."""

    def __post_init__(self):
        # validate at construction: a bad method or pattern argument fails here, not at the first call
        _check_method(self.method)
        self.pattern_for()

    def pattern_for(self) -> P.Pattern:
        raise NotImplementedError


def _pspec(time: str, memory: str, paper: str, summary: str) -> Spec:
    return Spec(exact=True, causal=True, masks="any", weights=True, dropout=True, kind="pattern", time=time,
                memory=memory, paper=paper, summary=summary)


@register("sliding_window", _pspec("O(L·w·D)", "O(L·w)", "Beltagy et al. 2020 (Longformer); Child et al. 2019",
                                   "keys within `window` positions of the query (local attention)"))
@dataclass(frozen=True)
class SlidingWindow(PatternMechanism):
    """Exact attention within ``window`` positions of each query (``patterns.sliding_window``)."""

    window: int = 128
    causal: bool = False
    align: str = "top_left"
    method: str = "auto"

    def pattern_for(self):
        return P.sliding_window(self.window, self.causal, self.align)


@register("dilated", _pspec("O(L·w·D)", "O(L·w)", "Beltagy et al. 2020 (Longformer)",
                            "`window` keys on each side, `dilation` apart"))
@dataclass(frozen=True)
class Dilated(PatternMechanism):
    """Exact attention to ``window`` keys on each side, ``dilation`` apart (``patterns.dilated``)."""

    window: int = 64
    dilation: int = 2
    causal: bool = False
    method: str = "auto"

    def pattern_for(self):
        return P.dilated(self.window, self.dilation, self.causal)


@register("strided", _pspec("O(L·(s + L/s)·D)", "O(L·(s + L/s))", "Child et al. 2019 (Sparse Transformer)",
                            "previous `stride` tokens plus every stride-th token"))
@dataclass(frozen=True)
class Strided(PatternMechanism):
    """Exact attention to the previous ``stride`` keys plus every stride-th key (``patterns.strided``)."""

    stride: int = 64
    causal: bool = True
    method: str = "auto"

    def pattern_for(self):
        return P.strided(self.stride, self.causal)


@register("fixed", _pspec("O(L·(b + L·c/b)·D)", "O(L·(b + L·c/b))", "Child et al. 2019 (Sparse Transformer)",
                          "own block plus the last `summary` positions of every block"))
@dataclass(frozen=True)
class Fixed(PatternMechanism):
    """Exact attention to the own block plus each block's last ``summary`` keys (``patterns.fixed``)."""

    block: int = 64
    summary: int = 8
    causal: bool = True
    method: str = "auto"

    def pattern_for(self):
        return P.fixed(self.block, self.summary, self.causal)


@register("block_sparse", _pspec("O(nnz blocks·b²·D)", "O(nnz)", "Child et al. 2019; Gray et al. 2017",
                                 "user block layout [n_query_blocks, n_key_blocks]"))
@dataclass(frozen=True, eq=False)
class BlockSparse(PatternMechanism):
    """Exact attention on a user block ``layout`` [n_query_blocks, n_key_blocks] of ``block_size``."""

    layout: torch.Tensor
    block_size: int = 64
    method: str = "auto"

    def __post_init__(self):
        _check_method(self.method)
        object.__setattr__(self, "_pattern", P.block_sparse(self.layout, self.block_size))

    def pattern_for(self):
        return self._pattern  # type: ignore[attr-defined]

    def _block(self):
        return None


@register("longformer", _pspec("O(L·(w + g)·D)", "O(L·(w + g))", "Beltagy et al. 2020 (Longformer)",
                               "sliding window plus global tokens"))
@dataclass(frozen=True)
class Longformer(PatternMechanism):
    """Exact attention: a sliding ``window`` plus global tokens (``patterns.longformer``)."""

    window: int = 128
    global_tokens: int | tuple[int, ...] = 1
    method: str = "auto"

    def __post_init__(self):
        _check_method(self.method)
        if isinstance(self.global_tokens, list):
            object.__setattr__(self, "global_tokens", tuple(self.global_tokens))
        self.pattern_for()

    def pattern_for(self):
        return P.longformer(self.window, self.global_tokens)


@register("bigbird", _pspec("O(L·b·(w + g + r)·D)", "O(L·b·(w + g + r))", "Zaheer et al. 2020 (BigBird)",
                            "window + global + random blocks"))
@dataclass(frozen=True)
class BigBird(PatternMechanism):
    """Exact attention: window, global and random blocks (``patterns.bigbird``)."""

    block_size: int = 64
    window_blocks: int = 3
    global_blocks: int = 1
    random_blocks: int = 1
    seed: int = 0
    method: str = "auto"

    def pattern_for(self):
        return P.bigbird(self.block_size, self.window_blocks, self.global_blocks, self.random_blocks, self.seed)

    def _block(self):
        return None
