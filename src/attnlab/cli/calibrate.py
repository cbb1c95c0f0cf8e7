"""attnlab calibrate: measure the kernels on this CPU and cache the planner's rates for it
(Note [Calibrated rates] in attnlab.kernels.rates; the grid: attnlab.functional.calibration)."""
from __future__ import annotations

import argparse

from attnlab.options import positive_int


def build_parser(p: argparse.ArgumentParser) -> None:
    """calibrate's options: the grid's size, --no-progress, --json."""
    p.add_argument("--n", type=positive_int, default=2048, help="sequence length of the grid (default 2048)")
    p.add_argument("--heads", type=positive_int, default=4, help="heads of the grid (default 4)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--json", action="store_true", help="print the fitted rates as JSON")


def run(args: argparse.Namespace) -> dict:
    """Run ``attnlab.functional.calibration.calibrate`` with a progress bar, write the cache file, print the
    rates and how long the calibration took.

    Returns {"rates", "measured", "path", "seconds", "exit_code": 0}."""
    import time

    from attnlab.functional.calibration import CalibrationConfig, calibrate
    from attnlab.harness.progress import progress

    from .common import console as new_console

    cfg = CalibrationConfig(n=args.n, heads=args.heads)
    t0 = time.perf_counter()
    with progress(disable=args.no_progress) as bar:
        task = bar.add_task("calibrating", total=None)

        def tick(done, total, label):
            bar.update(task, completed=done, total=total, description=label)

        fitted, measured, path = calibrate(cfg, tick)
    seconds = time.perf_counter() - t0
    console = new_console()
    record = {"path": str(path), "source": fitted.source, "seconds": round(seconds, 1),
              "SPARSE_BLOCK_SPEED": fitted.sparse_block_speed,
              "COMPILED_BLOCK_SPEED": {f"{b[0]}x{b[1]}": s for b, s in fitted.compiled_block_speed.items()},
              "COMPILED_DENSE_DTYPES": [str(d).removeprefix("torch.") for d in fitted.compiled_dense_dtypes],
              "SPARSE_OVER_COMPILED": fitted.sparse_over_compiled,
              "COMPILED_DENSE_MIN_PAIRS": {f"{str(d).removeprefix('torch.')} {'causal' if c else 'dense'}": p
                                           for (d, c), p in fitted.compiled_dense_min_pairs.items()},
              "KERNEL_GFLOPS": fitted.kernel_gflops,
              "DECODE_OVER_SDPA": {f"{str(d).removeprefix('torch.')} {'gqa' if g else 'mha'}": x
                                   for (d, g), x in fitted.decode_over_sdpa.items()},
              "measured_s": measured}
    if args.json:
        import json

        console.print_json(json.dumps(record))
    else:
        for key, value in record.items():
            if key != "measured_s":
                console.print(f"{key}: {value}", highlight=False, markup=False, soft_wrap=True)
    return {"rates": fitted, "measured": measured, "path": path, "seconds": seconds, "exit_code": 0}
