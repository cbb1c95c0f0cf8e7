"""The arithmetic of attention as a list of named steps, computed in float64 on real numbers.

Legend: H heads, L queries, S keys, D = d_model, E = d_k, Ev = d_v. Per-head steps hold [L, ·] for a
single-head trace and [H, L, ·] when several heads are shown.

Steps, with their stable names (the JSON output uses them as keys):
    X                 input rows                                   [L, D]
    W_Q, W_K, W_V     projections (X @ W + b)                      [D, H·E]
    Q, K, V           1) project: Q = X W_Q (split into heads)     [H, L, E]
    scores            2) similarity: Q Kᵀ  (or cosine)             [H, L, S]
    scaled            3) scale: ÷√d_k (or ÷1, ÷d_k)                [H, L, S]
    masked            4) mask: -inf where a key does not take part [H, L, S]
    weights           5) softmax over keys (or none)               [H, L, S]
    output            6) aggregate: weights · V                    [H, L, Ev]
    concat            7) concatenate heads                         [L, H·Ev]
    W_O               output projection                            [H·Ev, D]
    projected         8) concat · W_O (+ b)                        [L, D]
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .. import diagnostics as dg

__all__ = ["Step", "Trace", "TraceOptions", "trace_projection", "trace_qkv", "trace_scores", "trace_example",
           "EXAMPLE_TOKENS", "as_matrix"]

EXAMPLE_TOKENS = ("I", "love", "machine", "learning")


@dataclass(frozen=True)
class TraceOptions:
    """The failure-mode switches: scale none|sqrt|dk, softmax on/off, cosine instead of dot product."""

    scale: str = "sqrt"
    softmax: bool = True
    cosine: bool = False
    causal: bool = False

    def __post_init__(self):
        if self.scale not in dg.SCALES:
            raise ValueError(f"scale must be one of {dg.SCALES}, got {self.scale!r}")

    @property
    def is_standard(self) -> bool:
        """Whether these are the textbook settings (÷√d_k, softmax, dot product): no comparison needed."""
        return self.scale == "sqrt" and self.softmax and not self.cosine


@dataclass
class Step:
    """One step of the computation: its name ("Q", "scores", "weights", ...), title and formula, the value
    ([rows, cols], or [H, rows, cols] when ``per_head``; None in a summary, which keeps only ``stats``),
    the full shape, row and column labels, FLOPs and bytes, statistics and a note."""

    name: str
    title: str
    formula: str
    value: np.ndarray | None
    shape: tuple[int, ...]
    rows: list[str] | None = None
    cols: list[str] | None = None
    flops: int = 0
    bytes: int = 0
    stats: dict = field(default_factory=dict)
    note: str = ""
    per_head: bool = False


@dataclass
class Trace:
    """Every step of one attention computation; ``steps`` keep their order, ``step(name)`` finds one."""

    source: str
    options: TraceOptions
    steps: list[Step]
    labels: list[str] | None = None
    heads: list[int] | None = None  # which heads the per-head steps show
    num_heads: int = 1
    d_k: int | None = None
    comparison: list[dict] = field(default_factory=list)  # failure mode vs standard attention
    notes: list[str] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    def step(self, name: str) -> Step:
        """The step called ``name``; KeyError listing the steps when there is none."""
        for s in self.steps:
            if s.name == name:
                return s
        raise KeyError(f"no step {name!r} in this trace; steps: {[s.name for s in self.steps]}")

    def names(self) -> list[str]:
        """The steps' names, in order."""
        return [s.name for s in self.steps]

    def to_dict(self) -> dict:
        """JSON-ready dict; matrices are nested lists with -inf (masked scores) written as null."""
        return {
            "attnlab_trace": 1,
            "source": self.source,
            "options": {"scale": self.options.scale, "softmax": self.options.softmax,
                        "cosine": self.options.cosine, "causal": self.options.causal},
            "d_k": self.d_k,
            "num_heads": self.num_heads,
            "heads": self.heads,
            "labels": self.labels,
            "order": self.names(),
            "steps": {
                s.name: {
                    "title": s.title, "formula": s.formula, "shape": list(s.shape), "per_head": s.per_head,
                    "flops": int(s.flops), "bytes": int(s.bytes), "stats": _clean(s.stats), "note": s.note,
                    "value": None if s.value is None else _clean(s.value.tolist()),
                }
                for s in self.steps
            },
            "comparison": _clean(self.comparison),
            "notes": self.notes,
            "meta": _clean(self.meta),
        }


