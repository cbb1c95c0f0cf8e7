"""Interval evaluation of a FlexAttention ``mask_mod`` over whole tiles: a proof that a tile is full or empty.

Legend: T tiles; a tile is query rows [qlo, qhi] x key columns [klo, khi] (inclusive), int64 [T] each.

``mask_mod(b, h, q_idx, kv_idx)`` is called once on ``_Iv`` stand-ins: q_idx holds the interval
[qlo, qhi] of every tile, kv_idx [klo, khi], b and h the point of the (b, h) being built. Each torch op
the function applies maps intervals to intervals that contain every value the op can take on the tile
(Note [Sound intervals]); a comparison gives, per tile, ``all`` (true for every pair of the tile) and
``any`` (maybe true for some pair). So ``all`` proves a tile FULL and ``not any`` proves it EMPTY,
whatever else the function does; everything in between is left to exact evaluation. An op outside the
table below, Python control flow on a tensor (``if q_idx > 3``), a captured tensor indexed out of range,
raise ``NotInterval``: the caller then evaluates pairs instead, which is always correct.

Ops: + - * (by anything), // and % by a positive constant, neg, abs, minimum / maximum / clamp,
< <= > >= == !=, & | ~ on booleans, ``torch.where``, ``tensor[idx]`` (a captured 1-D tensor, or N-D with
one interval index and constants), ``new_ones`` / ``new_zeros`` / ``ones_like`` (as torch's noop_mask),
``.dtype`` / ``.device``, ``.long()`` / ``.to(int dtype)``.
"""
from __future__ import annotations

import torch

__all__ = ["NotInterval", "evaluate"]


class NotInterval(Exception):
    """The mask_mod did something the interval table does not cover (the message names it)."""


# Note [Sound intervals]: every handler returns an interval that contains the op's value at every pair
# of the tile, or raises NotInterval. Over-approximation only ever turns a provable FULL/EMPTY tile into
# an undecided one (then evaluated pair by pair), never the reverse, so a wrong answer needs a wrong
# handler, not an unlucky mask. Intervals of q_idx and kv_idx are treated as independent (they are: a
# tile is their product), an expression using one twice (q_idx - q_idx) only loses precision.
class _Iv(torch.Tensor):
    """An interval per tile. ``kind`` "num": lo <= value <= hi; "bool": lo = true at every pair, hi =
    maybe true at some pair. ``trace`` is a set shared by one evaluation, recording which of b / h it read."""

    lo: torch.Tensor
    hi: torch.Tensor
    kind: str
    tag: str | None
    trace: set

    @staticmethod
    def make(lo, hi, kind, trace, tag=None):
        t = torch.Tensor._make_subclass(_Iv, torch.empty(0, dtype=torch.bool if kind == "bool" else torch.long))
        t.lo, t.hi, t.kind, t.trace, t.tag = lo, hi, kind, trace, tag
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name == "__get__":  # a property: q_idx.dtype, q_idx.device
            prop = getattr(getattr(func, "__self__", None), "__name__", "?")
            self = args[0]
            if prop == "dtype":
                return torch.bool if self.kind == "bool" else torch.long
            if prop == "device":
                return torch.device("cpu")
            raise NotInterval(f"attribute .{prop}")
        ivs = [a for a in list(args) + list(kwargs.values()) if isinstance(a, _Iv)]
        ivs += [x for a in args if isinstance(a, (tuple, list)) for x in a if isinstance(x, _Iv)]
        trace = ivs[0].trace
        if name not in _SHAPE_ONLY:  # noop_mask's b.new_ones(()) reads no value of b
            for a in ivs:
                if a.tag:
                    trace.add(a.tag)
        handler = _HANDLERS.get(name)
        if handler is None:
            raise NotInterval(f"op {name}")
        return handler(trace, *args, **kwargs)

    def __repr__(self):  # torch's repr would run ops on the stand-in
        return f"_Iv({self.kind}, {self.lo.tolist()[:4]}.., {self.hi.tolist()[:4]}..)"


