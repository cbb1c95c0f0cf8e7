"""The picture of ``attnlab.retrieval``'s answer to one query: how the soft lookup's weight spreads over the
corpus as the temperature τ moves from database (τ → 0) to average of everything (τ → ∞)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from ..report import save_figure  # noqa: E402

if TYPE_CHECKING:
    from ..retrieval import RetrievalResult

__all__ = ["plot_retrieval"]


def plot_retrieval(r: RetrievalResult, path: str | Path) -> Path:
    """Write retrieve.png: the weight per entry at three τ, the effective number of entries against τ, and
    (with a learned projection) the weights on the query's best entries before and after learning."""
    n = len(r.corpus)
    panels = 3 if r.projection is not None else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.2))
    # 1) weights per entry, entries sorted by raw score, at three temperatures
    raw_w = r.soft["all_weights"]
    sweep = r.sweep
    order = sorted(range(n), key=lambda i: -raw_w[i])[:30]
    ax = axes[0]
    for tau in (sweep[0]["tau"], r.tau, sweep[-1]["tau"]):
        w = _weights_at(r, tau)
        eff = math.exp(-sum(x * math.log(x) for x in w if x > 0))
        ax.plot(range(len(order)), [max(w[i], 1e-7) for i in order], marker=".",
                label=f"τ={tau:.3g}: exp(H)={eff:.1f}")
    ax.set_xlabel("entry, ranked by q·k (top 30)")
    ax.set_ylabel("attention weight (clipped at 1e-7)")
    ax.set_yscale("log")
    ax.set_ylim(5e-8, 2)
    ax.set_title("weight per entry")
    ax.legend(fontsize=7)
    # 2) effective number of entries vs τ
    ax = axes[1]
    taus = [row["tau"] for row in sweep]
    ax.semilogx(taus, [row["effective_entries"] for row in sweep], marker="o", label="exp(H)")
    ax.semilogx(taus, [row["participation"] for row in sweep], marker=".", label="1/Σw²")
    ax.axhline(1, color="grey", ls=":", lw=1)
    ax.axhline(n, color="grey", ls=":", lw=1)
    ax.axvline(r.tau, color="red", ls="--", lw=1, label=f"τ = {r.tau:g}")
    ax.set_yscale("log")
    ax.set_xlabel("τ")
    ax.set_ylabel("effective number of entries")
    ax.set_title("database (1) ↔ average of everything (n)")
    ax.legend(fontsize=7)
    # 3) raw vs learned matching: weights on the query's best entries under either
    if r.projection is not None:
        ax = axes[2]
        lw = r.projection["query_weights_learned"]
        idx = sorted(set(sorted(range(n), key=lambda i: -raw_w[i])[:6]) | set(sorted(range(n), key=lambda i: -lw[i])[:6]),
                     key=lambda i: -(raw_w[i] + lw[i]))
        ys = range(len(idx))
        ax.barh([y + 0.2 for y in ys], [raw_w[i] for i in idx], height=0.4, label="raw q·k")
        ax.barh([y - 0.2 for y in ys], [lw[i] for i in idx], height=0.4, label="learned W_Q, W_K")
        ax.set_yticks(list(ys))
        ax.set_yticklabels([_short(r.corpus[i]["text"]) for i in idx], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel(f"attention weight (τ = {r.tau:g})")
        ax.set_title("what matches, before and after learning")
        ax.legend(fontsize=7)
    fig.suptitle(f"attnlab retrieve: {r.query!r} ({r.embedder})")
    fig.tight_layout()
    return save_figure(fig, path)


def _weights_at(r: RetrievalResult, tau: float) -> list[float]:
    return torch.softmax(torch.tensor(r.soft["all_scores"], dtype=torch.float64) / tau, 0).tolist()


def _short(text: str, width: int = 38) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"
