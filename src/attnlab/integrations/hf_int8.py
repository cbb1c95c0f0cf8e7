"""An int8 KV cache for transformers' ``generate``: keys and values stored as ``functional.kvquant.QuantizedKV``
and read by attnlab's decode kernel as they are. By default the group format of Note [int8 KV groups] (one float32
scale per 32 channels of each token and kv head, keys and values) with the keys Hadamard-rotated first (Note [int8
key rotation]) and searched scales (Note [int8 scale search]): llama.cpp q8_0's grouping, at 0.43x its next-token
KL on SmolLM2 (Note [int8 KV format choice] in experiments/kvquant.py), where 32 divides the head dim (``group_size="auto"``; one scale per token and kv head
where it does not); ``group_size=None`` keeps one scale per token and kv head.

    >>> from attnlab.integrations import hf_int8
    >>> model.set_attn_implementation(hf_int8.register())          # "attnlab_int8"
    >>> out = model.generate(**ids, cache=hf_int8.int8_cache(model.config), max_new_tokens=32)

Legend: B batch, H query heads, Hkv key/value heads, L new tokens, S cached tokens, D head dim.

Note [HF int8 cache]: transformers' attention modules call ``cache.update(k, v, layer)`` and pass what it returns
to the attention function as key and value. An ``Int8Layer`` writes the new rows into its int8 storage
([B, capacity, Hkv, D], flash-attn's layout, the format's ``encode`` hook; scales [B, capacity, Hkv, D / group_size],
or [B, capacity, Hkv] per token) and returns placeholders: [B, Hkv, S, D]
NaN tensors of no storage (a stride-0 expand) that carry the layer's caches. The "attnlab_int8" attention
function recognises them and runs ``attention_with_kvcache`` on the int8 caches (the query through the format's
``query`` hook there; bottom-right causal, so a prefill and every step see exactly the keys before them); a
float mask (padding), asked-for weights or training take the dequantised K/V through the "attnlab" function
instead. Any other attention implementation reads the placeholders as NaN: never silently wrong numbers.
The layer's format (rotation, smoothing, group size) is fixed at construction; its storage is allocated at the
first update, where the head dim is known and checked against the group size, grows by doubling past capacity,
and is indexed along the batch for ``reorder_cache`` / ``batch_select_indices`` / ``batch_repeat_interleave``
(beam search), the scales (one more dim in the group format) with their rows.
"""
from __future__ import annotations

