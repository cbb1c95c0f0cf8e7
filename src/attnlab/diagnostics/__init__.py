"""attnlab.diagnostics: numbers that say whether attention is healthy (spread, saturation, gradient flow).

Legend: H heads, L query length, S key length, E = d_k head dim, Ev value dim. ``weights`` are softmax
rows [..., L, S] (each row sums to 1 over the keys that take part); ``scores`` are the logits fed to it.

What each measure is, in plain PyTorch:
    entropy(w)            = -(w * log w).sum(-1)                   nats, 0 = one-hot, log S = uniform
    max_weight(w)         = w.amax(-1)
    saturated_fraction(w) = (w.amax(-1) >= threshold).float().mean()
    softmax_jacobian(w)   = diag(w) - w wᵀ                          per row, [..., S, S]
    jacobian_norm(w)      = ||diag(w) - w wᵀ||_F                    per row, closed form (no S×S tensor)
    score_grad_norm       = ||∂(out · g)/∂scores||                  the gradient that reaches the scores
For inputs too long to hold [L, S], ``streaming_summary`` asks ``attnlab.probe`` the same questions
block by block (tiled kernel; memory O(L + S) per head).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ..probe import probe

__all__ = [
    "entropy", "max_weight", "saturated_fraction", "softmax_jacobian", "jacobian_norm", "score_grad_norm",
    "weight_stats", "score_variance", "scale_sweep", "SCALES", "scale_value", "streaming_summary",
    "StreamingSummary",
]

#: the three score scales the tutorial discusses: none (1), sqrt (1/sqrt(d_k), the standard), dk (1/d_k)
SCALES = ("none", "sqrt", "dk")
#: a row whose largest weight is at least this is "saturated" (near one-hot)
SATURATION_THRESHOLD = 0.99


def scale_value(mode: str, d_k: int) -> float:
    """The multiplier applied to Q Kᵀ for a scale mode: none -> 1, sqrt -> 1/sqrt(d_k), dk -> 1/d_k."""
    if mode not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {mode!r}")
    if mode == "none":
        return 1.0
    if not isinstance(d_k, (int, np.integer)) or d_k < 1:
        raise ValueError(f"d_k must be a positive int for scale={mode!r}, got {d_k!r}")
    return 1.0 / math.sqrt(d_k) if mode == "sqrt" else 1.0 / d_k


def _t(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().double()
    return torch.as_tensor(np.asarray(x, dtype=np.float64))


def entropy(weights) -> torch.Tensor:
    """Row entropy in nats: [..., L] (zero weights contribute 0; a fully masked row gives 0)."""
    w = _t(weights)
    return -torch.where(w > 0, w * torch.log(w.clamp_min(1e-300)), torch.zeros_like(w)).sum(-1)


def max_weight(weights) -> torch.Tensor:
    """Largest weight of each row: [..., L]."""
    return _t(weights).amax(-1)


def saturated_fraction(weights, threshold: float = SATURATION_THRESHOLD) -> float:
    """Fraction of rows whose largest weight is >= threshold (near one-hot rows)."""
    m = max_weight(weights)
    return float((m >= threshold).double().mean()) if m.numel() else 0.0


def softmax_jacobian(weights) -> torch.Tensor:
    """∂softmax(x)/∂x = diag(p) - p pᵀ for each row p: [..., L, S, S] (materialises S×S per row)."""
    p = _t(weights)
    return torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)


def jacobian_norm(weights) -> torch.Tensor:
    """Frobenius norm of each row's softmax Jacobian: [..., L], without forming it.

    ||diag(p) - p pᵀ||_F² = Σ p_i² - 2 Σ p_i³ + (Σ p_i²)²; 0 for a one-hot row (no gradient flows),
    largest for a uniform row.
    """
    p = _t(weights)
    s2, s3 = (p * p).sum(-1), (p**3).sum(-1)
    return (s2 - 2 * s3 + s2 * s2).clamp_min(0).sqrt()


def score_grad_norm(scores, value, upstream=None, *, seed: int = 0) -> torch.Tensor:
    """Norm of the gradient reaching the scores: ||∂(softmax(scores) @ value · g)/∂scores|| per row.

    scores: [..., L, S]; value: [..., S, Ev]; upstream g: [..., L, Ev] (default: seeded N(0, 1)).
    Returns [..., L]. Computed with autograd in float64; equal to ||J_rowᵀ (V g_row)||.
    """
    s = _t(scores).clone().requires_grad_(True)
    v = _t(value)
    if s.shape[-1] != v.shape[-2]:
        raise ValueError(f"scores [..., L, S={s.shape[-1]}] and value [..., S={v.shape[-2]}, Ev] disagree on S")
    out = torch.softmax(s, dim=-1) @ v  # (..., L, Ev)
    if upstream is None:
        gen = torch.Generator().manual_seed(seed)
        g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    else:
        g = _t(upstream)
    (grad,) = torch.autograd.grad((out * g).sum(), s)
    return grad.norm(dim=-1)


def weight_stats(weights, threshold: float = SATURATION_THRESHOLD) -> dict:
    """Summary of softmax rows [..., L, S]: mean entropy, max weight, saturated fraction, Jacobian norm."""
    w = _t(weights)
    S = w.shape[-1]
    ent = entropy(w)
    return {
        "mean_entropy": float(ent.mean()),
        "max_entropy": math.log(S) if S else 0.0,
        "mean_max_weight": float(max_weight(w).mean()),
        "saturated_fraction": saturated_fraction(w, threshold),
        "mean_jacobian_norm": float(jacobian_norm(w).mean()),
        "min_weight": float(w.min()) if w.numel() else 0.0,
        "max_abs_weight": float(w.abs().max()) if w.numel() else 0.0,
        "row_sum_min": float(w.sum(-1).min()) if w.numel() else 0.0,
        "row_sum_max": float(w.sum(-1).max()) if w.numel() else 0.0,
        "negative_fraction": float((w < 0).double().mean()) if w.numel() else 0.0,
    }


def score_variance(d_k: int, *, n: int = 4096, seed: int = 0) -> dict:
    """Empirical Var(q·k) for q, k ~ N(0, I_{d_k}), unscaled and under each scale (theory: d_k, 1, 1/d_k)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, d_k, generator=gen, dtype=torch.float64)
    k = torch.randn(n, d_k, generator=gen, dtype=torch.float64)
    dots = (q * k).sum(-1)  # (n,) independent pairs
    raw = float(dots.var())
    return {"d_k": d_k, "unscaled": raw, **{m: raw * scale_value(m, d_k) ** 2 for m in SCALES}}


