"""The CPU-specific code paths of the kernels and the tests that prove each: for the test summary's path lines
(tests/conftest.py: ran, failed, or skipped and why, so that a CI log says what each run proved) and for the
conformance matrix of a CPU class's record (``attnlab.verify.record``).

A path is proved only on a CPU that has it (nothing emulates AMX); ONEDNN_MAX_CPU_ISA and ATEN_CPU_CAPABILITY
narrow a CPU to the paths of smaller ones, which the subprocess tests listed here use. ``summary`` takes the
session's outcomes (``Outcome``: from pytest's reports, or from a JUnit XML file) and this CPU's flags.
"""
from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Path:
    """A CPU-specific code path: its name, the tests that prove it, the flag it needs, how the tests reach it."""

    name: str
    tests: tuple[str, ...]  # regexes over node ids
    needs: str | None = None  # a /proc/cpuinfo flag the path needs (else it cannot run here)
    how: str = ""  # how the tests reach the path on this CPU


def paths(flags: frozenset[str] | None) -> list[Path]:
    """The paths, with the tests that reach each on a CPU of these flags (AVX512-BF16 tiles: a capped oneDNN on a
    CPU with AMX, whose own bf16 products take the AMX tiles)."""
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
        Path("VNNI int8 decode scores", (r"test_kvcache_int8\.py::test_vnni_(group_)?scores_give_the_same_bits",), "avx512_vnni",
             "vpdpwssd against vpmaddwd, same bits"),
        Path("int8 decode P @ V on integers", (r"test_kvcache_int8\.py::test_integer_pv_",), "avx512f",
             "the AVX-512 decode build, on and off within its rounding"),
        Path("int8 decode scores on key columns", (r"test_kvcache_int8\.py::test_key_column_scores_against_float64",),
             "avx512f", "the AVX-512 decode build, against float64 and the lane kernels"),
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


@dataclass(frozen=True)
class Outcome:
    """One test's result: its node id, "passed" / "failed" / "skipped", and a skip's reason."""

    nodeid: str
    outcome: str
    reason: str = ""


def from_pytest_report(rep) -> Outcome | None:
    """The Outcome of a pytest TestReport that decides a test (a call's pass, any failure, any skip)."""
    if rep.skipped:
        lr = rep.longrepr
        why = str(lr[2]).removeprefix("Skipped: ") if isinstance(lr, tuple) and len(lr) == 3 else "skipped"
        return Outcome(rep.nodeid, "skipped", why)
    if rep.failed:
        return Outcome(rep.nodeid, "failed")
    if rep.when == "call" and rep.passed:
        return Outcome(rep.nodeid, "passed")
    return None


def verdicts(outcomes: list[Outcome], flags: frozenset[str] | None) -> list[tuple[str, str, str]]:
    """(path, status, verdict) per path; status is ran / failed / skipped / not run."""
    rows = []
    for p in paths(flags):
        pats = [re.compile(t) for t in p.tests]
        mine = [r for r in outcomes if any(x.search(r.nodeid) for x in pats)]
        passed = {r.nodeid for r in mine if r.outcome == "passed"}
        failed = {r.nodeid for r in mine if r.outcome == "failed"}
        skipped = [r for r in mine if r.outcome == "skipped"]
        if p.needs and flags is not None and p.needs not in flags:
            status, verdict = "skipped", f"skipped: this CPU lacks {p.needs}"
            if passed:
                verdict += f" ({len(passed)} of its tests ran another path here)"
        elif failed:
            status, verdict = "failed", f"FAILED: {len(failed)} failed, {len(passed)} passed ({sorted(failed)[0]} ...)"
        elif passed:
            status, verdict = "ran", f"ran: {len(passed)} passed" + (f" ({p.how})" if p.how else "")
            if skipped:
                verdict += f", {len(skipped)} skipped"
        elif skipped:
            status, verdict = "skipped", f"skipped: {skipped[0].reason}"
        else:
            status, verdict = "not run", "not run: no test of it selected"
        rows.append((p.name, status, verdict))
    return rows


def summary(outcomes: list[Outcome], flags: frozenset[str] | None) -> list[str]:
    """One line per path: 'ran: N passed', 'FAILED: ...', 'skipped: why', or 'not run: no test selected'."""
    rows = verdicts(outcomes, flags)
    width = max(len(name) for name, _, _ in rows)
    return [f"{name:<{width}}  {verdict}" for name, _, verdict in rows]
