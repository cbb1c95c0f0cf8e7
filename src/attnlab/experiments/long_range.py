"""attnlab experiment long-range: ListOps (LRA rules), associative recall and selective copy at n >= 1024,
every attention mechanism trained with the same small budget.

Reports accuracy per task, training steps/s and peak memory (RSS growth while training, measured per
run after handing freed memory back to the OS) relative to vanilla exact attention, in the layout of
Tay et al. 2020 (Long Range Arena), Tables 1 and 2 (``LongRangeResult.write``; reports/long-range/ from the CLI).
"""
from __future__ import annotations

import math
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

import attnlab.mechanisms as M
from attnlab import harness
from attnlab.data import make_task
from attnlab.harness import fmt
from attnlab.harness import markdown_table as table
from attnlab.resources import check_memory

from .attention import choose, mechanism_names
from .training import RunConfig, plot_curves, train_run

__all__ = ["LongRangeConfig", "LongRangeResult", "run", "default_mechanisms", "baseline_accuracy", "learned",
           "VANILLA", "TASKS", "FULL", "QUICK"]

VANILLA = "sdpa"
TASKS = ("listops", "recall", "copy")
#: the default budget (every mechanism and task gets the same); quick mode shrinks it to toy size
FULL = {"seq_len": 1024, "steps": 1000, "batch": 8, "lr": 3e-3, "d_model": 64, "layers": 1, "train": 4000, "test": 500,
        "queries": 8}
QUICK = {"seq_len": 128, "steps": 6, "batch": 4, "lr": 1e-3, "d_model": 64, "layers": 2, "train": 64, "test": 32, "queries": 4}


def default_mechanisms() -> tuple[list[str], str | None]:
    """Vanilla first, then every registered non-exact mechanism (patterns and approximations)."""
    names, why = mechanism_names()
    if why is not None:
        return [VANILLA, "pattern:sliding_window", "pattern:longformer", "pattern:bigbird", "pattern:strided"], why

    specs = M.specs()
    return [VANILLA] + [n for n in names if specs[n].kind != "exact"], None


