"""The one planner: which kernel runs an attention call, why the others were refused, and the cost.

It walks every kernel's declaration (``attnlab.kernels.KERNELS``), collects each refusal reason from
``KernelSpec.not_supported_reasons``, then applies auto's choice rules below. Capability checks are
cheap; costs (block layouts, FLOPs, peak bytes) are computed only when auto must compare kernels or
``explain`` asks for them. ``attention``, ``attention_with_lse``, ``explain``, ``nn.MultiHeadAttention``
and the exact mechanisms all plan here.

Legend: B batch (leading dims flattened), H heads, Hkv key/value heads, L query length, S key length,
E head dim, Ev value head dim.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch

from .. import cpu
from .. import patterns as P
from .. import kernels
from ..kernels import KERNELS, Request, Tiling
from ..kernels import compiled as compiled_kernel
from ..kernels import fused as fused_kernel
from ..kernels import tiled as tiled_kernel
from ..report import format_bytes
from ..shapes import Prepared, check_block_size
from . import kvcache, rates

__all__ = ["Plan", "METHODS", "plan", "refusals", "candidates", "choose_lse_kernel", "causal_blocks", "nonempty_blocks"]

#: "auto" and every kernel's name, in explain's order (one definition, from the declarations)
METHODS: tuple[str, ...] = ("auto",) + tuple(s.name for s in KERNELS)
#: auto returns weights from the dense kernel while its [B, H, L, S] scores stay under this budget
DENSE_WEIGHTS_BUDGET = 256 * 2**20
#: auto uses the gathered block-sparse kernel when at least this fraction of blocks is empty
SPARSE_MIN_EMPTY = 0.25
DEFAULT_SPARSE_BLOCK = 128
SPARSE_QUERY_ROWS = 256  # query rows per block for patterns with narrow key blocks (see sparse_block)
#: fused-kernel speed (GFLOP/s) at query blocks of this many rows, measured on the 2-core reference
#: machine (B·H batches of [block, ~block + 256] problems); relative values choose a band's block size
SPARSE_BLOCK_SPEED = {32: 49.0, 64: 60.0, 128: 65.0, 256: 77.0}
DEFAULT_TILED_BLOCK = tiled_kernel.DEFAULT_BLOCK
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
#: than SDPA: measured no faster than SDPA for fp32 and bf16
COMPILED_DENSE_DTYPES: tuple = ()
_BLOCKED = frozenset(s.name for s in KERNELS if s.blocked)
#: the kernels that return a log-sum-exp, in attention_with_lse's order of preference
LSE_ORDER = ("sdpa", "compiled", "tiled")


@dataclass
class Plan:
    """What ``attention`` will do for these inputs: the method, why, what was refused, and the cost.

    ``peak_bytes`` / ``flops`` hold every kernel's predicted cost when built by ``explain``; a plan made
    for running holds only what auto had to compare.
    """

    method: str
    reason: str
    refused: dict[str, str] = field(default_factory=dict)
    peak_bytes: dict[str, int] = field(default_factory=dict)
    flops: dict[str, int] = field(default_factory=dict)
    sdpa_backend: str = "unknown"
    block_size: tuple[int, int] | None = None
    #: what the plan had to assume because the inputs hold no values (meta tensors): see ``meta_assumptions``
    assumptions: list[str] = field(default_factory=list)
    #: where the rates the kernels were compared by come from (Note [Calibrated rates] in ``functional.rates``)
    rates_source: str = ""
    density: float = 1.0  # fraction of (query, key) blocks that are computed
    #: {kernel: what it would pay beyond its usual work (e.g. ALiBi written out as a mask)}, for kernels not refused
    notes: dict[str, str] = field(default_factory=dict)
    #: the compiled kernel runs its decode path (L <= 16, inference: functional/kvcache.py, csrc/decode.cpp)
    decode: bool = False

    def __str__(self) -> str:
        lines = [f"method: {self.method} — {self.reason}"]
        for m in METHODS[1:]:
            cost = ""
            if m in self.peak_bytes:
                cost = f"peak ≈ {format_bytes(self.peak_bytes[m])}, {self.flops[m] / 1e9:.3g} GFLOP"
            state = "chosen" if m == self.method else f"refused: {self.refused[m]}" if m in self.refused else "available"
            lines.append(f"  {m:<8} {state:<50} {cost}")
            if m in self.notes:
                lines.append(f"  {'':<8} note: {self.notes[m]}")
        lines += [f"assumed: {a}" for a in self.assumptions]
        if self.rates_source:
            lines.append(f"rates: {self.rates_source}")
        lines.append(f"cpu: {cpu.summary()}")
        return "\n".join(lines)


@functools.lru_cache(maxsize=512)
def _refusals(r: Request) -> tuple[tuple[str, str], ...]:
    return tuple((s.name, "; ".join(why)) for s in KERNELS if (why := s.not_supported_reasons(r)))


def refusals(r: Request) -> dict[str, str]:
    """{kernel: every reason it cannot run ``r``, joined by "; "} over all declared kernels.

    Cached per request: the declarations are constant, and their dynamic facts (whether the extension
    loads) are settled once per process."""
    return dict(_refusals(r))


def sdpa_backend_of(p: Prepared, device: str | None = None) -> str:
    """The backend PyTorch's SDPA would pick for these inputs (shapes and dtypes; GQA's repeated heads
    would force one, so they are described by expanded views instead); with ``device``, for such
    tensors on that device (``fused.sdpa_backend``: meta inputs describing a CPU call)."""
    info, mask = p.info, p.mask
    N, H, S = p.N, info.H, info.S
    kb, vb = (p.kv_k, p.kv_v) if info.H == info.Hkv else (
        p.kv_k[:, :1].expand(N, H, S, info.E), p.kv_v[:, :1].expand(N, H, S, info.Ev))
    m = None if mask.is_trivial or p.is_causal_only else (mask.keep if mask.keep is not None else mask.bias)
    if m is None and mask.alibi is not None:  # SDPA would get ALiBi as a float mask: described by a 0-stride view
        m = torch.zeros((), dtype=p.q.dtype, device=p.q.device).expand(N, H, info.L, S)
    return fused_kernel.sdpa_backend(p.q, kb, vb, m, p.dropout_p, p.is_causal_only, info.scale, device=device)


class _Costs:
    """Each kernel's tiling and cost for one call, computed on first use (layouts are the costly part)."""

    def __init__(self, p: Prepared, r: Request, block_size: int | None):
        self.p, self.r, self.bs = p, r, block_size
        self._tilings: dict[str, Tiling | None] = {}

    def tiling(self, name: str) -> Tiling | None:
        if name not in self._tilings:
            self._tilings[name] = self._tiling(name)
        return self._tilings[name]

    def _tiling(self, name: str) -> Tiling | None:
        p, r, bs = self.p, self.r, self.bs
        L, S = r.L, r.S
        trivial, causal = p.mask.is_trivial, p.is_causal_only
        if name == "sparse":
            bq, bk = (bs, bs) if bs else sparse_block(p)
            if not (trivial or causal) and -(-L // bq) * -(-S // bk):
                return Tiling(bq, bk, nonempty_blocks(p, bq, bk))
            return Tiling(bq, bk, causal_blocks(L, S, bq, bk) if causal else None)
        if name == "tiled":
            bq, bk = (bs, bs) if bs else DEFAULT_TILED_BLOCK
        elif name == "compiled":
            bq, bk = compiled_blocks(p, bs)
            if _no_mask_tiles(p):  # ALiBi alone costs the compiled kernel no tile and skips nothing
                return Tiling(bq, bk, -(-L // bq) * -(-S // bk))
        else:
            return None
        if causal:
            return Tiling(bq, bk, causal_blocks(L, S, bq, bk))
        return Tiling(bq, bk, None if trivial else nonempty_blocks(p, bq, bk))

    def density(self, name: str) -> float:
        t = self.tiling(name)
        if t is None or t.blocks is None:
            return 1.0
        return t.blocks / max(1, -(-self.r.L // t.block_q) * -(-self.r.S // t.block_k))

    def flops(self, name: str) -> int:
        return kernels.get(name).flops(self.r, self.tiling(name))

    def peak(self, name: str) -> int:
        return kernels.get(name).peak_bytes(self.r, self.tiling(name))


def plan(p: Prepared, method: str = "auto", need_weights: bool = False, strict: bool = False,
         block_size: int | None = None, *, costs: bool = True, device: str | None = None) -> Plan:
    """The plan for prepared inputs: refusals of every kernel, then the requested method (raising when
    it is refused) or auto's choice. ``costs=False`` skips the cost of kernels auto need not compare;
    ``device`` plans as if the inputs were on that device type (meta tensors describing a CPU call)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    check_block_size(block_size)
    backend = sdpa_backend_of(p, device) if (strict or costs) else None
    r = p.request(need_weights, strict, backend)
    if device is not None:
        r = dataclasses.replace(r, device=device)
    refused = refusals(r)
    c = _Costs(p, r, block_size)
    if method != "auto":
        if method in refused:
            raise ValueError(f"method={method!r} cannot run these inputs: {refused[method]}")
        chosen, reason = method, "requested"
    else:
        chosen, reason = _choose(r, refused, c, backend)
    # a transform's wrappers (vmap, grad) cannot reach the decode extension: the tile path takes them
    decodes = kvcache.decode_applies(r) and not kernels.transformed(p.q, p.key, p.value)
    if method == "auto" and "compiled" not in refused and decodes:
        chosen = "compiled"  # decode shapes are memory-bound: the decode path reads K/V once per group
    decode = chosen == "compiled" and decodes
    if decode:
        # (the full reason, with splits and bytes, only when explain asks: it is built on every call otherwise)
        reason = ("requested; " if method != "auto" else "") + (kvcache.decode_reason(p, costs) if costs
                                                                else "decode path")
    if chosen == "sparse" and r.dropout_p > 0:
        reason += ("; dropout is drawn per block run by SDPA: the same distribution as F.dropout, but not "
                   "the same random stream for the same RNG state (matching it would draw all L×S)")
    t = c.tiling(chosen) if chosen in _BLOCKED else None
    out = Plan(chosen, reason, refused, sdpa_backend=backend or "unknown", decode=decode,
               block_size=(t.block_q, t.block_k) if t is not None else None,
               notes={s.name: "; ".join(n) for s in KERNELS if s.name not in refused and (n := s.notes(r))})
    out.assumptions = meta_assumptions(p)
    if costs:
        out.rates_source = rates.current().source
    if costs:
        out.peak_bytes = {s.name: c.peak(s.name) for s in KERNELS}
        out.flops = {s.name: c.flops(s.name) for s in KERNELS}
    if costs or "sparse" in c._tilings:
        out.density = c.density("sparse")
    return out


def meta_assumptions(p: Prepared) -> list[str]:
    """What planning meta inputs (shapes and dtypes, no values) must assume where a real call would read
    values: a meta ``attn_mask`` marks no key dead (Note [Dead keys]) and no block empty; meta per-batch
    ALiBi slopes are taken as differing across the batch. Empty for inputs that hold values."""
    m, out = p.mask, []
    if any(t is not None and t.device.type == "meta" for t in (m.keep, m.bias)):
        out.append("attn_mask holds no values (meta): no key is taken as dead and no block as empty; "
                   "a real mask can only let the kernels skip more")
    if m.alibi is not None and m.alibi.device.type == "meta" and m.alibi.shape[0] > 1:
        out.append("per-batch alibi_slopes hold no values (meta): taken as differing across the batch "
                   "(equal rows would run as [H])")
    return out


#: auto's last resort, in order, when none of ``_choose``'s rules fits; dense (the universal kernel, which
#: materialises L×S) comes last, and a declared kernel missing here goes just before it, so none is skipped
FALLBACK_ORDER = ("sdpa", "compiled", "tiled", "sparse", "dense")
_FALLBACK = (tuple(m for m in FALLBACK_ORDER[:-1] if m in METHODS)
             + tuple(m for m in METHODS[1:] if m not in FALLBACK_ORDER) + ("dense",))


def candidates(refused: dict[str, str]) -> tuple[str, ...]:
    """The kernels auto may choose from: exactly those whose declarations accept the request (every
    declared kernel not in ``refused``), in ``FALLBACK_ORDER``."""
    return tuple(m for m in _FALLBACK if m not in refused)


def _choose(r: Request, refused: dict[str, str], c: _Costs, backend: str | None) -> tuple[str, str]:
    """Auto's rules, in order, over ``candidates(refused)``; costs are asked for only where two kernels
    are compared. A rule names a kernel only when it is a candidate, and when no rule fits the first
    candidate of ``FALLBACK_ORDER`` runs: auto refuses only what every kernel refuses."""
    ok = candidates(refused)
    if not ok:
        reasons = "; ".join(f"{m}: {why}" for m, why in refused.items())
        raise ValueError(f"no attention method can run these inputs ({reasons})")
    plain = (r.trivial or r.causal_only) and not r.score_mods
    mods = " and ".join(n for n, on in (("soft-capping", r.softcap), ("ALiBi", r.alibi)) if on)
    if r.need_weights:
        if "dense" in ok and r.pairs * 4 * 3 <= DENSE_WEIGHTS_BUDGET:
            return "dense", "weights requested and the L×S scores are small"
        if "tiled" in ok:
            return "tiled", ("weights requested: output by online softmax, weights by a second pass over the "
                             "saved log-sum-exp")
        if "dense" in ok:
            return "dense", "weights requested and only the dense kernel returns them for these inputs"
    elif "compiled" in ok and not plain and not (
            r.pattern and "sparse" in ok and c.flops("sparse") * rates.current().sparse_over_compiled
            < c.flops("compiled")):
        t = c.tiling("compiled")
        if not (r.pattern or r.keep_mask or r.float_mask or r.causal_only):
            return "compiled", f"attnlab's compiled kernel: {mods} computed inside its {t.block_q}×{t.block_k} tiles"
        return "compiled", (f"attnlab's compiled kernel visits {c.density('compiled'):.1%} of "
                            f"{t.block_q}×{t.block_k} blocks, masks read inside the tiles"
                            + (f", {mods} computed there from positions" if mods else ""))
    elif "compiled" in ok and r.dtype in rates.current().compiled_dense_dtypes:
        return "compiled", f"attnlab's compiled kernel is faster than SDPA for {r.dtype} here"
    elif r.pattern and "sparse" in ok and (1 - c.density("sparse") >= SPARSE_MIN_EMPTY or "sdpa" not in ok):
        t = c.tiling("sparse")
        return "sparse", (f"the pattern leaves {c.density('sparse'):.1%} of {t.block_q}×{t.block_k} blocks; "
                          "the fused kernel runs on just those")
    first = ok[0]
    return first, _FALLBACK_REASONS.get(first, "the first kernel that accepts these inputs").format(
        backend=backend or "its own choice of", mods=f" ({mods} computed per tile)" if mods else "",
        refused=", ".join(m for m in _FALLBACK if m in refused))


_FALLBACK_REASONS = {
    "sdpa": "delegated to PyTorch's fused attention ({backend} backend)",
    "compiled": "attnlab's compiled kernel: exact online softmax without materialising L×S",
    "tiled": "exact online softmax without materialising L×S{mods}",
    "sparse": "gathered key blocks through the fused kernel",
    "dense": "the dense kernel runs everything; the others are refused ({refused}: see refused)",
}


def choose_lse_kernel(p: Prepared) -> tuple[list[str], dict[str, str]]:
    """For ``attention_with_lse``: the kernels that can return (out, lse) for these inputs, in order of
    preference, and why the others cannot."""
    r = dataclasses.replace(p.request(), needs_lse=True)
    refused = refusals(r)
    return [m for m in LSE_ORDER if m not in refused], refused


# -- block shapes and block counts -----------------------------------------------------------------
def _clip(b, L, S):
    """A block shape clipped to the sequence (rounded up to 16): the compiled kernel's own rule."""
    return compiled_kernel.clip_blocks(b[0], b[1], L, S)


def compiled_blocks(p: Prepared, block_size: int | None = None) -> tuple[int, int]:
    """The compiled kernel's (block_q, block_k) for a call: ``block_size`` square when given, else
    ``compiled_block``'s choice; either clipped to the sequence (a block of 10**5 on a 16-token input
    would allocate its scratch for 10**5 rows)."""
    return _clip((block_size, block_size), p.info.L, p.info.S) if block_size else compiled_block(p)


def compiled_block(p: Prepared) -> tuple[int, int]:
    """The compiled kernel's (block_q, block_k): large tiles for dense inputs; for bands (masks that
    depend on j - i only) the shape minimising visited area / speed; a block table's own block; user
    masks and other patterns a middle shape. Clipped to the sequence (rounded up to 16)."""
    pat, mask = p.mask.pattern, p.mask
    L, S = p.info.L, p.info.S
    if _no_mask_tiles(p) or p.is_causal_only:
        return _clip(COMPILED_DENSE_BLOCK, L, S)
    if pat is None or mask.keep is not None or mask.bias is not None:
        return _clip(COMPILED_MASK_BLOCK, L, S)
    if pat.translation_invariant():
        speed = rates.current().compiled_block_speed

        def cost(b):
            return nonempty_blocks(p, *b) * b[0] * b[1] / speed[b]
        return min((_clip(b, L, S) for b in speed if _clip(b, L, S) == b), key=cost,
                   default=_clip((64, 64), L, S))
    shape = pat.block_shape()
    if isinstance(pat, P.BlockTable) and shape is not None and 32 <= shape[0] <= 512:
        return _clip(shape, L, S)
    return _clip((128, 128), L, S)


def _no_mask_tiles(p: Prepared) -> bool:
    """No pattern, user mask or bias: the compiled kernel reads no mask tile (it computes ALiBi itself)."""
    m = p.mask
    return m.pattern is None and m.keep is None and m.bias is None


def sparse_block(p: Prepared) -> tuple[int, int]:
    """The sparse kernel's (block_q, block_k): for bands (masks that depend on j - i only) the square edge
    minimising computed area / fused speed; for a pattern with a natural block shape (block tables, the
    fixed pattern) that shape when it computes less than the default; else DEFAULT_SPARSE_BLOCK square."""
    pat, mask = p.mask.pattern, p.mask
    default = (DEFAULT_SPARSE_BLOCK, DEFAULT_SPARSE_BLOCK)
    if pat is None or mask.keep is not None or mask.bias is not None or p.is_causal_only:
        return default

    speeds = rates.current().sparse_block_speed

    def cost(bq, bk):
        speed = speeds[min(speeds, key=lambda b: abs(b - bq))]
        return nonempty_blocks(p, bq, bk) * bq * bk / speed

    if pat.translation_invariant():
        return min(((b, b) for b in speeds), key=lambda s: cost(*s))
    shape = pat.block_shape()
    if shape is None:
        return default
    if isinstance(pat, P.BlockTable):
        return shape if 32 <= shape[0] <= 512 else default
    # Query blocks: whole multiples of the pattern's, about 256 rows, since each run is one fused call and
    # small calls are slow (measured on fixed(64, 8), n = 16384, one thread: 0.39x / 0.31x / 0.29x SDPA's
    # time at 64 / 128 / 256 rows). Key blocks at least 8 wide; the shape only when it computes less.
    bq = shape[0] * -(-SPARSE_QUERY_ROWS // shape[0])
    if bq > 512:
        return default
    return min(((bq, max(8, shape[1])), default), key=lambda s: cost(*s))


def nonempty_blocks(p: Prepared, bq: int, bk: int) -> int:
    """Non-empty (bq x bk) blocks of the combined mask. A band alone (causal, sliding windows) is counted
    by the pattern in O(L / bq) (``Pattern.nonempty_blocks``); otherwise from the mask's layout, which
    is cached for the kernel that runs next."""
    pat, mask = p.mask.pattern, p.mask
    L, S = p.info.L, p.info.S
    if pat is not None and mask.keep is None and pat.band(L, S) is not None:
        return pat.nonempty_blocks(L, S, bq, bk)
    return int((mask.layout(bq, bk) != P.EMPTY).sum())


def causal_blocks(L: int, S: int, bq: int, bk: int) -> int:
    """Non-empty (bq x bk) blocks of a top-left causal mask, counted without building the layout."""
    nk = -(-S // bk)
    return sum(min(nk, min(L - 1, qi * bq + bq - 1) // bk + 1) for qi in range(-(-L // bq)))
