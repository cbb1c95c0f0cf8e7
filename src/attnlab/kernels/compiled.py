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
CPU's AMX / AVX512-BF16 units where oneDNN packs for them (``uses_brgemm``), and the bf16 forward's
exp and conversion run in one pass (csrc Note [Half-type exp]); elsewhere MKL's gemm. Consecutive full
key blocks run as one tile up to 512 keys wide (Note [Merged runs]).

``available()`` says whether the extension can run (False with ``ATTNLAB_NO_EXT=1``, when it was not
built, or for non-CPU tensors) and ``unavailable_reason()`` why not. Nothing is compiled at call
time: the extension is built by the package's install (setup.py).
"""
from __future__ import annotations

import dataclasses
import importlib
import os
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .. import patterns as P
from .masks import MaskSpec
from .spec import KernelSpec, Request, Tiling, io_bytes

__all__ = ["available", "unavailable_reason", "capability", "KernelLayout", "build_layout", "compiled_attention",
           "has_fast_gemm", "uses_brgemm", "converts_bf16_natively", "scratch_bytes", "saved_bytes", "bias_grad_bytes", "SPEC"]

#: must equal the extension's abi_version (csrc/attention.cpp): signatures the wrapper calls
ABI_VERSION = 7
_MODULES = {"AVX512": ("_C_avx512", "_C_avx2", "_C"), "AVX2": ("_C_avx2", "_C")}
_ext = None
_reason: str | None = None


def _load():
    """The extension module built for the best capability this CPU runs, or None (reason in _reason)."""
    global _ext, _reason
    if _ext is not None or _reason is not None:
        return _ext
    if os.environ.get("ATTNLAB_NO_EXT", "") not in ("", "0"):
        _reason = "ATTNLAB_NO_EXT is set"
        return None
    try:
        cap = torch.backends.cpu.get_cpu_capability()
    except Exception:  # very old torch: the baseline build runs everywhere
        cap = "DEFAULT"
    errors = []
    for name in _MODULES.get(cap, ("_C",)):
        try:
            mod = importlib.import_module(f"attnlab.{name}")
            if getattr(mod, "abi_version", None) != ABI_VERSION:
                errors.append(f"{name}: built from older sources (abi {getattr(mod, 'abi_version', None)}, "
                              f"need {ABI_VERSION}); rebuild: pip install --no-build-isolation -e .")
                continue
            _ext = mod
            return _ext
        except ImportError as e:
            errors.append(f"{name}: {e}")
        except Exception as e:  # a broken build must not break attnlab
            errors.append(f"{name}: {type(e).__name__}: {e}")
    missing = all("No module named" in e for e in errors)
    _reason = ("the compiled extension is not built (pip install --no-build-isolation -e . builds it)" if missing
               else "the compiled extension failed to load (" + "; ".join(errors) + ")")
    return None


def available(*tensors: torch.Tensor) -> bool:
    """True when the compiled kernel can run, and runs on these tensors (CPU only)."""
    return unavailable_reason(*tensors) is None


def unavailable_reason(*tensors: torch.Tensor) -> str | None:
    """Why the compiled kernel cannot run (these tensors), or None when it can."""
    if _load() is None:
        return _reason
    for t in tensors:
        if t is not None and t.device.type != "cpu":
            return f"CPU tensors only (got {t.device.type})"
    return None


def capability() -> str | None:
    """The CPU capability the loaded extension was compiled for ('AVX512', 'AVX2', 'DEFAULT'), or None."""
    ext = _load()
    return None if ext is None else str(ext.capability)


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


_CACHE: OrderedDict = OrderedDict()
CACHE_SIZE = 64
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
    ar_q, ar_k = torch.arange(bq), torch.arange(bk)
    uniq, chunk = [], max(1, _TILE_CHUNK_BYTES // (B * bq * bk))
    for c0 in range(0, len(part), chunk):
        pc = part[c0:c0 + chunk]
        # rows/columns past L or S repeat the last valid one, so any/all below see only real positions
        i = (pc[:, :1] * bq + ar_q).clamp(max=L - 1).unsqueeze(-1)  # [C, bq, 1]
        j = (pc[:, 1:] * bk + ar_k).clamp(max=S - 1).unsqueeze(1)  # [C, 1, bk]
        m = torch.broadcast_to(pattern.keep(i, j, L, S), ((B,) if pattern.batch_size else ()) + (len(pc), bq, bk))
        m = m.reshape(B, len(pc), bq * bk)
        any_, all_ = m.any(-1), m.all(-1)  # [B, C]
        qb, kb = pc[:, 0], pc[:, 1]
        visit[:, qb, kb] = any_
        sel = any_ & ~all_
        if bool(sel.any()):
            u, inv = torch.unique(m[sel].to(torch.uint8), dim=0, return_inverse=True)
            t = torch.full((B, len(pc)), -1, dtype=torch.int32)
            t[sel] = (inv + sum(x.shape[0] for x in uniq)).to(torch.int32)
            tid[:, qb, kb] = t
            uniq.append(u)
    tiles = torch.cat(uniq) if uniq else torch.zeros(0, bq * bk, dtype=torch.uint8)
    if len(uniq) > 1:  # the same tile found in several chunks: one copy
        tiles, inv = torch.unique(tiles, dim=0, return_inverse=True)
        tid = torch.where(tid >= 0, inv.to(torch.int32)[tid.clamp(min=0).long()], tid)
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
    hit = _CACHE.get(key)
    if hit is None:
        hit = _pattern_layout(mask.pattern, L, S, block_q, block_k)
        _CACHE[key] = hit
        while len(_CACHE) > CACHE_SIZE:
            _CACHE.popitem(last=False)
    else:
        _CACHE.move_to_end(key)
    visit, tid, tiles = hit
    if mask.keep is not None:
        visit = visit & (mask.layout(block_q, block_k, device="cpu") != P.EMPTY)
    return _compress(visit, tid, tiles, block_q, block_k)


def _allow_brgemm() -> bool:
    """Tiles go through oneDNN's brgemm micro-kernel where it applies (AVX-512 builds), else MKL's gemm;
    ``ATTNLAB_EXT_GEMM=mkl`` forces MKL (for comparisons)."""
    return os.environ.get("ATTNLAB_EXT_GEMM", "auto") != "mkl"


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


#: the bf16/fp16 backward takes brgemm when query blocks visit at least this many key blocks on average:
#: it transposes Q and dO once per query block (csrc Note [Half-type backward on brgemm]), which pays over
#: many key blocks only. Measured bf16 fwd+bwd vs MKL's gemm, H=8, D=64, 2 threads, loaded machine:
#: dense n=4096 (32 blocks of 128 keys) backward 1.03-1.17x at every tile from 64x128 to 256x512, causal
#: n=8192 (8 blocks of 512 on average) 1.17-1.26x, but window 256 n=8192 (5 blocks of 64) 0.89x and
#: block-sparse 0.05 (4 blocks of 128) 0.95x; with the transposes vectorised, window 1.00x, block-sparse
#: 0.94x (noisy).
BACKWARD_HALF_BRGEMM_MIN_BLOCKS = 8


def _backward_brgemm(dtype: torch.dtype, lay: KernelLayout) -> bool:
    """Whether the backward takes brgemm: half types when their query blocks visit enough key blocks
    (BACKWARD_HALF_BRGEMM_MIN_BLOCKS), fp32 for tiles up to BACKWARD_BRGEMM_MAX_TILE."""
    if not _allow_brgemm():
        return False
    if dtype in (torch.bfloat16, torch.float16):
        return float(lay.kv_num.float().mean()) >= BACKWARD_HALF_BRGEMM_MIN_BLOCKS if lay.kv_num.numel() else False
    return lay.block_q * lay.block_k <= BACKWARD_BRGEMM_MAX_TILE


def uses_brgemm(dtype: torch.dtype, E: int, Ev: int, block_k: int) -> bool:
    """Whether tiles of this dtype and head dims run on oneDNN's brgemm (bf16/fp16: the CPU's AMX or
    AVX512-BF16 instructions) rather than MKL's gemm."""
    ext = _load()
    return bool(ext is not None and _allow_brgemm() and ext.brgemm_for(str(dtype).replace("torch.", ""), E, Ev, block_k))


