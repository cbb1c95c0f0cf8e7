"""Calibration (Note [Calibrated rates] in attnlab.kernels.rates): measured rates cached per machine,
corrupt or foreign files ignored with one warning, and no calibration — however skewed — changes a result
beyond the chosen kernel's rounding."""
from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch

import attnlab
from attnlab import patterns as P
from attnlab import sysinfo
from attnlab.functional import calibration
from attnlab.functional.calibration import CalibrationConfig, calibrate
from attnlab.cli import main as cli
from attnlab.functional import plancache
from attnlab.kernels import rates
from attnlab import kernels
from attnlab.kernels import compiled

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def calibration_on(tmp_path, monkeypatch):
    """Calibration on, with its cache in a fresh folder; the tests' setting (off) restored afterwards. The grid's
    refusal of noisy samples is off (the test machine may be busy; Note [Tick-bound samples] has its own
    tests, with an injected clock)."""
    monkeypatch.setattr(calibration, "MAX_RATIO_SPREAD", float("inf"))
    monkeypatch.setattr(calibration, "MAX_TICK_SHARE", float("inf"))
    monkeypatch.setattr(calibration, "MIN_CPU_SHARE", 0.0)
    monkeypatch.setenv("ATTNLAB_CALIBRATION", "on")
    monkeypatch.setenv("ATTNLAB_CACHE_DIR", str(tmp_path))
    rates.reload()
    yield tmp_path
    monkeypatch.undo()
    rates.reload()


def test_off_uses_the_built_in_table():
    r = rates.current()
    assert r.source == "built-in table (ATTNLAB_CALIBRATION=off)"
    b = rates.builtin()
    assert (r.sparse_block_speed, r.compiled_block_speed, r.compiled_dense_dtypes, r.sparse_over_compiled) == \
        (b.sparse_block_speed, b.compiled_block_speed, b.compiled_dense_dtypes, b.sparse_over_compiled)
    q = torch.randn(1, 2, 16, 8)
    assert "rates: built-in table (ATTNLAB_CALIBRATION=off)" in str(attnlab.explain(q, q, q))


def test_calibrate_writes_this_machine_s_file_and_the_planner_reads_it(calibration_on):
    assert rates.current().source.startswith("built-in table")  # no file yet
    ticks = []
    cfg = CalibrationConfig(n=128, heads=2, dim=16, window=32, dtypes=(torch.float32,), rounds=1, min_sample_s=0.0)
    fitted, measured, path = calibrate(cfg, lambda *a: ticks.append(a))
    assert path == rates.cache_path() and path.parent == calibration_on and path.exists()
    assert ticks[-1][0] == ticks[-1][1] and len(ticks) == ticks[-1][1]
    doc = json.loads(path.read_text())
    assert doc["key"] == rates.machine_key() and doc["format"] == rates.FORMAT
    assert all(t > 0 for t in measured.values())
    cur = rates.current()
    assert cur.source.startswith("calibrated on this CPU") and str(path) in cur.source
    assert set(cur.sparse_block_speed) == set(rates.builtin().sparse_block_speed)
    if compiled.available():  # a size threshold for each dtype, dense and causal
        assert set(cur.compiled_dense_min_pairs) == {(torch.float32, False), (torch.float32, True)}
    from attnlab.kernels import decode

    if compiled.available() and decode.available():  # a ratio per cache length, and a fitted length, MHA and GQA
        keys = {(torch.float32, False), (torch.float32, True)}
        assert set(cur.decode_over_sdpa) == set(cur.decode_min_keys) == keys
        assert set(cur.step_over_sdpa) == set(cur.step_min_keys) == keys  # each door its crossing
        assert all(set(pts) == set(cfg.decode_ns) for pts in (*cur.decode_over_sdpa.values(),
                                                               *cur.step_over_sdpa.values()))
    assert all(s > 0 for s in (*cur.sparse_block_speed.values(), *cur.compiled_block_speed.values()))
    q = torch.randn(1, 2, 16, 8)
    assert f"rates: calibrated on this CPU" in str(attnlab.explain(q, q, q))
    assert sysinfo.collect(measure=False).calibration["source"] == cur.source


