"""Every course notebook (docs/notebooks/*.ipynb) runs top to bottom in a fresh kernel.

The notebooks check their own outputs: each claim is an ``assert`` in a cell, so a cell that raises
fails here with its source and traceback. The kernel is this interpreter (ipykernel), started in the
notebook's folder with the source tree first on its path, as a reader's Jupyter would run it.
``python tests/project/test_notebooks.py --write`` executes them and saves the outputs into the files
(what the docs site renders).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "docs" / "notebooks").glob("*.ipynb"))
TIMEOUT_S = 180  # per cell; each notebook runs in well under a minute on 2 idle cores


def execute(path: Path, timeout: int = TIMEOUT_S):
    """Run ``path`` in a fresh python3 kernel (cwd: its folder) and return the executed notebook."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    env = dict(os.environ, MPLBACKEND="module://matplotlib_inline.backend_inline", HF_HUB_OFFLINE="1",
               PYTHONWARNINGS="ignore", PYTHONPATH=os.pathsep.join(
                   [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=False,
                            resources={"metadata": {"path": str(path.parent)}})
    # kernel.json's "python" becomes this interpreter (jupyter_client's rule), so the kernel sees this env
    client.execute(env=env)
    return nb


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 5, NOTEBOOKS


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path):
    pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    nb = execute(path)
    code = [c for c in nb.cells if c.cell_type == "code"]
    asserts = sum("assert " in c.source for c in code)
    assert asserts >= 3, f"{path.name}: its outputs are checked by fewer than 3 cells with asserts"
    errors = [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    import nbformat

    for p in NOTEBOOKS:
        print(p.name, flush=True)
        nbformat.write(execute(p), p)