def _datasets(tasks, T, n_train, n_test, seed, recall_queries=1):
    out = {}
    for t in tasks:
        kw = {"listops": {"min_length": T // 4}, "recall": {"num_queries": recall_queries}}.get(t, {})
        out[t] = make_task(t, n_train + n_test, T, seed=seed, **kw).split(n_train)
    return out


@dataclass
class LongRangeConfig:
    """Settings of the long-range experiment; a None size means the default (``FULL``, or ``QUICK`` with
    quick). out: folder for checkpoints and partial results (None: none); resume: continue from them;
    report_only: train nothing, report the finished runs in ``out``; mechanisms None: vanilla and every
    registered non-exact mechanism (quick: the first four); token_shift: Note [Token shift]."""

    out: Path | None = None
    quick: bool = False
    resume: bool = False
    report_only: bool = False
    seeds: list[int] = field(default_factory=lambda: [0])
    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    mechanisms: list[str] | None = None
    seq_len: int | None = None
    steps: int | None = None
    batch_size: int | None = None
    lr: float | None = None
    d_model: int | None = None
    layers: int | None = None
    recall_queries: int | None = None
    token_shift: bool = True
    train_examples: int | None = None
    test_examples: int | None = None
    threads: int | None = 1

    def resolved(self) -> dict:
        """The sizes after defaults (quick mode changes the defaults only, never a value that was given),
        checked: ValueError naming the option otherwise."""
        size = QUICK if self.quick else FULL

        def given(v, default):  # an option's value, the default only when it was not given (0 is refused, not replaced)
            return default if v is None else v

        s = {"seq_len": given(self.seq_len, size["seq_len"]), "steps": given(self.steps, size["steps"]),
             "batch_size": given(self.batch_size, size["batch"]), "lr": given(self.lr, size["lr"]),
             "d_model": given(self.d_model, size["d_model"]), "num_layers": given(self.layers, size["layers"]),
             "train_examples": given(self.train_examples, size["train"]),
             "test_examples": given(self.test_examples, size["test"]),
             "recall_queries": given(self.recall_queries, size["queries"])}
        if s["seq_len"] < 32:
            raise ValueError(f"--seq-len must be >= 32, got {s['seq_len']}")
        bad = [t for t in self.tasks if t not in TASKS]
        if bad or not self.tasks:
            raise ValueError(f"--tasks must be a comma-separated subset of {TASKS}, got {','.join(self.tasks)!r}")
        if not self.seeds:
            raise ValueError("--seeds must name at least one seed")
        for name, key in (("--steps", "steps"), ("--batch-size", "batch_size"), ("--layers", "num_layers"),
                          ("--train-examples", "train_examples"), ("--test-examples", "test_examples")):
            if s[key] < 1:
                raise ValueError(f"{name} must be >= 1, got {s[key]}")
        if s["d_model"] < 32 or s["d_model"] % 32:
            raise ValueError(f"--d-model must be a positive multiple of 32 (heads of 32), got {s['d_model']}")
        if not (s["lr"] > 0 and math.isfinite(s["lr"])):
            raise ValueError(f"--lr must be a finite number > 0, got {s['lr']}")
        if not 1 <= s["recall_queries"] <= 8:
            raise ValueError(f"--recall-queries must be in [1, 8] (8 key-value pairs), got {s['recall_queries']}")
        return s


@dataclass
class LongRangeResult:
    """Every run and the LRA-style table (accuracy per task, steps/s and memory relative to vanilla).
    ``interrupted`` (Ctrl-C or SIGTERM; ``exit_code`` 130) or ``not_run`` (report only) make it partial.
    :meth:`write` makes the report; :meth:`to_json` is results.json's content."""

    settings: dict
    baselines: dict
    table: list[dict]
    refused: dict
    runs: list[dict]
    task_meta: dict
    environment: dict
    wall_s: float
    interrupted: str | None = None
    not_run: list[str] = field(default_factory=list)
    configs: int = 0
    exit_code: int = 0

    @property
    def complete(self) -> bool:
        """True when every run was trained (not interrupted, nothing left out by report_only)."""
        return self.interrupted is None and not self.not_run

    def to_json(self, files: list[str] | None = None) -> dict:
        """results.json's content (``files``: the plots written beside it)."""
        return {"experiment": "long-range", **self.settings, "baselines": self.baselines, "table": self.table,
                "refused": self.refused, "runs": self.runs, "task_meta": self.task_meta,
                "environment": self.environment, "files": files or [], "complete": self.complete,
                "wall_s": self.wall_s, "interrupted": self.interrupted, "not_run": self.not_run}

    def write(self, out: str | Path) -> dict:
        """lra.png, curves.png, results.json, report.md, report.html into ``out``; the partial results
        file goes once the run is complete. Returns the paths."""
        out = Path(out)
        tasks = self.settings["tasks"]
        files = [_plot(out, self.table, tasks, self.baselines)] if self.table else []
        if self.runs:
            files.append(plot_curves(self.runs, lambda r: r["mechanism"], lambda r: r["task"], out / "curves.png",
                                     keys=(("loss", "training loss", False),
                                           ("entropy", "attention entropy (nats)", False))))
        res = self.to_json(files)
        paths = harness.write_report(out, res, _report(res))
        if self.complete:
            harness.remove_partial(out)
        return paths

    def summary_lines(self, out=None) -> list[str]:
        """A few lines for a terminal (rich markup): accuracy, speed and memory per mechanism."""
        tasks = self.settings["tasks"]
        lines = [f"[bold]long-range[/bold] n={self.settings['seq_len']} -> {out}/report.md"]
        if self.interrupted:
            lines.append(f"[bold red]{self.interrupted}[/bold red] after {len(self.runs)} of {self.configs} runs: "
                         "partial report written; `--resume` with the same options continues")
        for row in self.table:
            accs = ", ".join(f"{t} {fmt(row['accuracy'].get(t))}" for t in tasks)
            lines.append(f"  {row['mechanism']:<16} {accs}; steps/s ×{fmt(row['speed_vs_vanilla'])}, "
                         f"memory ×{fmt(row['memory_vs_vanilla'])}")
        if self.refused:
            lines.append(f"  refused: {', '.join(self.refused)}")
        return lines


def run(config: LongRangeConfig, *, progress=None) -> LongRangeResult:
    """Train every mechanism on every task (ListOps, associative recall, selective copy; token ids
    [batch, seq_len]) with the same budget: accuracy per task, training steps/s and peak memory relative
    to vanilla SDPA, in the layout of Tay et al. 2020 (LRA) Tables 1-2.

    Each run checkpoints to ``config.out``, so ``resume`` continues a killed run and ``report_only``
    reports finished runs without training; Ctrl-C or SIGTERM ends the training early with a partial
    result (``exit_code`` 130). Default mechanisms that cannot run at seq_len are listed as refused (one
    named in ``mechanisms`` raises instead). Torch's thread count is ``config.threads`` while it runs.
    Raises ValueError for bad settings (seq_len < 32, unknown tasks or mechanisms, d_model not a
    multiple of 32, ...)."""
    s = config.resolved()
    with harness.threads(config.threads):
        return _run(config, s, progress if progress is not None else harness.NoProgress())


def _run(config: LongRangeConfig, s: dict, prog) -> LongRangeResult:
    t0 = time.perf_counter()
    seeds, tasks, T = list(config.seeds), list(config.tasks), s["seq_len"]
    if config.mechanisms:
        mechs, why = list(config.mechanisms), None
    else:
        mechs, why = default_mechanisms()
        if config.quick:
            mechs = mechs[:4]
    refused, usable = {}, []
    for m in mechs:
        try:
            choose(m, T)  # unknown names fail here, before any training
            usable.append(m)
        except (ValueError, TypeError) as e:
            if config.mechanisms:  # asked for by name: a typo must not become an empty report marked complete
                raise ValueError(f"--mechanisms: {e}") from None
            refused[m] = str(e)
    if not usable:
        raise ValueError(f"no mechanism can run at --seq-len {T}: " + "; ".join(f"{m}: {w}" for m, w in refused.items()))
    n_train, n_test, batch, d_model = s["train_examples"], s["test_examples"], s["batch_size"], s["d_model"]
    # the generated token ids (int64, a few copies while built) and the activations of one training step
    check_memory(f"--seq-len {T} with --train-examples {n_train} --test-examples {n_test}",
                 3 * 8 * (n_train + n_test) * T + 4 * 32 * batch * T * d_model * s["num_layers"],
                 "the generated examples and one training step's activations")
    out = Path(config.out) if config.out is not None else None
    datasets = _datasets(tasks, T, n_train, n_test, seed=1234, recall_queries=s["recall_queries"])
    # task by task: a run cut short still has every mechanism on the tasks it finished
    configs = [RunConfig(name=f"{task}-{m}", task=task, seq_len=T, d_model=d_model, num_heads=d_model // 32,
                         head_dim=32, num_layers=s["num_layers"], attention=m, steps=s["steps"], batch_size=batch,
                         lr=s["lr"], seed=seed, log_every=max(1, s["steps"] // 20), token_shift=config.token_shift)
               for task in tasks for m in usable for seed in seeds]
    runs, interrupted, not_run = [], None, []
    store = harness.ResultStore(out, sections=("runs",)) if out is not None else None
    ckdir = out / "checkpoints" if out is not None else None

    def on_term(signum, frame):
        raise _Interrupted(f"signal {signum}")

    main_thread = threading.current_thread() is threading.main_thread()
    old_term = signal.signal(signal.SIGTERM, on_term) if main_thread else None
    try:
        tid = prog.add_task("long-range", total=sum(c.steps for c in configs))
        for cfg in configs:
            train, test = datasets[cfg.task]
            ckpt = ckdir / f"{cfg.file_id}.pt" if ckdir is not None else None
            if config.report_only and not (ckpt is not None and _finished(ckpt, cfg)):
                not_run.append(cfg.run_id)
                prog.advance(tid, cfg.steps)
                continue
            try:
                r = train_run(cfg, train, test, ckpt, resume=config.resume or config.report_only,
                              advance=lambda n: prog.advance(tid, n))
            except harness.CheckpointError:
                raise  # the user's file to fix, not the mechanism's failure
            except Exception as e:  # a mechanism that cannot run this input: record why, measure the rest
                refused[f"{cfg.attention} on {cfg.task}"] = f"{type(e).__name__}: {e}"
                prog.advance(tid, cfg.steps)
                continue
            r["mechanism"], r["task"] = cfg.attention, cfg.task
            runs.append(r)
            if store is not None:
                store.state["refused"] = refused
                store.add(r)
    except (KeyboardInterrupt, _Interrupted) as e:
        # the run in progress keeps its last checkpoint (every 20 s): resume continues it
        interrupted = "interrupted (Ctrl-C)" if isinstance(e, KeyboardInterrupt) else f"terminated ({e})"
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
    baselines = {t: baseline_accuracy(datasets[t][1]) for t in tasks}
    settings = {"seq_len": T, "tasks": tasks, "mechanisms": mechs, "mechanisms_note": why, "vanilla": VANILLA,
                "steps": s["steps"], "batch_size": batch, "lr": s["lr"], "d_model": d_model,
                "num_layers": s["num_layers"], "num_heads": d_model // 32, "token_shift": config.token_shift,
                "recall_queries": s["recall_queries"], "train_examples": n_train, "test_examples": n_test,
                "seeds": seeds, "quick": bool(config.quick)}
    return LongRangeResult(settings=settings, baselines=baselines, table=_lra_table(runs, tasks, baselines),
                           refused=refused, runs=runs,
                           task_meta={t: {k: v for k, v in datasets[t][0].meta.items() if k != "lengths"} for t in tasks},
                           environment=harness.environment_record(seeds), wall_s=time.perf_counter() - t0,
                           interrupted=interrupted, not_run=not_run, configs=len(configs),
                           exit_code=130 if interrupted else 0)


def _finished(ckpt, cfg) -> bool:
    """Whether ``ckpt`` holds a finished training run of exactly ``cfg``."""
    if not ckpt.exists():
        return False
    state = harness.load_checkpoint(ckpt)
    return bool(state.get("done")) and state.get("config") == asdict(cfg)


class _Interrupted(BaseException):
    """SIGTERM, raised where the training loop is, so that the finished runs still get a report."""


def baseline_accuracy(test) -> dict:
    """What a model that learned nothing scores on ``test``: chance (1/classes) and the majority class
    (the best constant answer), with the number of scored items and the margin an accuracy must beat
    the majority by to count as learned (3 binomial standard errors of the majority rate)."""
    y = test.targets.reshape(-1)  # (N,) or (N·m,): every scored prediction
    counts = torch.bincount(y, minlength=test.num_classes)
    maj = float(counts.max()) / y.numel()
    return {"chance": 1.0 / test.num_classes, "majority": maj, "majority_class": int(counts.argmax()),
            "items": int(y.numel()), "margin": 3.0 * math.sqrt(maj * (1.0 - maj) / y.numel())}


def learned(acc: float | None, base: dict) -> bool | None:
    """True when ``acc`` beats the majority-class accuracy by more than ``base["margin"]``."""
    return None if acc is None else acc > base["majority"] + base["margin"]


def _lra_table(runs, tasks, baselines) -> list[dict]:
    by = {}
    for r in runs:
        by.setdefault(r["mechanism"], []).append(r)
    rows = []
    for m, rs in by.items():
        acc = {t: harness.mean_std([r["eval"]["accuracy"] for r in rs if r["task"] == t])[0] for t in tasks}
        sps = harness.mean_std([r["steps_per_s"] for r in rs])[0]
        # training memory per task; runs re-evaluated from checkpoints written before checkpoints kept it have none
        mem_by_task = {t: harness.mean_std([r["peak_rss_delta_bytes"] for r in rs
                                      if r["task"] == t and r["peak_rss_delta_bytes"] is not None])[0] for t in tasks}
        mem_by_task = {t: v for t, v in mem_by_task.items() if v is not None}
        vals = [a for a in acc.values() if a is not None]
        rows.append({"mechanism": m, "accuracy": acc, "avg_accuracy": sum(vals) / len(vals) if vals else None,
                     "learned": {t: learned(acc[t], baselines[t]) for t in tasks},
                     "steps_per_s": sps, "peak_bytes_by_task": mem_by_task,
                     "peak_bytes": sum(mem_by_task.values()) / len(mem_by_task) if mem_by_task else None,
                     "memory_tasks": sorted(mem_by_task, key=tasks.index)})
    van = next((r for r in rows if r["mechanism"] == VANILLA), None)
    for r in rows:
        r["speed_vs_vanilla"] = r["steps_per_s"] / van["steps_per_s"] if van and van["steps_per_s"] and r["steps_per_s"] else None
        # memory ratios only between tasks both sides measured, averaged over those tasks
        both = [t for t in r["memory_tasks"] if van and t in van["peak_bytes_by_task"] and van["peak_bytes_by_task"][t]]
        r["memory_vs_vanilla"] = (sum(r["peak_bytes_by_task"][t] / van["peak_bytes_by_task"][t] for t in both) / len(both)
                                  if both else None)
    return rows


def _plain_log_x(ax) -> None:
    """Plain-number ticks on a log x axis (10, 20, 50); over less than a factor 4, four evenly spaced ticks
    (the default labels 1.02×10¹, 1.04×10¹ … ran into each other)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter, NullLocator

    lo, hi = ax.get_xlim()
    fmt = FuncFormatter(lambda v, _: f"{v:.3g}")
    if lo > 0 and hi / lo < 4:
        ax.xaxis.set_major_locator(MaxNLocator(4))
        ax.xaxis.set_minor_locator(NullLocator())
    else:
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(fmt)
    ax.xaxis.set_minor_formatter(NullFormatter())


def _plot(out, table, tasks, baselines):
    plt = harness.pyplot()
    line_styles = harness.line_styles

    fig, axes = plt.subplots(1, len(tasks), figsize=(4.5 * len(tasks), 4.2), squeeze=False)
    names = [r["mechanism"] for r in table]
    # one colour + marker per mechanism, named in a legend outside the axes: text labels beside the
    # points overlapped wherever mechanisms ran at similar speed and accuracy
    style = dict(zip(names, line_styles(len(names))))
    for ax, t in zip(axes[0], tasks):
        for r in table:
            a = r["accuracy"].get(t)
            if r["steps_per_s"] and a is not None:
                size = 30 + 200 * (r["memory_vs_vanilla"] or 1.0)
                st = style[r["mechanism"]]
                ax.scatter(r["steps_per_s"], a, s=size, alpha=0.6, marker=st["marker"],
                           color="black" if r["mechanism"] == VANILLA else st["color"], edgecolors="white",
                           linewidths=0.5, label=r["mechanism"])
        b = baselines[t]
        ax.axhline(b["majority"], color="red", ls="--", lw=1, label="majority class")
        ax.axhline(b["majority"] + b["margin"], color="red", ls=":", lw=0.8, label="+3 s.e. (learned above)")
        ax.set_xscale("log")
        ax.set_xlabel("training steps/s")
        ax.set_ylabel("held-out accuracy")
        ax.set_title(t, fontsize=10)
        _plain_log_x(ax)
    from matplotlib.lines import Line2D

    # legend markers at one size (in the plot their area is the memory ratio), drawn as proxies so the
    # plotted points keep their sizes
    handles = [Line2D([], [], linestyle="none", marker=style[m]["marker"], markersize=7, alpha=0.8,
                      color="black" if m == VANILLA else style[m]["color"], label=m) for m in names]
    handles += axes[0][-1].get_legend_handles_labels()[0][-2:]  # the two baseline lines
    fig.legend(handles=handles, fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    fig.suptitle("accuracy vs training speed (marker area ∝ peak memory vs vanilla)", fontsize=10)
    fig.tight_layout()
    return harness.save_plot(fig, out / "lra.png")


_TASK_TEXT = {
    "listops": "ListOps (LRA generator rules: MIN, MAX, MED, SM; depth ≤ 10; up to 10 arguments; closing ] kept; "
               "10 classes, mean-pooled read-out)",
    "recall": "associative recall (8 key–value pairs in noise, then {q} of their keys as queries, each answered at "
              "its own position; 16 values, scored per query)",
    "copy": "selective copy (8 data tokens scattered among blanks, reproduced in order at the 8 final marker "
            "positions; 16 symbols, scored per token)",
}


def _report(res) -> str:
    tasks, base = res["tasks"], res["baselines"]
    md = ["# Long-range tasks: every mechanism, one budget", "",
          f"Sequence length {res['seq_len']}; a {res['num_layers']}-layer pre-norm Transformer (d_model "
          f"{res['d_model']}, {res['num_heads']} heads of 32, learned position embeddings"
          + (", token shift: each position also sees its predecessor's token embedding" if res["token_shift"] else "") + "), "
          f"{res['steps']} AdamW steps of batch {res['batch_size']} at lr {res['lr']:g} per task and mechanism — the "
          f"same budget for every mechanism — seeds {res['seeds']}, {res['train_examples']} generated training and "
          f"{res['test_examples']} held-out examples per task. Tasks: "
          + "; ".join(_TASK_TEXT[t].format(q=res["recall_queries"]) for t in tasks) + ". Padding is not masked (every mechanism sees the same "
          "input; ListOps pools over non-pad tokens)."
          + (" **Quick mode: toy sizes, the numbers say nothing.**" if res["quick"] else ""), "",
          *([f"> **Partial report** ({res.get('interrupted') or 'report only'}): {len(res['runs'])} runs finished"
             + (f", {len(res['not_run'])} not run" if res.get("not_run") else "")
             + ". `attnlab experiment long-range --resume` with the same options continues.", ""]
            if not res.get("complete", True) else []),
          "What a model that learned nothing scores on the held-out set, and the bar an accuracy must clear to "
          "count as learned (majority rate + 3 binomial standard errors):", ""]
    md += [table(["task", "chance (1/classes)", "majority class", "scored items", "learned above"],
                       [[t, base[t]["chance"], base[t]["majority"], base[t]["items"],
                         base[t]["majority"] + base[t]["margin"]] for t in tasks]), ""]
    md += ["## Accuracy, speed and memory (LRA Tables 1 and 2 layout)", "",
           "Accuracy on held-out examples; ✓ marks an accuracy above the bar. Steps/s is training throughput "
           "(forward, backward, optimiser) on this machine's CPU; memory is the growth of the process's resident "
           "set during training, after returning freed memory to the OS (activations, gradients and optimiser "
           f"state, as LRA's Table 2). Both relative to vanilla attention (`{res['vanilla']}`). A run continued "
           "from a checkpoint keeps the figures of the process that trained it, so a resumed run's ratios can span "
           "sittings; runs whose checkpoints hold no memory figure leave it out (the cell names the tasks "
           "that have one).", ""]
    if res["mechanisms_note"]:
        md += [f"Mechanism registry: {res['mechanisms_note']}", ""]

    def cell(r, t):
        a = r["accuracy"].get(t)
        return "—" if a is None else f"{a:.3f}" + (" ✓" if r["learned"].get(t) else "")

    def peak(r):
        if r.get("peak_bytes") is None:
            return None
        some = r.get("memory_tasks", tasks)
        return fmt(r["peak_bytes"] / 2**20) + ("" if len(some) == len(tasks) else f" ({', '.join(some)} only)")

    rows = [[r["mechanism"], *[cell(r, t) for t in tasks], r["avg_accuracy"], r["steps_per_s"],
             r["speed_vs_vanilla"], peak(r), r["memory_vs_vanilla"]]
            for r in res["table"]]
    md += [table(["mechanism", *[f"{t} acc" for t in tasks], "avg", "steps/s", "speed vs vanilla",
                        "peak MiB", "memory vs vanilla"], rows), ""]
    md += ["## What learned what", ""]
    for t in tasks:
        yes = [r["mechanism"] for r in res["table"] if r["learned"].get(t)]
        if not any(r["task"] == t for r in res["runs"]):
            md.append(f"- {t}: not run")
            continue
        md.append(f"- {t}: " + (f"{len(yes)} of {len(res['table'])} mechanisms beat the majority class clearly: "
                                + ", ".join(yes) if yes else
                                f"no mechanism beat the majority class ({base[t]['majority']:.3f}) clearly"))
    md.append("")
    for f in ("lra.png", "curves.png"):
        if any(str(x).endswith(f) for x in res["files"]):
            md += [f"![{f[:-4]}]({f})", ""]
    if res["refused"] or res.get("not_run"):
        md += ["## Not run", ""] + [f"- {k}: {v}" for k, v in res["refused"].items()]
        if res.get("not_run"):
            md += ["- not trained within this report's budget (`--report-only` over finished checkpoints): "
                   + ", ".join(res["not_run"])]
        md += [""]
    md += ["## Environment", "", "```", *[f"{k}: {v}" for k, v in res["environment"].items() if k != "argv"], "```", ""]
    return "\n".join(md)
