"""attention_with_kvcache: decode against a KV cache with flash-attn's ``flash_attn_with_kvcache`` semantics.

Legend: B batch, L new queries, Lnew new keys, H query heads, Hkv key/value heads, S cache capacity per
sequence, D head dim, Dv value head dim, P pages of T tokens (paged cache).

Layout is flash-attn's, so ported calls run unchanged: q [B, L, H, D], caches [B, S, Hkv, D] or a page pool
[P, T, Hkv, D], out [B, L, H, Dv]. The kernel reads every tensor through its strides, so a cache kept in
attnlab's [B, Hkv, S, D] layout is passed as ``k_cache.transpose(1, 2)`` (a view: no copy, and appends land
in the original tensor); likewise a [B, H, L, D] query as ``q.transpose(1, 2)``.

Two extras over flash-attn's arguments: an int8 cache (``QuantizedKV``: int8 rows with one float32 scale per
token and kv head, quantised on append, dequantised inside the decode kernel) and ``rotary`` (``Rotary``:
flash-attn's rotary_cos / rotary_sin, also accepted under those names).
"""
from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass

import torch

from ..kernels import decode as decode_kernel
from ..kernels import rates as kernel_rates
from ..shapes import AttentionDtypeError, AttentionInputError, check_softcap, shape_str
from .kvquant import INT8_ERROR_BUDGET, QuantizedKV, _quantize

__all__ = ["attention_with_kvcache", "QuantizedKV", "Rotary", "INT8_ERROR_BUDGET"]

@dataclass(frozen=True)
class Rotary:
    """Rotary embedding for ``attention_with_kvcache`` in flash-attn's form: ``cos``, ``sin`` [seqlen_ro,
    rotary_dim / 2] (position p's angles), the first rotary_dim features rotated. ``interleaved`` pairs
    features (0, 1), (2, 3), ... (GPT-J); else (i, i + rotary_dim / 2) (GPT-NeoX / LLaMA, attnlab's
    ``RotaryEmbedding``). Su et al. 2021, "RoFormer"."""

    cos: torch.Tensor
    sin: torch.Tensor
    interleaved: bool = False


def _rotary(rotary, rotary_cos, rotary_sin, rotary_interleaved, D: int) -> Rotary | None:
    if rotary is None and rotary_cos is None and rotary_sin is None:
        return None
    if rotary is not None and (rotary_cos is not None or rotary_sin is not None):
        raise AttentionInputError("give rotary= or rotary_cos= / rotary_sin=, not both")
    if rotary is None:
        if rotary_cos is None or rotary_sin is None:
            raise AttentionInputError("rotary_cos and rotary_sin go together: give both")
        rotary = Rotary(rotary_cos, rotary_sin, bool(rotary_interleaved))
    elif isinstance(rotary, (tuple, list)) and len(rotary) == 2:
        rotary = Rotary(rotary[0], rotary[1], bool(rotary_interleaved))
    elif not isinstance(rotary, Rotary):
        raise TypeError(f"attention_with_kvcache: rotary must be an attnlab Rotary(cos, sin, interleaved) or a (cos, sin) pair, got "
                        f"{type(rotary).__name__}")
    c, s_ = rotary.cos, rotary.sin
    if not (isinstance(c, torch.Tensor) and isinstance(s_, torch.Tensor) and c.dim() == 2
            and c.shape == s_.shape and c.dtype.is_floating_point and s_.dtype.is_floating_point):
        raise AttentionInputError(f"rotary cos and sin must be floating tensors of one shape [seqlen_ro, "
                                  f"rotary_dim / 2], got {shape_str(c) if isinstance(c, torch.Tensor) else c!r} and "
                                  f"{shape_str(s_) if isinstance(s_, torch.Tensor) else s_!r}")
    if not 0 < 2 * c.shape[1] <= D:
        raise AttentionInputError(f"rotary cos {shape_str(c)}: rotary_dim = 2 x {c.shape[1]} must be in (0, D={D}]")
    return rotary


