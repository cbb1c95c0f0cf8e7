"""attnlab experiment NAME: experiments that write reports/<name>/ (report.md, results.json, PNGs).

The experiments are a library (``attnlab.experiments``: ``run(config) -> result``, ``result.write(out)``);
this module turns argv into their configs, checks the output folder, shows progress and prints the
summary.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .options import output_dir, positive_float, positive_int, positive_int_list, seed, thread_count

from .common import add_force
from .common import console as new_console

__all__ = ["EXPERIMENTS", "build_parser", "run", "seeds_of"]

#: name -> (help, module under attnlab.experiments)
EXPERIMENTS = {
    "variance": ("Var(q·k) vs d_k for scalings 1, 1/sqrt(d_k), 1/d_k", "variance"),
    "scaling": ("training with and without the sqrt(d_k) scale", "scaling"),
    "failure-modes": ("no softmax, cosine similarity, no scaling", "failure_modes"),
    "long-range": ("ListOps, associative recall, selective copy", "long_range"),
    "approximation": ("approximation error vs budget vs speed", "approximation"),
    "kvquant": ("int8 KV formats vs bf16 and q8_0: output error, SmolLM2 perplexity and KL", "kvquant"),
}


# -- parsing -----------------------------------------------------------------------------------------------
def seeds_of(text: str) -> list[int]:
    """"0,1,2" -> [0, 1, 2]; ValueError naming --seeds otherwise."""
    try:
        seeds = [int(s) for s in str(text).split(",") if s.strip() != ""]
    except ValueError:
        raise ValueError(f"--seeds must be comma-separated integers, got {text!r}") from None
    if not seeds:
        raise ValueError(f"--seeds must name at least one seed, got {text!r}")
    return seeds


def _names(text: str) -> list[str]:
    return [t.strip() for t in str(text).split(",") if t.strip()]


def _common(p: argparse.ArgumentParser, *, seeds: str = "0,1,2") -> None:
    p.add_argument("--out", default=None, help="output folder (default reports/<name>)")
    p.add_argument("--quick", action="store_true", help="a toy-size run that finishes in seconds")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoints of a killed run")
    p.add_argument("--force", action="store_true",
                   help="replace the earlier run an --out folder holds (without it, such a folder is refused)")
    p.add_argument("--seeds", default=seeds, help=f"comma-separated seeds (default {seeds})")
    p.add_argument("--steps", type=positive_int, default=None, help="training steps per run (overrides the default)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--threads", type=thread_count, default=1,
                   help="torch threads while this runs (default 1: tiny models train fastest single-threaded, "
                        "and a shared machine stays usable)")


def _variance_args(p) -> None:
    _common(p, seeds="0")
    p.add_argument("--d-k", type=positive_int_list, default=None, help="comma-separated d_k values (default 16..1024)")
    p.add_argument("--keys", type=positive_int, default=None, help="keys per query row (default 128; quick 64)")
    p.add_argument("--rows", type=positive_int, default=None, help="query rows per measurement (default 512; quick 128)")
    p.add_argument("--no-minilm", action="store_true", help="skip MiniLM's real Q/K")


def _training_args(p, d_k_help: str) -> None:
    _common(p)
    p.add_argument("--tasks", default="recall,text", help="comma-separated: recall (associative recall), "
                   "text (byte-level LM on Python's own docstrings)")
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd"), help="the training optimizer")
    p.add_argument("--lr", type=positive_float, default=None, help="learning rate (default 1e-3 for adamw, 0.05 for sgd)")
    p.add_argument("--model", default="tiny", choices=("tiny", "lm"),
                   help="tiny: the experiments' own model (entropy probes, failure-mode switches); lm: "
                        "attnlab.nn.TransformerLM with d_model = 2·d_k (text task, softmax arms only)")
    p.add_argument("--qk-init", default="unit", choices=("unit", "torch"),
                   help="unit: q, k entries start with unit variance (the tutorial's premise); torch: nn.Linear's default")
    p.add_argument("--d-k", type=positive_int_list, default=None, help=d_k_help)


def _long_range_args(p) -> None:
    # lazy subcommand: loaded when the command runs, not by `attnlab --help`
    from attnlab.experiments.long_range import FULL, TASKS

    _common(p, seeds="0")
    p.add_argument("--seq-len", type=positive_int, default=None, help="sequence length (default 1024; quick 128)")
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated subset of {', '.join(TASKS)}")
    p.add_argument("--mechanisms", default=None,
                   help="comma-separated mechanisms (default: vanilla 'sdpa' and every registered pattern and "
                        "approximation); also torch_sdpa, naive, dense, tiled")
    p.add_argument("--batch-size", type=positive_int, default=None, help=f"batch size (default {FULL['batch']}; quick 4)")
    p.add_argument("--lr", type=positive_float, default=None, help=f"AdamW learning rate (default {FULL['lr']:g})")
    p.add_argument("--d-model", type=positive_int, default=None, help=f"model width (default {FULL['d_model']}; heads of 32)")
    p.add_argument("--layers", type=positive_int, default=None, help=f"Transformer layers (default {FULL['layers']})")
    p.add_argument("--recall-queries", type=positive_int, default=None,
                   help=f"queries per associative-recall example, answered in place (default {FULL['queries']}; "
                        "1 = one query read at the last token)")
    p.add_argument("--no-token-shift", action="store_true",
                   help="do not give each position the embedding of its predecessor (token shift, a 2-tap causal convolution)")
    p.add_argument("--report-only", action="store_true",
                   help="train nothing: report the runs whose checkpoints in --out are finished (same settings) "
                        "and list the others as not run")
    p.add_argument("--train-examples", type=positive_int, default=None,
                   help=f"generated training examples per task (default {FULL['train']})")
    p.add_argument("--test-examples", type=positive_int, default=None, help=f"held-out examples per task (default {FULL['test']})")


def _approximation_args(p) -> None:
    p.add_argument("--out", default=None, help="output folder (default reports/approximation)")
    p.add_argument("--quick", action="store_true", help="toy sizes: finishes in seconds")
    p.add_argument("--n", type=positive_int, default=None, help="random-input length (default 2048; quick 128)")
    p.add_argument("--heads", type=positive_int, default=None, help="heads of the random input (default 4; quick 2)")
    p.add_argument("--head-dim", type=positive_int, default=64, help="head dim of the random input")
    p.add_argument("--speed-n", type=positive_int, default=None,
                   help="length of the linear-vs-SDPA headline (default 16384; quick 1024)")
    p.add_argument("--minilm-tokens", type=positive_int, default=None, help="tokens of MiniLM text (default 256; quick 48)")
    p.add_argument("--no-minilm", action="store_true", help="skip MiniLM's real Q/K/V")
    p.add_argument("--seed", type=seed, default=0, help="seed of the random inputs")
    p.add_argument("--threads", type=thread_count, default=1,
                   help="torch threads for every timing (default 1: the same resources for SDPA and each "
                        "mechanism, and a shared machine stays usable)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_force(p)


def _kvquant_args(p) -> None:
    _common(p, seeds="0,1,2")
    p.add_argument("--tokens", type=int, default=None,
                   help="SmolLM2 tokens of the tutorial text (default 4096; quick 512; 0 skips SmolLM2)")
    p.add_argument("--no-kernel", action="store_true", help="simulate only (no attention_with_kvcache run)")


_ARGS = {"variance": _variance_args,
         "scaling": lambda p: _training_args(p, "comma-separated head dims (default 16,64,256; quick 16,64)"),
         "failure-modes": lambda p: _training_args(p, "comma-separated head dims (default 64; quick 16)"),
         "long-range": _long_range_args, "approximation": _approximation_args, "kvquant": _kvquant_args}


def build_parser(parser: argparse.ArgumentParser) -> None:
    """Add one sub-command per experiment (``EXPERIMENTS``) with its options to ``parser``."""
    sub = parser.add_subparsers(dest="name", metavar="NAME", required=True)
    for name, (help_text, _module) in EXPERIMENTS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        _ARGS[name](p)


# -- argv -> config ------------------------------------------------------------------------------------------
def _out(args, name: str, *, resumable: bool = True) -> Path:
    """``--out`` or reports/<name>, checked (``attnlab.resources.output_dir``): not a file; a folder holding an
    earlier run needs --force (or, for a ``resumable`` experiment, --resume), so an old report is never
    overwritten unasked nor mixed with a new run (Note [One rule for --out]). ``args.out`` is set to the folder, and ``args.checkpoint_dir`` for a
    resumable one (Ctrl-C names it, ``cli.main``)."""
    path = Path(args.out) if args.out else Path("reports") / name
    resume = (bool(getattr(args, "resume", False)) or bool(getattr(args, "report_only", False))) if resumable else False
    path = output_dir(path, "--out", resume=resume, force=bool(getattr(args, "force", False)), resumable=resumable)
    args.out = str(path)
    if resumable:
        args.checkpoint_dir = str(path)
    return path


def _config(args):
    """(experiment module, its config, output folder) from the parsed ``args``."""
    import importlib

    name = args.name
    mod = importlib.import_module(f"attnlab.experiments.{EXPERIMENTS[name][1]}")
    if name == "variance":
        cfg = mod.VarianceConfig(quick=args.quick, seeds=seeds_of(args.seeds),
                                 d_k=args.d_k, rows=args.rows,
                                 keys=args.keys, minilm=not args.no_minilm, threads=args.threads)
        cfg.resolved()  # bad sizes are refused before the output folder is looked at
        return mod, cfg, _out(args, name, resumable=False)  # nothing is checkpointed: --force replaces every file
    if name in ("scaling", "failure-modes"):
        cls = mod.ScalingConfig if name == "scaling" else mod.FailureModesConfig
        cfg = cls(quick=args.quick, resume=args.resume, seeds=seeds_of(args.seeds), tasks=_names(args.tasks),
                  d_k=args.d_k, steps=args.steps, optimizer=args.optimizer,
                  lr=args.lr, model=args.model, qk_init=args.qk_init, threads=args.threads)
        cfg.validate()
        cfg.out = _out(args, name)
        return mod, cfg, cfg.out
    if name == "long-range":
        cfg = mod.LongRangeConfig(
            quick=args.quick, resume=args.resume, report_only=args.report_only, seeds=seeds_of(args.seeds),
            tasks=_names(args.tasks), mechanisms=_names(args.mechanisms) if args.mechanisms else None,
            seq_len=args.seq_len, steps=args.steps, batch_size=args.batch_size, lr=args.lr, d_model=args.d_model,
            layers=args.layers, recall_queries=args.recall_queries, token_shift=not args.no_token_shift,
            train_examples=args.train_examples, test_examples=args.test_examples, threads=args.threads)
        cfg.resolved()
        cfg.out = _out(args, name)
        return mod, cfg, cfg.out
    if name == "kvquant":
        cfg = mod.KvquantConfig(quick=args.quick, seeds=tuple(seeds_of(args.seeds)), tokens=args.tokens,
                                kernel=not args.no_kernel, threads=args.threads)
        cfg.resolved()
        return mod, cfg, _out(args, name, resumable=False)
    command = ("attnlab " + " ".join(sys.argv[1:]) if sys.argv and sys.argv[0].endswith("attnlab")
               else "attnlab experiment approximation" + (" --quick" if args.quick else ""))
    cfg = mod.ApproximationConfig(quick=args.quick, n=args.n, heads=args.heads, head_dim=args.head_dim,
                                  speed_n=args.speed_n, minilm_tokens=args.minilm_tokens, minilm=not args.no_minilm,
                                  seed=args.seed, threads=args.threads, command=command)
    cfg.resolved()
    return mod, cfg, _out(args, name, resumable=False)


def run(args):
    """Run ``attnlab experiment NAME`` from the parsed ``args``: build the config, run the experiment with
    a progress bar (unless --no-progress), write its report into --out, print a short summary; return
    the result (its ``exit_code`` is 130 when the experiment stopped early on Ctrl-C or SIGTERM)."""

    from attnlab import harness  # lazy subcommand: loaded when the command runs, not by `attnlab --help`

    mod, cfg, out = _config(args)
    with harness.progress(args.no_progress) as prog:
        result = mod.run(cfg, progress=prog)
    result.write(out)
    new_console().print("\n".join(result.summary_lines(out)))
    return result
