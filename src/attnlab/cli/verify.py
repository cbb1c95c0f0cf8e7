"""attnlab verify: prove the kernels on this CPU class and write its record (attnlab.verify.record)."""
from __future__ import annotations

import argparse

from .options import positive_int


def build_parser(p: argparse.ArgumentParser) -> None:
    """verify's options: where the record goes, the fuzz's length, the stages, --fresh."""
    # lazy subcommand: loaded when the command runs, not by `attnlab --help`
    from attnlab.verify.record import RECORDS, STAGES

    p.add_argument("--records", default=str(RECORDS), help="the records folder, one record per CPU class (default: "
                   "the repository's docs/results/cpus)")
    p.add_argument("--repo", default=None, help="the attnlab checkout whose tests run (default: this package's)")
    p.add_argument("--fuzz-minutes", type=float, default=10.0, help="minutes of layout fuzz (default 10)")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated stages (default all: {','.join(STAGES)})")
    p.add_argument("--grid-sample", type=positive_int, default=None,
                   help="cases of the half-type grid per back end (default: all 7,290)")
    p.add_argument("--no-busy", action="store_true", help="headline ratios quiet only (not also beside a "
                   "CPU-bound process)")
    p.add_argument("--fresh", action="store_true", help="start over (default: resume an interrupted run)")
    p.add_argument("--force", action="store_true", help="replace this class's record when it exists (default: "
                   "refused, one line, exit 2)")


def run(args: argparse.Namespace) -> dict:
    """Run the stages with one progress line each on stderr; print the verdict and the files.
    Returns {"record", "exit_code"} (exit 1 when the verdict is not "verified")."""
    import sys

    from attnlab.verify import record  # lazy subcommand: loaded when the command runs, not by `attnlab --help`

    cfg = record.VerifyConfig(out=args.records, force=args.force, repo=args.repo, fuzz_minutes=args.fuzz_minutes,
                              stages=tuple(s.strip() for s in args.stages.split(",") if s.strip()),
                              grid_sample=args.grid_sample, busy=not args.no_busy, resume=not args.fresh)
    cfg.validate()
    rec = record.run(cfg, progress=lambda msg: print(f"attnlab verify: {msg}", file=sys.stderr, flush=True))
    print(f"{rec['key']} at code {rec['code_hash']}: {rec['verdict']} ({args.records}/{rec['key']}.md)")
    return {"record": rec, "exit_code": 0 if rec["verdict"] == "verified" else 1}
