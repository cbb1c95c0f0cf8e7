"""attnlab's decode kernel (the C++ extension ``attnlab._decode*``): a few queries against a long, maybe paged,
KV cache at the memory-bandwidth limit (flash-decoding).

Legend: B batch, H query heads, Hkv key/value heads (G = H / Hkv per group), L queries (1..16), S keys,
D head dim, Dv value head dim, P pages of T tokens.

Each unit of work is (sequence, kv head, key split): the G query heads of a group and all L queries are
computed together, so K and V are read once per group (GQA / MQA without copies), and the keys are split
across threads when B·Hkv alone would leave threads idle; the splits' partial results are merged by
Note [Merging by log-sum-exp] (``kernels/lse.py``; csrc/decode.cpp Note [Decode schedule]). fp32, bf16 and
fp16 K/V are read as stored and widened to fp32 one tile at a time; an int8 cache (one float32 scale per
token and kv head, ``k_scale`` / ``v_scale``) is dequantised as it is widened (csrc Note [Decode int8 cache]);
everything accumulates in fp32.

Forward only (inference): ``decode_attention`` refuses tensors that require grad under grad mode.
``available()`` says whether the extension loads (False with ``ATTNLAB_NO_EXT=1`` or when it was not built).
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import torch

from ..files import format_bytes
from .cacheview import UNBOUNDED, CacheCall
from .extension import Extension
from .kernel import Kernel, Cost
from .lse import sink_scale
from .spec import KernelSpec, Request, Tiling, io_bytes

__all__ = ["available", "unavailable_reason", "capability", "MAX_QUERIES", "DTYPES", "num_splits", "quantize_rows", "balanced_splits",
           "decode_attention", "kv_bytes", "head_span", "num_splits_for", "predicted_seconds", "read_bandwidth", "UNBOUNDED",
           "DecodePlan", "plan", "decode_step", "step_heads_first", "SPEC", "KERNEL", "DecodeKernel",
           "decode_args", "run_prepared", "direct"]

#: must equal the extension's abi_version (csrc/decode.cpp)
ABI_VERSION = 12
#: the longest query the decode path takes (decode, speculative verification, chunked-prefill tails)
MAX_QUERIES = 16
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: a key split is at least this many keys: below it, the merge and the split's fixed costs outweigh the
#: parallelism it buys
MIN_SPLIT_KEYS = 512
#: units (sequence, kv head, split) wanted per thread: more than one, so a thread that shares its core with
#: another process hands its remaining units to the others (the units are pulled from one counter)
UNITS_PER_THREAD = 4
#: the idle share of the threads' time past which a split count is raised to fill the last round of units
#: (Note [Decode balanced units])
UNBALANCED = 0.05

_EXT = Extension("_decode", ABI_VERSION, "decode extension")


def _load():
    """The extension module built for the best capability this CPU runs, or None (the reason: ``_EXT.reason``)."""
    return _EXT.load()


def unavailable_reason() -> str | None:
    """Why the decode kernel cannot run, or None when it can."""
    return _EXT.reason if _load() is None else None


def available() -> bool:
    """True when the decode extension loads."""
    return unavailable_reason() is None


def capability() -> str | None:
    """The CPU capability the loaded decode extension was compiled for, or None."""
    ext = _load()
    return None if ext is None else str(ext.capability)


def bf16_dot() -> bool:
    """True when a bf16 cache's scores run on VDPBF16PS (the CPU has avx512_bf16 and ``set_bf16_dot`` left it
    on; csrc Note [Decode bf16 scores]); False without the extension."""
    ext = _load()
    return bool(ext is not None and ext.bf16_dot())


def set_bf16_dot(on: bool) -> None:
    """Turn the VDPBF16PS scores on or off for this process (both paths are tested; off widens bf16 to fp32).
    A no-op where the CPU lacks avx512_bf16 or the extension is missing."""
    ext = _load()
    if ext is not None:
        ext.set_bf16_dot(bool(on))


def vnni() -> bool:
    """True when an int8 cache's integer dot products run on vpdpwssd (the CPU has avx512_vnni and
    ``set_vnni`` left it on; csrc Note [Decode int8 VNNI]); False otherwise. It changes timing only: the sums
    are exact either way."""
    ext = _load()
    return bool(ext is not None and ext.vnni())


def set_vnni(on: bool) -> None:
    """Turn vpdpwssd on or off for this process (off: vpmaddwd + vpaddd). A no-op where the CPU lacks it."""
    ext = _load()
    if ext is not None:
        ext.set_vnni(bool(on))


def int_pv() -> bool:
    """True when an int8 cache's P @ V runs on integers (the AVX-512 decode build, per-row scales, Dv a
    multiple of 64, and ``set_int_pv`` left it on; csrc Note [Decode int8 P @ V]). It adds one rounding: each
    weight p * v_scale on its row's int16 grid for the tile, at most max(p * v_scale) / 65534 off."""
    ext = _load()
    return bool(ext is not None and ext.int_pv())


