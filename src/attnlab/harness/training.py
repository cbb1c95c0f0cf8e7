"""The training loop every training instrument shares: seeded batches, logged probes, checkpoints,
resume, and Ctrl-C that stops between steps.

Legend: B batch, T sequence length, C classes.

A run is a config (a dataclass with :class:`TrainConfig`'s fields; the whole dataclass, ``asdict``,
is its identity for resuming), a model built by the caller, and a loss function
``loss_fn(model, ids [B, T], targets, stats) -> (loss, correct)`` where ``stats`` is None or a list the
model appends per-layer probe dicts to (``entropy``, ``max_weight``, ``score_std``; see
:func:`train_run`). Data objects have ``inputs``, ``targets`` and ``len()`` (``attnlab.data.TaskData``).
"""
from __future__ import annotations

import io
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch

from attnlab.report import atomic_write_bytes

from .memory import peak_rss_bytes, reset_peak_rss, rss_bytes
from ..timing import median_rate

__all__ = ["TrainConfig", "train_run", "evaluate", "grad_norm", "tail_mean", "load_checkpoint", "CheckpointError",
           "StepBoundary", "make_optimizer", "HISTORY_KEYS"]

#: what the history logs every ``log_every`` steps (lists, one entry per logged step)
HISTORY_KEYS = ("step", "loss", "grad_norm", "qk_grad_norm", "entropy", "max_weight", "score_std")

LossFn = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, "list | None"], "tuple[torch.Tensor, torch.Tensor]"]


@dataclass
class TrainConfig:
    """The training settings :func:`train_run` reads; an instrument's run config has these fields too.

    optimizer: "adamw" (weight decay 0.01) or "sgd" (momentum 0.9); grad_clip: max total gradient norm
    (None: no clipping); batches are drawn with a generator seeded 10000 + seed."""

    steps: int = 200
    batch_size: int = 32
    lr: float = 1e-3
    optimizer: str = "adamw"
    seed: int = 0
    log_every: int = 10
    grad_clip: float | None = None

    @property
    def run_id(self) -> str:
        """The run's name in results and checkpoints (instruments' configs add their own name)."""
        return f"seed{self.seed}"


def make_optimizer(name: str, params: list, lr: float) -> torch.optim.Optimizer:
    """AdamW (weight decay 0.01) or SGD (momentum 0.9); ValueError naming the choices otherwise."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    raise ValueError(f"optimizer must be 'adamw' or 'sgd', got {name!r}")


def grad_norm(params: Iterable[torch.nn.Parameter]) -> float:
    """The 2-norm of all the gradients of ``params`` together (0 when none has one)."""
    gs = [p.grad.detach().float().norm() for p in params if p.grad is not None]
    return float(torch.stack(gs).norm()) if gs else 0.0


def tail_mean(xs: list, frac: float = 0.2) -> float | None:
    """Mean of the last ``frac`` of the non-None values (at least one); None when there are none."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    k = max(1, int(len(xs) * frac))
    tail = xs[-k:]
    return float(sum(tail) / len(tail))


