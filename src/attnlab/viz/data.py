"""The numbers behind ``attnlab viz``: per-layer, per-head attention of a text, dense or streamed.

Short inputs (at most ``dense_max_tokens`` tokens) carry every weight, quantised to 8 bits
(weight·255, base64). Longer inputs switch to streaming summaries from ``attnlab.probe`` (top-k keys
per query, entropy, sink mass, distance histogram): no [L, S] tensor per head is built or shipped.

Models: "minilm" (all-MiniLM-L6-v2 through attnlab, WordPiece tokens) or "random" (a seeded
2-layer, 4-head toy encoder on whitespace tokens: no checkpoint, any length).
"""
from __future__ import annotations

import base64
import math
import re
import zlib

import numpy as np
import torch

from .. import patterns as P
from ..diagnostics import entropy as _entropy
from .tokens import pretty_tokens
from .. import mechanisms as M
from ..trace.minilm import load_minilm
from ..functional import attention

__all__ = ["attention_data", "weights_page_data", "distance_histogram", "distance_edges", "MODELS", "tokenize_words",
           "pattern_grid", "is_causal", "label_tokens"]

MODELS = ("minilm", "random")
_WEIGHTS_HINT = "pick one that can (auto, dense, tiled or a pattern mechanism; see `attnlab list`)"


def _b64(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a).tobytes()).decode("ascii")


def _q8(w: torch.Tensor) -> np.ndarray:
    return np.clip(np.rint(w.detach().double().cpu().numpy() * 255.0), 0, 255).astype(np.uint8)


def tokenize_words(text: str) -> list[str]:
    """Words and punctuation marks (the random model's tokens)."""
    return re.findall(r"\w+|[^\w\s]", text)


def _mechanism(name, params):
    """(mechanism instance or None, its pattern or None, its name)."""
    if name is None:
        return None, None, "auto"

    mech = M.get(name, **(params or {}))
    pat = mech.pattern_for() if hasattr(mech, "pattern_for") else None
    return mech, pat, name


# -- the random toy model ---------------------------------------------------------------------------
class _RandomEncoder:
    """Seeded toy encoder: hashed token embeddings + sinusoidal positions, 2 layers × 4 heads, d=64."""

    num_layers, num_heads, d = 2, 4, 64

    def __init__(self, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        d = self.d
        self.W = [{n: torch.randn(d, d, generator=g) / math.sqrt(d) for n in ("q", "k", "v", "o")}
                  for _ in range(self.num_layers)]

    def embed(self, tokens: list[str]) -> torch.Tensor:
        d, T = self.d, len(tokens)
        x = torch.stack([torch.randn(d, generator=torch.Generator().manual_seed(zlib.crc32(t.lower().encode())))
                         for t in tokens])  # (T, d)
        pos = torch.arange(T, dtype=torch.float32).unsqueeze(1)
        freq = torch.exp(-math.log(10000.0) * torch.arange(0, d, 2, dtype=torch.float32) / d)
        pe = torch.zeros(T, d)
        pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * freq), torch.cos(pos * freq)
        return x + 2.0 * pe

    def layer_qkv(self, x: torch.Tensor, i: int):
        H, D = self.num_heads, self.d // self.num_heads
        T = x.shape[0]
        split = lambda y: y.view(T, H, D).transpose(0, 1).unsqueeze(0)  # noqa: E731  (1, H, T, D)
        W = self.W[i]
        return split(x @ W["q"]), split(x @ W["k"]), split(x @ W["v"])

    def next_x(self, x, out, i):
        T = x.shape[0]
        y = out[0].transpose(0, 1).reshape(T, self.d) @ self.W[i]["o"]  # (T, d)
        return torch.nn.functional.layer_norm(x + y, (self.d,))


