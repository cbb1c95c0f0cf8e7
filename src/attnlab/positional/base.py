"""The two kinds of positional encoding attnlab's modules understand."""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["AbsolutePositional", "AttentionPositional"]


class AbsolutePositional(nn.Module):
    """Added to the token embeddings: forward(x [B, T, d], offset=0) -> x + P[offset : offset + T]."""

    def encoding(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [T, d]
        raise NotImplementedError

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        if x.dim() < 2:
            raise ValueError(f"x must be [..., T, d_model], got {list(x.shape)}")
        pos = torch.arange(offset, offset + x.shape[-2], device=x.device)
        return x + self.encoding(pos, x.dtype)


class AttentionPositional(nn.Module):
    """Acts inside attention, on positions: rotates queries/keys and/or adds a bias to the scores.

    ``apply(q [B, H, L, D], k [B, Hkv, T, D], q_pos [L], k_pos [T]) -> (q, k)`` (identity by default);
    ``bias(q_pos [L], k_pos [S]) -> [H, L, S] | None`` added to the scores (None by default).
    Positions are absolute token indices, so under a KV cache q_pos starts at the cache length.
    """

    #: True when ``bias`` returns a tensor (needs a mechanism that accepts a float attn_mask)
    has_bias: bool = False

    def apply(self, q, k, q_pos, k_pos):
        return q, k

    def bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        return None
