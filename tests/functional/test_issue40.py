"""Issue 40's defects D1-D8, each reproducer as it was filed: a crash on valid input, silent wrong results, a
corrupted cache, and unhelpful errors in ``flex_attention``, ``attention_with_kvcache`` and around them.

Oracles: torch's eager ``flex_attention`` in float64 (the same math as ours, so only summation order differs:
``TOL[float64]``, atol 1e-10 / rtol 1e-9, is ~10^6 ulps of slack over an error that is a few ulps at these
sizes); for the caches, the bytes before the call (a rejected call writes nothing).
"""
from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask
from torch.nn.attention.flex_attention import flex_attention as torch_flex

import attnlab
from attnlab import patterns as P
from attnlab.functional import flex, kvcache
from attnlab.kernels import compiled as compiled_kernel
from attnlab.kernels import rates as kernel_rates
from attnlab.shapes import AttentionInputError
from helpers import TOL, assert_close

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]

F64 = TOL[torch.float64]


def _one_line(e: BaseException, *words: str) -> None:
    msg = str(e)
    assert "\n" not in msg, msg
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"


# -- D1: a band unbounded on both sides ------------------------------------------------------------------
@pytest.mark.parametrize("L", [100, 37, 129, 200])
@pytest.mark.parametrize("make", ["torch", "attnlab"])
def test_d1_a_mask_that_keeps_every_pair_runs(L, make):
    """as_band built sliding_window(left=None, right=None) for ``j >= 0`` whose edge blocks are partial:
    ValueError at every length not a multiple of 128; torch's eager flex_attention returns the result."""
    g = torch.Generator().manual_seed(L)
    # q, k, v distinct tensors: torch's flex_attention (a dynamo frame) crashed in its recompilation-reason code
    # on q, q, q after other calls in the process ('NoneType' object is not subscriptable, torch 2.13)
    q, k, v = (torch.randn(1, 1, L, 8, dtype=torch.float64, generator=g) for _ in range(3))
    keep_all = lambda b, h, i, j: j >= 0  # noqa: E731
    build = torch_block_mask if make == "torch" else P.create_block_mask
    bm = build(keep_all, None, None, L, L, device="cpu")
    with torch.no_grad():
        assert_close(attnlab.flex_attention(q, k, v, block_mask=bm), torch_flex(q, k, v, block_mask=bm), **F64,
                     what=f"L={L}")
    assert P.as_band(keep_all, L, L, 128) is not None  # proved a band: every pair


# -- D2: isolated departures are proved, not sampled -----------------------------------------------------
def _d2_inputs():
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 1, n, 8, dtype=torch.float64, generator=g) for n in (24, 40, 40))


def test_d2_a_table_of_pairs_is_not_the_identity():
    q, k, v = _d2_inputs()
    T = torch.ones(24, 40, dtype=torch.float64)
    T[7, 13] = 3.0
    sm = lambda s, b, h, i, j: s * T[i, j]  # noqa: E731
    plan = attnlab.flex_plan(q, k, v, sm)
    assert plan.path == "general", str(plan)
    assert_close(attnlab.flex_attention(q, k, v, sm), torch_flex(q, k, v, sm), **F64, what="s * T[i, j]")


def test_d2_a_where_on_one_pair_is_not_the_identity():
    q, k, v = _d2_inputs()
    sm = lambda s, b, h, i, j: torch.where((i == 7) & (j == 13), 4 * s, s)  # noqa: E731
    assert attnlab.flex_plan(q, k, v, sm).path == "general"
    assert_close(attnlab.flex_attention(q, k, v, sm), torch_flex(q, k, v, sm), **F64, what="where one pair")


def test_d2_a_bias_of_pairs_is_never_a_relative_table():
    """A bias read from a table of (q_idx, kv_idx) that is constant along every offset but one pair: the
    sampling probe read it as a table per offset; the trace sees T[q, k] and runs the kept-blocks bias."""
    q, k, v = _d2_inputs()
    i, j = torch.arange(24).view(-1, 1), torch.arange(40).view(1, -1)
    T = 0.1 * (j - i).double()
    T[7, 13] += 2.0
    sm = lambda s, b, h, qi, ki: s + T[qi, ki]  # noqa: E731
    kind = flex.classify_score_mod(sm)
    assert kind.kind == "affine" and not kind.relative, kind.reason
    assert_close(attnlab.flex_attention(q, k, v, sm), torch_flex(q, k, v, sm), **F64, what="s + T[i, j]")


