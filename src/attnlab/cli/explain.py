"""attnlab explain: which attention method runs for given shapes, why the others were refused, and the cost."""
from __future__ import annotations

import torch

import attnlab
from attnlab import patterns as P
from attnlab.report import format_bytes as _fmt_bytes

from .main import UsageError

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_parser(p):
    p.add_argument("--shape", action="append", metavar="B,H,L,E",
                   help="query shape; repeat for several (default: a few typical shapes)")
    p.add_argument("--kv-len", type=int, help="key/value length S (default: L)")
    p.add_argument("--kv-heads", type=int, help="key/value heads (GQA)")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--pattern", help='e.g. "sliding_window(256, causal=True)" or "longformer(128, 1)"')
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--need-weights", action="store_true")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--strict", action="store_true")
    p.add_argument("--method", default="auto", choices=list(attnlab.METHODS))
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


DEFAULT_SHAPES = [
    ("1,8,1024,64", {}),
    ("1,8,16384,64", {"is_causal": True}),
    ("1,8,16384,64", {"pattern": "sliding_window(256, causal=True)"}),
    ("1,12,512,32", {"need_weights": True}),
]


def _shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise UsageError(f"--shape must be comma-separated integers like 1,8,1024,64, got {text!r}") from None
    if len(dims) < 2 or any(d < 0 for d in dims):
        raise UsageError(f"--shape needs at least L,E and no negative sizes, got {text!r}")
    return dims


def explain_shape(shape, *, kv_len=None, kv_heads=None, dtype=torch.float32, pattern=None, **kw) -> dict:
    """Plan for one query shape; tensors are allocated uninitialised (explain runs no attention)."""
    L = shape[-2]
    S = kv_len if kv_len is not None else L
    kshape = list(shape[:-2]) + [S, shape[-1]]
    if kv_heads is not None:
        if len(shape) < 3:
            raise UsageError("--kv-heads needs a shape with a head dim (B,H,L,E)")
        kshape[-3] = kv_heads
        kw["enable_gqa"] = True
    q = torch.empty(shape, dtype=dtype)
    k = torch.empty(kshape, dtype=dtype)
    pat = P.parse(pattern) if isinstance(pattern, str) else pattern
    plan = attnlab.explain(q, k, k, pattern=pat, **kw)
    return {"shape": list(shape), "S": S, "pattern": pattern, "options": {k: v for k, v in kw.items() if v},
            "method": plan.method, "reason": plan.reason, "refused": plan.refused,
            "peak_bytes": plan.peak_bytes, "flops": plan.flops, "sdpa_backend": plan.sdpa_backend,
            "density": plan.density, "plan": plan}


def run(args):
    from rich.console import Console
    from rich.table import Table

    opts = dict(is_causal=args.causal, need_weights=args.need_weights, dropout_p=args.dropout,
                strict=args.strict, method=args.method)
    if args.shape or args.pattern:
        todo = [(s, {"pattern": args.pattern} if args.pattern else {}) for s in args.shape or ["1,8,4096,64"]]
    else:
        todo = DEFAULT_SHAPES
    results = []
    for text, extra in todo:
        o = dict(opts)
        o.update({k: v for k, v in extra.items() if k != "pattern"})
        results.append(explain_shape(_shape(text), kv_len=args.kv_len, kv_heads=args.kv_heads,
                                     dtype=DTYPES[args.dtype], pattern=extra.get("pattern"), **o))
    console = Console()  # follows the terminal (or $COLUMNS)
    if args.json:
        import json

        console.print_json(json.dumps([{k: v for k, v in r.items() if k != "plan"} for r in results]))
    else:
        for r in results:
            t = Table(title=f"query {r['shape']}, S={r['S']} {r['pattern'] or ''} {r['options'] or ''}".strip(),
                      title_justify="left")
            for c in ("method", "status", "predicted peak", "GFLOP"):
                t.add_column(c)
            for m in attnlab.METHODS[1:]:
                status = "[bold green]chosen[/]: " + r["reason"] if m == r["method"] else \
                    f"[red]refused[/]: {r['refused'][m]}" if m in r["refused"] else "available"
                t.add_row(m, status, _fmt_bytes(r["peak_bytes"][m]), f"{r['flops'][m] / 1e9:.3g}")
            console.print(t)
    return {"plans": results, "exit_code": 0}
