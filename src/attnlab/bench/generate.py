"""attnlab bench generate: TransformerLM greedy generation with the KV cache vs without, side by side.

For each context length C the prompt has C - n tokens and n tokens are generated, so the last step
attends over C positions. Reported per configuration: tokens/s of ``generate`` (prefill included),
and decode-only tokens/s (the n - 1 steps after the prefill, timed step loop), with and without the
cache, and their ratios (cache / no cache).
Both runs must produce the same tokens (checked and recorded).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..options import check_memory, output_dir, positive_int, positive_int_list
from ..report import atomic_write_json, environment, save_figure

__all__ = ["build_parser", "run", "GenerateBench"]


@dataclass
class GenerateBench:
    """Result of one ``bench generate`` run: the model's settings, one row per context length (tokens/s
    with and without the KV cache, prefill and decode seconds, ``speedup`` = cache / no cache, and
    ``same_tokens``: both runs generated the same ids), the environment, and ``exit_code`` (1 if any
    context's two runs disagreed)."""
    out_dir: str
    model: dict
    rows: list[dict] = field(default_factory=list)
    env: dict = field(default_factory=dict)
    exit_code: int = 0


def build_parser(p):
    """Add ``bench generate``'s options (--quick, --out, --contexts, --new-tokens, --repeats, model sizes,
    --mechanism, --threads) to the argparse parser ``p``."""
    p.add_argument("--quick", action="store_true", help="tiny model, contexts 64 and 128 (seconds)")
    p.add_argument("--out", default="reports/bench-generate", help="output folder (default reports/bench-generate)")
    p.add_argument("--contexts", type=positive_int_list, default=None,
                   help="comma-separated context lengths (default 512,2048; quick 64,128)")
    p.add_argument("--new-tokens", type=positive_int, default=None, help="tokens generated per run (default 16; quick 4)")
    p.add_argument("--repeats", type=positive_int, default=None, help="timed repeats (median; default 2; quick 1)")
    p.add_argument("--d-model", type=positive_int, default=None, help="model width (default 256; quick 64)")
    p.add_argument("--layers", type=positive_int, default=None, help="Transformer layers (default 4; quick 2)")
    p.add_argument("--heads", type=positive_int, default=None, help="attention heads (default 8; quick 4)")
    p.add_argument("--mechanism", default="auto", help="attention mechanism of the model (default auto)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's current setting)")


def _time(f, repeats: int) -> tuple[float, object]:
    out, ts = None, []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = f()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)), out


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


def run(args) -> GenerateBench:
    """Run the generation benchmark with the parsed options ``args`` and return its :class:`GenerateBench`.

    Builds a seeded random :class:`~attnlab.nn.TransformerLM` (vocab 1000, RoPE) and, per context length
    C, generates ``--new-tokens`` n tokens greedily from a [1, C - n] prompt with and without the KV
    cache, timing ``generate`` and the decode steps alone. With the cache a decode step attends in O(C·d)
    per layer; without, it re-runs the whole prefix (O(C²·d) attention per layer). Writes generate.json and generate.png to
    ``args.out`` and prints a table. Raises ValueError for n < 2, --repeats < 1, a context <= n, a width not divisible
    by the heads, or a size that would not fit in memory. Torch's thread count is restored afterwards.
    """
    output_dir(args.out)
    # quick mode changes the defaults, never a value given on the command line
    defaults = dict(contexts=[64, 128], new_tokens=4, repeats=1, d_model=64, layers=2, heads=4) if args.quick else \
        dict(contexts=[512, 2048], new_tokens=16, repeats=2, d_model=256, layers=4, heads=8)
    given = {k: getattr(args, k, None) for k in defaults}
    given = {k: (positive_int_list(v) if k == "contexts" and isinstance(v, str) else v) for k, v in given.items()}
    contexts, n_new, repeats, d, layers, heads = (defaults[k] if given[k] is None else given[k] for k in defaults)
    if n_new < 2 or repeats < 1:
        raise ValueError(f"--new-tokens must be >= 2 and --repeats >= 1, got {n_new} and {repeats}")
    if any(c <= n_new for c in contexts):
        raise ValueError(f"every context must exceed --new-tokens ({n_new}), got {contexts}")
    if d % heads:
        raise ValueError(f"--d-model {d} must be divisible by --heads {heads}")
    # the KV cache (2 per layer), the activations and the position tables of the longest context
    check_memory(f"--contexts {max(contexts)} --d-model {d}", 4 * (max(contexts) + n_new) * d * (2 * layers + 16),
                 "the KV cache and activations of the longest context")
    if args.threads is not None:
        if args.threads <= 0:
            raise ValueError(f"--threads must be > 0, got {args.threads}")
        prev = torch.get_num_threads()
        torch.set_num_threads(args.threads)
        try:
            return _run(args, contexts, n_new, repeats, d, layers, heads)
        finally:
            torch.set_num_threads(prev)
    return _run(args, contexts, n_new, repeats, d, layers, heads)