# -- autograd --------------------------------------------------------------------------------------
class _CompiledFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, lay: KernelLayout, keep, bias, alibi, scale, softcap, alibi_causal, alibi_offset):
        ext = _load()
        # Note [fp32 O for delta] (csrc): half types keep O in float32 for the backward's rowsum(dO * O)
        keep_acc = q.dtype in (torch.bfloat16, torch.float16) and any(ctx.needs_input_grad[:3])
        # lse_lo: lse's rounding error, lse + lse_lo = m + log(l) for the backward (csrc Note [Split log-sum-exp])
        out, lse, out_acc, lse_lo = ext.forward(q, k, v, *lay.tensors, keep, bias, alibi, scale, softcap,
                                                alibi_causal, alibi_offset, lay.block_q, lay.block_k, _allow_brgemm(),
                                                keep_acc)
        ctx.save_for_backward(q, k, v, out if out_acc is None else out_acc, lse, lse_lo, bias)
        ctx.args = (lay, keep, alibi, scale, softcap, alibi_causal, alibi_offset)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, lse_lo, bias = ctx.saved_tensors
        lay, keep, alibi, scale, softcap, alibi_causal, alibi_offset = ctx.args
        # the float mask's gradient comes back dense [N, H, L, S]; ``bias`` is an expand() of the caller's
        # mask, so autograd's expand backward sums it over the broadcast dims to the mask's own shape
        bias_grad = bias is not None and ctx.needs_input_grad[5]
        # the scores on the forward's engine (csrc Note [Same scores]), the other products on _backward_brgemm's
        dq, dk, dv, dbias = _load().backward(dout, q, k, v, out, lse, lse_lo, *lay.tensors, keep, bias, alibi, scale,
                                             softcap, alibi_causal, alibi_offset, lay.block_q, lay.block_k,
                                             _backward_brgemm(q.dtype, lay), _allow_brgemm(),
                                             bias_grad, backward_splits(q.shape[0], k.shape[1], k.shape[2], lay.block_k))
        return dq, dk, dv, None, None, dbias, None, None, None, None, None


