"""The implementations the core benchmark compares, built from a JSON-able spec (shared with _child)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

import attnlab
from attnlab import patterns as P

__all__ = ["make_inputs", "build_call", "make_pattern", "naive_attention", "pattern_density", "peak_in_fresh_process"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def naive_attention(q, k, v, attn_mask=None, is_causal=False):
    """softmax(Q Kᵀ/√E + mask) V with separate tensor ops: the textbook O(n²)-memory baseline.

    q: [B, H, L, E], k: [B, H, S, E], v: [B, H, S, Ev] -> [B, H, L, Ev]. ``attn_mask``: bool, broadcastable
    to [B, H, L, S], True = takes part; ``is_causal`` masks keys after the query (top-left aligned).
    Materialises the [B, H, L, S] scores and weights.
    """
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, L, S)
    if is_causal:
        s = s.masked_fill(torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).triu(1), float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def make_pattern(spec: dict | None):
    """{"name": "sliding_window", "window": 256, "causal": true} -> a Pattern (None passes through)."""
    if not spec:
        return None
    spec = dict(spec)
    name = spec.pop("name")
    if name == "block_sparse":
        n, bs, keep = spec["n"], spec["block_size"], spec.get("keep", 0.1)
        nb = -(-n // bs)
        g = torch.Generator().manual_seed(spec.get("seed", 0))
        layout = (torch.rand(nb, nb, generator=g) < keep) | torch.eye(nb, dtype=torch.bool)
        return P.block_sparse(layout, bs)
    return getattr(P, name)(**spec)


def pattern_density(spec: dict | None, n: int) -> float:
    """Fraction of the n x n score matrix the pattern ``spec`` keeps (1.0 for no pattern).

    Exact for n <= 8192 and for patterns that count their entries in O(n) (bands, block tables); above
    that, the fraction of non-empty 128 x 128 blocks, an upper bound that avoids O(n²) work.
    """
    if spec and spec.get("name") == "block_sparse":
        spec = dict(spec, n=n)
    p = make_pattern(spec)
    if p is None:
        return 1.0
    if n <= 8192 or type(p).nnz is not P.Pattern.nnz:  # bands and block tables count in O(n)
        return p.density(n, n)
    # elsewhere the exact count is O(n²) work: the fraction of non-empty 128-blocks (an upper bound)
    return float((p.block_layout(n, n, 128, 128) != P.EMPTY).float().mean())


def make_inputs(spec: dict):
    """Seeded random query, key, value, each [B, H, n, D] (defaults B=1, H=8, D=64) in ``spec["dtype"]``.

    Reads ``n`` and optionally ``B``, ``H``, ``D``, ``dtype`` (default "float32"), ``seed`` (default 0) and
    ``backward`` (then each tensor requires grad). Returns the list ``[query, key, value]``.
    """
    dtype = DTYPES[spec.get("dtype", "float32")]
    g = torch.Generator().manual_seed(spec.get("seed", 0))
    shape = (spec.get("B", 1), spec.get("H", 8), spec["n"], spec.get("D", 64))
    qkv = [torch.randn(shape, generator=g).to(dtype) for _ in range(3)]
    if spec.get("backward"):
        for t in qkv:
            t.requires_grad_(True)
    return qkv


def build_call(spec: dict):
    """A callable ``f(query, key, value) -> [B, H, n, D]`` for the implementation ``spec["impl"]``.

    ``impl`` is "sdpa" (``F.scaled_dot_product_attention``, dense or causal: the pattern is ignored, it is
    the baseline a user would run without attnlab), "naive" (:func:`naive_attention` with the pattern
    materialised to an [n, n] mask), or "auto", "tiled", "sparse", "dense" (``attnlab.attention`` with
    that ``method``, the pattern and ``spec.get("block_size")``). ``causal`` applies to all, ``pattern``
    (a :func:`make_pattern` spec) to all but sdpa. An unknown ``impl`` raises KeyError.
    """
    impl, causal = spec["impl"], bool(spec.get("causal", False))
    pat_spec = spec.get("pattern")
    if pat_spec and pat_spec.get("name") == "block_sparse":
        pat_spec = dict(pat_spec, n=spec["n"])
    pattern = make_pattern(pat_spec)
    if impl == "sdpa":
        # the baseline for a pattern is SDPA's dense (or causal) attention: what a user runs without attnlab
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if impl == "naive":
        mask = pattern.materialize(spec["n"], spec["n"]) if pattern is not None else None
        return lambda q, k, v: naive_attention(q, k, v, attn_mask=mask, is_causal=causal)
    method = {"auto": "auto", "tiled": "tiled", "sparse": "sparse", "dense": "dense"}[impl]
    bs = spec.get("block_size")
    return lambda q, k, v: attnlab.attention(q, k, v, is_causal=causal, pattern=pattern, method=method,
                                             block_size=bs)



def peak_in_fresh_process(spec: dict, timeout: float = 600) -> dict:
    """{"peak_bytes", "baseline_bytes"}: the extra peak resident bytes of one attention call (forward, or
    forward + backward with ``spec["backward"]``) measured by attnlab.bench._child in a fresh process
    with this process's torch threads. spec: a :func:`build_call` spec, or a bench kernels implementation
    name as ``impl``. RuntimeError with the child's last stderr line when it fails."""
    env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()))
    r = subprocess.run([sys.executable, "-m", "attnlab.bench._child", json.dumps(spec)], capture_output=True,
                       text=True, timeout=timeout, env=env)
    if r.returncode != 0:
        raise RuntimeError((r.stderr.strip().splitlines() or [f"memory child failed for {spec}"])[-1][:300])
    return json.loads(r.stdout.strip().splitlines()[-1])
