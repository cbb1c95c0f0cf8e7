"""The generated data set every task returns: token ids, targets and the vocabulary sizes."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["TaskData"]


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
