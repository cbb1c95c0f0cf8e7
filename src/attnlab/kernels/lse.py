"""The one log-sum-exp merge: attention over two disjoint key sets combined exactly.

Note [Merging by log-sum-exp]: attention over keys K1 ∪ K2 is
    out = (exp(lse1)·out1 + exp(lse2)·out2) / (exp(lse1) + exp(lse2)),  lse = log(exp(lse1) + exp(lse2)),
computed relative to m = max(lse1, lse2) so nothing overflows. A side with lse = -inf (no key seen)
gets weight exactly 0; when both are -inf the result is (0-weighted output, -inf).
Used by the tiled kernel (tile by tile), ``attnlab.merge_partials`` and ring attention.

Shapes: out [..., L, Ev], lse [..., L].
"""
from __future__ import annotations

import torch

__all__ = ["merge", "merge_into", "acc_dtype", "sink_scale"]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype attnlab accumulates softmax statistics in: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _weights(lse_a: torch.Tensor, lse_b: torch.Tensor):
    """(wa, wb, denominator, m_safe, any) with wa = exp(lse_a - m) / denominator etc. [..., L]."""
    m = torch.maximum(lse_a, lse_b)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    wa, wb = torch.exp(lse_a - m_safe), torch.exp(lse_b - m_safe)
    tot = wa + wb
    nonzero = tot > 0
    denom = torch.where(nonzero, tot, torch.ones_like(tot))
    return wa / denom, wb / denom, denom, m_safe, nonzero


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor):
    """(out [..., L, Ev], lse [..., L]) of attention over the union of two disjoint key sets, from each
    set's (out, lse) (Note [Merging by log-sum-exp]). The output keeps each side's dtype promotion;
    lse is in lse_a's dtype. Differentiable."""
    lse_b = lse_b.to(lse_a.dtype)
    wa, wb, denom, m_safe, nonzero = _weights(lse_a, lse_b)
    out = out_a * wa.unsqueeze(-1).to(out_a.dtype) + out_b * wb.unsqueeze(-1).to(out_b.dtype)
    lse = torch.where(nonzero, m_safe + torch.log(denom), torch.full_like(m_safe, float("-inf")))
    return out, lse


def merge_into(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """In place: (out, lse) <- merge((out, lse), (out_b, lse_b)), without allocating a new output
    (the accumulating form for loops over key blocks or ring steps). Not for tensors autograd tracks."""
    lse_b = lse_b.to(lse.dtype)
    wa, wb, denom, m_safe, nonzero = _weights(lse, lse_b)
    out.mul_(wa.unsqueeze(-1).to(out.dtype)).addcmul_(out_b.to(out.dtype), wb.unsqueeze(-1).to(out.dtype))
    lse.copy_(torch.where(nonzero, m_safe + torch.log(denom), torch.full_like(m_safe, float("-inf"))))


# Note [Attention sinks]: a sink (gpt-oss; flash-attn, vLLM, llama.cpp) is one learned logit s_h per query head in
# the softmax denominator only:
#     out_i = Σ_j exp(x_ij - m) v_j / (exp(s_h - m) + Σ_j exp(x_ij - m)),
# attention over the keys plus one key of score s_h and value 0: the merge above with the partial (0, s_h). So
# from a row's (out, lse) without the sink, exactly:
#     out' = out·a,  lse' = logaddexp(lse, s_h),  a = exp(lse - lse') = sigmoid(lse - s_h),
# and the weights are exp(x - lse'), summing to a < 1. A row with no key: a = 0, out' = 0, lse' = s_h.
# Backward (dO' the gradient of out'): the softmax backward over the keys and the sink, whose value is 0, is
#     dx_ij = P'_ij (dO'_i·v_j - D_i),  D_i = dO'_i·out'_i,  dv_j = Σ_i P'_ij dO'_i,  ds_h = -Σ_i (1 - a_i) D_i,
# with P' = exp(x - lse'): FlashAttention's backward run on the sinked (out', lse') gives dq, dk, dv unchanged,
# and ds is one reduction. The tiled and compiled kernels keep (out', lse') for their backward; dense has the
# sink in its softmax (autograd); the decode kernel (inference) rescales its output, so only ds flows, through a.
def sink_scale(lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, lse') for rows' lse [N, H, L] and sinks [H] (Note [Attention sinks]): a = sigmoid(lse - s), the factor
    the output takes, and lse' = logaddexp(lse, s), both in lse's dtype; differentiable in ``sinks``."""
    s = sinks.to(lse.dtype).view(-1, 1)  # (H, 1)
    return torch.sigmoid(lse - s), torch.logaddexp(lse, s.expand_as(lse))