@pytest.mark.parametrize("content,why", [
    ("{not json", "Expecting property name"),
    (json.dumps({"format": 99}), "not a format-2 calibration file"),
    (json.dumps({"format": 1, "rates": {"DECODE_OVER_SDPA": {"float32 mha": 0.9}}}), "not a format-2 calibration file"),
    ("FOREIGN", "calibrated for another machine"),
    ("NEGATIVE", "speeds must be finite and > 0"),
])
def test_a_corrupt_or_foreign_file_is_ignored_with_one_warning_and_rewritten(calibration_on, content, why):
    path = rates.cache_path()
    good = rates.builtin()
    if content in ("FOREIGN", "NEGATIVE"):
        rates.save(good)
        doc = json.loads(path.read_text())
        if content == "FOREIGN":
            doc["key"]["cpu"] = "Another CPU"
        else:
            doc["rates"]["SPARSE_BLOCK_SPEED"]["64"] = -1.0
        content = json.dumps(doc)
    path.write_text(content)
    with pytest.warns(RuntimeWarning, match=why) as record:
        r = rates.reload()
        rates.current()
        q = torch.randn(1, 2, 16, 8)
        attnlab.explain(q, q, q, pattern=P.sliding_window(4))
    assert len([w for w in record if "calibration file" in str(w.message)]) == 1
    assert r.source.startswith("built-in table")
    rates.save(good)  # what the next `attnlab calibrate` does
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert rates.reload().source.startswith("calibrated on this CPU")


#: each skew makes one kernel (or block shape) the planner's fastest
SKEWS = {
    "compiled for dense": {"COMPILED_DENSE_DTYPES": ["float32", "bfloat16", "float16", "float64"]},
    "sparse over compiled": {"SPARSE_OVER_COMPILED": 1e-6},
    "compiled over sparse": {"SPARSE_OVER_COMPILED": 1e6},
    "medium compiled blocks": {"COMPILED_BLOCK_SPEED": {"64x64": 1.0, "128x128": 1e6, "128x256": 1.0,
                                                        "256x256": 1.0, "256x512": 1.0}},
    "large compiled blocks": {"COMPILED_BLOCK_SPEED": {"64x64": 1e-6, "128x128": 1e-6, "128x256": 1e-6,
                                                       "256x256": 1.0, "256x512": 1.0}},
    "large sparse blocks": {"SPARSE_BLOCK_SPEED": {"32": 1e-6, "64": 1e-6, "128": 1e-6, "256": 1.0}},
    "tiled fastest": {"KERNEL_GFLOPS": {"tiled": 1e9}},
    "dense fastest": {"KERNEL_GFLOPS": {"dense": 1e9}},
    "compiled fastest": {"KERNEL_GFLOPS": {"compiled": 1e9}},
    "decode path over sdpa": {"DECODE_OVER_SDPA": {"float32 mha": {"300": 2.0}, "float32 gqa": {"300": 2.0}},
                              "DECODE_MIN_KEYS": {"float32 mha": 0.0, "float32 gqa": 0.0}},
    "sdpa over decode path": {"DECODE_OVER_SDPA": {"float32 mha": {"300": 0.5}, "float32 gqa": {"300": 0.5}},
                              "DECODE_MIN_KEYS": {"float32 mha": None, "float32 gqa": None}},
    # the fitted length between the CALLS' two decode caches (200 and 300 keys): each side of it its own kernel
    "decode path from 250 keys": {"DECODE_OVER_SDPA": {"float32 mha": {"200": 0.8, "300": 1.2},
                                                       "float32 gqa": {"200": 0.8, "300": 1.2}},
                                  "DECODE_MIN_KEYS": {"float32 mha": 250.0, "float32 gqa": 250.0}},
}
#: the skews that change a choice without the compiled extension too
NO_EXTENSION_SKEWS = ("large sparse blocks", "tiled fastest", "dense fastest")

CALLS = [
    ((1, 2, 300, 16), torch.float32, {}),
    ((1, 2, 300, 16), torch.float32, {"is_causal": True}),
    ((1, 2, 300, 16), torch.bfloat16, {"is_causal": True}),
    ((2, 2, 333, 16), torch.float32, {"pattern": P.sliding_window(40, causal=True)}),
    ((1, 1, 2048, 8), torch.float32, {"pattern": P.fixed(64, 8)}),  # sparse by the built-in table
    ((1, 2, 300, 16), torch.float32, {"pattern": P.sliding_window(left=17, right=5), "softcap": 4.0}),
    ((1, 2, 300, 16), torch.float32, {"pattern": P.sliding_window(40, causal=True), "method": "sparse"}),
    # decode shapes (one query against 300 keys, multi-head and GQA): the decode path or SDPA
    ((1, 2, 1, 16), torch.float32, {"kv": (1, 2, 300, 16)}),
    ((1, 4, 1, 16), torch.float32, {"kv": (1, 2, 300, 16), "enable_gqa": True}),
    ((1, 2, 1, 16), torch.float32, {"kv": (1, 2, 200, 16)}),
    ((1, 4, 1, 16), torch.float32, {"kv": (1, 2, 200, 16), "enable_gqa": True}),
]

TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}


def _run_all(grad: bool):
    outs, methods = [], []
    g = torch.Generator().manual_seed(1)
    for shape, dtype, kw in CALLS:
        kw = dict(kw)
        kv = kw.pop("kv", shape)
        q, k, v = (torch.randn(*s, generator=g).to(dtype).requires_grad_(grad) for s in (shape, kv, kv))
        methods.append((attnlab.explain(q, k, v, **kw).method, attnlab.explain(q, k, v, **kw).block_size))
        out = attnlab.attention(q, k, v, **kw)
        ref = attnlab.reference.attention(q.detach().double(), k.detach().double(), v.detach().double(),
                                          is_causal=kw.get("is_causal", False), softcap=kw.get("softcap"),
                                          enable_gqa=kw.get("enable_gqa", False),
                                          attn_mask=kw["pattern"].materialize(shape[2], shape[2])
                                          if "pattern" in kw else None)[0]
        torch.testing.assert_close(out.detach().double(), torch.as_tensor(ref), **TOL[dtype])
        if grad:
            out.float().sum().backward()
            assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
        outs.append(out.detach())
    return outs, methods


@pytest.mark.parametrize("grad", [False, pytest.param(True, marks=pytest.mark.slow)])
@pytest.mark.parametrize("skew", list(SKEWS))
def test_a_skewed_calibration_changes_only_the_choice(calibration_on, skew, grad):
    _, before = _run_all(grad)
    rates.save(rates.builtin())
    path = rates.cache_path()
    doc = json.loads(path.read_text())
    doc["rates"].update(SKEWS[skew])
    path.write_text(json.dumps(doc))
    assert rates.reload().source.startswith("calibrated")
    _, after = _run_all(grad)  # each output against the float64 oracle at its dtype's tolerance
    if (compiled.available() or skew in NO_EXTENSION_SKEWS) and not (grad and "decode" in skew):  # autograd: no decode
        assert after != before, f"{skew}: the skew changed no choice, so the test checks nothing"


def test_plans_cached_under_old_rates_are_forgotten(calibration_on):
    q = torch.randn(1, 2, 16, 8)
    attnlab.attention(q, q, q)
    assert plancache.stats()["entries"] >= 1
    rates.save(rates.builtin())
    assert plancache.stats()["entries"] == 0


def test_least_pairs_is_where_the_fitted_speed_ratio_crosses_the_margin():
    from attnlab.functional.calibration import MARGIN, _least_pairs

    # ratio = MARGIN * (pairs / 4e6) ** 0.5: crosses the margin at exactly 4e6 pairs, dense and causal alike
    pts = [(p, MARGIN * (p / 4e6) ** 0.5) for p in (1e6, 4e6, 16e6) for _ in range(2)]
    assert _least_pairs(pts) == pytest.approx(4e6)
    assert _least_pairs([(1e6, 1.5), (16e6, 1.6)]) == 1e6  # wins over the whole grid: from its smallest size
    assert _least_pairs([(1e6, 2.0), (16e6, 0.9)]) is None  # loses at the largest size, falling: never
    # rising but under the margin at the largest size (Note [One size past the grid]): the line's crossing, kept
    # up to EXTRAPOLATE_PAIRS times the largest pairs, not further
    from attnlab.functional.calibration_grid import EXTRAPOLATE_PAIRS

    rising = [(p, MARGIN * (p / 32e6) ** 0.25) for p in (2e6, 8e6, 16e6)]  # crosses at 32e6, 2x the largest
    assert _least_pairs(rising) == pytest.approx(32e6)
    far = 16e6 * EXTRAPOLATE_PAIRS * 2
    assert _least_pairs([(p, MARGIN * (p / far) ** 0.25) for p in (2e6, 8e6, 16e6)]) is None
    assert _least_pairs([(1e6, 0.5), (4e6, 3.0), (16e6, 1.2)]) is not None  # one noisy size moves the line only
    assert _least_pairs([(p, MARGIN * (p / 16e6)) for p in (1e6, 4e6, 16e6)]) == pytest.approx(16e6)  # just there


