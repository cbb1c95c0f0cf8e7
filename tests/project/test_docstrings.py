"""Every public function, class and method in ``src/attnlab`` has a docstring (issue 15).

The rule, checked on the source with :mod:`ast` (nothing is imported, so this test is fast and cannot be
fooled by a docstring set at run time):

- **Modules**: every ``.py`` file under ``src/attnlab``, except private modules (a file name starting with
  ``_``, other than ``__init__.py``, which is a package's public face) and anything inside a private
  package. ``cli/`` is included.
- **The module itself** has a docstring (a one-line summary of what the module owns, as in
  ``torch.nn.attention``): ruff checks that (D100, D104; ``tests/project/test_ruff.py``), no longer this audit.
  Ruff's D101/D103 check classes and functions too, but only the names a module's ``__all__`` lists, and
  its D102 cannot exempt overrides of documented attnlab methods: the rules below stay here.
- **Top level**: every function and class whose name does not start with ``_`` (found in the module
  body, and inside top-level ``if``/``try`` blocks). Names bound by assignment (aliases such as
  ``f = g``) are not checked; a function nested in another is private to it.
- **Methods**: every method of a public top-level class whose name does not start with ``_``. Exempt:
  - dunder methods (``__init__``, ``__call__``, ...): the class docstring documents construction and
    calling;
  - property setters and deleters (``@x.setter``, ``@x.deleter``): the getter's docstring covers them;
  - ``@overload`` stubs;
  - a method that overrides a *documented* method of the same name in a base class defined in attnlab
    (bases are looked up by their simple name across all parsed modules, transitively). Overriding a
    method of a class outside attnlab (``torch.nn.Module.forward``) is not exempt: ``forward`` is where
    a layer's tensor shapes are written.

Modules not yet brought up to the rule are listed in ``NOT_YET`` (a file, or a package directory ending
in ``/``), so the gap is visible and shrinks rather than being skipped silently. A ``NOT_YET`` entry
that no longer names a module fails the test; one whose modules are all complete is flagged by
``python tests/project/test_docstrings.py`` (not failed: an in-flight package may be complete today and gain an
undocumented function tomorrow, before its owner takes it off the list).

Run ``python tests/project/test_docstrings.py`` for the per-module counts.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "src" / "attnlab"

# Modules not yet held to the rule. Each entry is a path relative to src/attnlab; a trailing "/" covers a
# whole package. Shrink this set as modules are documented (`python tests/project/test_docstrings.py` flags
# entries that have become complete).
NOT_YET: set[str] = set()


def public_modules() -> list[Path]:
    """Every public module file under src/attnlab, sorted (see the module docstring for the rule)."""
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if any(part.startswith("_") for part in rel.parts[:-1]):
            continue
        if rel.name.startswith("_") and rel.name != "__init__.py":
            continue
        out.append(path)
    return out


def _defs(body):
    """Function and class definitions in a statement list, looking inside if/try blocks."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node
        elif isinstance(node, ast.If):
            yield from _defs(node.body)
            yield from _defs(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _defs(block)


def _last_name(node) -> str | None:
    """``b`` of ``a.b``, ``a`` of a bare name; None for anything else."""
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else None


def _decorator_names(fn) -> set[str]:
    names = (_last_name(d.func if isinstance(d, ast.Call) else d) for d in fn.decorator_list)
    return {n for n in names if n}


def _base_names(cls: ast.ClassDef) -> list[str]:
    # Generic[T], Protocol[...]: the subscripted name
    names = (_last_name(b.value if isinstance(b, ast.Subscript) else b) for b in cls.bases)
    return [n for n in names if n]


def _classes(trees) -> dict[str, list[ast.ClassDef]]:
    """Every top-level class in attnlab by simple name (private modules too: they can hold bases)."""
    out: dict[str, list[ast.ClassDef]] = {}
    for tree in trees.values():
        for node in _defs(tree.body):
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, []).append(node)
    return out


def _base_documents(cls: ast.ClassDef, method: str, classes, seen=None) -> bool:
    """True if some attnlab base of ``cls`` (transitively) defines ``method`` with a docstring."""
    seen = set() if seen is None else seen
    for name in _base_names(cls):
        if name in seen:
            continue
        seen.add(name)
        for base in classes.get(name, []):
            for node in base.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == method:
                    if ast.get_docstring(node):
                        return True
            if _base_documents(base, method, classes, seen):
                return True
    return False


def _parse_all() -> dict[Path, ast.Module]:
    return {p: ast.parse(p.read_text(), filename=str(p)) for p in sorted(ROOT.rglob("*.py"))}


def audit() -> dict[str, tuple[int, list[str]]]:
    """Per public module (path relative to src/attnlab): (number of public objects, undocumented names)."""
    trees = _parse_all()
    classes = _classes(trees)
    report = {}
    for path in public_modules():
        rel = path.relative_to(ROOT).as_posix()
        total, missing = 0, []  # the module docstring: ruff's D100/D104 (tests/project/test_ruff.py)
        for node in _defs(trees[path].body):
            if node.name.startswith("_"):
                continue
            total += 1
            if not ast.get_docstring(node):
                missing.append(node.name)
            if not isinstance(node, ast.ClassDef):
                continue
            for m in node.body:
                if not isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)) or m.name.startswith("_"):
                    continue
                decorators = _decorator_names(m)
                if decorators & {"setter", "deleter", "overload"}:
                    continue
                if _base_documents(node, m.name, classes):
                    continue
                total += 1
                if not ast.get_docstring(m):
                    missing.append(f"{node.name}.{m.name}")
        report[rel] = (total, missing)
    return report


def _not_yet(rel: str) -> str | None:
    for entry in NOT_YET:
        if rel == entry or (entry.endswith("/") and rel.startswith(entry)):
            return entry
    return None


def test_not_yet_entries_exist():
    modules = {p.relative_to(ROOT).as_posix() for p in public_modules()}
    stale = sorted(e for e in NOT_YET if not any(_not_yet(m) == e for m in modules))
    assert not stale, f"NOT_YET names modules that no longer exist; remove them: {stale}"


def test_every_public_name_has_a_docstring():
    report = audit()
    assert len(report) > 50, "the module walk found too few modules; is ROOT right?"
    gaps = {rel: missing for rel, (_, missing) in report.items() if missing and _not_yet(rel) is None}
    lines = [f"  {rel}: {', '.join(names)}" for rel, names in sorted(gaps.items())]
    assert not gaps, "public names without a docstring (see this test's docstring for the rule):\n" + "\n".join(lines)


if __name__ == "__main__":
    report = audit()
    total = sum(t for t, _ in report.values())
    documented = sum(t - len(m) for t, m in report.values())
    for rel, (t, missing) in report.items():
        flag = " (NOT_YET)" if _not_yet(rel) else ""
        print(f"{t - len(missing):4d} / {t:4d}  {rel}{flag}")
    print(f"{documented} of {total} public functions, classes and methods have a docstring")
    pending: dict[str, int] = {}
    for rel, (_, missing) in report.items():
        entry = _not_yet(rel)
        if entry is not None:
            pending[entry] = pending.get(entry, 0) + len(missing)
    done = sorted(e for e, n in pending.items() if n == 0)
    if done:
        print(f"NOT_YET entries now complete (remove them): {done}")
