"""Plots for reports: matplotlib without a display, figures saved atomically, distinct line styles."""
from __future__ import annotations

import os

from attnlab.report import line_styles, save_figure

__all__ = ["pyplot", "save_plot", "line_styles"]


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (no display needed; imported on first use)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_plot(fig, path: str | os.PathLike, dpi: int = 120) -> str:
    """Save ``fig`` as PNG atomically (``attnlab.report.save_figure``), close it; return the path as str."""
    save_figure(fig, path, dpi=dpi)
    return str(path)
