"""A differential fuzz of ``attnlab.flex_attention`` against torch's eager ``flex_attention`` in float64 (issue 40).

The oracle is ``math_attention`` from ``torch._higher_order_ops.flex_attention``: the dense vmap math torch's
``flex_attention`` runs when not compiled (its lse in log2 units: times ln 2 here), called directly, without
the dynamo frame that public call goes through (0.3 s a case); ``test_flex_fuzz_fixed_seeds`` checks a few
cases against the public ``flex_attention`` itself.

Each case is drawn from a seed (hypothesis draws the seeds, so a failure names its seed and replays): shapes
with lengths that do not divide the block size (1..70 against blocks of 8..128), GQA, random mask_mods
(causal, bottom-right, windows, prefix, documents, one pair dropped or kept, per batch, per head, rows with
no key, everything kept) given as torch BlockMasks, attnlab's BlockMasks, attnlab patterns or none; and random
score_mods made of a score part (identity, a factor, soft-capping, squares, gates, clamps, a factor on one
isolated pair) plus biases (relative tables, ALiBi, T5 buckets, per head, per key, per batch, a table of pairs
that is relative but at one pair, one isolated pair, NaN at one pair or one offset, a mask written as -inf).

Tolerance (Note [Fuzz tolerance]): both sides compute in float64 the same formula, ``softmax(mod(q·k·scale))
@ v``; they differ in summation order, in where a constant factor is applied ((A·scale)·(q·k) against
A·(scale·(q·k))) and in the online softmax's rescaling: each a few ulps of the scores (|score| <= ~60 here),
so |out error| <~ 1e3·eps·max|v| ~ 1e-12. atol = rtol = 1e-10 leaves two orders of magnitude over that and
still catches any wrong pair (a wrong bias or a dropped key moves the output by >= 1e-4 at these sizes). NaN
must appear exactly where torch has it, -inf lse exactly where torch's is.
"""
from __future__ import annotations

import collections
import math
import os
import random
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch._higher_order_ops.flex_attention import math_attention
from torch.nn.attention.flex_attention import AuxRequest
from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask
from torch.nn.attention.flex_attention import noop_mask
from torch.nn.attention.flex_attention import flex_attention as torch_flex

import attnlab
from attnlab import patterns as P

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]

#: Note [Fuzz tolerance] (module docstring)
ATOL = RTOL = 1e-10


# -- mask_mods -------------------------------------------------------------------------------------------
def _mask_mod(rng: random.Random, B: int, H: int, L: int, S: int):
    """(mask_mod or None, reads b, reads h, words)."""
    n = max(L, S)
    a, c = rng.randrange(L), rng.randrange(S)
    w = rng.randint(0, 8)
    p = rng.randint(0, S)
    docs = torch.tensor(sorted(rng.randrange(4) for _ in range(n)))
    row = rng.randrange(L)
    prims = {
        "causal": (lambda b, h, q, k: q >= k, False, False),
        "bottom_right": (lambda b, h, q, k: k <= q + (S - L), False, False),
        "window": (lambda b, h, q, k: (q - k).abs() <= w, False, False),
        "causal_window": (lambda b, h, q, k: (q >= k) & (q - k <= w), False, False),
        "prefix": (lambda b, h, q, k: (k < p) | (q >= k), False, False),
        "document": (lambda b, h, q, k: docs[q] == docs[k], False, False),
        "dilated": (lambda b, h, q, k: (q - k) % 2 == 0, False, False),
        "keep_all": (lambda b, h, q, k: k >= 0, False, False),
        "per_batch": (lambda b, h, q, k: k <= q + b * 5, True, False),
        "per_head": (lambda b, h, q, k: (q - k).abs() <= 2 + 3 * h, False, True),
    }
    names = list(prims)
    if rng.random() < 0.15:
        return None, False, False, "none"
    name = rng.choice(names)
    mm, rb, rh = prims[name]
    words = name
    if rng.random() < 0.3:  # combined with a second one
        other = rng.choice(names)
        m2, rb2, rh2 = prims[other]
        if rng.random() < 0.5:
            mm, words = (lambda f, g: lambda b, h, q, k: f(b, h, q, k) & g(b, h, q, k))(mm, m2), f"{words} & {other}"
        else:
            mm, words = (lambda f, g: lambda b, h, q, k: f(b, h, q, k) | g(b, h, q, k))(mm, m2), f"{words} | {other}"
        rb, rh = rb or rb2, rh or rh2
    r = rng.random()
    if r < 0.15:  # one isolated pair dropped
        mm, words = (lambda f: lambda b, h, q, k: f(b, h, q, k) & ~((q == a) & (k == c)))(mm), f"{words}, pair ({a}, {c}) dropped"
    elif r < 0.3:  # one isolated pair kept
        mm, words = (lambda f: lambda b, h, q, k: f(b, h, q, k) | ((q == a) & (k == c)))(mm), f"{words}, pair ({a}, {c}) kept"
    elif r < 0.4:  # a row with no key
        mm, words = (lambda f: lambda b, h, q, k: f(b, h, q, k) & (q != row))(mm), f"{words}, row {row} empty"
    return mm, rb, rh, words


