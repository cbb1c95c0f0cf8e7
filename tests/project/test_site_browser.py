"""The built docs site read as a newcomer reads it: from file://, in a real browser (Debian chromium through
Playwright), at laptop width. From ``index.html`` every nav link opens its page (not a folder listing), no
page shows raw LaTeX (``$$``) and the course's formula is drawn, every image loads and every plot under
docs/results/ is shown by some page, no page scrolls sideways, search finds pages, and nothing is fetched
from another host."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.browser, pytest.mark.slow]

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]
LAPTOP = {"width": 1366, "height": 768}

# JS: what a reader sees of one page
PAGE = """() => {
  const art = document.querySelector('article');
  const text = art ? art.innerText : '';
  const imgs = [...document.querySelectorAll('article img')].map(i => ({src: i.currentSrc || i.src,
      ok: i.complete && i.naturalWidth > 0, shown: i.getBoundingClientRect().width}));
  const maths = [...document.querySelectorAll('article math')].map(m => m.getBoundingClientRect().height);
  const de = document.documentElement;
  return {title: document.title, h1: !!document.querySelector('article h1'), text_len: text.length,
          raw_tex: (text.match(/\\$\\$/g) || []).length + (text.match(/\\\\[\\[(]/g) || []).length,
          imgs, maths, scroll_w: de.scrollWidth, client_w: de.clientWidth};
}"""


@contextlib.contextmanager
def chromium():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site as ``make docs`` builds it (mkdocs build --strict), into a temporary folder."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocs_jupyter")
    pytest.importorskip("latex2mathml")
    pytest.importorskip("playwright")
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no chromium at {CHROMIUM} (make chromium)")
    out = tmp_path_factory.mktemp("docs") / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                        "-d", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return out


def test_every_nav_link_opens_its_page_from_file_urls(site):
    index = (site / "index.html").resolve().as_uri()
    errors, remote = [], []
    with chromium() as browser:
        page = browser.new_page(viewport=LAPTOP)
        page.on("pageerror", lambda e: errors.append(f"{page.url}: {e}"))
        page.on("request", lambda r: remote.append(r.url) if not r.url.startswith(("file:", "data:", "blob:",
                                                                                    "about:")) else None)
        page.goto(index)
        links = page.eval_on_selector_all(".md-sidebar--primary a.md-nav__link[href]", "es => es.map(e => e.href)")
        urls = list(dict.fromkeys(u.split("#")[0] for u in links if u.startswith("file:")))
        # the nav holds every page of mkdocs.yml's nav (81 entries at the time of writing); a selector that
        # matched nothing would check nothing
        assert len(urls) >= 40, urls
        assert all(u.endswith(".html") for u in urls), [u for u in urls if not u.endswith(".html")]

        shown_pngs, problems = set(), []
        for url in urls:
            page.goto(url)
            info = page.evaluate(PAGE)
            name = url.split("/site/", 1)[-1]
            if not info["h1"] or info["text_len"] < 100:
                problems.append(f"{name}: no page content ({info['title']!r})")
            if info["raw_tex"]:
                problems.append(f"{name}: {info['raw_tex']} raw LaTeX delimiters in the text")
            if any(h <= 0 for h in info["maths"]):
                problems.append(f"{name}: a formula drawn with no height")
            for img in info["imgs"]:
                if not img["ok"] or img["shown"] <= 0:
                    problems.append(f"{name}: image {img['src']} did not load")
                elif img["src"].endswith(".png") and "/results/" in img["src"]:
                    shown_pngs.add(img["src"].split("/site/", 1)[-1])
            if info["scroll_w"] > info["client_w"]:
                problems.append(f"{name}: scrolls sideways ({info['scroll_w']} px wide in {info['client_w']})")
            if name == "notebooks/01-qkv-retrieval.html" and not info["maths"]:
                problems.append(f"{name}: the attention formula is not drawn as math")
        assert not problems, "\n".join(problems)

    # every plot that sits beside a results page is on a page
    pngs = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs" / "results").rglob("*.png")}
    assert not pngs - shown_pngs, f"plots no page shows: {sorted(pngs - shown_pngs)}"
    assert not remote, f"fetched from another host: {remote[:5]}"
    assert not errors, errors[:5]


def test_search_works_from_file_urls(site):
    with chromium() as browser:
        page = browser.new_page(viewport=LAPTOP)
        page.goto((site / "index.html").resolve().as_uri())
        page.click("label.md-search__icon, .md-search__input", timeout=10000) if page.locator(
            ".md-search__input").is_hidden() else None
        page.fill(".md-search__input", "ring attention")
        page.wait_for_selector(".md-search-result__item", timeout=30000)
        hits = page.eval_on_selector_all(".md-search-result__item a", "es => es.map(e => e.href)")
        assert any(h.startswith("file:") and "distributed.html" in h for h in hits), hits[:10]
