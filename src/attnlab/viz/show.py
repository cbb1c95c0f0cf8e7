"""``attnlab.viz.show``: the viz page for attention weights from any model (Hugging Face, attnlab, raw).

    out = bert(**enc, output_attentions=True)            # transformers, attn_implementation="eager"
    page = attnlab.viz.show(out.attentions, tokens)       # tuple of [B, H, L, L] per layer
    page                                                  # inline in Jupyter (_repr_html_)
    page.save("reports/viz/bert.html")                    # the same offline page as `attnlab viz`

Accepted ``attentions`` (weights after softmax, values in [0, 1]):
- a tuple or list with one tensor per layer: [B, H, L, S] (Hugging Face), [H, L, S] or [L, S];
- an object with ``.attentions`` (a Hugging Face model output) or ``.weights()`` (``attnlab.capture.capture``);
- one tensor: [L, S] (one head), [H, L, S] (one layer), [layers, H, L, S] or [layers, B, H, L, S].
- a transformers model (or any model ``attnlab.capture`` can hook) with ``inputs=`` (the keyword arguments of
  one call): ``show(model, tokens, inputs=enc)`` runs ``model(**enc)`` under ``capture.run_with_cache`` and
  shows the weights it caught, whatever the model's attn_implementation (sdpa included).
torch tensors on any device and dtype, or numpy arrays. Self-attention has L = S = len(tokens);
cross-attention (L != S) takes ``key_tokens`` (S labels) beside ``tokens`` (L labels). For a sentence pair in
one sequence, ``sentence_b_start`` and ``pair="AB"`` (or "AA", "BA", "BB") show one block of it.

    page = attnlab.viz.show(model, tokens, inputs=enc)    # any HF model, no attn_implementation="eager" needed
    attnlab.viz.save(page, "bert.svg")                   # or .png: the layer's heads as heatmaps
"""
from __future__ import annotations

import html
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from ..report import atomic_write_text
from .data import weights_page_data
from .page import render_page
from .. import capture

__all__ = ["show", "AttentionPage", "save", "model_name"]

PAIRS = ("all", "AA", "AB", "BA", "BB")

# Weights a softmax produced may overshoot [0, 1] by rounding only; anything further is not weights.
_SLACK = 1e-3


class AttentionPage:
    """One rendered viz page: ``.html`` (the whole offline page), ``.data`` (what it embeds),
    ``.save(path)``, and ``_repr_html_`` so Jupyter shows it inline (an iframe whose ``srcdoc`` holds the
    escaped page: no file, no server, no network)."""

    def __init__(self, data: dict, height: int = 760):
        self.data = data
        self.html = render_page(data)
        self.height = int(height)

    def save(self, path, *, layer: int = 0, heads=None) -> Path:
        """Write the page atomically: to ``path`` if it ends in .html/.htm; a picture if it ends in .png or
        .svg (``attnlab.viz.save``: layer ``layer``'s heads as heatmaps); else to ``path/index.html``."""
        p = Path(path)
        if p.suffix.lower() in (".png", ".svg"):
            return save(self, p, layer=layer, heads=heads)
        if p.suffix.lower() not in (".html", ".htm"):
            p = p / "index.html"
        return atomic_write_text(p, self.html)

    def _repr_html_(self) -> str:
        doc = html.escape(self.html, quote=True)
        return (f'<iframe srcdoc="{doc}" sandbox="allow-scripts allow-downloads" '
                f'style="width:100%;height:{self.height}px;'
                f'border:1px solid #ddd" title="attnlab viz"></iframe>')  # allow-downloads: the export buttons

    def __repr__(self) -> str:
        d = self.data
        keys = f" × {d['S']} keys" if d.get("S", d["T"]) != d["T"] else ""
        return (f"AttentionPage({d['T']} tokens{keys}, {d['layers']} layers × {d['heads']} heads, {d['mode']} mode, "
                f"{len(self.html) / 1024:.0f} KiB)")


