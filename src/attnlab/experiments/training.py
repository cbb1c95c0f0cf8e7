"""Training runs for the experiments: one run's config, the grid of runs with checkpoints and partial
results, the per-arm summary, and the loss/gradient/entropy curves. The two training experiments
(``scaling``, ``failure_modes``) share :func:`run_training`; ``long_range`` uses the same runs.

Legend: B batch, T sequence length, D head dim (d_k).
"""
from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from attnlab import harness

from .model import build_model, loss_fn_for
from .tasks import task_data
from .training_report import training_report

__all__ = ["RunConfig", "train_run", "run_grid", "summarize_runs", "plot_curves", "TrainingConfig",
           "TrainingResult", "run_training", "verdicts", "QUICK_SIZES", "FULL_SIZES"]


@dataclass(kw_only=True)
class RunConfig(harness.TrainConfig):
    """One training run: model and data settings on top of ``attnlab.harness.TrainConfig``'s optimiser
    settings (all of it, ``asdict``, identifies the run's checkpoint). ``scale``: "sqrt" | "none" |
    "dk" | a number; ``score``: softmax | none | cosine; ``attention``: a name for
    ``experiments.attention.choose``; ``model``: "tiny" (the experiments' model) or "lm"
    (``attnlab.nn.TransformerLM``). Keyword arguments only."""

    name: str
    task: str = "recall"
    seq_len: int = 64
    d_model: int = 64
    num_heads: int = 2
    head_dim: int = 32
    num_layers: int = 2
    score: str = "softmax"
    scale: str | float = "sqrt"
    attention: str = "sdpa"
    causal: bool = False
    qk_init: str = "unit"
    cosine_temperature: float = 1.0
    model: str = "tiny"
    token_shift: bool = False

    @property
    def run_id(self) -> str:
        """``<name>-seed<seed>``: the run's name in results."""
        return f"{self.name}-seed{self.seed}"

    @property
    def file_id(self) -> str:
        """``run_id`` made safe as a file name."""
        return re.sub(r"[^A-Za-z0-9_.=-]+", "_", self.run_id).strip("_")


def train_run(cfg: RunConfig, train, test, ckpt: Path | None = None, *, resume: bool = False,
              advance: Callable[[int], None] | None = None, checkpoint_every_s: float = 20.0) -> dict:
    """Build ``cfg``'s model (``model.build_model``) and train it with ``attnlab.harness.train_run`` on
    ``train``, evaluated on ``test`` (``attnlab.data.TaskData``, inputs [N, T]); see there for the result."""
    model = build_model(cfg, train)
    return harness.train_run(cfg, model, loss_fn_for(train), train, test, ckpt, resume=resume, advance=advance,
                             checkpoint_every_s=checkpoint_every_s)


def run_grid(configs: list[RunConfig], datasets: dict, out: Path | None, *, resume: bool = False, progress=None,
             title: str = "training") -> list[dict]:
    """Train every config (checkpoints in ``out/checkpoints``; partial results kept up to date by a
    ``harness.ResultStore``, so a killed run leaves what it finished and ``resume`` continues it).
    ``datasets``: task -> (train, test). ``out`` None: no files at all."""
    prog = progress if progress is not None else harness.NoProgress()
    store = harness.ResultStore(out, sections=("runs",)) if out is not None else None
    ckdir = out / "checkpoints" if out is not None else None
    if ckdir is not None:
        ckdir.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    tid = prog.add_task(title, total=sum(c.steps for c in configs))
    for cfg in configs:
        train, test = datasets[cfg.task]
        r = train_run(cfg, train, test, ckdir / f"{cfg.file_id}.pt" if ckdir else None, resume=resume,
                      advance=lambda n: prog.advance(tid, n))
        runs.append(r)
        if store is not None:
            store.add(r)
    return runs


