"""Transformer blocks built on attnlab.nn.MultiHeadAttention: feed-forward, encoder and decoder layers
and stacks, and the encoder-decoder Transformer (Vaswani et al. 2017, §3.1).

Legend: B batch, T target/query length, S source/memory length, d d_model.

Post-norm (the paper, BERT):  x = LN(x + Attn(x));  x = LN(x + FFN(x))
Pre-norm  (GPT-2 onwards):    x = x + Attn(LN(x));  x = x + FFN(LN(x)), then one final LN
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .attention import AttentionIntermediates, MultiHeadAttention
from .cache import KVCache, LayerCache

__all__ = ["FeedForward", "EncoderLayer", "DecoderLayer", "Encoder", "Decoder", "Transformer", "ACTIVATIONS"]

ACTIVATIONS = {
    "gelu": lambda: nn.GELU(),  # exact erf form (BERT, the MiniLM checkpoint)
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
    "relu": lambda: nn.ReLU(),
    "silu": lambda: nn.SiLU(),
}


def _activation(name: str) -> nn.Module:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {name!r}")
    return ACTIVATIONS[name]()


class FeedForward(nn.Module):
    """FFN(x) = W_2 · act(W_1 x + b_1) + b_2, position-wise: [B, T, d] -> [B, T, d]; d_ff defaults to 4d."""

    def __init__(self, d_model: int, d_ff: int | None = None, *, activation: str = "gelu", dropout: float = 0.0,
                 bias: bool = True):
        super().__init__()
        d_ff = 4 * d_model if d_ff is None else d_ff
        self.linear1 = nn.Linear(d_model, d_ff, bias=bias)
        self.act = _activation(activation)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.dropout(self.act(self.linear1(x))))


def _attn(d_model, num_heads, num_kv_heads, dropout, bias, mechanism, pattern, positional, scale, **extra):
    return MultiHeadAttention(d_model, num_heads, num_kv_heads=num_kv_heads, bias=bias, dropout=dropout,
                              mechanism=mechanism, pattern=pattern, positional=positional, scale=scale, **extra)


class EncoderLayer(nn.Module):
    """Self-attention + feed-forward with residuals, pre- or post-norm: [B, T, d] -> [B, T, d].

    Submodules: ``self_attn`` (MultiHeadAttention), ``ffn`` (FeedForward), ``norm1``, ``norm2``.
    """

    def __init__(self, d_model: int, num_heads: int, d_ff: int | None = None, *, num_kv_heads: int | None = None,
                 dropout: float = 0.0, attention_dropout: float | None = None, activation: str = "gelu",
                 norm_first: bool = True, layer_norm_eps: float = 1e-5, bias: bool = True, mechanism="auto",
                 pattern=None, positional=None, scale: float | None = None):
        super().__init__()
        adrop = dropout if attention_dropout is None else attention_dropout
        self.self_attn = _attn(d_model, num_heads, num_kv_heads, adrop, bias, mechanism, pattern, positional, scale)
        self.ffn = FeedForward(d_model, d_ff, activation=activation, dropout=dropout, bias=bias)
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.dropout1, self.dropout2 = nn.Dropout(dropout), nn.Dropout(dropout)
        self.norm_first = norm_first

    def forward_intermediates(self, x, *, key_padding_mask=None, attn_mask=None, is_causal=False,
                              need_weights=False) -> tuple[torch.Tensor, AttentionIntermediates]:
        h = self.norm1(x) if self.norm_first else x
        r = self.self_attn.forward_intermediates(h, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                                                 is_causal=is_causal, need_weights=need_weights)
        if self.norm_first:
            x = x + self.dropout1(r.output)
            x = x + self.dropout2(self.ffn(self.norm2(x)))
        else:
            x = self.norm1(x + self.dropout1(r.output))
            x = self.norm2(x + self.dropout2(self.ffn(x)))
        return x, r

    def forward(self, x: torch.Tensor, key_padding_mask=None, attn_mask=None, is_causal: bool = False) -> torch.Tensor:
        return self.forward_intermediates(x, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                                          is_causal=is_causal)[0]


class DecoderLayer(nn.Module):
    """Causal self-attention, cross-attention to the encoder memory (unless ``cross_attention=False``,
    a decoder-only block), feed-forward. Submodules: ``self_attn``, ``cross_attn``, ``ffn``, ``norm1..3``.
    """

    def __init__(self, d_model: int, num_heads: int, d_ff: int | None = None, *, cross_attention: bool = True,
                 num_kv_heads: int | None = None, dropout: float = 0.0, activation: str = "gelu",
                 norm_first: bool = True, layer_norm_eps: float = 1e-5, bias: bool = True, mechanism="auto",
                 pattern=None, positional=None, scale: float | None = None, cross_mechanism="auto"):
        super().__init__()
        self.self_attn = _attn(d_model, num_heads, num_kv_heads, dropout, bias, mechanism, pattern, positional, scale)
        # cross-attention sees every memory position: no causal pattern, no positional rotation
        self.cross_attn = (_attn(d_model, num_heads, num_kv_heads, dropout, bias, cross_mechanism, None, None, scale)
                           if cross_attention else None)
        self.ffn = FeedForward(d_model, d_ff, activation=activation, dropout=dropout, bias=bias)
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps) if cross_attention else None
        self.norm3 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.drop = nn.Dropout(dropout)
        self.norm_first = norm_first

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None, *, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, tgt_mask=None, is_causal: bool = True,
                cache: LayerCache | None = None, cross_cache: LayerCache | None = None) -> torch.Tensor:
        """x [B, T, d], memory [B, S, d] -> [B, T, d]; ``cache`` / ``cross_cache`` for incremental decoding."""
        if self.cross_attn is not None and memory is None and not (cross_cache is not None and cross_cache.length):
            raise ValueError("this DecoderLayer has cross-attention: pass memory [B, S, d_model] from the encoder")
        if self.cross_attn is None and memory is not None:
            raise ValueError("this DecoderLayer was built with cross_attention=False; do not pass memory")

        def sa(h):
            return self.self_attn(h, key_padding_mask=tgt_key_padding_mask, attn_mask=tgt_mask, is_causal=is_causal,
                                  cache=cache)[0]

        def ca(h):
            return self.cross_attn(h, memory, memory, key_padding_mask=memory_key_padding_mask, cache=cross_cache)[0]

        if self.norm_first:
            x = x + self.drop(sa(self.norm1(x)))
            if self.cross_attn is not None:
                x = x + self.drop(ca(self.norm2(x)))
            x = x + self.drop(self.ffn(self.norm3(x)))
        else:
            x = self.norm1(x + self.drop(sa(x)))
            if self.cross_attn is not None:
                x = self.norm2(x + self.drop(ca(x)))
            x = self.norm3(x + self.drop(self.ffn(x)))
        return x


class Encoder(nn.Module):
    """A stack of EncoderLayers (+ a final LayerNorm when pre-norm): x [B, T, d] -> [B, T, d].

    ``layer_kwargs`` are EncoderLayer's keyword arguments (d_ff, num_kv_heads, dropout, activation,
    norm_first, layer_norm_eps, bias, mechanism, pattern, positional, scale).
    """

    def __init__(self, d_model: int, num_heads: int, num_layers: int, **layer_kwargs):
        super().__init__()
        if num_layers <= 0:
            raise ValueError(f"num_layers must be > 0, got {num_layers}")
        self.layers = nn.ModuleList(EncoderLayer(d_model, num_heads, **layer_kwargs) for _ in range(num_layers))
        norm_first = layer_kwargs.get("norm_first", True)
        self.norm = nn.LayerNorm(d_model, eps=layer_kwargs.get("layer_norm_eps", 1e-5)) if norm_first else None
        self.d_model = d_model

    def forward(self, x: torch.Tensor, key_padding_mask=None, attn_mask=None, is_causal: bool = False) -> torch.Tensor:
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must be [batch, seq, d_model={self.d_model}], got {list(x.shape)}")
        for layer in self.layers:
            x = layer(x, key_padding_mask=key_padding_mask, attn_mask=attn_mask, is_causal=is_causal)
        return self.norm(x) if self.norm is not None else x


class Decoder(nn.Module):
    """A stack of DecoderLayers (+ final LayerNorm when pre-norm); x [B, T, d], memory [B, S, d]."""

    def __init__(self, d_model: int, num_heads: int, num_layers: int, *, cross_attention: bool = True,
                 **layer_kwargs):
        super().__init__()
        if num_layers <= 0:
            raise ValueError(f"num_layers must be > 0, got {num_layers}")
        self.layers = nn.ModuleList(DecoderLayer(d_model, num_heads, cross_attention=cross_attention, **layer_kwargs)
                                    for _ in range(num_layers))
        norm_first = layer_kwargs.get("norm_first", True)
        self.norm = nn.LayerNorm(d_model, eps=layer_kwargs.get("layer_norm_eps", 1e-5)) if norm_first else None
        self.cross_attention, self.d_model = cross_attention, d_model

    def new_cache(self) -> KVCache:
        return KVCache(len(self.layers), cross=self.cross_attention, owner=self)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None, *, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, tgt_mask=None, is_causal: bool = True,
                cache: KVCache | None = None) -> torch.Tensor:
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must be [batch, seq, d_model={self.d_model}], got {list(x.shape)}")
        if cache is not None:
            if not isinstance(cache, KVCache):
                raise TypeError(f"cache must be an attnlab.nn.KVCache from new_cache(), got {type(cache).__name__}")
            cache.check(self, len(self.layers))
        for i, layer in enumerate(self.layers):
            x = layer(x, memory, tgt_key_padding_mask=tgt_key_padding_mask,
                      memory_key_padding_mask=memory_key_padding_mask, tgt_mask=tgt_mask, is_causal=is_causal,
                      cache=cache.self_attn[i] if cache is not None else None,
                      cross_cache=cache.cross_attn[i] if cache is not None and cache.cross_attn else None)
        return self.norm(x) if self.norm is not None else x


class Transformer(nn.Module):
    """Encoder-decoder on embeddings (like nn.Transformer, batch first): src [B, S, d], tgt [B, T, d]
    -> [B, T, d]. ``encode`` and ``decode`` are separate so decoding can reuse the memory and a cache."""

    def __init__(self, d_model: int = 512, num_heads: int = 8, num_encoder_layers: int = 6,
                 num_decoder_layers: int = 6, **layer_kwargs):
        super().__init__()
        self.encoder = Encoder(d_model, num_heads, num_encoder_layers, **layer_kwargs)
        self.decoder = Decoder(d_model, num_heads, num_decoder_layers, cross_attention=True, **layer_kwargs)

    def encode(self, src, src_key_padding_mask=None):
        return self.encoder(src, key_padding_mask=src_key_padding_mask)

    def decode(self, tgt, memory, *, tgt_key_padding_mask=None, memory_key_padding_mask=None, cache=None):
        return self.decoder(tgt, memory, tgt_key_padding_mask=tgt_key_padding_mask,
                            memory_key_padding_mask=memory_key_padding_mask, cache=cache)

    def new_cache(self) -> KVCache:
        return self.decoder.new_cache()

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, *, src_key_padding_mask=None,
                tgt_key_padding_mask=None) -> torch.Tensor:
        memory = self.encode(src, src_key_padding_mask)
        return self.decode(tgt, memory, tgt_key_padding_mask=tgt_key_padding_mask,
                           memory_key_padding_mask=src_key_padding_mask)
