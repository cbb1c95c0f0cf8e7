"""attnlab.attention: PyTorch SDPA's arguments and semantics, plus patterns, weights and a tiled kernel.

One path: the plan cache (``plancache``: a repeated signature skips the rest), ``shapes.prepare``
validates and flattens the inputs once, ``kernels.planner.plan`` picks the kernel object and its tiling,
``run`` calls ``plan.kernel.run`` (no kernel is named here); the calibration hears of long calls
(``calibration.note_call``).

Legend: B batch (leading dims flattened; the kernels call it N), H heads, Hkv key/value heads,
L query length, S key length, E head dim, Ev value head dim.
"""
from __future__ import annotations

import torch

from .. import patterns as P
from ..kernels import Declined, planner
from ..kernels import lse as lse_merge
from ..kernels.planner import DEFAULT_TILED_BLOCK, METHODS, Plan
from ..shapes import AttentionInputError, Prepared, check_block_size, prepare, shape_str
from . import calibration, plancache
from . import ops as _ops
from .kvcache import attention_with_kvcache
from .storage import empty_kv_cache

__all__ = ["attention", "explain", "attention_with_lse", "attention_with_kvcache", "empty_kv_cache", "merge_partials", "run", "Plan", "METHODS", "Prepared",
           "prepare", "planner", "DEFAULT_TILED_BLOCK"]


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
              enable_gqa: bool = False, *, pattern: P.Pattern | None = None, method: str = "auto",
              need_weights: bool = False, strict: bool = False, block_size: int | None = None,
              softcap: float | None = None, alibi_slopes: torch.Tensor | None = None,
              sinks: torch.Tensor | None = None):
    """Scaled dot-product attention with PyTorch's semantics, structured patterns and a tiled kernel.

    Args:
        query: [..., L, E]; key: [..., S, E]; value: [..., S, Ev]; leading dims must agree (attnlab
            does not broadcast them); the dim before L/S is the head dim H (Hkv for key/value: GQA
            with ``enable_gqa``).
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
        softcap: tanh soft-capping (Gemma 2; flash-attn's ``softcap``): each scaled product x becomes
            softcap·tanh(x / softcap) before ALiBi and ``attn_mask`` are added. A finite float > 0, or None.
        alibi_slopes: ALiBi (Press et al. 2022) from positions, no L×S tensor where the kernel takes
            slopes: [H] or [*batch, H] (query's dims before L), adds −slope·|i + S − L − j| to query i's
            score for key j — flash-attn's formula: queries line up with the last L keys, so with
            ``is_causal`` and L = S it is slope·(j − i) on every kept key. Not differentiated; float32
            or float64 (the compiled kernel reads them as float32, as flash-attn does).
        sinks: learned attention sinks (gpt-oss; flash-attn's ``s_aux``): [H], one logit s_h per query head, in
            each row's softmax denominator only: out_i = Σ_j exp(x_ij) v_j / (exp(s_h) + Σ_j exp(x_ij)), and the
            weights sum to less than 1. Floating, finite; may require grad (differentiated). Taken by dense (in
            its softmax), tiled, compiled and decode (from each row's log-sum-exp; Note [Attention sinks] in
            ``attnlab.kernels.lse``); SDPA and sparse refuse them.

    Returns: output [..., L, Ev], or (output, weights) with need_weights.

    A query row with no key left after masking gets output 0 and weights 0 (never NaN).
    Equivalent to: ``softmax(q @ k.transpose(-2, -1) * scale + mask) @ v`` with masked scores at -inf;
    with the score modifications, ``x = q @ k.transpose(-2, -1) * scale``,
    ``softmax(softcap * tanh(x / softcap) - slopes[..., None, None] * (i + S - L - j).abs() + mask) @ v``
    (Note [Score modifications] in ``attnlab.kernels.masks``); with sinks, the same softmax taken over the scores
    and one more column of score ``sinks[h]``, whose weight is dropped.
    """
    if torch.compiler.is_compiling():  # Note [Doors as torch ops]: one op, which dynamo does not look into
        return _ops.door_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, pattern, method,
                              need_weights, strict, block_size, softcap, alibi_slopes, sinks)
    sig = None if sinks is not None else plancache.signature(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, pattern,
                              softcap, alibi_slopes, method, need_weights, strict, block_size)
    hit = plancache.get(sig)  # Note [Plan cache]: a repeated signature skips the checks and the planning
    if hit is not None:
        if hit[2] is not None:  # the kernel straight on the caller's tensors (``Kernel.direct``)
            return hit[2](query, key, value)
        return run(hit[0].rebind(query, key, value), need_weights=need_weights, plan=hit[1])
    p = prepare(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, pattern, softcap=softcap,
                alibi_slopes=alibi_slopes, sinks=sinks).live()
    plan = planner.plan(p, method, need_weights, strict, block_size, costs=False)
    i = p.info  # Note [Background calibration]: the first long call of a process may start one
    calibration.note_call(calibration.seconds_for(2 * p.N * i.H * i.L * i.S * (i.E + i.Ev)))
    plancache.put(sig, p.template(), plan, plan.kernel.direct(p, plan.tiling, need_weights) if sig else None)
    return run(p, need_weights=need_weights, plan=plan)


