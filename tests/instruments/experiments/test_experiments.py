"""Experiments at toy size: their outputs, checked against oracles computed here (never timed)."""
import json
import math

import numpy as np
import pytest
import torch

from attnlab.cli.main import main
from attnlab.data import make_task
from attnlab import harness
from attnlab.experiments import model as M
from attnlab.experiments import training as TR
from attnlab.experiments import variance as V


def _read(path):
    return json.loads(path.read_text())


# -- variance ----------------------------------------------------------------------------------------
def test_measure_matches_numpy_softmax_jacobian():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(7, 24, generator=g, dtype=torch.float64), torch.randn(11, 24, generator=g, dtype=torch.float64)
    scale = 0.37
    m = V.measure(q, k, scale, seed=4)
    # oracle: the same V, G (same generator recipe), softmax Jacobian by hand in NumPy
    g2 = torch.Generator().manual_seed(4)
    Vv = torch.randn(11, 64, generator=g2, dtype=torch.float64).numpy()
    G = torch.randn(7, 64, generator=g2, dtype=torch.float64).numpy()
    z = (q.numpy() @ k.numpy().T) * scale
    w = np.exp(z - z.max(1, keepdims=True))
    w /= w.sum(1, keepdims=True)
    gw = G @ Vv.T  # dL/dw
    gz = w * (gw - (w * gw).sum(1, keepdims=True))  # softmax backward
    assert m["grad_norm_logits"] == pytest.approx(np.linalg.norm(gz, axis=1).mean(), rel=1e-10)
    assert m["grad_norm"] == pytest.approx(scale * np.linalg.norm(gz, axis=1).mean(), rel=1e-10)
    assert m["score_var"] == pytest.approx(z.var(ddof=1), rel=1e-10)
    assert m["max_weight"] == pytest.approx(w.max(1).mean(), rel=1e-10)
    assert m["entropy"] == pytest.approx((-(w * np.log(w)).sum(1)).mean(), rel=1e-10)


def test_variance_experiment_quick(tmp_path):
    assert main(["experiment", "variance", "--quick", "--no-minilm", "--no-progress", "--out", str(tmp_path)]) == 0
    res = _read(tmp_path / "results.json")
    recs = res["variance"]
    assert {r["scaling"] for r in recs} == {"none", "sqrt", "dk"}
    for r in recs:
        assert set(r) >= {"d_k", "scaling", "score_var", "max_weight", "entropy", "grad_norm"}
        # unit-variance inputs: Var(scale * q.k) = d_k * scale^2, within sampling error (128 x 64 scores)
        assert r["score_var"] == pytest.approx(r["d_k"] * r["scale"] ** 2, rel=0.2)
        assert 1 / 64 - 1e-12 <= r["max_weight"] <= 1
        assert 0 <= r["entropy"] <= math.log(64) + 1e-9
    by = {(r["d_k"], r["scaling"]): r for r in recs}
    for d in {r["d_k"] for r in recs}:  # a larger scale never raises the entropy of a softmax
        assert by[(d, "none")]["entropy"] < by[(d, "sqrt")]["entropy"] < by[(d, "dk")]["entropy"]
    slopes = res["fitted_log_slope_of_var_vs_dk"]
    assert slopes["none"] == pytest.approx(1, abs=0.1) and slopes["sqrt"] == pytest.approx(0, abs=0.1)
    assert slopes["dk"] == pytest.approx(-1, abs=0.1)
    assert (tmp_path / "report.md").read_text().startswith("# Var(q·k)")
    assert (tmp_path / "variance.png").read_bytes()[:4] == b"\x89PNG"
    assert res["environment"]["torch"] == torch.__version__
    for c in res["tutorial_checks"]:  # recomputed, never copied from the tutorial
        x = np.array(c["scores"], dtype=np.float64)
        want = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
        assert np.allclose(c["softmax"], want, atol=5e-5)


