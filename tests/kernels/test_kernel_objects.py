"""One door per kernel (issue 22): each kernel object's tiling and run, the planner's named rules, explain's
predicted times, and the plan cache holding the kernel object.

Each kernel's ``run`` is checked against the float64 reference (``attnlab.reference``) on a masked call
with awkward sizes; tolerances are float64's (every kernel computes in float64 for float64 inputs).
"""
from __future__ import annotations

import copy
import pickle

import pytest
import torch

import attnlab
from attnlab import kernels, reference
from attnlab import patterns as P
from attnlab.functional import plancache
from attnlab.kernels import planner, rates
from attnlab.shapes import prepare


def _q(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("kernel", kernels.KERNELS, ids=lambda k: k.name)
def test_each_kernel_runs_its_tiling_to_the_oracle(kernel):
    q, k, v = _q(2, 3, 23, 8), _q(2, 3, 17, 8, seed=1), _q(2, 3, 17, 5, seed=2)
    pat = P.sliding_window(6)
    p = prepare(q, k, v, None, 0.0, False, None, False, pat).live()
    weights = kernel.weights != "no"
    r = p.request(need_weights=weights)
    if kernel.name in planner.refusals(r):
        pytest.skip(f"{kernel.name}: {planner.refusals(r)[kernel.name]}")
    t = kernel.tiling(p, r, 8, rates.current())
    out, w, lse = kernel.run(p, t, need_weights=weights)
    ro, rw = reference.attention(q, k, v, attn_mask=pat.materialize(23, 17))
    torch.testing.assert_close(out, torch.as_tensor(ro), atol=1e-12, rtol=0)
    if weights:
        torch.testing.assert_close(w, torch.as_tensor(rw), atol=1e-12, rtol=0)
    if lse is not None:  # log-sum-exp of the scaled, masked scores
        s = (q @ k.mT) / 8 ** 0.5
        s = s.masked_fill(~pat.materialize(23, 17), float("-inf"))
        torch.testing.assert_close(lse, torch.logsumexp(s, -1), atol=1e-12, rtol=0)


def test_kernel_objects_are_the_declarations_and_copy_as_themselves():
    for k in kernels.KERNELS:
        assert kernels.get(k.name) is k and k.spec.name == k.name and k.weights == k.spec.weights
        assert copy.deepcopy(k) is k and pickle.loads(pickle.dumps(k)) is k


def test_auto_names_its_rule_and_explain_prints_each_capable_kernels_time():
    q = _q(1, 2, 40, 8).float()
    for kw in (dict(), dict(is_causal=True), dict(need_weights=True), dict(pattern=P.sliding_window(4))):
        plan = attnlab.explain(q, q, q, **kw)
        assert plan.rule in {rule.name for rule in planner.RULES}, plan
        assert plan.reason.endswith(f"[rule: {plan.rule}]") and plan.kernel is kernels.get(plan.method)
        text = str(plan)
        assert set(plan.seconds) == set(attnlab.METHODS[1:]) - set(plan.refused)
        for m, s in plan.seconds.items():
            assert s > 0 and plan.rate_sources[m] in text, (m, text)
    assert attnlab.explain(q, q, q, method="tiled").rule == "requested"


def test_the_plan_cache_keeps_the_kernel_object():
    plancache.clear()
    q = _q(1, 2, 16, 8).float()
    attnlab.attention(q, q, q, is_causal=True)
    sig = plancache.signature(q, q, q, None, 0.0, True, None, False, None, None, None, "auto", False, False, None)
    plan = plancache.get(sig)[1]
    assert plan.kernel is kernels.get(plan.method)
    torch.testing.assert_close(attnlab.attention(q, q, q, is_causal=True),
                               torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True))
    assert plancache.stats()["hits"] == 2  # get() above, and the second call
