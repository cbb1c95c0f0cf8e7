"""attnlab bench layers: self-attention vs recurrence vs convolution, per layer (Vaswani et al. 2017, Table 1).

Each layer maps a sequence x: [B, n, d] to [B, n, d]:

    attention         softmax(x xᵀ/√d) x, method="dense"          (the paper's O(n²·d): no projections;
                      the n x n weights are materialised and kept for backward)
    attention_fused   the same through attnlab's method="auto" (PyTorch's fused CPU kernel: O(n) memory)
    attention+proj    dense, with W_Q, W_K, W_V, W_O (d x d)        (what a real layer costs: + O(n·d²))
    attention_window  attention restricted to a window of r = 2w+1 keys (attnlab.patterns.sliding_window)
    gru, lstm         torch.nn.GRU / torch.nn.LSTM, hidden size d   (O(n·d²), n sequential steps)
    conv              torch.nn.Conv1d(d, d, k, padding=k//2)        (O(k·n·d²))

Measured on this machine, side by side in one run: best-of-reps wall time of the forward pass (no_grad) and
of forward + backward; forward peak memory (bytes PyTorch's CPU allocator hands out, from torch.profiler's
memory events, inputs and weights excluded); bytes autograd saves for backward (unique storages packed by
saved_tensors_hooks, inputs and weights excluded). Derived from each layer's structure at small n: the number
of sequential operations and the maximum path length between any input and any output position (from the
Jacobian sparsity of the actual module, or the unrolled recurrence h_t = f(x_t, h_{t-1})).

Legend: B batch, n sequence length, d model width, w window (each side), r = 2w+1 keys per query, k kernel.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from .. import patterns
from ..functional import attention, explain
from ..options import check_memory, nonneg_int, output_dir, positive_float, positive_int
from ..report import atomic_write_json, atomic_write_text, environment, save_figure

__all__ = ["LAYERS", "PAPER", "make_layer", "flops", "structure", "measure", "crossover", "build_parser", "run"]

LAYERS = ("attention", "attention_fused", "attention+proj", "attention_window", "gru", "lstm", "conv")
ATTENTION_LAYERS = ("attention", "attention_fused", "attention+proj", "attention_window")

# Vaswani et al. 2017, Table 1 (complexity per layer, sequential operations, maximum path length)
PAPER = {
    "attention": ("O(n²·d)", "O(1)", "O(1)"),
    "attention_fused": ("O(n²·d)", "O(1)", "O(1)"),
    "attention+proj": ("O(n²·d) (+ O(n·d²) projections, not in the table)", "O(1)", "O(1)"),
    "attention_window": ("O(r·n·d)", "O(1)", "O(n/r)"),
    "gru": ("O(n·d²)", "O(n)", "O(n)"),
    "lstm": ("O(n·d²)", "O(n)", "O(n)"),
    "conv": ("O(k·n·d²)", "O(1)", "O(log_k(n)) dilated; O(n/k) contiguous"),
}
# exponents of n and d the paper's complexity column implies (for the fitted log-log slopes)
PAPER_EXPONENTS = {"attention": (2, 1), "attention_fused": (2, 1), "attention+proj": (2, 1),
                   "attention_window": (1, 1), "gru": (1, 2), "lstm": (1, 2), "conv": (1, 2)}


# -- 1) the layers ---------------------------------------------------------------------------------------
class _Attention(nn.Module):
    """Single-head self-attention through attnlab.attention; Q = K = V = x unless ``project``."""

    def __init__(self, d: int, project: bool, pattern=None, method: str = "dense"):
        super().__init__()
        self.pattern, self.method = pattern, method
        self.proj = nn.ModuleList([nn.Linear(d, d) for _ in range(4)]) if project else None

    def forward(self, x):  # x: (B, n, d)
        q = k = v = x
        if self.proj is not None:
            q, k, v = (p(x) for p in self.proj[:3])
        out = attention(q[:, None], k[:, None], v[:, None], pattern=self.pattern, method=self.method)  # (B, 1, n, d)
        out = out[:, 0]  # (B, n, d)
        return self.proj[3](out) if self.proj is not None else out


class _Recurrent(nn.Module):
    def __init__(self, cell: type, d: int):
        super().__init__()
        self.rnn = cell(d, d, batch_first=True)

    def forward(self, x):  # (B, n, d) -> (B, n, d)
        return self.rnn(x)[0]


class _Conv(nn.Module):
    def __init__(self, d: int, k: int):
        super().__init__()
        self.conv = nn.Conv1d(d, d, k, padding=k // 2)

    def forward(self, x):  # (B, n, d) -> (B, d, n) -> conv -> (B, n, d)
        return self.conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)


def make_layer(name: str, d: int, *, window: int = 16, kernel: int = 3) -> nn.Module:
    """One layer of width ``d``; ``window`` (each side) for attention_window, ``kernel`` for conv."""
    if name == "attention":
        return _Attention(d, project=False)
    if name == "attention_fused":
        return _Attention(d, project=False, method="auto")
    if name == "attention+proj":
        return _Attention(d, project=True)
    if name == "attention_window":
        return _Attention(d, project=False, pattern=patterns.sliding_window(window), method="auto")
    if name == "gru":
        return _Recurrent(nn.GRU, d)
    if name == "lstm":
        return _Recurrent(nn.LSTM, d)
    if name == "conv":
        return _Conv(d, kernel)
    raise ValueError(f"layer must be one of {list(LAYERS)}, got {name!r}")


def flops(name: str, n: int, d: int, *, batch: int = 1, window: int = 16, kernel: int = 3) -> int:
    """Forward multiply-add FLOPs (2 per MAC) of the layer's matrix products."""
    if name in ATTENTION_LAYERS:
        pat = patterns.sliding_window(window) if name == "attention_window" else patterns.full()
        f = pat.flops(n, n, d)  # 2·nnz·2d: QKᵀ and AV
        if name == "attention+proj":
            f += 4 * 2 * n * d * d
    elif name == "gru":
        f = 3 * 2 * 2 * n * d * d  # 3 gates, input and hidden products
    elif name == "lstm":
        f = 4 * 2 * 2 * n * d * d  # 4 gates
    elif name == "conv":
        f = 2 * kernel * n * d * d
    else:
        raise ValueError(f"layer must be one of {list(LAYERS)}, got {name!r}")
    return int(batch * f)


