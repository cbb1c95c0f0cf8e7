"""Transformer blocks built on attnlab.nn.MultiHeadAttention: feed-forward, encoder and decoder layers
and stacks, and the encoder-decoder Transformer (Vaswani et al. 2017, §3.1).

Legend: B batch, L target/query length, S source/memory (key) length, d d_model (house legend: H heads,
Hkv key/value heads, E head dim).

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
    """FFN(x) = W_2 · act(W_1 x + b_1) + b_2, position-wise: [B, L, d] -> [B, L, d]; d_ff defaults to 4d."""

    def __init__(self, d_model: int, d_ff: int | None = None, *, activation: str = "gelu", dropout: float = 0.0,
                 bias: bool = True):
        super().__init__()
        d_ff = 4 * d_model if d_ff is None else d_ff
        self.linear1 = nn.Linear(d_model, d_ff, bias=bias)
        self.act = _activation(activation)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., d] -> [..., d], each position independently (dropout after the activation)."""
        return self.linear2(self.dropout(self.act(self.linear1(x))))


def _attn(d_model, num_heads, num_kv_heads, dropout, bias, mechanism, pattern, positional, scale, **extra):
    return MultiHeadAttention(d_model, num_heads, num_kv_heads=num_kv_heads, bias=bias, dropout=dropout,
                              mechanism=mechanism, pattern=pattern, positional=positional, scale=scale, **extra)