# -- the model's switches --------------------------------------------------------------------------------
def _layer(score, scale=0.5, causal=False):
    torch.manual_seed(0)
    # head_dim 3 != d_model / heads: the width of q, k is the experiment's own (nn.EncoderLayer(head_dim=))
    m = M.ExperimentModel(11, 3, 5, d_model=8, num_heads=2, head_dim=3, num_layers=1, score=score, scale=scale,
                          causal=causal)
    return m, m.encoder.layers[0].self_attn


@pytest.mark.parametrize("causal", [False, True])
def test_attention_switches_match_hand_written(causal):
    x = torch.randn(3, 5, 8)
    mask = torch.ones(5, 5, dtype=torch.bool).tril() if causal else torch.ones(5, 5, dtype=torch.bool)
    for score in ("softmax", "none", "cosine"):
        m, a = _layer(score, causal=causal)
        q = a.q_proj(x).view(3, 5, 2, 3).transpose(1, 2)
        k = a.k_proj(x).view(3, 5, 2, 3).transpose(1, 2)
        v = a.v_proj(x).view(3, 5, 2, 3).transpose(1, 2)
        if score == "cosine":
            s = torch.nn.functional.cosine_similarity(q.unsqueeze(-2), k.unsqueeze(-3), dim=-1)  # temperature 1
        else:
            s = (q @ k.transpose(-2, -1)) * 0.5
        if score == "none":
            w = s * mask
        else:
            w = torch.softmax(s.masked_fill(~mask, float("-inf")), -1)
        want = a.out_proj((w @ v).transpose(1, 2).reshape(3, 5, 6))
        got = a.forward_intermediates(x, is_causal=causal).output
        assert torch.allclose(got, want, atol=1e-5), (score, (got - want).abs().max())
        # the statistics each layer reports are those of the weights above (softmax rows only)
        stats = []
        m(torch.randint(1, 11, (2, 5)), readout="all", stats=stats)
        assert len(stats) == 1 and (stats[0]["entropy"] is None) == (score == "none")


