"""Smoke-run the half-type tiles benchmark (attnlab.bench.half_tiles) at toy size: its figures, not times."""
from __future__ import annotations

import math

import pytest
import torch

from attnlab.bench import half_tiles
from attnlab.kernels import compiled

pytestmark = pytest.mark.skipif(not compiled.available(), reason=f"compiled kernel: {compiled.unavailable_reason()}")


def test_half_tiles_reports_every_call_and_its_ratios():
    threads = torch.get_num_threads()
    cfg = half_tiles.HalfTilesConfig(ns=(48,), rounds=2, threads=1, backends=("auto", "fp32"),
                                     half=("bfloat16", "float16"), gemm_n=64, sample_seconds=0.0)
    res = half_tiles.run(cfg)
    assert torch.get_num_threads() == threads  # restored
    impls = ["sdpa fp32", "compiled fp32", "sdpa bf16", "compiled bf16 auto", "compiled bf16 fp32", "sdpa fp16",
             "compiled fp16 auto", "compiled fp16 fp32"]
    want = {f"{mode} {i} n=48" for mode in ("fwd", "fwd+bwd") for i in impls}
    assert set(res["seconds"]) == want and set(res["gflops"]) == want
    assert all(len(res["samples"][k]) == 2 and res["seconds"][k] > 0 for k in want)
    assert set(res["ratios"]) == {k for k in want if " compiled b" in k or " compiled fp16" in k}
    for key, r in res["ratios"].items():
        short = key.split()[2]
        assert set(r) == {"vs compiled fp32", f"vs sdpa {short}", "vs sdpa fp32", "of bf16 gemm rate"}
        assert all(math.isfinite(x) and x > 0 for x in r.values()), key
        mode, n = key.split()[0], key.split()[-1]
        assert r["vs compiled fp32"] == res["seconds"][f"{mode} compiled fp32 {n}"] / res["seconds"][key]
    assert res["gemm_gflops"]["bfloat16"] >= res["gemm_gflops_median"]["bfloat16"] > 0
    assert res["backends"]["float16"] in ("brgemm", "mkl", "fp32")
