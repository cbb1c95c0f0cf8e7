"""The abstract values of Note [score_mod by its trace] (``functional.flex_trace``): what a traced score_mod's
nodes are in the score (``_S``: A·score + bias) and in the indices (``_B``: a linear form in b, h, q_idx, kv_idx
and the atoms it reads), and each operation's rule on them.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.fx

# -- abstract values --------------------------------------------------------------------------------------
_ALL = frozenset({"b", "h", "q", "k", "*"})  # "*": not element-wise in the indices (no table per offset)


@dataclass(frozen=True)
class _B:
    """A value that does not depend on the score: the index atoms it may depend on, an exact integer
    combination ``lin = (a, c, d)`` meaning a·q_idx + c·kv_idx + d (None: not known to be one), ``const`` its
    value where it is one number everywhere, ``grad`` whether it reads a tensor that requires grad."""

    atoms: frozenset = frozenset()
    lin: tuple | None = None
    const: float | None = None
    grad: bool = False


@dataclass(frozen=True)
class _S:
    """A value that depends on the score: ``A·s + bias`` ("aff") or ``c·tanh(A·s) + bias`` ("cap")."""

    form: str
    A: float
    c: float
    bias: _B


@dataclass(frozen=True)
class _G:
    """General: what made it so."""

    why: str


class _Meta:
    """dtype, shape, device of a traced value: not a value of the grid."""


_META = _Meta()
_ZERO = _B(lin=(0, 0, 0), const=0.0)


def _atoms(v: _B) -> frozenset:
    if v.lin is None:
        return v.atoms
    a, c, _ = v.lin
    if a == 0 and c == 0:
        return frozenset()
    if a == -c:
        return frozenset({"off"})
    return frozenset(({"q"} if a else set()) | ({"k"} if c else set()))


def _number(x) -> _B:
    x = float(x) if not isinstance(x, bool) else float(int(x))
    lin = (0, 0, int(x)) if math.isfinite(x) and x.is_integer() and abs(x) < 2**53 else None
    return _B(lin=lin, const=x)


def _join(*vals, extra: frozenset = frozenset()) -> _B:
    """A value computed element-wise from ``vals`` (biases): their atoms, their grad."""
    atoms, grad = set(extra), False
    for v in vals:
        if isinstance(v, _B):
            atoms |= _atoms(v)
            grad |= v.grad
    return _B(frozenset(atoms), grad=grad)


def _opaque(*vals) -> _B:
    """A value computed from ``vals`` by an operation not known to be element-wise: every index if any."""
    j = _join(*vals)
    return _B(_ALL if j.atoms else frozenset(), grad=j.grad)


def _integral(v) -> int | None:
    if isinstance(v, _B) and v.const is not None and not v.grad and v.lin is not None:
        return v.lin[2]
    return None


def _badd(x: _B, y: _B, sign: int = 1) -> _B:
    lin = None
    if x.lin is not None and y.lin is not None:
        lin = tuple(a + sign * b for a, b in zip(x.lin, y.lin))
    const = x.const + sign * y.const if x.const is not None and y.const is not None else None
    j = _join(x, y)
    return _B(j.atoms if lin is None else frozenset(), lin, const, j.grad)


def _bmul(x: _B, y: _B) -> _B:
    lin = None
    kx, ky = _integral(x), _integral(y)
    if x.lin is not None and ky is not None:
        lin = tuple(a * ky for a in x.lin)
    elif y.lin is not None and kx is not None:
        lin = tuple(a * kx for a in y.lin)
    const = x.const * y.const if x.const is not None and y.const is not None else None
    j = _join(x, y)
    return _B(j.atoms if lin is None else frozenset(), lin, const, j.grad)


def _bscale(x: _B, k: float) -> _B:
    """x·k for a known number k (the bias of a scaled affine or capped form)."""
    return _bmul(x, _number(k))


def _bneg(x: _B) -> _B:
    return _bmul(x, _number(-1))


def _factor(v) -> float | None:
    """The number v is, when it is a known number read from no tensor that requires grad."""
    return v.const if isinstance(v, _B) and v.const is not None and not v.grad else None


def _s_add(x: _S, y, sign=1):
    """x + sign·y for x depending on the score."""
    if isinstance(y, _B):
        return _S(x.form, x.A, x.c, _badd(x.bias, y, sign))
    if x.form == "aff" and y.form == "aff":
        return _S("aff", x.A + sign * y.A, 1.0, _badd(x.bias, y.bias, sign))
    return _G("a sum of two soft-capped scores")


def _s_neg(x: _S) -> _S:
    return _S(x.form, -x.A if x.form == "aff" else x.A, -x.c if x.form == "cap" else x.c, _bneg(x.bias))


def _s_scale(x: _S, k: float) -> _S:
    return _S(x.form, x.A * k if x.form == "aff" else x.A, x.c * k if x.form == "cap" else x.c, _bscale(x.bias, k))


def _s_where(cond, x, y, what):
    if not isinstance(cond, _B):
        return _G(f"{what} with a condition that reads the score")
    if isinstance(x, _B) and isinstance(y, _B):
        const = x.const if x.const is not None and x.const == y.const else None
        j = _join(cond, x, y)
        return _B(j.atoms, None, const, j.grad)
    for a, b in ((x, y), (y, x)):  # a mask written as a score_mod: one branch -inf everywhere
        if isinstance(a, _S) and isinstance(b, _B) and b.const == -math.inf:
            j = _join(cond, a.bias, b)
            return _S(a.form, a.A, a.c, _B(j.atoms, grad=j.grad))
    if isinstance(x, _S) and isinstance(y, _S) and x.form == y.form and x.A == y.A and x.c == y.c:
        j = _join(cond, x.bias, y.bias)
        const = x.bias.const if x.bias.const is not None and x.bias.const == y.bias.const else None
        return _S(x.form, x.A, x.c, _B(j.atoms, None, const, j.grad))
    return _G(f"{what} picks between scores of different forms or factors")


# -- operations, by name ------------------------------------------------------------------------------------
_OPERATORS = {operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.truediv: "div",
              operator.neg: "neg", operator.pos: "pos", operator.getitem: "getitem", operator.floordiv: "floordiv",
              operator.mod: "mod", operator.pow: "pow", operator.and_: "and", operator.or_: "or",
              operator.xor: "xor", operator.invert: "invert", operator.abs: "abs", operator.eq: "eq",
              operator.ne: "ne", operator.lt: "lt", operator.le: "le", operator.gt: "gt", operator.ge: "ge",
              getattr: "getattr"}
_ALIASES = {"subtract": "sub", "multiply": "mul", "divide": "div", "true_divide": "div", "negative": "neg",
            "positive": "pos", "absolute": "abs", "clip": "clamp", "greater_equal": "ge", "greater": "gt",
            "less_equal": "le", "less": "lt", "not_equal": "ne", "bitwise_and": "and", "bitwise_or": "or",
            "bitwise_xor": "xor", "bitwise_not": "invert", "logical_not": "invert_bool"}
_DUNDER = {"add": "add", "sub": "sub", "mul": "mul", "truediv": "div", "div": "div", "neg": "neg", "pos": "pos",
           "getitem": "getitem", "floordiv": "floordiv", "mod": "mod", "pow": "pow", "and": "and", "or": "or",
           "xor": "xor", "invert": "invert", "abs": "abs", "eq": "eq", "ne": "ne", "lt": "lt", "le": "le",
           "gt": "gt", "ge": "ge"}
_COMPARE = {"eq", "ne", "lt", "le", "gt", "ge"}
#: element-wise on every operand (biases keep their operands' atoms)
_ELEMENTWISE = {"abs", "sign", "sgn", "floor", "ceil", "round", "trunc", "frac", "exp", "exp2", "expm1", "log",
                "log2", "log10", "log1p", "sqrt", "rsqrt", "sigmoid", "sin", "cos", "tan", "asin", "acos", "atan",
                "sinh", "cosh", "tanh", "asinh", "acosh", "atanh", "erf", "erfc", "reciprocal", "square", "pow",
                "float_power", "floordiv", "floor_divide", "mod", "remainder", "fmod", "and", "or", "xor", "invert",
                "invert_bool", "logical_and", "logical_or", "logical_xor", "clamp", "clamp_min", "clamp_max",
                "minimum", "maximum", "fmin", "fmax", "isnan", "isinf", "isfinite", "isneginf", "isposinf",
                "nan_to_num", "to", "type_as", "float", "double", "half", "bfloat16", "long", "int", "short", "bool",
                "contiguous", "clone", "detach", "atan2", "hypot", "copysign", "signbit", "where", "masked_fill",
                "add", "sub", "mul", "div", "neg", "pos", "eq", "ne", "lt", "le", "gt", "ge", "rsub",
                "bucketize"}
#: keep the form of a value that depends on the score
_COPIES = {"clone", "contiguous"}
_META_ATTRS = {"dtype", "device", "shape", "ndim", "is_cuda", "layout", "requires_grad"}
_META_METHODS = {"size", "dim", "numel", "ndimension", "is_floating_point", "element_size", "nelement"}


def _op_name(node: torch.fx.Node) -> tuple[str | None, bool]:
    """(canonical name, operands swapped) of a call node: ``__radd__`` is add with its operands swapped."""
    t = node.target
    if node.op == "call_function":
        if t in _OPERATORS:
            return _OPERATORS[t], False
        name = getattr(t, "__name__", None)
        if name and getattr(torch, name, None) is t:
            return _ALIASES.get(name, name), False
        return None, False
    name = str(t)
    if name.startswith("__r") and name.endswith("__") and name[3:-2] in _DUNDER:
        return _DUNDER[name[3:-2]], True
    if name.startswith("__") and name.endswith("__") and name[2:-2] in _DUNDER:
        return _DUNDER[name[2:-2]], False
    if name.endswith("_") and not name.startswith("_"):  # in place: a write, not a value
        return None, False
    return _ALIASES.get(name, name), False


def _eval(name: str, args: list, kwargs: dict, node: torch.fx.Node):
    """The abstract value of one operation (Note [score_mod by its trace])."""
    vals = list(args) + list(kwargs.values())
    scored = [v for v in vals if isinstance(v, (_S, _G))]
    for v in vals:
        if isinstance(v, _G):
            return v
    if name == "getattr":
        return _META if len(args) == 2 and args[1] in _META_ATTRS else (
            _G(f"attribute {args[1]!r} of the score") if scored else _opaque(*args))
    if name in _META_METHODS:
        return _META
    if name in ("full_like", "zeros_like", "ones_like"):  # the value ignores its argument's values
        fill = {"zeros_like": _number(0), "ones_like": _number(1)}.get(name)
        if fill is None:
            fill = args[1] if len(args) > 1 else kwargs.get("fill_value")
        return fill if isinstance(fill, _B) and fill.const is not None else _opaque(*args[1:])
    if name == "masked_fill" and len(args) == 3:
        return _s_where(args[1], args[2], args[0], "masked_fill")
    if name == "where" and len(args) == 3 and not kwargs:
        # torch.where(cond, x, y) is a function; x.where(cond, y) a method, its receiver first
        cond, x, y = (args[0], args[1], args[2]) if node.op == "call_function" else (args[1], args[0], args[2])
        return _s_where(cond, x, y, "where")
    if scored:
        return _score_op(name, args, kwargs)
    return _bias_op(name, args, kwargs, node)


def _score_op(name, args, kwargs):
    """An operation on a value that depends on the score (Note [score_mod by its trace])."""
    if name in _COPIES and len(args) == 1 and not kwargs:
        return args[0]
    if kwargs:
        return _G(f"{name} with keyword arguments {sorted(kwargs)} on the score")
    if name in ("add", "sub") and len(args) == 2:
        x, y = args
        if isinstance(x, _B) and name == "sub":  # bias - score
            return _s_add(_s_neg(y), x)
        if not isinstance(x, _S):
            x, y = y, x
        return _s_add(x, y, 1 if name == "add" else -1) if isinstance(y, (_S, _B)) else _G(f"{name} of a non-value")
    if name == "neg" and len(args) == 1:
        return _s_neg(args[0])
    if name == "pos" and len(args) == 1:
        return args[0]
    if name == "mul" and len(args) == 2:
        x, y = args if isinstance(args[0], _S) else (args[1], args[0])
        k = _factor(y)
        if isinstance(y, _S):
            return _G("a product of two values that depend on the score")
        if k is None:
            return _G("the score times a value that is not one known number (an index, a table, a tensor that "
                      "requires grad)")
        return _s_scale(x, k)
    if name == "div" and len(args) == 2:
        x, y = args
        if not isinstance(x, _S):
            return _G("a number divided by the score")
        k = _factor(y)
        if k is None or k == 0:
            return _G("the score divided by a value that is not one known nonzero number")
        return _s_scale(x, 1.0 / k)
    if name == "tanh" and len(args) == 1:
        x = args[0]
        if x.form == "aff" and x.bias.const == 0.0:
            return _S("cap", x.A, 1.0, _ZERO)
        return _G("tanh of a score with a bias or already capped")
    return _G(f"{name} applied to the score")


def _bias_op(name, args, kwargs, node):
    """An operation on values that do not depend on the score: which indices the result depends on."""
    if name == "getitem" and len(args) == 2:
        base, idx = args
        idx = idx if isinstance(idx, tuple) else (idx,)
        if isinstance(base, _B) and not _atoms(base) and all(isinstance(i, _B) for i in idx):
            j = _join(*idx)  # a captured table gathered at index values: element-wise in them
            return _B(j.atoms, grad=j.grad or base.grad)
        return _opaque(base, *[i for i in idx if isinstance(i, _B)])
    if len(args) == 2 and not kwargs and all(isinstance(a, _B) for a in args):
        x, y = args
        if name == "add":
            return _badd(x, y)
        if name == "sub":
            return _badd(x, y, -1)
        if name == "rsub":
            return _badd(y, x, -1)
        if name == "mul":
            return _bmul(x, y)
        if name in _COMPARE:
            if x.lin is not None and y.lin is not None:  # x op y <=> x - y op 0, exact on integers
                d = _badd(x, y, -1)
                return _B(_atoms(d), grad=x.grad or y.grad)
            return _join(x, y)
    if name == "neg" and len(args) == 1 and isinstance(args[0], _B) and not kwargs:
        return _bneg(args[0])
    if name in _ELEMENTWISE:
        return _join(*args, *kwargs.values())
    return _opaque(*args, *kwargs.values())


def _map_arg(a, env):
    if isinstance(a, torch.fx.Node):
        return env[a]
    if isinstance(a, (tuple, list)):
        return tuple(_map_arg(x, env) for x in a)
    if isinstance(a, (bool, int, float)):
        return _number(a)
    return a  # a literal: None, a slice, a dtype, a string


def _tensor_value(t: torch.Tensor) -> _B:
    """A captured tensor: a known number when 0-d and not requiring grad, else a table (no index atoms)."""
    if t.dim() == 0 and not t.requires_grad and t.device.type != "meta":
        try:
            x = t.item()
        except Exception:  # noqa: BLE001 - a tensor without a value: not a known number
            return _B(grad=t.requires_grad)
        if isinstance(x, (bool, int, float)):
            return _number(x)
    return _B(grad=t.requires_grad)


def _analyse(graph: torch.fx.Graph, tensors: dict) -> object:
    """The abstract value of the graph's output (Note [score_mod by its trace])."""
    env = {}
    seeds = [_S("aff", 1.0, 1.0, _ZERO), _B(frozenset({"b"})), _B(frozenset({"h"})), _B(lin=(1, 0, 0)),
             _B(lin=(0, 1, 0))]
    out = None
    for node in graph.nodes:
        if node.op == "placeholder":
            env[node] = seeds[len(env)] if len(env) < 5 else _G("more than five arguments")
        elif node.op == "get_attr":
            env[node] = _tensor_value(tensors[node.target])
        elif node.op in ("call_function", "call_method"):
            name, swapped = _op_name(node)
            args = [_map_arg(a, env) for a in node.args]
            kwargs = {k: _map_arg(v, env) for k, v in node.kwargs.items()}
            if swapped:
                args = args[::-1]
            if name is None:
                bad = [v for v in args + list(kwargs.values()) if isinstance(v, (_S, _G))]
                env[node] = bad[0] if bad and isinstance(bad[0], _G) else (
                    _G(f"{node.target} on the score") if bad else _opaque(*args, *kwargs.values()))
            else:
                env[node] = _eval(name, args, kwargs, node)
        elif node.op == "output":
            out = _map_arg(node.args[0], env)
        else:
            return _G(f"a {node.op} node ({node.target})")
    return out
