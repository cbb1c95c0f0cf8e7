"""Patterns from text specs such as ``"sliding_window(64) | causal()"`` (literals only; no code is evaluated)."""
from __future__ import annotations

import ast

from .bands import causal, dilated, full, prefix_lm, sliding_window, strided
from .base import Pattern
from .blocks import bigbird, fixed, longformer
from .sequences import document, key_padding


#: most calls joined by & or | in one ``parse`` spec: each join is one level of a combined pattern
#: that is evaluated recursively
MAX_PARSE_TERMS = 256


def _clip(spec: str, n: int = 60) -> str:
    """The spec for a one-line message: its first n characters."""
    return repr(spec) if len(spec) <= n else repr(spec[:n]) + f"... ({len(spec)} characters)"


#: the constructors a spec may call, by name (in the order error messages list them)
CONSTRUCTORS = {f.__name__: f for f in (causal, sliding_window, dilated, strided, fixed, longformer, bigbird,
                                        key_padding, full, document, prefix_lm)}
_PARSEABLE = tuple(CONSTRUCTORS)


def parse(spec: str) -> Pattern:
    """Build a pattern from text such as ``"sliding_window(256, causal=True)"`` or
    ``"sliding_window(64) | causal()"`` (literal arguments only; no code is evaluated).

    Each call names one of ``CONSTRUCTORS`` (a bare name is a call with no arguments) and calls join
    with ``&`` and ``|``, at most ``MAX_PARSE_TERMS`` of them. The result is valid for any (L, S) the
    constructors allow. Raises ValueError naming the spec for anything else.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"pattern spec must be a non-empty string, got {spec!r}")
    terms = spec.count("&") + spec.count("|") + 1
    if terms > MAX_PARSE_TERMS:
        raise ValueError(f"pattern spec {_clip(spec)} joins {terms} terms with & or |; at most "
                         f"{MAX_PARSE_TERMS} are supported")
    try:
        tree = ast.parse(spec.strip(), mode="eval").body
    except SyntaxError as e:
        raise ValueError(f"cannot parse pattern {_clip(spec)}: {e.msg}") from None
    except (RecursionError, MemoryError):  # nesting such as ((((...)))) past the parser's limit
        raise ValueError(f"pattern spec {_clip(spec)} is nested too deeply to parse") from None

    def build(node):
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.BitAnd, ast.BitOr)):
            a, b = build(node.left), build(node.right)
            return a & b if isinstance(node.op, ast.BitAnd) else a | b
        if isinstance(node, ast.Name):
            node = ast.Call(func=node, args=[], keywords=[])
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            raise ValueError(f"pattern {spec!r}: expected calls like sliding_window(256) joined by & or |")
        name = node.func.id
        if name not in _PARSEABLE:
            raise ValueError(f"unknown pattern {name!r}; choose from {', '.join(_PARSEABLE)}")
        try:
            args = [ast.literal_eval(a) for a in node.args]
            kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        except ValueError:
            raise ValueError(f"pattern {spec!r}: arguments must be literals") from None
        return CONSTRUCTORS[name](*args, **kwargs)

    return build(tree)
