"""attnlab.attention: PyTorch SDPA's arguments and semantics, plus patterns, weights and a tiled kernel.

Legend: N batch (leading dims flattened), H heads, Hkv key/value heads, L query length, S key length,
E head dim, Ev value head dim.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from . import cpu as _cpu
from . import patterns as P
from .kernels import compiled as _compiled
from .kernels import dense as _dense
from .kernels import fused as _fused
from .kernels import sparse as _sparse
from .kernels import tiled as _tiled
from .kernels.masks import MaskSpec
from .report import format_bytes as _fmt_bytes
from .shapes import AttentionInputError, AttentionInputs, check_attention_inputs, check_block_size, shape_str

__all__ = ["attention", "explain", "attention_with_lse", "merge_partials", "Plan", "METHODS", "Prepared", "prepare"]

METHODS = ("auto", "dense", "sdpa", "tiled", "sparse", "compiled")
#: auto returns weights from the dense kernel while its [N, H, L, S] scores stay under this budget
DENSE_WEIGHTS_BUDGET = 256 * 2**20
#: auto uses the gathered block-sparse kernel when at least this fraction of blocks is empty
SPARSE_MIN_EMPTY = 0.25
DEFAULT_SPARSE_BLOCK = 128
SPARSE_QUERY_ROWS = 256  # query rows per block for patterns with narrow key blocks (see _sparse_block)
#: fused-kernel speed (GFLOP/s) at query blocks of this many rows, measured on the 2-core reference
#: machine (B·H batches of [block, ~block + 256] problems); relative values choose a band's block size
SPARSE_BLOCK_SPEED = {32: 49.0, 64: 60.0, 128: 65.0, 256: 77.0}
DEFAULT_TILED_BLOCK = (512, 512)
#: the compiled kernel's relative speed (dense fp32, B=1, H=8, D=64, n=4096, both cores, MKL tiles) at each
#: (block_q, block_k): larger tiles run faster per pair, smaller ones skip more of a band's empty area.
#: With brgemm tiles, one thread on the busy machine: 0.77 / 0.93 / 0.90 / 0.88 / 0.96 of SDPA per pair; the
#: causal 256-window at n=4096 ran 81 ms at 64x64 and 104 ms at 128x128 (both threads), so 64x64 stays.
COMPILED_BLOCK_SPEED = {(64, 64): 0.69, (128, 128): 0.78, (128, 256): 0.83, (256, 256): 0.9, (256, 512): 1.0}
COMPILED_DENSE_BLOCK = (256, 512)
#: auto prefers the gathered kernel only when it computes this many times less than the compiled one
#: (its narrow key blocks fit patterns like fixed; per pair it is slower, see issue 14's figures)
SPARSE_OVER_COMPILED = 2.0
COMPILED_MASK_BLOCK = (128, 256)  # user masks: blocks they leave empty are skipped at this grain
#: dtypes for which auto runs plain dense / causal inputs (no other mask) on the compiled kernel rather
#: than SDPA: measured no faster than SDPA for fp32 and bf16 (see _plan)
COMPILED_DENSE_DTYPES: tuple = ()


# -- preparation: validate, flatten to 4-D, describe the mask ---------------------------------------
@dataclass
class Prepared:
    info: AttentionInputs
    q: torch.Tensor  # (N, H, L, E)
    kv_k: torch.Tensor  # (N, Hkv, S, E) as given, dead keys zeroed; GQA heads not repeated
    kv_v: torch.Tensor  # (N, Hkv, S, Ev)
    mask: MaskSpec
    is_causal_only: bool  # the mask is exactly top-left causal (SDPA's is_causal)
    out_shape: tuple[int, ...]
    dropout_p: float
    mask_requires_grad: bool
    _repeated: dict = field(default_factory=dict, repr=False)

    @property
    def N(self) -> int:
        return self.q.shape[0]

    @property
    def k(self) -> torch.Tensor:
        """(N, H, S, E): key heads repeated under GQA, built on first use (the compiled kernel reads kv_k)."""
        return self._heads("k", self.kv_k)

    @property
    def v(self) -> torch.Tensor:
        """(N, H, S, Ev), as ``k``."""
        return self._heads("v", self.kv_v)

    def _heads(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if self.info.H == self.info.Hkv:
            return t
        if name not in self._repeated:
            self._repeated[name] = t.repeat_interleave(self.info.groups, dim=1)
        return self._repeated[name]


def _to4d(t: torch.Tensor) -> torch.Tensor:
    if t.dim() == 2:
        return t.unsqueeze(0).unsqueeze(0)
    if t.dim() == 3:
        return t.unsqueeze(0)
    return t.reshape(math.prod(t.shape[:-3]), *t.shape[-3:])


def _mask4d(m: torch.Tensor, batch_shape: tuple[int, ...], L: int, S: int) -> torch.Tensor:
    full_rank = len(batch_shape) + 2
    m = m.reshape((1,) * (full_rank - m.dim()) + tuple(m.shape))
    if full_rank == 2:
        return m.unsqueeze(0).unsqueeze(0)
    if full_rank == 3:
        return m.unsqueeze(0)
    lead = m.shape[:-3]
    if all(s == 1 for s in lead):
        return m.reshape(1, *m.shape[-3:])
    return m.expand(*batch_shape[:-1], *m.shape[-3:]).reshape(math.prod(batch_shape[:-1]), *m.shape[-3:])


def prepare(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
            enable_gqa=False, pattern=None) -> Prepared:
    """Validate inputs and bring them to the kernels' 4-D form (see the module legend)."""
    info = check_attention_inputs(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if pattern is not None and not isinstance(pattern, P.Pattern):
        raise TypeError(f"pattern must be an attnlab.patterns.Pattern, got {type(pattern).__name__}")
    q, k, v = _to4d(query), _to4d(key), _to4d(value)  # k, v: (N, Hkv, S, E)
    N = q.shape[0]
    if pattern is not None and pattern.batch_size and pattern.batch_size != N:
        raise ValueError(
            f"pattern {pattern!r} is for batch size {pattern.batch_size}, but query {shape_str(query)} "
            f"has batch size {N}"
        )
    keep = bias = None
    if attn_mask is not None:
        m4 = _mask4d(attn_mask, info.batch_shape, info.L, info.S)
        if attn_mask.dtype == torch.bool:
            keep = m4
        else:
            bias = m4
    pat = pattern
    if is_causal:
        pat = P.causal() if pat is None else (pat & P.causal())
    mask = MaskSpec(info.L, info.S, pattern=pat, keep=keep, bias=bias)
    k, v, per_head = _zero_dead_keys(k, v, mask, info.groups if info.Hkv else 1)
    causal_only = is_causal and pattern is None and attn_mask is None
    p = Prepared(info, q, k, v, mask, causal_only, tuple(query.shape[:-1]) + (info.Ev,), float(dropout_p),
                 bool(attn_mask is not None and attn_mask.requires_grad))
    if per_head is not None:
        p._repeated.update(k=per_head[0], v=per_head[1], dead_per_head=True)
    return p


def _zero_dead_keys(k: torch.Tensor, v: torch.Tensor, mask: MaskSpec, groups: int = 1):
    """Zero the key and value rows of keys that no query may attend (padding), so that whatever they
    hold — even NaN or Inf — cannot reach the output through NaN scores or 0·NaN in a matrix product.

    # Note [Dead keys]: only keys masked for *every* query are zeroed — by a bool mask (False) or a float
    # mask (-inf) — ; the gradient reaching them is 0, which is also the true gradient. Costs one pass
    # over the user's mask (already L×S) when given.
    """
    dead = None
    if mask.keep is not None:
        dead = ~mask.keep.any(dim=-2)  # (N|1, H|1, S|1)
    if mask.bias is not None:
        d = torch.isneginf(mask.bias.detach()).all(dim=-2)  # (N|1, H|1, S|1)
        dead = d if dead is None else dead | d
    if mask.pattern is not None and mask.pattern.batch_size:
        kk = _pattern_keys(mask.pattern)
        if kk is not None:
            kk = torch.nn.functional.pad(kk, (0, max(0, mask.S - kk.shape[1])), value=False)[:, : mask.S]
            d = ~kk.to(v.device).view(kk.shape[0], 1, -1)  # (N, 1, S)
            dead = d if dead is None else dead | d
    if dead is None or not bool(dead.any()):
        return k, v, None
    dead = dead.unsqueeze(-1)  # (N|1, H|1, S, 1)
    per_head = None
    if groups > 1 and dead.shape[1] > 1:
        # GQA: k, v have H / groups heads; a key is zeroed there when dead for its whole group, and the
        # per-head copies (made now) also zero keys dead for only some heads of a group
        by_group = dead.view(dead.shape[0], -1, groups, *dead.shape[2:])
        if not bool((by_group.all(2) == by_group.any(2)).all()):
            per_head = (k.repeat_interleave(groups, dim=1).masked_fill(dead, 0),
                        v.repeat_interleave(groups, dim=1).masked_fill(dead, 0))
        dead = by_group.all(2)
    return k.masked_fill(dead, 0), v.masked_fill(dead, 0), per_head


def _pattern_keys(p):
    """Per-batch key keep vector [N, S] of a key-padding pattern (or an AND containing one)."""
    kk = getattr(p, "keep_keys", None)
    if kk is not None:
        return kk
    if getattr(p, "op", None) == "and":
        a, b = _pattern_keys(p.a), _pattern_keys(p.b)
        return a if b is None else b if a is None else a & b
    return None


# -- the plan: which method runs, why, and what it costs -------------------------------------------
@dataclass
class Plan:
    """What ``attention`` will do for these inputs: the method, why, what was refused, and the cost."""

    method: str
    reason: str
    refused: dict[str, str] = field(default_factory=dict)
    peak_bytes: dict[str, int] = field(default_factory=dict)
    flops: dict[str, int] = field(default_factory=dict)
    sdpa_backend: str = "unknown"
    block_size: tuple[int, int] | None = None
    density: float = 1.0  # fraction of (query, key) blocks that are computed

    def __str__(self) -> str:
        lines = [f"method: {self.method} — {self.reason}"]
        for m in METHODS[1:]:
            cost = ""
            if m in self.peak_bytes:
                cost = f"peak ≈ {_fmt_bytes(self.peak_bytes[m])}, {self.flops[m] / 1e9:.3g} GFLOP"
            state = "chosen" if m == self.method else f"refused: {self.refused[m]}" if m in self.refused else "available"
            lines.append(f"  {m:<8} {state:<50} {cost}")
        lines.append(f"cpu: {_cpu.summary()}")
        return "\n".join(lines)


def _plan(p: Prepared, method: str, need_weights: bool, strict: bool, block_size) -> Plan:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    check_block_size(block_size)
    info, mask = p.info, p.mask
    N, H, L, S, E, Ev = p.N, info.H, info.L, info.S, info.E, info.Ev
    el = p.q.element_size()
    io = N * H * L * (E + 2 * Ev) * el + 2 * N * H * S * (E + Ev) * el
    pairs = N * H * L * S
    has_pattern = mask.pattern is not None and not p.is_causal_only
    sq, sk = (block_size, block_size) if block_size else _sparse_block(p)
    tq, tk = (block_size, block_size) if block_size else DEFAULT_TILED_BLOCK
    refused: dict[str, str] = {}
    peak: dict[str, int] = {}
    flops: dict[str, int] = {}
    unit_flops = 2 * (E + Ev)

    # sparse layout at its block size: computed blocks and their area (plain causal is counted, not laid out)
    n_blocks = (-(-L // sq)) * (-(-S // sk))
    if not (mask.is_trivial or p.is_causal_only) and n_blocks:
        blocks = _nonempty_blocks(p, sq, sk)
        density = blocks / n_blocks
    elif p.is_causal_only:
        blocks = _causal_blocks(L, S, sq, sk)
        density = blocks / max(1, (-(-L // sq)) * (-(-S // sk)))
    else:
        blocks, density = None, 1.0
    computed = blocks * sq * sk if blocks is not None else L * S
    gathered = blocks * sk if blocks is not None else (-(-L // sq)) * max(S, 1)
    if p.is_causal_only:
        t_computed = _causal_blocks(L, S, tq, tk) * tq * tk
    else:
        t_computed = _nonempty_blocks(p, tq, tk) * tq * tk if not mask.is_trivial else L * S
    t_computed = min(t_computed, max(L, 1) * max(S, 1) * 4)

    # the backend depends on shapes and dtypes, not on GQA's repeated copies (which it would force)
    kb, vb = (p.kv_k, p.kv_v) if info.H == info.Hkv else (p.kv_k[:, :1].expand(N, H, S, E), p.kv_v[:, :1].expand(N, H, S, Ev))
    backend = _fused.sdpa_backend(p.q, kb, vb, None if p.mask.is_trivial or p.is_causal_only else (
        p.mask.keep if p.mask.keep is not None else p.mask.bias), p.dropout_p, p.is_causal_only, info.scale)
    # dense
    peak["dense"] = io + 3 * pairs * 4
    flops["dense"] = pairs * unit_flops
    # sdpa
    sdpa_mask_bytes = 0 if (mask.is_trivial or p.is_causal_only) else (L * S * (4 if mask.bias is not None else 1))
    peak["sdpa"] = io + N * H * L * 4 + sdpa_mask_bytes + (3 * pairs * 4 if backend == "math" else 0)
    flops["sdpa"] = pairs * unit_flops // (2 if p.is_causal_only and backend != "math" else 1)
    # tiled
    peak["tiled"] = io + N * H * L * (Ev + 3) * 4 + 3 * N * H * tq * tk * 4
    flops["tiled"] = N * H * t_computed * unit_flops
    # sparse
    peak["sparse"] = io + N * H * gathered * (E + Ev) * el + computed * 4 + N * H * L * 4
    flops["sparse"] = N * H * computed * unit_flops

    # compiled: the blocks its layout visits (plain causal counted, not laid out)
    cq, ck = (block_size, block_size) if block_size else _compiled_block(p)
    if mask.is_trivial:
        c_blocks = (-(-L // cq)) * (-(-S // ck))
    elif p.is_causal_only:
        c_blocks = _causal_blocks(L, S, cq, ck)
    else:
        c_blocks = _nonempty_blocks(p, cq, ck)
    peak["compiled"] = io + N * H * L * 4 + _compiled_scratch(cq, ck, E, Ev)
    flops["compiled"] = N * H * min(c_blocks * cq * ck, max(L, 1) * max(S, 1) * 4) * unit_flops
    why = _compiled.unavailable_reason(p.q)
    if why is not None:
        refused["compiled"] = why
    elif p.dropout_p > 0:
        refused["compiled"] = "no dropout (its backward recomputes the weights; use sdpa, sparse or dense)"
    elif p.mask_requires_grad:
        refused["compiled"] = "does not differentiate a float attn_mask that requires grad"
    elif p._repeated.get("dead_per_head"):
        refused["compiled"] = ("a per-head mask under GQA leaves some keys dead in only part of a key/value "
                               "head's group (their NaN-safe zeroing needs per-head copies)")

    if need_weights:
        for m in ("sdpa", "sparse", "compiled"):
            refused[m] = "cannot return attention weights (need_weights=True)"
        for m in ("dense", "tiled"):
            peak[m] += pairs * el
    if p.dropout_p > 0:
        refused["tiled"] = "no dropout (its backward recomputes the weights; use sdpa, sparse or dense)"
    if p.mask_requires_grad:
        refused.setdefault("tiled", "does not differentiate a float attn_mask that requires grad")
        refused.setdefault("sparse", "does not differentiate a float attn_mask that requires grad")
    if strict:
        refused.setdefault("dense", "strict=True: it materialises the L×S scores")
        if need_weights:
            for m in ("dense", "tiled"):
                refused[m] = ("strict=True: need_weights returns an L×S tensor; use attnlab.probe(...) "
                              "for streaming summaries")
        if backend == "math":
            refused.setdefault("sdpa", "strict=True: PyTorch would run its math backend, which materialises L×S")
        elif has_pattern:
            refused.setdefault("sdpa", "strict=True: the pattern would be materialised as an L×S mask")
    if mask.is_trivial:
        refused.setdefault("sparse", "no pattern or mask to skip work with (nothing is sparse)")

    if method != "auto":
        if method in refused:
            raise ValueError(f"method={method!r} cannot run these inputs: {refused[method]}")
        chosen, reason = method, "requested"
    else:
        if need_weights:
            if "dense" not in refused and pairs * 4 * 3 <= DENSE_WEIGHTS_BUDGET:
                chosen, reason = "dense", "weights requested and the L×S scores are small"
            elif "tiled" not in refused:
                chosen, reason = "tiled", "weights requested: output by online softmax, weights by a second pass over the saved log-sum-exp"
            else:
                chosen, reason = "dense", "weights requested with dropout: only the dense kernel does both"
        elif "compiled" not in refused and not (mask.is_trivial or p.is_causal_only) and not (
                has_pattern and "sparse" not in refused and flops["sparse"] * SPARSE_OVER_COMPILED < flops["compiled"]):
            c_density = c_blocks / max(1, (-(-L // cq)) * (-(-S // ck)))
            chosen, reason = "compiled", (f"attnlab's compiled kernel visits {c_density:.1%} of {cq}×{ck} blocks, "
                                          "masks read inside the tiles")
        elif "compiled" not in refused and p.q.dtype in COMPILED_DENSE_DTYPES:
            chosen, reason = "compiled", f"attnlab's compiled kernel is faster than SDPA for {p.q.dtype} here"
        elif has_pattern and "sparse" not in refused and (1 - density >= SPARSE_MIN_EMPTY or "sdpa" in refused):
            chosen, reason = "sparse", f"the pattern leaves {density:.1%} of {sq}×{sk} blocks; the fused kernel runs on just those"
        elif "sdpa" not in refused:
            chosen, reason = "sdpa", f"delegated to PyTorch's fused attention ({backend} backend)"
        elif "compiled" not in refused:
            chosen, reason = "compiled", "attnlab's compiled kernel: exact online softmax without materialising L×S"
        elif "tiled" not in refused:
            chosen, reason = "tiled", "exact online softmax without materialising L×S"
        elif "sparse" not in refused:
            chosen, reason = "sparse", "gathered key blocks through the fused kernel"
        else:
            reasons = "; ".join(f"{m}: {r}" for m, r in refused.items())
            raise ValueError(f"no attention method can run these inputs ({reasons})")
    if chosen == "sparse" and p.dropout_p > 0:
        reason += ("; dropout is drawn per block run by SDPA: the same distribution as F.dropout, but not "
                   "the same random stream for the same RNG state (matching it would draw all L×S)")
    blocks_of = {"sparse": (sq, sk), "tiled": (tq, tk), "compiled": (cq, ck)}
    return Plan(chosen, reason, refused, peak, flops, backend, blocks_of.get(chosen), density)


def _compiled_block(p: Prepared) -> tuple[int, int]:
    """The compiled kernel's (block_q, block_k): large tiles for dense inputs; for bands (masks that
    depend on j - i only) the shape minimising visited area / speed; a block table's own block; user
    masks and other patterns a middle shape. Clipped to the sequence (rounded up to 16)."""
    pat, mask = p.mask.pattern, p.mask
    L, S = p.info.L, p.info.S

    def clip(b):
        return (min(b[0], max(16, -(-L // 16) * 16)), min(b[1], max(16, -(-S // 16) * 16)))

    if mask.is_trivial or p.is_causal_only:
        return clip(COMPILED_DENSE_BLOCK)
    if pat is None or mask.keep is not None or mask.bias is not None:
        return clip(COMPILED_MASK_BLOCK)
    if _sparse._translation_invariant(pat):
        def cost(b):
            return _nonempty_blocks(p, *b) * b[0] * b[1] / COMPILED_BLOCK_SPEED[b]
        return min((clip(b) for b in COMPILED_BLOCK_SPEED if clip(b) == b), key=cost, default=clip((64, 64)))
    shape = pat._block_shape()
    if isinstance(pat, P._BlockTable) and shape is not None and 32 <= shape[0] <= 512:
        return clip(shape)
    return clip((128, 128))


def _nonempty_blocks(p: Prepared, bq: int, bk: int) -> int:
    """Non-empty (bq x bk) blocks of the combined mask. A band alone (causal, sliding windows) is counted in O(L / bq)
    from each query block's key range: building [nq, nk] layouts for every candidate block shape cost
    0.3-0.7 s per call at n = 16384 on the busy reference machine, as much as the kernel itself."""
    pat, mask = p.mask.pattern, p.mask
    if isinstance(pat, P._Band) and mask.keep is None:
        L, S = p.info.L, p.info.S
        off = pat._offset(L, S)
        q0 = torch.arange(0, L, bq, dtype=torch.float64)
        q1 = torch.clamp(q0 + bq - 1, max=L - 1)
        first = torch.clamp(q0 + off + pat.lo, min=0)
        last = torch.clamp(q1 + off + pat.hi, max=S - 1)
        n = torch.floor(last / bk) - torch.floor(first / bk) + 1
        return int(torch.where(last >= first, n, torch.zeros_like(n)).sum())
    return int((mask.layout(bq, bk) != P.EMPTY).sum())


def _compiled_scratch(bq: int, bk: int, E: int, Ev: int) -> int:
    """Bytes of the compiled kernel's per-thread tiles (scores, probabilities, accumulators)."""
    return torch.get_num_threads() * 4 * (4 * bq * bk + bq * (E + Ev + 4))


def _sparse_block(p: Prepared) -> tuple[int, int]:
    """The sparse kernel's (block_q, block_k): for bands (masks that depend on j - i only) the square edge
    minimising computed area / fused speed; for a pattern with a natural block shape (block tables, the
    fixed pattern) that shape when it computes less than the default; else DEFAULT_SPARSE_BLOCK square."""
    pat, mask = p.mask.pattern, p.mask
    default = (DEFAULT_SPARSE_BLOCK, DEFAULT_SPARSE_BLOCK)
    if pat is None or mask.keep is not None or mask.bias is not None or p.is_causal_only:
        return default

    def cost(bq, bk):
        speed = SPARSE_BLOCK_SPEED[min(SPARSE_BLOCK_SPEED, key=lambda b: abs(b - bq))]
        return _nonempty_blocks(p, bq, bk) * bq * bk / speed

    if _sparse._translation_invariant(pat):
        return min(((b, b) for b in SPARSE_BLOCK_SPEED), key=lambda s: cost(*s))
    shape = pat._block_shape()
    if shape is None:
        return default
    if isinstance(pat, P._BlockTable):
        return shape if 32 <= shape[0] <= 512 else default
    # Query blocks: whole multiples of the pattern's, about 256 rows, since each run is one fused call and
    # small calls are slow (measured on fixed(64, 8), n = 16384, one thread: 0.39x / 0.31x / 0.29x SDPA's
    # time at 64 / 128 / 256 rows). Key blocks at least 8 wide; the shape only when it computes less.
    bq = shape[0] * -(-SPARSE_QUERY_ROWS // shape[0])
    if bq > 512:
        return default
    return min(((bq, max(8, shape[1])), default), key=lambda s: cost(*s))


def _causal_blocks(L: int, S: int, bq: int, bk: int) -> int:
    """Non-empty (bq x bk) blocks of a top-left causal mask, counted without building the layout."""
    nk = -(-S // bk)
    return sum(min(nk, min(L - 1, qi * bq + bq - 1) // bk + 1) for qi in range(-(-L // bq)))


# -- public API ------------------------------------------------------------------------------------
def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
              enable_gqa: bool = False, *, pattern: P.Pattern | None = None, method: str = "auto",
              need_weights: bool = False, strict: bool = False, block_size: int | None = None):
    """Scaled dot-product attention with PyTorch's semantics, structured patterns and a tiled kernel.

    Args:
        query: [..., L, E]; key: [..., S, E]; value: [..., S, Ev]; leading dims must agree (attnlab
            does not broadcast them); the dim before L/S is the head dim (GQA with ``enable_gqa``).
        attn_mask: bool (True = takes part) or float (added to the scores), broadcast to [..., L, S].
        dropout_p: dropout on the attention weights (as in PyTorch, applied whenever > 0).
        is_causal: key j visible to query i when j <= i (top-left). Combined with ``attn_mask`` and
            ``pattern`` by logical AND (PyTorch's math kernel raises for that; its CPU flash kernel ANDs).
        scale: score scale, default 1/sqrt(E).
        pattern: an ``attnlab.patterns`` mask; same result as ``attn_mask=pattern.materialize(L, S)``,
            but empty blocks are skipped.
        method: "auto" | "dense" | "sdpa" | "tiled" | "sparse" | "compiled" (attnlab's C++ CPU kernel, when
            built); ``explain()`` says what auto picks and why.
        need_weights: also return the weights [..., L, S] (dense, or tiled by a second streaming pass).
        strict: refuse any path that would materialise an L×S tensor.
        block_size: block edge for the tiled and sparse kernels (default: 512 for tiled; for sparse a
            block table's own block, the fastest predicted edge for bands, else 128).

    Returns: output [..., L, Ev], or (output, weights) with need_weights.

    A query row with no key left after masking gets output 0 and weights 0 (never NaN).
    Equivalent to: ``softmax(q @ k.transpose(-2, -1) * scale + mask) @ v`` with masked scores at -inf.
    """
    p = prepare(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, pattern)
    if (method == "auto" and not need_weights and not strict and (p.mask.is_trivial or p.is_causal_only)
            and p.q.dtype not in COMPILED_DENSE_DTYPES and p.info.L and p.info.S):
        # what _plan's rule picks for plain dense or causal inputs, without costing the other methods
        out = _fused.sdpa(p.q, p.k, p.v, None, p.dropout_p, p.is_causal_only, p.info.scale)
        return out.reshape(p.out_shape)
    plan = _plan(p, method, need_weights, strict, block_size)
    out, weights = _run(p, plan, need_weights)
    out = out.reshape(p.out_shape)
    if need_weights:
        return out, weights.reshape(p.out_shape[:-1] + (p.info.S,))
    return out


def explain(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
            pattern=None, method="auto", need_weights=False, strict=False, block_size=None) -> Plan:
    """Which method ``attention`` would run for these arguments, why the others were refused, and the
    predicted peak memory and FLOPs of each. Runs no attention."""
    p = prepare(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, pattern)
    return _plan(p, method, need_weights, strict, block_size)


def _run(p: Prepared, plan: Plan, need_weights: bool):
    info, mask = p.info, p.mask
    if info.L == 0 or info.S == 0 or p.q.shape[0] * p.q.shape[1] == 0:  # nothing to attend (or no rows)
        out = torch.zeros(*p.q.shape[:-1], info.Ev, dtype=p.q.dtype, device=p.q.device)
        # keep autograd connected for empty inputs; sums of empty slices are exactly 0 whatever the inputs
        # hold (0 * q.sum() was NaN for a query holding Inf with S = 0)
        out = out + (p.q[..., :0].sum() + p.kv_k[..., :0].sum() + p.kv_v[..., :0].sum()).to(out.dtype)
        return out, torch.zeros(*p.q.shape[:-1], info.S, dtype=p.q.dtype, device=p.q.device)
    m = plan.method
    if m == "dense":
        return _dense.dense_attention(p.q, p.k, p.v, mask, info.scale, p.dropout_p)
    if m == "sdpa":
        if mask.is_trivial or p.is_causal_only:
            out = _fused.sdpa(p.q, p.k, p.v, None, p.dropout_p, p.is_causal_only, info.scale)
        elif mask.bias_finer_than(p.q.dtype):
            # SDPA takes a float mask in q's dtype only: compute in float32 (Note [Bias precision])
            out = _fused.sdpa(p.q.float(), p.k.float(), p.v.float(), _materialize(mask, p, torch.float32),
                              p.dropout_p, False, info.scale).to(p.q.dtype)
        else:
            out = _fused.sdpa(p.q, p.k, p.v, _materialize(mask, p), p.dropout_p, False, info.scale)
        return out, None
    if m == "compiled":
        bq, bk = plan.block_size
        return _compiled.compiled_attention(p.q, p.kv_k, p.kv_v, mask, info.scale, bq, bk)[0], None
    if m == "sparse":
        bq, bk = plan.block_size
        return _sparse.gathered_attention(p.q, p.k, p.v, mask, info.scale, p.dropout_p, bq, bk), None
    bq, bk = plan.block_size
    out, lse = _tiled.tiled_attention(p.q, p.k, p.v, mask, info.scale, bq, bk)
    weights = _weights_from_lse(p, lse, bq, bk) if need_weights else None
    return out, weights


def _materialize(mask: MaskSpec, p: Prepared, dtype: torch.dtype | None = None) -> torch.Tensor:
    """One SDPA mask (bool, or float in ``dtype``, default q's, when there is a bias) for the whole
    [N|1, H|1, L, S]."""
    kk = getattr(mask.pattern, "keep_keys", None)
    if kk is not None and mask.keep is None and mask.bias is None and kk.shape[1] >= mask.S:
        # key padding alone: SDPA broadcasts a [N, 1, 1, S] mask, so no L×S tensor is built
        return kk[:, : mask.S].to(p.q.device).view(kk.shape[0], 1, 1, mask.S)
    i = torch.arange(mask.L, device=p.q.device).unsqueeze(-1)
    j = torch.arange(mask.S, device=p.q.device).unsqueeze(0)
    keep, bias = mask.block(i, j, p.N)
    if bias is None:
        return keep
    b = bias.to(dtype or p.q.dtype)
    return b.masked_fill(~keep, float("-inf")) if keep is not None else b


def _weights_from_lse(p: Prepared, lse: torch.Tensor, bq: int, bk: int) -> torch.Tensor:
    """Second streaming pass: weights = exp(scores - lse), block by block, no extra L×S scratch."""
    info = p.info
    w = torch.zeros(p.N, info.H, info.L, info.S, dtype=p.q.dtype, device=p.q.device)
    acc = _tiled._acc_dtype(p.q.dtype)
    lse_b = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, float("inf")))
    qa, ka = p.q.detach().to(acc), p.k.detach().to(acc)
    for q0, q1, k0, k1, kind in _tiled.iter_blocks(p.mask.layout(bq, bk), info.L, info.S, bq, bk):
        s = _tiled.block_scores(qa[:, :, q0:q1], ka[:, :, k0:k1], p.mask, info.scale, q0, q1, k0, k1, kind, p.N)
        w[:, :, q0:q1, k0:k1] = torch.exp(s - lse_b[:, :, q0:q1].unsqueeze(-1)).to(w.dtype)
    return w


def attention_with_lse(query, key, value, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, *,
                       pattern=None, block_size=None):
    """(output [..., L, Ev], lse [..., L]) where lse is the log-sum-exp of each query row's scaled,
    masked scores (float32; float64 for float64 inputs; -inf for a row with no key).

    The pair is what partial attentions over disjoint key sets need to be merged exactly
    (``merge_partials``): ring attention and split-KV decoding build on it.
    """
    check_block_size(block_size)
    p = prepare(query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa, pattern)
    lead = p.out_shape[:-1]
    if p.info.S == 0 or p.info.L == 0 or p.q.shape[0] * p.q.shape[1] == 0:
        out = torch.zeros(p.out_shape, dtype=p.q.dtype, device=p.q.device)
        return out, torch.full(lead, float("-inf"), dtype=_tiled._acc_dtype(p.q.dtype), device=p.q.device)
    needs_grad = torch.is_grad_enabled() and (p.q.requires_grad or p.kv_k.requires_grad or p.kv_v.requires_grad)
    if (p.mask.is_trivial or p.is_causal_only) and not needs_grad:
        r = _fused.flash_cpu_with_lse(p.q, p.k, p.v, None, p.is_causal_only, p.info.scale)
        if r is not None:
            return r[0].reshape(p.out_shape), r[1].to(_tiled._acc_dtype(p.q.dtype)).reshape(lead)
    if _compiled.available(p.q) and not p.mask_requires_grad and not p._repeated.get("dead_per_head"):
        bq, bk = (block_size, block_size) if block_size else _compiled_block(p)
        out, lse = _compiled.compiled_attention(p.q, p.kv_k, p.kv_v, p.mask, p.info.scale, bq, bk)
        return out.reshape(p.out_shape), lse.reshape(lead)
    tq, tk = (block_size, block_size) if block_size else DEFAULT_TILED_BLOCK
    out, lse = _tiled.tiled_attention(p.q, p.k, p.v, p.mask, p.info.scale, tq, tk)
    return out.reshape(p.out_shape), lse.reshape(lead)


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor):
    """Merge attention over two disjoint key sets: out [..., L, Ev] and lse [..., L] each.

    Equivalent to attention over the union of the keys. A side with lse = -inf contributes nothing.
    """
    for name, t in (("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if out_a.dim() < 1 or out_a.shape != out_b.shape:
        raise AttentionInputError(f"out_a {shape_str(out_a)} and out_b {shape_str(out_b)} must have one shape "
                                  "[..., L, Ev] (partial attentions of the same queries)")
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if t.shape != out_a.shape[:-1]:
            raise AttentionInputError(f"{name} {shape_str(t)} must be out's shape without its last dim: "
                                      f"{list(out_a.shape[:-1])} (out_a {shape_str(out_a)})")
    m = torch.maximum(lse_a, lse_b)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    wa, wb = torch.exp(lse_a - m_safe), torch.exp(lse_b - m_safe)
    tot = wa + wb
    denom = torch.where(tot > 0, tot, torch.ones_like(tot))
    out = (out_a * (wa / denom).unsqueeze(-1).to(out_a.dtype) + out_b * (wb / denom).unsqueeze(-1).to(out_b.dtype))
    lse = torch.where(tot > 0, m_safe + torch.log(denom), torch.full_like(m, float("-inf")))
    return out, lse
