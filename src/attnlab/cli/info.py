"""attnlab info: this machine and install, for a bug report (CPU, flags, threads, NUMA, measured GEMM and
bandwidth, the compiled extension, calibration, versions)."""
from __future__ import annotations

import argparse
from .common import console as new_console


def build_parser(p: argparse.ArgumentParser) -> None:
    """info's options: --json, --no-measure."""
    p.add_argument("--json", action="store_true", help="print JSON instead of lines")
    p.add_argument("--no-measure", action="store_true",
                   help="skip the timings (fp32/bf16 GEMM, read bandwidth: about a second)")


def run(args: argparse.Namespace) -> dict:
    """Collect ``attnlab.sysinfo.collect`` and print it (lines, or JSON with --json).

    Returns {"info": SystemInfo, "exit_code": 0}."""
    from attnlab import sysinfo  # lazy subcommand: loaded when the command runs, not by `attnlab --help`

    info = sysinfo.collect(measure=not args.no_measure)
    console = new_console()
    if args.json:
        import json

        console.print_json(json.dumps(info.as_dict()))
    else:
        console.print(str(info), highlight=False, markup=False, soft_wrap=True)
    return {"info": info, "exit_code": 0}
