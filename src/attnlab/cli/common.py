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
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from ..report import atomic_write_text

__all__ = ["UsageError", "HelpFormatter", "ArgumentParser", "add_commands", "add_force", "add_width", "console", "fit", "set_width",
           "plain_text", "progress_display", "show_or_write"]


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
            if not any("--width" in a.option_strings for a in p._actions):
                add_width(p, default=argparse.SUPPRESS)  # also after the command; never resets one given before
            p.set_defaults(**{run_key: mod.run})

        if lazy:
            sub.loaders[name] = load
        else:
            load()


#: the narrowest --width: room for a records table's longest word and its column name
MIN_WIDTH = 20
#: the widest --width: far past any terminal or page, short of a width whose lines no viewer could show (rich
#: lays a table out at its width: 1e20 columns was accepted, issue 40)
MAX_WIDTH = 10_000


def _width(text: str) -> int:
    try:
        v = int(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number of columns, got {text!r}") from None
    if v < MIN_WIDTH:
        raise argparse.ArgumentTypeError(f"must be at least {MIN_WIDTH} columns, got {text!r}")
    if v > MAX_WIDTH:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_WIDTH} columns, got {text!r}")
    return v


def add_width(parser: argparse.ArgumentParser, default: Any = None) -> None:
    """The global --width (before or after the command): tables and text fit that many columns."""
    parser.add_argument("--width", type=_width, default=default, metavar="COLUMNS",
                        help=f"print tables and text this many columns wide, {MIN_WIDTH} to {MAX_WIDTH} (default: the "
                             "terminal's width, or $COLUMNS; 80 when piped); tables wrap between words, never "
                             "inside a word or number")


def add_force(parser: argparse.ArgumentParser, what: str = "folder") -> None:
    """The --force every command that writes an --out takes (Note [One rule for --out] in attnlab.resources)."""
    text = ("replace the earlier run an --out folder holds (without it, such a folder is refused)" if what == "folder"
            else "write over an --out file that exists (without it, such a file is refused)")
    parser.add_argument("--force", action="store_true", help=text)


# -- tables that fit the terminal -----------------------------------------------------------------------
# Note [Tables that fit]: rich shares a too-narrow width out by shrinking every column evenly, below the
# longest word in it, and then folds cells mid-word ("weigh/ts") or mid-number ("3.7e-" / "07"), or elides
# them ("mech…"). ``fit`` decides the widths itself, once for every table the CLI prints. Each column is
# at least as wide as the longest word (or number) in its header and cells, or as a short cell line
# whole (``KEEP_WHOLE``: "ok 4.3e-07" is not torn from its number), its floor; the widest
# columns give up width down to their floors and the text wraps between words. When the floors do not
# fit, in this order: the same without borders (one space between columns); the columns in groups, one
# table each, every group led by the first column (the row's name); one record per row ("column  value"
# per line), which fits any width that holds the longest word. Nothing is ever split or elided.
#: a cell line up to this many columns is kept on one line (a value and its unit, "~ rel 5.9"); longer wrap
KEEP_WHOLE = 14
_WIDTH: list[int | None] = [None]  # the global --width, set by ``main.invoke`` for the command it runs


def set_width(width: int | None) -> int | None:
    """Make every console of ``console()`` this many columns wide (None: follow the terminal or $COLUMNS);
    returns the previous setting, for restoring it."""
    old, _WIDTH[0] = _WIDTH[0], width
    return old


def _plain(cell: Any) -> str | None:
    """A cell's text as printed (markup applied), or None for a renderable that is not text."""
    from rich.text import Text

    if isinstance(cell, Text):
        return cell.plain
    if isinstance(cell, str):
        return Text.from_markup(cell).plain
    return None


def _copy(t, **changes):
    """A shallow copy of the rich Table ``t`` (cells shared) with ``changes`` to its attributes."""
    from rich.table import Table

    c = Table.__new__(Table)
    c.__dict__.update(t.__dict__)
    c.__dict__.update(changes)
    return c


def _room(t) -> int:
    """The width ``t``'s borders and padding leave for its cells' text, at a console width of 0."""
    return -t._extra_width - sum(t._get_padding_width(i) for i in range(len(t.columns)))


def _allocate(t, keep: list[int], floors: list[int], lines: list[int], width: int, **changes):
    """A copy of ``t`` with the columns ``keep`` only, each as wide as it needs (``lines``) less what the
    widest give up, down to their ``floors``, so the whole is ``width`` wide; None when the floors do not fit."""
    import dataclasses

    cols = [dataclasses.replace(t.columns[k], _index=n) for n, k in enumerate(keep)]
    table = _copy(t, columns=cols, **changes)
    room = width + _room(table)
    lo, widths = [floors[k] for k in keep], [lines[k] for k in keep]
    if sum(lo) > room:
        return None
    while sum(widths) > room:  # the widest column that can still give gives one column of width
        i = max((n for n in range(len(widths)) if widths[n] > lo[n]), key=lambda n: widths[n])
        widths[i] -= 1
    table.columns = [dataclasses.replace(c, width=w, min_width=None, max_width=None, ratio=None, no_wrap=False,
                                         overflow="fold") for c, w in zip(cols, widths)]
    return table


