"""What this CPU offers attention kernels: instruction-set flags, cores, and measured matmul peaks.

CPUs differ (and shared machines move between them), so nothing here is assumed: the flags are read
once at import from ``/proc/cpuinfo`` and ``torch.backends.cpu.get_cpu_capability()`` (cheap, no timing),
and the matrix-product peak is *measured* on demand by ``matmul_peak`` (a short timing, cached).

    >>> from attnlab import cpu
    >>> cpu.INFO.has("avx512_bf16")      # None where the flags cannot be read (not Linux)
    >>> cpu.summary()                   # 'Intel(R) Xeon(R) Processor · 2 CPUs (2 cores) · torch ISA AVX512 · ...'
    >>> cpu.matmul_peak(torch.bfloat16) # GFLOP/s of an n x n x n product, measured now (then cached)
"""
from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["CPUInfo", "INFO", "FLAGS_THAT_MATTER", "PATH_FLAGS", "cpu_class", "class_key", "detect", "summary", "matmul_peak", "matmul_peaks", "numa_nodes",
           "read_bandwidth"]

#: instruction-set extensions an attention kernel can use, in the order reports print them
FLAGS_THAT_MATTER = ("fma", "avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16",
                     "amx_tile", "amx_bf16", "amx_fp16")


@dataclass(frozen=True)
class CPUInfo:
    """The CPU as detected: ``flags`` is None where it could not be read (then ``has`` answers None)."""

    model: str
    flags: frozenset[str] | None
    torch_isa: str  # torch.backends.cpu.get_cpu_capability(): the widest ISA torch's kernels dispatch to
    logical_cpus: int | None  # os.cpu_count()
    usable_cpus: int | None  # CPUs this process may run on (affinity / cgroup-pinned sets)
    physical_cores: int | None  # distinct (package, core) pairs in /proc/cpuinfo

    def __repr__(self) -> str:
        return f"CPUInfo({summary(self, peaks=False)})"

    def has(self, flag: str) -> bool | None:
        """True / False for a /proc/cpuinfo flag (e.g. 'avx512_bf16', 'amx_bf16'); None when unknown."""
        return None if self.flags is None else flag in self.flags

    @property
    def bf16_matmul(self) -> str:
        """Which bf16 matrix instructions exist: 'amx', 'avx512_bf16', 'none' or 'unknown'."""
        if self.flags is None:
            return "unknown"
        if "amx_bf16" in self.flags:
            return "amx"
        return "avx512_bf16" if "avx512_bf16" in self.flags else "none"

    def as_dict(self) -> dict:
        """JSON-able record for reports: counts, torch's ISA, the bf16 matmul kind and each flag that matters."""
        return {"model": self.model, "torch_isa": self.torch_isa, "logical_cpus": self.logical_cpus,
                "usable_cpus": self.usable_cpus, "physical_cores": self.physical_cores,
                "torch_threads": torch.get_num_threads(), "bf16_matmul": self.bf16_matmul,
                "flags": None if self.flags is None else {f: f in self.flags for f in FLAGS_THAT_MATTER}}


def _parse_cpuinfo(text: str) -> tuple[str | None, frozenset[str] | None, int | None]:
    model, flags, cores = None, None, set()
    phys = core = None
    for line in text.splitlines():
        k, _, v = line.partition(":")
        k, v = k.strip(), v.strip()
        if k == "model name" and model is None:
            model = v
        elif k in ("flags", "Features") and flags is None:  # x86 / arm64 spelling
            flags = frozenset(v.split())
        elif k == "physical id":
            phys = v
        elif k == "core id":
            core = v
        elif not line.strip():
            if core is not None:
                cores.add((phys, core))
            phys = core = None
    if core is not None:
        cores.add((phys, core))
    return model, flags, (len(cores) or None)


def detect(cpuinfo_path: str | os.PathLike = "/proc/cpuinfo") -> CPUInfo:
    """Read the CPU's model, flags and core counts (no timing; a missing file gives unknowns, not errors)."""
    try:
        model, flags, cores = _parse_cpuinfo(Path(cpuinfo_path).read_text())
    except OSError:
        model, flags, cores = None, None, None
    try:
        isa = str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # older torch builds: not an error, just unknown
        isa = "unknown"
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = None
    return CPUInfo(model or platform.processor() or platform.machine() or "unknown", flags, isa, os.cpu_count(),
                   usable, cores)


INFO: CPUInfo = detect()

#: the /proc/cpuinfo flags that choose code paths in attnlab's kernels (and torch's / oneDNN's under them): a CPU
#: class is its vendor, family and model and which of these it has (records, shipped rate tables)
PATH_FLAGS = ("amx_bf16", "amx_fp16", "avx512_bf16", "avx512_fp16", "avx512_vnni", "avx512f", "avx2")


def _vendor_family_model(text: str) -> dict:
    out = {"vendor": None, "family": None, "model": None}
    for line in text.splitlines():
        k, _, v = line.partition(":")
        k, v = k.strip(), v.strip()
        if k == "vendor_id" and out["vendor"] is None:
            out["vendor"] = v
        elif k == "cpu family" and out["family"] is None and v.isdigit():
            out["family"] = int(v)
        elif k == "model" and out["model"] is None and v.isdigit():
            out["model"] = int(v)
        elif not line.strip() and out["vendor"] is not None:
            break
    return out


