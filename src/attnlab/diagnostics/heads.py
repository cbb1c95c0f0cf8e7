"""What each head does, measured: attention to the previous / same / next token, to [CLS] and [SEP],
mean attention distance and entropy, averaged over the real tokens of a set of sentences, plus a label.

Only query rows of ordinary tokens count (not [CLS], [SEP] or padding), so "previous token" means the
previous word piece. Keys are the real tokens (padding gets no weight in the model anyway).

A causal decoder (any Hugging Face model: ``HeadsConfig(hf=attnlab.viz.models.load_model("smollm2"))``) gets
measures and labels of its own (:data:`DECODER_LABEL_RULES`): the attention sink (mass on the sequence's first
token, where decoders park attention they do not need), previous-token, induction (on a repeated random
sequence: from the second copy of a token to the token after its first copy, as Olsson et al. 2022 measure
it), local and broad.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..capture import activation_name, attention_modules, run_with_cache
from ..report import atomic_write_json
from ..resources import output_dir
from ..trace.minilm import load_minilm

__all__ = ["head_stats", "label_head", "measure_heads", "LABEL_RULES", "DEFAULT_SENTENCES", "HeadsConfig",
           "HeadsResult", "run_heads", "DECODER_LABEL_RULES", "decoder_head_stats", "measure_decoder_heads",
           "DECODER_MEASURES"]

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


#: a causal decoder's labels, checked in this order (``induction`` from the repeated random sequence)
DECODER_LABEL_RULES = (
    ("induction", "induction", 0.4),
    ("previous-token", "prev", 0.5),
    ("attention sink", "sink", 0.5),
    ("self", "same", 0.5),
    ("broad", "norm_entropy", 0.75),
    ("local", "mean_distance", 2.0),  # mean distance below this
)
INDUCTION_LENGTH = 24  # tokens in each copy of the repeated random sequence
DECODER_MEASURES = ("prev", "same", "sink", "induction", "mean_distance", "entropy")


def label_head(s: dict, rules=LABEL_RULES) -> str:
    """The first rule of ``rules`` (LABEL_RULES, or DECODER_LABEL_RULES) that holds, else "mixed"."""
    for label, key, thr in rules:
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


def decoder_head_stats(attentions, attention_mask: torch.Tensor, induction=None, half: int = 0) -> list[dict]:
    """Per (layer, head) measures of a causal decoder from its weights.

    attentions: sequence of [B, H, T, T] per layer (causal); attention_mask [B, T] (1 = token; left or right
    padding). Query rows are the real tokens after each sequence's first (which can only attend to itself).
    induction: optional sequence of [1, H, 2n, 2n] per layer, the weights on a random sequence of n tokens
    repeated once (n = ``half``); the induction score is the mean weight from position n + i to i + 1.
    Returns dicts with layer, head, prev, same, sink (weight on the first real token), mean_distance, entropy,
    norm_entropy (entropy / log(keys visible)), induction (0.0 without ``induction``) and label.
    """
    real = attention_mask.bool()  # (B, T)
    B, T = real.shape
    first = real.int().argmax(-1)  # (B,) position of each sequence's first real token
    idx = torch.arange(T)
    qrow = real & (idx.unsqueeze(0) > first.unsqueeze(1))  # (B, T) rows that count
    n_rows = qrow.sum().clamp_min(1).double()
    dist = (idx.unsqueeze(0) - idx.unsqueeze(1)).abs().double()  # (T, T) |i - j|
    visible = (idx.unsqueeze(0) - first.unsqueeze(1) + 1).clamp_min(2).double()  # (B, T) keys row i can see
    first_key = torch.nn.functional.one_hot(first, T).bool()  # (B, T)
    out = []
    for li, a in enumerate(attentions):
        w = a.detach().double() * real[:, None, None, :]  # (B, H, T, T)
        H = w.shape[1]
        rowmask = qrow[:, None, :].double()  # (B, 1, T)

        def mean_over_rows(x):  # (B, H, T) -> (H,)
            return (x * rowmask).sum((0, 2)) / n_rows

        prev = torch.zeros(B, H, T, dtype=torch.float64)
        prev[..., 1:] = torch.diagonal(w, offset=-1, dim1=-2, dim2=-1)
        same = torch.diagonal(w, dim1=-2, dim2=-1)
        sink = (w * first_key[:, None, None, :]).sum(-1)
        md = (w * dist).sum(-1)
        ent = -torch.where(w > 0, w * torch.log(w.clamp_min(1e-300)), torch.zeros_like(w)).sum(-1)
        nent = ent / torch.log(visible)[:, None, :]
        m = {k: mean_over_rows(v) for k, v in (("prev", prev), ("same", same), ("sink", sink), ("mean_distance", md),
                                               ("entropy", ent), ("norm_entropy", nent))}
        if induction is not None:
            wi = induction[li].detach().double()[0]  # (H, 2n, 2n)
            n = half
            # from position n + i (the second copy of token i) to i + 1 (the token after its first copy)
            m["induction"] = torch.diagonal(wi, offset=1 - n, dim1=-2, dim2=-1)[:, 1:].mean(-1)  # rows n .. 2n-1
        else:
            m["induction"] = torch.zeros(H, dtype=torch.float64)
        for h in range(H):
            s = {"layer": li, "head": h, **{k: float(v[h]) for k, v in m.items()}}
            s["label"] = label_head(s, DECODER_LABEL_RULES)
            out.append(s)
    return out


def _hf_weights(model, **inputs) -> list[torch.Tensor]:
    """A Hugging Face model's attention weights [B, H, T, T] per layer, caught by attnlab.capture."""

    names = [activation_name(i, "weights") for i in range(len(attention_modules(model)))]
    with torch.no_grad():
        _, cache = run_with_cache(model, names=names, **inputs)
    return cache.weights()


