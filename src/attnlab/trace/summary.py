"""Trace sizes too big to print: per-step shapes, FLOPs, bytes and statistics instead of matrices.

Legend: B batch, H heads, L sequence length, D = d_model, E = D / H (d_k = d_v).
Statistics come from one seeded draw at the real size: X ~ N(0, 1), W ~ N(0, 1/D) (so Q, K entries
have variance ≈ 1, the tutorial's assumption). When L is large, score/weight statistics use
``sample_rows`` query rows against *all* keys (so each sampled row's softmax is exact).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .. import diagnostics as dg
from ..files import format_bytes  # the table's units (trace/render.py), so the note and the table agree
from ..resources import check_memory
from .core import Step, Trace, TraceOptions

__all__ = ["trace_summary"]

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _tstats(x: torch.Tensor) -> dict:
    f = x[torch.isfinite(x)].double()
    if f.numel() == 0:
        return {}
    return {"mean": float(f.mean()), "var": float(f.var(unbiased=False)), "min": float(f.min()), "max": float(f.max())}


def trace_summary(d_model: int = 768, seq_len: int = 512, num_heads: int = 12, *, batch: int = 1,
                  dtype: str = "float32", seed: int = 0, options: TraceOptions = TraceOptions(),
                  sample_rows: int = 512, max_stats_len: int = 65536) -> Trace:
    """Shapes, FLOPs and bytes of every step at this size, with statistics measured on a seeded draw."""
    for name, val in (("d_model", d_model), ("seq_len", seq_len), ("heads", num_heads), ("batch", batch)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    if d_model % num_heads:
        raise ValueError(f"d_model={d_model} is not divisible by heads={num_heads} (d_k = d_model / heads)")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    B, L, D, H = batch, seq_len, d_model, num_heads
    E = D // H
    isz = torch.empty((), dtype=_DTYPES[dtype]).element_size()
    factor = dg.scale_value(options.scale, E)

    # -- statistics on one seeded draw (batch element 0) -----------------------------------------
    stats: dict[str, dict] = {}
    sampled = None
    if L <= max_stats_len:
        cd = torch.float64 if L * D <= 2**20 else torch.float32
        r = max(16, min(sample_rows, 2**25 // (H * L)))
        # the draw: X, Q, K, V [L, D] and four [D, D] weights in cd, the sampled [H, r, L] scores (in cd,
        # scaled, masked) and weights (float64), checked before anything is allocated
        need = (4 * D * D + 4 * L * D + 3 * H * r * L) * (8 if cd == torch.float64 else 4) + 2 * 8 * H * r * L
        check_memory(f"d_model={D}, seq_len={L}, heads={H}", need, "the seeded draw the statistics are measured on")
        g = torch.Generator().manual_seed(seed)
        X = torch.randn(L, D, generator=g, dtype=cd)
        W = {n: torch.randn(D, D, generator=g, dtype=cd) / math.sqrt(D) for n in ("W_Q", "W_K", "W_V", "W_O")}
        # r keeps the sampled [H, rows, L] score block under ~2^25 entries (a few hundred MiB at most)
        rows = torch.arange(L) if L <= r else torch.randperm(L, generator=g)[:r].sort().values
        sampled = None if L <= r else int(rows.numel())
        q = (X[rows] @ W["W_Q"]).reshape(-1, H, E).transpose(0, 1)  # (H, r, E)
        k = (X @ W["W_K"]).reshape(L, H, E).transpose(0, 1)  # (H, L, E)
        v = (X @ W["W_V"]).reshape(L, H, E).transpose(0, 1)  # (H, L, E)
        stats["X"] = _tstats(X)
        stats["Q"], stats["K"], stats["V"] = _tstats(q), _tstats(k), _tstats(v)
        if options.cosine:
            s = torch.nn.functional.normalize(q, dim=-1) @ torch.nn.functional.normalize(k, dim=-1).transpose(-1, -2)
        else:
            s = q @ k.transpose(-1, -2)  # (H, r, L)
        stats["scores"] = _tstats(s)
        s = s * factor
        stats["scaled"] = _tstats(s)
        if options.causal:
            keep = torch.arange(L).unsqueeze(0) <= rows.unsqueeze(1)  # (r, L)
            s = s.masked_fill(~keep, float("-inf"))
        stats["masked"] = _tstats(s)
        if options.softmax:
            w = torch.softmax(s.double(), dim=-1)
            ws = dg.weight_stats(w)
            stats["weights"] = {**_tstats(w), "mean_entropy": ws["mean_entropy"], "max_entropy": ws["max_entropy"],
                                "mean_max_weight": ws["mean_max_weight"], "saturated_fraction": ws["saturated_fraction"],
                                "mean_jacobian_norm": ws["mean_jacobian_norm"]}
        else:
            w = torch.where(torch.isfinite(s), s, torch.zeros_like(s)).double()
            ws = dg.weight_stats(w)
            stats["weights"] = {**_tstats(w), "row_sum_min": ws["row_sum_min"], "row_sum_max": ws["row_sum_max"],
                                "negative_fraction": ws["negative_fraction"]}
        o = w.to(v.dtype) @ v  # (H, r, E)
        stats["output"] = _tstats(o)
        concat = o.transpose(0, 1).reshape(-1, D)  # (r, D)
        stats["concat"] = _tstats(concat)
        stats["projected"] = _tstats(concat @ W["W_O"])

    # -- shapes, FLOPs, bytes ----------------------------------------------------------------------
    def st(name, title, formula, shape, flops, note=""):
        return Step(name, title, formula, None, tuple(shape), flops=int(flops),
                    bytes=int(np.prod(shape)) * isz, stats=stats.get(name, {}), note=note)

    pairs = B * H * L * L
    steps = [
        st("X", "input rows", "X", (B, L, D), 0),
        st("W_Q", "projection W_Q", "[D, H·E]", (D, D), 0),
        st("W_K", "projection W_K", "[D, H·E]", (D, D), 0),
        st("W_V", "projection W_V", "[D, H·E]", (D, D), 0),
        st("Q", "1) project to Q", "Q = X W_Q", (B, H, L, E), 2 * B * L * D * D),
        st("K", "1) project to K", "K = X W_K", (B, H, L, E), 2 * B * L * D * D),
        st("V", "1) project to V", "V = X W_V", (B, H, L, E), 2 * B * L * D * D),
        st("scores", "2) similarity scores", "cos(q, k)" if options.cosine else "Q Kᵀ", (B, H, L, L), 2 * pairs * E,
           note=f"theory: Var(q·k) = d_k = {E} for unit-variance q, k" if not options.cosine else ""),
        st("scaled", "3) scale", {"sqrt": f"÷ √{E}", "dk": f"÷ {E}", "none": "÷ 1"}[options.scale], (B, H, L, L), pairs),
        st("masked", "4) mask", "causal" if options.causal else "no mask", (B, H, L, L),
           pairs if options.causal else 0),
        st("weights", "5) softmax" if options.softmax else "5) no softmax", "softmax over keys" if options.softmax
           else "weights = scores", (B, H, L, L), 5 * pairs if options.softmax else 0),
        st("output", "6) aggregate values", "weights · V", (B, H, L, E), 2 * pairs * E),
        st("concat", f"7) concatenate {H} heads", "[head_1 | … | head_H]", (B, L, D), 0),
        st("W_O", "output projection W_O", "[H·E, D]", (D, D), 0),
        st("projected", "8) project back", "concat · W_O", (B, L, D), 2 * B * L * D * D),
    ]
    t = Trace("summary", options, steps, None, None, H, E)
    total = sum(s.flops for s in steps)
    attn = sum(s.flops for s in steps if s.name in ("scores", "output"))
    t.meta.update({"batch": B, "seq_len": L, "d_model": D, "heads": H, "d_k": E, "dtype": dtype, "seed": seed,
                   "total_flops": total, "attention_matmul_flops": attn,
                   "score_matrix_bytes_per_layer": pairs * isz, "stats_rows_sampled": sampled})
    t.notes.append(f"Q Kᵀ and weights·V cost {attn / total:.0%} of this layer's FLOPs at L={L}; the [B, H, L, L] "
                   f"score tensor holds {format_bytes(pairs * isz, digits=4)} in {dtype}")
    if sampled:
        t.notes.append(f"statistics of scores and weights from {sampled} sampled query rows against all {L} keys")
    if L > max_stats_len:
        t.notes.append(f"statistics skipped above seq_len={max_stats_len}; shapes, FLOPs and bytes are exact")
    return t
