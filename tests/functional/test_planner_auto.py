"""Auto chooses from exactly the kernels whose declarations accept a call (issue 21).

Every combination of the arguments the declarations speak of — mask (bool, float, float requiring
grad), is_causal, a pattern, soft-capping, ALiBi [H] / [B, H], GQA, dropout, need_weights, strict — is
planned for every method: auto must plan whenever any explicit method does, pick one that was not
refused, and its explain must name every other refusal with the reason the explicit method raises.
Planning only (no kernel runs); ``test_differential`` runs the kernels on random draws of the same.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from attnlab import kernels
from attnlab import patterns as P
from attnlab.functional import METHODS, planner, prepare

pytestmark = pytest.mark.usefixtures("one_thread")

EXPLICIT = METHODS[1:]
B, H, L, S, E = 2, 4, 9, 9, 4


def _inputs(mask, causal, pattern, softcap, alibi, gqa, dropout):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, L, E, generator=g)
    k, v = (torch.randn(B, H // 2 if gqa else H, S, E, generator=g) for _ in range(2))
    m = None
    if mask == "bool":
        m = torch.rand(L, S, generator=g) > 0.2
    elif mask.startswith("float"):
        m = torch.randn(L, S, generator=g).requires_grad_(mask == "float grad")
    slopes = {None: None, "[H]": torch.rand(H, generator=g), "[B, H]": torch.rand(B, H, generator=g)}[alibi]
    return prepare(q, k, v, m, dropout, causal, None, gqa, P.sliding_window(3) if pattern else None,
                   softcap=softcap, alibi_slopes=slopes)


COMBOS = list(itertools.product(["none", "bool", "float", "float grad"], [False, True], [False, True],
                                [None, 2.0], [None, "[H]", "[B, H]"], [False, True], [0.0, 0.3]))


FLAGS = [(False, False), (True, False), (False, True), (True, True)]  # (need_weights, strict)


def test_auto_plans_whenever_an_explicit_method_does():
    dense_only = 0
    for combo in COMBOS:
        p = _inputs(*combo)
        for need_weights, strict in FLAGS:
            what = (*combo, f"need_weights={need_weights}", f"strict={strict}")
            ran, refused = [], {}
            for m in EXPLICIT:
                try:
                    planner.plan(p, m, need_weights, strict, costs=False)
                    ran.append(m)
                except ValueError as e:
                    refused[m] = str(e)
            try:
                auto = planner.plan(p, "auto", need_weights, strict, costs=False)
            except ValueError as e:
                assert not ran, f"{what}: auto raised ({e}) where {ran} plan"
                assert "no attention method can run these inputs" in str(e)
                continue
            assert ran and auto.method in ran, (what, auto.method, ran)
            assert set(auto.refused) == set(refused), (what, auto.refused, list(refused))
            assert planner.candidates(auto.refused) == tuple(m for m in planner.FALLBACK_ORDER if m in ran)
            text = str(auto)
            for m, why in auto.refused.items():
                assert why in refused[m] and f"refused: {why}" in text, (what, m, why, refused[m])
            dense_only += ran == ["dense"]
    assert dense_only, "no combination that only dense runs: the test would not see issue 21's defect"


def test_issue_21_reproducer_runs_on_dense():
    # softcap + a float mask that requires grad + alibi_slopes [B, H]: only dense takes all three
    p = _inputs("float grad", False, False, 2.0, "[B, H]", False, 0.0)
    plan = planner.plan(p, "auto", costs=False)
    assert plan.method == "dense" and set(plan.refused) == set(EXPLICIT) - {"dense"}
    assert "takes alibi_slopes of shape [H] only" in plan.refused["compiled"]
    assert "float attn_mask that requires grad" in plan.refused["tiled"]
    assert "soft-capping" in plan.refused["sdpa"]


def test_every_declared_kernel_is_a_fallback_and_dense_is_last():
    assert set(planner.candidates({})) == set(EXPLICIT) == {s.name for s in kernels.KERNELS}
    assert planner.candidates({})[-1] == "dense"
    assert planner.candidates({m: "x" for m in EXPLICIT}) == ()
