"""Smoke runs of `attnlab bench minilm` and `attnlab bench generate` at toy size: output files and
their content, never their timings."""
from __future__ import annotations

import json

import pytest

from attnlab.cli import main as cli


def test_bench_minilm_quick(tmp_path):
    pytest.importorskip("transformers")
    code = cli.main(["bench", "minilm", "--quick", "--threads", "1", "--mechanisms", "auto,dense",
                     "--out", str(tmp_path)])
    assert code == 0
    data = json.loads((tmp_path / "minilm.json").read_text())
    impls = {r["impl"]: r for r in data["rows"]}
    assert {"attnlab[auto]", "attnlab[dense]", "transformers[sdpa]", "transformers[eager]"} <= set(impls)
    assert impls["transformers[sdpa]"]["ratio_vs_sdpa"] == pytest.approx(1.0)
    for r in impls.values():
        assert r["sentences_per_s"] > 0 and len(r["seconds_all"]) == data["repeats"]
        assert r["max_abs_diff_vs_transformers_sdpa"] < 1e-4  # every implementation computed the same thing
    assert (tmp_path / "minilm.png").stat().st_size > 0


def test_bench_generate_quick(tmp_path):
    code = cli.main(["bench", "generate", "--quick", "--threads", "1", "--out", str(tmp_path)])
    assert code == 0
    data = json.loads((tmp_path / "generate.json").read_text())
    assert [r["context"] for r in data["rows"]] == [64, 128]
    for r in data["rows"]:
        assert r["same_tokens"] is True
        for k in ("cache", "no_cache"):
            assert r[k]["tokens_per_s"] > 0 and r[k]["decode_tokens_per_s"] > 0
        assert r["speedup"] == pytest.approx(r["cache"]["tokens_per_s"] / r["no_cache"]["tokens_per_s"])
    assert (tmp_path / "generate.png").stat().st_size > 0


def test_bench_generate_hf_quick(tmp_path):
    """--hf: transformers' generate on "attnlab" vs "sdpa", same tokens, the decode rate per new token."""
    pytest.importorskip("transformers")
    code = cli.main(["bench", "generate", "--hf", "--quick", "--threads", "1", "--contexts", "37", "--out",
                     str(tmp_path)])
    assert code == 0
    data = json.loads((tmp_path / "generate.json").read_text())
    assert data["model"]["hf"] is True and data["model"]["kv_heads"] == 2
    (r,) = data["rows"]
    assert r["prompt"] == 37 and r["context"] == 41 and r["same_tokens"] is True
    for k in ("attnlab", "sdpa"):
        assert r[k]["tokens_per_s"] > 0 and r[k]["prefill_seconds"] > 0 and r[k]["decode_seconds_per_token"] >= 0
    assert r["speedup"] == pytest.approx(r["attnlab"]["tokens_per_s"] / r["sdpa"]["tokens_per_s"])
    assert (tmp_path / "generate.png").stat().st_size > 0


def test_bench_bad_arguments(tmp_path):
    assert cli.main(["bench", "generate", "--hf", "--heads", "4", "--kv-heads", "3", "--out", str(tmp_path)]) == 2
    assert cli.main(["bench", "generate", "--kv-heads", "2", "--out", str(tmp_path)]) == 2
    assert cli.main(["bench", "generate", "--contexts", "8", "--new-tokens", "16", "--out", str(tmp_path)]) == 2
    assert cli.main(["bench", "minilm", "--tokens", "600", "--out", str(tmp_path)]) == 2
