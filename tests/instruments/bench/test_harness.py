"""attnlab.harness: the timer, memory probes, result store, table writer and training loop, each against
an oracle computed here (call logs, a buffer of known size, the files on disk, a run without resume)."""
import json
import os
import statistics
import time
from dataclasses import dataclass

import pytest
import torch

from attnlab import harness as Hn
from attnlab.harness import training as T


# -- timing ------------------------------------------------------------------------------------------
def test_time_call_counts_warmup_and_takes_the_median():
    calls, sleeps = [], iter([0.0, 0.03, 0.001, 0.002])  # warm-up, then three timed calls

    def f():
        calls.append(1)
        time.sleep(next(sleeps))

    t = Hn.time_call(f, repeats=3, warmup=1)
    assert len(calls) == 4
    assert 0.002 <= t < 0.03  # the median of (0.03, 0.001, 0.002) is the 0.002 s call, not the slow one
    with pytest.raises(ValueError, match="repeats"):
        Hn.time_call(f, repeats=0)


def test_interleaved_rotates_the_order_and_keeps_every_sample():
    log = []
    calls = {name: (lambda name=name: log.append(name)) for name in "abc"}
    res = Hn.interleaved(calls, rounds=4, min_rounds=1, min_sample_s=0.0, budget_s=1e9)
    assert list(res) == ["a", "b", "c"]
    for name, t in res.items():
        assert len(t.times) == 4 and t.calls_per_sample == 1 and t.first_s is not None
    timed = log[6:]  # two untimed calls each (warm-up, probe) come first
    assert [timed[3 * r] for r in range(4)] == ["a", "b", "c", "a"]  # round r starts at the r-th callable
    assert Hn.interleaved({}) == {}


def test_interleaved_pairs_time_two_callables_back_to_back_in_flipped_order():
    """Note [Paired samples]: a pair is adjacent in every round, first / second alternating, and rotates as one."""
    log = []
    calls = {name: (lambda name=name: log.append(name)) for name in ("a", "auto", "b", "pick")}
    res = Hn.interleaved(calls, rounds=4, min_rounds=1, min_sample_s=0.0, budget_s=1e9, pairs={"auto": "pick"})
    assert list(res) == ["a", "auto", "b", "pick"] and all(len(t.times) == 4 for t in res.values())
    timed = log[8:]  # warm-up and probe of each
    rounds = [timed[4 * r: 4 * r + 4] for r in range(4)]
    assert rounds == [["a", "auto", "pick", "b"], ["pick", "auto", "b", "a"],
                      ["b", "a", "auto", "pick"], ["a", "pick", "auto", "b"]]
    with pytest.raises(ValueError, match="pairs"):
        Hn.interleaved(calls, pairs={"auto": "nope"})
    with pytest.raises(ValueError, match="pairs"):
        Hn.interleaved(calls, pairs={"auto": "pick", "a": "auto"})


def test_a_pair_shares_its_calls_per_sample():
    """Both of a pair repeat as often per sample (the shorter count), so each sample spans the same stretch."""
    t = [0.0]

    def clock():
        return t[0]

    def cost(s):
        def f():
            t[0] += s
        return f

    # binary fractions: the fake clock's sums are exact; alone they would take 128 and 16 calls a sample
    res = Hn.interleaved({"fast": cost(2**-10), "slow": cost(2**-7)}, rounds=2, min_rounds=1, min_sample_s=2**-3,
                         budget_s=1e9, pairs={"fast": "slow"}, clock=clock)
    assert res["fast"].calls_per_sample == res["slow"].calls_per_sample == 16
    assert res["fast"].times == [2**-10] * 2 and res["slow"].times == [2**-7] * 2


def test_paired_ratio_is_the_median_of_per_round_ratios():
    """Not the ratio of the medians: a slow round slows both of a pair and cancels."""
    a, b = Hn.Timing([1.0, 2.0, 10.0]), Hn.Timing([1.0, 1.0, 8.0])  # rounds 2-3 slowed a (and b in round 3)
    assert Hn.paired_ratio(a, b) == pytest.approx(1.25)  # median of 1.0, 2.0, 1.25 (too few rounds per order)
    assert a.median / b.median == pytest.approx(2.0)
    assert Hn.paired_ratio(Hn.Timing(), Hn.Timing()) is None
    with pytest.raises(ValueError, match="per round"):
        Hn.paired_ratio(Hn.Timing([1.0]), Hn.Timing([1.0, 2.0]))


