"""Float64 NumPy attention: the oracle of attnlab's tests, short enough to check by eye."""
from __future__ import annotations

import math

import numpy as np

__all__ = ["attention"]


def attention(query, key, value, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, *,
              softcap=None, alibi_slopes=None, sinks=None):
    """softmax(Q Kᵀ · scale + mask) V in float64.

    query [..., L, E], key [..., S, E], value [..., S, Ev]; attn_mask bool (True = takes part) or float
    (added), broadcast to [..., L, S]; is_causal keeps key j for query i when j <= i (top-left), and is
    ANDed with attn_mask. A query row with no key left gets output 0 and weights 0.
    softcap: the scaled product x becomes softcap·tanh(x / softcap) before anything is added.
    alibi_slopes [H] or [..., H] (query's dims before L): adds −slope·|i + S − L − j| (flash-attn's ALiBi).
    sinks [H]: one logit s_h per query head in the denominator only (gpt-oss):
    weights_ij = exp(x_ij) / (exp(s_h) + Σ_j exp(x_ij)), which then sum to less than 1.
    Returns (output [..., L, Ev], weights [..., L, S]) as float64 arrays.
    """
    q, k, v = (np.asarray(_np(t), dtype=np.float64) for t in (query, key, value))
    L, S, E = q.shape[-2], k.shape[-2], q.shape[-1]
    if enable_gqa and q.ndim >= 3 and k.shape[-3] != q.shape[-3]:
        g = q.shape[-3] // k.shape[-3]
        k, v = np.repeat(k, g, axis=-3), np.repeat(v, g, axis=-3)
    s = 1.0 / math.sqrt(E) if scale is None else scale
    scores = (q @ np.swapaxes(k, -1, -2)) * s  # [..., L, S]
    if softcap is not None:
        scores = softcap * np.tanh(scores / softcap)
    if alibi_slopes is not None:
        slopes = _np(alibi_slopes).astype(np.float64)[..., None, None]  # [..., H, 1, 1]
        i, j = np.arange(L)[:, None], np.arange(S)[None, :]
        scores = scores - slopes * np.abs(i + S - L - j)
    keep = np.ones((L, S), dtype=bool)
    if is_causal:
        keep &= np.tril(np.ones((L, S), dtype=bool))
    if attn_mask is not None:
        m = _np(attn_mask)
        if m.dtype == np.bool_:
            keep = keep & m
        else:
            scores = scores + m.astype(np.float64)
    keep = np.broadcast_to(keep, scores.shape)
    scores = np.where(keep, scores, -np.inf)
    row_max = scores.max(axis=-1, keepdims=True) if S > 0 else np.zeros(scores.shape[:-1] + (1,))
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    sink = None
    if sinks is not None:
        sink = _np(sinks).astype(np.float64)[:, None, None]  # (H, 1, 1)
        row_max = np.maximum(row_max, sink)
    p = np.exp(scores - row_max)  # masked entries: exp(-inf) = 0
    denom = p.sum(axis=-1, keepdims=True)
    if sink is not None:
        denom = denom + np.exp(sink - row_max)
    weights = p / np.where(denom == 0, 1.0, denom)
    return weights @ v, weights


def _np(t):
    if hasattr(t, "detach"):
        t = t.detach().cpu()
        if t.dtype.is_floating_point:
            t = t.double()
        return t.numpy()
    return np.asarray(t)
