"""attnlab heads: what MiniLM's heads do, measured over a set of sentences (table + picture)."""
from __future__ import annotations

import argparse
from pathlib import Path

from ..diagnostics.heads import measure_heads
from .options import nonneg_int, output_dir
from .common import UsageError

__all__ = ["build_parser", "run", "measure_heads"]


def build_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sentence", action="append", default=[], help="a sentence to use (repeatable)")
    p.add_argument("--sentences", help="a text file with one sentence per line")
    p.add_argument("--out", default="reports/heads", help="folder for heads.png and heads.json (default reports/heads)")
    p.add_argument("--layer", type=nonneg_int, action="append", default=None,
                   help="only this layer in the table (repeatable; default every layer)")
    p.add_argument("--no-plot", action="store_true", help="skip heads.png")


def run(args: argparse.Namespace):
    from ..diagnostics.heads import DEFAULT_SENTENCES
    from ..report import atomic_write_json

    out = output_dir(args.out)
    sentences = list(args.sentence)
    if args.sentences:
        path = Path(args.sentences)
        if not path.is_file():
            raise UsageError(f"--sentences: file not found: {path}")
        sentences += [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    if not sentences:
        if args.sentence or args.sentences:
            raise UsageError("the sentences given are all empty")
        sentences = list(DEFAULT_SENTENCES)
    from ..trace.minilm import load_minilm

    model = load_minilm()
    nl = model.num_layers
    layers = args.layer if args.layer is not None else list(range(nl))
    for li in layers:
        if not 0 <= li < nl:
            raise UsageError(f"--layer {li} out of range: MiniLM has {nl} layers (0..{nl - 1})")
    res = measure_heads(sentences, model)
    files = [str(atomic_write_json(out / "heads.json", {k: v for k, v in res.items()} | {"sentences": sentences}))]
    if not args.no_plot:
        from ..viz.heatmaps import plot_head_stats

        files.append(str(plot_head_stats(res["stats"], out / "heads.png", num_layers=nl, num_heads=res["num_heads"])))
    _render(res, layers)
    print("wrote " + ", ".join(files))
    return {**res, "files": files, "exit_code": 0}


def _render(res: dict, layers: list[int]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"MiniLM heads over {res['n_sentences']} sentences ({res['n_tokens']} word pieces): "
                    "mean attention of a token to …")
    for c in ("layer", "head", "prev", "same", "next", "[CLS]", "[SEP]", "mean dist", "entropy", "label"):
        t.add_column(c, justify="left" if c == "label" else "right")
    for s in res["stats"]:
        if s["layer"] in layers:
            t.add_row(str(s["layer"]), str(s["head"]), *(f"{s[k]:.2f}" for k in ("prev", "same", "next", "cls", "sep",
                                                                                  "mean_distance", "entropy")),
                      s["label"])
    Console().print(t)
    Console().print("labels: " + ", ".join(f"{k} × {v}" for k, v in sorted(res["counts"].items(), key=lambda x: -x[1])))
