"""argparse types shared by every command's options, plus the resource checks they go with.

All subcommands take their number types from here, so that ``--seq-len 0`` or ``--lr nan`` is refused
at parse time (argparse's one-line error) instead of being silently replaced by a default through
``args.x or default``. The memory budget and output-folder checks live in ``attnlab.resources`` (the
library makes them too) and are re-exported here for the commands' convenience.
"""
from __future__ import annotations

import argparse
import math
import os

from ..resources import RUN_MARKERS, OptionError, check_memory, memory_budget, output_dir, output_file

__all__ = ["OptionError", "names", "positive_int", "nonneg_int", "int_in", "positive_float", "nonneg_float", "finite_float",
           "positive_int_list", "MINILM_LAYERS", "MINILM_HEADS", "MINILM_POSITIONS", "memory_budget", "check_memory", "output_dir", "output_file", "RUN_MARKERS"]


# -- argparse types -------------------------------------------------------------------------------------
def _int(text: str, what: str) -> int:
    try:
        return int(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    v = _int(text, "a positive integer")
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return v


#: the most torch threads a --threads takes: 4x this machine's CPUs (oversubscribed runs stay possible; 100000
#: had started 100000 OpenMP threads in each worker and stalled the machine)
MAX_THREADS = 4 * (os.cpu_count() or 1)


def thread_count(text: str) -> int:
    """argparse type for --threads: an integer from 1 to MAX_THREADS."""
    v = _int(text, "a positive integer")
    if not 1 <= v <= MAX_THREADS:
        raise argparse.ArgumentTypeError(f"must be from 1 to {MAX_THREADS} (4x this machine's {os.cpu_count()} "
                                         f"CPUs), got {text!r}")
    return v


def seed(text: str) -> int:
    """argparse type for --seed: an integer from 0 to 2^63 - 1 (what torch's and NumPy's generators take; a
    larger one had failed deep in torch with "Overflow when unpacking long long")."""
    v = _int(text, "an integer >= 0")
    if not 0 <= v < 2**63:
        raise argparse.ArgumentTypeError(f"must be an integer from 0 to 2^63 - 1, got {text!r}")
    return v


def nonneg_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    v = _int(text, "an integer >= 0")
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return v


def int_in(lo: int, hi: int, why: str = ""):
    """argparse type: an integer in [lo, hi]; the refusal shows the range and, in ``why``, where it comes
    from ("argument --subjects: must be an integer in [1, 48] (the corpus has 48 names), got '100'")."""
    why_text = f" ({why})" if why else ""

    def parse(text: str) -> int:
        v = _int(text, f"an integer in [{lo}, {hi}]{why_text}")
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"must be an integer in [{lo}, {hi}]{why_text}, got {text!r}")
        return v

    parse.__name__ = f"int in [{lo}, {hi}]"  # argparse names the type in some messages
    return parse


#: all-MiniLM-L6-v2's shape, for the options' ranges and --help (attnlab.models.minilm reads the same from the
#: checkpoint's config; tests/cli/test_cli_polish.py checks they agree)
MINILM_LAYERS, MINILM_HEADS, MINILM_POSITIONS = 6, 12, 512


def finite_float(text: str) -> float:
    """argparse type: a finite float (no nan, no inf)."""
    try:
        v = float(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return v


def positive_float(text: str) -> float:
    """argparse type: a finite float > 0."""
    v = finite_float(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return v


def nonneg_float(text: str) -> float:
    """argparse type: a finite float >= 0."""
    v = finite_float(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return v


def positive_int_list(text: str) -> list[int]:
    """argparse type: comma-separated integers >= 1, at least one ("128,256")."""
    parts = [p for p in str(text).split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"must be comma-separated positive integers, got {text!r}")
    try:
        vals = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated positive integers, got {text!r}") from None
    if min(vals) < 1:
        raise argparse.ArgumentTypeError(f"must be comma-separated positive integers, got {text!r}")
    return vals


def names(text: str) -> tuple[str, ...]:
    """argparse type: comma-separated names, blanks dropped ("float32, bfloat16" -> ("float32", "bfloat16"))."""
    return tuple(t.strip() for t in str(text).split(",") if t.strip())
