"""attnlab.capture: cache, ablate and patch the attention activations of a model while it runs.

Every ``attnlab.nn.MultiHeadAttention`` inside a model (in ``named_modules`` order, index ``i``) exposes
public hook points (``attnlab.nn.hooks``); this module reads and replaces them, in the manner of
TransformerLens' ``run_with_cache`` / ``run_with_hooks``. Activation names and shapes (legend: B batch,
H heads, Hkv key/value heads, L queries, S keys, D head dim, Dv value head dim, E embed_dim; for
all-MiniLM-L6-v2: i in 0..5, H = 12, D = Dv = 32, E = 384, L = S = T tokens):

    blocks.{i}.attn.q        [B, H, L, D]     projected queries (after rotary positions)
    blocks.{i}.attn.k        [B, Hkv, S, D]   projected keys
    blocks.{i}.attn.v        [B, Hkv, S, Dv]  projected values
    blocks.{i}.attn.scores   [B, H, L, S]     scale · q kᵀ, -inf where a key does not take part (key padding,
                                              causal, patterns, bool attn_mask); a float attn_mask is added.
                                              Position biases (ALiBi, T5) are not included. Recomputed from
                                              q, k (fused kernels never materialise scores).
    blocks.{i}.attn.weights  [B, H, L, S]     attention weights as the layer's mechanism computed them
    blocks.{i}.attn.z        [B, H, L, Dv]    per-head output weights · V, before the heads are merged
    blocks.{i}.attn.out      [B, L, E]        the attention layer's output (after W_O)

Beyond attention, every attnlab block (``attnlab.nn.EncoderLayer`` / ``DecoderLayer``, index ``i`` among the
blocks; MiniLM's ``layers.{i}``) has residual-stream and MLP points, read and replaced the same way:

    layers.{i}.resid_pre     [B, L, E]        the block's input (the residual stream before block i)
    layers.{i}.mlp_out       [B, L, E]        the feed-forward sublayer's output (before its residual add)
    layers.{i}.resid_post    [B, L, E]        the block's output (the residual stream after block i)

(they fire when the block is called as a module, as ``model(...)`` does; MiniLM's ``output_attentions=True``
path calls ``forward_intermediates`` and bypasses them). A Hugging Face model has them too: its blocks are the
entries of the ModuleList holding its attention modules (Llama's ``model.layers``, GPT-2's ``transformer.h``,
BERT's ``encoder.layer``); ``mlp_out`` is the block's ``mlp`` (Llama, GPT-2; BERT's feed-forward adds the
residual inside, so it has resid_pre and resid_post only). :func:`patch_sweep` patches every head (and
position) in turn and returns the metric as a [layers, heads(, L)] tensor; ``attnlab.viz.plot_patch_sweep``
draws it.

    >>> from attnlab import capture as C
    >>> out, cache = C.run_with_cache(model, **batch)          # model(**batch), every activation cached
    >>> cache["blocks.3.attn.weights"].shape                     # [B, 12, T, T]
    >>> with C.ablate_heads(model, layer=3, heads=[7], how="mean"):
    ...     emb = model.encode(sentences)                        # head 3.7 replaced by its mean output
    >>> with C.patch_heads(model, layer=3, heads=[7], source=cache_b):  # head 3.7 from another run
    ...     model(**batch)
    >>> C.head_effect(model, sentences, layer=3, heads=[7])    # cosine of MiniLM embeddings, with vs without
    >>> C.head_effect(smollm2, sentences, layer=3, heads=[7], tokenizer=tok)   # any Hugging Face model

The older weights/summary recorder (``capture(module)``, ``Capture``, ``Record``) lives here too;
``attnlab.inspect`` is a deprecated alias of this module.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch

from . import patterns as P
from .diagnostics import streaming_summary
from .integrations.hf import hook_modules, hooked
from .nn import DecoderLayer, EncoderLayer, MultiHeadAttention

__all__ = [
    "capture", "Capture", "Record", "attention_modules", "ActivationCache", "ACTIVATIONS", "activation_name",
    "cache_activations", "run_with_cache", "hooks", "run_with_hooks", "ablate_heads", "patch_heads", "head_effect",
    "sentence_embeddings", "LAYER_POINTS", "layer_point_name", "block_modules", "patch_sweep", "hf_sentence_embeddings",
]

#: residual-stream and MLP points of every attnlab block (``layers.{i}.{kind}``)
LAYER_POINTS = ("resid_pre", "mlp_out", "resid_post")

#: activation kinds cached per attention module, in the order a call computes them
ACTIVATIONS = ("q", "k", "v", "scores", "weights", "z", "out")
_HOOKED = ("q", "k", "v", "weights", "z", "out")  # the module's own hook points; scores are derived


def activation_name(layer: int, kind: str) -> str:
    """``blocks.{layer}.attn.{kind}``, checked against :data:`ACTIVATIONS`."""
    if kind not in ACTIVATIONS:
        raise ValueError(f"unknown activation {kind!r}; choose from {', '.join(ACTIVATIONS)}")
    return f"blocks.{layer}.attn.{kind}"


def layer_point_name(layer: int, kind: str) -> str:
    """``layers.{layer}.{kind}``, checked against :data:`LAYER_POINTS`."""
    if kind not in LAYER_POINTS:
        raise ValueError(f"unknown layer point {kind!r}; choose from {', '.join(LAYER_POINTS)}")
    return f"layers.{layer}.{kind}"


def block_modules(model) -> list[tuple[str, torch.nn.Module]]:
    """(name, block) for every attnlab ``EncoderLayer`` / ``DecoderLayer`` inside ``model``, in module order; for a
    model without one, a Hugging Face model's blocks: the ModuleList entries that hold its attention modules."""
    own = [(n or "(root)", m) for n, m in model.named_modules() if isinstance(m, (EncoderLayer, DecoderLayer))]
    if own or not isinstance(model, torch.nn.Module):
        return own
    try:
        hooks = hook_modules(model)
    except ImportError:  # transformers missing or too old: nothing of it to hook
        return []
    found: dict[str, torch.nn.Module] = {}
    for name, _ in hooks:
        parts = name.split(".")
        for k in range(len(parts) - 1, 0, -1):  # the innermost ancestor that is an entry of a ModuleList
            if parts[k].isdigit() and isinstance(model.get_submodule(".".join(parts[:k])), torch.nn.ModuleList):
                block = ".".join(parts[:k + 1])
                found.setdefault(block, model.get_submodule(block))
                break
    return list(found.items())