def _rotate(x: torch.Tensor, rot: Rotary, pos: torch.Tensor) -> torch.Tensor:
    """x [B, n, h, D] at positions pos [B, n] -> rotated (a new tensor, x's dtype; computed in fp32 as flash-attn)."""
    half = rot.cos.shape[1]
    rd = 2 * half
    c = rot.cos.to(device=x.device, dtype=torch.float32)[pos].unsqueeze(2)  # (B, n, 1, rd/2)
    s = rot.sin.to(device=x.device, dtype=torch.float32)[pos].unsqueeze(2)
    xr = x[..., :rd].to(torch.float32)
    if rot.interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]  # (B, n, h, rd/2) each
        yr = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), -1).flatten(-2)  # (B, n, h, rd)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        yr = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), -1)
    return torch.cat((yr.to(x.dtype), x[..., rd:]), -1)


def _as_quantized(c, name: str):
    """A QuantizedKV for a QuantizedKV or a (data, scale) pair; a tensor as it is."""
    if isinstance(c, QuantizedKV):
        return c
    if isinstance(c, (tuple, list)):
        if len(c) != 2:
            raise TypeError(f"attention_with_kvcache: {name} as a pair must be (int8 data, float32 scale), got {len(c)} items")
        try:
            return QuantizedKV(*c)
        except (AttentionInputError, AttentionDtypeError) as e:
            raise type(e)(f"{name}: {e}") from None
    return c


def _int_lengths(x, B: int, name: str) -> torch.Tensor:
    if isinstance(x, bool):
        raise TypeError(f"attention_with_kvcache: {name} must be an int or an integer tensor [B], got bool")
    if isinstance(x, int):
        return torch.full((B,), x, dtype=torch.int64)
    if not isinstance(x, torch.Tensor) or x.dtype.is_floating_point or x.dtype == torch.bool:
        raise TypeError(f"attention_with_kvcache: {name} must be an int or an integer tensor [B], got {type(x).__name__}"
                        + (f" {x.dtype}" if isinstance(x, torch.Tensor) else ""))
    if x.shape != (B,):
        raise AttentionInputError(f"{name} {shape_str(x)} must be [B] = [{B}] (one length per sequence of q)")
    x = x.to(device="cpu", dtype=torch.int64)
    if bool((x < 0).any()):
        raise AttentionInputError(f"{name} must be >= 0, got {x.tolist()}")
    return x


def _window(window_size, is_causal: bool) -> tuple[int, int]:
    """(left, right) in decode_kernel's form; flash-attn's -1 (or None) is an unbounded side."""
    left = right = -1
    if window_size is not None:
        if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
                or not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
            raise TypeError(f"attention_with_kvcache: window_size must be a pair of ints (left, right), -1 = unbounded, got {window_size!r}")
        left, right = window_size
        if left < -1 or right < -1:
            raise AttentionInputError(f"window_size sides must be >= 0 or -1 (unbounded), got {tuple(window_size)}")
    lo = decode_kernel.UNBOUNDED if left == -1 else left
    hi = decode_kernel.UNBOUNDED if right == -1 else right
    if is_causal:
        hi = 0
    return lo, hi