def _as_tensor(x, what: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float32)
    if isinstance(x, np.ndarray):
        if not np.issubdtype(x.dtype, np.number):
            raise TypeError(f"{what} must hold numbers, got a numpy array of {x.dtype}")
        return torch.from_numpy(np.asarray(x, dtype=np.float32))
    raise TypeError(f"{what} must be a torch.Tensor or numpy array, got {type(x).__name__}")


_NO_WEIGHTS = ("Either let attnlab catch them: attnlab.viz.show(model, tokens, inputs=enc) (or out, cache = "
               "attnlab.capture.run_with_cache(model, **enc); attnlab.viz.show(cache, tokens)), which works with any "
               "attn_implementation; or load the model with attn_implementation=\"eager\" and call it with "
               "output_attentions=True.")


def _captured(model, inputs) -> list[torch.Tensor]:
    """Run ``model(**inputs)`` under capture.run_with_cache and return its weights [B, H, L, S] per layer."""

    if not isinstance(inputs, Mapping):  # a dict, or a tokenizer's BatchEncoding (a Mapping, not a dict)
        raise TypeError("show(model, tokens, inputs=...) needs inputs: a dict of the model's keyword arguments "
                        "(e.g. the tokenizer's output), got " + type(inputs).__name__)
    mods = capture.attention_modules(model)
    if not mods:
        raise ValueError(f"{type(model).__name__} has no attention module attnlab can hook (neither "
                         "attnlab.nn.MultiHeadAttention nor a transformers attention module)")
    names = [capture.activation_name(i, "weights") for i in range(len(mods))]
    with torch.no_grad():
        _, cache = capture.run_with_cache(model, names=names, **dict(inputs))
    return cache.weights()


def _layers(attentions, batch_index: int) -> list[torch.Tensor]:
    """attentions (any accepted form) -> one [H, L, S] float32 tensor per layer."""
    if hasattr(attentions, "attentions") and not isinstance(attentions, (torch.Tensor, np.ndarray)):
        att = attentions.attentions
        if att is None or (isinstance(att, (tuple, list)) and len(att) == 0):
            got = "None" if att is None else "()"
            raise ValueError(f"the model output has attentions={got}: the model returned no attention weights "
                             "(transformers >= 5 runs sdpa by default, whose kernels return none, and "
                             f"output_attentions=True alone does not change that). {_NO_WEIGHTS}")
        attentions = att
    elif callable(getattr(attentions, "weights", None)):  # attnlab.capture.capture's result
        attentions = attentions.weights()
    if isinstance(attentions, (torch.Tensor, np.ndarray)):
        t = _as_tensor(attentions, "attentions")
        if t.dim() == 2:  # [L, S]: one head
            return [t.unsqueeze(0)]
        if t.dim() == 3:  # [H, L, S]: one layer
            return [t]
        if t.dim() == 4:  # [layers, H, L, S]
            return list(t.unbind(0))
        if t.dim() == 5:  # [layers, B, H, L, S], e.g. torch.stack(out.attentions)
            _check_batch(t.shape[1], batch_index, f"attentions {list(t.shape)} (layers, B, H, L, S)")
            return list(t[:, batch_index].unbind(0))
        raise ValueError(f"attentions must be [L, S], [H, L, S], [layers, H, L, S] or [layers, B, H, L, S], "
                         f"got a tensor of shape {list(t.shape)}")
    if not isinstance(attentions, (list, tuple)):
        raise TypeError("attentions must be a tuple/list of per-layer tensors (what output_attentions=True returns), "
                        f"a tensor, or attnlab's capture; got {type(attentions).__name__}")
    if len(attentions) == 0:
        raise ValueError("attentions is empty: no layers to show. If it is a transformers model's "
                         "out.attentions, the model ran sdpa, which returns no weights. " + _NO_WEIGHTS)
    out = []
    for li, a in enumerate(attentions):
        if a is None:
            raise ValueError(f"attentions[{li}] is None: that layer returned no weights (an SDPA/flash kernel?). "
                             + _NO_WEIGHTS)
        t = _as_tensor(a, f"attentions[{li}]")
        if t.dim() == 4:  # [B, H, L, S]
            _check_batch(t.shape[0], batch_index, f"attentions[{li}] {list(t.shape)} (B, H, L, S)")
            t = t[batch_index]
        elif t.dim() == 2:
            t = t.unsqueeze(0)
        elif t.dim() != 3:
            raise ValueError(f"attentions[{li}] must be [B, H, L, S], [H, L, S] or [L, S], got shape {list(t.shape)}")
        out.append(t)
    return out


