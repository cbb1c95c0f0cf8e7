"""The half-type grid: bf16 and fp16 forward + backward of the compiled kernel against float64, over small shapes
and small blocks, on one GEMM back end per process.

The grid is dtype (bf16, fp16) × L, S in ``LENGTHS`` × E in ``HEAD_DIMS`` × block in ``BLOCKS`` × mask (none,
causal, float bias). Small shapes and blocks of 16-48 are where the AMX tile state went wrong (csrc Note [AMX
tile state]): a crash there is a SIGILL, so ``run_isolated`` runs each back end in its own process and names the
back end and the last case started when one dies.

Budget (PyTorch's rule for fused kernels): each of out, dq, dk, dv may differ from the float64 autograd result by
``FACTOR`` times the error of the naive computation in the same dtype (every op in bf16 / fp16, softmax in fp32)
plus a floor; the gradients get ``GRAD_FACTOR`` (a fused backward recomputes the weights from the log-sum-exp).
A non-finite value where the float64 result is finite is a failure whatever the budget.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass

import torch

import attnlab

from ..kernels import compiled

__all__ = ["Case", "GridResult", "grid", "run_case", "run", "run_isolated", "LENGTHS", "HEAD_DIMS", "BLOCKS",
           "MASKS", "DTYPES", "BACKENDS"]

LENGTHS = (1, 2, 16, 17, 48, 64, 96, 130, 256)
HEAD_DIMS = (32, 64, 128)
BLOCKS = (16, 32, 48, 64, 128)
MASKS = ("none", "causal", "bias")
DTYPES = ("bfloat16", "float16")
#: ATTNLAB_EXT_GEMM values: the back end of the tile products (auto: the kernel's own rules)
BACKENDS = ("auto", "brgemm", "mkl", "loop")
FACTOR = 3.0
GRAD_FACTOR = 8.0
FLOOR = {"bfloat16": 4e-3, "float16": 5e-4}


@dataclass(frozen=True)
class Case:
    """One cell of the grid: dtype name, query and key lengths, head dim, block size, mask kind."""

    dtype: str
    L: int
    S: int
    E: int
    block: int
    mask: str

    def label(self) -> str:
        """e.g. "bfloat16 L=64 S=64 E=32 block=16 causal"."""
        return f"{self.dtype} L={self.L} S={self.S} E={self.E} block={self.block} {self.mask}"


@dataclass
class GridResult:
    """Counts of one back end's run: ``cases`` run, ``failures`` (label, what, error, budget), ``crashed`` (the
    process died: its signal or exit status and the last case started), the back end each dtype's tiles took."""

    backend: str
    cases: int = 0
    failures: list = dataclasses.field(default_factory=list)
    crashed: str | None = None
    tiles: dict = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """No case off its budget and no crash."""
        return not self.failures and self.crashed is None

    def as_dict(self) -> dict:
        """Plain data (the child's JSON line)."""
        return dataclasses.asdict(self)


def grid(sample: int | None = None, seed: int = 0) -> list[Case]:
    """Every case of the grid, or ``sample`` of them drawn with ``seed`` (the same draw in every process)."""
    cases = [Case(dt, L, S, E, b, m) for dt, L, S, E, b, m in
             itertools.product(DTYPES, LENGTHS, LENGTHS, HEAD_DIMS, BLOCKS, MASKS)]
    if sample is not None and sample < len(cases):
        cases = random.Random(seed).sample(cases, sample)
    return cases


def _naive(q, k, v, bias, causal, acc):
    """softmax(q kᵀ/√E + bias) v with the products in q's dtype and the softmax in ``acc`` (float64 inputs: the
    oracle); a row with no key is 0."""
    s = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if bias is not None:
        s = s + bias.to(s.dtype)
    if causal:  # top-left, as attnlab's and SDPA's is_causal
        L, S = s.shape[-2:]
        s = s.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(), float("-inf"))
    w = torch.softmax(s.to(acc), -1).nan_to_num(0.0).to(q.dtype)
    return w @ v


