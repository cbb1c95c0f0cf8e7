"""Generated tasks that need no download: ListOps (LRA rules), associative recall, selective copy.

Every generator is deterministic in its ``seed`` and returns a :class:`TaskData`:
``inputs`` [N, T] token ids (0 is padding), ``targets`` [N] class ids (or [N, m] for sequence
targets), ``target_positions`` (where a sequence target is read out) and the vocabulary sizes.
"""
from __future__ import annotations

from .copy import selective_copy
from .listops import listops
from .recall import associative_recall
from .task import TaskData

__all__ = ["TaskData", "listops", "associative_recall", "selective_copy", "TASKS", "make_task"]

TASKS = {"listops": listops, "recall": associative_recall, "copy": selective_copy}


def make_task(name: str, num_samples: int, seq_len: int, seed: int = 0, **kwargs) -> TaskData:
    """``TASKS[name](num_samples, seq_len, seed=seed, **kwargs)`` with a clear error for unknown names."""
    if name not in TASKS:
        raise ValueError(f"task must be one of {sorted(TASKS)}, got {name!r}")
    return TASKS[name](num_samples, seq_len, seed=seed, **kwargs)
