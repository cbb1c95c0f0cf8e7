"""ListOps with the Long Range Arena generator's rules (Nangia & Bowman 2018; Tay et al. 2020).

An expression is a tree: with probability ``value_p`` (0.25 in LRA) a node below ``max_depth`` is an
operator with 2..``max_args`` arguments, otherwise a digit 0-9; at ``max_depth`` it is always a
digit. Operators: MIN, MAX, MED (median, truncated to an int as LRA's ``int(np.median(...))``) and
SM (sum mod 10). Tokens: ``[MAX 2 9 [MIN 4 7 ] 0 ]`` — the closing ``]`` of every operator is kept
(LRA drops only the parentheses of its bracketed string). The label is the value of the expression
(10 classes). As in LRA, trees are drawn whole and kept only when their token count lies in
(``min_length``, ``max_length``).
"""
from __future__ import annotations

import random

import torch

from .task import TaskData

__all__ = ["listops", "generate_tree", "evaluate", "tokens_of", "VOCAB", "OPERATORS"]

OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
END = "]"
#: token -> id; 0 is padding
VOCAB = {"<pad>": 0, **{str(d): 1 + d for d in range(10)}, **{op: 11 + i for i, op in enumerate(OPERATORS)}, END: 15}


class _TooLong(Exception):
    pass


def generate_tree(rng: random.Random, max_depth: int = 10, max_args: int = 10, value_p: float = 0.25,
                  max_length: int | None = None):
    """One expression as nested tuples ``(op, [args])`` / int, and its token count (LRA's rules).

    Returns (None, length) when the tree grows past ``max_length`` tokens (it would be rejected).
    """
    count = [0]

    def grow(depth: int):
        r = rng.random() if depth < max_depth else 1.0
        if r > value_p:
            count[0] += 1
            if max_length is not None and count[0] >= max_length:
                raise _TooLong
            return rng.randrange(10)
        count[0] += 2  # the operator token and its closing ]
        n_args = rng.randint(2, max_args)
        args = [grow(depth + 1) for _ in range(n_args)]
        return (rng.choice(OPERATORS), args)

    try:
        tree = grow(1)
    except _TooLong:
        return None, count[0]
    return tree, count[0]


def evaluate(tree) -> int:
    """Value of an expression tree (an int 0-9)."""
    if isinstance(tree, int):
        return tree
    op, args = tree
    vals = [evaluate(a) for a in args]
    if op == "[MIN":
        return min(vals)
    if op == "[MAX":
        return max(vals)
    if op == "[SM":
        return sum(vals) % 10
    if op == "[MED":
        s = sorted(vals)
        m = len(s) // 2
        return s[m] if len(s) % 2 else int((s[m - 1] + s[m]) / 2)
    raise ValueError(f"unknown operator {op!r}")


def tokens_of(tree) -> list[str]:
    """Token strings, e.g. ``['[MAX', '2', '9', ']']``."""
    if isinstance(tree, int):
        return [str(tree)]
    op, args = tree
    out = [op]
    for a in args:
        out.extend(tokens_of(a))
    out.append(END)
    return out


def listops(num_samples: int, seq_len: int, seed: int = 0, *, min_length: int | None = None,
            max_depth: int = 10, max_args: int = 10, value_p: float = 0.25, max_tries: int = 2_000_000):
    """``num_samples`` ListOps expressions of at most ``seq_len`` tokens, right-padded with 0.

    min_length: keep trees longer than this (default ``seq_len // 4``; LRA used 500 for 2000).
    Returns a :class:`attnlab.data.TaskData` with inputs [N, seq_len], targets [N] (the value 0-9 of
    each expression: 10 classes) and the token lengths in ``meta["lengths"]``. Trees are drawn by
    rejection; raises ValueError if ``max_tries`` draws do not give ``num_samples`` of the right length.
    """

    if num_samples < 1 or seq_len < 2:
        raise ValueError(f"num_samples must be >= 1 and seq_len >= 2, got {num_samples} and {seq_len}")
    if max_depth < 1 or max_args < 2:
        raise ValueError(f"max_depth must be >= 1 and max_args >= 2, got {max_depth} and {max_args}")
    min_length = seq_len // 4 if min_length is None else min_length
    if min_length >= seq_len:
        raise ValueError(f"min_length ({min_length}) must be < seq_len ({seq_len})")
    rng = random.Random(seed)
    inputs = torch.zeros(num_samples, seq_len, dtype=torch.long)
    targets = torch.zeros(num_samples, dtype=torch.long)
    lengths = []
    kept = tries = 0
    while kept < num_samples:
        tries += 1
        if tries > max_tries:
            raise ValueError(f"could not draw {num_samples} ListOps trees with {min_length} < length <= {seq_len} "
                             f"in {max_tries} tries; lower min_length")
        tree, length = generate_tree(rng, max_depth, max_args, value_p, max_length=seq_len + 1)
        if tree is None or not (min_length < length <= seq_len):
            continue
        toks = tokens_of(tree)
        inputs[kept, :length] = torch.tensor([VOCAB[t] for t in toks])
        targets[kept] = evaluate(tree)
        lengths.append(length)
        kept += 1
    return TaskData("listops", inputs, targets, vocab_size=len(VOCAB), num_classes=10,
                    meta={"lengths": lengths, "tries": tries, "min_length": min_length, "max_depth": max_depth,
                          "max_args": max_args, "value_p": value_p, "seed": seed})
