"""Run Hugging Face transformers models on attnlab attention, through transformers' AttentionInterface.

    >>> from attnlab.integrations import hf
    >>> hf.register_all()                               # "attnlab", "attnlab_tiled", "attnlab_performer", ...
    >>> model = BertModel.from_pretrained(path, attn_implementation="attnlab_tiled")
    >>> model.set_attn_implementation("attnlab_sliding_window")

Needs the optional extra ``attnlab[hf]`` (transformers >= 4.48 with AttentionInterface and
AttentionMaskInterface). Each registered name gets an attention function (query [B, H, L, D],
key/value [B, Hkv, S, D] -> output [B, L, H, Dv], weights | None) and the sdpa-style mask function
(bool [B, 1, L, S], True = attend, or None when nothing is masked).

Generation: a step (query [B, H, L <= 16, D] against transformers' cache) runs attnlab's decode kernel
directly (Note [HF decode step]). transformers' ``DynamicCache`` concatenates each step (a copy of the whole cache
per layer and step, which at long contexts costs more than the attention itself); on a model running on an
attnlab implementation ``generate`` therefore gets a cache whose full-attention layers append in place into
storage reserved for ``max_length`` positions (Note [HF in-place generation]; ``cache_implementation="dynamic"``
keeps transformers' own). ``in_place_cache`` makes that cache by hand (for a model on "sdpa", or for ``forward``):

    >>> out = model.generate(ids, max_new_tokens=32, cache=hf.in_place_cache(model.config, 2048 + 32))

(``past_key_values=`` before transformers 5.)

``hook_modules(model)`` and ``hooked(model)`` let ``attnlab.capture`` cache, ablate and patch a transformers
model (BERT, GPT-2, Llama, ... anything whose attention calls AttentionInterface): each attention module gets
a :class:`HookedAttention` with attnlab's hook points (q, k, v, weights, z, out), and while ``hooked`` is
active the model runs on an attnlab implementation that calls them (Note [HF hooked attention]).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import math
import weakref
from typing import Iterator

import torch

from .. import mechanisms
from .. import patterns as P
from ..functional import METHODS, attention
from ..functional.storage import append_kv
from ..kernels import DECODE, SDPA, Declined
from ..kernels.cacheview import CacheCall, layout_of
from ..kernels.planner import plain_decode_kernel, plan_cache
from ..nn.hooks import AttentionHooks, HookContext

__all__ = ["register", "register_all", "attention_function", "registered", "HookedAttention", "hook_modules",
           "hooked", "in_place_cache"]

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


def _resolve(mechanism):
    if isinstance(mechanism, str) and mechanism in METHODS:
        return mechanism
    return mechanisms.resolve(mechanism)


# Note [Weights asked for]: a model asks for attention weights in one of two ways. Most (BERT, Llama) pass
# ``output_attentions`` down through ``**kwargs`` to the attention function. GPT-2 takes it as a named
# argument of its attention module and its model drops it from kwargs; transformers (5.x) then collects the
# weights with forward hooks that ``capture_outputs`` arms for the call, and a None weight is skipped, so
# ``outputs.attentions`` came back empty. The armed collector is the one signal every model shares: it holds
# an "attentions" (or "cross_attentions") list while the caller asked for them.
@functools.cache
def _collector():
    """transformers' ContextVar of armed output collectors (Note [Weights asked for]), or None where it has none;
    looked up once (every generation step of every layer asks)."""
    try:
        from transformers.utils.output_capturing import _active_collector  # (transformers: an optional dependency)
    except ImportError:
        return None
    return _active_collector


def _weights_asked(kwargs) -> bool:
    """Whether the model call wants attention weights (Note [Weights asked for])."""
    if kwargs.get("output_attentions"):
        return True
    if torch.compiler.is_compiling():  # dynamo cannot read a ContextVar: under compile only the flag in kwargs counts
        return False
    collector = _collector()
    if collector is None:  # transformers 4.x: the flag travels in kwargs or not at all
        return False
    collecting = collector.get()
    return isinstance(collecting, dict) and ("attentions" in collecting or "cross_attentions" in collecting)


def _sinks(kwargs):
    """The model's attention sinks [H] (gpt-oss passes its per-head logits as ``s_aux``; ``sinks`` elsewhere), or None."""
    s = kwargs.get("s_aux")
    return kwargs.get("sinks") if s is None else s