def _const(x, T):
    """(lo, hi, kind) of an operand: an interval, or a constant (Python number / bool, one-element tensor)."""
    if isinstance(x, _Iv):
        return x.lo, x.hi, x.kind
    if isinstance(x, bool):
        v = torch.full((T,), x, dtype=torch.bool)
        return v, v, "bool"
    if isinstance(x, (int, float)):
        v = torch.full((T,), x, dtype=torch.long if isinstance(x, int) else torch.float64)
        return v, v, "num"
    if isinstance(x, torch.Tensor) and x.numel() == 1 and not x.is_complex():
        v = x.reshape(()).expand(T)
        return (v, v, "bool") if x.dtype == torch.bool else (v, v, "num")
    raise NotInterval(f"operand {type(x).__name__} {tuple(getattr(x, 'shape', ()))} (only one-element constants)")


def _num(x, T):
    """(lo, hi) of an operand as numbers (a boolean interval as 0/1)."""
    lo, hi, kind = _const(x, T)
    return (lo.long(), hi.long()) if kind == "bool" else (lo, hi)


def _size(args):
    return next(a for a in args if isinstance(a, _Iv)).lo.shape[0]


def _mk(trace, lo, hi, kind):
    return _Iv.make(lo, hi, kind, trace)


def _add(trace, a, b, *, alpha=1):
    if alpha != 1:
        raise NotInterval("add with alpha")
    T = _size((a, b))
    (al, ah), (bl, bh) = _num(a, T), _num(b, T)
    return _mk(trace, al + bl, ah + bh, "num")


def _sub(trace, a, b, *, alpha=1):
    if alpha != 1:
        raise NotInterval("sub with alpha")
    T = _size((a, b))
    (al, ah), (bl, bh) = _num(a, T), _num(b, T)
    return _mk(trace, al - bh, ah - bl, "num")


def _rsub(trace, a, b, *, alpha=1):
    return _sub(trace, b, a, alpha=alpha)


def _mul(trace, a, b):
    T = _size((a, b))
    (al, ah), (bl, bh) = _num(a, T), _num(b, T)
    p = torch.stack([al * bl, al * bh, ah * bl, ah * bh])
    return _mk(trace, p.amin(0), p.amax(0), "num")


def _divisor(b, T):
    bl, bh = _num(b, T)
    if not bool((bl == bh).all()) or not bool((bl > 0).all()):
        raise NotInterval("// or % by something other than a positive constant")
    return bl


def _floordiv(trace, a, b, *, rounding_mode="floor"):
    if rounding_mode != "floor":
        raise NotInterval(f"div with rounding_mode={rounding_mode!r}")
    T = _size((a, b))
    if not isinstance(a, _Iv):
        raise NotInterval("a constant divided by an index")
    al, ah = _num(a, T)
    c = _divisor(b, T)
    return _mk(trace, torch.div(al, c, rounding_mode="floor"), torch.div(ah, c, rounding_mode="floor"), "num")


def _div(trace, a, b, *, rounding_mode=None):
    return _floordiv(trace, a, b, rounding_mode=rounding_mode)


def _remainder(trace, a, b):
    T = _size((a, b))
    if not isinstance(a, _Iv):
        raise NotInterval("a constant modulo an index")
    al, ah = _num(a, T)
    c = _divisor(b, T)
    # x mod c = x - c·floor(x / c) rises with x between multiples of c; across one it takes all of [0, c)
    same = torch.div(al, c, rounding_mode="floor") == torch.div(ah, c, rounding_mode="floor")
    top = c - 1 if not c.is_floating_point() else c
    return _mk(trace, torch.where(same, torch.remainder(al, c), torch.zeros_like(al)),
               torch.where(same, torch.remainder(ah, c), top), "num")


def _neg(trace, a):
    lo, hi = _num(a, _size((a,)))
    return _mk(trace, -hi, -lo, "num")


def _abs(trace, a):
    lo, hi = _num(a, _size((a,)))
    low = torch.where(lo >= 0, lo, torch.where(hi <= 0, -hi, torch.zeros_like(lo)))
    return _mk(trace, low, torch.maximum(lo.abs(), hi.abs()), "num")


