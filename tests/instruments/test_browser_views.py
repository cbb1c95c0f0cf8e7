"""The viz page's exports and cross-attention in a real browser (Debian chromium through Playwright):
each view's "export SVG" / "export PNG" buttons download a valid SVG (parsed by xml.etree) and PNG
(signature, decoded by matplotlib) of the view as drawn; a cross-attention page labels queries and keys
with their own tokens; ``viz.save`` writes the same two formats from Python."""
from __future__ import annotations

import contextlib
import io
import xml.etree.ElementTree as ET

import numpy as np
import pytest
import torch

from attnlab import viz

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
HOSTILE = '<script>window.pwned=1</script>&"x"'


def _check_png(data: bytes) -> np.ndarray:
    import matplotlib.image as mpimg

    assert data[:8] == PNG_SIGNATURE
    img = mpimg.imread(io.BytesIO(data), format="png")
    assert img.ndim == 3 and img.shape[0] > 20 and img.shape[1] > 20
    assert float(img[..., :3].std()) > 0.01  # not a blank picture
    return img


def _check_svg(data: bytes) -> ET.Element:
    root = ET.fromstring(data)
    assert root.tag.endswith("svg")
    return root


def _texts(root: ET.Element) -> list[str]:
    return [e.text for e in root.iter() if e.tag.endswith("text") and e.text]


def _weights(L, S, layers=2, heads=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(layers, heads, L, S, generator=g) * 2, -1)


def test_python_side_save_writes_valid_png_and_svg(tmp_path):
    w = _weights(5, 8)
    page = viz.show(w, list("abcde"), key_tokens=[f"key{j}" for j in range(8)])
    svg = viz.save(page, tmp_path / "x.svg", layer=1)
    root = _check_svg(svg.read_bytes())
    assert "key7" in ET.tostring(root, encoding="unicode") or any("key7" in t for t in _texts(root))
    _check_png(viz.save(page, tmp_path / "x.png").read_bytes())
    _check_png(page.save(tmp_path / "y.png", heads=[2]).read_bytes())
    _check_png(viz.save(w[0], tmp_path / "raw.png", tokens=list("abcde"), key_tokens=list("ABCDEFGH")).read_bytes())
    with pytest.raises(ValueError, match=r"\.png or \.svg"):
        viz.save(page, tmp_path / "x.pdf")
    with pytest.raises(ValueError, match=r"layer 2 out of range"):
        viz.save(page, tmp_path / "x.png", layer=2)


@contextlib.contextmanager
def _browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        try:
            yield b
        finally:
            b.close()


def _open(browser, path, errors):
    page = browser.new_page(viewport={"width": 1200, "height": 850}, accept_downloads=True)
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("dialog", lambda d: (errors.append(d.message), d.dismiss()))
    page.goto(path.as_uri())
    page.wait_for_selector("body[data-painted]", timeout=30000)
    return page


def _export(page, view, fmt) -> bytes:
    page.click(f"nav button[data-view={view}]")
    with page.expect_download(timeout=15000) as dl:
        page.click(f"section#{view} button.export[data-fmt={fmt}]")
    d = dl.value
    assert d.suggested_filename.startswith(f"attnlab-{view}") and d.suggested_filename.endswith("." + fmt)
    return open(d.path(), "rb").read()


@pytest.mark.browser
@pytest.mark.slow
def test_every_view_exports_svg_and_png(tmp_path):
    tokens = ["[CLS]", "the", HOSTILE, "sat", "on", "[SEP]"]
    path = viz.show(_weights(6, 6), tokens).save(tmp_path / "page.html")
    errors: list[str] = []
    with _browser() as b:
        page = _open(b, path, errors)
        page.click("#qcol .tok[data-i='2']")  # the head view as drawn now: one (pinned) query's links
        for view in ("head", "matrix", "model", "pattern"):
            root = _check_svg(_export(page, view, "svg"))
            if view == "head":
                texts = _texts(root)
                assert HOSTILE in texts and "[SEP]" in texts  # the token text, as text (XML-escaped on write)
                assert len([e for e in root.iter() if e.tag.endswith("line")]) > 0
                assert any("query 2" in t for t in texts)  # the readout of the hovered query
            _check_png(_export(page, view, "png"))
        assert page.evaluate("window.pwned") is None
    assert not errors, errors


