"""attnlab bench minilm: all-MiniLM-L6-v2 sentence encoding on attnlab vs Hugging Face transformers
(sdpa and eager attention), the same weights and inputs, timed side by side in one run.

What is timed: the model forward plus sentence-transformers' mean pooling and L2 normalisation on a
pre-tokenised batch (tokenisation is identical for every implementation and left out). Repeats are
interleaved (a, b, c, a, b, c, ...) so load changes on a shared machine hit every implementation
alike; the median is reported. Ratios are throughputs divided by transformers-sdpa's, same run.

``run(MiniLMConfig(...)) -> MiniLMBench``: no printing, no argv (the CLI is ``attnlab bench minilm``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from ..harness import threads
from ..models import minilm
from ..report import environment
from ..resources import check_memory
from .files import write_json_and_figure

__all__ = ["MiniLMConfig", "MiniLMBench", "run"]


@dataclass
class MiniLMConfig:
    """What ``bench minilm`` measures: a [batch, tokens] batch of token ids, ``repeats`` timed rounds, one
    attnlab model per entry of ``mechanisms``. A size left None takes quick's default (4 x 32, 2 repeats)
    when ``quick``, else 32 x 128 and 5 repeats. ``threads``: torch's thread count (None: unchanged)."""
    out: str = "reports/bench-minilm"
    quick: bool = False
    batch: int | None = None
    tokens: int | None = None
    repeats: int | None = None
    mechanisms: tuple[str, ...] = ("auto", "tiled")
    threads: int | None = None

    def resolved(self) -> tuple[int, int, int]:
        """(batch, tokens, repeats) with the defaults filled in; ValueError naming the option otherwise."""
        defaults = {"batch": 4, "tokens": 32, "repeats": 2} if self.quick else {"batch": 32, "tokens": 128, "repeats": 5}
        batch, tokens, repeats = (defaults[n] if getattr(self, n) is None else getattr(self, n) for n in defaults)
        for name, v in (("batch", batch), ("tokens", tokens), ("repeats", repeats)):
            if v <= 0:
                raise ValueError(f"--{name} must be > 0, got {v}")
        if tokens > 512:
            raise ValueError(f"--tokens must be <= 512 (MiniLM's positions), got {tokens}")
        if self.threads is not None and self.threads <= 0:
            raise ValueError(f"--threads must be > 0, got {self.threads}")
        return batch, tokens, repeats


@dataclass
class MiniLMBench:
    """Result of one ``bench minilm`` run on a [batch, tokens] batch of token ids: one row per
    implementation (median seconds and every repeat, sentences/s, tokens/s, the largest absolute
    difference of its [batch, 384] sentence embeddings from transformers-sdpa's, and its speed ratios to
    transformers' sdpa and eager), the implementations skipped and why, and the environment."""
    out_dir: str
    batch: int
    tokens: int
    repeats: int
    threads: int
    rows: list[dict] = field(default_factory=list)  # impl, seconds (median), sentences_per_s, ratio_vs_sdpa, ...
    skipped: list[dict] = field(default_factory=list)
    env: dict = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    exit_code: int = 0

    def write(self) -> list[str]:
        """Write minilm.json and minilm.png into ``out_dir``, atomically; returns both paths."""
        self.files = write_json_and_figure(self.out_dir, "minilm", {
            "suite": "minilm", "batch": self.batch, "tokens": self.tokens, "repeats": self.repeats,
            "threads": self.threads, "rows": self.rows, "skipped": self.skipped, "env": self.env,
            "note": "throughput ratios are transformers time / impl time in the same run (>1: faster)",
        }, lambda ax: _draw(self, ax))
        return self.files

    def row(self, impl: str) -> dict | None:
        """The row of implementation ``impl`` (e.g. "attnlab[auto]", "transformers[sdpa]"), or None."""
        return next((r for r in self.rows if r["impl"] == impl), None)


