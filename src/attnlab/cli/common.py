"""What ``cli/main.py`` and every subcommand module share: the usage error, the parser classes, the
subcommand table loader, and the two ways a command shows what it made (on the terminal, or in a file).

Subcommand modules import from here, never from ``cli.main``: ``main`` imports the subcommands, so the
other direction would be a cycle.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
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


class _LazySubParsers(argparse._SubParsersAction):
    """Subparsers whose options are added when their command is chosen (Note [Lazy subcommands])."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.loaders: dict[str, Any] = {}

    def __call__(self, parser, namespace, values, option_string=None):
        load = self.loaders.pop(values[0], None) if values else None
        if load is not None:
            load()
        super().__call__(parser, namespace, values, option_string)


# Note [Lazy subcommands]: importing every subcommand's module to build the parser cost `attnlab list`
# 1.4 s of its 5 (the bench and experiment suites import training, plotting and model code). The parser
# ``invoke`` builds is lazy: each subcommand is registered by name and help line (all `attnlab --help`
# shows), and its module is imported and its options added only when the command line chooses it, for
# a run or for its --help. ``build_parser()`` without ``lazy`` loads every command, for code that walks
# the parser's options.
def add_commands(parser: argparse.ArgumentParser, table: dict[str, tuple[str, str]], dest: str, *,
                 run_key: str, required: bool = False) -> None:
    """One subparser per entry of ``table`` (name -> (module, one-line help)).

    Each module provides ``build_parser(parser)`` and ``run(args) -> result``; ``run`` is stored on the
    parsed namespace under ``run_key``. A module that does not exist yet (a subcommand still being
    written) is simply not offered; an import error inside an existing module is raised. When
    ``parser`` was made lazy (``lazy_commands``), a module is imported only when its command is chosen
    (Note [Lazy subcommands]); its subcommands are lazy in turn."""

    lazy = getattr(parser, "lazy_commands", False)
    sub = parser.add_subparsers(dest=dest, metavar=dest.upper(), required=required, action=_LazySubParsers)
    for name, (mod_name, help_text) in table.items():
        if importlib.util.find_spec(mod_name) is None:
            continue
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.lazy_commands = lazy

        def load(p=p, mod_name=mod_name):
            mod = importlib.import_module(mod_name)
            mod.build_parser(p)
            p.set_defaults(**{run_key: mod.run})

        if lazy:
            sub.loaders[name] = load
        else:
            load()


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
