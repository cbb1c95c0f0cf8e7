"""attnlab tour: what attnlab can do, on this machine, in a few minutes (the README's ``make demo``).

Runs, in order: ``explain`` on a few shapes, the trace of the tutorial's worked example, the variance
experiment, MiniLM's attention on a sentence as an HTML view, and a quick core benchmark with its
plot. Writes reports/tour/index.html linking everything and prints a short summary. A piece whose
subcommand is not there yet is listed as "not available yet"; a piece that fails is listed with its
error; neither stops the tour.
"""
from __future__ import annotations

import argparse
import html
import importlib.util
import io
import time
from contextlib import redirect_stdout
from pathlib import Path

from ..options import output_dir

__all__ = ["build_parser", "run", "SENTENCE"]

SENTENCE = "The cat sat on the mat because it was warm."
EXPLAIN_SHAPES = [  # (label, B, H, L, S, E, kwargs)
    ("short sequence", 1, 8, 128, 128, 64, {}),
    ("long sequence, causal", 1, 8, 8192, 8192, 64, {"is_causal": True}),
    ("weights requested", 2, 12, 512, 512, 32, {"need_weights": True}),
    ("sliding window of 128 over 16384", 1, 4, 16384, 16384, 64, {"pattern": "sliding_window"}),
]


def build_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="reports/tour", help="output folder (default reports/tour)")
    p.add_argument("--skip", default="", help="comma-separated pieces to skip: explain,trace,variance,viz,bench")
    p.add_argument("--sentence", default=SENTENCE, help="the sentence MiniLM's attention is shown on")


def _subcommand_available(name: str) -> bool:
    from .main import SUBCOMMANDS

    mod = SUBCOMMANDS.get(name, (None,))[0]
    return mod is not None and importlib.util.find_spec(mod) is not None


