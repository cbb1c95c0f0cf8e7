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

__all__ = ["Linear", "kernel_attention", "FEATURE_MAPS"]

FEATURE_MAPS = ("elu+1", "relu")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den with 0 where den == 0 (a query with no key gets output 0, as in attnlab.attention)."""
    return num / torch.where(den == 0, torch.ones_like(den), den)


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
    if not is_causal:
        kv = torch.einsum("nhsf,nhse->nhfe", phi_k, v)  # (N, H, F, Ev)
        z = phi_k.sum(dim=-2)  # (N, H, F)
        num = torch.einsum("nhlf,nhfe->nhle", phi_q, kv)  # (N, H, L, Ev)
        den = torch.einsum("nhlf,nhf->nhl", phi_q, z).unsqueeze(-1)  # (N, H, L, 1)
        out = _safe_div(num, den)
    else:
        out, den = _causal_chunked(phi_q, phi_k, v, chunk_size)
    weights = None
    if need_weights:
        a = torch.einsum("nhlf,nhsf->nhls", phi_q, phi_k)  # (N, H, L, S)
        if is_causal:
            a = a.masked_fill(~torch.ones(L, S, dtype=torch.bool, device=a.device).tril(), 0.0)
        weights = _safe_div(a, a.sum(-1, keepdim=True))
    return out, weights


def _causal_chunked(phi_q, phi_k, v, C):
    """Causal kernel attention by chunks.

    # Note [Chunked prefix sums]: split positions into chunks of C. For a query in chunk t,
    #   Σ_{j<=i} φ(k_j) v_jᵀ = (Σ over chunks < t of φ(K_c)ᵀ V_c)  +  Σ_{j in chunk t, j<=i} φ(k_j) v_jᵀ.
    # The first term is an exclusive cumulative sum of per-chunk F×Ev states ([N, H, L/C, F, Ev]); the
    # second is a C×C masked product inside the chunk. Nothing is ever [L, F, Ev] (the naive cumsum),
    # and no key j > i enters query i, so the outputs before j cannot depend on token j.
    """
    N, H, L, Fd = phi_q.shape
    S, Ev = phi_k.shape[-2], v.shape[-1]
    T = -(-max(L, S) // C) * C  # common padded length; query i and key i share position i
    pq = F.pad(phi_q, (0, 0, 0, T - L))
    pk = F.pad(phi_k, (0, 0, 0, T - S))  # padded keys are zero: they add nothing
    pv = F.pad(v, (0, 0, 0, T - S))
    nc = T // C
    qc = pq.view(N, H, nc, C, Fd)  # (N, H, nc, C, F)
    kc = pk.view(N, H, nc, C, Fd)
    vc = pv.view(N, H, nc, C, Ev)
    # 1) per-chunk states and their exclusive prefix sums
    state = torch.einsum("nhcjf,nhcje->nhcfe", kc, vc)  # (N, H, nc, F, Ev)
    zst = kc.sum(dim=-2)  # (N, H, nc, F)
    state = torch.cumsum(state, dim=2) - state  # exclusive: chunks strictly before
    zst = torch.cumsum(zst, dim=2) - zst
    inter_num = torch.einsum("nhcif,nhcfe->nhcie", qc, state)  # (N, H, nc, C, Ev)
    inter_den = torch.einsum("nhcif,nhcf->nhci", qc, zst)  # (N, H, nc, C)
    # 2) inside the chunk: C×C scores, lower-triangular
    a = torch.einsum("nhcif,nhcjf->nhcij", qc, kc)  # (N, H, nc, C, C)
    a = a * torch.ones(C, C, dtype=a.dtype, device=a.device).tril()
    intra_num = torch.einsum("nhcij,nhcje->nhcie", a, vc)
    intra_den = a.sum(-1)
    den = (inter_den + intra_den).unsqueeze(-1)  # (N, H, nc, C, 1)
    out = _safe_div(inter_num + intra_num, den)
    return out.reshape(N, H, T, Ev)[:, :, :L], den.reshape(N, H, T, 1)[:, :, :L]


def elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    return F.elu(x) + 1.0


@register("linear", Spec(
    exact=False, causal=True, masks="key", weights=True, dropout=False,
    time="O((L+S)·F·D), F = E", memory="O(F·D) non-causal; O(L/C·F·D + L·C) causal",
    paper="Katharopoulos et al. 2020, Transformers are RNNs (arXiv:2006.16236)",
    summary="φ(q)·φ(k) kernel with φ = elu+1 or relu; causal by chunked prefix sums"))
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
        return elu_plus_one(x) if self.feature_map == "elu+1" else F.relu(x)

    def _forward(self, q, k, v, *, key_keep, attn_mask, is_causal, scale, dropout_p, need_weights):
        cd = _compute_dtype(q.dtype)
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

    def causal_flops(self, L, E, Ev=None):
        Ev = E if Ev is None else Ev
        C = self.chunk_size
        return 2 * L * E * Ev * 2 + 2 * L * C * (E + Ev)
