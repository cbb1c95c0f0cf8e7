"""No module of attnlab reaches into another package's private names (issue 15).

Checked on the source with :mod:`ast`: ``from <other attnlab package> import _x`` and ``mod._x`` where
``mod`` names an attnlab module imported from another package (module level or inside a function).
Within one package (``patterns/bands.py`` using ``patterns/base.py``'s helpers) private names are fine.
Attribute access on objects (``pattern._x``) cannot be seen statically and is not checked here.
``KNOWN`` lists crossings owned by work in flight; it may only shrink.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "src" / "attnlab"

KNOWN: set = set()


def _package(rel: Path) -> str:
    """The top-level package (or module) of attnlab a file belongs to."""
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _target(rel: Path, level: int, module: str) -> str:
    """The top-level attnlab package an import refers to ('' for a non-attnlab import)."""
    if level == 0:
        parts = module.split(".")
        return parts[1] if parts[0] == "attnlab" and len(parts) > 1 else ("attnlab" if parts[0] == "attnlab" else "")
    base = list(rel.parts[:-1])[: max(0, len(rel.parts) - level)]
    parts = base + [m for m in module.split(".") if m]
    return parts[0] if parts else "attnlab"


def crossings() -> set[str]:
    found = set()
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        own = _package(rel)
        tree = ast.parse(path.read_text())
        modules = {}  # local name -> whether it is another package's module
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                target = _target(rel, node.level, node.module or "")
                if not target:
                    continue
                for a in node.names:
                    other = target != own
                    if a.name.startswith("_") and not a.name.startswith("__") and other:
                        found.add(f"{rel}: from {'.' * node.level}{node.module or ''} import {a.name}")
                    modules[a.asname or a.name] = other
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("attnlab.") and a.asname:
                        modules[a.asname] = a.name.split(".")[1] != own
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and modules.get(node.value.id)
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                found.add(f"{rel}: {node.value.id}.{node.attr}")
    return found


def test_no_private_names_cross_packages():
    new = crossings() - KNOWN
    assert not new, "private names used across packages (make a public, documented function):\n" + "\n".join(sorted(new))


def test_the_checker_sees_a_crossing(tmp_path, monkeypatch):
    """The scan is not vacuous: a planted crossing is found."""
    pkg = tmp_path / "attnlab"
    (pkg / "a").mkdir(parents=True)
    (pkg / "a" / "x.py").write_text("from ..b import _hidden\nimport attnlab.b.y as Y\nY._inner()\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", pkg)
    assert crossings() == {"a/x.py: from ..b import _hidden", "a/x.py: Y._inner"}
