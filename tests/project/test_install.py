"""The README's pip line installs attnlab into an environment that already has torch.

A fresh venv (no system site-packages) sees this interpreter's site-packages through a ``.pth`` path
entry, so torch, numpy and the rest are "already installed" as in a user's environment, while the
editable attnlab there stays invisible (a plain path entry does not run that directory's ``.pth``
hooks). The package is installed non-editable from a copy of the source tree, then ``attnlab --version``
and one attention call run from a folder outside the sources. ``ATTNLAB_NO_BUILD_EXT=1`` skips the C++
kernel (minutes on 2 cores; setup.py's fallback without it is the path under test here, and
tests/kernels covers the kernel).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _readme_pip_line() -> list[str]:
    text = (ROOT / "README.md").read_text()
    m = re.search(r"^pip install --no-build-isolation \.(?=\s)", text, re.M)
    assert m, "README.md lost its `pip install --no-build-isolation .` line"
    return m.group(0).split()


def _copy_sources(dest: Path) -> Path:
    skip = shutil.ignore_patterns(".git", ".venv", "build", "dist", "site", "reports", "__pycache__",
                                  "*.egg-info", "*.so", ".pytest_cache", ".hypothesis")
    src = dest / "attnlab-src"
    shutil.copytree(ROOT, src, ignore=skip)
    return src


def test_pip_install_from_the_readme_into_an_env_with_torch(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    py = venv / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    # torch (and pip, setuptools>=77, wheel, ninja, the dependencies) come from this interpreter's env
    (Path(purelib) / "host-env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    src = _copy_sources(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(ATTNLAB_NO_BUILD_EXT="1", PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1")

    pip = _readme_pip_line()  # ["pip", "install", "--no-build-isolation", "."]
    r = subprocess.run([str(py), "-m", *pip, "--no-index", "-q"], cwd=src, env=env,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    exe = venv / "bin" / "attnlab"
    assert exe.exists(), "the install made no `attnlab` console script"
    r = subprocess.run([str(exe), "--version"], cwd=outside, env=env, capture_output=True, text=True, timeout=120)
    version = re.search(r'(?m)^version\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert r.returncode == 0 and r.stdout.strip() == f"attnlab {version}", (r.stdout, r.stderr)

    code = (
        "import torch, attnlab, pathlib, sys\n"
        "q, k, v = (torch.randn(1, 2, 5, 8, dtype=torch.float64) for _ in range(3))\n"
        "out = attnlab.attention(q, k, v, is_causal=True)\n"
        "ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)\n"
        "assert torch.allclose(out, ref, rtol=1e-12, atol=1e-12), (out - ref).abs().max()\n"
        "print(pathlib.Path(attnlab.__file__).resolve(), attnlab.__version__)\n")
    r = subprocess.run([str(py), "-c", code], cwd=outside, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    where, got = r.stdout.split()
    assert Path(where).is_relative_to(venv.resolve()), f"attnlab imported from {where}, not the new venv"
    assert got == version
