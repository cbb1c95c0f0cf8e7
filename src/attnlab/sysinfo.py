"""What a bug report needs about this machine and this install: CPU, extension, calibration, versions.

``collect()`` gathers it (with ``measure=True`` it also times this CPU's fp32/bf16 GEMM and its read
bandwidth, about a second in all); ``attnlab info`` prints it, as ``python -m xformers.info`` does.

    >>> from attnlab import sysinfo
    >>> print(sysinfo.collect(measure=False))       # doctest: +SKIP
"""
from __future__ import annotations

import os
import platform
import sys
from dataclasses import asdict, dataclass, field

import torch

from . import cpu
from .functional import calibration
from .kernels import compiled as compiled_kernel
from .kernels import decode as decode_kernel
from .verify import record
from .version import __version__

__all__ = ["SystemInfo", "collect", "ENV_VARS"]

#: environment variables that change which kernel runs or how (reported when set)
ENV_VARS = ("ATTNLAB_NO_EXT", "ATTNLAB_EXT_GEMM", "ATTNLAB_EXT_BWD_SPLITS", "ATTNLAB_EXT_NO_AVX512BF16",
            "ATTNLAB_DECODE_NO_BF16_DOT", "ATTNLAB_DECODE_NO_PREFETCH", "ATTNLAB_DECODE_PREFETCH_LEVEL",
            "ATTNLAB_CALIBRATION", "ATTNLAB_CACHE_DIR", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
            "OMP_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass
class SystemInfo:
    """One machine and install, as ``collect`` found it (every field JSON-able; ``as_dict`` gives them)."""

    attnlab: str
    python: str
    platform: str
    torch: str
    transformers: str | None
    cpu: dict  # cpu.CPUInfo.as_dict(): model, counts, torch's ISA, the flags that matter
    threads: int  # torch.get_num_threads()
    numa_nodes: list[dict] | None
    #: {"float32_gemm_gflops", "bfloat16_gemm_gflops", "read_gb_s"}: measured now, or None when not asked
    measured: dict | None
    extension: dict  # the compiled kernel: variant, capability, status, tile back ends
    calibration: dict  # the planner's rates: where they come from
    verified: dict = field(default_factory=dict)  # attnlab.verify.record.status(): this CPU class's record
    #: the decode kernel (kernels/decode.py): status, capability, bf16 scores' instructions, prefetch level
    decode: dict = field(default_factory=dict)
    environment: dict[str, str] = field(default_factory=dict)  # the ENV_VARS that are set

    def as_dict(self) -> dict:
        """The record as plain data (for ``--json``)."""
        return asdict(self)

    def __str__(self) -> str:
        c, x = self.cpu, self.extension
        flags = c["flags"]
        lines = [f"attnlab: {self.attnlab}", f"python: {self.python}", f"platform: {self.platform}",
                 f"torch: {self.torch}", f"transformers: {self.transformers or 'not installed'}",
                 f"cpu.model: {c['model']}", f"cpu.torch_isa: {c['torch_isa']}",
                 f"cpu.cpus: {c['usable_cpus'] or '?'} usable of {c['logical_cpus'] or '?'} "
                 f"({c['physical_cores'] or '?'} physical cores)",
                 f"cpu.flags: " + ("unknown" if flags is None else
                                   " ".join(f"{f}={'yes' if on else 'no'}" for f, on in flags.items())),
                 f"cpu.bf16_matmul: {c['bf16_matmul']}", f"threads: {self.threads}",
                 "numa_nodes: " + ("unknown" if self.numa_nodes is None else
                                   f"{len(self.numa_nodes)} (" + ", ".join(
                                       f"node{n['node']}: cpus {n['cpus']}" for n in self.numa_nodes) + ")")]
        if self.measured is None:
            lines.append("measured: not measured (run without --no-measure)")
        else:
            m = self.measured
            lines += [f"measured.float32_gemm: {m['float32_gemm_gflops']:.0f} GFLOP/s",
                      f"measured.bfloat16_gemm: {m['bfloat16_gemm_gflops']:.0f} GFLOP/s",
                      f"measured.read_bandwidth: {m['read_gb_s']:.1f} GB/s"]
        if x["status"] == "ok":
            lines += [f"extension: {x['variant']} (capability {x['capability']})",
                      f"extension.gemm_setting: {x['gemm_setting']}",
                      f"extension.tiles: " + ", ".join(f"{d} {b}" for d, b in x["tiles"].items()),
                      f"extension.native_bf16_convert: {x['native_bf16_convert']}"]
        else:
            lines.append(f"extension: unavailable: {x['status']}")
        d = self.decode
        if d.get("status") == "ok":
            lines.append(f"decode: capability {d['capability']}, bf16 scores {d['bf16_scores']}, "
                         f"int8 scores {d.get('int8_scores', '?')}, prefetch {d['prefetch']}")
        elif d:
            lines.append(f"decode: unavailable: {d['status']}")
        lines.append("calibration: " + ", ".join(f"{k}={v}" for k, v in self.calibration.items()))
        v = self.verified
        if v:
            r = v["record"]
            if r is None:
                lines.append(f"verified: no record for this CPU class ({v['class']}); `make verify` makes one")
            else:
                lines.append(f"verified: this CPU class ({v['class']}) on {r['date']}: {r['verdict']}, at kernel code "
                             f"{r['code_hash']}" + ("" if v["current"] else f" (this install's is {v['code_hash']}: "
                                                    "the record is older than the kernels)"))
            lines.append("verified classes: " + (", ".join(v["classes"]) or "none"))
        lines += [f"env.{k}: {v}" for k, v in self.environment.items()]
        return "\n".join(lines)


def _version(dist: str) -> str | None:
    """An installed distribution's version without importing it (transformers takes seconds to import)."""
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _extension() -> dict:
    reason = compiled_kernel.unavailable_reason()
    if reason is not None:
        return {"status": reason, "variant": None, "capability": None}
    try:
        setting = compiled_kernel.gemm_setting()
    except ValueError as e:  # a bad ATTNLAB_EXT_GEMM: reported, not raised (this is what a bug report needs)
        return {"status": "ok", "variant": compiled_kernel.variant(), "capability": compiled_kernel.capability(),
                "gemm_setting": f"invalid: {e}", "tiles": {}, "native_bf16_convert": None}
    tiles = {str(d).removeprefix("torch."): compiled_kernel.gemm_backend(d)
             for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}
    return {"status": "ok", "variant": compiled_kernel.variant(), "capability": compiled_kernel.capability(),
            "gemm_setting": setting, "tiles": tiles, "native_bf16_convert": compiled_kernel.converts_bf16_natively()}


def _decode() -> dict:
    reason = decode_kernel.unavailable_reason()
    if reason is not None:
        return {"status": reason}
    return {"status": "ok", "capability": decode_kernel.capability(),
            "bf16_scores": "vdpbf16ps" if decode_kernel.bf16_dot() else "widened to fp32",
            "int8_scores": ("vpdpwssd" if decode_kernel.vnni() else
                            "widened to fp32" if decode_kernel.capability() == "DEFAULT" else "vpmaddwd")
            + (" on key columns" if decode_kernel.int_cols() else ""),
            "prefetch": {0: "off", 1: "into L1", 2: "into L2"}[decode_kernel.prefetch_mode()]}


def _calibration() -> dict:
    return calibration.state()


def _verified() -> dict:
    return record.status()


def collect(measure: bool = True, seconds: float = 0.25) -> SystemInfo:
    """This machine and install. ``measure``: also time the fp32 and bf16 GEMM peaks (``cpu.matmul_peak``,
    n = 1024) and the read bandwidth (``cpu.read_bandwidth``), about ``seconds`` each (cached per process)."""

    measured = None
    if measure:
        measured = {"float32_gemm_gflops": cpu.matmul_peak(torch.float32, 1024, seconds),
                    "bfloat16_gemm_gflops": cpu.matmul_peak(torch.bfloat16, 1024, seconds),
                    "read_gb_s": cpu.read_bandwidth(seconds=seconds) / 1e9}
    return SystemInfo(
        attnlab=__version__, python=sys.version.split()[0], platform=platform.platform(), torch=torch.__version__,
        transformers=_version("transformers"), cpu=cpu.INFO.as_dict(), threads=torch.get_num_threads(),
        numa_nodes=cpu.numa_nodes(), measured=measured, extension=_extension(), calibration=_calibration(), decode=_decode(),
        verified=_verified(),
        environment={k: os.environ[k] for k in ENV_VARS if k in os.environ})
