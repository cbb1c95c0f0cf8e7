"""attnlab list: every registered mechanism and its declared capabilities (from its Spec), or with
--kernels every attention kernel's declaration (``attnlab.kernels.KernelSpec``)."""
from __future__ import annotations

import argparse
from attnlab import kernels
from attnlab.patterns import Pattern

from .common import UsageError
from .common import console as new_console
from .options import check_memory


def build_parser(p: argparse.ArgumentParser) -> None:
    """list's options: --json, --kernels instead of mechanisms, --kind, and the sizes of the cost columns."""
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--kernels", action="store_true",
                   help="list the kernels attnlab.attention plans over and what each declares it supports")
    p.add_argument("--kind", choices=["exact", "pattern", "approximate"], help="only this kind")
    p.add_argument("--cost", metavar="L,S,D", default="4096,4096,64",
                   help="cost model evaluated at these sizes, per batch element and head (default 4096,4096,64)")


#: a pattern without a closed-form pair count is counted pair by pair (Pattern.nnz: O(L·S) work, about a
#: minute per pattern at 2^28 pairs on the 2-core reference machine); above this, its cost is not shown.
#: Every registered pattern counts analytically (``Pattern.counts_analytically``); this guards the others.
COUNT_LIMIT_PAIRS = 2**28


def _counted_pair_by_pair(m, L: int, S: int) -> bool:
    """Whether the mechanism's cost at (L, S) needs the generic O(L·S) count of a pattern's kept pairs."""

    pattern_for = getattr(m, "pattern_for", None)
    try:
        pat = pattern_for() if pattern_for is not None else None
    except NotImplementedError:
        pat = None
    return isinstance(pat, Pattern) and not pat.counts_analytically() and L * S > COUNT_LIMIT_PAIRS


def _sizes(text: str) -> tuple[int, int, int]:
    try:
        L, S, D = (int(x) for x in text.split(","))
    except ValueError:
        raise UsageError(f"--cost must be three comma-separated integers L,S,D, got {text!r}") from None
    if min(L, S, D) < 1:
        raise UsageError(f"--cost sizes must be >= 1, got {text!r}")

    # a pattern's cost counts its kept pairs row by row: a few float64 vectors of length L and S
    check_memory(f"--cost {text}", 4 * 8 * (L + S), "the patterns' per-row counts of kept pairs")
    return L, S, D


def kernel_rows() -> list[dict]:
    """One dict per kernel from its declaration: name, summary and the capability fields."""

    rows = []
    for s in kernels.KERNELS:
        rows.append({"name": s.name, "summary": s.summary, "masks": s.masks, "causal": s.causal, "weights": s.weights, "lse": s.lse, "dropout": s.dropout,
                     "backward": s.backward, "float_mask_grad": s.float_mask_grad, "gqa_no_copy": s.gqa_no_copy,
                     "materializes": s.materializes, "needs_sparsity": s.needs_sparsity,
                     "needs_extension": s.needs_extension, "devices": list(s.devices) if s.devices else None,
                     "dtypes": [str(d).replace("torch.", "") for d in s.dtypes], "softcap": s.softcap,
                     "alibi": s.alibi, "alibi_shapes": list(s.alibi_shapes) if s.alibi != "no" else []})
    return rows


def _run_kernels(args, console) -> dict:
    import json

    from rich.table import Table

    rows = kernel_rows()
    if args.json:
        console.print_json(json.dumps(rows))
        return {"kernels": rows, "exit_code": 0}
    t = Table(title="attnlab kernels (what attnlab.attention's planner reads; `attnlab explain` shows its choice)",
              title_justify="left")
    for c in ("name", "weights", "lse", "dropout", "mask grad", "softcap", "ALiBi", "materialises", "needs", "summary"):
        t.add_column(c, overflow="fold")
    for r in rows:
        needs = [n for n, on in (("a mask", r["needs_sparsity"]), ("the extension", r["needs_extension"])) if on]
        needs += [f"{'/'.join(r['devices'])} tensors"] if r["devices"] else []
        t.add_row(r["name"], r["weights"], r["lse"], "yes" if r["dropout"] else "no",
                  "yes" if r["float_mask_grad"] else "no", "yes" if r["softcap"] else "no",
                  r["alibi"] + (f" {' or '.join(r['alibi_shapes'])}" if r["alibi"] != "no" else ""),
                  r["materializes"], ", ".join(needs) or "—", r["summary"])
    console.print(t)
    return {"kernels": rows, "exit_code": 0}