def test_weight_stats_match_numpy():
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, 2, 6, 4, generator=g), torch.randn(2, 2, 6, 4, generator=g)
    st = M.weight_stats(q, k, 0.7, "softmax", causal=True)
    z = (q.double().numpy() @ k.double().numpy().transpose(0, 1, 3, 2)) * 0.7
    z = np.where(np.tril(np.ones((6, 6), bool)), z, -np.inf)
    w = np.exp(z - z.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    ent = -(np.where(w > 0, w * np.log(np.where(w > 0, w, 1)), 0)).sum(-1)
    assert st["entropy"] == pytest.approx(ent.mean(), rel=1e-5)
    assert st["max_weight"] == pytest.approx(w.max(-1).mean(), rel=1e-5)
    assert st["entropy_uniform"] == pytest.approx(np.log(np.arange(1, 7)).mean(), rel=1e-6)


def test_unknown_attention_lists_the_choices():
    from attnlab.experiments.attention import choose

    with pytest.raises(ValueError, match="sdpa.*pattern:<name>.*registered mechanism"):
        choose("no_such_thing", 64)
    assert choose("torch_sdpa").mechanism == "sdpa" and choose("pattern:bigbird", 64).pattern is not None


def test_scale_value():
    assert M.scale_value("sqrt", 64) == 0.125 and M.scale_value("none", 64) == 1.0 and M.scale_value("dk", 64) == 1 / 64
    with pytest.raises(ValueError):
        M.scale_value("half", 64)


# -- training, checkpoints and resume -----------------------------------------------------------------------
def _tiny(tmp_path, steps=6):
    tr, te = make_task("recall", 96, 16, seed=0, num_pairs=3).split(64)
    cfg = TR.RunConfig(name="t/1", task="recall", seq_len=16, d_model=16, num_heads=2, head_dim=8, num_layers=1,
                      steps=steps, batch_size=8, log_every=1)
    return cfg, tr, te


@pytest.fixture
def one_thread():
    with harness.threads(1):
        yield


def test_resume_after_kill_gives_the_uninterrupted_run(tmp_path, one_thread):
    cfg, tr, te = _tiny(tmp_path)
    straight = TR.train_run(cfg, tr, te)

    class Killed(Exception):
        pass

    seen = []

    def kill_at_4(n):
        seen.append(n)
        if sum(seen) == 4:
            raise Killed

    ck = tmp_path / f"{cfg.file_id}.pt"
    with pytest.raises(Killed):
        TR.train_run(cfg, tr, te, ck, advance=kill_at_4, checkpoint_every_s=0.0)
    state = torch.load(ck, weights_only=True)
    assert state["step"] == 3 and not state["done"]
    resumed = TR.train_run(cfg, tr, te, ck, resume=True)
    assert resumed["resumed_from"] == 3
    assert resumed["history"]["loss"] == pytest.approx(straight["history"]["loss"], rel=1e-6)
    assert resumed["eval"]["loss"] == pytest.approx(straight["eval"]["loss"], rel=1e-6)
    # a finished run is not repeated
    again = TR.train_run(cfg, tr, te, ck, resume=True)
    assert again["resumed_from"] == cfg.steps and again["history"] == resumed["history"]
    # ... and keeps the training memory the process that trained it measured
    if harness.reset_peak_rss():
        assert resumed["peak_rss_delta_bytes"] is not None
    assert again["peak_rss_delta_bytes"] == resumed["peak_rss_delta_bytes"]


def test_scaling_quick_entropy_order_and_resume(tmp_path):
    argv = ["experiment", "scaling", "--quick", "--tasks", "recall", "--d-k", "16", "--seeds", "0", "--steps", "3",
            "--no-progress", "--out", str(tmp_path)]
    assert main(argv) == 0
    res = _read(tmp_path / "results.json")
    assert len(res["runs"]) == 3 and res["complete"]
    ent = {s["arm"]: s["entropy_init"] for s in res["summary"]}
    # same init weights in every arm: the score scale alone orders the entropy (1 > 1/sqrt(16) > 1/16)
    assert ent["1 (no scaling)"] < ent["1/sqrt(d_k)"] < ent["1/d_k"]
    assert {v["arm"] for v in res["verdicts"]} == {"1 (no scaling)", "1/d_k"}
    assert (tmp_path / "curves.png").exists() and "Verdicts" in (tmp_path / "report.md").read_text()
    assert main(argv + ["--resume"]) == 0
    again = _read(tmp_path / "results.json")
    assert all(r["resumed_from"] == 3 for r in again["runs"])
    assert [r["eval"] for r in again["runs"]] == [r["eval"] for r in res["runs"]]


def test_failure_modes_quick(tmp_path):
    assert main(["experiment", "failure-modes", "--quick", "--tasks", "text", "--seeds", "0", "--steps", "2",
                 "--no-progress", "--out", str(tmp_path)]) == 0
    res = _read(tmp_path / "results.json")
    arms = {r["arm"]: r for r in res["runs"]}
    assert set(arms) == {"standard", "no scaling", "no softmax", "cosine"}
    assert arms["no softmax"]["history"]["entropy"][0] is None
    assert arms["cosine"]["history"]["entropy"][0] is not None
    assert res["tasks"] == ["text"] and "docstrings" in res["task_meta"]["text"]["source"]


def test_scaling_with_library_transformer_lm(tmp_path):
    assert main(["experiment", "scaling", "--quick", "--model", "lm", "--tasks", "text", "--d-k", "8", "--seeds", "0",
                 "--steps", "2", "--no-progress", "--out", str(tmp_path)]) == 0
    res = _read(tmp_path / "results.json")
    assert res["model"] == "lm" and len(res["runs"]) == 3
    assert all(math.isfinite(r["eval"]["loss"]) and r["history"]["qk_grad_norm"][0] > 0 for r in res["runs"])
    assert main(["experiment", "scaling", "--quick", "--model", "lm", "--tasks", "recall", "--out", str(tmp_path)]) == 2


def test_long_range_quick(tmp_path):
    assert main(["experiment", "long-range", "--quick", "--seq-len", "64", "--tasks", "recall,copy", "--steps", "2",
                 "--mechanisms", "sdpa,sliding_window", "--no-progress", "--out", str(tmp_path)]) == 0
    res = _read(tmp_path / "results.json")
    rows = {r["mechanism"]: r for r in res["table"]}
    assert set(rows) == {"sdpa", "sliding_window"}
    assert rows["sdpa"]["speed_vs_vanilla"] == pytest.approx(1.0)
    for r in rows.values():
        assert set(r["accuracy"]) == {"recall", "copy"} and all(0 <= a <= 1 for a in r["accuracy"].values())
    # a name asked for that does not exist is refused before training (it used to leave an empty report)
    assert main(["experiment", "long-range", "--quick", "--mechanisms", "sdpa,no_such_thing", "--no-progress",
                 "--out", str(tmp_path / "typo")]) == 2 and not (tmp_path / "typo").exists()
    text = (tmp_path / "report.md").read_text()
    assert "Long-range" in text and "majority class" in text
    for t in ("recall", "copy"):  # the baselines are the held-out set's own, recomputed here
        b = res["baselines"][t]
        assert b["chance"] == 1 / 16 and 1 / 16 <= b["majority"] <= 1
        for r in rows.values():
            assert r["learned"][t] == (r["accuracy"][t] > b["majority"] + b["margin"])
    assert res["token_shift"] and all(r["config"]["token_shift"] for r in res["runs"])
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("argv", [["experiment", "scaling", "--quick", "--seeds", "x"],
                                  ["experiment", "scaling", "--quick", "--tasks", "poems"],
                                  ["experiment", "long-range", "--quick", "--tasks", "sorting"],
                                  ["experiment", "variance", "--quick", "--d-k", "0"]])
def test_bad_input_exit_code_2(argv, tmp_path):
    assert main(argv + ["--out", str(tmp_path)]) == 2


def test_token_shift_adds_the_predecessor_embedding():
    torch.manual_seed(0)
    m = M.ExperimentModel(11, 5, 7, d_model=8, num_heads=2, head_dim=4, num_layers=1, token_shift=True, scale=0.5)
    seen = {}
    m.encoder.layers[0].norm1.register_forward_pre_hook(lambda mod, args: seen.setdefault("x", args[0]))
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2]])
    m(ids, readout="all")
    want = torch.stack([m.tok.weight[t] + m.pos.weight[i] + m.prev.weight[ids[0, i - 1] if i else 0]
                        for i, t in enumerate(ids[0].tolist())])  # written out token by token
    assert torch.allclose(seen["x"][0], want, atol=1e-6)
    plain = M.ExperimentModel(11, 5, 7, d_model=8, num_heads=2, head_dim=4, num_layers=1, scale=0.5)
    assert plain.prev is None