# Note [HF position bias]: T5 and its kin (mT5, LongT5, Pix2Struct, ...) pass their learned relative position bias
# [B|1, H, L, S] as ``position_bias``, added to the scores; the function had let it fall into **kwargs and dropped
# it (a tiny random T5's logits 0.18 off eager, where sdpa is 1e-6 off). It is folded into one additive float mask
# as transformers' sdpa does (``create_position_bias_mask``): the bias where a key is visible, -inf where the mask
# or causality (top-left, as there) hides it; the call is then not causal, its mask holding that.
def _with_position_bias(kwargs, mask, is_causal: bool, query, key):
    """(mask, is_causal) for the call: with a ``position_bias`` in kwargs, the additive float mask [.., L, S] of
    Note [HF position bias] in query's dtype and False; else as given."""
    bias = kwargs.get("position_bias")
    if bias is None:
        return mask, is_causal
    bias = bias.to(query.dtype)
    if mask is None:
        if not is_causal:
            return bias, False
        L, S = query.shape[2], key.shape[2]
        mask = torch.arange(L, device=query.device)[:, None] >= torch.arange(S, device=query.device)[None, :]
    if mask.dtype == torch.bool:
        return bias.masked_fill(~mask, float("-inf")), False
    return bias + mask.to(query.dtype), False


def _is_causal(module, query, attention_mask, kwargs) -> bool:
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = bool(getattr(module, "is_causal", False)) and attention_mask is None and query.shape[2] > 1
    return bool(is_causal)


def _attend(mech, pattern, module, query, key, value, mask, scaling, dropout, is_causal, need_weights, softcap=None,
            sinks=None):
    """query [B, H, L, D], key/value [B, Hkv, S, D|Dv] -> (output [B, H, L, Dv], weights [B, H, L, S] or None).
    ``softcap``: the model's logit soft-capping (Gemma 2's ``attn_logit_softcapping``), or None; ``sinks``: its
    attention sinks [H] (gpt-oss's ``s_aux``), or None."""
    L = query.shape[2]
    gqa = query.shape[1] != key.shape[1]
    dropout_p = dropout if module.training else 0.0
    pat = pattern  # HF's own sliding windows already arrive inside attention_mask
    if isinstance(mech, str):
        method = "auto" if need_weights and mech in ("sdpa", "sparse") else mech
        r = attention(query, key, value, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scaling,
                      enable_gqa=gqa, pattern=pat, method=method, need_weights=need_weights, softcap=softcap,
                      sinks=sinks)
    else:
        if sinks is not None:
            raise ValueError(f"this model has attention sinks (s_aux, [{sinks.shape[0]}]), which mechanism "
                             f"{type(mech).__name__} does not take: use a core method (\"attnlab\", \"attnlab_tiled\", ...)")
        if softcap is not None:
            raise ValueError(f"this model soft-caps its attention scores (softcap={softcap}), which mechanism "
                             f"{type(mech).__name__} does not do: use a core method (\"attnlab\", \"attnlab_tiled\", ...)")
        if pat is not None:
            keep = pat.materialize(L, key.shape[2], device=query.device).view(1, 1, L, key.shape[2])
            mask = keep if mask is None else (mask & keep if mask.dtype == torch.bool
                                              else mask.masked_fill(~keep, float("-inf")))
        if mask is not None and mask.dtype == torch.bool:
            mask = _key_only(mask)
        r = mech(query, key, value, attn_mask=mask, is_causal=is_causal, scale=scaling, dropout_p=dropout_p,
                 enable_gqa=gqa, need_weights=need_weights)
    return r if need_weights else (r, None)


