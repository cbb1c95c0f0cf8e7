"""PNG heatmaps: attention weights per head, structured patterns (density, FLOPs saved), diagnostics.

All figures use matplotlib's Agg backend and are written atomically by ``attnlab.report.save_figure``.
"""
from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from ..report import save_figure  # noqa: E402
from ..patterns import block_codes, block_mask_stats

__all__ = ["plot_patch_sweep", "plot_heads", "plot_pattern", "plot_patterns", "plot_block_mask", "plot_diagnostics", "plot_head_stats",
           "pattern_cost"]


def _np(x) -> np.ndarray:
    return x.detach().double().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, dtype=np.float64)


def _tick_labels(ax, tokens, n_rows, n_cols, max_ticks=40, key_tokens=None):
    if tokens is None:
        return
    keys = tokens if key_tokens is None else key_tokens
    if n_cols <= max_ticks:
        ax.set_xticks(range(n_cols))
        ax.set_xticklabels(keys[:n_cols], rotation=90, fontsize=7)
    if n_rows <= max_ticks:
        ax.set_yticks(range(n_rows))
        ax.set_yticklabels(tokens[:n_rows], fontsize=7)


def plot_heads(weights, path, *, tokens=None, title: str = "attention weights", heads=None, cols: int = 4,
               key_tokens=None):
    """One heatmap per head. weights: [H, L, S] (or [L, S]); rows = queries (``tokens``), columns = keys
    (``key_tokens``, default ``tokens``). PNG, or SVG when ``path`` ends in .svg."""
    w = _np(weights)
    if w.ndim == 2:
        w = w[None]
    if w.ndim != 3:
        raise ValueError(f"weights must be [H, L, S] or [L, S], got shape {list(w.shape)}")
    heads = list(range(w.shape[0])) if heads is None else ([heads] if isinstance(heads, int) else list(heads))
    bad = [h for h in heads if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < w.shape[0]]
    if bad or not heads:
        raise ValueError(f"heads must name heads in 0..{w.shape[0] - 1}, got {heads!r}")
    n = len(heads)
    cols = min(cols, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 3.2 * rows), squeeze=False, layout="constrained")
    for ax in axes.flat:
        ax.axis("off")
    for ax, h in zip(axes.flat, heads):
        ax.axis("on")
        im = ax.imshow(w[h], cmap="viridis", vmin=0.0, vmax=max(1e-12, float(w[h].max())), aspect="auto",
                       interpolation="nearest")
        ax.set_title(f"head {h}", fontsize=9)
        _tick_labels(ax, tokens, w.shape[1], w.shape[2], key_tokens=key_tokens)
        ax.set_ylabel("query", fontsize=8)
        ax.set_xlabel("key", fontsize=8)
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    fig.suptitle(title)
    return save_figure(fig, path)


