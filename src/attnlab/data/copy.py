"""Selective copy: reproduce, in order, the few data tokens scattered through a long blank sequence.

Layout of one example of length T: ``num_tokens`` data tokens at random (sorted) positions among
blank tokens in the first T - num_tokens positions, then ``num_tokens`` marker tokens. The model's
outputs at the marker positions must be the data tokens in order (Gu & Dao 2023, "Mamba", §3.1).
Token ids: 0 pad, 1 blank, 2 marker, 3.. data.
"""
from __future__ import annotations

import torch

from .task import TaskData

__all__ = ["selective_copy"]


def selective_copy(num_samples: int, seq_len: int, seed: int = 0, *, num_tokens: int = 8, num_symbols: int = 16):
    """``num_samples`` N examples of length T = ``seq_len`` (layout in the module docstring), seeded.

    Returns a :class:`attnlab.data.TaskData` with inputs [N, T] and targets [N, num_tokens] (the data
    symbols in order, ``num_symbols`` classes) read at the last ``num_tokens`` positions. Raises
    ValueError unless num_tokens >= 1 and seq_len >= 2·num_tokens.
    """

    if num_tokens < 1 or seq_len < 2 * num_tokens:
        raise ValueError(f"seq_len must be >= 2 * num_tokens = {2 * num_tokens} (num_tokens >= 1), got seq_len={seq_len}")
    g = torch.Generator().manual_seed(seed)
    N, T, m = num_samples, seq_len, num_tokens
    inputs = torch.ones(N, T, dtype=torch.long)  # blanks
    inputs[:, T - m:] = 2  # markers
    pos = torch.sort(torch.argsort(torch.rand(N, T - m, generator=g), dim=1)[:, :m], dim=1).values  # (N, m)
    data = torch.randint(num_symbols, (N, m), generator=g)  # (N, m)
    inputs[torch.arange(N).unsqueeze(1), pos] = 3 + data
    return TaskData("copy", inputs, data, vocab_size=3 + num_symbols, num_classes=num_symbols,
                    target_positions=torch.arange(T - m, T), meta={"num_tokens": m, "seed": seed})