def _clean(o):
    """Replace non-finite floats by None so the result is valid JSON."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, (np.floating,)):
        return _clean(float(o))
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o


# -- input checks --------------------------------------------------------------------------------
def as_matrix(name: str, x) -> np.ndarray:
    """A non-empty, rectangular, finite 2-D float64 matrix, or ValueError naming ``name``."""
    try:
        a = np.asarray(x, dtype=np.float64)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{name} must be a rectangular matrix of numbers (a list of equal-length rows): {e}") from None
    if a.size == 0:
        raise ValueError(f"{name} is empty (shape {list(a.shape)}); give at least one row and one column")
    if a.ndim == 1:
        a = a[None, :]
    if a.ndim != 2:
        raise ValueError(f"{name} must be a 2-D matrix [rows, cols], got an array of shape {list(a.shape)}")
    if not np.isfinite(a).all():
        raise ValueError(f"{name} contains NaN or infinity")
    return a


# -- statistics ----------------------------------------------------------------------------------
def _stats(a: np.ndarray) -> dict:
    f = a[np.isfinite(a)]
    if f.size == 0:
        return {}
    return {"mean": float(f.mean()), "var": float(f.var()), "min": float(f.min()), "max": float(f.max())}


def _weight_stats(w: np.ndarray, softmax: bool) -> dict:
    st = _stats(w)
    ws = dg.weight_stats(w)
    st.update({"row_sum_min": ws["row_sum_min"], "row_sum_max": ws["row_sum_max"],
               "negative_fraction": ws["negative_fraction"]})
    if softmax:
        st.update({"mean_entropy": ws["mean_entropy"], "mean_max_weight": ws["mean_max_weight"],
                   "saturated_fraction": ws["saturated_fraction"], "mean_jacobian_norm": ws["mean_jacobian_norm"]})
    return st


# -- the attention steps (2..6) ------------------------------------------------------------------
def _softmax(x: np.ndarray) -> np.ndarray:
    """Row softmax with -inf = masked; a row with no key left gives zeros (as attnlab.attention does)."""
    m = np.max(x, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(x - m)
    d = e.sum(-1, keepdims=True)
    return e / np.where(d == 0, 1.0, d)


def _keep_mask(L: int, S: int, causal: bool, mask: np.ndarray | None) -> np.ndarray | None:
    keep = None
    if causal:
        keep = np.tril(np.ones((L, S), dtype=bool))
    if mask is not None:
        keep = mask if keep is None else (keep & mask)
    return keep


def _attend(steps: list[Step], opts: TraceOptions, *, q=None, k=None, v=None, scores=None, d_k=None,
            mask=None, rows=None, cols=None, per_head=False, itemsize=8) -> dict:
    """Append steps scores..output; arrays are [H, L, ·] internally. Returns the arrays by name."""
    H = (q if q is not None else scores).shape[0]
    if scores is None:
        E = q.shape[-1]
        d_k = E if d_k is None else d_k
        if opts.cosine:
            qn = q / np.maximum(np.linalg.norm(q, axis=-1, keepdims=True), 1e-12)
            kn = k / np.maximum(np.linalg.norm(k, axis=-1, keepdims=True), 1e-12)
            sc = qn @ np.swapaxes(kn, -1, -2)  # (H, L, S)
            formula = "cos(q_i, k_j) = q_i·k_j / (|q_i| |k_j|)"
        else:
            sc = q @ np.swapaxes(k, -1, -2)  # (H, L, S)
            formula = "Q Kᵀ"
        L, S = sc.shape[-2:]
        steps.append(_step("scores", "2) similarity scores", formula, sc, rows, cols, per_head,
                           flops=2 * H * L * S * E + (3 * H * (L + S) * E if opts.cosine else 0),
                           itemsize=itemsize))
    else:
        sc = scores
        L, S = sc.shape[-2:]
        steps.append(_step("scores", "2) similarity scores (given)", "Q Kᵀ (given)", sc, rows, cols, per_head,
                           itemsize=itemsize))
    if d_k is None and opts.scale != "none":
        raise ValueError(f"scale={opts.scale!r} needs d_k (the query/key head dim); pass --d-k or --scale none")
    factor = dg.scale_value(opts.scale, d_k) if opts.scale != "none" else 1.0
    scale_txt = {"sqrt": f"÷ √d_k = ÷ √{d_k} = ÷ {math.sqrt(d_k) if d_k else 0:.4g}",
                 "dk": f"÷ d_k = ÷ {d_k}", "none": "÷ 1 (no scaling)"}[opts.scale]
    scaled = sc * factor
    steps.append(_step("scaled", "3) scale", scale_txt, scaled, rows, cols, per_head, flops=H * L * S,
                       itemsize=itemsize))
    keep = _keep_mask(L, S, opts.causal, mask)
    if keep is None:
        masked = scaled
        note = "no mask: every key takes part"
    else:
        masked = np.where(keep, scaled, -np.inf)
        note = f"{int((~keep).sum())} of {L * S} (query, key) pairs masked to -inf"
    steps.append(_step("masked", "4) mask", "scores + mask (-inf where a key does not take part)", masked, rows,
                       cols, per_head, flops=H * L * S if keep is not None else 0, note=note, itemsize=itemsize))
    if opts.softmax:
        w = _softmax(masked)
        st = _weight_stats(w, True)
        steps.append(_step("weights", "5) softmax over keys", "exp(s_ij) / Σ_j exp(s_ij)", w, rows, cols, per_head,
                           flops=5 * H * L * S, stats=st, itemsize=itemsize))
    else:
        w = np.where(np.isfinite(masked), masked, 0.0)
        st = _weight_stats(w, False)
        steps.append(_step("weights", "5) no softmax (failure mode)", "weights = scaled scores (masked -> 0)", w,
                           rows, cols, per_head, stats=st, itemsize=itemsize,
                           note="rows need not sum to 1 and may be negative"))
    out = None
    if v is not None:
        out = w @ v  # (H, L, Ev)
        Ev = v.shape[-1]
        steps.append(_step("output", "6) aggregate values", "weights · V", out, rows,
                           [f"v{j}" for j in range(Ev)], per_head, flops=2 * H * L * S * Ev, itemsize=itemsize))
    return {"scores": sc, "scaled": scaled, "masked": masked, "weights": w, "output": out, "keep": keep,
            "factor": factor}


def _step(name, title, formula, value, rows=None, cols=None, per_head=False, *, flops=0, stats=None, note="",
          itemsize=8, shape=None) -> Step:
    """Per-head arrays arrive as [H, L, ·]; a single shown head is stored as [L, ·]."""
    v = value
    if per_head and v is not None and v.ndim == 3 and v.shape[0] == 1:
        v = v[0]
    if v is not None and v.ndim == 3 and not per_head:
        v = v[0]
    shape = tuple(v.shape) if shape is None else shape
    st = _stats(v) if stats is None and v is not None else (stats or {})
    return Step(name, title, formula, v, shape, rows, cols, flops, int(np.prod(shape)) * itemsize, st, note,
                per_head=bool(per_head and v is not None and v.ndim == 3))


def _compare(trace: Trace, q, k, v, scores, d_k, mask) -> None:
    """For a failure-mode trace: the same inputs through standard attention, side by side."""
    opts = trace.options
    if opts.is_standard:
        return
    if q is None and d_k is None:
        trace.notes.append("give --d-k to compare with standard ÷√d_k attention")
        return
    base_steps: list[Step] = []
    base = _attend(base_steps, TraceOptions(causal=opts.causal), q=q, k=k, v=v, scores=scores,
                   d_k=d_k if d_k is not None else (q.shape[-1] if q is not None else None), mask=mask)
    mine = trace.step("weights")
    w_mine = mine.value
    w_base = base["weights"]
    if w_base.ndim == 3 and w_base.shape[0] == 1 and w_mine.ndim == 2:
        w_base = w_base[0]
    a, b = dg.weight_stats(w_base), dg.weight_stats(w_mine)
    label = f"scale={opts.scale}" + (", no softmax" if not opts.softmax else "") + (", cosine" if opts.cosine else "")
    rows = [("largest |weight|", "max_abs_weight"), ("smallest weight", "min_weight"),
            ("row sum (min)", "row_sum_min"), ("row sum (max)", "row_sum_max"),
            ("negative weights (fraction)", "negative_fraction")]
    if opts.softmax:
        rows += [("mean max weight", "mean_max_weight"), ("mean entropy (nats)", "mean_entropy"),
                 ("saturated rows (max ≥ 0.99)", "saturated_fraction"),
                 ("softmax Jacobian norm (mean)", "mean_jacobian_norm")]
    for title, key in rows:
        trace.comparison.append({"measure": title, "standard": a[key], label: b[key]})
    sv_base = float(np.var(base["scaled"][np.isfinite(base["scaled"])]))
    sc = trace.step("scaled").value
    trace.comparison.append({"measure": "variance of scaled scores", "standard": sv_base,
                             label: float(np.var(sc[np.isfinite(sc)]))})
    if opts.softmax and v is not None:
        gb = dg.score_grad_norm(np.where(np.isfinite(base["masked"]), base["masked"], -1e30), v)
        mm = trace.step("masked").value
        mm = mm[None] if mm.ndim == 2 else mm
        gm = dg.score_grad_norm(np.where(np.isfinite(mm), mm, -1e30), v)
        trace.comparison.append({"measure": "gradient norm reaching scores (mean)", "standard": float(gb.mean()),
                                 label: float(gm.mean())})
    if opts.cosine and q is not None:
        # Lost magnitude: scale one query 10x; dot-product weights sharpen, cosine weights do not move.
        q2 = q.copy()
        q2[:, 0] *= 10.0
        s_dot = _attend([], TraceOptions(causal=opts.causal), q=q2, k=k, v=None, d_k=d_k or q.shape[-1],
                        mask=mask)["weights"]
        s_cos = _attend([], opts, q=q2, k=k, v=None, d_k=d_k or q.shape[-1], mask=mask)["weights"]
        d_dot = float(np.abs(s_dot[:, 0] - base["weights"][:, 0]).max())
        cw = trace.step("weights").value
        cw = cw[None] if cw.ndim == 2 else cw
        d_cos = float(np.abs(s_cos[:, 0] - cw[:, 0]).max())
        trace.comparison.append({"measure": "change in row 0 when |q_0| is ×10", "standard": d_dot, label: d_cos})
        trace.notes.append("cosine similarity ignores |q| and |k|: making query 0 ten times longer changes its "
                           f"dot-product weights by up to {d_dot:.3g} but its cosine weights by {d_cos:.3g}")
    if not opts.softmax:
        trace.notes.append(f"without softmax the weights range over [{b['min_weight']:.3g}, {b['max_abs_weight']:.3g}] "
                           f"in magnitude and rows sum to [{b['row_sum_min']:.3g}, {b['row_sum_max']:.3g}] "
                           "instead of 1: no longer a weighted average")
    if opts.softmax and opts.scale != "sqrt":
        trace.notes.append(f"scale={opts.scale}: mean max weight {b['mean_max_weight']:.3g} vs {a['mean_max_weight']:.3g} "
                           f"with ÷√d_k; saturated rows {b['saturated_fraction']:.0%} vs {a['saturated_fraction']:.0%}")


# -- entry points --------------------------------------------------------------------------------
def _split_heads(x: np.ndarray, H: int) -> np.ndarray:
    L, HE = x.shape
    return x.reshape(L, H, HE // H).transpose(1, 0, 2)  # (H, L, E)


def trace_projection(X, W_Q, W_K, W_V, W_O=None, *, num_heads: int = 1, heads=None, b_Q=None, b_K=None, b_V=None,
                     b_O=None, labels=None, options: TraceOptions = TraceOptions(), mask=None, source: str = "custom",
                     scale_d_k: int | None = None) -> Trace:
    """Trace from input rows X [L, D] and projections W_* [D, H·E] (X @ W + b), W_O [H·Ev, D].

    ``heads`` selects which heads the per-head steps show (default: all); the concat and W_O steps always
    use every head. ``mask``: bool [L, L], True = takes part.
    """
    X = as_matrix("X", X)
    L, D = X.shape
    mats = {"W_Q": as_matrix("W_Q", W_Q), "W_K": as_matrix("W_K", W_K), "W_V": as_matrix("W_V", W_V)}
    for n, w in mats.items():
        if w.shape[0] != D:
            raise ValueError(f"{n} must be [d_model={D}, heads·d], got {list(w.shape)} (X is {list(X.shape)})")
    if mats["W_Q"].shape[1] != mats["W_K"].shape[1]:
        raise ValueError(f"W_Q {list(mats['W_Q'].shape)} and W_K {list(mats['W_K'].shape)} must have the same width")
    H = num_heads
    for n, w in mats.items():
        if w.shape[1] % H:
            raise ValueError(f"{n} width {w.shape[1]} is not divisible by num_heads={H}")
    heads = list(range(H)) if heads is None else list(heads)
    for h in heads:
        if not 0 <= h < H:
            raise ValueError(f"head {h} out of range: this layer has {H} heads (0..{H - 1})")
    E, Ev = mats["W_Q"].shape[1] // H, mats["W_V"].shape[1] // H
    labels = list(labels) if labels is not None else [f"t{i}" for i in range(L)]
    steps: list[Step] = []
    steps.append(_step("X", "input rows", "X", X, labels, [f"x{j}" for j in range(D)]))
    proj = {}
    for (n, w), b, out in zip(mats.items(), (b_Q, b_K, b_V), ("Q", "K", "V")):
        steps.append(_step(n, f"projection {n}", f"[d_model={D}, {H}·{w.shape[1] // H}]", w, None, None))
        y = X @ w + (0 if b is None else np.asarray(b, dtype=np.float64))  # (L, H·E)
        proj[out] = _split_heads(y, H)  # (H, L, E)
    hsel = np.array(heads)
    bias = {"Q": b_Q, "K": b_K, "V": b_V}
    per_head = len(heads) > 1
    for out in ("Q", "K", "V"):
        d = proj[out].shape[-1]
        steps.append(_step(out, f"1) project to {out}" + (f" (head {heads[0]})" if len(heads) == 1 and H > 1 else ""),
                           f"{out} = X W_{out}" + (" + b" if bias[out] is not None else ""), proj[out][hsel], labels,
                           [f"{out.lower()}{j}" for j in range(d)], per_head, flops=2 * L * D * d * len(heads)))
    d_k = scale_d_k if scale_d_k is not None else E
    arrs = _attend(steps, options, q=proj["Q"][hsel], k=proj["K"][hsel], v=proj["V"][hsel], d_k=d_k, mask=mask,
                   rows=labels, cols=labels, per_head=per_head)
    trace = Trace(source, options, steps, labels, heads, H, d_k)
    if W_O is not None:
        W_O = as_matrix("W_O", W_O)
        if W_O.shape[0] != H * Ev:
            raise ValueError(f"W_O must be [heads·d_v={H * Ev}, d_model], got {list(W_O.shape)}")
        all_out = _attend([], options, q=proj["Q"], k=proj["K"], v=proj["V"], d_k=d_k, mask=mask)["output"]
        concat = all_out.transpose(1, 0, 2).reshape(L, H * Ev)  # (L, H·Ev)
        steps.append(_step("concat", f"7) concatenate {H} head{'s' if H > 1 else ''}", "[head_1 | … | head_H]", concat,
                           labels, [f"h{j // Ev}.{j % Ev}" for j in range(H * Ev)]))
        steps.append(_step("W_O", "output projection W_O", f"[{H}·{Ev}, d_model={W_O.shape[1]}]", W_O, None, None))
        y = concat @ W_O + (0 if b_O is None else np.asarray(b_O, dtype=np.float64))
        steps.append(_step("projected", "8) project back", "concat · W_O" + (" + b" if b_O is not None else ""), y,
                           labels, [f"y{j}" for j in range(y.shape[1])], flops=2 * L * H * Ev * W_O.shape[1]))
    _compare(trace, proj["Q"][hsel], proj["K"][hsel], proj["V"][hsel], None, d_k, mask)
    return trace


def trace_qkv(q, k, v=None, *, d_k: int | None = None, labels=None, key_labels=None,
              options: TraceOptions = TraceOptions(), mask=None, source: str = "qkv") -> Trace:
    """Trace from given Q [L, E], K [S, E] and optionally V [S, Ev] (one head)."""
    q, k = as_matrix("Q", q), as_matrix("K", k)
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"Q and K must have the same number of columns (d_k): Q is {list(q.shape)}, K is {list(k.shape)}")
    if v is not None:
        v = as_matrix("V", v)
        if v.shape[0] != k.shape[0]:
            raise ValueError(f"V must have one row per key: K is {list(k.shape)}, V is {list(v.shape)}")
    L, S = q.shape[0], k.shape[0]
    if options.causal and L != S:
        raise ValueError(f"--causal needs as many queries as keys, got Q {list(q.shape)} and K {list(k.shape)}")
    _check_mask(mask, L, S)
    rows = list(labels) if labels is not None else [f"q{i}" for i in range(L)]
    cols = list(key_labels) if key_labels is not None else (rows if S == L and labels is not None else [f"k{j}" for j in range(S)])
    steps = [_step("Q", "query rows (given)", "Q", q, rows, [f"e{j}" for j in range(q.shape[1])]),
             _step("K", "key rows (given)", "K", k, cols, [f"e{j}" for j in range(k.shape[1])])]
    if v is not None:
        steps.append(_step("V", "value rows (given)", "V", v, cols, [f"v{j}" for j in range(v.shape[1])]))
    d_k = q.shape[1] if d_k is None else d_k
    _attend(steps, options, q=q[None], k=k[None], v=None if v is None else v[None], d_k=d_k, mask=mask, rows=rows,
            cols=cols)
    trace = Trace(source, options, steps, rows, None, 1, d_k)
    _compare(trace, q[None], k[None], None if v is None else v[None], None, d_k, mask)
    return trace


def trace_scores(scores, *, d_k: int | None = None, v=None, labels=None, options: TraceOptions = TraceOptions(),
                 mask=None, source: str = "scores") -> Trace:
    """Trace from a given score matrix Q Kᵀ [L, S] (and optionally V [S, Ev])."""
    sc = as_matrix("scores", scores)
    if options.cosine:
        raise ValueError("--cosine needs Q and K (cosine similarity is computed from them), not a score matrix")
    L, S = sc.shape
    if v is not None:
        v = as_matrix("V", v)
        if v.shape[0] != S:
            raise ValueError(f"V must have one row per key: scores are {list(sc.shape)} (S={S}), V is {list(v.shape)}")
    if options.causal and L != S:
        raise ValueError(f"--causal needs a square score matrix, got {list(sc.shape)}")
    _check_mask(mask, L, S)
    rows = list(labels) if labels is not None else [f"q{i}" for i in range(L)]
    cols = rows if (labels is not None and S == L) else [f"k{j}" for j in range(S)]
    steps: list[Step] = []
    if v is not None:
        steps.append(_step("V", "value rows (given)", "V", v, cols, [f"v{j}" for j in range(v.shape[1])]))
    _attend(steps, options, scores=sc[None], v=None if v is None else v[None], d_k=d_k, mask=mask, rows=rows, cols=cols)
    trace = Trace(source, options, steps, rows, None, 1, d_k)
    _compare(trace, None, None, None if v is None else v[None], sc[None], d_k, mask)
    return trace


def _check_mask(mask, L, S):
    if mask is not None and tuple(np.shape(mask)) != (L, S):
        raise ValueError(f"mask must be [L={L}, S={S}], got {list(np.shape(mask))}")


def example_inputs(seed: int = 0, num_heads: int = 1, d_model: int = 8, d_k: int = 4) -> dict:
    """The 4-token worked example's inputs: X [4, d_model] in [0, 1) with one decimal, W_* ~ N(0, 1/d_model)
    rounded to two decimals (numbers a reader can redo by hand), seeded."""
    rng = np.random.default_rng(seed)
    L = len(EXAMPLE_TOKENS)
    X = np.round(rng.uniform(0.0, 1.0, size=(L, d_model)), 1)
    sd = 1.0 / math.sqrt(d_model)
    W = {n: np.round(rng.normal(0.0, sd, size=(d_model, num_heads * d_k)), 2) + 0.0 for n in ("W_Q", "W_K", "W_V")}
    W["W_O"] = np.round(rng.normal(0.0, 1.0 / math.sqrt(num_heads * d_k), size=(num_heads * d_k, d_model)), 2) + 0.0
    return {"X": X, **W}


def trace_example(*, seed: int = 0, num_heads: int = 1, options: TraceOptions = TraceOptions()) -> Trace:
    """The tutorial's 4-token example ("I love machine learning", d_model=8, d_k=d_v=4) on seeded weights."""
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}")
    inp = example_inputs(seed, num_heads)
    t = trace_projection(inp["X"], inp["W_Q"], inp["W_K"], inp["W_V"], inp["W_O"], num_heads=num_heads,
                         labels=EXAMPLE_TOKENS, options=options, source="example")
    t.meta.update({"seed": seed, "d_model": 8, "d_k": 4, "d_v": 4})
    return t