def _minimum(trace, a, b=None, *rest, **kw):
    if b is None or rest or kw:
        raise NotInterval("min / max as a reduction")
    T = _size((a, b))
    (al, ah), (bl, bh) = _num(a, T), _num(b, T)
    return _mk(trace, torch.minimum(al, bl), torch.minimum(ah, bh), "num")


def _maximum(trace, a, b=None, *rest, **kw):
    if b is None or rest or kw:
        raise NotInterval("min / max as a reduction")
    T = _size((a, b))
    (al, ah), (bl, bh) = _num(a, T), _num(b, T)
    return _mk(trace, torch.maximum(al, bl), torch.maximum(ah, bh), "num")


def _clamp(trace, a, min=None, max=None):
    x = a
    if min is not None:
        x = _maximum(trace, x, min)
    if max is not None:
        x = _minimum(trace, x, max)
    return x


def _cmp(op):
    def h(trace, a, b):
        T = _size((a, b))
        (al, ah), (bl, bh) = _num(a, T), _num(b, T)
        if op == "lt":
            all_, any_ = ah < bl, al < bh
        elif op == "le":
            all_, any_ = ah <= bl, al <= bh
        elif op == "gt":
            all_, any_ = al > bh, ah > bl
        elif op == "ge":
            all_, any_ = al >= bh, ah >= bl
        else:
            point = (al == ah) & (bl == bh) & (al == bl)
            overlap = (al <= bh) & (bl <= ah)
            all_, any_ = (point, overlap) if op == "eq" else (~overlap, ~point)
        return _mk(trace, all_, any_, "bool")
    return h


def _bools(args, T):
    out = []
    for a in args:
        lo, hi, kind = _const(a, T)
        if kind != "bool":
            raise NotInterval("& | ~ on integers (bitwise), not booleans")
        out.append((lo, hi))
    return out


def _and(trace, a, b):
    (al, ah), (bl, bh) = _bools((a, b), _size((a, b)))
    return _mk(trace, al & bl, ah & bh, "bool")


def _or(trace, a, b):
    (al, ah), (bl, bh) = _bools((a, b), _size((a, b)))
    return _mk(trace, al | bl, ah | bh, "bool")


def _not(trace, a):
    ((lo, hi),) = _bools((a,), _size((a,)))
    return _mk(trace, ~hi, ~lo, "bool")


def _where(trace, cond, x=None, y=None):
    if x is None or y is None:
        raise NotInterval("torch.where(cond) (nonzero)")
    T = _size((cond, x, y))
    ((cl, ch),) = _bools((cond,), T)
    xl, xh, xk = _const(x, T)
    yl, yh, yk = _const(y, T)
    if xk != yk:
        raise NotInterval("torch.where mixing booleans and numbers")
    never = ~ch
    if xk == "bool":
        lo = torch.where(cl, xl, torch.where(never, yl, xl & yl))
        hi = torch.where(cl, xh, torch.where(never, yh, xh | yh))
    else:
        lo = torch.where(cl, xl, torch.where(never, yl, torch.minimum(xl, yl)))
        hi = torch.where(cl, xh, torch.where(never, yh, torch.maximum(xh, yh)))
    return _mk(trace, lo, hi, xk)


def _same(trace, a, *args, **kwargs):
    """.long(), .to(int dtype), .int(): the value is unchanged for index intervals."""
    dtype = kwargs.get("dtype", next((x for x in args if isinstance(x, torch.dtype)), None))
    if dtype is not None and (dtype.is_floating_point or dtype == torch.bool):
        raise NotInterval(f"cast to {dtype}")
    lo, hi = _num(a, _size((a,)))
    return _mk(trace, lo, hi, "num")


def _ones(value):
    def h(trace, a, *args, dtype=None, **kw):
        T = _size((a,))
        if dtype == torch.bool:
            v = torch.full((T,), bool(value))
            return _mk(trace, v, v, "bool")
        v = torch.full((T,), value, dtype=torch.long)
        return _mk(trace, v, v, "num")
    return h


