"""Shared plumbing for attnlab's experiments: attention choices, a tiny model with switches, training
with checkpoints, peak-memory probes, progress and report writing.

Legend: B batch, T sequence length, H heads, D head dim (d_k), C classes.

The model here is deliberately small and has switches the library modules do not have (no softmax,
cosine similarity, any score scale): the experiments need them to put the tutorials' failure modes
to the test. It is built on ``attnlab.attention`` (exact methods and patterns) and, for approximate
mechanisms, on ``attnlab.mechanisms.resolve`` (imported lazily).
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from attnlab.harness import (CheckpointError, environment_record, load_checkpoint, mean_std, peak_rss_bytes,
                             progress, pyplot, reset_peak_rss, rss_bytes, save_plot, threads, write_report)
from attnlab.harness import evaluate as _evaluate
from attnlab.harness import fmt
from attnlab.harness import markdown_table as fmt_table
from attnlab.harness import train_run as _train_run
from attnlab.options import output_dir, positive_float, positive_int

plt = pyplot
env_record = environment_record
write_results = write_report

__all__ = [
    "add_common_args", "out_dir", "seeds_of", "attention_fn", "pattern_catalog", "mechanism_names",
    "RunConfig", "TinyTransformer", "train_run", "stdlib_text", "text_task", "scale_value",
    "peak_rss_bytes", "reset_peak_rss", "progress", "write_results", "fmt_table", "save_plot",
    "make_mechanism", "threads", "run_grid", "load_checkpoint", "CheckpointError", "summarize_runs", "training_experiment", "build_model", "evaluate",
]

EXACT_METHODS = ("auto", "dense", "sdpa", "tiled", "sparse")


# -- command line -------------------------------------------------------------------------------------
def add_common_args(p: argparse.ArgumentParser, *, seeds: str = "0,1,2") -> None:
    p.add_argument("--out", default=None, help="output folder (default reports/<name>)")
    p.add_argument("--quick", action="store_true", help="a toy-size run that finishes in seconds")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoints of a killed run")
    p.add_argument("--force", action="store_true",
                   help="replace the earlier run an --out folder holds (without it, such a folder is refused)")
    p.add_argument("--seeds", default=seeds, help=f"comma-separated seeds (default {seeds})")
    p.add_argument("--steps", type=positive_int, default=None, help="training steps per run (overrides the default)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--threads", type=positive_int, default=1,
                   help="torch threads while this runs (default 1: tiny models train fastest single-threaded, "
                        "and a shared machine stays usable)")


def out_dir(args, name: str, *, resumable: bool = True) -> Path:
    """``--out`` or reports/<name>, checked (``attnlab.options.output_dir``): not a file; for a
    ``resumable`` experiment, a folder holding an earlier run needs ``--resume`` or ``--force``, so an
    old report never mixes with a new run. ``args.out`` is set to the folder (Ctrl-C names it)."""
    path = Path(args.out) if getattr(args, "out", None) else Path("reports") / name
    resume = (bool(getattr(args, "resume", False)) or bool(getattr(args, "report_only", False))) if resumable else None
    path = output_dir(path, "--out", resume=resume, force=bool(getattr(args, "force", False)))
    args.out = str(path)
    if resumable:
        args.checkpoint_dir = str(path)  # Ctrl-C says it is kept and how to resume (cli.main)
    return path


def seeds_of(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in str(text).split(",") if s.strip() != ""]
    except ValueError:
        raise ValueError(f"--seeds must be comma-separated integers, got {text!r}") from None
    if not seeds:
        raise ValueError(f"--seeds must name at least one seed, got {text!r}")
    return seeds


def ints_of(text: str, name: str) -> list[int]:
    try:
        vals = [int(s) for s in str(text).split(",") if s.strip() != ""]
    except ValueError:
        raise ValueError(f"{name} must be comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise ValueError(f"{name} must be positive integers, got {text!r}")
    return vals


# -- attention choices ----------------------------------------------------------------------------------
def pattern_catalog(seq_len: int, causal: bool = False) -> dict:
    """Every structured pattern with parameters sized for ``seq_len`` (name -> Pattern)."""
    from attnlab import patterns as P

    w = max(1, min(128, seq_len // 8))
    blk = max(1, min(64, seq_len // 8))
    stride = max(1, int(round(math.sqrt(seq_len))))
    cat = {
        "sliding_window": P.sliding_window(w, causal=causal),
        "dilated": P.dilated(max(1, w // 2), 2, causal=causal),
        "longformer": P.longformer(w, global_tokens=1),
        "bigbird": P.bigbird(blk),
        "strided": P.strided(stride, causal=causal),
        "fixed": P.fixed(stride, max(1, stride // 8), causal=causal),
    }
    if causal:
        cat = {k: (v & P.causal()) for k, v in cat.items()}
    return cat


def mechanism_names() -> tuple[list[str], str | None]:
    """Registered mechanism names (contract 1), or ([], why) when ``attnlab.mechanisms`` is not there yet."""
    try:
        import attnlab.mechanisms as M
    except ImportError as e:
        return [], f"attnlab.mechanisms not available yet ({e})"
    try:
        names = list(M.available())
    except Exception as e:  # a registry still being built: say so, measure the rest
        return [], f"attnlab.mechanisms.available() failed: {type(e).__name__}: {e}"
    return [str(n) for n in names], None


def attention_fn(spec: str, seq_len: int | None = None, causal: bool = False) -> Callable:
    """A callable ``f(q, k, v, *, is_causal=False, scale=None) -> out`` on [B, H, T, D] tensors.

    spec: "torch_sdpa" (PyTorch directly), an exact method ("auto", "dense", "sdpa", "tiled",
    "sparse"), "pattern:<name>" (``pattern_catalog``) or a registered mechanism name.
    """
    import attnlab

    if spec == "torch_sdpa":
        def f(q, k, v, *, is_causal=False, scale=None):
            return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)
        return f
    if spec == "naive":
        def f(q, k, v, *, is_causal=False, scale=None):
            s = (q @ k.transpose(-2, -1)) * (scale if scale is not None else q.shape[-1] ** -0.5)  # (B, H, T, T)
            if is_causal:
                T = q.shape[-2]
                s = s.masked_fill(~torch.ones(T, k.shape[-2], dtype=torch.bool, device=q.device).tril(), float("-inf"))
            return torch.softmax(s, dim=-1) @ v
        return f
    if spec in EXACT_METHODS and mechanism_names()[1] is not None:  # registry not there: exact methods directly
        def f(q, k, v, *, is_causal=False, scale=None):
            return attnlab.attention(q, k, v, is_causal=is_causal, scale=scale, method=spec)
        return f
    if spec.startswith("pattern:"):
        name = spec.split(":", 1)[1]
        if seq_len is None:
            raise ValueError(f"attention spec {spec!r} needs seq_len")
        cat = pattern_catalog(seq_len, causal)
        if name not in cat:
            raise ValueError(f"unknown pattern {name!r}; choose from {sorted(cat)}")
        pat = cat[name]

        def f(q, k, v, *, is_causal=False, scale=None):
            return attnlab.attention(q, k, v, is_causal=is_causal, scale=scale, pattern=pat)
        return f
    mech = make_mechanism(spec, seq_len)

    def f(q, k, v, *, is_causal=False, scale=None):
        return mech(q, k, v, is_causal=is_causal, scale=scale)
    return f


def make_mechanism(name: str, seq_len: int | None = None):
    """``attnlab.mechanisms.get(name)`` with its defaults; mechanisms that need parameters get them sized
    for ``seq_len`` (block_sparse: a band of 3 blocks plus the first block column)."""
    names, why = mechanism_names()
    if why is not None:
        raise ValueError(f"mechanism {name!r}: {why}")
    if name not in names:
        raise ValueError(f"unknown attention {name!r}; choose from torch_sdpa, naive, pattern:<name>, "
                         f"or a registered mechanism: {', '.join(names)}")
    import attnlab.mechanisms as M

    if name == "block_sparse":
        if seq_len is None:
            raise ValueError("mechanism 'block_sparse' needs seq_len to build its layout")
        bs = 64 if seq_len >= 256 else max(1, seq_len // 4)
        nb = -(-seq_len // bs)
        i = torch.arange(nb)
        layout = ((i[:, None] - i[None, :]).abs() <= 1) | (i[None, :] == 0)  # (nb, nb) band + first column
        return M.get(name, layout=layout, block_size=bs)
    return M.get(name)


# -- the model ------------------------------------------------------------------------------------------
SCORES = ("softmax", "none", "cosine")


def scale_value(scale: str | float | None, head_dim: int) -> float:
    """"sqrt" -> 1/sqrt(d_k), "none" -> 1, "dk" -> 1/d_k, a number -> itself."""
    if scale is None or scale == "sqrt":
        return 1.0 / math.sqrt(head_dim)
    if scale == "none":
        return 1.0
    if scale == "dk":
        return 1.0 / head_dim
    if isinstance(scale, (int, float)):
        return float(scale)
    raise ValueError(f"scale must be 'sqrt', 'none', 'dk' or a number, got {scale!r}")


class Attention(nn.Module):
    """Multi-head self-attention with switches: score "softmax" (attention via ``attend``), "none"
    (weights = scaled scores, no softmax, no normalisation), "cosine" (softmax over cosine
    similarities times ``cosine_temperature``)."""

    def __init__(self, d_model: int, num_heads: int, head_dim: int, *, score: str = "softmax", scale: float,
                 attend: Callable, causal: bool = False, cosine_temperature: float = 1.0, qk_init: str = "unit"):
        super().__init__()
        if score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {score!r}")
        self.H, self.D, self.score, self.scale, self.causal = num_heads, head_dim, score, scale, causal
        self.attend, self.cosine_temperature = attend, cosine_temperature
        self.q_proj = nn.Linear(d_model, num_heads * head_dim)
        self.k_proj = nn.Linear(d_model, num_heads * head_dim)
        self.v_proj = nn.Linear(d_model, num_heads * head_dim)
        self.out_proj = nn.Linear(num_heads * head_dim, d_model)
        if qk_init == "unit":
            # q, k entries ~ unit variance for unit-variance inputs: the premise of Var(q·k) = d_k
            for lin in (self.q_proj, self.k_proj):
                nn.init.normal_(lin.weight, std=d_model ** -0.5)
                nn.init.zeros_(lin.bias)
        elif qk_init != "torch":
            raise ValueError(f"qk_init must be 'unit' or 'torch', got {qk_init!r}")

    def forward(self, x: torch.Tensor, stats: list | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.H, self.D).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(B, T, self.H, self.D).transpose(1, 2)  # (B, H, T, D)
        v = self.v_proj(x).view(B, T, self.H, self.D).transpose(1, 2)  # (B, H, T, D)
        if self.score == "cosine":
            q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
            scale = self.cosine_temperature
        else:
            scale = self.scale
        if self.score == "none":
            s = (q @ k.transpose(-2, -1)) * scale  # (B, H, T, T), unbounded, possibly negative
            if self.causal:
                s = s * torch.ones(T, T, device=x.device).tril()
            out = s @ v  # (B, H, T, D)
        else:
            out = self.attend(q, k, v, is_causal=self.causal, scale=scale)
        if stats is not None:
            stats.append(_weight_stats(q.detach(), k.detach(), scale, self.score, self.causal))
        return self.out_proj(out.transpose(1, 2).reshape(B, T, self.H * self.D))  # (B, T, d_model)


def _weight_stats(q, k, scale, score, causal, max_items: int = 4) -> dict:
    """Entropy (nats) and max weight of the attention rows, and the score std, on a few items."""
    q, k = q[:max_items].float(), k[:max_items].float()
    s = (q @ k.transpose(-2, -1)) * scale  # (b, H, T, T)
    T = s.shape[-1]
    if causal:
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=s.device).tril(), float("-inf"))
    finite = torch.isfinite(s)
    res = {"score_std": float(s[finite].std()) if finite.sum() > 1 else 0.0}
    if score == "none":
        res.update(entropy=None, max_weight=None)
        return res
    w = torch.softmax(s, dim=-1)
    ent = -(w * torch.log(w.clamp_min(1e-30))).sum(-1)  # (b, H, T)
    res.update(entropy=float(ent.mean()), max_weight=float(w.amax(-1).mean()),
               entropy_uniform=float(torch.log(finite.sum(-1).float()).mean()))
    return res


class Block(nn.Module):
    def __init__(self, d_model, num_heads, head_dim, **attn_kw):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = Attention(d_model, num_heads, head_dim, **attn_kw)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x, stats=None):
        x = x + self.attn(self.ln1(x), stats)
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    """Pre-norm Transformer for classification (mean pool over non-pad tokens), per-position read-out
    (``target_positions``) or causal language modelling. ids [B, T] -> logits [B, C] or [B, m, C]."""

    def __init__(self, vocab_size: int, num_classes: int, max_len: int, *, d_model: int = 64, num_heads: int = 2,
                 head_dim: int = 32, num_layers: int = 2, token_shift: bool = False, **attn_kw):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        nn.init.normal_(self.pos.weight, std=0.02)
        # Note [Token shift]: each position also gets an embedding of the token before it (a 2-tap causal
        # convolution over tokens, as in RWKV's token shift and H3/Based's short convolutions). One attention
        # layer can then match a query key against "value whose predecessor is that key" (associative
        # recall) instead of first having to learn a previous-token head from position embeddings.
        self.prev = nn.Embedding(vocab_size, d_model) if token_shift else None
        self.blocks = nn.ModuleList(Block(d_model, num_heads, head_dim, **attn_kw) for _ in range(num_layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, ids: torch.Tensor, target_positions: torch.Tensor | None = None, *, readout: str = "mean",
                stats: list | None = None) -> torch.Tensor:
        """readout: "mean" (pool non-pad tokens), "last" (last token) or "all" (every position)."""
        B, T = ids.shape
        x = self.tok(ids) + self.pos(torch.arange(T, device=ids.device))  # (B, T, d)
        if self.prev is not None:
            x = x + self.prev(F.pad(ids, (1, 0))[:, :T])  # (B, T, d): token t-1's embedding (0 = pad before t=0)
        for blk in self.blocks:
            x = blk(x, stats)
        x = self.ln(x)
        if target_positions is not None:
            return self.head(x[:, target_positions])  # (B, m, C)
        if readout == "mean":
            keep = (ids != 0).unsqueeze(-1).to(x.dtype)  # (B, T, 1)
            return self.head((x * keep).sum(1) / keep.sum(1).clamp_min(1.0))  # (B, C)
        if readout == "last":
            return self.head(x[:, -1])  # (B, C)
        return self.head(x)  # (B, T, C)


# -- text that ships with Python ------------------------------------------------------------------------
_TEXT_MODULES = ("json", "collections", "itertools", "functools", "re", "string", "textwrap", "pathlib",
                 "argparse", "random", "statistics", "heapq", "bisect", "csv", "datetime", "fractions",
                 "decimal", "difflib", "shutil", "tempfile", "typing", "dataclasses", "enum", "contextlib")


def stdlib_text(max_chars: int = 400_000) -> str:
    """Docstrings of a fixed list of standard-library modules and their public members (no download)."""
    import importlib
    import inspect

    parts = []
    for name in _TEXT_MODULES:
        mod = importlib.import_module(name)
        if mod.__doc__:
            parts.append(inspect.cleandoc(mod.__doc__))
        for attr in sorted(getattr(mod, "__all__", None) or dir(mod)):
            if attr.startswith("_"):
                continue
            doc = getattr(getattr(mod, attr, None), "__doc__", None)
            if isinstance(doc, str) and len(doc) > 40:
                parts.append(inspect.cleandoc(doc))
    text = "\n\n".join(dict.fromkeys(parts))  # drop duplicates, keep order
    return text[:max_chars]


def text_task(num_samples: int, seq_len: int, seed: int = 0):
    """Byte-level next-token windows from ``stdlib_text()``: inputs [N, T] (ids = byte + 1), targets [N, T]."""
    from attnlab.data import TaskData

    data = torch.tensor(list(stdlib_text().encode("utf-8")), dtype=torch.long) + 1  # 0 stays padding
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - seq_len - 1, (num_samples,), generator=g)
    idx = starts.unsqueeze(1) + torch.arange(seq_len + 1)  # (N, T+1)
    win = data[idx]
    return TaskData("text", win[:, :-1], win[:, 1:], vocab_size=257, num_classes=257, readout="all",
                    meta={"source": "docstrings of Python stdlib modules " + ",".join(_TEXT_MODULES),
                          "python": sys.version.split()[0], "chars": int(data.numel())})


# -- training ---------------------------------------------------------------------------------------------
@dataclass
class RunConfig:
    """One training run. ``scale``: "sqrt" | "none" | "dk" | a number; ``score``: softmax | none | cosine."""

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
    steps: int = 200
    batch_size: int = 32
    lr: float = 1e-3
    optimizer: str = "adamw"
    seed: int = 0
    log_every: int = 10
    qk_init: str = "unit"
    cosine_temperature: float = 1.0
    grad_clip: float | None = None
    model: str = "tiny"
    token_shift: bool = False

    @property
    def run_id(self) -> str:
        return f"{self.name}-seed{self.seed}"

    @property
    def file_id(self) -> str:
        """``run_id`` made safe as a file name."""
        import re

        return re.sub(r"[^A-Za-z0-9_.=-]+", "_", self.run_id).strip("_")


class _LibraryLM(nn.Module):
    """``attnlab.nn.TransformerLM`` (contract 2) behind TinyTransformer's call signature (no weight stats)."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, ids, target_positions=None, *, readout="all", stats=None):
        return self.lm(ids)  # (B, T, V)