# -- 2) structure: sequential operations and maximum path length ----------------------------------------
def _jacobian_reach(layer: nn.Module, n: int, d: int) -> torch.Tensor:
    """[n, n] bool: output position i depends on input position j (Jacobian block (i, j) is non-zero)."""
    torch.manual_seed(0)
    x = torch.randn(1, n, d, dtype=torch.float64, requires_grad=True)
    layer = layer.double()
    y = layer(x)  # (1, n, d)
    reach = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        (g,) = torch.autograd.grad(y[0, i].sum(), x, retain_graph=True)
        reach[i] = g[0].abs().sum(-1) > 0
    return reach


def _diameter(adj: torch.Tensor) -> int | None:
    """Longest shortest path (in layers) between an input and an output position when the same one-step
    adjacency ``adj`` [n, n] is stacked; None if some position never reaches another."""
    n = adj.shape[0]
    a = adj.float()
    reach = torch.eye(n, dtype=torch.bool) | adj
    hops = 1
    while not bool(reach.all()):
        new = ((a @ reach.float()) > 0) | reach  # (n, n): one more layer on top
        if bool((new == reach).all()):
            return None
        reach, hops = new, hops + 1
    return hops


def structure(name: str, n: int, *, window: int = 16, kernel: int = 3, d: int = 3) -> dict:
    """Sequential operations and maximum path length of one layer type at length n, derived from structure.

    Attention and convolution: the Jacobian sparsity of the actual module gives the one-layer adjacency
    (which inputs each output reads, in one parallel step); the maximum path length is the number of stacked
    layers needed to connect every input to every output; sequential operations: 1 (one step per layer).
    Recurrence: the Jacobian is lower-triangular, but every dependence runs through the chain
    h_t = f(x_t, h_{t-1}) — a graph x_t -> h_t, h_{t-1} -> h_t whose longest path (n cells) is both the
    number of sequential operations and the path from x_1 to y_n."""
    layer = make_layer(name, d, window=window, kernel=kernel)
    reach = _jacobian_reach(layer, n, d)
    if name in ("gru", "lstm"):
        # the recurrence's graph: nodes x_1..x_n, h_1..h_n; the path x_j -> h_j -> ... -> h_i has i - j + 1
        # edges, and the first input reaches the last output only that way
        lower = torch.tril(torch.ones(n, n, dtype=torch.bool))
        if not bool((reach == lower).all()):
            raise RuntimeError(f"{name}: expected a causal (lower-triangular) Jacobian at n={n}")
        return {"layer": name, "n": n, "sequential_ops": n, "max_path_length": n,
                "one_layer_density": float(reach.double().mean())}
    return {"layer": name, "n": n, "sequential_ops": 1, "max_path_length": _diameter(reach),
            "one_layer_density": float(reach.double().mean())}