import inspect
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

    # Note [Crop semantics]: transformers 5 changed DynamicLayer.crop's argument from a length to keep
    # (`max_length`: n >= 0 keeps the first n rows, n < 0 drops -n) to a count to drop (`tokens_to_remove`: 0 drops
    # nothing, and generate's deferred stop check calls crop(0) every step; a positive count raises). The int8
    # layer follows whichever DynamicLayer is installed, told apart by that parameter's name
    # (tests/models/test_hf_int8.py runs the same crops on both layers).
    _CROP_REMOVES = "tokens_to_remove" in inspect.signature(DynamicLayer.crop).parameters

    class Int8Layer(DynamicLayer):
        """A DynamicLayer whose keys and values live in int8 storage (``QuantizedKV`` [B, capacity, Hkv, D];
        ``group_size``: one scale per that many channels, None one per row: Note [int8 KV groups]); ``keys`` /
        ``values`` are placeholders carrying it (Note [HF int8 cache]). Storage doubles past ``capacity``."""

        def __init__(self, capacity: int = 0, rotate: bool = True, smooth: bool = False,
                     group_size: int | str | None = "auto", **kwargs):
            super().__init__(**kwargs)
            self.capacity, self.rotate, self.smooth = int(capacity), bool(rotate), bool(smooth)
            self.group_size = _check_group_size(group_size)
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
                                              f"{B} sequences (change its batch with batch_select_indices / "
                                              f"batch_repeat_interleave first)")
                if kc is None:  # the head dims are known from here on ("auto" resolved)
                    self.group_size = _check_group_size(self.group_size, D, value_states.shape[3])
                cap = max(need, self.capacity, 2 * (kc.shape[1] if kc is not None else 0), 16)
                gs = self.group_size
                nk = QuantizedKV.empty(B, cap, Hkv, D, rotate=self.rotate, smooth=self.smooth, group_size=gs)
                nv = QuantizedKV.empty(B, cap, Hkv, value_states.shape[3], group_size=gs)
                if kc is not None:  # (grown: the rows so far, their scales, and the fixed channel scales)
                    for old, new in ((kc, nk), (self.v_cache, nv)):
                        new.data[:, :self.n] = old.data[:, :self.n]
                        new.scale[:, :self.n] = old.scale[:, :self.n]
                        if old.channel is not None:
                            new.channel.copy_(old.channel)
                self.k_cache, self.v_cache = nk, nv
            # both encoded before either is written (functional.kvcache's Note [Checked, then appended])
            # (values first: a non-finite value leaves a smoothed key cache's channel scales unfixed, as in
            # functional.cacheargs.check)
            vd, vs = kvquant.encode(self.v_cache, value_states.transpose(1, 2))
            kd, ks = kvquant.encode(self.k_cache, key_states.transpose(1, 2))  # (B, L, Hkv, D), (B, L, Hkv[, ng])
            self.k_cache.data[:, self.n:need], self.k_cache.scale[:, self.n:need] = kd, ks
            self.v_cache.data[:, self.n:need], self.v_cache.scale[:, self.n:need] = vd, vs
            self.n = need
            self.keys = _placeholder(self.k_cache, self.v_cache, need, key_states.dtype, "k")
            self.values = _placeholder(self.k_cache, self.v_cache, need, value_states.dtype, "v")
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.n

        def crop(self, n: int) -> None:
            """As the installed DynamicLayer.crop (Note [Crop semantics]): a negative ``n`` drops that many rows
            from the end; transformers 5 takes 0 as "nothing to drop" and refuses a positive ``n``, transformers
            4 keeps the first ``n`` rows."""
            if _CROP_REMOVES and n > 0:
                raise ValueError(f"Calling `crop` with a positive value (`{n}`) is not supported. Please use a "
                                 "negative integer to remove that number of tokens from the cache instead.")
            max_length = self.n - abs(n) if n < 0 or _CROP_REMOVES else n
            if self.k_cache is None or self.n <= max_length:
                return
            self.n = max(max_length, 0)
            self.keys = _placeholder(self.k_cache, self.v_cache, self.n, self.keys.dtype, "k")
            self.values = _placeholder(self.k_cache, self.v_cache, self.n, self.values.dtype, "v")

        def _take(self, pick) -> None:
            """New storage from ``pick(t)`` of each batch-leading tensor (rows and scales alike, a group scale's
            extra dim included); the per-head channel scales and rotation are shared by every sequence."""
            if self.k_cache is None:
                return
            self.k_cache, self.v_cache = (
                QuantizedKV(pick(c.data), pick(c.scale), c.channel, c.rotation) for c in (self.k_cache, self.v_cache))
            self.keys = _placeholder(self.k_cache, self.v_cache, self.n, self.keys.dtype, "k")
            self.values = _placeholder(self.k_cache, self.v_cache, self.n, self.values.dtype, "v")

        def batch_repeat_interleave(self, repeats: int) -> None:
            """Each sequence ``repeats`` times in a row, as DynamicLayer.batch_repeat_interleave."""
            self._take(lambda t: t.repeat_interleave(repeats, dim=0))

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            """Keep the sequences ``indices`` (in that order), as DynamicLayer.batch_select_indices."""
            self._take(lambda t: t[indices.to(t.device) if isinstance(indices, torch.Tensor) else indices])

        def reorder_cache(self, beam_idx) -> None:
            """Sequence i becomes sequence beam_idx[i] of before (beam search), as DynamicLayer.reorder_cache."""
            self._take(lambda t: t.index_select(0, torch.as_tensor(beam_idx, device=t.device)))

        def reset(self) -> None:
            """Drop the cached rows (the storage and the channel scales too)."""
            self.k_cache = self.v_cache = None
            self.n = 0
            super().reset()

    class Int8Cache(DynamicCache):
        """transformers' DynamicCache with its full-attention layers as Int8Layer."""

        def __init__(self, config=None, capacity: int = 0, rotate: bool = True, smooth: bool = False,
                     group_size: int | str | None = "auto"):
            super().__init__(config=config)
            if self.layer_class_to_replicate is not None:
                self.layer_class_to_replicate = lambda: Int8Layer(capacity, rotate, smooth, group_size)
            self.layers = [Int8Layer(capacity, rotate, smooth, group_size) if type(layer) is DynamicLayer else layer
                           for layer in self.layers]

    _STATE["classes"] = (Int8Layer, Int8Cache)
    return _STATE["classes"]


