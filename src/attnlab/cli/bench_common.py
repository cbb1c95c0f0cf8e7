"""What every ``attnlab bench SUITE`` face shares: the progress display and the --out checks."""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Callable, Iterator

from attnlab.options import output_dir

__all__ = ["progress_display", "checked_out", "run_suite"]


@contextmanager
def progress_display(enabled: bool = True, title: str = "") -> Iterator[Callable[[int, int, str], None] | None]:
    """A ``progress(done, total, label)`` callback that draws a bar on stderr for the with-block (a
    progress line per call when stderr is not a terminal); ``None`` when not ``enabled``. The bar is
    removed when the block ends, so the summary printed after it stands alone."""
    if not enabled:
        yield None
        return
    if not sys.stderr.isatty():
        def line(done: int, total: int, label: str) -> None:
            print(f"[{done}/{total}] {title}{' · ' if title else ''}{label}", file=sys.stderr, flush=True)
        yield line
        return
    from .common import console as new_console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=new_console(stderr=True), transient=True) as bar:
        task = bar.add_task(title, total=None)

        def update(done: int, total: int, label: str) -> None:
            bar.update(task, completed=done, total=total, description=f"{title} {label}".strip())
        yield update


def checked_out(args, *, resumable: bool = False):
    """``args.out`` checked as an output folder (a used one needs ``--force``, or ``--resume`` where the suite
    resumes: Note [One rule for --out] in attnlab.resources); a suite
    that resumes also records it as ``args.checkpoint_dir``, which the Ctrl-C message names."""
    if not resumable:  # Note [One rule for --out]: a used folder needs --force all the same
        return output_dir(args.out, resume=False, force=bool(getattr(args, "force", False)), resumable=False)
    out = output_dir(args.out, resume=bool(args.resume), force=bool(args.force))
    args.checkpoint_dir = str(out)
    return out


def run_suite(args, config, run: Callable, render: Callable[[object], None], *, title: str, resumable: bool = False,
              progress: bool = True):
    """The body of every suite's CLI ``run``: check --out (see :func:`checked_out`) into ``config.out``,
    call the library's ``run(config, progress=...)`` under a progress display, render its result with
    ``render`` and return it (``cli.main`` reads its ``exit_code``)."""
    config.out = str(checked_out(args, resumable=resumable))
    with progress_display(enabled=progress, title=title) as show:
        res = run(config, progress=show)
    render(res)
    return res
