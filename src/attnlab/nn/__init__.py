"""attnlab.nn: multi-head attention, encoder/decoder blocks, KV cache and generation as nn.Modules."""
from __future__ import annotations

from .attention import AttentionIntermediates, MultiHeadAttention
from .blocks import Decoder, DecoderLayer, Encoder, EncoderLayer, FeedForward, Transformer
from .cache import KVCache, LayerCache
from .lm import TransformerLM, sample_next

__all__ = [
    "MultiHeadAttention", "AttentionIntermediates", "KVCache", "LayerCache",
    "FeedForward", "EncoderLayer", "DecoderLayer", "Encoder", "Decoder", "Transformer",
    "TransformerLM", "sample_next",
]
