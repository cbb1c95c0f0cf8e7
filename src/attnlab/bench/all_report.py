"""The analysis and the report of ``bench all``: ratios to SDPA, fitted exponents, plots, CSV and Markdown.

Every function takes the result dict :func:`analyse` builds (what results.json holds) and writes or
returns one part of the report; nothing here measures.
"""
from __future__ import annotations

import statistics
from pathlib import Path

from attnlab.report import atomic_write_text

from ..harness import fmt, line_styles, markdown_table, pyplot, save_plot
from ..report import format_bytes, legend_outside
from .all_jobs import REFERENCE
from .fit import fit_exponent

__all__ = ["TUTORIAL_TABLE", "analyse", "plots", "write_csv", "markdown", "format_seconds"]

#: the tutorial's "Why This Matters for Production" table: n -> (operations, latency, memory) as printed
TUTORIAL_TABLE = {128: ("1M", "<1ms", "64KB"), 512: ("17M", "5-10ms", "1MB"), 2048: ("270M", "50-100ms", "16MB"),
                  4096: ("1B", "200-400ms", "67MB")}


def format_seconds(t: float | None) -> str:
    """0.0123 -> '12.3 ms', 2.5 -> '2.5 s', None -> '—'."""
    if t is None:
        return "—"
    return f"{t * 1e3:.3g} ms" if t < 1 else f"{t:.3g} s"


def analyse(records, mechs, lengths, peak, stopped, prod, lra, lra_lengths) -> dict:
    """Ratios to torch SDPA at the same n written into each record (time, memory, fraction of the
    matrix-product ``peak``), fitted exponents per mechanism (n >= 1024 where possible), a reason for each
    mechanism that stopped, and the LRA table's ratios to vanilla attention; returns the report's dict."""
    ref = {r["n"]: r for r in records if r["mechanism"] == REFERENCE and "error" not in r}
    pk = peak.get("gflops")
    for r in records:
        if "error" in r:
            continue
        s = ref.get(r["n"])
        r["time_vs_sdpa"] = r["time_s"] / s["time_s"] if s else None
        r["memory_vs_sdpa"] = r["peak_bytes"] / s["peak_bytes"] if s and s["peak_bytes"] else None
        r["fraction_of_matmul_peak"] = r["gflops"] / pk if r.get("gflops") and pk else None
    fits = {}
    for m in mechs:
        ok = sorted((r for r in records if r["mechanism"] == m and "error" not in r), key=lambda r: r["n"])
        ns = [r["n"] for r in ok]
        fits[m] = {"time": fit_exponent(ns, [r["time_s"] for r in ok], 1024),
                   "memory": fit_exponent(ns, [r["peak_bytes"] for r in ok], 1024),
                   "time_all": fit_exponent(ns, [r["time_s"] for r in ok]),
                   "points": len(ok), "max_n": max(ns) if ns else None}
        errs = [r for r in records if r["mechanism"] == m and "error" in r]
        if errs and m not in stopped:
            stopped[m] = f"error at n={errs[0]['n']}: {errs[0]['error']}"
    vref = {r["n"]: r for r in lra if r["mechanism"] == "sdpa" and "error" not in r}
    if not vref:
        vref = {r["n"]: r for r in lra if r["mechanism"] == REFERENCE and "error" not in r}
    for r in lra:
        v = vref.get(r["n"])
        if "error" not in r and v:
            r["speed_vs_vanilla"] = r["steps_per_s"] / v["steps_per_s"]
            r["memory_vs_vanilla"] = r["peak_bytes"] / v["peak_bytes"] if v["peak_bytes"] else None
    return {"records": records, "matmul_gflops": pk, "matmul": peak, "fits": fits, "stopped": stopped,
            "production": prod, "lra": lra, "lra_lengths": lra_lengths,
            "lra_vanilla": "sdpa" if any(r["mechanism"] == "sdpa" for r in lra) else REFERENCE}


