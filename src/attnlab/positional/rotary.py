"""Rotary position embedding (RoPE; Su et al. 2021, "RoFormer").

Pairs of features (x_i, x_{i+D/2}) are rotated by angle p·θ_i with θ_i = base^(-2i/D), so
q_p · k_r depends on p and r only through p - r. The half-split pairing is GPT-NeoX/LLaMA's.
"""
from __future__ import annotations

import torch

from .base import AttentionPositional

__all__ = ["RotaryEmbedding", "rotate_half"]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] = (x1, x2) split in halves -> (-x2, x1), same shape: multiplying by sin and adding
    x·cos rotates each pair (x_i, x_{i+D/2}) (GPT-NeoX/LLaMA's half-split pairing)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(AttentionPositional):
    """apply(q, k, q_pos, k_pos) rotates the first ``rotary_dim`` features (default all) of q and k.

    Cost: O((L + S)·D) per call, nothing L×S; composes with every mechanism and pattern because it
    only changes q and k.
    """

    def __init__(self, head_dim: int, base: float = 10000.0, rotary_dim: int | None = None):
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(f"rotary_dim must be even and in (0, head_dim={head_dim}], got {rotary_dim}")
        self.head_dim, self.rotary_dim, self.base = head_dim, rotary_dim, base
        inv = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)  # (rd/2,)
        self.register_buffer("inv_freq", inv, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos, sin [T, rotary_dim] for integer positions [T] (angles in float64, then cast)."""
        ang = positions.to(torch.float64).unsqueeze(-1) * self.inv_freq.to(positions.device)  # (T, rd/2)
        ang = torch.cat((ang, ang), dim=-1)  # (T, rd)
        return ang.cos().to(dtype), ang.sin().to(dtype)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [..., T, D] at positions [T] -> rotated x, same shape."""
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"RoPE was built for head_dim={self.head_dim}, got tensor {list(x.shape)}")
        cos, sin = self.cos_sin(positions, x.dtype)
        rd = self.rotary_dim
        xr, xp = x[..., :rd], x[..., rd:]
        xr = xr * cos + rotate_half(xr) * sin
        return torch.cat((xr, xp), dim=-1) if rd < self.head_dim else xr

    def apply(self, q, k, q_pos, k_pos):
        """q [B, H, L, E] at positions q_pos [L] and k [B, Hkv, S, E] at k_pos [S] -> both rotated, same
        shapes; equivalent to ``(self.rotate(q, q_pos), self.rotate(k, k_pos))``."""
        return self.rotate(q, q_pos), self.rotate(k, k_pos)

    def extra_repr(self):
        """The settings shown by ``repr(module)``."""
        return f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, base={self.base}"