def int_pv_bound(probs: torch.Tensor, v_scale: torch.Tensor) -> torch.Tensor:
    """The most the integer P @ V (csrc Note [Decode int8 P @ V]) moves an output element, per query row:
    within a tile of at most 32 consecutive keys each weight p_t * v_scale_t is off by at most the tile's
    largest over 65534, and |v8| <= 127, so a tile adds at most 32 x that max x 127 / 65534. Any tile holding
    key t lies within t - 31 .. t + 31, so the sum over keys of that window's largest weight bounds the sum over
    tiles, whatever the split and page boundaries. probs [..., n]: the softmax probabilities, key order (0
    where masked); v_scale [..., n] (broadcast): each key's value scale, or for group-scaled values the largest of
    its group scales (the kernel rounds a row's weights of every group on one grid a tile: the largest weight
    of any group sets it). Returns [...]."""
    w = (probs.double() * v_scale.double()).reshape(-1, 1, probs.shape[-1])
    win = torch.nn.functional.max_pool1d(w, kernel_size=63, stride=1, padding=31)
    return (win.sum(-1) * (127 / 65534)).reshape(probs.shape[:-1])


def set_int_pv(on: bool) -> None:
    """Turn the integer P @ V on or off for this process (off: the fp32 P @ V, the dequantised cache's products).
    A no-op without the AVX-512 build."""
    ext = _load()
    if ext is not None:
        ext.set_int_pv(bool(on))


def int_cols() -> bool:
    """True when an int8 cache's scores run on key columns (the AVX-512 decode build, D a multiple of 64, and
    ``set_int_cols`` left it on; csrc Note [Decode int8 key columns]): 16 keys a vector instead of a key's
    channels. The integer dot products are the same; only the fp32 order of a key's group terms differs."""
    ext = _load()
    return bool(ext is not None and ext.int_cols())


def set_int_cols(on: bool) -> None:
    """Turn the key-column scores on or off for this process (off: the lane kernels of Note [Decode int8
    scores]). A no-op without the AVX-512 build."""
    ext = _load()
    if ext is not None:
        ext.set_int_cols(bool(on))


def prefetch_mode() -> int:
    """The decode kernel's software prefetch of the next tile's rows: 0 off, 1 into L1, 2 into L2 (the
    default; csrc Note [Decode prefetch]); 0 without the extension."""
    ext = _load()
    return 0 if ext is None else int(ext.prefetch())


def set_prefetch_mode(mode: int) -> None:
    """Set the prefetch mode (0, 1 or 2) for this process; it changes timing only, never a result."""
    if mode not in (0, 1, 2):
        raise ValueError(f"prefetch mode must be 0 (off), 1 (into L1) or 2 (into L2), got {mode!r}")
    ext = _load()
    if ext is not None:
        ext.set_prefetch(int(mode))


