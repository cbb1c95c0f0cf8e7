"""Resident memory of this process: now, at its peak since the last reset, and the peak a block adds.

Linux only for the peak reset (``/proc/self/clear_refs``); elsewhere the peak is ``ru_maxrss``, which
cannot be reset and, across fork+exec, keeps the parent's peak, so a child process started from a large
one would report nothing: measure a block in a fresh process, or where the reset works.
"""
from __future__ import annotations

__all__ = ["rss_bytes", "peak_rss_bytes", "reset_peak_rss", "PeakRSS"]


def _status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def rss_bytes() -> int:
    """Resident set size of this process now (VmRSS; 0 where /proc is missing)."""
    return (_status_kib("VmRSS") or 0) * 1024


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (VmHWM; ``ru_maxrss`` where /proc is missing)."""
    kib = _status_kib("VmHWM")
    if kib is None:
        import resource

        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib * 1024


def reset_peak_rss(trim: bool = True) -> bool:
    """Reset this process's peak RSS to its current RSS (Linux ``clear_refs`` 5); False if unsupported.

    With ``trim``, garbage is collected and freed heap memory handed back to the OS first (glibc
    ``malloc_trim``), so that later allocations show up in the RSS instead of silently reusing memory
    the allocator kept."""
    if trim:
        import gc

        gc.collect()
        try:
            import ctypes

            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakRSS:
    """Context manager: the peak resident memory the block adds on top of the RSS at its start.

    ``with PeakRSS() as m: work()`` then ``m.bytes`` (None when the peak could not be reset, since the
    process's earlier peak would then be mistaken for the block's). ``m.baseline`` is the RSS at entry."""

    def __init__(self, trim: bool = True):
        self.trim, self.ok, self.baseline, self.bytes = trim, False, 0, None

    def __enter__(self) -> "PeakRSS":
        self.ok = reset_peak_rss(self.trim)
        self.baseline = rss_bytes()
        return self

    def current(self) -> int | None:
        """The peak added so far (None when the reset is unsupported)."""
        return max(0, peak_rss_bytes() - self.baseline) if self.ok else None

    def __exit__(self, *exc) -> bool:
        self.bytes = self.current()
        return False
