"""attnlab command line. Each subcommand lives in its own module with two functions:

    build_parser(parser: argparse.ArgumentParser) -> None
    run(args: argparse.Namespace) -> object          # a result object (dict or dataclass); prints/renders

``main(argv)`` returns the process exit code; the result of the last command is kept in ``LAST_RESULT``
so tests can call ``main([...])`` and inspect what it returned and wrote.

Note [One error boundary]: every failure leaves through ``main`` as one line on stderr and a non-zero
exit code, never a traceback. Bad input exits 2: argparse's errors (one line, no usage block), and
``UsageError`` / ``ValueError`` / ``TypeError`` from the commands and the library, a missing file, input
nested too deeply to parse. What the machine refuses exits 1: memory that cannot be had, files that
cannot be written. Anything else is a bug and exits 1 with its type named (``ATTNLAB_TRACEBACK=1``
shows the traceback). Ctrl-C exits 130 with one line saying what was kept and how to resume
(``interrupted_message``).
"""
from __future__ import annotations

import argparse
import importlib
import os
import shlex
import sys

__all__ = ["main", "UsageError", "SUBCOMMANDS", "ArgumentParser", "HelpFormatter"]

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
_DEPTH = 0  # main() calls in progress: the tour runs other subcommands through main()


class UsageError(Exception):
    """Bad command-line input: printed without a traceback, exit code 2."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, unless its help already says it or there is none to show."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.default in (None, False, argparse.SUPPRESS) or "default" in text.lower()
                or not action.option_strings or isinstance(action.default, bool)):
            return text
        shown = ",".join(map(str, action.default)) if isinstance(action.default, (list, tuple)) else action.default
        return f"{text} (default: {str(shown).replace('%', '%%')})" if text else f"(default: {str(shown).replace('%', '%%')})"


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line error (Note [One error boundary]): no usage block, a pointer to --help."""

    def __init__(self, *a, **kw):
        kw.setdefault("formatter_class", HelpFormatter)
        super().__init__(*a, **kw)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from attnlab import __version__

    parser = ArgumentParser(
        prog="attnlab", description="attnlab: exact and efficient self-attention you can see, trace, measure and scale.")
    parser.add_argument("--version", action="version", version=f"attnlab {__version__}")
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


def _command(args) -> str:
    sub = {"bench": "suite", "experiment": "name"}.get(args.command)
    return " ".join(x for x in (args.command, getattr(args, sub, None) if sub else None) if isinstance(x, str))


def interrupted_message(args, argv: list[str]) -> str:
    """One line for Ctrl-C: what was kept on disk and the command that continues from it.

    A command that can resume sets ``args.checkpoint_dir`` once its output folder is checked; the
    others write their files whole at the end (``attnlab.report``), so an interrupted run leaves the
    folder as it was."""
    prog = f"attnlab {_command(args)}" if args is not None else " ".join(["attnlab", *argv[:1]])
    out = getattr(args, "out", None)
    kept_dir = getattr(args, "checkpoint_dir", None)
    if kept_dir:
        argv = [a for a in argv if a != "--force"]  # --force again would throw away what was kept
        again = ["attnlab", *argv] + ([] if "--resume" in argv else ["--resume"])
        return (f"{prog}: interrupted; what finished is kept in {kept_dir} (checkpoints, partial results); "
                f"resume with: {shlex.join(again)}")
    kept = f"every file in {out} is whole (each is written at once or not at all)" if out else "nothing was written"
    return f"{prog}: interrupted; {kept}; rerun `{shlex.join(['attnlab', *argv])}` to start again"


def _error_line(prog: str, e: BaseException) -> tuple[str, int]:
    if isinstance(e, (UsageError, ValueError, TypeError)):
        return f"{prog}: error: {e}", 2
    if isinstance(e, RecursionError):
        return f"{prog}: error: input nested too deeply to process ({e})", 2
    if isinstance(e, MemoryError) or (isinstance(e, RuntimeError) and ("can't allocate memory" in str(e)
                                                                       or "out of memory" in str(e))):
        msg = str(e).split("DefaultCPUAllocator: ")[-1].split(". Error code")[0] or "out of memory"
        return f"{prog}: error: not enough memory: {msg}; use smaller sizes", 1
    if isinstance(e, FileNotFoundError):
        return f"{prog}: error: file not found: {e.filename or e}", 2
    if isinstance(e, OSError):
        return f"{prog}: error: {e.strerror or e}" + (f": {e.filename}" if e.filename else ""), 1
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return (f"{prog}: error: {type(e).__name__}: {first} (unexpected; ATTNLAB_TRACEBACK=1 shows the traceback)"), 1


def _exit_interrupted() -> None:
    """Exit 130 now. Note [Exit 130 after Ctrl-C]: when the interrupt lands inside an import that C code
    runs (torch imports _dynamo, seconds, on first use of torch.optim), CPython can remember it as
    unhandled even though ``main`` caught it, and end the process by re-raising SIGINT at shutdown:
    exit status -2 instead of 130. Every file was written whole (``attnlab.report``) and the message
    is printed; the exit handlers still run (multiprocessing's among them, which release the worker
    pools' semaphores), then the process leaves without the rest of that shutdown."""
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(130)


def main(argv: list[str] | None = None) -> int:
    """Run ``attnlab ARGV``; returns the exit code. ``argv=None`` (the command line, as the ``attnlab``
    script and ``python -m attnlab.cli.main`` call it) reads ``sys.argv``."""
    global LAST_RESULT, _DEPTH
    from_command_line = argv is None and _DEPTH == 0
    argv = list(sys.argv[1:] if argv is None else argv)
    args = None
    _DEPTH += 1
    try:
        parser = build_parser()
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:  # argparse already printed its message (or --help / --version)
            return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
        if not getattr(args, "_run", None):
            parser.print_help()
            return 2
        LAST_RESULT = args._run(args)
    except KeyboardInterrupt:
        if _DEPTH > 1:
            raise  # a subcommand run by another (the tour): the outer one stops and reports
        print(interrupted_message(args, argv), file=sys.stderr)
        if from_command_line:
            _exit_interrupted()
        return 130
    except Exception as e:  # Note [One error boundary]
        if os.environ.get("ATTNLAB_TRACEBACK"):
            raise
        prog = f"attnlab {_command(args)}" if args is not None else "attnlab"
        line, code = _error_line(prog, e)
        print(" ".join(line.split("\n")), file=sys.stderr)
        return code
    finally:
        _DEPTH -= 1
    code = getattr(LAST_RESULT, "exit_code", None)
    if code is None and isinstance(LAST_RESULT, dict):
        code = LAST_RESULT.get("exit_code")
    if code == 130:  # the command caught Ctrl-C itself, after writing what it had
        print(interrupted_message(args, argv), file=sys.stderr)
        if from_command_line:
            _exit_interrupted()
    return int(code or 0)


if __name__ == "__main__":
    # `python -m attnlab.cli.main` runs this file as __main__, a second copy of the module: the
    # subcommands raise attnlab.cli.main.UsageError, which only the imported copy's boundary knows
    from attnlab.cli.main import main as _main

    sys.exit(_main())