def _check_batch(B: int, batch_index: int, what: str) -> None:
    if not -B <= batch_index < B:
        raise ValueError(f"batch_index={batch_index} is out of range for {what}: batch size {B}")


def _labels(tokens, what: str) -> list[str]:
    if isinstance(tokens, str):
        raise TypeError(f"{what} must be a list of strings, one per position; got one str (split it, or pass "
                        "tokenizer.convert_ids_to_tokens(input_ids[0]))")
    try:
        out = [str(t) for t in tokens]
    except TypeError:
        raise TypeError(f"{what} must be a list of strings, one per position; got {type(tokens).__name__}") from None
    if not out:
        raise ValueError(f"{what} is empty: give one string per position")
    return out


def _pair_block(layers, tokens, sentence_b_start, pair):
    """Cut the (query, key) block of a sentence pair: A = tokens[:b], B = tokens[b:]."""
    if pair not in PAIRS:
        raise ValueError(f"pair must be one of {', '.join(PAIRS)}, got {pair!r}")
    T = len(tokens)
    if sentence_b_start is None:
        if pair != "all":
            raise ValueError(f"pair={pair!r} needs sentence_b_start (the index of sentence B's first token)")
        return layers, tokens, tokens
    b = sentence_b_start
    if isinstance(b, bool) or not isinstance(b, int) or not 0 < b < T:
        raise ValueError(f"sentence_b_start must be an index in 1..{T - 1} (the first token of sentence B among "
                         f"{T} tokens), got {b!r}")
    if pair == "all":
        return layers, tokens, tokens
    span = {"A": slice(0, b), "B": slice(b, T)}
    qs, ks = span[pair[0]], span[pair[1]]
    return [w[:, qs, ks] for w in layers], tokens[qs], tokens[ks]


def model_name(model) -> str:
    """A model's name for the page header: the checkpoint it was loaded from (its folder or GGUF file's name) and
    its class, e.g. "SmolLM2-135M-Instruct.Q4_1 (LlamaForCausalLM)"; the class alone when nothing says more."""
    cls = type(model).__name__
    cfg = getattr(model, "config", None)
    where = str(getattr(model, "name_or_path", "") or getattr(cfg, "name_or_path", "")
                or getattr(cfg, "_name_or_path", ""))
    if not where:
        return cls
    p = Path(where)
    name = p.name or where
    try:
        ggufs = sorted(p.glob("*.gguf")) if p.is_dir() else []
    except OSError:
        ggufs = []
    if len(ggufs) == 1:  # a GGUF checkpoint is loaded from its folder: the file names the model
        name = ggufs[0].stem
    return f"{name} ({cls})"


def _unpadded(layers, tokens, inputs, batch_index):
    """Drop the padded positions of sequence ``batch_index`` (attention_mask 0) from the weights and, when they
    cover every position, the tokens; (layers, tokens, how many were dropped)."""
    mask = inputs.get("attention_mask") if isinstance(inputs, Mapping) else None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or not -mask.shape[0] <= batch_index < mask.shape[0]:
        return layers, tokens, 0
    keep = mask[batch_index].detach().to("cpu").bool()  # (T,)
    L = layers[0].shape[-1]
    if keep.all() or keep.shape[0] != L or layers[0].shape[-2] != L or not keep.any():
        return layers, tokens, 0
    if len(tokens) == L:
        tokens = [t for t, k in zip(tokens, keep.tolist()) if k]
    return [w[:, keep][:, :, keep] for w in layers], tokens, int((~keep).sum())