def test_experiments_run_as_a_library_without_the_cli(tmp_path, one_thread):
    from attnlab.experiments import failure_modes as FM

    cfg = FM.FailureModesConfig(quick=True, seeds=[0], tasks=["recall"], steps=2)
    res = FM.run(cfg)  # no folder: nothing is written until asked
    assert res.out is None and [r["arm"] for r in res.runs] == ["standard", "no scaling", "no softmax", "cosine"]
    paths = res.write(tmp_path)
    on_disk = _read(tmp_path / "results.json")
    assert on_disk["runs"][0]["eval"] == res.runs[0]["eval"] and paths["report"].endswith("report.md")
    with pytest.raises(ValueError, match="--tasks"):
        FM.run(FM.FailureModesConfig(tasks=["poems"]))


def test_long_range_baselines_count_the_majority_class():
    from attnlab.experiments import long_range as LR

    tr, te = make_task("copy", 40, 32, seed=3, num_tokens=4).split(10)
    b = LR.baseline_accuracy(te)
    flat = te.targets.reshape(-1).tolist()
    best = max(set(flat), key=flat.count)
    assert b["items"] == 30 * 4 and b["majority"] == flat.count(best) / len(flat) and b["chance"] == 1 / 16
    assert b["margin"] == pytest.approx(3 * math.sqrt(b["majority"] * (1 - b["majority"]) / 120))
    assert LR.learned(b["majority"] + b["margin"] + 1e-9, b) and not LR.learned(b["majority"] + b["margin"], b)