def test_d2_the_classification_follows_what_the_score_mod_reads():
    """Note [Classified once per score_mod]: kept per function, made again when a captured tensor is written in
    place or a closure cell or global it reads is rebound."""
    q, k, v = _d2_inputs()
    c = torch.tensor(2.0, dtype=torch.float64)
    sm = lambda s, b, h, i, j: s * c  # noqa: E731
    assert flex.classify_score_mod(sm).factor == 2.0
    c.fill_(3.0)  # in place: its version moves
    assert flex.classify_score_mod(sm).factor == 3.0
    assert_close(attnlab.flex_attention(q, k, v, sm), torch_flex(q, k, v, sm), **F64, what="factor 3")

    cap = 20.0

    def capped(s, b, h, i, j):
        return cap * torch.tanh(s / cap)
    assert flex.classify_score_mod(capped).softcap == 20.0
    cap = 5.0  # a closure cell rebound
    assert flex.classify_score_mod(capped).softcap == 5.0
    assert_close(attnlab.flex_attention(q, k, v, capped), torch_flex(q, k, v, capped), **F64, what="cap 5")
    assert flex.classify_score_mod(capped) is flex.classify_score_mod(capped)  # kept while nothing it reads moves

    import types

    cfg = types.ModuleType("cfg")  # attributes of a module or class it reads (had been keyed by identity alone)

    class Cfg:
        factor = 1.0
    cfg.cap = 50.0

    def module_cap(s, b, h, i, j):
        return cfg.cap * torch.tanh(s / cfg.cap)

    def class_factor(s, b, h, i, j):
        return Cfg.factor * s
    assert flex.classify_score_mod(module_cap).softcap == 50.0 and flex.classify_score_mod(class_factor).factor == 1.0
    cfg.cap, Cfg.factor = 2.0, 3.0
    assert flex.classify_score_mod(module_cap).softcap == 2.0 and flex.classify_score_mod(class_factor).factor == 3.0
    for sm in (module_cap, class_factor):
        assert_close(attnlab.flex_attention(q, k, v, sm), torch_flex(q, k, v, sm), **F64, what=sm.__name__)


def test_d2_first_classification_is_cheap():
    """A trace per score_mod object, kept: the second call costs a snapshot comparison, not a trace."""
    import time

    table = torch.randn(4, 17, dtype=torch.float64)
    sm = lambda s, b, h, i, j: s + table[h, torch.clamp(i - j, -8, 8) + 8]  # noqa: E731
    t0 = time.perf_counter()
    kind = flex.classify_score_mod(sm)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(100):
        assert flex.classify_score_mod(sm) is kind
    again = (time.perf_counter() - t0) / 100
    assert kind.relative and again < first, (first, again)


# -- D3, D4, D5: nothing is written before an error --------------------------------------------------------
def _paged(seed=0):
    g = torch.Generator().manual_seed(seed)
    kp, vp = torch.zeros(4, 4, 1, 8), torch.zeros(4, 4, 1, 8)
    return (torch.randn(2, 1, 1, 8, generator=g), kp, vp, torch.ones(2, 1, 1, 8), torch.ones(2, 1, 1, 8))


@pytest.mark.parametrize("table, what", [
    (torch.tensor([[0, 2**32], [2, 3]]), "block_table[0, 1] = 4294967296"),  # D3: wrapped to page 0 before
    (torch.tensor([[0, 2**31], [2, 3]]), "block_table[0, 1] = 2147483648"),  # int32's -2^31 after the cast
    (torch.tensor([[0, 1], [7, 2]]), "block_table[1, 0] = 7"),  # D4: read only, checked after the append
    (torch.tensor([[0, 1], [7, 2]], dtype=torch.int32), "block_table[1, 0] = 7"),
    (torch.tensor([[0, -1], [2, 3]], dtype=torch.int16), "block_table[0, 1] = -1"),
])
@pytest.mark.parametrize("seqlens", [5, "tensor"])
def test_d3_d4_every_page_is_checked_before_the_append(table, what, seqlens):
    q, kp, vp, k, v = _paged()
    cs = 5 if seqlens == 5 else torch.tensor([5, 5])
    before = kp.clone(), vp.clone()
    with pytest.raises(AttentionInputError) as e:
        attnlab.attention_with_kvcache(q, kp, vp, k, v, cache_seqlens=cs, block_table=table)
    _one_line(e.value, "attention_with_kvcache", what)
    assert torch.equal(kp, before[0]) and torch.equal(vp, before[1]), "rows written before the error"


def _contiguous(B=2, S=8, H=2, D=8):
    g = torch.Generator().manual_seed(1)
    kc, vc = torch.zeros(B, S, H, D), torch.zeros(B, S, H, D)
    return torch.randn(B, 1, H, D, generator=g), kc, vc, torch.ones(B, 1, H, D), torch.ones(B, 1, H, D)


def _no_kernel(call):
    raise ValueError("no kernel reads this KV-cache view (test)")


