"""Property-based differential test: every exact method, and auto, against the float64 reference.

Hypothesis draws the arguments — ranks 3-5, zero-size batch / heads / L / S, L = 1, GQA, scale <= 0,
bool and float masks of three shapes (float32 masks with bfloat16 inputs too; float masks that require
grad), fully masked rows, keys removed for every query by the mask whose key and value rows hold NaN or
±Inf (they must not leak), is_causal, patterns (bands, blocks, per-batch key padding), soft-capping,
ALiBi slopes [H] and [*batch, H], need_weights, strict, dropout — and the memory layout of every tensor
(``helpers.layouts``: stride-0 expands on any dim, ``.mT`` and permuted storage, strided and sliced
dims, offsets, odd strides on size-1 dims). Dtypes float64, float32 and bfloat16.

For each draw: every method the planner accepts runs and matches the reference; a method it refuses
raises, and auto's ``explain`` names it refused with the same reason; auto runs whenever any explicit
method runs (issue 21: it raised for softcap + a float mask requiring grad + ALiBi [B, H], which only
dense runs), and matches the reference too.

Outputs and weights are compared with ``attnlab.reference`` (attention_with_lse's log-sum-exp with
float64 logsumexp); gradients (q, k, v and a float mask's) with autograd through the naive computation
in float64 (plain torch ops, no attnlab kernel).

Tolerance, the way PyTorch budgets its fused kernels (test/test_transformers.py): elementwise
|got - ref| <= atol + rtol·|ref|, where atol is ERROR_FACTOR times the error of the naive computation in
the input's own dtype (softmax(capped q kᵀ·scale + ALiBi + mask) v with every op in that dtype) against
the same float64 reference, but at least PyTorch's default atol for the dtype, and rtol is PyTorch's default.

Examples: a small default per test (the module runs in seconds); ``ATTNLAB_FUZZ_EXAMPLES=N`` runs N per
test for a long sweep, ``ATTNLAB_FUZZ_METHODS=dense,tiled,...`` restricts the explicit methods compared
(auto still runs whatever it picks), ``ATTNLAB_FUZZ_LAYOUTS=0`` keeps every tensor row-major.
``test_each_layout_of_each_tensor`` lays out one tensor at a time in each kind of layout, by name.
"""
from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import attnlab
from attnlab import patterns as P
from attnlab import reference
from attnlab.functional import METHODS
from helpers import Layout, layouts

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: two threads on two busy cores stall

EXPLICIT = tuple(m for m in ("dense", "sdpa", "tiled", "sparse", "compiled") if m in METHODS)
if os.environ.get("ATTNLAB_FUZZ_METHODS"):
    EXPLICIT = tuple(m for m in os.environ["ATTNLAB_FUZZ_METHODS"].split(",") if m in EXPLICIT)
EXACT = EXPLICIT + ("auto",)
FUZZ_EXAMPLES = int(os.environ.get("ATTNLAB_FUZZ_EXAMPLES", "0"))
#: ATTNLAB_FUZZ_LAYOUTS=0 draws row-major tensors only (to sweep the arguments apart from the layouts)
FUZZ_LAYOUTS = os.environ.get("ATTNLAB_FUZZ_LAYOUTS", "1") not in ("0", "")
#: a method's error vs float64 may be this factor times the naive same-dtype computation's error
#: (PyTorch's rule for its fused attention kernels; the house FUSED_ERROR_FACTOR)
ERROR_FACTOR = 3.0
#: the same for gradients: a fused backward recomputes the weights from the log-sum-exp and takes
#: rowsum(dO∘O) from the output rounded to the input dtype (FlashAttention-2's backward), so PyTorch's own
#: SDPA gradient tests allow larger factors (test_transformers.py: up to 160 for grad_query). Measured here
#: (bf16, float32 bias): tiled 3x, compiled 6x the naive bf16 error on dq.
GRAD_ERROR_FACTOR = 8.0
#: PyTorch's floors in its fused-attention tests (test_transformers.py default_atol / default_rtol); for
#: float64, which it does not budget there, 1e-12 (the naive float64 error is ~1e-16)
DEFAULT_ATOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-3}
DEFAULT_RTOL = {torch.float64: 0.0, torch.float32: 1.3e-6, torch.bfloat16: 1.6e-2}
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _examples(default: int) -> int:
    return FUZZ_EXAMPLES or default


#: name -> pattern for (flattened batch N, key length S, generator); per-batch ones need N >= 1
PATTERNS = {
    "window": lambda N, S, g: P.sliding_window(3),
    "causal window": lambda N, S, g: P.sliding_window(4, causal=True),
    "dilated": lambda N, S, g: P.dilated(2, 2),
    "fixed": lambda N, S, g: P.fixed(4, 1),
    "key padding": lambda N, S, g: P.key_padding(torch.randint(0, S + 1, (N,), generator=g)),
}
MASK_SHAPES = ("[L, S]", "[*batch, H, L, S]", "[1, S]")


