"""FlexAttention's API on the CPU without a compiler: ``flex_attention(query, key, value, score_mod, block_mask)``.

Legend: B batch, H query heads, Hkv key/value heads (GQA: H = G·Hkv, query head h reads kv head h // G),
L query length, S key length, E head dim, Ev value head dim; b, h, q_idx, kv_idx index them.

``score_mod(score, b, h, q_idx, kv_idx)`` is classified from its torch.fx trace (``flex_trace``, Note
[score_mod by its trace]): what it is at every pair is proved from its graph, never sampled, and a fast path
runs only where the proof is complete:

- none / identity: ``attnlab.attention`` with the mask as a pattern (block skipping in the kernel);
- soft-capping ``cap·tanh(A·score)`` (plus a bias): ``attention(..., softcap=cap)``, A·cap folded into scale;
- affine ``A·score + bias(b, h, q_idx, kv_idx)``, A > 0 one known number, folded into ``scale``. A bias
  proved a function of (h, kv_idx - q_idx) only (T5 buckets, a learned relative table, ALiBi) is evaluated
  once per offset, [H, L + S - 1], and the compiled kernel adds it inside its tiles with the mask as a
  pattern, in one call (Note [Relative bias table]); any other bias is evaluated per query block on the key
  blocks the mask keeps only and passed with them as a float ``attn_mask`` (Note [Kept-blocks bias]).
  Either way its gradient flows, through autograd, into the tensors the function reads;
- anything else, or anything the trace cannot prove: ``general``, blockwise over the kept key blocks with an
  online softmax, the function applied to each block's scores, differentiable through autograd
  (checkpointed per query block). Exact; slower.

``flex_plan`` says which path a call takes and why, without running attention.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .. import patterns as P
from ..kernels import COMPILED, KERNELS, planner, transformed
from ..kernels.spec import Request
from ..files import format_bytes
from ..shapes import AttentionInputError, check_scale_range, prepare, shape_str
from .flex_masks import GENERAL_BLOCK, FlexMask, read_block_mask
from .flex_general import general
from .flex_trace import ScoreModKind, classify_score_mod
from . import ops as _ops

try:  # torch >= 2.5; attnlab patterns work without it
    from torch.nn.attention.flex_attention import AuxOutput, AuxRequest
except ImportError:  # pragma: no cover - older torch
    AuxOutput = AuxRequest = None

__all__ = ["flex_attention", "flex_plan", "FlexPlan", "classify_score_mod", "probe_score_mod", "ScoreModKind",
           "GENERAL_BLOCK"]



def probe_score_mod(score_mod, B: int | None = None, H: int | None = None, L: int | None = None,
                    S: int | None = None, seed: int = 0) -> ScoreModKind:
    """``classify_score_mod(score_mod)``, under the name of the sampling probe it replaced: the shape and seed
    arguments are accepted and unused, as the classification holds at every shape."""
    return classify_score_mod(score_mod)

@dataclass
class FlexPlan:
    """Which path ``flex_attention`` takes for a call: ``path`` "attention" (attnlab's kernels, with
    ``attention_kwargs`` saying what was passed) or "general" (the blockwise fallback); ``score_mod``
    what its trace proved; ``mask`` how block_mask was read; ``reason`` why this path; ``notes`` costs."""

    path: str
    reason: str
    score_mod: ScoreModKind
    mask: str
    attention_kwargs: dict = field(default_factory=dict)
    block_size: tuple[int, int] | None = None
    notes: list[str] = field(default_factory=list)
    #: how a bias runs on the "attention" path: "relative" (one table per offset in the compiled kernel),
    #: "kept blocks" (per query block, Note [Kept-blocks bias]) or None (no bias)
    bias: str | None = None

    def __str__(self):
        lines = [f"flex_attention path: {self.path} ({self.reason})",
                 f"  score_mod: {self.score_mod.kind} ({self.score_mod.reason})", f"  block_mask: {self.mask}"]
        if self.attention_kwargs:
            lines.append("  attnlab.attention(" + ", ".join(f"{k}={v}" for k, v in self.attention_kwargs.items()) + ")")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


# -- inputs -----------------------------------------------------------------------------------------
def _check_inputs(query, key, value, scale, enable_gqa):
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"flex_attention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise AttentionInputError(f"flex_attention: {name} {shape_str(t)} must be 4-D [B, H, L|S, E|Ev], as in "
                                      "torch's flex_attention")
        if t.device.type != "cpu":
            raise AttentionInputError(f"flex_attention: {name} is on {t.device}; attnlab.flex_attention runs on CPU "
                                      "tensors (use torch.compile(torch.nn.attention.flex_attention) elsewhere)")
        if not t.is_floating_point():
            raise AttentionInputError(f"flex_attention: {name} must be floating point, got {t.dtype}")
    if not (query.dtype == key.dtype == value.dtype):
        raise AttentionInputError(f"flex_attention: query, key and value must share a dtype, got {query.dtype}, "
                                  f"{key.dtype}, {value.dtype}")
    B, H, L, E = query.shape
    if key.shape[0] != B or value.shape[0] != B:
        raise AttentionInputError(f"flex_attention: query {shape_str(query)}, key {shape_str(key)} and value "
                                  f"{shape_str(value)} must have one batch size")
    if key.shape[1] != value.shape[1] or key.shape[2] != value.shape[2]:
        raise AttentionInputError(f"flex_attention: key {shape_str(key)} and value {shape_str(value)} must agree "
                                  "in heads and length")
    if key.shape[3] != E:
        raise AttentionInputError(f"flex_attention: query {shape_str(query)} and key {shape_str(key)} must have one "
                                  "head dim E")
    Hkv = key.shape[1]
    if not enable_gqa and H != Hkv:
        raise AttentionInputError(f"flex_attention: query has {H} heads and key/value {Hkv}; "
                                  "try setting enable_gqa=True for GQA")
    if enable_gqa and (Hkv == 0 or H % Hkv):
        raise AttentionInputError(f"flex_attention: enable_gqa needs query heads ({H}) a multiple of key/value "
                                  f"heads ({Hkv})")
    if scale is not None and not (isinstance(scale, (int, float)) and not isinstance(scale, bool)
                                  and math.isfinite(scale)):
        raise AttentionInputError(f"flex_attention: scale must be a finite float or None, got {scale!r}")
    if scale is not None:
        check_scale_range(float(scale), query.dtype, "flex_attention: ")  # shapes' Note [Scalars in float32]
    return 1.0 / math.sqrt(E) if scale is None else float(scale)


def _want(return_lse, return_aux, kernel_options):
    """(lse wanted, max_scores wanted, aux form) from torch's two ways of asking."""
    if kernel_options:
        raise ValueError(f"flex_attention: kernel_options {sorted(kernel_options)} are Triton/Inductor settings; "
                         "attnlab has none to honour: pass kernel_options=None")
    if return_aux is not None:
        if return_lse:
            raise ValueError("flex_attention: give return_lse or return_aux, not both (return_lse is deprecated: "
                             "use return_aux=AuxRequest(lse=True))")
        lse, mx = getattr(return_aux, "lse", None), getattr(return_aux, "max_scores", None)
        if not isinstance(lse, bool) or not isinstance(mx, bool):
            raise TypeError(f"flex_attention: return_aux must be an AuxRequest(lse=..., max_scores=...), got {return_aux!r}")
        return lse, mx, True
    return bool(return_lse), False, False


