"""attnlab retrieve: a query answered by hard lookup, top-k and soft attention over an embedded corpus."""
from __future__ import annotations

import argparse
import json
import math

from .. import retrieval as R
from .options import nonneg_int, output_dir, positive_float, positive_int
from ..report import atomic_write_json, save_figure

DEFAULT_QUERY = "Tell me about Maya."


def build_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("query", nargs="?", default=DEFAULT_QUERY, help=f"the question (default: {DEFAULT_QUERY!r})")
    p.add_argument("--embedder", default="minilm", choices=sorted(R.EMBEDDERS),
                   help="minilm: all-MiniLM-L6-v2 via attnlab.models.minilm; hashing: bag of words, no weights")
    p.add_argument("--tau", type=positive_float, default=0.05, help="softmax temperature τ of the soft lookup")
    p.add_argument("-k", "--k", type=positive_int, default=5, help="entries in the top-k lookup")
    p.add_argument("--subjects", type=positive_int, default=48, help="people in the generated corpus (6 sentences each)")
    p.add_argument("--seed", type=int, default=0, help="corpus and train/held-out split seed")
    p.add_argument("--no-learn", action="store_true", help="skip fitting the W_Q, W_K projection")
    p.add_argument("--target", default=R.DEFAULT_TARGET, choices=list(R.RELATIONS),
                   help="which sentence answers 'Tell me about X.' in the labelled pairs")
    p.add_argument("--train", type=positive_int, default=8, help="labelled query–answer pairs to fit the projection on")
    p.add_argument("--rank", type=positive_int, default=1, help="rank of the learned update W = I + A·B")
    p.add_argument("--steps", type=nonneg_int, default=60, help="gradient steps (Adam)")
    p.add_argument("--lr", type=positive_float, default=0.01, help="learning rate")
    p.add_argument("--show", type=positive_int, default=10, help="entries shown in the weight table")
    p.add_argument("--out", default="reports/retrieve", help="folder for retrieve.json and retrieve.png")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of tables")


def run(args: argparse.Namespace) -> R.RetrievalResult:
    from rich.console import Console

    from .common import UsageError

    console = Console(stderr=args.json)
    out = output_dir(args.out)
    try:
        with console.status("retrieving") as status:
            result = R.retrieve(args.query, embedder=args.embedder, num_subjects=args.subjects, seed=args.seed,
                                tau=args.tau, k=args.k, learn=not args.no_learn, target=args.target,
                                train_subjects=args.train, rank=args.rank, steps=args.steps, lr=args.lr,
                                show=args.show, progress=lambda msg: status.update(msg))
    except ImportError as e:  # MiniLM's weights package is optional
        raise UsageError(f"{e} (or run with --embedder hashing, which needs no weights)") from e
    result.files["png"] = str(save_figure(figure(result), out / "retrieve.png"))
    result.files["json"] = str(out / "retrieve.json")
    atomic_write_json(out / "retrieve.json", result.to_dict())
    if args.json:
        print(json.dumps(result.to_dict(), default=str))
    else:
        render(result, console)
    return result


# -- rendering ------------------------------------------------------------------------------------------
def render(r: R.RetrievalResult, console) -> None:
    from rich.table import Table

    from rich.markup import escape

    console.print(f"[bold]query:[/bold] {escape(r.query)}   [dim]embedder {r.embedder}, {len(r.corpus)} sentences, "
                  f"τ = {r.tau:g}[/dim]")
    t = Table(title="one query, three answers")
    t.add_column("hard top-1 (database)")
    t.add_column(f"top-{r.k} by q·k")
    t.add_column(f"soft: softmax(q·Kᵀ/τ)·V, τ={r.tau:g}")
    top = "\n".join(f"{e['score']:.3f}  {e['text']}" for e in r.topk)
    soft = (f"effective entries exp(H) = {r.soft['effective_entries']:.1f} of {len(r.corpus)}\n"
            f"largest weight {r.soft['max_weight']:.3f}\n"
            f"cos(out, hard value) = {r.soft['cos_to_hard']:.3f}\n"
            f"cos(out, mean value) = {r.soft['cos_to_mean']:.3f}\n"
            f"nearest entry to out: {r.soft['nearest_text']}")
    t.add_row(f"{r.hard['score']:.3f}  {r.hard['text']}", top, soft)
    console.print(t)

    w = Table(title=f"soft attention: the weight each entry gets (τ = {r.tau:g})")
    for col in ("#", "entry", "q·k", "weight"):
        w.add_column(col, justify="left" if col == "entry" else "right")
    for e in r.soft["weights"]:
        w.add_row(str(e["index"]), e["text"], f"{e['score']:.3f}", f"{e['weight']:.4f}")
    w.add_row("", f"[dim]the other {len(r.corpus) - len(r.soft['weights'])} entries[/dim]", "",
              f"{r.soft['rest_weight']:.4f}")
    console.print(w)

    s = Table(title="temperature: from database (τ → 0) to average of everything (τ → ∞)")
    for col in ("τ", "max weight", "entropy (nats)", "exp(H)", "1/Σw²", "cos(out, hard)", "cos(out, mean)"):
        s.add_column(col, justify="right")
    for row in r.sweep:
        s.add_row(f"{row['tau']:.3g}", f"{row['max_weight']:.3f}", f"{row['entropy']:.3f}",
                  f"{row['effective_entries']:.1f}", f"{row['participation']:.1f}", f"{row['cos_to_hard']:.3f}",
                  f"{row['cos_to_mean']:.3f}")
    s.caption = f"n = {len(r.corpus)}: exp(H) runs from the number of tied top entries to n; ln n = {math.log(len(r.corpus)):.3f}"
    console.print(s)

    p = r.projection
    if p is not None:
        a = Table(title=f"learned projection W_Q, W_K (rank {p['rank']}, {p['steps']} steps, "
                        f"{len(p['train_subjects'])} labelled pairs): {p['task']}")
        for col in ("queries", "raw q·k: top-1", "raw: mean rank", "learned: top-1", "learned: mean rank"):
            a.add_column(col, justify="right" if col != "queries" else "left")
        for label, key in ((f"train ({len(p['train_subjects'])})", "train"),
                           (f"held-out subjects ({p['heldout_subjects']})", "heldout"),
                           (f"direct questions, held-out ({p['direct_questions']['raw']['n']})", "direct_questions")):
            raw, lr = p[key]["raw"], p[key]["learned"]
            a.add_row(label, f"{raw['top1']:.2f}", f"{raw['mean_rank']:.1f}", f"{lr['top1']:.2f}",
                      f"{lr['mean_rank']:.1f}")
        a.caption = f"training loss {p['loss_first']:.3f} -> {p['loss_last']:.3f}"
        console.print(a)
        b = Table(title=f"top-{r.k} for the query: raw vs learned matching")
        b.add_column("raw q·k")
        b.add_column("(q W_Q)·(k W_K)")
        for e0, e1 in zip(r.topk, p["query_topk"]):
            b.add_row(f"{e0['score']:.3f}  {e0['text']}", f"{e1['score']:.3f}  {e1['text']}")
        console.print(b)
    console.print(f"[dim]wrote {r.files.get('json')} and {r.files.get('png')}[/dim]")


def figure(r: R.RetrievalResult):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    return fig


def _weights_at(r: R.RetrievalResult, tau: float) -> list[float]:
    import torch

    return torch.softmax(torch.tensor(r.soft["all_scores"], dtype=torch.float64) / tau, 0).tolist()


def _short(text: str, width: int = 38) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"