@dataclass
class SweepRow:
    """One (d_k, scale) point of :func:`scale_sweep`: the variance of the scaled scores [L, S], the
    weights' mean and maximum possible entropy (nats), mean largest weight, fraction of saturated rows,
    mean softmax-Jacobian norm, and the mean norm of the gradient reaching each score row."""
    d_k: int
    scale: str
    score_var: float
    mean_entropy: float
    max_entropy: float
    mean_max_weight: float
    saturated_fraction: float
    mean_jacobian_norm: float
    mean_grad_norm: float


def scale_sweep(d_ks=(4, 16, 64, 256, 512), scales=SCALES, *, seq_len: int = 64, d_v: int = 16,
                seed: int = 0) -> list[SweepRow]:
    """For q, k, v ~ N(0, 1): how each scale's score variance, spread and gradient flow change with d_k.

    The tutorial's claim, measured: with scale none the score variance grows like d_k and rows
    saturate (near one-hot), where the softmax Jacobian, hence the gradient reaching the scores, is 0;
    sqrt keeps the variance ≈ 1. ``d_v`` is held fixed so gradient norms compare across d_k.
    """
    rows = []
    for d_k in d_ks:
        gen = torch.Generator().manual_seed(seed + d_k)
        q = torch.randn(seq_len, d_k, generator=gen, dtype=torch.float64)
        k = torch.randn(seq_len, d_k, generator=gen, dtype=torch.float64)
        v = torch.randn(seq_len, d_v, generator=gen, dtype=torch.float64)
        raw = q @ k.T  # (L, S)
        for mode in scales:
            s = raw * scale_value(mode, d_k)
            w = torch.softmax(s, dim=-1)
            st = weight_stats(w)
            rows.append(SweepRow(d_k, mode, float(s.var()), st["mean_entropy"], st["max_entropy"],
                                 st["mean_max_weight"], st["saturated_fraction"], st["mean_jacobian_norm"],
                                 float(score_grad_norm(s, v, seed=seed).mean())))
    return rows