# -- public -------------------------------------------------------------------------------------------
def pattern_grid(pattern, L: int, n: int = 96) -> np.ndarray:
    """A picture of ``pattern`` at L × L, at most n × n cells (nearest sample when L > n): uint8 0/255."""
    m = min(L, n)
    idx = torch.linspace(0, L - 1, m).round().long() if L > n else torch.arange(L)
    keep = pattern.keep(idx.unsqueeze(-1), idx.unsqueeze(0), L, L)
    keep = torch.broadcast_to(keep, keep.shape[:-2] + (m, m))
    keep = keep.reshape(-1, m, m)[0] if keep.dim() > 2 else keep
    return keep.to(torch.uint8).numpy() * 255


def _pattern_entries(T: int, mech_pattern, mech_name: str) -> list[dict]:
    pats = {}
    if mech_pattern is not None:
        pats[f"{mech_name} (this run)"] = mech_pattern
    else:
        pats["full (this run)"] = P.full()
    w = max(1, T // 8)
    s = max(2, int(math.isqrt(max(T, 1))))
    pats.setdefault(f"sliding_window({w})", P.sliding_window(w))
    if mech_name != "causal":  # a causal run's own entry already shows it
        pats.setdefault("causal", P.causal())
    pats.setdefault(f"strided({s})", P.strided(s))
    pats.setdefault(f"longformer({w}, global=1)", P.longformer(w, 1))
    out = []
    for name, p in pats.items():
        dens = p.density(T, T) if T * T <= 2**24 else float(pattern_grid(p, T, 256).mean() / 255)
        out.append({"name": name, "density": dens, "flops_saved": 1.0 - dens, "n": min(T, 96),
                    "grid": _b64(pattern_grid(p, T))})
    return out


def attention_data(text: str, *, model: str = "minilm", mechanism: str | None = None, params: dict | None = None,
                   dense_max_tokens: int = 96, max_length: int = 512, topk: int = 4, seed: int = 0,
                   model_obj=None, pretty: bool = True) -> dict:
    """Everything the viz page shows, as a JSON-ready dict (see the module docstring); ``pretty``: readable
    token labels, the raw tokens in ``raw_tokens`` (:func:`label_tokens`)."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("text is empty: give some words to look at")
    if model not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {model!r}")
    if dense_max_tokens < 1:
        raise ValueError(f"dense_max_tokens must be >= 1, got {dense_max_tokens}")
    mech, mech_pattern, mech_name = _mechanism(mechanism, params)
    notes: list[str] = []
    layers_w: list[torch.Tensor] = []  # (H, T, T) per layer (dense mode)
    layers_qk: list[tuple] = []  # (q, k) per layer (summary mode)

    if model == "minilm":
        m = model_obj if model_obj is not None else load_minilm()
        enc = m.tokenize(text, max_length=max_length)
        tokens = list(enc["tokens"][0])
        T = len(tokens)
        if T >= max_length:
            notes.append(f"input truncated to MiniLM's {max_length} tokens")
        dense = T <= dense_max_tokens
        if dense and mech is not None and not mech.spec.weights:  # say so by name, before the model runs
            raise ValueError(f"mechanism {mech_name!r} cannot return attention weights, which a page of {T} tokens "
                             f"(<= dense max {dense_max_tokens}) shows; {_WEIGHTS_HINT}")
        old = (getattr(m, "mechanism", "auto"), getattr(m, "pattern", None))
        if mech is not None:
            m.set_mechanism(mech)
        try:
            with torch.no_grad():
                out = m.forward(enc["input_ids"], enc["attention_mask"], output_attentions=dense, output_qkv=not dense)
        finally:
            if mech is not None:
                m.set_mechanism(*old)
        L_, H = m.num_layers, m.num_heads
        if dense:
            if out.attentions is None or any(a is None for a in out.attentions):
                raise ValueError(f"mechanism {mech_name!r} cannot return attention weights; {_WEIGHTS_HINT}")
            layers_w = [a[0] for a in out.attentions]
        else:
            layers_qk = [(q[0], k[0]) for q, k, _ in out.qkv]
        model_desc = "all-MiniLM-L6-v2 (attnlab)"
    else:
        tokens = tokenize_words(text)
        if not tokens:
            raise ValueError("text has no words to tokenize")
        T = len(tokens)
        enc_model = _RandomEncoder(seed)
        L_, H = enc_model.num_layers, enc_model.num_heads
        dense = T <= dense_max_tokens

        x = enc_model.embed(tokens)
        with torch.no_grad():
            for i in range(L_):
                q, k, v = enc_model.layer_qkv(x, i)
                if dense:
                    if mech is not None:
                        if not mech.spec.weights:
                            raise ValueError(f"mechanism {mech_name!r} cannot return attention weights; "
                                             f"{_WEIGHTS_HINT}")
                        o, w = mech(q, k, v, need_weights=True)
                    else:
                        o, w = attention(q, k, v, need_weights=True)
                    layers_w.append(w[0])
                else:
                    o = mech(q, k, v) if mech is not None else attention(q, k, v, pattern=mech_pattern)
                    layers_qk.append((q[0], k[0]))
                x = enc_model.next_x(x, o, i)
        model_desc = f"random toy encoder (seed {seed}, {L_} layers × {H} heads, d=64)"

    data: dict = {"title": "attnlab viz", "text": text, "model": model_desc, "mechanism": mech_name,
                  "tokens": tokens, "T": T, "S": T, "layers": L_, "heads": H, "mode": "dense" if dense else "summary",
                  "notes": notes}
    if dense:
        _add_dense(data, layers_w)
    else:
        if mech is not None and not (mech.spec.exact or mech_pattern is not None):
            raise ValueError(f"{T} tokens needs streaming summaries, which only exact or pattern mechanisms "
                             f"provide; {mech_name!r} is an approximation (raise --dense-max or pick another)")
        notes.append(_summary_note(T, dense_max_tokens, topk))
        _add_summary(data, [_qk_rows(q, k, mech_pattern) for q, k in layers_qk], topk)
    data["patterns"] = _pattern_entries(T, mech_pattern, mech_name)
    return label_tokens(data, pretty)


def _qk_rows(q: torch.Tensor, k: torch.Tensor, pattern=None):
    """rows(i0, i1) -> softmax(q kᵀ/√E) [H, i1 - i0, S] for query rows i0..i1 (q: [H, L, E], k: [H, S, E]);
    pairs outside ``pattern`` get weight 0, a row with no key left is all zeros."""
    L, S, E = q.shape[1], k.shape[1], q.shape[2]
    kt = k.transpose(-2, -1)  # (H, E, S)

    def rows(i0: int, i1: int) -> torch.Tensor:
        s = (q[:, i0:i1] @ kt) / math.sqrt(E)  # (H, l, S)
        if pattern is not None:
            keep = pattern.keep(torch.arange(i0, i1).unsqueeze(-1), torch.arange(S).unsqueeze(0), L, S)
            keep = keep.reshape(-1, i1 - i0, S)[0] if keep.dim() > 2 else keep  # a per-batch pattern: its first
            s = s.masked_fill(~keep, float("-inf"))
            return torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)  # a row with no key: NaN -> 0
        return torch.softmax(s, dim=-1)

    return rows


def _add_summary(data: dict, layer_rows: list, topk: int) -> None:
    """Top-k keys, head statistics and distance histogram per layer, from rows(i0, i1) -> [H, i1 - i0, S]
    weights, a block of query rows at a time (about 4 M weights per block: no [L, S] tensor per head)."""
    L, S, H = data["T"], data.get("S", data["T"]), data["heads"]
    if S > 65535:
        raise ValueError(f"the page indexes keys with 16 bits: at most 65535 keys, got {S}")
    k_ = max(1, min(topk, S))
    step = max(1, (1 << 22) // max(1, H * S))
    edges = torch.tensor(distance_edges(max(L, S)))
    summ = {"k": k_, "idx": [], "w": []}
    head_stats, hists = [], []
    for rows in layer_rows:
        idx = torch.empty(H, L, k_, dtype=torch.long)
        val = torch.empty(H, L, k_, dtype=torch.float64)
        ent, mx, sink = (torch.zeros(H, dtype=torch.float64) for _ in range(3))
        hist = torch.zeros(H, len(edges), dtype=torch.float64)
        for i0 in range(0, L, step):
            i1 = min(L, i0 + step)
            w = rows(i0, i1)  # (H, l, S)
            top = w.topk(k_, dim=-1)
            idx[:, i0:i1], val[:, i0:i1] = top.indices, top.values
            ent -= torch.special.xlogy(w, w).sum(-1).double().sum(-1)
            mx += w.amax(-1).double().sum(-1)
            sink += w[..., 0].double().sum(-1)
            d = (torch.arange(S).unsqueeze(0) - torch.arange(i0, i1).unsqueeze(1)).abs()  # (l, S)
            b = (torch.bucketize(d, edges, right=True) - 1).flatten()
            hist.scatter_add_(1, b.expand(H, -1), w.reshape(H, -1).double())
        summ["idx"].append(_b64(idx.numpy().astype("<u2")))
        summ["w"].append(_b64(_q8(val)))
        head_stats.append([{"entropy": float(ent[h] / L), "max_weight": float(mx[h] / L), "sink": float(sink[h] / L)}
                           for h in range(H)])
        hists.append((hist / L).tolist())
    data["summary"] = summ
    data["head_stats"] = head_stats
    data["distance"] = {"edges": distance_edges(max(L, S)), "hist": hists}


def _summary_note(T: int, dense_max_tokens: int, topk: int) -> str:
    return (f"long input: {T} tokens > {dense_max_tokens}, so the page shows streaming summaries "
            f"(top-{topk} keys per query, entropy, distance histogram) instead of dense weights")


def distance_edges(T: int) -> list[int]:
    """Lower edges of the |i - j| bins of the distance histogram: 0, 1, 2, 4, 8, … up to T - 1 (the bins of
    ``attnlab.probe``, without the empty ones past the longest distance)."""
    top = max(T, 1)
    edges = sorted(set([0, 1, 2, 4] + [2**e for e in range(3, max(3, top.bit_length()) + 1)]))
    return [e for e in edges if e <= max(top - 1, 0)]


def distance_histogram(weights: torch.Tensor) -> torch.Tensor:
    """Mean attention mass per query row by |i - j| bin: weights [H, L, S] -> [H, nbins] (edges from
    ``distance_edges(max(L, S))``)."""
    H, L, S = weights.shape
    edges = torch.tensor(distance_edges(max(L, S)))
    d = (torch.arange(S).unsqueeze(0) - torch.arange(L).unsqueeze(1)).abs()  # (L, S)
    b = (torch.bucketize(d, edges, right=True) - 1).flatten()  # bin per pair
    hist = torch.zeros(H, len(edges), dtype=torch.float64)
    hist.scatter_add_(1, b.expand(H, -1), weights.double().reshape(H, -1))
    return hist / max(L, 1)


def _add_dense(data: dict, layers_w: list[torch.Tensor]) -> None:
    """Dense weights [H, L, S] per layer -> the page's 8-bit weights, head statistics and distances."""
    H = data["heads"]
    data["dense"] = {"b64": [_b64(_q8(w)) for w in layers_w]}
    head_stats, hist = [], []
    for w in layers_w:
        ent = _entropy(w).mean(-1)  # (H,)
        mx = w.double().amax(-1).mean(-1)
        sink = w.double()[..., 0].mean(-1)
        head_stats.append([{"entropy": float(ent[h]), "max_weight": float(mx[h]), "sink": float(sink[h])}
                           for h in range(H)])
        hist.append(distance_histogram(w).tolist())
    data["head_stats"] = head_stats
    data["distance"] = {"edges": distance_edges(max(data["T"], data.get("S", data["T"]))), "hist": hist}


def is_causal(layers_w: list[torch.Tensor]) -> bool:
    """Whether weights [H, L, L] per layer come from causal attention: no query puts any weight on a later key
    (softmax gives every unmasked key a weight > 0, so a bidirectional run fails this on its first row)."""
    if not layers_w or layers_w[0].shape[-1] != layers_w[0].shape[-2] or layers_w[0].shape[-1] < 2:
        return False
    L = layers_w[0].shape[-1]
    later = torch.ones(L, L, dtype=torch.bool).triu(1)  # (L, L) key j > query i
    return all(not bool(w[..., later].any()) for w in layers_w)


def label_tokens(data: dict, pretty: bool = True) -> dict:
    """Readable labels in ``data["tokens"]`` (and ``key_tokens``): the tokenizer's markers turned into text
    (``attnlab.viz.tokens.pretty_tokens``); the raw tokens move to ``raw_tokens`` (``raw_key_tokens``), which the
    page shows on hover, when any label differs from its token."""
    if not pretty:
        return data
    for key, raw_key in (("tokens", "raw_tokens"), ("key_tokens", "raw_key_tokens")):
        if key in data:
            raw = [str(t) for t in data[key]]
            nice = pretty_tokens(raw)
            if nice != raw:
                data[key], data[raw_key] = nice, raw
    return data


def weights_page_data(layers_w: list[torch.Tensor], tokens: list[str], *, model: str = "given weights",
                      mechanism: str = "given", title: str = "attnlab viz", text: str | None = None,
                      dense_max_tokens: int = 128, topk: int = 4, notes: list[str] | None = None,
                      key_tokens: list[str] | None = None, causal: bool | None = None, pretty: bool = True) -> dict:
    """The viz page's data from attention weights someone else computed.

    layers_w: one [H, L, S] tensor per layer (rows = queries, columns = keys, values in [0, 1]);
    tokens: L query labels; key_tokens: S key labels (None: the keys are ``tokens``, self-attention).
    Up to ``dense_max_tokens`` queries and keys every weight is shipped (8 bits); longer inputs ship the
    top-``topk`` keys per query, entropy, max weight, sink mass and distance histogram.
    causal: whether the run was causal (None: read from the weights, :func:`is_causal`); a causal run is named
    so in the header and the pattern view. pretty: readable token labels (:func:`label_tokens`).
    Shapes are the caller's to check (``attnlab.viz.show`` does).
    """
    keys = list(tokens) if key_tokens is None else list(key_tokens)
    cross = key_tokens is not None and list(key_tokens) != list(tokens)
    T, S, H = len(tokens), len(keys), int(layers_w[0].shape[0])
    notes = list(notes or [])
    dense = max(T, S) <= dense_max_tokens
    causal = (not cross and is_causal(layers_w)) if causal is None else bool(causal)
    data: dict = {"title": title, "text": text, "model": model,
                  "mechanism": mechanism, "tokens": list(tokens), "T": T, "S": S, "layers": len(layers_w), "heads": H,
                  "mode": "dense" if dense else "summary", "notes": notes, "causal": causal}
    if cross:
        data["key_tokens"] = keys
    label_tokens(data, pretty)
    if text is None:
        data["text"] = " ".join(data["tokens"]) + ("  →  " + " ".join(data["key_tokens"]) if cross else "")
    if dense:
        _add_dense(data, layers_w)
    else:
        notes.append(_summary_note(max(T, S), dense_max_tokens, topk))
        _add_summary(data, [(lambda i0, i1, w=w: w[:, i0:i1]) for w in layers_w], topk)
    data["patterns"] = ((_pattern_entries(T, P.causal(), "causal") if causal else _pattern_entries(T, None, "given"))
                        if T == S else [])
    return data
