"""attnlab.viz: pictures of attention — PNG heatmaps and a self-contained interactive HTML page."""
from .data import MODELS, attention_data, pattern_grid, tokenize_words
from .heatmaps import pattern_cost, plot_diagnostics, plot_head_stats, plot_heads, plot_pattern, plot_patterns
from .page import render_page, write_page

__all__ = [
    "attention_data", "render_page", "write_page", "plot_heads", "plot_pattern", "plot_patterns",
    "plot_diagnostics", "plot_head_stats", "pattern_cost", "pattern_grid", "tokenize_words", "MODELS",
]
