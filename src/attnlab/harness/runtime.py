"""What a measurement runs under: torch threads for a block, and the environment recorded beside results."""
from __future__ import annotations

import os
import sys

import torch

from attnlab.report import environment

__all__ = ["threads", "environment_record"]


class threads:
    """Context manager: ``torch.set_num_threads(n)`` inside (None: unchanged), the previous value after."""

    def __init__(self, n: int | None):
        if n is not None and n < 1:
            raise ValueError(f"--threads must be >= 1, got {n}")
        self.n, self.prev = n, torch.get_num_threads()

    def __enter__(self) -> "threads":
        if self.n:
            torch.set_num_threads(self.n)
        return self

    def __exit__(self, *a) -> bool:
        torch.set_num_threads(self.prev)
        return False


def environment_record(seeds: list[int] | None = None) -> dict:
    """``attnlab.report.environment()`` plus the seeds, the command line and the working folder."""

    env = environment()
    env["seeds"] = seeds
    env["argv"] = sys.argv
    env["cwd"] = os.getcwd()
    return env
