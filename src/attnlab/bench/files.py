"""The files a small suite writes: its JSON record and one figure, both atomically, side by side."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..harness import pyplot, save_plot
from ..report import atomic_write_json

__all__ = ["write_json_and_figure"]


def write_json_and_figure(out_dir: str | Path, stem: str, payload: dict, draw: Callable[[object], None],
                          figsize: tuple[float, float] = (6, 3)) -> list[str]:
    """Write ``<out_dir>/<stem>.json`` (``payload``) and ``<out_dir>/<stem>.png``, a figure of one axes that
    ``draw(ax)`` fills; returns both paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / f"{stem}.json", payload)
    fig, ax = pyplot().subplots(figsize=figsize)
    draw(ax)
    save_plot(fig, out / f"{stem}.png")
    return [str(out / f"{stem}.json"), str(out / f"{stem}.png")]
