"""attnlab's guided tour as a library function: the headline results, measured on this machine.

    result = attnlab.tour.run_tour(TourConfig(out="reports/tour"), progress=print_progress)

Pieces, in order (each writes into ``out`` and returns a line of findings, links and figures):
    explain   which method ``attnlab.attention`` picks for four shapes, and why
    trace     every step of the tutorial's 4-token example on real numbers (trace.html)
    variance  Var(q·k) against d_k for the scales 1, 1/√d_k, 1/d_k (random q, k; plot + report)
    speed     a sliding window (attnlab, sparse kernel) against torch SDPA's full causal attention
    memory    peak memory of the tiled kernel against naive attention, each call in a fresh process
    heads     what MiniLM's heads do (labels per layer and head, measured over sentences)
    viz       MiniLM's attention on a sentence (the interactive page)
The index (index.md, rendered to index.html with markdown-it) shows the figures inline; every Markdown
report the tour writes is rendered to HTML beside it. A piece that fails is listed with its error and
does not stop the tour. ``progress(done, total, message)`` is called as pieces start, advance and end.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

import attnlab
from attnlab import patterns as P
from attnlab import trace as tr
from attnlab.bench.core import peak_bytes
from attnlab.bench.impls import build_call, make_inputs
from attnlab.diagnostics.heads import DEFAULT_SENTENCES, HeadsConfig, run_heads
from attnlab.experiments.variance import random_records
from attnlab.harness import interleaved
from attnlab.trace.minilm import load_minilm

from .report import atomic_write_json, atomic_write_text, environment, markdown_to_html, save_figure

__all__ = ["TourConfig", "TourResult", "Piece", "run_tour", "PIECES", "SENTENCE", "EXPLAIN_SHAPES"]

SENTENCE = "The cat sat on the mat because it was warm."
PIECES = ("explain", "trace", "variance", "speed", "memory", "heads", "viz")
EXPLAIN_SHAPES = [  # (label, B, H, L, S, E, kwargs)
    ("short sequence", 1, 8, 128, 128, 64, {}),
    ("long sequence, causal", 1, 8, 8192, 8192, 64, {"is_causal": True}),
    ("weights requested", 2, 12, 512, 512, 32, {"need_weights": True}),
    ("sliding window of 128 over 16384", 1, 4, 16384, 16384, 64, {"pattern": "sliding_window"}),
]
Progress = Callable[[int, int, str], None]


@dataclass
class TourConfig:
    """What the tour measures. The defaults finish in a few minutes on a laptop CPU."""

    out: str | Path = "reports/tour"
    sentence: str = SENTENCE
    skip: tuple[str, ...] = ()
    speed_ns: tuple[int, ...] = (1024, 2048, 4096, 8192)
    memory_ns: tuple[int, ...] = (1024, 2048, 4096)
    window: int = 256
    heads: int = 4
    head_dim: int = 64
    repeats: int = 3
    variance_dks: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024)
    model: object | None = None  # a loaded MiniLM to reuse (else loaded once when needed)

    def __post_init__(self):
        bad = set(self.skip) - set(PIECES)
        if bad:
            raise ValueError(f"skip takes pieces from {', '.join(PIECES)}; got {', '.join(sorted(bad))}")
        for name in ("speed_ns", "memory_ns", "variance_dks"):
            vals = getattr(self, name)
            if not vals or any(int(v) < 1 for v in vals):
                raise ValueError(f"{name} must be positive integers, got {vals}")
        if self.window < 1 or self.heads < 1 or self.head_dim < 1 or self.repeats < 1:
            raise ValueError("window, heads, head_dim and repeats must be >= 1")
        if not isinstance(self.sentence, str) or not self.sentence.strip():  # (checked before the tour runs: an
            # empty one had failed its piece only after the timings)
            raise ValueError(f"--sentence must be a non-empty sentence, got {self.sentence!r}")


@dataclass
class Piece:
    """One piece of the tour as it ran: status, a line of findings, links and figures (paths relative to
    the tour's folder), a Markdown table of what was measured, and the seconds it took."""

    name: str
    title: str
    status: str = "ok"  # ok | failed | skipped
    detail: str = ""
    links: list[dict] = field(default_factory=list)  # {"href", "label"}
    figures: list[dict] = field(default_factory=list)  # {"href", "caption"}
    table: str = ""  # a Markdown table of the figures measured
    seconds: float = 0.0


@dataclass
class TourResult:
    """What ``run_tour`` did: every piece, the index page's path, the machine, the time, the exit code
    (1 when a piece failed)."""

    pieces: list[Piece]
    index: str
    environment: dict
    seconds: float
    exit_code: int

    def to_dict(self) -> dict:
        """JSON-ready dict (what tour.json holds)."""
        return asdict(self)


TITLES = {
    "explain": "Which attention method runs, and why",
    "trace": "The worked example, step by step",
    "variance": "Why divide by √d_k: Var(q·k) against d_k",
    "speed": "A sliding window against torch SDPA",
    "memory": "Memory: tiled kernel against naive attention",
    "heads": "What MiniLM's heads do",
    "viz": "MiniLM's attention on a sentence",
}


def _fmt_n(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display), imported when a piece draws."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _log2_axis(ax, xs) -> None:
    """Log-2 x axis with one readable tick per measured length (no overlapping minor labels)."""
    from matplotlib.ticker import FixedLocator, NullLocator

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(list(xs)))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([_fmt_n(int(x)) for x in xs])