@st.composite
def cases(draw, dropout: bool = False, weights: bool = True):
    rank = draw(st.sampled_from([3, 4, 4, 5]))
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
    Hkv = draw(st.integers(0, 2))
    groups = draw(st.sampled_from([1, 1, 2, 3])) if Hkv else 1
    H = Hkv * groups
    lead = [draw(st.integers(0, 2)) for _ in range(rank - 3)]
    L = draw(st.sampled_from([0, 1, 1, 2, 5, 17, 33]))
    S = draw(st.sampled_from([0, 1, 3, 8, 17, 40]))
    E = draw(st.integers(1, 12))
    Ev = draw(st.sampled_from([E, E, draw(st.integers(1, 12))]))
    scale = draw(st.sampled_from([None, None, 0.7, 0.0, -0.4, 2.0]))
    is_causal = draw(st.booleans())
    mask_kind = draw(st.sampled_from(["none", "bool", "float"]))
    mask_shape = draw(st.sampled_from(MASK_SHAPES))
    mask_grad = mask_kind == "float" and draw(st.sampled_from([False, False, True]))
    poison = draw(st.sampled_from([None, float("nan"), float("inf"), float("-inf")]))
    N = math.prod(lead)
    pattern = draw(st.sampled_from([None, None, None, *(p for p in PATTERNS if p != "key padding" or N)]))
    softcap = draw(st.sampled_from([None, None, 1.5, 0.4]))
    alibi = draw(st.sampled_from([None, None, "[H]", *(["[*batch, H]"] if lead else [])]))
    need_weights = weights and draw(st.sampled_from([False, False, True]))
    strict = draw(st.sampled_from([False] * 7 + [True]))
    dropout_p = draw(st.sampled_from([0.3, 0.7])) if dropout else 0.0
    block = draw(st.sampled_from([None, 4, 16]))
    seed = draw(st.integers(0, 2**31 - 1))
    mshape = {"[L, S]": (L, S), "[*batch, H, L, S]": (*lead, H, L, S), "[1, S]": (1, S)}[mask_shape]
    # dead keys hold poison in every head: their rows must not be stride-0 copies of a live key's
    keep_s = (-2,) if poison is not None and mask_kind != "none" else ()
    lays = layouts if FUZZ_LAYOUTS else (lambda shape, **kw: st.just(Layout(tuple(shape))))
    lay = dict(q=draw(lays((*lead, H, L, E))), k=draw(lays((*lead, Hkv, S, E), no_expand=keep_s)),
               v=draw(lays((*lead, Hkv, S, Ev), no_expand=keep_s)),
               mask=draw(lays(mshape)) if mask_kind != "none" else None,
               slopes=draw(lays((H,) if alibi == "[H]" else (*lead, H))) if alibi else None)
    return dict(rank=rank, dtype=dtype, H=H, Hkv=Hkv, lead=lead, L=L, S=S, E=E, Ev=Ev, scale=scale,
                is_causal=is_causal, mask_kind=mask_kind, mask_shape=mask_shape, mask_grad=mask_grad,
                poison=poison, pattern=pattern, softcap=softcap, alibi=alibi, need_weights=need_weights,
                strict=strict, dropout_p=dropout_p, block=block, seed=seed, layouts=lay)


def _describe(c) -> str:
    """The case without its defaults, layouts as strides, for failure messages."""
    skip = {"mask_grad": False, "poison": None, "pattern": None, "softcap": None, "alibi": None,
            "need_weights": False, "strict": False, "dropout_p": 0.0, "block": None}
    parts = [f"{k}={v}" for k, v in c.items() if k != "layouts" and skip.get(k, object()) != v]
    lays = [f"{n}: {lay}" for n, lay in c["layouts"].items() if lay is not None and not lay.is_default()]
    return ", ".join(parts) + (" | layouts " + "; ".join(lays) if lays else "")


