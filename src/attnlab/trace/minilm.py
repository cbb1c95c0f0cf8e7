"""Trace one layer and head of MiniLM (all-MiniLM-L6-v2) on a real sentence, tokens as labels.

X is the hidden state entering the layer; W_Q, W_K, W_V, W_O (and biases) are the layer's own
projections, so the ``weights`` step equals what the model reports with ``output_attentions=True``.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from .core import Trace, TraceOptions, trace_projection

__all__ = ["trace_text", "load_minilm"]


@functools.lru_cache(maxsize=2)
def load_minilm(mechanism: str = "auto"):
    """attnlab.models.minilm.load(mechanism), loaded once per process."""
    try:
        from ..models import minilm  # inside try: a failed models import becomes the install hint
    except ImportError as e:  # the models package itself failed to import
        raise ValueError(f"MiniLM is not available: {e}") from None
    try:
        return minilm.load(mechanism=mechanism)
    except ImportError as e:  # the checkpoint package is missing: its message is minilm.INSTALL_HINT, the fix
        hint = "" if minilm.INSTALL_HINT in str(e) else f" ({minilm.INSTALL_HINT})"
        raise ValueError(f"MiniLM is not available: {e}{hint}") from None


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float64).cpu().numpy()


def trace_text(text: str, *, layer: int = 0, head: int = 0, options: TraceOptions = TraceOptions(), model=None,
               max_length: int = 128) -> Trace:
    """Run ``text`` through MiniLM and trace attention in ``layer`` (0..5) for ``head`` (0..11)."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("text is empty: give a sentence, e.g. --text \"The cat sat on the mat\"")
    m = model if model is not None else load_minilm()
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < m.num_layers:
        raise ValueError(f"layer {layer!r} out of range: MiniLM has {m.num_layers} layers (0..{m.num_layers - 1})")
    if isinstance(head, bool) or not isinstance(head, int) or not 0 <= head < m.num_heads:
        raise ValueError(f"head {head!r} out of range: MiniLM has {m.num_heads} heads per layer (0..{m.num_heads - 1})")
    enc = m.tokenize(text, max_length=max_length)
    tokens = list(enc["tokens"][0])
    with torch.no_grad():
        out = m.forward(enc["input_ids"], enc["attention_mask"], output_hidden_states=True, output_attentions=True)
    X = _np(out.hidden_states[layer][0])  # (T, 384)
    sa = m.layers[layer].self_attn
    W = {n: _np(getattr(sa, p).weight).T for n, p in (("W_Q", "q_proj"), ("W_K", "k_proj"), ("W_V", "v_proj"),
                                                        ("W_O", "out_proj"))}  # (in, out): X @ W
    b = {n: (None if getattr(sa, p).bias is None else _np(getattr(sa, p).bias))
         for n, p in (("b_Q", "q_proj"), ("b_K", "k_proj"), ("b_V", "v_proj"), ("b_O", "out_proj"))}
    am = enc["attention_mask"][0].bool()
    T = len(tokens)
    mask = None if bool(am.all()) else np.broadcast_to(am.numpy()[None, :], (T, T)).copy()
    t = trace_projection(X, W["W_Q"], W["W_K"], W["W_V"], W["W_O"], num_heads=m.num_heads, heads=[head],
                         labels=tokens, options=options, mask=mask, source="minilm", **b)
    if T >= max_length:
        t.notes.append(f"text truncated to {max_length} tokens")
    t.meta.update({"model": "all-MiniLM-L6-v2", "layer": layer, "head": head, "text": text,
                   "model_weights": _np(out.attentions[layer][0, head]).tolist()})
    return t