def plot_patch_sweep(result, path, *, title: str = "activation patching", metric: str = "metric",
                     baseline: float | None = None, tokens=None, layers=None, heads=None):
    """Heatmap of ``attnlab.capture.patch_sweep``'s result: [layers, heads] (one panel) or [layers, heads, L]
    (one panel per layer: heads × positions, labelled by ``tokens``). ``baseline`` (the unpatched metric) is
    subtracted when given, on a diverging colour scale centred on 0. PNG, or SVG when ``path`` ends in .svg."""
    r = _np(result)
    if r.ndim not in (2, 3):
        raise ValueError(f"result must be [layers, heads] or [layers, heads, L], got shape {list(r.shape)}")
    if baseline is not None:
        r = r - float(baseline)
    layers = list(range(r.shape[0])) if layers is None else list(layers)
    heads = list(range(r.shape[1])) if heads is None else list(heads)
    lim = max(1e-12, float(np.abs(r).max()))
    label = metric if baseline is None else f"{metric} − unpatched"
    cmap, vmin = ("RdBu_r", -lim) if baseline is not None or r.min() < 0 else ("viridis", float(r.min()))
    vmax = lim if cmap == "RdBu_r" else float(r.max())
    if r.ndim == 2:
        fig, ax = plt.subplots(figsize=(1.2 + 0.45 * r.shape[1], 1.2 + 0.4 * r.shape[0]), layout="constrained")
        im = ax.imshow(r, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto", interpolation="nearest")
        ax.set_xticks(range(len(heads)), [str(h) for h in heads], fontsize=7)
        ax.set_yticks(range(len(layers)), [str(li) for li in layers], fontsize=7)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        fig.colorbar(im, ax=ax, label=label)
    else:
        n = r.shape[0]
        fig, axes = plt.subplots(n, 1, figsize=(1.5 + 0.35 * r.shape[2], 0.6 + 0.3 * r.shape[1] * n), squeeze=False,
                                 layout="constrained")
        for a, ax in enumerate(axes[:, 0]):
            im = ax.imshow(r[a], cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto", interpolation="nearest")
            ax.set_yticks(range(len(heads)), [str(h) for h in heads], fontsize=7)
            ax.set_ylabel(f"layer {layers[a]}\nhead", fontsize=8)
            if tokens is not None and len(tokens) == r.shape[2]:
                ax.set_xticks(range(r.shape[2]), list(tokens), rotation=90, fontsize=7)
        axes[-1, 0].set_xlabel("query position")
        fig.colorbar(im, ax=axes[:, 0].tolist(), label=label)
    fig.suptitle(title)
    return save_figure(fig, path)


def pattern_cost(pattern, L: int, S: int | None = None, E: int = 64) -> dict:
    """Density of a pattern at L × S and the FLOPs it saves against dense attention (head dim E)."""
    S = L if S is None else S
    dense = 2 * L * S * (2 * E)
    flops = pattern.flops(L, S, E)
    return {"L": L, "S": S, "density": pattern.density(L, S), "flops": flops, "dense_flops": dense,
            "flops_saved": 1.0 - flops / dense if dense else 0.0}


def plot_pattern(pattern, L: int, path, *, S: int | None = None, E: int = 64, name: str | None = None):
    """Heatmap of a pattern's mask at L × S, titled with its density and FLOPs saved."""
    return plot_patterns({name or repr(pattern): pattern}, L, path, S=S, E=E)


def plot_patterns(patterns: dict, L: int, path, *, S: int | None = None, E: int = 64, cols: int = 4):
    """Several patterns side by side (name -> Pattern)."""
    S = L if S is None else S
    n = len(patterns)
    if n == 0:
        raise ValueError("patterns is empty")
    cols = min(cols, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.6 * rows), squeeze=False, layout="constrained")
    for ax in axes.flat:
        ax.axis("off")
    for ax, (name, p) in zip(axes.flat, patterns.items()):
        ax.axis("on")
        m = p.materialize(L, S)
        m = m.reshape(-1, L, S)[0] if m.dim() > 2 else m
        c = pattern_cost(p, L, S, E)
        ax.imshow(m.numpy(), cmap="Greys", vmin=0, vmax=1, interpolation="nearest", aspect="auto")
        ax.set_title(f"{name}\ndensity {c['density']:.1%}, saves {c['flops_saved']:.0%} FLOPs", fontsize=8)
        ax.set_xlabel("key j", fontsize=7)
        ax.set_ylabel("query i", fontsize=7)
    fig.suptitle(f"attention patterns at L={L} (black = takes part)")
    return save_figure(fig, path)


def plot_diagnostics(sweep, path, *, title: str = "score scale vs d_k"):
    """Plots of ``attnlab.diagnostics.scale_sweep`` rows: score variance, max weight, entropy and the
    gradient norm reaching the scores, against d_k, one line per scale."""
    rows = list(sweep)
    if not rows:
        raise ValueError("sweep is empty")
    scales = sorted({r.scale for r in rows}, key=["none", "sqrt", "dk"].index)
    fig, axes = plt.subplots(1, 5, figsize=(20, 3.8), layout="constrained")
    panels = (("score_var", "variance of scaled scores", True), ("mean_max_weight", "mean max weight", False),
              ("mean_entropy", "mean entropy (nats)", False), ("mean_jacobian_norm", "softmax Jacobian norm", False),
              ("mean_grad_norm", "gradient norm at scores", False))
    for ax, (attr, label, logy) in zip(axes, panels):
        for s in scales:
            pts = [(r.d_k, getattr(r, attr)) for r in rows if r.scale == s]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"scale={s}")
        ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel("d_k")
        ax.set_title(label, fontsize=10)
    axes[2].plot([r.d_k for r in rows if r.scale == scales[0]], [r.max_entropy for r in rows if r.scale == scales[0]],
                 "k:", label="uniform (log S)")
    axes[0].legend(fontsize=8)
    axes[2].legend(fontsize=8)
    fig.suptitle(title)
    return save_figure(fig, path)


