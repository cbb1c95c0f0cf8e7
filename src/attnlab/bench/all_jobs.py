"""The jobs of ``bench all`` and the worker processes that measure them, one JSON job at a time.

A job is a dict: {"kind": "attn", "mechanism", "n", "B", "H", "D", "repeats", "warmup", "time_budget"}
(one forward call on query, key, value [B, H, n, D]), {"kind": "train", "mechanism", "n", "B", ...} (one
training step of a small classifier, LRA Table 2 style) or {"kind": "matmul", "size", "repeats"} (the
matrix-product peak). :func:`measure_job` measures one in this process; :class:`Runner` hands jobs to a
fresh worker per job or to one long-lived worker (``python -m attnlab.bench.all_jobs --worker``).

Legend: B batch, H heads, n sequence length (L = S = n), D head dim.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch

import attnlab
import attnlab.mechanisms as M

from .. import cpu
from ..experiments.attention import choose
from ..harness import peak_rss_bytes, reset_peak_rss, rss_bytes
from ..nn import Encoder
from .impls import naive_attention

__all__ = ["REFERENCE", "mechanism_names", "make_mechanism", "attention_callable", "mechanism_cost", "measure_job",
           "Runner", "Worker", "worker_main"]

#: PyTorch's own fused kernel, called directly: every ratio is to it
REFERENCE = "torch_sdpa"


def mechanism_names() -> list[str]:
    """torch_sdpa, naive and every mechanism of the ``attnlab.mechanisms`` registry."""

    return [REFERENCE, "naive", *M.available()]


def make_mechanism(name: str, n: int):
    """The registered mechanism ``name`` as an instance with its defaults, sized for length n where its
    parameters depend on it (``attnlab.experiments.attention.choose``: block_sparse's layout). ValueError
    listing the valid names when unknown."""

    if name not in M.available():
        raise ValueError(f"unknown mechanism {name!r}; choose from {', '.join(mechanism_names())}")
    mech = choose(name, n).mechanism
    return M.get(name) if isinstance(mech, str) else mech  # exact methods: their registry entry


def attention_callable(name: str, n: int) -> Callable:
    """f(q, k, v) -> out on [B, H, n, D] tensors: PyTorch's SDPA for torch_sdpa, softmax(QKᵀ/√D)V written
    out for naive, else the registered mechanism (:func:`make_mechanism`)."""
    if name == REFERENCE:
        return lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v)
    if name == "naive":
        return naive_attention
    return make_mechanism(name, n)


def mechanism_cost(name: str, n: int, B: int, H: int, D: int) -> tuple[int | None, int | None]:
    """(FLOPs, intermediate bytes) from the cost model: the mechanism's own flops()/memory(); for
    torch_sdpa and naive, dense attention's 2·n²·(D + Dv) FLOPs. (None, None) when it has no model."""
    if name in (REFERENCE, "naive"):
        return B * H * 2 * n * n * 2 * D, (B * H * 3 * n * n * 4 if name == "naive" else B * H * n * D * 4)
    try:
        m = make_mechanism(name, n)
        return B * H * int(m.flops(n, n, D, D)), B * H * int(m.memory(n, n, D, D))
    except Exception:
        return None, None


class _Classifier(torch.nn.Module):
    """ids [B, n] -> logits [B, classes]: embedding, an ``attnlab.nn.Encoder`` with the mechanism under
    test, mean over positions, a linear read-out."""

    def __init__(self, mechanism, vocab: int, classes: int, d_model: int, heads: int, layers: int):
        super().__init__()

        self.embed = torch.nn.Embedding(vocab, d_model)
        self.encoder = Encoder(d_model, heads, layers, mechanism=mechanism)
        self.head = torch.nn.Linear(d_model, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids)).mean(1))  # (B, n, d) -> (B, d) -> (B, classes)


