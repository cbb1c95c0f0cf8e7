"""The layers import nothing from above them (issue 22; STYLE.md: cli → instruments → nn → functional →
patterns/kernels/mechanisms, "nothing below imports from above").

Checked on the source with :mod:`ast`, every import statement of every file, at module level or inside a
function (a lazy ``from ..functional import kvcache`` is as much an upward edge as one at the top): ``kernels/``
may import only itself and the leaf modules under it (``patterns``, ``cpu``, ``caches``, ``report``), and the
package root only for ``__version__``; ``patterns/`` only itself. An import under ``if TYPE_CHECKING:`` runs
nothing and may name ``shapes`` (the prepared inputs the kernels read through their attributes).

The whole package (issue 41; ``python tests/project/test_layers.py`` prints the counts): no alias modules (a module
that only re-exports another), no import circles, no import that climbs to a higher layer (``RANKS``), and at most
``MAX_FUNCTION_IMPORTS`` function-level imports of attnlab modules, each with a one-line comment giving its reason
(it breaks a cycle, defers a heavy optional dependency, or keeps ``import attnlab`` or the CLI's start light).
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


# -- the whole package: alias modules, import circles, imports climbing back up, function-level imports -----------
# (issue 41). ``python tests/project/test_layers.py`` prints the counts and every finding.

#: the layers, low to high (docs/architecture.md). ``shapes`` sits above ``kernels`` (it builds the prepared call
#: from kernels' specs; kernels read it only under TYPE_CHECKING); the leaves import nothing from attnlab above them.
RANKS = {
    **dict.fromkeys(("cpu", "patterns", "caches", "files", "version", "timing", "reference", "resources"), 0),
    "kernels": 1,
    "shapes": 2,
    **dict.fromkeys(("functional", "probe", "attnlab"), 3),  # "attnlab": the package root, the public API
    **dict.fromkeys(("nn", "positional", "mechanisms"), 4),
    **dict.fromkeys(("integrations", "models", "distributed"), 5),
    **dict.fromkeys(("trace", "viz", "bench", "experiments", "capture", "serve", "verify", "diagnostics", "harness",
                     "data", "report", "sysinfo", "conformance", "retrieval", "tour"), 6),
    "cli": 7,
}
#: upward imports in files other work is rewriting (issue 41's cheap mends could not edit them); may only shrink
KNOWN_UPWARD: set = set()
#: at most this many function-level imports of attnlab modules (issue 41), each with a one-line reason comment
MAX_FUNCTION_IMPORTS = 80
#: function-level imports still without a reason comment, per module, in files other work is rewriting (issue 41's
#: cheap mends could not edit them); the counts may only shrink
KNOWN_BARE: dict = {}


def _modname(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["attnlab", *parts])


def _function_nodes(tree: ast.AST) -> set[int]:
    """ids of every node inside a function body (any depth)."""
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for stmt in node.body:
                inside |= {id(n) for n in ast.walk(stmt)}
    return inside


def _resolve(name: str, is_pkg: bool, node, modules: set[str]) -> list[str]:
    """The attnlab modules an import statement loads (a ``from pkg import sub`` names the submodule)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name == "attnlab" or a.name.startswith("attnlab.")]
    if node.level:
        base = (name if is_pkg else name.rsplit(".", 1)[0]).split(".")
        base = base[: len(base) - (node.level - 1)]
        mod = ".".join(base + ([node.module] if node.module else []))
    else:
        mod = node.module or ""
    if mod != "attnlab" and not mod.startswith("attnlab."):
        return []
    return [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]


def scan(root: Path = ROOT) -> dict:
    """The package's imports, read with :mod:`ast`: {module: path}, module-level and function-level edges (run-time
    imports only: ``if TYPE_CHECKING:`` runs nothing) and the function-level import statements of attnlab modules as
    (module, line, has a reason comment)."""
    paths = {_modname(p, root): p for p in sorted(root.rglob("*.py"))}
    modules = set(paths)
    top_edges: dict[str, set[str]] = {m: set() for m in modules}
    fn_edges: dict[str, set[str]] = {m: set() for m in modules}
    fn_imports = []
    for name, path in paths.items():
        source = path.read_text()
        lines = source.splitlines()
        tree = ast.parse(source)
        typing, inside = _typing_nodes(tree), _function_nodes(tree)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in typing:
                continue
            targets = _resolve(name, path.name == "__init__.py", node, modules)
            if not targets:
                continue
            (fn_edges if id(node) in inside else top_edges)[name].update(t for t in targets if t != name)
            if id(node) in inside:
                fn_imports.append((name, node.lineno, _has_reason(lines, node)))
    return {"paths": paths, "top": top_edges, "fn": fn_edges, "fn_imports": fn_imports}


def _is_import_line(line: str) -> bool:
    s = line.strip()
    return s.startswith(("import ", "from ")) or s.startswith(")") or s.endswith(",")


