"""One SDPA-or-decode rule: on a calibrated machine the HF generation step and ``attention()`` send the same plain
decode call to the same kernel (``Rates.plain_decode_on_sdpa``, kernels.planner Note [Plain MHA decode]) where the
calibration fitted one crossing; the HF step once decided by the uncalibrated constant alone. Where it fitted each
door its own (functional.calibration_grid Note [Each door its crossing]), each door follows its own, asked of the same
function. Every result matches the float64 reference."""
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


@pytest.fixture
def doors():
    """Rates whose crossings differ by door: fp32 plain decode on SDPA below 1000 keys through ``attention``, and
    the steps (the KV-cache API's, the HF step's) on the decode path at every length."""
    before = rates.current()
    r = dataclasses.replace(rates.builtin(), source="test: a crossing per door",
                            decode_min_keys={(torch.float32, False): 1000.0, (torch.float32, True): 1000.0},
                            step_min_keys={(torch.float32, False): 0.0, (torch.float32, True): 0.0})
    rates.make_current(r)
    yield
    rates.make_current(before)


@pytest.mark.parametrize("Hkv", [8, 2], ids=["mha", "gqa"])
def test_each_door_follows_its_crossing(doors, monkeypatch, Hkv):
    """At 500 keys ``attention`` runs SDPA (its door's crossing is 1000), while the HF step and the KV-cache API's
    plain step on a heads-first cache run the decode step (theirs is 0); explain names the door's evidence."""
    S, H, D = 500, 8, 64
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, H, 1, D, generator=g)
    k, v = (torch.randn(1, Hkv, S, D, generator=g) for _ in range(2))
    used = []
    real = dk.decode_step
    monkeypatch.setattr(dk, "decode_step", lambda *a, **kw: (used.append("decode"), real(*a, **kw))[1])
    with torch.no_grad():
        assert attnlab.explain(q, k, v, enable_gqa=Hkv != H).kernel.name == "sdpa"
        out_a = attnlab.attention(q, k, v, enable_gqa=Hkv != H)
        assert not used
        out_h = hf._decode_step("auto", q, k, v, None, None, SimpleNamespace(training=False), False, False)
        assert used == ["decode"]
        used.clear()
        kc, vc = k.transpose(1, 2), v.transpose(1, 2)  # heads-first views: SDPA could read them
        out_c = attnlab.attention_with_kvcache(q.transpose(1, 2), kc, vc, cache_seqlens=S)
        assert used and used[-1] == "decode"
    ref = torch.as_tensor(reference.attention(q.double(), k.double(), v.double(), enable_gqa=Hkv != H)[0])
    for out in (out_a, out_h.transpose(1, 2), out_c.transpose(1, 2)):
        assert (out - ref).abs().max() <= 1e-5  # fp32 arithmetic over 500 keys


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


@pytest.mark.parametrize("layout", ["heads-first", "tokens-first"])
@pytest.mark.parametrize("S", [500, 2000])
def test_kvcache_plain_step_follows_the_rule(skewed, monkeypatch, S, layout):
    """The KV-cache door's plain step asks the same rule (kernels.cacheview Note [Cache layouts]): on a
    heads-first cache SDPA below the skewed crossover and the one-call decode step above it; on flash-attn's
    tokens-first cache the decode step at every length. Output and the appended rows against float64."""
    g = torch.Generator().manual_seed(S)
    H, D = 8, 64
    q, knew, vnew = (torch.randn(1, 1, H, D, generator=g) for _ in range(3))
    if layout == "heads-first":
        kc, vc = (torch.randn(1, H, S + 4, D, generator=g).transpose(1, 2) for _ in range(2))
    else:
        kc, vc = (torch.randn(1, S + 4, H, D, generator=g) for _ in range(2))
    k_old, v_old = kc[:, :S].clone(), vc[:, :S].clone()
    used = []
    real_step, real_sdpa = dk.decode_step, torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(dk, "decode_step", lambda *a, **kw: (used.append("decode"), real_step(*a, **kw))[1])
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **kw: (used.append("sdpa"), real_sdpa(*a, **kw))[1])
    with torch.no_grad():
        out = attnlab.attention_with_kvcache(q, kc, vc, knew, vnew, cache_seqlens=S)
    want = "sdpa" if layout == "heads-first" and S < 1000 else "decode"
    assert used and used[-1] == want and "sdpa" not in used[:-1], (layout, S, used)
    assert torch.equal(kc[:, S], knew[:, 0]) and torch.equal(vc[:, S], vnew[:, 0])
    k = torch.cat([k_old, knew], 1).double().transpose(1, 2)
    v = torch.cat([v_old, vnew], 1).double().transpose(1, 2)
    ref = torch.as_tensor(reference.attention(q.double().transpose(1, 2), k, v)[0]).transpose(1, 2)
    assert (out - ref).abs().max() <= 1e-5  # fp32 arithmetic over S <= 2000 keys


