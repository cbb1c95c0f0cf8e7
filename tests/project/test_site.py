"""The docs site (mkdocs.yml) builds in strict mode, offline, and what it builds needs no network.

Strict mode turns every broken link, unknown nav entry, missing anchor and docstring the API reference
cannot parse into a failure. The build runs without a network where the machine allows it (``unshare
-n``, as root), so a plugin that fetches (Google fonts, material's privacy or social plugins) fails it;
the pages must not load scripts, styles or fonts from elsewhere either.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _offline_prefix() -> list[str]:
    unshare = shutil.which("unshare")
    if unshare and subprocess.run([unshare, "-n", "true"], capture_output=True).returncode == 0:
        return [unshare, "-n"]
    return []  # no network namespace here: the page check below still catches fetched assets


def test_docs_site_builds_strict_and_offline(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    pytest.importorskip("mkdocs_jupyter")
    site = tmp_path / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", PYTHONWARNINGS="ignore")
    cmd = [*_offline_prefix(), sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
           "-d", str(site)]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]

    # every guide, notebook, results page and API page was rendered
    # pages are files (use_directory_urls: false), so that links open them from file://
    for page in ("index.html", "core.html", "notebooks/02-worked-example.html",
                 "results/scaling/report.html", "api/attnlab.html", "changelog.html", "search/search_index.js"):
        assert (site / page).is_file(), page
    assert len(list((site / "notebooks").glob("*.html"))) == len(list((ROOT / "docs" / "notebooks").glob("*.ipynb")))
    api = (site / "api" / "attnlab.html").read_text()
    assert 'id="attnlab.attention"' in api and "seq" in api  # the docstring, shapes included
    worked = (site / "notebooks" / "02-worked-example.html").read_text()
    assert "13 of 16 printed cells" in worked  # rendered with its outputs

    # nothing is loaded from another host when the pages are opened (links to elsewhere are fine)
    offenders = [str(p.relative_to(site)) for p in site.rglob("*") if p.suffix in (".html", ".css")
                 and remote_loads(p.read_text(errors="replace"))]
    assert not offenders, offenders

    # math is MathML written at build time; no page is left with raw LaTeX for a renderer it does not load
    course = (site / "notebooks" / "01-qkv-retrieval.html").read_text()
    assert "<math" in course and "text/x-mathjax-config" not in course
    raw = [str(p.relative_to(site)) for p in site.rglob("*.html") if "$$" in _CODE.sub("", p.read_text())]
    assert not raw, raw

    # no internal vocabulary on the site: issue and contract numbers live in the tracker and CHANGELOG's history
    internal = [f"{p.relative_to(site)}: {m.group(0)!r}" for p in site.rglob("*.html")
                for m in INTERNAL.finditer(_TAGS.sub(" ", p.read_text()))]
    assert not internal, internal[:20]


#: what the site, CLI help and user-facing messages must not say (tests/cli/test_cli_vocabulary.py uses it too)
INTERNAL = re.compile(r"issue [0-9]+|contract [0-9]")
_CODE = re.compile(r"<(pre|code|script)\b.*?</\1>", re.S | re.I)
_TAGS = re.compile(r"<[^>]+>")
_TAG = re.compile(r"<(script|img|iframe|link|source)\b[^>]*>", re.I)
_REMOTE = re.compile(r"""\s(?:src|href)\s*=\s*["']?(?:https?:)?//""", re.I)


def remote_loads(text: str) -> list[str]:
    """Tags and CSS rules in ``text`` that make a browser fetch from another host: a remote ``src`` on
    script/img/iframe/source, a remote stylesheet/preload/preconnect/icon ``<link>``, a remote ``@import``
    or ``url()``, Google's font hosts anywhere."""
    found = []
    for m in _TAG.finditer(text):
        tag = m.group(0)
        if not _REMOTE.search(tag):
            continue
        if m.group(1).lower() != "link" or re.search(r"rel\s*=\s*[\"']?(stylesheet|preload|preconnect|icon|modulepreload)", tag, re.I):
            found.append(tag)
    found += re.findall(r"""(?:@import\s+|url\()\s*["']?(?:https?:)?//[^)"'\s]+""", text, re.I)
    found += re.findall(r"fonts\.(?:googleapis|gstatic)\.com", text)
    return found


def test_remote_loads_finds_what_a_browser_would_fetch():
    assert remote_loads('<link rel="stylesheet" href="https://fonts.googleapis.com/css?family=Roboto">')
    assert remote_loads('<link href="//cdn.example/x.css" rel="stylesheet">')
    assert remote_loads('<script src="https://cdn.example/mathjax.js"></script>')
    assert remote_loads("body { background: url('https://x.example/a.png') }")
    assert not remote_loads('<a href="https://squidfunk.github.io/mkdocs-material/">Material</a>')
    assert not remote_loads('<script src="../assets/javascripts/bundle.js"></script><link rel="stylesheet" href="a.css">')
