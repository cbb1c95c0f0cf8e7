"""attention_with_kvcache: decode against a KV cache with flash-attn's ``flash_attn_with_kvcache`` semantics.

Legend: B batch, L new queries, Lnew new keys, H query heads, Hkv key/value heads, S cache capacity per
sequence, D head dim, Dv value head dim, P pages of T tokens (paged cache).

Layout is flash-attn's, so ported calls run unchanged: q [B, L, H, D], caches [B, S, Hkv, D] or a page pool
[P, T, Hkv, D], out [B, L, H, Dv]. The kernel reads every tensor through its strides, so a cache kept in
attnlab's [B, Hkv, S, D] layout is passed as ``k_cache.transpose(1, 2)`` (a view: no copy, and appends land
in the original tensor); likewise a [B, H, L, D] query as ``q.transpose(1, 2)``.

Two extras over flash-attn's arguments: an int8 cache (``QuantizedKV``, ``functional.kvquant``) and ``rotary``
(``Rotary``: flash-attn's rotary_cos / rotary_sin, also accepted under those names).

The door, as every door: check once (``functional.cacheargs``, Note [Checked, then appended]), append (the one
append, ``storage.append_kv``), ask the planner (``kernels.planner.plan_cache``) and run the plan's kernel on the
cache view (``Kernel.run_cache``). Where no kernel reads the view (another device, no extension, more than 16
queries) the cache is gathered into ordinary tensors and planned as an ordinary call (``attention_with_lse``).
"""
from __future__ import annotations

import math

import torch

from ..kernels import DECODE, SDPA, Declined
from ..kernels.cacheview import layout_of
from ..kernels.planner import plain_decode_kernel, plan_cache
from ..shapes import AttentionDtypeError, AttentionInputError
from . import cacheargs
from . import ops as _ops
from .cacheargs import Rotary
from .kvquant import INT8_ERROR_BUDGET, QuantizedKV
from .storage import append_kv

__all__ = ["attention_with_kvcache", "QuantizedKV", "Rotary", "INT8_ERROR_BUDGET"]

_F32_MAX = torch.finfo(torch.float32).max  # a larger or non-finite scale takes the checks (shapes' Note [Scalars in float32])


