"""attnlab experiment kvquant (``experiments/kvquant.py``): its q8_0 simulation equals ggml's definition written
here, the decode kernel's error on attnlab's formats equals the simulated one within the kernel's rounding, the
chosen format (Hadamard-rotated keys) is at most q8_0's error on keys with outlier channels, and the report is
written. SmolLM2 is not loaded (tokens=0): its measurement is the experiment's full run."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attnlab.experiments import kvquant as E
from attnlab.kernels import decode as dk


def _q8_0(x):
    """ggml quantize_row_q8_0_ref: per 32 channels d = amax / 127, roundf(x / d), dequantised with fp16(d)."""
    xb = x.float().reshape(*x.shape[:-1], -1, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, xb * (1 / d), torch.zeros_like(xb))
    q = torch.sign(q) * torch.floor(q.abs() + 0.5)
    return (q.double() * d.half().double()).reshape(x.shape)


def test_q8_0_is_ggml_s():
    x = torch.randn(3, 5, 2, 64, generator=torch.Generator().manual_seed(0)) * 4
    x[0, 0, 0] = 0
    assert torch.equal(E.q8_0(x), _q8_0(x))
    with pytest.raises(ValueError, match="multiple of 32"):
        E.q8_0(torch.zeros(2, 40))


@pytest.mark.skipif(not dk.available(), reason="decode extension")
def test_quick_run_and_report(tmp_path, one_thread):
    """Kernel and simulation agree within 1 % of the error itself (the kernel's float32 and int16-query
    rounding are 2^-16 of a score where int8 rounding is 2^-8: tests/functional/test_kvcache_int8.py)."""
    cfg = E.KvquantConfig(quick=True, seeds=(0,), S=512, H=8, Hkv=2, D=128, n0=64, tokens=0)
    r = E.run(cfg)
    assert set(r.errors) == {"outlier keys", "gaussian keys"}
    for data, e in r.kernel.items():
        for f, x in e.items():
            assert abs(x - r.errors[data][f]) <= 0.01 * r.errors[data][f], (data, f)
    out = r.errors["outlier keys"]
    assert out["int8-hadamard"] <= out["q8_0"] < out["int8"]
    paths = r.write(tmp_path)
    res = json.loads(Path(paths["results"]).read_text())
    assert res["experiment"] == "kvquant" and (tmp_path / "kvquant.png").exists()
    with pytest.raises(ValueError, match="unknown formats"):
        E.KvquantConfig(formats=("int4",)).resolved()
