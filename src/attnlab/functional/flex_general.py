"""``flex_attention``'s general path: any score_mod, exact, blockwise over the key blocks the mask keeps with an
online softmax, the function applied to each block's scores, differentiable through autograd (checkpointed per
query block: Note [Recomputed query blocks]).

Legend: B batch, H query heads, L query length, S key length, E head dim, Ev value head dim.
"""
from __future__ import annotations


import torch

from .. import patterns as P
from .flex_masks import FlexMask

__all__ = ["general"]


def _leaves(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors requiring grad that ``t`` was computed from (its autograd graph's leaves)."""
    seen, out, todo = set(), [], [t.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if hasattr(fn, "variable"):  # AccumulateGrad
            out.append(fn.variable)
        todo.extend(f for f, _ in fn.next_functions)
    return out


def _row_block(q, k, v, score_mod, mask: FlexMask, scale, q0, blocks, B, H, want_max):
    """Online softmax over the kept key blocks of one query block: q [B, H, r, E] (accumulation dtype),
    k [B, H, S, E], v [B, H, S, Ev] -> out [B, H, r, Ev], lse [B, H, r], max [B, H, r]."""
    r = q.shape[2]
    acc = q.dtype
    bidx = torch.arange(B).view(B, 1, 1, 1)
    hidx = torch.arange(H).view(1, H, 1, 1)
    i = torch.arange(q0, q0 + r)
    m = q.new_full((B, H, r), float("-inf"))
    l = q.new_zeros(B, H, r)
    o = q.new_zeros(B, H, r, v.shape[-1])
    mx = m.clone()
    for k0, k1, partial in blocks:
        j = torch.arange(k0, k1)
        s = torch.matmul(q, k[:, :, k0:k1].transpose(-1, -2)) * scale  # (B, H, r, c)
        if score_mod is not None:
            s = torch.broadcast_to(score_mod(s, bidx, hidx, i.view(1, 1, -1, 1), j.view(1, 1, 1, -1)), s.shape).to(acc)
        if partial and mask.keep is not None:
            s = s.masked_fill(~mask.keep(bidx, hidx, i, j), float("-inf"))
        if want_max:
            mx = torch.maximum(mx, s.amax(-1))
        # Note [Online softmax rescaling]: the running max is detached (the result does not depend on it);
        # a row with nothing kept yet keeps max -inf, shifted by 0 instead
        m_new = torch.maximum(m, s.detach().amax(-1))
        shift = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        p = torch.exp(s - shift.unsqueeze(-1))  # (B, H, r, c)
        alpha = torch.exp(m - shift)  # (B, H, r): 0 where m was -inf
        l = l * alpha + p.sum(-1)
        o = o * alpha.unsqueeze(-1) + torch.matmul(p, v[:, :, k0:k1])
        m = m_new
    # Note [NaN rows stay NaN]: only a row with no kept key (l == 0) gives 0 and lse -inf; a NaN from score_mod
    # (or from the inputs) at any kept pair makes l NaN, and its row NaN, as torch's softmax does: a NaN is
    # the user's signal of a bug, never hidden as a zero row (issue 40, D6)
    dead = l == 0
    l_safe = torch.where(dead, torch.ones_like(l), l)
    out = torch.where(dead.unsqueeze(-1), torch.zeros_like(o), o / l_safe.unsqueeze(-1))
    shift = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    lse = torch.where(dead, torch.full_like(l, float("-inf")), shift + torch.log(l_safe))
    return out, lse, mx


# Note [Recomputed query blocks]: under autograd the general path keeps no scores: each query block's
# forward runs without a graph and its backward runs it again with one (activation checkpointing). Not with
# torch.utils.checkpoint: its first call imports torch._dynamo, and with it torch.fx's symbolic shapes and
# sympy (0.5-1.4 s of a first call in a fresh process; tests/functional/test_flex.py
# test_first_call_imports_no_compiler_stack). _Recomputed takes the block's queries, k, v and the leaves
# score_mod reads (found from one call of it on a single pair: a score_mod that reads a tensor requiring grad
# at some pairs only, by Python control flow on values, would not be seen) as inputs, so autograd routes the
# gradients the recomputation finds to them; the recomputation differentiates through the captured tensors'
# own graph to those leaves (retained, as every query block walks it). One backward only (no double backward).
class _Recomputed(torch.autograd.Function):
    """(out, lse, max) of ``run(qs)`` for one query block, recomputed in the backward (Note [Recomputed
    query blocks]). Inputs: run, qs [B, H, r, E], k, v (which run reads), then the leaves score_mod reads."""

    @staticmethod
    def forward(ctx, run, qs, k, v, *leaves):
        # the very tensors (not saved copies): the recomputation's graph must reach these objects
        ctx.run, ctx.inputs = run, (qs, k, v, *leaves)
        return run(qs)  # autograd is off inside forward: no graph, no scores kept

    @staticmethod
    def backward(ctx, *grads):
        qs, k, v, *leaves = ctx.inputs  # kept: a retained graph may run this backward again (gradcheck does)
        wrt = [qs.detach().requires_grad_(ctx.needs_input_grad[1])] + [k, v] + list(leaves)
        need = [ctx.needs_input_grad[1], ctx.needs_input_grad[2], ctx.needs_input_grad[3],
                *ctx.needs_input_grad[4:]]
        pick = [i for i, n in enumerate(need) if n]
        with torch.enable_grad():
            outs = ctx.run(wrt[0])
            pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad]
            # a scalar sum(o · g), not grad_outputs=g: torch.autograd.grad imports torch.fx's symbolic shapes
            # and sympy on its first call with grad_outputs (the vector-Jacobian product is the same, exactly)
            total = sum((o * g).sum() for o, g in pairs) if pairs else None
        got = torch.autograd.grad(total, [wrt[i] for i in pick], allow_unused=True,
                                  retain_graph=True) if pairs and pick else []
        res = [None] * len(wrt)
        for i, gi in zip(pick, got):
            res[i] = gi
        return (None, *res)


def general(query, key, value, score_mod, mask: FlexMask, scale, want_max):
    """out [B, H, L, Ev] (query's dtype), lse [B, H, L] and max [B, H, L] (accumulation dtype) by online
    softmax over the blocks ``mask.codes`` keeps (union over batch and heads), per query block."""
    B, H, L, _ = query.shape
    S = key.shape[2]
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    G = H // key.shape[1]
    q, k, v = query.to(acc), key.to(acc), value.to(acc)
    if G > 1:  # (B, Hkv, S, E) -> (B, H, S, E): query head h reads kv head h // G
        k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    bq, bk = mask.block
    kept = mask.codes.amax(dim=(0, 1))  # (nq, nk): EMPTY only where every (b, h) is empty
    full_all = (mask.codes == P.FULL).all(0).all(0)
    grad = torch.is_grad_enabled()
    leaves = []
    if grad and score_mod is not None:  # the tensors requiring grad score_mod reads (Note [Recomputed query blocks])
        z = torch.zeros(1, 1, 1, 1, dtype=torch.long)
        y = score_mod(torch.zeros(1, 1, 1, 1, dtype=acc), z, z, z, z)
        leaves = _leaves(y) if isinstance(y, torch.Tensor) and y.requires_grad else []
    outs, lses, maxes = [], [], []
    for qb in range(-(-L // bq)):
        q0, q1 = qb * bq, min(L, (qb + 1) * bq)
        blocks = [(kb * bk, min(S, (kb + 1) * bk), not bool(full_all[qb, kb]))
                  for kb in range(kept.shape[1]) if int(kept[qb, kb]) != P.EMPTY]

        def run(qs, q0=q0, blocks=blocks):
            return _row_block(qs, k, v, score_mod, mask, scale, q0, blocks, B, H, want_max)
        if grad and (q.requires_grad or k.requires_grad or v.requires_grad or leaves):
            o, lse, mx = _Recomputed.apply(run, q[:, :, q0:q1], k, v, *leaves)
        else:
            o, lse, mx = run(q[:, :, q0:q1])
        outs.append(o), lses.append(lse), maxes.append(mx)
    out = torch.cat(outs, 2).to(query.dtype) if outs else query.new_zeros(B, H, 0, value.shape[-1])
    lse = torch.cat(lses, 2) if lses else q.new_zeros(B, H, 0)
    mx = torch.cat(maxes, 2) if maxes else q.new_zeros(B, H, 0)
    return out, lse, mx