def attention_with_kvcache(q: torch.Tensor, k_cache, v_cache,
                           k: torch.Tensor | None = None, v: torch.Tensor | None = None, *,
                           cache_seqlens: int | torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                           is_causal: bool = True, window_size: tuple[int, int] | None = None,
                           softcap: float | None = None, alibi_slopes: torch.Tensor | None = None,
                           rotary: Rotary | tuple | None = None, rotary_cos: torch.Tensor | None = None,
                           rotary_sin: torch.Tensor | None = None, rotary_interleaved: bool = False,
                           scale: float | None = None, num_splits: int | None = None, return_lse: bool = False,
                           sinks: torch.Tensor | None = None):
    """Attention of new queries against a KV cache, appending new keys/values in place first
    (flash-attn's ``flash_attn_with_kvcache``; ``scale`` is its ``softmax_scale``, ``is_causal`` its
    ``causal``, True by default here).

    Args:
        q: [B, L, H, D], L small (decode: 1; speculative verification / chunked prefill: a few).
        k_cache, v_cache: [B, S, Hkv, D|Dv] contiguous caches, or with ``block_table`` page pools
            [P, T, Hkv, D|Dv] of any page size T. Any strides with a contiguous last dim. q's dtype, or
            both int8: ``QuantizedKV`` (or a pair (int8 data, float32 scale [B|P, S|T, Hkv])), the new k, v
            quantised on append (error budget: Note [int8 KV error budget], ``INT8_ERROR_BUDGET``).
        k, v: optional [B, Lnew, Hkv, D|Dv]: written into the caches at positions
            ``cache_seqlens[b] .. cache_seqlens[b] + Lnew - 1`` of sequence b (in place, as flash-attn does;
            ``cache_seqlens`` itself is not advanced: the caller adds Lnew).
        cache_seqlens: int or int [B]: keys already in each sequence's cache (default: the whole
            capacity, and then k, v cannot be given). Sequence b attends to its first
            ``cache_seqlens[b] + Lnew`` keys.
        block_table: int32 [B, pages]: sequence b's token t lives in page ``block_table[b, t // T]``.
        is_causal: bottom-right causal (query i sees keys j <= i + seqlen_k - L: the last query sees all).
        window_size: (left, right), -1 = unbounded: query i at position i' = i + seqlen_k - L sees keys
            i' - left .. i' + right (right is 0 under is_causal).
        softcap: tanh soft-capping of the scaled scores (0.0 or None: off). alibi_slopes: [H] or [B, H]
            float32, adds ``-slope·|i' - j|``.
        rotary: ``Rotary(cos, sin, interleaved)`` or a (cos, sin) pair, cos/sin [seqlen_ro, rotary_dim / 2]
            (flash-attn's ``rotary_cos``, ``rotary_sin``, ``rotary_interleaved``, also accepted by those names):
            the new k is rotated at positions ``cache_seqlens[b] + i`` before its append, and q at
            ``cache_seqlens[b] + i`` under is_causal or a window, else every query at ``cache_seqlens[b]``
            (flash-attn's rule). Needs k, v.
        num_splits: key splits per (sequence, kv head); None: the kernel's heuristic (results agree within fp32
            rounding). return_lse: also return the log-sum-exp [B, H, L] (float32; -inf for a row seeing no key).
        sinks: attention sinks [H] (gpt-oss; flash-attn's ``s_aux``): one logit per query head added to each
            row's softmax denominator only (Note [Attention sinks] in ``attnlab.kernels.lse``); lse includes it.

    Returns: out [B, L, H, Dv] in q's dtype (a row that sees no key is 0), and lse with return_lse.

    Equivalent to ``attnlab.attention`` per sequence b on its first ``cache_seqlens[b] + Lnew`` keys (after the
    append) with ``enable_gqa=True, pattern=causal("bottom_right")``. Forward only. Cost: each K/V row read once
    per kv head group, split across threads. The kernel is the planner's (``kernels.planner.plan_cache``): the
    decode kernel (a plain step in one extension call), or SDPA on a plain heads-first cache where it is faster.
    """
    if torch.compiler.is_compiling():  # functional's Note [Doors as torch ops]: under compile the door is an op
        return _ops.kvcache_call(q, k_cache, v_cache, k, v, cache_seqlens, block_table, is_causal, window_size, softcap,
                                 alibi_slopes, rotary, rotary_cos, rotary_sin, scale, num_splits, return_lse, sinks)
    if ((type(cache_seqlens) is int and 0 <= cache_seqlens < 2**62 or type(cache_seqlens) is torch.Tensor)
            and type(k_cache) is torch.Tensor and type(q) is torch.Tensor and q.dim() == 4 and k_cache.dim() == 4
            and q.device.type == "cpu" and rotary is None and rotary_cos is None and window_size is None
            and not return_lse and num_splits is None and alibi_slopes is None and not softcap and sinks is None
            and (scale is None or type(scale) in (int, float) and abs(scale) <= _F32_MAX)):  # (finite in float32)
        # Note [Plain steps on the decode kernel]: a plain step takes the direct path of the kernel the one rule gives
        # it: the decode kernel for pages, per-sequence lengths or a tokens-first cache (SDPA reads none: Note [Cache
        # layouts]); on a heads-first cache the rule's pick. The checks and the append are one extension call.
        sc, out = scale if scale is not None else 1.0 / math.sqrt(q.shape[3]) if q.shape[3] else 1.0, None
        if (block_table is not None or type(cache_seqlens) is not int or layout_of(k_cache) == "tokens-first"
                or plain_decode_kernel(q.dtype, q.shape[2], k_cache.shape[2], cache_seqlens + (
                    k.shape[1] if type(k) is torch.Tensor and k.dim() == 4 else 0)) is DECODE):
            out = DECODE.step(q, k_cache, v_cache, k, v, cache_seqlens, block_table, bool(is_causal), sc)
        elif q.shape[1] == 1 or not is_causal:  # SDPA's direct path, every query seeing every key (Note [SDPA steps])
            out = SDPA.step(q, k_cache, v_cache, k, v, cache_seqlens, sc)
        if out is not None:
            return out
    try:
        c = cacheargs.check(q, k_cache, v_cache, k, v, cache_seqlens, block_table, is_causal, window_size, softcap,
                            alibi_slopes, rotary, rotary_cos, rotary_sin, rotary_interleaved, scale, num_splits,
                            return_lse, sinks)
    except (AttentionInputError, TypeError) as e:  # every message names the function, on one line
        if str(e).startswith("attention_with_kvcache") or type(e) not in (AttentionInputError, AttentionDtypeError, TypeError):
            raise
        raise type(e)(f"attention_with_kvcache: {' '.join(str(e).split())}") from None
    for cache, new in ((c.k_cache, c.k), (c.v_cache, c.v)) if c.k is not None else ():  # checked, then appended
        append_kv(cache, new, c.start, pos=c.pos, block_table=c.call.block_table)
    out, lse = _run(c.call)
    return (out, lse) if return_lse else out


def _run(call):
    """(out [B, L, H, Dv], lse [B, H, L] or None): the planned kernel on the cache view, or the gathered call."""
    try:
        plan = plan_cache(call)
    except ValueError:  # no kernel reads this view
        plan = None
    if plan is not None:
        try:
            out, lse = plan.kernel.run_cache(call)
            if lse is not None or not call.need_lse:
                return out, lse
        except Declined:
            pass
        except RuntimeError as e:  # the kernel checks every page a visible key reaches once more
            bad = cacheargs.PAGE_ERROR.search(str(e))
            if bad is None:
                raise
            raise cacheargs.page_error(*bad.groups(), call.k) from None
    from . import attention_with_lse  # (the package's door imports this module)
    q = call.q.transpose(1, 2)
    k, v = call.gathered(torch.float32)
    out, lse = attention_with_lse(q.float(), k, v, attn_mask=call.mask(), scale=call.scale, enable_gqa=True,
                                  softcap=call.softcap, sinks=call.sinks)
    return out.to(call.q.dtype).transpose(1, 2).contiguous(), lse
