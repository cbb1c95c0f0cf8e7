"""The bottom layers import nothing from above them (issue 22; STYLE.md: cli → instruments → nn → functional →
patterns/kernels/mechanisms, "nothing below imports from above").

Checked on the source with :mod:`ast`, every import statement of every file, at module level or inside a
function (a lazy ``from ..functional import kvcache`` is as much an upward edge as one at the top): ``kernels/``
may import only itself and the leaf modules under it (``patterns``, ``cpu``, ``caches``, ``report``), and the
package root only for ``__version__``; ``patterns/`` only itself. An import under ``if TYPE_CHECKING:`` runs
nothing and may name ``shapes`` (the prepared inputs the kernels read through their attributes).
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "src" / "attnlab"

#: {layer: the attnlab top-level packages / modules its files may import at run time}
ALLOWED = {
    "kernels": {"kernels", "patterns", "cpu", "caches", "report", "files", "version"},
    "patterns": {"patterns"},
}
#: what an ``if TYPE_CHECKING:`` block may import besides, per layer (annotations only: nothing runs)
TYPING_ONLY = {"kernels": {"shapes"}, "patterns": set()}
#: names a layer may take from the package root (``from .. import x``): constants, not submodules
ROOT_NAMES = {"__version__"}


def _target(rel: Path, level: int, module: str) -> list[str]:
    """The top-level attnlab names an import refers to: [package] for ``from ..pkg import x`` or ``import
    attnlab.pkg``, [] for a non-attnlab import, ["attnlab"] for the package root itself."""
    if level == 0:
        parts = module.split(".")
        if parts[0] != "attnlab":
            return []
        return [parts[1]] if len(parts) > 1 else ["attnlab"]
    base = list(rel.parts[:-1])[: max(0, len(rel.parts) - level)]
    parts = base + [m for m in module.split(".") if m]
    return [parts[0]] if parts else ["attnlab"]


def _typing_nodes(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside an ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``) block."""
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            t = node.test
            name = t.id if isinstance(t, ast.Name) else t.attr if isinstance(t, ast.Attribute) else None
            if name == "TYPE_CHECKING":
                for stmt in node.body:
                    inside |= {id(n) for n in ast.walk(stmt)}
    return inside


def upward_imports(root: Path = ROOT) -> set[str]:
    """'file:line: statement' for every import of a layer in ``ALLOWED`` that reaches outside what it may."""
    found = set()
    for layer, allowed in ALLOWED.items():
        for path in sorted((root / layer).rglob("*.py")):
            rel = path.relative_to(root)
            tree = ast.parse(path.read_text())
            typing = _typing_nodes(tree)
            for node in ast.walk(tree):
                may = allowed | (TYPING_ONLY[layer] if id(node) in typing else set())
                if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                    for target in _target(rel, node.level, node.module or ""):
                        names = [a.name for a in node.names]
                        if target == "attnlab":  # from .. import x: x is a constant or a top-level module
                            bad = [n for n in names if n not in ROOT_NAMES and n not in may]
                        else:
                            bad = names if target not in may else []
                        if bad:
                            found.add(f"{rel}:{node.lineno}: from {'.' * node.level}{node.module or ''} import "
                                      f"{', '.join(bad)}")
                elif isinstance(node, ast.Import):
                    for a in node.names:
                        for target in _target(rel, 0, a.name):
                            if target not in may:
                                found.add(f"{rel}:{node.lineno}: import {a.name}")
    return found


def test_bottom_layers_import_nothing_above_them():
    found = upward_imports()
    assert not found, ("upward imports (move the code down, or pass what it needs in from above):\n"
                       + "\n".join(sorted(found)))


def test_the_checker_sees_upward_imports(tmp_path):
    """The scan is not vacuous: each form of an upward import planted in a copy is found, the allowed ones not."""
    k = tmp_path / "kernels"
    k.mkdir()
    (tmp_path / "patterns").mkdir()
    (k / "ok.py").write_text(
        "from __future__ import annotations\nfrom typing import TYPE_CHECKING\nimport torch\n"
        "from .. import patterns as P\nfrom ..report import format_bytes\nfrom . import spec\n"
        "if TYPE_CHECKING:\n    from ..shapes import Prepared\n"
        "def f():\n    from .. import __version__\n    return __version__\n")
    (k / "bad.py").write_text(
        "from ..functional import kvcache\nimport attnlab.nn.attention\n"
        "def g():\n    from .. import functional\n    from attnlab.cli import main\n"
        "from ..shapes import prepare\n")
    (tmp_path / "patterns" / "p.py").write_text("from ..kernels import masks\n")
    assert upward_imports(tmp_path) == {
        "kernels/bad.py:1: from ..functional import kvcache", "kernels/bad.py:2: import attnlab.nn.attention",
        "kernels/bad.py:4: from .. import functional", "kernels/bad.py:5: from attnlab.cli import main",
        "kernels/bad.py:6: from ..shapes import prepare", "patterns/p.py:1: from ..kernels import masks"}
