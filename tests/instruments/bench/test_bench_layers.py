"""attnlab bench layers: structure, FLOP model, crossover arithmetic and the --quick smoke run (no timing asserts)."""
from __future__ import annotations

import json
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from attnlab import patterns
from attnlab.bench import layers as BL
from attnlab.cli import main as cli


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.one_thread


def _counted(fn) -> int:
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        fn()
    return fc.get_total_flops()


# -- layers compute what they claim -----------------------------------------------------------------------
def test_attention_layers_match_plain_torch():
    torch.manual_seed(0)
    x = torch.randn(2, 17, 8, dtype=torch.float64)
    out = BL.make_layer("attention", 8).double()(x)
    ref = torch.softmax(x @ x.transpose(1, 2) / math.sqrt(8), -1) @ x  # (B, n, d)
    torch.testing.assert_close(out, ref)
    w = 3
    out = BL.make_layer("attention_window", 8, window=w).double()(x)
    i = torch.arange(17)
    band = (i[:, None] - i[None, :]).abs() <= w  # (n, n) keys within w of the query
    s = (x @ x.transpose(1, 2) / math.sqrt(8)).masked_fill(~band, float("-inf"))
    torch.testing.assert_close(out, torch.softmax(s, -1) @ x)


def test_conv_layer_keeps_length_and_matches_torch_conv():
    torch.manual_seed(0)
    layer = BL.make_layer("conv", 6, kernel=5)
    x = torch.randn(3, 11, 6)
    ref = torch.nn.functional.conv1d(x.transpose(1, 2), layer.conv.weight, layer.conv.bias, padding=2)
    torch.testing.assert_close(layer(x), ref.transpose(1, 2))


def test_flop_model_against_torch_flop_counter():
    n, d, B = 19, 12, 2
    x = torch.randn(B, n, d)
    # recurrent and convolutional layers: torch counts their matrix products directly (GRU) ...
    assert BL.flops("gru", n, d, batch=B) == _counted(lambda: BL.make_layer("gru", d)(x))
    assert BL.flops("conv", n, d, batch=B, kernel=3) == _counted(lambda: BL.make_layer("conv", d, kernel=3)(x))
    # ... or through an unrolled cell (LSTM; CPU's fused LSTM is not counted)
    cell, h, c = torch.nn.LSTMCell(d, d), torch.zeros(B, d), torch.zeros(B, d)

    def unrolled():
        hc = (h, c)
        for t in range(n):
            hc = cell(x[:, t], hc)

    assert BL.flops("lstm", n, d, batch=B) == _counted(unrolled)
    # attention: the two products of plain-torch attention, plus the four projections
    plain = _counted(lambda: torch.softmax(x @ x.transpose(1, 2), -1) @ x)
    assert BL.flops("attention", n, d, batch=B) == plain == BL.flops("attention_fused", n, d, batch=B)
    proj = BL.make_layer("attention+proj", d)
    assert BL.flops("attention+proj", n, d, batch=B) == plain + _counted(lambda: [p(x) for p in proj.proj])
    # restricted attention: the band's pairs only
    nnz = int(patterns.sliding_window(2).materialize(n, n).sum())
    assert BL.flops("attention_window", n, d, batch=B, window=2) == B * 2 * nnz * 2 * d


