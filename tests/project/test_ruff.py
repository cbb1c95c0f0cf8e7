"""``ruff check`` passes on the repository, with the rules in pyproject.toml's ``[tool.ruff]`` (issue 41).

They replace the module-docstring part of ``tests/project/test_docstrings.py`` (D100, D104) and check, besides,
syntax errors and broken-code pyflakes rules (E9, F63, F7), the docstrings of the public classes and functions that
``__all__`` lists (D101, D103) and private names imported from other distributions (PLC2701). The audits that ruff
cannot do stay hand-written: docstrings on every public method and every name without ``__all__``
(test_docstrings.py), private names across attnlab's own packages (test_private_names.py), the layers
(test_layers.py).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _ruff() -> list[str] | None:
    """The command that runs ruff: the module beside this Python (the `test` extra installs it), else a ruff on PATH."""
    try:
        import ruff  # noqa: F401
    except ImportError:
        exe = shutil.which("ruff")
        return [exe] if exe else None
    return [sys.executable, "-m", "ruff"]


def test_ruff_check_passes():
    cmd = _ruff()
    if cmd is None:
        pytest.skip("ruff is not installed (it is in the `test` extra: pip install -e '.[test]')")
    r = subprocess.run([*cmd, "check", "--no-cache", "--output-format", "concise", "."], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"ruff check found problems (rules: pyproject.toml [tool.ruff]):\n{r.stdout}{r.stderr}"


def test_ruff_sees_the_rules(tmp_path):
    """Not vacuous: the repository's configuration flags a planted module without a docstring."""
    cmd = _ruff()
    if cmd is None:
        pytest.skip("ruff is not installed (it is in the `test` extra: pip install -e '.[test]')")
    planted = tmp_path / "planted.py"
    planted.write_text("def public():\n    return 1\n")
    r = subprocess.run([*cmd, "check", "--no-cache", "--config", str(REPO / "pyproject.toml"), "--output-format",
                        "json", str(planted)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert {v["code"] for v in json.loads(r.stdout)} == {"D100", "D103"}
