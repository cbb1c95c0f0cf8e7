"""The checks of ``attention_with_kvcache`` (flash-attn's layout and arguments), each failure one line naming the
argument and the shapes, and the rotary embedding it applies before the append.

Legend: B batch, L new queries, Lnew new keys, H query heads, Hkv key/value heads, S cache capacity per
sequence, D head dim, Dv value head dim, P pages of T tokens (paged cache).
"""
from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass

import torch

from ..kernels.cacheview import UNBOUNDED, CacheCall
from ..kernels import DECODE
from ..shapes import (AttentionDtypeError, AttentionInputError, check_scale_range, check_sinks,
                      check_slopes_fit_float32, check_softcap, shape_str)
from . import kvquant
from .kvquant import QuantizedKV

__all__ = ["Rotary", "Checked", "check", "page_error", "PAGE_ERROR"]


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
    lo = UNBOUNDED if left == -1 else left
    hi = UNBOUNDED if right == -1 else right
    if is_causal:
        hi = 0
    return lo, hi


# Note [Checked, then appended]: nothing is written into a cache unless the whole call will succeed (issue 40,
# D3-D5): every argument is checked first (num_splits a positive int, scale a finite real number, the int8 rows
# quantised, so a non-finite k or v is refused), and every page the call will read (the append's among them:
# pages 0 .. ceil(seqlen / T) - 1 of each sequence, seqlen after the append) is range-checked against the pool
# in the caller's index dtype, before the table is cast to the kernel's int32 (an int64 entry of 2^32 wrapped
# to page 0 and was written and read). Then the append, then the attention. The plain step (csrc Note
# [One-call decode step]) does the same in C++ for the calls it takes; the decode kernel checks the pages it
# reads once more (csrc/decode.cpp), which no longer fires after these checks. Their cost on the full path: a
# comparison of the table's used columns, one reduction (the plain paged step, in C++, pays none of it).
PAGE_ERROR = re.compile(r"block_table\[(\d+), (\d+)\] = (-?\d+) is outside the pool of (\d+) pages")


def page_error(b, p, page, pool, kc_t: torch.Tensor) -> AttentionInputError:
    """The one-line error for block_table[b, p] = page outside a pool of ``pool`` pages."""
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
    raise page_error(b, p, int(bt[b, p]), pool, kc_t)


def _check_num_splits(num_splits) -> int | None:
    if num_splits is None:
        return None
    if isinstance(num_splits, bool) or not isinstance(num_splits, int):
        raise TypeError(f"attention_with_kvcache: num_splits must be a positive int or None (the kernel's choice), "
                        f"got {num_splits!r} ({type(num_splits).__name__})")
    if num_splits < 1:
        raise AttentionInputError(f"attention_with_kvcache: num_splits must be >= 1 (or None), got {num_splits}")
    return num_splits


def _check_scale(scale, D: int, dtype: torch.dtype) -> float:
    if scale is None:
        return 1.0 / math.sqrt(D) if D else 1.0
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"attention_with_kvcache: scale must be a real number or None (1 / sqrt(D)), got {scale!r:.40} "
                        f"({type(scale).__name__})")
    if not math.isfinite(scale):
        raise AttentionInputError(f"attention_with_kvcache: scale must be finite, got {scale}")
    check_scale_range(float(scale), dtype, "attention_with_kvcache: ")  # (shapes' Note [Scalars in float32])
    return float(scale)


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
    check_slopes_fit_float32(a)  # the decode kernel's ALiBi is float32 too
    return a.detach().to(device="cpu", dtype=torch.float32)



@dataclass
class Checked:
    """A checked ``attention_with_kvcache`` call: the caches (an int8 pair as ``QuantizedKV``), the new rows to
    append (rotated, and encoded for an int8 cache: nothing is written yet), where they go (``start``: one
    length for every sequence, a slice; else ``pos`` [B, Lnew]) and the call the planner gets after the append."""

    k_cache: object
    v_cache: object
    k: object
    v: object
    start: int | None
    pos: torch.Tensor | None
    call: CacheCall


def check(q, k_cache, v_cache, k, v, cache_seqlens, block_table, is_causal, window_size, softcap, alibi_slopes,
          rotary, rotary_cos, rotary_sin, rotary_interleaved, scale, num_splits, return_lse, sinks=None) -> Checked:
    """Every check of ``attention_with_kvcache`` (Note [Checked, then appended]): raises naming the argument and
    the shapes, or returns what the append and the planner need."""
    k_cache, v_cache = _as_quantized(k_cache, "k_cache"), _as_quantized(v_cache, "v_cache")
    quant = isinstance(k_cache, QuantizedKV)
    if quant != isinstance(v_cache, QuantizedKV):
        raise AttentionDtypeError("k_cache and v_cache must both be int8 (QuantizedKV) or both floating, got "
                                  f"{type(k_cache).__name__} and {type(v_cache).__name__}")
    if quant and (v_cache.rotation is not None or v_cache.channel is not None):
        # (a rotated or smoothed value row would come back transformed: only the query is transformed, to match keys)
        raise AttentionInputError(
            f"v_cache has {'a rotation' if v_cache.rotation is not None else 'channel scales'}, which only a key cache "
            f"takes (Note [int8 key rotation]: the query is transformed to match its keys, nothing undoes it on the "
            f"values): make the value cache with QuantizedKV.empty(..., rotate=False, smooth=False)")
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
        elif t.dtype not in DECODE.spec.dtypes:
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
    sinks = check_sinks(sinks, H, q.device, f"q {shape_str(q)} has H = {H}")
    rot = _rotary(rotary, rotary_cos, rotary_sin, rotary_interleaved, D)
    scale = _check_scale(scale, D, q.dtype)
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
    Lnew_pos = None
    start = n0 if cache is None else None
    if k is not None and Lnew:
        if quant:  # both encoded before either is written: v first, so that a non-finite v leaves k's cache
            # untouched too (a smoothed key cache's first encode fixes its channel scales: kvquant.encode)
            v = kvquant.encode(v_cache, v)
            k = kvquant.encode(k_cache, k)
        if cache is not None or block_table is not None:
            start = None
            Lnew_pos = (torch.arange(n0, n0 + Lnew).expand(B, Lnew) if cache is None
                        else cache.unsqueeze(1) + torch.arange(Lnew))  # (B, Lnew)
    if not Lnew:
        k = v = None  # nothing to append
    if quant:
        q = kvquant.query(k_cache, q)
    call = CacheCall(q, kc_t, vc_t, scale, seqlens, block_table, lo, hi, cap, slopes,
                     k_scale=k_cache.scale if quant else None, v_scale=v_cache.scale if quant else None,
                     splits=splits, need_lse=bool(return_lse), sinks=sinks)
    return Checked(k_cache, v_cache, k, v, start, Lnew_pos, call)
