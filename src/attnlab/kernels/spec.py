"""What each attention kernel supports and costs, declared as data (as xformers' fmha ops do).

Every kernel module declares one :class:`KernelSpec` (``SPEC``). The planner
(``attnlab.kernels.planner``: ``refusals_of``), the mechanism registry, ``explain`` and ``attnlab check``
read these declarations; none of them re-codes a kernel's limits.

Legend: N batch (leading dims flattened), H heads, Hkv key/value heads, L query length, S key length,
E query/key head dim, Ev value head dim.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..files import format_bytes

__all__ = ["KernelSpec", "Request", "Tiling", "FLOAT_DTYPES", "io_bytes", "alibi_mask_bytes", "refusals_of",
           "check_block_size"]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class Request:
    """One attention call described by sizes and flags, enough to decide support and cost without
    running it (``attnlab.shapes.Prepared.request`` builds one from real inputs).

    causal_only: the only mask is top-left causal (SDPA's ``is_causal``).
    pattern: a structured pattern other than plain causal is part of the mask.
    keep_mask / float_mask: a user bool / float ``attn_mask`` takes part; float_mask_grad: it requires grad.
    dead_per_head: under GQA some keys are dead for only part of a key/value head's group.
    sdpa_backend: the backend PyTorch's SDPA would pick ("math", "flash", ...), or None when not asked.
    needs_lse: the caller wants each row's log-sum-exp too (``attention_with_lse``); needs_grad: autograd
        will differentiate the result.
    softcap: tanh soft-capping of the scores is asked for; alibi: ALiBi slopes are given, of shape "[H]" or
        "[B, H]" (None: no ALiBi).
    rel_bias: a relative bias table [H, L + S - 1] is added to the scores (``flex_attention``'s relative
        score_mod, a declared score modification like ALiBi). rel_bias_grad: that table (the compiled kernel's ``rel_bias``, from
        ``flex_attention``) requires grad: the backward sums its gradient per unit (csrc Note [Relative bias]).
    sinks: learned attention sinks are given (``sinks=``, one logit s_h per query head, gpt-oss): exp(s_h) joins
        each row's softmax denominator (Note [Attention sinks] in ``kernels.lse``).
    cache: the keys and values are a KV-cache view (``kernels.cacheview.CacheCall``: flash-attn's layout) of
        this kind: "contiguous" (one length for every sequence, rows [B, S]), "lengths" (a length per
        sequence) or "paged" (a block table into a page pool); None: ordinary tensors.
    cache_layout: that cache's memory order: "heads-first" ([B, Hkv, S, D] memory, each head's rows contiguous:
        attnlab's and transformers' caches, read through transposed views) or "tokens-first" (flash-attn's
        [B, S, Hkv, D] memory); None for ordinary tensors.
    quantized: that cache is int8 (``QuantizedKV``). transformed: the inputs are wrapped by a vmap/grad
        transform (``kernels.extension.transformed``).
    """

    N: int
    H: int
    Hkv: int
    L: int
    S: int
    E: int
    Ev: int
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    causal_only: bool = False
    pattern: bool = False
    keep_mask: bool = False
    float_mask: bool = False
    float_mask_grad: bool = False
    dropout_p: float = 0.0
    need_weights: bool = False
    strict: bool = False
    dead_per_head: bool = False
    sdpa_backend: str | None = None
    needs_lse: bool = False
    needs_grad: bool = False
    softcap: bool = False
    alibi: str | None = None
    rel_bias_grad: bool = False
    rel_bias: bool = False
    sinks: bool = False
    cache: str | None = None
    cache_layout: str | None = None
    quantized: bool = False
    transformed: bool = False

    @property
    def trivial(self) -> bool:
        """No mask or bias of any kind (not even causal or ALiBi); soft-capping may still be asked for."""
        return not (self.causal_only or self.pattern or self.keep_mask or self.float_mask or self.alibi
                    or self.rel_bias)

    @property
    def score_mods(self) -> bool:
        """Soft-capping or ALiBi is asked for."""
        return self.softcap or self.alibi is not None or self.rel_bias

    @property
    def element_size(self) -> int:
        """Bytes per element of the inputs' dtype."""
        return self.dtype.itemsize

    @property
    def pairs(self) -> int:
        """(query, key) pairs over every batch element and head: N·H·L·S."""
        return self.N * self.H * self.L * self.S


@dataclass(frozen=True)
class Tiling:
    """A blocked kernel's tile shape and how many (block_q × block_k) tiles it visits (None: every pair
    is computed, no layout was built); ``decode``: the kernel runs its decode path instead of its tiles
    (few queries against a KV cache: the compiled kernel's, csrc/decode.cpp)."""

    block_q: int
    block_k: int
    blocks: int | None = None
    decode: bool = False

    def computed(self, L: int, S: int) -> int:
        """(query, key) pairs the visited tiles cover per batch element and head (at most 4·L·S)."""
        if self.blocks is None:
            return L * S
        return min(self.blocks * self.block_q * self.block_k, max(L, 1) * max(S, 1) * 4)


def io_bytes(r: Request) -> int:
    """Bytes of q, k, v, the output and their gradients' worth of inputs: what every kernel reads/writes."""
    el = r.element_size
    return r.N * r.H * r.L * (r.E + 2 * r.Ev) * el + 2 * r.N * r.H * r.S * (r.E + r.Ev) * el


def alibi_mask_bytes(r: Request) -> int:
    """Bytes of ALiBi written out as a float mask [B|1, H, L, S] (float32, float64 for float64 inputs):
    what a kernel that takes no slopes pays for them."""
    if r.alibi is None:
        return 0
    return (r.N if r.alibi == "[B, H]" else 1) * r.H * r.L * r.S * max(4, r.element_size)


#: ALiBi slope shapes a request may carry (``Request.alibi``)
ALIBI_SHAPES = ("[H]", "[B, H]")


@dataclass(frozen=True)
class KernelSpec:
    """A kernel's capabilities and cost model, as data.

    masks: applies patterns and user bool/float masks; causal: applies ``is_causal``.
    weights: "no" | "yes" (returns them) | "second pass" (recomputes them from the saved log-sum-exp).
    lse: returns each row's log-sum-exp: "no" | "yes" | "inference" (only without autograd, on CPU, and
        with no mask but causal: PyTorch's private CPU flash op).
    materializes: "scores" (always builds [N, H, L, S]), "mask" (a pattern becomes an L×S mask, and
        PyTorch's math backend builds the scores), "never".
    needs_sparsity: refuses inputs with no mask at all (nothing to skip).
    float_mask_grad: differentiates a float ``attn_mask`` that requires grad.
    gqa_no_copy: reads key/value heads in place under GQA (so per-head dead keys cannot be zeroed).
    needs_extension: runs only when attnlab's compiled extension loads.
    softcap: applies tanh soft-capping (s -> softcap·tanh(s / softcap)) to the scaled scores, with its
        gradient.
    alibi: how it applies ALiBi slopes: "no" | "native" (the slopes are read inside the compiled tiles) |
        "positions" (each visited block's bias is computed from positions) | "mask" (written out as an
        L×S float mask per head first: ``alibi_mask_bytes``). alibi_shapes: the slope shapes it takes.
    devices: device types it runs on (None: any).
    backward: differentiates its output (False: inference only, refused when the inputs require grad).
    rel_bias: adds a relative bias table [H, L + S - 1] inside its tiles, with its gradient.
    sinks: takes attention sinks (``Request.sinks``), with their gradient where it has a backward: in its softmax,
        or by rescaling its output from its log-sum-exp (Note [Attention sinks] in ``kernels.lse``).
    max_queries: a decode kernel's longest query (it needs L <= max_queries, and outside a KV-cache view
        1 <= L < S: a short self-attention, L = S, stays on the prefill kernels); None: any shape.
    cache_views: the KV-cache views it reads in place (``Request.cache``); cache_layouts: the memory orders of
        those views it reads (``Request.cache_layout``); quantized_cache: it reads int8 caches; transforms: it runs
        under vmap/grad transforms.
    peak_bytes / flops: ``f(request, tiling)`` (tiling None for unblocked kernels).
    unavailable: a hook for dynamic facts (e.g. "extension not built"): ``f(request) -> reason | None``.
    explain: a hook for what this CPU makes the kernel do beyond its usual work, for ``notes``:
        ``f(request) -> line | None``.
    """

    name: str
    summary: str
    masks: bool = True
    causal: bool = True
    weights: str = "no"
    lse: str = "no"
    dropout: bool = False
    backward: bool = True
    float_mask_grad: bool = False
    gqa_no_copy: bool = False
    materializes: str = "never"
    needs_sparsity: bool = False
    needs_extension: bool = False
    blocked: bool = False
    softcap: bool = False
    alibi: str = "no"
    alibi_shapes: tuple[str, ...] = ALIBI_SHAPES
    dtypes: tuple = FLOAT_DTYPES
    devices: tuple[str, ...] | None = None
    rel_bias: bool = False
    sinks: bool = False
    max_queries: int | None = None
    cache_views: tuple[str, ...] = ()
    cache_layouts: tuple[str, ...] = ("heads-first", "tokens-first")
    quantized_cache: bool = False
    transforms: bool = True
    peak_bytes: Callable[[Request, Tiling | None], int] | None = field(default=None, compare=False)
    flops: Callable[[Request, Tiling | None], int] | None = field(default=None, compare=False)
    unavailable: Callable[[Request], str | None] | None = field(default=None, compare=False)
    explain: Callable[[Request], str | None] | None = field(default=None, compare=False)

    def not_supported_reasons(self, r: Request) -> list[str]:
        """Every reason this kernel cannot run ``r`` (empty: it can), derived from the fields above."""
        why: list[str] = []
        if self.unavailable is not None:
            u = self.unavailable(r)
            if u:
                why.append(u)
        if self.devices is not None and r.device not in self.devices:
            why.append(f"{'/'.join(d.upper() for d in self.devices)} tensors only (got {r.device})")
        if r.dtype not in self.dtypes:
            why.append(f"dtype {r.dtype} is not supported")
        if self.max_queries is not None and not (r.L <= self.max_queries and (r.cache is not None
                                                                             or 1 <= r.L < r.S)):
            why.append(f"decodes 1..{self.max_queries} queries against more keys (a KV cache), got L = {r.L}, "
                       f"S = {r.S}")
        if r.needs_grad and not self.backward:
            why.append("forward only (inference): the inputs require grad")
        if r.cache is not None and r.cache not in self.cache_views:
            why.append(f"reads no KV-cache view ({r.cache} cache)")
        elif r.cache is not None and r.cache_layout not in self.cache_layouts:
            why.append(f"reads a KV cache only {' or '.join(self.cache_layouts)} in memory, this one is "
                       f"{r.cache_layout} (Note [Cache layouts])")
        if r.quantized and not self.quantized_cache:
            why.append("reads no int8 cache")
        if r.transformed and not self.transforms:
            why.append("its extension cannot be reached through a vmap/grad transform's wrapped tensors")
        if (r.pattern or r.keep_mask or r.float_mask) and not self.masks:
            why.append("takes no pattern or attn_mask")
        if r.causal_only and not self.causal:
            why.append("does not apply is_causal")
        if r.dropout_p > 0 and not self.dropout:
            why.append("no dropout (its backward recomputes the weights; use sdpa, sparse or dense)")
        if r.float_mask_grad and not self.float_mask_grad:
            why.append("does not differentiate a float attn_mask that requires grad")
        if r.dead_per_head and self.gqa_no_copy:
            why.append("a per-head mask under GQA leaves some keys dead in only part of a key/value "
                       "head's group (their NaN-safe zeroing needs per-head copies)")
        if r.need_weights and self.weights == "no":
            why.append("cannot return attention weights (need_weights=True)")
        if r.strict:
            if r.need_weights and self.weights != "no":
                why.append("strict=True: need_weights returns an L×S tensor; use attnlab.probe(...) "
                           "for streaming summaries")
            elif self.materializes == "scores":
                why.append("strict=True: it materialises the L×S scores")
            if self.materializes == "mask":
                if r.sdpa_backend == "math":
                    why.append("strict=True: PyTorch would run its math backend, which materialises L×S")
                elif r.pattern:
                    why.append("strict=True: the pattern would be materialised as an L×S mask")
        if r.needs_lse and self.lse == "no":
            why.append("does not return the log-sum-exp")
        elif r.needs_lse and self.lse == "inference":
            if r.needs_grad:
                why.append("its log-sum-exp comes from PyTorch's private CPU flash op, which has no autograd here")
            if r.device != "cpu":
                why.append(f"its log-sum-exp comes from PyTorch's private CPU flash op (got {r.device})")
            if not (r.trivial or r.causal_only):
                why.append("its log-sum-exp path takes no mask but causal")
        if self.needs_sparsity and r.trivial:
            why.append("no pattern or mask to skip work with (nothing is sparse)")
        if r.softcap and not self.softcap:
            why.append("no soft-capping (softcap=)")
        if r.sinks and not self.sinks:
            why.append("no attention sinks (sinks=): its softmax takes no sink and it has no differentiable log-sum-exp "
                       "to rescale by")
        if r.rel_bias and not self.rel_bias:
            why.append("no relative bias table (flex_attention's score_mod of kv_idx - q_idx)")
        if r.alibi is not None:
            if self.alibi == "no":
                why.append("no ALiBi (alibi_slopes=)")
            elif r.alibi not in self.alibi_shapes:
                why.append(f"takes alibi_slopes of shape {' or '.join(self.alibi_shapes)} only, got {r.alibi}")
            elif self.alibi == "mask" and r.strict:
                why.append("strict=True: ALiBi would be written out as an L×S float mask per head")
        return why

    def notes(self, r: Request) -> list[str]:
        """What running ``r`` here costs beyond the kernel's usual work, for ``explain`` (empty: nothing)."""
        out = []
        if r.alibi is not None and self.alibi == "mask" and r.alibi in self.alibi_shapes:
            out.append(f"ALiBi written out as a [{'B' if r.alibi == '[B, H]' else '1'}, H, L, S] float mask: "
                       f"{format_bytes(alibi_mask_bytes(r))}")
        if self.explain is not None and (line := self.explain(r)):
            out.append(line)
        return out


def refusals_of(kernels, r: Request) -> tuple[tuple[str, str], ...]:
    """((kernel name, every reason it cannot run ``r``, joined by "; "), ...) for each of ``kernels`` (objects
    holding a ``spec``: :class:`KernelSpec`) that refuses ``r``, in their order: the declarations alone."""
    out = []
    for k in kernels:
        spec: KernelSpec = k.spec
        why = KernelSpec.not_supported_reasons(spec, r)
        if why:
            out.append((spec.name, "; ".join(why)))
    return tuple(out)


def check_block_size(block_size) -> int | None:
    """``block_size`` for the tiled and sparse kernels: None (the default) or an int >= 1."""
    if block_size is None:
        return None
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"block_size must be an int >= 1 or None, got {block_size!r} ({type(block_size).__name__})")
    if block_size < 1:
        raise ValueError(f"block_size must be an int >= 1 or None, got {block_size}")
    return block_size