class Built:
    """One drawn call: ``leaves`` (row-major; gradients are taken with respect to them), the tensors
    attnlab gets (``q, k, v, mask, slopes``: laid out, dead keys poisoned), the oracle's row-major
    values (``clean``: same values, no poison) and the attention keywords."""

    def __init__(self, c, grad: bool = False):
        g = torch.Generator().manual_seed(c["seed"])
        lead, L, S, dtype, lay = c["lead"], c["L"], c["S"], c["dtype"], c["layouts"]
        self.c, self.gqa = c, c["H"] != c["Hkv"]
        q = torch.randn(*lead, c["H"], L, c["E"], generator=g, dtype=torch.float64).to(dtype)
        k = torch.randn(*lead, c["Hkv"], S, c["E"], generator=g, dtype=torch.float64).to(dtype)
        v = torch.randn(*lead, c["Hkv"], S, c["Ev"], generator=g, dtype=torch.float64).to(dtype)
        N = math.prod(lead)
        self.pattern = PATTERNS[c["pattern"]](N, S, g) if c["pattern"] else None
        m = None
        if c["mask_kind"] != "none":
            mshape = lay["mask"].shape
            keep = torch.rand(mshape, generator=g) > 0.3
            if L and S and mshape[-2] == L:
                keep[..., 0, :] = False  # a fully masked row: output 0
            keep = keep & ~(torch.rand(S, generator=g) < 0.3)  # keys no query may see (padding)
            if c["mask_kind"] == "bool":
                m = keep
            else:
                bias = torch.randn(mshape, generator=g, dtype=torch.float64) * 3
                # float32 masks with bfloat16 inputs stay float32 (issue 13); else the inputs' dtype
                m = bias.masked_fill(~keep, float("-inf")).to(torch.float32 if dtype == torch.bfloat16 else dtype)
        sl = None
        if c["alibi"]:
            # float32 values (the compiled kernel reads slopes as float32, as flash-attn does), passed as
            # float64 with float64 inputs: a kernel computes ALiBi's bias in the slopes' dtype (float32 at
            # least: Note [Bias precision]), so float32 slopes would round it below float64's precision
            sl = torch.rand(lay["slopes"].shape, generator=g) * 0.9 + 0.05
            sl = sl.double() if dtype == torch.float64 else sl
        grads = (grad, grad, grad, c["mask_grad"])  # a float mask that requires grad changes the plan
        self.leaves = [t if t is None else t.requires_grad_(r) for t, r in zip((q, k, v, m), grads)]
        self.clean = [None if t is None else lay[n].values(t) for n, t in zip(("q", "k", "v", "mask"), self.leaves)]
        self.slopes = None if sl is None else lay["slopes"].apply(sl)
        self.slopes_values = None if sl is None else lay["slopes"].values(sl)
        self.q = lay["q"].apply(self.leaves[0])
        self.mask = None if m is None else lay["mask"].apply(self.leaves[3])
        self.k, self.v = lay["k"].apply(self.leaves[1]), lay["v"].apply(self.leaves[2])
        mv = self.clean[3]
        if mv is not None and c["poison"] is not None and S:
            # keys the mask removes for every query (after the layout: an expanded mask repeats its rows)
            kept = (mv if mv.dtype == torch.bool else ~torch.isneginf(mv.detach())).broadcast_to((*lead, c["H"], L, S))
            dead = ~kept.reshape(-1, S).any(0)
            if bool(dead.any()):
                # what dead keys hold must not matter: the oracle sees the clean rows, attnlab poison
                d = dead.unsqueeze(-1)
                self.k = lay["k"].apply(torch.where(d, torch.tensor(c["poison"], dtype=dtype), self.leaves[1]))
                self.v = lay["v"].apply(torch.where(d, torch.tensor(c["poison"], dtype=dtype), self.leaves[2]))
        self.kw = dict(attn_mask=self.mask, is_causal=c["is_causal"], scale=c["scale"], enable_gqa=self.gqa,
                       pattern=self.pattern, softcap=c["softcap"], alibi_slopes=self.slopes)
        self.run_kw = dict(strict=c["strict"], block_size=c["block"])

    def to_leaf(self, name: str, t):
        """An elementwise bound on the gradient of ``name``'s values, as a bound on its leaf's gradient
        (an expanded dim's gradient is summed into index 0)."""
        if t is None:
            return None
        x = torch.zeros(self.c["layouts"][name].shape, dtype=t.dtype, requires_grad=True)
        return torch.autograd.grad(self.c["layouts"][name].values(x), x, t.expand(x.shape))[0]

    def oracle_mask(self, mask):
        """``mask`` (clean values, any dtype) combined with the pattern, for the reference and the naive
        computation: bool AND the pattern, or a float mask at -inf where the pattern drops the pair."""
        if self.pattern is None:
            return mask
        c = self.c
        pm = self.pattern.materialize(c["L"], c["S"])
        if self.pattern.batch_size:
            pm = pm.reshape(*c["lead"], 1, c["L"], c["S"]) if c["lead"] else pm.reshape(1, c["L"], c["S"])
        if mask is None:
            return pm
        if mask.dtype == torch.bool:
            return mask & pm
        return torch.where(pm, mask, torch.tensor(float("-inf"), dtype=mask.dtype))

    def reference(self):
        """(out, weights) of the float64 reference on the clean values."""
        q, k, v, m = (None if t is None else t.detach() for t in self.clean)
        c = self.c
        out, w = reference.attention(q, k, v, self.oracle_mask(m), c["is_causal"], c["scale"], self.gqa,
                                     softcap=c["softcap"], alibi_slopes=self.slopes_values)
        return torch.from_numpy(out), torch.from_numpy(w)

    def naive(self, q, k, v, mask):
        """(out, weights) with every op in q's dtype (the budget), or float64 autograd's oracle."""
        c = self.c
        return _naive(q, k, v, self.oracle_mask(mask), c["is_causal"], c["scale"], self.gqa, c["softcap"],
                      self.slopes_values)

    def scores(self, q, k, mask):
        c = self.c
        return _scores(q, k, self.oracle_mask(mask), c["is_causal"], c["scale"], self.gqa, c["softcap"],
                       self.slopes_values)


def _naive(q, k, v, mask, is_causal, scale, gqa, softcap=None, slopes=None):
    """softmax(s) v with s from ``_scores``, every op in q's dtype; masked scores -inf, empty rows 0.
    Returns (out, weights)."""
    if gqa:
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
    s = _scores(q, k, mask, is_causal, scale, gqa, softcap, slopes)
    m = s.amax(-1, keepdim=True) if s.shape[-1] else torch.zeros(*s.shape[:-1], 1, dtype=s.dtype)
    p = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
    d = p.sum(-1, keepdim=True)
    w = p / torch.where(d == 0, torch.ones_like(d), d)
    return w @ v, w


def _scores(q, k, mask, is_causal, scale, gqa, softcap=None, slopes=None):
    """Scaled, soft-capped, ALiBi-biased, masked scores in q's dtype (masked: -inf): what the
    log-sum-exp is taken over (Note [Score modifications], written out)."""
    if gqa:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
    L, S, E = q.shape[-2], k.shape[-2], q.shape[-1]
    s = (q @ k.transpose(-2, -1)) * (1 / math.sqrt(E) if scale is None else scale)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if slopes is not None:
        i, j = torch.arange(L).unsqueeze(-1), torch.arange(S).unsqueeze(0)
        s = s - slopes.to(q.dtype)[..., None, None] * (i + S - L - j).abs().to(q.dtype)
    keep = torch.ones(L, S, dtype=torch.bool)
    if is_causal:
        keep = keep.tril()
    if mask is not None and mask.dtype == torch.bool:
        keep = keep & mask
    elif mask is not None:
        s = s + mask.to(q.dtype)
    return s.masked_fill(~keep, float("-inf"))


def _lse_err(a, ref):
    """Largest |a - ref| over rows, where rows with no key must be -inf in both."""
    if not a.numel():
        return 0.0
    a = a.double()
    both = torch.isneginf(a) & torch.isneginf(ref)
    assert torch.equal(torch.isneginf(a), torch.isneginf(ref)), "rows with no key must have lse = -inf"
    return float(torch.where(both, torch.zeros_like(a), a - ref).abs().max())


