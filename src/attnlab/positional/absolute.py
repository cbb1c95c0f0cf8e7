"""Absolute position encodings added to token embeddings: sinusoidal (Vaswani et al. 2017) and learned."""
from __future__ import annotations

import math

import torch
from torch import nn

from .base import AbsolutePositional

__all__ = ["sinusoidal_table", "SinusoidalPositionalEncoding", "LearnedPositionalEmbedding"]


def sinusoidal_table(positions: torch.Tensor, d_model: int, base: float = 10000.0,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Integer positions [L] -> [L, d_model]: PE[p, 2i] = sin(p / base^(2i/d)), PE[p, 2i+1] = cos(p / base^(2i/d)).

    Computed in float64 and cast, so a position of 100000 is as exact as position 1.
    """
    if d_model <= 0:
        raise ValueError(f"d_model must be > 0, got {d_model}")
    p = positions.to(torch.float64).unsqueeze(-1)  # (T, 1)
    i = torch.arange(0, d_model, 2, dtype=torch.float64, device=positions.device)  # (ceil(d/2),)
    angle = p / torch.pow(torch.tensor(base, dtype=torch.float64), i / d_model)  # (T, ceil(d/2))
    pe = torch.zeros(positions.shape[0], d_model, dtype=torch.float64, device=positions.device)
    pe[:, 0::2] = torch.sin(angle)
    pe[:, 1::2] = torch.cos(angle[:, : d_model // 2])
    return pe.to(dtype)


class SinusoidalPositionalEncoding(AbsolutePositional):
    """Fixed sinusoids, any length (no table to outgrow). Paper: Vaswani et al. 2017, §3.5."""

    def __init__(self, d_model: int, base: float = 10000.0):
        super().__init__()
        if d_model <= 0:
            raise ValueError(f"d_model must be > 0, got {d_model}")
        self.d_model, self.base = d_model, base

    def encoding(self, positions, dtype):
        return sinusoidal_table(positions, self.d_model, self.base, dtype)

    def forward(self, x, offset=0):
        """x [..., L, d_model] -> x + PE[offset : offset + L]; raises ValueError if x's last dim is not
        ``d_model``."""
        if x.shape[-1] != self.d_model:
            raise ValueError(f"x has {x.shape[-1]} features but the encoding was built for d_model={self.d_model}")
        return super().forward(x, offset)

    def extra_repr(self):
        """The settings shown by ``repr(module)``."""
        return f"d_model={self.d_model}, base={self.base}"


class LearnedPositionalEmbedding(AbsolutePositional):
    """A trained [max_len, d_model] table (BERT, GPT-2); positions past max_len raise."""

    def __init__(self, max_len: int, d_model: int):
        super().__init__()
        if max_len <= 0 or d_model <= 0:
            raise ValueError(f"max_len and d_model must be > 0, got {max_len} and {d_model}")
        self.max_len = max_len
        self.weight = nn.Parameter(torch.randn(max_len, d_model) * 0.02)

    def encoding(self, positions, dtype):
        if positions.numel() and int(positions.max()) >= self.max_len:
            raise ValueError(
                f"position {int(positions.max())} is past the learned table (max_len={self.max_len}); "
                "build the model with a larger max_len or use positional='rope'/'sinusoidal'"
            )
        return self.weight[positions].to(dtype)

    def extra_repr(self):
        """The settings shown by ``repr(module)``."""
        return f"max_len={self.max_len}, d_model={self.weight.shape[1]}"
