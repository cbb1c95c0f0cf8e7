"""attnlab tour: the library runs its pieces and reports progress; the page is Markdown rendered to HTML
with figures inline and escaped text; a failing piece is listed and does not stop the tour."""
import json
import re

import pytest

from attnlab import tour
from attnlab.cli import main as M
from attnlab.report import markdown_to_html

SMALL = dict(speed_ns=(128, 256), memory_ns=(128, 256), variance_dks=(16, 64, 256), repeats=1)


@pytest.mark.slow
def test_tour_measures_and_renders(tmp_path):
    events = []
    res = tour.run_tour(tour.TourConfig(out=tmp_path, skip=("heads", "viz"), **SMALL),
                        progress=lambda done, total, msg: events.append((done, total, msg)))
    status = {p.name: p.status for p in res.pieces}
    assert status == {"explain": "ok", "trace": "ok", "variance": "ok", "speed": "ok", "memory": "ok",
                      "heads": "skipped", "viz": "skipped"}, [(p.name, p.detail) for p in res.pieces]
    assert res.exit_code == 0
    # progress: every piece reports, counts only go up, long pieces report their inner steps
    dones = [e[0] for e in events]
    assert dones == sorted(dones) and dones[-1] == 7 and all(e[1] == 7 for e in events)
    assert any("memory: naive at n=256" in e[2] for e in events) and any("d_k=64" in e[2] for e in events)
    page = (tmp_path / "index.html").read_text()
    for fig in ("variance/variance.png", "speed.png", "memory.png"):
        assert f'<img src="{fig}"' in page and (tmp_path / fig).read_bytes()[:4] == b"\x89PNG"
    assert "<table>" in page and "<h2>" in page
    assert not re.search(r'href="[^"]*\.md"', page)  # reports are linked as rendered HTML
    assert (tmp_path / "variance" / "report.html").read_text().count("<tr>") == 1 + 3 * 3
    # the tables show what was measured
    speed = json.loads((tmp_path / "speed.json").read_text())
    assert [r["n"] for r in speed] == [128, 256] and all(r["sdpa_s"] > 0 and r["window_s"] > 0 for r in speed)
    assert f"{speed[-1]['sdpa_s'] * 1e3:.2f}" in page
    mem = json.loads((tmp_path / "memory.json").read_text())
    assert {(r["n"], r["impl"]) for r in mem} == {(128, "tiled"), (128, "naive"), (256, "tiled"), (256, "naive")}
    var = next(p for p in res.pieces if p.name == "variance").detail
    unscaled, scaled = (float(x) for x in re.findall(r"d_k\^(-?[\d.]+)", var)[:2])
    assert abs(unscaled - 1) < 0.2 and abs(scaled) < 0.2  # Var(q·k) ∝ d_k, flat after ÷√d_k
    assert json.loads((tmp_path / "tour.json").read_text())["exit_code"] == 0


def test_failing_piece_is_listed_and_tour_goes_on(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("<b>kaput</b>")

    monkeypatch.setitem(tour._RUN, "trace", boom)
    res = tour.run_tour(tour.TourConfig(out=tmp_path, skip=("variance", "speed", "memory", "heads", "viz")))
    status = {p.name: p.status for p in res.pieces}
    assert status["trace"] == "failed" and status["explain"] == "ok" and res.exit_code == 1
    page = (tmp_path / "index.html").read_text()
    assert "&lt;b&gt;kaput&lt;/b&gt;" in page and "<b>kaput" not in page
    explain = (tmp_path / "explain.txt").read_text()
    assert explain.count("method:") == len(tour.EXPLAIN_SHAPES)


def test_cli_tour_prints_progress_lines(tmp_path, capsys):
    assert M.main(["tour", "--out", str(tmp_path), "--skip", "variance,speed,memory,heads,viz"]) == 0
    cap = capsys.readouterr()
    lines = [ln for ln in cap.err.splitlines() if ln.startswith("[")]
    assert lines[0].startswith("[0/7] explain: starting") and lines[-1].startswith("[7/7] viz: skipped")
    assert "trace" in cap.out and (tmp_path / "trace.html").stat().st_size > 0
    assert M.main(["tour", "--out", str(tmp_path), "--skip", "explain,trace,variance,speed,memory,heads,viz",
                   "--no-progress", "--force"]) == 0  # the folder holds the run above: Note [One rule for --out]
    assert "[" not in capsys.readouterr().err


def test_markdown_page_escapes_text():
    p = tour.Piece("viz", "t<i>", detail="<script>alert(1)</script> *x* [a](javascript:alert(1))",
                   links=[{"href": "a'b\".html", "label": "<b>"}], figures=[{"href": "x y.png", "caption": "<img>"}])
    page = markdown_to_html(tour.index_markdown([p], {"cpu": "<cpu>"}))
    assert "<script>alert" not in page and "&lt;script&gt;" in page and "&lt;cpu&gt;" in page
    assert "<b>" not in page and "href=\"javascript" not in page  # no raw markup, no script link
    assert 'src="x%20y.png"' in page


@pytest.mark.parametrize("argv, needle", [(["--skip", "dance"], "--skip dance: dance is not a piece of the tour"),
                                          (["--speed-n", "0,12"], "--speed-n: must be comma-separated positive integers"),
                                          (["--memory-n", "a"], "--memory-n: must be comma-separated positive integers")])
def test_tour_rejects_bad_options(tmp_path, argv, needle, capsys):
    assert M.main(["tour", "--out", str(tmp_path), *argv]) == 2
    assert needle in capsys.readouterr().err