# Note [HF decode step]: a generation step (query [B, H, L <= 16, D] against the cache's S > L keys, no pattern,
# inference) changes S every step, so attnlab.attention's plan cache never hits there and each step would be
# prepared and planned anew. The step is instead a KV-cache call (``kernels.cacheview.CacheCall``: transformers'
# [B, Hkv, S, D] cache read as flash-attn's layout through transposed views, no copy; HF's bool mask of a padded
# batch as the kernel's keep) planned by ``kernels.planner.plan_cache``, the door ``attention_with_kvcache`` takes
# too: the same rules, so the one SDPA-or-decode decision (planner Note [Plain MHA decode]). The decode kernel
# writes the output in HF's [B, L, H, Dv] layout, so no transpose copy follows; a plain step goes through the
# one-call step (csrc Note [One-call decode step]). "compiled" (attnlab's own C++ kernels) and "decode" steps run
# the decode kernel. Anything else (weights, dropout, grad, a float mask, top-left causal L > 1) takes
# attnlab.attention.
_STEP_MECHANISMS = {"auto": "auto", "compiled": "decode", "decode": "decode"}


def _decode_step(mech, query, key, value, mask, scaling, module, is_causal, need_weights, softcap=None, sinks=None):
    """out [B, L, H, Dv] for a generation step on the route of Note [HF decode step], or None."""
    B, H, L, D = query.shape
    S = key.shape[2]
    if (need_weights or module.training or not 1 <= L <= DECODE.spec.max_queries or S <= L or B == 0
            or (is_causal and L > 1) or key.dtype != query.dtype or value.dtype != query.dtype
            or key.shape[1] == 0 or H % key.shape[1]):
        return None
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return None
    if mask is not None and (mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[-1] != S
                             or mask.shape[1] not in (1, H) or mask.shape[0] not in (1, B)
                             or mask.shape[2] not in (1, L)):
        return None
    scale = float(scaling) if scaling is not None else 1.0 / math.sqrt(D)
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or sinks.shape != (H,)
                              or not sinks.dtype.is_floating_point):
        return None  # attnlab.attention checks them and says what is wrong
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    if mask is None and not softcap and sinks is None:
        # a plain step: the direct path of the kernel the one rule gives it (planner Note [Plain MHA decode]; csrc
        # Notes [One-call decode step], [SDPA steps]), without building the call and its plan
        if mech != "auto" or plain_decode_kernel(q.dtype, H, k.shape[2], S, layout_of(k)) is DECODE:
            out = DECODE.step(q, k, v, None, None, S, None, bool(is_causal), scale)
        else:
            out = SDPA.step(q, k, v, None, None, S, scale)
        if out is not None:
            return out.contiguous()
    call = CacheCall(q, k, v, scale, S, keep=mask, softcap=softcap or None, sinks=sinks)
    try:
        plan = plan_cache(call, _STEP_MECHANISMS[mech])
        out, _ = plan.kernel.run_cache(call)
    except (ValueError, Declined):  # no kernel reads this step's view: attnlab.attention takes it
        return None
    return out.contiguous()  # (B, L, H, Dv)


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
    mech = _resolve(mechanism)
    steps = pattern is None and isinstance(mech, str) and mech in _STEP_MECHANISMS

    def attnlab_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        need_weights = _weights_asked(kwargs)
        is_causal = _is_causal(module, query, attention_mask, kwargs)
        softcap = kwargs.get("softcap")
        sinks = _sinks(kwargs)
        attention_mask, is_causal = _with_position_bias(kwargs, attention_mask, is_causal, query, key)
        if steps and not torch.compiler.is_compiling():  # Note [HF decode step]; under compile the door's op
            # (functional's Note [Doors as torch ops]) takes the step
            out = _decode_step(mech, query, key, value, attention_mask, scaling, module, is_causal, need_weights,
                               softcap, sinks)
            if out is not None:
                return out, None
        out, weights = _attend(mech, pattern, module, query, key, value, attention_mask, scaling, dropout,
                               is_causal, need_weights, softcap, sinks)
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
    _install_generation_hook()  # Note [HF in-place generation]
    return name


