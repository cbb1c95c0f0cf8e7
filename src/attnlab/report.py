"""Writing results people keep: atomic files, environment records, figures."""
from __future__ import annotations

import os
import platform
from pathlib import Path

from . import cpu

# the atomic writes and format_bytes live in the leaf attnlab.files (the core uses them too); re-exported here
from .files import atomic_write_bytes, atomic_write_json, atomic_write_text, format_bytes

__all__ = ["format_bytes", "atomic_write_text", "atomic_write_bytes", "atomic_write_json", "save_figure", "environment",
           "markdown_to_html", "render_markdown_file", "line_styles", "legend_outside"]


def save_figure(fig, path: str | os.PathLike, dpi: int = 120) -> Path:
    """Save a matplotlib figure atomically and close it: SVG when ``path`` ends in .svg, else PNG."""
    import io

    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fmt = "svg" if str(path).lower().endswith(".svg") else "png"
    import matplotlib

    with matplotlib.rc_context({"svg.fonttype": "none"}):  # SVG text stays text (searchable, editable)
        fig.savefig(buf, format=fmt, dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    return atomic_write_bytes(path, buf.getvalue())


def environment() -> dict:
    """Versions, threads and CPU: recorded beside every measurement."""
    import numpy
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "threads": torch.get_num_threads(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        # the instruction-set flags that decide kernel speed (detected, never assumed; attnlab.cpu)
        "cpu_features": _cpu_features(),
    }


def _cpu_features() -> dict:
    return cpu.INFO.as_dict()


_MD_CSS = ("body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;max-width:980px;margin:2em auto;padding:0 1em;"
           "color:#1d1d1f;line-height:1.5}img{max-width:100%;border:1px solid #ddd}table{border-collapse:collapse;"
           "margin:.6em 0}td,th{border:1px solid #ccc;padding:3px 9px}th{background:#f4f4f4}code{background:#f4f4f4;"
           "padding:0 .2em}pre{background:#f6f6f6;padding:.6em;overflow:auto}h2{border-bottom:1px solid #eee;"
           "padding-bottom:.2em;margin-top:1.6em}")


def markdown_to_html(text: str, title: str = "attnlab report") -> str:
    """A self-contained HTML page from Markdown (markdown-it-py, CommonMark + tables). Raw HTML in the
    Markdown is escaped, not passed through, so user text cannot inject markup or scripts."""
    import html

    from markdown_it import MarkdownIt

    md = MarkdownIt("commonmark", {"html": False}).enable("table")
    return ("<!doctype html><html lang='en'><head><meta charset='utf-8'>"
            "<meta http-equiv='Content-Security-Policy' content=\"default-src 'none'; style-src 'unsafe-inline'; "
            "img-src 'self' data: file:\">"
            f"<title>{html.escape(title)}</title><style>{_MD_CSS}</style></head><body>\n{md.render(text)}</body></html>\n")


def render_markdown_file(path: str | os.PathLike, title: str | None = None) -> Path:
    """Write PATH.html (same folder, same stem) rendered from the Markdown file PATH; return its path."""
    p = Path(path)
    return atomic_write_text(p.with_suffix(".html"), markdown_to_html(p.read_text(encoding="utf-8"), title or p.stem))


# Okabe & Ito's colour-blind-safe colours (black kept for references) and four of Paul Tol's "muted" set.
_LINE_COLOURS = ("#E69F00", "#56B4E9", "#009E73", "#0072B2", "#D55E00", "#CC79A7", "#F0E442", "#882255",
                 "#44AA99", "#332288", "#999933")
_LINE_MARKERS = ("o", "s", "^", "D", "v", "P", "X")
_LINE_DASHES = ("-", "--", "-.", ":")


def line_styles(n: int) -> list[dict]:
    """``n`` distinct matplotlib styles (color, marker, linestyle) for line plots: 11 colour-blind-safe
    colours first; past 11 lines the marker and dash change too, so no two lines look alike."""
    nc = len(_LINE_COLOURS)
    return [{"color": _LINE_COLOURS[i % nc], "marker": _LINE_MARKERS[(i // nc) % len(_LINE_MARKERS)],
             "linestyle": _LINE_DASHES[(i // nc) % len(_LINE_DASHES)]} for i in range(n)]


def legend_outside(ax, fontsize: float = 7, **kw):
    """A legend to the right of the axes, outside the data (use with bbox_inches="tight", as save_figure does)."""
    return ax.legend(fontsize=fontsize, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, **kw)
