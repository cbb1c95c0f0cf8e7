"""An int8 KV cache for transformers' ``generate``: keys and values stored as ``functional.kvquant.QuantizedKV``
(int8 rows, one float32 scale per token and kv head; keys Hadamard-rotated by default: Note [int8 key rotation])
and read by attnlab's decode kernel as they are.

    >>> from attnlab.integrations import hf_int8
    >>> model.set_attn_implementation(hf_int8.register())          # "attnlab_int8"
    >>> out = model.generate(**ids, cache=hf_int8.int8_cache(model.config), max_new_tokens=32)

Legend: B batch, H query heads, Hkv key/value heads, L new tokens, S cached tokens, D head dim.

Note [HF int8 cache]: transformers' attention modules call ``cache.update(k, v, layer)`` and pass what it returns
to the attention function as key and value. An ``Int8Layer`` writes the new rows into its int8 storage
([B, capacity, Hkv, D], flash-attn's layout, the format's ``encode`` hook) and returns placeholders: [B, Hkv, S, D]
NaN tensors of no storage (a stride-0 expand) that carry the layer's caches. The "attnlab_int8" attention
function recognises them and runs ``attention_with_kvcache`` on the int8 caches (the query through the format's
``query`` hook there; bottom-right causal, so a prefill and every step see exactly the keys before them); a
float mask (padding), asked-for weights or training take the dequantised K/V through the "attnlab" function
instead. Any other attention implementation reads the placeholders as NaN: never silently wrong numbers.
"""
from __future__ import annotations

import math

import torch

from ..functional import kvquant
from ..functional.kvcache import attention_with_kvcache
from ..functional.kvquant import QuantizedKV
from . import hf

__all__ = ["register", "int8_cache", "INT8_IMPLEMENTATION"]

INT8_IMPLEMENTATION = "attnlab_int8"
_STATE: dict = {}


def _placeholder(kc: QuantizedKV, vc: QuantizedKV, n: int, dtype: torch.dtype, which: str) -> torch.Tensor:
    """A [B, Hkv, n, D] NaN tensor with no storage that carries the layer's caches (Note [HF int8 cache])."""
    c = kc if which == "k" else vc
    B, _, Hkv, D = c.shape
    t = torch.full((), float("nan"), dtype=dtype, device=c.data.device).expand(B, Hkv, n, D)
    t._attnlab_int8 = (kc, vc, n)
    return t


def _int8_classes():
    """(Int8Layer, Int8Cache), defined once transformers is importable."""
    if "classes" in _STATE:
        return _STATE["classes"]
    from transformers.cache_utils import DynamicCache, DynamicLayer

    class Int8Layer(DynamicLayer):
        """A DynamicLayer whose keys and values live in int8 storage (``QuantizedKV`` [B, capacity, Hkv, D]);
        ``keys`` / ``values`` are placeholders carrying it (Note [HF int8 cache]). Storage doubles past
        ``capacity``."""

        def __init__(self, capacity: int = 0, rotate: bool = True, smooth: bool = False, **kwargs):
            super().__init__(**kwargs)
            self.capacity, self.rotate, self.smooth = int(capacity), bool(rotate), bool(smooth)
            self.k_cache = self.v_cache = None
            self.n = 0

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            B, Hkv, L, D = key_states.shape
            need = self.n + L
            kc = self.k_cache
            if kc is None or need > kc.shape[1] or kc.shape[0] != B:
                if kc is not None and kc.shape[0] != B:
                    raise NotImplementedError(f"the int8 cache holds a batch of {kc.shape[0]} but this step has "
                                              f"{B} sequences (beam search / batch changes are not supported)")
                cap = max(need, self.capacity, 2 * (kc.shape[1] if kc is not None else 0), 16)
                nk = QuantizedKV.empty(B, cap, Hkv, D, rotate=self.rotate, smooth=self.smooth)
                nv = QuantizedKV.empty(B, cap, Hkv, value_states.shape[3])
                if kc is not None:  # (grown: the rows so far, and the fixed channel scales)
                    for old, new in ((kc, nk), (self.v_cache, nv)):
                        new.data[:, :self.n] = old.data[:, :self.n]
                        new.scale[:, :self.n] = old.scale[:, :self.n]
                        if old.channel is not None:
                            new.channel.copy_(old.channel)
                self.k_cache, self.v_cache = nk, nv
            # both encoded before either is written (functional.kvcache's Note [Checked, then appended])
            kd, ks = kvquant.encode(self.k_cache, key_states.transpose(1, 2))  # (B, L, Hkv, D), (B, L, Hkv)
            vd, vs = kvquant.encode(self.v_cache, value_states.transpose(1, 2))
            self.k_cache.data[:, self.n:need], self.k_cache.scale[:, self.n:need] = kd, ks
            self.v_cache.data[:, self.n:need], self.v_cache.scale[:, self.n:need] = vd, vs
            self.n = need
            self.keys = _placeholder(self.k_cache, self.v_cache, need, key_states.dtype, "k")
            self.values = _placeholder(self.k_cache, self.v_cache, need, value_states.dtype, "v")
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.n

        def crop(self, max_length: int) -> None:
            """Keep the first ``max_length`` rows (negative: drop that many from the end), as DynamicLayer.crop."""
            if max_length < 0:
                max_length = self.n - abs(max_length)
            if self.k_cache is None or self.n <= max_length:
                return
            self.n = max(max_length, 0)
            self.keys = _placeholder(self.k_cache, self.v_cache, self.n, self.keys.dtype, "k")
            self.values = _placeholder(self.k_cache, self.v_cache, self.n, self.values.dtype, "v")

        def batch_repeat_interleave(self, repeats: int) -> None:
            raise NotImplementedError("the int8 cache does not support beam search or batch expansion")

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            raise NotImplementedError("the int8 cache does not support selecting sequences of a batch")

        def reorder_cache(self, beam_idx) -> None:
            raise NotImplementedError("the int8 cache does not support beam search")

        def reset(self) -> None:
            """Drop the cached rows (the storage and the channel scales too)."""
            self.k_cache = self.v_cache = None
            self.n = 0
            super().reset()

    class Int8Cache(DynamicCache):
        """transformers' DynamicCache with its full-attention layers as Int8Layer."""

        def __init__(self, config=None, capacity: int = 0, rotate: bool = True, smooth: bool = False):
            super().__init__(config=config)
            if self.layer_class_to_replicate is not None:
                self.layer_class_to_replicate = lambda: Int8Layer(capacity, rotate, smooth)
            self.layers = [Int8Layer(capacity, rotate, smooth) if type(layer) is DynamicLayer else layer
                           for layer in self.layers]

    _STATE["classes"] = (Int8Layer, Int8Cache)
    return _STATE["classes"]