def register_all() -> list[str]:
    """"attnlab" (auto) and "attnlab_<name>" for every core method and registered mechanism that has
    default hyperparameters (others: ``register(name, attnlab.mechanisms.get(m, **params))``).
    Returns the names."""
    names = [register("attnlab", "auto")]
    try:
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


# -- a transformers cache that appends in place -------------------------------------------------------
_IN_PLACE: dict = {}

# Note [In-place cache storage]: an InPlaceLayer's first update (the prefill) allocates the storage for the whole
# generation and writes the prompt's rows into it. That storage was empty_kv_cache's (zeroed, on huge pages: Note
# [KV cache on huge pages]); on SmolLM2 (30 layers, GQA 9/3, D 64) at 4,096 tokens the update took 26-37 ms a layer,
# 0.8-1.1 s of a 16 s prefill, where DynamicLayer's first cat takes ~3 ms, and attnlab's prefill was 0.96x sdpa's
# while attnlab on cache_implementation="dynamic" was 1.005x (2 cores, interleaved rounds, medians). The storage
# is now uninitialised (``new_empty``): the prompt's rows are written once, and rows past those written are never
# read (keys and values are views of the written [:n] rows; a NaN-filled storage gives the same tokens:
# tests/models/test_hf_decode.py). What huge pages bought this layout in decode was nothing measurable for fp32
# (huge / normal time 1.02 at S 32,768, 0.88-1.03 at 4,096) and 6 % for bf16 at 32,768 (0.94).


def _storage(like: torch.Tensor, *shape: int) -> torch.Tensor:
    """Uninitialised storage ``shape`` of ``like``'s dtype and device (Note [In-place cache storage])."""
    return like.new_empty(shape)


def _in_place_classes():
    """(InPlaceLayer, InPlaceCache), defined once transformers is importable."""
    if _IN_PLACE:
        return _IN_PLACE["classes"]
    from transformers.cache_utils import DynamicCache, DynamicLayer

    class InPlaceLayer(DynamicLayer):
        """A DynamicLayer whose keys/values [B, Hkv, S, D] are views of storage [B, Hkv, capacity, D]: an update
        writes the new rows in place (storage doubles past its capacity). Whatever replaced the views (beam
        reordering, batch selection, crop) is adopted into fresh storage at the next update."""

        def __init__(self, capacity: int = 0, **kwargs):
            super().__init__(**kwargs)
            self.capacity = int(capacity)
            self._kbuf = self._vbuf = None

        def _views_of_storage(self) -> bool:
            kb, k = self._kbuf, self.keys
            return (kb is not None and k is not None and k.dim() == 4 and k.data_ptr() == kb.data_ptr()
                    and k.stride() == kb.stride() and k.shape[:2] == kb.shape[:2] and k.shape[3] == kb.shape[3])

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n = self.keys.shape[-2] if self.keys is not None and self.keys.dim() == 4 else 0
            need = n + key_states.shape[-2]
            if not self._views_of_storage() or need > self._kbuf.shape[2] \
                    or self._kbuf.shape[0] != key_states.shape[0] or self._kbuf.dtype != key_states.dtype:
                cap = max(need, self.capacity, 2 * (self._kbuf.shape[2] if self._kbuf is not None else 0), 16)
                B, Hkv, _, D = key_states.shape
                # (B, Hkv, capacity, D), uninitialised: every row read is written first (Note [In-place cache
                # storage])
                kb = _storage(key_states, B, Hkv, cap, D)
                vb = _storage(value_states, B, value_states.shape[1], cap, value_states.shape[3])
                if n:
                    kb[:, :, :n] = self.keys
                    vb[:, :, :n] = self.values
                self._kbuf, self._vbuf = kb, vb
            append_kv(self._kbuf, key_states, n, dim=2)  # the one append (``functional.storage.append_kv``)
            append_kv(self._vbuf, value_states, n, dim=2)
            self.keys, self.values = self._kbuf[:, :, :need], self._vbuf[:, :, :need]
            return self.keys, self.values

        def reset(self) -> None:
            """Drop the cached rows (the storage is freed too)."""
            self._kbuf = self._vbuf = None
            super().reset()

    class InPlaceCache(DynamicCache):
        """transformers' DynamicCache with its full-attention layers as InPlaceLayer (sliding-window layers
        stay transformers' own)."""

        def __init__(self, config=None, capacity: int = 0):
            super().__init__(config=config)
            if self.layer_class_to_replicate is not None:
                self.layer_class_to_replicate = lambda: InPlaceLayer(capacity)
            self.layers = [InPlaceLayer(capacity) if type(layer) is DynamicLayer else layer for layer in self.layers]

    _IN_PLACE["classes"] = (InPlaceLayer, InPlaceCache)
    return _IN_PLACE["classes"]


