"""Run Hugging Face transformers models on attnlab attention, through transformers' AttentionInterface.

    >>> from attnlab.integrations import hf
    >>> hf.register_all()                               # "attnlab", "attnlab_tiled", "attnlab_performer", ...
    >>> model = BertModel.from_pretrained(path, attn_implementation="attnlab_tiled")
    >>> model.set_attn_implementation("attnlab_sliding_window")

Needs the optional extra ``attnlab[hf]`` (transformers >= 4.48 with AttentionInterface and
AttentionMaskInterface). Each registered name gets an attention function (query [B, H, L, D],
key/value [B, Hkv, S, D] -> output [B, L, H, Dv], weights | None) and the sdpa-style mask function
(bool [B, 1, L, S], True = attend, or None when nothing is masked).
"""
from __future__ import annotations

import torch

from .. import patterns as P
from ..functional import METHODS, attention

__all__ = ["register", "register_all", "attention_function", "registered"]

_REGISTERED: dict[str, tuple] = {}


def _interfaces():
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as e:
        raise ImportError(
            "attnlab.integrations.hf needs transformers with AttentionInterface (>= 4.48): "
            "pip install 'attnlab[hf]'"
        ) from e
    return AttentionInterface, AttentionMaskInterface, sdpa_mask


def _key_only(mask: torch.Tensor) -> torch.Tensor:
    """[B, 1, L, S] -> [B, 1, 1, S] when every query row has the same mask (padding only), so that
    mechanisms that accept only key-padding masks can run it."""
    if mask.shape[-2] > 1 and bool((mask == mask[..., :1, :]).all()):
        return mask[..., :1, :]
    return mask


def attention_function(mechanism="auto", pattern: P.Pattern | None = None):
    """An AttentionInterface function running ``mechanism`` (a core method name, a registered
    mechanism name or instance), restricted to ``pattern``.

    The function has transformers' signature ``f(module, query [B, H, L, E], key [B, Hkv, S, E],
    value [B, Hkv, S, Ev], attention_mask, scaling=None, dropout=0.0, **kwargs)`` and returns
    (output [B, L, H, Ev], weights [B, H, L, S] with ``output_attentions``, else None). GQA is enabled
    when Hkv != H; dropout applies only in training mode. Raises TypeError for a ``pattern`` that is
    not an attnlab Pattern.
    """
    if pattern is not None and not isinstance(pattern, P.Pattern):
        raise TypeError(f"pattern must be an attnlab Pattern or None, got {type(pattern).__name__}")
    if isinstance(mechanism, str) and mechanism in METHODS:
        mech = mechanism
    else:
        from .. import mechanisms

        mech = mechanisms.resolve(mechanism)

    def attnlab_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        L = query.shape[2]
        is_causal = kwargs.get("is_causal")
        if is_causal is None:
            is_causal = bool(getattr(module, "is_causal", False)) and attention_mask is None and L > 1
        need_weights = bool(kwargs.get("output_attentions", False))
        gqa = query.shape[1] != key.shape[1]
        dropout_p = dropout if module.training else 0.0
        mask = attention_mask
        pat = pattern  # HF's own sliding windows already arrive inside attention_mask
        if isinstance(mech, str):
            method = "auto" if need_weights and mech in ("sdpa", "sparse") else mech
            r = attention(query, key, value, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scaling,
                          enable_gqa=gqa, pattern=pat, method=method, need_weights=need_weights)
        else:
            if pat is not None:
                keep = pat.materialize(L, key.shape[2], device=query.device).view(1, 1, L, key.shape[2])
                mask = keep if mask is None else (mask & keep if mask.dtype == torch.bool
                                                  else mask.masked_fill(~keep, float("-inf")))
            if mask is not None and mask.dtype == torch.bool:
                mask = _key_only(mask)
            r = mech(query, key, value, attn_mask=mask, is_causal=is_causal, scale=scaling, dropout_p=dropout_p,
                     enable_gqa=gqa, need_weights=need_weights)
        out, weights = r if need_weights else (r, None)
        return out.transpose(1, 2).contiguous(), weights  # (B, L, H, Dv)

    attnlab_attention.mechanism, attnlab_attention.pattern = mechanism, pattern
    return attnlab_attention


def register(name: str = "attnlab", mechanism="auto", pattern: P.Pattern | None = None) -> str:
    """Register ``mechanism`` (and ``pattern``) with transformers as attn_implementation ``name``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    AttentionInterface, AttentionMaskInterface, sdpa_mask = _interfaces()
    fn = attention_function(mechanism, pattern)
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, sdpa_mask)
    _REGISTERED[name] = (mechanism, pattern)
    return name


def register_all() -> list[str]:
    """"attnlab" (auto) and "attnlab_<name>" for every core method and registered mechanism that has
    default hyperparameters (others: ``register(name, attnlab.mechanisms.get(m, **params))``).
    Returns the names."""
    names = [register("attnlab", "auto")]
    try:
        from .. import mechanisms

        available = list(mechanisms.available())
    except ImportError:
        available = list(METHODS)
    for m in dict.fromkeys(list(METHODS[1:]) + available):
        if m == "auto":
            continue
        try:
            names.append(register(f"attnlab_{m}", m))
        except TypeError:  # needs parameters without defaults (block_sparse's layout): register(name, get(...))
            continue
    return names


def registered() -> dict[str, tuple]:
    """name -> (mechanism, pattern) for everything this process registered."""
    return dict(_REGISTERED)