def test_kept_cache_plans_equal_fresh_ones(skewed):
    """Note [Cache plans]: plan_cache keeps the decode rule's plans under the request without S; a kept plan is the
    plan a fresh walk of the rules makes (``costs=True`` never reads the memo), on both sides of the skewed
    crossover, for every cache view kind, and a change of the rates forgets them."""
    from attnlab.kernels.cacheview import CacheCall
    from attnlab.kernels.planner import _CACHE_PLANS, plan_cache

    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 1, 8, 64, generator=g)
    kc = torch.randn(2, 8, 3000, 64, generator=g).transpose(1, 2)  # heads-first: SDPA may read it
    table = torch.arange(2 * 30, dtype=torch.int32).view(2, 30)
    for S in (500, 2000, 600, 2500, 999, 1000):
        for seqlens, bt, k in ((S, None, kc), (torch.tensor([S, S - 7]), None, kc),
                               (torch.tensor([S, S - 7]), table, kc.reshape(60, 100, 8, 64))):
            call = CacheCall(q, k, k, 0.125, seqlens, block_table=bt)
            kept, fresh = plan_cache(call), plan_cache(call, costs=True)
            assert kept.kernel is fresh.kernel, (S, call.kind, kept.kernel.name, fresh.kernel.name)
            if call.kind == "contiguous":
                assert (kept.kernel.name == "sdpa") == (S < 1000), S
    assert _CACHE_PLANS
    rates.make_current(rates.current())
    assert not _CACHE_PLANS


def test_sdpa_step_is_the_full_path(skewed, monkeypatch):
    """csrc Note [SDPA steps]: where the rule gives a plain heads-first step to SDPA, its direct path (the decode
    extension's checks and append, then SDPA on views) appends the same rows and returns the same bits as the full
    path's SDPA (checks in Python, ``SDPA.run_cache``); against float64; a call whose checks fail writes nothing."""
    from attnlab.kernels import SDPA

    g = torch.Generator().manual_seed(11)
    H, Hkv, D, S = 8, 2, 64, 300
    q, = (torch.randn(2, 1, H, D, generator=g),)
    knew, vnew = (torch.randn(2, 1, Hkv, D, generator=g) for _ in range(2))
    kc, vc = (torch.randn(2, Hkv, S + 4, D, generator=g).transpose(1, 2) for _ in range(2))  # heads-first views
    kc2, vc2 = kc.clone(), vc.clone()
    k_old, v_old = kc[:, :S].clone(), vc[:, :S].clone()
    taken = []
    real = SDPA.step
    monkeypatch.setattr(SDPA, "step", lambda *a: taken.append(real(*a)) or taken[-1])
    with torch.no_grad():
        out = attnlab.attention_with_kvcache(q, kc, vc, knew, vnew, cache_seqlens=S)
        assert len(taken) == 1 and taken[0] is not None, "the SDPA step was not taken"
        monkeypatch.setattr(SDPA, "step", lambda *a: None)  # the full path
        full = attnlab.attention_with_kvcache(q, kc2, vc2, knew, vnew, cache_seqlens=S)
        assert torch.equal(out, full) and torch.equal(kc, kc2) and torch.equal(vc, vc2)
        k = torch.cat([k_old, knew], 1).double().transpose(1, 2)
        v = torch.cat([v_old, vnew], 1).double().transpose(1, 2)
        ref = torch.as_tensor(reference.attention(q.double().transpose(1, 2), k, v, enable_gqa=True)[0])
        assert (out.transpose(1, 2) - ref).abs().max() <= 1e-5  # fp32 arithmetic over S ~ 300 keys
        before = kc.clone(), vc.clone()
        for bad in ({"n0": S + 4}, {"n0": -1}, {"k": knew.double(), "v": vnew.double()}):
            args = {"n0": S, "k": knew, "v": vnew} | bad
            assert real(q, kc, vc, args["k"], args["v"], args["n0"], 0.125) is None, bad
            assert torch.equal(kc, before[0]) and torch.equal(vc, before[1]), f"{bad}: the caches changed"