@pytest.mark.parametrize("rounds", [4, 7, 8, 11])
def test_paired_ratio_cancels_the_pair_order(rounds):
    """Note [Pair order]: two callables of the same cost, timed in pairs whose order flips each round (a first
    on even rounds), where the pair's first sample runs 20 % slower and the rounds' speed scatters: the paired
    ratio is 1 exactly, at an odd count of rounds too; the plain median of the per-round ratios is not."""
    slow = [1.0 + 0.3 * ((7 * r) % 5) for r in range(rounds)]  # the machine's state in round r
    a = Hn.Timing([s * (1.2 if r % 2 == 0 else 1.0) for r, s in enumerate(slow)])
    b = Hn.Timing([s * (1.0 if r % 2 == 0 else 1.2) for r, s in enumerate(slow)])
    assert Hn.paired_ratio(a, b) == pytest.approx(1.0)
    assert Hn.paired_ratio(b, a) == pytest.approx(1.0)
    if rounds % 2:
        assert statistics.median(x / y for x, y in zip(a.times, b.times)) == pytest.approx(1.2)
    # a real difference survives: a 10 % slower in both orders
    c = Hn.Timing([t * 1.1 for t in b.times])
    assert Hn.paired_ratio(Hn.Timing([t * 1.1 for t in a.times]), a) == pytest.approx(1.1)
    assert Hn.paired_ratio(c, b) == pytest.approx(1.1)


def test_median_rate_ignores_an_outlier():
    assert Hn.median_rate([0.1, 0.1, 100.0]) == pytest.approx(10.0)
    assert Hn.median_rate([]) is None


# -- memory ------------------------------------------------------------------------------------------
def test_peak_rss_sees_a_buffer_of_known_size():
    assert Hn.rss_bytes() > 0 and Hn.peak_rss_bytes() >= Hn.rss_bytes()
    size = 64 * 2**20
    with Hn.PeakRSS() as m:
        buf = bytearray(size)  # zero-filled: every page touched
        del buf
    if not m.ok:
        pytest.skip("this kernel cannot reset the peak RSS (/proc/self/clear_refs)")
    assert 0.9 * size <= m.bytes <= size + 16 * 2**20


# -- store -------------------------------------------------------------------------------------------
def test_store_keeps_partial_results_and_resumes_only_matching_keys(tmp_path):
    s = Hn.ResultStore(tmp_path, sections=("records", "extra"), context={"threads": 1})
    s.add({"n": 1, "t": 0.5}, job={"n": 1})
    s.add({"note": "x"}, section="extra")
    on_disk = json.loads((tmp_path / "results.partial.json").read_text())  # a kill now keeps this
    assert on_disk["records"][0]["t"] == 0.5 and on_disk["extra"] == [{"note": "x"}] and on_disk["complete"] is False
    again = Hn.ResultStore(tmp_path, sections=("records",), context={"threads": 1}, resume=True)
    assert again.lookup({"n": 1})["t"] == 0.5 and again.lookup({"n": 2}) is None
    assert again.source == str(tmp_path / "results.partial.json")
    other = Hn.ResultStore(tmp_path, context={"threads": 2}, resume=True)
    assert other.lookup({"n": 1}) is None  # another context: measured again
    fresh = Hn.ResultStore(tmp_path, context={"threads": 1})
    assert fresh.lookup({"n": 1}) is None  # no resume: nothing reused
    paths = again.finish({"complete": True, "records": []}, "# done\n\n| a |\n|---|\n| 1 |\n")
    assert not (tmp_path / "results.partial.json").exists()
    assert json.loads(open(paths["results"]).read())["complete"] is True
    assert "<table>" in open(paths["html"]).read()
    with pytest.raises(ValueError, match="section"):
        again.add({}, section="nope")


