"""attnlab info / ``sysinfo.collect``: what a bug report needs, read from the same sources the kernels use."""
from __future__ import annotations

import json
import math

import pytest
import torch

from attnlab import cpu, sysinfo
from attnlab.cli import main as cli
from attnlab.kernels import compiled


def test_collect_reports_what_the_kernels_see():
    info = sysinfo.collect(measure=False)
    assert info.cpu == cpu.INFO.as_dict() and info.threads == torch.get_num_threads()
    assert info.torch == torch.__version__ and info.measured is None
    x = info.extension
    if compiled.unavailable_reason() is None:
        assert x["status"] == "ok" and x["variant"] == compiled.variant() and x["variant"].startswith("attnlab._C")
        assert x["capability"] == compiled.capability()
        assert x["tiles"]["float32"] == compiled.gemm_backend(torch.float32)
        assert x["tiles"]["bfloat16"] == compiled.gemm_backend(torch.bfloat16)
    else:
        assert x["status"] == compiled.unavailable_reason()
    json.dumps(info.as_dict())  # JSON-able as it stands
    text = str(info)
    assert f"cpu.model: {cpu.INFO.model}" in text and "not measured" in text
    for flag in ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16"):
        assert flag in text


def test_measured_rates_are_positive_and_cached():
    info = sysinfo.collect(measure=True, seconds=0.01)
    m = info.measured
    assert all(math.isfinite(v) and v > 0 for v in m.values()), m
    assert cpu.read_bandwidth(seconds=0.01) / 1e9 == m["read_gb_s"]  # cached per process, not re-timed (same division, same float)
    with pytest.raises(ValueError, match="nbytes"):
        cpu.read_bandwidth(nbytes=10)


def test_numa_nodes_read_from_sysfs(tmp_path):
    for n, cpus in ((1, "2-3"), (0, "0-1")):
        (tmp_path / f"node{n}").mkdir()
        (tmp_path / f"node{n}" / "cpulist").write_text(cpus + "\n")
    (tmp_path / "possible").write_text("0-1\n")
    assert cpu.numa_nodes(tmp_path) == [{"node": 0, "cpus": "0-1"}, {"node": 1, "cpus": "2-3"}]
    assert cpu.numa_nodes(tmp_path / "absent") is None


def test_a_bad_setting_is_reported_not_raised(monkeypatch):
    monkeypatch.setenv("ATTNLAB_EXT_GEMM", "fastest")
    info = sysinfo.collect(measure=False)
    assert info.environment["ATTNLAB_EXT_GEMM"] == "fastest"
    if compiled.unavailable_reason() is None:
        assert info.extension["gemm_setting"].startswith("invalid: ATTNLAB_EXT_GEMM must be one of")


def test_cli_info_json(capsys):
    outcome = cli.invoke(["info", "--json", "--no-measure"])
    assert outcome.exit_code == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(json.dumps(outcome.result["info"].as_dict()))
    assert printed["cpu"]["model"] == cpu.INFO.model
