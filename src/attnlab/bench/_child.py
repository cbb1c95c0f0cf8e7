"""Peak-memory child: run one attention configuration in a fresh process and report its extra peak RSS.

    python -m attnlab.bench._child '{"impl": "tiled", "n": 4096, "dtype": "float32", "causal": false,
                                      "backward": true, "B": 1, "H": 8, "D": 64, "pattern": null}'

``impl`` is one of attnlab.bench.impls.build_call's names, or one of bench kernels' implementation names
("torch:sdpa", "attnlab:<method>", see attnlab.bench.kernels_cases.build_impl; dense inputs). Prints one
JSON line {"peak_bytes": ..., "baseline_bytes": ...}. The baseline is the resident size after imports,
inputs and a tiny warm-up call, when the kernel's peak mark is reset (/proc/self/clear_refs); the figure
is the peak (VmHWM) the attention call adds on top.
"""
from __future__ import annotations

import json
import sys

import torch

from attnlab.harness import peak_rss_bytes, reset_peak_rss, rss_bytes

from .impls import build_call, make_inputs


def _build(spec: dict):
    if ":" in spec["impl"]:  # bench kernels' names: torch:sdpa, attnlab:<method>
        from .kernels_cases import build_impl  # bench kernels' cases only: other benches' children start without them

        return build_impl(spec["impl"])
    return build_call(spec)


def _run(f, spec: dict) -> None:
    out = f(*make_inputs(spec))
    if spec.get("backward"):
        out.float().sum().backward()


def main(argv: list[str]) -> None:
    """Measure the spec given as ``argv[0]`` (JSON); write the result line on stdout."""
    spec = json.loads(argv[0])
    torch.set_num_threads(int(spec.get("threads", torch.get_num_threads())))
    tiny = dict(spec, n=min(64, spec["n"]))
    _run(_build(tiny), tiny)  # imports, kernels, thread pools, allocator warm
    f = _build(spec)
    q, k, v = make_inputs(spec)
    # no trim, as this child has always measured: its figures stay comparable with earlier reports
    reset_peak_rss(trim=False)
    base = rss_bytes() or peak_rss_bytes()
    out = f(q, k, v)
    if spec.get("backward"):
        out.float().sum().backward()
    peak = max(0, peak_rss_bytes() - base)
    sys.stdout.write(json.dumps({"peak_bytes": peak, "baseline_bytes": base}) + "\n")  # the protocol


if __name__ == "__main__":
    main(sys.argv[1:])
