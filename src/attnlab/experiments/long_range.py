"""attnlab experiment long-range: ListOps (LRA rules), associative recall and selective copy at n >= 1024,
every attention mechanism trained with the same small budget.

Reports accuracy per task, training steps/s and peak memory (RSS growth while training, measured per
run after handing freed memory back to the OS) relative to vanilla exact attention, in the layout of
Tay et al. 2020 (Long Range Arena), Tables 1 and 2. Writes reports/long-range/.
"""
from __future__ import annotations

import time

from . import _common as C

__all__ = ["build_parser", "run", "default_mechanisms", "VANILLA"]

VANILLA = "sdpa"
TASKS = ("listops", "recall", "copy")


def build_parser(p):
    C.add_common_args(p, seeds="0")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (default 1024; quick 128)")
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated subset of {', '.join(TASKS)}")
    p.add_argument("--mechanisms", default=None,
                   help="comma-separated mechanisms (default: vanilla 'sdpa' and every registered pattern and "
                        "approximation); also torch_sdpa, naive, dense, tiled")
    p.add_argument("--batch-size", type=int, default=None, help="batch size (default 8; quick 4)")
    p.add_argument("--train-examples", type=int, default=None, help="generated training examples per task (default 4000)")
    p.add_argument("--test-examples", type=int, default=None, help="held-out examples per task (default 500)")


def default_mechanisms() -> tuple[list[str], str | None]:
    """Vanilla first, then every registered non-exact mechanism (patterns and approximations)."""
    names, why = C.mechanism_names()
    if why is not None:
        return [VANILLA, "pattern:sliding_window", "pattern:longformer", "pattern:bigbird", "pattern:strided"], why
    import attnlab.mechanisms as M

    specs = M.specs()
    return [VANILLA] + [n for n in names if specs[n].kind != "exact"], None


