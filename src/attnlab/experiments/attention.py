"""Which attention an experiment's model uses: a name from the command line turned into what
``attnlab.nn.MultiHeadAttention`` takes (an exact method, a registered mechanism, a pattern).

No dispatcher of its own: exact methods run through ``attnlab.attention`` and everything else through
``attnlab.mechanisms`` (its registry and ``resolve``). This module only sizes the parameters that
depend on the sequence length (block-sparse layouts, pattern widths) and names the choices on error.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

import attnlab.mechanisms as M
from attnlab import patterns as P
from attnlab.functional import METHODS

__all__ = ["AttentionChoice", "choose", "mechanism_names", "pattern_catalog", "ALIASES"]

#: names the experiments' --mechanisms flag has always accepted for exact attention, and the method each means
ALIASES = {"torch_sdpa": "sdpa", "naive": "dense"}


@dataclass(frozen=True)
class AttentionChoice:
    """What ``MultiHeadAttention(mechanism=..., pattern=...)`` gets for one name: an exact method name
    or a mechanism instance, and a pattern (or None)."""

    name: str
    mechanism: Any
    pattern: Any = None


def pattern_catalog(seq_len: int, causal: bool = False) -> dict:
    """Every structured pattern with parameters sized for ``seq_len`` (name -> ``attnlab.patterns``
    pattern): windows of n/8 (at most 128), BigBird blocks of n/8 (at most 64), strides of √n."""

    w = max(1, min(128, seq_len // 8))
    blk = max(1, min(64, seq_len // 8))
    stride = max(1, int(round(math.sqrt(seq_len))))
    cat = {
        "sliding_window": P.sliding_window(w, causal=causal),
        "dilated": P.dilated(max(1, w // 2), 2, causal=causal),
        "longformer": P.longformer(w, global_tokens=1),
        "bigbird": P.bigbird(blk),
        "strided": P.strided(stride, causal=causal),
        "fixed": P.fixed(stride, max(1, stride // 8), causal=causal),
    }
    if causal:
        cat = {k: (v & P.causal()) for k, v in cat.items()}
    return cat


def mechanism_names() -> tuple[list[str], str | None]:
    """Registered mechanism names, or ([], why) when ``attnlab.mechanisms`` cannot load its registry."""
    try:
        import attnlab.mechanisms as M  # inside try: a registry that fails to import is reported, not raised
    except ImportError as e:
        return [], f"attnlab.mechanisms not available ({e})"
    try:
        names = list(M.available())
    except Exception as e:  # a registry still being built: say so, measure the rest
        return [], f"attnlab.mechanisms.available() failed: {type(e).__name__}: {e}"
    return [str(n) for n in names], None


def _sized(name: str, seq_len: int | None):
    """``attnlab.mechanisms.get(name)``; block_sparse gets a layout for ``seq_len``: a band of 3 blocks
    plus the first block column, blocks of 64 (n/4 below 256)."""

    if name == "block_sparse":
        if seq_len is None:
            raise ValueError("mechanism 'block_sparse' needs seq_len to build its layout")
        bs = 64 if seq_len >= 256 else max(1, seq_len // 4)
        nb = -(-seq_len // bs)
        i = torch.arange(nb)
        layout = ((i[:, None] - i[None, :]).abs() <= 1) | (i[None, :] == 0)  # (nb, nb) band + first column
        return M.get(name, layout=layout, block_size=bs)
    return M.get(name)


def choose(name: str, seq_len: int | None = None, causal: bool = False) -> AttentionChoice:
    """The attention called ``name``: an exact method of ``attnlab.attention`` ("auto", "dense", "sdpa",
    "tiled", ...; "torch_sdpa" and "naive" are the old names of "sdpa" and "dense"), "pattern:<name>"
    (exact attention under a pattern of :func:`pattern_catalog`, sized for ``seq_len``), or a registered
    mechanism (its defaults, block_sparse sized for ``seq_len``). Raises ValueError listing the choices."""
    if not isinstance(name, str):
        raise TypeError(f"attention name must be a str, got {type(name).__name__}")
    method = ALIASES.get(name, name)
    if method in METHODS:
        return AttentionChoice(name, method)
    if name.startswith("pattern:"):
        if seq_len is None:
            raise ValueError(f"attention {name!r} needs seq_len to size its pattern")
        cat = pattern_catalog(seq_len, causal)
        pat = name.split(":", 1)[1]
        if pat not in cat:
            raise ValueError(f"unknown pattern {pat!r}; choose from {sorted(cat)}")
        return AttentionChoice(name, "auto", cat[pat])
    names, why = mechanism_names()
    if why is not None:
        raise ValueError(f"mechanism {name!r}: {why}")
    if name not in names:
        raise ValueError(f"unknown attention {name!r}; choose from {', '.join(METHODS)}, torch_sdpa, naive, "
                         f"pattern:<name>, or a registered mechanism: {', '.join(names)}")
    return AttentionChoice(name, _sized(name, seq_len))