def _check(what, got, ref, naive_err, dtype, factor=ERROR_FACTOR, floor=None):
    """PyTorch's rule: |got - ref| <= atol + rtol·|ref| elementwise, atol = max(factor · naive
    error, default atol[dtype]), rtol = default rtol[dtype]; plus ``floor`` (elementwise) where given.
    Rows at -inf (an lse with no key) must be -inf in both and are then equal."""
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    if not got.numel():
        return
    got = got.detach().double()
    assert torch.equal(torch.isneginf(got), torch.isneginf(ref)), f"{what}: -inf rows differ"
    fin = ~torch.isneginf(ref)
    atol = max(factor * naive_err, DEFAULT_ATOL[dtype])
    rtol = DEFAULT_RTOL[dtype]
    err = torch.where(fin, got - ref, torch.zeros_like(ref)).abs()
    bound = atol + rtol * torch.where(fin, ref, torch.zeros_like(ref)).abs()
    if floor is not None:
        bound = bound + floor
    assert not torch.isnan(err).any(), f"{what}: NaN"
    worst = int((err - bound).argmax())
    assert bool((err <= bound).all()), (f"{what}: error {float(err.flatten()[worst]):.3g} > {atol:.3g} + {rtol:g}·|ref| "
                                        f"(naive error {naive_err:.3g})")


