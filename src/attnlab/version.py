"""attnlab's version, in a leaf module: it imports nothing from attnlab, so any layer may read it."""
from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

__all__ = ["__version__"]


def _version() -> str:
    """The installed distribution's version (pyproject.toml's ``[project] version``, the one source);
    a source tree on ``PYTHONPATH`` without an install reads that pyproject.toml itself."""
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    if pyproject.is_file() and (pyproject.parent / "src" / "attnlab").is_dir():  # a source checkout
        m = re.search(r'(?m)^version\s*=\s*"([^"]+)"', pyproject.read_text())
        if m:
            return m.group(1)
    try:
        return metadata.version("attnlab")
    except metadata.PackageNotFoundError:
        return "0+unknown"


__version__ = _version()
