"""Smoke run of `attnlab bench decode` at toy size: its output file and content, never its timings."""
from __future__ import annotations

import json

import pytest
import torch
from rich.cells import cell_len

from attnlab.bench import decode as bench_decode
from attnlab.cli import main as cli
from attnlab.kernels import decode as dk


@pytest.mark.skipif(not dk.available(), reason=f"decode extension: {dk.unavailable_reason()}")
def test_bench_decode_toy(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    code = cli.main(["bench", "decode", "--seq-lens", "100,300", "--dtypes", "float32,bfloat16", "--heads", "mqa,mha",
                     "--layouts", "contiguous,paged16", "--batches", "1,2", "--rounds", "1", "--bandwidth-mib", "8", "--threads", "1",
                     "--out", str(tmp_path)])
    assert code == 0
    data = json.loads((tmp_path / "decode.json").read_text())
    rows = data["rows"]
    assert len(rows) == 2 * 2 * 2 * 2 * 2 and all(r["correct"] for r in rows)
    for r in rows:
        H, Hkv, D = bench_decode.HEADS[r["heads"]]
        assert r["kv_bytes"] == r["B"] * Hkv * r["S"] * 2 * D * (4 if r["dtype"] == "float32" else 2)
        assert r["speedup"] == pytest.approx(r["sdpa_ms"] / r["attnlab_ms"])
        assert r["attnlab_over_bound"] == pytest.approx(r["attnlab_ms"] / r["memory_bound_ms"])
    assert (tmp_path / "decode.png").stat().st_size > 0
    # the table fits 80 columns with nothing elided (it once printed "he…", "fl…": Note [Tables that fit])
    out = capsys.readouterr().out
    assert "…" not in out and max(cell_len(ln) for ln in out.splitlines()) <= 80
    for word in ("heads", "layout", "bfloat16", "contiguous", "paged16", "speedup"):
        assert word in out


def test_bench_decode_bad_arguments(tmp_path):
    assert cli.main(["bench", "decode", "--heads", "gqa,xyz", "--out", str(tmp_path)]) == 2
    assert cli.main(["bench", "decode", "--layouts", "pagedX", "--out", str(tmp_path)]) == 2
    assert cli.main(["bench", "decode", "--dtypes", "int8g16", "--out", str(tmp_path)]) == 2


@pytest.mark.skipif(not dk.available(), reason=f"decode extension: {dk.unavailable_reason()}")
def test_bench_decode_int8_and_layout_targets(tmp_path):
    """--dtypes int8 measures the int8 cache (1 byte an element + two float32 scales a row, checked against
    SDPA on the dequantised values), int8g32 the group-scaled one (a float32 scale per 32 channels, paged
    too); the targets compare paged with contiguous and each int8 format with bf16."""
    code = cli.main(["bench", "decode", "--seq-lens", "32768", "--dtypes", "bfloat16,int8,int8g32", "--heads", "mqa",
                     "--layouts", "contiguous,paged64", "--batches", "1", "--rounds", "1", "--bandwidth-mib", "8",
                     "--threads", "1", "--out", str(tmp_path)])
    assert code == 0
    data = json.loads((tmp_path / "decode.json").read_text())
    rows = {(r["dtype"], r["layout"]): r for r in data["rows"]}
    assert all(r["correct"] for r in rows.values())
    assert rows["int8", "contiguous"]["kv_bytes"] == 32768 * (2 * 128 + 8)
    assert rows["int8g32", "contiguous"]["kv_bytes"] == 32768 * 2 * (128 + 4 * 4)
    targets = {t["case"]: t for t in data["targets"]}
    paged = targets["mqa S=32768 int8 B=1 paged64 vs contiguous"]
    assert paged["paged_over_contiguous"] == pytest.approx(rows["int8", "paged64"]["attnlab_ms"]
                                                           / rows["int8", "contiguous"]["attnlab_ms"])
    for name in ("int8", "int8g32"):
        i8 = targets[f"mqa S=32768 {name} vs bf16 B=1 contiguous"]
        assert i8["int8_over_bf16"] == pytest.approx(rows[name, "contiguous"]["attnlab_ms"]
                                                     / rows["bfloat16", "contiguous"]["attnlab_ms"])


@pytest.mark.skipif(not dk.available(), reason=f"decode extension: {dk.unavailable_reason()}")
def test_bench_decode_probe_before_every_timed_call(tmp_path, monkeypatch):
    """Note [Decode bench cold cache]: each timed call (attnlab's or SDPA's) follows a bandwidth probe, so no
    call reads K/V the other one of its round left in the caches."""
    events = []
    probe, call = bench_decode._bandwidth_once, bench_decode.decode_kernel_call
    sdpa = bench_decode.F.scaled_dot_product_attention

    class _F:  # bench_decode's F with SDPA's calls recorded
        @staticmethod
        def scaled_dot_product_attention(*a, **kw):
            events.append("sdpa")
            return sdpa(*a, **kw)

    monkeypatch.setattr(bench_decode, "_bandwidth_once", lambda buf: events.append("probe") or probe(buf))
    monkeypatch.setattr(bench_decode, "decode_kernel_call", lambda *a: events.append("mine") or call(*a))
    monkeypatch.setattr(bench_decode, "F", _F)
    res = bench_decode.run(bench_decode.DecodeConfig(out=str(tmp_path), seq_lens=(64,), dtypes=("float32",),
                                                     heads=("mqa",), batches=(1,), layouts=("contiguous",), rounds=3,
                                                     bandwidth_mib=1, threads=1))
    assert res.exit_code == 0 and len(res.rows) == 1
    # the untimed check (attnlab, SDPA, SDPA in float64), then 3 rounds alternating who goes first
    assert events == ["mine", "sdpa", "sdpa"] + ["probe", "mine", "probe", "sdpa", "probe", "sdpa", "probe", "mine",
                                                 "probe", "mine", "probe", "sdpa"]


@pytest.mark.skipif(not dk.available(), reason=f"decode extension: {dk.unavailable_reason()}")
def test_bench_decode_caches_share_one_storage(tmp_path, monkeypatch):
    """The contiguous and the paged caches both come from empty_kv_cache (like with like: Note [KV cache on huge
    pages]), and decode.json records the storage and each row's huge-page share."""
    from attnlab.functional import storage

    shapes = []
    real = bench_decode.empty_kv_cache

    def counting(*shape, **kw):
        shapes.append(shape)
        return real(*shape, **kw)

    monkeypatch.setattr(bench_decode, "empty_kv_cache", counting)
    code = cli.main(["bench", "decode", "--seq-lens", "100", "--dtypes", "float32", "--heads", "mqa",
                     "--layouts", "contiguous,paged16", "--batches", "1", "--rounds", "1", "--bandwidth-mib", "8",
                     "--threads", "1", "--out", str(tmp_path)])
    assert code == 0
    H, Hkv, D = bench_decode.HEADS["mqa"]
    assert shapes.count((1, Hkv, 100, D)) == 2  # k and v, once: both layouts' cases share them and their rounds
    assert shapes.count((7, 16, Hkv, D)) == 2  # the paged pools: ceil(100 / 16) pages
    data = json.loads((tmp_path / "decode.json").read_text())
    assert data["storage"]["huge_pages_available"] == storage.huge_pages_available()
    assert data["storage"]["transparent_hugepage"] == storage.transparent_hugepage_mode()
    for r in data["rows"]:
        assert r["huge_pages_fraction"] is None or 0 <= r["huge_pages_fraction"] <= 1


def test_bench_decode_int8_cache_is_laid_out_like_the_others():
    """The int8 case compares with the bf16 case like with like: its data and scales sit in [B, Hkv, S, ·]
    storage seen as [B, S, Hkv, ·] (the other dtypes' contiguous cache), so the kernel reads it with the
    same head span and splits; and it holds the quantised rows of the keys it was given."""
    from attnlab.functional.kvcache import QuantizedKV

    gen = torch.Generator().manual_seed(0)
    B, S, Hkv, D = 2, 50, 3, 16
    x = torch.randn(B, Hkv, S, D, generator=gen).transpose(1, 2)
    c = bench_decode._quantized_cache(x)
    want = QuantizedKV.quantize(x)
    assert torch.equal(c.data, want.data) and torch.equal(c.scale, want.scale)
    assert c.data.stride() == x.stride() == (Hkv * S * D, D, S * D, 1)
    assert c.scale.stride() == (Hkv * S, 1, S)
    if dk.available():
        assert dk.head_span(c.data) == dk.head_span(x) == 1


def _recording(monkeypatch, events):
    """bench_decode with each timed call recorded: ("probe",), ("mine", dtype, paged?) or ("sdpa", dtype)."""
    probe, call = bench_decode._bandwidth_once, bench_decode.decode_kernel_call
    sdpa = bench_decode.F.scaled_dot_product_attention

    class _F:
        @staticmethod
        def scaled_dot_product_attention(q, *a, **kw):
            events.append(("sdpa", q.dtype))
            return sdpa(q, *a, **kw)

    monkeypatch.setattr(bench_decode, "_bandwidth_once", lambda buf: events.append(("probe",)) or probe(buf))
    monkeypatch.setattr(bench_decode, "decode_kernel_call",
                        lambda q, k, v, table, S: events.append(("mine", q.dtype, table is not None)) or call(q, k, v, table, S))
    monkeypatch.setattr(bench_decode, "F", _F)


@pytest.mark.skipif(not dk.available(), reason=f"decode extension: {dk.unavailable_reason()}")
def test_bench_decode_cases_of_one_shape_share_rounds(tmp_path, monkeypatch):
    """Note [Decode bench round groups]: every dtype and layout of one (heads, S, B) is timed in the same
    rounds, each call after its own probe, the order rotated by one each round; the ratio targets say so."""
    events = []
    _recording(monkeypatch, events)
    f32, b16 = torch.float32, torch.bfloat16
    res = bench_decode.run(bench_decode.DecodeConfig(out=str(tmp_path), seq_lens=(64,), dtypes=("float32", "bfloat16"),
                                                     heads=("mqa",), batches=(1,), layouts=("contiguous", "paged16"),
                                                     rounds=7, bandwidth_mib=1, threads=1))
    assert res.exit_code == 0 and len(res.rows) == 4
    assert len({r["round_group"] for r in res.rows}) == 1 and all(r["calls_per_round"] == 6 for r in res.rows)
    calls = [("mine", f32, False), ("mine", f32, True), ("sdpa", f32), ("mine", b16, False), ("mine", b16, True),
             ("sdpa", b16)]
    timed = events[events.index(("probe",)):]
    assert timed[0::2] == [("probe",)] * 42
    assert timed[1::2] == sum((calls[r % 6:] + calls[:r % 6] for r in range(7)), [])
    assert all(t["side_by_side"] for t in res.targets if "paged_over_contiguous" in t)


@pytest.mark.skipif(not dk.available(), reason=f"decode extension: {dk.unavailable_reason()}")
def test_bench_decode_splits_a_group_past_its_memory(tmp_path, monkeypatch):
    """A (heads, S, B) whose caches pass GROUP_BYTES_LIMIT is split in order into groups that fit; a target
    across two groups is marked not side by side."""
    H, Hkv, D = bench_decode.HEADS["mqa"]
    one = bench_decode.decode_kernel.kv_bytes(1, Hkv, 64, D, D, torch.float32)
    monkeypatch.setattr(bench_decode, "GROUP_BYTES_LIMIT", one)  # room for SDPA's K/V and no pool
    res = bench_decode.run(bench_decode.DecodeConfig(out=str(tmp_path), seq_lens=(64,), dtypes=("float32",),
                                                     heads=("mqa",), batches=(1,), layouts=("contiguous", "paged16"),
                                                     rounds=1, bandwidth_mib=1, threads=1))
    groups = {r["layout"]: r["round_group"] for r in res.rows}
    assert groups == {"contiguous": 0, "paged16": 1}
    assert [t["side_by_side"] for t in res.targets if "paged_over_contiguous" in t] == [False]
    assert bench_decode._chunks("mqa", 64, 1, [("float32", "contiguous"), ("float32", "paged16")]) == [
        [("float32", "contiguous")], [("float32", "paged16")]]
    monkeypatch.setattr(bench_decode, "GROUP_BYTES_LIMIT", 2 * one)
    assert len(bench_decode._chunks("mqa", 64, 1, [("float32", "contiguous"), ("float32", "paged16")])) == 1