def run(args: argparse.Namespace) -> dict:
    """Print every registered mechanism (or, with --kernels, every kernel) and what it declares; the mechanism
    table adds GFLOP and MiB per batch element and head at --cost's sizes, with default parameters.

    Returns the rows (``mechanisms`` or ``kernels``) and ``exit_code`` 0."""
    import json

    from rich.table import Table

    import attnlab.mechanisms as M  # lazy subcommand: loaded when the command runs, not by `attnlab --help`

    if getattr(args, "kernels", False):
        return _run_kernels(args, new_console())

    L, S, D = _sizes(args.cost)
    rows, uncounted = [], []
    for name in M.available():
        d = M.describe(name)
        if args.kind and d["kind"] != args.kind:
            continue
        if not M.needs_params(name):
            m = M.get(name)
            slow = _counted_pair_by_pair(m, L, S)
            d["gflop"] = None if slow else m.flops(L, S, D) / 1e9
            d["memory_mib"] = m.memory(L, S, D) / 2**20
            if slow:
                uncounted.append(name)
        else:
            d["gflop"] = d["memory_mib"] = None
        rows.append(d)
    console = new_console()  # follows the terminal (or $COLUMNS)
    if args.json:
        console.print_json(json.dumps(rows))
    else:
        # Columns follow the terminal: the long ones (time, parameters, paper) only where they fit.
        W = console.width
        cols = {"time": W >= 100, "parameters (defaults)": W >= 130, "paper": W >= 170}
        t = Table(title=f"attnlab mechanisms (cost at L={L}, S={S}, D={D}, per batch·head, default params)",
                  title_justify="left")
        for c in ("name", "kind", "masks"):
            t.add_column(c, no_wrap=True)
        t.add_column("supports", overflow="fold", min_width=8)
        if cols["time"]:
            t.add_column("time", no_wrap=True)
        for c in ("GFLOP", "MiB"):
            t.add_column(c, no_wrap=True, justify="right")
        for c in ("parameters (defaults)", "paper"):
            if cols[c]:
                t.add_column(c, ratio=1, overflow="fold", min_width=16)
        for d in rows:
            sup = [f for f in ("causal", "weights", "dropout") if d[f]]
            cells = [d["name"], d["kind"], d["masks"], ", ".join(sup) or "—"]
            cells += [d["time"]] if cols["time"] else []
            cells += ["—" if d["gflop"] is None else f"{d['gflop']:.3g}",
                      "—" if d["memory_mib"] is None else f"{d['memory_mib']:.3g}"]
            cells += [d["params"]] if cols["parameters (defaults)"] else []
            cells += [d["paper"]] if cols["paper"] else []
            t.add_row(*cells)
        console.print(t)
        console.print("masks: none | key (bool key padding [..., 1, S]) | any ([..., L, S]).  "
                      "Use: attnlab.mechanisms.get(name, **params) or resolve(name).")
        if uncounted:
            console.print(f"GFLOP not shown for {', '.join(uncounted)}: their kept pairs are counted one by one, "
                          f"O(L·S) work, and L·S = {L * S:.3g} is over {COUNT_LIMIT_PAIRS:.3g}; use a smaller --cost")
        hidden = [c for c, on in cols.items() if not on]
        if hidden:
            console.print(f"(a wider terminal also shows: {', '.join(hidden)}; `attnlab list --json` has everything)")
    return {"mechanisms": rows, "exit_code": 0}
