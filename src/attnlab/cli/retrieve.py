"""attnlab retrieve: a query answered by hard lookup, top-k and soft attention over an embedded corpus."""
from __future__ import annotations

import argparse
import json
import math

from .. import retrieval as R
from ..retrieval import DEFAULT_QUERY
from .common import UsageError, add_force, console, progress_display
from .options import int_in, nonneg_int, output_dir, positive_float, positive_int, seed

__all__ = ["build_parser", "run", "render"]


def build_parser(p: argparse.ArgumentParser) -> None:
    """retrieve's options: the query, the embedder, the lookup (τ, k), the corpus, the learned projection."""
    p.add_argument("query", nargs="?", default=DEFAULT_QUERY, help=f"the question (default: {DEFAULT_QUERY!r})")
    p.add_argument("--embedder", default="minilm", choices=sorted(R.EMBEDDERS),
                   help="minilm: all-MiniLM-L6-v2 via attnlab.models.minilm; hashing: bag of words, no weights")
    p.add_argument("--tau", type=positive_float, default=0.05, help="softmax temperature τ of the soft lookup")
    p.add_argument("-k", "--k", type=positive_int, default=5,
                   help="entries in the top-k lookup, 1..6 × --subjects (the corpus size)")
    p.add_argument("--subjects", type=int_in(1, len(R.NAMES), f"the corpus generator knows {len(R.NAMES)} names"),
                   default=len(R.NAMES),
                   help=f"people in the generated corpus, 1..{len(R.NAMES)} (its list of names); 6 sentences each")
    p.add_argument("--seed", type=seed, default=0, help="corpus and train/held-out split seed")
    p.add_argument("--no-learn", action="store_true", help="skip fitting the W_Q, W_K projection")
    p.add_argument("--target", default=R.DEFAULT_TARGET, choices=list(R.RELATIONS),
                   help="which sentence answers 'Tell me about X.' in the labelled pairs")
    p.add_argument("--train", type=positive_int, default=8,
                   help="labelled query–answer pairs to fit the projection on, 1..--subjects - 1 (the rest are held out)")
    p.add_argument("--rank", type=positive_int, default=1, help="rank of the learned update W = I + A·B")
    p.add_argument("--steps", type=nonneg_int, default=60, help="gradient steps (Adam)")
    p.add_argument("--lr", type=positive_float, default=0.01, help="learning rate")
    p.add_argument("--show", type=positive_int, default=10, help="entries shown in the weight table")
    p.add_argument("--out", default="reports/retrieve", help="folder for retrieve.json and retrieve.png")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of tables")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress on stderr (a bar on a terminal, a line per stage when piped)")
    add_force(p)


def run(args: argparse.Namespace) -> R.RetrievalResult:
    """Answer the query through ``attnlab.retrieval.run_retrieve`` with a status line; tables or JSON."""
    con = console(stderr=args.json)
    size = len(R.RELATIONS) * args.subjects
    if args.k > size:
        raise UsageError(f"-k {args.k} is more than the corpus holds: {size} sentences "
                         f"({len(R.RELATIONS)} per person × --subjects {args.subjects})")
    if not args.no_learn and not args.train < args.subjects:
        raise UsageError(f"--train {args.train} must be less than --subjects {args.subjects}: the projection is "
                         f"fitted on --train people and checked on the others (or pass --no-learn)")
    out = output_dir(args.out, resume=False, force=args.force, resumable=False)  # Note [One rule for --out]
    cfg = R.RetrieveConfig(args.query, embedder=args.embedder, num_subjects=args.subjects, seed=args.seed,
                           tau=args.tau, k=args.k, learn=not args.no_learn, target=args.target,
                           train_subjects=args.train, rank=args.rank, steps=args.steps, lr=args.lr, show=args.show,
                           out=out)
    try:
        with progress_display(enabled=not args.no_progress, title="retrieve") as show:
            note = (lambda msg: show(0, None, msg)) if show else None
            result = R.run_retrieve(cfg, progress=note)
    except ImportError as e:  # MiniLM's weights package is optional
        raise UsageError(f"{e} (or run with --embedder hashing, which needs no weights)") from e
    if args.json:
        print(json.dumps(result.to_dict(), default=str))
    else:
        render(result, con)
    return result


# -- rendering ------------------------------------------------------------------------------------------
def render(r: R.RetrievalResult, con) -> None:
    """The answers as rich tables on ``con``: three answers, the weights, the τ sweep, the projection."""
    from rich.markup import escape
    from rich.table import Table

    con.print(f"[bold]query:[/bold] {escape(r.query)}   [dim]embedder {r.embedder}, {len(r.corpus)} sentences, "
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
    con.print(t)

    w = Table(title=f"soft attention: the weight each entry gets (τ = {r.tau:g})")
    for col in ("#", "entry", "q·k", "weight"):
        w.add_column(col, justify="left" if col == "entry" else "right")
    for e in r.soft["weights"]:
        w.add_row(str(e["index"]), e["text"], f"{e['score']:.3f}", f"{e['weight']:.4f}")
    w.add_row("", f"[dim]the other {len(r.corpus) - len(r.soft['weights'])} entries[/dim]", "",
              f"{r.soft['rest_weight']:.4f}")
    con.print(w)

    s = Table(title="temperature: from database (τ → 0) to average of everything (τ → ∞)")
    for col in ("τ", "max weight", "entropy (nats)", "exp(H)", "1/Σw²", "cos(out, hard)", "cos(out, mean)"):
        s.add_column(col, justify="right")
    for row in r.sweep:
        s.add_row(f"{row['tau']:.3g}", f"{row['max_weight']:.3f}", f"{row['entropy']:.3f}",
                  f"{row['effective_entries']:.1f}", f"{row['participation']:.1f}", f"{row['cos_to_hard']:.3f}",
                  f"{row['cos_to_mean']:.3f}")
    s.caption = f"n = {len(r.corpus)}: exp(H) runs from the number of tied top entries to n; ln n = {math.log(len(r.corpus)):.3f}"
    con.print(s)

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
        con.print(a)
        b = Table(title=f"top-{r.k} for the query: raw vs learned matching")
        b.add_column("raw q·k")
        b.add_column("(q W_Q)·(k W_K)")
        for e0, e1 in zip(r.topk, p["query_topk"]):
            b.add_row(f"{e0['score']:.3f}  {e0['text']}", f"{e1['score']:.3f}  {e1['text']}")
        con.print(b)
    con.print(f"[dim]wrote {r.files.get('json')} and {r.files.get('png')}[/dim]")
