"""The two kinds of positional encoding attnlab's modules understand."""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["AbsolutePositional", "AttentionPositional"]


class AbsolutePositional(nn.Module):
    """Added to the token embeddings: forward(x [B, L, d_model], offset=0) -> x + P[offset : offset + L].

    Subclasses implement :meth:`encoding`; ``offset`` is the number of positions before ``x`` (the KV
    cache length when decoding).
    """

    def encoding(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [T, d]
        """The encodings P[positions]: integer positions [L] -> [L, d_model] in ``dtype``. Subclasses
        must implement it (the base raises NotImplementedError)."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """x [..., L, d_model] -> x + encoding(offset .. offset + L - 1), same shape (broadcast over the
        leading dims). Raises ValueError if ``x`` has fewer than 2 dims."""
        if x.dim() < 2:
            raise ValueError(f"x must be [..., T, d_model], got {list(x.shape)}")
        pos = torch.arange(offset, offset + x.shape[-2], device=x.device)
        return x + self.encoding(pos, x.dtype)


class AttentionPositional(nn.Module):
    """Acts inside attention, on positions: rotates queries/keys and/or adds a bias to the scores.

    ``apply(q [B, H, L, E], k [B, Hkv, S, E], q_pos [L], k_pos [S]) -> (q, k)`` (identity by default);
    ``bias(q_pos [L], k_pos [S]) -> [H, L, S] | None`` added to the scores (None by default).
    Positions are absolute token indices, so under a KV cache q_pos starts at the cache length.
    """

    #: True when ``bias`` returns a tensor (needs a mechanism that accepts a float attn_mask)
    has_bias: bool = False

    def apply(self, q, k, q_pos, k_pos):
        """Position-dependent queries and keys: q [B, H, L, E], k [B, Hkv, S, E] at integer positions
        q_pos [L], k_pos [S] -> (q, k) of the same shapes. The base returns them unchanged."""
        return q, k

    def bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        """Float bias [H, L, S] added to the attention scores for positions q_pos [L], k_pos [S], or None
        for no bias (the base's answer; subclasses that return one set ``has_bias = True``)."""
        return None

    def kernel_slopes(self) -> torch.Tensor | None:
        """Slopes [H] when ``bias(q_pos, k_pos)`` is ALiBi, −slope_h·|q_pos[i] − k_pos[j]|, so that a kernel
        can compute it from positions (``attnlab.attention(alibi_slopes=)``) instead of reading an
        [H, L, S] tensor; None (the base's answer) for any other bias."""
        return None