def _mlp(block: torch.nn.Module) -> torch.nn.Module | None:
    """The feed-forward sublayer whose output is ``mlp_out``: attnlab's ``ffn``, a Hugging Face block's ``mlp``."""
    for attr in ("ffn", "mlp"):
        m = getattr(block, attr, None)
        if isinstance(m, torch.nn.Module):
            return m
    return None


def _parse_layer_point(name: str, n_blocks: int) -> tuple[int, str]:
    parts = name.split(".")
    if len(parts) != 3 or parts[0] != "layers" or not parts[1].isdigit() or parts[2] not in LAYER_POINTS:
        raise ValueError(f"layer point {name!r} must look like 'layers.{{i}}.{{kind}}' with kind in "
                         f"{', '.join(LAYER_POINTS)} (attention activations are 'blocks.{{i}}.attn.{{kind}}')")
    i = int(parts[1])
    if i >= n_blocks:
        raise ValueError(f"{name!r}: this model has {n_blocks} blocks"
                         + (f" (layers.0 .. layers.{n_blocks - 1})" if n_blocks else
                            " (layer points exist on attnlab.nn.EncoderLayer / DecoderLayer and on the blocks of "
                            "Hugging Face models)"))
    return i, parts[2]


def _split_names(names) -> tuple[list[str], list[str]]:
    """Activation names -> (attention names ``blocks.*``, layer points ``layers.*``)."""
    if isinstance(names, str):
        names = [names]
    names = list(names)
    return ([n for n in names if not (isinstance(n, str) and n.startswith("layers."))],
            [n for n in names if isinstance(n, str) and n.startswith("layers.")])


@contextlib.contextmanager
def _layer_hooks(model, wanted: list[tuple[int, str, Callable]]) -> Iterator[None]:
    """torch hooks for layer points: fn(tensor [B, L, E], ctx) -> tensor | None (ctx.module, ctx.point)."""
    import types

    blocks = block_modules(model)
    handles = []

    def checked(r, x, point):
        if r is None:
            return None
        if not isinstance(r, torch.Tensor) or r.shape != x.shape:
            raise ValueError(f"a hook at {point!r} returned {getattr(r, 'shape', type(r).__name__)}; it must "
                             f"return None or a tensor of the same shape {list(x.shape)}")
        return r

    try:
        for i, kind, fn in wanted:
            blk = blocks[i][1]
            ctx = types.SimpleNamespace(module=blk, point=layer_point_name(i, kind))
            if kind == "resid_pre":
                def pre(mod, args, kwargs, _fn=fn, _ctx=ctx):
                    key = next((k for k in ("x", "hidden_states") if k in kwargs), None)  # attnlab's, transformers'
                    x = args[0] if args else kwargs[key]
                    r = checked(_fn(x, _ctx), x, _ctx.point)
                    if r is None:
                        return None
                    return ((r,) + tuple(args[1:]), kwargs) if args else (args, {**kwargs, key: r})

                handles.append(blk.register_forward_pre_hook(pre, with_kwargs=True))
            else:
                target = _mlp(blk) if kind == "mlp_out" else blk
                if target is None:
                    raise ValueError(f"{ctx.point!r}: {type(blk).__name__} has no separate feed-forward sublayer "
                                     "(its residual add happens inside it); resid_pre and resid_post are there")

                def post(mod, args, out, _fn=fn, _ctx=ctx):
                    if isinstance(out, tuple):  # a block returning (hidden_states, ...)
                        r = checked(_fn(out[0], _ctx), out[0], _ctx.point)
                        return None if r is None else (r,) + tuple(out[1:])
                    return checked(_fn(out, _ctx), out, _ctx.point)

                handles.append(target.register_forward_hook(post))
        yield
    finally:
        for h in handles:
            h.remove()