# -- 3) measurements -----------------------------------------------------------------------------------------
def _times(fn: Callable[[], object], min_time: float, max_reps: int) -> list[float]:
    """Wall times of repeated calls after one warm-up: at least 3, until ``min_time`` or ``max_reps``."""
    fn()  # warm-up
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < 3 or time.perf_counter() - start < min_time):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def _forward_peak_bytes(fn: Callable[[], object]) -> int:
    """Peak of (allocated - freed) bytes over the call, from torch.profiler's CPU memory events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    cur = peak = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        cur += e.self_cpu_memory_usage
        peak = max(peak, cur)
    return int(peak)


def _saved_bytes(layer: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the unique storages autograd saves for backward, the input and the weights excluded."""
    exclude = {x.untyped_storage().data_ptr()} | {p.untyped_storage().data_ptr() for p in layer.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in exclude:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    del y
    return int(sum(seen.values()))


def measure(name: str, n: int, d: int, *, batch: int = 1, window: int = 16, kernel: int = 3,
            min_time: float = 0.2, max_reps: int = 20, memory: bool = True) -> dict:
    """Time of forward (no_grad) and forward+backward (best of reps, see Note [Best of reps]; medians kept
    too), FLOPs, and memory, for one layer at (n, d). x: [batch, n, d] float32."""
    torch.manual_seed(0)
    layer = make_layer(name, d, window=window, kernel=kernel)
    x = torch.randn(batch, n, d)
    xg = x.clone().requires_grad_(True)

    def fwd():
        with torch.no_grad():
            return layer(x)

    def fwd_bwd():
        layer.zero_grad(set_to_none=True)
        xg.grad = None
        layer(xg).sum().backward()

    t_f, t_b = _times(fwd, min_time, max_reps), _times(fwd_bwd, min_time, max_reps)
    # Note [Best of reps]: on a shared machine interference only ever adds time, so the reported time is the
    # fastest repetition; the median is kept beside it
    row = {"layer": name, "n": n, "d": d, "batch": batch,
           "forward_s": min(t_f), "forward_backward_s": min(t_b),
           "forward_median_s": statistics.median(t_f), "forward_backward_median_s": statistics.median(t_b),
           "reps": [len(t_f), len(t_b)],
           "flops": flops(name, n, d, batch=batch, window=window, kernel=kernel)}
    if name in ATTENTION_LAYERS:
        q = x[:, None]
        row["method"] = (layer.method if layer.method != "auto"
                         else explain(q, q, q, pattern=layer.pattern).method)
    if memory:
        row["forward_peak_bytes"] = _forward_peak_bytes(fwd)
        row["saved_bytes"] = _saved_bytes(layer, xg)
    return row


def _interp_crossing(ns: list[int], ratio: list[float]) -> float | None:
    """First n where log(ratio) crosses 0 going up (attention stops being cheaper), log-log interpolation."""
    for (n0, r0), (n1, r1) in zip(zip(ns, ratio), zip(ns[1:], ratio[1:])):
        if r0 < 1 <= r1:
            a, b = math.log(r0), math.log(r1)
            return math.exp(math.log(n0) + (math.log(n1) - math.log(n0)) * (0 - a) / (b - a))
    return None


def crossover(rows: list[dict], attn: str, rnn: str, key: str) -> list[dict]:
    """Per d: the n where ``attn`` becomes slower than ``rnn`` (time ``key``), or where it stays, and n*/d."""
    out = []
    for d in sorted({r["d"] for r in rows}):
        by = {(r["layer"], r["n"]): r[key] for r in rows if r["d"] == d}
        ns = sorted(n for (layer, n) in by if layer == attn and (rnn, n) in by)
        if not ns:
            continue
        ratio = [by[(attn, n)] / by[(rnn, n)] for n in ns]
        n_star = _interp_crossing(ns, ratio)
        if n_star is None:
            verdict = (f"{attn} cheaper at every n measured (up to {ns[-1]})" if all(r < 1 for r in ratio)
                       else f"{attn} dearer at every n measured (from {ns[0]})" if all(r >= 1 for r in ratio)
                       else "no single crossing")
        else:
            verdict = f"{attn} cheaper while n < {n_star:.0f} ≈ {n_star / d:.2g}·d"
        # the FLOP model's crossing: flops(attn) = flops(rnn), solved on the measured grid's continuum
        out.append({"d": d, "attention": attn, "recurrent": rnn, "timing": key, "ns": ns, "ratio": ratio,
                    "n_star": n_star, "n_star_over_d": None if n_star is None else n_star / d,
                    "verdict": verdict, "flop_model_n_star": _flop_crossing(attn, rnn, d)})
    return out


def _flop_crossing(attn: str, rnn: str, d: int) -> float | None:
    """n where the FLOP counts of ``attn`` (dense) and ``rnn`` meet: 4n²d (+8nd²) = c·n·d²."""
    c = {"gru": 12, "lstm": 16}[rnn]
    extra = 8 if attn == "attention+proj" else 0
    if attn == "attention_window":
        return None
    return (c - extra) * d / 4 if c > extra else None


def _slope(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 2:
        return None
    lx, ly = [math.log(v) for v in xs], [math.log(v) for v in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    sxx = sum((a - mx) ** 2 for a in lx)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sxx if sxx else None


def fitted_slopes(rows: list[dict], key: str = "forward_s") -> dict:
    """Log-log slopes of time vs n (at the largest d, upper half of n) and vs d (at the largest n)."""
    out = {}
    for name in sorted({r["layer"] for r in rows}, key=LAYERS.index):
        mine = [r for r in rows if r["layer"] == name]
        d_max, n_max = max(r["d"] for r in mine), max(r["n"] for r in mine)
        by_n = sorted((r["n"], r[key]) for r in mine if r["d"] == d_max)
        by_n = by_n[len(by_n) // 2 - (len(by_n) % 2 == 0):] if len(by_n) > 2 else by_n
        by_d = sorted((r["d"], r[key]) for r in mine if r["n"] == n_max)
        out[name] = {"n_slope": _slope([a for a, _ in by_n], [b for _, b in by_n]), "at_d": d_max,
                     "d_slope": _slope([a for a, _ in by_d], [b for _, b in by_d]), "at_n": n_max,
                     "paper": PAPER_EXPONENTS[name]}
    return out


# -- 4) report --------------------------------------------------------------------------------------------------
def _fmt_s(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def _fmt_b(b: int | None) -> str:
    if b is None:
        return "–"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= size:
            return f"{b / size:.3g} {unit}"
    return f"{b} B"


def markdown(result: dict) -> str:
    """The layers.md report of a :func:`run` result: the paper's Table 1 beside the derived structure,
    measured times and memory, fitted exponents and the attention/recurrence crossover."""
    cfg = result["config"]
    env = result["environment"]
    lines = [
        "# Self-attention vs recurrence vs convolution, per layer (Vaswani et al. 2017, Table 1)", "",
        f"Measured by `{cfg['command']}` on {env['cpu']} ({env['threads']} thread{'s' if env['threads'] != 1 else ''}, torch {env['torch']}). "
        f"Batch {cfg['batch']}, window w = {cfg['window']} each side (r = {2 * cfg['window'] + 1} keys), "
        f"kernel k = {cfg['kernel']}, float32. Times are the best of {cfg['max_reps']} repetitions at most (medians in "
        f"the JSON); only ratios within this run mean anything.", "",
        "## Structure (derived) beside the paper's Table 1", "",
        "| layer | paper: complexity per layer | paper: sequential ops | paper: max path length | "
        + " | ".join(f"derived at n={n}: seq ops / path" for n in cfg["structure_ns"]) + " |",
        "|---|---|---|---|" + "---|" * len(cfg["structure_ns"]),
    ]
    for name in cfg["layers"]:
        cells = []
        for n in cfg["structure_ns"]:
            s = next(s for s in result["structure"] if s["layer"] == name and s["n"] == n)
            cells.append(f"{s['sequential_ops']} / {s['max_path_length']}")
        lines.append(f"| {name} | " + " | ".join(PAPER[name]) + " | " + " | ".join(cells) + " |")
    lines += ["", "## Measured time and memory", "",
              "| layer | n | d | forward | fwd+bwd | fwd / GRU fwd | fwd GFLOP/s | forward peak | saved for bwd | method |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    gru = {(r["n"], r["d"]): r["forward_s"] for r in result["rows"] if r["layer"] == "gru"}
    for r in sorted(result["rows"], key=lambda r: (r["d"], r["n"], LAYERS.index(r["layer"]))):
        ratio = f"{r['forward_s'] / gru[(r['n'], r['d'])]:.3g}" if (r["n"], r["d"]) in gru else "–"
        lines.append(f"| {r['layer']} | {r['n']} | {r['d']} | {_fmt_s(r['forward_s'])} | "
                     f"{_fmt_s(r['forward_backward_s'])} | {ratio} | {r['flops'] / r['forward_s'] / 1e9:.3g} | "
                     f"{_fmt_b(r.get('forward_peak_bytes'))} | {_fmt_b(r.get('saved_bytes'))} | "
                     f"{r.get('method', '–')} |")
    lines += ["", "## Fitted log-log exponents of forward time (paper's exponents in brackets)", "",
              "| layer | time ∝ n^a (at largest d, upper half of n) | time ∝ d^b (at largest n) |", "|---|---|---|"]
    for name, s in result["slopes"].items():
        fa = "–" if s["n_slope"] is None else f"{s['n_slope']:.2f}"
        fb = "–" if s["d_slope"] is None else f"{s['d_slope']:.2f}"
        lines.append(f"| {name} | {fa} [{s['paper'][0]}] (d={s['at_d']}) | {fb} [{s['paper'][1]}] (n={s['at_n']}) |")
    lines += ["", "## Where \"self-attention is cheaper than recurrence when n < d\" lands here", "",
              "The paper's argument counts operations: n²·d for attention against n·d² for a recurrent layer, so "
              "attention wins while n < d. With the constants of a GRU (12·n·d² FLOPs) and attention's two "
              "products (4·n²·d) the FLOP model crosses at n = 3d; with the W_Q, W_K, W_V, W_O projections "
              "(+8·n·d²) at n = d. Measured crossings (forward time, then forward+backward):", "",
              "| attention | recurrent | timing | d | measured n* | n*/d | FLOP-model n* | verdict |",
              "|---|---|---|---|---|---|---|---|"]
    for c in result["crossover"]:
        ns = "–" if c["n_star"] is None else f"{c['n_star']:.0f}"
        nd = "–" if c["n_star_over_d"] is None else f"{c['n_star_over_d']:.2g}"
        fm = "–" if c["flop_model_n_star"] is None else f"{c['flop_model_n_star']:.0f}"
        lines.append(f"| {c['attention']} | {c['recurrent']} | {c['timing']} | {c['d']} | {ns} | {nd} | {fm} | "
                     f"{c['verdict']} |")
    lines += ["", "Files: " + ", ".join(f"`{Path(p).name}`" for p in result["files"].values()), ""]
    return "\n".join(lines)


def _plots(result: dict, out: Path) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, files = result["rows"], {}
    ds = sorted({r["d"] for r in rows})
    fig, axes = plt.subplots(2, len(ds), figsize=(4.4 * len(ds), 7.5), squeeze=False, layout="constrained")
    for col, d in enumerate(ds):
        for row, key in enumerate(("forward_s", "forward_backward_s")):
            ax = axes[row][col]
            for name in result["config"]["layers"]:
                pts = sorted((r["n"], r[key]) for r in rows if r["layer"] == name and r["d"] == d)
                if pts:
                    ax.loglog([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
            ax.axvline(d, color="grey", ls=":", lw=1)
            ax.set_title(f"d={d}, {'forward' if row == 0 else 'forward+backward'}")
            ax.set_xlabel("n (dotted: n = d)")
            ax.set_ylabel("seconds")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Per-layer time vs sequence length (log-log)")
    files["time_png"] = str(save_figure(fig, out / "layers_time.png"))

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), layout="constrained")
    d = ds[-1]
    for ax, key, title in ((axes[0], "forward_peak_bytes", "forward peak"),
                           (axes[1], "saved_bytes", "saved for backward")):
        for name in result["config"]["layers"]:
            pts = sorted((r["n"], r[key]) for r in rows if r["layer"] == name and r["d"] == d and r.get(key))
            if pts:
                ax.loglog([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set_title(f"{title}, d={d}")
        ax.set_xlabel("n")
        ax.set_ylabel("bytes")
    axes[0].legend(fontsize=7)
    files["memory_png"] = str(save_figure(fig, out / "layers_memory.png"))
    return files


# -- 5) CLI ---------------------------------------------------------------------------------------------------------
# --quick runs on one thread: toy sizes gain nothing from more, and on a busy machine a second thread that
# is descheduled stalls every parallel region
QUICK = {"ns": [8, 16, 32], "ds": [8, 16], "batch": 1, "window": 2, "kernel": 3, "min_time": 0.0, "max_reps": 3,
         "structure_ns": [8, 16], "threads": 1, "memory_at": "largest n"}
FULL = {"ns": [16, 32, 64, 128, 256, 512, 1024, 2048], "ds": [16, 64, 256], "batch": 1, "window": 16,
        "kernel": 3, "min_time": 0.1, "max_reps": 10, "structure_ns": [32, 64], "threads": None,
        "memory_at": "every n"}


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return sorted(set(vals))


def build_parser(p: argparse.ArgumentParser) -> None:
    """Add ``bench layers``' options (--quick, --out, --ns, --ds, --layers, sizes, --threads, --no-memory,
    --json) to the argparse parser ``p``."""
    p.add_argument("--quick", action="store_true", help="toy sizes, runs in seconds (what the tests run)")
    p.add_argument("--out", default="reports/bench-layers", help="folder for layers.json, layers.md, PNGs")
    p.add_argument("--ns", type=_int_list, help="sequence lengths, e.g. 32,128,512")
    p.add_argument("--ds", type=_int_list, help="model widths, e.g. 32,128,512")
    p.add_argument("--layers", type=lambda s: [v.strip() for v in s.split(",") if v.strip()],
                   help=f"subset of {','.join(LAYERS)}")
    p.add_argument("--batch", type=positive_int, help="batch size")
    p.add_argument("--window", type=nonneg_int, help="attention window w (keys on each side; r = 2w+1)")
    p.add_argument("--kernel", type=positive_int, help="convolution kernel size k (odd)")
    p.add_argument("--min-time", type=positive_float, help="seconds of repetitions per measurement")
    p.add_argument("--threads", type=positive_int, help="torch intra-op threads for the run (default: torch's)")
    p.add_argument("--no-memory", action="store_true", help="skip the memory measurements")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of tables")


def run(args: argparse.Namespace) -> dict:
    """Run the per-layer benchmark with the parsed options ``args`` and return the result dict.

    For every layer in --layers, d in --ds and n in --ns: :func:`measure` on x: [batch, n, d] (plus
    :func:`structure` at the small ``structure_ns``), then the fitted slopes and the attention/recurrence
    :func:`crossover`. Writes layers.json, layers.md, layers_time.png and layers_memory.png to ``args.out``
    and prints tables (or the JSON with --json). Torch's thread count is set for the run and restored.
    Raises ValueError for an unknown layer, an even kernel, or sizes whose [batch, n, n] attention
    scores would not fit in memory.
    """
    cfg = dict(QUICK if args.quick else FULL)
    for key in ("ns", "ds", "batch", "window", "kernel", "min_time", "threads"):
        if getattr(args, key, None) is not None:
            cfg[key] = getattr(args, key)
    cfg["layers"] = list(args.layers or LAYERS)
    bad = [name for name in cfg["layers"] if name not in LAYERS]
    if bad:
        raise ValueError(f"--layers: unknown {bad}; choose from {list(LAYERS)}")
    if cfg["batch"] < 1 or cfg["window"] < 0 or cfg["kernel"] < 1 or cfg["kernel"] % 2 == 0:
        raise ValueError(f"need batch >= 1, window >= 0 and an odd kernel >= 1; got batch={cfg['batch']}, "
                         f"window={cfg['window']}, kernel={cfg['kernel']}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    cfg["command"] = "attnlab bench layers" + (" --quick" if args.quick else "") + (
        f" --threads {args.threads}" if args.threads else "")
    n, d, b = max(cfg["ns"]), max(cfg["ds"]), cfg["batch"]
    # full self-attention keeps [B, n, n] scores and weights (and their gradients); the rest is O(B·n·d)
    check_memory(f"--ns {n} --ds {d} --batch {b}", 4 * b * n * n * 4 + 4 * b * n * d * 32,
                 "self-attention's [B, n, n] scores and the layers' activations at the largest size")
    out = output_dir(args.out)
    threads_before = torch.get_num_threads()
    if cfg["threads"]:
        torch.set_num_threads(cfg["threads"])
    try:
        return _run(args, cfg, out)
    finally:
        torch.set_num_threads(threads_before)


def _run(args: argparse.Namespace, cfg: dict, out: Path) -> dict:
    import json

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    console = Console(stderr=args.json)

    rows, struct = [], []
    grid = [(name, n, d) for d in cfg["ds"] for n in cfg["ns"] for name in cfg["layers"]]
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("structure", total=len(grid) + len(cfg["layers"]) * len(cfg["structure_ns"]))
        for name in cfg["layers"]:
            for n in cfg["structure_ns"]:
                struct.append(structure(name, n, window=cfg["window"], kernel=cfg["kernel"]))
                bar.advance(task)
        for name, n, d in grid:
            bar.update(task, description=f"{name} n={n} d={d}")
            rows.append(measure(name, n, d, batch=cfg["batch"], window=cfg["window"], kernel=cfg["kernel"],
                                min_time=cfg["min_time"], max_reps=cfg["max_reps"],
                                memory=not args.no_memory and (cfg["memory_at"] == "every n" or n == max(cfg["ns"]))))
            bar.advance(task)

    cross = []
    for attn in ("attention", "attention_fused", "attention+proj"):
        for rnn in ("gru", "lstm"):
            if attn in cfg["layers"] and rnn in cfg["layers"]:
                for key in ("forward_s", "forward_backward_s"):
                    cross += crossover(rows, attn, rnn, key)
    result = {"suite": "layers", "config": cfg, "environment": environment(), "paper": PAPER,
              "structure": struct, "rows": rows, "slopes": fitted_slopes(rows), "crossover": cross,
              "files": {}, "exit_code": 0}
    result["files"].update(_plots(result, out))
    result["files"]["json"] = str(out / "layers.json")
    result["files"]["markdown"] = str(out / "layers.md")
    atomic_write_text(out / "layers.md", markdown(result))
    atomic_write_json(out / "layers.json", result)

    if args.json:
        print(json.dumps(result, default=str))
        return result
    table = Table(title="per-layer forward time (ratio to GRU at the same n, d)")
    for col in ("layer", *(f"n={n}" for n in cfg["ns"])):
        table.add_column(col, justify="right" if col != "layer" else "left")
    d = cfg["ds"][-1]
    gru = {r["n"]: r["forward_s"] for r in rows if r["layer"] == "gru" and r["d"] == d}
    for name in cfg["layers"]:
        cells = []
        for n in cfg["ns"]:
            r = next(r for r in rows if r["layer"] == name and r["n"] == n and r["d"] == d)
            cells.append(_fmt_s(r["forward_s"]) + (f" ({r['forward_s'] / gru[n]:.2g}x)" if n in gru else ""))
        table.add_row(name, *cells)
    table.caption = f"d = {d}, batch {cfg['batch']}"
    console.print(table)
    ct = Table(title="crossover: self-attention cheaper than recurrence while n < n*")
    for col in ("attention", "recurrent", "timing", "d", "n*", "n*/d", "FLOP-model n*"):
        ct.add_column(col)
    for c in cross:
        ct.add_row(c["attention"], c["recurrent"], c["timing"], str(c["d"]),
                   "–" if c["n_star"] is None else f"{c['n_star']:.0f}",
                   "–" if c["n_star_over_d"] is None else f"{c['n_star_over_d']:.2g}",
                   "–" if c["flop_model_n_star"] is None else f"{c['flop_model_n_star']:.0f}")
    console.print(ct)
    console.print(f"report: {out / 'layers.md'}  json: {out / 'layers.json'}  plots: "
                  f"{result['files']['time_png']}, {result['files']['memory_png']}")
    return result
