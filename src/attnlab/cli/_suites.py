"""Shared plumbing for subcommands that dispatch to suites (bench, experiment)."""
from __future__ import annotations

import argparse

from attnlab.functional import calibration

from .common import add_commands


def add_suites(parser: argparse.ArgumentParser, suites: dict[str, tuple[str, str]], dest: str) -> None:
    """Each suite module provides build_parser(parser) and run(args) -> result."""
    add_commands(parser, suites, dest, run_key="_suite_run", required=True)


def run_suite(args: argparse.Namespace):
    """Run the suite chosen on the command line; its result. No background calibration runs meanwhile
    (Note [Calibration held]): a benchmark's timings never share the CPU with it unseen."""

    with calibration.held("attnlab bench is timing"):
        return args._suite_run(args)