def test_the_size_threshold_round_trips_and_decides_by_size(calibration_on):
    b = rates.builtin()
    least = {(torch.bfloat16, False): 1e6, (torch.bfloat16, True): None, (torch.float32, False): 0.0}
    fitted = rates.Rates(b.sparse_block_speed, b.compiled_block_speed, (torch.float16,), b.sparse_over_compiled,
                         "calibrated on this CPU", compiled_dense_min_pairs=least)
    rates.save(fitted)
    cur = rates.current()
    assert cur.compiled_dense_min_pairs == least
    assert not cur.compiled_dense_wins(torch.bfloat16, 10**6 - 1) and cur.compiled_dense_wins(torch.bfloat16, 10**6)
    assert not cur.compiled_dense_wins(torch.bfloat16, 10**12, causal=True)  # None: never
    assert cur.compiled_dense_wins(torch.float32, 1)
    assert cur.compiled_dense_wins(torch.float16, 1) and not cur.compiled_dense_wins(torch.float64, 10**12)  # no
    # threshold fitted: the dtype list decides, as in a file written before the threshold was fitted
    doc = json.loads(rates.cache_path().read_text())
    del doc["rates"]["COMPILED_DENSE_MIN_PAIRS"]
    rates.cache_path().write_text(json.dumps(doc))
    cur = rates.reload()
    assert cur.source.startswith("calibrated") and cur.compiled_dense_min_pairs == {}
    assert cur.compiled_dense_wins(torch.float16, 1) and not cur.compiled_dense_wins(torch.bfloat16, 10**12)
    doc["rates"]["COMPILED_DENSE_MIN_PAIRS"] = {"bfloat16 sideways": 1.0}
    rates.cache_path().write_text(json.dumps(doc))
    with pytest.warns(RuntimeWarning, match="COMPILED_DENSE_MIN_PAIRS keys"):
        assert rates.reload().source.startswith("built-in")


def test_an_isa_cap_is_another_machine(calibration_on, monkeypatch):
    """ONEDNN_MAX_CPU_ISA=AVX2 runs other kernels: its calibration has its own file, and the default key is
    unchanged by the variables being unset (all of them: a run under ATTNLAB_EXT_GEMM=mkl has one set)."""
    for name in rates.ISA_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    plain = rates.machine_key()
    assert "env" not in plain
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    capped = rates.machine_key()
    assert capped["env"] == {"ONEDNN_MAX_CPU_ISA": "AVX2"} and rates.cache_path(capped) != rates.cache_path(plain)