def _has_reason(lines: list[str], node) -> bool:
    """A comment on the import's lines, or on the line above it or above the run of imports it belongs to."""
    if any("#" in lines[i] for i in range(node.lineno - 1, node.end_lineno)):
        return True
    i = node.lineno - 2
    while i >= 0 and _is_import_line(lines[i]) and "#" not in lines[i]:
        i -= 1
    return i >= 0 and lines[i].strip().startswith("#")


def alias_modules(root: Path = ROOT) -> list[str]:
    """Modules (not packages) that only re-export another: no function or class of their own (a module
    ``__getattr__``/``__dir__`` forwarder does not count as one) and at least one attnlab import."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                and n.name not in ("__getattr__", "__dir__")]
        imports = [n for n in tree.body if isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").startswith("attnlab"))]
        if not defs and imports:
            found.append(path.relative_to(root).as_posix())
    return found


def _ancestor(module: str, other: str) -> bool:
    return module.startswith(other + ".")


def import_circles(s: dict | None = None) -> list[list[str]]:
    """Strongly connected groups (more than one module) of the run-time import graph. An import of a package is an
    edge to its ``__init__``; a function-level import of an ancestor package is left out (the ancestor is imported,
    whole, before any of its modules' functions can run)."""
    s = s or scan()
    graph = {m: s["top"][m] | {t for t in s["fn"][m] if not _ancestor(m, t)} for m in s["paths"]}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "attnlab"


def climbing_imports(s: dict | None = None) -> set[str]:
    """'a.b -> c' for every module whose run-time imports (module or function level) reach a higher layer."""
    s = s or scan()
    found = set()
    for m in s["paths"]:
        for t in s["top"][m] | s["fn"][m]:
            if RANKS[_layer(m)] < RANKS[_layer(t)]:
                found.add(f"{m.removeprefix('attnlab.')} -> {t.removeprefix('attnlab.') if '.' in t else t}")
    return found


def test_every_top_level_module_has_a_layer():
    assert not {_layer(m) for m in scan()["paths"]} - set(RANKS), "add the new top-level module to RANKS"


def test_no_alias_modules():
    assert alias_modules() == [], "modules that only re-export another: import the real module instead"


def test_no_import_circles():
    circles = import_circles()
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_no_import_climbs_back_up():
    found = climbing_imports()
    new, gone = found - KNOWN_UPWARD, KNOWN_UPWARD - found
    assert not new, "imports that climb to a higher layer (RANKS):\n" + "\n".join(sorted(new))
    assert not gone, f"KNOWN_UPWARD entries fixed: take them off the list: {sorted(gone)}"


def test_function_level_imports_are_few_and_say_why():
    fn = scan()["fn_imports"]
    counts: dict[str, int] = {}
    for m, _, reason in fn:
        counts[m] = counts.get(m, 0) + (not reason)
    bare = [f"{m}:{line}" for m, line, reason in fn if not reason and counts[m] > KNOWN_BARE.get(m, 0)]
    assert len(fn) <= MAX_FUNCTION_IMPORTS, f"{len(fn)} function-level imports of attnlab modules (at most " \
                                            f"{MAX_FUNCTION_IMPORTS}): move them to the top of the module"
    assert not bare, ("function-level imports without a one-line reason comment (breaks a cycle, defers a heavy "
                      "optional dependency, keeps `import attnlab` fast):\n" + "\n".join(bare))


def test_the_package_checks_see_what_they_count(tmp_path):
    """Not vacuous: a planted alias, circle, upward import and bare function-level import are each found."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "cli").mkdir()
    for pkg in ("", "kernels", "cli"):
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "cpu.py").write_text('"""alias"""\nfrom .kernels.a import *\n')
    (tmp_path / "kernels" / "a.py").write_text("from . import b\ndef f():\n    from ..cli import main\n")
    (tmp_path / "kernels" / "b.py").write_text("def g():\n    # breaks a cycle\n    from . import a\n")
    (tmp_path / "cli" / "main.py").write_text("")
    s = scan(tmp_path)
    assert alias_modules(tmp_path) == ["cpu.py"]
    assert import_circles(s) == [["attnlab.kernels.a", "attnlab.kernels.b"]]
    assert climbing_imports(s) == {"cpu -> kernels.a", "kernels.a -> cli.main"}
    assert [(m, line, r) for m, line, r in s["fn_imports"]] == [("attnlab.kernels.a", 3, False),
                                                                ("attnlab.kernels.b", 3, True)]


if __name__ == "__main__":
    s = scan()
    fn = s["fn_imports"]
    print(f"alias modules: {len(alias_modules())} {alias_modules()}")
    print(f"import circles: {len(import_circles(s))} {import_circles(s)}")
    up = sorted(climbing_imports(s))
    print(f"imports climbing back up: {len(up)}")
    for u in up:
        print(f"  {u}{'  (KNOWN)' if u in KNOWN_UPWARD else ''}")
    print(f"function-level imports of attnlab modules: {len(fn)} (without a reason: {sum(not r for *_, r in fn)})")
    counts: dict[str, int] = {}
    for m, _, _ in fn:
        counts[m] = counts.get(m, 0) + 1
    for m, k in sorted(counts.items(), key=lambda kv: -kv[1]):
        print(f"  {k:3d} {m}")