# -- streaming: long inputs ----------------------------------------------------------------------
@dataclass
class StreamingSummary:
    """Per-head answers from ``attnlab.probe`` (no [L, S] tensor): shapes use H heads, L queries."""

    L: int
    S: int
    entropy: torch.Tensor  # (H, L) nats
    max_weight: torch.Tensor  # (H, L)
    sink_mass: torch.Tensor  # (H, L) weight on key 0
    topk_weights: torch.Tensor  # (H, L, k)
    topk_indices: torch.Tensor  # (H, L, k)
    distance_hist: torch.Tensor  # (H, nbins) mean mass per row by |i - j| bin
    distance_edges: torch.Tensor  # (nbins,) lower bin edges
    extra: dict = field(default_factory=dict)

    def per_head(self) -> list[dict]:
        """One dict of scalars per head (means over rows)."""
        out = []
        for h in range(self.entropy.shape[0]):
            out.append({
                "head": h,
                "mean_entropy": float(self.entropy[h].mean()),
                "mean_max_weight": float(self.max_weight[h].mean()),
                "saturated_fraction": float((self.max_weight[h] >= SATURATION_THRESHOLD).double().mean()),
                "mean_sink_mass": float(self.sink_mass[h].mean()),
                "mean_distance": _mean_distance(self.distance_hist[h], self.distance_edges),
            })
        return out


def _mean_distance(hist: torch.Tensor, edges: torch.Tensor) -> float:
    """Approximate mean |i - j| from a binned histogram (bin centre = mid of [edge, next edge))."""
    e = edges.double()
    upper = torch.cat([e[1:], e[-1:] * 2 + 1])
    centre = torch.where(upper - e <= 1, e, (e + upper - 1) / 2)
    tot = float(hist.sum())
    return float((hist.double() * centre).sum() / tot) if tot > 0 else 0.0


def streaming_summary(query, key, attn_mask=None, is_causal=False, scale=None, *, pattern=None, k: int = 5,
                      block_size: int | None = None) -> StreamingSummary:
    """Entropy, max weight, sink mass, top-k keys and distance histogram per head, streamed.

    query: [H, L, E] or [1, H, L, E]; key: [H, S, E] or [1, H, S, E]. Works for a 32k-token input:
    only one block of scores exists at a time (with a sparse ``pattern`` only its blocks are computed).
    """

    if query.dim() == 4:
        if query.shape[0] != 1:
            raise ValueError(f"streaming_summary takes one sequence: query batch dim must be 1, got {list(query.shape)}")
        query, key = query[0], key[0]
    if query.dim() != 3 or key.dim() != 3:
        raise ValueError(f"query must be [H, L, E] and key [H, S, E], got {list(query.shape)} and {list(key.shape)}")
    pr = probe(query, key, attn_mask, is_causal, scale, pattern=pattern, block_size=block_size)
    k = max(1, min(k, pr.S))
    tw, ti = pr.topk(k)
    hist, edges = pr.distance_histogram()
    return StreamingSummary(pr.L, pr.S, pr.entropy(), pr.max_weight(), pr.sink_mass(), tw, ti,
                            hist.reshape(query.shape[0], -1), edges)
