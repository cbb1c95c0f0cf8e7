"""Generated tasks that need no download: ListOps (LRA rules), associative recall, selective copy.

Every generator is deterministic in its ``seed`` and returns a :class:`TaskData`:
``inputs`` [N, T] token ids (0 is padding), ``targets`` [N] class ids (or [N, m] for sequence
targets), ``target_positions`` (where a sequence target is read out) and the vocabulary sizes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["TaskData", "listops", "associative_recall", "selective_copy", "TASKS", "make_task"]


@dataclass
class TaskData:
    """A generated data set.

    inputs: [N, T] int64 token ids, 0 = padding.
    targets: [N] int64 class ids, or [N, m] for tasks read out at ``target_positions``.
    target_positions: None (classify the whole sequence) or [m] positions whose outputs are the targets.
    readout: for whole-sequence classes, "mean" (pool over non-pad tokens) or "last" (the last token).
    """

    name: str
    inputs: torch.Tensor
    targets: torch.Tensor
    vocab_size: int
    num_classes: int
    target_positions: torch.Tensor | None = None
    meta: dict = field(default_factory=dict)
    readout: str = "mean"

    def __len__(self) -> int:
        return self.inputs.shape[0]

    @property
    def seq_len(self) -> int:
        """T, the (padded) length of every input row: ``inputs.shape[1]``."""
        return self.inputs.shape[1]

    def split(self, n_train: int) -> tuple["TaskData", "TaskData"]:
        """First ``n_train`` examples, and the rest."""
        a = TaskData(self.name, self.inputs[:n_train], self.targets[:n_train], self.vocab_size,
                     self.num_classes, self.target_positions, dict(self.meta), self.readout)
        b = TaskData(self.name, self.inputs[n_train:], self.targets[n_train:], self.vocab_size,
                     self.num_classes, self.target_positions, dict(self.meta), self.readout)
        return a, b


from .copy import selective_copy  # noqa: E402
from .listops import listops  # noqa: E402
from .recall import associative_recall  # noqa: E402

TASKS = {"listops": listops, "recall": associative_recall, "copy": selective_copy}


def make_task(name: str, num_samples: int, seq_len: int, seed: int = 0, **kwargs) -> TaskData:
    """``TASKS[name](num_samples, seq_len, seed=seed, **kwargs)`` with a clear error for unknown names."""
    if name not in TASKS:
        raise ValueError(f"task must be one of {sorted(TASKS)}, got {name!r}")
    return TASKS[name](num_samples, seq_len, seed=seed, **kwargs)
