"""A decoder-only language model (GPT-style) with KV-cache generation.

Legend: B batch, T tokens in this call, P cached positions (the offset), V vocabulary, d d_model.

Decoding with a cache: each step feeds only the new token; every layer appends its key/value to the
cache and attends over all P + 1 positions, so a step costs O(P·d) instead of the O((P+1)²·d) of
re-running the whole prefix. ``generate`` reserves the cache for prompt + new tokens, so each step appends in
place, and a step's attention (one query against the cache) runs the decode kernel (kernels/decode.py) through
``attnlab.attention``'s decode path. Prompts of different lengths (``prompt_lengths``) are left-padded and
their pads masked as keys: with relative positions (RoPE, ALiBi, T5, none) a padded row computes what the
prompt alone would.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .. import positional as PE
from .blocks import Decoder
from .cache import KVCache

__all__ = ["TransformerLM", "sample_next"]


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token ids [B] from logits [B, V]: greedy when temperature == 0, else sample from
    softmax(logits / temperature) restricted to the top_k tokens and/or the smallest set whose
    probability reaches top_p (nucleus sampling, Holtzman et al. 2020)."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
            math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"sample_next: temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass *before* it already reaches top_p (the top token always stays)
        drop = (probs.cumsum(-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


class TransformerLM(nn.Module):
    """Token embedding (+ absolute positions) -> N causal decoder blocks -> final norm -> tied LM head.

    Args:
        vocab_size, d_model, num_heads, num_layers: the usual sizes.
        d_ff: feed-forward width (default 4·d_model).
        max_len: the longest sequence (prompt + generated) the model accepts.
        mechanism / pattern / scale: for every self-attention layer (see MultiHeadAttention).
        positional: "rope" (default), "sinusoidal", "learned", "alibi", "t5" or "none".
        norm_first: pre-norm (default) or post-norm blocks.
        num_kv_heads: grouped-query attention.
    """

    def __init__(self, vocab_size: int, d_model: int, num_heads: int, num_layers: int, *, d_ff: int | None = None,
                 max_len: int = 2048, mechanism="auto", pattern=None, positional: str = "rope",
                 scale: float | None = None, norm_first: bool = True, dropout: float = 0.0,
                 num_kv_heads: int | None = None, activation: str = "gelu", tie_weights: bool = True):
        super().__init__()
        if vocab_size <= 0 or max_len <= 0:
            raise ValueError(f"vocab_size and max_len must be > 0, got {vocab_size} and {max_len}")
        if d_model % num_heads:
            raise ValueError(f"num_heads ({num_heads}) must divide d_model ({d_model})")
        self.vocab_size, self.d_model, self.max_len = vocab_size, d_model, max_len
        self.positional_name = positional
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        nn.init.normal_(self.tok_emb.weight, std=0.02)
        self.pos_emb, attn_pos = PE.build(positional, d_model=d_model, num_heads=num_heads,
                                          head_dim=d_model // num_heads, max_len=max_len)
        self.drop = nn.Dropout(dropout)
        self.decoder = Decoder(d_model, num_heads, num_layers, cross_attention=False, d_ff=d_ff,
                               num_kv_heads=num_kv_heads, dropout=dropout, activation=activation,
                               norm_first=norm_first, mechanism=mechanism, pattern=pattern, positional=attn_pos,
                               scale=scale)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        if tie_weights:
            self.lm_head.weight = self.tok_emb.weight

    @property
    def layers(self):
        """The decoder blocks (an nn.ModuleList of DecoderLayer without cross-attention)."""
        return self.decoder.layers

    def new_cache(self) -> KVCache:
        """An empty KV cache for this model (one LayerCache per layer)."""
        return self.decoder.new_cache()

    def set_mechanism(self, mechanism="auto", pattern=None) -> "TransformerLM":
        """Switch every self-attention layer to ``mechanism`` and ``pattern`` in place (the weights stay);
        returns the model. See MultiHeadAttention for the accepted values."""
        for layer in self.decoder.layers:
            layer.self_attn.mechanism = mechanism
            layer.self_attn.pattern = pattern
        return self

    def forward(self, ids: torch.Tensor, *, cache: KVCache | None = None,
                key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """ids [B, T] -> logits [B, T, V]. With ``cache``, ids continue the cached sequence.
        ``key_padding_mask`` bool [B, P + T] (P cached positions), True = ignore that key (left padding)."""
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError(f"ids must be an integer tensor [batch, tokens], got {getattr(ids, 'shape', ids)!r}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.vocab_size}), got range "
                             f"[{int(ids.min())}, {int(ids.max())}]")
        offset = 0
        if cache is not None:
            if not isinstance(cache, KVCache):
                raise TypeError(f"cache must be an attnlab.nn.KVCache from model.new_cache(), got {type(cache).__name__}")
            cache.check(self.decoder, len(self.decoder.layers))
            offset = cache.length
        if offset + ids.shape[1] > self.max_len:
            raise ValueError(f"sequence of {offset + ids.shape[1]} tokens (cache {offset} + {ids.shape[1]} new) is longer "
                             f"than max_len={self.max_len}")
        x = self.tok_emb(ids)  # (B, T, d)
        if self.pos_emb is not None:
            x = self.pos_emb(x, offset)
        x = self.decoder(self.drop(x), is_causal=True, cache=cache, tgt_key_padding_mask=key_padding_mask)
        return self.lm_head(x)  # (B, T, V)

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, eos_id: int | None = None,
                 seed: int | None = None, use_cache: bool = True, return_logits: bool = False,
                 prompt_lengths: torch.Tensor | None = None, pad_id: int = 0):
        """Continue prompt_ids [B, T0] by up to max_new_tokens -> ids [B, T0 + n] (and, with
        return_logits, the logits [B, n, V] each token was drawn from).

        temperature 0 is greedy; ``seed`` makes sampling reproducible (the same seed gives the same
        tokens with and without the cache). After ``eos_id`` a sequence keeps emitting eos_id; generation
        stops early when every sequence has finished.

        Batched prompts of different lengths: ``prompt_lengths`` int [B], row b's prompt being
        ``prompt_ids[b, :prompt_lengths[b]]`` (right padding). Row b of the result is its prompt, its n new
        tokens, then ``pad_id`` up to T0 + n; greedy, each row gets the tokens its prompt alone would (to
        float rounding). Internally the prompts are left-padded and the pads masked as keys, which needs
        relative positions (positional "rope", "alibi", "t5" or "none": ValueError otherwise).
        """
        if isinstance(prompt_ids, torch.Tensor) and prompt_ids.dim() == 1:
            prompt_ids = prompt_ids.unsqueeze(0)
        if not isinstance(prompt_ids, torch.Tensor) or prompt_ids.dim() != 2 or prompt_ids.shape[1] == 0:
            raise ValueError(f"prompt_ids must be a non-empty integer tensor [batch, tokens], got "
                             f"{getattr(prompt_ids, 'shape', prompt_ids)!r}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
                math.isfinite(temperature) and temperature >= 0):  # nan passed `< 0` and failed in torch.multinomial
            raise ValueError(f"TransformerLM.generate: temperature must be a finite number >= 0 (0 = greedy), got "
                             f"{temperature!r}")
        if top_k is not None and (not isinstance(top_k, int) or top_k <= 0):
            raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
        if top_p is not None and not (0.0 < top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")
        if prompt_ids.shape[1] + max_new_tokens > self.max_len:
            raise ValueError(f"prompt ({prompt_ids.shape[1]}) + max_new_tokens ({max_new_tokens}) exceeds "
                             f"max_len={self.max_len}")
        shift = None
        if prompt_lengths is not None:
            shift = self._left_pad_shift(prompt_ids, prompt_lengths)
            prompt_ids = _roll_rows(prompt_ids, shift)  # (B, T0) left-padded
        was_training = self.training
        self.eval()
        gen = None
        if seed is not None:
            gen = torch.Generator(device=prompt_ids.device).manual_seed(seed)
        ids = prompt_ids
        B, T0 = ids.shape
        finished = torch.zeros(B, dtype=torch.bool, device=ids.device)
        cache = self.new_cache() if use_cache else None
        if cache is not None:
            cache.reserve(T0 + max_new_tokens)  # every step appends in place
        pads = None  # (B, T0 + steps) bool, True = a pad key
        if shift is not None:
            pads = torch.arange(T0, device=ids.device).unsqueeze(0) < shift.unsqueeze(1)
        step_logits = []
        try:
            logits = self(ids, cache=cache, key_padding_mask=pads)[:, -1]  # (B, V)
            for step in range(max_new_tokens):
                step_logits.append(logits)
                nxt = sample_next(logits, temperature, top_k, top_p, gen)  # (B,)
                if eos_id is not None:
                    nxt = torch.where(finished, torch.full_like(nxt, eos_id), nxt)
                    finished |= nxt == eos_id
                ids = torch.cat([ids, nxt.unsqueeze(1)], dim=1)
                if pads is not None:
                    pads = torch.cat([pads, pads.new_zeros(B, 1)], dim=1)
                if (eos_id is not None and bool(finished.all())) or step == max_new_tokens - 1:
                    break
                logits = (self(nxt.unsqueeze(1), cache=cache, key_padding_mask=pads) if use_cache
                          else self(ids, key_padding_mask=pads))[:, -1]
        finally:
            self.train(was_training)
        if shift is not None:  # back to right padding: prompt, new tokens, pad_id
            ids = _roll_rows(ids, -shift)
            n = ids.shape[1] - T0
            keep = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0) < (T0 - shift + n).unsqueeze(1)
            ids = ids.masked_fill(~keep, pad_id)
        if return_logits:
            V = self.vocab_size
            return ids, torch.stack(step_logits, 1) if step_logits else ids.new_zeros(B, 0, V, dtype=torch.float32)
        return ids

    def _left_pad_shift(self, prompt_ids: torch.Tensor, prompt_lengths) -> torch.Tensor:
        """The shift [B] that left-pads each row of right-padded prompts (T0 - length), checked."""
        B, T0 = prompt_ids.shape
        if self.positional_name not in ("rope", "alibi", "t5", "none"):
            raise ValueError(f"prompt_lengths (left padding) needs relative positions (rope, alibi, t5 or none); this "
                             f"model's positional is {self.positional_name!r}: generate the prompts one at a time")
        n = torch.as_tensor(prompt_lengths)
        if n.dtype.is_floating_point or n.dtype == torch.bool or n.shape != (B,):
            raise ValueError(f"prompt_lengths must be an integer tensor [B] = [{B}], got {n!r:.60}")
        if bool((n < 1).any()) or bool((n > T0).any()):
            raise ValueError(f"prompt_lengths must be in [1, {T0}] (prompt_ids {list(prompt_ids.shape)}), got {n.tolist()}")
        return (T0 - n).to(device=prompt_ids.device, dtype=torch.int64)


def _roll_rows(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Row b of x [B, T] rotated right by shift[b] (negative: left)."""
    T = x.shape[1]
    j = (torch.arange(T, device=x.device).unsqueeze(0) - shift.unsqueeze(1)) % T  # (B, T)
    return x.gather(1, j)