def show(attentions, tokens, *, key_tokens=None, sentence_b_start: int | None = None, pair: str = "all",
         inputs: dict | None = None, batch_index: int = 0, title: str = "attnlab viz", model: str | None = None,
         text: str | None = None, dense_max_tokens: int = 128, topk: int = 4, height: int = 760,
         pretty: bool = True, attention_mask=None) -> AttentionPage:
    """The viz page (head, matrix, model and pattern views) for ``attentions`` over ``tokens``.

    attentions: see the module docstring; each layer becomes [H, L, S].
    tokens: one string per query position, L of them (e.g. ``tokenizer.convert_ids_to_tokens(ids)``).
    key_tokens: one string per key position (S), for cross-attention; None means the keys are ``tokens``.
    sentence_b_start, pair: a sentence pair in one sequence (A = tokens[:sentence_b_start], B = the rest);
    pair "AB" shows A's queries over B's keys (likewise "AA", "BA", "BB"; "all", the default, the whole).
    inputs: with a model as ``attentions``, the keyword arguments of one call (``model(**inputs)``); with an
    ``attention_mask`` in them, the padded positions of the sequence shown are left out (tokens may then list
    every position or the real ones only). attention_mask: the same for weights given as tensors ([B, T], 1 =
    token), e.g. the tokenizer's mask beside ``out.attentions``.
    batch_index: which sequence of a batched [B, H, L, S] input to show.
    model: the model's name in the header (default: read from the model given, else "given weights").
    pretty: token labels as text (``Ġcapital`` -> ``capital``, ``▁cap`` -> ``cap``, ``##ing`` -> ``ing``); the raw
    token shows on hover. A causal run (no weight on later keys) is named so in the header and pattern view.
    Up to ``dense_max_tokens`` tokens the page carries every weight (8 bits, error ≤ 0.5/255); longer
    inputs carry the top-``topk`` keys per query with entropy, max weight and distance histograms.
    Returns an ``AttentionPage`` (``.save(path)`` for HTML, PNG or SVG; inline display in Jupyter). Raises
    ValueError naming the shapes when they do not fit the tokens, or when the values are not attention weights.
    """
    tokens = _labels(tokens, "tokens")
    keys = tokens if key_tokens is None else _labels(key_tokens, "key_tokens")
    if key_tokens is not None and (sentence_b_start is not None or pair != "all"):
        raise ValueError("give either key_tokens (cross-attention) or sentence_b_start/pair (a sentence pair in "
                         "one sequence), not both")
    if dense_max_tokens < 1 or topk < 1:
        raise ValueError(f"dense_max_tokens and topk must be >= 1, got {dense_max_tokens} and {topk}")
    if isinstance(attentions, torch.nn.Module):
        if inputs is None:
            raise TypeError(f"attentions is a model ({type(attentions).__name__}): pass inputs=, the keyword "
                            "arguments of one call, e.g. show(model, tokens, inputs=tokenizer(text, "
                            "return_tensors='pt'))")
        if model is None:
            model = model_name(attentions)
        attentions = _captured(attentions, inputs)
    elif inputs is not None:
        raise TypeError("inputs= is for show(model, tokens, inputs=...); attentions here is not a model")
    layers = _layers(attentions, batch_index)
    dropped = 0
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a [B, T] tensor (1 = token), got {type(attention_mask).__name__}")
    masks = inputs if inputs is not None else {"attention_mask": attention_mask} if attention_mask is not None else None
    if masks is not None and key_tokens is None:
        layers, tokens, dropped = _unpadded(layers, tokens, masks, batch_index)
        keys = tokens
    H = layers[0].shape[0]
    for li, w in enumerate(layers):
        Hl, L, S = w.shape
        if Hl == 0:
            raise ValueError(f"layer {li} has no heads (weights of shape [H, L, S] = {list(w.shape)}): show() "
                             "needs at least one head per layer")
        if (L, S) != (len(tokens), len(keys)):
            if key_tokens is None and L != S:
                raise ValueError(f"layer {li} attends {L} queries to {S} keys (shape [H={Hl}, L={L}, S={S}]): "
                                 f"cross-attention needs key_tokens, one label per key, beside tokens ({len(tokens)} "
                                 "query labels)")
            what = f"tokens has {len(tokens)} entries" + ("" if key_tokens is None else
                                                          f" and key_tokens {len(keys)}")
            raise ValueError(f"layer {li} has weights for {L} positions × {S} keys (shape [H={Hl}, L={L}, S={S}]) "
                             f"but {what}; pass one token per position (special tokens and padding included)")
        if Hl != H:
            raise ValueError(f"every layer must have the same number of heads: layer 0 has {H}, layer {li} has {Hl}")
        if not torch.isfinite(w).all():
            raise ValueError(f"layer {li} contains NaN or infinity; attention weights are finite")
        lo, hi = float(w.min()), float(w.max())
        if lo < -_SLACK or hi > 1 + _SLACK:
            raise ValueError(f"layer {li} has values in [{lo:.3g}, {hi:.3g}], outside [0, 1]: show() takes attention "
                             "weights after softmax, not scores or logits")
    layers = [w.clamp(0.0, 1.0) for w in layers]
    notes = [f"{dropped} padding position{'s' * (dropped != 1)} left out (the attention mask's zeros)"] if dropped else []
    if key_tokens is None:
        layers, tokens, keys = _pair_block(layers, tokens, sentence_b_start, pair)
        if pair != "all":
            notes.append(f"sentence pair: sentence {pair[0]}'s queries over sentence {pair[1]}'s keys (rows are a "
                         "block of the full attention, so they need not sum to 1)")
    data = weights_page_data(layers, tokens, model="given weights" if model is None else model, title=title,
                             text=text, key_tokens=keys, dense_max_tokens=dense_max_tokens, topk=topk, notes=notes,
                             pretty=pretty)
    if sentence_b_start is not None and pair == "all":
        data["sentence_b_start"] = int(sentence_b_start)
    return AttentionPage(data, height=height)