def _run(args, contexts, n_new, repeats, d, layers, heads) -> GenerateBench:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from ..nn import TransformerLM

    vocab = 1000
    torch.manual_seed(0)
    model = TransformerLM(vocab, d, heads, layers, max_len=max(contexts), mechanism=args.mechanism).eval()
    res = GenerateBench(str(args.out), {"vocab": vocab, "d_model": d, "layers": layers, "heads": heads,
                                        "mechanism": args.mechanism, "positional": "rope"}, env=environment())
    console = Console()
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("generate", total=len(contexts) * 4)
        for C in contexts:
            prompt = torch.randint(0, vocab, (1, C - n_new), generator=torch.Generator().manual_seed(C))
            row = {"context": C, "prompt": C - n_new, "new_tokens": n_new}
            for use_cache in (True, False):
                key = "cache" if use_cache else "no_cache"
                t_n, ids = _time(lambda: model.generate(prompt, n_new, temperature=0, use_cache=use_cache), repeats)
                progress.advance(task)
                t_pre, t_dec = _decode_times(model, prompt, n_new, use_cache, repeats)
                progress.advance(task)
                row[key] = {"seconds": t_n, "tokens_per_s": n_new / t_n, "prefill_seconds": t_pre,
                            "decode_seconds": t_dec, "decode_tokens_per_s": (n_new - 1) / t_dec}
                row[f"ids_{key}"] = ids[0, C - n_new:].tolist()
            row["same_tokens"] = row.pop("ids_cache") == row.pop("ids_no_cache")
            row["speedup"] = row["cache"]["tokens_per_s"] / row["no_cache"]["tokens_per_s"]
            row["decode_speedup"] = row["cache"]["decode_tokens_per_s"] / row["no_cache"]["decode_tokens_per_s"]
            res.rows.append(row)
    if not all(r["same_tokens"] for r in res.rows):
        res.exit_code = 1
    out_dir = Path(args.out)
    atomic_write_json(out_dir / "generate.json", {
        "suite": "generate", "model": res.model, "threads": torch.get_num_threads(), "rows": res.rows,
        "env": res.env, "note": "speedup = tokens/s with cache / tokens/s without, same run; decode_* excludes "
                                "the prefill"})
    _plot(res, out_dir / "generate.png")
    t = Table(title=f"TransformerLM generate (d={d}, {layers} layers), greedy, {n_new} new tokens")
    for col in ("context", "cache tok/s", "no-cache tok/s", "speedup", "decode speedup", "same tokens"):
        t.add_column(col, justify="right")
    for r in res.rows:
        t.add_row(str(r["context"]), f"{r['cache']['tokens_per_s']:.1f}", f"{r['no_cache']['tokens_per_s']:.1f}",
                  f"{r['speedup']:.1f}x", f"{r['decode_speedup']:.1f}x", "yes" if r["same_tokens"] else "NO")
    console.print(t)
    console.print(f"wrote {out_dir / 'generate.json'}")
    return res


def _plot(res: GenerateBench, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    cs = [r["context"] for r in res.rows]
    ax.plot(cs, [r["cache"]["decode_tokens_per_s"] for r in res.rows], "o-", label="KV cache")
    ax.plot(cs, [r["no_cache"]["decode_tokens_per_s"] for r in res.rows], "s-", label="no cache")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length")
    ax.set_ylabel("decode tokens / s")
    ax.legend()
    save_figure(fig, path)
