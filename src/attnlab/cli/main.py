"""attnlab command line. Each subcommand lives in its own module with two functions:

    build_parser(parser: argparse.ArgumentParser) -> None
    run(args: argparse.Namespace) -> object          # calls the library, renders, returns a result

``main(argv)`` returns the process exit code; ``invoke(argv)`` returns the exit code together with the
command's result, so tests can run a command and inspect what it returned and wrote.

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
import errno
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .common import ArgumentParser, HelpFormatter, UsageError, add_commands, add_width, set_width
from attnlab.version import __version__

__all__ = ["main", "invoke", "Outcome", "UsageError", "SUBCOMMANDS", "ArgumentParser", "HelpFormatter",
           "build_parser", "interrupted_message"]

# name -> (module, one-line help). A module is imported when its command runs or shows its --help
# (Note [Lazy subcommands] in cli/common.py).
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
    "calibrate": ("attnlab.cli.calibrate", "measure the kernels on this CPU and cache the planner's rates"),
    "info": ("attnlab.cli.info", "this machine and install, for a bug report (CPU, extension, versions)"),
    "verify": ("attnlab.cli.verify", "prove the kernels on this CPU class and write its record"),
}


@dataclass
class Outcome:
    """What one command did: its exit code and the result its ``run`` returned (None when it failed
    before or during the run)."""

    exit_code: int
    result: Any = None


def build_parser(lazy: bool = False) -> argparse.ArgumentParser:
    """The ``attnlab`` parser with every subcommand of ``SUBCOMMANDS`` that can be imported.

    lazy: import a subcommand's module (and add its options) only when a parse chooses it, as ``invoke``
    does (Note [Lazy subcommands] in cli/common.py); the default loads every one, for walking the options."""

    parser = ArgumentParser(
        prog="attnlab", description="attnlab: exact and efficient self-attention you can see, trace, measure and scale.")
    parser.lazy_commands = lazy
    parser.add_argument("--version", action="version", version=f"attnlab {__version__}")
    add_width(parser)
    add_commands(parser, SUBCOMMANDS, "command", run_key="_run")
    return parser


def _chosen_parser(parser: argparse.ArgumentParser, args) -> argparse.ArgumentParser:
    """The innermost (sub)parser the parsed ``args`` went through (``attnlab experiment scaling``'s own)."""
    for dest in ("command", "suite", "name"):
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction) and a.dest == dest]
        chosen = getattr(args, dest, None)
        if subs and isinstance(chosen, str) and chosen in subs[0].choices:
            parser = subs[0].choices[chosen]
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


_CANNOT_CREATE = (errno.ENOENT, errno.EACCES, errno.EPERM, errno.EROFS)


def _out_error_line(prog: str, e: BaseException, args) -> tuple[str, int] | None:
    """A write under ``--out`` that the filesystem refused (``--out /proc/nope``: ENOENT; a read-only folder:
    EACCES, EPERM, EROFS): say that the output could not be created there, naming the option, instead of "file
    not found" (also what ``resources.output_dir`` raises when it finds the folder unwritable before a run)."""
    out = getattr(args, "out", None)
    if not isinstance(e, OSError) or e.errno not in _CANNOT_CREATE or not out or not e.filename:
        return None
    out_path, failed = Path(str(out)).absolute(), Path(str(e.filename)).absolute()
    if failed != out_path and failed.parent not in (out_path, out_path.parent):
        return None  # some other file: an input that is missing
    parent = out_path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    return (f"{prog}: error: --out {out}: cannot create it: {parent} does not take new files or folders "
            f"({e.strerror or 'No such file or directory'}); choose a folder you can write to"), 1


def _ignore_more_interrupts() -> None:
    """After the first Ctrl-C the process is on its way out: a second one (a double press, or ``timeout -s INT``,
    which signals the command and then its process group) had interrupted the message or the exit handlers and
    printed a traceback. From here SIGINT is ignored."""
    import signal

    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread
        pass


def _interrupt_once():
    """Ctrl-C raises KeyboardInterrupt once and ignores SIGINT from then on (_ignore_more_interrupts), in the
    signal handler itself: a second SIGINT 5 ms after the first had landed while the first unwound, before the
    handler in ``invoke`` could ignore it. Returns the handler it replaced (None where it replaced none)."""
    import signal

    def first(signum, frame):
        _ignore_more_interrupts()
        raise KeyboardInterrupt

    try:
        prev = signal.getsignal(signal.SIGINT)
        if prev is signal.default_int_handler:  # (not where SIGINT is ignored already)
            signal.signal(signal.SIGINT, first)
            return prev
    except ValueError:  # not the main thread
        pass
    return None


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


def invoke(argv: list[str] | None = None) -> Outcome:
    """Run ``attnlab ARGV`` behind the error boundary (Note [One error boundary]); the exit code and the
    command's result. ``argv=None`` (the command line, as the ``attnlab`` script and
    ``python -m attnlab.cli.main`` call it) reads ``sys.argv``; only then does Ctrl-C end the process."""
    from_command_line = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    prev_handler = _interrupt_once() if from_command_line else None
    try:
        return _invoke(argv, from_command_line)
    finally:
        if prev_handler is not None:
            _restore_handler(prev_handler)


def _restore_handler(handler) -> None:
    import signal

    try:
        signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread
        pass


def _invoke(argv: list[str], from_command_line: bool) -> Outcome:
    args = None
    try:
        parser = build_parser(lazy=True)
        try:
            args, extra = parser.parse_known_args(argv)
            if extra:  # named by the command they were given to, not by the top-level parser
                _chosen_parser(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
        except SystemExit as e:  # argparse already printed its message (or --help / --version)
            return Outcome(e.code if isinstance(e.code, int) else (0 if e.code is None else 2))
        if not getattr(args, "_run", None):
            parser.print_help()
            return Outcome(2)
        previous_width = set_width(getattr(args, "width", None))
        try:
            result = args._run(args)
        finally:
            set_width(previous_width)
    except KeyboardInterrupt:
        if from_command_line:
            _ignore_more_interrupts()
        print(interrupted_message(args, argv), file=sys.stderr)
        if from_command_line:
            _exit_interrupted()
        return Outcome(130)
    except Exception as e:  # Note [One error boundary]
        if os.environ.get("ATTNLAB_TRACEBACK"):
            raise
        prog = f"attnlab {_command(args)}" if args is not None else "attnlab"
        line, code = _out_error_line(prog, e, args) or _error_line(prog, e)
        print(" ".join(line.split("\n")), file=sys.stderr)
        return Outcome(code)
    code = getattr(result, "exit_code", None)
    if code is None and isinstance(result, dict):
        code = result.get("exit_code")
    if code == 130:  # the command caught Ctrl-C itself, after writing what it had
        if from_command_line:
            _ignore_more_interrupts()
        print(interrupted_message(args, argv), file=sys.stderr)
        if from_command_line:
            _exit_interrupted()
    return Outcome(int(code or 0), result)


def main(argv: list[str] | None = None) -> int:
    """Run ``attnlab ARGV``; returns the exit code (``invoke`` also returns the command's result)."""
    return invoke(argv).exit_code


if __name__ == "__main__":
    sys.exit(main())