def class_key(c: dict) -> str:
    """e.g. "GenuineIntel-6-143+amx_bf16+avx512_bf16+..." (vendor-family-model+path flags)."""
    return f"{c.get('vendor') or platform.machine()}-{c.get('family')}-{c.get('model')}+" + "+".join(c["flags"])


def cpu_class(flags: frozenset[str] | None = None, cpuinfo_path: str | os.PathLike = "/proc/cpuinfo") -> dict:
    """This CPU's class: {vendor, family, model, model_name, flags (the PATH_FLAGS it has), key}."""
    try:
        info = _vendor_family_model(Path(cpuinfo_path).read_text())
    except OSError:
        info = {"vendor": None, "family": None, "model": None}
    info["model_name"] = INFO.model
    flags = INFO.flags if flags is None else flags
    info["flags"] = [f for f in PATH_FLAGS if flags and f in flags]
    info["key"] = class_key(info)
    return info


def summary(info: CPUInfo | None = None, peaks: bool = True) -> str:
    """One line for reports: model, CPU counts, torch's ISA, the flags that matter, and the matmul peaks
    measured so far in this process (never measures)."""
    info = info or INFO
    counts = f"{info.usable_cpus or info.logical_cpus or '?'} CPUs" + \
        (f" ({info.physical_cores} cores)" if info.physical_cores else "") + f", {torch.get_num_threads()} torch threads"
    if info.flags is None:
        flags = "flags unknown"
    else:
        has = [f for f in FLAGS_THAT_MATTER if f in info.flags]
        lacks = [f for f in FLAGS_THAT_MATTER if f not in info.flags]
        flags = " ".join(has) or "none of " + " ".join(FLAGS_THAT_MATTER)
        flags += f" (lacks {' '.join(lacks)})" if lacks and has else ""
    line = f"{info.model} · {counts} · torch ISA {info.torch_isa} · {flags}"
    if peaks and _PEAKS:
        line += " · matmul peak " + ", ".join(
            f"{str(k[0]).removeprefix('torch.')} {v:.0f} GFLOP/s" for k, v in sorted(_PEAKS.items(), key=str))
    return line


_PEAKS: dict[tuple, float] = {}


def matmul_peak(dtype: torch.dtype = torch.float32, n: int = 1024, seconds: float = 0.3,
                refresh: bool = False) -> float:
    """Measured GFLOP/s of an [n, n] @ [n, n] product in ``dtype`` on this CPU with torch's current thread
    count: the best of repeated products over about ``seconds`` after one warm-up (best, not median: a
    peak is what the hardware can do; on a busy machine it is what it did). Cached per (dtype, n,
    threads); ``refresh=True`` measures again. The ceiling an attention kernel in that dtype can reach.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 16:
        raise ValueError(f"n must be an int >= 16, got {n!r}")
    key = (dtype, n, torch.get_num_threads())
    if key in _PEAKS and not refresh:
        return _PEAKS[key]
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(dtype)
    b = torch.randn(n, n, generator=g).to(dtype)
    torch.mm(a, b)  # warm-up: packing buffers, oneDNN kernel selection
    best, t_end, reps = float("inf"), time.perf_counter() + seconds, 0
    while reps < 3 or (time.perf_counter() < t_end and reps < 200):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
        reps += 1
    _PEAKS[key] = 2 * n**3 / best / 1e9
    return _PEAKS[key]


def matmul_peaks(dtypes=(torch.float32, torch.bfloat16), n: int = 1024, seconds: float = 0.3) -> dict[str, float]:
    """{'float32': GFLOP/s, 'bfloat16': ...} measured (or cached) for each dtype."""
    return {str(d).removeprefix("torch."): matmul_peak(d, n, seconds) for d in dtypes}


def numa_nodes(root: str | os.PathLike = "/sys/devices/system/node") -> list[dict] | None:
    """The NUMA nodes Linux reports: ``[{"node": 0, "cpus": "0-1"}, ...]``; None where unknown (not Linux)."""
    base = Path(root)
    try:
        nodes = sorted((d for d in base.iterdir() if d.name.startswith("node") and d.name[4:].isdigit()),
                       key=lambda d: int(d.name[4:]))
    except OSError:
        return None
    out = []
    for d in nodes:
        try:
            cpus = (d / "cpulist").read_text().strip()
        except OSError:
            cpus = "?"
        out.append({"node": int(d.name[4:]), "cpus": cpus})
    return out or None


_BANDWIDTH: dict[tuple, float] = {}


def read_bandwidth(nbytes: int = 128 << 20, seconds: float = 0.3, refresh: bool = False) -> float:
    """Measured bytes/s this process reads from memory with torch's current thread count: the best of
    repeated ``sum`` passes over an ``nbytes`` float32 buffer (larger than the caches) over about
    ``seconds``, after one warm-up. Cached per (nbytes, threads); ``refresh=True`` measures again. The
    ceiling of memory-bound kernels (decoding reads each key once)."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 4096:
        raise ValueError(f"nbytes must be an int >= 4096, got {nbytes!r}")
    key = (nbytes, torch.get_num_threads())
    if key in _BANDWIDTH and not refresh:
        return _BANDWIDTH[key]
    x = torch.ones(nbytes // 4)
    x.sum()  # warm-up: pages touched, threads woken
    best, t_end, reps = float("inf"), time.perf_counter() + seconds, 0
    while reps < 3 or (time.perf_counter() < t_end and reps < 100):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
        reps += 1
    _BANDWIDTH[key] = x.numel() * 4 / best
    return _BANDWIDTH[key]
