"""attnlab's compiled CPU attention kernel (the C++ extension ``attnlab._C*``), its block layouts and autograd.

One flash-attention-2 style kernel runs every mask: for each query block it visits only the key
blocks its *layout* lists, each FULL (no mask work) or PARTIAL (the pattern's exact mask applied
inside the tile from a deduplicated table of bool tiles; bands such as causal or a sliding window
have only a handful of distinct tiles). A user bool or float ``attn_mask`` is read inside each tile
through its strides, never expanded per head. Forward returns the output and the log-sum-exp; the
backward recomputes each block's probabilities from them (no L×S tensor is saved).

Inputs are CPU tensors q [N, H, L, E], k [N, Hkv, S, E], v [N, Hkv, S, Ev] (GQA: query head h reads
key/value head h // (H / Hkv), without copying K/V); fp32, fp64, bf16 or fp16 (half types accumulate
in fp32). On AVX-512 builds the tiles multiply through oneDNN's brgemm micro-kernel, for bf16 on the
CPU's AMX or AVX512-BF16 dot products (``uses_brgemm``; csrc Note [Half-type brgemm without AMX]), and the
bf16 forward's exp and conversion run in one pass (csrc Note [Half-type exp]); elsewhere MKL's gemm. A CPU
without the half dtype's dot product in hardware (AVX2-only; fp16 without AVX512-FP16 or AMX-FP16) runs
half types as fp32 tiles, converted once (``runs_as_fp32``, csrc Note [Half-type dot products]). Consecutive
full key blocks run as one tile up to 512 keys wide (Note [Merged runs]).

Inputs may have any batch and head strides (broadcast heads included); a tensor whose rows the tile
products cannot read in place (an ``expand`` along L or S, a single row from ``.mT``, a last stride
other than 1) is copied to canonical strides first (Note [Operand strides], ``takes_in_place``). An empty
head dim (E = 0 or Ev = 0) runs as one zero column. Block sizes are clipped to the sequence lengths
(``clip_blocks``), so the scratch follows the problem's size.

Environment (read at each call):

- ``ATTNLAB_EXT_GEMM`` picks the back end of the tile products: ``auto`` (default: brgemm where it applies
  and pays, else MKL's gemm), ``brgemm`` (brgemm wherever it applies, forward and backward: fp32 on AVX-512
  builds, bf16/fp16 where oneDNN has a kernel on the CPU's dot products; other tiles on MKL's gemm), ``mkl``
  (MKL's sgemm/dgemm/cblas_gemm_bf16bf16f32/cblas_gemm_f16f16f32), ``loop`` (the plain loop that runs where torch has
  no MKL), ``fp32`` (bf16/fp16 converted once to fp32 and run on the fp32 tiles, which ``auto`` does on CPUs
  without the dtype's dot product; other dtypes as ``auto``). ``gemm_backend()`` says which runs for a dtype;
  an unknown value raises ValueError.
- ``ATTNLAB_EXT_BWD_SPLITS=k`` forces k key-block ranges per kv head in the backward (``backward_splits``).
- ``ATTNLAB_EXT_NO_AVX512BF16=1`` (read at load) converts bf16 with at::vec's sequence instead of the CPU's
  instruction (``converts_bf16_natively``); ``ATTNLAB_NO_EXT=1`` disables the extension.
- Outside attnlab: ``ATEN_CPU_CAPABILITY=avx2|default`` makes torch, hence attnlab, load ``_C_avx2`` / ``_C``;
  ``ONEDNN_MAX_CPU_ISA`` (e.g. ``AVX2``, ``AVX512_CORE_BF16``) caps the instructions oneDNN's brgemm uses.

``available()`` says whether the extension can run (False with ``ATTNLAB_NO_EXT=1``, when it was not
built, or for non-CPU tensors) and ``unavailable_reason()`` why not. Nothing is compiled at call
time: the extension is built by the package's install (setup.py).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import patterns as P
from ..caches import ByteLRU
from ..files import format_bytes
from .extension import Extension, transformed
from .masks import MaskSpec
from .kernel import Kernel, causal_blocks, masked_tiling, nonempty_blocks
from .lse import sink_scale
from .spec import KernelSpec, Request, Tiling, io_bytes

__all__ = ["available", "unavailable_reason", "capability", "variant", "KernelLayout", "build_layout",
           "compiled_attention", "has_fast_gemm", "uses_brgemm", "gemm_backend", "half_dot", "runs_as_fp32",
           "gemm_setting", "GEMM_SETTINGS", "takes_in_place", "clip_blocks", "converts_bf16_natively",
           "scratch_bytes", "saved_bytes", "bias_grad_bytes", "SPEC", "KERNEL", "CompiledKernel", "compiled_block",
           "compiled_blocks", "COMPILED_DENSE_BLOCK", "COMPILED_MASK_BLOCK"]

#: must equal the extension's abi_version (csrc/attention.cpp): signatures the wrapper calls
ABI_VERSION = 10
_EXT = Extension("_C", ABI_VERSION, "compiled extension")


def _load():
    """The extension module built for the best capability this CPU runs, or None (the reason: ``_EXT.reason``)."""
    return _EXT.load()


def available(*tensors: torch.Tensor) -> bool:
    """True when the compiled kernel can run, and runs on these tensors (CPU only)."""
    return unavailable_reason(*tensors) is None


def unavailable_reason(*tensors: torch.Tensor) -> str | None:
    """Why the compiled kernel cannot run (these tensors), or None when it can."""
    if _load() is None:
        return _EXT.reason
    for t in tensors:
        if t is not None and t.device.type != "cpu":
            return f"CPU tensors only (got {t.device.type})"
    return None


def capability() -> str | None:
    """The CPU capability the loaded extension was compiled for ('AVX512', 'AVX2', 'DEFAULT'), or None."""
    ext = _load()
    return None if ext is None else str(ext.capability)


def variant() -> str | None:
    """The extension module that loaded ('attnlab._C_avx512', 'attnlab._C_avx2', 'attnlab._C'), or None."""
    ext = _load()
    return None if ext is None else ext.__name__


def has_fast_gemm(dtype: torch.dtype) -> bool:
    """Whether tiles of this dtype multiply through MKL's gemm (else a plain loop: correct but slow)."""
    ext = _load()
    if ext is None:
        return False
    return bool(ext.has_half_blas()) if dtype in (torch.bfloat16, torch.float16) else bool(ext.has_blas())


def converts_bf16_natively() -> bool:
    """Whether the kernel turns fp32 probabilities into bf16 with the CPU's AVX512-BF16 instruction
    (detected at load; ``ATTNLAB_EXT_NO_AVX512BF16=1`` forces at::vec's integer sequence, same rounding)."""
    ext = _load()
    return bool(ext is not None and ext.native_bf16_convert())


# -- block layouts ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class KernelLayout:
    """Which key blocks each query block visits, for 1 or N batch elements (Nl).

    kv_num [Nl, nq] int32; kv_idx, tile_id [Nl, nq, maxk] int32 (tile_id -1 = FULL block);
    tiles [T, bq, bk] uint8, the distinct masks of PARTIAL blocks. ``density`` is the visited
    fraction of the nq × nk blocks (averaged over Nl).
    """

    kv_num: torch.Tensor
    kv_idx: torch.Tensor
    tile_id: torch.Tensor
    tiles: torch.Tensor
    block_q: int
    block_k: int
    density: float

    @property
    def tensors(self):
        """(kv_num, kv_idx, tile_id, tiles) in the order the extension takes them."""
        return self.kv_num, self.kv_idx, self.tile_id, self.tiles


