"""The one Markdown table writer, and the number formatting reports share."""
from __future__ import annotations

import math
from typing import Any, Sequence

__all__ = ["fmt", "markdown_table", "mean_std"]


def fmt(x: Any, digits: int = 3) -> str:
    """A cell: None -> '—', a float -> ``digits`` significant digits (nan/inf as written), else ``str``."""
    if x is None:
        return "—"
    if isinstance(x, float):
        if not math.isfinite(x):
            return str(x)
        return f"{x:.{digits}g}"
    return str(x)


def _cell(x: Any, digits: int) -> str:
    # a '|' inside a cell would end it; a newline would end the row
    return fmt(x, digits).replace("|", "\\|").replace("\n", " ")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, digits: int = 3,
                   align: Sequence[str] | None = None) -> str:
    """A GitHub-flavoured Markdown table; cells through :func:`fmt`, '|' escaped.

    align: one of "l", "r", "c" per column (default: none given). Raises ValueError naming the row
    whose length differs from the headers'."""
    headers = list(headers)
    for i, r in enumerate(rows):
        if len(r) != len(headers):
            raise ValueError(f"markdown_table: row {i} has {len(r)} cells, headers have {len(headers)}")
    if align is not None and len(align) != len(headers):
        raise ValueError(f"markdown_table: align has {len(align)} entries, headers have {len(headers)}")
    rule = {"l": ":---", "r": "---:", "c": ":---:"}
    seps = ["---"] * len(headers) if align is None else [rule[a] for a in align]
    lines = ["| " + " | ".join(_cell(h, digits) for h in headers) + " |", "|" + "|".join(seps) + "|"]
    lines += ["| " + " | ".join(_cell(c, digits) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def mean_std(xs: Sequence[float | None]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation of the finite values (None, None when there are none; std 0
    for one value)."""
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return None, None
    m = sum(xs) / len(xs)
    sd = (sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5 if len(xs) > 1 else 0.0
    return m, sd
