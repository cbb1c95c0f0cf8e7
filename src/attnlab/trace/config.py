"""The trace as one call: a ``TraceConfig`` saying where the numbers come from, ``run_trace`` returning the
``Trace`` (and, when a printed table is given, the ``TableCheck`` of it). Nothing here parses arguments
or prints; ``attnlab trace`` turns its options into a ``TraceConfig`` and renders the result.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import diagnostics as dg
from .check import TableCheck, check_table
from .core import Trace, TraceOptions, trace_example, trace_qkv, trace_scores
from .minilm import trace_text
from .summary import trace_summary

__all__ = ["SOURCES", "TraceConfig", "TraceResult", "run_trace", "plot_trace"]

#: where a trace's numbers come from
SOURCES = ("example", "text", "scores", "qkv", "summary")


@dataclass
class TraceConfig:
    """What to trace.

    source: one of ``SOURCES``: "example" (the tutorial's 4 tokens, d_model=8, d_k=4), "text" (``text``
    through MiniLM, one ``layer`` and ``head``), "scores" (a given score matrix ``scores`` [L, S]),
    "qkv" (given ``q`` [L, d_k] and ``k`` [S, d_k]; ``v`` [S, d_v] optional, also with "scores"), or
    "summary" (shapes, FLOPs, bytes and statistics of a model ``d_model`` wide with ``heads`` heads on
    ``batch`` × ``seq_len`` tokens, counted in ``dtype``).
    d_k: the head dim used by the scale (default: the columns of Q; required for "scores").
    heads: the example's heads (1 or 2; default 1) or the summary's (default 12).
    expect, expect_step: a printed table (JSON text, '#' comments allowed) to check against the
    trace's step ``expect_step`` (see ``attnlab.trace.check_table``).
    """

    source: str = "example"
    text: str | None = None
    scores: np.ndarray | None = None
    q: np.ndarray | None = None
    k: np.ndarray | None = None
    v: np.ndarray | None = None
    d_k: int | None = None
    layer: int = 0
    head: int = 0
    heads: int | None = None
    d_model: int = 768
    seq_len: int = 512
    batch: int = 1
    dtype: str = "float32"
    seed: int = 0
    options: TraceOptions = field(default_factory=TraceOptions)
    expect: str | None = None
    expect_step: str = "weights"

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {', '.join(SOURCES)}, got {self.source!r}")
        if self.d_k is not None and self.d_k < 1:
            raise ValueError(f"d_k must be a positive int, got {self.d_k}")
        if self.v is not None and self.source not in ("scores", "qkv"):
            raise ValueError(f"v goes with source 'scores' or 'qkv', not {self.source!r}")


@dataclass
class TraceResult:
    """A trace and, when ``TraceConfig.expect`` was given, the check of the printed table against it."""

    trace: Trace
    check: TableCheck | None = None


def run_trace(config: TraceConfig) -> TraceResult:
    """Trace attention as ``config`` says (see ``TraceConfig``); check the printed table if one is given."""
    c = config
    if c.source == "example":
        trace = trace_example(seed=c.seed, num_heads=1 if c.heads is None else c.heads, options=c.options)
    elif c.source == "text":
        trace = trace_text(c.text or "", layer=c.layer, head=c.head, options=c.options)
    elif c.source == "scores":
        trace = trace_scores(c.scores, d_k=c.d_k, v=c.v, options=c.options)
    elif c.source == "qkv":
        trace = trace_qkv(c.q, c.k, c.v, d_k=c.d_k, options=c.options)
    else:
        trace = trace_summary(c.d_model, c.seq_len, 12 if c.heads is None else c.heads, batch=c.batch,
                              dtype=c.dtype, seed=c.seed, options=c.options)
    if c.expect is None:
        return TraceResult(trace)
    if trace.source == "summary":
        raise ValueError("a printed table is checked against a small trace; the summary has none "
                         "(trace given scores or Q, K instead)")
    return TraceResult(trace, check_table(c.expect, trace, step=c.expect_step))


def plot_trace(trace: Trace, path: str | Path) -> Path:
    """A PNG of the trace: the weights per shown head ([H, L, S] heatmaps), or for a summary the
    diagnostics of score scale against d_k (4, 16, 64, 256 and the model's own)."""
    from .. import viz  # breaks a cycle: viz imports trace

    if trace.source == "summary":
        d_k = trace.d_k
        d_ks = sorted({4, 16, 64, 256, d_k})
        return Path(viz.plot_diagnostics(dg.scale_sweep(d_ks=d_ks, seq_len=min(128, trace.meta["seq_len"])), path,
                                         title=f"score scale vs d_k (this model: d_k={d_k})"))
    w = trace.step("weights")
    heads = trace.heads if (w.per_head and trace.heads) else None
    value = w.value if w.per_head else w.value[None]  # (H, L, S)
    title = "attention weights" + (f", layer {trace.meta['layer']}" if "layer" in trace.meta else "")
    if heads is None and trace.heads and len(trace.heads) == 1:
        title += f", head {trace.heads[0]}"
    return Path(viz.plot_heads(value, path, tokens=trace.labels, title=title,
                               heads=None if heads is None else list(range(len(heads)))))
