"""``explain`` on meta tensors (the CLI, the tour) gives the plan a real CPU call of those shapes runs
(issue 22 item 5): kernel, SDPA backend, block sizes, peak bytes and FLOPs, refusals."""
from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab import patterns as P
from attnlab import tour
from attnlab.cli import explain as cli_explain
from attnlab.positional import alibi_slopes


def _fields(plan):
    return (plan.method, plan.sdpa_backend, plan.block_size, plan.peak_bytes, plan.flops, plan.refused,
            plan.density, plan.notes)


def _tensors(shape, S, Hkv, dtype, device, grad=False):
    B, H, L, E = shape
    make = (lambda *s: torch.empty(*s, dtype=dtype, device="meta")) if device == "meta" else \
        (lambda *s: torch.randn(*s, dtype=torch.float32).to(dtype))
    q, k, v = make(B, H, L, E), make(B, Hkv, S, E), make(B, Hkv, S, E)
    if grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v


GRID = [
    ((1, 8, 2048, 64), {"is_causal": True}),
    ((1, 8, 2048, 64), {}),
    ((2, 4, 100, 32), {"is_causal": True, "S": 300}),  # dead suffix keys: the live view is cut
    ((2, 4, 333, 17), {"dtype": torch.bfloat16}),
    ((1, 4, 1024, 64), {"pattern": P.sliding_window(128)}),
    ((1, 4, 1024, 64), {"pattern": P.sliding_window(64, causal=True), "dtype": torch.bfloat16}),
    ((1, 4, 1024, 64), {"pattern": P.longformer(64, 2)}),
    ((2, 2, 512, 32), {"pattern": P.key_padding(torch.tensor([512, 300]))}),
    ((1, 2, 512, 64), {"pattern": P.fixed(64, 8)}),
    ((1, 8, 256, 64), {"enable_gqa": True, "Hkv": 2, "is_causal": True}),
    ((1, 8, 256, 64), {"alibi": True, "is_causal": True}),
    ((1, 8, 256, 64), {"softcap": 30.0}),
    ((1, 4, 256, 32), {"need_weights": True}),
    ((1, 4, 256, 32), {"dropout_p": 0.1}),
    ((1, 4, 256, 32), {"grad": True, "is_causal": True}),
    ((1, 4, 256, 32), {"grad": True, "pattern": P.sliding_window(32)}),
    ((1, 4, 256, 32), {"strict": True, "is_causal": True}),
    ((1, 4, 256, 32), {"method": "tiled", "block_size": 96}),
    ((1, 4, 0, 32), {}),
]


def _kwargs(opts, shape, device):
    kw = {k: v for k, v in opts.items() if k not in ("S", "Hkv", "dtype", "grad", "alibi")}
    if opts.get("alibi"):
        kw["alibi_slopes"] = alibi_slopes(shape[1]).to(device)
    return kw


@pytest.mark.parametrize("shape,opts", GRID, ids=lambda x: str(x) if isinstance(x, tuple) else None)
def test_meta_plan_equals_the_real_plan(shape, opts):
    S = opts.get("S", shape[2])
    Hkv, dtype, grad = opts.get("Hkv", shape[1]), opts.get("dtype", torch.float32), opts.get("grad", False)
    real = attnlab.explain(*_tensors(shape, S, Hkv, dtype, "cpu", grad), **_kwargs(opts, shape, "cpu"))
    meta = attnlab.explain(*_tensors(shape, S, Hkv, dtype, "meta", grad), **_kwargs(opts, shape, "meta"),
                           device="cpu")
    assert _fields(meta) == _fields(real)
    assert meta.assumptions == [] and real.assumptions == []


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
@pytest.mark.parametrize("mshape", [(256, 256), (1, 4, 1, 256), (2, 1, 256, 256)])
def test_meta_masks_plan_like_a_mask_that_keeps_everything(dtype, mshape):
    """A meta attn_mask has no values: the plan assumes no dead key and no empty block, says so, and equals
    the plan of a real mask that keeps every pair (the most work a mask of that shape can leave)."""
    q, k, v = _tensors((2, 4, 256, 32), 256, 4, torch.float32, "cpu")
    full = torch.ones(mshape, dtype=torch.bool) if dtype == torch.bool else torch.zeros(mshape)
    real = attnlab.explain(q, k, v, attn_mask=full)
    qm, km, vm = _tensors((2, 4, 256, 32), 256, 4, torch.float32, "meta")
    meta = attnlab.explain(qm, km, vm, attn_mask=torch.empty(mshape, dtype=dtype, device="meta"), device="cpu")
    assert _fields(meta) == _fields(real)
    assert len(meta.assumptions) == 1 and "no key is taken as dead" in meta.assumptions[0]
    assert "assumed: attn_mask holds no values" in str(meta)


