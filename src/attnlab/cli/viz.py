"""attnlab viz TEXT [--out DIR]: a self-contained, offline HTML page of a model's attention on TEXT."""
from __future__ import annotations

import argparse
from pathlib import Path

from .options import output_dir, positive_int
from .common import UsageError

__all__ = ["build_parser", "run", "parse_params", "default_out"]


def build_parser(p: argparse.ArgumentParser) -> None:
    """viz's options: the text, --out (default under reports/viz/), model, mechanism and its parameters."""
    p.add_argument("text", help="the text to look at (quote it)")
    p.add_argument("--out", default=None,
                   help="folder to write index.html (and heads.png) into (default: reports/viz/<model>-<words of TEXT>)")
    p.add_argument("--model", choices=("minilm", "random"), default="minilm",
                   help="minilm: all-MiniLM-L6-v2 (WordPiece); random: a seeded toy encoder on words, any length")
    p.add_argument("--mechanism", default=None, help="attention mechanism (see `attnlab list`), e.g. sliding_window")
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                   help="mechanism hyperparameter, e.g. --param window=4 (repeatable)")
    p.add_argument("--dense-max", type=int, default=96, dest="dense_max",
                   help="longer inputs show streaming summaries instead of dense weights (default 96 tokens)")
    p.add_argument("--topk", type=int, default=4, help="keys kept per query in summary mode")
    p.add_argument("--max-length", type=positive_int, default=512, dest="max_length", help="MiniLM token limit (<= 512)")
    p.add_argument("--png", action="store_true", help="also write heads.png (layer 0 heatmaps, dense mode only)")


def default_out(text: str, model: str) -> Path:
    """reports/viz/<model>-<first words of text, as a safe file name>."""
    import re

    slug = "-".join(re.findall(r"[A-Za-z0-9]+", text.lower())[:6])[:48].strip("-") or "text"
    return Path("reports") / "viz" / f"{model}-{slug}"


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
    """Compute the page's data for TEXT, write index.html (and heads.png with --png), print where."""
    from .. import viz

    if not args.text.strip():
        raise UsageError("TEXT is empty: give some words to look at")
    if args.out is None:
        args.out = str(default_out(args.text, args.model))
    output_dir(args.out)
    if args.topk < 1:
        raise UsageError(f"--topk must be >= 1, got {args.topk}")
    params = parse_params(args.param)
    if params and args.mechanism is None:
        raise UsageError("--param needs --mechanism")
    if args.mechanism is not None:
        from .. import mechanisms as M

        if args.mechanism not in M.available():
            raise UsageError(f"unknown mechanism {args.mechanism!r}; available: {', '.join(M.available())}")
    try:
        data = viz.attention_data(args.text, model=args.model, mechanism=args.mechanism, params=params,
                                  dense_max_tokens=args.dense_max, max_length=args.max_length, topk=args.topk)
    except KeyError as e:  # a mechanism's unknown parameter, reported by the registry
        raise UsageError(str(e)) from None
    path = viz.write_page(args.out, data)
    files = [str(path)]
    if args.png and data["mode"] == "dense":
        import base64

        import numpy as np

        T, H = data["T"], data["heads"]
        w = np.frombuffer(base64.b64decode(data["dense"]["b64"][0]), dtype=np.uint8).reshape(H, T, T) / 255.0
        files.append(str(viz.plot_heads(w, Path(args.out) / "heads.png", tokens=data["tokens"],
                                        title="layer 0 attention per head")))
    print(f"wrote {path} ({data['T']} tokens, {data['mode']} mode, {path.stat().st_size / 1024:.0f} KiB); "
          f"open it in a browser (works offline)")
    return {"out": str(path), "files": files, "mode": data["mode"], "T": data["T"], "tokens": data["tokens"],
            "exit_code": 0}
