"""A FlexAttention ``score_mod`` classified from its torch.fx trace: identity, affine, soft-capping, relative bias.

Legend: s the score, b h q k the index arguments (batch, head, q_idx, kv_idx), A a score factor, c a cap's
outer factor, off the offset kv_idx - q_idx.

Note [score_mod by its trace]: ``score_mod(s, b, h, q_idx, kv_idx)`` is traced once with torch.fx (symbolic
proxies for all five arguments, as FlexAttention traces its mods before compiling them: no values, so no
pair can be missed), and its graph is read by an abstract interpretation that keeps, for every node, what it
is as a function of the score and of the indices:

- a *bias* (independent of s): which index atoms it may depend on (b, h, q, k, or ``off``: q and k only
  through kv_idx - q_idx), whether it is an exact integer combination ``a·q + c·k + d`` of the indices, whether
  it is a known number, and whether it reads a tensor that requires grad;
- ``A·s + bias`` (affine), A a known number;
- ``c·tanh(A·s) + bias`` (soft-capping), c and A known numbers;
- anything else: *general*.

Only operations whose meaning is known move a value between these forms: + - * / by numbers, tanh, where /
masked_fill with an index-only condition (both branches of one form and factor, or one branch -inf: a mask
written as a score_mod), clone. Any other operation on a value that depends on s makes it general (a clamp, a
comparison with s, a factor read from a table, a factor that requires grad). On biases, element-wise
operations keep the atoms of their operands; a difference of exact integer combinations whose q and k
coefficients cancel (``q - k``, ``k - q``, ``q >= k``) depends on ``off`` only; indexing a captured tensor
by index values depends on the atoms of the indices (``T[q, k]``: q and k, never ``off``); an operation not
known to be element-wise on index values depends on every index (no relative table). So a departure at one
isolated (q_idx, kv_idx) pair, ``s * T[q, k]`` or ``where((q == 7) & (k == 13), 4 * s, s)``, is general: the
form of the whole function is proved, not sampled. A relative bias is one whose atoms are within {h, off}:
a table per (head, offset) equals it at every pair. A score_mod that cannot be traced (Python control flow on
an index or on the score, ``int(q)``, a non-torch function) is general: the exact path, slower and right.

What the trace does not see, and the answer to it: values a score_mod reads from Python state (closure
cells, globals) are baked into the trace as constants. The classification is kept per score_mod object with a
snapshot of those (Note [Classified once per score_mod]) and made again when the snapshot differs.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import operator
import types
import weakref
from dataclasses import dataclass

import torch
import torch.fx

__all__ = ["ScoreModKind", "classify_score_mod"]


@dataclass(frozen=True)
class ScoreModKind:
    """What a score_mod is, proved from its trace (Note [score_mod by its trace]): ``kind`` is "none",
    "identity", "affine", "softcap" or "general"; ``factor`` the constant A folded into ``scale`` (affine
    ``A·score + bias``; soft-capping ``cap·tanh(A·score) + bias`` has factor A·cap); ``softcap`` the cap;
    ``has_bias`` whether the bias is not proved 0; ``relative`` whether the bias is proved a function of
    (h, kv_idx - q_idx) only; ``reads_grad`` whether the bias reads a tensor that requires grad; ``reason``
    in words."""

    kind: str
    reason: str
    factor: float = 1.0
    softcap: float | None = None
    has_bias: bool = False
    reads_grad: bool = False
    relative: bool = False


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


# -- tracing ---------------------------------------------------------------------------------------------
class _Proxy(torch.fx.Proxy):
    """torch.fx's Proxy, telling a Tensor method from a torch function without torch.overrides' table of
    every overridable function (its first build is ~50 ms of a first flex_attention call)."""

    @classmethod
    def __torch_function__(cls, orig_method, types, args=(), kwargs=None):
        args, kwargs = args or (), kwargs or {}
        tracer = None
        todo = list(args) + list(kwargs.values())
        while todo and tracer is None:
            a = todo.pop()
            if isinstance(a, torch.fx.Proxy):
                tracer = a.tracer
            elif isinstance(a, (tuple, list)):
                todo.extend(a)
        name = getattr(orig_method, "__name__", None)
        if name and (getattr(orig_method, "__objclass__", None) is torch._C.TensorBase
                     or getattr(torch.Tensor, name, None) is orig_method):
            return tracer.create_proxy("call_method", name, args, kwargs)
        return tracer.create_proxy("call_function", orig_method, args, kwargs)


class _Tracer(torch.fx.Tracer):
    """A Tracer whose captured tensors (closure cells, globals, parameters of any module) become get_attr
    constants kept here, by identity: they need not belong to a module."""

    def __init__(self):
        super().__init__(autowrap_modules=(), autowrap_functions=())
        self.tensors: dict[str, torch.Tensor] = {}
        self._nodes: dict[int, torch.fx.Node] = {}

    def proxy(self, node):
        return _Proxy(node, self)

    def create_arg(self, a):
        if isinstance(a, torch.Tensor):
            node = self._nodes.get(id(a))
            if node is None:
                name = f"_captured{len(self.tensors)}"
                self.tensors[name] = a
                node = self._nodes[id(a)] = self.create_node("get_attr", name, (), {})
            return node
        return super().create_arg(a)


def _trace(score_mod):
    """(graph, captured tensors) of score_mod traced on five symbolic arguments."""
    def score_mod_root(score, b, h, q_idx, kv_idx):
        return score_mod(score, b, h, q_idx, kv_idx)
    tracer = _Tracer()
    graph = tracer.trace(score_mod_root)
    return graph, tracer.tensors


def _name(score_mod) -> str:
    return getattr(score_mod, "__name__", type(score_mod).__name__)


def _check_callable(score_mod, name):
    if not callable(score_mod):
        raise TypeError(f"flex_attention: score_mod must be callable as score_mod(score, b, h, q_idx, kv_idx), "
                        f"got {type(score_mod).__name__}")
    try:
        sig = inspect.signature(score_mod)
    except (TypeError, ValueError):  # a builtin without a signature: its call will say
        return
    try:
        sig.bind(0, 0, 0, 0, 0)
    except TypeError:
        raise TypeError(f"flex_attention: score_mod {name} must take 5 positional arguments (score, b, h, q_idx, "
                        f"kv_idx), its signature is {name}{sig}") from None


def _check_output(score_mod, name) -> bool:
    """One call on a column of two pairs: a float tensor of that shape, as the paths need. Returns whether it
    requires grad (it reads a tensor that does)."""
    s = torch.zeros(2, 1, dtype=torch.float64)
    z = torch.zeros(2, 1, dtype=torch.long)
    y = score_mod(s, z, z, z, z)
    if not isinstance(y, torch.Tensor) or not y.is_floating_point():
        raise TypeError(f"flex_attention: score_mod {name} must return a float tensor built from score with tensor "
                        f"operations, got {type(y).__name__ if not isinstance(y, torch.Tensor) else y.dtype}")
    try:
        torch.broadcast_to(y, s.shape)
    except RuntimeError:
        raise ValueError(f"flex_attention: score_mod {name} returned shape {list(y.shape)} for scores "
                         f"{list(s.shape)}; it must act element-wise (b, h, q_idx, kv_idx broadcast)") from None
    return y.requires_grad


def _kind_of(value, name) -> ScoreModKind:
    """The ScoreModKind of the output's abstract value."""
    if isinstance(value, _G):
        return ScoreModKind("general", f"score_mod {name}: {value.why}")
    if isinstance(value, _B):
        return ScoreModKind("general", f"score_mod {name} does not read the score", reads_grad=value.grad)
    if not isinstance(value, _S):
        return ScoreModKind("general", f"score_mod {name} returns no single value")
    bias = value.bias
    has_bias = bias.const != 0.0
    atoms = _atoms(bias)
    relative = has_bias and atoms <= {"h", "off"}
    words = {"b": "b", "h": "h", "q": "q_idx", "k": "kv_idx", "off": "kv_idx - q_idx"}
    where = ", ".join(w for a, w in words.items() if a in atoms) if "*" not in atoms else "b, h, q_idx, kv_idx"
    bias_words = "" if not has_bias else (f" + bias({where})" if where else " + a constant") + (
        " (relative)" if relative else "")
    if value.form == "aff":
        A = value.A
        if not (math.isfinite(A) and A > 0):
            return ScoreModKind("general", f"score_mod {name} is {A:.6g}·score + bias: only a finite factor > 0 "
                                "folds into scale", reads_grad=bias.grad)
        if A == 1.0 and not has_bias:
            return ScoreModKind("identity", f"score_mod {name} is the score (traced)")
        return ScoreModKind("affine", f"score_mod {name} is {A:.6g}·score{bias_words} (traced)", factor=A,
                            has_bias=has_bias, reads_grad=bias.grad, relative=relative)
    A, c = value.A, value.c
    if not (math.isfinite(A) and math.isfinite(c) and A > 0 and c > 0):
        return ScoreModKind("general", f"score_mod {name} is {c:.6g}·tanh({A:.6g}·score): only positive finite "
                            "factors are soft-capping", reads_grad=bias.grad)
    return ScoreModKind("softcap", f"score_mod {name} is {c:.6g}·tanh(score·{A:.6g}){bias_words} (traced)",
                        factor=A * c, softcap=c, has_bias=has_bias, reads_grad=bias.grad, relative=relative)