# -- the paths -------------------------------------------------------------------------------------
def _row_keys(mask: "FlexMask", qb: int, S: int):
    """Key positions of the blocks query block ``qb`` keeps (for any b, h) as a slice when they are one
    range, else an int64 index; and the positions (within those keys) of the blocks that are PARTIAL for
    some (b, h), None when every kept block is FULL everywhere."""
    bq, bk = mask.block
    kept = (mask.codes[:, :, qb] != P.EMPTY).any(0).any(0)  # (nk,)
    kbs = kept.nonzero().view(-1)
    if kbs.numel() == 0:
        return None, None
    part = ~(mask.codes[:, :, qb, kbs] == P.FULL).all(0).all(0)  # (kept,) PARTIAL somewhere
    lo, hi = int(kbs[0]), int(kbs[-1])
    if hi - lo + 1 == kbs.numel():
        cols = slice(lo * bk, min(S, (hi + 1) * bk))
        j = torch.arange(cols.start, cols.stop)
    else:
        j = (kbs.view(-1, 1) * bk + torch.arange(bk)).view(-1)
        cols = j = j[j < S]
    if not bool(part.any()):
        return cols, None
    pblocks = kbs[part]
    return cols, torch.isin(torch.div(j, bk, rounding_mode="floor"), pblocks).nonzero().view(-1)