@pytest.mark.browser
@pytest.mark.slow
def test_cross_attention_page_labels_queries_and_keys(tmp_path):
    L, S = 4, 9
    q = [f"q{i}" for i in range(L)]
    k = [f"key{j}" for j in range(S)]
    w = _weights(L, S, layers=1, heads=2, seed=5)
    path = viz.show(w, q, key_tokens=k).save(tmp_path / "cross.html")
    errors: list[str] = []
    with _browser() as b:
        page = _open(b, path, errors)
        assert page.eval_on_selector_all("#qcol .tok", "es => es.map(e => e.textContent)") == q
        assert page.eval_on_selector_all("#kcol .tok", "es => es.map(e => e.textContent)") == k
        assert "4 queries × 9 keys" in page.inner_text("header")
        page.hover("#qcol .tok[data-i='1']")
        best = int(w[0, :, 1].max(0).values.argmax())
        assert f"strongest key {best} \u201ckey{best}\u201d" in page.inner_text("#readout")
        page.click("nav button[data-view=matrix]")
        box = page.eval_on_selector("#mat", "e => { const b = e.getBoundingClientRect(); "
                                            "return [b.x, b.y, b.width, b.height]; }")
        page.mouse.move(box[0] + box[2] * (S - 0.5) / S, box[1] + box[3] * 0.5 / L)  # the last key of query 0
        assert "query 0 \u201cq0\u201d \u2192 key 8 \u201ckey8\u201d" in page.inner_text("#mreadout")
        assert page.eval_on_selector_all("#mcols .mlab", "es => es.map(e => e.textContent)") == k
        page.click("nav button[data-view=pattern]")
        assert "cross-attention" in page.inner_text("#patterns")
        _check_png(_export(page, "matrix", "png"))
    assert not errors, errors


@pytest.mark.browser
@pytest.mark.slow
def test_png_export_is_the_figure_viz_save_writes(tmp_path):
    """The head and matrix views' PNG: the layer's heads as heatmaps in matplotlib's viridis, each head from 0 to
    its max (Note [One export figure]); oracle: matplotlib's colormap applied to the page's own weights. Raw
    tokens show on hover; a long input's matrix view has position numbers on both axes."""
    import matplotlib

    from attnlab.viz.show import _page_weights

    tokens = ["The", "Ġcat", HOSTILE, "Ġsat", "Ġon", "Ġmat"]
    page_obj = viz.show(_weights(6, 6, layers=2, heads=3, seed=3), tokens)
    path = page_obj.save(tmp_path / "page.html")
    long_path = viz.show(_weights(300, 300, layers=1, heads=2, seed=4), [f"t{i}" for i in range(300)],
                         dense_max_tokens=64).save(tmp_path / "long.html")
    errors: list[str] = []
    with _browser() as b:
        page = _open(b, path, errors)
        assert page.get_attribute("#qcol .tok[data-i='1']", "title") == 'token 1: "\u0120cat"'
        assert page.inner_text("#qcol .tok[data-i='1']") == "cat"
        page.select_option("#layer", "1")
        for view in ("head", "matrix"):
            if view == "matrix":
                page.click("nav button[data-view=matrix]")
                page.select_option("#mlayer", "1")
            img = _check_png(_export(page, view, "png"))
            fig = page.evaluate("window.attnlabFigure")
            assert fig["layer"] == 1 and [p["head"] for p in fig["panels"]] == [0, 1, 2]
            assert (img.shape[1], img.shape[0]) == (fig["width"], fig["height"])
            assert float(img[:, img.shape[1] // 2:, :3].std()) > 0.05  # the right half is drawn too
            w = _page_weights(page_obj.data, 1)  # (H, L, S): the weights the page holds
            k = fig["scale"]
            for p in fig["panels"]:
                want = matplotlib.colormaps["viridis"](np.round(255 * w[p["head"]] / w[p["head"]].max()).astype(int))
                for i, j in ((0, 0), (2, 1), (5, 5), (3, 0)):
                    y = int(k * (p["y"] + (i + 0.5) * p["h"] / 6))
                    x = int(k * (p["x"] + (j + 0.5) * p["w"] / 6))
                    assert np.abs(img[y, x, :3] - want[i, j, :3]).max() <= 2 / 255, (p["head"], i, j)
        page = _open(b, long_path, errors)
        page.click("nav button[data-view=matrix]")
        ticks = page.eval_on_selector_all("#mrows .mlab.tick", "es => es.map(e => e.textContent)")
        assert len(ticks) >= 4 and ticks[0] == "0"
        page.click("#zdiag")  # 64 tokens: still too small a cell for tokens, so numbers on both axes
        assert page.eval_on_selector_all("#mcols .mlab.tick", "es => es.length") >= 4
        assert page.eval_on_selector_all("#mrows .mlab.tick", "es => es.length") >= 4
    assert not errors, errors
