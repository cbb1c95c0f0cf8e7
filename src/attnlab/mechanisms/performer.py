"""Performer (FAVOR+): positive orthogonal random features for the softmax kernel.

Legend: N batch, H heads, L queries, S keys, E head dim, M random features, Ev value dim.

    exp(q·k·s) = E_ω[φ(q)·φ(k)],  φ(x) = exp(ωᵀx' - |x'|²/2) / sqrt(M),  x' = x·s^(1/2),  ω ~ N(0, I)

with the M rows of ω drawn in orthogonal blocks (Choromanski et al. 2020, arXiv:2009.14794). Positive
features keep every weight >= 0, so the estimate never has negative denominators. Attention is then
linear attention with this φ (``linear.kernel_attention``), causal by chunked prefix sums.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..caches import ByteLRU
from . import Mechanism, MechanismModule, Spec, _prepare, register
from .linear import compute_dtype, kernel_attention

__all__ = ["Performer", "PerformerModule", "orthogonal_gaussian"]

_STABILIZER = 1e-6  # added to every feature, as in the reference implementation


def orthogonal_gaussian(num_features: int, dim: int, *, orthogonal: bool = True,
                        generator: torch.Generator | None = None) -> torch.Tensor:
    """ω: [num_features, dim]. Orthogonal blocks of ``dim`` rows (QR of a Gaussian), each row rescaled
    to the norm of an independent Gaussian vector so that marginally every row is N(0, I)."""
    if not orthogonal:
        return torch.randn(num_features, dim, generator=generator, dtype=torch.float64)
    blocks = []
    for _ in range(-(-num_features // dim)):
        g = torch.randn(dim, dim, generator=generator, dtype=torch.float64)
        qm, r = torch.linalg.qr(g)  # (dim, dim), orthonormal columns
        # sign fix: without it Householder QR's Q is not uniformly (Haar) distributed and the kernel
        # estimate is biased (Mezzadri 2007)
        qm = qm * torch.sign(torch.diagonal(r)).unsqueeze(0)
        blocks.append(qm.T)
    w = torch.cat(blocks, 0)[:num_features]  # (M, dim), unit rows, orthogonal within a block
    norms = torch.randn(num_features, dim, generator=generator, dtype=torch.float64).norm(dim=1)
    return w * norms.unsqueeze(1)


#: the seeded feature matrices kept for reuse weigh at most this together (a million features of dim 32 are
#: 256 MB: such a matrix is drawn, used and dropped, never kept)
FEATURE_CACHE_BYTES = 64 << 20
_FEATURES = ByteLRU("mechanisms.performer features", FEATURE_CACHE_BYTES, max_entries=64)


def _features(seed: int, num_features: int, dim: int, orthogonal: bool) -> torch.Tensor:
    def draw():
        g = torch.Generator().manual_seed(seed)
        return orthogonal_gaussian(num_features, dim, orthogonal=orthogonal, generator=g)

    return _FEATURES.get_or_compute((seed, num_features, dim, orthogonal), draw)


def positive_features(x: torch.Tensor, omega: torch.Tensor, scale: float, is_query: bool,
                      causal: bool = False, keep: torch.Tensor | None = None) -> torch.Tensor:
    """φ(x) for x [N, H, T, E] and ω [M, E] -> [N, H, T, M] (positive).

    # Note [Performer stabiliser]: the exp is shifted by a constant that cancels in the normalisation:
    # per row for queries (each query's own normaliser absorbs it); per (N, H) for keys, the max over
    # all keys — except when causal, where a max over keys would let a later key shift the features
    # of earlier ones (through the additive _STABILIZER), so keys use the data-free bound
    # ωᵀx - |x|²/2 <= |ω|²/2 instead.
    """
    # scale <= 0 too: q·k·s = (-q)·k·|s|, so queries are negated for a negative scale (s = 0: every
    # weight equal, which φ(0) gives)
    x = x * (abs(scale) ** 0.5 if not (is_query and scale < 0) else -(abs(scale) ** 0.5))
    proj = torch.einsum("nhte,me->nhtm", x, omega)  # (N, H, T, M)
    sq = (x * x).sum(-1, keepdim=True) / 2
    logits = proj - sq
    if is_query:
        stab = logits.amax(dim=-1, keepdim=True)
    elif causal:
        stab = (omega * omega).sum(-1).amax() / 2
    else:  # masked keys (keep [N|1, H|1, T] False) must not set the shift
        lg = logits if keep is None else logits.masked_fill(~keep.unsqueeze(-1), float("-inf"))
        stab = lg.amax(dim=(-1, -2), keepdim=True)
    stab = torch.where(torch.isfinite(stab), stab, torch.zeros_like(stab)).detach()
    return (torch.exp(logits - stab) + _STABILIZER) / math.sqrt(omega.shape[0])


@register("performer", Spec(
    exact=False, causal=True, masks="key", weights=True, dropout=False,
    time="O((L+S)·M·D)", memory="O(M·D) non-causal; O(L/C·M·D + L·C) causal",
    paper="Choromanski et al. 2020, Rethinking Attention with Performers (arXiv:2009.14794)",
    summary="FAVOR+: positive orthogonal random features estimate exp(q·k·s)",
    error_band=6.0))  # Note [Error bands] in mechanisms/__init__.py: max 4.03 measured (E = 32), median 0.91
@dataclass(frozen=True)
class Performer(Mechanism):
    """FAVOR+ attention with ``num_features`` positive random features.

    seed: features are drawn from this seed (deterministic, cached); ``None`` redraws on every call.
    orthogonal: orthogonal blocks (lower variance) or i.i.d. Gaussian rows.
    chunk_size: causal chunk length. For a module that owns its features and redraws them every
    ``redraw_interval`` training steps, use ``as_module()``.
    """

    num_features: int = 256
    orthogonal: bool = True
    seed: int | None = 0
    chunk_size: int = 128

    def __post_init__(self):
        for name in ("num_features", "chunk_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise TypeError(f"seed must be an int or None, got {self.seed!r}")

    def omega(self, dim: int, device=None, dtype=torch.float32) -> torch.Tensor:
        """ω: [num_features, dim] random feature directions for head dim E = ``dim``, in ``dtype``: the same
        for a given (seed, num_features, dim, orthogonal), freshly drawn on every call when ``seed`` is None."""
        if self.seed is None:
            w = orthogonal_gaussian(self.num_features, dim, orthogonal=self.orthogonal)
        else:
            w = _features(self.seed, self.num_features, dim, self.orthogonal)
        return w.to(device=device, dtype=dtype)

    def _forward(self, q, k, v, *, key_keep, attn_mask, is_causal, scale, dropout_p, need_weights, omega=None):
        cd = compute_dtype(q.dtype)
        w = self.omega(q.shape[-1], q.device, cd) if omega is None else omega.to(device=q.device, dtype=cd)
        pq = positive_features(q.to(cd), w, scale, True)
        pk = positive_features(k.to(cd), w, scale, False, causal=is_causal, keep=key_keep)
        out, weights = kernel_attention(pq, pk, v.to(cd), key_keep=key_keep, is_causal=is_causal,
                                        chunk_size=self.chunk_size, need_weights=need_weights)
        return out.to(q.dtype), (weights.to(q.dtype) if weights is not None else None)

    def flops(self, L, S, E, Ev=None):
        Ev = E if Ev is None else Ev
        M = self.num_features
        return 2 * (L + S) * E * M + 2 * S * M * Ev + 2 * L * M * Ev + 2 * (L + S) * M

    def memory(self, L, S, E, Ev=None, element_size=4):
        Ev = E if Ev is None else Ev
        M = self.num_features
        return ((L + S) * M + M * Ev + M * E) * element_size

    def as_module(self, redraw_interval: int | None = None) -> "PerformerModule":
        return PerformerModule(self, redraw_interval)


class PerformerModule(MechanismModule):
    """Performer as an nn.Module: ω is a buffer (saved with the state dict, moved by .to()).

    ``redraw_features()`` draws new ones; with ``redraw_interval`` = n they are redrawn every n
    training-mode calls (Choromanski et al. redraw periodically during training).
    """

    def __init__(self, mechanism: Performer, redraw_interval: int | None = None):
        super().__init__(mechanism)
        self.redraw_interval = redraw_interval
        self.register_buffer("omega", torch.empty(0), persistent=True)
        self._calls = 0

    @torch.no_grad()
    def redraw_features(self, dim: int | None = None) -> None:
        """Replace the ``omega`` buffer by a fresh unseeded draw [num_features, dim] (float32, on the
        buffer's device); ``dim`` defaults to the current buffer's head dim E."""
        dim = dim or self.omega.shape[-1]
        w = orthogonal_gaussian(self.mechanism.num_features, dim, orthogonal=self.mechanism.orthogonal)
        self.omega = w.to(device=self.omega.device, dtype=torch.float32)

    def forward(self, query, key, value, *, attn_mask=None, is_causal=False, scale=None, dropout_p=0.0,
                enable_gqa=False, need_weights=False):
        E = query.shape[-1]
        if self.omega.numel() == 0 or self.omega.shape[-1] != E:
            self.omega = self.mechanism.omega(E, query.device, torch.float32)
        elif self.training and self.redraw_interval and self._calls % self.redraw_interval == 0 and self._calls:
            self.redraw_features(E)
        if self.training:
            self._calls += 1
        p = _prepare(self.mechanism, query, key, value, attn_mask, is_causal, scale, dropout_p, enable_gqa,
                     need_weights)
        out, w = self.mechanism._forward(p.q, p.k, p.v, key_keep=p.key_keep, attn_mask=p.mask,
                                         is_causal=is_causal, scale=p.scale, dropout_p=p.dropout_p,
                                         need_weights=need_weights, omega=self.omega)
        out = out.reshape(p.out_shape)
        return (out, w.reshape(p.out_shape[:-1] + (p.S,))) if need_weights else out
