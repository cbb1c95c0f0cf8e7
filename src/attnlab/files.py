"""Atomic file writes and byte sizes, in a leaf module: it imports nothing from attnlab, so the core (kernels,
functional, shapes) writes and formats through it without importing an instrument (``attnlab.report``
re-exports these names)."""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

__all__ = ["format_bytes", "atomic_write_bytes", "atomic_write_text", "atomic_write_json"]


def format_bytes(n: float | None, digits: int = 3) -> str:
    """1536 -> '1.5 KiB' (binary units, ``digits`` significant digits); None -> '—'."""
    if n is None:
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024:
            return f"{n:.{digits}g} {unit}"
        n /= 1024
    return f"{n:.{digits}g} EiB" if abs(n) < 1e4 else f"{n * 2**60:.{digits}g} B"  # past 10^4 EiB: plain bytes


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write to a temporary file in the same folder, fsync, then rename over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; reports are for everyone to read
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` as UTF-8 to ``path`` atomically (see :func:`atomic_write_bytes`); returns the path."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    """Write ``obj`` as indented JSON to ``path`` atomically; returns the path. Tensors and arrays become
    lists (``tolist()``), dataclasses dicts, anything else that JSON cannot hold its ``str``."""
    return atomic_write_text(path, json.dumps(obj, indent=2, default=_json_default) + "\n")


def _json_default(o):
    if hasattr(o, "tolist"):
        return o.tolist()
    if hasattr(o, "__dataclass_fields__"):
        return asdict(o)
    return str(o)
