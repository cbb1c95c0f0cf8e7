"""Peak-memory child: run one attention configuration in a fresh process and report its extra peak RSS.

    python -m attnlab.bench._child '{"impl": "tiled", "n": 4096, "dtype": "float32", "causal": false,
                                      "backward": true, "B": 1, "H": 8, "D": 64, "pattern": null}'

Prints one JSON line {"peak_bytes": ..., "baseline_bytes": ...}. The baseline is the high-water mark
after imports, inputs and a tiny warm-up call, so the figure is what the attention call itself adds.
"""
from __future__ import annotations

import json
import resource
import sys

import torch

from .impls import build_call, make_inputs


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


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
    base = _maxrss_bytes()
    out = build_call(spec)(q, k, v)
    if spec.get("backward"):
        out.float().sum().backward()
    peak = _maxrss_bytes()
    print(json.dumps({"peak_bytes": max(0, peak - base), "baseline_bytes": base}))


if __name__ == "__main__":
    main(sys.argv[1:])
