"""attnlab command line. Each subcommand lives in its own module with two functions:

    build_parser(parser: argparse.ArgumentParser) -> None
    run(args: argparse.Namespace) -> object          # a result object (dict or dataclass); prints/renders

``main(argv)`` returns the process exit code; the result of the last command is kept in ``LAST_RESULT``
so tests can call ``main([...])`` and inspect what it returned and wrote.
Bad input raises ``UsageError`` (or ValueError/TypeError from the library): message, exit code 2.
"""
from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["main", "UsageError", "SUBCOMMANDS"]

# name -> (module, one-line help). Modules are imported when the parser is built.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "tour": ("attnlab.cli.tour", "the guided tour: what attnlab can do, on this machine"),
    "explain": ("attnlab.cli.explain", "which attention method runs for given shapes, and why"),
    "bench": ("attnlab.cli.bench", "benchmarks against PyTorch SDPA (time, memory, ratios)"),
    "list": ("attnlab.cli.list_cmd", "every registered mechanism and its declared capabilities"),
    "check": ("attnlab.cli.check", "conformance check of every mechanism against the float64 oracle"),
    "trace": ("attnlab.cli.trace", "step-by-step arithmetic of attention on real numbers"),
    "viz": ("attnlab.cli.viz", "interactive HTML view of attention weights"),
    "heads": ("attnlab.cli.heads", "what MiniLM's heads do, measured"),
    "experiment": ("attnlab.cli.experiment", "experiments that write reports with plots"),
    "retrieve": ("attnlab.cli.retrieve", "attention as retrieval over a MiniLM-embedded corpus"),
    "serve": ("attnlab.cli.serve", "live attention explorer in the browser (local web app)"),
}

LAST_RESULT: object = None


class UsageError(Exception):
    """Bad command-line input: printed without a traceback, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnlab", description="attnlab: exact and efficient self-attention you can see, trace, measure and scale.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (mod_name, help_text) in SUBCOMMANDS.items():
        try:
            mod = importlib.import_module(mod_name)
        except ModuleNotFoundError as e:
            if e.name != mod_name:
                raise
            continue  # a subcommand still being written is simply not offered
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod.build_parser(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    global LAST_RESULT
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse already printed its message
        return int(e.code or 0)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        LAST_RESULT = args._run(args)
    except (UsageError, ValueError, TypeError, FileNotFoundError) as e:
        print(f"attnlab {args.command}: error: {e}", file=sys.stderr)
        return 2
    code = getattr(LAST_RESULT, "exit_code", None)
    if code is None and isinstance(LAST_RESULT, dict):
        code = LAST_RESULT.get("exit_code")
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