def test_store_names_an_unreadable_earlier_file(tmp_path):
    (tmp_path / "results.partial.json").write_text("{not json")
    with pytest.raises(ValueError, match="results.partial.json"):
        Hn.ResultStore(tmp_path, resume=True)


# -- tables ------------------------------------------------------------------------------------------
def test_markdown_table_cells_escape_and_check_lengths():
    md = Hn.markdown_table(["a", "b|c"], [[1.23456, None], ["x|y", float("nan")]])
    lines = md.splitlines()
    assert lines[0] == "| a | b\\|c |" and lines[1] == "|---|---|"
    assert lines[2] == "| 1.23 | — |" and lines[3] == "| x\\|y | nan |"
    assert Hn.markdown_table(["a"], [[1]], align=["r"]).splitlines()[1] == "|---:|"
    with pytest.raises(ValueError, match="row 0 has 1 cells, headers have 2"):
        Hn.markdown_table(["a", "b"], [[1]])


def test_mean_std_is_the_sample_std_of_finite_values():
    m, sd = Hn.mean_std([1.0, 2.0, 3.0, None, float("inf")])
    assert m == 2.0 and sd == pytest.approx(1.0)
    assert Hn.mean_std([]) == (None, None) and Hn.mean_std([4.0]) == (4.0, 0.0)


# -- training ----------------------------------------------------------------------------------------
@dataclass
class _Data:
    inputs: torch.Tensor
    targets: torch.Tensor

    def __len__(self):
        return len(self.inputs)


@dataclass
class _Cfg(T.TrainConfig):
    name: str = "toy"


def _toy():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 5, generator=g)
    y = (x.sum(1) > 0).long()
    return _Data(x, y)


def _loss(model, ids, tgt, stats):
    logits = model(ids)  # (B, 2)
    if stats is not None:
        logits_d = logits.detach()
    if stats is not None:
        stats.append({"entropy": float(-(logits_d.softmax(-1) * logits_d.log_softmax(-1)).sum(-1).mean()),
                      "max_weight": None, "score_std": 0.0})
    return torch.nn.functional.cross_entropy(logits, tgt), logits.argmax(-1) == tgt


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def test_train_run_resumed_equals_uninterrupted(tmp_path):
    data = _toy()
    cfg = _Cfg(steps=9, batch_size=8, lr=0.05, log_every=2)
    whole_model = _model(0)
    whole = Hn.train_run(cfg, whole_model, _loss, data, data, tmp_path / "a.pt")
    assert whole["history"]["step"] == [0, 2, 4, 6, 8] and whole["steps"] == 9
    assert all(e is not None for e in whole["history"]["entropy"])
    assert whole["history"]["max_weight"] == [None] * 5  # no layer reported one
    # stop after 4 steps (the checkpoint a killed run leaves), then resume to 9 in a new model
    Hn.train_run(_Cfg(steps=4, batch_size=8, lr=0.05, log_every=2), _model(0), _loss, data, data, tmp_path / "b.pt")
    state = torch.load(tmp_path / "b.pt", weights_only=True)
    state["config"], state["done"] = T.asdict(cfg), False
    torch.save(state, tmp_path / "b.pt")
    resumed_model = _model(1)  # other weights: the checkpoint must replace them
    resumed = Hn.train_run(cfg, resumed_model, _loss, data, data, tmp_path / "b.pt", resume=True)
    assert resumed["resumed_from"] == 4
    for p, q in zip(whole_model.parameters(), resumed_model.parameters()):
        assert torch.equal(p, q)
    assert resumed["eval"] == whole["eval"]


def test_unreadable_checkpoint_is_a_checkpoint_error(tmp_path):
    (tmp_path / "c.pt").write_bytes(b"truncated")
    with pytest.raises(Hn.CheckpointError, match="c.pt"):
        Hn.load_checkpoint(tmp_path / "c.pt")
    with pytest.raises(ValueError, match="optimizer"):
        T.make_optimizer("lion", [], 0.1)


def test_threads_restores_the_previous_count():
    before = torch.get_num_threads()
    with Hn.threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="--threads"):
        Hn.threads(0)
