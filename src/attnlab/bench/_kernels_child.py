"""Peak-memory child of ``attnlab bench kernels``: one implementation, forward+backward, fresh process.

    python -m attnlab.bench._kernels_child '{"impl": "attnlab:tiled", "n": 16384, "B": 1, "H": 8, "D": 64,
                                             "dtype": "float32", "backward": true}'

Prints one JSON line {"peak_bytes": ..., "baseline_bytes": ...}: the peak resident size (VmHWM) the call
adds over the size after imports, inputs and a tiny warm-up (see attnlab.bench._child).
"""
from __future__ import annotations

import json
import sys

from attnlab.harness import peak_rss_bytes, reset_peak_rss, rss_bytes

from .impls import make_inputs
from .kernels_cases import build_impl


def _call(f, qkv, backward):
    out = f(*qkv)
    if backward:
        out.float().sum().backward()


def main(argv: list[str]) -> None:
    spec = json.loads(argv[0])
    f = build_impl(spec["impl"])
    _call(f, make_inputs(dict(spec, n=min(64, spec["n"]))), spec["backward"])  # imports, kernels, allocator warm
    qkv = make_inputs(spec)
    reset_peak_rss(trim=False)
    base = rss_bytes() or peak_rss_bytes()
    _call(f, qkv, spec["backward"])
    peak = max(0, peak_rss_bytes() - base)
    sys.stdout.write(json.dumps({"peak_bytes": peak, "baseline_bytes": base}) + "\n")  # the protocol


if __name__ == "__main__":
    main(sys.argv[1:])