@pytest.mark.parametrize("text,kw", [
    ("1,8,16384,64", {"is_causal": True}),
    ("1,8,4096,64", {"pattern": "sliding_window(256, causal=True)"}),
    ("1,8,1024,64", {"kv_heads": 2, "alibi": True}),
    ("2,4,512,32", {"kv_len": 1000, "is_causal": True, "dtype": torch.bfloat16}),
])
def test_cli_explain_equals_the_real_plan(text, kw):
    shape = tuple(int(x) for x in text.split(","))
    got = cli_explain.explain_shape(shape, **kw)["plan"]
    S = kw.get("kv_len", shape[2])
    Hkv = kw.get("kv_heads", shape[1])
    real_kw = {"is_causal": kw.get("is_causal", False), "enable_gqa": Hkv != shape[1]}
    if "pattern" in kw:
        real_kw["pattern"] = P.parse(kw["pattern"])
    if kw.get("alibi"):
        real_kw["alibi_slopes"] = alibi_slopes(shape[1])
    real = attnlab.explain(*_tensors(shape, S, Hkv, kw.get("dtype", torch.float32), "cpu"), **real_kw)
    assert _fields(got) == _fields(real)


def test_the_issue_s_causal_16384_is_flash_not_math():
    got = cli_explain.explain_shape((1, 8, 16384, 64), is_causal=True)["plan"]
    assert got.sdpa_backend != "math"
    assert got.method != "sdpa" or got.peak_bytes["sdpa"] < 2**30


@pytest.mark.parametrize("label,B,H,L,S,E,kw", tour.EXPLAIN_SHAPES)
def test_tour_shapes_plan_as_real_tensors(label, B, H, L, S, E, kw):
    kw = dict(kw)
    if kw.get("pattern") == "sliding_window":
        kw["pattern"] = P.sliding_window(128)
    meta = attnlab.explain(*(torch.empty(B, H, n, E, device="meta") for n in (L, S, S)), device="cpu", **kw)
    real = attnlab.explain(*(torch.zeros(B, H, n, E) for n in (L, S, S)), **kw)
    assert _fields(meta) == _fields(real)


def test_explain_says_when_the_estimates_rank_another_kernel_first():
    """A rule may choose by a measurement or a capability while the rows' FLOP-rate times rank another kernel first:
    the plan's text then says so, naming both; where the chosen kernel is also the estimates' first, it says
    nothing of the kind. Refused kernels are not ranked."""
    from attnlab.kernels.planner import Plan

    ranked = Plan(method="compiled", reason="measured faster [rule: a threshold]", rule="a threshold",
                  seconds={"sdpa": 0.239, "compiled": 0.291, "tiled": 0.4})
    line = [ln for ln in str(ranked).splitlines() if ln.startswith("estimates:")]
    assert line == ["estimates: the ≈ times (FLOPs over rates) rank sdpa first; the rule on the first line chose "
                    "compiled"]
    agree = Plan(method="sdpa", reason="fastest", rule="fastest", seconds={"sdpa": 0.239, "compiled": 0.291})
    refused = Plan(method="compiled", reason="only one", rule="r", seconds={"sdpa": 0.1, "compiled": 0.3},
                   refused={"sdpa": "cannot"})
    assert not any(ln.startswith("estimates:") for p in (agree, refused) for ln in str(p).splitlines())
    # a real plan renders, and its line (if any) names the kernel the plan chose
    q = torch.randn(1, 4, 64, 32)
    text = str(attnlab.explain(q, q, q))
    assert all(ln.endswith(f"chose {attnlab.explain(q, q, q).method}") for ln in text.splitlines()
               if ln.startswith("estimates:"))