#: outcome measures summarised per arm: name -> how to read it from a run
_MEASURES: dict[str, Callable[[dict], float | None]] = {
    "final_loss": lambda r: r["final_loss"],
    "eval_loss": lambda r: r["eval"]["loss"],
    "eval_accuracy": lambda r: r["eval"]["accuracy"],
    "first_loss": lambda r: r["history"]["loss"][0] if r["history"]["loss"] else None,
    "grad_norm_init": lambda r: r["history"]["grad_norm"][0] if r["history"]["grad_norm"] else None,
    "qk_grad_norm_init": lambda r: r["history"]["qk_grad_norm"][0] if r["history"]["qk_grad_norm"] else None,
    "entropy_init": lambda r: r["history"]["entropy"][0] if r["history"]["entropy"] else None,
    "entropy_final": lambda r: r["history"]["entropy"][-1] if r["history"]["entropy"] else None,
    "max_weight_init": lambda r: r["history"]["max_weight"][0] if r["history"]["max_weight"] else None,
    "max_weight_final": lambda r: r["history"]["max_weight"][-1] if r["history"]["max_weight"] else None,
    "steps_per_s": lambda r: r["steps_per_s"],
}


def summarize_runs(runs: list[dict], key_fields: list[str]) -> list[dict]:
    """Group runs by ``key_fields`` of their config; mean ± std over seeds of the outcome measures
    (``<measure>`` and ``<measure>_std``), and how many seeds diverged."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault(tuple(r["config"][k] for k in key_fields), []).append(r)
    rows = []
    for key, rs in groups.items():
        row = dict(zip(key_fields, key))
        row["seeds"] = [r["config"]["seed"] for r in rs]
        for name, get in _MEASURES.items():
            m, sd = harness.mean_std([get(r) for r in rs])
            row[name], row[name + "_std"] = m, sd
        row["diverged"] = sum(1 for r in rs if r["nonfinite_step"] is not None)
        rows.append(row)
    return rows


def plot_curves(runs: list[dict], group_of: Callable[[dict], str], panel_of: Callable[[dict], str], path: Path,
                keys=(("loss", "training loss", True), ("qk_grad_norm", "‖grad‖ of W_Q, W_K", True),
                      ("entropy", "attention entropy (nats)", False))) -> str:
    """One row of panels per ``panel_of`` value, one column per (history key, title, log y); a line per
    run coloured by ``group_of``. Saved atomically to ``path``; returns it as str."""
    plt = harness.pyplot()
    panels = sorted({panel_of(r) for r in runs})
    groups = sorted({group_of(r) for r in runs})
    styles = {g: st for g, st in zip(groups, harness.line_styles(len(groups)))}  # distinct past 10 groups
    fig, axes = plt.subplots(len(panels), len(keys), figsize=(5 * len(keys), 3.2 * len(panels)), squeeze=False)
    for pi, panel in enumerate(panels):
        for ki, (key, title, logy) in enumerate(keys):
            ax = axes[pi][ki]
            seen = set()
            for r in runs:
                if panel_of(r) != panel:
                    continue
                h = r["history"]
                pts = [(s, v) for s, v in zip(h["step"], h[key]) if v is not None and math.isfinite(v) and (v > 0 or not logy)]
                if not pts:
                    continue
                g = group_of(r)
                st = styles[g]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], color=st["color"], linestyle=st["linestyle"], lw=1,
                        alpha=0.8, label=g if g not in seen else None)
                seen.add(g)
            if logy:
                ax.set_yscale("log")
            ax.set_title(f"{panel}: {title}", fontsize=9)
            ax.set_xlabel("step")
            if ki == 0 and seen:
                ax.legend(fontsize=7)
    fig.tight_layout()
    return harness.save_plot(fig, path)


# -- the two training experiments (scaling, failure-modes) ------------------------------------------------
QUICK_SIZES = {"seq_len": {"recall": 16, "text": 32}, "train": 512, "test": 128, "steps": 12,
               "d_model": 32, "num_layers": 1, "batch_size": 16, "log_every": 3}
FULL_SIZES = {"seq_len": {"recall": 32, "text": 64}, "train": 20000, "test": 1000, "steps": 400,
              "d_model": 64, "num_layers": 2, "batch_size": 32, "log_every": 10}
TASKS = ("recall", "text")


@dataclass
class TrainingConfig:
    """Settings of a training experiment (``scaling``, ``failure_modes``).

    out: folder for checkpoints and partial results (None: nothing on disk until ``write``); resume:
    continue from its checkpoints; quick: toy sizes; d_k: head dims (None: the experiment's default);
    steps: training steps per run (None: 400, quick 12); lr: None means 1e-3 for adamw, 0.05 for sgd;
    model: "tiny" (``ExperimentModel``) or "lm" (``attnlab.nn.TransformerLM``, text task only);
    qk_init: "unit" or "torch"; threads: torch threads while it runs."""

    out: Path | None = None
    quick: bool = False
    resume: bool = False
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    d_k: list[int] | None = None
    steps: int | None = None
    optimizer: str = "adamw"
    lr: float | None = None
    model: str = "tiny"
    qk_init: str = "unit"
    threads: int | None = 1

    def validate(self) -> None:
        """Raise ValueError naming the option for settings that cannot run."""
        if not self.seeds:
            raise ValueError("--seeds must name at least one seed")
        bad = [t for t in self.tasks if t not in TASKS]
        if bad or not self.tasks:
            raise ValueError(f"--tasks must name recall and/or text, got {','.join(self.tasks)!r}")
        if self.model not in ("tiny", "lm"):
            raise ValueError(f"--model must be 'tiny' or 'lm', got {self.model!r}")
        if self.model == "lm" and list(self.tasks) != ["text"]:
            raise ValueError(f"--model lm trains attnlab.nn.TransformerLM on the text task only; pass --tasks text "
                             f"(got --tasks {','.join(self.tasks)})")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if self.d_k is not None and (not self.d_k or min(self.d_k) < 1):
            raise ValueError(f"--d-k must be positive integers, got {self.d_k}")
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"--optimizer must be 'adamw' or 'sgd', got {self.optimizer!r}")
        if self.lr is not None and not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"--lr must be a finite number > 0, got {self.lr}")


@dataclass
class TrainingResult:
    """What a training experiment found: every run, the per-(task, d_k, arm) summary and the verdicts
    against the baseline arm. :meth:`write` puts report.md, results.json, report.html and curves.png in
    a folder (``attnlab.harness``); :meth:`to_json` is results.json's content."""

    experiment: str
    model: str
    arms: dict
    baseline: str
    d_k: list[int]
    tasks: list[str]
    sizes: dict
    optimizer: str
    lr: float
    qk_init: str
    seeds: list[int]
    quick: bool
    intro: list[str]
    summary: list[dict]
    verdicts: list[dict]
    runs: list[dict]
    task_meta: dict
    environment: dict
    wall_s: float
    out: Path | None = None
    exit_code: int = 0

    def to_json(self, files: list[str] | None = None) -> dict:
        """results.json's content (``files``: the plots written beside it)."""
        return {"experiment": self.experiment, "model": self.model, "arms": self.arms, "baseline": self.baseline,
                "d_k": self.d_k, "tasks": self.tasks, "sizes": self.sizes, "optimizer": self.optimizer, "lr": self.lr,
                "qk_init": self.qk_init, "seeds": self.seeds, "quick": self.quick, "summary": self.summary,
                "verdicts": self.verdicts, "runs": self.runs, "task_meta": self.task_meta,
                "environment": self.environment, "files": files or [], "complete": True, "wall_s": self.wall_s}

    def write(self, out: str | Path | None = None) -> dict:
        """Write curves.png, results.json, report.md and report.html into ``out`` (default: the config's),
        drop the partial results file; returns the paths."""

        out = Path(out if out is not None else self.out)
        files = [plot_curves(self.runs, lambda r: r["arm"],
                             lambda r: f"{r['config']['task']} d_k={r['config']['head_dim']}", out / "curves.png")]
        paths = harness.write_report(out, self.to_json(files), training_report(self))
        harness.remove_partial(out)
        return paths

    def summary_lines(self, out=None) -> list[str]:
        """A few lines for a terminal (rich markup): where the report is (``out``, default the config's
        folder) and each verdict."""
        out = out if out is not None else self.out
        lines = [f"[bold]{self.experiment}[/bold] -> {out}/report.md ({len(self.runs)} runs, {self.wall_s:.0f} s)"]
        return lines + [f"  {v['task']} d_k={v['d_k']} {v['arm']}: {v['verdict']}" for v in self.verdicts]


def run_training(config: TrainingConfig, name: str, arms: list[tuple[str, dict]], default_d_k: list[int],
                 intro: list[str], baseline: str, *, progress=None) -> TrainingResult:
    """Train every (task, d_k, arm, seed): ``arms`` are (label, RunConfig overrides), everything else the
    same (same init seed per seed, same batches). ``default_d_k`` when ``config.d_k`` is None."""
    config.validate()
    with harness.threads(config.threads):
        t0 = time.perf_counter()
        d_ks = list(config.d_k) if config.d_k else list(default_d_k)
        sizes = dict(QUICK_SIZES if config.quick else FULL_SIZES)
        if config.steps is not None:
            sizes["steps"] = config.steps
        lr = config.lr if config.lr is not None else (1e-3 if config.optimizer == "adamw" else 0.05)
        tasks = list(config.tasks)
        datasets = {t: task_data(t, sizes) for t in tasks}
        configs = [RunConfig(name=f"{task}-dk{dk}-{label}", task=task, seq_len=sizes["seq_len"][task],
                             d_model=sizes["d_model"], num_heads=2, head_dim=dk, num_layers=sizes["num_layers"],
                             causal=(task == "text"), steps=sizes["steps"], batch_size=sizes["batch_size"], lr=lr,
                             optimizer=config.optimizer, seed=seed, log_every=sizes["log_every"],
                             qk_init=config.qk_init, model=config.model, **over)
                   for task in tasks for dk in d_ks for label, over in arms for seed in config.seeds]
        out = Path(config.out) if config.out is not None else None
        runs = run_grid(configs, datasets, out, resume=config.resume, progress=progress, title=name)
        label_of = {f"{t}-dk{dk}-{lab}": lab for t in tasks for dk in d_ks for lab, _ in arms}
        for r in runs:
            r["arm"] = label_of[r["config"]["name"]]
            r["config"]["arm"] = r["arm"]
        summary = summarize_runs(runs, ["task", "head_dim", "arm"])
        return TrainingResult(
            experiment=name, model=config.model, arms={a: o for a, o in arms}, baseline=baseline, d_k=d_ks, tasks=tasks,
            sizes=sizes, optimizer=config.optimizer, lr=lr, qk_init=config.qk_init, seeds=list(config.seeds),
            quick=bool(config.quick), intro=intro, summary=summary,
            verdicts=verdicts(summary, baseline), runs=runs, task_meta={t: datasets[t][0].meta for t in tasks},
            environment=harness.environment_record(list(config.seeds)), wall_s=time.perf_counter() - t0, out=out)


def verdicts(summary: list[dict], baseline: str) -> list[dict]:
    """Per (task, d_k): is each arm worse or better than ``baseline`` by more than the seed spread?
    Note [Verdict threshold]: the held-out losses must differ by more than twice the larger seed
    standard deviation, and by at least 0.02, to count."""
    out = []
    by = {(r["task"], r["head_dim"], r["arm"]): r for r in summary}
    for (task, dk, arm), r in by.items():
        if arm == baseline or (task, dk, baseline) not in by:
            continue
        b = by[(task, dk, baseline)]
        if r["eval_loss"] is None or b["eval_loss"] is None:
            verdict = "diverged (non-finite loss)" if r["diverged"] else "no result"
            delta = None
        else:
            delta = r["eval_loss"] - b["eval_loss"]
            noise = 2 * max(r["eval_loss_std"] or 0.0, b["eval_loss_std"] or 0.0, 0.01)
            if r["diverged"]:
                verdict = f"worse: diverged in {r['diverged']} of {len(r['seeds'])} seeds"
            elif delta > noise:
                verdict = f"worse than {baseline} (eval loss +{delta:.3g}, noise ±{noise:.2g})"
            elif delta < -noise:
                verdict = f"better than {baseline} (eval loss {delta:.3g}, noise ±{noise:.2g})"
            else:
                verdict = f"no clear difference from {baseline} (eval loss {delta:+.3g}, noise ±{noise:.2g})"
        out.append({"task": task, "d_k": dk, "arm": arm, "baseline": baseline, "eval_loss_delta": delta,
                    "verdict": verdict, "seeds": len(r["seeds"])})
    return out

