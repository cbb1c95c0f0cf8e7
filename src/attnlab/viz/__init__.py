"""attnlab.viz: pictures of attention — PNG heatmaps and a self-contained interactive HTML page
(``attention_data`` + ``write_page`` for attnlab's models, ``show`` for any model's weights)."""
from .build import VizConfig, VizResult, default_out, dense_weights, run_viz
from .data import MODELS, attention_data, distance_edges, distance_histogram, pattern_grid, tokenize_words, weights_page_data
from .heatmaps import (pattern_cost, plot_block_mask, plot_diagnostics, plot_head_stats, plot_heads, plot_patch_sweep, plot_pattern,
                       plot_patterns)
from .page import HEAD_COLOURS, render_page, write_page
from . import tokens
from .show import AttentionPage, model_name, save, show
from .tokens import pretty_tokens

__all__ = [
    "attention_data", "weights_page_data", "render_page", "write_page", "show", "save", "AttentionPage", "plot_heads",
    "plot_pattern", "plot_patterns", "plot_diagnostics", "plot_head_stats", "pattern_cost", "pattern_grid",
    "tokenize_words", "distance_histogram", "distance_edges", "HEAD_COLOURS", "MODELS", "VizConfig", "VizResult",
    "run_viz", "default_out", "dense_weights", "plot_patch_sweep", "plot_block_mask", "pretty_tokens", "model_name",
]
