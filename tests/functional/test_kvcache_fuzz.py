"""Random ``attention_with_kvcache`` calls with one invalid argument each (issue 40, D3-D5): every rejected call
raises one line naming the function, and leaves the caches byte-identical (Note [Checked, then appended]).

Each case is drawn from a seed: a valid call (contiguous or paged cache, float32, bfloat16 or int8, one length
or one per sequence, new keys or none, causal, windows, soft-capping, ALiBi, rotary, splits, scale, lse), then
one argument made invalid (every argument that can be rejected: num_splits, scale, block_table entries in
the caller's dtype and the table itself, cache_seqlens, window_size, softcap, alibi_slopes, rotary, k and v,
q, the caches' kinds, an int8 append of a non-finite row, grad). The caches are filled with random values
first, so a write of any row shows in the bytes. The valid call itself must run and write.
"""
from __future__ import annotations

import collections
import os
import random
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attnlab
from attnlab.functional.kvcache import QuantizedKV, Rotary

pytestmark = [pytest.mark.usefixtures("one_thread")]


def _valid_call(rng: random.Random, seed: int) -> dict:
    """The arguments of a valid call: q, k_cache, v_cache, k, v and the keywords."""
    g = torch.Generator().manual_seed(seed)
    B, Hkv, G = rng.randint(1, 3), rng.choice([1, 2]), rng.choice([1, 2, 4])
    H, D = Hkv * G, rng.choice([8, 16])
    Dv = rng.choice([D, 8])
    dtype = rng.choice(["float32", "bfloat16", "int8"])
    fdt = torch.float32 if dtype in ("float32", "int8") else torch.bfloat16
    paged = rng.random() < 0.5
    L, Lnew = rng.randint(1, 3), rng.choice([0, 1, 2])
    if paged:
        T, maxp = rng.choice([2, 4, 8]), rng.randint(1, 4)
        pool = B * maxp + rng.randint(0, 2)
        capacity, shape = maxp * T, (pool, T, Hkv)
        pages = torch.randperm(pool, generator=g)[:B * maxp].view(B, maxp)
        table = pages.to(rng.choice([torch.int32, torch.int64]))
    else:
        capacity = rng.choice([4, 8, 16])
        shape, table = (B, capacity, Hkv), None
    if dtype == "int8":
        kc = QuantizedKV.quantize(torch.randn(*shape, D, generator=g))
        vc = QuantizedKV.quantize(torch.randn(*shape, Dv, generator=g))
    else:
        kc, vc = torch.randn(*shape, D, generator=g).to(fdt), torch.randn(*shape, Dv, generator=g).to(fdt)
    top = capacity - Lnew
    if rng.random() < 0.5:
        seqlens = rng.randint(0, top)
    else:
        seqlens = torch.tensor([rng.randint(0, top) for _ in range(B)], dtype=rng.choice([torch.int32, torch.int64]))
    q = torch.randn(B, L, H, D, generator=g).to(fdt)
    k = v = None
    if Lnew or rng.random() < 0.3:
        k, v = torch.randn(B, Lnew, Hkv, D, generator=g).to(fdt), torch.randn(B, Lnew, Hkv, Dv, generator=g).to(fdt)
    kw = dict(cache_seqlens=seqlens, block_table=table, is_causal=rng.random() < 0.7)
    if rng.random() < 0.2:
        kw["window_size"] = (rng.choice([-1, 0, 2, 5]), rng.choice([-1, 0, 3]))
    if rng.random() < 0.2:
        kw["softcap"] = rng.choice([0.0, 5.0, 30.0])
    if rng.random() < 0.2:
        kw["alibi_slopes"] = torch.rand(H, generator=g)
    if k is not None and rng.random() < 0.2:
        half = rng.choice([1, D // 4, D // 2])
        kw["rotary"] = Rotary(torch.rand(capacity + L + 4, half, generator=g), torch.rand(capacity + L + 4, half, generator=g),
                              rng.random() < 0.5)
    if rng.random() < 0.3:
        kw["num_splits"] = rng.randint(1, 5)
    if rng.random() < 0.3:
        kw["scale"] = rng.choice([0.1, 0.5, 2])
    kw["return_lse"] = rng.random() < 0.2
    return dict(q=q, k_cache=kc, v_cache=vc, k=k, v=v, kw=kw, B=B, H=H, D=D, Dv=Dv, L=L, Lnew=Lnew, paged=paged,
                capacity=capacity, dtype=dtype, pool=kc.shape[0] if paged else None, seqlens=seqlens)


def _lengths(c) -> list[int]:
    s = c["seqlens"]
    return [s] * c["B"] if isinstance(s, int) else [int(x) for x in s]


def _breakers(c) -> dict:
    """name -> (function that makes the call invalid, the argument its error names)."""
    B, H, paged = c["B"], c["H"], c["paged"]
    out = {}

    def put(name, arg, fn):
        out[name] = (fn, arg)
    for bad in (0, -1, 2.5, True, "2", 1.0):
        put(f"num_splits={bad!r}", "num_splits", lambda c, bad=bad: c["kw"].__setitem__("num_splits", bad))
    for bad in ("a", float("nan"), float("inf"), -float("inf"), True, torch.tensor(0.5), [0.5]):
        put(f"scale={bad!r}", "scale", lambda c, bad=bad: c["kw"].__setitem__("scale", bad))
    if paged:
        used = [(b, p) for b, n in enumerate(_lengths(c)) for p in range(-(-(n + c["Lnew"]) // c["k_cache"].shape[1]))]
        if used:
            for bad in ("pool", "pool+5", -1, 2**31, 2**32, -(2**40)):
                def fn(c, bad=bad):
                    t = c["kw"]["block_table"].to(torch.int64).clone()
                    b, p = random.Random(str(bad)).choice(used)
                    t[b, p] = {"pool": c["pool"], "pool+5": c["pool"] + 5}.get(bad, bad)
                    c["kw"]["block_table"] = t
                put(f"block_table entry {bad}", "block_table", fn)
            put("block_table entry int32 out of pool", "block_table", lambda c: c["kw"].__setitem__(
                "block_table", torch.full_like(c["kw"]["block_table"], c["pool"], dtype=torch.int32)))
        put("block_table float", "block_table", lambda c: c["kw"].__setitem__("block_table", c["kw"]["block_table"].double()))
        put("block_table bool", "block_table", lambda c: c["kw"].__setitem__("block_table", c["kw"]["block_table"] > 0))
        put("block_table rows", "block_table", lambda c: c["kw"].__setitem__(
            "block_table", torch.cat([c["kw"]["block_table"]] * 2)))
        put("block_table 1-D", "block_table", lambda c: c["kw"].__setitem__("block_table", c["kw"]["block_table"][0]))
    put("cache_seqlens -1", "cache_seqlens", lambda c: c["kw"].__setitem__("cache_seqlens", -1))
    put("cache_seqlens overflows", "cache_seqlens", lambda c: c["kw"].__setitem__(
        "cache_seqlens", c["capacity"] - c["Lnew"] + 1 if c["Lnew"] else c["capacity"] + 1))
    put("cache_seqlens one overflows", "cache_seqlens", lambda c: c["kw"].__setitem__(
        "cache_seqlens", torch.tensor([0] * (B - 1) + [c["capacity"] + 1])))
    put("cache_seqlens negative entry", "cache_seqlens", lambda c: c["kw"].__setitem__(
        "cache_seqlens", torch.tensor([-1] + [0] * (B - 1))))
    put("cache_seqlens shape", "cache_seqlens", lambda c: c["kw"].__setitem__("cache_seqlens", torch.zeros(B + 1, dtype=torch.long)))
    put("cache_seqlens float", "cache_seqlens", lambda c: c["kw"].__setitem__("cache_seqlens", torch.zeros(B)))
    put("cache_seqlens bool", "cache_seqlens", lambda c: c["kw"].__setitem__("cache_seqlens", True))
    if c["k"] is not None:
        put("cache_seqlens None with k", "cache_seqlens", lambda c: c["kw"].__setitem__("cache_seqlens", None))
    for bad in ((-2, 0), (0,), "a", (1.5, 0)):
        put(f"window_size={bad!r}", "window_size", lambda c, bad=bad: c["kw"].__setitem__("window_size", bad))
    for bad in (-1.0, float("nan"), "x", True):
        put(f"softcap={bad!r}", "softcap", lambda c, bad=bad: c["kw"].__setitem__("softcap", bad))
    put("alibi_slopes shape", "alibi_slopes", lambda c: c["kw"].__setitem__("alibi_slopes", torch.rand(H + 1)))
    put("alibi_slopes int", "alibi_slopes", lambda c: c["kw"].__setitem__("alibi_slopes", torch.ones(H, dtype=torch.long)))
    put("alibi_slopes inf", "alibi_slopes", lambda c: c["kw"].__setitem__("alibi_slopes", torch.full((H,), float("inf"))))
    if c["k"] is not None:
        put("rotary too short", "rotary", lambda c: c["kw"].__setitem__("rotary", (torch.rand(0, 2), torch.rand(0, 2))))
        put("rotary too wide", "rotary", lambda c: c["kw"].__setitem__(
            "rotary", (torch.rand(64, c["D"]), torch.rand(64, c["D"]))))
        put("rotary cos only", "rotary", lambda c: c["kw"].update(rotary=None, rotary_cos=torch.rand(64, 2)))
        put("rotary not a pair", "rotary", lambda c: c["kw"].__setitem__("rotary", "cos"))
        put("v head dim", "v", lambda c: c.__setitem__("v", torch.zeros(*c["v"].shape[:3], c["Dv"] + 1, dtype=c["v"].dtype)))
        put("k heads", "k", lambda c: c.__setitem__("k", torch.zeros(c["B"], c["Lnew"], c["H"] + 1, c["D"], dtype=c["k"].dtype)))
        put("v missing", "v", lambda c: c.__setitem__("v", None))
        put("k dtype", "k", lambda c: c.__setitem__("k", c["k"].double()))
        if c["dtype"] == "int8" and c["Lnew"]:
            def nan_v(c):
                c["v"] = c["v"].clone()
                c["v"][-1, -1, -1, -1] = float("nan")
            put("int8 append of a NaN", "v", nan_v)
    else:
        put("rotary without k", "rotary", lambda c: c["kw"].__setitem__("rotary", (torch.rand(64, 2), torch.rand(64, 2))))
    put("q dtype", "q", lambda c: c.__setitem__("q", c["q"].double()))
    put("q 3-D", "q", lambda c: c.__setitem__("q", c["q"][0]))
    put("q requires grad", "grad", lambda c: c.__setitem__("q", c["q"].clone().requires_grad_()))
    if c["dtype"] == "int8":
        put("mixed cache kinds", "v_cache", lambda c: c.__setitem__("v_cache", c["v_cache"].dequantize()))
    return out


def _bytes(c) -> list[torch.Tensor]:
    out = []
    for cache in (c["k_cache"], c["v_cache"]):
        for t in ((cache.data, cache.scale) if isinstance(cache, QuantizedKV) else (cache,)):
            out.append(t.detach().clone().view(torch.uint8) if t.dtype != torch.int8 else t.clone())
    return out


def run_case(seed: int, counts: collections.Counter | None = None) -> None:
    """One valid call (it must run, and write when it appends), then one breaker per seed on a fresh copy."""
    rng = random.Random(seed)
    c = _valid_call(rng, seed)
    breakers = _breakers(c)
    name = rng.choice(sorted(breakers))
    fn, arg = breakers[name]
    fn(c)
    before = _bytes(c)  # (after the breaker: it may swap a cache for another kind, never writes one)
    what = f"seed {seed}: {name} ({c['dtype']}, {'paged' if c['paged'] else 'contiguous'}, B={c['B']}, L={c['L']}, " \
           f"Lnew={c['Lnew']}, {sorted(k for k, v in c['kw'].items() if v is not None and v is not False)})"
    with torch.enable_grad():
        try:
            attnlab.attention_with_kvcache(c["q"], c["k_cache"], c["v_cache"], c["k"], c["v"], **c["kw"])
        except (ValueError, TypeError, RuntimeError) as e:
            msg = str(e)
            assert "\n" not in msg and msg.startswith("attention_with_kvcache") and arg.split("_")[0] in msg, \
                f"{what}: {type(e).__name__}: {msg}"
        else:
            raise AssertionError(f"{what}: accepted")
    after = _bytes(c)
    assert all(torch.equal(a, b) for a, b in zip(before, after)), f"{what}: the caches changed"
    if counts is not None:
        counts["rejected calls"] += 1
        counts[f"arg {arg}"] += 1
        counts[f"cache {c['dtype']} {'paged' if c['paged'] else 'contiguous'}"] += 1


def run_valid(seed: int) -> None:
    """The valid call of ``seed`` runs; with new keys, it writes them."""
    c = _valid_call(random.Random(seed), seed)
    before = _bytes(c)
    with torch.no_grad():
        attnlab.attention_with_kvcache(c["q"], c["k_cache"], c["v_cache"], c["k"], c["v"], **c["kw"])
    if c["Lnew"]:
        assert not all(torch.equal(a, b) for a, b in zip(before, _bytes(c))), f"seed {seed}: nothing appended"


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**31 - 1))
def test_a_rejected_call_writes_nothing(seed):
    run_case(seed)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**31 - 1))
def test_the_valid_calls_run(seed):
    run_valid(seed)


def test_every_argument_is_rejected_somewhere():
    counts: collections.Counter = collections.Counter()
    for seed in range(400):
        run_case(seed, counts)
    for arg in ("num_splits", "scale", "block_table", "cache_seqlens", "window_size", "softcap", "alibi_slopes",
                "rotary", "k", "v", "q", "grad"):
        assert counts[f"arg {arg}"] > 0, (arg, dict(counts))


@pytest.mark.slow
def test_kvcache_random_sweep():
    """ATTNLAB_FUZZ_SECONDS (default 30) of consecutive seeds from ATTNLAB_FUZZ_SEED (default 0)."""
    seconds = float(os.environ.get("ATTNLAB_FUZZ_SECONDS", "30"))
    seed = int(os.environ.get("ATTNLAB_FUZZ_SEED", "0"))
    counts: collections.Counter = collections.Counter()
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        run_case(seed, counts)
        run_valid(seed)
        counts["valid calls"] += 1
        seed += 1
    print(f"kvcache fuzz: {dict(sorted(counts.items()))}")
