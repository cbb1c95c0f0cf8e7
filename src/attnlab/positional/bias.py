"""Relative position biases added to attention scores: ALiBi (Press et al. 2022) and T5's bucketed
learned bias (Raffel et al. 2020). Both give a float [H, L, S] bias, so they need a mechanism that
accepts a float attn_mask (every exact attnlab method does)."""
from __future__ import annotations

import math

import torch
from torch import nn

from .base import AttentionPositional

__all__ = ["alibi_slopes", "ALiBi", "t5_relative_bucket", "T5RelativeBias"]


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """Head slopes: the geometric sequence 2^(-8/n), 2^(-16/n), ... for n a power of two; otherwise
    the slopes of the next lower power of two, then every other slope of twice that (the paper's rule)."""
    if num_heads <= 0:
        raise ValueError(f"num_heads must be > 0, got {num_heads}")

    def pow2(n):
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(num_heads).is_integer():
        s = pow2(num_heads)
    else:
        closest = 2 ** math.floor(math.log2(num_heads))
        s = pow2(closest) + pow2(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(s, dtype=torch.float64)


class ALiBi(AttentionPositional):
    """bias[h, i, j] = -slope_h · |p_i - p_j| (causal models only ever see j <= i). No parameters."""

    has_bias = True

    def __init__(self, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.register_buffer("slopes", alibi_slopes(num_heads), persistent=False)

    def bias(self, q_pos, k_pos):
        """Float32 bias [H, L, S] = -slope_h · |q_pos[i] - k_pos[j]| for positions q_pos [L], k_pos [S]
        (computed in float64, then cast). O(H·L·S) memory."""
        d = (q_pos.unsqueeze(-1) - k_pos.unsqueeze(0)).abs().to(torch.float64)  # (L, S)
        return -(self.slopes.to(q_pos.device).view(-1, 1, 1) * d).to(torch.float32)  # (H, L, S)

    def kernel_slopes(self) -> torch.Tensor:
        """The slopes [H] (float64; the compiled kernel reads them as float32, as flash-attn does):
        ``bias`` is exactly ALiBi."""
        return self.slopes

    def extra_repr(self):
        """The settings shown by ``repr(module)``."""
        return f"num_heads={self.num_heads}"


def t5_relative_bucket(relative_position: torch.Tensor, bidirectional: bool = True, num_buckets: int = 32,
                       max_distance: int = 128) -> torch.Tensor:
    """T5's bucket of relative_position = key_pos - query_pos: exact buckets for small distances,
    log-spaced ones up to max_distance, everything further shares the last bucket."""
    buckets = torch.zeros_like(relative_position)
    n = relative_position
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (n > 0).long() * num_buckets
        n = n.abs()
    else:
        n = -torch.clamp(n, max=0)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    large = max_exact + (
        torch.log(n.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).long()
    large = torch.clamp(large, max=num_buckets - 1)
    return buckets + torch.where(is_small, n, large)


class T5RelativeBias(AttentionPositional):
    """A learned scalar per (bucket, head): bias[h, i, j] = table[bucket(p_j - p_i), h]."""

    has_bias = True

    def __init__(self, num_heads: int, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True):
        super().__init__()
        if num_buckets < 2 or max_distance < 2:
            raise ValueError(f"num_buckets and max_distance must be >= 2, got {num_buckets}, {max_distance}")
        self.num_heads, self.num_buckets, self.max_distance = num_heads, num_buckets, max_distance
        self.bidirectional = bidirectional
        self.table = nn.Embedding(num_buckets, num_heads)
        nn.init.normal_(self.table.weight, std=0.02)

    def bias(self, q_pos, k_pos):
        """Learned bias [H, L, S] = table[bucket(k_pos[j] - q_pos[i]), h] for positions q_pos [L],
        k_pos [S], in the table's dtype (differentiable: the table trains with the model)."""
        rel = k_pos.unsqueeze(0) - q_pos.unsqueeze(-1)  # (L, S)
        b = t5_relative_bucket(rel, self.bidirectional, self.num_buckets, self.max_distance)
        return self.table(b).permute(2, 0, 1)  # (H, L, S)

    def extra_repr(self):
        """The settings shown by ``repr(module)``."""
        return (f"num_heads={self.num_heads}, num_buckets={self.num_buckets}, max_distance={self.max_distance}, "
                f"bidirectional={self.bidirectional}")
