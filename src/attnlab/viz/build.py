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
from .page import write_page

__all__ = ["VizConfig", "VizResult", "run_viz", "default_out", "dense_weights"]


def default_out(text: str, model: str) -> Path:
    """reports/viz/<model>-<first words of text, as a safe file name>."""
    slug = "-".join(re.findall(r"[A-Za-z0-9]+", text.lower())[:6])[:48].strip("-") or "text"
    return Path("reports") / "viz" / f"{model}-{slug}"


@dataclass
class VizConfig:
    """What the page shows and where it goes.

    text: the input (MiniLM: up to ``max_length`` word pieces; "random": words, any length).
    out: folder for index.html (and heads.png); default ``default_out(text, model)``.
    model: "minilm" or "random" (a seeded toy encoder, no checkpoint).
    mechanism, params: an attention mechanism of the registry and its hyperparameters.
    dense_max: longer inputs show streaming summaries (``topk`` keys per query) instead of weights.
    png: also write heads.png, layer 0's [H, T, T] weights as heatmaps (dense mode only).
    loaded: an already loaded MiniLM to reuse (else it is loaded when ``model`` is "minilm").
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
            from .. import mechanisms as M

            if self.mechanism not in M.available():
                raise ValueError(f"unknown mechanism {self.mechanism!r}; available: {', '.join(M.available())}")


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


def run_viz(config: VizConfig) -> VizResult:
    """Compute the page's data for the text, write index.html (and heads.png when asked); what was written."""
    c = config
    out = output_dir(c.out if c.out is not None else default_out(c.text, c.model))
    try:
        data = attention_data(c.text, model=c.model, mechanism=c.mechanism, params=c.params,
                              dense_max_tokens=c.dense_max, max_length=c.max_length, topk=c.topk,
                              model_obj=c.loaded)
    except KeyError as e:  # a mechanism's unknown parameter, reported by the registry
        raise ValueError(str(e)) from None
    path = write_page(out, data)
    files = [str(path)]
    if c.png and data["mode"] == "dense":
        files.append(str(plot_heads(dense_weights(data), out / "heads.png", tokens=data["tokens"],
                                    title="layer 0 attention per head")))
    return VizResult(page=path, files=files, mode=data["mode"], T=data["T"], tokens=data["tokens"],
                     size_bytes=path.stat().st_size)
