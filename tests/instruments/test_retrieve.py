"""attnlab.retrieval and `attnlab retrieve`: hard / top-k / soft lookup against float64 oracles and limits."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab import reference
from attnlab import retrieval as R
from attnlab.cli.main import main


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.one_thread


@pytest.fixture(scope="module")
def keys(corpus):
    return R.hashing_embedder()(corpus.texts)  # (n, d)


def _rand(n=37, d=17, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.nn.functional.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(n, 5, generator=g, dtype=torch.float64)
    q = torch.nn.functional.normalize(torch.randn(d, generator=g, dtype=torch.float64), dim=0)
    return q, k, v


# -- corpus --------------------------------------------------------------------------------------------------
def test_corpus_is_deterministic_labelled_and_a_few_hundred(corpus):
    assert len(corpus) == 48 * len(R.RELATIONS) == 288
    assert corpus.texts == R.generate_corpus(48, seed=0).texts
    assert corpus.texts != R.generate_corpus(48, seed=1).texts
    for e in corpus.entries:  # every sentence names its subject and its value
        assert e.subject in e.text and e.value in e.text
    pairs = {(e.subject, e.relation) for e in corpus.entries}
    assert len(pairs) == len(corpus)  # one sentence per (subject, relation)
    q, a = R.labelled_queries(corpus, "pet", ["Maya", "Oscar"])
    assert q == ["Which animal does Maya keep at home?", "Which animal does Oscar keep at home?"]
    assert [corpus.entries[i].relation for i in a] == ["pet", "pet"]
    assert [corpus.entries[i].subject for i in a] == ["Maya", "Oscar"]
    _, a = R.labelled_queries(corpus, "profile", ["Maya"], target="food")
    assert corpus.entries[a[0]].relation == "food"


def test_bad_inputs_name_the_argument(corpus):
    with pytest.raises(ValueError, match="num_subjects"):
        R.generate_corpus(0)
    with pytest.raises(ValueError, match="relation"):
        R.labelled_queries(corpus, "colour")
    with pytest.raises(ValueError, match="tau"):
        R.soft_lookup(torch.zeros(4), torch.zeros(3, 4), torch.zeros(3, 2), 0.0)
    with pytest.raises(ValueError, match=r"query must be \[d\].*\(5,\).*\(3, 4\)"):
        R.hard_lookup(torch.zeros(5), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="values"):
        R.soft_lookup(torch.zeros(4), torch.zeros(3, 4), torch.zeros(2, 2), 1.0)
    with pytest.raises(ValueError, match="k must be"):
        R.topk_lookup(torch.zeros(4), torch.zeros(3, 4), 4)
    with pytest.raises(ValueError, match="embedder"):
        R.get_embedder("word2vec")
    with pytest.raises(ValueError, match="rank"):
        R.fit_projection(torch.zeros(2, 4), torch.zeros(3, 4), [0, 1], rank=5)
    with pytest.raises(ValueError, match="answers"):
        R.fit_projection(torch.zeros(2, 4), torch.zeros(3, 4), [0, 3])


# -- the three lookups against oracles ---------------------------------------------------------------------------
def test_soft_lookup_matches_float64_oracle():
    q, k, v = _rand()
    for tau in (0.03, 0.5, 7.0):
        out, w = R.soft_lookup(q.float(), k.float(), v.float(), tau)
        ref_out, ref_w = reference.attention(q[None].numpy(), k.numpy(), v.numpy(), scale=1 / tau)
        np.testing.assert_allclose(w.numpy(), ref_w[0], atol=2e-6, rtol=1e-4)
        np.testing.assert_allclose(out.numpy(), ref_out[0], atol=2e-5, rtol=1e-4)
        # the same thing written by hand in NumPy float64
        s = k.numpy() @ q.numpy() / tau
        e = np.exp(s - s.max())
        np.testing.assert_allclose(w.numpy(), e / e.sum(), atol=2e-6, rtol=1e-4)


def test_hard_and_topk_agree_with_numpy_sort():
    q, k, _ = _rand(n=143, d=9, seed=3)
    s = k.numpy() @ q.numpy()
    order = np.argsort(-s)
    i, score = R.hard_lookup(q, k)
    assert i == order[0] and score == pytest.approx(s[order[0]])
    idx, scores = R.topk_lookup(q, k, 7)
    assert idx == order[:7].tolist()
    np.testing.assert_allclose(scores, s[order[:7]])


def test_soft_tends_to_hard_as_tau_goes_to_zero_and_to_mean_as_tau_grows():
    q, k, v = _rand(n=61, d=13, seed=5)
    i_hard, _ = R.hard_lookup(q, k)
    s = (k @ q).sort(descending=True).values
    assert s[0] - s[1] > 1e-3  # a unique best entry, so the τ → 0 limit is one entry
    hard, mean = v[i_hard], v.mean(0)
    spread = float((v - hard).norm(dim=-1).max())
    taus = [10.0 ** e for e in range(2, -7, -1)]  # 100 ... 1e-6
    dist_hard, w_star = [], []
    for tau in taus:
        out, w = R.soft_lookup(q, k, v, tau)
        dist_hard.append(float((out - hard).norm()))
        w_star.append(float(w[i_hard]))
        # ‖Σ w_i v_i − v*‖ = ‖Σ_{i≠*} w_i (v_i − v*)‖ ≤ (1 − w*) · max‖v_i − v*‖
        assert dist_hard[-1] <= (1 - w_star[-1]) * spread + 1e-12
    assert all(b >= a for a, b in zip(w_star, w_star[1:]))  # the best entry's weight grows as τ falls
    assert w_star[-1] == pytest.approx(1.0, abs=1e-12)
    assert dist_hard[-1] < 1e-9
    assert dist_hard[-1] < dist_hard[0]
    # τ → ∞: uniform weights, the mean of the values
    out, w = R.soft_lookup(q, k, v, 1e8)
    np.testing.assert_allclose(w.numpy(), np.full(61, 1 / 61), rtol=1e-6)
    assert float((out - mean).norm()) < 1e-7
    st = R.weight_stats(w)
    assert st["effective_entries"] == pytest.approx(61, rel=1e-6)
    assert st["entropy"] == pytest.approx(math.log(61), rel=1e-6)


def test_temperature_sweep_goes_from_database_to_average(corpus, keys):
    q = keys[corpus.index("Maya", "pet")] * 0.9 + keys[corpus.index("Oscar", "food")] * 0.1
    rows = R.temperature_sweep(q, keys, keys, R.default_taus())
    eff = [r["effective_entries"] for r in rows]
    assert all(b >= a - 1e-6 for a, b in zip(eff, eff[1:]))  # spreads monotonically with τ
    assert eff[0] == pytest.approx(1.0, abs=1e-3)
    assert eff[-1] == pytest.approx(len(corpus), rel=1e-3)
    assert rows[0]["cos_to_hard"] == pytest.approx(1.0, abs=1e-5)
    assert rows[-1]["cos_to_mean"] == pytest.approx(1.0, abs=1e-5)
    assert rows[0]["argmax"] == corpus.index("Maya", "pet")


def test_weight_stats_against_direct_formulas():
    w = torch.tensor([0.5, 0.25, 0.125, 0.125, 0.0])
    st = R.weight_stats(w)
    h = -(0.5 * math.log(0.5) + 0.25 * math.log(0.25) + 2 * 0.125 * math.log(0.125))
    assert st["entropy"] == pytest.approx(h)
    assert st["effective_entries"] == pytest.approx(math.exp(h))
    assert st["participation"] == pytest.approx(1 / (0.25 + 0.0625 + 2 * 0.015625))
    assert st["max_weight"] == 0.5


# -- learned projection ----------------------------------------------------------------------------------------
def test_projection_starts_at_raw_matching_and_learns_the_training_pairs(corpus, keys):
    emb = R.hashing_embedder()
    train = corpus.subjects[:6]
    qt, ans = R.labelled_queries(corpus, "profile", train, target="pet")
    q = emb(qt)
    p0 = R.fit_projection(q, keys, ans, steps=0)
    assert torch.equal(p0.w_q, torch.eye(keys.shape[1])) and torch.equal(p0.w_k, torch.eye(keys.shape[1]))
    assert R.retrieval_accuracy(q, keys, ans, p0) == R.retrieval_accuracy(q, keys, ans)
    p = R.fit_projection(q, keys, ans, rank=2, steps=40, lr=0.05)
    assert p.losses[-1] < 0.5 * p.losses[0]
    before, after = R.retrieval_accuracy(q, keys, ans), R.retrieval_accuracy(q, keys, ans, p)
    assert after["mean_rank"] < before["mean_rank"] and after["top1"] > before["top1"]
    # the factored form computes (q W_Q)·(k W_K) with W = I + A·B
    s = (q @ p.w_q) @ (keys @ p.w_k).T
    assert torch.allclose(p.queries(q) @ p.keys(keys).T, s, atol=1e-5)


def test_retrieval_accuracy_ranks_against_brute_force():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(5, 7, generator=g), torch.randn(11, 7, generator=g)
    ans = [0, 3, 10, 4, 4]
    acc = R.retrieval_accuracy(q, k, ans)
    s = (q @ k.T).numpy()
    ranks = [1 + int((s[i] > s[i, a]).sum()) for i, a in enumerate(ans)]
    assert acc["mean_rank"] == pytest.approx(np.mean(ranks))
    assert acc["top1"] == pytest.approx(np.mean([r == 1 for r in ranks]))


# -- CLI --------------------------------------------------------------------------------------------------------
def test_cli_retrieve_json_and_png(tmp_path, capsys):
    code = main(["retrieve", "Which instrument does Maya play?", "--embedder", "hashing", "--steps", "5",
                 "--out", str(tmp_path), "--json"])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    on_disk = json.loads((tmp_path / "retrieve.json").read_text())
    assert printed["hard"] == on_disk["hard"]
    corpus = R.generate_corpus(48, 0)
    emb = R.hashing_embedder()
    scores = emb(corpus.texts) @ emb(["Which instrument does Maya play?"])[0]  # independent recomputation
    assert printed["hard"]["index"] == int(scores.argmax())
    assert printed["hard"]["index"] == corpus.index("Maya", "instrument")
    assert printed["topk"][0]["index"] == printed["hard"]["index"] and len(printed["topk"]) == 5
    w = printed["soft"]["all_weights"]
    assert len(w) == 288 and sum(w) == pytest.approx(1.0, abs=1e-5)
    assert printed["projection"]["steps"] == 5
    assert (tmp_path / "retrieve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_retrieve_tables_and_bad_input(tmp_path, capsys):
    assert main(["retrieve", "--embedder", "hashing", "--no-learn", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "three answers" in out and "temperature" in out
    assert main(["retrieve", "x", "--embedder", "hashing", "--tau", "-1", "--out", str(tmp_path)]) == 2
    assert "tau" in capsys.readouterr().err
    assert main(["retrieve", "x", "--embedder", "hashing", "-k", "0", "--out", str(tmp_path)]) == 2


# -- properties -------------------------------------------------------------------------------------------------
@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 23), d=st.integers(1, 9), tau=st.floats(1e-3, 1e3), seed=st.integers(0, 2**16))
def test_soft_lookup_properties(n, d, tau, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(d, generator=g), torch.randn(n, d, generator=g), torch.randn(n, 3, generator=g)
    out, w = R.soft_lookup(q, k, v, tau)
    assert w.shape == (n,) and out.shape == (3,)
    assert float(w.sum()) == pytest.approx(1.0, abs=1e-5) and bool((w >= 0).all())
    # permuting the (key, value) entries permutes the weights and leaves the answer alone
    perm = torch.randperm(n, generator=g)
    out_p, w_p = R.soft_lookup(q, k[perm], v[perm], tau)
    torch.testing.assert_close(w_p, w[perm], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out_p, out, atol=1e-5, rtol=1e-5)
    # the answer is a convex combination of the values: inside their bounding box
    assert bool((out >= v.min(0).values - 1e-5).all() and (out <= v.max(0).values + 1e-5).all())
    # the largest weight sits on the hard lookup's entry (up to ties)
    i, s = R.hard_lookup(q, k)
    assert float(w[i]) == pytest.approx(float(w.max()), rel=1e-5)
