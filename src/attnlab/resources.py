"""Checks every instrument makes before it allocates or writes: the memory budget and output paths.

Sizes are checked against ``memory_budget()`` before anything is allocated (``check_memory``), and
``output_dir`` refuses an output folder that is a file, or a folder holding an earlier run, unless
``resume`` or ``force`` says what to do with it; ``output_file`` refuses a file that exists unless ``force``
(Note [One rule for --out]). The errors are ``OptionError`` (a ``ValueError``) and
name the option or setting as the caller passes it ("--out", "--shape 1,1,200000,64"), so the command
line can show them as they are.
"""
from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

from .files import format_bytes

__all__ = ["OptionError", "memory_budget", "check_memory", "output_dir", "output_file", "RUN_MARKERS", "OUTPUT_MARKERS"]


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

    budget, source = memory_budget()
    if nbytes > budget:
        why = f" ({what})" if what else ""
        raise OptionError(f"{option} would need about {format_bytes(nbytes)}{why}, over the memory budget of "
                          f"{format_bytes(budget)} ({source}); use smaller sizes or set ATTNLAB_MEMORY_BUDGET_GIB")


# -- output ---------------------------------------------------------------------------------------------
#: files and folders whose presence marks a folder as holding an earlier run of a resumable command
#: (``--force`` removes these before the new run, so an old run cannot mix with it)
RUN_MARKERS = ("results.json", "results.partial.json", "checkpoints", "report.md")
#: what else marks a folder as holding an earlier run of any command: every command that writes a folder
#: writes a JSON of its results there (results.json, heads.json, layers.json, ...) or a page (viz)
OUTPUT_MARKERS = ("*.json", "index.html")

# Note [One rule for --out]: every command that writes an --out refuses one holding another run unless told
# what to do with it (issue 21): a folder holding any of RUN_MARKERS or OUTPUT_MARKERS needs --force (replace
# it: RUN_MARKERS are removed first, the other files are written over) or, for a command that resumes,
# --resume; a file that exists needs --force. The refusal is an OptionError, which the command line shows as
# one line on stderr and exit 2. Library calls (``resume=None``, ``force=None``) only check the kind of path.


def output_file(path: str | os.PathLike, option: str = "--out", *, force: bool | None = None) -> Path:
    """A file to write: refused when it names a folder, or sits under a path component that is a file;
    with ``force`` given (a command's --force), also when it exists and ``force`` is False."""
    p = Path(path)
    if p.is_dir():
        raise OptionError(f"{option} {p} is a folder; name a file to write (e.g. {p / 'trace.html'})")
    for parent in p.parents:
        if parent.exists() and not parent.is_dir():
            raise OptionError(f"{option} {p}: {parent} is a file, not a folder")
    if force is False and p.exists():
        raise OptionError(f"{option} {p} exists (an earlier run?); pass --force to replace it, or choose another "
                          f"{option}")
    return p


def _held(p: Path, markers: tuple[str, ...]) -> list[str]:
    """The entries of folder ``p`` that mark an earlier run: ``markers`` and ``OUTPUT_MARKERS`` (globs)."""
    found = [m for m in markers if (p / m).exists()]
    for g in OUTPUT_MARKERS:
        found += sorted(x.name for x in p.glob(g) if x.name not in found)
    return found


def _check_writable(p: Path, option: str) -> None:
    """Refuse a folder that cannot be written: the folder, or the nearest folder above it that exists, must take a
    new entry (a scratch folder made and removed there, so a read-only or pseudo file system such as /proc is
    found out before a run, not after it). Raises the OSError with ``p`` as its filename, which the CLI's error
    boundary words as "--out P: cannot create it" (cli/main.py ``_out_error_line``)."""
    import tempfile

    anchor = next((a for a in (p, *p.parents) if a.exists()), Path("."))
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".attnlab-write-check-", dir=anchor))
    except OSError as e:
        raise OSError(e.errno, e.strerror or str(e), str(p)) from None


def output_dir(path: str | os.PathLike, option: str = "--out", *, resume: bool | None = None, force: bool = False,
               markers: tuple[str, ...] = RUN_MARKERS, resumable: bool = True) -> Path:
    """An output folder: refused when it is a file (or under one).

    For a command (``resume`` is not None; Note [One rule for --out]): a folder holding an earlier run
    (any of ``markers``, or of ``OUTPUT_MARKERS``) is refused unless ``resume`` (continue it; only where
    ``resumable``) or ``force`` (``markers`` are removed first, so the old run cannot mix with the new
    one; other files are written over)."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise OptionError(f"{option} {p} is a file; name a folder to write into")
    for parent in p.parents:
        if parent.exists() and not parent.is_dir():
            raise OptionError(f"{option} {p}: {parent} is a file, not a folder")
    if resume is not None:  # a command checks here, before it runs (issue 40: bench decode --out /proc/x ran first)
        _check_writable(p, option)
    if resume is None or (resume and resumable) or not p.is_dir():
        return p
    held = _held(p, markers)
    if held and not force:
        shown = ", ".join(held[:4]) + (f", ... ({len(held)} entries)" if len(held) > 4 else "")
        how = "pass --resume to continue it, --force to replace it" if resumable else "pass --force to replace it"
        raise OptionError(f"{option} {p} holds an earlier run ({shown}); {how}, or choose another {option}")
    found = [m for m in markers if (p / m).exists()]
    for m in found:
        target = p / m
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        else:
            target.unlink()
    return p