def _pool(h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.unsqueeze(-1).to(h.dtype)  # (B, T, 1)
    return torch.nn.functional.normalize((h * m).sum(1) / m.sum(1).clamp(min=1e-9), dim=-1)


def run(config: MiniLMConfig, *, progress: Callable[[int, int, str], None] | None = None) -> MiniLMBench:
    """Time MiniLM sentence encoding on attnlab and transformers; writes minilm.json and minilm.png to ``out``.

    Times attnlab's MiniLM (one model per entry of ``mechanisms``) and, when installed, transformers'
    BertModel with sdpa and eager attention, all on the same local weights and one fixed unpadded
    [batch, tokens] batch; each call is forward + mean pooling + L2 normalisation. Repeats are interleaved
    after one warm-up round; medians are reported. ``progress(done, total, label)`` is called before each
    call. Raises ValueError for a size <= 0, more than 512 tokens, or a batch that would not fit in
    memory. Torch's thread count is restored afterwards.
    """
    batch, tokens, repeats = config.resolved()
    # per layer of the three models: hidden states [B, T, 384] and their temporaries, 12 heads' [T, T] scores
    check_memory(f"--batch {batch} --tokens {tokens}", 4 * batch * tokens * (384 * 24 + 12 * tokens * 3),
                 "MiniLM's activations for one batch")
    with threads(config.threads):
        return _run(config, batch, tokens, repeats, progress)


def _run(config: MiniLMConfig, batch: int, tokens: int, repeats: int, progress) -> MiniLMBench:
    res = MiniLMBench(str(config.out), batch, tokens, repeats, torch.get_num_threads(), env=environment())

    # one fixed batch: [CLS] random WordPiece ids [SEP], every token real (no padding)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 29000, (batch, tokens), generator=g)  # (B, T)
    ids[:, 0], ids[:, -1] = 101, 102
    mask = torch.ones_like(ids)

    impls: dict[str, callable] = {}
    for mech in [m.strip() for m in config.mechanisms if m.strip()]:
        model = minilm.load(mechanism=mech)
        impls[f"attnlab[{mech}]"] = (lambda model=model: _pool(model(ids, mask).last_hidden_state, mask))
    try:
        from transformers import BertModel

        for impl in ("sdpa", "eager"):
            hf = BertModel.from_pretrained(str(minilm.model_path()), local_files_only=True,
                                           attn_implementation=impl).eval()
            impls[f"transformers[{impl}]"] = (
                lambda hf=hf: _pool(hf(input_ids=ids, attention_mask=mask).last_hidden_state, mask))
    except ImportError as e:
        res.skipped.append({"impl": "transformers", "reason": f"transformers not installed ({e}); pip install 'attnlab[hf]'"})

    times: dict[str, list[float]] = {k: [] for k in impls}
    outputs: dict[str, torch.Tensor] = {}
    total, done = (repeats + 1) * len(impls), 0
    with torch.inference_mode():
        for rep in range(repeats + 1):  # the first round is a warm-up
            for name, f in impls.items():
                if progress:
                    progress(done, total, f"{'warm-up' if rep == 0 else f'round {rep}'} {name}")
                t0 = time.perf_counter()
                out = f()
                dt = time.perf_counter() - t0
                if rep == 0:
                    outputs[name] = out
                else:
                    times[name].append(dt)
                done += 1

    ref = outputs.get("transformers[sdpa]")
    for name, ts in times.items():
        sec = float(np.median(ts))
        res.rows.append({
            "impl": name, "seconds": sec, "seconds_all": ts, "sentences_per_s": batch / sec,
            "tokens_per_s": batch * tokens / sec,
            "max_abs_diff_vs_transformers_sdpa": None if ref is None else float((outputs[name] - ref).abs().max()),
        })
    sdpa, eager = res.row("transformers[sdpa]"), res.row("transformers[eager]")
    for r in res.rows:
        r["ratio_vs_sdpa"] = sdpa["seconds"] / r["seconds"] if sdpa else None
        r["ratio_vs_eager"] = eager["seconds"] / r["seconds"] if eager else None

    res.write()
    if progress:
        progress(total, total, "done")
    return res


def _draw(res: MiniLMBench, ax) -> None:
    names = [r["impl"] for r in res.rows]
    ax.barh(names, [r["sentences_per_s"] for r in res.rows], color="tab:blue")
    ax.set_xlabel("sentences / s (higher is better)")
    ax.set_title(f"MiniLM encode, batch {res.batch} x {res.tokens} tokens")