def int8_cache(config=None, capacity: int = 0, *, rotate: bool = True, smooth: bool = False):
    """A transformers ``DynamicCache`` (pass it as ``cache=``, ``past_key_values=`` before transformers 5.24) whose full-attention layers keep K/V in
    int8 (Note [HF int8 cache]); the model must run on ``register()``'s implementation. ``capacity``: positions
    reserved at the first update; ``rotate``: the keys' Hadamard rotation (Note [int8 key rotation]; with
    ``rotate=False, smooth=False`` the per-token format); ``smooth``: key channel smoothing fixed by the prefill
    (Note [int8 key channel smoothing]). ``config``: the model's config (its layer types; its attn implementation
    is checked)."""
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
        raise ValueError(f"int8_cache: capacity must be an int >= 0 (positions to reserve), got {capacity!r}")
    for name, val in (("rotate", rotate), ("smooth", smooth)):
        if not isinstance(val, bool):
            raise TypeError(f"int8_cache: {name} must be a bool, got {type(val).__name__}")
    impl = getattr(config, "_attn_implementation", None)
    if config is not None and isinstance(impl, str) and impl != INT8_IMPLEMENTATION:
        raise ValueError(f"int8_cache: the model runs attn_implementation={impl!r}, which cannot read an int8 "
                         f"cache; call model.set_attn_implementation(attnlab.integrations.hf_int8.register()) first")
    return _int8_classes()[1](config, capacity, rotate, smooth)


def _dequantized(kc: QuantizedKV, vc: QuantizedKV, n: int, dtype: torch.dtype):
    """The first n rows as [B, Hkv, n, D] tensors of ``dtype``."""
    k = QuantizedKV(kc.data[:, :n], kc.scale[:, :n], kc.channel, kc.rotation).dequantize(dtype)
    v = QuantizedKV(vc.data[:, :n], vc.scale[:, :n]).dequantize(dtype)
    return k.transpose(1, 2), v.transpose(1, 2)


def register(name: str = INT8_IMPLEMENTATION) -> str:
    """Register the attention function that reads an int8 cache (and runs "attnlab" otherwise) with transformers
    as attn_implementation ``name``; returns the name."""

    hf.register(name, "auto")  # the plain function, the mask function, the generation hook
    base = hf.attention_function("auto")
    from transformers import AttentionInterface

    def attnlab_int8_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        st = getattr(key, "_attnlab_int8", None)
        if st is None:  # a full-precision cache
            return base(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
        kc, vc, n = st
        if (attention_mask is not None or module.training or hf._weights_asked(kwargs)
                or (torch.is_grad_enabled() and query.requires_grad)):
            k, v = _dequantized(kc, vc, n, query.dtype)
            return base(module, query, k, v, attention_mask, scaling, dropout, **kwargs)
        D = query.shape[-1]
        out = attention_with_kvcache(query.transpose(1, 2), kc, vc, cache_seqlens=n, is_causal=True,
                                     scale=float(scaling) if scaling is not None else 1.0 / math.sqrt(D),
                                     softcap=kwargs.get("softcap"))
        return out, None  # (B, L, H, Dv)

    AttentionInterface.register(name, attnlab_int8_attention)
    return name
