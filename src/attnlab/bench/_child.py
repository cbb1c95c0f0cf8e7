"""Peak-memory child: run one attention configuration in a fresh process and report its extra peak RSS.

    python -m attnlab.bench._child '{"impl": "tiled", "n": 4096, "dtype": "float32", "causal": false,
                                      "backward": true, "B": 1, "H": 8, "D": 64, "pattern": null}'

Prints one JSON line {"peak_bytes": ..., "baseline_bytes": ...}. The baseline is the resident size after
imports, inputs and a tiny warm-up call, when the kernel's peak mark is reset (/proc/self/clear_refs);
the figure is the peak (VmHWM) the attention call adds on top.
"""
from __future__ import annotations

import json
import resource
import sys

import torch

from .impls import build_call, make_inputs


def _status_bytes(field: str) -> int | None:
    try:
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        return None
    return None


def _reset_peak() -> None:
    """Reset the kernel's peak-RSS mark (Linux >= 4.0); ru_maxrss cannot be reset and, worse, keeps the
    parent's peak across fork+exec, so a child of a large benchmark process would report nothing."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _maxrss_bytes() -> int:
    hwm = _status_bytes("VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(argv: list[str]) -> None:
    spec = json.loads(argv[0])
    torch.set_num_threads(int(spec.get("threads", torch.get_num_threads())))
    tiny = dict(spec, n=min(64, spec["n"]))
    q, k, v = make_inputs(tiny)
    f = build_call(tiny)
    r = f(q, k, v)
    if spec.get("backward"):
        r.float().sum().backward()
    del q, k, v, r
    q, k, v = make_inputs(spec)
    _reset_peak()
    base = _status_bytes("VmRSS") or _maxrss_bytes()
    out = build_call(spec)(q, k, v)
    if spec.get("backward"):
        out.float().sum().backward()
    peak = _maxrss_bytes()
    print(json.dumps({"peak_bytes": max(0, peak - base), "baseline_bytes": base}))


if __name__ == "__main__":
    main(sys.argv[1:])
