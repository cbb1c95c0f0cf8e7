"""Associative recall: find the value paired with a query key anywhere in a long, noisy sequence.

Layout of one example of length T: noise tokens, with ``num_pairs`` adjacent (key, value) pairs at
random non-overlapping positions in the first T-1 tokens; the last token is a query key drawn from
those pairs. The label is the value that followed that key (``num_values`` classes), read at the last token. Keys within an
example are distinct, so the answer is unique (cf. Ba et al. 2016; Arora et al. 2023 "Zoology").
Token ids: 0 pad, 1..num_noise noise, then keys, then values.
"""
from __future__ import annotations

import torch

__all__ = ["associative_recall"]


def associative_recall(num_samples: int, seq_len: int, seed: int = 0, *, num_pairs: int = 8, num_keys: int = 32,
                       num_values: int = 16, num_noise: int = 16):
    """Returns a :class:`attnlab.data.TaskData`; ``meta`` holds the token id ranges."""
    from . import TaskData

    if num_pairs < 1 or num_pairs > num_keys:
        raise ValueError(f"num_pairs must be in [1, num_keys={num_keys}], got {num_pairs}")
    if seq_len < 2 * num_pairs + 1:
        raise ValueError(f"seq_len must be >= 2 * num_pairs + 1 = {2 * num_pairs + 1}, got {seq_len}")
    g = torch.Generator().manual_seed(seed)
    key0, val0 = 1 + num_noise, 1 + num_noise + num_keys
    N, T = num_samples, seq_len
    inputs = 1 + torch.randint(num_noise, (N, T), generator=g)  # (N, T) noise
    keys = torch.argsort(torch.rand(N, num_keys, generator=g), dim=1)[:, :num_pairs]  # (N, P) distinct keys
    vals = torch.randint(num_values, (N, num_pairs), generator=g)  # (N, P)
    # non-overlapping slots: choose P of the (T-1)//2 even-aligned pair slots
    slots = torch.argsort(torch.rand(N, (T - 1) // 2, generator=g), dim=1)[:, :num_pairs] * 2  # (N, P)
    rows = torch.arange(N).unsqueeze(1)
    inputs[rows, slots] = key0 + keys
    inputs[rows, slots + 1] = val0 + vals
    which = torch.randint(num_pairs, (N,), generator=g)
    inputs[:, -1] = key0 + keys[torch.arange(N), which]
    targets = vals[torch.arange(N), which]
    return TaskData("recall", inputs, targets, vocab_size=val0 + num_values, num_classes=num_values,
                    meta={"num_pairs": num_pairs, "key_ids": [key0, key0 + num_keys], "value_ids": [val0, val0 + num_values],
                          "seed": seed}, readout="last")