def test_measured_kernel_rates_and_decode_ratios_round_trip_and_decide(calibration_on):
    """KERNEL_GFLOPS replaces a kernel's built-in rate (its source is then the calibration); DECODE_MIN_KEYS
    decides plain decode per (dtype, heads) by the cache length, and a key it lacks keeps Note [Plain MHA
    decode]'s default."""
    b = rates.builtin()
    assert b.plain_decode_on_sdpa(torch.float32, False, 4096) and not b.plain_decode_on_sdpa(torch.float32, True, 4096)
    assert not b.plain_decode_on_sdpa(torch.bfloat16, False, 4096)
    points = {(torch.float32, False): {2048: 0.9, 4096: 1.1, 8192: 1.25}, (torch.bfloat16, True): {2048: 0.5}}
    least = {(torch.float32, False): 3000.0, (torch.bfloat16, True): None, (torch.float16, False): 0.0}
    step_points, step_least = {(torch.float32, False): {2048: 1.2, 4096: 1.3}}, {(torch.float32, False): 0.0}
    fitted = dataclasses.replace(b, source="calibrated on this CPU", kernel_gflops={"tiled": 123.0, "dense": 4.5},
                                 decode_over_sdpa=points, decode_min_keys=least, step_over_sdpa=step_points,
                                 step_min_keys=step_least)
    rates.save(fitted)
    cur = rates.current()
    assert cur.kernel_gflops == {"tiled": 123.0, "dense": 4.5}
    assert cur.decode_over_sdpa == points and cur.decode_min_keys == least
    assert cur.step_over_sdpa == step_points and cur.step_min_keys == step_least
    # Note [Each door its crossing]: the steps by their own length where measured, else by attention's
    assert not cur.plain_decode_on_sdpa(torch.float32, False, 2999, step=True)
    assert "the decode path at every length" in cur.decode_evidence(torch.float32, False, 2500, step=True)
    assert cur.plain_decode_on_sdpa(torch.bfloat16, True, 10**6, step=True)
    assert cur.plain_decode_on_sdpa(torch.float32, False, 2999)  # under the fitted length: SDPA is faster
    assert not cur.plain_decode_on_sdpa(torch.float32, False, 3000)  # from it on: the decode path
    assert cur.plain_decode_on_sdpa(torch.bfloat16, True, 10**6)  # None: SDPA at every length
    assert not cur.plain_decode_on_sdpa(torch.float16, False, 1)  # 0: the decode path at every length
    assert not cur.plain_decode_on_sdpa(torch.float32, True, 100)  # not measured: the built-in default
    assert "0.90x at S = 2048, the length nearest 2500" in cur.decode_evidence(torch.float32, False, 2500)
    assert "from S = 3000" in cur.decode_evidence(torch.float32, False, 2500)
    assert cur.decode_evidence(torch.float32, True, 2500) is None
    q = torch.randn(1, 2, 64, 8)
    plan = attnlab.explain(q, q, q)
    assert plan.rate_sources["tiled"] == cur.source and plan.rate_sources["dense"] == cur.source
    assert plan.seconds["tiled"] == pytest.approx(plan.flops["tiled"] / 123e9)
    assert plan.rate_sources["sdpa"] == kernels.kernel.BUILTIN_SOURCE  # not measured: its built-in gflops
    for bad in ({"KERNEL_GFLOPS": {"tiled": -1.0}}, {"DECODE_OVER_SDPA": {"float32 both": {"64": 1.0}}},
                {"DECODE_OVER_SDPA": {"float32 mha": {"64": 0.0}}}, {"DECODE_OVER_SDPA": {"float32 mha": {"0": 1.0}}},
                {"DECODE_OVER_SDPA": {"float32 mha": 1.0}}, {"DECODE_MIN_KEYS": {"float32 mha": -1.0}},
                {"DECODE_MIN_KEYS": {"bfloat16 all": 1.0}}):
        doc = json.loads(rates.cache_path().read_text())
        doc["rates"].update(bad)
        rates.cache_path().write_text(json.dumps(doc))
        with pytest.warns(RuntimeWarning, match="ignoring the calibration file"):
            assert rates.reload().source.startswith("built-in")
        rates.save(fitted)


def test_explain_says_which_measured_decode_ratio_at_which_length_decided(calibration_on):
    """Note [Plain MHA decode]: a plain decode call goes to SDPA under the fitted cache length and to the decode
    path from it, and explain quotes the ratio measured at the nearest length either way."""
    from attnlab.kernels import decode

    if not (compiled.available() and decode.available()):
        pytest.skip("the decode extension is not built")
    b = rates.builtin()
    rates.save(dataclasses.replace(b, source="calibrated on this CPU",
                                   decode_over_sdpa={(torch.float32, False): {256: 0.8, 1024: 1.3}},
                                   decode_min_keys={(torch.float32, False): 500.0}))
    q = torch.randn(1, 2, 1, 16)
    short, long = torch.randn(1, 2, 300, 16), torch.randn(1, 2, 900, 16)
    plan = attnlab.explain(q, short, short)
    assert plan.method == "sdpa" and "SDPA faster at S = 300" in plan.reason
    assert "0.80x at S = 256, the length nearest 300" in plan.reason and "from S = 500" in plan.reason
    plan = attnlab.explain(q, long, long)
    assert plan.method == "decode" and plan.decode and "1.30x at S = 1024, the length nearest 900" in plan.reason
    torch.testing.assert_close(attnlab.attention(q, long, long), attnlab.attention(q, long, long, method="sdpa"),
                               rtol=2e-5, atol=2e-5)


def test_least_keys_is_where_the_fitted_decode_ratio_crosses_the_margin():
    """Note [SDPA keeps decode by a margin]: the decode path takes plain decode from where SDPA's time over its
    own, on the fitted line, reaches 1 / DECODE_MARGIN."""
    from attnlab.functional.calibration import _least_keys
    from attnlab.functional.calibration_grid import DECODE_MARGIN

    # ratio = (S / 3000) ** 0.3 / DECODE_MARGIN: reaches 1 / DECODE_MARGIN at exactly 3000 keys
    assert _least_keys([(n, (n / 3000) ** 0.3 / DECODE_MARGIN) for n in (2048, 4096, 8192)]) == pytest.approx(3000)
    # wins at every length measured: every length (the line is not extrapolated below the shortest)
    assert _least_keys([(n, (n / 500) ** 0.3) for n in (2048, 4096, 8192)]) == 0.0
    assert _least_keys([(2048, 0.7), (8192, 0.9)]) is None  # SDPA more than the margin faster at the longest: never
    assert _least_keys([(2048, 1.5), (8192, 1.2)]) == 0.0  # wins at the longest and more below: everywhere
    assert _least_keys([(64, 1.1)]) == 0.0 and _least_keys([(64, 0.9)]) is None  # one length: its verdict
    tie = 1 / DECODE_MARGIN ** 0.5  # SDPA faster, but by less than the margin: the decode path
    assert _least_keys([(64, tie)]) == 0.0 and _least_keys([(2048, tie), (4096, tie), (8192, tie)]) == 0.0
    # the probe of Note [Plain MHA decode]: one noisy length moves the line, not the verdict at the others
    least = _least_keys([(2048, 0.85), (4096, 1.28), (8192, 1.12)])  # (SDPA over the margin faster at 2048)
    assert 1024 < least < 4096