def _append(cache, new, pos: torch.Tensor, block_table: torch.Tensor | None) -> None:
    """cache[sequence b, positions pos[b, :]] = new[b] in place, through the page table when paged; an int8
    cache gets the quantised rows and their scales (``new`` then the (data, scale) pair of ``_quantize``, made
    before anything is written: Note [Checked, then appended])."""
    B, Lnew = pos.shape
    if block_table is None:
        idx = (torch.arange(B).unsqueeze(1), pos)  # [B, Lnew, Hkv, D] into [B, S, Hkv, D]
    else:
        T = cache.shape[1]
        idx = (block_table.long().gather(1, pos // T), pos % T)  # (B, Lnew) pages and offsets
    if isinstance(cache, QuantizedKV):
        data, scale = new
        cache.data[idx] = data
        cache.scale[idx] = scale
    else:
        cache[idx] = new.to(cache.dtype)


# Note [Checked, then appended]: nothing is written into a cache unless the whole call will succeed (issue 40,
# D3-D5): every argument is checked first (num_splits a positive int, scale a finite real number, the int8 rows
# quantised, so a non-finite k or v is refused), and every page the call will read (the append's among them:
# pages 0 .. ceil(seqlen / T) - 1 of each sequence, seqlen after the append) is range-checked against the pool
# in the caller's index dtype, before the table is cast to the kernel's int32 (an int64 entry of 2^32 wrapped
# to page 0 and was written and read). Then the append, then the attention. The plain step (csrc Note
# [One-call decode step]) does the same in C++ for the calls it takes; the decode kernel checks the pages it
# reads once more (csrc/decode.cpp), which no longer fires after these checks. Their cost on the full path: a
# comparison of the table's used columns, one reduction (the plain paged step, in C++, pays none of it).
_PAGE_ERROR = re.compile(r"block_table\[(\d+), (\d+)\] = (-?\d+) is outside the pool of (\d+) pages")


def _page_error(b, p, page, pool, kc_t: torch.Tensor) -> AttentionInputError:
    return AttentionInputError(f"block_table[{b}, {p}] = {page} points outside the pool of {pool} pages "
                               f"(k_cache {shape_str(kc_t)})")


def _check_pages(block_table: torch.Tensor, seqlens, T: int, pool: int, kc_t: torch.Tensor) -> None:
    """Raise naming the first entry ``block_table[b, p]`` with p·T < seqlens[b] (a page the call reads or
    writes) that lies outside the pool of ``pool`` pages, compared in block_table's own dtype (Note [Checked,
    then appended]). seqlens: an int (every sequence) or int64 [B]."""
    B, maxp = block_table.shape
    if B == 0 or maxp == 0:
        return
    bt = block_table.cpu()
    if isinstance(seqlens, int):
        bt = bt[:, :-(-seqlens // T)]  # the pages every sequence uses
        bad = (bt < 0) | (bt >= pool)
    else:
        used = torch.arange(maxp).unsqueeze(0) * T < seqlens.unsqueeze(1)  # (B, pages)
        bad = used & ((bt < 0) | (bt >= pool))
    if not bool(bad.any()):
        return
    b, p = (int(x) for x in bad.nonzero()[0])
    raise _page_error(b, p, int(bt[b, p]), pool, kc_t)


def _check_num_splits(num_splits) -> int | None:
    if num_splits is None:
        return None
    if isinstance(num_splits, bool) or not isinstance(num_splits, int):
        raise TypeError(f"attention_with_kvcache: num_splits must be a positive int or None (the kernel's choice), "
                        f"got {num_splits!r} ({type(num_splits).__name__})")
    if num_splits < 1:
        raise AttentionInputError(f"attention_with_kvcache: num_splits must be >= 1 (or None), got {num_splits}")
    return num_splits


def _check_scale(scale, D: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(D) if D else 1.0
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"attention_with_kvcache: scale must be a real number or None (1 / sqrt(D)), got {scale!r:.40} "
                        f"({type(scale).__name__})")
    if not math.isfinite(scale):
        raise AttentionInputError(f"attention_with_kvcache: scale must be finite, got {scale}")
    return float(scale)


def _append_rows(cache, new, start: int) -> None:
    """cache[:, start : start + Lnew] = new [B, Lnew, Hkv, D] in place (Note [One cache length]); an int8 cache
    gets the quantised rows and their scales (``new`` the (data, scale) pair of ``_quantize``)."""
    if isinstance(cache, QuantizedKV):
        data, scale = new
        stop = start + data.shape[1]
        cache.data[:, start:stop] = data
        cache.scale[:, start:stop] = scale
    else:
        cache[:, start:start + new.shape[1]] = new


def attention_with_kvcache(q: torch.Tensor, k_cache, v_cache,
                           k: torch.Tensor | None = None, v: torch.Tensor | None = None, *,
                           cache_seqlens: int | torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                           is_causal: bool = True, window_size: tuple[int, int] | None = None,
                           softcap: float | None = None, alibi_slopes: torch.Tensor | None = None,
                           rotary: Rotary | tuple | None = None, rotary_cos: torch.Tensor | None = None,
                           rotary_sin: torch.Tensor | None = None, rotary_interleaved: bool = False,
                           scale: float | None = None, num_splits: int | None = None, return_lse: bool = False):
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
        num_splits: key splits per (sequence, kv head); None: the kernel's heuristic. Results agree
            across split counts within fp32 rounding.
        return_lse: also return the log-sum-exp [B, H, L] (float32; -inf for a row that sees no key).

    Returns: out [B, L, H, Dv] in q's dtype (a row that sees no key is 0), and lse with return_lse.

    Equivalent to (per sequence b, with n = cache_seqlens[b] + Lnew, after the append):
    ``attnlab.attention(q[b].transpose(0, 1), k_cache[b, :n].transpose(0, 1), v_cache[b, :n].transpose(0, 1),
    enable_gqa=True, pattern=causal("bottom_right"))`` transposed back. Forward only (inference).
    Cost: reads each sequence's K/V once per kv head group (``decode_kernel.kv_bytes``), split across
    threads (flash-decoding); memory O(B·H·L·Dv·splits). A plain call (one int length, a contiguous floating
    cache, every query seeing every key, no lse) runs where the planner sends plain decode: PyTorch's SDPA on
    views of the cache for multi-head fp32 below the calibrated cache length (Note [Plain decode on SDPA here]),
    except the plain steps (an int length, optional k, v, contiguous or paged, causal or not), which run in one
    extension call that checks, appends and runs the decode kernel (csrc Note [One-call decode step]).
    """
    if (type(cache_seqlens) is int and 0 <= cache_seqlens < 2**62
            and rotary is None and rotary_cos is None and rotary_sin is None and window_size is None and not return_lse and num_splits is None and alibi_slopes is None
            and (softcap is None or softcap == 0) and type(k_cache) is torch.Tensor and type(q) is torch.Tensor):
        out = _one_call_step(q, k_cache, v_cache, k, v, cache_seqlens, block_table, is_causal, scale)
        if out is not None:
            return out
    try:
        return _full_path(q, k_cache, v_cache, k, v, cache_seqlens, block_table, is_causal, window_size, softcap,
                          alibi_slopes, rotary, rotary_cos, rotary_sin, rotary_interleaved, scale, num_splits,
                          return_lse)
    except (AttentionInputError, TypeError) as e:  # every message names the function, on one line
        if str(e).startswith("attention_with_kvcache") or type(e) not in (AttentionInputError, AttentionDtypeError,
                                                                          TypeError):
            raise
        raise type(e)(f"attention_with_kvcache: {' '.join(str(e).split())}") from None


def _full_path(q, k_cache, v_cache, k, v, cache_seqlens, block_table, is_causal, window_size, softcap, alibi_slopes,
               rotary, rotary_cos, rotary_sin, rotary_interleaved, scale, num_splits, return_lse):
    """attention_with_kvcache's every path but the one-call step: checks, then the append, then the attention
    (Note [Checked, then appended])."""
    k_cache, v_cache = _as_quantized(k_cache, "k_cache"), _as_quantized(v_cache, "v_cache")
    quant = isinstance(k_cache, QuantizedKV)
    if quant != isinstance(v_cache, QuantizedKV):
        raise AttentionDtypeError("k_cache and v_cache must both be int8 (QuantizedKV) or both floating, got "
                                  f"{type(k_cache).__name__} and {type(v_cache).__name__}")
    kc_t = k_cache.data if quant else k_cache
    vc_t = v_cache.data if quant else v_cache
    for name, t in (("q", q), ("k_cache", kc_t), ("v_cache", vc_t), ("k", k), ("v", v)):
        if t is None and name in ("k", "v"):
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"attention_with_kvcache: {name} must be a torch.Tensor"
                            f"{' or an attnlab QuantizedKV' if 'cache' in name else ''}, "
                            f"got {type(t).__name__}")
        if t.dim() != 4:
            raise AttentionInputError(f"{name} must be 4-D (flash-attn's layout: q [B, L, H, D], caches "
                                      f"[B, S, Hkv, D] or pages [P, T, Hkv, D]), got {shape_str(t)}")
        if quant and "cache" in name:
            pass  # int8, checked by QuantizedKV
        elif t.dtype not in decode_kernel.DTYPES:
            raise AttentionDtypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
        elif t.dtype != q.dtype:
            raise AttentionDtypeError(f"q and {name} must share one dtype, got {q.dtype} and {t.dtype}")
        if t.device != q.device:
            raise AttentionInputError(f"q is on {q.device} but {name} is on {t.device}")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, kc_t, vc_t, k, v)):
        raise AttentionInputError("attention_with_kvcache is inference only: q, the caches or k, v require grad; "
                                  "call it under torch.no_grad() (attnlab.attention differentiates)")
    if (k is None) != (v is None):
        raise AttentionInputError("give both k and v (the new keys and values) or neither")
    B, L, H, D = q.shape
    P_, T, Hkv, Dk = kc_t.shape
    Dv = vc_t.shape[-1]
    if Dk != D or v_cache.shape[:3] != k_cache.shape[:3]:
        raise AttentionInputError(f"k_cache {shape_str(kc_t)} and v_cache {shape_str(vc_t)} must agree on "
                                  f"[P|B, T|S, Hkv] and k_cache's head dim must be q's D={D} (q {shape_str(q)})")
    if Hkv == 0 or H % Hkv:
        raise AttentionInputError(f"q's heads ({H}, dim 2 of {shape_str(q)}) must be a multiple of the caches' "
                                  f"kv heads ({Hkv}, dim 2 of {shape_str(kc_t)})")
    if block_table is None:
        if P_ != B:
            raise AttentionInputError(f"k_cache {shape_str(kc_t)} holds {P_} sequences but q {shape_str(q)} has "
                                      f"B={B} (a paged cache needs block_table)")
        capacity = T
    else:
        if not isinstance(block_table, torch.Tensor) or block_table.dtype.is_floating_point or block_table.is_complex() \
                or block_table.dtype == torch.bool or block_table.dim() != 2 or block_table.shape[0] != B:
            raise AttentionInputError(f"block_table must be an integer tensor [B, pages] = [{B}, ...], got "
                                      f"{shape_str(block_table) if isinstance(block_table, torch.Tensor) else block_table!r}"
                                      f"{' ' + str(block_table.dtype) if isinstance(block_table, torch.Tensor) else ''}")
        capacity = block_table.shape[1] * T  # (cast to int32 once its used pages are checked in its own dtype)
    # Note [One cache length]: an int cache_seqlens (or none: the whole capacity) is one length for every
    # sequence, kept a Python int: the overflow check needs no reduction, a contiguous cache's append is a
    # slice copy rather than an index_put, and the kernel's wrapper builds its length tensors from the int.
    # Per-sequence lengths [B] take the tensor path. Both write and read the same rows.
    n0 = cache = None
    if cache_seqlens is None:
        if k is not None:
            raise AttentionInputError("k, v are appended at cache_seqlens: give cache_seqlens (int or [B])")
        n0 = capacity
    elif type(cache_seqlens) is int:
        if cache_seqlens < 0:
            raise AttentionInputError(f"cache_seqlens must be >= 0, got {cache_seqlens}")
        n0 = cache_seqlens
    else:
        cache = _int_lengths(cache_seqlens, B, "cache_seqlens")
    Lnew = 0
    if k is not None:
        if k.shape[:3] != (B, k.shape[1], Hkv) or k.shape[3] != D or v.shape[:3] != k.shape[:3] or v.shape[3] != Dv:
            raise AttentionInputError(f"k {shape_str(k)} and v {shape_str(v)} must be [B, Lnew, Hkv, D|Dv] = "
                                      f"[{B}, Lnew, {Hkv}, {D}|{Dv}] (q {shape_str(q)}, k_cache {shape_str(kc_t)})")
        Lnew = k.shape[1]
    seqlens = n0 + Lnew if cache is None else cache + Lnew  # (int or [B])
    if B and (seqlens if cache is None else int(seqlens.max())) > capacity:
        b = 0 if cache is None else int(seqlens.argmax())
        raise AttentionInputError(
            f"the cache overflows: sequence {b} holds cache_seqlens={n0 if cache is None else int(cache[b])} keys "
            f"and {Lnew} new ones, but "
            f"its capacity is {capacity} ({'S' if block_table is None else 'pages x page size'} of k_cache "
            f"{shape_str(kc_t)})")
    if cache is None and (rotary is not None or rotary_cos is not None):
        cache = torch.full((B,), n0, dtype=torch.int64)  # the rotary path indexes per sequence
        seqlens = cache + Lnew
    lo, hi = _window(window_size, is_causal)
    cap = check_softcap(softcap)
    if cap and cap > torch.finfo(torch.float32).max:  # the decode path computes in float32: the identity there
        cap = None  # (Note [Soft-cap at infinity])
    slopes = _slopes(alibi_slopes, B, H)
    rot = _rotary(rotary, rotary_cos, rotary_sin, rotary_interleaved, D)
    scale = _check_scale(scale, D)
    splits = _check_num_splits(num_splits)
    if block_table is not None:  # every page read or written, in the caller's dtype (Note [Checked, then appended])
        _check_pages(block_table, seqlens, T, P_, kc_t)
        block_table = block_table.to(device="cpu", dtype=torch.int32).contiguous()
    if rot is not None:
        if k is None:
            raise AttentionInputError("rotary rotates the new k (and q) at cache_seqlens: give k, v (flash-attn's rule)")
        local = is_causal or window_size not in (None, (-1, -1))
        qpos = cache.unsqueeze(1) + (torch.arange(L) if local else torch.zeros(L, dtype=torch.int64))  # (B, L)
        kpos = cache.unsqueeze(1) + torch.arange(Lnew)  # (B, Lnew)
        top = max(int(qpos.max()) if qpos.numel() else 0, int(kpos.max()) if kpos.numel() else 0)
        if top >= rot.cos.shape[0]:
            raise AttentionInputError(f"rotary cos {shape_str(rot.cos)} covers positions < {rot.cos.shape[0]}, but "
                                      f"the queries / new keys reach position {top}")
        q = _rotate(q, rot, qpos)
        k = _rotate(k, rot, kpos)
    if k is not None and Lnew:
        if quant:  # both quantised before either is written: a non-finite v leaves k's cache untouched too
            k, v = _quantize(k), _quantize(v)
        if cache is None and block_table is None:  # one length, a contiguous cache: rows n0 .. n0 + Lnew - 1
            _append_rows(k_cache, k, n0)
            _append_rows(v_cache, v, n0)
        else:
            if cache is None:  # one length, paged
                pos = torch.arange(n0, n0 + Lnew).expand(B, Lnew)
            else:
                pos = cache.unsqueeze(1) + torch.arange(Lnew)  # (B, Lnew)
            _append(k_cache, k, pos, block_table)
            _append(v_cache, v, pos, block_table)
    # Note [Plain decode on SDPA here]: a plain call (one length, a contiguous floating cache, every query seeing
    # every key: L = 1 or not causal, no window, softcap, ALiBi or lse asked) goes where the planner sends plain
    # decode (kernels/planner.py Note [Plain MHA decode]: SDPA for multi-head fp32 below the calibrated cache
    # length, the decode path otherwise), on views of the cache: no copy. Measured (2 threads, MHA 8 x 64 fp32,
    # a [B, S, Hkv, D] cache, hot, per call): S = 512 SDPA 44.8 us vs the decode path 93.4; S = 2048 154 vs 180;
    # S = 4096 623 vs 400 (the calibration's crossover, 3.5-3.9k keys here, keeps that one on the decode path).
    # Only the full path follows this rule: the one-call step (csrc Note [One-call decode step]), which takes
    # these calls first, runs the kernel at every length (its measurements in that Note).
    if (cache is None and block_table is None and not quant and not return_lse and cap is None and slopes is None
            and lo == decode_kernel.UNBOUNDED and (hi == decode_kernel.UNBOUNDED or L == 1) and q.device.type == "cpu"
            and B and seqlens and kernel_rates.current().plain_decode_on_sdpa(q.dtype, H != Hkv, seqlens)):
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k_cache[:, :seqlens].transpose(1, 2), v_cache[:, :seqlens].transpose(1, 2),
            scale=scale, enable_gqa=H != Hkv)
        return out.transpose(1, 2)
    if q.device.type == "cpu" and decode_kernel.available() and L <= decode_kernel.MAX_QUERIES:
        kw = dict(k_scale=k_cache.scale, v_scale=v_cache.scale) if quant else {}
        if splits is not None:  # splits past the keys would be empty: at most one per key (no oversized buffers)
            splits = min(splits, max(1, seqlens if cache is None else int(seqlens.max()) if B else 1))
        try:  # the kernel checks every page a visible key reaches again (Note [Checked, then appended])
            out, lse = decode_kernel.decode_attention(  # q, out in [B, L, H, D]: no views (Note [Decode call overhead])
                q, kc_t, vc_t, scale=scale, block_table=block_table, seqlens=seqlens, left=lo, right=hi,
                softcap=cap or 0.0, alibi_slopes=slopes, splits=splits, blhd=True, **kw)
        except RuntimeError as e:
            bad = _PAGE_ERROR.search(str(e))
            if bad is None:
                raise
            raise _page_error(*bad.groups(), kc_t) from None
    else:
        if cache is None:
            seqlens = torch.full((B,), seqlens, dtype=torch.int64)
        kf = k_cache.dequantize() if quant else k_cache
        vf = v_cache.dequantize() if quant else v_cache
        out, lse = _fallback(q.transpose(1, 2), kf, vf, block_table, seqlens, lo, hi, cap, slopes, scale)
    return (out, lse) if return_lse else out


def _one_call_step(q, k_cache, v_cache, k, v, n0: int, block_table, is_causal, scale):
    """The plain step in one extension call (csrc Note [One-call decode step]), or None where the call is not
    one the step takes (nothing is written, and the full path runs and names any error). It runs the decode
    kernel at every length: the SDPA rule of the full path (Note [Plain decode on SDPA here]) was fitted to
    the full path's overhead; the step's kernel measured faster than the step running SDPA at every length
    (S = 512 .. 4096), and against SDPA called direct within 7 % in cache and 21 % after a cache flush below
    4096 keys, faster at 4096 (csrc Note [One-call decode step])."""
    if q.dim() != 4 or k_cache.dim() != 4 or q.device.type != "cpu":
        return None
    if scale is None:
        D = q.shape[3]
        scale = 1.0 / math.sqrt(D) if D else 1.0
    elif type(scale) not in (int, float) or not math.isfinite(scale):
        return None
    return decode_kernel.decode_step(q, k_cache, v_cache, k, v, n0, block_table, bool(is_causal), scale)


def _slopes(alibi_slopes, B: int, H: int):
    if alibi_slopes is None:
        return None
    a = alibi_slopes
    if not isinstance(a, torch.Tensor) or not a.dtype.is_floating_point:
        raise AttentionDtypeError(f"alibi_slopes must be a floating tensor [H] or [B, H], got {a!r:.60}")
    if tuple(a.shape) not in ((H,), (B, H)):
        raise AttentionInputError(f"alibi_slopes {shape_str(a)} must be [H] = [{H}] or [B, H] = [{B}, {H}]")
    if not bool(torch.isfinite(a).all()):
        raise AttentionInputError("alibi_slopes must be finite")
    return a.detach().to(device="cpu", dtype=torch.float32)


def _fallback(qh, k_cache, v_cache, block_table, seqlens, lo, hi, cap, slopes, scale):
    """The same attention through attnlab.attention_with_lse (no extension, another device, or L > MAX_QUERIES):
    each sequence's keys gathered to [B, Hkv, S, D], the mask written as a pattern."""
    from . import attention_with_lse
    B, H, L, _ = qh.shape
    S = int(seqlens.max()) if B else 0
    T = k_cache.shape[1]
    j = torch.arange(S)
    if block_table is None:
        kd, vd = k_cache[:, :S], v_cache[:, :S]
    else:  # a sequence's pages past its own length are not checked (nor read: masked below); page 0 stands in
        used = torch.arange(block_table.shape[1]).unsqueeze(0) * T < seqlens.unsqueeze(1)  # (B, pages)
        table = block_table.long().masked_fill(~used, 0)
        page = table[:, j // T] if S else torch.zeros(B, 0, dtype=torch.long)
        kd, vd = k_cache[page, j % T], v_cache[page, j % T]  # (B, S, Hkv, D)
    i = torch.arange(L).view(1, L, 1)
    pos = i + (seqlens - L).view(B, 1, 1)  # (B, L, 1)
    keep = (j.view(1, 1, S) < seqlens.view(B, 1, 1)) & (j >= pos - lo) & (j <= pos + hi)  # (B, L, S)
    bias = None
    if slopes is not None:
        sl = slopes.view(-1, H, 1, 1)
        bias = -sl * (pos.unsqueeze(1) - j.view(1, 1, 1, S)).abs().to(torch.float32)  # (B, H, L, S)
    mask = keep.unsqueeze(1) if bias is None else bias.masked_fill(~keep.unsqueeze(1), float("-inf"))
    out, lse = attention_with_lse(qh.float(), kd.transpose(1, 2).float(), vd.transpose(1, 2).float(),
                                  attn_mask=mask.to(qh.device), scale=scale, enable_gqa=True, softcap=cap)
    return out.to(qh.dtype).transpose(1, 2).contiguous(), lse
