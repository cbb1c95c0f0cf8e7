"""One SDPA-or-decode rule: on a calibrated machine the HF generation step and ``attention()`` send the same plain
decode call to the same kernel (``Rates.plain_decode_on_sdpa``, kernels.planner Note [Plain MHA decode]); the HF
step once decided by the uncalibrated constant alone. Both results match the float64 reference."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

import attnlab
from attnlab import reference
from attnlab.integrations import hf
from attnlab.kernels import decode as dk
from attnlab.kernels import rates

pytestmark = pytest.mark.skipif(not dk.available(), reason=f"decode extension: {dk.unavailable_reason()}")


@pytest.fixture
def skewed():
    """Rates that send fp32 multi-head and GQA plain decode to SDPA below 1000 keys, the decode path from there."""
    before = rates.current()
    r = dataclasses.replace(rates.builtin(), source="test: skewed calibration",
                            decode_min_keys={(torch.float32, False): 1000.0, (torch.float32, True): 1000.0})
    rates.make_current(r)
    yield
    rates.make_current(before)


@pytest.mark.parametrize("Hkv", [8, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("S", [500, 2000])
def test_hf_step_and_attention_choose_alike(skewed, monkeypatch, S, Hkv):
    g = torch.Generator().manual_seed(S)
    q = torch.randn(1, 8, 1, 64, generator=g)
    k, v = (torch.randn(1, Hkv, S, 64, generator=g) for _ in range(2))
    with torch.no_grad():
        plan = attnlab.explain(q, k, v, enable_gqa=Hkv != 8)
        chose_decode = plan.kernel.name != "sdpa"
        assert chose_decode == (S >= 1000), plan
        used = []
        real = dk.decode_step
        monkeypatch.setattr(dk, "decode_step", lambda *a, **kw: (used.append("decode"), real(*a, **kw))[1])
        out = hf._decode_step("auto", q, k, v, None, None, SimpleNamespace(training=False), False, False)
    assert (used == ["decode"]) == chose_decode, (S, used)
    ref = torch.as_tensor(reference.attention(q.double(), k.double(), v.double(), enable_gqa=Hkv != 8)[0])
    assert (out.transpose(1, 2) - ref).abs().max() <= 1e-5  # fp32 arithmetic over S <= 2000 keys