CACHE_SIZE = 64
#: the layouts kept together weigh at most this (their tensors and their keys: a pattern key holds every
#: global token of a longformer, so a key alone can weigh gigabytes; such an entry is built, used, dropped)
CACHE_BYTES = 256 << 20
_CACHE = ByteLRU("kernels.compiled layouts", CACHE_BYTES, max_entries=CACHE_SIZE)
#: tiles evaluated per step while building a layout's tile table (bounds its scratch memory)
_TILE_CHUNK_BYTES = 1 << 24


def _pattern_key(p):
    """A hashable key equal for patterns with equal parameters (causal() is rebuilt on every call),
    else the pattern object itself (kept alive by the cache, so its identity stays unique)."""
    if p is None:
        return None
    if dataclasses.is_dataclass(p):
        vals = []
        for f in dataclasses.fields(p):
            x = getattr(p, f.name)
            if isinstance(x, P.Pattern):
                x = _pattern_key(x)
                if isinstance(x, P.Pattern):
                    return p
            elif isinstance(x, tuple) and all(isinstance(e, (int, float, str, bool)) for e in x):
                pass
            elif not isinstance(x, (int, float, str, bool, type(None))):
                return p
            vals.append(x)
        return (type(p).__name__, tuple(vals))
    return p


def _unique_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(u, inv) with u[inv] == x: the distinct rows of x [n, w] (uint8 tiles) and each row's index among
    them, as ``torch.unique(x, dim=0, return_inverse=True)`` (whose row sort was 55 ms of a first document-mask
    call at L = S = 16384) in the order of a random projection: rows grouped by it, every row then
    compared with its group's first (a collision falls back to torch.unique)."""
    n = x.shape[0]
    if n <= 1:
        return x, torch.zeros(n, dtype=torch.long)
    # 8 bytes a word (rows padded with zeros to whole words), times fixed odd hash words (wrapping), summed:
    # exact integer arithmetic, so equal rows always meet. The words are a multiplicative hash of the column,
    # not a random draw: a random op would refuse to run under vmap (a layout built inside a transform). The
    # hash, the gathers and the comparison all run on the int64 words: per element, 8x fewer than bytes (the
    # byte-wise gather was most of this function's 23 ms on a document mask's 340 tiles at L = S = 16384).
    words = _words(x)  # (n, ceil(w / 8)) int64
    mult = (torch.arange(words.shape[1], dtype=torch.int64) * 0x1E3779B97F4A7C15 + 0x7F4A7C15) | 1
    proj = (words * mult).sum(1)
    key, inv = torch.unique(proj, return_inverse=True)  # (g,), (n,)
    first = torch.full((key.numel(),), n, dtype=torch.long).scatter_reduce(0, inv, torch.arange(n), "amin")
    dup = (first[inv] != torch.arange(n)).nonzero().view(-1)  # rows after their group's first
    if dup.numel() and not torch.equal(words.index_select(0, dup), words.index_select(0, first[inv[dup]])):
        return torch.unique(x, dim=0, return_inverse=True)  # two distinct rows with one projection
    return x.index_select(0, first), inv


def _words(x: torch.Tensor) -> torch.Tensor:
    """x [n, w] (uint8 or bool) as int64 [n, ceil(w / 8)], each row padded with zero bytes to whole words."""
    x = x.view(torch.uint8) if x.dtype == torch.bool else x
    xp = x.contiguous() if x.shape[1] % 8 == 0 else F.pad(x, (0, -x.shape[1] % 8))
    return xp.view(torch.int64)


