"""attnlab trace: every step of attention on real numbers (example, MiniLM, given matrices, or sizes)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .common import UsageError, add_force, show_or_write
from .options import MINILM_HEADS, MINILM_LAYERS, int_in, nonneg_int, output_file, positive_int, seed

if TYPE_CHECKING:
    from ..trace import TraceConfig

__all__ = ["build_parser", "run", "load_matrix", "config_from_args"]


def build_parser(p: argparse.ArgumentParser) -> None:
    """trace's options: where the numbers come from, sizes, failure-mode switches, format, --expect."""
    src = p.add_argument_group("where the numbers come from (pick one; default --example)")
    src.add_argument("--example", action="store_true",
                     help='the 4-token worked example "I love machine learning" (d_model=8, d_k=d_v=4, seeded)')
    src.add_argument("--text", help="a sentence run through MiniLM; trace --layer/--head")
    src.add_argument("--scores", help="a score matrix QKᵀ as JSON ('[[1.2,0.8],[0.6,1.5]]') or a .json/.npy file")
    src.add_argument("--q", help="query matrix [L, d_k] (JSON or .json/.npy file); needs --k")
    src.add_argument("--k", help="key matrix [S, d_k]")
    src.add_argument("--v", help="value matrix [S, d_v] (optional: adds the ·V step)")
    src.add_argument("--summary", action="store_true", help="shapes, FLOPs, bytes and statistics at a real size")
    p.add_argument("--d-k", type=int, dest="d_k", help="head dim used by the scale (default: the columns of Q)")
    p.add_argument("--layer", type=int_in(0, MINILM_LAYERS - 1, f"MiniLM has {MINILM_LAYERS} layers"), default=0,
                   help=f"MiniLM layer for --text, 0..{MINILM_LAYERS - 1}")
    p.add_argument("--head", type=int_in(0, MINILM_HEADS - 1, f"MiniLM has {MINILM_HEADS} heads per layer"),
                   default=0, help=f"MiniLM head for --text, 0..{MINILM_HEADS - 1}")
    p.add_argument("--heads", type=positive_int, default=None, help="heads (example: default 1; summary: default 12)")
    p.add_argument("--d-model", type=positive_int, default=768, dest="d_model", help="--summary: model width")
    p.add_argument("--seq-len", type=positive_int, default=512, dest="seq_len", help="--summary: sequence length")
    p.add_argument("--batch", type=positive_int, default=1, help="--summary: batch size")
    p.add_argument("--dtype", default="float32", help="--summary: dtype whose bytes are counted")
    p.add_argument("--seed", type=seed, default=0, help="seed of the example's / summary's random numbers")
    fm = p.add_argument_group("failure modes from the tutorial")
    fm.add_argument("--scale", choices=("none", "sqrt", "dk"), default="sqrt",
                    help="divide scores by 1, √d_k (standard) or d_k")
    fm.add_argument("--no-softmax", action="store_true", help="use the scaled scores as weights")
    fm.add_argument("--cosine", action="store_true", help="cosine similarity instead of the dot product")
    p.add_argument("--causal", action="store_true", help="causal mask (key j visible to query i when j <= i)")
    p.add_argument("--format", choices=("rich", "markdown", "html", "json"), default="rich",
                   help="how the trace is rendered")
    p.add_argument("--out", help="write the rendered trace to this file instead of the terminal")
    p.add_argument("--png", help="also write a PNG: the weights per head, or (with --summary) score scale vs d_k")
    add_force(p, "file")
    p.add_argument("--max-show", type=int, default=8, dest="max_show", help="rows/columns printed per matrix")
    p.add_argument("--digits", type=nonneg_int, default=3, help="decimals printed")
    ck = p.add_argument_group("check a printed table (a textbook's, say)")
    ck.add_argument("--expect", metavar="TABLE",
                    help="a printed table to check, as JSON ('[[0.296, 0.242], ...]', '#' comments allowed) or a file "
                         "holding it: every cell further than half a unit of its last printed digit from the exact "
                         "value is marked with the correct value. Exit status 1 when any cell is wrong, 0 when all "
                         "are right (like diff)")
    ck.add_argument("--expect-step", default="weights", dest="expect_step",
                    choices=("scores", "scaled", "masked", "weights", "output"),
                    help="which step the printed table shows (default: weights, the softmax table)")


def load_matrix(name: str, spec: str) -> np.ndarray:
    """A 2-D matrix from inline JSON or a .json/.npy file; ValueError with the argument's name otherwise."""
    from ..trace import as_matrix  # lazy subcommand: loaded when the command runs, not by `attnlab --help`

    s = spec.strip()
    path = Path(s)
    if s.endswith(".npy"):
        if not path.is_file():
            raise ValueError(f"{name}: file not found: {s}")
        try:
            data = np.load(path, allow_pickle=False)
        except Exception as e:  # corrupt or pickled file
            raise ValueError(f"{name}: cannot read {s} as a .npy array: {e}") from None
    elif s.endswith(".json") and not s.startswith("["):
        if not path.is_file():
            raise ValueError(f"{name}: file not found: {s}")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{name}: {s} is not valid JSON: {e}") from None
        except RecursionError:
            raise ValueError(f"{name}: {s} is nested too deeply to be a matrix") from None
    else:
        try:
            data = json.loads(s)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} must be a JSON matrix like [[1, 2], [3, 4]] or a .json/.npy file: {e}") from None
        except RecursionError:
            raise ValueError(f"{name} is nested too deeply to be a matrix (a matrix is [[...], [...]])") from None
    if isinstance(data, dict):
        raise ValueError(f"{name} must be a matrix (list of rows), got a JSON object")
    if isinstance(data, list) and data and all(isinstance(r, list) for r in data):
        lens = {len(r) for r in data}
        if len(lens) > 1:
            raise ValueError(f"{name} is not rectangular: its rows have lengths {sorted(lens)}")
    return as_matrix(name, data)


