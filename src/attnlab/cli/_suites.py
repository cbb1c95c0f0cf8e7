"""Shared plumbing for subcommands that dispatch to suites (bench, experiment)."""
from __future__ import annotations

import argparse
import importlib


def add_suites(parser: argparse.ArgumentParser, suites: dict[str, tuple[str, str]], dest: str) -> None:
    """Each suite module provides build_parser(parser) and run(args) -> result."""
    sub = parser.add_subparsers(dest=dest, metavar=dest.upper(), required=True)
    for name, (mod_name, help_text) in suites.items():
        try:
            mod = importlib.import_module(mod_name)
        except ModuleNotFoundError as e:
            if e.name != mod_name:
                raise
            continue
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod.build_parser(p)
        p.set_defaults(_suite_run=mod.run)


def run_suite(args: argparse.Namespace):
    return args._suite_run(args)