# -- score_mods ------------------------------------------------------------------------------------------
def _score_mod(rng: random.Random, B: int, H: int, L: int, S: int):
    """(score_mod or None, words): a score part plus 0-3 biases, maybe a -inf mask or a one-pair departure."""
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    a, c = rng.randrange(L), rng.randrange(S)
    f = rng.choice([0.25, 0.5, 1.5, 3.0])
    cap = rng.choice([1.0, 5.0, 30.0])
    parts = {
        "identity": lambda s, b, h, q, k: s,
        "factor": lambda s, b, h, q, k: s * f,
        "divided": lambda s, b, h, q, k: s / f,
        "softcap": lambda s, b, h, q, k: cap * torch.tanh(s / cap),
        "softcap_scaled": lambda s, b, h, q, k: torch.tanh(s / cap) * (cap * f),
        "square": lambda s, b, h, q, k: s * s / 8,
        "gate": lambda s, b, h, q, k: s + 0.5 * torch.tanh(s),
        "clamp": lambda s, b, h, q, k: torch.clamp(s, -1.0, 1.0),
        "leaky": lambda s, b, h, q, k: torch.where(s > 0, s, 0.25 * s),
        "pair_factor": lambda s, b, h, q, k: torch.where((q == a) & (k == c), 4 * s, s),
    }
    pair = torch.ones(L, S, dtype=torch.float64)
    pair[a, c] = 2.5
    parts["pair_table_factor"] = lambda s, b, h, q, k: s * pair[q, k]
    rel = torch.randn(L + S - 1, dtype=torch.float64, generator=g)
    slopes = torch.rand(H, dtype=torch.float64, generator=g)
    t5 = torch.randn(H, 9, dtype=torch.float64, generator=g)
    per_head = torch.randn(H, dtype=torch.float64, generator=g)
    per_key = torch.randn(S, dtype=torch.float64, generator=g)
    per_batch = torch.randn(B, dtype=torch.float64, generator=g)
    i, j = torch.arange(L).view(-1, 1), torch.arange(S).view(1, -1)
    rel_but_one = 0.1 * (j - i).double()
    rel_but_one[a, c] += 1.5
    nan_pair = torch.zeros(L, S, dtype=torch.float64)
    nan_pair[a, c] = float("nan")
    nan_rel = torch.zeros(L + S - 1, dtype=torch.float64)
    nan_rel[rng.randrange(L + S - 1)] = float("nan")
    biases = {
        "rel_table": lambda b, h, q, k: rel[q - k + S - 1],
        "alibi": lambda b, h, q, k: -slopes[h] * (q - k).abs(),
        "t5": lambda b, h, q, k: t5[h, torch.clamp(q - k, -4, 4) + 4],
        "per_head": lambda b, h, q, k: per_head[h],
        "per_key": lambda b, h, q, k: per_key[k],
        "per_batch": lambda b, h, q, k: per_batch[b],
        "abs_q": lambda b, h, q, k: 0.05 * q,
        "const": lambda b, h, q, k: torch.full_like(q, 0.5, dtype=torch.float64),
        "rel_but_one_pair": lambda b, h, q, k: rel_but_one[q, k],
        "one_pair": lambda b, h, q, k: torch.where((q == a) & (k == c), 2.0, 0.0),
        "nan_pair": lambda b, h, q, k: nan_pair[q, k],
        "nan_offset": lambda b, h, q, k: nan_rel[q - k + S - 1],
        "floored_float_offset": lambda b, h, q, k: torch.floor(q * 0.3 - k * 0.3),
    }
    if rng.random() < 0.1:
        return None, "none"
    pname = rng.choice(list(parts))
    part = parts[pname]
    chosen = [rng.choice(list(biases)) for _ in range(rng.choice([0, 0, 1, 1, 2, 3]))]
    if rng.random() < 0.08:  # a NaN at one pair of the score part
        chosen.append("nan_pair")
    fns = [biases[n] for n in chosen]
    inf_mask = rng.random() < 0.2
    cut = rng.randrange(L)

    def score_mod(s, b, h, q, k):
        y = part(s, b, h, q, k)
        for fn in fns:
            y = y + fn(b, h, q, k)
        if inf_mask:  # a mask written as a score_mod
            y = torch.where(q != cut, y, float("-inf"))
        return y
    words = pname + "".join(f" + {n}" for n in chosen) + (f", row {cut} -inf" if inf_mask else "")
    return score_mod, words


