"""attnlab explain: which attention method runs for given shapes, why the others were refused, and the cost."""
from __future__ import annotations

import argparse
import math

import torch

import attnlab
from attnlab import patterns as P
from .options import check_memory, nonneg_int, positive_int
from attnlab.positional import alibi_slopes
from attnlab.report import format_bytes as _fmt_bytes

from .common import UsageError
from .common import console as new_console

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_parser(p: argparse.ArgumentParser) -> None:
    """explain's options: shapes, S, key/value heads, causal or a pattern, dtype, weights, dropout, method."""
    p.add_argument("--shape", action="append", metavar="B,H,L,E",
                   help="query shape; repeat for several (default: a few typical shapes)")
    p.add_argument("--kv-len", type=nonneg_int, help="key/value length S (default: L)")
    p.add_argument("--kv-heads", type=positive_int, help="key/value heads (GQA)")
    p.add_argument("--causal", action="store_true", help="causal mask (is_causal=True)")
    p.add_argument("--pattern", help='e.g. "sliding_window(256, causal=True)" or "longformer(128, 1)"')
    p.add_argument("--dtype", choices=list(DTYPES), default="float32", help="dtype of the inputs")
    p.add_argument("--need-weights", action="store_true", help="the attention weights are asked for too")
    p.add_argument("--dropout", type=float, default=0.0, help="dropout probability on the weights (dropout_p)")
    p.add_argument("--softcap", type=float, help="tanh soft-capping of the scores (softcap=, as in Gemma 2)")
    p.add_argument("--alibi", action="store_true", help="ALiBi with the standard slopes of H heads (alibi_slopes=)")
    p.add_argument("--strict", action="store_true", help="refuse rather than fall back (strict=True)")
    p.add_argument("--method", default="auto", choices=list(attnlab.METHODS), help="the method asked for")
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
    if math.prod(dims) >= 2**62:  # torch's element count is an int64
        raise UsageError(f"--shape {text} has {math.prod(dims):.3g} elements, more than a tensor can hold (2^62)")
    return dims


#: bytes per block of the sparse planner's block layouts (int64 bounds and a few temporaries per block)
_LAYOUT_BYTES_PER_BLOCK = 64


def explain_shape(shape, *, kv_len=None, kv_heads=None, dtype=torch.float32, pattern=None, alibi=False,
                  **kw) -> dict:
    """Plan for one query shape on this machine's CPU. The tensors live on the meta device (shapes and
    dtypes, no storage) and are planned as CPU tensors: explain runs no attention, so a shape of any size
    can be explained; only a pattern's block layouts,
    which the planner builds for real, are checked against the memory budget first."""
    L = shape[-2]
    S = kv_len if kv_len is not None else L
    kshape = list(shape[:-2]) + [S, shape[-1]]
    if math.prod(kshape) >= 2**62:  # as --shape's own check: torch's element count is an int64
        raise UsageError(f"--kv-len {S}: the key shape {kshape} holds 2^62 or more elements")
    if kv_heads is not None:
        if len(shape) < 3:
            raise UsageError("--kv-heads needs a shape with a head dim (B,H,L,E)")
        kshape[-3] = kv_heads
        kw["enable_gqa"] = True
    q = torch.empty(shape, dtype=dtype, device="meta")
    k = torch.empty(kshape, dtype=dtype, device="meta")
    pat = P.parse(pattern) if isinstance(pattern, str) else pattern
    if pat is not None:
        # the planner prices block sizes from 32 up on [ceil(L/32), ceil(S/32)] layouts
        blocks = -(-L // 32) * -(-S // 32)
        check_memory(f"--shape {','.join(map(str, shape))} with --pattern", blocks * _LAYOUT_BYTES_PER_BLOCK,
                     f"the sparse planner's block layout of {-(-L // 32)} x {-(-S // 32)} blocks")
    if alibi:
        if len(shape) < 3:
            raise UsageError("--alibi needs a shape with a head dim (B,H,L,E)")
        # the slopes are real: H floats (about 60 bytes each while built), checked before (a head count of 2^31
        # had taken 5 GB and 14 s before failing)
        check_memory(f"--shape {','.join(map(str, shape))} with --alibi", 64 * shape[-3], "the ALiBi slopes of H heads")
        kw["alibi_slopes"] = alibi_slopes(shape[-3]).to(q.device)
    plan = attnlab.explain(q, k, k, pattern=pat, device="cpu", **kw)  # what a CPU run of these shapes does
    return {"shape": list(shape), "S": S, "pattern": pattern, "options": {k: True if isinstance(v, torch.Tensor) else v for k, v in kw.items()
                                                          if isinstance(v, torch.Tensor) or v},
            "method": plan.method, "reason": plan.reason, "refused": plan.refused,
            "peak_bytes": plan.peak_bytes, "flops": plan.flops, "sdpa_backend": plan.sdpa_backend,
            "density": plan.density, "plan": plan}


def _title(r: dict) -> str:
    """One table's title, as a user would write the call: ``query [1, 8, 1024, 64], S=1024, pattern
    causal, is_causal=True, method=auto``."""
    parts = [f"query {r['shape']}", f"S={r['S']}"]
    if r["pattern"]:
        parts.append(f"pattern {r['pattern']}")
    parts += [f"{k}={v}" for k, v in (r["options"] or {}).items()]
    return ", ".join(parts)


def run(args: argparse.Namespace) -> dict:
    """Plan each --shape (or ``DEFAULT_SHAPES``) with ``explain_shape`` and print one table per shape: every
    method, chosen or refused and why, its predicted peak memory and GFLOP. Runs no attention.

    Returns the plans, this CPU's capabilities and ``exit_code`` 0; bad shapes raise ``UsageError``."""
    from rich.table import Table

    opts = dict(is_causal=args.causal, need_weights=args.need_weights, dropout_p=args.dropout,
                strict=args.strict, method=args.method, softcap=args.softcap, alibi=args.alibi)
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
    console = new_console()  # follows the terminal (or $COLUMNS)
    if args.json:
        import json

        console.print_json(json.dumps([{k: v for k, v in r.items() if k != "plan"} for r in results]))
    else:
        for r in results:
            t = Table(title=_title(r), title_justify="left")
            for c in ("method", "status", "predicted peak", "GFLOP"):
                t.add_column(c)
            for m in attnlab.METHODS[1:]:
                status = "[bold green]chosen[/]: " + r["reason"] if m == r["method"] else \
                    f"[red]refused[/]: {r['refused'][m]}" if m in r["refused"] else "available"
                t.add_row(m, status, _fmt_bytes(r["peak_bytes"][m]), f"{r['flops'][m] / 1e9:.3g}")
            console.print(t)
        console.print(f"cpu: {attnlab.cpu.summary()}", highlight=False)
    return {"plans": results, "cpu": attnlab.cpu.INFO.as_dict(), "exit_code": 0}
