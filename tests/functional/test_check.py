"""attnlab check / attnlab list: the CLI returns inspectable results and its exit code means something."""
from __future__ import annotations

from dataclasses import dataclass

import torch

import attnlab
import attnlab.mechanisms as M
from attnlab.cli import main as cli


def run_cli(argv):
    outcome = cli.invoke(argv)
    return outcome.exit_code, outcome.result


def test_list_shows_every_mechanism_with_its_spec(capsys):
    code, res = run_cli(["list", "--json"])
    assert code == 0
    names = [r["name"] for r in res["mechanisms"]]
    assert names == list(M.available())
    by = {r["name"]: r for r in res["mechanisms"]}
    assert by["linformer"]["causal"] is False and by["linear"]["causal"] is True
    assert by["nystrom"]["masks"] == "key" and by["dense"]["masks"] == "any"
    assert by["linear"]["gflop"] < by["dense"]["gflop"] / 10  # cost at 4096: linear is far cheaper
    assert by["block_sparse"]["gflop"] is None  # needs a layout: no default cost
    code, res = run_cli(["list", "--kind", "approximate"])
    assert code == 0 and {r["name"] for r in res["mechanisms"]} == {
        "linear", "performer", "linformer", "nystrom", "token_pruning", "hierarchical"}
    assert "performer" in capsys.readouterr().out


def test_list_kernels_shows_the_planners_declarations(capsys):
    from attnlab import kernels

    code, res = run_cli(["list", "--kernels", "--json"])
    assert code == 0 and [r["name"] for r in res["kernels"]] == list(attnlab.METHODS[1:])
    by = {r["name"]: r for r in res["kernels"]}
    for s in kernels.KERNELS:
        assert by[s.name]["dropout"] == s.dropout and by[s.name]["weights"] == s.weights
    assert run_cli(["list", "--kernels"])[0] == 0
    assert "second pass" in capsys.readouterr().out


def test_list_bad_cost_is_a_usage_error(capsys):
    assert cli.main(["list", "--cost", "4096,64"]) == 2
    assert "--cost" in capsys.readouterr().err


def test_check_passes_exact_and_reports_approximations_and_skips():
    code, res = run_cli(["check", "--shape", "2,2,19,8", "-m", "dense", "-m", "tiled", "-m", "sliding_window",
                         "-m", "linear", "-m", "linformer", "-m", "sparse", "--json"])
    assert code == 0 and res["exit_code"] == 0 and res["exact_failures"] == 0
    rows = {(r["mechanism"], r["case"]): r for r in res["results"]}
    for case in ("random", "causal", "key_padding", "full_mask", "float_mask", "L!=S", "L=1", "gqa", "bf16"):
        r = rows[("dense", case)]
        assert r["status"] == "ok" and r["max_abs_err"] <= r["tol"], r
        assert rows[("tiled", case)]["path"] == "tiled"
    assert rows[("sliding_window", "random")]["status"] == "ok"
    assert rows[("linear", "random")]["status"] == "approx" and rows[("linear", "random")]["rel_fro_err"] > 0
    skip = rows[("linformer", "causal")]
    assert skip["status"] == "skip" and any("is_causal" in why for why in skip["reasons"])
    assert rows[("linear", "full_mask")]["status"] == "skip"
    assert rows[("sparse", "random")]["status"] == "skip"
    assert rows[("sparse", "full_mask")]["status"] == "ok" and rows[("sparse", "full_mask")]["path"] == "sparse"
    assert rows[("dense", "bf16")]["dtype"] == "bfloat16"


def test_check_fails_when_an_exact_mechanism_misses_tolerance():
    """A mechanism that declares itself exact but is off by 0.1% must make the exit code non-zero."""

    @dataclass(frozen=True)
    class SlightlyWrong(M.Mechanism):
        def __call__(self, query, key, value, **kw):
            return attnlab.attention(query, key, value, attn_mask=kw.get("attn_mask"),
                                     is_causal=kw.get("is_causal", False), enable_gqa=kw.get("enable_gqa", False)) * 1.001

    M.register("_test_slightly_wrong", M.Spec(exact=True, kind="exact"), SlightlyWrong)
    try:
        code, res = run_cli(["check", "--shape", "1,2,11,8", "-m", "_test_slightly_wrong", "--case", "random",
                             "--case", "causal"])
        assert code == 1 and res["exact_failures"] == 2
        assert {r["status"] for r in res["results"]} == {"FAIL"}
        # and an approximate one with the same error is only reported
        M._REGISTRY.pop("_test_slightly_wrong")
        M.register("_test_slightly_wrong", M.Spec(exact=False), SlightlyWrong)
        code, res = run_cli(["check", "--shape", "1,2,11,8", "-m", "_test_slightly_wrong", "--case", "random"])
        assert code == 0 and res["results"][0]["status"] == "approx"
    finally:
        M._REGISTRY.pop("_test_slightly_wrong", None)


def test_check_reports_a_crash_as_a_failure():
    @dataclass(frozen=True)
    class Crashes(M.Mechanism):
        def _forward(self, q, k, v, **kw):
            raise RuntimeError("boom")

    M.register("_test_crashes", M.Spec(exact=False), Crashes)
    try:
        code, res = run_cli(["check", "--shape", "1,1,5,4", "-m", "_test_crashes", "--case", "random"])
        assert code == 1 and "boom" in res["results"][0]["reasons"][0]
    finally:
        M._REGISTRY.pop("_test_crashes", None)


def test_check_bad_input_is_a_usage_error(capsys):
    assert cli.main(["check", "--shape", "2,2,19"]) == 2
    assert cli.main(["check", "-m", "nope"]) == 2
    assert "available" in capsys.readouterr().err


def test_check_sizes_patterns_so_they_really_mask():
    from attnlab.cli.check import sized_instance

    m = sized_instance("sliding_window", 80, 80)
    assert m.pattern_for().density(80, 80) < 0.5
    assert sized_instance("block_sparse", 80, 80).pattern_for().density(80, 80) < 0.6
    assert sized_instance("hierarchical", 80, 80).block_size == 10
