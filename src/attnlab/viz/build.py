"""The viz page as one call: ``VizConfig`` (the text, model, mechanism, where to write) in, ``VizResult``
(the files written, the mode, the tokens) out. Nothing here parses arguments or prints; ``attnlab viz``
turns its options into a ``VizConfig`` and says where the page is.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from ..resources import output_dir
from .data import attention_data
from .heatmaps import plot_heads
from .models import load_model
from .page import write_page
from .. import mechanisms as M
from .show import show

__all__ = ["VizConfig", "VizResult", "run_viz", "default_out", "dense_weights", "hf_attention_data"]


def default_out(text: str, model: str) -> Path:
    """reports/viz/<model>-<first words of text, as a safe file name> (a model given as a path: its file or
    folder name)."""
    slug = "-".join(re.findall(r"[A-Za-z0-9]+", text.lower())[:6])[:48].strip("-") or "text"
    name = Path(str(model).rstrip("/\\")).name or "model"
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", name.removesuffix(".gguf"))[:40] or "model"
    return Path("reports") / "viz" / f"{name}-{slug}"


@dataclass
class VizConfig:
    """What the page shows and where it goes.

    text: the input (MiniLM and Hugging Face models: up to ``max_length`` tokens; "random": words, any length).
    out: folder for index.html (and heads.png); default ``default_out(text, model)``.
    model: "minilm", "random" (a seeded toy encoder, no checkpoint), or any Hugging Face model:
    "smollm2", a .gguf file or a checkpoint folder (``attnlab.viz.models.load_model``).
    mechanism, params: an attention mechanism of the registry and its hyperparameters (minilm and random).
    dense_max: longer inputs show streaming summaries (``topk`` keys per query) instead of weights.
    png: also write heads.png, layer 0's [H, T, T] weights as heatmaps (dense mode only).
    loaded: an already loaded MiniLM (or ``LoadedModel``) to reuse (else it is loaded here).
    """

    text: str
    out: str | Path | None = None
    model: str = "minilm"
    mechanism: str | None = None
    params: dict = field(default_factory=dict)
    dense_max: int = 96
    topk: int = 4
    max_length: int = 512
    png: bool = False
    loaded: object | None = None

    def __post_init__(self):
        if not isinstance(self.text, str) or not self.text.strip():
            raise ValueError("TEXT is empty: give some words to look at")
        if self.topk < 1:
            raise ValueError(f"topk must be >= 1, got {self.topk}")
        if self.params and self.mechanism is None:
            raise ValueError("mechanism parameters need a mechanism")
        if self.mechanism is not None:
            if self.mechanism not in M.available():
                raise ValueError(f"unknown mechanism {self.mechanism!r}; available: {', '.join(M.available())}")
            if self.model not in ("minilm", "random"):
                raise ValueError(f"a mechanism runs on attnlab's own models (minilm, random), not on {self.model!r}")


@dataclass
class VizResult:
    """The page written: its path and size, every file written, the mode ("dense" or "summary"), the
    number of tokens ``T`` and the tokens themselves."""

    page: Path
    files: list[str]
    mode: str
    T: int
    tokens: list[str]
    size_bytes: int


def dense_weights(data: dict, layer: int = 0):
    """Layer ``layer``'s weights from dense page data, as a float array [H, T, T] (8-bit precision)."""
    import base64

    import numpy as np

    T, H = data["T"], data["heads"]
    raw = np.frombuffer(base64.b64decode(data["dense"]["b64"][layer]), dtype=np.uint8)
    return raw.reshape(H, T, T) / 255.0  # (H, T, T)


def hf_attention_data(text: str, loaded, *, dense_max_tokens: int = 96, max_length: int = 512, topk: int = 4) -> dict:
    """The page's data for a Hugging Face model (a ``LoadedModel``): ``text`` tokenised (at most ``max_length``
    tokens), run once under ``attnlab.capture``, shown as ``attnlab.viz.show`` shows weights."""

    tok = loaded.tokenizer
    enc = tok(text, return_tensors="pt", truncation=True, max_length=max_length)
    ids = enc["input_ids"][0]
    tokens = tok.convert_ids_to_tokens(ids.tolist())
    name = f"{loaded.name} ({type(loaded.model).__name__})"
    page = show(loaded.model, tokens, inputs=dict(enc), model=name, text=text,
                dense_max_tokens=dense_max_tokens, topk=topk)
    data = page.data
    if len(ids) >= max_length and len(tok(text)["input_ids"]) > max_length:
        data["notes"].append(f"input truncated to {max_length} tokens")
    return data


def run_viz(config: VizConfig) -> VizResult:
    """Compute the page's data for the text, write index.html (and heads.png when asked); what was written."""
    c = config
    out = output_dir(c.out if c.out is not None else default_out(c.text, c.model))
    if c.model in ("minilm", "random"):
        try:
            data = attention_data(c.text, model=c.model, mechanism=c.mechanism, params=c.params,
                                  dense_max_tokens=c.dense_max, max_length=c.max_length, topk=c.topk,
                                  model_obj=c.loaded)
        except KeyError as e:  # a mechanism's unknown parameter, reported by the registry
            raise ValueError(str(e)) from None
    else:
        data = hf_attention_data(c.text, c.loaded if c.loaded is not None else load_model(c.model),
                                 dense_max_tokens=c.dense_max, max_length=c.max_length, topk=c.topk)
    # heads.png before index.html, the run's marker: a run interrupted between them had left index.html alone, which
    # the rerun the message suggests then refused as an earlier run
    pngs = []
    if c.png and data["mode"] == "dense":
        pngs.append(str(plot_heads(dense_weights(data), out / "heads.png", tokens=data["tokens"],
                                   title="layer 0 attention per head")))
    path = write_page(out, data)
    files = [str(path), *pngs]
    return VizResult(page=path, files=files, mode=data["mode"], T=data["T"], tokens=data["tokens"],
                     size_bytes=path.stat().st_size)