def _page_weights(data: dict, layer: int) -> np.ndarray:
    """Layer ``layer``'s weights [H, L, S] from page data (dense: every weight; summary: the top-k per query)."""
    import base64

    L, S, H = data["T"], data.get("S", data["T"]), data["heads"]
    if data["mode"] == "dense":
        raw = np.frombuffer(base64.b64decode(data["dense"]["b64"][layer]), dtype=np.uint8)
        return raw.reshape(H, L, S) / 255.0
    k = data["summary"]["k"]
    idx = np.frombuffer(base64.b64decode(data["summary"]["idx"][layer]), dtype="<u2").reshape(H, L, k)
    val = np.frombuffer(base64.b64decode(data["summary"]["w"][layer]), dtype=np.uint8).reshape(H, L, k) / 255.0
    out = np.zeros((H, L, S))
    np.put_along_axis(out, idx.astype(np.int64), val, axis=-1)
    return out


def save(what, path, *, tokens=None, key_tokens=None, layer: int = 0, heads=None, title: str | None = None) -> Path:
    """Write a picture of attention weights to ``path`` (.png or .svg, chosen by the suffix; matplotlib).

    what: an ``AttentionPage`` (its layer ``layer``, as the page holds it: 8-bit weights, or the top-k keys
    per query of a long input) or anything ``show`` accepts as weights, with ``tokens`` (and ``key_tokens``).
    heads: which heads (default all), one heatmap each, rows = queries, columns = keys, labelled by token.
    Returns the path. The browser page's own "export" buttons save the rendered view as SVG or PNG.
    """
    from .heatmaps import plot_heads  # defers matplotlib until a figure is drawn

    p = Path(path)
    if p.suffix.lower() not in (".png", ".svg"):
        raise ValueError(f"path must end in .png or .svg, got {str(path)!r} (an .html page: AttentionPage.save)")
    page = what if isinstance(what, AttentionPage) else show(what, tokens, key_tokens=key_tokens)
    d = page.data
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < d["layers"]:
        raise ValueError(f"layer {layer!r} out of range: the page has {d['layers']} layers (0..{d['layers'] - 1})")
    w = _page_weights(d, layer)
    return plot_heads(w, p, tokens=d["tokens"], key_tokens=d.get("key_tokens"), heads=heads,
                      title=title or f"{d['title']}: layer {layer} ({d['model']})")
