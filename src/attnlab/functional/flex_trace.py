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
import types
import weakref
from dataclasses import dataclass

import torch
import torch.fx

from .flex_values import _B, _G, _S, _analyse, _atoms  # the abstract values (Note [score_mod by its trace])

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
# ``_version`` (an in-place write bumps it: a captured scale changed in place is seen), containers item by item,
# a module or class by identity and the attributes of it that the code names (``cfg.cap``, ``Cfg.factor``: these
# had been keyed by identity alone, so a cap changed on a config module kept the first call's kind; the
# functions among those attributes by identity).
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


def _key(v, depth: int, names: frozenset = frozenset(), path: tuple = ()):
    """A comparable stand-in for v (Note [Classified once per score_mod]), or None where there is none.
    ``names``: the names the score_mod's code reads (a module's or class's attributes among them are part of its
    key)."""
    if v is _EMPTY or isinstance(v, _SCALARS):
        return ("v", type(v), v)
    if isinstance(v, torch.Tensor):
        return ("t", v, v._version, v.requires_grad)
    if isinstance(v, (types.BuiltinFunctionType, types.BuiltinMethodType, torch._ops.OpOverloadPacket)):
        return ("o", v)
    if isinstance(v, types.ModuleType) or isinstance(v, type):
        if any(v is u for u in path):  # a cycle (torch.torch is torch): the outer key holds its attributes
            return ("o", v)
        if depth > 3:
            return None
        attrs = []
        for n in sorted(names):
            a = v.__dict__.get(n, _EMPTY) if isinstance(v, types.ModuleType) else inspect.getattr_static(v, n, _EMPTY)
            if a is _EMPTY:
                continue
            k = ("o", a) if isinstance(a, types.FunctionType) else _key(a, depth + 1, names, path + (v,))
            if k is None:
                return None
            attrs.append((n, k))
        return ("m", v, tuple(attrs))
    if isinstance(v, types.FunctionType):
        snap = _snapshot(v, depth + 1)
        return None if snap is None else ("f", snap)
    if type(v) in (tuple, list) and len(v) <= _MAX_ITEMS:
        items = tuple(_key(x, depth + 1, names) for x in v)
        return None if any(i is None for i in items) else ("s", type(v), items)
    if type(v) is dict and len(v) <= _MAX_ITEMS and all(isinstance(k, _SCALARS) for k in v):
        items = tuple((k, _key(x, depth + 1, names)) for k, x in v.items())
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
    names = _global_names(fn.__code__)
    vals += [g.get(n, _EMPTY) for n in names]
    keys, read = [fn.__code__], frozenset(names)
    for v in vals:
        k = _key(v, depth, read)
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
