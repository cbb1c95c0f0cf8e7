"""CPU feature detection reads what /proc/cpuinfo says (never assumes), and the matmul peak is measured."""
from __future__ import annotations

import math

import pytest
import torch

import attnlab
from attnlab import cpu

SAPPHIRE = """processor	: 0
model name	: Intel(R) Xeon(R) Platinum 8480+
physical id	: 0
core id		: 0
flags		: fpu sse2 avx avx2 fma avx512f avx512_bf16 amx_tile amx_bf16 amx_int8

processor	: 1
model name	: Intel(R) Xeon(R) Platinum 8480+
physical id	: 0
core id		: 0
flags		: fpu sse2 avx avx2 fma avx512f avx512_bf16 amx_tile amx_bf16 amx_int8

processor	: 2
model name	: Intel(R) Xeon(R) Platinum 8480+
physical id	: 0
core id		: 1
flags		: fpu sse2 avx avx2 fma avx512f avx512_bf16 amx_tile amx_bf16 amx_int8
"""

ROME = """processor	: 0
model name	: AMD EPYC 7B12
physical id	: 0
core id		: 0
flags		: fpu sse2 avx avx2 fma
"""


def test_detect_reads_flags_models_and_cores(tmp_path):
    (tmp_path / "a").write_text(SAPPHIRE)
    (tmp_path / "b").write_text(ROME)
    spr, rome = cpu.detect(tmp_path / "a"), cpu.detect(tmp_path / "b")
    assert spr.model == "Intel(R) Xeon(R) Platinum 8480+" and rome.model == "AMD EPYC 7B12"
    assert spr.has("amx_bf16") and spr.has("avx512_bf16") and spr.bf16_matmul == "amx"
    assert rome.has("avx2") and rome.has("avx512f") is False and rome.bf16_matmul == "none"
    assert spr.physical_cores == 2 and rome.physical_cores == 1  # hyperthreads share a core id
    assert cpu.summary(rome, peaks=False).endswith(
        "fma avx2 (lacks avx512f avx512_vnni avx512_bf16 avx512_fp16 amx_tile amx_bf16 amx_fp16)")
    assert cpu.summary(spr, peaks=False).endswith("amx_tile amx_bf16 (lacks avx512_vnni avx512_fp16 amx_fp16)")
    assert spr.as_dict()["flags"]["amx_bf16"] is True and rome.as_dict()["flags"]["avx512_bf16"] is False


def test_missing_cpuinfo_is_unknown_not_an_error(tmp_path):
    info = cpu.detect(tmp_path / "absent")
    assert info.flags is None and info.has("avx2") is None and info.bf16_matmul == "unknown"
    assert "flags unknown" in cpu.summary(info)


def test_this_machine_matches_its_cpuinfo():
    """The import-time detection agrees with a direct read of the flags line."""
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        pytest.skip("no /proc/cpuinfo here")
    line = next((ln for ln in text.splitlines() if ln.startswith(("flags", "Features"))), None)
    if line is None:
        pytest.skip("no flags line")
    flags = set(line.split(":", 1)[1].split())
    for f in cpu.FLAGS_THAT_MATTER:
        assert cpu.INFO.has(f) == (f in flags), f
    assert cpu.INFO.torch_isa == str(torch.backends.cpu.get_cpu_capability())


def test_matmul_peak_is_measured_and_cached():
    g = cpu.matmul_peak(torch.float32, n=128, seconds=0.01)
    assert math.isfinite(g) and g > 0
    assert cpu.matmul_peak(torch.float32, n=128, seconds=0.01) == g  # cached, not re-timed
    assert "float32" in cpu.summary() and "GFLOP/s" in cpu.summary()
    with pytest.raises(TypeError, match="dtype"):
        cpu.matmul_peak(torch.int32)
    with pytest.raises(ValueError, match="n must be"):
        cpu.matmul_peak(n=4)


def test_explain_prints_the_cpu_line():
    q = torch.randn(1, 2, 16, 8)
    text = str(attnlab.explain(q, q, q))
    cpu_line = [ln for ln in text.splitlines() if ln.startswith("cpu: ")]
    assert len(cpu_line) == 1 and cpu.INFO.model in cpu_line[0] and cpu.INFO.torch_isa in cpu_line[0]
