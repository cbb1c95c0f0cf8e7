"""Nyströmformer: softmax attention through m landmarks (segment means) and a pseudo-inverse.

Legend: N batch, H heads, L queries, S keys, m landmarks, E head dim, Ev value dim.

    Q̃, K̃ = segment means of Q and K (m segments each)
    F1 = softmax(Q K̃ᵀ s)  [L, m],   A = softmax(Q̃ K̃ᵀ s)  [m, m],   F3 = softmax(Q̃ Kᵀ s)  [m, S]
    out = F1 · A⁺ · (F3 V)                         (Xiong et al. 2021, arXiv:2102.03902)

A⁺ by the iterative Moore–Penrose scheme of the paper (Razavi et al. 2014), or exactly. With m = L = S
every segment is one token, F1 = A = F3 and F1 A⁺ F3 = A A⁺ A = A: exact attention.
Key-padding masks: masked keys leave the segment means and F3; a segment with no key left is dropped.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import Inputs, Mechanism, Spec, register
from ..kernels.dense import masked_softmax

__all__ = ["Nystrom", "iterative_pinv", "segment_means"]

PINV = ("iterative", "exact")


def segment_means(x: torch.Tensor, m: int, keep: torch.Tensor | None = None):
    """Means of x [N, H, T, D] over m contiguous segments (position t in segment ⌊t·m/T⌋).

    keep: [N|1, H|1, T] bool; masked positions are left out. Returns (means [N, H, m, D],
    counts [N|1, H|1, m]); a segment with count 0 has mean 0.
    """
    T = x.shape[-2]
    seg = torch.div(torch.arange(T, device=x.device) * m, T, rounding_mode="floor")  # (T,)
    onehot = torch.nn.functional.one_hot(seg, m).to(x.dtype)  # (T, m)
    if keep is None:
        w = onehot.expand(1, 1, T, m)
    else:
        w = onehot * keep.unsqueeze(-1).to(x.dtype)  # (N|1, H|1, T, m)
    counts = w.sum(-2)  # (N|1, H|1, m)
    sums = torch.einsum("nhtm,nhtd->nhmd", w, x)  # (N, H, m, D)
    return sums / counts.clamp_min(1).unsqueeze(-1), counts


def iterative_pinv(a: torch.Tensor, iterations: int = 6) -> torch.Tensor:
    """Moore–Penrose pseudo-inverse of a [..., m, m] by the cubically convergent iteration
        Z ← ¼ Z (13 I − AZ (15 I − AZ (7 I − AZ))),   Z₀ = Aᵀ / (‖A‖₁ ‖A‖∞)
    (Razavi et al. 2014, as used by Nyströmformer). Z₀ is per matrix, so batch elements stay independent.
    """
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    norm1 = a.abs().sum(-2).amax(-1, keepdim=True).unsqueeze(-1)  # max column sum
    norminf = a.abs().sum(-1).amax(-1, keepdim=True).unsqueeze(-1)  # max row sum
    z = a.transpose(-2, -1) / (norm1 * norminf).clamp_min(torch.finfo(a.dtype).tiny)
    for _ in range(iterations):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


@register("nystrom", Spec(
    exact=False, causal=False, masks="key", weights=True, dropout=False,
    time="O(L·m·D + m·S·D + m³)", memory="O(L·m + m·S)",
    paper="Xiong et al. 2021, Nyströmformer (arXiv:2102.03902)",
    summary="landmarks by segment means, iterative Moore–Penrose pseudo-inverse",
    error_band=1.2))  # Note [Error bands] in mechanisms/__init__.py: max 0.85 measured
@dataclass(frozen=True)
class Nystrom(Mechanism):
    """num_landmarks: m (capped at min(L, S)); pinv: "iterative" (the paper's) or "exact"
    (torch.linalg.pinv); pinv_iterations: steps of the iteration (the paper uses 6).
    Weights, when asked for, are the effective mixing matrix F1·A⁺·F3 [L, S]: rows sum to about 1
    but entries can be negative."""

    num_landmarks: int = 64
    pinv: str = "iterative"
    pinv_iterations: int = 6

    def __post_init__(self):
        for name in ("num_landmarks", "pinv_iterations"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name == "num_landmarks" else 0):
                raise ValueError(f"{name} must be a non-negative int (num_landmarks >= 1), got {v!r}")
        if self.pinv not in PINV:
            raise ValueError(f"pinv must be one of {PINV}, got {self.pinv!r}")

    def _forward(self, q, k, v, *, key_keep, attn_mask, is_causal, scale, dropout_p, need_weights):
        cd = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        qf, kf, vf = q.to(cd), k.to(cd), v.to(cd)
        L, S = q.shape[-2], k.shape[-2]
        m = max(1, min(self.num_landmarks, L, S))
        # 1) landmarks
        q_l, _ = segment_means(qf, m)  # (N, H, m, E)
        k_l, k_cnt = segment_means(kf, m, key_keep)  # (N, H, m, E), (N|1, H|1, m)
        lm_keep = (k_cnt > 0).unsqueeze(-2)  # (N|1, H|1, 1, m)
        kk = key_keep.unsqueeze(-2) if key_keep is not None else None  # (N|1, H|1, 1, S)
        # 2) the three softmax factors
        f1 = masked_softmax(qf @ k_l.transpose(-2, -1) * scale, lm_keep)  # (N, H, L, m)
        a = masked_softmax(q_l @ k_l.transpose(-2, -1) * scale, lm_keep)  # (N, H, m, m)
        f3 = masked_softmax(q_l @ kf.transpose(-2, -1) * scale, kk)  # (N, H, m, S)
        # 3) pseudo-inverse and product, right to left: never L×S
        if self.pinv == "exact":
            a_inv = torch.linalg.pinv(a.double()).to(cd) if cd != torch.float64 else torch.linalg.pinv(a)
        else:
            a_inv = iterative_pinv(a, self.pinv_iterations)
        out = f1 @ (a_inv @ (f3 @ vf))  # (N, H, L, Ev)
        w = (f1 @ a_inv @ f3).to(q.dtype) if need_weights else None
        return out.to(q.dtype), w

    def flops(self, L, S, E, Ev=None):
        Ev = E if Ev is None else Ev
        m = min(self.num_landmarks, L, S)
        it = self.pinv_iterations if self.pinv == "iterative" else 10
        return (2 * L * m * E + 2 * m * m * E + 2 * m * S * (E + Ev) + it * 4 * 2 * m ** 3
                + 2 * m * m * Ev + 2 * L * m * Ev + (L + S) * E)

    def memory(self, L, S, E, Ev=None, element_size=4):
        Ev = E if Ev is None else Ev
        m = min(self.num_landmarks, L, S)
        return (2 * L * m + 2 * m * S + 4 * m * m + 2 * m * (E + Ev)) * element_size