# Note [HF in-place generation]: transformers' generate makes its DynamicCache in
# GenerationMixin._prepare_cache_for_generation (it has no registry of cache kinds to add one to). register()
# wraps that method once: for a model whose attention runs on an attnlab implementation (config._attn_implementation
# registered here), no cache passed and no cache_implementation asked for, the DynamicCache it made gets
# InPlaceLayers reserving max_cache_length positions (generate's max_length) for its full-attention layers, so
# every step appends in place and the decode kernel reads views of one storage. Models on transformers' own
# implementations, a user's cache and cache_implementation="dynamic" (the opt-out) keep transformers' behaviour;
# if the method's signature is not the one read here (another transformers version) nothing is wrapped.
_GENERATION_HOOK: dict = {}


def _attnlab_model(model) -> bool:
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return isinstance(impl, str) and impl in _REGISTERED


def _install_generation_hook() -> bool:
    """Wrap GenerationMixin._prepare_cache_for_generation once (Note [HF in-place generation]); whether it is."""
    if "installed" in _GENERATION_HOOK:
        return _GENERATION_HOOK["installed"]
    _GENERATION_HOOK["installed"] = False
    try:
        from transformers.cache_utils import DynamicCache, DynamicLayer
        from transformers.generation.utils import GenerationMixin
    except ImportError:
        return False
    original = getattr(GenerationMixin, "_prepare_cache_for_generation", None)
    try:
        params = list(inspect.signature(original).parameters) if original is not None else []
    except (TypeError, ValueError):
        params = []
    if params != ["self", "generation_config", "model_kwargs", "generation_mode", "batch_size", "max_cache_length"]:
        return False
    in_place_layer = _in_place_classes()[0]

    @functools.wraps(original)
    def prepare_cache(self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length):
        user_cache = model_kwargs.get("cache") is not None
        out = original(self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length)
        cache = model_kwargs.get("cache")
        if (not user_cache and type(cache) is DynamicCache and generation_config.cache_implementation is None
                and _attnlab_model(self) and cache.get_seq_length() == 0):
            cap = max(int(max_cache_length), 0)
            cache.layers = [in_place_layer(cap) if type(layer) is DynamicLayer else layer for layer in cache.layers]
            if cache.layer_class_to_replicate is DynamicLayer:
                cache.layer_class_to_replicate = lambda: in_place_layer(cap)
        return out

    prepare_cache.attnlab_wrapped = original
    GenerationMixin._prepare_cache_for_generation = prepare_cache
    _GENERATION_HOOK["installed"] = True
    return True


def in_place_cache(config=None, capacity: int = 0):
    """A transformers ``DynamicCache`` (pass it as ``past_key_values`` to ``generate`` or ``forward``) whose
    full-attention layers append in place: storage for ``capacity`` positions (prompt + new tokens) is reserved
    at the first update, so a step writes only its new rows and the attention reads views of the storage (the
    decode kernel reads them in place), where DynamicCache copies the whole cache every step. ``config``: the
    model's config (its layer types), or None for every layer a full-attention one. Same results as
    DynamicCache."""
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
        raise ValueError(f"capacity must be an int >= 0 (positions to reserve), got {capacity!r}")
    _interfaces()
    return _in_place_classes()[1](config, capacity)


