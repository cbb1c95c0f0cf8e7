"""attnlab verify (attnlab.verify.record): the class key, the code hash, a record's files, resuming an interrupted
run, and what `attnlab info` says about this class's record."""
from __future__ import annotations

import json

import pytest
import torch

import attnlab
from attnlab import sysinfo
from attnlab.kernels import compiled
from attnlab.verify import record


def test_class_key_names_vendor_family_model_and_the_path_flags():
    flags = frozenset({"avx2", "avx512f", "avx512_bf16", "fma", "sse4_2"})
    c = record.cpu_class(flags)
    assert c["flags"] == ["avx512_bf16", "avx512f", "avx2"]  # PATH_FLAGS order, nothing else
    assert c["key"].endswith("+avx512_bf16+avx512f+avx2") and c["key"].count("-") >= 2


def test_code_hash_is_stable_and_short():
    h = record.code_hash()
    assert h == record.code_hash() and len(h) == 12 and int(h, 16) >= 0


@pytest.mark.skipif(not compiled.available(), reason="the half-type grid needs the compiled kernel")
def test_a_run_writes_json_and_markdown_and_resumes(tmp_path):
    cfg = record.VerifyConfig(out=str(tmp_path), stages=("half_grid",), grid_sample=3, fuzz_minutes=0)
    said = []
    rec = record.run(cfg, progress=said.append)
    key = rec["key"]
    assert json.loads((tmp_path / f"{key}.json").read_text())["code_hash"] == record.code_hash()
    md = (tmp_path / f"{key}.md").read_text()
    assert "Half-type grid" in md and rec["verdict"].startswith("incomplete: conformance")
    assert all(g["cases"] == 3 and g["crashed"] is None for g in rec["stages"]["half_grid"].values())
    assert (tmp_path / f"{key}.partial.json").exists() and any("grid" in s for s in said)  # incomplete: kept
    # an interrupted run's finished stage is kept (same code), another code's is not
    partial = dict(rec, stages={"half_grid": {"auto": {"cases": 99, "failures": [], "n_failures": 0, "crashed": None,
                                                        "tiles": {}, "seconds": 0}}})
    (tmp_path / f"{key}.partial.json").write_text(json.dumps(partial))
    again = record.run(cfg, progress=said.append)
    assert again["stages"]["half_grid"]["auto"]["cases"] == 99 and "kept" in said[-1]
    (tmp_path / f"{key}.partial.json").write_text(json.dumps(dict(partial, code_hash="0" * 12)))
    fresh = record.run(cfg)
    assert fresh["stages"]["half_grid"]["auto"]["cases"] == 3


def test_bad_config_names_the_option(tmp_path):
    with pytest.raises(ValueError, match="--stages"):
        record.VerifyConfig(out=str(tmp_path), stages=("nope",)).validate()
    with pytest.raises(ValueError, match="--repo"):
        record.VerifyConfig(out=str(tmp_path), repo=str(tmp_path), stages=("fuzz",)).validate()


def test_info_says_whether_this_class_has_a_record(tmp_path, monkeypatch):
    index = tmp_path / "verified.json"
    monkeypatch.setattr(record, "INDEX", index)
    monkeypatch.setattr(record.records, "__defaults__", (index,))
    monkeypatch.setattr(record.record_for, "__defaults__", (None, index))
    lines = str(sysinfo.collect(measure=False)).splitlines()
    assert any(ln.startswith("verified: no record for this CPU class") for ln in lines)
    key = record.cpu_class()["key"]
    record._update_index({"key": key, "class": {}, "code_hash": record.code_hash(), "date": "2026-12-04",
                          "verdict": "verified"}, index)
    lines = str(sysinfo.collect(measure=False)).splitlines()
    assert any(ln.startswith(f"verified: this CPU class ({key}) on 2026-12-04: verified") for ln in lines)
    assert f"verified classes: {key}" in lines


def test_the_command_refuses_to_replace_this_class_record_without_force(tmp_path, capsys):
    from attnlab.cli import main as cli

    key = record.cpu_class()["key"]
    (tmp_path / f"{key}.json").write_text('{"mine": 1}')
    rc = cli.main(["verify", "--records", str(tmp_path), "--stages", "half_grid", "--grid-sample", "1"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(err) == 1 and "--force" in err[0] and key in err[0], err
    assert (tmp_path / f"{key}.json").read_text() == '{"mine": 1}'


def test_headline_pass_runs_on_small_sizes():
    """The headline stage's measurements run (small sizes here; the record uses the targets' sizes) and give
    positive ratios for every call, each kernel call naming auto's pick (Note [Headline pairs])."""
    h = record._headline_once(n=128, n_window=512, s_decode=1024, sample_s=0.004, rounds=2)
    assert {"float32 dense forward", "bfloat16 causal forward+backward"} <= set(h)
    assert all(v > 0 for r in h.values() for v in r.values() if not isinstance(v, str))
    for call in ("float32 dense forward", "bfloat16 causal forward+backward"):
        assert h[call]["auto's pick"] == attnlab_pick(call)


def attnlab_pick(call: str) -> str:
    """What auto plans for a headline call at the test's n = 128 (a grad call is planned for its backward)."""
    dt = torch.bfloat16 if call.startswith("bfloat16") else torch.float32
    q = torch.randn(1, 8, 128, 64).to(dt).requires_grad_("backward" in call)
    return attnlab.explain(q, q, q, is_causal="causal" in call).method


def test_busy_pass_takes_more_rounds_and_budget(monkeypatch):
    """Note [Busy rounds]: beside a CPU-bound process the paired calls take the stage's busy rounds within twice
    the budget, the small calls twice those rounds; quiet keeps its rounds; the stage asks for BUSY_ROUNDS."""
    seen = []
    real = record.interleaved

    def spy(calls, **kw):
        seen.append((tuple(calls), kw["rounds"], kw["budget_s"], kw["min_sample_s"]))
        return real(calls, **{**kw, "rounds": 2, "budget_s": 1.0})

    monkeypatch.setattr(record, "interleaved", spy)
    small = dict(n=128, n_window=512, s_decode=1024, sample_s=0.004)
    record._headline_once(**small, rounds=15)
    quiet, seen[:] = list(seen), []
    record._headline_once(**small, rounds=9, busy=True)
    busy = list(seen)
    assert len(quiet) == len(busy)
    for (names, rq, bq, sq), (_, rb, bb, sb) in zip(quiet, busy):
        if "auto" in names and "sdpa" in names and len(names) == 2:  # a small call
            assert (rq, rb) == (19, 17) and sb < sq
        elif "pick" in names:  # a headline call: auto paired with its pick
            assert (rq, rb) == (15, 9) and bb == 2 * bq
        else:  # the window and decode medians keep 15 rounds
            assert rb in (15, 17) and bb == bq
    calls = []
    monkeypatch.setattr(record, "_headline_once", lambda **kw: calls.append(kw) or {})
    monkeypatch.setattr(record, "_busy_process", lambda: type("P", (), {"kill": lambda s: None,
                                                                       "wait": lambda s: None})())
    record._stage_headline(record.VerifyConfig(busy=True), None, lambda msg: None)
    assert calls == [{}, {"rounds": record.BUSY_ROUNDS, "busy": True}]
