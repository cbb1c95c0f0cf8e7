"""Positional encodings: absolute (sinusoidal, learned) added to token embeddings, and relative ones
(rotary, ALiBi, T5 bias) applied inside attention, with position offsets for KV-cache decoding."""
from __future__ import annotations

from .absolute import LearnedPositionalEmbedding, SinusoidalPositionalEncoding, sinusoidal_table
from .base import AbsolutePositional, AttentionPositional
from .bias import ALiBi, T5RelativeBias, alibi_slopes, t5_relative_bucket
from .rotary import RotaryEmbedding

__all__ = [
    "AbsolutePositional", "AttentionPositional", "SinusoidalPositionalEncoding", "LearnedPositionalEmbedding",
    "RotaryEmbedding", "ALiBi", "T5RelativeBias", "sinusoidal_table", "alibi_slopes", "t5_relative_bucket",
    "NAMES", "build",
]

#: names accepted by ``build`` (and by ``TransformerLM(positional=...)``)
NAMES = ("none", "sinusoidal", "learned", "rope", "alibi", "t5")


def build(name: str | None, *, d_model: int, num_heads: int, head_dim: int, max_len: int):
    """(absolute, in_attention) modules for a positional scheme name; either may be None.

    "sinusoidal"/"learned" are added to the token embeddings; "rope", "alibi" and "t5" act inside
    every attention layer (one shared module, so every layer uses the same rotation or bias).
    """
    if name is None or name == "none":
        return None, None
    if not isinstance(name, str):
        raise TypeError(f"positional must be a name {NAMES} or None, got {type(name).__name__}")
    if name == "sinusoidal":
        return SinusoidalPositionalEncoding(d_model), None
    if name == "learned":
        return LearnedPositionalEmbedding(max_len, d_model), None
    if name == "rope":
        return None, RotaryEmbedding(head_dim)
    if name == "alibi":
        return None, ALiBi(num_heads)
    if name == "t5":
        return None, T5RelativeBias(num_heads, bidirectional=False)
    raise ValueError(f"unknown positional encoding {name!r}; choose one of {NAMES}")
