"""attnlab.trace: every step of attention (X → Q, K, V → QKᵀ → ÷√d_k → mask → softmax → ·V → concat → W_O)
on real numbers, with shapes, FLOPs and the tutorial's failure modes as switches."""
from .check import TableCheck, check_html, check_markdown, check_rich, check_table, parse_printed_table
from .config import SOURCES, TraceConfig, TraceResult, plot_trace, run_trace
from .core import (EXAMPLE_TOKENS, Step, Trace, TraceOptions, as_matrix, example_inputs, trace_example,
                   trace_projection, trace_qkv, trace_scores)
from .minilm import trace_text
from .render import FORMATS, to_html, to_json, to_markdown, to_rich
from .summary import trace_summary

__all__ = [
    "Step", "Trace", "TraceOptions", "trace_example", "trace_projection", "trace_qkv", "trace_scores", "trace_text",
    "trace_summary", "example_inputs", "as_matrix", "EXAMPLE_TOKENS", "FORMATS", "to_json", "to_markdown", "to_html",
    "to_rich", "TableCheck", "check_table", "parse_printed_table", "check_markdown", "check_html", "check_rich",
    "TraceConfig", "TraceResult", "run_trace", "plot_trace", "SOURCES",
]
