"""A result store on disk: partial results as they arrive, resume, and the finished report's files.

Note [Partial results]: every finished record is written at once (``results.partial.json``, atomically),
so a run killed at any moment, even by SIGKILL, keeps everything it finished; ``resume`` reads it back
and reuses a record only when its key (the job's settings plus the store's context) matches exactly.
When the run completes, :func:`write_report` writes results.json, report.md and report.html and the
partial file goes.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

from attnlab.report import atomic_write_json, atomic_write_text, render_markdown_file

__all__ = ["ResultStore", "write_report", "remove_partial", "PARTIAL"]

#: the partial results file of an output folder
PARTIAL = "results.partial.json"


class ResultStore:
    """The records of one output folder, on disk as they arrive (Note [Partial results]).

    out: the folder; sections: the lists of records the state holds (``state[section]``); context:
    settings every record shares (threads, isolation, ...), part of each record's key; resume: read
    the partial file (else results.json) of an earlier run so that :meth:`lookup` finds its records.

    ``state`` is the dict saved (add your own top-level fields before :meth:`save`); ``previous`` the
    earlier run's whole file when resuming (None otherwise), ``source`` its path. Raises ValueError
    naming the file when an earlier run's file cannot be read."""

    def __init__(self, out: str | os.PathLike, *, sections: Iterable[str] = ("records",), context: dict | None = None,
                 resume: bool = False):
        self.out = Path(out)
        self.sections = tuple(sections)
        self.context = dict(context or {})
        self.partial = self.out / PARTIAL
        self.state: dict[str, Any] = {"complete": False, **{s: [] for s in self.sections}}
        self.earlier: dict[str, dict] = {}
        self.previous: dict | None = None
        self.source: str | None = None
        if resume:
            for path in (self.partial, self.out / "results.json"):
                if path.exists():
                    try:
                        old = json.loads(path.read_text())
                    except (OSError, ValueError) as e:
                        raise ValueError(f"--resume: cannot read {path}: {e}") from None
                    if not isinstance(old, dict):
                        raise ValueError(f"--resume: {path} is not an attnlab results file")
                    self.previous, self.source = old, str(path)
                    for sec in self.sections:
                        for r in old.get(sec, []) or []:
                            if isinstance(r, dict) and r.get("settings_key"):
                                self.earlier[r["settings_key"]] = r
                    break

    def key(self, job: dict) -> str:
        """The identity of a job: its settings and the store's context, as canonical JSON."""
        return json.dumps({**job, **self.context}, sort_keys=True, default=str)

    def lookup(self, job: dict) -> dict | None:
        """The earlier run's record for ``job`` (a copy), or None."""
        rec = self.earlier.get(self.key(job))
        return None if rec is None else json.loads(json.dumps(rec))

    def add(self, rec: dict, section: str | None = None, job: dict | None = None) -> dict:
        """Append ``rec`` to ``section`` (default: the first), keyed by ``job`` when given
        (``rec["settings_key"]``), and save at once. Returns ``rec``."""
        section = self.sections[0] if section is None else section
        if section not in self.state:
            raise ValueError(f"ResultStore.add: unknown section {section!r}; sections are {list(self.sections)}")
        if job is not None:
            rec["settings_key"] = self.key(job)
        self.state[section].append(rec)
        self.save()
        return rec

    def save(self) -> Path:
        """Write the state (and the context) to the partial file atomically."""
        self.out.mkdir(parents=True, exist_ok=True)
        state = {**self.state, "context": self.context} if self.context else self.state
        return atomic_write_json(self.partial, state)

    def finish(self, results: dict, report_md: str, title: str | None = None) -> dict:
        """:func:`write_report` then remove the partial file; returns the written paths."""
        paths = write_report(self.out, results, report_md, title)
        remove_partial(self.out)
        return paths


def write_report(out: str | os.PathLike, results: dict, report_md: str, title: str | None = None) -> dict:
    """Write results.json, report.md and report.html (rendered, readable in a browser) into ``out``
    atomically; returns {"results", "report", "html"} paths as str."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "results.json", results)
    atomic_write_text(out / "report.md", report_md)
    html = render_markdown_file(out / "report.md", title or f"attnlab {out.name} report")
    return {"results": str(out / "results.json"), "report": str(out / "report.md"), "html": str(html)}


def remove_partial(out: str | os.PathLike) -> None:
    """Remove ``out``'s partial results file, if any (the run it belonged to is complete)."""
    p = Path(out) / PARTIAL
    if p.exists():
        p.unlink()
