"""attnlab list: every registered mechanism and its declared capabilities (from its Spec)."""
from __future__ import annotations


def build_parser(p):
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--kind", choices=["exact", "pattern", "approximate"], help="only this kind")
    p.add_argument("--cost", metavar="L,S,D", default="4096,4096,64",
                   help="cost model evaluated at these sizes, per batch element and head (default 4096,4096,64)")


def _sizes(text: str) -> tuple[int, int, int]:
    from .main import UsageError

    try:
        L, S, D = (int(x) for x in text.split(","))
    except ValueError:
        raise UsageError(f"--cost must be three comma-separated integers L,S,D, got {text!r}") from None
    if min(L, S, D) < 1:
        raise UsageError(f"--cost sizes must be >= 1, got {text!r}")
    from attnlab.options import check_memory

    # a pattern's cost counts its kept pairs row by row: a few float64 vectors of length L and S
    check_memory(f"--cost {text}", 4 * 8 * (L + S), "the patterns' per-row counts of kept pairs")
    return L, S, D


def run(args):
    import json

    from rich.console import Console
    from rich.table import Table

    import attnlab.mechanisms as M

    L, S, D = _sizes(args.cost)
    rows = []
    for name in M.available():
        d = M.describe(name)
        if args.kind and d["kind"] != args.kind:
            continue
        if not M._needs_params(name):
            m = M.get(name)
            d["gflop"] = m.flops(L, S, D) / 1e9
            d["memory_mib"] = m.memory(L, S, D) / 2**20
        else:
            d["gflop"] = d["memory_mib"] = None
        rows.append(d)
    console = Console(width=200)
    if args.json:
        console.print_json(json.dumps(rows))
    else:
        t = Table(title=f"attnlab mechanisms (cost at L={L}, S={S}, D={D}, per batch·head, default params)",
                  title_justify="left")
        for c in ("name", "kind", "causal", "masks", "weights", "dropout", "time", "GFLOP", "MiB",
                  "parameters (defaults)", "paper"):
            t.add_column(c, overflow="fold")
        yes = lambda b: "[green]yes[/]" if b else "[red]no[/]"  # noqa: E731
        for d in rows:
            t.add_row(d["name"], d["kind"], yes(d["causal"]), d["masks"], yes(d["weights"]), yes(d["dropout"]),
                      d["time"], "—" if d["gflop"] is None else f"{d['gflop']:.3g}",
                      "—" if d["memory_mib"] is None else f"{d['memory_mib']:.3g}", d["params"], d["paper"])
        console.print(t)
        console.print("masks: none | key (bool key padding [..., 1, S]) | any ([..., L, S]).  "
                      "Use: attnlab.mechanisms.get(name, **params) or resolve(name).")
    return {"mechanisms": rows, "exit_code": 0}