def _delta_floor(b: Built, gout, dtype):
    """Elementwise rounding floors for (dq, dk, dmask) of a backward that takes delta = rowsum(dO∘O) from O
    rounded to ``dtype`` (FlashAttention-2's backward, PyTorch's CPU flash kernel): dS = P∘(dP − delta)
    cancels terms of size P·(|dP| + Σ|dO∘O|), each rounded at ``dtype``'s unit roundoff u, so
    |ddS| <= u·P·(|dP| + D), |ddq| <= u·|scale|·(P·(|dP| + D)) |k| and |ddk| <= u·|scale|·(P·(|dP| + D))ᵀ |q|
    to first order (soft-capping's derivative, at most 1, only shrinks them). On tiny rows (L = 1, S = 3)
    the naive computation's own error can be 25x below this by luck, so the naive-error budget alone fails
    a correct kernel (hypothesis found SDPA bf16 dq at 25x naive)."""
    q, k, v, m = (None if t is None else t.detach().double() for t in b.clean)
    g = gout.double()
    rep = q.shape[-3] // k.shape[-3] if b.gqa else 1
    if rep > 1:
        k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
    c = b.c
    p = torch.softmax(_scores(q, k, b.oracle_mask(m), c["is_causal"], c["scale"], False, c["softcap"],
                              b.slopes_values), -1).nan_to_num(0.0)  # rows with no key: 0
    dp = g @ v.transpose(-2, -1)  # [..., L, S]
    d = (g.abs() * (p @ v).abs()).sum(-1, keepdim=True) + (p * dp.abs()).sum(-1, keepdim=True)
    t = p * (dp.abs() + d)
    u = torch.finfo(dtype).eps / 2
    sc = abs(1 / math.sqrt(q.shape[-1]) if c["scale"] is None else c["scale"])
    fq, fk = u * sc * (t @ k.abs()), u * sc * (t.transpose(-2, -1) @ q.abs())
    if rep > 1:
        fk = fk.unflatten(-3, (fk.shape[-3] // rep, rep)).sum(-3)  # the group's query heads share a key head
    fm = None if m is None else (u * t).sum_to_size(m.shape)
    return b.to_leaf("q", fq), b.to_leaf("k", fk), b.to_leaf("mask", fm)


def _cast_floor(c, gout):
    """Elementwise floors for (dq, dk, dv) from rounding each position's gradient to the input dtype: every
    kernel returns the gradient of the tensor it was given, an expanded layout included, in that tensor's dtype
    (unit roundoff u), and autograd then sums the expanded positions into the leaf. Where the positions'
    gradients cancel (k expanded along S gives every key the same scores, and a row's dS sums to 0), the leaf's
    gradient is near 0 and off by up to u · Σ|position gradients| whatever the kernel; the naive computation,
    rounded the same way, can be lucky (hypothesis found the dense method's bf16 dk at 9x the naive error on q
    [2, 33, 4] strides [33, 1, 0] and k [1, 40, 4] strides [4, 0, 1]: seed 4234 of ``attnlab verify``'s fuzz)."""
    if c["dtype"] == torch.float64:
        return (None, None, None)
    b = Built(c)
    q, k, v = (t.detach().double().requires_grad_(True) for t in b.clean[:3])
    m = None if b.clean[3] is None else b.clean[3].detach().double() if b.clean[3].is_floating_point() \
        else b.clean[3].detach()
    g = torch.autograd.grad(b.naive(q, k, v, m)[0], [q, k, v], gout.double(), allow_unused=True)
    u = torch.finfo(c["dtype"]).eps / 2
    return tuple(None if x is None else b.to_leaf(n, u * x.abs()) for n, x in zip(("q", "k", "v"), g))


def _o_rounded(ran: str, dtype: torch.dtype) -> bool:
    """Whether the backward that ran takes delta = rowsum(dO∘O) from an O rounded at ``dtype``'s unit
    roundoff, so ``_delta_floor`` applies. PyTorch's fused backward reads O in the input dtype (sdpa, and the
    sparse kernel, whose backward runs it per gathered run on the fused forward's O). attnlab's
    tiled and compiled kernels keep O in float32: for float32 inputs that is the input dtype's own
    roundoff (the tiled backward runs PyTorch's fused CPU backward on it: hypothesis found its dq 15x the
    naive float32 error on a q summed over an expanded head dim, equal to SDPA's on the same inputs), for
    bfloat16 it is finer — but the compiled kernel's half-type forward rounds P to the input dtype before
    P·V, so its O carries the same relative error u (csrc Note [fp32 O for delta]; measured: 2 of 400 draws
    of FOUND_BF16_DELTA's shape over the naive budget alone, from 29 with O rounded to bf16)."""
    if dtype == torch.float64:
        return False
    if ran in ("sdpa", "sparse") or (ran in ("tiled", "compiled") and dtype == torch.float32):
        return True
    return ran == "compiled" and dtype in (torch.bfloat16, torch.float16)


def _err(a, ref):
    return float((a.detach().double() - ref).abs().max()) if a.numel() else 0.0


def _plans(b: Built, c, **kw):
    """(auto's plan or the error it raised, {explicit method: its plan}) — checking that each method
    explain refuses is refused by auto's plan with the same reason, shown in auto's explain text, and that
    auto refuses only when every method does."""
    try:
        auto, auto_err = attnlab.explain(b.q, b.k, b.v, **b.kw, method="auto", **b.run_kw, **kw), None
    except ValueError as e:
        auto, auto_err = None, e
    ok = {}
    for method in EXPLICIT:
        try:
            ok[method] = attnlab.explain(b.q, b.k, b.v, **b.kw, method=method, **b.run_kw, **kw)
        except ValueError as e:
            assert f"method={method!r} cannot run these inputs" in str(e), e
            if auto is not None:
                why = auto.refused.get(method)
                assert why is not None and why in str(e), (method, str(e), auto.refused)
                assert f"refused: {why}" in str(auto), (method, str(auto))
            continue
        assert auto is not None, f"auto raised ({auto_err}) where method={method!r} runs: {_describe(c)}"
        assert method not in auto.refused, (method, auto.refused)
    if auto is None:
        assert not ok and "no attention method can run these inputs" in str(auto_err), auto_err
    else:
        assert auto.method not in auto.refused and (auto.method in ok or auto.method not in EXPLICIT), auto
    return auto, ok


def _case(**kw):
    """A case from the defaults below (row-major layouts unless given)."""
    c = dict(rank=3, dtype=torch.float32, H=1, Hkv=1, lead=[], L=1, S=1, E=1, Ev=1, scale=None, is_causal=False,
             mask_kind="none", mask_shape="[L, S]", mask_grad=False, poison=None, pattern=None, softcap=None,
             alibi=None, need_weights=False, strict=False, dropout_p=0.0, block=None, seed=0)
    lay = kw.pop("layouts", {})
    c.update(kw)
    lead, H, Hkv, L, S = c["lead"], c["H"], c["Hkv"], c["L"], c["S"]
    shapes = dict(q=(*lead, H, L, c["E"]), k=(*lead, Hkv, S, c["E"]), v=(*lead, Hkv, S, c["Ev"]),
                  mask=None if c["mask_kind"] == "none" else {"[L, S]": (L, S), "[1, S]": (1, S),
                                                              "[*batch, H, L, S]": (*lead, H, L, S)}[c["mask_shape"]],
                  slopes=None if not c["alibi"] else (H,) if c["alibi"] == "[H]" else (*lead, H))
    c["layouts"] = {n: lay.get(n) or (None if shp is None else Layout(shp)) for n, shp in shapes.items()}
    return c


#: found by hypothesis (issue 21): attention_with_lse 0.49 off with a value whose last dim has stride 2 —
#: PyTorch's private CPU flash op reads the head dims as dense (Note [Private flash op strides])
FOUND_LSE_STRIDED_V = _case(H=2, Hkv=2, S=3, E=2, Ev=2, layouts=dict(v=Layout((2, 3, 2), steps=(1, 1, 2))))

#: found by hypothesis (issue 21's long sweep, both tile paths): the compiled kernel 0.72 off for values
#: expanded along S (stride 0), float64 (MKL's dgemm is handed a leading dimension of 0; float32 too under
#: ATTNLAB_EXT_GEMM=mkl)
FOUND_COMPILED_V_STRIDE0_S = _case(dtype=torch.float64, H=2, Hkv=2, S=3, layouts=dict(v=Layout((2, 3, 1), expanded=(1,))))
#: ... and raising "q, k, v must be 4-D with a contiguous last dim" for a value head dim of 1 with stride 3
FOUND_COMPILED_EV1_STRIDED = _case(S=3, layouts=dict(v=Layout((1, 3, 1), order=(0, 2, 1))))

#: ... and PyTorch's flash kernel (private op and public SDPA) returning 1e35 / NaN for q [1, 2, 33, 11] with
#: strides [1, 66, 0, 1]: a size-1 batch dim's stride below the next dim's, queries expanded (kernels/fused.py
#: Note [Size-1 dim strides])
FOUND_SDPA_UNIT_DIM_STRIDE = _case(rank=4, lead=[1], dtype=torch.bfloat16, H=2, Hkv=1, L=33, S=3, E=11, Ev=11,
                                   scale=0.7, seed=4598, layouts=dict(q=Layout((1, 2, 33, 11), expanded=(2,),
                                   steps=(3, 1, 1, 1), pads=(5, 0, 5, 0), unit_strides=(1, None, None, None))))


#: ... and the same kernel reading past the data (errors up to 1e29 and NaN, different on every call) once
#: attnlab set that size-1 batch dim's stride to 1 where the dims after it are expanded: q [3, 33, 5] expanded
#: on heads and queries, GQA, scale < 0, causal + window + a key-padding mask, poisoned dead keys (the layout
#: fuzz of `attnlab verify`, seed 28885; kernels/fused.py Note [Size-1 dim strides])
FOUND_SDPA_EXPANDED_AFTER_UNIT = _case(rank=3, dtype=torch.float32, H=3, Hkv=1, L=33, S=8, E=5, Ev=5, scale=-0.4,
                                       is_causal=True, mask_kind="bool", mask_shape="[1, S]", poison=float("-inf"),
                                       pattern="window", block=16, seed=2705,
                                       layouts=dict(q=Layout((3, 33, 5), expanded=(0, 1), pads=(1, 1, 1), offset=3),
                                                    k=Layout((1, 8, 5), order=(1, 2, 0), steps=(3, 1, 1),
                                                             pads=(5, 0, 0), unit_strides=(7, None, None)),
                                                    mask=Layout((1, 8))))

#: ... and public SDPA leaving one output element uninitialised for q [1, 2, 2] with strides [1, 0, 1] (4-D: [1, 1,
#: 2, 2], strides [1, 1, 0, 1], size-1 strides already the ones Note [Size-1 dim strides] gives, so nothing was
#: copied): the layout fuzz of `attnlab verify`, seed 4219
FOUND_SDPA_TIDY_EXPANDED = _case(L=2, E=2, Ev=2, layouts=dict(q=Layout((1, 2, 2), expanded=(1,),
                                                                       unit_strides=(1, None, None))))


@settings(max_examples=_examples(150), **SETTINGS)
@given(cases())
@example(FOUND_SDPA_TIDY_EXPANDED)
@example(FOUND_SDPA_EXPANDED_AFTER_UNIT)
@example(FOUND_LSE_STRIDED_V)
@example(FOUND_SDPA_UNIT_DIM_STRIDE)
@example(FOUND_COMPILED_V_STRIDE0_S)
@example(FOUND_COMPILED_EV1_STRIDED)
def test_every_exact_method_matches_the_float64_reference(c):
    _outputs_match(c)


def _outputs_match(c):
    """Every method the planner accepts (and auto) against the float64 reference: output, weights, lse."""
    b = Built(c)
    auto, ok = _plans(b, c, need_weights=c["need_weights"])
    if auto is None:
        return
    ref, ref_w = b.reference()
    naive, naive_w = b.naive(*(None if t is None else t.detach() for t in b.clean))
    naive_err, naive_w_err = _err(naive, ref), _err(naive_w, ref_w)
    for method in (*ok, "auto"):
        got = attnlab.attention(b.q, b.k, b.v, **b.kw, method=method, need_weights=c["need_weights"], **b.run_kw)
        out, w = got if c["need_weights"] else (got, None)
        ran = auto.method if method == "auto" else method
        assert out.dtype == b.q.dtype, (method, out.dtype)
        _check(f"{method} ({ran}) {_describe(c)}", out, ref, naive_err, c["dtype"])
        if w is not None:
            _check(f"{method} ({ran}) weights {_describe(c)}", w, ref_w, naive_w_err, c["dtype"])
    if c["need_weights"] or c["strict"]:
        return
    # attention_with_lse: the fused path for plain and causal inputs, the compiled or tiled kernel otherwise
    try:
        out, lse = attnlab.attention_with_lse(b.q, b.k, b.v, **b.kw, block_size=c["block"])
    except ValueError as e:  # no kernel returning a log-sum-exp takes these inputs (e.g. dense-only ones)
        assert "no attention method can return the log-sum-exp" in str(e), e
        return
    _check(f"attention_with_lse {_describe(c)}", out, ref, naive_err, c["dtype"])
    q, k, _, m = (None if t is None else t.detach() for t in b.clean)
    s64 = b.scores(q.double(), k.double(), m.double() if m is not None and m.dtype != torch.bool else m)
    lse_ref = torch.logsumexp(s64, -1) if c["S"] else torch.full(s64.shape[:-1], float("-inf"), dtype=torch.float64)
    naive_s = b.scores(q, k, m)
    lse_naive = torch.logsumexp(naive_s, -1) if c["S"] else lse_ref.to(q.dtype)
    _check(f"lse {_describe(c)}", lse, lse_ref, _lse_err(lse_naive, lse_ref), c["dtype"])


@pytest.mark.parametrize("method", EXACT)
def test_the_naive_budget_is_not_vacuous(method):
    # the same budget catches a real error: a key dropped from the softmax
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 9, 8, generator=g) for _ in range(3))
    ref = torch.from_numpy(reference.attention(q, k, v)[0])
    naive = _err(_naive(q, k, v, None, False, None, False)[0], ref)
    keep = torch.ones(9, 9, dtype=torch.bool)
    keep[:, 4] = False
    try:
        out = attnlab.attention(q, k, v, attn_mask=keep, method=method)
    except ValueError as e:  # compiled without its extension
        pytest.skip(str(e))
    _check("right", attnlab.attention(q, k, v, method="dense"), ref, naive, torch.float32)
    with pytest.raises(AssertionError, match="error"):
        _check("one key dropped", out, ref, naive, torch.float32)