def build_model(cfg: RunConfig, data) -> nn.Module:
    torch.manual_seed(cfg.seed)
    if cfg.model == "lm":
        if data.name != "text" or cfg.score != "softmax":
            raise ValueError("--model lm (attnlab.nn.TransformerLM) runs the text task with softmax attention only")
        from attnlab.nn import TransformerLM

        lm = TransformerLM(data.vocab_size, cfg.num_heads * cfg.head_dim, cfg.num_heads, cfg.num_layers,
                           max_len=cfg.seq_len, mechanism=cfg.attention, scale=scale_value(cfg.scale, cfg.head_dim))
        return _LibraryLM(lm)
    if cfg.model != "tiny":
        raise ValueError(f"model must be 'tiny' or 'lm', got {cfg.model!r}")
    attend = attention_fn(cfg.attention, cfg.seq_len, cfg.causal)
    return TinyTransformer(data.vocab_size, data.num_classes, cfg.seq_len, d_model=cfg.d_model,
                           num_heads=cfg.num_heads, head_dim=cfg.head_dim, num_layers=cfg.num_layers,
                           score=cfg.score, scale=scale_value(cfg.scale, cfg.head_dim), attend=attend,
                           causal=cfg.causal, cosine_temperature=cfg.cosine_temperature, qk_init=cfg.qk_init,
                           token_shift=cfg.token_shift)