class _SdpaRates:
    """kernel_rates.current() whose plain-decode rule says SDPA (the SDPA-on-views path of the full path)."""

    def plain_decode_on_sdpa(self, *a, **kw):
        return True


@pytest.mark.parametrize("path", ["decode", "sdpa", "fallback"])
@pytest.mark.parametrize("kw, err, words", [
    (dict(num_splits=0), AttentionInputError, "num_splits"),
    (dict(num_splits=-3), AttentionInputError, "num_splits"),
    (dict(num_splits=2.5), TypeError, "num_splits"),
    (dict(num_splits=True), TypeError, "num_splits"),
    (dict(num_splits="2"), TypeError, "num_splits"),
    (dict(scale="a"), TypeError, "scale"),
    (dict(scale=float("nan")), AttentionInputError, "scale"),
    (dict(scale=float("inf")), AttentionInputError, "scale"),
    (dict(scale=True), TypeError, "scale"),
    (dict(scale=torch.tensor(0.5)), TypeError, "scale"),
])
def test_d5_num_splits_and_scale_are_checked_on_every_path(monkeypatch, path, kw, err, words):
    if path == "sdpa":
        monkeypatch.setattr(kernel_rates, "current", lambda: _SdpaRates())
    if path == "fallback":  # no kernel reads the view: the cache is gathered into ordinary tensors
        monkeypatch.setattr(kvcache, "plan_cache", _no_kernel)
    q, kc, vc, k, v = _contiguous()
    before = kc.clone(), vc.clone()
    with pytest.raises(err) as e:
        attnlab.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=3, is_causal=False, **kw)
    _one_line(e.value, "attention_with_kvcache", words)
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1]), "rows written before the error"


def test_d5_valid_splits_and_scales_still_run(monkeypatch):
    q, kc, vc, k, v = _contiguous()
    ref = attnlab.attention_with_kvcache(q, kc.clone(), vc.clone(), k, v, cache_seqlens=3, scale=0.25)
    for kw in (dict(num_splits=1), dict(num_splits=10**9), dict(scale=0.25, num_splits=3)):
        out = attnlab.attention_with_kvcache(q, kc.clone(), vc.clone(), k, v, cache_seqlens=3, **{"scale": 0.25, **kw})
        assert_close(out, ref, **TOL[torch.float32], what=str(kw))


def test_d5_an_int8_append_writes_neither_cache_when_v_is_not_finite():
    kc, vc = kvcache.QuantizedKV.empty(2, 8, 2, 8), kvcache.QuantizedKV.empty(2, 8, 2, 8)
    q, _, _, k, v = _contiguous()
    v = v.clone()
    v[1, 0, 0, 3] = float("nan")
    before = [t.clone() for t in (kc.data, kc.scale, vc.data, vc.scale)]
    with pytest.raises(AttentionInputError) as e:
        attnlab.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=torch.tensor([1, 2]))
    _one_line(e.value, "attention_with_kvcache")
    assert all(torch.equal(a, b) for a, b in zip(before, (kc.data, kc.scale, vc.data, vc.scale)))


# -- D6: a NaN from score_mod stays in its row ------------------------------------------------------------
_NAN_TABLE = torch.zeros(40, 40, dtype=torch.float64)
_NAN_TABLE[13, 7] = float("nan")  # (q_idx 13, kv_idx 7: kept by the causal mask too)
_NAN_OFFSET = torch.zeros(80, dtype=torch.float64)
_NAN_OFFSET[45] = float("nan")


