"""What ``cli/main.py`` and every subcommand module share: the usage error, the parser classes, the
subcommand table loader, and the two ways a command shows what it made (on the terminal, or in a file).

Subcommand modules import from here, never from ``cli.main``: ``main`` imports the subcommands, so the
other direction would be a cycle.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

__all__ = ["UsageError", "HelpFormatter", "ArgumentParser", "add_commands", "add_force", "console", "plain_text",
           "show_or_write"]


class UsageError(Exception):
    """Bad command-line input: printed without a traceback, exit code 2 (Note [One error boundary])."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, unless its help already says it or there is none to show."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.default in (None, False, argparse.SUPPRESS) or "default" in text.lower()
                or not action.option_strings or isinstance(action.default, bool)):
            return text
        shown = ",".join(map(str, action.default)) if isinstance(action.default, (list, tuple)) else action.default
        shown = str(shown).replace("%", "%%")  # argparse %-formats help strings
        return f"{text} (default: {shown})" if text else f"(default: {shown})"


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line error (Note [One error boundary]): no usage block, a pointer to --help."""

    def __init__(self, *a, **kw):
        kw.setdefault("formatter_class", HelpFormatter)
        super().__init__(*a, **kw)

    def error(self, message):
        """Exit 2 with one line: the program, the message and where help is."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_commands(parser: argparse.ArgumentParser, table: dict[str, tuple[str, str]], dest: str, *,
                 run_key: str, required: bool = False) -> None:
    """One subparser per entry of ``table`` (name -> (module, one-line help)).

    Each module provides ``build_parser(parser)`` and ``run(args) -> result``; ``run`` is stored on the
    parsed namespace under ``run_key``. A module that does not exist yet (a subcommand still being
    written) is simply not offered; an import error inside an existing module is raised."""
    sub = parser.add_subparsers(dest=dest, metavar=dest.upper(), required=required)
    for name, (mod_name, help_text) in table.items():
        try:
            mod = importlib.import_module(mod_name)
        except ModuleNotFoundError as e:
            if e.name != mod_name:
                raise
            continue
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod.build_parser(p)
        p.set_defaults(**{run_key: mod.run})


def add_force(parser: argparse.ArgumentParser, what: str = "folder") -> None:
    """The --force every command that writes an --out takes (Note [One rule for --out] in attnlab.resources)."""
    text = ("replace the earlier run an --out folder holds (without it, such a folder is refused)" if what == "folder"
            else "write over an --out file that exists (without it, such a file is refused)")
    parser.add_argument("--force", action="store_true", help=text)


def console(*, stderr: bool = False):
    """A rich console on stdout (or stderr, when stdout carries JSON)."""
    from rich.console import Console

    return Console(stderr=stderr)


def plain_text(renderable: Any, width: int = 140) -> str:
    """A rich renderable as plain text (no colour), as it is written to a file."""
    from io import StringIO

    from rich.console import Console

    buf = StringIO()
    Console(file=buf, width=width, no_color=True).print(renderable)
    return buf.getvalue()


def show_or_write(content: str | Any, out: str | None, *, wrote: str = "") -> str | None:
    """Print ``content`` (text as it is, or a rich renderable) or, with ``out``, write it there atomically
    and print "wrote OUT" (plus ``wrote``, e.g. ": 2 of 9 cells wrong"). Returns the text written or
    printed, None for a renderable shown on the terminal."""
    from ..report import atomic_write_text

    if out:
        text = content if isinstance(content, str) else plain_text(content)
        atomic_write_text(out, text)
        print(f"wrote {out}{wrote}")
        return text
    if isinstance(content, str):
        sys.stdout.write(content)
        return content
    console().print(content)
    return None
