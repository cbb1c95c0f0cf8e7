"""What every ``attnlab bench SUITE`` face shares: the progress display and the --out checks."""
from __future__ import annotations

import dataclasses
from typing import Callable

from .options import output_dir

from .common import progress_display

__all__ = ["progress_display", "checked_out", "run_suite", "config_of"]


def checked_out(args, *, resumable: bool = False):
    """``args.out`` checked as an output folder (a used one needs ``--force``, or ``--resume`` where the suite
    resumes: Note [One rule for --out] in attnlab.resources); a suite
    that resumes also records it as ``args.checkpoint_dir``, which the Ctrl-C message names."""
    if not resumable:  # Note [One rule for --out]: a used folder needs --force all the same
        return output_dir(args.out, resume=False, force=bool(getattr(args, "force", False)), resumable=False)
    out = output_dir(args.out, resume=bool(args.resume), force=bool(args.force))
    args.checkpoint_dir = str(out)
    return out


def config_of(args, cls):
    """The suite's config dataclass ``cls`` of parsed options: each field from the option of its name (``--max-n``
    is ``max_n``), a field with no option at its default. The caller checks it."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})


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