# -- one case -------------------------------------------------------------------------------------------
def _case(seed: int):
    """Everything one differential case needs, drawn from ``seed``."""
    rng = random.Random(seed)
    B, Hkv, G = rng.choice([1, 1, 2]), rng.choice([1, 2, 3]), rng.choice([1, 1, 2])
    H = Hkv * G
    L = rng.randint(1, 70)
    S = L if rng.random() < 0.5 else rng.randint(1, 70)
    E, Ev = rng.choice([4, 8]), rng.choice([3, 8])
    block = rng.choice([8, 16, 32, 64, 128])
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, E, dtype=torch.float64, generator=g)
    k = torch.randn(B, Hkv, S, E, dtype=torch.float64, generator=g)
    v = torch.randn(B, Hkv, S, Ev, dtype=torch.float64, generator=g)
    mm, rb, rh, mwords = _mask_mod(rng, B, H, L, S)
    sm, swords = _score_mod(rng, B, H, L, S)
    form = rng.choice(["torch", "attnlab_torch", "pattern", "from_mask_mod"])
    return dict(q=q, k=k, v=v, mm=mm, rb=rb, rh=rh, sm=sm, form=form, block=block, B=B, H=H, L=L, S=S,
                gqa=G > 1, words=f"seed {seed}: B={B} H={H}/{Hkv} L={L} S={S} block={block} mask {mwords} as {form}; "
                                f"score_mod {swords}")


def _oracle(q, k, v, sm, mm):
    """torch's eager FlexAttention math (what flex_attention runs uncompiled): out, lse in natural units."""
    out, lse2, _ = math_attention(q, k, v, sm or (lambda s, b, h, i, j: s), (mm or noop_mask,),
                                  1 / math.sqrt(q.shape[-1]), {})
    return out, lse2 * math.log(2)


def run_case(seed: int, counts: collections.Counter | None = None, public: bool = False) -> None:
    """One differential case: attnlab's out and lse against torch's eager flex_attention math (Note [Fuzz
    tolerance]; ``public``: the public torch flex_attention call itself); ``counts`` gathers the paths."""
    c = _case(seed)
    q, k, v, mm, sm, block = c["q"], c["k"], c["v"], c["mm"], c["sm"], c["block"]
    B, H, L, S = c["B"], c["H"], c["L"], c["S"]
    Bm, Hm = (B if c["rb"] else None), (H if c["rh"] else None)
    form = c["form"]
    torch_mask = (None if mm is None or form not in ("torch",) and not (public or c["rh"])
                  else torch_block_mask(mm, Bm, Hm, L, S, device="cpu", BLOCK_SIZE=block))
    if mm is None:
        mask = None
    elif form == "torch":
        mask = torch_mask
    elif form == "attnlab_torch":
        mask = P.create_block_mask(mm, Bm, Hm, L, S, BLOCK_SIZE=block, output="torch")
    elif c["rh"]:  # a pattern is shared by the heads: refused up front (issue 40, D7)
        with pytest.raises(ValueError, match="reads h"):
            if form == "pattern":
                P.create_block_mask(mm, Bm, Hm, L, S, BLOCK_SIZE=block, output="pattern")
            else:
                P.from_mask_mod(mm, B=Bm)
        mask = torch_mask
        form = "torch"
    elif form == "pattern":
        mask = P.create_block_mask(mm, Bm, None, L, S, BLOCK_SIZE=block, output="pattern")
    else:
        mask = P.from_mask_mod(mm, B=Bm)
    with torch.no_grad():
        if public:
            ref, ref_aux = torch_flex(q, k, v, score_mod=sm, block_mask=torch_mask, enable_gqa=c["gqa"],
                                      return_aux=AuxRequest(lse=True))
            ref_lse = ref_aux.lse
        else:
            ref, ref_lse = _oracle(q, k, v, sm, mm)
        plan = attnlab.flex_plan(q, k, v, sm, mask, enable_gqa=c["gqa"], block_size=block)
        out, aux = attnlab.flex_attention(q, k, v, sm, mask, enable_gqa=c["gqa"], block_size=block,
                                          return_aux=AuxRequest(lse=True))
    what = f"{c['words']} [path {plan.path}, score_mod {plan.score_mod.kind}, bias {plan.bias}]"
    _compare(out, ref, what + " out")
    _compare(aux.lse, ref_lse, what + " lse")
    if counts is not None:
        counts["cases"] += 1
        counts[f"path {plan.path}"] += 1
        counts[f"score_mod {plan.score_mod.kind}"] += 1
        counts[f"bias {plan.bias}"] += 1
        counts[f"mask {form if mm is not None else 'none'}"] += 1
        counts["NaN rows"] += int(bool(torch.isnan(ref).any()))
        counts["rows with no key"] += int(bool(torch.isneginf(ref_lse).any()))
        counts["L or S not a multiple of the block"] += int(L % block != 0 or S % block != 0)