def test_layouts_are_what_they_say():
    # the strategy's tensors hold the given values in the strides they claim: a stride-0 expand, .mT,
    # a ::2 slice of a wider last dim, a size-1 dim with an odd stride
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    lay = Layout((2, 3, 4), expanded=(1,), order=(0, 2, 1), steps=(1, 1, 2), offset=3)
    y = lay.apply(x)
    assert y.stride() == lay.strides() == (7, 0, 2) and y.storage_offset() == 3  # rows of 7: x[..., ::2] of 4
    assert torch.equal(y, x[:, :1].expand(2, 3, 4)) and not y.is_contiguous()
    z = Layout((5, 1, 3), unit_strides=(None, 1000, None)).apply(torch.randn(5, 1, 3))
    assert z.stride() == (3, 1000, 1)
    # what .mT of a wider tensor's ::2 slice gives
    w = torch.randn(4, 6)[:, ::2].mT
    assert Layout((3, 4), order=(1, 0), steps=(2, 1), pads=(1, 0)).apply(torch.randn(3, 4)).stride() == w.stride()


#: found by hypothesis (issue 21): auto raised "no attention method can run these inputs" for soft-capping +
#: a float mask that requires grad + ALiBi [B, H], where method="dense" runs (auto never fell back to dense)
FOUND_AUTO_DENSE_ONLY = _case(rank=4, H=2, Hkv=2, lead=[2], L=5, S=8, E=4, Ev=4, mask_kind="float",
                              mask_grad=True, softcap=1.5, alibi="[*batch, H]")