def _parse_name(name: str, n_modules: int) -> tuple[int, str]:
    parts = name.split(".") if isinstance(name, str) else []
    if len(parts) != 4 or parts[0] != "blocks" or parts[2] != "attn" or not parts[1].isdigit() \
            or parts[3] not in ACTIVATIONS:
        raise ValueError(f"activation name {name!r} must look like 'blocks.{{i}}.attn.{{kind}}' with kind in "
                         f"{', '.join(ACTIVATIONS)}")
    i = int(parts[1])
    if i >= n_modules:
        raise ValueError(f"{name!r}: this model has {n_modules} attention modules (blocks.0 .. blocks.{n_modules - 1})")
    return i, parts[3]


def attention_modules(module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) for every attnlab.nn.MultiHeadAttention inside ``module`` (itself included); for a
    model without one, a transformers model's attention modules as ``attnlab.integrations.hf.HookedAttention``
    (each with ``.module``, ``.hooks``, ``.num_heads``)."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"capture() needs a torch.nn.Module, got {type(module).__name__}")
    mods = [(n or "(root)", m) for n, m in module.named_modules() if isinstance(m, MultiHeadAttention)]
    if mods:
        return mods
    try:
        return hook_modules(module)
    except ImportError:  # transformers missing or too old: nothing of it to hook
        return []


def _modules(model) -> list[tuple[str, torch.nn.Module]]:
    mods = attention_modules(model)
    if not mods:
        raise ValueError(f"{type(model).__name__} contains no attention module to capture: neither an "
                         "attnlab.nn.MultiHeadAttention nor a transformers attention module that calls "
                         "AttentionInterface (transformers >= 4.48)")
    return mods


@contextlib.contextmanager
def _registered(pairs: Iterable[tuple[torch.nn.Module, str, Callable]], model=None) -> Iterator[None]:
    """Add each (module, point, fn) hook; remove them all on exit, whatever happened. A transformers
    ``model`` runs on attnlab's hooked attention meanwhile (Note [HF hooked attention] in integrations/hf.py)."""
    pairs = list(pairs)
    handles = []
    engaged = contextlib.nullcontext()
    if model is not None and any(not isinstance(m, MultiHeadAttention) for m, _, _ in pairs):
        engaged = hooked(model)
    with engaged:
        try:
            for m, point, fn in pairs:
                handles.append(m.hooks.add(point, fn))
            yield
        finally:
            for h in handles:
                h.remove()