def _loss(model, data, ids, tgt, stats=None):
    if data.name == "text":
        logits = model(ids, readout="all", stats=stats)  # (B, T, C)
    else:
        logits = model(ids, data.target_positions, readout=data.readout, stats=stats)  # (B, C) or (B, m, C)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))
    correct = (logits.argmax(-1) == tgt).float()
    return loss, correct


def loss_fn_for(data) -> Callable:
    """The loss function ``harness.train_run`` wants, for a task's data (text: every position)."""
    def loss_fn(model, ids, tgt, stats=None):
        return _loss(model, data, ids, tgt, stats)
    return loss_fn


def evaluate(model, data, batch_size: int = 64) -> dict:
    return _evaluate(model, loss_fn_for(data), data, batch_size)


def train_run(cfg: RunConfig, train, test, ckpt: Path | None = None, *, resume: bool = False,
              advance: Callable[[int], None] | None = None, checkpoint_every_s: float = 20.0) -> dict:
    """Build the model of ``cfg`` and train it with ``attnlab.harness.train_run``."""
    model = build_model(cfg, train)
    return _train_run(cfg, model, loss_fn_for(train), train, test, ckpt, resume=resume, advance=advance,
                      checkpoint_every_s=checkpoint_every_s)


def config_fields() -> list[str]:
    return [f.name for f in fields(RunConfig)]


