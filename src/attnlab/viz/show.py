"""``attnlab.viz.show``: the viz page for attention weights from any model (Hugging Face, attnlab, raw).

    out = bert(**enc, output_attentions=True)            # transformers, attn_implementation="eager"
    page = attnlab.viz.show(out.attentions, tokens)       # tuple of [B, H, L, L] per layer
    page                                                  # inline in Jupyter (_repr_html_)
    page.save("reports/viz/bert.html")                    # the same offline page as `attnlab viz`

Accepted ``attentions`` (weights after softmax, values in [0, 1]):
- a tuple or list with one tensor per layer: [B, H, L, S] (Hugging Face), [H, L, S] or [L, S];
- an object with ``.attentions`` (a Hugging Face model output) or ``.weights()`` (``attnlab.capture.capture``);
- one tensor: [L, S] (one head), [H, L, S] (one layer), [layers, H, L, S] or [layers, B, H, L, S].
torch tensors on any device and dtype, or numpy arrays. Self-attention only: L = S = len(tokens).
"""
from __future__ import annotations

import html
from pathlib import Path

import numpy as np
import torch

from ..report import atomic_write_text
from .data import weights_page_data
from .page import render_page

__all__ = ["show", "AttentionPage"]

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

    def save(self, path) -> Path:
        """Write the page atomically: to ``path`` if it ends in .html/.htm, else to ``path/index.html``."""
        p = Path(path)
        if p.suffix.lower() not in (".html", ".htm"):
            p = p / "index.html"
        return atomic_write_text(p, self.html)

    def _repr_html_(self) -> str:
        doc = html.escape(self.html, quote=True)
        return (f'<iframe srcdoc="{doc}" sandbox="allow-scripts" style="width:100%;height:{self.height}px;'
                f'border:1px solid #ddd" title="attnlab viz"></iframe>')

    def __repr__(self) -> str:
        d = self.data
        return (f"AttentionPage({d['T']} tokens, {d['layers']} layers × {d['heads']} heads, {d['mode']} mode, "
                f"{len(self.html) / 1024:.0f} KiB)")


def _as_tensor(x, what: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float32)
    if isinstance(x, np.ndarray):
        if not np.issubdtype(x.dtype, np.number):
            raise TypeError(f"{what} must hold numbers, got a numpy array of {x.dtype}")
        return torch.from_numpy(np.asarray(x, dtype=np.float32))
    raise TypeError(f"{what} must be a torch.Tensor or numpy array, got {type(x).__name__}")


def _layers(attentions, batch_index: int) -> list[torch.Tensor]:
    """attentions (any accepted form) -> one [H, L, S] float32 tensor per layer."""
    if hasattr(attentions, "attentions") and not isinstance(attentions, (torch.Tensor, np.ndarray)):
        att = attentions.attentions
        if att is None:
            raise ValueError("the model output has attentions=None: call the model with output_attentions=True "
                             "(Hugging Face: and attn_implementation='eager', since SDPA kernels return no weights)")
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
        raise ValueError("attentions is empty: no layers to show")
    out = []
    for li, a in enumerate(attentions):
        if a is None:
            raise ValueError(f"attentions[{li}] is None: that layer returned no weights (an SDPA/flash kernel?); "
                             "use attn_implementation='eager' or an attnlab mechanism that returns weights")
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


def show(attentions, tokens, *, batch_index: int = 0, title: str = "attnlab viz", model: str = "given weights",
         text: str | None = None, dense_max_tokens: int = 128, topk: int = 4, height: int = 760) -> AttentionPage:
    """The viz page (head, matrix, model and pattern views) for ``attentions`` over ``tokens``.

    attentions: see the module docstring; each layer becomes [H, L, S] with L = S = len(tokens).
    tokens: one string per position (e.g. ``tokenizer.convert_ids_to_tokens(ids)``).
    batch_index: which sequence of a batched [B, H, L, S] input to show.
    Up to ``dense_max_tokens`` tokens the page carries every weight (8 bits, error ≤ 0.5/255); longer
    inputs carry the top-``topk`` keys per query with entropy, max weight and distance histograms.
    Returns an ``AttentionPage`` (``.save(path)``, inline display in Jupyter). Raises ValueError naming
    the shapes when they do not fit the tokens, or when the values are not attention weights.
    """
    if isinstance(tokens, str):
        raise TypeError("tokens must be a list of strings, one per position; got one str (split it, or pass "
                        "tokenizer.convert_ids_to_tokens(input_ids[0]))")
    try:
        tokens = [str(t) for t in tokens]
    except TypeError:
        raise TypeError(f"tokens must be a list of strings, one per position; got {type(tokens).__name__}") from None
    if not tokens:
        raise ValueError("tokens is empty: give one string per position")
    if dense_max_tokens < 1 or topk < 1:
        raise ValueError(f"dense_max_tokens and topk must be >= 1, got {dense_max_tokens} and {topk}")
    layers = _layers(attentions, batch_index)
    T = len(tokens)
    H = layers[0].shape[0]
    for li, w in enumerate(layers):
        Hl, L, S = w.shape
        if Hl == 0:
            raise ValueError(f"layer {li} has no heads (weights of shape [H, L, S] = {list(w.shape)}): show() "
                             "needs at least one head per layer")
        if L != S:
            raise ValueError(f"layer {li} attends {L} queries to {S} keys; show() draws self-attention (L = S) only")
        if L != T:
            raise ValueError(f"layer {li} has weights for {L} positions (shape [H={Hl}, L={L}, S={S}]) but tokens has "
                             f"{T} entries; pass one token per position (special tokens and padding included)")
        if Hl != H:
            raise ValueError(f"every layer must have the same number of heads: layer 0 has {H}, layer {li} has {Hl}")
        if not torch.isfinite(w).all():
            raise ValueError(f"layer {li} contains NaN or infinity; attention weights are finite")
        lo, hi = float(w.min()), float(w.max())
        if lo < -_SLACK or hi > 1 + _SLACK:
            raise ValueError(f"layer {li} has values in [{lo:.3g}, {hi:.3g}], outside [0, 1]: show() takes attention "
                             "weights after softmax, not scores or logits")
    layers = [w.clamp(0.0, 1.0) for w in layers]
    data = weights_page_data(layers, tokens, model=model, title=title, text=text,
                             dense_max_tokens=dense_max_tokens, topk=topk)
    return AttentionPage(data, height=height)