def plots(out: Path, res) -> list[str]:
    """time.png, memory.png, ratio.png (and lra.png) in ``out``: every mechanism against n, log-log."""
    plt = pyplot()
    files = []
    ok = [r for r in res["records"] if "error" not in r]
    for key, ylabel, fname in (("time_s", "median forward time (s)", "time.png"), ("peak_bytes", "peak memory (bytes)", "memory.png"),
                               ("time_vs_sdpa", "time / torch SDPA time", "ratio.png")):
        fig, ax = plt.subplots(figsize=(8, 5.5))
        others = [m for m in res["mechanisms"] if m != REFERENCE]
        style = dict(zip(others, line_styles(len(others))))
        style[REFERENCE] = {"color": "black", "marker": "o", "linestyle": "-"}
        for m in res["mechanisms"]:
            pts = sorted((r["n"], r[key]) for r in ok if r["mechanism"] == m and r.get(key))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], ms=3, lw=1.2, label=m, **style[m])
        if key != "time_vs_sdpa" and ok:
            n0 = min(r["n"] for r in ok)
            ys = [r[key] for r in ok if r["n"] == n0 and r.get(key)]
            if ys:
                y0 = statistics.median(ys)
                ns = sorted({r["n"] for r in ok})
                ax.plot(ns, [y0 * (n / n0) ** 2 for n in ns], "k:", lw=0.8, label="∝ n²")
                ax.plot(ns, [y0 * (n / n0) for n in ns], "k--", lw=0.8, label="∝ n")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length n")
        ax.set_ylabel(ylabel)
        sh = res["shape"]
        ax.set_title(f"B={sh['B']}, H={sh['H']}, D={sh['D']}, float32, forward", fontsize=10)
        ax.grid(alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[0]:  # an interrupted run may have nothing to label yet
            legend_outside(ax)
        files.append(save_plot(fig, out / fname))
    if res["lra"]:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        lstyle = dict(zip(res["mechanisms"], line_styles(len(res["mechanisms"]))))
        for m in res["mechanisms"]:
            pts = sorted((r["n"], r.get("speed_vs_vanilla"), r.get("memory_vs_vanilla")) for r in res["lra"]
                         if r["mechanism"] == m and "error" not in r)
            if pts:
                axes[0].plot([p[0] for p in pts], [p[1] for p in pts], ms=3, lw=1.2, label=m, **lstyle[m])
                axes[1].plot([p[0] for p in pts], [p[2] for p in pts], ms=3, lw=1.2, label=m, **lstyle[m])
        for ax, t in zip(axes, ("training steps/s vs vanilla", "peak memory vs vanilla")):
            ax.set_xlabel("n")
            ax.set_yscale("log")
            ax.set_title(t, fontsize=10)
        legend_outside(axes[1])
        files.append(save_plot(fig, out / "lra.png"))
    return files


def write_csv(out: Path, res) -> str:
    """results.csv: one row per measurement of the grid, production and LRA tables (atomically)."""
    import csv
    import io

    cols = ["table", "kind", "mechanism", "n", "B", "H", "D", "time_s", "peak_bytes", "flops", "gflops",
            "fraction_of_matmul_peak", "time_vs_sdpa", "memory_vs_sdpa", "steps_per_s", "speed_vs_vanilla",
            "memory_vs_vanilla", "repeats_done", "error"]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore")
    w.writeheader()
    for r in res["records"] + res["production"] + res["lra"]:
        w.writerow({"table": r.get("table", "grid"), **r})
    atomic_write_text(out / "results.csv", buf.getvalue())
    return str(out / "results.csv")


def markdown(res) -> str:
    """report.md: the setup, fitted exponents, every measurement, the production and LRA tables, the
    environment (a partial report says so at the top)."""
    sh = res["shape"]
    md = ["# attnlab bench all: every mechanism × sequence length", ""]
    if not res.get("complete", True):
        n_done = len(res["records"]) + len(res["production"]) + len(res["lra"])
        md += [f"> **Partial report** ({res.get('interrupted') or 'run in progress or killed'}): {n_done} "
               "configuration(s) measured so far. `attnlab bench all --resume` with the same options and `--out` "
               "measures only the rest.", ""]
    if len(res.get("sessions") or []) > 1:
        md += [f"> Measured over {len(res['sessions'])} sessions (`--resume`): {', '.join(res['sessions'])}. "
               f"{res.get('reused', 0)} configuration(s) were reused from earlier sessions, "
               f"{res.get('measured_this_session', 0)} measured in the last one; each record's `session` says when. "
               "A ratio between records of different sessions compares measurements taken at different times.", ""]
    pics = {Path(f).name for f in res.get("files") or []}
    md += [
          f"Forward pass, float32, B={sh['B']}, H={sh['H']}, D={sh['D']}, L = S = n; median of {res['repeats']} calls "
          f"after {res['warmup']} warm-up call(s). Peak memory: growth of the worker's peak RSS over its RSS once the "
          f"inputs exist ({'a fresh process per configuration' if res['isolation'] == 'config' else 'one worker process; peak reset between configurations'}). "
          f"FLOPs from each mechanism's cost model (`flops()`); GFLOP/s against a {res['matmul'].get('size')}² float32 "
          f"matrix product measured at the start of each session and at the end of the run (the largest counts): **{fmt(res['matmul_gflops'])} "
          f"GFLOP/s** (other: {fmt(res['matmul'].get('other_measurement_gflops'))}). Every ratio is to "
          f"`{REFERENCE}` (torch.nn.functional.scaled_dot_product_attention) at the same n, in the same run. "
          f"Budgets: {res['time_budget_s']:g} s per configuration ({4 * res['time_budget_s']:g} s for the reference), "
          f"{format_bytes(res['memory_budget_bytes'])} memory."
          + (" **Quick mode: toy sizes.**" if res["quick"] else ""), "",
          *[x for f in ("time", "memory", "ratio") if f + ".png" in pics for x in (f"![{f}]({f}.png)", "")],
          "## Fitted exponents (log-log least squares over n ≥ 1024 where there are two such points, else all)", ""]
    rows = [[m, f["time"], f["memory"], f["time_all"], f["max_n"], res["stopped"].get(m, "")] for m, f in res["fits"].items()]
    md += [markdown_table(["mechanism", "time exponent", "memory exponent", "time exponent (all n)", "largest n",
                        "stopped"], rows), ""]
    md += ["## Every measurement", ""]
    rows = []
    for r in sorted(res["records"], key=lambda r: (res["mechanisms"].index(r["mechanism"]) if r["mechanism"] in res["mechanisms"] else 99, r["n"])):
        if "error" in r:
            rows.append([r["mechanism"], r["n"], "—", "—", "—", "—", "—", "—", r["error"][:80]])
        else:
            rows.append([r["mechanism"], r["n"], format_seconds(r["time_s"]), format_bytes(r["peak_bytes"]), r.get("gflops"),
                         r.get("fraction_of_matmul_peak"), r.get("time_vs_sdpa"), r.get("memory_vs_sdpa"), ""])
    md += [markdown_table(["mechanism", "n", "time", "peak memory", "GFLOP/s", "of matmul peak", "time vs SDPA",
                        "memory vs SDPA", "note"], rows), ""]
    if res["production"]:
        md += ["## The tutorial's production table, regenerated on this machine", "",
               "One head, d_k = 64, float32, forward only. The tutorial names no machine; its figures are shown "
               "as printed beside ours. 'naive' is softmax(QKᵀ/√d_k)V written out in PyTorch (it materialises the "
               "n×n scores, as the tutorial's memory column assumes); torch SDPA is PyTorch's fused kernel.", ""]
        rows = []
        by = {(r["mechanism"], r["n"]): r for r in res["production"]}
        for n in sorted({r["n"] for r in res["production"]}):
            ops, lat, mem = TUTORIAL_TABLE.get(n, ("—", "—", "—"))
            nv, sd = by.get(("naive", n), {}), by.get((REFERENCE, n), {})
            rows.append([n, ops, f"{n * n * 64 / 1e6:.3g}M", lat, format_seconds(nv.get("time_s")), format_seconds(sd.get("time_s")),
                         mem, format_bytes(n * n * 4), format_bytes(nv.get("peak_bytes")), format_bytes(sd.get("peak_bytes"))])
        md += [markdown_table(["n", "tutorial ops", "n²·d_k", "tutorial latency", "measured naive", "measured torch SDPA",
                            "tutorial memory", "n²·4 B", "measured naive peak", "measured SDPA peak"], rows), ""]
    if res["lra"]:
        md += ["## LRA-style efficiency (Tay et al. 2020, Table 2 layout)", "",
               f"Training steps/s and peak memory of a 2-layer classifier (an `attnlab.nn.Encoder`, d_model 64, 2 heads; "
               f"`{REFERENCE}` runs there as attnlab's method sdpa, `naive` as method dense) with each mechanism, "
               f"relative to vanilla attention (`{res['lra_vanilla']}`) at the same n, batch "
               f"{(res['lra'] or [{}])[0].get('B')}. Above 1 is faster / more memory.", ""]
        ns = res["lra_lengths"]
        by = {(r["mechanism"], r["n"]): r for r in res["lra"]}
        rows = []
        for m in res["mechanisms"]:
            cells_s = [by.get((m, n), {}).get("speed_vs_vanilla") for n in ns]
            cells_m = [by.get((m, n), {}).get("memory_vs_vanilla") for n in ns]
            errs = [by.get((m, n), {}).get("error") for n in ns if by.get((m, n), {}).get("error")]
            rows.append([m, *cells_s, *cells_m, (errs[0][:60] if errs else "")])
        md += [markdown_table(["mechanism", *[f"steps/s ×, n={n}" for n in ns], *[f"memory ×, n={n}" for n in ns], "note"], rows),
               "", *(["![lra](lra.png)", ""] if "lra.png" in pics else [])]
    if res["mechanisms_note"]:
        md += [f"Mechanism registry: {res['mechanisms_note']}", ""]
    md += ["## Environment", "", "```", *[f"{k}: {v}" for k, v in res["environment"].items() if k != "argv"], "```", ""]
    return "\n".join(md)

