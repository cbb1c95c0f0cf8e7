"""Smoke run of `attnlab bench decode` at toy size: its output file and content, never its timings."""
from __future__ import annotations

import json

import pytest

from attnlab.bench import decode as bench_decode
from attnlab.cli import main as cli
from attnlab.kernels import decode as dk


@pytest.mark.skipif(not dk.available(), reason=f"decode extension: {dk.unavailable_reason()}")
def test_bench_decode_toy(tmp_path):
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


def test_bench_decode_bad_arguments(tmp_path):
    assert cli.main(["bench", "decode", "--heads", "gqa,xyz", "--out", str(tmp_path)]) == 2
    assert cli.main(["bench", "decode", "--layouts", "pagedX", "--out", str(tmp_path)]) == 2
