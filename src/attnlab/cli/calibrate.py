"""attnlab calibrate: measure the kernels on this CPU and cache the planner's rates for it
(Note [Calibrated rates] in attnlab.kernels.rates; the grid: attnlab.functional.calibration)."""
from __future__ import annotations

import argparse

from attnlab.kernels.rates import as_json

from .common import console as new_console
from .options import positive_int


def build_parser(p: argparse.ArgumentParser) -> None:
    """calibrate's options: the grid's size, --no-progress, --json."""
    p.add_argument("--n", type=positive_int, default=2048, help="sequence length of the grid (default 2048)")
    p.add_argument("--heads", type=positive_int, default=4, help="heads of the grid (default 4)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--json", action="store_true", help="print the fitted rates as JSON")


def run(args: argparse.Namespace) -> dict:
    """Run ``attnlab.functional.calibration.calibrate`` with a progress bar, write the cache file, print the
    rates (``--json``: every fitted entry, as the file holds them) and how long the calibration took. On a
    machine too busy to measure (Note [Tick-bound samples]) nothing is written: one line on stderr, exit 1.

    Returns {"rates", "measured", "path", "seconds", "exit_code"} (on a busy machine rates, measured and
    path are None and "error" holds the line)."""
    import sys
    import time

    # looked up at call time, so a patched calibration.CalibrationConfig (the tests' quick grid) is the one used
    from attnlab.functional.calibration import CalibrationConfig, TooNoisy, calibrate
    # lazy subcommand: loaded when the command runs, not by `attnlab --help`
    from attnlab.harness.progress import progress

    cfg = CalibrationConfig(n=args.n, heads=args.heads)
    t0 = time.perf_counter()
    try:
        with progress(disable=args.no_progress) as bar:
            task = bar.add_task("calibrating", total=None)

            def tick(done, total, label):
                bar.update(task, completed=done, total=total, description=label)

            fitted, measured, path = calibrate(cfg, tick)
    except TooNoisy as e:
        print(f"attnlab calibrate: {e}", file=sys.stderr)
        return {"rates": None, "measured": None, "path": None, "seconds": time.perf_counter() - t0,
                "exit_code": 1, "error": str(e)}
    seconds = time.perf_counter() - t0
    console = new_console()
    record = {"path": str(path), "source": fitted.source, "seconds": round(seconds, 1), **as_json(fitted),
              "measured_s": measured}
    if args.json:
        import json

        console.print_json(json.dumps(record))
    else:
        for key, value in record.items():
            if key != "measured_s":
                console.print(f"{key}: {value}", highlight=False, markup=False, soft_wrap=True)
    return {"rates": fitted, "measured": measured, "path": path, "seconds": seconds, "exit_code": 0}
