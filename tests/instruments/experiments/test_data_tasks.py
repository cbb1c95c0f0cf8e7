"""Generated long-range tasks checked against independent scanners written here."""
import importlib
import random

import numpy as np
import pytest

from attnlab.data import make_task
from attnlab.data.listops import VOCAB, evaluate

listops_mod = importlib.import_module("attnlab.data.listops")

ID2TOK = {v: k for k, v in VOCAB.items()}


def _stack_eval(tokens: list[str]) -> tuple[int, int]:
    """Evaluate a ListOps token list with an explicit stack; also return the deepest operator nesting."""
    stack, depth, deepest = [], 0, 0
    for t in tokens:
        if t.startswith("["):
            stack.append([t])
            depth += 1
            deepest = max(deepest, depth)
        elif t == "]":
            op, *args = stack.pop()
            depth -= 1
            if op == "[MIN":
                val = min(args)
            elif op == "[MAX":
                val = max(args)
            elif op == "[SM":
                val = sum(args) % 10
            else:
                val = int(np.median(args))
            if stack:
                stack[-1].append(val)
            else:
                return val, deepest
        else:
            if stack:
                stack[-1].append(int(t))
            else:
                return int(t), deepest
    raise AssertionError(f"unbalanced expression {tokens}")


def test_listops_labels_lengths_and_rules():
    d = make_task("listops", 40, 200, seed=3)
    assert d.inputs.shape == (40, 200) and d.num_classes == 10 and d.vocab_size == 16
    for row, label, length in zip(d.inputs.tolist(), d.targets.tolist(), d.meta["lengths"]):
        assert 200 // 4 < length <= 200
        assert all(t == 0 for t in row[length:]) and all(t != 0 for t in row[:length])
        toks = [ID2TOK[t] for t in row[:length]]
        assert sum(t == "]" for t in toks) == sum(t.startswith("[") for t in toks)  # every ] kept
        assert {t for t in toks if t.startswith("[")} <= {"[MIN", "[MAX", "[MED", "[SM"}
        val, deepest = _stack_eval(toks)
        assert val == label
        assert deepest <= 9  # the root is depth 1 and depth 10 holds only digits


def test_listops_median_truncates_like_lra():
    for args in ([1, 2], [3, 8, 0, 9], [7], [5, 5, 6, 2, 9]):
        assert evaluate(("[MED", args)) == int(np.median(args))


def test_listops_generator_depth_limit():
    rng = random.Random(0)
    for _ in range(200):
        tree, n = listops_mod.generate_tree(rng, max_depth=3, max_args=4)
        toks = listops_mod.tokens_of(tree)
        assert len(toks) == n
        assert _stack_eval(toks)[1] <= 2


def test_tasks_deterministic_in_seed():
    for name in ("listops", "recall", "copy"):
        a, b, c = (make_task(name, 8, 64, seed=s) for s in (1, 1, 2))
        assert (a.inputs == b.inputs).all() and (a.targets == b.targets).all()
        assert not (a.inputs == c.inputs).all()


def test_recall_answer_is_value_after_query_key():
    d = make_task("recall", 50, 97, seed=5, num_pairs=6)
    k0, k1 = d.meta["key_ids"]
    v0, _ = d.meta["value_ids"]
    assert d.readout == "last"
    for row, label in zip(d.inputs.tolist(), d.targets.tolist()):
        q = row[-1]
        assert k0 <= q < k1
        keys = [t for t in row[:-1] if k0 <= t < k1]
        assert len(keys) == 6 and len(set(keys)) == 6
        pos = row[:-1].index(q)
        assert row[pos + 1] - v0 == label


def test_multi_query_recall_answers_every_query_in_place():
    d = make_task("recall", 40, 101, seed=6, num_pairs=7, num_queries=5)
    k0, k1 = d.meta["key_ids"]
    v0, _ = d.meta["value_ids"]
    assert d.target_positions.tolist() == list(range(96, 101)) and d.targets.shape == (40, 5)
    for row, labels in zip(d.inputs.tolist(), d.targets.tolist()):
        body, queries = row[:96], row[96:]
        assert all(k0 <= q < k1 for q in queries) and len(set(queries)) == 5
        assert len([t for t in body if k0 <= t < k1]) == 7
        assert [body[body.index(q) + 1] - v0 for q in queries] == labels
    one = make_task("recall", 40, 101, seed=6, num_pairs=7)
    assert one.targets.shape == (40,) and one.target_positions is None


def test_copy_targets_are_scattered_tokens_in_order():
    d = make_task("copy", 30, 50, seed=2, num_tokens=5)
    assert d.target_positions.tolist() == list(range(45, 50))
    for row, tgt in zip(d.inputs.tolist(), d.targets.tolist()):
        assert row[45:] == [2] * 5
        assert [t - 3 for t in row[:45] if t >= 3] == tgt


@pytest.mark.parametrize("name,kw", [("listops", {"min_length": 80}), ("recall", {"num_pairs": 40}),
                                     ("recall", {"num_queries": 9}),
                                     ("copy", {"num_tokens": 50}), ("nope", {})])
def test_bad_arguments_raise(name, kw):
    with pytest.raises(ValueError):
        make_task(name, 4, 64, **kw)