def _classify(score_mod, name) -> ScoreModKind:
    _check_callable(score_mod, name)
    grad = _check_output(score_mod, name)
    try:
        graph, tensors = _trace(score_mod)
    except Exception as e:  # noqa: BLE001 - anything that does not trace is general (the exact path runs it)
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return ScoreModKind("general", f"score_mod {name} could not be traced ({type(e).__name__}: {msg[:120]})",
                            reads_grad=grad)
    try:
        kind = _kind_of(_analyse(graph, tensors), name)
    except Exception as e:  # noqa: BLE001 - an unexpected graph: not proved, so general
        kind = ScoreModKind("general", f"score_mod {name}: its trace could not be read ({type(e).__name__}: {e})")
    if kind.kind == "general":  # reads_grad: whether any tensor it reads requires grad
        kind = dataclasses.replace(kind, reads_grad=grad or any(t.requires_grad for t in tensors.values()))
    return kind


# Note [Classified once per score_mod]: a trace costs about a millisecond (a few on a process's first), so the
# kind is kept per score_mod object (weakly: it goes with the function), with a snapshot of what the function
# reads besides its arguments: its code, defaults, closure cells and the globals its code names (recursively
# into the functions among them, a few levels), numbers and strings by value, tensors by identity and
# ``_version`` (an in-place write bumps it: a captured scale changed in place is seen), containers item by item.
# A call whose snapshot equals the kept one reuses the kind; any difference traces again. A callable whose
# state cannot be snapshotted so (a bound method, an nn.Module, functools.partial, an object with
# attributes) is traced again on every call: its answer is never stale. A learned table updated by an
# optimizer bumps its version, so such a score_mod is traced again after each step (about a millisecond).
_KINDS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_EMPTY = object()
_SCALARS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, type(Ellipsis))
_MAX_ITEMS = 64