def _bias_blocks(score_mod, B, H, i, j, dtype):
    """score_mod(0, b, h, q_idx, kv_idx) on rows i [r] x keys j [c] only: float [B|1, H|1, r, c] (broadcast
    over what it does not read; differentiable into the tensors it reads)."""
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    # a zero score with dims, as torch's [B, H, L, S] score has: a float32 bias mixed with it then computes in
    # ``dtype`` (a 0-dim zero would leave ``(s + x) * c`` in float32)
    y = score_mod(torch.zeros(1, 1, 1, 1, dtype=dtype), b, h, i.view(1, 1, -1, 1), j.view(1, 1, 1, -1))
    y = y.view(*([1] * (4 - y.dim())), *y.shape) if y.dim() < 4 else y
    return y.to(dtype).expand(*y.shape[:2], i.numel(), j.numel())


# Note [Relative bias table]: a bias proved a function of (h, kv_idx - q_idx) only (Note [score_mod by its
# trace]) is a table of L + S - 1 values per head: evaluated once per offset (not once per kept pair: the
# per-pair gathers were most of the time of a T5 or learned relative bias) and added by the compiled kernel
# inside its tiles (csrc Note [Relative bias]), whose gradient, summed per diagonal, autograd takes on into the
# captured tensors. The table is score_mod(0, 0, h, lo(d), lo(d) + d) for every h and offset d (lo(d) the
# first q_idx that has it), in float64 (under autograd when it is on), rounded by the kernel to its
# accumulation dtype; a bias made of one operation on float32 tensors rounds to the same float32 value as
# when evaluated in float32 (IEEE operations are correctly rounded). Nothing is sampled: the trace proved
# that every pair of an offset has the table's value (an offset's pairs compute it by the same operations
# on the same (h, kv_idx - q_idx), the q and k coefficients of every index combination cancelling exactly).
def _relative_table(score_mod, H, L, S, dtype):
    """score_mod(0, 0, h, q_idx, kv_idx) once per offset kv_idx - q_idx = t - (L - 1): [H, L + S - 1] in
    ``dtype`` (differentiable into the tensors it reads)."""
    d = torch.arange(-(L - 1), S)  # (W,)
    i = (-d).clamp(min=0)
    h = torch.arange(H).view(H, 1)
    y = score_mod(torch.zeros(1, 1, dtype=dtype), torch.zeros(1, 1, dtype=torch.long), h, i.view(1, -1),
                  (i + d).view(1, -1))
    return torch.broadcast_to(y.to(dtype), (H, d.numel()))


def _relative_bias_attention(query, key, value, rel, mask: "FlexMask", kind, scale, enable_gqa):
    """Note [Relative bias table]: one call through the planner's door with the mask as a pattern and the bias
    as a declared score modification, the table per offset ``rel`` [H, L + S - 1] (float64: the kernel rounds
    it to the accumulation dtype, differentiably; the compiled kernel is the one that declares it). Returns
    out [B, H, L, Ev] and lse [B, H, L] (not differentiable), or None when no kernel takes the table here."""
    p = prepare(query, key, value, None, 0.0, False, scale * kind.factor, enable_gqa, mask.pattern,
                softcap=kind.softcap, rel_bias=rel).live()
    try:
        plan = planner.plan(p, "auto", costs=False)
    except ValueError:  # no kernel adds a relative bias table here (e.g. the compiled extension is not built)
        return None
    out, _, lse = plan.kernel.run(p, plan.tiling, need_lse=True)
    return out.reshape(p.out_shape), lse.reshape(p.out_shape[:-1])


def _takes_relative(query, key, value, H, L, S) -> bool:
    """Whether a kernel the planner would run takes a relative bias table for these inputs (its declaration:
    ``KernelSpec.rel_bias``), asked of a request with the table's flag set."""
    r = Request(query.shape[0], H, key.shape[1], L, S, query.shape[-1], value.shape[-1], query.dtype,
                query.device.type, pattern=True, rel_bias=True, transformed=transformed(query, key, value),
                needs_grad=torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)))
    return len(planner.refusals(r)) < len(KERNELS)


