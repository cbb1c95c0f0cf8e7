"""The viz page in a real browser (Debian chromium through Playwright): it loads offline without console
errors, hovering a token changes what is highlighted, the model view opens a head, a screenshot is taken."""
from __future__ import annotations

import pytest

from attnlab.cli.main import main

pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]


def test_viz_page_in_chromium(tmp_path):
    from playwright.sync_api import sync_playwright

    out = tmp_path / "viz"
    text = 'The cat sat on the mat </script> & "it" was <b>tired</b>'
    assert main(["viz", text, "--model", "random", "--out", str(out)]) == 0
    url = (out / "index.html").resolve().as_uri()
    errors, requests = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 800})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("request", lambda r: requests.append(r.url))
            page.goto(url)
            page.wait_for_selector("body[data-ready='1']", timeout=15000)
            assert page.locator("#text").text_content() == text  # escaped in HTML, shown verbatim
            assert page.locator("header b").count() == 0  # the <b> in the text stayed text

            keys = "#kcol .tok"
            bg = lambda: page.eval_on_selector_all(keys, "es => es.map(e => e.style.background)")  # noqa: E731
            before = bg()
            assert all(b == "" for b in before)
            page.locator("#qcol .tok").nth(3).hover()  # "on"
            after = bg()
            assert after != before and sum(b != "" for b in after) >= 1
            assert page.locator("#lines line").count() > 0
            assert page.locator("#qcol .tok").nth(3).evaluate("e => e.classList.contains('active')")
            weights = page.eval_on_selector_all(keys, "es => es.map(e => parseFloat(e.dataset.w))")
            assert max(weights) > 0 and all(0 <= w <= 1.0 + 1e-9 for w in weights)
            page.locator("#qcol .tok").nth(5).hover()
            assert bg() != after  # another token, another highlight

            page.click("nav button[data-view=model]")
            page.locator(".cell[data-layer='1'][data-head='2']").click()  # opens layer 1, head 2 in the head view
            assert page.locator("#layer").input_value() == "1"
            assert page.locator(".chip.on").count() == 1
            page.click("nav button[data-view=pattern]")
            assert page.locator(".pat canvas").count() >= 2
            page.click("nav button[data-view=head]")
            shot = tmp_path / "viz.png"
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 5000
    assert errors == []
    assert all(u.startswith("file://") for u in requests), requests
