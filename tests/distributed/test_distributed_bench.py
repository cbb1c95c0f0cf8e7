"""Smoke run of `attnlab bench ring --quick` at toy size: its outputs, never its timings."""
from __future__ import annotations

import json

from attnlab.cli import main as cli


def test_bench_ring_quick_writes_per_rank_records(tmp_path):
    outcome = cli.invoke(["bench", "ring", "--procs", "2", "--quick", "--layouts", "zigzag", "--seq-len", "64",
                          "--out", str(tmp_path)])
    assert outcome.exit_code == 0
    res = outcome.result
    assert [(r.config, r.rank) for r in res.records] == [("single", 0), ("ring-zigzag", 0), ("ring-zigzag", 1)]
    assert [r.local_len for r in res.records] == [64, 32, 32]
    for r in res.records:
        assert r.peak_mib >= 0 and r.attention_peak_mib >= 0 and r.seconds > 0
        assert r.memory_method in ("VmHWM", "ru_maxrss")
    # forward: every key/value position passes each other rank once, keys and values in one message
    B, H, E = res.settings["batch"], res.settings["heads"], res.settings["head_dim"]
    assert res.records[0].sent_mib == 0
    for r in res.records[1:]:
        assert r.sent_mib * 2**20 == (2 - 1) * r.local_len * B * H * (E + E) * 4
        assert r.wait_seconds >= 0
    assert {s["config"] for s in res.summary} == {"single", "ring-zigzag"}
    ring = next(s for s in res.summary if s["config"] == "ring-zigzag")
    single = res.records[0]
    assert ring["seconds"] == max(r.seconds for r in res.records[1:])
    assert ring["time_ratio"] == ring["seconds"] / single.seconds
    assert res.target["applies"] is False  # toy size is not the n=32768, 4-process target
    saved = json.loads((tmp_path / "ring.json").read_text())
    assert saved["settings"]["n"] == 64 and len(saved["records"]) == 3
    assert (tmp_path / "ring.png").stat().st_size > 0


def test_bench_ring_refuses_bad_settings(capsys):
    assert cli.main(["bench", "ring", "--procs", "1", "--quick"]) == 2
    assert "--procs must be >= 2" in capsys.readouterr().err
    assert cli.main(["bench", "ring", "--procs", "4", "--seq-len", "5"]) == 2
    assert "too short" in capsys.readouterr().err
