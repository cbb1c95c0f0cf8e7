"""Linear (kernelised) attention: softmax(q·k) replaced by φ(q)·φ(k), O(L·F·D) instead of O(L·S·D).

Legend: N batch, H heads, L queries, S keys, F feature dim of φ, Ev value dim, C chunk length.

    out_i = φ(q_i)ᵀ Σ_j φ(k_j) v_jᵀ / φ(q_i)ᵀ Σ_j φ(k_j)            (Katharopoulos et al. 2020)

Non-causal: the sums over j are computed once (φ(K)ᵀV is F×Ev). Causal: the sums run over j <= i,
computed chunk by chunk (Note [Chunked prefix sums]) so memory is O(L/C·F·Ev + L·C), not O(L·F·Ev).
``kernel_attention`` is shared with Performer, which only changes φ.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import Mechanism, Spec, register

__all__ = ["Linear", "kernel_attention", "compute_dtype", "FEATURE_MAPS"]

FEATURE_MAPS = ("elu+1", "relu")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype feature-map attention computes in: float32 for half types (their sums overflow or lose
    the small terms), else the input dtype."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den with 0 where den == 0 (a query with no key gets output 0, as in attnlab.attention).

    Every term of den = Σ φ(q)·φ(k) is >= 0, so den == 0 only when every term is 0, and then num is 0
    too: clamping den to the smallest normal number gives exactly 0 there, in one pass."""
    return num / den.clamp_min(torch.finfo(den.dtype).tiny)


def kernel_attention(phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, *, key_keep=None,
                     is_causal: bool = False, chunk_size: int = 128, need_weights: bool = False):
    """Attention with weights ∝ φ(q)·φ(k).

    phi_q: [N, H, L, F] and phi_k: [N, H, S, F], both non-negative; v: [N, H, S, Ev];
    key_keep: [N|1, H|1, S] bool or None. Returns (out [N, H, L, Ev], weights [N, H, L, S] | None).
    """
    N, H, L, Fd = phi_q.shape
    S = phi_k.shape[-2]
    if key_keep is not None:
        phi_k = phi_k * key_keep.unsqueeze(-1).to(phi_k.dtype)  # masked keys contribute nothing
    # Note [Normaliser column]: a column of ones appended to V makes one product give both the
    # numerator Σ φ(k_j) v_jᵀ and the normaliser Σ φ(k_j): out = num / den with den the last column.
    v1 = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)  # (N, H, S, Ev + 1)
    if not is_causal:
        kv = torch.matmul(phi_k.transpose(-2, -1), v1)  # (N, H, F, Ev + 1)
        nd = torch.matmul(phi_q, kv)  # (N, H, L, Ev + 1)
    else:
        nd = _causal_chunked(phi_q, phi_k, v1, chunk_size)
    out = _safe_div(nd[..., :-1], nd[..., -1:])
    weights = None
    if need_weights:
        a = torch.matmul(phi_q, phi_k.transpose(-2, -1))  # (N, H, L, S)
        if is_causal:
            a = a.masked_fill(~torch.ones(L, S, dtype=torch.bool, device=a.device).tril(), 0.0)
        weights = _safe_div(a, a.sum(-1, keepdim=True))
    return out, weights


