"""Exact attention in the registry: attnlab.attention's methods and every core pattern."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .. import patterns as P
from ..functional import attention
from . import Inputs, Mechanism, Spec, UnsupportedInputs, register

__all__ = [
    "Exact", "Auto", "Dense", "SDPA", "Tiled", "Sparse",
    "PatternMechanism", "SlidingWindow", "Dilated", "Strided", "Fixed", "BlockSparse", "Longformer", "BigBird",
]

_METHODS = ("auto", "dense", "sdpa", "tiled", "sparse")


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
        inputs = Inputs.from_tensors(query, key, value, attn_mask, is_causal, dropout_p, enable_gqa, need_weights,
                                     scale)
        reasons = self.not_supported_reasons(inputs)
        if reasons:
            raise UnsupportedInputs(f"{self!r} cannot run these inputs: " + "; ".join(reasons))
        return attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                         scale=scale, enable_gqa=enable_gqa, pattern=self.pattern_for(), method=self.method,
                         need_weights=need_weights, strict=getattr(self, "strict", False),
                         block_size=self._block())

    def _extra_reasons(self, inputs: Inputs) -> list[str]:
        r = []
        if self.method == "sparse" and inputs.mask == "none" and self.pattern_for() is None:
            r.append(f"{self.name}: method 'sparse' needs a pattern or an attn_mask to skip work with")
        if self.method == "tiled" and inputs.dropout_p > 0:
            r.append(f"{self.name}: method 'tiled' has no dropout")
        if self.method in ("sdpa", "sparse") and inputs.need_weights:
            r.append(f"{self.name}: method {self.method!r} cannot return attention weights")
        return r

    def flops(self, L, S, E, Ev=None):
        Ev = E if Ev is None else Ev
        pat = self.pattern_for()
        return pat.flops(L, S, E, Ev) if pat is not None else 2 * L * S * (E + Ev)

    def memory(self, L, S, E, Ev=None, element_size=4):
        Ev = E if Ev is None else Ev
        if self.method == "dense":
            return 3 * L * S * 4
        if self.method == "tiled":
            b = self._block() or 512
            return L * (Ev + 3) * 4 + 3 * b * b * 4
        if self.method == "sparse":
            pat = self.pattern_for()
            nnz = pat.nnz(L, S) if pat is not None else L * S
            return nnz * 4 + L * 4
        return L * (Ev + 1) * 4  # sdpa/auto: fused kernels keep O(L) extra state


_EXACT_SPEC = dict(exact=True, causal=True, masks="any", kind="exact",
                   paper="Vaswani et al. 2017, Attention Is All You Need")


@register("auto", Spec(weights=True, dropout=True, time="O(L·S·D)", memory="depends on the chosen method",
                       summary="attnlab.attention(method='auto'): picks dense/sdpa/tiled/sparse, see explain()",
                       **_EXACT_SPEC))
@dataclass(frozen=True)
class Auto(Exact):
    strict: bool = False
    block_size: int | None = None
    method = "auto"


@register("dense", Spec(weights=True, dropout=True, time="O(L·S·D)", memory="O(L·S)",
                        summary="materialises the L×S scores; supports everything", **_EXACT_SPEC))
@dataclass(frozen=True)
class Dense(Exact):
    method = "dense"


@register("sdpa", Spec(weights=False, dropout=True, time="O(L·S·D)", memory="O(L) (fused) or O(L·S) (math)",
                       summary="PyTorch's scaled_dot_product_attention", **_EXACT_SPEC))
@dataclass(frozen=True)
class SDPA(Exact):
    method = "sdpa"


@register("tiled", Spec(weights=True, dropout=False, time="O(L·S·D)", memory="O(L·D + block²)",
                        summary="online-softmax tiles (FlashAttention's algorithm), recompute backward",
                        **{**_EXACT_SPEC, "paper": "Dao et al. 2022, FlashAttention"}))
@dataclass(frozen=True)
class Tiled(Exact):
    block_size: int | None = None
    method = "tiled"

    def __post_init__(self):
        if self.block_size is not None:
            _check_int("block_size", self.block_size, 1)


@register("sparse", Spec(weights=False, dropout=True, time="O(nnz blocks·block²·D)", memory="O(nnz)",
                         summary="only the non-empty key blocks of a mask, through the fused kernel",
                         **_EXACT_SPEC))
@dataclass(frozen=True)
class Sparse(Exact):
    block_size: int | None = None
    method = "sparse"

    def __post_init__(self):
        if self.block_size is not None:
            _check_int("block_size", self.block_size, 1)


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
    stride: int = 64
    causal: bool = True
    method: str = "auto"

    def pattern_for(self):
        return P.strided(self.stride, self.causal)


@register("fixed", _pspec("O(L·(b + L·c/b)·D)", "O(L·(b + L·c/b))", "Child et al. 2019 (Sparse Transformer)",
                          "own block plus the last `summary` positions of every block"))
@dataclass(frozen=True)
class Fixed(PatternMechanism):
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
