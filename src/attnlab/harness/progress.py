"""Progress for long runs: a rich progress bar on stderr, or a no-op with the same methods."""
from __future__ import annotations

__all__ = ["progress", "NoProgress"]


class NoProgress:
    """The no-op progress: a context manager with rich.progress.Progress's add_task/advance/update."""

    def __enter__(self) -> "NoProgress":
        return self

    def __exit__(self, *a) -> bool:
        return False

    def add_task(self, *a, **k) -> int:
        """A task id (always 0); nothing is shown."""
        return 0

    def advance(self, *a, **k) -> None:
        """Nothing: no bar to advance."""

    def update(self, *a, **k) -> None:
        """Nothing: no bar to update."""


def progress(disable: bool = False):
    """A rich progress bar on stderr (stdout stays clean for results), or :class:`NoProgress`."""
    if disable:
        return NoProgress()
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=Console(stderr=True), transient=False)