def test_long_range_killed_leaves_a_report_and_resumes(tmp_path, monkeypatch):
    import os
    import signal

    from attnlab.experiments import long_range as LR

    argv = ["experiment", "long-range", "--quick", "--seq-len", "48", "--tasks", "recall,copy", "--steps", "2",
            "--mechanisms", "sdpa,linear", "--no-progress", "--out", str(tmp_path)]
    real, calls = LR.train_run, []

    def killed_at_third(cfg, *a, **k):
        calls.append(cfg.run_id)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(cfg, *a, **k)

    monkeypatch.setattr(LR, "train_run", killed_at_third)
    assert main(argv) == 130
    res = _read(tmp_path / "results.json")
    # task by task: the finished task has every mechanism
    assert not res["complete"] and [(r["task"], r["mechanism"]) for r in res["runs"]] == [("recall", "sdpa"),
                                                                                        ("recall", "linear")]
    assert "Partial report" in (tmp_path / "report.md").read_text()
    monkeypatch.setattr(LR, "train_run", real)
    assert main(argv + ["--report-only"]) == 0  # trains nothing: reports the finished runs, lists the rest
    res = _read(tmp_path / "results.json")
    assert [r["resumed_from"] for r in res["runs"]] == [2, 2] and not res["complete"]
    assert sorted(res["not_run"]) == ["copy-linear-seed0", "copy-sdpa-seed0"]
    assert "copy: not run" in (tmp_path / "report.md").read_text()
    assert main(argv + ["--resume"]) == 0
    res = _read(tmp_path / "results.json")
    assert res["complete"] and len(res["runs"]) == 4 and "Partial report" not in (tmp_path / "report.md").read_text()
    assert [r["resumed_from"] for r in res["runs"][:2]] == [2, 2]  # finished runs are not trained again


# the options each experiment had when its parser lived in the experiment module (issue 15 moved them to
# cli/experiment.py; the command line must not change)
FLAGS = {
    "approximation": "--force --head-dim --heads --minilm-tokens --n --no-minilm --no-progress --out --quick --seed "
                     "--speed-n --threads",
    "failure-modes": "--d-k --force --lr --model --no-progress --optimizer --out --qk-init --quick --resume --seeds "
                     "--steps --tasks --threads",
    "long-range": "--batch-size --d-model --force --layers --lr --mechanisms --no-progress --no-token-shift --out "
                  "--quick --recall-queries --report-only --resume --seeds --seq-len --steps --tasks --test-examples "
                  "--threads --train-examples",
    "scaling": "--d-k --force --lr --model --no-progress --optimizer --out --qk-init --quick --resume --seeds --steps "
               "--tasks --threads",
    "variance": "--d-k --force --keys --no-minilm --no-progress --out --quick --resume --rows --seeds --steps --threads",
    "kvquant": "--force --no-kernel --no-progress --out --quick --resume --seeds --steps --threads --tokens",
}


def test_experiment_options_unchanged():
    import argparse

    from attnlab.cli import experiment as E

    p = argparse.ArgumentParser()
    E.build_parser(p)
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == set(FLAGS)
    for name, sp in sub.choices.items():
        got = sorted(a.option_strings[0] for a in sp._actions if a.option_strings and a.option_strings[0] != "-h")
        assert got == FLAGS[name].split(), name


def test_library_runs_print_nothing(capsys, tmp_path):
    res = V.run(V.VarianceConfig(quick=True, d_k=[16, 64], rows=16, keys=8, minilm=False))
    res.write(tmp_path)
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""  # only cli/ prints
    assert _read(tmp_path / "results.json")["settings"]["d_k"] == [16, 64]