def _plain_log_y(ax) -> None:
    """Log y axis labelled with plain numbers (20, 50, 100) rather than 2×10¹."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


# -- the pieces ---------------------------------------------------------------------------------------
def _explain(cfg: TourConfig, out: Path, piece: Piece, tick) -> None:
    import torch

    lines, rows = [], []
    for label, B, H, L, S, E, kw in EXPLAIN_SHAPES:
        kw = dict(kw)
        if kw.get("pattern") == "sliding_window":
            kw["pattern"] = P.sliding_window(128)
        try:
            q, k, v = (torch.empty(B, H, n, E, device="meta") for n in (L, S, S))
            plan = attnlab.explain(q, k, v, device="cpu", **kw)  # the plan of a CPU call of these shapes
        except Exception:  # the meta device may not be accepted: small real tensors cost nothing for explain
            q, k, v = (torch.zeros(B, H, n, E) for n in (L, S, S))
            plan = attnlab.explain(q, k, v, **kw)
        lines += [f"## {label}: query [{B}, {H}, {L}, {E}], key/value [{B}, {H}, {S}, {E}]", str(plan), ""]
        rows.append((label, plan.method, plan.reason))
    atomic_write_text(out / "explain.txt", "\n".join(lines))
    piece.detail = "; ".join(f"{label} → {m}" for label, m, _ in rows)
    piece.table = "| shapes | method | why |\n|---|---|---|\n" + "".join(
        f"| {label} | `{m}` | {_md_cell(why)} |\n" for label, m, why in rows)
    piece.links.append({"href": "explain.txt", "label": "the full plans"})


def _trace(cfg: TourConfig, out: Path, piece: Piece, tick) -> None:
    t = tr.run_trace(tr.TraceConfig(source="example")).trace
    atomic_write_text(out / "trace.html", tr.to_html(t))
    w = t.step("weights").value
    piece.detail = (f"'I love machine learning' (d_model=8, d_k=4): row 0 of softmax(QKᵀ/√d_k) is "
                    f"[{', '.join(f'{x:.3f}' for x in w[0])}], and every row sums to 1")
    piece.links.append({"href": "trace.html", "label": "every step, with shapes and FLOPs"})


def _variance(cfg: TourConfig, out: Path, piece: Piece, tick) -> None:
    plt = _pyplot()
    dks = sorted(int(d) for d in cfg.variance_dks)
    recs = []
    for i, d in enumerate(dks):
        tick(f"Var(q·k) at d_k={d} ({i + 1}/{len(dks)})")
        recs += random_records([d], rows=256, keys=128, seed=0)
    by = {s: [r for r in recs if r["scaling"] == s] for s in ("none", "sqrt", "dk")}
    slope = {s: float(np.polyfit(np.log([r["d_k"] for r in rs]), np.log([r["score_var"] for r in rs]), 1)[0])
             for s, rs in by.items()}
    label = {"none": "no scaling (q·k)", "sqrt": "÷ √d_k (standard)", "dk": "÷ d_k"}
    colour = {"none": "#D55E00", "sqrt": "#0072B2", "dk": "#009E73"}
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), layout="constrained")
    for s, rs in by.items():
        x = [r["d_k"] for r in rs]
        axes[0].plot(x, [r["score_var"] for r in rs], "o-", color=colour[s], label=label[s])
        axes[0].plot(x, [r["theory_var"] for r in rs], ":", color=colour[s], lw=1)
        axes[1].plot(x, [r["max_weight"] for r in rs], "o-", color=colour[s], label=label[s])
    axes[0].set_yscale("log")
    axes[0].set_title("variance of the scaled scores (dotted: theory d_k·scale²)", fontsize=10)
    axes[1].set_title("mean largest softmax weight (128 keys)", fontsize=10)
    axes[1].axhline(1 / 128, color="grey", lw=0.8, ls="--", label="uniform (1/128)")  # in the legend: the ÷d_k
    # line runs along it, so a label on the plot would sit on the lines
    for ax in axes:
        _log2_axis(ax, dks)
        ax.set_xlabel("d_k")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.suptitle("random q, k with unit-variance entries, measured on this machine", fontsize=10)
    save_figure(fig, out / "variance" / "variance.png")
    plt.close(fig)
    big = dks[-1]
    mw = {s: next(r["max_weight"] for r in rs if r["d_k"] == big) for s, rs in by.items()}
    piece.detail = (f"Var(q·k) grows as d_k^{slope['none']:.2f} unscaled and as d_k^{slope['sqrt']:.2f} after ÷√d_k; "
                    f"at d_k={big} the largest weight averages {mw['none']:.2f} unscaled, {mw['sqrt']:.2f} with ÷√d_k "
                    f"and {mw['dk']:.3f} with ÷d_k (uniform would be {1 / 128:.3f})")
    rows = "".join(f"| {r['d_k']} | {label[r['scaling']]} | {r['score_var']:.3g} | {r['theory_var']:.3g} | "
                   f"{r['max_weight']:.3f} | {r['entropy']:.2f} |\n" for r in recs)
    report = (f"# Var(q·k) against d_k\n\nMeasured on this machine: 256 random queries × 128 keys per d_k, entries "
              f"N(0, 1). Fitted slope of log Var against log d_k: unscaled {slope['none']:.3f}, ÷√d_k "
              f"{slope['sqrt']:.3f}, ÷d_k {slope['dk']:.3f} (theory 1, 0, -1).\n\n![variance](variance.png)\n\n"
              "| d_k | scaling | Var(scores) | theory | mean max weight | mean entropy (nats) |\n"
              "|---:|---|---:|---:|---:|---:|\n" + rows)
    atomic_write_text(out / "variance" / "report.md", report)
    atomic_write_text(out / "variance" / "report.html", markdown_to_html(report, "Var(q·k) against d_k"))
    piece.figures.append({"href": "variance/variance.png", "caption": "Var(q·k) and the largest weight against d_k"})
    piece.links.append({"href": "variance/report.html", "label": "the variance report"})


def _speed(cfg: TourConfig, out: Path, piece: Piece, tick) -> None:
    import torch

    plt = _pyplot()
    ns = sorted(int(n) for n in cfg.speed_ns)
    pat = {"name": "sliding_window", "window": cfg.window, "causal": True}
    rows = []
    for i, n in enumerate(ns):
        tick(f"n={n} ({i + 1}/{len(ns)}): sliding window vs SDPA")
        spec = dict(n=n, dtype="float32", causal=True, pattern=pat, H=cfg.heads, D=cfg.head_dim)
        q, k, v = make_inputs(spec)
        calls = {impl: build_call(dict(spec, impl=impl)) for impl in ("sdpa", "auto")}
        # the harness's one timer (Note [Median, interleaved]): a warm-up call each (the sparse planner
        # builds its layouts on the first), then rounds in rotating order, the median of each side
        with torch.no_grad():
            t = interleaved({impl: (lambda f=f: f(q, k, v)) for impl, f in calls.items()}, rounds=cfg.repeats,
                            min_rounds=cfg.repeats, budget_s=60.0)
        med = {impl: timing.median for impl, timing in t.items()}
        rows.append({"n": n, "sdpa_s": med["sdpa"], "window_s": med["auto"], "speedup": med["sdpa"] / med["auto"],
                     "sdpa_runs_s": t["sdpa"].times, "window_runs_s": t["auto"].times})
    fig, ax = plt.subplots(figsize=(6.4, 4), layout="constrained")
    ax.plot(ns, [r["sdpa_s"] * 1e3 for r in rows], "o-", color="#D55E00", label="torch SDPA, full causal")
    ax.plot(ns, [r["window_s"] * 1e3 for r in rows], "s-", color="#0072B2",
            label=f"attnlab sliding window ({cfg.window}), causal")
    _plain_log_y(ax)
    _log2_axis(ax, ns)
    ax.set_xlabel("sequence length n")
    ax.set_ylabel(f"ms per call (median of {cfg.repeats} interleaved rounds)")
    ax.grid(alpha=0.3, which="both")
    for r in rows:
        ax.annotate(f"{r['speedup']:.1f}×", (r["n"], r["window_s"] * 1e3), textcoords="offset points",
                    xytext=(0, -14), ha="center", fontsize=8, color="#0072B2")
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(f"forward time, {cfg.heads} heads × d={cfg.head_dim}, float32, this machine", fontsize=10)
    save_figure(fig, out / "speed.png")
    plt.close(fig)
    last = rows[-1]
    piece.detail = (f"at n={last['n']}: sliding window {last['window_s'] * 1e3:.1f} ms vs SDPA {last['sdpa_s'] * 1e3:.1f} ms "
                    f"(SDPA's time / the window's = {last['speedup']:.2f}); the window's work grows as n, SDPA's as n²")
    piece.table = "| n | SDPA (ms) | sliding window (ms) | SDPA time / window time |\n|---:|---:|---:|---:|\n" + "".join(
        f"| {r['n']} | {r['sdpa_s'] * 1e3:.2f} | {r['window_s'] * 1e3:.2f} | {r['speedup']:.2f} |\n" for r in rows)
    piece.figures.append({"href": "speed.png", "caption": "time per call against n"})
    atomic_write_json(out / "speed.json", rows)


def _memory(cfg: TourConfig, out: Path, piece: Piece, tick) -> None:
    plt = _pyplot()
    ns = sorted(int(n) for n in cfg.memory_ns)
    rows = []
    jobs = [(n, impl) for n in ns for impl in ("tiled", "naive")]
    for i, (n, impl) in enumerate(jobs):
        tick(f"{impl} at n={n} in a fresh process ({i + 1}/{len(jobs)})")
        spec = dict(impl=impl, n=n, dtype="float32", causal=False, backward=False, H=cfg.heads, D=cfg.head_dim,
                    pattern=None)
        rows.append({"n": n, "impl": impl, "peak_bytes": peak_bytes(spec)})
    fig, ax = plt.subplots(figsize=(6.4, 4), layout="constrained")
    for impl, colour, mark in (("naive", "#D55E00", "o-"), ("tiled", "#0072B2", "s-")):
        ys = [r["peak_bytes"] / 2**20 for r in rows if r["impl"] == impl]
        ax.plot(ns, ys, mark, color=colour, label={"naive": "naive: softmax(QKᵀ)V, the [n, n] matrix in memory",
                                                   "tiled": "attnlab tiled: online softmax, O(n) memory"}[impl])
    n2 = [(n / ns[-1]) ** 2 * next(r["peak_bytes"] for r in rows if r["impl"] == "naive" and r["n"] == ns[-1]) / 2**20
          for n in ns]
    ax.plot(ns, n2, ":", color="grey", lw=1, label="∝ n² (through the naive point at the largest n)")
    _plain_log_y(ax)
    _log2_axis(ax, ns)
    ax.set_xlabel("sequence length n")
    ax.set_ylabel("extra peak memory (MiB)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(f"forward pass, {cfg.heads} heads × d={cfg.head_dim}, float32, fresh process each", fontsize=10)
    save_figure(fig, out / "memory.png")
    plt.close(fig)
    big = {r["impl"]: r["peak_bytes"] for r in rows if r["n"] == ns[-1]}
    ratio = big["naive"] / max(big["tiled"], 1)
    piece.detail = (f"at n={ns[-1]}: tiled {big['tiled'] / 2**20:.1f} MiB vs naive {big['naive'] / 2**20:.1f} MiB "
                    f"({ratio:.0f}× less)")
    piece.table = "| n | tiled (MiB) | naive (MiB) | naive / tiled |\n|---:|---:|---:|---:|\n" + "".join(
        f"| {n} | {t / 2**20:.1f} | {nv / 2**20:.1f} | {nv / max(t, 1):.1f} |\n"
        for n, t, nv in ((n, next(r["peak_bytes"] for r in rows if r["n"] == n and r["impl"] == "tiled"),
                          next(r["peak_bytes"] for r in rows if r["n"] == n and r["impl"] == "naive")) for n in ns))
    piece.figures.append({"href": "memory.png", "caption": "peak memory against n"})
    atomic_write_json(out / "memory.json", rows)


def _minilm(cfg: TourConfig):
    if cfg.model is None:
        cfg.model = load_minilm()
    return cfg.model


def _heads(cfg: TourConfig, out: Path, piece: Piece, tick) -> None:
    tick("loading MiniLM")
    model = _minilm(cfg)
    tick(f"running MiniLM on {len(DEFAULT_SENTENCES)} sentences")
    res = run_heads(HeadsConfig(out=out / "heads", model=model))
    counts = sorted(res.counts.items(), key=lambda kv: -kv[1])
    piece.detail = (f"{res.num_layers * res.num_heads} heads over {res.n_sentences} sentences: "
                    + ", ".join(f"{k} × {v}" for k, v in counts))
    piece.figures.append({"href": "heads/heads.png", "caption": "MiniLM's heads, layers × heads, labelled"})


def _viz(cfg: TourConfig, out: Path, piece: Piece, tick) -> None:
    from attnlab import viz  # defers the viz package (matplotlib) to the viz piece

    tick("loading MiniLM")
    model = _minilm(cfg)
    tick("MiniLM's attention on the sentence")
    res = viz.run_viz(viz.VizConfig(cfg.sentence, out=out / "viz", model="minilm", loaded=model))
    piece.detail = (f"MiniLM's {model.num_layers} layers × {model.num_heads} heads on {cfg.sentence!r} "
                    f"({res.T} word pieces): head, matrix, model and pattern views, offline")
    piece.links.append({"href": "viz/index.html", "label": "open the interactive view"})


_RUN = {"explain": _explain, "trace": _trace, "variance": _variance, "speed": _speed, "memory": _memory,
        "heads": _heads, "viz": _viz}


def _md_cell(s: str) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def run_tour(config: TourConfig | None = None, progress: Progress | None = None) -> TourResult:
    """Run every piece not in ``config.skip``; write index.md/index.html and tour.json into ``config.out``."""
    cfg = config or TourConfig()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    total = len(PIECES)
    pieces = []
    for i, name in enumerate(PIECES):
        piece = Piece(name, TITLES[name])
        t1 = time.perf_counter()

        def tick(msg: str, _i=i, _name=name, _t1=t1) -> None:
            if progress is not None:
                progress(_i, total, f"{_name}: {msg} ({time.perf_counter() - _t1:.0f} s)")

        if name in cfg.skip:
            piece.status, piece.detail = "skipped", "skipped"
        else:
            tick("starting")
            try:
                _RUN[name](cfg, out, piece, tick)
            except Exception as e:  # one broken piece must not stop the tour
                piece.status, piece.detail = "failed", f"{type(e).__name__}: {e}"
                piece.links, piece.figures = [], []
        piece.links = [link for link in piece.links if (out / link["href"]).exists()]
        piece.figures = [f for f in piece.figures if (out / f["href"]).exists()]
        piece.seconds = time.perf_counter() - t1
        pieces.append(piece)
        if progress is not None:
            progress(i + 1, total, f"{name}: {piece.status} ({piece.seconds:.0f} s)")
    env = environment()
    md = index_markdown(pieces, env)
    atomic_write_text(out / "index.md", md)
    atomic_write_text(out / "index.html", markdown_to_html(md, "attnlab tour"))
    result = TourResult(pieces, str(out / "index.html"), env, time.perf_counter() - t0,
                        1 if any(p.status == "failed" for p in pieces) else 0)
    atomic_write_json(out / "tour.json", result.to_dict())
    return result


def index_markdown(pieces: list[Piece], env: dict) -> str:
    """The tour's page as Markdown (rendered to HTML by ``attnlab.report.markdown_to_html``, which escapes
    any raw HTML in it)."""
    lines = ["# attnlab tour", "",
             f"Measured on this machine: {env.get('cpu')}, torch {env.get('torch')}, {env.get('threads')} threads.", ""]
    for p in pieces:
        lines += [f"## {p.title} — {p.status}", "", _md_text(p.detail), ""]
        if p.table:
            lines += [p.table, ""]
        for f in p.figures:
            lines += [f"![{_md_text(f['caption'])}]({_md_url(f['href'])})", ""]
        if p.links:
            lines += [f"- [{_md_text(link['label'])}]({_md_url(link['href'])})" for link in p.links] + [""]
    return "\n".join(lines)


def _md_text(s: str) -> str:
    """Text shown literally in Markdown: its markup characters escaped."""
    return "".join("\\" + c if c in "\\`*_[]<>#|!" else c for c in str(s))


def _md_url(href: str) -> str:
    return "<" + str(href).replace(">", "%3E").replace("<", "%3C").replace(" ", "%20") + ">"