def config_from_args(args: argparse.Namespace) -> TraceConfig:
    """The ``TraceConfig`` the options describe; UsageError for options that do not go together."""
    # lazy subcommand: loaded when the command runs, not by `attnlab --help`
    from ..trace import TraceConfig, TraceOptions

    sources = [n for n, on in (("--example", args.example), ("--text", args.text is not None),
                               ("--scores", args.scores is not None),
                               ("--q/--k", args.q is not None or args.k is not None),
                               ("--summary", args.summary)) if on]
    if len(sources) > 1:
        raise UsageError(f"choose one starting point, got {', '.join(sources)}")
    if args.v is not None and not ({"--scores", "--q/--k"} & set(sources)):
        raise UsageError("--v goes with --scores or --q/--k")
    for opt, path in (("--out", args.out), ("--png", args.png)):
        if path:
            output_file(path, opt, force=bool(args.force))  # Note [One rule for --out]
    if args.max_show < 2:
        raise UsageError(f"--max-show must be >= 2, got {args.max_show}")
    if args.d_k is not None and args.d_k < 1:
        raise UsageError(f"--d-k must be a positive int, got {args.d_k}")
    source = {"--q/--k": "qkv"}.get(sources[0], sources[0].lstrip("-")) if sources else "example"
    if source == "summary" and args.d_model % (args.heads or 12):
        raise UsageError(f"--d-model {args.d_model} is not divisible by --heads {args.heads or 12} "
                         f"(each head gets d_k = --d-model / --heads columns)")
    if source == "example" and args.heads not in (None, 1, 2):
        raise UsageError(f"--heads for --example must be 1 or 2 (d_model=8 = heads × d_k=4), got {args.heads}")
    if source == "qkv" and (args.q is None or args.k is None):
        raise UsageError("--q and --k go together (and --v optionally)")
    if source == "summary" and args.expect is not None:
        raise UsageError("--expect checks a small printed table; --summary has none (use --scores or --q/--k)")
    opts = TraceOptions(scale=args.scale, softmax=not args.no_softmax, cosine=args.cosine, causal=args.causal)
    return TraceConfig(
        source=source, text=args.text, d_k=args.d_k, layer=args.layer, head=args.head, heads=args.heads,
        d_model=args.d_model, seq_len=args.seq_len, batch=args.batch, dtype=args.dtype, seed=args.seed, options=opts,
        scores=load_matrix("--scores", args.scores) if source == "scores" else None,
        q=load_matrix("--q", args.q) if source == "qkv" else None,
        k=load_matrix("--k", args.k) if source == "qkv" else None,
        v=load_matrix("--v", args.v) if args.v is not None else None,
        expect=None if args.expect is None else _expect_text(args.expect), expect_step=args.expect_step)


def run(args: argparse.Namespace) -> dict:
    """Trace as the options say, render it (terminal, or --out) and write --png; the trace and what was shown.

    Exit status 1 when --expect found a wrong cell (like diff), else 0."""
    from .. import trace as tr  # lazy subcommand: loaded when the command runs, not by `attnlab --help`

    res = tr.run_trace(config_from_args(args))
    trace, check, fmt = res.trace, res.check, args.format
    if check is not None:
        content = {"json": lambda: json.dumps(check.to_dict(), indent=2) + "\n",
                   "markdown": lambda: tr.check_markdown(check), "html": lambda: tr.check_html(check),
                   "rich": lambda: tr.check_rich(check)}[fmt]()
        text = show_or_write(content, args.out, wrote=f": {check.summary()}")
        return {"trace": trace, "check": check, "format": fmt, "text": text, "out": args.out,
                "exit_code": 0 if check.ok else 1}
    png = str(tr.plot_trace(trace, args.png)) if args.png else None
    kw = {"max_show": args.max_show, "digits": args.digits}
    content = {"json": lambda: tr.to_json(trace), "markdown": lambda: tr.to_markdown(trace, **kw),
               "html": lambda: tr.to_html(trace, **kw), "rich": lambda: tr.to_rich(trace, **kw)}[fmt]()
    text = show_or_write(content, args.out)
    if png:
        print(f"wrote {png}")
    return {"trace": trace, "format": fmt, "text": text, "out": args.out, "png": png, "exit_code": 0}


def _expect_text(spec: str) -> str:
    """--expect's table: the file's text when SPEC names a file, else SPEC itself."""
    s = spec.strip()
    if not s.startswith("[") and Path(s).is_file():
        return Path(s).read_text()
    if not s.startswith("[") and (s.endswith(".json") or s.endswith(".txt") or "/" in s):
        raise ValueError(f"--expect: file not found: {s}")
    return s
