"""Peak-memory child: run one attention configuration in a fresh process and report its extra peak RSS.

    python -m attnlab.bench._child '{"impl": "tiled", "n": 4096, "dtype": "float32", "causal": false,
                                      "backward": true, "B": 1, "H": 8, "D": 64, "pattern": null}'

Prints one JSON line {"peak_bytes": ..., "baseline_bytes": ...}. The baseline is the resident size after
imports, inputs and a tiny warm-up call, when the kernel's peak mark is reset (/proc/self/clear_refs);
the figure is the peak (VmHWM) the attention call adds on top.
"""
from __future__ import annotations

import json
import sys

import torch

from attnlab.harness import peak_rss_bytes, reset_peak_rss, rss_bytes

from .impls import build_call, make_inputs


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
    # no trim, as this child has always measured: its figures stay comparable with earlier reports
    reset_peak_rss(trim=False)
    base = rss_bytes() or peak_rss_bytes()
    out = build_call(spec)(q, k, v)
    if spec.get("backward"):
        out.float().sum().backward()
    peak = peak_rss_bytes()
    sys.stdout.write(json.dumps({"peak_bytes": max(0, peak - base), "baseline_bytes": base}) + "\n")  # the protocol


if __name__ == "__main__":
    main(sys.argv[1:])
