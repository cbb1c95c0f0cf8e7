"""attnlab tour: the headline results, measured on this machine, in a few minutes (the README's ``make demo``).

The work is ``attnlab.tour.run_tour``; this module parses the options, shows a progress line while the
pieces run (on stderr) and prints the summary table.
"""
from __future__ import annotations

import argparse
import sys

from .common import UsageError, add_force
from .options import check_memory, output_dir, positive_int_list
from .common import console as new_console

__all__ = ["build_parser", "run"]


def build_parser(p: argparse.ArgumentParser) -> None:
    """The tour's options: output folder, pieces to skip, the sentence, the lengths measured."""
    # lazy subcommand: loaded when the command runs, not by `attnlab --help`
    from ..tour import PIECES, SENTENCE, TourConfig

    d = TourConfig()
    speed, memory = ",".join(map(str, d.speed_ns)), ",".join(map(str, d.memory_ns))

    p.add_argument("--out", default="reports/tour", help="output folder (default reports/tour)")
    p.add_argument("--skip", default="", help=f"comma-separated pieces to skip: {','.join(PIECES)} (default: none)")
    p.add_argument("--sentence", default=SENTENCE, help=f"the sentence MiniLM's attention is shown on (default {SENTENCE!r})")
    p.add_argument("--speed-n", type=positive_int_list, default=speed, dest="speed_n",
                   help=f"sequence lengths timed for sliding window vs SDPA (default {speed})")
    p.add_argument("--memory-n", type=positive_int_list, default=memory, dest="memory_n",
                   help=f"sequence lengths whose peak memory is measured, tiled vs naive (default {memory})")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    add_force(p)


def run(args: argparse.Namespace):
    """Run the tour with a progress line on stderr; print the summary table; return tour.json's dict."""
    from ..tour import TourConfig, run_tour  # lazy subcommand: loaded when the command runs, not by `attnlab --help`

    from ..tour import PIECES  # lazy subcommand: loaded when the command runs, not by `attnlab --help`

    skip = tuple(s.strip() for s in args.skip.split(",") if s.strip())
    unknown = sorted(set(skip) - set(PIECES))
    if unknown:
        raise UsageError(f"--skip {args.skip}: {', '.join(unknown)} is not a piece of the tour; "
                         f"choose from {', '.join(PIECES)}")
    out = output_dir(args.out, resume=False, force=args.force, resumable=False)  # Note [One rule for --out]
    cfg = TourConfig(out=out, sentence=args.sentence, skip=skip, speed_ns=tuple(args.speed_n),
                     memory_ns=tuple(args.memory_n))
    # the memory piece runs naive attention ([H, n, n] scores and weights, float32) in a fresh process
    if "memory" not in skip:
        check_memory(f"--memory-n {max(cfg.memory_ns)}", 3 * 4 * cfg.heads * max(cfg.memory_ns) ** 2,
                     "naive attention's [H, n, n] scores and weights")
    if "speed" not in skip:
        check_memory(f"--speed-n {max(cfg.speed_ns)}", 8 * 4 * cfg.heads * max(cfg.speed_ns) * cfg.head_dim,
                     "float32 inputs and outputs at the longest length timed")
    line = None if args.no_progress else _ProgressLine()
    try:
        res = run_tour(cfg, progress=line)
    finally:
        if line is not None:
            line.close()
    _render(res)
    failed = [p.name for p in res.pieces if p.status == "failed"]
    if failed:  # the table above says why; stderr gets the one line of a failed command
        print(f"attnlab tour: {len(failed)} of {len(res.pieces)} pieces failed ({', '.join(failed)}); "
              f"see {res.index}", file=sys.stderr)
    summary = res.to_dict()
    return summary


class _ProgressLine:
    """One line on stderr, rewritten in place on a terminal; plain lines when stderr is a file or pipe."""

    def __init__(self):
        self.tty = sys.stderr.isatty()
        self.width = 0

    def __call__(self, done: int, total: int, message: str) -> None:
        text = f"[{done}/{total}] {message}"
        if self.tty:
            pad = max(0, self.width - len(text))
            sys.stderr.write("\r" + text + " " * pad)
            self.width = len(text)
        else:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.tty and self.width:
            sys.stderr.write("\r" + " " * self.width + "\r")
            sys.stderr.flush()


def _render(res) -> None:
    from rich.markup import escape
    from rich.table import Table

    t = Table(title=f"attnlab tour ({res.seconds:.0f} s) → {res.index}")
    t.add_column("piece", no_wrap=True)
    t.add_column("status", no_wrap=True)
    t.add_column("what it showed", overflow="fold", ratio=1)
    for p in res.pieces:
        style = {"ok": "green", "failed": "red"}.get(p.status, "yellow")
        # details are plain text ("pip install 'attnlab[minilm]'"): rich would read [...] as markup
        t.add_row(escape(p.name), f"[{style}]{escape(p.status)}[/{style}]", escape(p.detail))
    new_console().print(t)