def _compare(a: torch.Tensor, e: torch.Tensor, what: str) -> None:
    assert a.shape == e.shape and a.dtype == e.dtype, f"{what}: {a.shape} {a.dtype} vs {e.shape} {e.dtype}"
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    assert torch.equal(nan_a, nan_e), f"{what}: NaN at {nan_a.sum()} elements, torch at {nan_e.sum()}"
    inf_a, inf_e = torch.isinf(a), torch.isinf(e)
    assert torch.equal(inf_a, inf_e) and torch.equal(a[inf_a], e[inf_e]), f"{what}: infinities differ"
    fin = ~(nan_e | inf_e)
    err = (a[fin] - e[fin]).abs()
    bound = ATOL + RTOL * e[fin].abs()
    if bool((err > bound).any()):
        i = int((err - bound).argmax())
        raise AssertionError(f"{what}: {int((err > bound).sum())} of {err.numel()} elements off; worst "
                             f"{float(a[fin][i])!r} vs {float(e[fin][i])!r}")


# -- the suite's fuzz (fast) and the longer sweep (slow) -------------------------------------------------------
@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**31 - 1))
def test_flex_attention_matches_torch_eager(seed):
    run_case(seed)


@pytest.mark.parametrize("seed", [0, 1, 2, 1037])
def test_flex_fuzz_fixed_seeds(seed):
    """A few cases against torch's public flex_attention itself (the oracle above is the math it runs); 1037
    held a NaN at a pair its mask drops, which the kept-blocks bias turned into a NaN row (-inf added to NaN)."""
    run_case(seed, public=True)


@pytest.mark.slow
def test_flex_attention_random_sweep():
    """The longer sweep: ATTNLAB_FUZZ_SECONDS (default 60) of consecutive seeds from ATTNLAB_FUZZ_SEED (default
    0); 0 wrong and 0 crashes (issue 40's target is a 20-minute sweep: ATTNLAB_FUZZ_SECONDS=1200)."""
    seconds = float(os.environ.get("ATTNLAB_FUZZ_SECONDS", "60"))
    seed = int(os.environ.get("ATTNLAB_FUZZ_SEED", "0"))
    counts: collections.Counter = collections.Counter()
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        run_case(seed, counts)
        seed += 1
    print(f"flex fuzz: {dict(sorted(counts.items()))}")
    assert counts["cases"] > 0


def test_every_path_is_reached():
    """The fuzz reaches every path: the kernels with no bias, a relative table, kept blocks, and the general
    path; NaN rows, rows with no key and lengths the block does not divide."""
    counts: collections.Counter = collections.Counter()
    for seed in range(1000, 1040):
        run_case(seed, counts)
    for key in ("path attention", "path general", "bias kept blocks", "bias None", "NaN rows", "rows with no key",
                "L or S not a multiple of the block", "score_mod softcap", "score_mod affine"):
        assert counts[key] > 0, (key, dict(counts))
    assert math.isfinite(counts["cases"])
