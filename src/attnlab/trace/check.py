"""Check a printed table (a textbook's softmax weights, say) against the trace's exact values.

A printed number is right when it is within half a unit of its last printed digit of the exact value
(0.296 stands for [0.2955, 0.2965)); the precision is read from the text of each number, so "0.25" and
"0.250" get different tolerances. Every other cell is wrong, and the check carries its correct value.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np

from .render import _md

__all__ = ["TableCheck", "parse_printed_table", "check_table", "decimals_of", "check_markdown", "check_html", "check_rich"]

# float64 rounding of the exact value may sit a hair past the half-unit boundary; this much is forgiven
_EPS = 1e-12


def decimals_of(number: str) -> int:
    """Decimal places a printed number shows: "0.296" -> 3, "1.5e-2" -> 3, "12" -> 0, "1e3" -> 0."""
    s = number.strip().lstrip("+-")
    mant, _, exp = s.lower().partition("e")
    frac = mant.split(".", 1)[1] if "." in mant else ""
    return max(0, len(frac) - (int(exp) if exp else 0))


def parse_printed_table(text: str, name: str = "table") -> tuple[np.ndarray, np.ndarray]:
    """A printed matrix as JSON (``#`` comments to the end of a line allowed, as in a textbook's listing)
    -> (values [L, S] float64, decimals [L, S] int). ValueError naming ``name`` otherwise."""
    body = re.sub(r"#[^\n]*", "", text)
    try:
        data = json.loads(body, parse_float=str, parse_int=str)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name} must be a JSON matrix like [[0.3, 0.7], [0.6, 0.4]] (or a file holding one): {e}") from None
    if isinstance(data, str):
        data = [[data]]
    if not isinstance(data, list) or not data:
        raise ValueError(f"{name} must be a non-empty list of rows, got {type(data).__name__}")
    if all(isinstance(x, str) for x in data):
        data = [data]  # one row
    if not all(isinstance(r, list) and r and all(isinstance(x, str) for x in r) for r in data):
        raise ValueError(f"{name} must be a list of rows of numbers (a 2-D matrix)")
    lens = {len(r) for r in data}
    if len(lens) > 1:
        raise ValueError(f"{name} is not rectangular: its rows have lengths {sorted(lens)}")
    values = np.array([[float(x) for x in r] for r in data], dtype=np.float64)
    if not np.isfinite(values).all():
        raise ValueError(f"{name} contains NaN or infinity")
    return values, np.array([[decimals_of(x) for x in r] for r in data], dtype=np.int64)


@dataclass
class TableCheck:
    """Printed vs exact values of one trace step ([L, S] each) and which printed cells are wrong."""

    step: str
    printed: np.ndarray  # (L, S)
    correct: np.ndarray  # (L, S) exact (float64)
    decimals: np.ndarray  # (L, S) decimals shown per printed cell
    rows: list[str]
    cols: list[str]

    @property
    def tolerance(self) -> np.ndarray:
        """Half a unit in the last printed digit, per cell."""
        return 0.5 * 10.0 ** (-self.decimals.astype(np.float64))

    @property
    def error(self) -> np.ndarray:
        """|printed - exact| per cell, [L, S]."""
        return np.abs(self.printed - self.correct)

    @property
    def wrong(self) -> np.ndarray:
        """Bool [L, S]: the cells further than their tolerance from the exact value."""
        return self.error > self.tolerance * (1 + _EPS) + _EPS

    @property
    def ok(self) -> bool:
        """True when every printed cell is right."""
        return not bool(self.wrong.any())

    def correct_as_printed(self, i: int, j: int) -> str:
        """The exact value at the cell's printed precision (what the table should say)."""
        d = int(self.decimals[i, j])
        return f"{self.correct[i, j]:.{d}f}"

    def cells(self) -> list[dict]:
        """Every wrong cell: row, column, printed, correct (full and at the printed precision), error in
        units of the last printed digit."""
        out = []
        for i, j in zip(*np.nonzero(self.wrong)):
            i, j = int(i), int(j)
            unit = 10.0 ** -int(self.decimals[i, j])
            out.append({"row": i, "col": j, "row_label": self.rows[i], "col_label": self.cols[j],
                        "printed": float(self.printed[i, j]), "correct": float(self.correct[i, j]),
                        "correct_as_printed": self.correct_as_printed(i, j),
                        "error": float(self.error[i, j]), "error_units": float(self.error[i, j] / unit)})
        return out

    def summary(self) -> str:
        """One sentence: how many cells are wrong, the tolerance, rounding slips and the worst cell."""
        n, total = int(self.wrong.sum()), self.wrong.size
        tol = sorted({f"±{t:g}" for t in self.tolerance.flat})
        head = (f"{n} of {total} printed cells of '{self.step}' are wrong" if n else
                f"all {total} printed cells of '{self.step}' are right")
        text = f"{head} (±{', '.join(tol).replace('±', '')}: half a unit of the last digit)"
        if n:
            cells = self.cells()
            slips = sum(c["error_units"] <= 1.0 for c in cells)
            if slips:
                text += f"; {slips} only a rounding slip"
            worst = max(cells, key=lambda c: c["error"])
            text += (f"; worst {worst['row_label']}, {worst['col_label']}: {worst['printed']:g}, "
                     f"not {worst['correct']:.4g}")
        return text

    def to_dict(self) -> dict:
        """JSON-ready dict (``attnlab trace --expect … --format json``)."""
        return {"step": self.step, "ok": self.ok, "n_wrong": int(self.wrong.sum()), "n_cells": int(self.wrong.size),
                "rows": self.rows, "cols": self.cols, "printed": self.printed.tolist(),
                "correct": self.correct.tolist(), "decimals": self.decimals.tolist(),
                "printed_row_sums": self.printed.sum(-1).tolist(), "wrong_cells": self.cells(),
                "summary": self.summary()}


def check_table(printed, trace, *, step: str = "weights", name: str = "--expect") -> TableCheck:
    """Compare ``printed`` with the trace's ``step`` ([L, S], one head).

    printed: the table's text (JSON, ``#`` comments allowed; precision read per number) or a
    (values, decimals) pair from ``parse_printed_table``.
    """
    values, decimals = parse_printed_table(printed, name) if isinstance(printed, str) else printed
    st = trace.step(step)
    if st.value is None:
        raise ValueError(f"step {step!r} of this trace holds no values to compare")
    correct = np.asarray(st.value, dtype=np.float64)
    if correct.ndim != 2:
        raise ValueError(f"{name} is one head's table, but this trace shows {correct.shape[0]} heads in {step!r} "
                         f"(shape {list(correct.shape)}); trace a single head")
    if values.shape != correct.shape:
        raise ValueError(f"{name} is {values.shape[0]}×{values.shape[1]} but the trace's {step!r} is "
                         f"{correct.shape[0]}×{correct.shape[1]} (queries × keys)")
    rows = list(st.rows) if st.rows else [f"q{i}" for i in range(correct.shape[0])]
    cols = list(st.cols) if st.cols else [f"k{j}" for j in range(correct.shape[1])]
    return TableCheck(step, values, correct, decimals, rows, cols)


# -- renderings (the CLI prints them) ------------------------------------------------------------
def _cell_text(c: TableCheck, i: int, j: int) -> tuple[str, bool]:
    d = int(c.decimals[i, j])
    shown = f"{c.printed[i, j]:.{d}f}"
    if c.wrong[i, j]:
        return f"{shown} ✗ {c.correct_as_printed(i, j)}", False  # one line when it fits, else rich folds it
    return shown, True


def check_markdown(c: TableCheck) -> str:
    """Markdown: the printed table with each wrong cell struck through and followed by its correct value."""
    # labels and the table's name are user text: escaped, as to_markdown's
    lines = [f"## Check of the printed '{_md(c.step)}' table", "", _md(c.summary()), "",
             "| | " + " | ".join(_md(x) for x in c.cols) + " | printed row sum |", "|---" * (len(c.cols) + 2) + "|"]
    for i, r in enumerate(c.rows):
        cells = []
        for j in range(len(c.cols)):
            d = int(c.decimals[i, j])
            cells.append(f"~~{c.printed[i, j]:.{d}f}~~ **{c.correct_as_printed(i, j)}**" if c.wrong[i, j]
                         else f"{c.printed[i, j]:.{d}f}")
        lines.append(f"| {_md(r)} | " + " | ".join(cells) + f" | {c.printed[i].sum():.4g} |")
    lines += ["", "Struck-through cells are wrong; the bold number is the exact value at the printed precision."]
    return "\n".join(lines) + "\n"


def check_html(c: TableCheck) -> str:
    """A self-contained HTML page: wrong cells red with their correct value, right cells green."""
    import html as _h

    e = _h.escape
    head = "".join(f"<th>{e(x)}</th>" for x in c.cols)
    body = []
    for i, r in enumerate(c.rows):
        tds = []
        for j in range(len(c.cols)):
            d = int(c.decimals[i, j])
            if c.wrong[i, j]:
                tds.append(f"<td class='bad' title='printed {c.printed[i, j]:.{d}f}, exact {c.correct[i, j]:.6f}'>"
                           f"<s>{c.printed[i, j]:.{d}f}</s> {e(c.correct_as_printed(i, j))}</td>")
            else:
                tds.append(f"<td class='good'>{c.printed[i, j]:.{d}f}</td>")
        body.append(f"<tr><th>{e(r)}</th>{''.join(tds)}<td>{c.printed[i].sum():.4g}</td></tr>")
    return ("<!doctype html><html><head><meta charset='utf-8'><title>attnlab trace --expect</title><style>"
            "body{font-family:system-ui,sans-serif;margin:2em}table{border-collapse:collapse}"
            "td,th{border:1px solid #ccc;padding:4px 10px;text-align:right;font-family:ui-monospace,monospace}"
            ".bad{background:#ffd7d5;color:#82071e}.good{background:#dafbe1}</style></head><body>"
            f"<h1>Check of the printed '{e(c.step)}' table</h1><p>{e(c.summary())}</p>"
            f"<table><tr><th></th>{head}<th>printed row sum</th></tr>{''.join(body)}</table>"
            "<p>Red: wrong (struck-through printed value, then the exact value at the printed precision).</p>"
            "</body></html>\n")


def check_rich(c: TableCheck):
    """The check as a rich ``Table`` (right cells green, wrong cells red with 'printed ✗ correct') and, below it
    at the terminal's width rather than the table's, the verdict (:meth:`TableCheck.summary`)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    t = Table(title=f"printed '{c.step}' vs exact (wrong: printed ✗ correct)")
    t.add_column("", no_wrap=True, min_width=2)
    for col in c.cols:
        t.add_column(col, justify="right", min_width=5)
    t.add_column("Σ", justify="right")
    for i, r in enumerate(c.rows):
        cells = []
        for j in range(len(c.cols)):
            text, good = _cell_text(c, i, j)
            cells.append(f"[green]{text}[/green]" if good else f"[bold red]{text}[/bold red]")
        t.add_row(r, *cells, f"{c.printed[i].sum():.4g}")
    return Group(t, Text(c.summary()))