def _datasets(tasks, T, n_train, n_test, seed):
    from attnlab.data import make_task

    out = {}
    for t in tasks:
        kw = {"min_length": T // 4} if t == "listops" else {}
        out[t] = make_task(t, n_train + n_test, T, seed=seed, **kw).split(n_train)
    return out


def run(args):
    with C.threads(args.threads):
        return _run(args)


def _run(args):
    t0 = time.perf_counter()
    seeds = C.seeds_of(args.seeds)
    T = args.seq_len or (128 if args.quick else 1024)
    if T < 32:
        raise ValueError(f"--seq-len must be >= 32, got {T}")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    bad = [t for t in tasks if t not in TASKS]
    if bad or not tasks:
        raise ValueError(f"--tasks must be a comma-separated subset of {TASKS}, got {args.tasks!r}")
    if args.mechanisms:
        mechs, why = [m.strip() for m in args.mechanisms.split(",") if m.strip()], None
    else:
        mechs, why = default_mechanisms()
        if args.quick:
            mechs = mechs[:4]
    steps = args.steps or (6 if args.quick else 200)
    batch = args.batch_size or (4 if args.quick else 8)
    n_train, n_test = (64, 32) if args.quick else (4000, 500)
    n_train, n_test = args.train_examples or n_train, args.test_examples or n_test
    if n_train < 1 or n_test < 1:
        raise ValueError(f"--train-examples and --test-examples must be >= 1, got {n_train} and {n_test}")
    out = C.out_dir(args, "long-range")
    datasets = _datasets(tasks, T, n_train, n_test, seed=1234)
    configs, refused = [], {}
    for m in mechs:
        try:
            C.attention_fn(m, T)  # unknown names fail here, before any training
        except (ValueError, TypeError) as e:
            refused[m] = str(e)
            continue
        for task in tasks:
            for seed in seeds:
                configs.append(C.RunConfig(name=f"{task}-{m}", task=task, seq_len=T, d_model=64, num_heads=2,
                                           head_dim=32, num_layers=2, attention=m, steps=steps, batch_size=batch,
                                           lr=1e-3, seed=seed, log_every=max(1, steps // 10)))
    runs = []
    with C.progress(args.no_progress) as prog:
        tid = prog.add_task("long-range", total=sum(c.steps for c in configs))
        ckdir = out / "checkpoints"
        for cfg in configs:
            train, test = datasets[cfg.task]
            try:
                r = C.train_run(cfg, train, test, ckdir / f"{cfg.file_id}.pt", resume=args.resume,
                                advance=lambda n: prog.advance(tid, n))
            except Exception as e:  # a mechanism that cannot run this input: record why, measure the rest
                refused[f"{cfg.attention} on {cfg.task}"] = f"{type(e).__name__}: {e}"
                prog.advance(tid, cfg.steps)
                continue
            r["mechanism"], r["task"] = cfg.attention, cfg.task
            runs.append(r)
            from attnlab.report import atomic_write_json

            atomic_write_json(out / "results.partial.json", {"complete": False, "runs": runs, "refused": refused})
    table = _lra_table(runs, tasks)
    files = [_plot(out, table, tasks)] if table else []
    results = {"experiment": "long-range", "seq_len": T, "tasks": tasks, "mechanisms": mechs,
               "mechanisms_note": why, "vanilla": VANILLA, "steps": steps, "batch_size": batch,
               "train_examples": n_train, "test_examples": n_test, "seeds": seeds, "quick": bool(args.quick),
               "table": table, "refused": refused, "runs": runs,
               "task_meta": {t: {k: v for k, v in datasets[t][0].meta.items() if k != "lengths"} for t in tasks},
               "environment": C.env_record(seeds), "files": files, "complete": True,
               "wall_s": time.perf_counter() - t0}
    md = _report(results)
    results["paths"] = C.write_results(out, results, md)
    partial = out / "results.partial.json"
    if partial.exists():
        partial.unlink()
    lines = [f"[bold]long-range[/bold] n={T} -> {out}/report.md"]
    for row in table:
        accs = ", ".join(f"{t} {C.fmt(row['accuracy'].get(t))}" for t in tasks)
        lines.append(f"  {row['mechanism']:<16} {accs}; steps/s ×{C.fmt(row['speed_vs_vanilla'])}, "
                     f"memory ×{C.fmt(row['memory_vs_vanilla'])}")
    if refused:
        lines.append(f"  refused: {', '.join(refused)}")
    C.render(lines)
    results["summary_lines"] = lines
    return results


def _lra_table(runs, tasks) -> list[dict]:
    by = {}
    for r in runs:
        by.setdefault(r["mechanism"], []).append(r)
    rows = []
    for m, rs in by.items():
        acc = {t: C.mean_std([r["eval"]["accuracy"] for r in rs if r["task"] == t])[0] for t in tasks}
        sps = C.mean_std([r["steps_per_s"] for r in rs])[0]
        mem = C.mean_std([r["peak_rss_delta_bytes"] for r in rs if r["peak_rss_delta_bytes"] is not None])[0]
        vals = [a for a in acc.values() if a is not None]
        rows.append({"mechanism": m, "accuracy": acc, "avg_accuracy": sum(vals) / len(vals) if vals else None,
                     "steps_per_s": sps, "peak_bytes": mem})
    van = next((r for r in rows if r["mechanism"] == VANILLA), None)
    for r in rows:
        r["speed_vs_vanilla"] = r["steps_per_s"] / van["steps_per_s"] if van and van["steps_per_s"] and r["steps_per_s"] else None
        r["memory_vs_vanilla"] = r["peak_bytes"] / van["peak_bytes"] if van and van["peak_bytes"] and r["peak_bytes"] else None
    return rows


def _plot(out, table, tasks):
    plt = C.plt()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for r in table:
        if r["steps_per_s"] and r["avg_accuracy"] is not None:
            size = 30 + 300 * (r["memory_vs_vanilla"] or 1.0)
            ax.scatter(r["steps_per_s"], r["avg_accuracy"], s=size, alpha=0.5)
            ax.annotate(r["mechanism"], (r["steps_per_s"], r["avg_accuracy"]), fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("training steps/s")
    ax.set_ylabel(f"mean accuracy ({', '.join(tasks)})")
    ax.set_title("accuracy vs speed (marker area ∝ peak memory vs vanilla)", fontsize=10)
    return C.save_plot(fig, out / "lra.png")


def _report(res) -> str:
    tasks = res["tasks"]
    chance = {"listops": "≈0.1–0.2 (majority class)", "recall": "1/16", "copy": "1/16 per token"}
    md = ["# Long-range tasks: every mechanism, one small budget", "",
          f"Sequence length {res['seq_len']}; a 2-layer pre-norm Transformer (d_model 64, 2 heads of 32), "
          f"{res['steps']} AdamW steps of batch {res['batch_size']} per task and mechanism, seeds {res['seeds']}, "
          f"{res['train_examples']} generated training and {res['test_examples']} held-out examples per task. "
          "ListOps follows the LRA generator (MIN, MAX, MED, SM; depth ≤ 10; up to 10 arguments; closing ] kept); "
          "associative recall reads the value of the queried key at the last token; selective copy reproduces 8 "
          "scattered tokens at the 8 final positions. Padding is not masked (every mechanism sees the same input; "
          "classification pools over non-pad tokens). Chance: "
          + "; ".join(f"{t} {chance[t]}" for t in tasks) + "."
          + (" **Quick mode: toy sizes, the numbers say nothing.**" if res["quick"] else ""), "",
          "Steps/s is training throughput (forward, backward, optimiser) on this machine's CPU; memory is the growth "
          "of the process's resident set during training, after returning freed memory to the OS (it includes "
          "activations, gradients and optimiser state, as LRA's Table 2 does). Both are relative to vanilla "
          f"attention ({res['vanilla']}) measured in the same run.", ""]
    if res["mechanisms_note"]:
        md += [f"Mechanism registry: {res['mechanisms_note']}", ""]
    rows = [[r["mechanism"], *[r["accuracy"].get(t) for t in tasks], r["avg_accuracy"], r["steps_per_s"],
             r["speed_vs_vanilla"], None if r["peak_bytes"] is None else r["peak_bytes"] / 2**20, r["memory_vs_vanilla"]]
            for r in res["table"]]
    md += [C.fmt_table(["mechanism", *[f"{t} acc" for t in tasks], "avg", "steps/s", "speed vs vanilla",
                        "peak MiB", "memory vs vanilla"], rows), ""]
    if res["files"]:
        md += ["![lra](lra.png)", ""]
    if res["refused"]:
        md += ["## Not run", ""] + [f"- {k}: {v}" for k, v in res["refused"].items()] + [""]
    md += ["## Environment", "", "```", *[f"{k}: {v}" for k, v in res["environment"].items() if k != "argv"], "```", ""]
    return "\n".join(md)