@torch.no_grad()
def evaluate(model: torch.nn.Module, loss_fn: LossFn, data, batch_size: int = 64) -> dict:
    """Mean loss and accuracy of ``model`` over ``data`` in eval mode (train mode restored after)."""
    model.eval()
    tot_loss = tot_acc = n = 0.0
    for i in range(0, len(data), batch_size):
        ids, tgt = data.inputs[i:i + batch_size], data.targets[i:i + batch_size]
        loss, correct = loss_fn(model, ids, tgt, None)
        b = ids.shape[0]
        tot_loss += float(loss) * b
        tot_acc += float(correct.float().mean()) * b
        n += b
    model.train()
    return {"loss": tot_loss / max(n, 1), "accuracy": tot_acc / max(n, 1)}


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from; the message names the file and what to do."""


def load_checkpoint(path: str | Path) -> dict:
    """``torch.load`` of a training checkpoint; a file that cannot be read (truncated by a full disk or a
    copy cut short: checkpoints are written atomically, so a kill alone cannot do it) is a
    CheckpointError naming the file and what to do, not a PytorchStreamReader traceback."""
    try:
        state = torch.load(path, weights_only=True)
    except Exception as e:  # zip reader, unpickler and EOF errors all mean the same here
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"--resume: checkpoint {path} is unreadable ({first}); delete it to train that run "
                              "again, or drop --resume and pass --force to start the whole run over") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"--resume: checkpoint {path} is not an attnlab training checkpoint; delete it or "
                              "pass --force")
    return state


class StepBoundary:
    """Context manager: Ctrl-C (SIGINT) inside sets ``pressed`` instead of raising, so that a loop can stop
    between steps with a consistent checkpoint; a second Ctrl-C raises at once.

    Note [Ctrl-C between steps]: a KeyboardInterrupt raised mid-step leaves the model updated and the
    step counter not, so the checkpoint written then would resume into a different run than the
    uninterrupted one. Deferring the interrupt to the step boundary keeps resumed runs identical to
    uninterrupted ones (tests/instruments/experiments/test_experiments.py) and makes Ctrl-C keep every finished step. Only the
    main thread can install a signal handler; elsewhere Ctrl-C behaves as usual."""

    def __init__(self):
        self.pressed, self.prev = False, None

    def _on_sigint(self, signum, frame):
        if self.pressed:
            raise KeyboardInterrupt
        self.pressed = True

    def __enter__(self) -> "StepBoundary":
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            self.prev = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc) -> bool:
        import signal

        if self.prev is not None:
            signal.signal(signal.SIGINT, self.prev)
        return False


def _mean(xs: list) -> float | None:
    return sum(xs) / len(xs) if xs else None


def train_run(cfg, model: torch.nn.Module, loss_fn: LossFn, train, test, ckpt: Path | None = None, *,
              resume: bool = False, advance: Callable[[int], None] | None = None, checkpoint_every_s: float = 20.0,
              probe_params: list | None = None) -> dict:
    """Train ``model`` for ``cfg.steps`` steps on batches of ``train``; evaluate on ``test``.

    Every ``log_every`` steps (and the last) the history logs the loss, the gradient norm of all
    parameters and of ``probe_params`` (default: parameters named ``*.q_proj.*`` / ``*.k_proj.*``, logged
    as ``qk_grad_norm``), and the means over the stats dicts the model appended (``entropy``,
    ``max_weight``, ``score_std``; None entries skipped). A non-finite loss stops the run (diverged).

    ckpt: checkpoint file, written atomically every ``checkpoint_every_s`` seconds, on Ctrl-C (Note
    [Ctrl-C between steps]) and at the end; with ``resume`` and a checkpoint of the same config (all of
    ``asdict(cfg)``), training continues from it and a finished run is not repeated. ``advance(n)`` is
    called as steps complete (progress).

    Returns {config, run_id, history, eval, steps, steps_per_s (1 / median step time), steps_per_s_mean,
    train_time_s, nonfinite_step, resumed_from, peak_rss_delta_bytes (training only, before evaluation),
    final_loss (mean of the last fifth of the logged losses)}."""
    params = list(model.parameters())
    opt = make_optimizer(cfg.optimizer, params, cfg.lr)
    if probe_params is None:
        probe_params = [p for n, p in model.named_parameters() if ".q_proj." in n or ".k_proj." in n]
    gen = torch.Generator().manual_seed(10_000 + cfg.seed)
    hist: dict[str, list] = {k: [] for k in HISTORY_KEYS}
    step, train_time, done, resumed_from = 0, 0.0, False, None
    step_times: list[float] = []  # Note [Median, interleaved] (attnlab.timing): throughput from the median step
    stored_peak: int | None = None  # training memory a killed or finished earlier process measured
    cfg_dict = asdict(cfg)
    if resume and ckpt is not None and ckpt.exists():
        state = load_checkpoint(ckpt)
        if state.get("config") == cfg_dict:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            gen.set_state(state["gen"])
            torch.set_rng_state(state["rng"])
            hist, step, train_time, done = state["history"], int(state["step"]), float(state["train_time"]), bool(state["done"])
            step_times = list(state.get("step_times", []))
            stored_peak = state.get("peak_rss_delta_bytes")
            resumed_from = step
            if advance:
                advance(step)

    def measured_peak() -> int | None:
        # no step taken here (a finished run resumed): this process measured no training memory
        here = peak_rss_bytes() - rss0 if peak_reset and step != resumed_from else None
        return max((m for m in (here, stored_peak) if m is not None), default=None)

    def save(done_now: bool, peak: int | None = None):
        if ckpt is None:
            return
        buf = io.BytesIO()
        torch.save({"config": cfg_dict, "model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(),
                    "rng": torch.get_rng_state(), "history": hist, "step": step, "train_time": train_time,
                    "step_times": step_times, "peak_rss_delta_bytes": peak if done_now else measured_peak(),
                    "done": done_now}, buf)
        atomic_write_bytes(ckpt, buf.getvalue())

    last_save = time.perf_counter()
    peak_reset = reset_peak_rss()
    rss0 = rss_bytes()
    nonfinite_step = next((hist["step"][i] for i, v in enumerate(hist["loss"]) if not math.isfinite(v)), None)
    with StepBoundary() as ctrl_c:
        while not done and step < cfg.steps:
            if ctrl_c.pressed:  # Note [Ctrl-C between steps]
                save(False)
                raise KeyboardInterrupt
            t0 = time.perf_counter()
            idx = torch.randint(0, len(train), (cfg.batch_size,), generator=gen)
            ids, tgt = train.inputs[idx], train.targets[idx]
            log = step % cfg.log_every == 0 or step == cfg.steps - 1
            stats: list | None = [] if log else None
            loss, _ = loss_fn(model, ids, tgt, stats)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = grad_norm(params) if log else None
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            step_times.append(time.perf_counter() - t0)
            train_time += step_times[-1]
            lv = float(loss.detach())
            if log:
                hist["step"].append(step)
                hist["loss"].append(lv if math.isfinite(lv) else float("nan"))
                hist["grad_norm"].append(gnorm if math.isfinite(gnorm) else float("nan"))
                hist["qk_grad_norm"].append(grad_norm(probe_params))
                for key in ("entropy", "max_weight", "score_std"):
                    hist[key].append(_mean([s[key] for s in stats if s.get(key) is not None]))
            step += 1
            if advance:
                advance(1)
            if not math.isfinite(lv):
                nonfinite_step = step - 1
                break  # diverged: nothing more to learn from this run
            if ckpt is not None and time.perf_counter() - last_save > checkpoint_every_s:
                save(False)
                last_save = time.perf_counter()
    peak_train = measured_peak()
    if advance and step < cfg.steps:
        advance(cfg.steps - step)
    ev = evaluate(model, loss_fn, test)
    save(True, peak_train)  # measured before evaluation, which is not training
    return {"config": cfg_dict, "run_id": cfg.run_id, "history": hist, "eval": ev, "steps": step,
            "steps_per_s": median_rate(step_times),
            "steps_per_s_mean": step / train_time if train_time > 0 else None, "train_time_s": train_time,
            "nonfinite_step": nonfinite_step, "resumed_from": resumed_from, "peak_rss_delta_bytes": peak_train,
            "final_loss": tail_mean(hist["loss"])}
