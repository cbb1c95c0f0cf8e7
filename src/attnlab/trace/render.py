"""Render a Trace: rich terminal tables, Markdown, a self-contained HTML page, or JSON.

Matrices wider or taller than ``max_show`` are cut to their first rows/columns with an ellipsis in the
text formats; JSON always holds every number.
"""
from __future__ import annotations

import html
import json

import numpy as np

from ..files import format_bytes
from .core import Step, Trace

__all__ = ["to_json", "to_markdown", "to_html", "to_rich", "FORMATS"]

FORMATS = ("rich", "markdown", "html", "json")


def _fmt(x: float, digits: int) -> str:
    if not np.isfinite(x):
        return "-inf" if x < 0 else ("inf" if x > 0 else "nan")
    if x != 0 and (abs(x) >= 10**6 or abs(x) < 0.5 * 10**-digits):
        return f"{x:.{max(digits - 1, 1)}e}"
    return f"{x:.{digits}f}"


def _fmt_int(n: int) -> str:
    """A count in SI units, k up to E (10^18); past 1000 E in plain e-notation, never "1.54e+10G"."""
    if n >= 1e21:
        return f"{n:.3g}"
    for unit, div in (("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(int(n))


def _fmt_bytes(n: int) -> str:
    return format_bytes(n, digits=4)


def _cut(labels, n, prefix):
    labels = list(labels) if labels is not None else [f"{prefix}{i}" for i in range(n)]
    return labels


def _grid(value: np.ndarray, rows, cols, max_show: int, digits: int):
    """(header, [(row label, cells)]) of a 2-D matrix cut to max_show rows and columns."""
    R, C = value.shape
    rows, cols = _cut(rows, R, "r"), _cut(cols, C, "c")
    ri = list(range(R)) if R <= max_show else list(range(max_show - 1)) + [None, R - 1]
    ci = list(range(C)) if C <= max_show else list(range(max_show - 1)) + [None, C - 1]
    header = [("…" if j is None else str(cols[j])) for j in ci]
    body = []
    for i in ri:
        if i is None:
            body.append(("…", ["…"] * len(ci)))
        else:
            body.append((str(rows[i]), ["…" if j is None else _fmt(float(value[i, j]), digits) for j in ci]))
    return header, body


def _heat(x: float, lo: float, hi: float) -> str:
    """Inline style colouring one cell: white at 0, red for positive and blue for negative values, in
    proportion to the matrix's largest magnitude (sequential white→red when nothing is negative)."""
    if not np.isfinite(x):
        return "background:#e8e8e8;color:#777"  # masked (-inf)
    m = max(abs(lo), abs(hi))
    if m == 0:
        return ""
    a = min(1.0, abs(x) / m)
    r, g, b = (180, 30, 40) if x >= 0 else (30, 80, 180)
    mix = lambda c: round(255 + (c - 255) * a)  # noqa: E731 - white → the colour by |x| / max
    ink = "#fff" if a > 0.6 else "#111"
    return f"background:rgb({mix(r)},{mix(g)},{mix(b)});color:{ink}"


def _heat_grid(value: np.ndarray, max_show: int) -> list[list[str]]:
    """Cell styles in the layout of ``_grid`` (the same cut rows and columns; '' for the ellipses)."""
    R, C = value.shape
    fin = value[np.isfinite(value)]
    lo, hi = (float(fin.min()), float(fin.max())) if fin.size else (0.0, 0.0)
    ri = list(range(R)) if R <= max_show else list(range(max_show - 1)) + [None, R - 1]
    ci = list(range(C)) if C <= max_show else list(range(max_show - 1)) + [None, C - 1]
    return [["" if i is None or j is None else _heat(float(value[i, j]), lo, hi) for j in ci] for i in ri]


def _matrices(step: Step, trace: Trace):
    """[(caption, 2-D array)] for a step: one per shown head for per-head steps."""
    if step.value is None:
        return []
    if step.per_head:
        return [(f"head {h}", step.value[n]) for n, h in enumerate(trace.heads or range(step.value.shape[0]))]
    return [("", step.value)]


def _stat_line(step: Step) -> str:
    parts = [f"{k}={_fmt(v, 4) if isinstance(v, float) else v}" for k, v in step.stats.items()]
    return ", ".join(parts)


def to_json(trace: Trace) -> str:
    """The trace as JSON (``Trace.to_dict``: every number, -inf written as null)."""
    return json.dumps(trace.to_dict(), indent=1)


def _header_lines(trace: Trace) -> list[str]:
    o = trace.options
    out = [f"source: {trace.source}; scale: {o.scale}; softmax: {'on' if o.softmax else 'off'}; "
           f"similarity: {'cosine' if o.cosine else 'dot product'}; mask: {'causal' if o.causal else 'none'}"]
    if trace.labels and trace.source != "summary":
        out.append("tokens: " + " ".join(trace.labels))
    if trace.heads is not None and trace.num_heads > 1:
        out.append(f"heads shown: {trace.heads} of {trace.num_heads}")
    for k, v in trace.meta.items():
        if k in ("layer", "model", "d_model", "seq_len", "heads", "batch", "dtype", "seed"):
            out.append(f"{k}: {v}")
    return out


def to_markdown(trace: Trace, *, max_show: int = 8, digits: int = 3) -> str:
    """The trace as Markdown: header, one table per step and head (at most ``max_show`` rows and columns,
    ``digits`` decimals), the comparison with standard attention, notes. User text is escaped."""
    lines = [f"# attnlab trace ({trace.source})", ""]
    lines += [f"- {_md(x)}" for x in _header_lines(trace)] + [""]  # (the tokens are user text)
    if trace.source == "summary":
        lines += ["| step | formula | shape | FLOPs | bytes | mean | var | min | max | extra |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for s in trace.steps:
            st = dict(s.stats)
            base = [_fmt(st.pop(k), 4) if k in st else "" for k in ("mean", "var", "min", "max")]
            extra = ", ".join(f"{k}={_fmt(v, 4) if isinstance(v, float) else v}" for k, v in st.items())
            lines.append(f"| {s.title} | {_md(s.formula)} | {list(s.shape)} | {_fmt_int(s.flops)} | "
                         f"{_fmt_bytes(s.bytes)} | " + " | ".join(base) + f" | {extra} |")
        lines.append("")
    else:
        for s in trace.steps:
            lines += [f"## {s.title}: `{s.name}`", "", f"{_md(s.formula)} — shape {list(s.shape)}"
                      + (f", {_fmt_int(s.flops)} FLOPs" if s.flops else ""), ""]
            if s.note:
                lines += [f"_{_md(s.note)}_", ""]
            for cap, m in _matrices(s, trace):
                if cap:
                    lines += [f"**{cap}**", ""]
                header, body = _grid(m, s.rows, s.cols, max_show, digits)
                lines.append("| | " + " | ".join(_md(h) for h in header) + " |")
                lines.append("|---" * (len(header) + 1) + "|")
                for lab, cells in body:
                    lines.append(f"| **{_md(lab)}** | " + " | ".join(cells) + " |")
                lines.append("")
            if s.stats:
                lines += [f"stats: {_stat_line(s)}", ""]
    if trace.comparison:
        keys = list(trace.comparison[0].keys())
        lines += ["## what changes vs standard attention", "", "| " + " | ".join(keys) + " |",
                  "|---" * len(keys) + "|"]
        for row in trace.comparison:
            lines.append("| " + " | ".join(_fmt(v, 4) if isinstance(v, float) else _md(str(v)) for v in row.values()) + " |")
        lines.append("")
    for n in trace.notes:
        lines.append(f"> {_md(n)}")
    return "\n".join(lines).rstrip() + "\n"


def _md(s: str) -> str:
    """Escape what Markdown tables and inline HTML would interpret."""
    return html.escape(str(s), quote=False).replace("|", "\\|").replace("*", "\\*").replace("_", "\\_")


_CSS = """body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;margin:.4em 0 1em}td,th{border:1px solid #ccc;padding:2px 6px;text-align:right;
font-family:ui-monospace,monospace;font-size:12px}th{background:#f3f3f3}.f{color:#555}.note{color:#a50}
h2{font-size:1.05em;margin-top:1.4em}"""


def to_html(trace: Trace, *, max_show: int = 8, digits: int = 3) -> str:
    """The trace as one self-contained HTML page (inline CSS, no scripts); every piece of text escaped."""
    e = lambda s: html.escape(str(s))  # noqa: E731 - every piece of user text goes through this
    out = ["<!doctype html><html><head><meta charset='utf-8'>",
           f"<title>attnlab trace ({e(trace.source)})</title><style>{_CSS}</style></head><body>",
           f"<h1>attnlab trace ({e(trace.source)})</h1><ul>"]
    out += [f"<li>{e(x)}</li>" for x in _header_lines(trace)] + ["</ul>"]
    if trace.source == "summary":
        out.append("<table><tr><th>step</th><th>formula</th><th>shape</th><th>FLOPs</th><th>bytes</th><th>statistics</th></tr>")
        for s in trace.steps:
            out.append(f"<tr><td>{e(s.title)}</td><td>{e(s.formula)}</td><td>{e(list(s.shape))}</td>"
                       f"<td>{e(_fmt_int(s.flops))}</td><td>{e(_fmt_bytes(s.bytes))}</td><td>{e(_stat_line(s))}</td></tr>")
        out.append("</table>")
    else:
        for s in trace.steps:
            out.append(f"<h2>{e(s.title)}: <code>{e(s.name)}</code></h2><div class='f'>{e(s.formula)} — shape "
                       f"{e(list(s.shape))}{', ' + e(_fmt_int(s.flops)) + ' FLOPs' if s.flops else ''}</div>")
            if s.note:
                out.append(f"<div class='note'>{e(s.note)}</div>")
            for cap, m in _matrices(s, trace):
                header, body = _grid(m, s.rows, s.cols, max_show, digits)
                colours = _heat_grid(m, max_show)
                out.append((f"<div>{e(cap)}</div>" if cap else "") + "<table><tr><th></th>"
                           + "".join(f"<th>{e(h)}</th>" for h in header) + "</tr>")
                for (lab, cells), crow in zip(body, colours):
                    out.append(f"<tr><th>{e(lab)}</th>" + "".join(
                        f"<td style='{st}'>{e(c)}</td>" if st else f"<td>{e(c)}</td>" for c, st in zip(cells, crow))
                        + "</tr>")
                out.append("</table>")
            if s.stats:
                out.append(f"<div class='f'>stats: {e(_stat_line(s))}</div>")
    if trace.comparison:
        keys = list(trace.comparison[0].keys())
        out.append("<h2>what changes vs standard attention</h2><table><tr>"
                   + "".join(f"<th>{e(k)}</th>" for k in keys) + "</tr>")
        for row in trace.comparison:
            out.append("<tr>" + "".join(f"<td>{e(_fmt(v, 4) if isinstance(v, float) else v)}</td>"
                                        for v in row.values()) + "</tr>")
        out.append("</table>")
    out += [f"<p class='note'>{e(n)}</p>" for n in trace.notes]
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def to_rich(trace: Trace, *, max_show: int = 8, digits: int = 3):
    """The trace as a rich renderable (a ``Group``: header lines, one table per step and head, the
    comparison with standard attention, notes); ``Console().print(to_rich(trace))`` shows it."""
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table

    parts: list = [f"[bold]attnlab trace[/bold] ({escape(trace.source)})"]
    parts += ["  " + escape(x) for x in _header_lines(trace)]
    if trace.source == "summary":
        t = Table(title="per-step shapes, FLOPs, bytes and statistics")
        for c in ("step", "formula", "shape", "FLOPs", "bytes", "mean", "var", "min", "max", "more"):
            t.add_column(c, justify="right" if c not in ("step", "formula", "more") else "left")
        for s in trace.steps:
            st = dict(s.stats)
            base = [_fmt(st.pop(k), 4) if k in st else "" for k in ("mean", "var", "min", "max")]
            more = ", ".join(f"{k}={_fmt(v, 3) if isinstance(v, float) else v}" for k, v in st.items())
            t.add_row(escape(s.title), escape(s.formula), str(list(s.shape)), _fmt_int(s.flops), _fmt_bytes(s.bytes),
                      *base, escape(more))
        parts.append(t)
    else:
        for s in trace.steps:
            for cap, m in _matrices(s, trace):
                title = f"{s.title}  [dim]{escape(s.name)}[/dim]" + (f" — {escape(cap)}" if cap else "")
                cap_txt = f"{escape(s.formula)} — shape {list(s.shape)}" + (f", {_fmt_int(s.flops)} FLOPs" if s.flops else "")
                if s.note:
                    cap_txt += f"\n{escape(s.note)}"
                t = Table(title=title, caption=cap_txt, title_justify="left")
                header, body = _grid(m, s.rows, s.cols, max_show, digits)
                t.add_column("")
                for h in header:
                    t.add_column(escape(h), justify="right")
                for lab, cells in body:
                    t.add_row(escape(lab), *cells)
                parts.append(t)
    if trace.comparison:
        keys = list(trace.comparison[0].keys())
        t = Table(title="what changes vs standard attention (÷√d_k, softmax, dot product)")
        for k in keys:
            t.add_column(escape(k), justify="left" if k == "measure" else "right")
        for row in trace.comparison:
            t.add_row(*[_fmt(v, 4) if isinstance(v, float) else escape(str(v)) for v in row.values()])
        parts.append(t)
    parts += ["[yellow]note:[/yellow] " + escape(n) for n in trace.notes]
    return Group(*parts)