def _train_step(job: dict) -> Callable:
    """One AdamW step of the LRA-style classifier (2 heads of 32) on random ids [B, n] over 16 tokens."""

    # the encoder runs attnlab's modules: torch_sdpa (PyTorch's fused kernel) is attnlab's method sdpa there,
    # naive is method dense, as in the experiments
    mech = choose(job["mechanism"], job["n"]).mechanism
    torch.manual_seed(0)
    model = _Classifier(mech, 16, 10, job.get("d_model", 64), 2, job.get("layers", 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, tgt = torch.randint(1, 16, (job["B"], job["n"])), torch.randint(0, 10, (job["B"],))

    def step():
        loss = torch.nn.functional.cross_entropy(model(ids), tgt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


def _matmul(job: dict, rec: dict) -> dict:
    # the best of repeated products (attnlab.cpu.matmul_peak): a peak, not a typical figure
    rec["gflops"] = cpu.matmul_peak(torch.float32, job.get("size", 1024), seconds=0.2, refresh=True)
    return rec


def measure_job(job: dict) -> dict:
    """Run one measurement in this process; returns the job's dict with what was measured added.

    attn and train jobs: ``warmup`` untimed calls, then ``repeats`` timed ones (fewer when they would
    pass ``time_budget``), median ``time_s``; ``peak_bytes`` is the growth of this process's peak RSS
    over its RSS once the inputs exist (after freed memory was returned to the OS and the peak reset),
    so allocator caches and the interpreter do not count. A job that fails records ``error`` instead.
    """
    rec = dict(job)
    try:
        if job["kind"] == "matmul":
            return _matmul(job, rec)
        n, B = job["n"], job["B"]
        if job["kind"] == "attn":
            g = torch.Generator().manual_seed(0)
            q, k, v = (torch.randn(B, job["H"], n, job["D"], generator=g) for _ in range(3))  # (B, H, n, D)
            fn = attention_callable(job["mechanism"], n)
            call = lambda: fn(q, k, v)  # noqa: E731
        else:
            call = _train_step(job)
        with torch.no_grad() if job["kind"] == "attn" else torch.enable_grad():
            reset_peak_rss()
            rss0 = rss_bytes()
            warm = []
            for _ in range(max(1, job.get("warmup", 1))):
                t0 = time.perf_counter()
                out = call()
                warm.append(time.perf_counter() - t0)
                del out
            budget = job.get("time_budget", 60.0)
            reps = max(1, min(job.get("repeats", 5), int(budget / max(warm[-1], 1e-9)) - len(warm)))
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                out = call()
                ts.append(time.perf_counter() - t0)
                del out
            rec["peak_bytes"] = max(0, peak_rss_bytes() - rss0)
        rec.update(time_s=statistics.median(ts), times_s=ts, warmup_s=warm, repeats_done=reps)
        if job["kind"] == "attn":
            rec["flops"], rec["model_bytes"] = mechanism_cost(job["mechanism"], n, B, job["H"], job["D"])
            rec["gflops"] = rec["flops"] / rec["time_s"] / 1e9 if rec["flops"] else None
        else:
            rec["steps_per_s"] = 1.0 / rec["time_s"]
    except Exception as e:  # a mechanism that refuses these inputs: record why
        rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return rec


def worker_main(argv: list[str]) -> int:
    """``python -m attnlab.bench.all_jobs --worker [--threads N]``: one JSON job per stdin line, one
    ``RESULT {...}`` line per job on stdout."""
    import signal

    # Ctrl-C reaches the whole process group: the driver handles it (and kills this worker), so that an
    # interrupt never shows up as a measurement ("worker exited ..."). If the driver dies, so do we.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if "--threads" in argv:
        torch.set_num_threads(int(argv[argv.index("--threads") + 1]))
    for line in sys.stdin:
        if not line.strip():
            continue
        rec = measure_job(json.loads(line))
        rec["threads"] = torch.get_num_threads()
        sys.stdout.write("RESULT " + json.dumps(rec) + "\n")  # the protocol's channel, not a message
        sys.stdout.flush()
    return 0


class Worker:
    """A measuring Python process (:func:`worker_main`) that answers one job per :meth:`measure`."""

    def __init__(self, threads: int | None):
        env = dict(os.environ)
        src = str(Path(attnlab.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        cmd = [sys.executable, "-m", "attnlab.bench.all_jobs", "--worker"]
        if threads:
            cmd += ["--threads", str(threads)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env, bufsize=1)

    def measure(self, job: dict, timeout: float) -> dict:
        """The worker's record for ``job``, or the job with ``error`` when it died or passed ``timeout`` s."""
        import select

        try:
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return {**job, "error": f"worker died: {self._stderr()}"}
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close(kill=True)
                return {**job, "error": f"timed out after {timeout:.0f} s"}
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 1.0))
            if not ready:
                if self.proc.poll() is not None:
                    return {**job, "error": f"worker exited with code {self.proc.returncode}: {self._stderr()}"}
                continue
            line = self.proc.stdout.readline()
            if not line:
                self.proc.wait()
                return {**job, "error": f"worker exited with code {self.proc.returncode}: {self._stderr()}"}
            if line.startswith("RESULT "):
                return json.loads(line[7:])

    def _stderr(self) -> str:
        try:
            self.proc.wait(timeout=5)
            return (self.proc.stderr.read() or "").strip()[-300:]
        except Exception:
            return ""

    def alive(self) -> bool:
        """Whether the process still runs."""
        return self.proc.poll() is None

    def close(self, kill: bool = False) -> None:
        """End the process: close its input and wait (or kill it), then close the pipes."""
        if self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdout, self.proc.stderr):
            try:
                f.close()
            except Exception:
                pass


class Runner:
    """Hands jobs to workers: a fresh process per job (``isolation="config"``) or one long-lived process
    (``"suite"``) with ``threads`` torch threads."""

    def __init__(self, isolation: str, threads: int | None):
        self.isolation, self.threads = isolation, threads
        self.worker: Worker | None = None

    def measure(self, job: dict) -> dict:
        """The record of one job (see :func:`measure_job`), measured in a worker."""
        timeout = 180 + 3 * job.get("time_budget", 60)
        if self.worker is None or not self.worker.alive():
            self.worker = Worker(self.threads)
        rec = self.worker.measure(job, timeout)
        if self.isolation == "config":
            self.close()
        return rec

    def close(self, kill: bool = False) -> None:
        """End the current worker, if any."""
        if self.worker is not None:
            self.worker.close(kill=kill)
            self.worker = None


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv))
