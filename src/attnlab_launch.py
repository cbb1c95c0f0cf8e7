"""The ``attnlab`` console script: Ctrl-C while torch is still importing exits 130 with one line.

``attnlab.cli.main`` imports torch, seconds on a cold start, and Ctrl-C in those seconds would raise
KeyboardInterrupt inside the import, before the CLI's error boundary (Note [One error boundary] in
``attnlab/cli/main.py``) exists: a traceback, and exit status -2. This module sits outside the package
so that importing it imports nothing heavy. It takes SIGINT over first, imports the CLI, then hands
SIGINT back, so the commands' own Ctrl-C handling (checkpoints, ``interrupted_message``) is unchanged.
While the import runs, the handler leaves at once (``os._exit``): an exception raised in the middle of
torch's import could be swallowed by a broad ``except`` there, and CPython can end a process whose
import was interrupted with a re-raised SIGINT instead of our exit status (Note [Exit 130 after
Ctrl-C]). Nothing has been written yet, so there is nothing to clean up.

``python -m attnlab_launch ARGS`` runs it like the installed script.
"""
from __future__ import annotations

import os
import shlex
import signal
import sys
from typing import NoReturn

__all__ = ["main", "interrupted_line"]


def interrupted_line(argv: list[str]) -> str:
    """The one stderr line for Ctrl-C before the command started (argv without the program name)."""
    prog = " ".join(["attnlab", *argv[:1]])
    return f"{prog}: interrupted while starting; nothing was written; rerun `{shlex.join(['attnlab', *argv])}` to start again"


def _leave(code: int, line: str) -> NoReturn:
    try:
        os.write(2, (line + "\n").encode(errors="replace"))
    except OSError:  # stderr closed: the exit status still says what happened
        pass
    os._exit(code)


def main() -> int:
    """Import ``attnlab.cli.main`` with Ctrl-C handled, then run ``attnlab`` on ``sys.argv``; the exit code."""
    argv = sys.argv[1:]
    previous = signal.getsignal(signal.SIGINT)
    # a process started with SIGINT ignored (nohup, `cmd &` in a script) keeps ignoring it
    take_over = previous is not signal.SIG_IGN
    if take_over:
        signal.signal(signal.SIGINT, lambda signum, frame: _leave(130, interrupted_line(argv)))
    try:
        from attnlab.cli.main import main as cli_main
    except KeyboardInterrupt:  # code in the import chain put Python's own handler back
        _leave(130, interrupted_line(argv))
    except Exception as e:  # a broken install: one line, like every other CLI failure
        if os.environ.get("ATTNLAB_TRACEBACK"):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        _leave(1, f"attnlab: error: cannot import attnlab: {type(e).__name__}: {first} "
                        "(ATTNLAB_TRACEBACK=1 shows the traceback)")
    finally:
        if take_over:
            signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
