"""attnlab check: every applicable mechanism against the float64 oracle, on your shapes and on edge cases.

The cases, tolerances and the check itself live in ``attnlab.conformance``; this module parses the
arguments and prints the result. The exit code is 1 when an exact mechanism misses its tolerance (or
any mechanism crashes on inputs it claims).
"""
from __future__ import annotations

import argparse

from attnlab.conformance import (CASES, DTYPES, TOL_FACTOR, TOL_FLOOR, check, check_budget, make_cases,
                                 run_conformance, sized_instance)
from .options import positive_int, seed

from .common import UsageError, progress_display
from .common import console as new_console

__all__ = ["run", "build_parser", "verdict", "check", "CASES", "TOL_FACTOR", "TOL_FLOOR", "make_cases", "sized_instance"]


def build_parser(p: argparse.ArgumentParser) -> None:
    """check's options: the query shape and S, dtype, which mechanisms and cases, the seed, --json."""
    p.add_argument("--shape", default="2,4,77,32", metavar="B,H,L,E", help="query shape (default 2,4,77,32)")
    p.add_argument("--kv-len", type=positive_int, help="key/value length S (default L)")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32", help="dtype of the inputs")
    p.add_argument("--mechanism", "-m", action="append", metavar="NAME",
                   help="check only these mechanisms (repeat); default: every registered one")
    p.add_argument("--case", action="append", choices=list(CASES), help="only these cases (repeat)")
    p.add_argument("--seed", type=seed, default=0, help="seed of the random inputs")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress on stderr (a bar on a terminal, a line per mechanism and case when piped)")


def _shape(text: str) -> tuple[int, int, int, int]:
    try:
        dims = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise UsageError(f"--shape must be four comma-separated integers B,H,L,E, got {text!r}") from None
    if len(dims) != 4 or min(dims) < 1:
        raise UsageError(f"--shape must be four positive integers B,H,L,E, got {text!r}")
    return dims  # type: ignore[return-value]


def verdict(rows: list[dict]) -> str:
    """The verdict cell for one mechanism's rows (one per case): exact ones within tolerance or not;
    approximations within their ``Spec.error_band`` or not (Note [Error bands] in attnlab.mechanisms),
    e.g. "expected (band ≤ 12)" or "OUTSIDE band ≤ 1.5: random 2.3"."""
    ran = [r for r in rows if r["status"] != "skip"]
    if not ran:
        return "[dim]skipped[/]"
    failed = [r for r in ran if r["status"] == "FAIL"]
    if failed:
        return f"[bold red]FAIL[/]: {', '.join(r['case'] for r in failed)}"
    if ran[0]["exact"]:
        return "[green]within tolerance[/]"
    band = ran[0].get("band")
    if band is None:
        return "no band declared"
    out = [r for r in ran if r.get("within_band") is False]
    if out:
        worst = max(out, key=lambda r: r["rel_fro_err"])
        return f"[yellow]OUTSIDE[/] band ≤ {band:g}: {worst['case']} {worst['rel_fro_err']:.2g}"
    return f"[green]expected[/] (band ≤ {band:g})"


def run(args: argparse.Namespace) -> dict:
    """Run the conformance check (``attnlab.conformance.run_conformance``) and print its table or JSON.

    Returns the rows, the failure counts and ``exit_code`` (1 when an exact mechanism missed its
    tolerance or any mechanism crashed on inputs it claims, else 0)."""
    import json

    from rich.table import Table

    shape = _shape(args.shape)
    if args.kv_len is not None and args.kv_len < 1:
        raise UsageError(f"--kv-len must be >= 1, got {args.kv_len}")
    check_budget(shape, args.kv_len, args.case, args.shape)  # names the user's --shape text
    try:
        with progress_display(enabled=not args.no_progress, title="check") as show:
            res = run_conformance(args.mechanism, shape, args.kv_len, DTYPES[args.dtype], args.seed, args.case,
                                  progress=show)
    except ValueError as e:  # an unknown mechanism name
        raise UsageError(str(e)) from None
    rows, failures, exact_fail = res.rows, res.failures, res.exact_failures
    console = new_console()  # follows the terminal (or $COLUMNS)
    if args.json:
        console.print_json(json.dumps(rows))
    else:
        cases = list(dict.fromkeys(r["case"] for r in rows))
        t = Table(title=f"attnlab check: query {list(shape)}, S={args.kv_len or shape[2]}, {args.dtype}; cell: "
                        f"exact: max |error| vs float64 reference (ok / FAIL); approximations: relative "
                        f"Frobenius error (~); windows and budgets sized to ~L/8; verdict: exact within "
                        f"tolerance, approximations within their declared error band",
                  title_justify="left")
        t.add_column("mechanism")
        for c in cases:
            t.add_column(c)
        t.add_column("verdict")
        by = {(r["mechanism"], r["case"]): r for r in rows}
        for n in dict.fromkeys(r["mechanism"] for r in rows):
            cells = []
            for c in cases:
                r = by[(n, c)]
                if r["status"] == "skip":
                    cells.append("[dim]skip[/]")
                elif r["status"] == "ok":
                    cells.append(f"[green]ok[/] {r['max_abs_err']:.1e}")
                elif r["status"] == "approx":
                    cells.append(f"~ rel {r['rel_fro_err']:.2g}")
                else:
                    cells.append(f"[bold red]FAIL[/] {r.get('max_abs_err', float('nan')):.1e}")
            t.add_row(n, *cells, verdict([by[(n, c)] for c in cases]))
        console.print(t)
        reasons = {}
        for r in rows:
            for why in r.get("reasons", []):
                reasons.setdefault(why, []).append(f"{r['case']}")
        if reasons:
            console.print("[bold]skipped / failed, and why:[/]")
            for why, where in reasons.items():
                console.print(f"  {why}  [dim]({', '.join(dict.fromkeys(where))})[/]")
        paths = {}
        for r in rows:
            if r.get("path") and r["exact"]:
                paths.setdefault(r["mechanism"], set()).add(r["path"])
        console.print("[bold]paths:[/] " + "; ".join(f"{n}: {', '.join(sorted(p))}" for n, p in paths.items()))
        msg = (f"[bold red]{len(exact_fail)} exact check(s) missed tolerance[/]" if exact_fail
               else "[green]every exact mechanism is within tolerance[/]")
        console.print(msg + f" (tolerance = {TOL_FACTOR} × naive same-dtype error + floor)")
        outside = res.outside_band
        if outside:
            console.print(f"[yellow]{len(outside)} approximation result(s) outside the declared error band[/] "
                          f"({', '.join(dict.fromkeys(r['mechanism'] for r in outside))}): a regression, or inputs "
                          "the band does not cover (head dim > 64, a budget far below L/4); not a failure")
    return {"results": rows, "failures": len(failures), "exact_failures": len(exact_fail),
            "outside_band": len(res.outside_band), "exit_code": res.exit_code}