def _any_all(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(m.any(-1), m.all(-1)) of a bool m [..., w], on its int64 words when w is whole words (a bool
    reduction per byte was a third of _pattern_layout on a document mask at L = S = 16384); a bool holds 0 or 1
    in each byte, so a word is all-True when it equals 0x0101010101010101."""
    shape = m.shape[:-1]
    flat = m.reshape(-1, m.shape[-1])
    if m.shape[-1] % 8 or flat.shape[0] == 0:
        return m.any(-1), m.all(-1)
    words = _words(flat)
    ones = 0x0101010101010101
    return (words != 0).any(1).view(shape), (words == ones).all(1).view(shape)


def _pattern_layout(pattern, L: int, S: int, bq: int, bk: int):
    """(visit [Nl, nq, nk] bool, tid [Nl, nq, nk] int32, tiles [T, bq, bk] uint8) for the pattern alone."""
    nq, nk = -(-L // bq), -(-S // bk)
    if pattern is None:
        return (torch.ones(1, nq, nk, dtype=torch.bool), torch.full((1, nq, nk), -1, dtype=torch.int32),
                torch.zeros(0, bq, bk, dtype=torch.uint8))
    lay = pattern.block_layout(L, S, bq, bk, device="cpu")  # union over the batch, conservative
    B = pattern.batch_size or 1
    visit = (lay != P.EMPTY).unsqueeze(0).expand(B, nq, nk).clone()
    tid = torch.full((B, nq, nk), -1, dtype=torch.int32)
    part = (lay == P.PARTIAL).nonzero()  # [Np, 2]
    if not len(part):
        return visit, tid, torch.zeros(0, bq, bk, dtype=torch.uint8)
    pre = getattr(pattern, "partial_tiles", None)  # BlockMaskPattern: Note [PARTIAL tiles evaluated once]
    pre = pre(L, S) if pre is not None and pattern.block_shape() == (bq, bk) else None
    if pre is not None and not torch.equal(pre[0], part):
        pre = None
    all_part, rep = part, None
    if pattern.translation_invariant() and not pattern.batch_size and len(part) > 1:
        # keep depends on j - i only: blocks at one offset qb·bq - kb·bk hold one tile, so each offset is
        # evaluated once (a band at L = S = 16384 evaluated 255 tiles of 128² pairs for 2 distinct ones); the
        # last row and column of blocks (cut by L or S: clamped indices below) are evaluated on their own
        edge = (part[:, 0] == nq - 1) | (part[:, 1] == nk - 1)
        group = torch.where(edge, -1 - torch.arange(len(part)), part[:, 0] * bq - part[:, 1] * bk + nk * bk)  # >= bk > 0
        _, rep = torch.unique(group, return_inverse=True)  # (Np,) each block's offset group
        first = torch.full((int(rep.max()) + 1,), len(part), dtype=torch.long).scatter_reduce(
            0, rep, torch.arange(len(part)), "amin")
        part = part[first]  # one block per group
        pre = None
    ar_q, ar_k = torch.arange(bq), torch.arange(bk)
    uniq, chunk = [], max(1, _TILE_CHUNK_BYTES // (B * bq * bk))
    for c0 in range(0, len(part), chunk):
        pc = part[c0:c0 + chunk]
        # rows/columns past L or S repeat the last valid one, so any/all below see only real positions
        i = (pc[:, :1] * bq + ar_q).clamp(max=L - 1).unsqueeze(-1)  # [C, bq, 1]
        j = (pc[:, 1:] * bk + ar_k).clamp(max=S - 1).unsqueeze(1)  # [C, 1, bk]
        m = pre[1][c0:c0 + chunk] if pre is not None else torch.broadcast_to(
            pattern.keep(i, j, L, S), ((B,) if pattern.batch_size else ()) + (len(pc), bq, bk))
        m = m.reshape(B, len(pc), bq * bk)
        any_, all_ = _any_all(m)  # [B, C]
        qb, kb = pc[:, 0], pc[:, 1]
        visit[:, qb, kb] = any_
        sel = any_ & ~all_
        if bool(sel.any()):
            ms = m if bool(sel.all()) else m[sel]  # (n, bq·bk) bool: deduplicated before the uint8 copy
            u, inv = _unique_rows(ms.reshape(-1, bq * bk))
            u = u.to(torch.uint8)
            t = torch.full((B, len(pc)), -1, dtype=torch.int32)
            t[sel] = (inv + sum(x.shape[0] for x in uniq)).to(torch.int32)
            tid[:, qb, kb] = t
            uniq.append(u)
    tiles = torch.cat(uniq) if uniq else torch.zeros(0, bq * bk, dtype=torch.uint8)
    if len(uniq) > 1:  # the same tile found in several chunks: one copy
        tiles, inv = _unique_rows(tiles)
        tid = torch.where(tid >= 0, inv.to(torch.int32)[tid.clamp(min=0).long()], tid)
    if rep is not None:  # every block as its group's evaluated one
        src = part[rep]  # (Np, 2)
        visit[:, all_part[:, 0], all_part[:, 1]] = visit[:, src[:, 0], src[:, 1]]
        tid[:, all_part[:, 0], all_part[:, 1]] = tid[:, src[:, 0], src[:, 1]]
    return visit, tid, tiles.view(-1, bq, bk).contiguous()


def _compress(visit: torch.Tensor, tid: torch.Tensor, tiles: torch.Tensor, bq: int, bk: int) -> KernelLayout:
    kv_num = visit.sum(-1)
    maxk = max(1, int(kv_num.max())) if kv_num.numel() else 1
    order = torch.sort((~visit).to(torch.int8), dim=-1, stable=True).indices[..., :maxk]  # visited first, ascending
    kv_idx = order.to(torch.int32).contiguous()
    tile_id = tid.gather(-1, order).to(torch.int32).contiguous()
    density = float(visit.float().mean()) if visit.numel() else 0.0
    return KernelLayout(kv_num.to(torch.int32).contiguous(), kv_idx, tile_id, tiles, bq, bk, density)


def build_layout(mask: MaskSpec, block_q: int, block_k: int) -> KernelLayout:
    """The kernel's layout for a mask at one block shape. The pattern's part is cached per
    (pattern, L, S, block); a user bool mask only removes the blocks it leaves empty (its values
    are read inside the tiles by the kernel)."""
    L, S = mask.L, mask.S
    key = (_pattern_key(mask.pattern), L, S, block_q, block_k)
    sentinel = object()
    hit = _CACHE.get(key, sentinel)
    if hit is sentinel:
        hit = _pattern_layout(mask.pattern, L, S, block_q, block_k)
        if _wrapped(*hit):  # built under torch.func.grad: its wrappers die with the transform
            return _compress(*hit, block_q, block_k)
        _CACHE.put(key, hit)
    visit, tid, tiles = hit
    if mask.keep is not None:
        visit = visit & (mask.layout(block_q, block_k, device="cpu") != P.EMPTY)
    return _compress(visit, tid, tiles, block_q, block_k)


#: the values ATTNLAB_EXT_GEMM takes (module docstring)
GEMM_SETTINGS = ("auto", "brgemm", "mkl", "loop", "fp32")
#: the extension's GemmMode (csrc Note [Gemm arguments]): products off brgemm on the loop or MKL; 2 = brgemm
#: where it applies
_LOOP, _BLAS, _BRGEMM = 0, 1, 2


def gemm_setting() -> str:
    """``ATTNLAB_EXT_GEMM`` ('auto' when unset or empty), one of GEMM_SETTINGS; anything else raises ValueError."""
    value = os.environ.get("ATTNLAB_EXT_GEMM", "").strip().lower() or "auto"
    if value not in GEMM_SETTINGS:
        raise ValueError(f"ATTNLAB_EXT_GEMM must be one of {', '.join(GEMM_SETTINGS)} (or unset), "
                         f"got {os.environ['ATTNLAB_EXT_GEMM']!r}")
    return value


#: the fp32 backward takes brgemm only for tiles up to this many scores: it needs P and dS transposed
#: (brgemm has no transposed operands), which costs more than MKL's per-call overhead on large tiles
#: (measured fwd+bwd, dense n=4096, 2 threads: 256x512 tiles 0.58x SDPA with brgemm, 1.39x with MKL;
#: 64x64 tiles 0.85x with brgemm)
BACKWARD_BRGEMM_MAX_TILE = 64 * 64


#: the backward wants at least this many units per thread (csrc Note [Backward balance]); fewer (n, kv head)
#: pairs than that split each kv head's key blocks into ranges, at the cost of a partial fp32 dq per range
#: (zeroed, then summed) and of each range's own pass over the query blocks. Measured fwd+bwd, window 256,
#: n=16384, H=8, Hkv=1 (one pair), fp32, loaded machine: 2 threads 490 / 328 / 429 ms for 1 / 2 / 4 ranges,
#: 1 thread 384 / 457 / 538 ms: ranges pay only to give an idle thread work, so one unit per thread.
BACKWARD_UNITS_PER_THREAD = 1


def backward_splits(N: int, Hkv: int, S: int, block_k: int) -> int:
    """Key-block ranges per (batch element, kv head) in the backward: 1 when N·Hkv already gives every
    thread BACKWARD_UNITS_PER_THREAD units, else enough ranges for that (at most one per key block).
    ``ATTNLAB_EXT_BWD_SPLITS=k`` forces k (for comparisons)."""
    forced = os.environ.get("ATTNLAB_EXT_BWD_SPLITS", "")
    nk = max(1, -(-S // block_k))
    if forced:
        return max(1, min(int(forced), nk))
    want = BACKWARD_UNITS_PER_THREAD * torch.get_num_threads()
    pairs = max(1, N * Hkv)
    return 1 if pairs >= want else min(nk, -(-want // pairs))


#: on AMX, the bf16/fp16 backward takes brgemm when query blocks visit at least this many key blocks on average:
#: it transposes Q and dO once per query block (csrc Note [Half-type backward on brgemm]), which pays over
#: many key blocks only. Measured bf16 fwd+bwd vs MKL's gemm, H=8, D=64, 2 threads, loaded machine:
#: dense n=4096 (32 blocks of 128 keys) backward 1.03-1.17x at every tile from 64x128 to 256x512, causal
#: n=8192 (8 blocks of 512 on average) 1.17-1.26x, but window 256 n=8192 (5 blocks of 64) 0.89x and
#: block-sparse 0.05 (4 blocks of 128) 0.95x; with the transposes vectorised, window 1.00x, block-sparse
#: 0.94x (noisy). Without AMX (the vector dot products of AVX512-BF16) brgemm's backward pays at every density:
#: bf16 fwd+bwd's backward, n=4096, H=8, D=64, 2 threads, Zen 5 (shared machine), brgemm vs MKL:
#: dense 0.97x (both brgemm: noise), causal 1.81x, window 256 1.56x, block-sparse 0.1 1.58x, window 32 (64x64
#: tiles) 1.21x; n=1024 window 64 1.00x; n=256 causal 1.28x.
BACKWARD_HALF_BRGEMM_MIN_BLOCKS = 8


def _backward_brgemm(dtype: torch.dtype, lay: KernelLayout) -> bool:
    """Whether the backward takes brgemm: half types on AMX when their query blocks visit enough key blocks
    (BACKWARD_HALF_BRGEMM_MIN_BLOCKS), else always, fp32 for tiles up to BACKWARD_BRGEMM_MAX_TILE; always
    under ATTNLAB_EXT_GEMM=brgemm. (Where brgemm does not apply to the tiles, the extension runs MKL's gemm.)"""
    setting = _engine_setting()
    if setting != "auto":
        return setting == "brgemm"
    if dtype in (torch.bfloat16, torch.float16):
        if half_dot(dtype) != "amx":  # the vector dot products: brgemm wherever it applies
            return True
        return float(lay.kv_num.float().mean()) >= BACKWARD_HALF_BRGEMM_MIN_BLOCKS if lay.kv_num.numel() else False
    return lay.block_q * lay.block_k <= BACKWARD_BRGEMM_MAX_TILE


def _engine_setting() -> str:
    """gemm_setting() as it applies to the tiles the kernel runs: "fp32" converts half types and otherwise
    chooses as "auto"."""
    setting = gemm_setting()
    return "auto" if setting == "fp32" else setting


def half_dot(dtype: torch.dtype) -> str | None:
    """How this CPU multiplies pairs of this half dtype in hardware: "amx" (AMX tiles), "avx512" (the vector dot
    products of AVX512-BF16 / AVX512-FP16) or None (it does not; also without the extension), read from its flags
    by the extension (csrc Note [Half-type dot products])."""
    ext = _load()
    if ext is None or dtype not in (torch.bfloat16, torch.float16):
        return None
    return ext.half_dot(str(dtype).replace("torch.", "")) or None


def runs_as_fp32(dtype: torch.dtype) -> bool:
    """Whether bf16 / fp16 inputs are converted once to fp32 and run on the fp32 tiles (then rounded back):
    under ATTNLAB_EXT_GEMM=fp32, and under auto on a CPU without the dtype's dot product in hardware, where
    a half-type product is a conversion followed by fp32 arithmetic (slower than fp32 tiles: csrc Note
    [Half-type dot products]; measured in attnlab.bench.half_tiles)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return False
    setting = gemm_setting()
    return setting == "fp32" or (setting == "auto" and not half_dot(dtype))


def _gemm_mode(dtype: torch.dtype, lay: KernelLayout | None = None, backward: bool = False) -> int:
    """The extension's gemm argument for one pass (ATTNLAB_EXT_GEMM, and for the backward under auto its
    measured rules); ``dtype`` is the dtype the kernel runs (float32 for half types that ``runs_as_fp32``)."""
    setting = _engine_setting()
    if setting == "loop":
        return _LOOP
    if setting == "mkl" or (backward and not _backward_brgemm(dtype, lay)):
        return _BLAS
    return _BRGEMM


def gemm_backend(dtype: torch.dtype, E: int = 64, Ev: int | None = None, block_k: int = 64, *,
                 backward: bool = False, layout: KernelLayout | None = None) -> str | None:
    """Which back end multiplies this dtype's tiles (head dims E, Ev; key blocks of ``block_k``) under the
    current ``ATTNLAB_EXT_GEMM``: "brgemm" (oneDNN's micro-kernel; bf16 on AMX or AVX512-BF16), "mkl" (MKL's gemm
    from torch's build), "loop" (the plain loop) or, for half types, "fp32" (converted once and run on the fp32
    tiles, whose back end is ``gemm_backend(torch.float32, ...)``: ``runs_as_fp32``); None without the extension.
    Every product of one pass runs on one back end, but for the backward's scores, which run on the forward's
    (csrc Note [Same scores]).
    ``backward=True`` answers for the backward, whose choice under auto follows the ``layout`` (required then:
    BACKWARD_BRGEMM_MAX_TILE, BACKWARD_HALF_BRGEMM_MIN_BLOCKS)."""
    ext = _load()
    if ext is None:
        return None
    if backward and layout is None and gemm_setting() in ("auto", "fp32"):
        raise ValueError("gemm_backend(backward=True) under ATTNLAB_EXT_GEMM=auto needs the layout "
                         "(its choice depends on the tile shape and the visited blocks)")
    if runs_as_fp32(dtype):
        return "fp32"
    mode = _gemm_mode(dtype, layout, backward)
    Ev = E if Ev is None else Ev
    name = str(dtype).replace("torch.", "")
    # an empty head dim runs as one zero column (compiled_attention)
    if mode == _BRGEMM and dtype != torch.float64 and ext.brgemm_for(name, max(E, 1), max(Ev, 1), block_k):
        return "brgemm"
    return "mkl" if mode != _LOOP and has_fast_gemm(dtype) else "loop"


def uses_brgemm(dtype: torch.dtype, E: int, Ev: int, block_k: int) -> bool:
    """Whether the forward's tiles of this dtype and head dims run on oneDNN's brgemm (bf16/fp16: the CPU's AMX
    or AVX512-BF16 instructions) rather than MKL's gemm (``gemm_backend``)."""
    return gemm_backend(dtype, E, Ev, block_k) == "brgemm"


# -- operands ---------------------------------------------------------------------------------------
_INT_MAX = 2 ** 31 - 1


def takes_in_place(t: torch.Tensor) -> bool:
    """Whether the kernel reads q, k or v ([N, H, T, D]) through its own strides (else it gets a copy).

    # Note [Operand strides]: the tile products (MKL's gemm, oneDNN's brgemm, the loop) take each [T, D]
    # slab as a matrix with leading dim stride(-2), which they accept only between max(1, D) and 2^31 - 1,
    # with a last stride of 1 (or D = 1). Batch and head strides are free (0 for broadcast heads). PyTorch
    # calls a tensor contiguous whatever the stride of a size-1 dim, so ``.contiguous()`` is no fix: a
    # single row from ``.mT`` keeps row stride 1, an ``expand`` along T has row stride 0 (MKL refused both:
    # "Parameter N was incorrect", printed, with the tile left stale). csrc's check_operand refuses what
    # this lets through and the gemm wrappers check every product (csrc Note [Gemm arguments]).
    """
    D = t.shape[-1]
    return (t.stride(-1) == 1 or D == 1) and max(1, D) <= t.stride(-2) <= _INT_MAX


def _operand(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy with canonical strides when the kernel cannot read it in place (Note [Operand strides]);
    ``clone(memory_format=contiguous_format)`` writes canonical strides even for size-1 dims."""
    return t if takes_in_place(t) else t.clone(memory_format=torch.contiguous_format)


def _dense(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy, such that canonical offsets address it (dout: the kernel indexes it so): PyTorch's
    contiguity is exactly that condition, a size-1 dim's stride being never used."""
    return t if t.is_contiguous() else t.clone(memory_format=torch.contiguous_format)


def clip_blocks(block_q: int, block_k: int, L: int, S: int) -> tuple[int, int]:
    """(block_q, block_k) no larger than L and S rounded up to 16 (and at least 16): the kernel's scratch
    (``scratch_bytes``) and tile table then follow the problem's size, whatever block size was asked for."""
    return min(block_q, max(16, -(-L // 16) * 16)), min(block_k, max(16, -(-S // 16) * 16))


# -- autograd --------------------------------------------------------------------------------------
_wrapped = transformed  # a transform's wrappers reach the extension only through the dispatcher (_backward_op)


#: torch.func.grad / vjp / jacrev wrap every tensor made inside them, the layout's (built and cached per
#: call) included, and the extension cannot read a wrapper: refused with this message. vmap is supported.
_GRAD_TRANSFORM = ("method='compiled' does not run under torch.func.grad / vjp / jacrev (its block layout is built "
                   "and cached inside the call): differentiate with torch.autograd (torch.func.vmap over it works), "
                   "or use method='tiled'")


def _vmap_by_slices(fn, info, in_dims, args):
    """A vmap rule: ``fn`` on each slice of the mapped dim, outputs stacked at 0 (a None output stays None).
    One call per slice: vmap here serves transforms such as batched gradients, not speed."""
    outs = [fn(*(a if d is None else a.select(d, b) for a, d in zip(args, in_dims)))
            for b in range(info.batch_size)]
    stacked = tuple(None if o is None else torch.stack([r[i] for r in outs]) for i, o in enumerate(outs[0]))
    return stacked, tuple(None if o is None else 0 for o in stacked)


def _run_backward(dout, q, k, v, out, lse, lse_lo, kv_num, kv_idx, tile_id, tiles, keep, bias, alibi, rel, scale,
                  softcap, alibi_causal, alibi_offset, block_q, block_k, gemm, score_gemm, bias_grad, rel_grad, splits):
    """The extension's backward on plain tensors: (dq, dk, dv, dbias or None, drel or None)."""
    dq, dk, dv, dbias, drel = _load().backward(_dense(dout.to(q.dtype)), _operand(q), _operand(k), _operand(v), out,
                                               lse, lse_lo, kv_num, kv_idx, tile_id, tiles, keep, bias, alibi, rel,
                                               scale, softcap, alibi_causal, alibi_offset, block_q, block_k, gemm,
                                               score_gemm, bias_grad, rel_grad, splits)
    return dq, dk, dv, dbias, drel


@torch.library.custom_op("attnlab::compiled_backward", mutates_args=())
def _backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, lse_lo: torch.Tensor, kv_num: torch.Tensor, kv_idx: torch.Tensor,
                 tile_id: torch.Tensor,
                 tiles: torch.Tensor, keep: torch.Tensor | None, bias: torch.Tensor | None,
                 alibi: torch.Tensor | None, rel: torch.Tensor | None, scale: float, softcap: float,
                 alibi_causal: bool, alibi_offset: int, block_q: int, block_k: int, gemm: int, score_gemm: int,
                 bias_grad: bool, rel_grad: bool,
                 splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The compiled backward as a dispatcher op, for transforms only: vmap (torch.func's rule below; the
    legacy vmap of gradcheck's batched gradients loops over the batch itself) and create_graph=True (its
    autograd rule refuses double backward). dbias and drel are empty when not asked."""
    dq, dk, dv, dbias, drel = _run_backward(dout, q, k, v, out, lse, lse_lo, kv_num, kv_idx, tile_id, tiles, keep, bias,
                                            alibi, rel, scale, softcap, alibi_causal, alibi_offset, block_q, block_k,
                                            gemm, score_gemm, bias_grad, rel_grad, splits)
    return (dq, dk, dv, dbias if dbias is not None else lse.new_empty(0),
            drel if drel is not None else lse.new_empty(0))


@_backward_op.register_vmap
def _backward_op_vmap(info, in_dims, *args):
    return _vmap_by_slices(_backward_op, info, in_dims, args)


def _no_double_backward(ctx, *grads):
    raise RuntimeError("the compiled attention kernel's backward is not differentiable (no double backward): "
                       "use method='tiled' or 'dense' for higher-order gradients")


_backward_op.register_autograd(_no_double_backward)


def _convert(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in ``dtype`` (t itself when it is already), converted on the calling thread (csrc Note [Serial
    conversion]: PyTorch's parallel conversions wait for the slowest thread of a busy CPU); a transform's
    wrapper (vmap) takes PyTorch's own. Never differentiated (the kernel's backward has no double backward)."""
    if t.dtype == dtype:
        return t
    if _wrapped(t):
        return t.to(dtype)
    return _load().convert(t, str(dtype).replace("torch.", ""))


class _CompiledFunction(torch.autograd.Function):
    """(out, lse, out_acc or None, lse_lo) of the kernel, differentiable in q, k, v, the float mask ``bias`` and
    the relative bias table ``rel`` [H, L + S - 1] (csrc Note [Relative bias]);
    torch.func-compatible (setup_context, a vmap rule). lse_lo is lse's rounding error, lse + lse_lo = m + log(l),
    for the backward (csrc Note [Split log-sum-exp]). With ``sinks`` [H] the four are the sinked ones, which the
    unchanged backward takes, and the sinks' gradient is one reduction (Note [Attention sinks] in ``kernels.lse``)."""

    @staticmethod
    def forward(q, k, v, lay: KernelLayout, keep, bias, alibi, scale, softcap, alibi_causal, alibi_offset, keep_acc,
                as_fp32, rel=None, sinks=None):
        if _wrapped(*lay.tensors):
            raise RuntimeError(_GRAD_TRANSFORM)
        dtype = q.dtype
        if as_fp32:  # runs_as_fp32: converted once, the fp32 kernel, its output rounded once
            q, k, v = (_convert(t, torch.float32) for t in (q, k, v))
        # Note [fp32 O for delta] (csrc): half types keep O in float32 for the backward's rowsum(dO * O)
        out, lse, out_acc, lse_lo = _load().forward(_operand(q), _operand(k), _operand(v), *lay.tensors, keep, bias,
                                                    alibi, rel, scale, softcap, alibi_causal, alibi_offset,
                                                    lay.block_q, lay.block_k, _gemm_mode(q.dtype),
                                                    (keep_acc or sinks is not None) and not as_fp32)
        if sinks is not None:  # the float32 O, when kept, is rescaled and rounded once
            out, out_acc, lse, lse_lo = _sinked(out, out_acc, lse, lse_lo, sinks.detach(), keep_acc)
        if as_fp32:
            out, out_acc = _convert(out, dtype), (out if keep_acc else None)
        return out, lse, out_acc, lse_lo

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, lay, keep, bias, alibi, scale, softcap, alibi_causal, alibi_offset, _, as_fp32, rel, sinks = inputs
        out, lse, out_acc, lse_lo = output
        ctx.save_for_backward(q, k, v, out if out_acc is None else out_acc, lse, lse_lo, bias, rel, sinks)
        ctx.args = (lay, keep, alibi, scale, softcap, alibi_causal, alibi_offset)
        ctx.as_fp32 = as_fp32
        ctx.mark_non_differentiable(*(t for t in (lse, out_acc, lse_lo) if t is not None))

    @staticmethod
    def backward(ctx, dout, _dlse, _dacc, _dlo):
        q, k, v, out, lse, lse_lo, bias, rel, sinks = ctx.saved_tensors
        lay, keep, alibi, scale, softcap, alibi_causal, alibi_offset = ctx.args
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[14]:  # ds_h = -Σ (1 - a)·rowsum(dO ∘ O'), Note [Attention sinks]
            acc = lse.dtype
            rest = torch.exp((sinks.detach().to(acc).view(-1, 1) - lse) - lse_lo)  # 1 - a = exp(s - lse')
            dsinks = -(rest * (dout.to(acc) * out.to(acc)).sum(-1)).sum((0, 2)).to(sinks.dtype)
            if not any(ctx.needs_input_grad[i] for i in (0, 1, 2, 5, 13)):
                return (None,) * 14 + (dsinks,)
        # the float mask's gradient comes back dense [N, H, L, S]; ``bias`` is an expand() of the caller's
        # mask, so autograd's expand backward sums it over the broadcast dims to the mask's own shape
        bias_grad = bias is not None and ctx.needs_input_grad[5]
        rel_grad = rel is not None and ctx.needs_input_grad[13]
        dtype = q.dtype
        if ctx.as_fp32:  # as the forward ran: the fp32 kernel on converted inputs
            dout, q, k, v, out = (_convert(t, torch.float32) for t in (dout, q, k, v, out))
        # the scores on the forward's engine (csrc Note [Same scores]), the other products on the backward's
        args = (dout, q, k, v, out, lse, lse_lo, *lay.tensors, keep, bias, alibi, rel, scale, softcap, alibi_causal,
                alibi_offset, lay.block_q, lay.block_k, _gemm_mode(q.dtype, lay, backward=True), _gemm_mode(q.dtype),
                bias_grad, rel_grad, backward_splits(q.shape[0], k.shape[1], k.shape[2], lay.block_k))
        if torch.is_grad_enabled() or _wrapped(dout, q, k, v, out, lse, lse_lo, bias, keep, rel):
            dq, dk, dv, dbias, drel = _backward_op(*args)  # a transform, or create_graph=True
            dbias = dbias if bias_grad else None
            drel = drel if rel_grad else None
        else:
            dq, dk, dv, dbias, drel = _run_backward(*args)
        if ctx.as_fp32:
            dq, dk, dv = (_convert(t, dtype) for t in (dq, dk, dv))
        return dq, dk, dv, None, None, dbias, None, None, None, None, None, None, None, drel, dsinks

    @staticmethod
    def vmap(info, in_dims, *args):
        return _vmap_by_slices(_CompiledFunction.apply, info, in_dims, args)


def _sinked(out, out_acc, lse, lse_lo, sinks, keep_acc: bool):
    """(out', out_acc' or None, lse', lse_lo') with attention sinks (Note [Attention sinks] in ``kernels.lse``):
    lse' = logaddexp(lse + lse_lo, s) in float64, split again into hi + lo (csrc Note [Split log-sum-exp]); the
    output rescaled from its float32 copy when there is one (half types), then rounded once."""
    acc = lse.dtype
    a, full = sink_scale(lse.double() + lse_lo.double(), sinks)  # (N, H, L) each, float64
    hi = full.to(acc)
    lo = torch.where(torch.isfinite(hi), full - hi.double(), torch.zeros_like(full)).to(acc)
    src = out if out_acc is None else out_acc
    scaled = src * a.unsqueeze(-1).to(src.dtype)  # (N, H, L, Ev)
    return scaled.to(out.dtype), (scaled if keep_acc and out_acc is not None else None), hi, lo


def compiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: MaskSpec, scale: float,
                       block_q: int = 64, block_k: int = 64, *, softcap: float = 0.0,
                       alibi_slopes: torch.Tensor | None = None, alibi_causal: bool = False,
                       layout: KernelLayout | None = None, rel_bias: torch.Tensor | None = None):
    """q [N, H, L, E], k [N, Hkv, S, E], v [N, Hkv, S, Ev] -> (out [N, H, L, Ev], lse [N, H, L]).

    lse is float32 (float64 for float64 inputs), -inf for a row with no key (whose output is 0), and
    not differentiable. Attention sinks come from ``mask.sinks`` [H] (differentiable; lse then includes them:
    Note [Attention sinks] in ``kernels.lse``). Differentiable in q, k, v and in a float mask ``mask.bias`` that requires grad
    (its gradient is built dense, [N, H, L, S] in the accumulation dtype, then summed to its shape).
    Soft-capping and ALiBi come from ``mask`` (``mask.softcap``, ``mask.alibi`` [1, H]: Note [Score
    modifications]) or, for direct callers, from the keywords (not both): softcap > 0 replaces each
    scaled score s by softcap·tanh(s / softcap) (Gemma 2, flash-attn); ``alibi_slopes`` [H] adds
    −slope·|j − i'| to the scores, or slope·(j − i') with ``alibi_causal`` (equal on the keys a
    bottom-right causal mask keeps), where i' = i + S − L (flash-attn's alignment).
    ``rel_bias`` [H, L + S − 1] adds rel_bias[h, j − i + L − 1] to the scaled (soft-capped) score of query i,
    key j, differentiable when it requires grad (csrc Note [Relative bias]: O(L + S) memory and gradient).
    Any strides (Note [Operand strides]); E = 0 (every score q·k is 0) and Ev = 0 (out [N, H, L, 0], lse
    still that of the scores) included. block_q, block_k are clipped to the sequence (``clip_blocks``)
    unless ``layout`` fixes them. Raises RuntimeError when the extension is unavailable (check
    ``available()`` first), ValueError for an unknown ``ATTNLAB_EXT_GEMM``.
    """
    why = unavailable_reason(q, k, v)
    if why is not None:
        raise RuntimeError(f"compiled attention kernel unavailable: {why}")
    gemm_setting()  # an unknown ATTNLAB_EXT_GEMM is an error before any work
    if any(torch._C._functorch.is_gradtrackingtensor(t) for t in (q, k, v)):
        raise RuntimeError(_GRAD_TRANSFORM)
    N, H, L, E = q.shape
    S, Ev = k.shape[2], v.shape[-1]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    if min(N, H, L, S) == 0 or k.shape[1] == 0:  # nothing to compute; rows with no key are 0 / -inf
        # graph kept through sums of empty slices (0 * q.sum() would be NaN for a q holding Inf)
        out = q.new_zeros(N, H, L, Ev) + (q[..., :0].sum() + k[..., :0].sum() + v[..., :0].sum())
        lse = torch.full((N, H, L), float("-inf"), dtype=acc, device=q.device)
        return out, (lse if mask.sinks is None else sink_scale(lse, mask.sinks.detach())[1])
    if layout is None:
        layout = build_layout(mask, *clip_blocks(block_q, block_k, L, S))
    keep = bias = None
    if mask.keep is not None:
        keep = mask.keep.expand(N, H, L, S)
    if mask.bias is not None:  # differentiable: the backward returns its gradient when it requires grad
        bias = mask.bias.to(acc).expand(N, H, L, S)
    if mask.softcap is not None or mask.alibi is not None:
        if softcap or alibi_slopes is not None:
            raise ValueError("compiled_attention: softcap/alibi_slopes given both in mask and as keywords")
        softcap = mask.softcap_for(acc) or 0.0  # Note [Soft-cap at infinity] (kernels/masks.py)
        if mask.alibi is not None:
            if mask.alibi.shape[0] != 1:
                raise ValueError(f"the compiled kernel takes ALiBi slopes [H] only, got one row per batch element "
                                 f"{list(mask.alibi.shape)}")
            alibi_slopes, alibi_causal = mask.alibi[0], False
    if softcap and softcap > torch.finfo(acc).max:  # Note [Soft-cap at infinity]: the identity
        softcap = 0.0
    if alibi_slopes is not None:
        a = alibi_slopes.detach()
        if not bool(torch.isfinite(a.to(torch.float32)).all()):
            raise ValueError(f"alibi_slopes must be finite float32 values, |slope| <= {torch.finfo(torch.float32).max:.6g} "
                             f"(the kernel computes ALiBi in float32), got {a.tolist() if a.numel() <= 16 else 'others'}")
        alibi_slopes = a.to(torch.float32).contiguous()
    if E == 0:  # every score q·k is 0: one zero column gives exactly that (and the scale no 0 · inf)
        q, k, scale = F.pad(q, (0, 1)), F.pad(k, (0, 1)), 1.0
    if Ev == 0:  # lse is still the scores'; the output is the empty slice of one zero column's
        v = F.pad(v, (0, 1))
    if rel_bias is not None:
        if rel_bias.shape != (H, L + S - 1):
            raise ValueError(f"compiled_attention: rel_bias must be [H, L + S - 1] = [{H}, {L + S - 1}], "
                             f"got {list(rel_bias.shape)}")
        rel_bias = rel_bias.to(acc).contiguous()
    keep_acc = q.dtype in (torch.bfloat16, torch.float16) and torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad)
    sinks = mask.sinks
    if sinks is not None and sinks.shape != (H,):
        raise ValueError(f"compiled_attention: mask.sinks must be [H] = [{H}], got {list(sinks.shape)}")
    out, lse, _, _ = _CompiledFunction.apply(q, k, v, layout, keep, bias, alibi_slopes, float(scale), float(softcap),
                                             bool(alibi_causal), int(S - L), keep_acc, runs_as_fp32(q.dtype), rel_bias,
                                             sinks)
    return (out[..., :0] if Ev == 0 else out), lse


# -- declaration ------------------------------------------------------------------------------------
def scratch_bytes(block_q: int, block_k: int, E: int, Ev: int) -> int:
    """Bytes of the kernel's per-thread tiles (scores, probabilities, accumulators), all threads."""
    # the forward merges runs of full key blocks into tiles up to 512 keys wide (csrc: merged runs)
    return torch.get_num_threads() * 4 * (4 * block_q * max(block_k, 512) + block_q * (E + Ev + 4))


def saved_bytes(r: Request) -> int:
    """Bytes the forward keeps for the backward besides q, k, v and the output: the log-sum-exp
    [N, H, L] and, under autograd, its rounding error [N, H, L] (csrc Note [Split log-sum-exp]) and, for
    half types, the output again in float32 [N, H, L, Ev] (csrc Note [fp32 O for delta])."""
    acc = 8 if r.dtype == torch.float64 else 4
    out_acc = r.N * r.H * r.L * r.Ev * 4 if r.needs_grad and r.dtype in (torch.bfloat16, torch.float16) else 0
    lse_lo = r.N * r.H * r.L * acc if r.needs_grad else 0
    return r.N * r.H * r.L * acc + lse_lo + out_acc


def bias_grad_bytes(r: Request) -> int:
    """Bytes of the float mask's dense gradient [N, H, L, S] (accumulation dtype) when it requires grad:
    the mask may broadcast, so the kernel writes every (head, query, key) before summing to its shape
    (as PyTorch's math path materialises the L×S gradient too)."""
    return r.pairs * (8 if r.dtype == torch.float64 else 4) if r.float_mask_grad else 0


def rel_bias_grad_bytes(r: Request, block_k: int) -> int:
    """Bytes of the relative bias table's gradient in the backward, when it requires grad (``r.rel_bias_grad``
    under ``r.needs_grad``): each backward unit (batch element, kv head, key range: ``backward_splits``) sums
    its score gradients into its own rows [groups, L + S - 1], added up in unit order into the result
    [H, L + S - 1] (csrc Note [Relative bias]): (units·groups + H)·(L + S - 1) in the accumulation dtype."""
    if not (r.rel_bias_grad and r.needs_grad):
        return 0
    acc = 8 if r.dtype == torch.float64 else 4
    nk = max(1, -(-r.S // block_k))
    units = r.N * r.Hkv * max(1, min(backward_splits(r.N, r.Hkv, r.S, block_k), nk))
    return (units * (r.H // max(1, r.Hkv)) + r.H) * (r.L + r.S - 1) * acc


def _peak(r: Request, t: Tiling | None) -> int:
    bq, bk = (t.block_q, t.block_k) if t is not None else (64, 64)
    splits = backward_splits(r.N, r.Hkv, r.S, bk) if r.needs_grad else 1
    dq_parts = splits * r.N * r.H * r.L * r.E * 4 if splits > 1 else 0  # csrc Note [Backward balance]
    wide = _fp32_copy_bytes(r) if _planned_as_fp32(r) else 0
    return (io_bytes(r) + saved_bytes(r) + bias_grad_bytes(r) + rel_bias_grad_bytes(r, bk) + dq_parts + wide
            + scratch_bytes(bq, bk, r.E, r.Ev))


def _flops(r: Request, t: Tiling | None) -> int:
    computed = t.computed(r.L, r.S) if t is not None else r.L * r.S
    return r.N * r.H * computed * 2 * (r.E + r.Ev)


def _explain(r: Request) -> str | None:
    """explain's line when half types run as fp32 tiles here (``runs_as_fp32``), else None."""
    if not _planned_as_fp32(r):
        return None
    name = str(r.dtype).replace("torch.", "")
    why = ("ATTNLAB_EXT_GEMM=fp32" if gemm_setting() == "fp32" else
           f"no {name} dot product on this CPU (AMX or AVX512-{'BF16' if r.dtype == torch.bfloat16 else 'FP16'})")
    return f"{name} runs as fp32 tiles, {why}: q, k, v converted once ({format_bytes(_fp32_copy_bytes(r))})"


def _planned_as_fp32(r: Request) -> bool:
    """``runs_as_fp32`` for a planned request; False without the extension or under an unknown
    ATTNLAB_EXT_GEMM (the call itself raises on it: planning and explaining other kernels do not)."""
    try:
        return _load() is not None and runs_as_fp32(r.dtype)
    except ValueError:
        return False


def _fp32_copy_bytes(r: Request) -> int:
    """Bytes of the fp32 copies of q, k, v and of the output before rounding, when ``runs_as_fp32``."""
    return 4 * (r.N * r.H * r.L * (r.E + r.Ev) + r.N * r.Hkv * r.S * (r.E + r.Ev))


SPEC = KernelSpec("compiled", "attnlab's C++ CPU kernel: online softmax over the layout's tiles, masks read "
                  "inside them", lse="yes", float_mask_grad=True, gqa_no_copy=True, needs_extension=True, blocked=True,
                  devices=("cpu",), softcap=True, alibi="native", alibi_shapes=("[H]",), rel_bias=True, sinks=True,
                  peak_bytes=_peak, flops=_flops, unavailable=lambda r: unavailable_reason(), explain=_explain)


# -- the kernel object ------------------------------------------------------------------------------
#: dense inputs (and ALiBi or soft-capping alone): the largest tiles (the fastest per pair)
COMPILED_DENSE_BLOCK = (256, 512)
COMPILED_MASK_BLOCK = (128, 256)  # user masks: blocks they leave empty are skipped at this grain


#: Note [Causal tile size]: a causal call visits its diagonal's tiles whole, so its work is the visited tiles'
#: pairs plus a fixed cost per tile (the tile's softmax bookkeeping and products' set-up), which this counts as
#: that many pairs. Fitted on the model-207 AMX Xeon (fp32, GQA 9/3, D 64, 2 threads, L = S = 4096, blocks of
#: 64, 128 and 256 through ``block_size``): 0.30 us a tile against 0.78 ns a pair, 381 pairs. The fit
#: predicted L = 8000 within 0.5-2 % (64: 247.8 against 248.9 ms measured). By it, with the rate table it was
#: fitted against, an inference call took 64 x 64 tiles at 512 and 128 x 128 from 1024 to 8000 (with the table
#: re-measured at this code: 128 x 128 from 512 to 8000, 256 x 256 at 16384), where the dense tiles (256 x 512)
#: had been kept. Those
#: had cost causal calls the diagonal's waste: time over SDPA's on SmolLM2's attention shape (quiet, medians of
#: 9-61 interleaved rounds), dense tiles -> these: 512 0.99x -> 1.40x (64), 1024 0.99x -> 1.26x (128), 4096
#: 1.06x -> 1.12x (128), 8000 1.09x -> 1.11x (128). Half types pair faster on AMX, so the same fixed cost is
#: more pairs: bf16 MHA 16/16 D 128 at 4096 ran 128 x 128 tiles 1.04x and 256 x 256 1.09x the dense tiles' speed
#: (2048: 1.20x and 1.17x), which 1024 pairs a tile separates. A call that needs grad takes the same tiles (the
#: backward reuses the forward's): forward + backward, dense tiles' time over these (2 threads, medians of 3-21
#: interleaved rounds, the plan cache cleared at each switch): fp32 GQA 9/3 D 64 1.47-1.51x at 512, 1.27-1.28x
#: at 1024, 1.11-1.13x at 2048, 1.01-1.03x at 4096; fp32 MHA 16/16 D 128 1.30x at 1024, 1.12-1.15x at 2048;
#: bf16 GQA 9/3 D 64 1.40-1.44x at 2048; bf16 MHA 16/16 D 128 1.10-1.18x at 2048, 1.03-1.04x at 4096. A
#: larger fixed cost for the backward (4x) chose larger tiles and was no better (0.99-1.32x, the same rows).
COMPILED_TILE_PAIRS = 384
COMPILED_TILE_PAIRS_HALF = 1024


def block_speed(speed: dict, b: tuple[int, int]) -> float:
    """A tile shape's relative speed from ``speed``: its own, or (a clipped shape) the nearest shape's by area."""
    s = speed.get(b)
    return s if s is not None else speed[min(speed, key=lambda x: abs(x[0] * x[1] - b[0] * b[1]))]


def _causal_block(p, speed: dict) -> tuple[int, int]:
    """A causal inference call's (block_q, block_k): of the square shapes in ``speed`` and the dense tiles, the
    least (visited tiles x (pairs a tile + a tile's fixed cost in pairs)) / relative speed (Note [Causal tile
    size]: COMPILED_TILE_PAIRS, or COMPILED_TILE_PAIRS_HALF for bf16 and fp16)."""
    L, S = p.info.L, p.info.S
    shapes = {clip_blocks(*b, L, S) for b in speed if b[0] == b[1]} | {clip_blocks(*COMPILED_DENSE_BLOCK, L, S)}
    fixed = COMPILED_TILE_PAIRS_HALF if p.q.dtype in (torch.bfloat16, torch.float16) else COMPILED_TILE_PAIRS

    def cost(b):
        return causal_blocks(L, S, *b) * (b[0] * b[1] + fixed) / block_speed(speed, b)

    return min(sorted(shapes, key=lambda b: -b[0] * b[1]), key=cost)  # (ties: the larger tiles)


def _no_mask_tiles(p) -> bool:
    """No pattern, user mask or bias: the kernel reads no mask tile (it computes ALiBi itself)."""
    m = p.mask
    return m.pattern is None and m.keep is None and m.bias is None


def compiled_block(p, speed: dict) -> tuple[int, int]:
    """The compiled kernel's (block_q, block_k): large tiles for dense inputs; for bands (masks that
    depend on j - i only) the shape minimising visited area / speed (``speed``: {(block_q, block_k):
    relative speed per pair}); a block table's own block; user masks and other patterns a middle shape.
    Clipped to the sequence (rounded up to 16)."""
    pat, mask = p.mask.pattern, p.mask
    L, S = p.info.L, p.info.S
    if p.is_causal_only and speed:
        return _causal_block(p, speed)
    if _no_mask_tiles(p) or p.is_causal_only:
        return clip_blocks(*COMPILED_DENSE_BLOCK, L, S)
    if pat is None or mask.keep is not None or mask.bias is not None:
        return clip_blocks(*COMPILED_MASK_BLOCK, L, S)
    if pat.translation_invariant():
        def cost(b):
            return nonempty_blocks(p, *b) * b[0] * b[1] / speed[b]
        return min((clip_blocks(*b, L, S) for b in speed if clip_blocks(*b, L, S) == b), key=cost,
                   default=clip_blocks(64, 64, L, S))
    shape = pat.block_shape()
    if isinstance(pat, P.BlockTable) and shape is not None and 32 <= shape[0] <= 512:
        return clip_blocks(*shape, L, S)
    return clip_blocks(128, 128, L, S)


def compiled_blocks(p, block_size: int | None, speed: dict) -> tuple[int, int]:
    """``block_size`` square when given, else ``compiled_block``'s choice; either clipped to the sequence
    (a block of 10**5 on a 16-token input would allocate its scratch for 10**5 rows)."""
    return clip_blocks(block_size, block_size, p.info.L, p.info.S) if block_size else compiled_block(p, speed)


class CompiledKernel(Kernel):
    """The compiled kernel's door: its tiles over the mask's layout (few queries against a KV cache go to the
    decode kernel, ``kernels.decode``). Its rate is ``gflops`` (its best tiles, dense fp32) times the calibrated
    or built-in relative speed of the tile shape (``rates.compiled_block_speed``)."""

    def tiling(self, p, r: Request, block_size: int | None, rates) -> Tiling:
        """Its (block_q, block_k) (``compiled_blocks``) and visited blocks."""
        L, S = p.info.L, p.info.S
        bq, bk = compiled_blocks(p, block_size, rates.compiled_block_speed)
        if _no_mask_tiles(p):  # ALiBi alone costs the kernel no tile and skips nothing
            return Tiling(bq, bk, -(-L // bq) * -(-S // bk))
        return masked_tiling(p, bq, bk)

    def rate(self, r: Request, t: Tiling | None, rates) -> tuple[float, str]:
        """Its best tiles' GFLOP/s (calibrated: ``rates.kernel_gflops``, else ``gflops``) × the tile shape's
        relative speed (the nearest shape by area when not in the table)."""
        speed = rates.compiled_block_speed
        b = (t.block_q, t.block_k) if t is not None else COMPILED_DENSE_BLOCK
        return (rates.kernel_gflops.get(self.spec.name, self.gflops) * block_speed(speed, b) / max(speed.values()),
                rates.source)

    def run(self, p, t: Tiling | None, need_weights: bool = False, need_lse: bool = False):
        """(out, None, lse) from the tiles."""
        bq, bk = (t.block_q, t.block_k) if t is not None else COMPILED_DENSE_BLOCK
        out, lse = compiled_attention(p.q, p.kv_k, p.kv_v, p.mask, p.info.scale, bq, bk, rel_bias=p.mask.rel_bias)
        return out, None, lse

    def rel_bias_grad_bytes(self, r: Request, block_k: int = 16) -> int:
        """Bytes of a relative bias table's gradient in its backward (``rel_bias_grad_bytes``)."""
        return rel_bias_grad_bytes(r, block_k)


#: GFLOP/s of its best tiles on the 2-core reference machine: 0.96 of SDPA's per pair (brgemm, dense fp32)
KERNEL = CompiledKernel(SPEC, gflops=77.0, title="Compiled", memory="O(L·D + block²)",
                        why="attnlab's compiled kernel: exact online softmax without materialising L×S",
                        paper="Dao 2023, FlashAttention-2")
