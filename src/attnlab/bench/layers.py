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

import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from .. import patterns
from ..functional import attention, explain
from ..harness import markdown_table, pyplot, save_plot, threads
from ..resources import check_memory
from ..report import atomic_write_json, atomic_write_text, environment, format_bytes
from .all_report import format_seconds
from .fit import fit_exponent

__all__ = ["LAYERS", "PAPER", "LayersConfig", "LayersResult", "make_layer", "flops", "structure", "measure",
           "crossover", "fitted_slopes", "markdown", "run"]

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


def fitted_slopes(rows: list[dict], key: str = "forward_s") -> dict:
    """Log-log slopes of time vs n (at the largest d, upper half of n) and vs d (at the largest n)."""
    out = {}
    for name in sorted({r["layer"] for r in rows}, key=LAYERS.index):
        mine = [r for r in rows if r["layer"] == name]
        d_max, n_max = max(r["d"] for r in mine), max(r["n"] for r in mine)
        by_n = sorted((r["n"], r[key]) for r in mine if r["d"] == d_max)
        by_n = by_n[len(by_n) // 2 - (len(by_n) % 2 == 0):] if len(by_n) > 2 else by_n
        by_d = sorted((r["d"], r[key]) for r in mine if r["n"] == n_max)
        out[name] = {"n_slope": fit_exponent([a for a, _ in by_n], [b for _, b in by_n]), "at_d": d_max,
                     "d_slope": fit_exponent([a for a, _ in by_d], [b for _, b in by_d]), "at_n": n_max,
                     "paper": PAPER_EXPONENTS[name]}
    return out


# -- 4) report --------------------------------------------------------------------------------------------------
def markdown(result: "LayersResult") -> str:
    """The layers.md report of a :func:`run` result: the paper's Table 1 beside the derived structure,
    measured times and memory, fitted exponents and the attention/recurrence crossover."""
    cfg = result.config
    env = result.environment
    lines = [
        "# Self-attention vs recurrence vs convolution, per layer (Vaswani et al. 2017, Table 1)", "",
        f"Measured by `{cfg['command']}` on {env['cpu']} ({env['threads']} thread{'s' if env['threads'] != 1 else ''}, torch {env['torch']}). "
        f"Batch {cfg['batch']}, window w = {cfg['window']} each side (r = {2 * cfg['window'] + 1} keys), "
        f"kernel k = {cfg['kernel']}, float32. Times are the best of {cfg['max_reps']} repetitions at most (medians in "
        f"the JSON); only ratios within this run mean anything.", "",
        "## Structure (derived) beside the paper's Table 1", "",
    ]
    rows = []
    for name in cfg["layers"]:
        cells = []
        for n in cfg["structure_ns"]:
            s = next(s for s in result.structure if s["layer"] == name and s["n"] == n)
            cells.append(f"{s['sequential_ops']} / {s['max_path_length']}")
        rows.append([name, *PAPER[name], *cells])
    lines.append(markdown_table(["layer", "paper: complexity per layer", "paper: sequential ops",
                                 "paper: max path length",
                                 *(f"derived at n={n}: seq ops / path" for n in cfg["structure_ns"])], rows))
    lines += ["", "## Measured time and memory", ""]
    gru = {(r["n"], r["d"]): r["forward_s"] for r in result.rows if r["layer"] == "gru"}
    rows = []
    for r in sorted(result.rows, key=lambda r: (r["d"], r["n"], LAYERS.index(r["layer"]))):
        ratio = f"{r['forward_s'] / gru[(r['n'], r['d'])]:.3g}" if (r["n"], r["d"]) in gru else "–"
        rows.append([r["layer"], r["n"], r["d"], format_seconds(r["forward_s"]),
                     format_seconds(r["forward_backward_s"]), ratio,
                     f"{r['flops'] / r['forward_s'] / 1e9:.3g}", format_bytes(r.get("forward_peak_bytes")),
                     format_bytes(r.get("saved_bytes")), r.get("method", "–")])
    lines.append(markdown_table(["layer", "n", "d", "forward", "fwd+bwd", "fwd / GRU fwd", "fwd GFLOP/s", "forward peak",
                                 "saved for bwd", "method"], rows))
    lines += ["", "## Fitted log-log exponents of forward time (paper's exponents in brackets)", ""]
    rows = []
    for name, s in result.slopes.items():
        fa = "–" if s["n_slope"] is None else f"{s['n_slope']:.2f}"
        fb = "–" if s["d_slope"] is None else f"{s['d_slope']:.2f}"
        rows.append([name, f"{fa} [{s['paper'][0]}] (d={s['at_d']})", f"{fb} [{s['paper'][1]}] (n={s['at_n']})"])
    lines.append(markdown_table(["layer", "time ∝ n^a (at largest d, upper half of n)", "time ∝ d^b (at largest n)"],
                                rows))
    lines += ["", "## Where \"self-attention is cheaper than recurrence when n < d\" lands here", "",
              "The paper's argument counts operations: n²·d for attention against n·d² for a recurrent layer, so "
              "attention wins while n < d. With the constants of a GRU (12·n·d² FLOPs) and attention's two "
              "products (4·n²·d) the FLOP model crosses at n = 3d; with the W_Q, W_K, W_V, W_O projections "
              "(+8·n·d²) at n = d. Measured crossings (forward time, then forward+backward):", "",
              ""]
    rows = [[c["attention"], c["recurrent"], c["timing"], c["d"],
             "–" if c["n_star"] is None else f"{c['n_star']:.0f}",
             "–" if c["n_star_over_d"] is None else f"{c['n_star_over_d']:.2g}",
             "–" if c["flop_model_n_star"] is None else f"{c['flop_model_n_star']:.0f}", c["verdict"]]
            for c in result.crossover]
    lines.append(markdown_table(["attention", "recurrent", "timing", "d", "measured n*", "n*/d", "FLOP-model n*",
                                 "verdict"], rows))
    lines += ["", "Files: " + ", ".join(f"`{Path(p).name}`" for p in result.files.values()), ""]
    return "\n".join(lines)


def _plots(result: "LayersResult", out: Path) -> dict:
    plt = pyplot()

    rows, files = result.rows, {}
    ds = sorted({r["d"] for r in rows})
    fig, axes = plt.subplots(2, len(ds), figsize=(4.4 * len(ds), 7.5), squeeze=False, layout="constrained")
    for col, d in enumerate(ds):
        for row, key in enumerate(("forward_s", "forward_backward_s")):
            ax = axes[row][col]
            for name in result.config["layers"]:
                pts = sorted((r["n"], r[key]) for r in rows if r["layer"] == name and r["d"] == d)
                if pts:
                    ax.loglog([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
            ax.axvline(d, color="grey", ls=":", lw=1)
            ax.set_title(f"d={d}, {'forward' if row == 0 else 'forward+backward'}")
            ax.set_xlabel("n (dotted: n = d)")
            ax.set_ylabel("seconds")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Per-layer time vs sequence length (log-log)")
    files["time_png"] = str(save_plot(fig, out / "layers_time.png"))

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), layout="constrained")
    d = ds[-1]
    for ax, key, title in ((axes[0], "forward_peak_bytes", "forward peak"),
                           (axes[1], "saved_bytes", "saved for backward")):
        for name in result.config["layers"]:
            pts = sorted((r["n"], r[key]) for r in rows if r["layer"] == name and r["d"] == d and r.get(key))
            if pts:
                ax.loglog([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set_title(f"{title}, d={d}")
        ax.set_xlabel("n")
        ax.set_ylabel("bytes")
    if axes[0].get_legend_handles_labels()[0]:  # --no-memory: nothing measured, an empty figure says so
        axes[0].legend(fontsize=7)
    files["memory_png"] = str(save_plot(fig, out / "layers_memory.png"))
    return files


# -- 5) the run -------------------------------------------------------------------------------------------------
# quick runs on one thread: toy sizes gain nothing from more, and on a busy machine a second thread that
# is descheduled stalls every parallel region
QUICK = {"ns": [8, 16, 32], "ds": [8, 16], "batch": 1, "window": 2, "kernel": 3, "min_time": 0.0, "max_reps": 3,
         "structure_ns": [8, 16], "threads": 1, "memory_at": "largest n"}
FULL = {"ns": [16, 32, 64, 128, 256, 512, 1024, 2048], "ds": [16, 64, 256], "batch": 1, "window": 16,
        "kernel": 3, "min_time": 0.1, "max_reps": 10, "structure_ns": [32, 64], "threads": None,
        "memory_at": "every n"}


@dataclass
class LayersConfig:
    """What ``bench layers`` measures. A setting left None takes ``QUICK``'s value when ``quick``, else
    ``FULL``'s: lengths ``ns``, widths ``ds``, x: [batch, n, d]; ``window`` keys each side of
    attention_window, an odd conv ``kernel``; ``min_time`` seconds of repetitions per measurement;
    ``threads`` torch threads for the run. ``memory``: measure forward peak and saved bytes."""
    out: str = "reports/bench-layers"
    quick: bool = False
    ns: list[int] | None = None
    ds: list[int] | None = None
    layers: list[str] | None = None
    batch: int | None = None
    window: int | None = None
    kernel: int | None = None
    min_time: float | None = None
    threads: int | None = None
    memory: bool = True
    command: str = "attnlab bench layers"  # how the report says it was measured

    def resolved(self) -> dict:
        """Every setting with the defaults filled in; ValueError naming the option for a bad one."""
        cfg = dict(QUICK if self.quick else FULL)
        for key in ("ns", "ds", "batch", "window", "kernel", "min_time", "threads"):
            if getattr(self, key) is not None:
                cfg[key] = getattr(self, key)
        cfg["ns"], cfg["ds"] = sorted(set(cfg["ns"])), sorted(set(cfg["ds"]))
        for key in ("ns", "ds"):
            if not cfg[key] or any(v < 1 for v in cfg[key]):
                raise ValueError(f"--{key}: expected positive integers, got {cfg[key]}")
        cfg["layers"] = list(self.layers or LAYERS)
        bad = [name for name in cfg["layers"] if name not in LAYERS]
        if bad:
            raise ValueError(f"--layers: unknown {bad}; choose from {list(LAYERS)}")
        if cfg["batch"] < 1 or cfg["window"] < 0 or cfg["kernel"] < 1 or cfg["kernel"] % 2 == 0:
            raise ValueError(f"need batch >= 1, window >= 0 and an odd kernel >= 1; got batch={cfg['batch']}, "
                             f"window={cfg['window']}, kernel={cfg['kernel']}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")
        cfg["command"] = self.command
        return cfg


@dataclass
class LayersResult:
    """Everything one ``bench layers`` run measured (as written to layers.json): the resolved config, the
    environment, the paper's Table 1, the derived ``structure`` per (layer, n), one row per (layer, n, d)
    from :func:`measure`, the fitted ``slopes``, the attention/recurrence ``crossover`` and the files."""
    config: dict
    environment: dict
    paper: dict = field(default_factory=lambda: dict(PAPER))
    structure: list[dict] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)
    slopes: dict = field(default_factory=dict)
    crossover: list[dict] = field(default_factory=list)
    files: dict = field(default_factory=dict)
    out_dir: str = ""
    suite: str = "layers"
    exit_code: int = 0

    def write(self) -> dict:
        """Write layers_time.png, layers_memory.png, layers.md and layers.json into ``out_dir``,
        atomically; returns the files by kind (also kept in ``files``)."""
        out = Path(self.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.files.update(_plots(self, out))
        self.files["json"] = str(out / "layers.json")
        self.files["markdown"] = str(out / "layers.md")
        atomic_write_text(out / "layers.md", markdown(self))
        atomic_write_json(out / "layers.json", asdict(self))
        return self.files


def run(config: LayersConfig, *, progress: Callable[[int, int, str], None] | None = None) -> LayersResult:
    """Measure every layer on the grid, derive the structure and the crossover, write the report.

    For every layer in ``layers``, d in ``ds`` and n in ``ns``: :func:`measure` on x: [batch, n, d] (plus
    :func:`structure` at the small ``structure_ns``), then the fitted slopes and the attention/recurrence
    :func:`crossover`. Writes layers.json, layers.md, layers_time.png and layers_memory.png to ``out``.
    ``progress(done, total, label)`` is called before each step. Torch's thread count is set for the run
    and restored. Raises ValueError for an unknown layer, an even kernel, or sizes whose [batch, n, n]
    attention scores would not fit in memory.
    """
    cfg = config.resolved()
    n, d, b = max(cfg["ns"]), max(cfg["ds"]), cfg["batch"]
    # full self-attention keeps [B, n, n] scores and weights (and their gradients); the rest is O(B·n·d)
    check_memory(f"--ns {n} --ds {d} --batch {b}", 4 * b * n * n * 4 + 4 * b * n * d * 32,
                 "self-attention's [B, n, n] scores and the layers' activations at the largest size")
    with threads(cfg["threads"]):
        return _run(config, cfg, Path(config.out), progress)


def _run(config: LayersConfig, cfg: dict, out: Path, progress) -> LayersResult:
    rows, struct = [], []
    grid = [(name, n, d) for d in cfg["ds"] for n in cfg["ns"] for name in cfg["layers"]]
    total, done = len(grid) + len(cfg["layers"]) * len(cfg["structure_ns"]), 0
    for name in cfg["layers"]:
        for n in cfg["structure_ns"]:
            if progress:
                progress(done, total, f"structure {name} n={n}")
            struct.append(structure(name, n, window=cfg["window"], kernel=cfg["kernel"]))
            done += 1
    for name, n, d in grid:
        if progress:
            progress(done, total, f"{name} n={n} d={d}")
        rows.append(measure(name, n, d, batch=cfg["batch"], window=cfg["window"], kernel=cfg["kernel"],
                            min_time=cfg["min_time"], max_reps=cfg["max_reps"],
                            memory=config.memory and (cfg["memory_at"] == "every n" or n == max(cfg["ns"]))))
        done += 1

    cross = []
    for attn in ("attention", "attention_fused", "attention+proj"):
        for rnn in ("gru", "lstm"):
            if attn in cfg["layers"] and rnn in cfg["layers"]:
                for key in ("forward_s", "forward_backward_s"):
                    cross += crossover(rows, attn, rnn, key)
    result = LayersResult(config=cfg, environment=environment(), structure=struct, rows=rows,
                          slopes=fitted_slopes(rows), crossover=cross, out_dir=str(out))
    result.write()
    if progress:
        progress(total, total, "done")
    return result
