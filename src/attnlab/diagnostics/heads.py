"""What each head does, measured: attention to the previous / same / next token, to [CLS] and [SEP],
mean attention distance and entropy, averaged over the real tokens of a set of sentences, plus a label.

Only query rows of ordinary tokens count (not [CLS], [SEP] or padding), so "previous token" means the
previous word piece. Keys are the real tokens (padding gets no weight in the model anyway).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

__all__ = ["head_stats", "label_head", "measure_heads", "LABEL_RULES", "DEFAULT_SENTENCES", "HeadsConfig",
           "HeadsResult", "run_heads"]

#: label -> (measure, threshold): the first rule that holds names the head (checked in this order)
LABEL_RULES = (
    ("previous-token", "prev", 0.5),
    ("next-token", "next", 0.5),
    ("self", "same", 0.5),
    ("[CLS]", "cls", 0.5),
    ("delimiter", "sep", 0.5),
    ("broad", "norm_entropy", 0.75),
    ("local", "mean_distance", 2.0),  # mean distance below this
)

DEFAULT_SENTENCES = (
    "The cat sat on the mat because it was tired.",
    "Attention lets every token look at every other token in one step.",
    "She gave the book to her brother, who read it twice.",
    "Stock prices fell sharply after the central bank raised interest rates.",
    "The quick brown fox jumps over the lazy dog.",
    "When the rain stopped, the children ran outside to play in the puddles.",
    "Researchers trained a small model on millions of sentences.",
    "I love machine learning.",
)


def label_head(s: dict) -> str:
    """The first rule of LABEL_RULES that holds, else "mixed"."""
    for label, key, thr in LABEL_RULES:
        if key == "mean_distance":
            if s[key] < thr:
                return label
        elif s[key] >= thr:
            return label
    return "mixed"


def head_stats(attentions, attention_mask: torch.Tensor, special: torch.Tensor, cls_mask: torch.Tensor,
               sep_mask: torch.Tensor) -> list[dict]:
    """Per (layer, head) measures from weights.

    attentions: sequence of [B, H, T, T] per layer; attention_mask [B, T] (1 = token);
    special, cls_mask, sep_mask: bool [B, T] marking special tokens, [CLS] and [SEP].
    Returns dicts with layer, head, prev, same, next, cls, sep, mean_distance, entropy,
    norm_entropy (entropy / log(number of keys)) and label.
    """
    real = attention_mask.bool()  # (B, T)
    qrow = real & ~special  # query rows that count
    B, T = real.shape
    idx = torch.arange(T)
    dist = (idx.unsqueeze(0) - idx.unsqueeze(1)).abs().double()  # (T, T) |i - j|
    n_rows = qrow.sum().clamp_min(1).double()
    out = []
    for li, a in enumerate(attentions):
        w = a.detach().double() * real[:, None, None, :]  # (B, H, T, T); padded keys carry nothing
        H = w.shape[1]
        rowmask = qrow[:, None, :].double()  # (B, 1, T)

        def mean_over_rows(x):  # x: (B, H, T) -> (H,)
            return (x * rowmask).sum((0, 2)) / n_rows

        prev = torch.zeros(B, H, T, dtype=torch.float64)
        nxt = torch.zeros(B, H, T, dtype=torch.float64)
        prev[..., 1:] = torch.diagonal(w, offset=-1, dim1=-2, dim2=-1)
        nxt[..., :-1] = torch.diagonal(w, offset=1, dim1=-2, dim2=-1)
        same = torch.diagonal(w, dim1=-2, dim2=-1)
        cls = (w * cls_mask[:, None, None, :]).sum(-1)
        sep = (w * sep_mask[:, None, None, :]).sum(-1)
        md = (w * dist).sum(-1)
        ent = -torch.where(w > 0, w * torch.log(w.clamp_min(1e-300)), torch.zeros_like(w)).sum(-1)
        nkeys = real.sum(-1).double().clamp_min(2)[:, None, None]  # (B, 1, 1)
        nent = ent / torch.log(nkeys)
        m = {k: mean_over_rows(v) for k, v in (("prev", prev), ("same", same), ("next", nxt), ("cls", cls),
                                               ("sep", sep), ("mean_distance", md), ("entropy", ent),
                                               ("norm_entropy", nent))}
        for h in range(H):
            s = {"layer": li, "head": h, **{k: float(v[h]) for k, v in m.items()}}
            s["label"] = label_head(s)
            out.append(s)
    return out


def measure_heads(sentences: list[str], model=None) -> dict:
    """Run MiniLM on ``sentences`` and measure every head. Returns {stats, counts, n_sentences, n_tokens}."""
    import torch

    from ..trace.minilm import load_minilm

    sentences = [s for s in sentences if s.strip()]
    if not sentences:
        raise ValueError("no sentences: give --sentence TEXT or a --sentences file with non-empty lines")
    m = model if model is not None else load_minilm()
    enc = m.tokenize(sentences, max_length=128)
    toks = enc["tokens"]
    cls = torch.tensor([[t == "[CLS]" for t in row] for row in toks])
    sep = torch.tensor([[t == "[SEP]" for t in row] for row in toks])
    pad = torch.tensor([[t == "[PAD]" for t in row] for row in toks])
    with torch.no_grad():
        out = m.forward(enc["input_ids"], enc["attention_mask"], output_attentions=True)
    stats = head_stats(out.attentions, enc["attention_mask"], cls | sep | pad, cls, sep)
    return {"stats": stats, "counts": dict(Counter(s["label"] for s in stats)), "n_sentences": len(sentences),
            "n_tokens": int((enc["attention_mask"].bool() & ~(cls | sep)).sum()),
            "num_layers": m.num_layers, "num_heads": m.num_heads}


@dataclass
class HeadsConfig:
    """What ``run_heads`` measures and writes: the sentences (default ``DEFAULT_SENTENCES``), the folder
    for heads.json (and heads.png unless ``plot`` is False), the layers the caller will show (default
    all; checked against the model), and a loaded MiniLM to reuse (else loaded here)."""

    sentences: list[str] = field(default_factory=lambda: list(DEFAULT_SENTENCES))
    out: str | Path = "reports/heads"
    layers: list[int] | None = None
    plot: bool = True
    model: object | None = None


@dataclass
class HeadsResult:
    """Every head's measures (``stats``: one dict per (layer, head), see ``head_stats``), how many heads
    got each label, the sentences and word pieces measured, the model's size, the layers asked for and
    the files written."""

    stats: list[dict]
    counts: dict
    n_sentences: int
    n_tokens: int
    num_layers: int
    num_heads: int
    sentences: list[str]
    layers: list[int]
    files: list[str]

    def to_dict(self) -> dict:
        """JSON-ready dict (what heads.json holds, less ``files`` and ``layers``)."""
        return {k: v for k, v in asdict(self).items() if k not in ("files", "layers")}


def run_heads(config: HeadsConfig) -> HeadsResult:
    """Measure MiniLM's heads over the sentences; write heads.json (and heads.png) into ``config.out``."""
    from ..report import atomic_write_json
    from ..resources import output_dir

    out = output_dir(config.out)
    sentences = [s for s in config.sentences if s.strip()]
    if not sentences:
        raise ValueError("the sentences given are all empty")
    model = config.model
    if model is None:
        from ..trace.minilm import load_minilm

        model = load_minilm()
    nl = model.num_layers
    layers = list(range(nl)) if config.layers is None else list(config.layers)
    for li in layers:
        if not 0 <= li < nl:
            raise ValueError(f"layer {li} out of range: MiniLM has {nl} layers (0..{nl - 1})")
    res = measure_heads(sentences, model)
    result = HeadsResult(**res, sentences=sentences, layers=layers, files=[])
    result.files.append(str(atomic_write_json(out / "heads.json", result.to_dict())))
    if config.plot:
        from ..viz.heatmaps import plot_head_stats

        result.files.append(str(plot_head_stats(res["stats"], out / "heads.png", num_layers=nl,
                                                num_heads=res["num_heads"])))
    return result