class _RangeTable:
    """min / max of a 1-D tensor over index ranges [lo, hi], vectorised. A monotone tensor answers from
    its ends; otherwise a sparse table over chunks of ``chunk`` elements (the range widened to whole
    chunks: a wider interval, still sound) of at most about 4M entries."""

    def __init__(self, u: torch.Tensor):
        self.n = u.numel()
        u = u.long() if u.dtype == torch.bool else u
        self.u = u
        d = u[1:] - u[:-1] if self.n > 1 else u[:0]
        self.mono = 1 if bool((d >= 0).all()) else (-1 if bool((d <= 0).all()) else 0)
        if self.mono:
            return
        chunk = 1
        while -(-self.n // chunk) * max(1, (-(-self.n // chunk)).bit_length()) > (1 << 22):
            chunk *= 2
        self.chunk = chunk
        m = -(-self.n // chunk)
        pad = m * chunk - self.n
        x = torch.cat([u, u[-1:].expand(pad)]) if pad else u
        lo, hi = [x.view(m, chunk).amin(1)], [x.view(m, chunk).amax(1)]
        w = 1
        while 2 * w <= m:
            lo.append(torch.minimum(lo[-1][:-w], lo[-1][w:]))
            hi.append(torch.maximum(hi[-1][:-w], hi[-1][w:]))
            w *= 2
        self.lo, self.hi = lo, hi

    def query(self, a: torch.Tensor, b: torch.Tensor):
        if self.mono == 1:
            return self.u[a], self.u[b]
        if self.mono == -1:
            return self.u[b], self.u[a]
        ca, cb = a // self.chunk, b // self.chunk
        k = torch.floor(torch.log2((cb - ca + 1).double())).long()
        k = torch.clamp(k, max=len(self.lo) - 1)
        lo = torch.stack(self.lo_at(k, ca, cb, self.lo, torch.minimum))
        hi = torch.stack(self.lo_at(k, ca, cb, self.hi, torch.maximum))
        return lo[0], hi[0]

    @staticmethod
    def lo_at(k, ca, cb, levels, op):
        out = torch.empty_like(ca, dtype=levels[0].dtype)
        for lev in torch.unique(k).tolist():
            sel = k == lev
            w = 1 << lev
            out[sel] = op(levels[lev][ca[sel]], levels[lev][cb[sel] - w + 1])
        return (out,)


def _getitem(trace, t, idx):
    if isinstance(t, _Iv):
        raise NotInterval("indexing an index")
    if not isinstance(t, torch.Tensor) or t.is_complex():
        raise NotInterval("indexing something other than a tensor")
    idx = idx if isinstance(idx, tuple) else (idx,)
    T = _size(idx)
    free = [k for k, x in enumerate(idx) if isinstance(x, _Iv) and not _is_point(x)]
    if len(free) > 1:
        raise NotInterval("a tensor indexed by two index intervals")
    if len(idx) > t.dim() or any(x is Ellipsis or x is None or isinstance(x, slice) for x in idx):
        raise NotInterval("slicing, None or ... in an index")
    fixed = []
    for x in idx:
        if isinstance(x, _Iv):
            if x.kind != "num":
                raise NotInterval("indexing by a boolean")
            fixed.append(None if not _is_point(x) else int(x.lo[0]))
        elif isinstance(x, int) or (isinstance(x, torch.Tensor) and x.numel() == 1 and not x.dtype.is_floating_point):
            fixed.append(int(x))
        else:
            raise NotInterval("indexing by a tensor")
    for k, v in enumerate(fixed):
        if v is not None and not -t.shape[k] <= v < t.shape[k]:
            raise NotInterval("index out of range")
    if not free:
        v = t[tuple(fixed)]
        if v.numel() != 1:
            raise NotInterval("a partial index (result is not one element)")
        return _mk(trace, *_const(v, T)[:2], "bool" if v.dtype == torch.bool else "num")
    k = free[0]
    lo, hi = idx[k].lo, idx[k].hi
    n = t.shape[k]
    if bool((lo < 0).any()) or bool((hi >= n).any()):
        raise NotInterval("a captured tensor indexed outside [0, its length)")
    sel = tuple(slice(None) if v is None else v for v in fixed) + (slice(None),) * (t.dim() - len(fixed))
    u = t[sel]
    if u.dim() != 1:
        raise NotInterval("a partial index (result is not one element per pair)")
    table = _table(trace, u)
    vl, vh = table.query(lo, hi)
    if u.dtype == torch.bool:
        return _mk(trace, vl.bool(), vh.bool(), "bool")
    return _mk(trace, vl, vh, "num")


def _is_point(x):
    return bool((x.lo == x.hi).all()) and bool((x.lo == x.lo[0]).all())


def _table(trace, u):
    """The range table of ``u``, built once per evaluation (the trace set holds a cache dict)."""
    cache = next((c for c in trace if isinstance(c, _Cache)), None)
    key = (u.data_ptr(), u.shape, u.stride(), u.dtype, u._version)
    hit = cache.tables.get(key) if cache else None
    if hit is None:
        hit = _RangeTable(u.contiguous())
        if cache is not None:
            cache.tables[key] = hit
    return hit


class _Cache:
    """Range tables shared across the calls of one build (hashable by identity, lives in the trace set)."""

    def __init__(self):
        self.tables = {}


_HANDLERS = {
    "add": _add, "__add__": _add, "__radd__": _add, "sub": _sub, "__sub__": _sub, "__rsub__": _rsub,
    "mul": _mul, "__mul__": _mul, "__rmul__": _mul, "floor_divide": _floordiv, "__floordiv__": _floordiv,
    "div": _div, "remainder": _remainder, "__mod__": _remainder, "fmod": None, "neg": _neg, "__neg__": _neg,
    "negative": _neg, "abs": _abs, "__abs__": _abs, "minimum": _minimum, "maximum": _maximum, "min": _minimum,
    "max": _maximum, "clamp": _clamp, "clip": _clamp,
    "lt": _cmp("lt"), "__lt__": _cmp("lt"), "less": _cmp("lt"), "le": _cmp("le"), "__le__": _cmp("le"),
    "gt": _cmp("gt"), "__gt__": _cmp("gt"), "greater": _cmp("gt"), "ge": _cmp("ge"), "__ge__": _cmp("ge"),
    "eq": _cmp("eq"), "__eq__": _cmp("eq"), "ne": _cmp("ne"), "__ne__": _cmp("ne"),
    "__and__": _and, "__rand__": _and, "logical_and": _and, "bitwise_and": _and,
    "__or__": _or, "__ror__": _or, "logical_or": _or, "bitwise_or": _or,
    "__invert__": _not, "logical_not": _not, "bitwise_not": _not,
    "where": _where, "__getitem__": _getitem, "long": _same, "int": _same, "to": _same,
    "new_ones": _ones(1), "ones_like": _ones(1), "new_zeros": _ones(0), "zeros_like": _ones(0),
}
_HANDLERS = {k: v for k, v in _HANDLERS.items() if v is not None}
_SHAPE_ONLY = frozenset({"new_ones", "new_zeros", "ones_like", "zeros_like"})


def evaluate(mask_mod, b: int, h: int, qlo, qhi, klo, khi, cache: _Cache | None = None):
    """(all [T], any [T], reads) of ``mask_mod`` over the tiles, or raise NotInterval. ``all`` True: every
    pair of the tile is kept; ``any`` False: none is. ``reads`` the subset of {"b", "h"} it used."""
    T = qlo.shape[0]
    trace: set = {cache} if cache is not None else set()
    pb = _Iv.make(torch.full((T,), b, dtype=torch.long), torch.full((T,), b, dtype=torch.long), "num", trace, "b")
    ph = _Iv.make(torch.full((T,), h, dtype=torch.long), torch.full((T,), h, dtype=torch.long), "num", trace, "h")
    q = _Iv.make(qlo, qhi, "num", trace)
    kv = _Iv.make(klo, khi, "num", trace)
    try:
        r = mask_mod(pb, ph, q, kv)
    except NotInterval:
        raise
    except Exception as e:  # anything the stand-ins cannot answer (control flow on a tensor, ...)
        raise NotInterval(f"{type(e).__name__}: {e}") from None
    lo, hi, kind = _const(r, T)
    if kind != "bool":
        raise NotInterval("mask_mod returned numbers, not booleans")
    reads = {x for x in trace if isinstance(x, str)}
    return lo.expand(T).clone(), hi.expand(T).clone(), reads