# -- the activation cache -----------------------------------------------------------------------------
@dataclass
class ActivationCache:
    """Activations by name (see the module docstring), from the latest call of each attention module.

    ``modules[i]`` is the module path of ``blocks.{i}`` (e.g. ``layers.3.self_attn`` in MiniLM).
    Tensors are detached; they live on the model's device and dtype.
    """

    modules: list[str]
    store: dict[str, torch.Tensor] = field(default_factory=dict)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.store:
            if isinstance(name, str) and name.startswith("layers."):
                _parse_layer_point(name, 1 << 30)  # a malformed name gets the naming rule
            else:
                _parse_name(name, len(self.modules))
            raise KeyError(f"{name!r} was not cached (cached: {len(self.store)} activations, e.g. "
                           f"{', '.join(list(self.store)[:4])})")
        return self.store[name]

    def __contains__(self, name: str) -> bool:
        return name in self.store

    def __len__(self) -> int:
        return len(self.store)

    def keys(self) -> list[str]:
        """The cached names ("blocks.0.q", ...), in the order they were recorded."""
        return list(self.store)

    def items(self):
        """(name, tensor) pairs, as ``dict.items``."""
        return self.store.items()

    def weights(self) -> list[torch.Tensor]:
        """The cached weights [B, H, L, S] of every module that has them, in module order (as
        ``Capture.weights()`` gives them, so ``attnlab.viz.show(cache, tokens)`` draws an ActivationCache)."""
        out = [self.store[n] for n in (activation_name(i, "weights") for i in range(len(self.modules)))
               if n in self.store]
        if not out:
            raise ValueError("no weights were cached: cache 'blocks.{i}.attn.weights' (names=None caches all)")
        return out

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        """The activations of ``blocks.{i}`` by kind (q, k, v, ...)."""
        pre = f"blocks.{i}.attn."
        return {n[len(pre):]: t for n, t in self.store.items() if n.startswith(pre)}

    def head(self, i: int, kind: str, head: int) -> torch.Tensor:
        """One head's slice of a per-head activation: q, scores, weights, z -> [B, L, ·]; k, v -> the key/value
        head serving ``head`` (grouped-query heads share one)."""
        t = self[activation_name(i, kind)]
        if kind == "out":
            raise ValueError("blocks.{i}.attn.out has no head axis (heads are merged by W_O)")
        n = t.shape[1]
        if kind in ("k", "v"):
            H = self[activation_name(i, "q")].shape[1] if activation_name(i, "q") in self.store else n
            return t[:, head // (H // n)]
        return t[:, head]


def _scores(q: torch.Tensor, k: torch.Tensor, ctx) -> torch.Tensor:
    """scale · q kᵀ with the call's masks (see the module docstring): q [B, H, L, D], k [B, Hkv, S, D] ->
    [B, H, L, S]."""
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # (B, H, S, D)
    s = (q @ k.transpose(-1, -2)) * ctx.scale  # (B, H, L, S)
    B, _, L, S = s.shape
    keep = torch.ones(B, 1, L, S, dtype=torch.bool, device=s.device)
    pattern = ctx.pattern
    am = ctx.attn_mask
    if isinstance(am, P.Pattern):
        pattern = am if pattern is None else pattern & am
        am = None
    if pattern is not None:
        # as the layer applies it: a pattern over the call's (L, S), except that under a KV cache (offset > 0)
        # the L queries are rows offset .. offset + L - 1 of the sequence (patterns.shifted). Cross-attention
        # (L != S, no offset) is the pattern's own [L, S] mask, not rows of an [S, S] one.
        if ctx.offset:
            pattern = P.shifted(pattern, ctx.offset)
        keep = keep & pattern.materialize(L, S, device=s.device)  # (L, S) or (B, 1, L, S)
    if ctx.is_causal:
        qpos = torch.arange(ctx.offset, ctx.offset + L, device=s.device).unsqueeze(-1)  # (L, 1)
        keep = keep & (torch.arange(S, device=s.device) <= qpos)
    if ctx.key_padding_mask is not None:
        keep = keep & ~ctx.key_padding_mask.view(B, 1, 1, S)
    if isinstance(am, torch.Tensor):
        if am.dtype == torch.bool:
            keep = keep & am
        else:
            s = s + am.to(s.dtype)
    return s.masked_fill(~keep, float("-inf"))


@contextlib.contextmanager
def cache_activations(model, names: Iterable[str] | None = None) -> Iterator[ActivationCache]:
    """Cache activations of every attention module in ``model`` while the block runs.

    names: which activations (``blocks.{i}.attn.{kind}``); None caches all of them. Caching ``weights``
    makes those layers compute weights (their mechanism must be able to).
    """
    if names is None:
        attn_names, layer_names = None, [layer_point_name(i, k) for i, (_, b) in enumerate(block_modules(model))
                                         for k in LAYER_POINTS if k != "mlp_out" or _mlp(b) is not None]
    else:
        attn_names, layer_names = _split_names(names)
    mods = _modules(model) if attn_names is None or attn_names or not layer_names else attention_modules(model)
    cache = ActivationCache([n for n, _ in mods])
    wanted: dict[int, set[str]] = {}
    if attn_names is None:
        wanted = {i: set(ACTIVATIONS) for i in range(len(mods))}
    else:
        for name in attn_names:
            i, kind = _parse_name(name, len(mods))
            wanted.setdefault(i, set()).add(kind)
    pairs = []
    for i, kinds in wanted.items():
        m = mods[i][1]
        scratch: dict[str, torch.Tensor] = {}

        def hook(x, ctx, _i=i, _kinds=kinds, _scratch=scratch):
            kind = ctx.point
            if kind in _kinds:
                cache.store[activation_name(_i, kind)] = x.detach()
            if "scores" in _kinds:
                if kind in ("q", "k"):
                    _scratch[kind] = x.detach()
                elif kind == "z":  # q and k of this call are known by now
                    cache.store[activation_name(_i, "scores")] = _scores(_scratch["q"], _scratch["k"], ctx)
            return None

        points = set(kinds) - {"scores"}
        if "scores" in kinds:
            points |= {"q", "k", "z"}
        pairs += [(m, p, hook) for p in _HOOKED if p in points]
    n_blocks = len(block_modules(model))
    layer_wanted = []
    for name in layer_names:
        i, kind = _parse_layer_point(name, n_blocks)

        def keep(x, ctx, _name=name):
            cache.store[_name] = x.detach().clone()  # the block may add to its sublayer outputs in place
            return None

        layer_wanted.append((i, kind, keep))
    with _registered(pairs, model), _layer_hooks(model, layer_wanted):
        yield cache


def _check_positional(model, args: tuple, fn: str) -> None:
    """A Hugging Face model takes the arguments after ``input_ids`` in its own order (GPT-2's second is the
    KV cache, not the mask), so ``run_with_cache(gpt2, ids, mask)``, written as for MiniLM, would end in an
    AttributeError deep inside transformers: refuse it here in one line, naming the parameter."""
    import inspect
    import sys

    transformers = sys.modules.get("transformers")
    if len(args) < 2 or transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return
    params = [p.name for p in inspect.signature(model.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(params) > 1 and params[1] != "attention_mask":
        raise TypeError(f"{fn}: {type(model).__name__}'s second argument is {params[1]!r}, not the attention "
                        f"mask; pass the rest by name: {fn}(model, input_ids, attention_mask=mask) or "
                        f"{fn}(model, **tokenizer(text, return_tensors='pt'))")


def run_with_cache(model, *args, names: Iterable[str] | None = None, **kwargs):
    """``model(*args, **kwargs)`` under :func:`cache_activations`; returns (output, ActivationCache).

    For a Hugging Face model, pass what follows ``input_ids`` by name (``attention_mask=mask``): its
    positional order is the model's own (GPT-2's second argument is the KV cache)."""
    _check_positional(model, args, "run_with_cache")
    with cache_activations(model, names) as cache:
        out = model(*args, **kwargs)
    return out, cache


@contextlib.contextmanager
def hooks(model, fwd_hooks: Iterable[tuple[str, Callable]]) -> Iterator[None]:
    """Run the block with ``fwd_hooks``: pairs (activation name, fn(tensor, ctx) -> tensor | None).

    A returned tensor replaces the activation (``q, k, v, z, out`` and the layer points ``layers.{i}.resid_pre,
    mlp_out, resid_post``; ``weights`` is read only). ``scores`` is
    not a hook point (it is derived from q and k): hook q or k instead.
    """
    fwd_hooks = list(fwd_hooks)
    attn = [(n, f) for n, f in fwd_hooks if not (isinstance(n, str) and n.startswith("layers."))]
    n_blocks = len(block_modules(model))
    layer_wanted = [(*_parse_layer_point(n, n_blocks), f) for n, f in fwd_hooks
                    if isinstance(n, str) and n.startswith("layers.")]
    mods = _modules(model) if attn or not layer_wanted else []
    pairs = []
    for name, fn in attn:
        i, kind = _parse_name(name, len(mods))
        if kind == "scores":
            raise ValueError(f"{name!r} is derived from q and k, not a hook point; hook "
                             f"{activation_name(i, 'q')!r} or {activation_name(i, 'k')!r} instead")
        pairs.append((mods[i][1], kind, fn))
    with _registered(pairs, model), _layer_hooks(model, layer_wanted):
        yield


def run_with_hooks(model, *args, fwd_hooks: Iterable[tuple[str, Callable]] = (), **kwargs):
    """``model(*args, **kwargs)`` with ``fwd_hooks`` active (see :func:`hooks`); returns the output."""
    _check_positional(model, args, "run_with_hooks")
    with hooks(model, fwd_hooks):
        return model(*args, **kwargs)


# -- interventions on heads ---------------------------------------------------------------------------
def _head_list(heads, H: int) -> list[int]:
    hs = [heads] if isinstance(heads, int) and not isinstance(heads, bool) else list(heads)
    for h in hs:
        if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < H:
            raise ValueError(f"head {h!r} out of range: this layer has {H} heads (0..{H - 1})")
    return hs


def _layer_module(model, layer: int):
    mods = _modules(model)
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < len(mods):
        raise ValueError(f"layer {layer!r} out of range: {type(model).__name__} has {len(mods)} attention modules "
                         f"(0..{len(mods) - 1})")
    return mods[layer][1]


@contextlib.contextmanager
def ablate_heads(model, layer: int, heads, how: str = "zero") -> Iterator[None]:
    """Replace the per-head output z of ``heads`` in attention module ``layer`` while the block runs.

    how="zero": z = 0 (the head contributes only W_O's bias). how="mean": z becomes that head's mean z, so
    the head still adds its average, not its token-specific, information (Note [Mean ablation]):

    - in a call that sees every position (no causal flag, no KV cache: an encoder such as MiniLM), the mean
      over the call's positions (and batch), real tokens only when a key padding mask marks padding;
    - in a causal call, and in every call that continues a KV cache, z at position t is the mean over
      positions 0..t of the sequence (and the batch), real tokens only: what position t can see. It is
      kept as a running sum per head across the calls of one sequence, so decoding with a KV cache
      gives the tokens and logits that decoding without one gives.

    ``heads=[]`` ablates nothing and leaves the output bit for bit unchanged.

    Note [Mean ablation]: the mean over "the call's positions" is not defined incrementally: a KV-cache
    step is one position, whose mean is the token itself, so the ablation did nothing there and cached and
    uncached generation diverged. The causal (prefix) mean is the definition that a step can compute from
    a running sum and that a full causal call reproduces position by position; an encoder's
    bidirectional call keeps the whole-call mean (tests/instruments/test_capture.py's bias oracle).
    """
    if how not in ("zero", "mean"):
        raise ValueError(f"how must be 'zero' or 'mean', got {how!r}")
    m = _layer_module(model, layer)
    hs = _head_list(heads, m.num_heads)
    state: dict = {"next": None, "sum": None, "count": None}  # the running prefix sums of one causal sequence

    def real_rows(z, ctx):  # (B, L) 1.0 for real query tokens, or None when nothing marks padding
        kpm, L = ctx.key_padding_mask, z.shape[2]
        if kpm is None or kpm.shape[-1] != ctx.offset + L:  # a cross-attention mask covers keys, not queries
            return None
        return (~kpm[:, ctx.offset:]).to(z.dtype)

    def hook(z, ctx):  # z: (B, H, L, Dv)
        if not hs:
            return None
        z = z.clone()
        if how == "zero":
            z[:, hs] = 0.0
            return z
        sel = z[:, hs]  # (B, h, L, Dv)
        real = real_rows(z, ctx)
        w = torch.ones(sel.shape[0], sel.shape[2], dtype=z.dtype, device=z.device) if real is None else real  # (B, L)
        if not ctx.is_causal and ctx.offset == 0:
            mean = (sel * w[:, None, :, None]).sum((0, 2), keepdim=True) / w.sum().clamp(min=1)  # (1, h, 1, Dv)
            z[:, hs] = mean.expand_as(sel)
            return z
        if ctx.offset == 0:
            state.update(next=0, sum=None, count=None)  # a new sequence
        elif state["next"] != ctx.offset:
            raise ValueError(
                f"ablate_heads(how='mean') on layer {layer}: this call continues a KV cache at position {ctx.offset}, "
                f"but the ablation has seen {state['next'] or 0} positions of that sequence; enter ablate_heads "
                "before the sequence's first call (cache offset 0) and decode one sequence at a time")
        csum = torch.cumsum((sel * w[:, None, :, None]).sum(0), dim=1)  # (h, L, Dv): prefix sums of this call
        ccount = torch.cumsum(w.sum(0), dim=0)  # (L,)
        if state["sum"] is not None:
            csum = csum + state["sum"].unsqueeze(1)
            ccount = ccount + state["count"]
        mean = csum / ccount.clamp(min=1)[None, :, None]  # (h, L, Dv): position t's mean over 0..t
        state.update(next=ctx.offset + z.shape[2], sum=csum[:, -1], count=ccount[-1])
        z[:, hs] = mean.unsqueeze(0).expand_as(sel)
        return z

    with _registered([(m, "z", hook)], model):
        yield


@contextlib.contextmanager
def patch_heads(model, layer: int, heads, source) -> Iterator[None]:
    """Replace the per-head output z of ``heads`` in module ``layer`` by another run's while the block runs.

    source: an :class:`ActivationCache` holding ``blocks.{layer}.attn.z`` (e.g. from :func:`run_with_cache`
    on a second input of the same token count) or that z tensor itself, [B, H, L, Dv]. Patching a run with
    its own z is the identity bit for bit when the source cache did not record weights (recording weights
    runs a weights-returning kernel whose z agrees to float rounding, not bitwise).
    """
    m = _layer_module(model, layer)
    hs = _head_list(heads, m.num_heads)
    src = source[activation_name(layer, "z")] if isinstance(source, ActivationCache) else source
    if not isinstance(src, torch.Tensor) or src.dim() != 4 or src.shape[1] != m.num_heads:
        raise ValueError(f"source must be an ActivationCache with {activation_name(layer, 'z')} or a z tensor "
                         f"[B, H={m.num_heads}, L, Dv], got {getattr(src, 'shape', type(src).__name__)}")

    def hook(z, ctx):  # z: (B, H, L, Dv)
        if z.shape != src.shape:
            raise ValueError(f"cannot patch layer {layer}: this run's z is {list(z.shape)} but the source's is "
                             f"{list(src.shape)} (same batch and token count needed)")
        if not hs:
            return None
        z = z.clone()
        z[:, hs] = src[:, hs].to(z.dtype)
        return z

    with _registered([(m, "z", hook)], model):
        yield


def _call(model, inputs):
    return model(**inputs) if isinstance(inputs, dict) else model(*(inputs if isinstance(inputs, tuple) else (inputs,)))


@torch.no_grad()
def patch_sweep(model, inputs, source: ActivationCache, metric: Callable, *, layers=None, heads=None,
                positions: bool = False) -> torch.Tensor:
    """Activation patching over layers × heads (× positions): the metric of ``model(inputs)`` with one head's z
    (at one query position) replaced by ``source``'s, for every head in turn.

    inputs: a dict (``model(**inputs)``), a tuple (``model(*inputs)``) or one tensor. source: an
    ActivationCache of a run on another input of the same shape (``run_with_cache``), holding
    ``blocks.{i}.attn.z`` for the swept layers. metric: output -> a number (e.g. a logit difference).
    layers, heads: which (default all). positions: also sweep the query position t (patch z[:, h, t] only).
    Returns float64 [len(layers), len(heads)] or [len(layers), len(heads), L]; cost: one forward pass per
    cell. Equivalent to ``with patch_heads(model, layer, [h], source): metric(model(**inputs))`` per cell.
    """
    mods = _modules(model)
    layers = list(range(len(mods))) if layers is None else [layers] if isinstance(layers, int) else list(layers)
    for li in layers:
        _layer_module(model, li)
    H = mods[layers[0]][1].num_heads if layers else 0
    heads = list(range(H)) if heads is None else _head_list(heads, H)
    srcs = {li: source[activation_name(li, "z")] if isinstance(source, ActivationCache) else None for li in layers}
    if any(v is None for v in srcs.values()):
        raise TypeError(f"source must be an ActivationCache holding blocks.{{i}}.attn.z, got {type(source).__name__}")
    L = next(iter(srcs.values())).shape[2] if srcs else 0
    out = torch.zeros((len(layers), len(heads)) + ((L,) if positions else ()), dtype=torch.float64)

    def value(o) -> float:
        v = metric(o)
        return float(v.item() if isinstance(v, torch.Tensor) else v)

    for a, li in enumerate(layers):
        src = srcs[li]
        for b, h in enumerate(heads):
            for t in (range(L) if positions else [None]):
                def hook(z, ctx, _h=h, _t=t, _src=src, _li=li):  # z: (B, H, L, Dv)
                    if z.shape != _src.shape:
                        raise ValueError(f"cannot patch layer {_li}: this run's z is {list(z.shape)} but the "
                                         f"source's is {list(_src.shape)} (same batch and token count needed)")
                    z = z.clone()
                    if _t is None:
                        z[:, _h] = _src[:, _h].to(z.dtype)
                    else:
                        z[:, _h, _t] = _src[:, _h, _t].to(z.dtype)
                    return z

                with hooks(model, [(activation_name(li, "z"), hook)]):
                    v = value(_call(model, inputs))
                if t is None:
                    out[a, b] = v
                else:
                    out[a, b, t] = v
    return out


def sentence_embeddings(model, batch: dict) -> torch.Tensor:
    """MiniLM sentence embeddings [B, E] from a ``model.tokenize(...)`` batch, as ``MiniLM.encode`` makes them
    (mean of the last hidden states over real tokens, L2-normalised), in one forward pass."""
    h = model(batch["input_ids"], batch["attention_mask"]).last_hidden_state  # (B, T, E)
    m = batch["attention_mask"].unsqueeze(-1).to(h.dtype)  # (B, T, 1)
    pooled = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, p=2, dim=-1)


def hf_sentence_embeddings(model, batch) -> torch.Tensor:
    """A Hugging Face model's sentence embeddings [B, E] from a tokenizer's padded batch: its last hidden states,
    averaged over the real tokens and L2-normalised (as MiniLM's are made)."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True)
    h = out.hidden_states[-1]  # (B, T, E)
    m = batch["attention_mask"].unsqueeze(-1).to(h.dtype)  # (B, T, 1)
    pooled = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, p=2, dim=-1)


@torch.no_grad()
def head_effect(model, sentences, layer: int, heads, how="zero", *, tokenizer=None) -> dict:
    """The effect of one intervention on a model's sentence embeddings.

    model: attnlab's MiniLM (it tokenises), or any Hugging Face model with its ``tokenizer``; the embedding is
    the mean of the last hidden states over real tokens, L2-normalised (:func:`sentence_embeddings`,
    :func:`hf_sentence_embeddings`). A tokenizer without a pad token (most decoders') pads with its end-of-text
    token: this sets ``tokenizer.pad_token``.
    how: "zero" or "mean" (:func:`ablate_heads`), or an ActivationCache / z tensor to patch from
    (:func:`patch_heads`; the source must come from a batch of the same shape as ``sentences`` tokenised
    together). Returns a dict: layer, heads, how, cosine (per sentence, float64, with vs without),
    mean_cosine, min_cosine, max_abs_diff.
    """
    if isinstance(sentences, str):
        sentences = [sentences]
    if not sentences:
        raise ValueError("sentences must not be empty")
    if tokenizer is not None:
        if getattr(tokenizer, "pad_token", "") is None:  # decoders often have none: pad with end-of-text
            tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
        batch = dict(tokenizer(list(sentences), return_tensors="pt", padding=True))
        embed = hf_sentence_embeddings
    elif callable(getattr(model, "tokenize", None)):
        batch = model.tokenize(list(sentences))
        embed = sentence_embeddings
    else:
        raise TypeError(f"head_effect on {type(model).__name__} needs its tokenizer: head_effect(model, sentences, "
                        "layer, heads, tokenizer=tokenizer)")
    base = embed(model, batch)
    ctx = ablate_heads(model, layer, heads, how) if isinstance(how, str) else patch_heads(model, layer, heads, how)
    with ctx:
        changed = embed(model, batch)
    a, b = base.double(), changed.double()
    cos = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
    return {"layer": layer, "heads": _head_list(heads, _layer_module(model, layer).num_heads),
            "how": how if isinstance(how, str) else "patch", "cosine": cos.tolist(),
            "mean_cosine": float(cos.mean()), "min_cosine": float(cos.min()),
            "max_abs_diff": float((a - b).abs().max())}


# -- the weights / summary recorder (formerly attnlab.inspect.capture) --------------------------------
@dataclass
class Record:
    """One call of one attention module: where it sits, which call it was, and what was recorded
    (``weights`` [B, H, L, S] in weights mode, a ``StreamingSummary`` per batch element in summary mode)."""

    name: str  # module path inside the captured model, e.g. "layers.3.self_attn"
    index: int  # order of the module among attention modules
    call: int  # how many times this module had been called before (0 = first call)
    weights: torch.Tensor | None = None  # (B, H, L, S) in weights mode
    summary: object | None = None  # StreamingSummary per batch element in summary mode (list)


@dataclass
class Capture:
    """Everything ``capture`` recorded: the mode ("weights" or "summary"), the attention modules' names,
    and one ``Record`` per call; ``last()``, ``weights()`` and ``summaries()`` read it."""

    mode: str
    names: list[str]
    records: list[Record] = field(default_factory=list)

    def last(self) -> list[Record]:
        """The latest call of each attention module, in module order."""
        latest: dict[int, Record] = {}
        for r in self.records:
            latest[r.index] = r
        return [latest[i] for i in sorted(latest)]

    def weights(self) -> list[torch.Tensor]:
        """Per-head weights [B, H, L, S] of each module's latest call (mode="weights")."""
        if self.mode != "weights":
            raise ValueError("this capture ran in summary mode; use .summaries() or capture(mode='weights')")
        return [r.weights for r in self.last()]

    def summaries(self) -> list:
        """Per module: a list (one per batch element) of StreamingSummary (mode="summary")."""
        if self.mode != "summary":
            raise ValueError("this capture ran in weights mode; use .weights() or capture(mode='summary')")
        return [r.summary for r in self.last()]


@contextlib.contextmanager
def capture(module, mode: str = "weights", *, topk: int = 5) -> Iterator[Capture]:
    """Record attention of every attnlab MultiHeadAttention inside ``module`` during the block.

    mode: "weights" keeps per-head weights [B, H, L, S] (detached); "summary" keeps streaming
    summaries (entropy, max weight, sink mass, top-``topk`` keys, distance histogram) per head from the
    projected q, k, without an [L, S] tensor; additive position biases (ALiBi) are not included there.
    """
    if mode not in ("weights", "summary"):
        raise ValueError(f"mode must be 'weights' or 'summary', got {mode!r}")
    mods = _modules(module)
    cap = Capture(mode, [n for n, _ in mods])
    calls = [0] * len(mods)
    pairs = []
    for idx, (name, m) in enumerate(mods):
        if mode == "weights":
            def on_weights(w, ctx, _idx=idx, _name=name):
                cap.records.append(Record(_name, _idx, calls[_idx], weights=w.detach()))
                calls[_idx] += 1

            pairs.append((m, "weights", on_weights))
        else:
            seen: dict[str, torch.Tensor] = {}

            def on_q(q, ctx, _seen=seen):
                _seen["q"] = q.detach()

            def on_k(k, ctx, _idx=idx, _name=name, _seen=seen):
                cap.records.append(Record(_name, _idx, calls[_idx], summary=_summarise(_seen.pop("q"), k.detach(),
                                                                                        ctx, topk)))
                calls[_idx] += 1

            pairs += [(m, "q", on_q), (m, "k", on_k)]
    with _registered(pairs, module):
        yield cap


def _summarise(q: torch.Tensor, k: torch.Tensor, ctx, topk: int) -> list:
    """Streaming summaries of one call from its projected q [B, H, L, D], k [B, Hkv, S, D]: one per batch element."""
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # (B, H, S, D)
    pattern = ctx.pattern
    if ctx.is_causal:
        pattern = P.causal() if pattern is None else pattern & P.causal()
    am = ctx.attn_mask
    if isinstance(am, P.Pattern):
        pattern = am if pattern is None else pattern & am
        am = None
    if pattern is not None and ctx.offset:  # under a KV cache the queries are rows offset.. (as in _scores)
        pattern = P.shifted(pattern, ctx.offset)
    kpm = ctx.key_padding_mask
    out = []
    for b in range(q.shape[0]):
        pat = pattern
        if kpm is not None:
            kp = P.from_key_padding_mask(kpm[b:b + 1])
            pat = kp if pat is None else pat & kp
        mask_b = None
        if isinstance(am, torch.Tensor):
            mask_b = am if am.dim() == 2 else am[b if am.shape[0] > 1 else 0]
        out.append(streaming_summary(q[b], k[b], mask_b, scale=ctx.module.scale, pattern=pat, k=topk))
    return out
