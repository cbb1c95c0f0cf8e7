"""The test summary's CPU-path lines: for each code path the kernels choose by CPU, whether this run proved it
(the tests that run it passed), failed, or skipped it and why, so that a CI log says what each run proved.

A path is proved only on a CPU that has it (nothing emulates AMX); ONEDNN_MAX_CPU_ISA and ATEN_CPU_CAPABILITY
narrow a CPU to the paths of smaller ones, which the subprocess tests listed here use. ``summary`` reads the
session's test reports (xdist forwards them to the controller) and this CPU's flags.
"""
from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Path:
    name: str
    tests: tuple[str, ...]  # regexes over node ids
    needs: str | None = None  # a /proc/cpuinfo flag the path needs (else it cannot run here)
    how: str = ""  # how the tests reach the path on this CPU


def paths(flags: frozenset[str] | None) -> list[Path]:
    f = flags or frozenset()
    amx = "amx_bf16" in f
    brgemm_bf16 = (r"test_half_grid\.py::test_half_grid_sample_on_each_back_end\[(auto|brgemm)\]",
                   r"test_compiled_backends\.py::test_conformance_on_each_backend\[torch\.bfloat16-brgemm\]",
                   r"test_half_grid\.py::test_the_issue_reproducer_runs")
    capped_bf16 = (r"test_compiled_backends\.py::test_other_cpu_paths_in_subprocesses\[ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16",
                   r"test_compiled_backends\.py::test_half_brgemm_probe_under_a_capped_onednn")
    return [
        Path("AMX tiles (bf16 brgemm)", brgemm_bf16, "amx_bf16", "bf16 products on oneDNN's brgemm"),
        Path("AVX512-BF16 tiles (VDPBF16PS brgemm)", capped_bf16 if amx else brgemm_bf16, "avx512_bf16",
             "oneDNN capped at AVX512_CORE_BF16 in a subprocess" if amx else "bf16 products on oneDNN's brgemm"),
        Path("AVX512-BF16 decode scores", (r"test_kvcache_bf16\.py",), "avx512_bf16", "bf16 caches"),
        Path("VNNI int8 decode scores", (r"test_kvcache_int8\.py::test_vnni_scores_give_the_same_bits",), "avx512_vnni",
             "vpdpwssd against vpmaddwd, same bits"),
        Path("AVX-512 build (_C_avx512, _decode_avx512)", (r"test_compiled_backends\.py::test_conformance_on_each_backend",),
             "avx512f", "the build this CPU loads"),
        Path("AVX2 build (_C_avx2, _decode_avx2)",
             (r"test_compiled_backends\.py::test_other_cpu_paths_in_subprocesses\[ATEN_CPU_CAPABILITY=avx2",
              r"test_kvcache\.py::.*(avx2|AVX2)"), "avx2", "ATEN_CPU_CAPABILITY=avx2 in a subprocess"),
        Path("default build (_C, _decode)",
             (r"test_compiled_backends\.py::test_other_cpu_paths_in_subprocesses\[ATEN_CPU_CAPABILITY=default",
              r"test_kvcache\.py::.*(default|DEFAULT)"), None, "ATEN_CPU_CAPABILITY=default in a subprocess"),
        Path("brgemm products", (r"test_conformance_on_each_backend\[[^\]]*-brgemm\]",
                                 r"test_half_grid_sample_on_each_back_end\[brgemm\]"), "avx512f"),
        Path("MKL products", (r"test_conformance_on_each_backend\[[^\]]*-mkl\]",
                              r"test_half_grid_sample_on_each_back_end\[mkl\]")),
        Path("loop products", (r"test_conformance_on_each_backend\[[^\]]*-loop\]",
                               r"test_half_grid_sample_on_each_back_end\[loop\]")),
    ]


def _reason(rep) -> str:
    lr = rep.longrepr
    if isinstance(lr, tuple) and len(lr) == 3:
        return str(lr[2]).removeprefix("Skipped: ")
    return str(lr).splitlines()[-1] if lr else "skipped"


def summary(reports: list, flags: frozenset[str] | None) -> list[str]:
    """One line per path: 'ran: N passed', 'FAILED: ...', 'skipped: why', or 'not run: no test selected'."""
    lines = []
    width = max(len(p.name) for p in paths(flags))
    for p in paths(flags):
        pats = [re.compile(t) for t in p.tests]
        mine = [r for r in reports if any(x.search(r.nodeid) for x in pats)]
        passed = {r.nodeid for r in mine if r.when == "call" and r.passed}
        failed = {r.nodeid for r in mine if r.failed}
        skipped = [r for r in mine if r.skipped]
        if p.needs and flags is not None and p.needs not in flags:
            verdict = f"skipped: this CPU lacks {p.needs}"
            if passed:
                verdict += f" ({len(passed)} of its tests ran another path here)"
        elif failed:
            verdict = f"FAILED: {len(failed)} failed, {len(passed)} passed ({sorted(failed)[0]} ...)"
        elif passed:
            verdict = f"ran: {len(passed)} passed" + (f" ({p.how})" if p.how else "")
            if skipped:
                verdict += f", {len(skipped)} skipped"
        elif skipped:
            verdict = f"skipped: {_reason(skipped[0])}"
        else:
            verdict = "not run: no test of it selected"
        lines.append(f"{p.name:<{width}}  {verdict}")
    return lines