# -- hook points on transformers models (attnlab.capture) ---------------------------------------------
# Note [HF hooked attention]: transformers' attention modules compute q, k, v, call the AttentionInterface
# function named by config._attn_implementation, then apply their output projection. While ``hooked(model)``
# is active the model's implementation is "<base>_hooked": the same attnlab mechanism as <base> (attnlab's
# "auto" for eager/sdpa/flash, which agree to float rounding) with each module's HookedAttention points run
# on q, k, v, weights, z inside the function, and "out" run by a forward hook on the output projection
# (o_proj, out_proj, c_proj, or BERT's sibling output.dense). The previous implementation comes back on exit.
_HOOKED: "weakref.WeakKeyDictionary[torch.nn.Module, HookedAttention]" = weakref.WeakKeyDictionary()
_ENGAGED: "weakref.WeakKeyDictionary[torch.nn.Module, list]" = weakref.WeakKeyDictionary()
_CALLS_INTERFACE: dict[type, bool] = {}


class HookedAttention:
    """One transformers attention module as attnlab hook points.

    module: the transformers module (e.g. ``BertSelfAttention``, ``GPT2Attention``, ``LlamaAttention``).
    hooks: an ``attnlab.nn.hooks.AttentionHooks`` (points q, k, v, weights, z, out, shapes as attnlab's).
    num_heads: query heads H. out_proj: the module applying W_O (None when not found: no "out" point).
    """

    def __init__(self, module: torch.nn.Module, out_proj: torch.nn.Module | None):
        self.module = module
        self.hooks = AttentionHooks()
        cfg = getattr(module, "config", None)
        self.num_heads = int(getattr(module, "num_heads", None) or getattr(module, "num_attention_heads", None)
                             or getattr(cfg, "num_attention_heads"))
        self.scale = getattr(module, "scaling", None)
        self.out_proj = out_proj
        self.last_ctx: HookContext | None = None

    def __repr__(self) -> str:
        return f"HookedAttention({type(self.module).__name__}, {self.num_heads} heads, {self.hooks!r})"


def _calls_interface(cls: type) -> bool:
    """Whether ``cls.forward`` dispatches through transformers' AttentionInterface (read once per class)."""
    if cls not in _CALLS_INTERFACE:
        try:
            src = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            src = ""
        _CALLS_INTERFACE[cls] = "ALL_ATTENTION_FUNCTIONS" in src
    return _CALLS_INTERFACE[cls]


def _out_proj(model: torch.nn.Module, name: str, module: torch.nn.Module) -> torch.nn.Module | None:
    for attr in ("o_proj", "out_proj", "c_proj", "dense", "out_lin"):
        m = getattr(module, attr, None)
        if isinstance(m, torch.nn.Module) and hasattr(m, "weight"):
            return m
    parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    dense = getattr(getattr(parent, "output", None), "dense", None)  # BERT: attention.self + attention.output.dense
    return dense if isinstance(dense, torch.nn.Module) else None


def _pretrained(model) -> list[torch.nn.Module]:
    """The outermost transformers PreTrainedModels inside ``model`` (itself, when it is one)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return []
    if isinstance(model, PreTrainedModel):
        return [model]
    found, prefixes = [], []
    for n, m in model.named_modules():
        if isinstance(m, PreTrainedModel) and not any(n.startswith(p + ".") for p in prefixes):
            found.append(m)
            prefixes.append(n)
    return found


def hook_modules(model) -> list[tuple[str, HookedAttention]]:
    """(name, HookedAttention) for every transformers attention module in ``model`` that calls the
    AttentionInterface, in ``named_modules`` order; [] for a model with none (or without transformers)."""
    if not isinstance(model, torch.nn.Module) or not _pretrained(model):
        return []
    out = []
    for name, m in model.named_modules():
        if name and _calls_interface(type(m)):
            if m not in _HOOKED:
                _HOOKED[m] = HookedAttention(m, _out_proj(model, name, m))
            out.append((name, _HOOKED[m]))
    return out


def _hooked_name(base: str) -> str:
    """The registered "<base>_hooked" implementation for the model's current implementation ``base``."""
    if base in _REGISTERED and base.endswith("_hooked"):
        return base
    mechanism, pattern = _REGISTERED.get(base, ("auto", None))
    name = f"{base if base in _REGISTERED else 'attnlab'}_hooked"
    if name not in _REGISTERED:
        AttentionInterface, AttentionMaskInterface, sdpa_mask = _interfaces()
        AttentionInterface.register(name, _hooked_function(mechanism, pattern))
        AttentionMaskInterface.register(name, sdpa_mask)
        _REGISTERED[name] = (mechanism, pattern)
    return name


