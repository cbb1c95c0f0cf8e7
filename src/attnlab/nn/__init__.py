"""attnlab.nn: multi-head attention, encoder/decoder blocks, KV cache and generation as nn.Modules."""
from __future__ import annotations

from .attention import AttentionIntermediates, MultiHeadAttention
from .cache import KVCache, LayerCache

__all__ = ["MultiHeadAttention", "AttentionIntermediates", "KVCache", "LayerCache"]