def _causal_chunked(phi_q, phi_k, v1, C):
    """Causal kernel attention by chunks; v1 is V with the normaliser column (Note [Normaliser column]).
    Returns [N, H, L, Ev + 1]: numerators and, in the last column, normalisers.

    # Note [Chunked prefix sums]: split positions into chunks of C. For a query in chunk t,
    #   Σ_{j<=i} φ(k_j) v_jᵀ = (Σ over chunks < t of φ(K_c)ᵀ V_c)  +  Σ_{j in chunk t, j<=i} φ(k_j) v_jᵀ.
    # The first term is an exclusive cumulative sum of per-chunk F×Ev states ([N, H, L/C, F, Ev]); the
    # second is a C×C masked product inside the chunk. Nothing is ever [L, F, Ev] (the naive cumsum),
    # and no key j > i enters query i, so the outputs before j cannot depend on token j.
    """
    N, H, L, Fd = phi_q.shape
    S, Ev1 = phi_k.shape[-2], v1.shape[-1]
    T = -(-max(L, S) // C) * C  # common padded length; query i and key i share position i
    C = min(C, T)
    nc = T // C
    qc = F.pad(phi_q, (0, 0, 0, T - L)).view(N, H, nc, C, Fd)  # (N, H, nc, C, F)
    kc = F.pad(phi_k, (0, 0, 0, T - S)).view(N, H, nc, C, Fd)  # padded keys are zero: they add nothing
    vc = F.pad(v1, (0, 0, 0, T - S)).view(N, H, nc, C, Ev1)
    # 1) per-chunk states and their exclusive prefix sums
    state = torch.matmul(kc.transpose(-2, -1), vc)  # (N, H, nc, F, Ev + 1)
    # exclusive sum (chunks strictly before), built so that chunk t's own keys never enter it, not even
    # as rounding error (an inclusive cumsum minus the chunk's own state would)
    state = F.pad(torch.cumsum(state[:, :, :-1], dim=2), (0, 0, 0, 0, 1, 0))
    inter = torch.matmul(qc, state)  # (N, H, nc, C, Ev + 1)
    # 2) inside the chunk: C×C scores, lower-triangular
    a = torch.matmul(qc, kc.transpose(-2, -1))  # (N, H, nc, C, C)
    a = a * torch.ones(C, C, dtype=a.dtype, device=a.device).tril()
    nd = inter + torch.matmul(a, vc)  # (N, H, nc, C, Ev + 1)
    return nd.reshape(N, H, T, Ev1)[:, :, :L]


def elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    """φ(x) = elu(x) + 1, elementwise, same shape and dtype as ``x``: Katharopoulos et al.'s feature map,
    positive everywhere, so every weight φ(q)·φ(k) and every normaliser is > 0."""
    if x.requires_grad and torch.is_grad_enabled():
        return F.elu(x) + 1.0
    return F.elu(x).add_(1.0)  # in place on a fresh tensor: one pass fewer when no graph is built


@register("linear", Spec(
    exact=False, causal=True, masks="key", weights=True, dropout=False,
    time="O((L+S)·F·D), F = E", memory="O(F·D) non-causal; O(L/C·F·D + L·C) causal",
    paper="Katharopoulos et al. 2020, Transformers are RNNs (arXiv:2006.16236)",
    summary="φ(q)·φ(k) kernel with φ = elu+1 or relu; causal by chunked prefix sums",
    error_band=1.5))  # Note [Error bands] in mechanisms/__init__.py: max 0.93 measured
@dataclass(frozen=True)
class Linear(Mechanism):
    """Linear attention. ``scale`` is accepted and not used: φ replaces exp(q·k·scale) (as in the paper).

    feature_map: "elu+1" (Katharopoulos et al.) or "relu".
    chunk_size: causal chunk length C (memory O(L·C + L/C·F·Ev)).
    """

    feature_map: str = "elu+1"
    chunk_size: int = 128

    def __post_init__(self):
        if self.feature_map not in FEATURE_MAPS:
            raise ValueError(f"feature_map must be one of {FEATURE_MAPS}, got {self.feature_map!r}")
        if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ValueError(f"chunk_size must be an int >= 1, got {self.chunk_size!r}")

    def phi(self, x: torch.Tensor) -> torch.Tensor:
        """The feature map φ of ``feature_map`` applied to queries or keys [..., E] -> [..., E] (F = E),
        same dtype. With "relu" a row can be all zero; a query whose every φ(q)·φ(k) is 0 gets output 0
        (``_safe_div``), as a query with no key does in ``attnlab.attention``."""
        return elu_plus_one(x) if self.feature_map == "elu+1" else F.relu(x)

    def _forward(self, q, k, v, *, key_keep, attn_mask, is_causal, scale, dropout_p, need_weights):
        cd = compute_dtype(q.dtype)
        out, w = kernel_attention(self.phi(q.to(cd)), self.phi(k.to(cd)), v.to(cd), key_keep=key_keep,
                                  is_causal=is_causal, chunk_size=self.chunk_size, need_weights=need_weights)
        return out.to(q.dtype), (w.to(q.dtype) if w is not None else None)

    def flops(self, L, S, E, Ev=None):
        Ev = E if Ev is None else Ev
        # φ(K)ᵀV, Σφ(K), φ(Q)·(KV), φ(Q)·z  (+ C×C blocks when causal, not counted here)
        return 2 * S * E * Ev + S * E + 2 * L * E * Ev + 2 * L * E

    def memory(self, L, S, E, Ev=None, element_size=4):
        Ev = E if Ev is None else Ev
        return ((L + S) * E + E * Ev + L) * element_size

    def causal_flops(self, L: int, E: int, Ev: int | None = None) -> int:
        """FLOPs of the causal path (L = S) per batch element and head: the chunk states φ(K_c)ᵀV_c and
        their use φ(Q_c)·state (4·L·E·Ev), plus the C x C block inside each chunk (2·L·C·(E + Ev)).
        ``flops`` counts the non-causal path, which has no C x C term."""
        Ev = E if Ev is None else Ev
        C = self.chunk_size
        return 2 * L * E * Ev * 2 + 2 * L * C * (E + Ev)