def _hooked_function(mechanism, pattern):
    mech = _resolve(mechanism)

    def attnlab_hooked(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        ad = _HOOKED.get(module)
        need_weights = _weights_asked(kwargs)
        is_causal = _is_causal(module, query, attention_mask, kwargs)
        attention_mask, is_causal = _with_position_bias(kwargs, attention_mask, is_causal, query, key)
        if ad is None or not ad.hooks:
            out, w = _attend(mech, pattern, module, query, key, value, attention_mask, scaling, dropout, is_causal,
                             need_weights, kwargs.get("softcap"), _sinks(kwargs))
            return out.transpose(1, 2).contiguous(), w
        L, S = query.shape[2], key.shape[2]
        causal = is_causal or (bool(getattr(module, "is_causal", False)) and L > 0)
        # the mask already holds causality and padding; the flag and offset describe them for capture's
        # recomputed scores and its causal mean ablation (queries are the last L of S positions)
        ctx = HookContext(module=ad, point="", key_padding_mask=None, attn_mask=attention_mask, pattern=pattern,
                          is_causal=causal, offset=max(0, S - L) if causal else 0,
                          scale=float(scaling) if scaling is not None else 1.0 / math.sqrt(query.shape[-1]))
        ad.last_ctx = ctx
        q = ad.hooks.run("q", query, ctx)  # (B, H, L, D)
        k = ad.hooks.run("k", key, ctx)  # (B, Hkv, S, D)
        v = ad.hooks.run("v", value, ctx)  # (B, Hkv, S, Dv)
        want = need_weights or ad.hooks.has("weights")
        out, w = _attend(mech, pattern, module, q, k, v, attention_mask, scaling, dropout, is_causal, want,
                         kwargs.get("softcap"), _sinks(kwargs))
        if w is not None:
            ad.hooks.run("weights", w, ctx)
        z = ad.hooks.run("z", out, ctx)  # (B, H, L, Dv)
        return z.transpose(1, 2).contiguous(), (w if need_weights else None)  # (B, L, H, Dv)

    attnlab_hooked.mechanism, attnlab_hooked.pattern = mechanism, pattern
    return attnlab_hooked


@contextlib.contextmanager
def hooked(model) -> Iterator[list[tuple[str, HookedAttention]]]:
    """Run ``model``'s transformers attention through attnlab with its HookedAttention points live (Note [HF
    hooked attention]); nested uses share one switch, the outermost exit restores the implementation."""
    mods = hook_modules(model)
    roots = _pretrained(model)
    entered = []
    try:
        for r in roots:
            state = _ENGAGED.get(r)
            if state is None:
                old = r.config._attn_implementation
                r.set_attn_implementation(_hooked_name(old or "sdpa"))
                state = _ENGAGED[r] = [old, 0, []]
                for _, ad in hook_modules(r):
                    if ad.out_proj is not None:
                        state[2].append(ad.out_proj.register_forward_hook(_out_hook(ad)))
            state[1] += 1
            entered.append(r)
        yield mods
    finally:
        for r in entered:
            state = _ENGAGED[r]
            state[1] -= 1
            if state[1] == 0:
                for h in state[2]:
                    h.remove()
                del _ENGAGED[r]
                r.set_attn_implementation(state[0])


def _out_hook(ad: HookedAttention):
    def fn(_module, _inputs, output):  # output: (B, L, E)
        if ad.hooks.has("out") and ad.last_ctx is not None:
            return ad.hooks.run("out", output, ad.last_ctx)
        return None

    return fn