def _err(a, b) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def run_case(c: Case) -> list[tuple[str, float, float]]:
    """The case's failures: (what, error, budget) for each of out, dq, dk, dv off its budget or non-finite."""

    dtype = getattr(torch, c.dtype)
    g = torch.Generator().manual_seed(hash((c.L, c.S, c.E, c.block, c.mask)) % 2**31)
    base = [torch.randn(1, 2, n, c.E, generator=g, dtype=torch.float64) for n in (c.L, c.S, c.S)]
    bias = torch.randn(c.L, c.S, generator=g, dtype=torch.float64) if c.mask == "bias" else None
    dout = torch.randn(1, 2, c.L, c.E, generator=g, dtype=torch.float64)
    causal = c.mask == "causal"

    def grads(out, leaves):
        return torch.autograd.grad(out, leaves, dout.to(out.dtype))

    ref_leaves = [t.clone().requires_grad_() for t in base]
    ref_out = _naive(*ref_leaves, bias, causal, torch.float64)
    ref = [ref_out.detach(), *grads(ref_out, ref_leaves)]
    nv_leaves = [t.to(dtype).requires_grad_() for t in base]
    nv_out = _naive(*nv_leaves, None if bias is None else bias.to(dtype), causal, torch.float32)
    naive = [nv_out.detach(), *grads(nv_out, nv_leaves)]
    leaves = [t.to(dtype).requires_grad_() for t in base]
    out = attnlab.attention(*leaves, attn_mask=None if bias is None else bias.to(dtype), is_causal=causal,
                            method="compiled", block_size=c.block)
    got = [out.detach(), *grads(out, leaves)]
    bad = []
    for what, x, r, n in zip(("out", "dq", "dk", "dv"), got, ref, naive):
        budget = (FACTOR if what == "out" else GRAD_FACTOR) * _err(n, r) + FLOOR[c.dtype] * (1 if what == "out" else 10)
        e = _err(x, r)
        finite_ref = bool(torch.isfinite(r).all())
        if not (e <= budget) or (finite_ref and not bool(torch.isfinite(x).all())):
            bad.append((what, e, budget))
    return bad


def run(cases: list[Case], backend: str = "auto", progress=None) -> GridResult:
    """Run ``cases`` in this process under ``ATTNLAB_EXT_GEMM=backend``. ``progress(i, case)`` is called before
    each case (``run_isolated``'s child prints it, so a crash names its case)."""

    prev = os.environ.get("ATTNLAB_EXT_GEMM")
    os.environ["ATTNLAB_EXT_GEMM"] = backend
    res = GridResult(backend)
    try:
        for dt in DTYPES:
            res.tiles[dt] = compiled.gemm_backend(getattr(torch, dt))
        for i, c in enumerate(cases):
            if progress:
                progress(i, c)
            for what, e, budget in run_case(c):
                res.failures.append((c.label(), what, e, budget))
            res.cases += 1
    finally:
        if prev is None:
            os.environ.pop("ATTNLAB_EXT_GEMM", None)
        else:
            os.environ["ATTNLAB_EXT_GEMM"] = prev
    return res


def run_isolated(backend: str, sample: int | None = None, seed: int = 0, timeout_s: float = 1800.0,
                 env: dict | None = None, shards: int = 1) -> GridResult:
    """``run(grid(sample, seed), backend)`` in child processes, so that a crash (SIGILL, SIGSEGV) is a result:
    ``crashed`` names the signal and the case that was running. ``shards`` > 1 splits the cases over that many
    children of one thread each, run side by side (the cases are small: a thread each uses the cores better)."""
    procs = []
    for i in range(shards):
        argv = [sys.executable, "-m", "attnlab.verify.halfgrid", "--backend", backend, "--seed", str(seed),
                "--shard", f"{i}/{shards}"]
        if sample is not None:
            argv += ["--sample", str(sample)]
        e = {**os.environ, **(env or {})}
        if shards > 1:
            e["OMP_NUM_THREADS"] = "1"
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e))
    total = GridResult(backend)
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        part = _child_result(backend, p.returncode, out, err)
        total.cases += part.cases
        total.failures += part.failures
        total.tiles = total.tiles or part.tiles
        total.crashed = total.crashed or part.crashed
    return total


def _child_result(backend: str, rc: int, out: str, err: str) -> GridResult:
    last = None
    for line in out.splitlines():
        if line.startswith("case "):
            last = line[5:]
        elif line.startswith("{"):
            d = json.loads(line)
            return GridResult(d["backend"], d["cases"], [tuple(f) for f in d["failures"]], d["crashed"], d["tiles"])
    how = f"signal {-rc}" if rc < 0 else f"exit {rc}"
    tail = (err.strip().splitlines() or [""])[-1][:300]
    return GridResult(backend, crashed=f"{how} during {last or 'start-up'}" + (f": {tail}" if tail else ""))


if __name__ == "__main__":  # run_isolated's child: one "case ..." line per case, then the result as one JSON line
    import argparse

    ap = argparse.ArgumentParser(description="the half-type grid on one GEMM back end (one JSON line)")
    ap.add_argument("--backend", default="auto", choices=BACKENDS)
    ap.add_argument("--sample", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard", default="0/1", help="i/n: this child runs cases i, i + n, ...")
    a = ap.parse_args()
    i, n = (int(x) for x in a.shard.split("/"))
    res = run(grid(a.sample, a.seed)[i::n], a.backend, progress=lambda i, c: print(f"case {c.label()}", flush=True))
    print(json.dumps(res.as_dict()), flush=True)
