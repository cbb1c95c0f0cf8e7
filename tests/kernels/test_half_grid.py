"""The half-type forward + backward over small shapes and small blocks, on every GEMM back end this CPU runs
(``attnlab.verify.halfgrid``), each in its own process so that a crash is a named failure, not a lost worker.

The regression this guards: csrc Note [AMX tile state]. On a CPU with AMX the bf16 backward at L = S = 64 with
blocks of 16 died with SIGILL (its score products on brgemm, the others on MKL, whose AMX code released the
tiles behind torch's cached configuration). On a CPU without AMX the same cases run the AVX512-BF16 or loop
paths (the test summary's path lines say which ran).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from attnlab.kernels import compiled
from attnlab.verify import halfgrid

pytestmark = pytest.mark.skipif(not compiled.available(), reason=f"compiled kernel: {compiled.unavailable_reason()}")

#: cases drawn per back end in the normal suite (the whole grid, 7,290 cases, runs in `attnlab verify`)
SAMPLE = 160

REPRODUCER = """
import sys, torch, attnlab
torch.set_num_threads(int(sys.argv[4]))
L, block, E = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
q, k, v = (torch.randn(1, 2, L, E, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
attnlab.attention(q, k, v, method="compiled", block_size=block).float().sum().backward()
print("ok")
"""


@pytest.mark.parametrize("L,block,E,threads", [(64, 16, 32, 1), (64, 32, 64, 2), (96, 48, 32, 1), (64, 16, 64, 2)])
def test_the_issue_reproducer_runs(L, block, E, threads):
    """The issue's reproducer (SIGILL on an AMX Xeon before the fix) in a child process."""
    r = subprocess.run([sys.executable, "-c", REPRODUCER, str(L), str(block), str(E), str(threads)],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, ATTNLAB_CALIBRATION="off"))
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stderr[-500:])


@pytest.mark.parametrize("backend", halfgrid.BACKENDS)
def test_half_grid_sample_on_each_back_end(backend):
    res = halfgrid.run_isolated(backend, sample=SAMPLE, seed=halfgrid.BACKENDS.index(backend))
    assert res.crashed is None, f"{backend}: the process died ({res.crashed})"
    assert res.cases == SAMPLE and not res.failures, (backend, res.tiles, res.failures[:5])


def test_the_grid_reaches_the_crashing_shapes():
    """The grid holds the reproducer's shapes (L = S <= 128, blocks 16-48, each mask), not only large ones."""
    cases = set(halfgrid.grid())
    for block in (16, 32, 48):
        for mask in halfgrid.MASKS:
            assert halfgrid.Case("bfloat16", 64, 64, 32, block, mask) in cases
    assert len(cases) == 2 * len(halfgrid.LENGTHS) ** 2 * 3 * 5 * 3
