"""attnlab.attention: PyTorch SDPA's arguments and semantics, plus patterns, weights and a tiled kernel.

One path: ``shapes.prepare`` validates and flattens the inputs once, ``planner.plan`` picks the kernel
from the kernels' declarations, ``run`` calls it.

Legend: B batch (leading dims flattened; the kernels call it N), H heads, Hkv key/value heads,
L query length, S key length, E head dim, Ev value head dim.
"""
from __future__ import annotations

import torch

from .. import patterns as P
from ..kernels import compiled as compiled_kernel
from ..kernels import dense as dense_kernel
from ..kernels import fused as fused_kernel
from ..kernels import lse as lse_merge
from ..kernels import sparse as sparse_kernel
from ..kernels import tiled as tiled_kernel
from ..kernels.masks import MaskSpec
from ..shapes import AttentionInputError, Prepared, check_block_size, prepare, shape_str
from . import kvcache, plancache, planner
from .kvcache import attention_with_kvcache
from .planner import DEFAULT_TILED_BLOCK, METHODS, Plan

__all__ = ["attention", "explain", "attention_with_lse", "attention_with_kvcache", "merge_partials", "run", "Plan", "METHODS", "Prepared",
           "prepare", "planner", "DEFAULT_TILED_BLOCK"]


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
              enable_gqa: bool = False, *, pattern: P.Pattern | None = None, method: str = "auto",
              need_weights: bool = False, strict: bool = False, block_size: int | None = None,
              softcap: float | None = None, alibi_slopes: torch.Tensor | None = None):
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

    Returns: output [..., L, Ev], or (output, weights) with need_weights.

    A query row with no key left after masking gets output 0 and weights 0 (never NaN).
    Equivalent to: ``softmax(q @ k.transpose(-2, -1) * scale + mask) @ v`` with masked scores at -inf;
    with the score modifications, ``x = q @ k.transpose(-2, -1) * scale``,
    ``softmax(softcap * tanh(x / softcap) - slopes[..., None, None] * (i + S - L - j).abs() + mask) @ v``
    (Note [Score modifications] in ``attnlab.kernels.masks``).
    """
    sig = plancache.signature(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, pattern,
                              softcap, alibi_slopes, method, need_weights, strict, block_size)
    hit = plancache.get(sig)  # Note [Plan cache]: a repeated signature skips the checks and the planning
    if hit is not None:
        return run(hit[0].rebind(query, key, value), need_weights=need_weights, plan=hit[1])
    p = prepare(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, pattern, softcap=softcap,
                alibi_slopes=alibi_slopes).live()
    plan = planner.plan(p, method, need_weights, strict, block_size, costs=False)
    plancache.put(sig, p.template(), plan)
    return run(p, need_weights=need_weights, plan=plan)


def run(p: Prepared, *, method: str = "auto", need_weights: bool = False, strict: bool = False,
        block_size: int | None = None, plan: Plan | None = None):
    """``attention`` on inputs already prepared by ``attnlab.shapes.prepare`` (validated once): plan (unless
    ``plan``, made by ``planner.plan`` for ``p.live()`` and these options, is given), run the chosen kernel
    on q [B, H, L, E], k/v [B, H|Hkv, S, E|Ev], restore the leading dims.
    Returns out [..., L, Ev] (and weights [..., L, S] with need_weights)."""
    p = p.live()  # dead prefix/suffix keys cut off, dead keys inside made harmless (Note [Dead keys])
    if plan is None:
        plan = planner.plan(p, method, need_weights, strict, block_size, costs=False)
    info, mask, m = p.info, p.mask, plan.method
    weights = None
    if p.empty:
        out, weights = p.empty_result()
    elif m == "sdpa":  # ALiBi arrives here written out as a float mask (the planner's notes say what it costs)
        # GQA: SDPA reads the kv heads in place (enable_gqa), unless per-head dead keys needed copies
        gqa = info.H != info.Hkv and not p.dead_per_head and fused_kernel.SDPA_GQA
        k, v = (p.kv_k, p.kv_v) if gqa else (p.k, p.v)
        if mask.is_trivial or p.is_causal_only:
            out = fused_kernel.sdpa(p.q, k, v, None, p.dropout_p, p.is_causal_only, info.scale, gqa)
        elif mask.bias_finer_than(p.q.dtype):
            # SDPA takes a float mask in q's dtype only: compute in float32 (Note [Bias precision])
            out = fused_kernel.sdpa(p.q.float(), k.float(), v.float(), _materialize(mask, p, torch.float32),
                                    p.dropout_p, False, info.scale, gqa).to(p.q.dtype)
        else:
            out = fused_kernel.sdpa(p.q, k, v, _materialize(mask, p), p.dropout_p, False, info.scale, gqa)
    elif m == "dense":
        # GQA: the kv heads as given, repeated in the compute dtype (Note [GQA gradients in the accumulation dtype])
        out, weights = dense_kernel.dense_attention(p.q, p.kv_k, p.kv_v, mask, info.scale, p.dropout_p,
                                                    dead=_dead_per_head(p))
    elif m == "compiled" and plan.decode:  # L <= 16, inference: keys split across threads, K/V read once per group
        out = kvcache.run_prepared(p)
    elif m == "compiled":
        out = compiled_kernel.compiled_attention(p.q, p.kv_k, p.kv_v, mask, info.scale, *plan.block_size)[0]
    elif m == "sparse":
        out = sparse_kernel.gathered_attention(p.q, p.k, p.v, mask, info.scale, p.dropout_p, *plan.block_size)
    else:
        out, lse = tiled_kernel.tiled_attention(p.q, p.kv_k, p.kv_v, mask, info.scale, *plan.block_size,
                                                dead=_dead_per_head(p))
        weights = _weights_from_lse(p, lse, *plan.block_size) if need_weights else None
    if len(p.out_shape) != 4:  # 4-D inputs ran as they are
        out = out.reshape(p.out_shape)  # (..., L, Ev)
    if need_weights:
        weights = weights.reshape(p.out_shape[:-1] + (info.S,))  # (..., L, S'): the live keys
        if p.key_range is not None and p.key_range[:2] != (0, p.key_range[2]):
            start, stop, S = p.key_range  # dead keys cut off have weight 0
            weights = torch.nn.functional.pad(weights, (start, S - stop))
        return out, weights
    return out


def _dead_per_head(p: Prepared):
    """The keys [B|1, H, S] dead for only some heads of a GQA group, which kernels repeating ``kv_k``/``kv_v``
    zero per head (the copies ``Prepared.k``/``v`` zero), or None."""
    return p.dead if p.dead_per_head else None


def explain(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
            pattern=None, method="auto", need_weights=False, strict=False, block_size=None,
            softcap: float | None = None, alibi_slopes: torch.Tensor | None = None,
            device: str | None = None) -> Plan:
    """Which method ``attention`` would run for these arguments (query [..., L, E], key [..., S, E],
    value [..., S, Ev]), why the others were refused, and the predicted peak memory and FLOPs of each
    (with what a kernel pays extra, e.g. ALiBi written out as a mask, in ``Plan.notes``).
    Runs no attention. ``device`` ("cpu", "cuda") plans as if the tensors were there: meta tensors
    (shapes only, no storage) can then describe a call of any size on that device, and get the plan a
    real call of those shapes, strides and dtypes makes on this machine (SDPA's backend as PyTorch picks
    it there, the compiled kernel when it loads); where the plan would read values (a meta ``attn_mask``)
    ``Plan.assumptions`` says what it assumed."""
    p = prepare(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, pattern, softcap=softcap,
                alibi_slopes=alibi_slopes).live()  # what run() plans for
    return planner.plan(p, method, need_weights, strict, block_size, costs=True, device=device)


def _materialize(mask: MaskSpec, p: Prepared, dtype: torch.dtype | None = None) -> torch.Tensor:
    """One SDPA mask (bool, or float in ``dtype``, default q's, when there is a bias) for the whole
    [B|1, H|1, L, S]."""
    if getattr(mask.pattern, "by_key", False) and mask.keep is None and mask.bias is None and mask.alibi is None:
        # key padding alone: SDPA broadcasts a [B, 1, 1, S] mask, so no L×S tensor is built
        kk = mask.pattern.key_mask(mask.S)
        return kk.to(p.q.device).view(kk.shape[0], 1, 1, mask.S)
    i = torch.arange(mask.L, device=p.q.device).unsqueeze(-1)
    j = torch.arange(mask.S, device=p.q.device).unsqueeze(0)
    keep, bias = mask.block(i, j, p.N)
    if bias is None:
        return keep
    b = bias.to(dtype or p.q.dtype)
    return b.masked_fill(~keep, float("-inf")) if keep is not None else b


def _weights_from_lse(p: Prepared, lse: torch.Tensor, bq: int, bk: int) -> torch.Tensor:
    """Second streaming pass: weights [B, H, L, S] = exp(scores - lse), block by block, no extra L×S scratch."""
    info = p.info
    w = torch.zeros(p.N, info.H, info.L, info.S, dtype=p.q.dtype, device=p.q.device)
    acc = lse_merge.acc_dtype(p.q.dtype)
    lse_b = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, float("inf")))
    qa, ka = p.q.detach().to(acc), p.k.detach().to(acc)
    for q0, q1, k0, k1, kind in tiled_kernel.iter_blocks(p.mask.layout(bq, bk), info.L, info.S, bq, bk):
        s = tiled_kernel.block_scores(qa[:, :, q0:q1], ka[:, :, k0:k1], p.mask, info.scale, q0, q1, k0, k1, kind, p.N)
        w[:, :, q0:q1, k0:k1] = torch.exp(s - lse_b[:, :, q0:q1].unsqueeze(-1)).to(w.dtype)
    return w


def attention_with_lse(query, key, value, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, *,
                       pattern=None, block_size=None, softcap: float | None = None,
                       alibi_slopes: torch.Tensor | None = None):
    """(output [..., L, Ev], lse [..., L]) where lse is the log-sum-exp of each query row's scaled,
    (soft-capped, ALiBi-biased: as in ``attention``) masked scores (float32; float64 for float64 inputs;
    -inf for a row with no key).

    The pair is what partial attentions over disjoint key sets need to be merged exactly
    (``merge_partials``): ring attention and split-KV decoding build on it. The kernel is the first of
    ``planner.LSE_ORDER`` the planner does not refuse.
    """
    check_block_size(block_size)
    p = prepare(query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa, pattern, softcap=softcap,
                alibi_slopes=alibi_slopes).live()  # Note [Dead keys]
    lead = p.out_shape[:-1]
    acc = lse_merge.acc_dtype(p.q.dtype)
    if p.empty:
        out = torch.zeros(p.out_shape, dtype=p.q.dtype, device=p.q.device)
        return out, torch.full(lead, float("-inf"), dtype=acc, device=p.q.device)
    usable, refused = planner.choose_lse_kernel(p)
    for m in usable:
        if m == "sdpa":
            r = fused_kernel.flash_cpu_with_lse(p.q, p.k, p.v, None, p.is_causal_only, p.info.scale)
            if r is None:  # the private op is missing or refused these inputs: the next kernel
                continue
            return r[0].reshape(p.out_shape), r[1].to(acc).reshape(lead)
        if m == "compiled":
            bq, bk = planner.compiled_blocks(p, block_size)
            out, lse = compiled_kernel.compiled_attention(p.q, p.kv_k, p.kv_v, p.mask, p.info.scale, bq, bk)
        else:
            bq, bk = (block_size, block_size) if block_size else DEFAULT_TILED_BLOCK
            out, lse = tiled_kernel.tiled_attention(p.q, p.kv_k, p.kv_v, p.mask, p.info.scale, bq, bk,
                                                    dead=_dead_per_head(p))
        return out.reshape(p.out_shape), lse.reshape(lead)
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