def test_the_measured_size_threshold_sends_small_plain_calls_to_sdpa(calibration_on):
    """Where the calibration fitted a size threshold, a plain call below it goes to SDPA even when the
    compiled kernel's measured rate predicts it faster (the threshold holds its per-call overhead)."""
    if not compiled.available():
        pytest.skip("the compiled extension is not built")
    b = rates.builtin()
    rates.save(dataclasses.replace(b, source="calibrated on this CPU", kernel_gflops={"compiled": 1e9},
                                   compiled_dense_min_pairs={(torch.float32, False): 1e6, (torch.float32, True): 1e6}))
    small, large = torch.randn(1, 2, 64, 8), torch.randn(1, 4, 512, 8)  # 8192 and 1048576 pairs
    plan = attnlab.explain(small, small, small)
    assert plan.method == "sdpa" and "measured size threshold" in plan.reason
    assert plan.seconds["compiled"] < plan.seconds["sdpa"]  # what the threshold overrides
    assert attnlab.explain(large, large, large).method == "compiled"
    assert attnlab.explain(small, small, small, is_causal=True).method == "sdpa"


def test_a_ratio_is_the_median_of_per_round_ratios():
    """Note [Calibration against the sweep]: the two kernels of a round are timed back to back, so a load
    change between rounds cancels in their ratio and not in the ratio of their medians."""
    from attnlab.functional.calibration import _ratio
    from attnlab.timing import Timing

    t = {"a": Timing(), "b": Timing()}
    t["a"].times, t["b"].times = [1.0, 1.0, 10.0], [0.5, 10.0, 5.0]  # round 2: b alone under load
    assert _ratio(t, "a", "b") == pytest.approx(2.0)  # medians would say 1.0 / 5.0
    t["a"].times, t["b"].times = [1.0, 4.0], [1.0, 1.0]
    assert _ratio(t, "a", "b") == pytest.approx(2.0)  # even rounds: the geometric mean of the middle two


def test_the_calibration_fits_each_mask_kind_and_gqa_apart(calibration_on):
    """Note [Calibration against the sweep]: dense, causal, MHA and GQA each get their own size threshold."""
    if not compiled.available():
        pytest.skip("the compiled extension is not built")
    cfg = CalibrationConfig(n=128, heads=4, dim=16, window=32, dense_ns=(64,), dtypes=(torch.float32,), rounds=1,
                            min_sample_s=0.0, decode_ns=(64,))
    fitted, measured, _ = calibrate(cfg, save=False)
    keys = {(torch.float32, False), (torch.float32, True)}
    assert set(fitted.compiled_dense_min_pairs) == keys and set(fitted.compiled_gqa_min_pairs) == keys
    assert "sdpa causal float32 gqa n=64" in measured and "compiled dense float32 gqa n=128" in measured