def _fitted(t, width: int):
    """``t`` fitted to ``width`` (Note [Tables that fit]): one table, a Group of column groups or records;
    None when it fits as it is or holds cells that are not text (rich measures those itself)."""
    from rich.cells import cell_len
    from rich.console import Group

    texts = []
    for c in t.columns:
        col = [_plain(x) for x in [c.header, *c._cells]]
        if any(x is None for x in col):
            return None
        texts.append(col)
    def keep(line: str) -> int:  # a short line ("ok 4.3e-07", "~ rel 5.9") stays whole; a long one wraps
        return cell_len(line) if cell_len(line) <= KEEP_WHOLE else max(map(cell_len, line.split()), default=1)

    lines = [max([cell_len(ln) for x in col for ln in x.splitlines()] or [1]) for col in texts]
    floors = [ln if c.no_wrap else max([keep(x) for y in col for x in y.splitlines()] or [1])
              for c, col, ln in zip(t.columns, texts, lines)]
    n = len(t.columns)
    if sum(lines) <= width + _room(t):
        return None
    one = (_allocate(t, list(range(n)), floors, lines, width)
           or _allocate(t, list(range(n)), floors, lines, width, box=None, show_edge=False, _padding=(0, 1, 0, 0),
                        pad_edge=False))
    if one is not None:
        return one
    groups: list[list[int]] = [[]]
    for k in range(1, n):  # greedily, in order: as many columns beside the first as fit
        if _allocate(t, [0, *groups[-1], k], floors, lines, width) is None:
            groups.append([])
        groups[-1].append(k)
    if n > 1 and all(groups) and _allocate(t, [0, *groups[-1]], floors, lines, width) is not None:
        return Group(*(_allocate(t, [0, *g], floors, lines, width, title=t.title if i == 0 else None,
                                 caption=t.caption if i == len(groups) - 1 else None)
                       for i, g in enumerate(groups)))
    return _records(t, texts)


def _records(t, texts):
    """``t`` as records: one section per row, a line per column ("header  value"), values wrapped."""
    from rich.table import Table

    r = Table(title=t.title, caption=t.caption, title_justify=t.title_justify, show_header=False, box=t.box,
              title_style=t.title_style, caption_style=t.caption_style)
    r.add_column(style="bold", no_wrap=False)
    r.add_column(overflow="fold")
    heads = [t.columns[i].header for i in range(len(t.columns))]
    for row in range(t.row_count):
        cells = [(h, t.columns[i]._cells[row]) for i, h in enumerate(heads) if texts[i][row + 1].strip()]
        for n, (h, cell) in enumerate(cells):
            r.add_row(h, cell, end_section=n == len(cells) - 1)
    return r


def fit(renderable: Any, width: int) -> Any:
    """``renderable`` with every rich Table in it (directly or in a Group) made to fit ``width`` columns
    without splitting or eliding a word or number (Note [Tables that fit]); anything else as it is."""
    from rich.console import Group
    from rich.table import Table

    if isinstance(renderable, Table):
        return _fitted(renderable, width) or renderable
    if isinstance(renderable, Group):
        return Group(*(fit(r, width) for r in renderable.renderables), fit=renderable.fit)
    return renderable


def console(*, stderr: bool = False, file=None, width: int | None = None, **kw):
    """A rich console on stdout (or stderr, when stdout carries JSON), ``width`` or --width columns wide
    (else the terminal's, or $COLUMNS); its ``print`` fits tables to that width (Note [Tables that fit])."""
    from rich.console import Console

    class _Fitting(Console):
        def print(self, *objects, **kwargs):
            """As rich's ``Console.print``, with each table fitted to the console's width."""
            super().print(*(fit(o, self.width) for o in objects), **kwargs)

    return _Fitting(stderr=stderr, file=file, width=width or _WIDTH[0], **kw)


@contextmanager
def progress_display(enabled: bool = True, title: str = "") -> Iterator[Callable[[int, int | None, str], None] | None]:
    """A ``progress(done, total, label)`` callback for the with-block, on stderr so stdout keeps the result:
    a rich bar on a terminal (removed when the block ends, so the summary printed after it stands alone),
    one plain line per call when stderr is piped or a file ("[3/17] check · linear · causal"; without a
    total, "retrieve · embedding the corpus"); ``None`` when not ``enabled``."""
    if not enabled:
        yield None
        return
    if not sys.stderr.isatty():
        def line(done: int, total: int | None, label: str) -> None:
            count = f"[{done}/{total}] " if total else ""
            print(f"{count}{title}{' · ' if title and label else ''}{label}", file=sys.stderr, flush=True)
        yield line
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console(stderr=True), transient=True) as bar:
        task = bar.add_task(title, total=None)

        def update(done: int, total: int | None, label: str) -> None:
            bar.update(task, completed=done, total=total, description=f"{title} {label}".strip())
        yield update


def plain_text(renderable: Any, width: int = 140) -> str:
    """A rich renderable as plain text (no colour), as it is written to a file (tables fitted to ``width``)."""
    from io import StringIO

    buf = StringIO()
    console(file=buf, width=width, no_color=True).print(renderable)
    return buf.getvalue()


def show_or_write(content: str | Any, out: str | None, *, wrote: str = "") -> str | None:
    """Print ``content`` (text as it is, or a rich renderable) or, with ``out``, write it there atomically
    and print "wrote OUT" (plus ``wrote``, e.g. ": 2 of 9 cells wrong"). Returns the text written or
    printed, None for a renderable shown on the terminal."""

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