# -- structure: sequential operations and path length --------------------------------------------------------
@pytest.mark.parametrize("n", [7, 13])
def test_structure_against_geometry(n):
    w, k = 2, 5
    for name in ("attention", "attention_fused", "attention+proj"):
        s = BL.structure(name, n)
        assert (s["sequential_ops"], s["max_path_length"], s["one_layer_density"]) == (1, 1, 1.0)
    s = BL.structure("attention_window", n, window=w)
    assert s["sequential_ops"] == 1 and s["max_path_length"] == math.ceil((n - 1) / w)
    assert s["one_layer_density"] == pytest.approx(patterns.sliding_window(w).density(n, n))
    s = BL.structure("conv", n, kernel=k)
    assert s["sequential_ops"] == 1 and s["max_path_length"] == math.ceil((n - 1) / (k // 2))
    for name in ("gru", "lstm"):
        s = BL.structure(name, n)
        assert s["sequential_ops"] == n and s["max_path_length"] == n
        assert s["one_layer_density"] == pytest.approx((n + 1) / (2 * n))  # causal: lower triangle


def test_diameter_of_simple_graphs():
    n = 9
    i = torch.arange(n)
    chain = (i[:, None] - i[None, :]).abs() <= 1
    assert BL._diameter(chain) == n - 1
    assert BL._diameter(torch.ones(n, n, dtype=torch.bool)) == 1
    assert BL._diameter(torch.eye(n, dtype=torch.bool)) is None  # nothing ever connects


# -- crossover and slopes on synthetic rows (times chosen, so the answer is known) --------------------------------
def test_crossover_and_slopes_on_synthetic_timings():
    rows = []
    for d in (8, 32):
        for n in (2, 4, 8, 16, 32, 64, 128):
            rows.append({"layer": "attention", "n": n, "d": d, "forward_s": 1e-6 * n * n * d})
            rows.append({"layer": "gru", "n": n, "d": d, "forward_s": 1e-6 * 3 * n * d * d})
    cross = BL.crossover(rows, "attention", "gru", "forward_s")
    assert [c["d"] for c in cross] == [8, 32]
    for c in cross:  # n²d = 3nd²  <=>  n = 3d
        assert c["n_star"] == pytest.approx(3 * c["d"], rel=1e-9)
        assert c["n_star_over_d"] == pytest.approx(3.0)
        assert c["flop_model_n_star"] == pytest.approx(3 * c["d"])  # 4n²d = 12nd²
    slopes = BL.fitted_slopes(rows)
    assert slopes["attention"]["n_slope"] == pytest.approx(2.0) and slopes["attention"]["d_slope"] == pytest.approx(1.0)
    assert slopes["gru"]["n_slope"] == pytest.approx(1.0) and slopes["gru"]["d_slope"] == pytest.approx(2.0)
    # attention always cheaper: no crossing, and the verdict says so
    flat = [dict(r, forward_s=r["forward_s"] * (1e-3 if r["layer"] == "attention" else 1)) for r in rows]
    c = BL.crossover([r for r in flat if r["d"] == 8], "attention", "gru", "forward_s")[0]
    assert c["n_star"] is None and "cheaper at every n" in c["verdict"]


def test_saved_bytes_hold_the_attention_matrix_and_grow_with_n():
    a16 = BL.measure("attention", 16, 8, min_time=0.0, max_reps=1)
    a64 = BL.measure("attention", 64, 8, min_time=0.0, max_reps=1)
    g16 = BL.measure("gru", 16, 8, min_time=0.0, max_reps=1)
    g64 = BL.measure("gru", 64, 8, min_time=0.0, max_reps=1)
    assert a64["saved_bytes"] >= 4 * 64 * 64  # at least the float32 weights [n, n]
    assert a64["saved_bytes"] / a16["saved_bytes"] > 8  # ~ n² (16x), well above linear
    assert 2 < g64["saved_bytes"] / g16["saved_bytes"] < 8  # ~ n (4x)
    f64 = BL.measure("attention_fused", 64, 8, min_time=0.0, max_reps=1)
    assert f64["saved_bytes"] < a64["saved_bytes"]  # the fused kernel keeps O(n) (out, logsumexp), not [n, n]
    for r in (a16, a64, g16, g64, f64):
        assert r["forward_s"] > 0 and r["forward_backward_s"] > 0 and r["forward_peak_bytes"] > 0


# -- the CLI ----------------------------------------------------------------------------------------------------
def test_bench_layers_quick_writes_report_json_and_plots(tmp_path, capsys):
    out = tmp_path / "bl"
    outcome = cli.invoke(["bench", "layers", "--quick", "--out", str(out)])
    assert outcome.exit_code == 0
    res = outcome.result
    cfg = res.config
    assert {(r["layer"], r["n"], r["d"]) for r in res.rows} == {
        (name, n, d) for name in BL.LAYERS for n in cfg["ns"] for d in cfg["ds"]}
    on_disk = json.loads((out / "layers.json").read_text())
    assert on_disk["rows"] == json.loads(json.dumps(res.rows))
    for f in ("layers_time.png", "layers_memory.png"):
        assert (out / f).read_bytes()[:4] == b"\x89PNG"
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]  # atomic writes leave nothing behind
    md = (out / "layers.md").read_text()
    for cell in ("O(n²·d)", "O(n·d²)", "O(k·n·d²)", "O(r·n·d)", "O(n/r)"):
        assert cell in md
    assert "n < d" in md
    # every (attention, recurrent, timing, d) has a crossover entry
    assert len(res.crossover) == 3 * 2 * 2 * len(cfg["ds"])
    assert "crossover" in capsys.readouterr().out


def test_bench_layers_bad_input(tmp_path, capsys):
    assert cli.main(["bench", "layers", "--quick", "--layers", "transformer", "--out", str(tmp_path)]) == 2
    assert "transformer" in capsys.readouterr().err
    assert cli.main(["bench", "layers", "--quick", "--kernel", "4", "--out", str(tmp_path)]) == 2
    assert cli.main(["bench", "layers", "--quick", "--ns", "0,8", "--out", str(tmp_path)]) == 2