def _last_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def compiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: MaskSpec, scale: float,
                       block_q: int = 64, block_k: int = 64, *, softcap: float = 0.0,
                       alibi_slopes: torch.Tensor | None = None, alibi_causal: bool = False,
                       layout: KernelLayout | None = None):
    """q [N, H, L, E], k [N, Hkv, S, E], v [N, Hkv, S, Ev] -> (out [N, H, L, Ev], lse [N, H, L]).

    lse is float32 (float64 for float64 inputs), -inf for a row with no key (whose output is 0), and
    not differentiable. Differentiable in q, k, v and in a float mask ``mask.bias`` that requires grad
    (its gradient is built dense, [N, H, L, S] in the accumulation dtype, then summed to its shape).
    Soft-capping and ALiBi come from ``mask`` (``mask.softcap``, ``mask.alibi`` [1, H]: Note [Score
    modifications]) or, for direct callers, from the keywords (not both): softcap > 0 replaces each
    scaled score s by softcap·tanh(s / softcap) (Gemma 2, flash-attn); ``alibi_slopes`` [H] adds
    −slope·|j − i'| to the scores, or slope·(j − i') with ``alibi_causal`` (equal on the keys a
    bottom-right causal mask keeps), where i' = i + S − L (flash-attn's alignment).
    Raises RuntimeError when the extension is unavailable (check ``available()`` first).
    """
    why = unavailable_reason(q, k, v)
    if why is not None:
        raise RuntimeError(f"compiled attention kernel unavailable: {why}")
    N, H, L, _ = q.shape
    S, Ev = k.shape[2], v.shape[-1]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    if min(N, H, L, S) == 0 or k.shape[1] == 0:  # nothing to compute; rows with no key are 0 / -inf
        # graph kept through sums of empty slices (0 * q.sum() would be NaN for a q holding Inf)
        out = q.new_zeros(N, H, L, Ev) + (q[..., :0].sum() + k[..., :0].sum() + v[..., :0].sum())
        return out, torch.full((N, H, L), float("-inf"), dtype=acc, device=q.device)
    if layout is None:
        layout = build_layout(mask, block_q, block_k)
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
    return _CompiledFunction.apply(_last_contiguous(q), _last_contiguous(k), _last_contiguous(v), layout, keep, bias,
                                   alibi_slopes, float(scale), float(softcap), bool(alibi_causal), int(S - L))


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


def _peak(r: Request, t: Tiling | None) -> int:
    bq, bk = (t.block_q, t.block_k) if t is not None else (64, 64)
    splits = backward_splits(r.N, r.Hkv, r.S, bk) if r.needs_grad else 1
    dq_parts = splits * r.N * r.H * r.L * r.E * 4 if splits > 1 else 0  # csrc Note [Backward balance]
    return io_bytes(r) + saved_bytes(r) + bias_grad_bytes(r) + dq_parts + scratch_bytes(bq, bk, r.E, r.Ev)


def _flops(r: Request, t: Tiling | None) -> int:
    computed = t.computed(r.L, r.S) if t is not None else r.L * r.S
    return r.N * r.H * computed * 2 * (r.E + r.Ev)


SPEC = KernelSpec("compiled", "attnlab's C++ CPU kernel: online softmax over the layout's tiles, masks read "
                  "inside them", lse="yes", float_mask_grad=True, gqa_no_copy=True, needs_extension=True, blocked=True,
                  devices=("cpu",), softcap=True, alibi="native", alibi_shapes=("[H]",),
                  peak_bytes=_peak, flops=_flops, unavailable=lambda r: unavailable_reason())
