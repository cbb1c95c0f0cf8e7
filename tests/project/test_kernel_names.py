"""No module outside ``kernels/`` switches on a kernel's name (issue 22, "one door per kernel").

functional/, nn/ and mechanisms/ reach a kernel through its object (``plan.kernel.run``, ``Kernel``
capabilities, the planner's rules); a kernel name written there as a string literal is a switch coming
back (``m == "compiled"``, ``if method in ("tiled", "sparse")``, ``refused["sdpa"]``). The one use left
is a user-facing method passed through as a keyword argument (``attention(..., method="dense")``).
Names are read from the code's tokens, so docstrings and comments may still mention kernels.
"""
from __future__ import annotations

import io
import tokenize
from pathlib import Path

import attnlab
from attnlab import kernels

ROOT = Path(attnlab.__file__).parent
PACKAGES = ("functional", "nn", "mechanisms")
NAMES = {k.name for k in kernels.KERNELS}


def _switches(source: str) -> list[tuple[int, str]]:
    """(line, code) of every kernel-name string literal that is not a keyword argument's value."""
    toks = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
            if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT)]
    out = []
    for i, t in enumerate(toks):
        if t.type != tokenize.STRING:
            continue
        try:
            value = eval(t.string, {})  # a plain literal ("sdpa", 'tiled'); f-strings and bytes are not names
        except Exception:
            continue
        if value not in NAMES:
            continue
        prev, prev2 = (toks[i - 1] if i else None), (toks[i - 2] if i > 1 else None)
        keyword_arg = prev is not None and prev.string == "=" and prev2 is not None and prev2.type == tokenize.NAME
        if not keyword_arg:
            out.append((t.start[0], t.line.strip()))
    return out


def test_the_detector_finds_switches():
    bad = 'if m == "compiled":\n    pass\nx = refused["sdpa"]\nif k in ("tiled", "dense"): pass\n'
    assert [line for line, _ in _switches(bad)] == [1, 3, 4, 4]
    ok = 'attention(q, k, v, method="dense")\n"""the compiled kernel"""\n# m == "sparse"\n'
    assert _switches(ok) == []


def test_no_kernel_name_switches_outside_kernels():
    found = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            found += [f"{path.relative_to(ROOT)}:{line}: {code}" for line, code in _switches(path.read_text())]
    assert not found, "kernel names switched on outside kernels/ (use the kernel objects):\n" + "\n".join(found)
