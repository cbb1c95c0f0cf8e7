"""Ring attention under torchrun, from the command line: each rank prints its report.

    torchrun --standalone --nproc-per-node 4 -m attnlab.cli.ring_demo --seq-len 4096 --causal

The work is ``attnlab.distributed.demo.run_ring_demo``; this module parses the options and prints.
"""
from __future__ import annotations

import sys

from ..distributed.demo import RingDemoConfig, run_ring_demo
from ..distributed.layout import LAYOUTS
from .common import ArgumentParser
from .options import positive_float, positive_int

__all__ = ["main"]


def main(argv: list[str] | None = None) -> dict:
    """Parse ``argv`` (default: the command line), run the demo on this rank, print and return its report."""
    p = ArgumentParser(prog="python -m attnlab.cli.ring_demo", description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=positive_int, default=4096)
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--heads", type=positive_int, default=4)
    p.add_argument("--head-dim", type=positive_int, default=64)
    p.add_argument("--layout", choices=LAYOUTS, default="zigzag")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--no-check", action="store_true", help="skip the single-process comparison")
    p.add_argument("--timeout", type=positive_float, default=120.0, help="process group timeout (s)")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    report = run_ring_demo(RingDemoConfig(seq_len=a.seq_len, batch=a.batch, heads=a.heads, head_dim=a.head_dim,
                                          layout=a.layout, causal=a.causal, check=not a.no_check, timeout=a.timeout))
    print(report, flush=True)
    return report


if __name__ == "__main__":
    main()