@pytest.mark.parametrize("name, sm, path", [
    ("general", lambda s, b, h, i, j: s * (1 + _NAN_TABLE[i, j]), "general"),
    ("kept-blocks bias", lambda s, b, h, i, j: s + _NAN_TABLE[i, j], "attention"),
    ("relative bias", lambda s, b, h, i, j: s + _NAN_OFFSET[i - j + 40], "attention"),
    ("nan on one key", lambda s, b, h, i, j: torch.where(j == 5, s * float("nan"), s), "general"),
])
@pytest.mark.parametrize("masked", [False, True])
def test_d6_a_nan_pair_makes_its_row_nan(name, sm, path, masked):
    """torch gives NaN in every row that keeps a NaN pair; the general path gave 0 there. A row whose NaN pair
    is masked out, and a row with no key, stay finite / 0."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 40, 8, dtype=torch.float64, generator=g) for _ in range(3))
    mm = (lambda b, h, i, j: (i >= j) & (i != 30)) if masked else None
    bm = torch_block_mask(mm, None, None, 40, 40, device="cpu", BLOCK_SIZE=16) if masked else None
    assert attnlab.flex_plan(q, k, v, sm, bm).path == path
    with torch.no_grad():
        out, lse = attnlab.flex_attention(q, k, v, sm, bm, return_lse=True)
        ref, ref_lse = torch_flex(q, k, v, sm, bm, return_lse=True)
    nan_rows = torch.isnan(ref).any(-1)
    assert bool(nan_rows.any()), "the case has no NaN row"
    assert torch.equal(torch.isnan(out).any(-1), nan_rows) and torch.equal(torch.isnan(lse), torch.isnan(ref_lse))
    fin = ~nan_rows
    assert_close(out[fin], ref[fin], **F64, what=f"{name}: the other rows")
    if masked:  # row 30 keeps no key: 0 and -inf, as before
        assert bool((out[:, :, 30] == 0).all()) and bool(torch.isneginf(lse[:, :, 30]).all())


# -- D7: a pattern never reads h -----------------------------------------------------------------------
@pytest.mark.parametrize("H", [None, 1, 3])
@pytest.mark.parametrize("mm", [
    lambda b, h, i, j: (i >= j) | (h > 5),
    lambda b, h, i, j: torch.where(h == 0, i >= j, i <= j),
    lambda b, h, i, j: (i - j) <= torch.tensor([3, 5, 7])[h],
])
def test_d7_a_pattern_whose_mask_reads_h_is_refused_up_front(H, mm):
    with pytest.raises(ValueError) as e:
        P.create_block_mask(mm, None, H, 40, 40, BLOCK_SIZE=16, output="pattern")
    _one_line(e.value, "create_block_mask", "reads h")
    bm = P.create_block_mask(mm, None, 3, 40, 40, BLOCK_SIZE=16, output="torch")  # per head: a torch BlockMask
    q, k, v = (torch.randn(1, 3, 40, 8, dtype=torch.float64) for _ in range(3))
    with torch.no_grad():
        assert_close(attnlab.flex_attention(q, k, v, block_mask=bm), torch_flex(q, k, v, block_mask=bm), **F64)


# -- D8: one line naming the function and the argument ------------------------------------------------------
@pytest.mark.parametrize("sm", [lambda s, b, h, i: s, lambda s: s, lambda s, b, h, i, j, extra: s])
def test_d8_score_mod_arity(sm):
    q = torch.randn(1, 1, 8, 4, dtype=torch.float64)
    for call in (attnlab.flex_attention, attnlab.flex_plan):
        with pytest.raises(TypeError) as e:
            call(q, q, q, sm)
        _one_line(e.value, "flex_attention", "score_mod", "5 positional arguments")


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -1.0, "1", True])
def test_d8_generate_temperature(temperature):
    from attnlab.nn import TransformerLM

    lm = TransformerLM(vocab_size=11, d_model=16, num_heads=2, num_layers=1, max_len=32)
    with pytest.raises(ValueError) as e:
        lm.generate(torch.tensor([[1, 2, 3]]), 4, temperature=temperature)
    _one_line(e.value, "generate", "temperature")


@pytest.mark.parametrize("shape", [(2**40, 2**30), (2**62, 4), (2**21, 2**21, 2**21)])
def test_d8_empty_kv_cache_checks_the_size_first(shape):
    with pytest.raises(AttentionInputError) as e:
        attnlab.empty_kv_cache(*shape)
    _one_line(e.value, "empty_kv_cache", "shape")


@pytest.mark.parametrize("width", ["1e20", "100000000000000000000", "10001"])
def test_d8_cli_refuses_absurd_widths(width, capsys):
    from attnlab.cli import main as cli

    assert cli.main(["--width", width, "list"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--width" in err[0], err


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self"), reason="needs procfs (a folder that takes no new entries)")
def test_d8_bench_decode_refuses_an_unwritable_out_before_running(monkeypatch, capsys):
    from attnlab.cli import bench_decode
    from attnlab.cli import main as cli

    def never(*a, **kw):
        raise AssertionError("the benchmark ran before --out was checked")
    monkeypatch.setattr(bench_decode, "run_decode", never)
    assert cli.main(["bench", "decode", "--quick", "--out", "/proc/x"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--out /proc/x" in err[0], err


def test_relative_path_needs_the_compiled_kernel_or_stays_exact():
    """Either way (table in the compiled kernel, or kept blocks without it), a relative bias is exact."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 33, 8, dtype=torch.float64, generator=g) for _ in range(3))
    rel = torch.randn(65, dtype=torch.float64, generator=g)
    sm = lambda s, b, h, i, j: s + rel[i - j + 32]  # noqa: E731
    plan = attnlab.flex_plan(q, k, v, sm)
    assert plan.bias == ("relative" if compiled_kernel.available() else "kept blocks")
    assert_close(attnlab.flex_attention(q, k, v, sm), torch_flex(q, k, v, sm), **F64)
    assert not math.isnan(float(attnlab.flex_attention(q, k, v, sm).sum()))
