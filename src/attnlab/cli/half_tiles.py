"""``python -m attnlab.cli.half_tiles [--quick] [--fp16]``: attnlab.bench.half_tiles' figures printed as JSON."""
from __future__ import annotations

import json
import sys
from dataclasses import asdict

from attnlab.bench.half_tiles import HalfTilesConfig, run


def main(argv: list[str] | None = None) -> int:
    """Run the half-type tile benchmark (``--quick``: n = 1024, 3 rounds; ``--fp16``: fp16 too) and print JSON."""
    argv = sys.argv[1:] if argv is None else argv
    cfg = HalfTilesConfig()
    if "--quick" in argv:
        cfg = HalfTilesConfig(ns=(1024,), rounds=3)
    if "--fp16" in argv:
        cfg = HalfTilesConfig(**{**asdict(cfg), "half": ("bfloat16", "float16")})
    print(json.dumps(run(cfg), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