def num_splits(B: int, Hkv: int, S: int) -> int:
    """Key splits per (sequence, kv head span): 1 when B·Hkv units already give every thread UNITS_PER_THREAD,
    else enough for that, each split at least MIN_SPLIT_KEYS keys (Note [Decode schedule]).
    ``ATTNLAB_DECODE_SPLITS=k`` forces k (for comparisons)."""
    forced = os.environ.get("ATTNLAB_DECODE_SPLITS", "")
    if forced:
        return max(1, int(forced))
    threads = torch.get_num_threads()
    want = UNITS_PER_THREAD * threads
    pairs = max(1, B * Hkv)
    top = max(1, S // MIN_SPLIT_KEYS)
    ns = 1 if pairs >= want else max(1, min(-(-want // pairs), top))
    return balanced_splits(pairs, ns, top, threads)


def balanced_splits(pairs: int, ns: int, top: int, threads: int) -> int:
    """Note [Decode balanced units]: the threads pull equal units from one counter, so pairs · ns units keep
    every thread busy to the end only when they are a multiple of the thread count: 3 kv heads in 3 splits on 2
    threads end on a thread holding 5 units while the other waits (SmolLM2's decode step, GQA 9/3, S 4096, 2
    threads, in the model, medians of 10 paired rounds: 44.4 ms a token at 3 splits, 43.7 at 2 or 4). Where the
    last round of units would leave more than UNBALANCED of the threads' time idle, the least count above ns
    (at most 2 ns and ``top``) that fills every round is taken instead; else ns."""
    units = pairs * ns
    rounds = -(-units // threads)
    if threads <= 1 or units % threads == 0 or rounds * threads <= units * (1 + UNBALANCED):
        return ns
    for n in range(ns + 1, min(top, 2 * ns) + 1):
        if (pairs * n) % threads == 0:
            return n
    return ns


def head_span(k: torch.Tensor) -> int:
    """KV heads one unit of work reads together: all of them when a token's heads sit side by side
    (k [P, T, Hkv, D] with the head stride below the token stride: flash-attn's layout, paged pools), so the
    cache is read in order (csrc Note [Decode head span]); else 1."""
    Hkv = k.shape[2]
    return Hkv if Hkv > 1 and k.shape[1] > 1 and abs(k.stride(2)) < abs(k.stride(1)) else 1


def num_splits_for(k: torch.Tensor, B: int, S: int) -> int:
    """``num_splits`` for a cache k [P, T, Hkv, D] of B sequences of up to S keys (its head span counted)."""
    return num_splits(B, k.shape[2] // head_span(k), S)


def kv_bytes(B: int, Hkv: int, S: int, D: int, Dv: int, dtype: torch.dtype, groups: int = 1) -> int:
    """Bytes of K and V a decode call reads: B·Hkv·S·(D + Dv) elements (each row once per kv group); an
    int8 cache also reads its two float32 scales per (token, kv head), or per scale group of each."""
    scales = B * Hkv * S * 2 * 4 * groups if dtype == torch.int8 else 0
    return B * Hkv * S * (D + Dv) * dtype.itemsize + scales


#: the contiguous cache's block table [[0], [1], ...] per batch size (read only; Note [Decode call overhead])
_TABLES: dict = {}


def _table(B: int) -> torch.Tensor:
    t = _TABLES.get(B)
    if t is None:
        if len(_TABLES) > 64:
            _TABLES.clear()
        t = _TABLES[B] = torch.arange(B, dtype=torch.int32).view(B, 1)
    return t


def _i64(x, B: int, name: str) -> torch.Tensor:
    if isinstance(x, int) and not isinstance(x, bool):
        return torch.full((B,), x, dtype=torch.int64)
    if isinstance(x, torch.Tensor) and x.dtype == torch.int64 and x.shape == (B,) and x.is_contiguous():
        return x
    t = torch.as_tensor(x, dtype=torch.int64)
    if t.dim() == 0:
        t = t.expand(B)
    if t.shape != (B,):
        raise ValueError(f"{name} must be an int or [B] = [{B}], got shape {list(t.shape)}")
    return t.contiguous()


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                     block_table: torch.Tensor | None = None, seqlens=None, mask_offset=None,
                     left: int = UNBOUNDED, right: int = UNBOUNDED, keep: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None, softcap: float = 0.0,
                     alibi_slopes: torch.Tensor | None = None, alibi_offset=None, splits: int | None = None,
                     out: torch.Tensor | None = None, return_partials: bool = False,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                     blhd: bool = False):
    """q [B, H, L, D] (any strides), k [P, T, Hkv, D], v [P, T, Hkv, Dv] (a page pool, any strides; a
    contiguous cache [B, S, Hkv, D] is P = B pages of T = S tokens) -> (out [B, H, L, Dv], lse [B, H, L]).

    Query i of sequence b sits at position ``i + mask_offset[b]`` (default ``seqlens[b] - L``: bottom-right,
    the KV-cache convention) and sees keys j < seqlens[b] (default: every page) with
    ``pos - left <= j <= pos + right`` (causal: right=0), where ``keep`` [B|1, H|1, L|1, >=S] bool is True
    and with ``bias`` [.., >=S] float added. ``block_table`` [B, pages] int32 maps sequence b's token t to
    page ``block_table[b, t // T]`` (default: sequence b is page b). softcap > 0 caps the scaled product;
    ``alibi_slopes`` [H] or [B, H] adds ``-slope·|i + alibi_offset[b] - j|`` (default offset: mask_offset).
    lse is float32, -inf for a row that sees no key (its output is 0). ``splits`` forces the key split
    count (default ``num_splits``); ``return_partials`` also returns the splits' (out [ns, B, H, L, Dv],
    lse [ns, B, H, L]) before their merge (None, None for one split). An int8 k, v comes with float32
    ``k_scale``, ``v_scale`` [P, T, Hkv] (any strides): row (p, t, g) is ``k[p, t, g] * k_scale[p, t, g]``;
    or [P, T, Hkv, D / gs] (a scale per group of gs channels, gs a multiple of 32: csrc Note [Decode int8
    groups]): channel c of row (p, t, g) is ``k[p, t, g, c] * k_scale[p, t, g, c // gs]``.
    ``blhd``: q and out are [B, L, H, D] (flash-attn's layout) instead; lse is [B, H, L] either way.

    Cost: reads each visible K/V row once per kv group: ``kv_bytes``; 2·B·H·L·S·(D + Dv) FLOPs.
    """
    ext = _load()
    if ext is None:
        raise RuntimeError(f"attnlab decode kernel unavailable: {_EXT.reason}")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, bias)):
        raise RuntimeError("the decode kernel is forward only (inference): q, k, v or the bias require grad; "
                           "call it under torch.no_grad() / torch.inference_mode(), or use attnlab.attention")
    if blhd:  # q and out in flash-attn's [B, L, H, D], read through their strides (no transposed views)
        B, L, H, D = q.shape
    else:
        B, H, L, D = q.shape
    P, T, Hkv, _ = k.shape
    Dv = v.shape[-1]
    # Note [Decode call overhead] (the plain step skips this wrapper: csrc Note [One-call decode step]):
    # at decode sizes (S ~ 512) the kernel runs in tens of microseconds, as long as
    # a few small tensor ops each: the default table is cached, an int length is one torch.full, and the
    # longest length is known without a reduction when it is an int
    if block_table is None:
        if P != B:
            raise ValueError(f"without block_table the cache holds one sequence per row: k has {P} rows, q {B}")
        block_table = _table(B)
    elif block_table.dtype != torch.int32 or not block_table.is_contiguous():
        block_table = block_table.to(torch.int32).contiguous()
    S = block_table.shape[1] * T
    if seqlens is None:
        seqlens = S
    smax = seqlens if isinstance(seqlens, int) else None
    # one int length (and the offset it implies) goes to the kernel as an int (Note [Decode call overhead])
    seqlens = None if smax is not None else _i64(seqlens, B, "seqlens")
    moff_all = 0
    if mask_offset is None:
        moff, moff_all = (None, smax - L) if smax is not None else (seqlens - L, 0)
    elif isinstance(mask_offset, int):
        moff, moff_all = None, mask_offset
    else:
        moff = _i64(mask_offset, B, "mask_offset")
    if out is None:
        out = torch.empty((B, L, H, Dv) if blhd else (B, H, L, Dv), dtype=q.dtype)
    slopes = aoff = None
    if alibi_slopes is not None:
        slopes = alibi_slopes.detach().to(torch.float32)
        slopes = slopes.view(1, H).expand(B, H) if slopes.dim() == 1 else slopes.expand(B, H)
        if alibi_offset is None:
            aoff = moff if moff is not None else _i64(moff_all, B, "alibi_offset")
        else:
            aoff = _i64(alibi_offset, B, "alibi_offset")
    if keep is not None:
        keep = keep.expand(B, H, L, keep.shape[-1])
    if bias is not None:
        bias = bias.detach().to(torch.float32).expand(B, H, L, bias.shape[-1])
    hs = head_span(k)
    if splits is not None:
        ns = splits
    else:
        ns = num_splits(B, Hkv // hs, (smax if smax is not None else int(seqlens.max())) if B else S)

    def last(t):  # rows are read through their strides (0 and paged pools included); the last dim must be dense,
        # and ``.contiguous()`` is a no-op for a size-1 last dim of any stride (compiled's Note [Operand strides])
        return t if t.stride(-1) == 1 else t.clone(memory_format=torch.contiguous_format)

    # group scales [P, T, Hkv, G]: each row's groups side by side (csrc Note [Decode int8 groups]); per-row scales
    # [P, T, Hkv] are read through any strides
    k_scale, v_scale = (s if s is None or s.dim() != 4 else last(s) for s in (k_scale, v_scale))
    res = ext.forward(last(q), last(k), last(v), out, block_table, seqlens, smax if smax is not None else 0, moff,
                      int(moff_all), int(left), int(right), keep,
                      bias, slopes, aoff, float(scale), float(softcap or 0.0), int(ns), hs, bool(return_partials),
                      k_scale, v_scale, bool(blhd))
    if return_partials:
        return out, res[0], res[1], res[2]
    return out, res[0]


def decode_step(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor | None,
                v: torch.Tensor | None, n0: int | torch.Tensor, block_table: torch.Tensor | None, causal: bool,
                scale: float, attend: bool = True) -> torch.Tensor | None:
    """The plain decode step in one extension call (csrc Note [One-call decode step]): append k, v [B, Lnew,
    Hkv, D|Dv] (or none) at token ``n0`` of every sequence of the floating cache [B, S, Hkv, D] (or page pool
    with an int32 ``block_table``), or at ``n0[b]`` of sequence b for an int32 / int64 tensor [B] (csrc Note
    [One-call step lengths]), then attend q [B, L, H, D] to each sequence's keys up to its new length
    (bottom-right causal or every key): out [B, L, H, Dv]. Returns None, having written nothing, where the
    extension is missing or the call is anything else (or bad input): the caller's full path then runs and names
    the error. ``attend=False``: the checks and the append only (an empty tensor where they passed: csrc Note
    [SDPA steps])."""
    ext = _load()
    if ext is None:
        return None
    forced = os.environ.get("ATTNLAB_DECODE_SPLITS", "")
    lens = n0 if type(n0) is torch.Tensor else None
    return ext.step(q, k_cache, v_cache, k, v, 0 if lens is not None else n0, block_table, bool(causal),
                    float(scale), max(1, int(forced)) if forced else 0, UNITS_PER_THREAD, MIN_SPLIT_KEYS,
                    MAX_QUERIES, UNBOUNDED, lens, bool(attend))


def quantize_rows(x: torch.Tensor, groups: int, hadamard: int, candidates: int):
    """The int8 cache's quantiser in the extension (csrc Note [int8 scale search]): x float32 [N, D] ->
    (int8 [N, D], float32 scale [N, groups]), each group's scale the best of ``candidates`` (max|group| / m,
    m = 127, 126, ...), rows first rotated by the Walsh-Hadamard transform on blocks of ``hadamard`` channels
    (0: none). A group holding inf or NaN gets a NaN scale. None without the extension (the caller's torch
    path then runs the same search)."""
    ext = _load()
    if ext is None:
        return None
    data, scale = ext.quantize(x if x.is_contiguous() else x.contiguous(), groups, hadamard, candidates)
    return data, scale


def step_heads_first(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool,
                     scale: float) -> torch.Tensor | None:
    """``decode_step`` without an append for attnlab's and transformers' layout: query [B, H, L, D] against all
    of key, value [B, Hkv, S, D|Dv] (views, no copy) -> out [B, L, H, Dv], or None where the step declines."""
    return decode_step(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), None, None,
                       key.shape[2], None, causal, scale)


_BANDWIDTH: list = []


def read_bandwidth(nbytes: int = 256 * 2**20, rounds: int = 3) -> float:
    """The CPU's read bandwidth (bytes/s), measured once per process: the best of ``rounds`` sums over a
    float32 buffer of ``nbytes`` (well past the caches), all threads."""
    if not _BANDWIDTH:
        x = torch.ones(nbytes // 4)
        best = math.inf
        for _ in range(rounds):
            t = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t)
        _BANDWIDTH.append(nbytes / best)
    return _BANDWIDTH[0]


def predicted_seconds(nbytes: int, bandwidth: float) -> float:
    """The memory-bound time of a decode call: K/V bytes over a read bandwidth (bytes/s)."""
    return nbytes / bandwidth if bandwidth > 0 else math.inf


@dataclass(frozen=True)
class DecodePlan:
    """How the decode kernel runs one call (what ``explain`` prints for a decode call): B sequences x Hkv kv
    heads x S keys, read ``head_span`` kv heads per unit of work (Note [Decode head span]) in ``splits`` key
    splits (Note [Decode schedule]); ``kv_bytes`` of K/V read once per kv group, and with a measured
    ``bandwidth`` (bytes/s) the memory-bound time."""

    B: int
    Hkv: int
    S: int
    groups: int
    splits: int
    head_span: int
    kv_bytes: int
    dtype: torch.dtype
    bandwidth: float | None = None

    @property
    def units(self) -> int:
        """Units of work the threads pull: sequences x kv head spans x key splits."""
        return self.B * (self.Hkv // self.head_span) * self.splits

    @property
    def predicted_seconds(self) -> float | None:
        """kv_bytes over the bandwidth (None without one)."""
        return None if self.bandwidth is None else predicted_seconds(self.kv_bytes, self.bandwidth)

    def describe(self) -> str:
        """One line: the schedule, the bytes read and, with a bandwidth, the predicted time."""
        span = (f"{self.head_span} kv heads per unit (the cache holds a token's heads side by side)"
                if self.head_span > 1 else "one kv head per unit")
        why = (f"decode path: {self.B}×{self.Hkv // self.head_span} (sequence, kv head span) units × {self.splits} "
               f"key split{'s' * (self.splits > 1)} = {self.units} units, {span}; the {self.groups} query "
               f"head{'s' * (self.groups > 1)} of a group in one pass (K/V read once per group, no copy): "
               f"{format_bytes(self.kv_bytes)} of {'int8 ' if self.dtype == torch.int8 else ''}K/V")
        if self.bandwidth is not None:
            why += (f", ≈ {self.predicted_seconds * 1e3:.3g} ms at the {self.bandwidth / 1e9:.3g} GB/s read "
                    "bandwidth measured now")
        return why


def plan(B: int, H: int, Hkv: int, S: int, D: int, Dv: int, dtype: torch.dtype, k: torch.Tensor | None = None,
         splits: int | None = None, bandwidth: float | None = None) -> DecodePlan:
    """The ``DecodePlan`` of a call with q [B, H, L, D] against B sequences of S keys of Hkv heads (dtype: the
    cache's, int8 included), the cache k [P, T, Hkv, D] as the kernel gets it (its strides set the head span;
    None: one head per unit), ``splits`` as ``decode_attention`` takes it."""
    hs = 1 if k is None else head_span(k)
    ns = splits if splits is not None else num_splits(B, Hkv // hs, S)
    return DecodePlan(B, Hkv, S, H // max(Hkv, 1), ns, hs, kv_bytes(B, Hkv, S, D, Dv, dtype), dtype, bandwidth)


# -- attention() calls of decode shape: their masks as the kernel's arguments ----------------------------------
def decode_reason(p, costs: bool = False) -> str:
    """What the decode path does for prepared inputs ``p``: splits, K/V bytes read and, with ``costs``, the
    time that takes at the read bandwidth measured in this process (``read_bandwidth``); the
    schedule is ``plan``'s for the cache as ``run_prepared`` passes it."""
    i = p.info
    bw = read_bandwidth() if costs else None
    return plan(p.N, i.H, i.Hkv, i.S, i.E, i.Ev, p.q.dtype, k=p.kv_k.transpose(1, 2),
                              bandwidth=bw).describe()


def decode_args(p) -> dict:
    """The decode kernel's keywords for prepared inputs ``p`` (what ``run_prepared`` passes it but the tensors
    and ``out``): a band pattern (causal, sliding windows, any alignment) becomes the kernel's key range; key
    padding by lengths its per-sequence lengths; other patterns and user masks a bool keep [N|1, H|1, L, S]
    (L×S is small at decode sizes) read through strides; ALiBi keeps attnlab's alignment i + S - L."""
    i, mask = p.info, p.mask
    N, L, S = p.N, i.L, i.S
    seqlens = S  # an int until key padding shortens a sequence (Note [Decode call overhead])
    left = right = UNBOUNDED
    keep = mask.keep
    pat = mask.pattern
    rest = []  # patterns the key range cannot express
    for part in and_parts(pat):
        band = part.band(L, S) if part.batch_size is None else None
        kk = getattr(part, "keep_keys", None)
        if band is not None:
            lo, hi = band
            left = min(left, UNBOUNDED if lo == -math.inf else max(-(2**40), int(-lo)))
            right = min(right, UNBOUNDED if hi == math.inf else max(-(2**40), int(hi)))
        elif kk is not None and is_prefix(kk, S):
            lens = kk[:, :S].sum(1).to(torch.int64)  # (N,)
            if isinstance(seqlens, int):
                seqlens = lens.clamp(max=S).expand(N).contiguous()
            else:
                seqlens = torch.minimum(seqlens, lens)
        else:
            rest.append(part)
    for part in rest:
        qi, kj = torch.arange(L).view(L, 1), torch.arange(S).view(1, S)
        m = part.keep(qi, kj, L, S)  # (L, S) or (N, L, S)
        m = m.view(-1, 1, L, S)  # (N|1, 1, L, S)
        keep = m if keep is None else keep & m
    bias = mask.bias
    return dict(scale=i.scale, seqlens=seqlens, mask_offset=0, left=left, right=right,
                keep=None if keep is None else keep.expand(N, i.H, L, S),
                bias=None if bias is None else bias.expand(N, i.H, L, S),
                softcap=mask.softcap_for(torch.float32) or 0.0,
                alibi_slopes=None if mask.alibi is None else mask.alibi.expand(N, i.H), alibi_offset=S - L)


def run_prepared(p, return_lse: bool = False):
    """``attention`` on prepared inputs through the decode kernel: out [N, H, L, Ev] (and lse [N, H, L]);
    the masks as ``decode_args`` turns them into the kernel's arguments."""
    out = torch.empty(p.N, p.info.H, p.info.L, p.info.Ev, dtype=p.q.dtype)
    # the kernel reads flash-attn's [N, S, Hkv, E] layout through strides: (N, Hkv, S, E) -> (N, S, Hkv, E) views
    out, lse = decode_attention(p.q, p.kv_k.transpose(1, 2), p.kv_v.transpose(1, 2), out=out,
                                              **decode_args(p))
    return (out, lse) if return_lse else out


def direct(p):
    """``run_prepared`` for inputs of ``p``'s signature as one callable ``f(query, key, value) -> out`` on the
    caller's 4-D tensors, its arguments built once (Note [Decode direct call]), or None when running reads
    more than the signature holds (a mask tensor, key padding lengths, dead keys, non-4-D inputs)."""
    i = p.info
    if (p.empty or len(p.out_shape) != 4 or p.dead is not None
            or (p.key_range is not None and p.key_range[:2] != (0, p.key_range[2]))):
        return None
    kw = decode_args(p)
    if kw["keep"] is not None or kw["bias"] is not None or kw["alibi_slopes"] is not None \
            or not isinstance(kw["seqlens"], int):
        return None
    # Note [Decode direct call]: a repeated decode call (the plan cache's hit) then does the signature, these
    # few lines and decode_attention's own O(1) checks: the lengths and offsets are fixed int64 tensors the
    # kernel only reads, the keywords fixed; only ``out`` is new each call (the caller keeps it)
    N, H, L, Ev, dtype = p.N, i.H, i.L, i.Ev, p.q.dtype
    n_keys, scale = kw["seqlens"], kw["scale"]
    # one query seeing every key: the kernel through the one-call step (csrc Note [One-call decode step]),
    # which skips decode_attention's Python (it declines, and the wrapper runs, for anything it does not take)
    one_call = (L == 1 and kw["left"] == UNBOUNDED and kw["right"] == UNBOUNDED
                and not kw["softcap"])
    kw["seqlens"] = torch.full((N,), kw["seqlens"], dtype=torch.int64)
    kw["mask_offset"] = torch.zeros(N, dtype=torch.int64)
    del kw["alibi_slopes"], kw["alibi_offset"], kw["keep"], kw["bias"]
    run, step = decode_attention, step_heads_first

    def decode_direct(query, key, value):  # (N, H, L, E), (N, Hkv, S, E|Ev) -> (N, H, L, Ev)
        if one_call and key.shape[2] == n_keys:
            out = step(query, key, value, False, scale)
            if out is not None:
                return out.transpose(1, 2)  # (N, 1, H, Ev) -> (N, H, 1, Ev): a view, its size-1 dim moved
        out = torch.empty(N, H, L, Ev, dtype=dtype)
        return run(query, key.transpose(1, 2), value.transpose(1, 2), out=out, **kw)[0]

    return decode_direct


def and_parts(pat) -> list:
    """The operands of a pattern's ANDs (a pattern that is no AND is its own single part)."""
    if pat is None:
        return []
    if getattr(pat, "op", None) == "and":
        return and_parts(pat.a) + and_parts(pat.b)
    return [pat]


def is_prefix(kk: torch.Tensor, S: int) -> bool:
    """A key-padding mask [N, >=S] that keeps exactly each row's first n keys (lengths, right padding)."""
    k = kk[:, :S]
    n = k.sum(1, keepdim=True)  # (N, 1)
    return bool((k == (torch.arange(k.shape[1]).unsqueeze(0) < n)).all())


# -- the kernel object -----------------------------------------------------------------------------------------
def _peak(r: Request, t: Tiling | None) -> int:
    """The inputs and output, and each key split's partial output and log-sum-exp (float32)."""
    splits = t.blocks if t is not None and t.blocks else 1
    return io_bytes(r) + 4 * r.N * r.H * r.L * (r.Ev + 1) * (splits if splits > 1 else 0)


def _flops(r: Request, t: Tiling | None) -> int:
    return 2 * r.N * r.H * r.L * r.S * (r.E + r.Ev)


SPEC = KernelSpec("decode", "attnlab's decode kernel: 1-16 queries against a KV cache, K/V read once per kv head "
                  "group, keys split across threads (flash-decoding)",
                  lse="yes", backward=False, gqa_no_copy=True, needs_extension=True, devices=("cpu",), softcap=True,
                  alibi="native", sinks=True, dtypes=DTYPES, max_queries=MAX_QUERIES,
                  cache_views=("contiguous", "lengths", "paged"), quantized_cache=True, transforms=False,
                  peak_bytes=_peak, flops=_flops, unavailable=lambda r: unavailable_reason())


class DecodeKernel(Kernel):
    """The decode kernel's door (Note [Decode schedule] in csrc/decode.cpp): few queries against a KV cache,
    inference. Its tiling is the key split (``Tiling(L, keys per split, splits, decode=True)``), its cost the K/V
    bytes it reads over the read bandwidth measured in this process (``read_bandwidth``: it is memory-bound).
    It runs prepared ``attention()`` inputs (``run``, ``direct``: the masks become its arguments, ``decode_args``)
    and KV-cache views (``run_cache``: ``attention_with_kvcache``, the Hugging Face generation step)."""

    def decodes(self, p, r: Request) -> bool:
        return True

    def decode_reason(self, p, costs: bool = False) -> str:
        """Its schedule for ``p`` (prepared inputs or a ``CacheCall``): splits, bytes read, with ``costs`` the time."""
        bw = read_bandwidth() if costs else None
        if isinstance(p, CacheCall):
            B, L, H, D = p.q.shape
            dt = torch.int8 if p.quantized else p.k.dtype
            return plan(B, H, p.k.shape[2], p.S, D, p.v.shape[3], dt, k=p.k, splits=p.splits, bandwidth=bw).describe()
        return decode_reason(p, costs)

    def tiling(self, p, r: Request, block_size: int | None, rates) -> Tiling:
        """The key split: L queries × ceil(S / splits) keys, one tile per split (``num_splits``)."""
        if isinstance(p, CacheCall):
            ns = p.splits or num_splits_for(p.k, r.N, r.S)
        else:
            ns = num_splits_for(p.kv_k.transpose(1, 2), r.N, r.S)
        return Tiling(max(r.L, 1), max(1, -(-r.S // ns)), ns, decode=True)

    def seconds(self, r: Request, t: Tiling | None, rates) -> float:
        """K/V bytes (int8 with its scales) over the read bandwidth measured in this process."""
        nbytes = kv_bytes(r.N, r.Hkv, r.S, r.E, r.Ev, torch.int8 if r.quantized else r.dtype)
        return predicted_seconds(nbytes, read_bandwidth())

    def cost(self, r: Request, t: Tiling | None, rates) -> Cost:
        bw = read_bandwidth()
        return Cost(self.spec.flops(r, t), self.spec.peak_bytes(r, t), self.seconds(r, t, rates), self.gflops,
                    f"decode: K/V bytes at the {bw / 1e9:.3g} GB/s read bandwidth measured now")

    def direct(self, p, t: Tiling | None, need_weights: bool = False):
        """The kernel on the caller's 4-D tensors with its arguments built once (Note [Decode direct call])."""
        return None if need_weights else direct(p)

    def run(self, p, t: Tiling | None, need_weights: bool = False, need_lse: bool = False):
        """(out, None, lse or None) for prepared inputs; L <= 16, inference: keys split across threads, K/V
        read once per group."""
        out, lse = run_prepared(p, return_lse=True)
        if p.mask.sinks is not None:  # Note [Attention sinks]: from its log-sum-exp (inference: ds flows through a);
            # half types: out is rounded once by the kernel and once more here (at most half an ulp more)
            a, lse = sink_scale(lse, p.mask.sinks)  # (N, H, L)
            out = (out * a.unsqueeze(-1)).to(out.dtype)
        return out, None, lse if need_lse else None

    def step(self, q, k_cache, v_cache, k, v, n0: int, block_table, causal: bool, scale: float):
        """The plain step in one extension call (append, then attend: csrc Note [One-call decode step]), its direct
        path for the KV-cache API: out [B, L, H, Dv], or None (nothing written) where the step does not take it."""
        return decode_step(q, k_cache, v_cache, k, v, n0, block_table, causal, scale)

    def run_cache(self, c: CacheCall):
        """(out [B, L, H, Dv], lse [B, H, L]) for a KV-cache view, in the cache's layout: the one-call step where
        the call is plain, else ``decode_attention`` (the kernel checks every page a visible key reaches)."""
        plain = (isinstance(c.seqlens, int) and c.keep is None and not c.softcap and c.alibi_slopes is None
                 and c.left >= UNBOUNDED and c.right in (0, UNBOUNDED) and not c.quantized and c.splits is None
                 and not c.need_lse and c.sinks is None)
        if plain:
            out = decode_step(c.q, c.k, c.v, None, None, c.seqlens, c.block_table, c.right == 0, c.scale)
            if out is not None:
                return out, None
        kw = dict(k_scale=c.k_scale, v_scale=c.v_scale) if c.quantized else {}
        splits = c.splits
        if splits is not None:  # splits past the keys would be empty: at most one per key (no oversized buffers)
            splits = min(splits, max(1, c.S))
        out, lse = decode_attention(c.q, c.k, c.v, scale=c.scale, block_table=c.block_table, seqlens=c.seqlens,
                                    left=c.left, right=c.right, keep=c.keep, softcap=c.softcap or 0.0,
                                    alibi_slopes=c.alibi_slopes, splits=splits, blhd=True, **kw)
        if c.sinks is not None:  # Note [Attention sinks]: out [B, L, H, Dv] from lse [B, H, L]
            a, lse = sink_scale(lse, c.sinks)
            out = (out * a.transpose(1, 2).unsqueeze(-1)).to(out.dtype)
        return out, lse


#: its speed is the read bandwidth (``seconds``); 2·(E + Ev) FLOPs per pair at 100 GFLOP/s is what explain shows
KERNEL = DecodeKernel(SPEC, gflops=100.0, title="Decode", memory="O(B·H·L·Dv·splits)",
                      why="attnlab's decode kernel: K/V read once per kv head group at the memory bandwidth",
                      paper="Dao et al. 2023, Flash-Decoding for long-context inference")
