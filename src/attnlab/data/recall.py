"""Associative recall: find the value paired with a query key anywhere in a long, noisy sequence.

Layout of one example of length T: noise tokens, with ``num_pairs`` adjacent (key, value) pairs at
random non-overlapping positions in the first T - num_queries tokens; the last ``num_queries`` tokens
are query keys drawn (without repeats) from those pairs. The label of each query is the value that
followed its key (``num_values`` classes), read at the query's position: one query gives targets [N]
read at the last token (Ba et al. 2016), several give targets [N, num_queries] ("multi-query
associative recall", Arora et al. 2023 "Zoology"). Keys within an example are distinct, so every
answer is unique. Token ids: 0 pad, 1..num_noise noise, then keys, then values.
"""
from __future__ import annotations

import torch

from .task import TaskData

__all__ = ["associative_recall"]


def associative_recall(num_samples: int, seq_len: int, seed: int = 0, *, num_pairs: int = 8, num_keys: int = 32,
                       num_values: int = 16, num_noise: int = 16, num_queries: int = 1):
    """``num_samples`` N examples of length T = ``seq_len`` (layout in the module docstring), seeded.

    Returns a :class:`attnlab.data.TaskData` with inputs [N, T] and ``num_values`` classes: targets [N]
    read at the last token (``readout="last"``) for one query, else [N, num_queries] read at the last
    ``num_queries`` positions. ``meta`` holds the token id ranges. Raises ValueError unless
    1 <= num_queries <= num_pairs <= num_keys and seq_len >= 2·num_pairs + num_queries.
    """

    if num_pairs < 1 or num_pairs > num_keys:
        raise ValueError(f"num_pairs must be in [1, num_keys={num_keys}], got {num_pairs}")
    if num_queries < 1 or num_queries > num_pairs:
        raise ValueError(f"num_queries must be in [1, num_pairs={num_pairs}], got {num_queries}")
    if seq_len < 2 * num_pairs + num_queries:
        raise ValueError(f"seq_len must be >= 2 * num_pairs + num_queries = {2 * num_pairs + num_queries}, "
                         f"got {seq_len}")
    g = torch.Generator().manual_seed(seed)
    key0, val0 = 1 + num_noise, 1 + num_noise + num_keys
    N, T = num_samples, seq_len
    inputs = 1 + torch.randint(num_noise, (N, T), generator=g)  # (N, T) noise
    keys = torch.argsort(torch.rand(N, num_keys, generator=g), dim=1)[:, :num_pairs]  # (N, P) distinct keys
    vals = torch.randint(num_values, (N, num_pairs), generator=g)  # (N, P)
    # non-overlapping slots: choose P of the (T-Q)//2 even-aligned pair slots before the queries
    slots = torch.argsort(torch.rand(N, (T - num_queries) // 2, generator=g), dim=1)[:, :num_pairs] * 2  # (N, P)
    rows = torch.arange(N).unsqueeze(1)
    inputs[rows, slots] = key0 + keys
    inputs[rows, slots + 1] = val0 + vals
    if num_queries == 1:  # (drawn this way, one query reproduces the data sets of earlier versions)
        which = torch.randint(num_pairs, (N,), generator=g).unsqueeze(1)  # (N, 1)
    else:
        which = torch.argsort(torch.rand(N, num_pairs, generator=g), dim=1)[:, :num_queries]  # (N, Q) distinct
    inputs[:, T - num_queries:] = key0 + keys.gather(1, which)
    targets = vals.gather(1, which)  # (N, Q)
    meta = {"num_pairs": num_pairs, "num_queries": num_queries, "key_ids": [key0, key0 + num_keys],
            "value_ids": [val0, val0 + num_values], "seed": seed}
    if num_queries == 1:
        return TaskData("recall", inputs, targets[:, 0], vocab_size=val0 + num_values, num_classes=num_values,
                        meta=meta, readout="last")
    return TaskData("recall", inputs, targets, vocab_size=val0 + num_values, num_classes=num_values,
                    target_positions=torch.arange(T - num_queries, T), meta=meta)