def test_auto_runs_what_only_dense_runs():
    c = FOUND_AUTO_DENSE_ONLY
    b = Built(c)
    plan = attnlab.explain(b.q, b.k, b.v, **b.kw)
    assert plan.method == "dense" and set(plan.refused) == set(METHODS[1:]) - {"dense"}
    _check("auto", attnlab.attention(b.q, b.k, b.v, **b.kw), b.reference()[0],
           _err(b.naive(*(t.detach() for t in b.clean))[0], b.reference()[0]), c["dtype"])


#: found by hypothesis (stop 18): the compiled backward took delta = rowsum(dO∘O) from O rounded to bfloat16,
#: dk error 0.00256 against the naive bf16 error 0.00025; with the float32 O (csrc Note [fp32 O for delta])
#: its error equals the naive one
FOUND_BF16_DELTA = _case(rank=4, dtype=torch.bfloat16, lead=[1], S=3, Ev=5, scale=2.0)

#: found by hypothesis (issue 21's long sweep): the compiled backward's dv 0.043 off for keys expanded along
#: S under GQA, float64
FOUND_COMPILED_GQA_K_STRIDE0_S = _case(dtype=torch.float64, rank=4, lead=[1], H=2, Hkv=1, S=3,
                                       layouts=dict(k=Layout((1, 1, 3, 1), expanded=(2,))))

#: found by hypothesis (issue 21's long sweep, no extension): tiled dq 1.11e-5 against the naive float32 error
#: 7.2e-7 on q expanded along its head dim (the leaf's gradient sums 9 entries); the same error for a
#: contiguous q, and SDPA's fused backward gives it too: the delta rounding of ``_o_rounded``
#: (and sparse's dq 1.19e-05 against 1.19e-06 at L=2, S=40, E=Ev=10, v expanded along its heads too)
FOUND_TILED_F32_DELTA = _case(rank=5, lead=[2, 2], L=2, S=17, E=9, Ev=9, scale=2.0, mask_kind="float",
                              mask_shape="[1, S]", layouts=dict(q=Layout((2, 2, 1, 2, 9), expanded=(4,))))

#: found by hypothesis (the 3000-example sweep): dense and tiled dv 0.035 (9 bf16 ulps) off under bf16 GQA,
#: 3 query heads per key head whose per-head dv (-4.8, 5.9, -0.3) cancel to 0.79: they were repeated before
#: the kernel, so each per-head gradient was rounded to bf16 before the group's sum (Note [GQA gradients in
#: the accumulation dtype]); the naive bf16 computation does the same and was exact here by luck
FOUND_BF16_GQA_DV_SUM = _case(dtype=torch.bfloat16, H=3, Hkv=1, L=17, S=3, scale=0.7, mask_kind="float",
                              softcap=1.5, seed=1)


#: found by hypothesis (a fresh clone's make test): PyTorch's CPU SDPA backward gave dq off by 0.115 for q
#: expanded along L with a size-1 head dim of stride 1 (strides [2, 1, 0, 1]); Note [SDPA backward of
#: expanded operands]
FOUND_SDPA_Q_EXPANDED_L = _case(rank=4, lead=[1], L=2, S=1, E=2, Ev=2,
                                layouts=dict(q=Layout((1, 1, 2, 2), expanded=(2,), unit_strides=(None, 1, None, None))))


#: ... and the dense method's bf16 dk 9x the naive error where every key is the same (k expanded along S) and the
#: positions' gradients cancel in the leaf's sum (``_cast_floor``): the layout fuzz of `attnlab verify`, seed 4234
FOUND_BF16_CANCELLING_DK = _case(dtype=torch.bfloat16, H=2, Hkv=1, L=33, S=40, E=4, Ev=4, scale=0.7, seed=61485,
                                 layouts=dict(q=Layout((2, 33, 4), expanded=(2,)), k=Layout((1, 40, 4), expanded=(1,))))


@settings(max_examples=_examples(100), **SETTINGS)
@given(cases(weights=False))
@example(FOUND_BF16_CANCELLING_DK)
@example(FOUND_SDPA_Q_EXPANDED_L)
@example(FOUND_BF16_DELTA)
@example(FOUND_BF16_GQA_DV_SUM)
@example(FOUND_AUTO_DENSE_ONLY)
@example(FOUND_COMPILED_GQA_K_STRIDE0_S)
@example(FOUND_TILED_F32_DELTA)
def test_every_exact_method_differentiates_like_the_float64_naive_computation(c):
    _gradients_match(c)


