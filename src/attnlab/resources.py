"""Checks every instrument makes before it allocates or writes: the memory budget and output paths.

Sizes are checked against ``memory_budget()`` before anything is allocated (``check_memory``), and
``output_dir`` refuses an output folder that is a file, or a folder holding an earlier run, unless
``resume`` or ``force`` says what to do with it. The errors are ``OptionError`` (a ``ValueError``) and
name the option or setting as the caller passes it ("--out", "--shape 1,1,200000,64"), so the command
line can show them as they are.
"""
from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

__all__ = ["OptionError", "memory_budget", "check_memory", "output_dir", "output_file", "RUN_MARKERS"]


class OptionError(ValueError):
    """A setting whose value cannot work; the message names the option and the value."""


# -- memory ---------------------------------------------------------------------------------------------
def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def memory_budget() -> tuple[int, str]:
    """(bytes, where it comes from): ``ATTNLAB_MEMORY_BUDGET_GIB`` when set, else half of the memory
    the kernel reports available (``MemAvailable``), else 8 GiB. Half, because a command's peak is
    estimated, not measured, and the machine is usually shared."""
    env = os.environ.get("ATTNLAB_MEMORY_BUDGET_GIB")
    if env:
        try:
            gib = float(env)
        except ValueError:
            raise OptionError(f"ATTNLAB_MEMORY_BUDGET_GIB must be a number of GiB, got {env!r}") from None
        if not gib > 0 or not math.isfinite(gib):
            raise OptionError(f"ATTNLAB_MEMORY_BUDGET_GIB must be a finite number > 0, got {env!r}")
        return int(gib * 2**30), "ATTNLAB_MEMORY_BUDGET_GIB"
    avail = _available_bytes()
    if avail is None:
        return 8 * 2**30, "a default, /proc/meminfo unreadable"
    return avail // 2, "half of the available memory"


def check_memory(option: str, nbytes: float, what: str = "") -> None:
    """Raise OptionError naming ``option`` when ``nbytes`` is over ``memory_budget()``.

    option: the option and its value as the user wrote them ("--shape 1,1,200000,64");
    what: which allocation dominates ("the float64 reference's [B, H, L, S] scores")."""
    from .report import format_bytes

    budget, source = memory_budget()
    if nbytes > budget:
        why = f" ({what})" if what else ""
        raise OptionError(f"{option} would need about {format_bytes(nbytes)}{why}, over the memory budget of "
                          f"{format_bytes(budget)} ({source}); use smaller sizes or set ATTNLAB_MEMORY_BUDGET_GIB")


# -- output ---------------------------------------------------------------------------------------------
#: files and folders whose presence marks a folder as holding an earlier run of a resumable command
RUN_MARKERS = ("results.json", "results.partial.json", "checkpoints", "report.md")


def output_file(path: str | os.PathLike, option: str = "--out") -> Path:
    """A file to write: refused when it names a folder, or sits under a path component that is a file."""
    p = Path(path)
    if p.is_dir():
        raise OptionError(f"{option} {p} is a folder; name a file to write (e.g. {p / 'trace.html'})")
    for parent in p.parents:
        if parent.exists() and not parent.is_dir():
            raise OptionError(f"{option} {p}: {parent} is a file, not a folder")
    return p


def output_dir(path: str | os.PathLike, option: str = "--out", *, resume: bool | None = None, force: bool = False,
               markers: tuple[str, ...] = RUN_MARKERS) -> Path:
    """An output folder: refused when it is a file (or under one).

    For commands that resume (``resume`` is not None): a folder holding an earlier run (any of
    ``markers``) is refused unless ``resume`` (continue it) or ``force`` (its markers are removed first,
    so the old run cannot mix with the new one)."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise OptionError(f"{option} {p} is a file; name a folder to write into")
    for parent in p.parents:
        if parent.exists() and not parent.is_dir():
            raise OptionError(f"{option} {p}: {parent} is a file, not a folder")
    if resume is None or resume or not p.is_dir():
        return p
    found = [m for m in markers if (p / m).exists()]
    if found and not force:
        raise OptionError(f"{option} {p} holds an earlier run ({', '.join(found)}); pass --resume to continue it, "
                          f"--force to replace it, or choose another {option}")
    for m in found:
        target = p / m
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        else:
            target.unlink()
    return p