def render(console_lines: list[str]) -> None:
    """Print a short summary with rich (stdout)."""
    from rich.console import Console

    Console().print("\n".join(console_lines))


def run_grid(configs: list[RunConfig], datasets: dict, out: Path, *, resume: bool = False, quiet: bool = False,
             title: str = "training") -> list[dict]:
    """Train every config (checkpoints in ``out/checkpoints``); a partial results file is kept up to date
    so a killed run leaves what it finished, and ``resume`` continues it."""
    from attnlab.report import atomic_write_json

    ckdir = out / "checkpoints"
    ckdir.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    with progress(quiet) as prog:
        tid = prog.add_task(title, total=sum(c.steps for c in configs))
        for cfg in configs:
            train, test = datasets[cfg.task]
            r = train_run(cfg, train, test, ckdir / f"{cfg.file_id}.pt", resume=resume,
                          advance=lambda n: prog.advance(tid, n))
            runs.append(r)
            atomic_write_json(out / "results.partial.json", {"complete": False, "runs": runs})
    return runs


def summarize_runs(runs: list[dict], key_fields: list[str]) -> list[dict]:
    """Group runs by ``key_fields`` of their config; mean ± std over seeds of the outcome measures."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault(tuple(r["config"][k] for k in key_fields), []).append(r)
    rows = []
    for key, rs in groups.items():
        row = dict(zip(key_fields, key))
        row["seeds"] = [r["config"]["seed"] for r in rs]
        for name, get in (("final_loss", lambda r: r["final_loss"]), ("eval_loss", lambda r: r["eval"]["loss"]),
                          ("eval_accuracy", lambda r: r["eval"]["accuracy"]),
                          ("first_loss", lambda r: r["history"]["loss"][0] if r["history"]["loss"] else None),
                          ("grad_norm_init", lambda r: r["history"]["grad_norm"][0] if r["history"]["grad_norm"] else None),
                          ("qk_grad_norm_init", lambda r: r["history"]["qk_grad_norm"][0] if r["history"]["qk_grad_norm"] else None),
                          ("entropy_init", lambda r: r["history"]["entropy"][0] if r["history"]["entropy"] else None),
                          ("entropy_final", lambda r: r["history"]["entropy"][-1] if r["history"]["entropy"] else None),
                          ("max_weight_init", lambda r: r["history"]["max_weight"][0] if r["history"]["max_weight"] else None),
                          ("max_weight_final", lambda r: r["history"]["max_weight"][-1] if r["history"]["max_weight"] else None),
                          ("steps_per_s", lambda r: r["steps_per_s"])):
            m, sd = mean_std([get(r) for r in rs])
            row[name], row[name + "_std"] = m, sd
        row["diverged"] = sum(1 for r in rs if r["nonfinite_step"] is not None)
        rows.append(row)
    return rows


def plot_curves(runs: list[dict], group_of: Callable[[dict], str], panel_of: Callable[[dict], str], path: Path,
                keys=(("loss", "training loss", True), ("qk_grad_norm", "‖grad‖ of W_Q, W_K", True),
                      ("entropy", "attention entropy (nats)", False))) -> str:
    """One row of panels per ``panel_of`` value, one column per measure; a line per run coloured by group."""
    pyplot = plt()
    panels = sorted({panel_of(r) for r in runs})
    groups = sorted({group_of(r) for r in runs})
    from ..report import line_styles

    styles = {g: st for g, st in zip(groups, line_styles(len(groups)))}  # distinct past 10 groups
    fig, axes = pyplot.subplots(len(panels), len(keys), figsize=(5 * len(keys), 3.2 * len(panels)), squeeze=False)
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
    return save_plot(fig, path)


# -- the two training experiments (scaling, failure-modes) share this driver ------------------------------
QUICK_SIZES = {"seq_len": {"recall": 16, "text": 32}, "train": 512, "test": 128, "steps": 12,
               "d_model": 32, "num_layers": 1, "batch_size": 16, "log_every": 3}
FULL_SIZES = {"seq_len": {"recall": 32, "text": 64}, "train": 20000, "test": 1000, "steps": 400,
              "d_model": 64, "num_layers": 2, "batch_size": 32, "log_every": 10}


def task_data(task: str, sizes: dict, seed: int = 0):
    from attnlab.data import make_task

    T, n = sizes["seq_len"][task], sizes["train"] + sizes["test"]
    if task == "text":
        data = text_task(n, T, seed)
    elif task == "recall":
        data = make_task("recall", n, T, seed=seed, num_pairs=4)
    else:
        raise ValueError(f"task must be 'recall' or 'text', got {task!r}")
    return data.split(sizes["train"])


def add_training_args(p) -> None:
    add_common_args(p)
    p.add_argument("--tasks", default="recall,text", help="comma-separated: recall (associative recall), "
                   "text (byte-level LM on Python's own docstrings)")
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd"), help="the training optimizer")
    p.add_argument("--lr", type=positive_float, default=None, help="learning rate (default 1e-3 for adamw, 0.05 for sgd)")
    p.add_argument("--model", default="tiny", choices=("tiny", "lm"),
                   help="tiny: the experiments' own model (entropy probes, failure-mode switches); lm: "
                        "attnlab.nn.TransformerLM with d_model = 2·d_k (text task, softmax arms only)")
    p.add_argument("--qk-init", default="unit", choices=("unit", "torch"),
                   help="unit: q, k entries start with unit variance (the tutorial's premise); torch: nn.Linear's default")


def training_experiment(args, name: str, arms: list[tuple[str, dict]], d_ks: list[int], intro: list[str],
                        baseline: str) -> dict:
    """Train every (task, d_k, arm, seed); write report.md, results.json, curves.png per experiment."""
    with threads(args.threads):
        return _training_experiment(args, name, arms, d_ks, intro, baseline)


def _training_experiment(args, name, arms, d_ks, intro, baseline) -> dict:
    t0 = time.perf_counter()
    seeds = seeds_of(args.seeds)
    tasks = [t.strip() for t in str(args.tasks).split(",") if t.strip()]
    for t in tasks:
        if t not in ("recall", "text"):
            raise ValueError(f"--tasks must name recall and/or text, got {args.tasks!r}")
    if args.model == "lm" and tasks != ["text"]:
        raise ValueError(f"--model lm trains attnlab.nn.TransformerLM on the text task only; pass --tasks text "
                         f"(got --tasks {args.tasks})")
    sizes = dict(QUICK_SIZES if args.quick else FULL_SIZES)
    if args.steps is not None:
        if args.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {args.steps}")
        sizes["steps"] = args.steps
    lr = args.lr if args.lr is not None else (1e-3 if args.optimizer == "adamw" else 0.05)
    out = out_dir(args, name)
    datasets = {t: task_data(t, sizes) for t in tasks}
    configs = []
    for task in tasks:
        for dk in d_ks:
            for label, over in arms:
                for seed in seeds:
                    configs.append(RunConfig(
                        name=f"{task}-dk{dk}-{label}", task=task, seq_len=sizes["seq_len"][task], d_model=sizes["d_model"],
                        num_heads=2, head_dim=dk, num_layers=sizes["num_layers"], causal=(task == "text"),
                        steps=sizes["steps"], batch_size=sizes["batch_size"], lr=lr, optimizer=args.optimizer, seed=seed,
                        log_every=sizes["log_every"], qk_init=args.qk_init, model=args.model, **over))
    runs = run_grid(configs, datasets, out, resume=args.resume, quiet=args.no_progress, title=name)
    label_of = {f"{t}-dk{dk}-{lab}": lab for t in tasks for dk in d_ks for lab, _ in arms}
    for r in runs:
        r["arm"] = label_of[r["config"]["name"]]
        r["config"]["arm"] = r["arm"]
    summary = summarize_runs(runs, ["task", "head_dim", "arm"])
    files = [plot_curves(runs, lambda r: r["arm"], lambda r: f"{r['config']['task']} d_k={r['config']['head_dim']}",
                         out / "curves.png")]
    verdicts = _verdicts(summary, baseline, [a for a, _ in arms if a != baseline])
    results = {"experiment": name, "model": args.model, "arms": {a: o for a, o in arms}, "baseline": baseline,
               "d_k": d_ks, "tasks": tasks,
               "sizes": sizes, "optimizer": args.optimizer, "lr": lr, "qk_init": args.qk_init, "seeds": seeds,
               "quick": bool(args.quick), "summary": summary, "verdicts": verdicts, "runs": runs,
               "task_meta": {t: datasets[t][0].meta for t in tasks}, "environment": env_record(seeds),
               "files": files, "complete": True, "wall_s": time.perf_counter() - t0}
    md = _training_report(results, intro)
    results["paths"] = write_results(out, results, md)
    partial = out / "results.partial.json"
    if partial.exists():
        partial.unlink()
    lines = [f"[bold]{name}[/bold] -> {out}/report.md ({len(runs)} runs, {time.perf_counter() - t0:.0f} s)"]
    lines += [f"  {v['task']} d_k={v['d_k']} {v['arm']}: {v['verdict']}" for v in verdicts]
    render(lines)
    results["summary_lines"] = lines
    return results


def _verdicts(summary: list[dict], baseline: str, others: list[str]) -> list[dict]:
    """Per (task, d_k): is each arm worse than the baseline by more than the seed spread (eval loss)?"""
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


def _training_report(res: dict, intro: list[str]) -> str:
    sz = res["sizes"]
    md = [f"# attnlab experiment {res['experiment']}", "", *intro, "",
          (f"Setup: attnlab.nn.TransformerLM (RoPE, tied embeddings), {sz['num_layers']} layers, 2 heads of d_k each "
           "(d_model = 2·d_k), " if res.get("model") == "lm" else
           f"Setup: a {sz['num_layers']}-layer pre-norm Transformer, d_model {sz['d_model']}, 2 heads of d_k each, ")
          + f"{sz['steps']} steps of batch {sz['batch_size']}, {res['optimizer']} at lr {res['lr']}, seeds {res['seeds']}, "
          f"W_Q/W_K init: {res['qk_init'] if res.get('model') != 'lm' else 'the library default'}. Tasks: "
          + ", ".join({"recall": f"associative recall (length {sz['seq_len']['recall']}, 4 key-value pairs, 16 classes, "
                                 "read at the last token)",
                       "text": f"byte-level next-token prediction on docstrings of Python's standard library "
                               f"(length {sz['seq_len']['text']}, causal)"}[t] for t in res["tasks"])
          + f". {sz['train']} training and {sz['test']} held-out examples."
          + (" **Quick mode: toy sizes, the numbers say nothing.**" if res["quick"] else ""), "",
          "![curves](curves.png)", "", "## Outcomes (mean ± std over seeds)", ""]
    rows = []
    for r in res["summary"]:
        pm = lambda k: None if r[k] is None else (f"{r[k]:.3g} ± {r[k + '_std']:.2g}" if r[k + "_std"] else f"{r[k]:.3g}")  # noqa: E731
        rows.append([r["task"], r["head_dim"], r["arm"], pm("eval_loss"), pm("eval_accuracy"), pm("final_loss"),
                     pm("entropy_init"), pm("entropy_final"), pm("max_weight_init"), pm("qk_grad_norm_init"),
                     r["diverged"], pm("steps_per_s")])
    md.append(fmt_table(["task", "d_k", "arm", "held-out loss", "held-out acc", "final train loss", "entropy at init",
                         "entropy at end", "max weight at init", "‖grad W_Q,W_K‖ at init", "diverged", "steps/s"], rows))
    md += ["", "## Verdicts", "",
           "An arm counts as worse or better only when its mean held-out loss differs from the baseline's by more "
           "than twice the larger seed standard deviation (at least 0.02).", ""]
    md += [f"- {v['task']}, d_k = {v['d_k']}, **{v['arm']}**: {v['verdict']}" for v in res["verdicts"]]
    md += ["", "## Environment", "", "```", *[f"{k}: {v}" for k, v in res["environment"].items() if k != "argv"], "```", ""]
    return "\n".join(md)