def _suite_available(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _call(argv: list[str]):
    """Run ``attnlab ARGV`` in this process; (exit code, result, captured stdout)."""
    from . import main as M

    buf = io.StringIO()
    with redirect_stdout(buf):
        code = M.main(argv)
    return code, M.LAST_RESULT, buf.getvalue()


# -- the pieces: each returns (status, detail, links) ------------------------------------------------------
def _explain(out: Path):
    import torch

    import attnlab
    from attnlab import patterns as P
    from attnlab.report import atomic_write_text

    lines, rows = [], []
    for label, B, H, L, S, E, kw in EXPLAIN_SHAPES:
        kw = dict(kw)
        if kw.get("pattern") == "sliding_window":
            kw["pattern"] = P.sliding_window(128)
        q = torch.empty(B, H, L, E, device="meta")
        k = torch.empty(B, H, S, E, device="meta")
        v = torch.empty(B, H, S, E, device="meta")
        try:
            plan = attnlab.explain(q, k, v, **kw)
        except Exception:  # the meta device may not be accepted: small real tensors cost nothing for explain
            q, k, v = (torch.zeros(B, H, n, E) for n in (L, S, S))
            plan = attnlab.explain(q, k, v, **kw)
        lines += [f"## {label}: query [{B}, {H}, {L}, {E}], key/value [{B}, {H}, {S}, {E}]", str(plan), ""]
        rows.append((label, plan.method, plan.reason))
    atomic_write_text(out / "explain.txt", "\n".join(lines))
    detail = "; ".join(f"{label} → {m}" for label, m, _ in rows)
    return "ok", detail, [("explain.txt", "which method runs for which shapes, and why")]


def _trace(out: Path):
    if not _subcommand_available("trace"):
        return "not available yet", "attnlab trace (issue 5) is not there yet", []
    code, res, _ = _call(["trace", "--example", "--format", "html", "--out", str(out / "trace.html")])
    if code != 0:
        return "failed", f"attnlab trace exited with {code}", []
    return "ok", "every step of the 4-token worked example, on real numbers", [("trace.html", "trace of the worked example")]


def _variance(out: Path):
    if not _suite_available("attnlab.experiments.variance"):
        return "not available yet", "attnlab experiment variance is not there yet", []
    code, res, _ = _call(["experiment", "variance", "--quick", "--no-progress", "--out", str(out / "variance")])
    if code != 0:
        return "failed", f"attnlab experiment variance exited with {code}", []
    s = res["fitted_log_slope_of_var_vs_dk"]
    at = max(r["d_k"] for r in res["variance"] if r["source"] == "random")
    mw = {r["scaling"]: r["max_weight"] for r in res["variance"] if r["source"] == "random" and r["d_k"] == at}
    detail = (f"Var(q·k) ∝ d_k^{s['none']:.2f} unscaled, d_k^{s['sqrt']:.2f} with 1/√d_k; at d_k={at} the max weight is "
              f"{mw['none']:.2f} unscaled vs {mw['sqrt']:.2f} scaled")
    links = [("variance/report.md", "variance report"), ("variance/variance.png", "plot: random q, k")]
    if (out / "variance" / "minilm.png").exists():
        links.append(("variance/minilm.png", "plot: MiniLM's real q, k"))
    return "ok", detail, links


def _viz(out: Path, sentence: str):
    if not _subcommand_available("viz"):
        return "not available yet", "attnlab viz (issue 5) is not there yet", []
    code, res, _ = _call(["viz", sentence, "--out", str(out / "viz")])
    if code != 0:
        return "failed", f"attnlab viz exited with {code}", []
    return "ok", f"MiniLM's attention on {sentence!r}", [("viz/index.html", "interactive view of MiniLM's attention")]


def _bench(out: Path):
    if not _suite_available("attnlab.bench.core"):
        return "not available yet", "attnlab bench core is not there yet", []
    code, res, _ = _call(["bench", "core", "--quick", "--force", "--out", str(out / "bench-core")])
    if code != 0:
        return "failed", f"attnlab bench core exited with {code}", []
    links = [(f"bench-core/{p.name}", f"benchmark: {p.name}") for p in sorted((out / "bench-core").glob("*"))
             if p.suffix in (".png", ".md", ".json", ".csv")]
    return "ok", "tiled / sparse / auto vs torch SDPA (quick grid)", links


def run(args):
    t0 = time.perf_counter()
    out = output_dir(args.out)
    out.mkdir(parents=True, exist_ok=True)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    names = ("explain", "trace", "variance", "viz", "bench")
    bad = skip - set(names)
    if bad:
        raise ValueError(f"--skip takes pieces from {', '.join(names)}; got {', '.join(sorted(bad))}")
    pieces = [("explain", "Which attention method runs, and why", lambda: _explain(out)),
              ("trace", "The worked example, step by step", lambda: _trace(out)),
              ("variance", "Var(q·k) against d_k, with and without scaling", lambda: _variance(out)),
              ("viz", "MiniLM's attention on a sentence", lambda: _viz(out, args.sentence)),
              ("bench", "A quick benchmark against torch SDPA", lambda: _bench(out))]
    results = []
    for name, title, fn in pieces:
        t1 = time.perf_counter()
        if name in skip:
            status, detail, links = "skipped", "--skip", []
        else:
            try:
                status, detail, links = fn()
            except Exception as e:  # one broken piece must not stop the tour
                status, detail, links = "failed", f"{type(e).__name__}: {e}", []
        links = [(href, label) for href, label in links if (out / href).exists()]
        results.append({"name": name, "title": title, "status": status, "detail": detail,
                        "links": [{"href": h, "label": lab} for h, lab in links], "seconds": time.perf_counter() - t1})
    from attnlab.report import atomic_write_json, atomic_write_text, environment

    env = environment()
    atomic_write_text(out / "index.html", _index_html(results, env))
    summary = {"pieces": results, "index": str(out / "index.html"), "environment": env,
               "seconds": time.perf_counter() - t0,
               "exit_code": 1 if any(r["status"] == "failed" for r in results) else 0}
    atomic_write_json(out / "tour.json", summary)
    _render(results, out, summary["seconds"])
    return summary


def _index_html(results: list[dict], env: dict) -> str:
    e = html.escape
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>attnlab tour</title>",
             "<style>body{font-family:system-ui,sans-serif;max-width:960px;margin:2em auto;padding:0 1em}"
             ".ok{color:#1a7f37}.failed{color:#cf222e}.na{color:#9a6700}img{max-width:100%;border:1px solid #ddd}"
             "code{background:#f4f4f4;padding:0 .2em}</style></head><body>",
             "<h1>attnlab tour</h1>",
             f"<p>Measured on this machine: {e(str(env.get('cpu')))}, torch {e(str(env.get('torch')))}, "
             f"{e(str(env.get('threads')))} threads.</p>"]
    for r in results:
        cls = {"ok": "ok", "failed": "failed"}.get(r["status"], "na")
        parts.append(f"<h2>{e(r['title'])} <small class='{cls}'>[{e(r['status'])}]</small></h2>")
        parts.append(f"<p>{e(r['detail'])}</p>")
        if r["links"]:
            parts.append("<ul>" + "".join(f"<li><a href='{e(l['href'])}'>{e(l['label'])}</a></li>" for l in r["links"]) + "</ul>")
            for l in r["links"]:
                if l["href"].endswith(".png"):
                    parts.append(f"<p><img src='{e(l['href'])}' alt='{e(l['label'])}'></p>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _render(results, out, seconds) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"attnlab tour ({seconds:.0f} s) → {out / 'index.html'}")
    t.add_column("piece")
    t.add_column("status")
    t.add_column("what it showed", overflow="fold")
    for r in results:
        style = {"ok": "green", "failed": "red"}.get(r["status"], "yellow")
        t.add_row(r["title"], f"[{style}]{r['status']}[/{style}]", r["detail"])
    Console().print(t)