def run(p: Prepared, *, method: str = "auto", need_weights: bool = False, strict: bool = False,
        block_size: int | None = None, plan: Plan | None = None):
    """``attention`` on inputs already prepared by ``attnlab.shapes.prepare`` (validated once): plan (unless
    ``plan``, made by ``planner.plan`` for ``p.live()`` and these options, is given), run the plan's kernel
    on q [B, H, L, E], k/v [B, H|Hkv, S, E|Ev] (``plan.kernel.run``), restore the leading dims.
    Returns out [..., L, Ev] (and weights [..., L, S] with need_weights)."""
    p = p.live()  # dead prefix/suffix keys cut off, dead keys inside made harmless (Note [Dead keys])
    if plan is None:
        plan = planner.plan(p, method, need_weights, strict, block_size, costs=False)
    if p.empty:
        out, weights = p.empty_result()
    else:
        out, weights, _ = plan.kernel.run(p, plan.tiling, need_weights)
    if len(p.out_shape) != 4:  # 4-D inputs ran as they are
        out = out.reshape(p.out_shape)  # (..., L, Ev)
    if need_weights:
        weights = weights.reshape(p.out_shape[:-1] + (p.info.S,))  # (..., L, S'): the live keys
        if p.key_range is not None and p.key_range[:2] != (0, p.key_range[2]):
            start, stop, S = p.key_range  # dead keys cut off have weight 0
            weights = torch.nn.functional.pad(weights, (start, S - stop))
        return out, weights
    return out


def explain(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
            pattern=None, method="auto", need_weights=False, strict=False, block_size=None,
            softcap: float | None = None, alibi_slopes: torch.Tensor | None = None,
            sinks: torch.Tensor | None = None, device: str | None = None) -> Plan:
    """Which method ``attention`` would run for these arguments (query [..., L, E], key [..., S, E],
    value [..., S, Ev]), why the others were refused, and the predicted peak memory and FLOPs of each
    (with what a kernel pays extra, e.g. ALiBi written out as a mask, in ``Plan.notes``).
    Runs no attention. ``device`` ("cpu", "cuda") plans as if the tensors were there: meta tensors
    (shapes only, no storage) can then describe a call of any size on that device, and get the plan a
    real call of those shapes, strides and dtypes makes on this machine (SDPA's backend as PyTorch picks
    it there, the compiled kernel when it loads); where the plan would read values (a meta ``attn_mask``)
    ``Plan.assumptions`` says what it assumed."""
    p = prepare(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, pattern, softcap=softcap,
                alibi_slopes=alibi_slopes, sinks=sinks).live()  # what run() plans for
    plan = planner.plan(p, method, need_weights, strict, block_size, costs=True, device=device)
    bg = calibration.state()["background"]
    if bg != "not started" and plan.rates_source:  # Note [Calibration held]: the grid is never unseen
        plan.rates_source += f"; background calibration: {bg}"
    return plan


def attention_with_lse(query, key, value, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, *,
                       pattern=None, block_size=None, softcap: float | None = None,
                       alibi_slopes: torch.Tensor | None = None, sinks: torch.Tensor | None = None):
    """(output [..., L, Ev], lse [..., L]) where lse is the log-sum-exp of each query row's scaled,
    (soft-capped, ALiBi-biased: as in ``attention``) masked scores (float32; float64 for float64 inputs;
    -inf for a row with no key). With ``sinks`` [H] (as in ``attention``) lse includes the row's sink,
    logaddexp(lse, sinks[h]) (a row with no key: sinks[h]).

    The pair is what partial attentions over disjoint key sets need to be merged exactly
    (``merge_partials``): ring attention and split-KV decoding build on it. The kernel is the first of
    ``kernels.LSE_ORDER`` the planner does not refuse (and whose run does not decline the inputs).
    """
    if torch.compiler.is_compiling():  # Note [Doors as torch ops]
        return _ops.lse_door_call(query, key, value, attn_mask, is_causal, scale, enable_gqa, pattern, block_size,
                                  softcap, alibi_slopes, sinks)
    check_block_size(block_size)
    p = prepare(query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa, pattern, softcap=softcap,
                alibi_slopes=alibi_slopes, sinks=sinks).live()  # Note [Dead keys]
    lead = p.out_shape[:-1]
    acc = lse_merge.acc_dtype(p.q.dtype)
    if p.empty:  # 0 joined to the inputs' graph, as attention's (zero gradients, not none); with sinks a row
        # with no key has its sink's logit alone as lse, differentiable in the sinks
        out = p.empty_result()[0].reshape(p.out_shape)
        lse = torch.full(p.q.shape[:-1], float("-inf"), dtype=acc, device=p.q.device)  # (B, H, L)
        if p.mask.sinks is not None:
            lse = lse_merge.sink_scale(lse, p.mask.sinks)[1]
        return out, lse.reshape(lead)
    usable, refused = planner.choose_lse_kernel(p, block_size)
    for kernel, tiling in usable:
        try:
            out, _, lse = kernel.run(p, tiling, need_lse=True)
        except Declined:  # e.g. PyTorch's private op is missing or refused these inputs: the next kernel
            continue
        return out.reshape(p.out_shape), lse.to(acc).reshape(lead)
    reasons = "; ".join(f"{m}: {why}" for m, why in refused.items() if m in planner.LSE_ORDER)
    raise ValueError(f"no attention method can return the log-sum-exp for these inputs ({reasons})")


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor):
    """Merge attention over two disjoint key sets: out [..., L, Ev] and lse [..., L] each.

    Equivalent to attention over the union of the keys (Note [Merging by log-sum-exp],
    ``attnlab.kernels.lse.merge``). A side with lse = -inf contributes nothing.
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
    return lse_merge.merge(out_a, lse_a, out_b, lse_b)