def int8_cache(config=None, capacity: int = 0, *, rotate: bool = True, smooth: bool = False,
               group_size: int | str | None = "auto"):
    """A transformers ``DynamicCache`` (pass it as ``cache=``, ``past_key_values=`` before transformers 5.24) whose
    full-attention layers keep K/V in int8 (Note [HF int8 cache]); the model must run on ``register()``'s
    implementation. ``capacity``: positions reserved at the first update; ``rotate``: the keys' Hadamard rotation
    (Note [int8 key rotation]; rotation, then groups); ``smooth``: key channel smoothing fixed by the prefill (Note
    [int8 key channel smoothing]); ``group_size``: one float32 scale per that many channels of each token and kv
    head, keys and values (Note [int8 KV groups]; a positive multiple of kvquant.GROUP_MULTIPLE dividing the head
    dim); "auto" (the default) kvquant.GROUP_SIZE where it divides the head dim, else one scale per token (a head
    dim of 80, say); None or 0 one per token and kv head (with ``rotate=False, smooth=False`` the per-token format).
    ``config``: the model's config (its layer types; its attn implementation is checked, and its head dim against
    ``group_size`` where it states one: else at the first update)."""
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
        raise ValueError(f"int8_cache: capacity must be an int >= 0 (positions to reserve), got {capacity!r}")
    for name, val in (("rotate", rotate), ("smooth", smooth)):
        if not isinstance(val, bool):
            raise TypeError(f"int8_cache: {name} must be a bool, got {type(val).__name__}")
    group_size = _check_group_size(group_size, _head_dim(config))
    impl = getattr(config, "_attn_implementation", None)
    if config is not None and isinstance(impl, str) and impl != INT8_IMPLEMENTATION:
        raise ValueError(f"int8_cache: the model runs attn_implementation={impl!r}, which cannot read an int8 "
                         f"cache; call model.set_attn_implementation(attnlab.integrations.hf_int8.register()) first")
    return _int8_classes()[1](config, capacity, rotate, smooth, group_size)


def _check_group_size(group_size, *head_dims: int | None) -> int | str | None:
    """``group_size`` as the layers take it (None: per-token rows; 0 means that too; "auto": kvquant.GROUP_SIZE
    where it divides every known head dim, else None, and "auto" while none is known); ValueError in one line
    naming it and the head dim unless it is a positive multiple of kvquant.GROUP_MULTIPLE dividing each known head
    dim."""
    if group_size is None or (type(group_size) is int and group_size == 0):
        return None
    dims = sorted({d for d in head_dims if d is not None})
    if isinstance(group_size, str) and group_size == "auto":
        if not dims:
            return "auto"
        return kvquant.GROUP_SIZE if all(d % kvquant.GROUP_SIZE == 0 for d in dims) else None
    where = f"the head dim D={'/'.join(map(str, dims))}" if dims else "the head dim"
    if (isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 0
            or group_size % kvquant.GROUP_MULTIPLE or any(d % group_size for d in dims)):
        raise ValueError(f"int8_cache: group_size must be a positive multiple of {kvquant.GROUP_MULTIPLE} dividing "
                         f"{where} ('auto', or None / 0: one scale per token and kv head), got {group_size!r}")
    return group_size


def _head_dim(config) -> int | None:
    """The attention head dim a config states (``head_dim``, else hidden_size / num_attention_heads), or None
    where it states none or keys and values differ (``v_head_dim``): the first update checks those."""
    if config is None:
        return None
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if getattr(text, "v_head_dim", None) is not None:
        return None
    d = getattr(text, "head_dim", None)
    if not isinstance(d, int) or isinstance(d, bool):
        h, n = getattr(text, "hidden_size", None), getattr(text, "num_attention_heads", None)
        d = h // n if isinstance(h, int) and isinstance(n, int) and n > 0 and h % n == 0 else None
    return d if d and d > 0 else None


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
                or kwargs.get("position_bias") is not None or (torch.is_grad_enabled() and query.requires_grad)):
            k, v = _dequantized(kc, vc, n, query.dtype)
            return base(module, query, k, v, attention_mask, scaling, dropout, **kwargs)
        D = query.shape[-1]
        out = attention_with_kvcache(query.transpose(1, 2), kc, vc, cache_seqlens=n, is_causal=True,
                                     scale=float(scaling) if scaling is not None else 1.0 / math.sqrt(D),
                                     softcap=kwargs.get("softcap"), sinks=hf._sinks(kwargs))
        return out, None  # (B, L, H, Dv)

    AttentionInterface.register(name, attnlab_int8_attention)
    return name