def test_the_gqa_size_threshold_round_trips_and_decides_gqa_calls(calibration_on):
    """A GQA call follows COMPILED_GQA_MIN_PAIRS, an MHA call of the same pairs COMPILED_DENSE_MIN_PAIRS, and
    explain says which; a file without the GQA field (written before it) decides GQA by the MHA threshold."""
    if not compiled.available():
        pytest.skip("the compiled extension is not built")
    b = rates.builtin()
    mha, gqa = {(torch.float32, False): None, (torch.float32, True): None}, {(torch.float32, False): 1e5,
                                                                            (torch.float32, True): None}
    rates.save(dataclasses.replace(b, source="calibrated on this CPU", compiled_dense_min_pairs=mha,
                                   compiled_gqa_min_pairs=gqa))
    cur = rates.current()
    assert cur.compiled_gqa_min_pairs == gqa and cur.compiled_dense_min_pairs == mha
    q, kv = torch.randn(1, 4, 256, 16), torch.randn(1, 1, 256, 16)  # 262144 pairs
    qm = torch.randn(1, 4, 256, 16)
    plan = attnlab.explain(q, kv, kv, enable_gqa=True)
    assert plan.method == "compiled" and "GQA" in plan.reason
    assert attnlab.explain(q, kv, kv, enable_gqa=True, is_causal=True).method == "sdpa"
    plan = attnlab.explain(qm, qm, qm)
    assert plan.method == "sdpa" and "GQA" not in plan.reason
    doc = json.loads(rates.cache_path().read_text())
    del doc["rates"]["COMPILED_GQA_MIN_PAIRS"]
    rates.cache_path().write_text(json.dumps(doc))
    assert rates.reload().compiled_gqa_min_pairs == {}
    assert attnlab.explain(q, kv, kv, enable_gqa=True).method == "sdpa"


# -- Note [Tick-bound samples]: a busy machine's samples are refused, with an injected clock ---------------------
def _tick_clock(tick_s=calibration.TICK_S):
    """A clock that reads whole scheduler ticks, as a call does under a load above the core count."""
    import math
    import time

    return lambda: math.floor(time.perf_counter() / tick_s) * tick_s


def _jitter_clock():
    """A clock that jumps by up to 20 ms now and then, as a call that waits for a descheduled thread."""
    import random
    import time

    rng, skew = random.Random(0), [0.0]

    def clock():
        skew[0] += rng.choice((0.0, 0.0, 0.02)) * rng.random()
        return time.perf_counter() + skew[0]
    return clock


QUICK = CalibrationConfig(n=64, heads=2, plain_heads=2, gqa_kv_heads=1, dim=16, window=16, dense_ns=(32,),
                          dtypes=(torch.float32,), rounds=5, min_sample_s=0.002, decode_ns=(64,), decode_heads=4)


@pytest.mark.parametrize("clock, why", [(_tick_clock(), "scheduler ticks|read 0 s"), (_jitter_clock(), "scatter")])
def test_tick_bound_or_scattered_samples_are_refused_and_nothing_is_written(calibration_on, monkeypatch, clock, why):
    monkeypatch.setattr(calibration, "MAX_RATIO_SPREAD", 0.25)
    monkeypatch.setattr(calibration, "MAX_TICK_SHARE", 0.6)
    monkeypatch.setattr(calibration, "CLOCK", clock)
    with pytest.raises(calibration.TooNoisy, match=f"too busy to calibrate .*({why}).*nothing written"):
        calibrate(QUICK)
    assert not rates.cache_path().exists() and rates.current().source.startswith("built-in")


def test_a_process_starved_of_its_cores_is_refused(calibration_on, monkeypatch):
    """A step whose process got a fifth of its cores' time (the CPU clock runs at a fifth of the wall clock)."""
    import time

    monkeypatch.setattr(calibration, "MIN_CPU_SHARE", 0.5)
    monkeypatch.setattr(calibration, "CPU_CLOCK", lambda: time.perf_counter() * 0.2)
    with pytest.raises(calibration.TooNoisy, match=r"too busy to calibrate .*got 20% of 1 cores' time"):
        calibrate(dataclasses.replace(QUICK, min_sample_s=0.02))
    assert not rates.cache_path().exists()


def test_the_checks_on_made_up_samples():
    """The checks themselves, on made-up samples: quiet ones pass, whole ticks and scattered ratios do not."""
    from attnlab.functional.calibration import _ratio_spread, _tick_bound
    from attnlab.timing import Timing

    def timing(times, k=1):
        return Timing(list(times), calls_per_sample=k)

    quiet = {"a": timing([0.05013, 0.05121, 0.04987, 0.05077, 0.05230]),
             "b": timing([0.0431, 0.0447, 0.0452, 0.0429, 0.0441])}
    assert _tick_bound(quiet, "quiet") is None and _ratio_spread(quiet, "a", "b") < 0.1
    ticks = {"a": timing([0.008, 0.008, 0.008004, 0.016], k=6), "b": timing([0.008, 0.008003, 0.008, 0.008], k=6)}
    assert "8 of 8 samples are whole 4 ms scheduler ticks" in _tick_bound(ticks, "ticks")
    long = {n: timing([0.2, 0.204, 0.2, 0.208]) for n in "ab"}  # 50 ticks: one more or less is 2 %
    assert _tick_bound(long, "long") is None
    assert "read 0 s" in _tick_bound({"a": timing([0.0, 0.004])}, "zero")
    scattered = {"a": timing([0.01, 0.02, 0.01, 0.03, 0.01]), "b": timing([0.02, 0.01, 0.01, 0.01, 0.03])}
    assert _ratio_spread(scattered, "a", "b") > calibration.MAX_RATIO_SPREAD