def _global_names(code) -> list[str]:
    names = list(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names += _global_names(c)
    return names


def _key(v, depth: int):
    """A comparable stand-in for v (Note [Classified once per score_mod]), or None where there is none."""
    if v is _EMPTY or isinstance(v, _SCALARS):
        return ("v", type(v), v)
    if isinstance(v, torch.Tensor):
        return ("t", v, v._version, v.requires_grad)
    if isinstance(v, types.ModuleType) or isinstance(v, type) or isinstance(
            v, (types.BuiltinFunctionType, types.BuiltinMethodType, torch._ops.OpOverloadPacket)):
        return ("o", v)
    if isinstance(v, types.FunctionType):
        snap = _snapshot(v, depth + 1)
        return None if snap is None else ("f", snap)
    if type(v) in (tuple, list) and len(v) <= _MAX_ITEMS:
        items = tuple(_key(x, depth + 1) for x in v)
        return None if any(i is None for i in items) else ("s", type(v), items)
    if type(v) is dict and len(v) <= _MAX_ITEMS and all(isinstance(k, _SCALARS) for k in v):
        items = tuple((k, _key(x, depth + 1)) for k, x in v.items())
        return None if any(i is None for _, i in items) else ("d", items)
    return None


def _snapshot(fn, depth: int = 0):
    """What fn reads besides its arguments (Note [Classified once per score_mod]), or None."""
    if not isinstance(fn, types.FunctionType) or depth > 3:
        return None
    vals = [fn.__defaults__, fn.__kwdefaults__ and tuple(sorted(fn.__kwdefaults__.items()))]
    for cell in fn.__closure__ or ():
        try:
            vals.append(cell.cell_contents)
        except ValueError:  # an empty cell
            vals.append(_EMPTY)
    g = fn.__globals__
    vals += [g.get(n, _EMPTY) for n in _global_names(fn.__code__)]
    keys = [fn.__code__]
    for v in vals:
        k = _key(v, depth)
        if k is None:
            return None
        keys.append(k)
    return tuple(keys)


def _same(a, b) -> bool:
    """Whether two snapshots are equal: tensors by identity and version, the rest by value."""
    if type(a) is not type(b):
        return False
    if isinstance(a, tuple):
        if len(a) != len(b):
            return False
        if len(a) == 4 and a[:1] == ("t",) and isinstance(a[1], torch.Tensor):
            return a[1] is b[1] and a[2] == b[2] and a[3] == b[3]
        if len(a) == 2 and a[:1] == ("o",):
            return a[1] is b[1]
        return all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a is b
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a is b or a == b


def classify_score_mod(score_mod) -> ScoreModKind:
    """What ``score_mod(score, b, h, q_idx, kv_idx)`` is, proved from its torch.fx trace (Note [score_mod by its
    trace]): identity, affine ``A·score + bias``, soft-capping ``cap·tanh(A·score) + bias``, with the bias
    proved relative (a function of (h, kv_idx - q_idx)) or not; anything not proved is "general". Kept per
    score_mod object (Note [Classified once per score_mod]). Raises TypeError for a score_mod that is not
    callable with five arguments or does not return a float tensor."""
    if score_mod is None:
        return ScoreModKind("none", "no score_mod")
    name = _name(score_mod)
    snap = _snapshot(score_mod)
    try:
        hit = _KINDS.get(score_mod)
    except TypeError:  # not weakly referenceable or not hashable: classified on every call
        hit = None
    if hit is not None and snap is not None and _same(hit[0], snap):
        return hit[1]
    kind = _classify(score_mod, name)
    if snap is not None:
        try:
            _KINDS[score_mod] = (snap, kind)
        except TypeError:
            pass
    return kind