def _kept_bias_attention(query, key, value, score_mod, mask: "FlexMask", kind, scale, enable_gqa, want_lse):
    """Note [Kept-blocks bias]: an affine (or soft-capping) score_mod with a bias runs one query block at a
    time on the key blocks the mask keeps: the bias is evaluated on those (rows x kept keys) only, the
    partial blocks' mask folded in as -inf, and attnlab.attention runs the slab with it as a float
    attn_mask (so its gradient reaches the captured tensors by autograd). Memory: the kept blocks' bias,
    never L x S; keys of a row that form one range are a view, else gathered.
    Returns out [B, H, L, Ev] and lse [B, H, L] (None unless want_lse)."""
    from . import attention, attention_with_lse  # the package (the doors) imports this module

    B, H, L, _ = query.shape
    S = key.shape[2]
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    bq, _ = mask.block
    bidx = torch.arange(B).view(B, 1, 1, 1)
    hidx = torch.arange(H).view(1, H, 1, 1)
    outs, lses = [], []
    kw = dict(scale=scale * kind.factor, enable_gqa=enable_gqa, softcap=kind.softcap)
    for qb in range(-(-L // bq)):
        q0, q1 = qb * bq, min(L, (qb + 1) * bq)
        cols, pcols = _row_keys(mask, qb, S)
        if cols is None:  # no key: output 0, lse -inf (as flex_attention)
            outs.append(query.new_zeros(B, H, q1 - q0, value.shape[-1]))
            lses.append(torch.full((B, H, q1 - q0), float("-inf"), dtype=acc))
            continue
        i = torch.arange(q0, q1)
        j = torch.arange(S)[cols]
        bias = _bias_blocks(score_mod, B, H, i, j, acc)  # (B|1, H|1, r, c)
        if pcols is not None and mask.keep is not None:  # the mask, on the partial blocks' keys only
            keep = mask.keep(bidx, hidx, i, j[pcols])
            keep = keep.view(*([1] * (4 - keep.dim())), *keep.shape)  # (B|1, H|1, r, c_partial)
            # the dropped pairs set to -inf (not -inf added: a NaN the bias holds at a dropped pair must vanish
            # there, as in torch, where the mask replaces the score; Note [NaN rows stay NaN])
            kept = torch.ones(*(max(x, y) for x, y in zip(bias.shape[:2], keep.shape[:2])), i.numel(), j.numel(),
                              dtype=torch.bool)
            kept[..., pcols] = keep
            bias = bias.masked_fill(~kept, float("-inf"))
        k, v = key[:, :, cols], value[:, :, cols]
        if want_lse:
            o, lse = attention_with_lse(query[:, :, q0:q1], k, v, attn_mask=bias, **kw)
            lses.append(lse)
        else:
            o = attention(query[:, :, q0:q1], k, v, attn_mask=bias, **kw)
        outs.append(o)
    out = torch.cat(outs, 2) if outs else query.new_zeros(B, H, 0, value.shape[-1])
    lse = (torch.cat(lses, 2) if lses else query.new_zeros(B, H, 0, dtype=acc)) if want_lse else None
    return out, lse


# -- plan -------------------------------------------------------------------------------------------
def _plan(query, key, value, score_mod, block_mask, scale, enable_gqa, want_lse, want_max, block_size):
    B, H, L, _ = query.shape
    S = key.shape[2]
    mask = read_block_mask(block_mask, B, H, L, S, block_size)
    kind = classify_score_mod(score_mod)
    needs_grad = torch.is_grad_enabled() and (kind.reads_grad or any(t.requires_grad for t in (query, key, value)))
    notes = []
    why = None
    if kind.kind == "general":
        why = "score_mod is not proved affine in the score or soft-capping (its trace: " + kind.reason + ")"
    elif want_max:
        why = "max_scores asked for: the attnlab kernels do not return it"
    elif want_lse and needs_grad:
        why = "lse asked for under autograd: the kernels' lse is not differentiable, the general path's is"
    elif mask.refusal is not None and not kind.has_bias:
        why = f"block_mask: {mask.refusal}"
    bq, bk = mask.block
    if why is not None:
        kept = int((mask.codes != P.EMPTY).any(0).any(0).sum())
        notes.append(f"general path: {kept} of {mask.codes.shape[-2] * mask.codes.shape[-1]} blocks of {bq}x{bk} "
                     f"kept; score_mod called once per kept block on [B, H, {bq}, {bk}] scores; "
                     "checkpointed per query block under autograd (scores recomputed in backward)")
        return FlexPlan("general", why, kind, mask.describe, block_size=(bq, bk), notes=notes), mask, None
    kw = {"scale": f"{scale * kind.factor:.6g}", "enable_gqa": enable_gqa}
    if mask.pattern is not None and not kind.has_bias:
        kw["pattern"] = repr(mask.pattern)
    if kind.softcap is not None:
        kw["softcap"] = f"{kind.softcap:.6g}"
    bias = rel = None
    if kind.has_bias:
        if kind.relative and mask.refusal is None and L and S and _takes_relative(query, key, value, H, L, S):
            rel = _relative_table(score_mod, H, L, S, torch.float64)
        if rel is not None:
            bias = "relative"
            kw["pattern"] = repr(mask.pattern)
            kw["rel_bias"] = f"score_mod(0, 0, h, q_idx, kv_idx) once per offset kv_idx - q_idx: [{H}, {L + S - 1}]"
            notes.append("the bias is proved a function of (h, kv_idx - q_idx) only by its trace: one compiled-kernel "
                         "call adds it from a table per offset, the mask as a pattern (Note [Relative bias table]); "
                         "memory and gradient O(H·(L + S))")
            if needs_grad and kind.reads_grad:
                r = Request(B, H, key.shape[1], L, S, query.shape[-1], value.shape[-1], query.dtype, needs_grad=True,
                            rel_bias=True, rel_bias_grad=True)
                notes.append(f"backward: the table's gradient is summed in per-unit rows, at most "
                             f"{format_bytes(COMPILED.rel_bias_grad_bytes(r, 16))} "
                             "(units x groups x (L + S - 1), csrc Note [Relative bias])")
        else:
            bias = "kept blocks"
            kw["attn_mask"] = "score_mod(0, b, h, q_idx, kv_idx) on the kept blocks, per query block"
            kept = int((mask.codes != P.EMPTY).any(0).any(0).sum())
            nq, nk = mask.codes.shape[-2:]
            notes.append(f"the bias is evaluated per query block of {bq} on the key blocks the mask keeps ({kept} of "
                         f"{nq * nk} blocks of {bq}x{bk}), one attention call per query block (Note [Kept-blocks "
                         "bias]); its memory and gradient are the kept blocks', not L×S")
    reason = {"none": "no score_mod", "identity": "score_mod is the identity",
              "affine": "score_mod is affine in the score: its bias goes in as a float attn_mask",
              "softcap": "score_mod is soft-capping: attention's softcap"}[kind.kind]
    return FlexPlan("attention", reason, kind, mask.describe, attention_kwargs=kw, notes=notes, bias=bias), mask, rel


def flex_plan(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod=None, block_mask=None,
              scale: float | None = None, enable_gqa: bool = False, return_lse: bool = False,
              kernel_options: dict | None = None, *, return_aux=None, block_size: int | None = None) -> FlexPlan:
    """Which path ``flex_attention`` takes for these arguments and why (``FlexPlan``; ``print`` it), from
    score_mod's trace and reading block_mask. Runs no attention."""
    scale = _check_inputs(query, key, value, scale, enable_gqa)
    want_lse, want_max, _ = _want(return_lse, return_aux, kernel_options)
    return _plan(query, key, value, score_mod, block_mask, scale, enable_gqa, want_lse, want_max, block_size)[0]


# -- the API ----------------------------------------------------------------------------------------
def flex_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod=None, block_mask=None,
                   scale: float | None = None, enable_gqa: bool = False, return_lse: bool = False,
                   kernel_options: dict | None = None, *, return_aux=None, block_size: int | None = None):
    """``torch.nn.attention.flex_attention`` on CPU tensors, forward and backward, with no compile step.

    Args:
        query: [B, H, L, E]; key: [B, Hkv, S, E]; value: [B, Hkv, S, Ev] (Hkv = H, or H = G·Hkv with enable_gqa).
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, applied to each scaled score
            ``q·k·scale`` before the softmax. It is called on broadcasting index tensors (int64), never
            per element, so it must use tensor operations (indexing a captured table by ``q_idx - kv_idx``
            works). Tensors it reads that require grad get their gradient.
        block_mask: a torch ``BlockMask`` (``create_block_mask``, ``BlockMask.from_kv_blocks``: its full and
            partial blocks and its ``mask_mod`` on the partial ones) or an ``attnlab.patterns`` Pattern
            (e.g. ``from_mask_mod``); None keeps every pair.
        scale: default 1/sqrt(E). enable_gqa: as in torch.
        return_lse / return_aux: as in torch: ``return_aux=AuxRequest(lse=True, max_scores=True)`` returns
            ``(out, AuxOutput(lse, max_scores))``; ``return_lse=True`` (deprecated in torch) ``(out, lse)``.
            lse [B, H, L] is the natural log-sum-exp of the modified, masked scores; max_scores [B, H, L]
            their maximum; both float32 (float64 for float64 inputs), -inf for a row with no key.
        kernel_options: torch's Triton settings; attnlab has none, so anything but None/{} is an error.
        block_size: (attnlab) block edge of the general path when block_mask brings none (default 128).

    Returns: out [B, H, L, Ev] in query's dtype (0 for a row with no key), and lse / AuxOutput as asked.

    Paths (``flex_plan`` says which one a call takes and why): score_mod is classified from its torch.fx
    trace, once per score_mod object (``classify_score_mod``, Note [score_mod by its trace]): what it is at
    every pair is proved from its graph, and a score_mod the trace does not prove runs the exact general
    path. None / identity / soft-capping run ``attnlab.attention`` with the mask as a
    pattern (a BlockMask proved to be a band runs as attnlab's band pattern, Note [Bands proved once per
    BlockMask]); a score_mod affine in the score, ``A·score + bias(b, h, q_idx, kv_idx)``, whose bias is proved
    a function of (h, kv_idx - q_idx) only evaluates it once per offset and runs one compiled-kernel call
    (Note [Relative bias table]: memory O(H·(L + S))); another bias is evaluated on the kept blocks only, one
    query block at a time (memory: the kept blocks', never L×S). Either way its gradient reaches the
    captured tensors by autograd. Any other score_mod, or
    max_scores, or lse under autograd, or a per-head BlockMask, takes the general path: O(L·S·E) time over
    the kept blocks, scores of one query block at a time in memory (recomputed in backward).

    Equivalent to: ``s = q @ k.transpose(-2, -1) * scale; s = score_mod(s, b, h, i, j); s[~mask] = -inf;
    out = softmax(s, -1) @ v``.
    """
    scale = _check_inputs(query, key, value, scale, enable_gqa)
    want_lse, want_max, aux = _want(return_lse, return_aux, kernel_options)
    if block_size is not None and (not isinstance(block_size, int) or block_size < 1):
        raise ValueError(f"flex_attention: block_size must be a positive int or None, got {block_size!r}")
    if torch.compiler.is_compiling():  # Note [Doors as torch ops] (functional/ops.py): no trace or mask reading here
        return _ops.flex_call(query, key, value, score_mod, block_mask, scale, enable_gqa, want_lse, want_max, aux,
                              AuxOutput)
    plan, mask, rel = _plan(query, key, value, score_mod, block_mask, scale, enable_gqa, want_lse, want_max, block_size)
    lse = mx = None
    if plan.path == "general":
        out, lse, mx = general(query, key, value, score_mod, mask, scale, want_max)
    else:
        from . import attention, attention_with_lse  # the package (the doors) imports this module

        kind = plan.score_mod
        kw = dict(scale=scale * kind.factor, enable_gqa=enable_gqa, pattern=mask.pattern, softcap=kind.softcap)
        got = None
        if plan.bias == "relative":
            got = _relative_bias_attention(query, key, value, rel, mask, kind, scale, enable_gqa)
        if got is not None:
            out, lse = got
            lse = lse if want_lse else None
        elif kind.has_bias:
            out, lse = _kept_bias_attention(query, key, value, score_mod, mask, kind, scale, enable_gqa, want_lse)
        elif want_lse:
            out, lse = attention_with_lse(query, key, value, **kw)
        else:
            out = attention(query, key, value, **kw)
    if aux:
        return out, AuxOutput(lse=lse if want_lse else None, max_scores=mx if want_max else None)
    return (out, lse) if want_lse else out
