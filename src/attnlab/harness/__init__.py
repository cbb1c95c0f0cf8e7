"""The instruments' shared harness: measuring, storing, training and reporting, in one place.

Every instrument (``bench``, ``experiments``, ...) measures, keeps partial results, trains and writes
reports the same way, through these modules; none of them parses arguments or prints.

- :mod:`~attnlab.timing` (re-exported here): one timer (warm-up, interleaved rounds, median).
- :mod:`~attnlab.harness.memory`: resident memory now and at its peak; reset the peak.
- :mod:`~attnlab.harness.store`: a result store on disk with partial results and resume; report files.
- :mod:`~attnlab.harness.tables`: the one Markdown table writer and number formatting.
- :mod:`~attnlab.harness.plots`: matplotlib without a display, figures saved atomically, line styles.
- :mod:`~attnlab.harness.progress`: a rich progress bar on stderr, or a no-op.
- :mod:`~attnlab.harness.training`: the training loop with checkpoints, resume and Ctrl-C at a step boundary.
- :mod:`~attnlab.harness.runtime`: torch threads for a block, the environment record.
"""
from __future__ import annotations

from .memory import PeakRSS, peak_rss_bytes, reset_peak_rss, rss_bytes
from .plots import line_styles, pyplot, save_plot
from .progress import NoProgress, progress
from .runtime import environment_record, threads
from .store import ResultStore, remove_partial, write_report
from .tables import fmt, markdown_table, mean_std
from ..timing import Timing, interleaved, median_rate, paired_ratio, time_call
from .training import (CheckpointError, StepBoundary, TrainConfig, evaluate, grad_norm, load_checkpoint,
                       tail_mean, train_run)

__all__ = [
    "Timing", "time_call", "interleaved", "paired_ratio", "median_rate",
    "rss_bytes", "peak_rss_bytes", "reset_peak_rss", "PeakRSS",
    "ResultStore", "write_report", "remove_partial",
    "fmt", "markdown_table", "mean_std",
    "pyplot", "save_plot", "line_styles",
    "progress", "NoProgress",
    "TrainConfig", "train_run", "evaluate", "grad_norm", "tail_mean", "load_checkpoint", "CheckpointError",
    "StepBoundary",
    "threads", "environment_record",
]