def plot_head_stats(stats: list[dict], path, *, num_layers: int, num_heads: int,
                    measures=("prev", "same", "next", "cls", "sep", "mean_distance", "entropy"),
                    title: str | None = None):
    """Layers × heads grids: first each head's label (one colour per label, full names in a legend below
    the grid), then one heatmap per measure."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    labels = sorted({s["label"] for s in stats})
    palette = ["#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00", "#CC79A7", "#999999",
               "#882255", "#44AA99", "#332288", "#999933"]
    n = len(measures) + 1
    cols = min(3, n)  # three across: the picture keeps readable text when a page shows it 900 px wide
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False, layout="constrained")
    # a tick every 1, 2, 5, ... so at most 12 numbers per axis (30 layers of a decoder stay legible)
    step = lambda k: next(s for s in (1, 2, 5, 10, 20, 50, 100, 10**9) if k / s <= 12)  # noqa: E731
    yt, xt = range(0, num_layers, step(num_layers)), range(0, num_heads, step(num_heads))
    for ax in axes.flat:
        ax.axis("off")
    ax0 = axes.flat[0]
    ax0.axis("on")
    cat = np.zeros((num_layers, num_heads))
    for s in stats:
        cat[s["layer"], s["head"]] = labels.index(s["label"])
    cmap = ListedColormap([palette[i % len(palette)] for i in range(len(labels))])
    ax0.imshow(cat, cmap=cmap, vmin=-0.5, vmax=len(labels) - 0.5, aspect="auto", interpolation="nearest")
    ax0.set_title("label of each head", fontsize=11)
    ax0.set_xlabel("head", fontsize=10)
    ax0.set_ylabel("layer", fontsize=10)
    ax0.set_xticks(xt)
    ax0.set_yticks(yt)
    ax0.tick_params(labelsize=9)
    ax0.legend(handles=[Patch(color=palette[i % len(palette)], label=lab) for i, lab in enumerate(labels)],
               loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, fontsize=9, frameon=False)
    for ax, meas in zip(list(axes.flat)[1:], measures):
        ax.axis("on")
        grid = np.zeros((num_layers, num_heads))
        for s in stats:
            grid[s["layer"], s["head"]] = s[meas]
        im = ax.imshow(grid, cmap="magma", aspect="auto", interpolation="nearest")
        ax.set_title({"sink": "first token (sink)"}.get(meas, meas.replace("_", " ")), fontsize=11)
        ax.set_xlabel("head", fontsize=10)
        ax.set_ylabel("layer", fontsize=10)
        ax.set_xticks(xt)
        ax.set_yticks(yt)
        ax.tick_params(labelsize=9)
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04).ax.tick_params(labelsize=9)
    fig.suptitle(title or "what MiniLM's heads do: labels, and the mean attention of a token to prev/same/next/[CLS]/[SEP]")
    return save_figure(fig, Path(path))


def plot_block_mask(block_mask, path, *, E: int = 64, max_heads: int = 8, title: str | None = None):
    """A block mask per (b, h): each block FULL (black), PARTIAL (grey) or EMPTY (white), titled with its
    counts and the FLOPs it skips at head dim E; (b, h) with the same blocks share one panel.

    ``block_mask``: a torch ``BlockMask`` or an ``attnlab.patterns.BlockMaskPattern``. Rows are query blocks,
    columns key blocks (``patterns.block_mask_text`` is the same picture as text)."""

    codes = block_codes(block_mask)  # (Bm, Hm, nq, nk)
    stats = block_mask_stats(block_mask, E=E)
    panels, seen = [], {}
    for st in stats:
        c = codes[st["b"], st["h"]]
        key = c.numpy().tobytes()
        if key in seen:
            seen[key]["also"].append((st["b"], st["h"]))
            continue
        seen[key] = dict(st, codes=c, also=[])
        panels.append(seen[key])
    shown = panels[:max_heads]
    cols = min(4, len(shown))
    rows = math.ceil(len(shown) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 3.7 * rows), squeeze=False, layout="constrained")
    for ax in axes.flat:
        ax.axis("off")
    cmap = matplotlib.colors.ListedColormap(["white", "0.6", "black"])
    for ax, p in zip(axes.flat, shown):
        ax.axis("on")
        ax.imshow(p["codes"].numpy(), cmap=cmap, vmin=0, vmax=2, interpolation="nearest", aspect="auto")
        who = f"b={p['b']}, h={p['h']}" + (f" (+{len(p['also'])} alike)" if p["also"] else "")
        ax.set_title(f"{who}\n{p['full']} full, {p['partial']} partial, {p['empty']} empty\n"
                     f"skips {p['fraction_skipped']:.0%} of pairs ({p['flops_skipped']:.3g} FLOPs)", fontsize=8)
        ax.set_xlabel("key block", fontsize=7)
        ax.set_ylabel("query block", fontsize=7)
    more = f" ({len(panels) - len(shown)} more layouts not shown)" if len(panels) > len(shown) else ""
    fig.suptitle((title or "block mask") + f": black full, grey partial, white empty{more}", fontsize=9)
    return save_figure(fig, path)