def measure_decoder_heads(sentences: list[str], loaded) -> dict:
    """Run a Hugging Face model (``attnlab.viz.models.LoadedModel``) on ``sentences`` (padded together) and on
    a repeated random sequence, and measure every head (:func:`decoder_head_stats`)."""
    sentences = [s for s in sentences if s.strip()]
    if not sentences:
        raise ValueError("no sentences: give --sentence TEXT or a --sentences file with non-empty lines")
    tok, model = loaded.tokenizer, loaded.model
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token or tok.unk_token
    enc = tok(sentences, return_tensors="pt", padding=True, truncation=True, max_length=128)
    att = _hf_weights(model, input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])
    # induction: a seeded random sequence of ordinary tokens, twice
    special = set(tok.all_special_ids)
    g = torch.Generator().manual_seed(0)
    pool = torch.tensor([i for i in range(min(len(tok), int(model.config.vocab_size))) if i not in special])
    n = INDUCTION_LENGTH
    rnd = pool[torch.randperm(len(pool), generator=g)[:n]]
    rep = torch.cat([rnd, rnd]).unsqueeze(0)  # (1, 2n)
    ind = _hf_weights(model, input_ids=rep, attention_mask=torch.ones_like(rep))
    stats = decoder_head_stats(att, enc["attention_mask"], ind, n)
    return {"stats": stats, "counts": dict(Counter(s["label"] for s in stats)), "n_sentences": len(sentences),
            "n_tokens": int(enc["attention_mask"].sum()), "num_layers": len(att), "num_heads": int(att[0].shape[1])}


def measure_heads(sentences: list[str], model=None) -> dict:
    """Run MiniLM on ``sentences`` and measure every head. Returns {stats, counts, n_sentences, n_tokens}."""
    import torch

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
    all; checked against the model), and a loaded MiniLM to reuse (else loaded here); or ``hf``, any
    Hugging Face model (``attnlab.viz.models.load_model``), measured with a decoder's measures when causal."""

    sentences: list[str] = field(default_factory=lambda: list(DEFAULT_SENTENCES))
    out: str | Path = "reports/heads"
    layers: list[int] | None = None
    plot: bool = True
    model: object | None = None
    hf: object | None = None


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
    model_name: str = "MiniLM"
    kind: str = "encoder"  # or "decoder": which measures and labels ``stats`` holds

    def to_dict(self) -> dict:
        """JSON-ready dict (what heads.json holds, less ``files`` and ``layers``)."""
        return {k: v for k, v in asdict(self).items() if k not in ("files", "layers")}


def run_heads(config: HeadsConfig) -> HeadsResult:
    """Measure MiniLM's heads over the sentences; write heads.json (and heads.png) into ``config.out``."""

    out = output_dir(config.out)
    sentences = [s for s in config.sentences if s.strip()]
    if not sentences:
        raise ValueError("the sentences given are all empty")
    model = config.hf if config.hf is not None else config.model
    if model is None:
        from ..trace.minilm import load_minilm  # breaks a cycle: trace imports diagnostics

        model = load_minilm()
    name = getattr(config.hf, "name", "MiniLM")
    nl = model.num_layers
    layers = list(range(nl)) if config.layers is None else list(config.layers)
    for li in layers:
        if not 0 <= li < nl:
            raise ValueError(f"layer {li} out of range: {name} has {nl} layers (0..{nl - 1})")
    kind = "decoder" if config.hf is not None and config.hf.causal else "encoder"
    if config.hf is None:
        res = measure_heads(sentences, model)
    elif kind == "decoder":
        res = measure_decoder_heads(sentences, config.hf)
    else:
        raise ValueError(f"{name} is not a causal decoder; the head measures of an encoder read MiniLM's [CLS] "
                         "and [SEP]: use the default model")
    result = HeadsResult(**res, sentences=sentences, layers=layers, files=[], model_name=name, kind=kind)
    pngs = []  # heads.png first: heads.json, the run's marker, last (an interrupted run leaves no marker)
    if config.plot:
        from ..viz.heatmaps import plot_head_stats  # defers matplotlib (viz) until a plot is asked for

        kw = {} if kind == "encoder" else {"measures": DECODER_MEASURES, "title": f"what {name}'s heads do: labels, "
                                           "and the mean attention of a token to prev/same/the first token/induction"}
        pngs.append(str(plot_head_stats(res["stats"], out / "heads.png", num_layers=nl,
                                        num_heads=res["num_heads"], **kw)))
    result.files += [str(atomic_write_json(out / "heads.json", result.to_dict())), *pngs]
    return result