def _gradients_match(c):
    """Every method the planner accepts (and auto): dq, dk, dv and a float mask's gradient."""
    # gradient oracle: autograd through _naive in float64 (plain torch ops, no attnlab kernel), on the
    # clean values; budget as for the output (GRAD_ERROR_FACTOR), against the naive computation's gradients
    # in the input dtype. Gradients are taken with respect to the row-major leaves the layouts were made from.
    auto, ok = _plans(Built(c), c)
    if auto is None:
        return
    gen = torch.Generator().manual_seed(c["seed"] + 1)
    gout = torch.randn(*c["lead"], c["H"], c["L"], c["Ev"], generator=gen, dtype=torch.float64)

    def grads(b: Built, out):
        wrt = [t for t in b.leaves if t is not None and t.requires_grad]
        g = torch.autograd.grad(out, wrt, gout.to(out.dtype), allow_unused=True)
        g = [torch.zeros_like(t) if d is None else d for t, d in zip(wrt, g)]
        return g + [None] * (4 - len(g))

    def oracle(dtype):
        b = Built(c, grad=True)
        cast = [t.to(dtype) if dtype is not None and t is not None and t.dtype != torch.bool else t for t in b.clean]
        return grads(b, b.naive(*cast)[0])

    ref, naive = oracle(torch.float64), oracle(None)
    fl = _delta_floor(Built(c), gout, c["dtype"])
    cf = _cast_floor(c, gout)
    for method in (*ok, "auto"):
        b = Built(c, grad=True)
        # auto plans the pass that runs: with inputs that require grad (the decode kernel, inference only, gives way)
        ran = attnlab.explain(b.q, b.k, b.v, **b.kw, method="auto", **b.run_kw).method if method == "auto" else method
        got = grads(b, attnlab.attention(b.q, b.k, b.v, **b.kw, method=method, **b.run_kw))
        floors = (fl[0], fl[1], None, fl[2]) if _o_rounded(ran, c["dtype"]) else (None,) * 4
        floors = tuple(a if b_ is None else b_ if a is None else a + b_ for a, b_ in zip(floors, (*cf, None)))
        for name, g, r, n, f in zip(("dq", "dk", "dv", "dmask"), got, ref, naive, floors):
            if r is None:
                continue
            _check(f"{method} ({ran}) {name} {_describe(c)}", g, r.double(), _err(n, r.double()), c["dtype"],
                   GRAD_ERROR_FACTOR, f)


@settings(max_examples=_examples(40), **SETTINGS)
@given(cases(dropout=True))
def test_auto_runs_whenever_an_explicit_method_runs_with_dropout(c):
    # dropout draws random weights, so there is no float64 answer to compare with: auto must run when any
    # explicit method does, and give exactly what the method it chose gives from the same RNG state
    b = Built(c)
    kw = dict(b.kw, dropout_p=c["dropout_p"])
    auto, ok = _plans(b, c, need_weights=c["need_weights"], dropout_p=c["dropout_p"])
    if auto is None:
        return
    outs = []
    for method in ("auto", auto.method):
        torch.manual_seed(c["seed"])
        outs.append(attnlab.attention(b.q, b.k, b.v, **kw, method=method, need_weights=c["need_weights"],
                                      **b.run_kw))
    for a, e in zip(*(o if c["need_weights"] else (o,) for o in outs)):
        assert torch.equal(a, e) and bool(a.isfinite().all()), f"auto ({auto.method}) {_describe(c)}"


# -- one layout at a time ---------------------------------------------------------------------------
def _one_layout_cases():
    """(id, case): each tensor in each kind of layout, the others row-major, so that a layout a kernel
    gets wrong fails by name whatever hypothesis draws. Shapes: GQA with a float mask (E = 4, Ev = 3; its dead
    keys make prepare copy k and v), no mask, and head dims of 1 (a size-1 last dim's stride is arbitrary)."""
    out = []
    for family, kw in (("gqa", dict(rank=4, lead=[2], H=2, Hkv=1, L=7, S=9, E=4, Ev=3, mask_kind="float",
                                    mask_shape="[*batch, H, L, S]")),
                       ("no mask", dict(rank=4, lead=[2], H=2, Hkv=2, L=7, S=9, E=4, Ev=3)),
                       ("head dim 1", dict(rank=4, lead=[2], H=2, Hkv=2, L=5, S=6, E=1, Ev=1))):
        shapes = {n: lay.shape for n, lay in _case(**kw)["layouts"].items() if lay is not None and n != "slopes"}
        for name, shape in shapes.items():
            n = len(shape)
            kinds = {f"expand dim {d - n}": Layout(shape, expanded=(d,)) for d in range(n) if shape[d] >= 2}
            kinds.update({"mT": Layout(shape, order=(*range(n - 2), n - 1, n - 2)),
                          "last dim ::2": Layout(shape, steps=(1,) * (n - 1) + (2,)),
                          "rows sliced from wider ones": Layout(shape, pads=(0,) * (n - 1) + (3,)),
                          "heads outermost": Layout(shape, order=(1, 0, *range(2, n))),
                          "offset": Layout(shape, offset=3)})
            if shape[-1] == 1:
                kinds["size-1 last dim, stride 7"] = Layout(shape, unit_strides=(None,) * (n - 1) + (7,))
            for kind, lay in kinds.items():
                for dtype in (torch.float64, torch.float32):
                    out.append(pytest.param(_case(**kw, dtype=dtype, layouts={name: lay}),
                                            id=f"{family}-{name}-{kind}-{str(dtype)[6:]}"))
    return out


@pytest.mark.parametrize("c", _one_layout_cases())
def test_each_layout_of_each_tensor(c):
    _outputs_match(c)
    _gradients_match(c)
