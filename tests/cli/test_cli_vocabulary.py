"""What a user reads speaks to a user: no tracker numbers ("issue 23", "contract 3") in the help of any
command, in any message the package can print, or in a table title; the docs site has the same check
(tests/project/test_site.py). Issue numbers belong in the tracker and in CHANGELOG's history."""
from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

from attnlab.cli.main import build_parser, main

INTERNAL = re.compile(r"issue [0-9]+|issue-[0-9]+|contract [0-9]")
SRC = Path(__file__).resolve().parents[2] / "src" / "attnlab"


def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("attnlab",)):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def test_no_command_help_names_an_issue_or_a_contract():
    found, n = [], 0
    for path, parser in _parsers(build_parser()):  # every subcommand loaded, its options added
        n += 1
        for m in INTERNAL.finditer(parser.format_help()):
            found.append(f"{' '.join(path)} --help: {m.group(0)!r}")
    assert n >= 25  # attnlab, its commands, bench's suites and experiment's names: a walk that found none checks nothing
    assert not found, found


def test_no_message_the_package_prints_names_an_issue_or_a_contract():
    """Every string literal in the package that is not a docstring or a comment: error messages, help lines,
    report text, result fields (docstrings that reach users are checked on the docs site's API pages)."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
                      and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                    and INTERNAL.search(node.value)):
                found.append(f"{path.relative_to(SRC)}:{node.lineno}: {node.value[:80]!r}")
    assert not found, found


def test_explain_table_titles_read_as_arguments_not_a_dict(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    assert main(["explain", "--shape", "1,2,64,16", "--causal"]) == 0
    out = capsys.readouterr().out
    title = next(line for line in out.splitlines() if line.startswith("query"))
    assert "{" not in title and "'" not in title, title
    assert "is_causal=True" in title and "method=auto" in title, title
