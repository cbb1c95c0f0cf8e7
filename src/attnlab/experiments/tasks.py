"""The training experiments' data: byte-level text that ships with Python, and associative recall.

Legend: N examples, T sequence length.
"""
from __future__ import annotations

import sys

import torch

from attnlab.data import TaskData, make_task

__all__ = ["TEXT_MODULES", "stdlib_text", "text_task", "task_data"]

#: standard-library modules whose docstrings make the text task's corpus (fixed: the corpus is the same everywhere)
TEXT_MODULES = ("json", "collections", "itertools", "functools", "re", "string", "textwrap", "pathlib",
                "argparse", "random", "statistics", "heapq", "bisect", "csv", "datetime", "fractions",
                "decimal", "difflib", "shutil", "tempfile", "typing", "dataclasses", "enum", "contextlib")


def stdlib_text(max_chars: int = 400_000) -> str:
    """Docstrings of :data:`TEXT_MODULES` and their public members, duplicates dropped (no download)."""
    import importlib
    import inspect

    parts = []
    for name in TEXT_MODULES:
        mod = importlib.import_module(name)
        if mod.__doc__:
            parts.append(inspect.cleandoc(mod.__doc__))
        for attr in sorted(getattr(mod, "__all__", None) or dir(mod)):
            if attr.startswith("_"):
                continue
            doc = getattr(getattr(mod, attr, None), "__doc__", None)
            if isinstance(doc, str) and len(doc) > 40:
                parts.append(inspect.cleandoc(doc))
    text = "\n\n".join(dict.fromkeys(parts))  # drop duplicates, keep order
    return text[:max_chars]


def text_task(num_samples: int, seq_len: int, seed: int = 0):
    """Byte-level next-token windows of :func:`stdlib_text` as ``attnlab.data.TaskData``: inputs [N, T]
    (ids = byte + 1, 0 stays padding), targets [N, T] (the next byte's id), 257 classes."""

    data = torch.tensor(list(stdlib_text().encode("utf-8")), dtype=torch.long) + 1  # 0 stays padding
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - seq_len - 1, (num_samples,), generator=g)
    idx = starts.unsqueeze(1) + torch.arange(seq_len + 1)  # (N, T+1)
    win = data[idx]
    return TaskData("text", win[:, :-1], win[:, 1:], vocab_size=257, num_classes=257, readout="all",
                    meta={"source": "docstrings of Python stdlib modules " + ",".join(TEXT_MODULES),
                          "python": sys.version.split()[0], "chars": int(data.numel())})


def task_data(task: str, sizes: dict, seed: int = 0):
    """(train, test) ``TaskData`` of a training experiment's task: "text" (:func:`text_task`) or "recall"
    (``attnlab.data.make_task("recall")`` with 4 pairs); lengths ``sizes["seq_len"][task]``, counts
    ``sizes["train"]`` and ``sizes["test"]``."""

    T, n = sizes["seq_len"][task], sizes["train"] + sizes["test"]
    if task == "text":
        data = text_task(n, T, seed)
    elif task == "recall":
        data = make_task("recall", n, T, seed=seed, num_pairs=4)
    else:
        raise ValueError(f"task must be 'recall' or 'text', got {task!r}")
    return data.split(sizes["train"])