class EncoderLayer(nn.Module):
    """Self-attention + feed-forward with residuals, pre- or post-norm: [B, L, d] -> [B, L, d].

    Submodules: ``self_attn`` (MultiHeadAttention), ``ffn`` (FeedForward), ``norm1``, ``norm2``.
    """

    def __init__(self, d_model: int, num_heads: int, d_ff: int | None = None, *, num_kv_heads: int | None = None,
                 dropout: float = 0.0, attention_dropout: float | None = None, activation: str = "gelu",
                 norm_first: bool = True, layer_norm_eps: float = 1e-5, bias: bool = True, mechanism="auto",
                 pattern=None, positional=None, scale: float | None = None, head_dim: int | None = None):
        super().__init__()
        adrop = dropout if attention_dropout is None else attention_dropout
        # head_dim: heads narrower or wider than d_model / num_heads (the experiments vary d_k alone)
        self.self_attn = _attn(d_model, num_heads, num_kv_heads, adrop, bias, mechanism, pattern, positional, scale,
                               head_dim=head_dim)
        self.ffn = FeedForward(d_model, d_ff, activation=activation, dropout=dropout, bias=bias)
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.dropout1, self.dropout2 = nn.Dropout(dropout), nn.Dropout(dropout)
        self.norm_first = norm_first

    def forward_intermediates(self, x, *, key_padding_mask=None, attn_mask=None, is_causal=False,
                              need_weights=False) -> tuple[torch.Tensor, AttentionIntermediates]:
        """x [B, L, d] -> (the layer's output [B, L, d], the self-attention's AttentionIntermediates:
        its output [B, L, d], weights [B, H, L, L] with ``need_weights`` else None, and the projected
        q [B, H, L, E], k [B, Hkv, L, E] and v [B, Hkv, L, Ev]). Masks as in :meth:`forward`."""
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
        """x [B, L, d] -> [B, L, d].

        key_padding_mask: bool [B, L], True = ignore that key (nn.MultiheadAttention's polarity);
        attn_mask: bool (True = takes part) or float (added to the scores) of shape [L, L], [B, L, L]
        or [B, H|1, L, L], or an attnlab Pattern;
        is_causal: position i attends to positions <= i. See :class:`MultiHeadAttention`.
        """
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
        """x [B, L, d], memory [B, S, d] -> [B, L, d]; ``cache`` / ``cross_cache`` for incremental decoding."""
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
    """A stack of EncoderLayers (+ a final LayerNorm when pre-norm): x [B, L, d] -> [B, L, d].

    ``layer_kwargs`` are EncoderLayer's keyword arguments (d_ff, num_kv_heads, dropout, activation,
    norm_first, layer_norm_eps, bias, mechanism, pattern, positional, scale, head_dim).
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
        """x [B, L, d] -> [B, L, d] through every layer (masks as in :meth:`EncoderLayer.forward`, the same
        for each layer), then the final LayerNorm when pre-norm. Raises ValueError unless x is
        [B, L, d_model]."""
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must be [batch, seq, d_model={self.d_model}], got {list(x.shape)}")
        for layer in self.layers:
            x = layer(x, key_padding_mask=key_padding_mask, attn_mask=attn_mask, is_causal=is_causal)
        return self.norm(x) if self.norm is not None else x


class Decoder(nn.Module):
    """A stack of DecoderLayers (+ final LayerNorm when pre-norm); x [B, L, d], memory [B, S, d]."""

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
        """An empty KVCache for this decoder: one self-attention LayerCache per layer, plus one
        cross-attention cache per layer when it has cross-attention. Only this decoder accepts it."""
        return KVCache(len(self.layers), cross=self.cross_attention, owner=self)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None, *, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, tgt_mask=None, is_causal: bool = True,
                cache: KVCache | None = None) -> torch.Tensor:
        """x [B, L, d], memory [B, S, d] (None without cross-attention) -> [B, L, d].

        Self-attention is causal by default; ``tgt_key_padding_mask`` [B, L] and
        ``memory_key_padding_mask`` [B, S] are bool, True = ignore that key; ``tgt_mask`` is an extra
        self-attention mask (see :class:`MultiHeadAttention`). With ``cache`` (from :meth:`new_cache`),
        x holds only the new positions: each layer appends their keys/values and attends over the
        cached ones too, so a one-token step costs O(P·d) per layer for P cached positions. Raises
        ValueError unless x is [B, L, d_model], TypeError for a cache that is not a KVCache, and
        ValueError for a cache made by another model.
        """
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
    """Encoder-decoder on embeddings (like nn.Transformer, batch first): src [B, S, d], tgt [B, L, d]
    -> [B, L, d]. ``encode`` and ``decode`` are separate so decoding can reuse the memory and a cache."""

    def __init__(self, d_model: int = 512, num_heads: int = 8, num_encoder_layers: int = 6,
                 num_decoder_layers: int = 6, **layer_kwargs):
        super().__init__()
        self.encoder = Encoder(d_model, num_heads, num_encoder_layers, **layer_kwargs)
        self.decoder = Decoder(d_model, num_heads, num_decoder_layers, cross_attention=True, **layer_kwargs)

    def encode(self, src, src_key_padding_mask=None):
        """src [B, S, d] -> memory [B, S, d] (the encoder stack); ``src_key_padding_mask`` bool [B, S],
        True = ignore that position."""
        return self.encoder(src, key_padding_mask=src_key_padding_mask)

    def decode(self, tgt, memory, *, tgt_key_padding_mask=None, memory_key_padding_mask=None, cache=None):
        """tgt [B, L, d], memory [B, S, d] -> [B, L, d]: the causal decoder stack (see
        :meth:`Decoder.forward`; ``cache`` from :meth:`new_cache` for incremental decoding)."""
        return self.decoder(tgt, memory, tgt_key_padding_mask=tgt_key_padding_mask,
                            memory_key_padding_mask=memory_key_padding_mask, cache=cache)

    def new_cache(self) -> KVCache:
        """An empty KVCache for :meth:`decode` (self- and cross-attention per decoder layer)."""
        return self.decoder.new_cache()

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, *, src_key_padding_mask=None,
                tgt_key_padding_mask=None) -> torch.Tensor:
        """src [B, S, d], tgt [B, L, d] -> [B, L, d]; equivalent to
        ``decode(tgt, encode(src, src_key_padding_mask), tgt_key_padding_mask=...,
        memory_key_padding_mask=src_key_padding_mask)``. Padding masks are bool, True = ignore."""
        memory = self.encode(src, src_key_padding_mask)
        return self.decode(tgt, memory, tgt_key_padding_mask=tgt_key_padding_mask,
                           memory_key_padding_mask=src_key_padding_mask)