def test_cli_calibrate_on_a_busy_machine_says_so_and_exits_1(calibration_on, monkeypatch, capsys):
    monkeypatch.setattr(calibration, "MAX_TICK_SHARE", 0.6)
    monkeypatch.setattr(calibration, "CLOCK", _tick_clock())
    monkeypatch.setattr(calibration, "CalibrationConfig", lambda n, heads: dataclasses.replace(QUICK, n=n, heads=heads))
    outcome = cli.invoke(["calibrate", "--n", "64", "--heads", "1", "--no-progress", "--json"])
    err = capsys.readouterr().err.strip().splitlines()
    assert outcome.exit_code == 1 and len(err) == 1 and err[0].startswith("attnlab calibrate: the machine is too busy")
    assert not rates.cache_path().exists()


def test_cli_calibrate_json_lists_every_fitted_entry(calibration_on, monkeypatch, capsys):
    monkeypatch.setattr(calibration, "CalibrationConfig",
                        lambda n, heads: dataclasses.replace(QUICK, n=n, heads=heads, rounds=1, min_sample_s=0.0))
    outcome = cli.invoke(["calibrate", "--n", "64", "--heads", "2", "--no-progress", "--json"])
    assert outcome.exit_code == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["path"] == str(rates.cache_path()) and outcome.result["path"].exists()
    assert set(rates.RATE_NAMES) <= set(printed) and "COMPILED_GQA_MIN_PAIRS" in rates.RATE_NAMES
    saved = json.loads(rates.cache_path().read_text())["rates"]
    assert all(printed[name] == saved[name] for name in rates.RATE_NAMES)
    if compiled.available():
        assert set(printed["COMPILED_GQA_MIN_PAIRS"]) == {"float32 dense", "float32 causal"}


@pytest.mark.skipif(kernels.DECODE.unavailable_reason() is not None, reason="no decode extension here")
def test_decode_ratios_are_measured_per_door():
    """Note [Each door its crossing]: step 6 times each door's plain decode call, attention()'s prepared one and the
    KV-cache steps, each call once per round (called for real, so the calls run), and keeps each door's ratio. The
    timings are replaced by known ones: SDPA over decode is 0.5 at attention's door and 2.0 for the steps at every
    length, and the fitted crossings send attention's calls to SDPA and the steps to the decode path."""
    from attnlab.functional.calibration_grid import _decode_ratios
    from attnlab.timing import Timing

    seen = []

    def timed(calls):
        for f in calls.values():
            assert f() is not None  # every timed call runs, the steps included
        seen.append(sorted(calls))
        out = {}
        for name in calls:  # decode 1 ms; SDPA 0.5 ms at attention's door, 2 ms as a step
            t = 1e-3 if name.startswith("decode") else (2e-3 if " step " in name else 0.5e-3)
            out[name] = Timing(times=[t, t * 1.01, t])
        return out

    cfg = CalibrationConfig(decode_ns=(64, 128), dtypes=(torch.float32,))
    calls, steps = _decode_ratios(cfg, timed, lambda *a: None)
    assert set(calls) == set(steps) == {(torch.float32, False), (torch.float32, True)}
    for pts, want in ((p, 0.5) for p in calls.values()):
        assert set(pts) == {64, 128} and all(abs(x - want) < 1e-9 for x in pts.values())
    for pts in steps.values():
        assert set(pts) == {64, 128} and all(abs(x - 2.0) < 1e-9 for x in pts.values())
    from attnlab.functional.calibration_grid import _least_keys

    r = dataclasses.replace(rates.builtin(), decode_over_sdpa=calls, step_over_sdpa=steps,
                            decode_min_keys={k: _least_keys(list(p.items())) for k, p in calls.items()},
                            step_min_keys={k: _least_keys(list(p.items())) for k, p in steps.items()})
    for gqa in (False, True):
        assert r.plain_decode_on_sdpa(torch.float32, gqa, 96) and not r.plain_decode_on_sdpa(torch.float32, gqa, 96,
                                                                                              step=True)
    assert any(n.startswith("decode step ") for n in seen[0]) and any(n.startswith("sdpa step ") for n in seen[0])
