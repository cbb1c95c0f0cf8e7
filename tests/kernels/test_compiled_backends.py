"""The compiled kernel on every layout and every tile back end (issue 21).

Layouts: strides the tile products cannot take are copied to canonical ones (kernels/compiled.py Note
[Operand strides]); the C++ refuses them itself and checks each product's arguments (csrc Note [Gemm
arguments]), so MKL never prints or skips. Back ends: ``ATTNLAB_EXT_GEMM`` = brgemm / mkl / loop each run
the conformance matrix (tests/kernels/compiled_check.py) that the machine can run, and subprocesses load
the AVX2 and baseline builds and cap oneDNN's ISA, so other CPUs' paths run here too. Also: block sizes
clipped to the sequence, empty head dims, and torch.func (vmap over the backward, gradcheck's batched
gradients). Tolerances: the fused-kernel rule of tests/helpers.py (FUSED_ERROR_FACTOR times the naive
same-dtype error against float64, plus a floor).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import attnlab
from attnlab import cpu
from attnlab import patterns as P
from attnlab.kernels import compiled
from attnlab.kernels.masks import MaskSpec
from helpers import FUSED_ERROR_FACTOR, TOL, assert_close, max_err

import compiled_check

pytestmark = pytest.mark.skipif(not compiled.available(), reason=f"compiled kernel: {compiled.unavailable_reason()}")

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _sdpa(q, k, v, mask=None, **kw):
    """PyTorch's SDPA (math backend) in float64, masked rows 0."""
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, **kw).nan_to_num(0.0)


def _bound(got, ref64, naive, dtype, grad=False):
    return FUSED_ERROR_FACTOR * max_err(naive, ref64) + compiled_check.FLOOR[dtype] * (10 if grad else 1)


# -- issue 21's layout reproducers ------------------------------------------------------------------
def _layout_cases():
    """(name, q, k, v, mask, kwargs) whose strides the tile products cannot take as they are."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 4, 8, generator=g, dtype=torch.float64)
    kv = torch.randn(1, 1, 1, 8, generator=g, dtype=torch.float64).expand(1, 1, 4, 8)  # row stride 0
    v = torch.randn(1, 1, 1, 8, generator=g, dtype=torch.float64).expand(1, 1, 4, 8)
    tril = torch.ones(4, 4, dtype=torch.bool).tril()
    yield "expand S (issue)", q, kv, v, tril, {}
    yield "expand L", q[:, :, :1].expand(1, 1, 4, 8), kv.contiguous(), kv.contiguous() * 2, tril, {}
    row = torch.randn(1, 2, 8, 1, generator=g, dtype=torch.float64).mT  # [1, 2, 1, 8], row stride 1
    k = torch.randn(1, 2, 6, 8, generator=g, dtype=torch.float64)
    yield "mT single query", row, k, k.flip(2), None, {}
    yield "mT single key", q.expand(1, 2, 4, 8), row, row * 3, None, {}
    v1 = torch.randn(1, 1, 1, 8, generator=g, dtype=torch.float64).mT  # [1, 1, 8, 1], last stride 8
    qk = torch.randn(1, 1, 8, 4, generator=g, dtype=torch.float64)
    yield "Ev=1 last stride 8 (issue)", qk, qk.flip(2), v1, None, {"is_causal": True}
    e1 = torch.randn(1, 1, 1, 8, generator=g, dtype=torch.float64).mT  # E = 1, last stride 8
    yield "E=1 last stride 8", e1, e1.flip(2), torch.randn(1, 1, 8, 3, generator=g, dtype=torch.float64), None, \
        {"is_causal": True}


@pytest.mark.parametrize("gemm", ["auto", "mkl", "loop"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_layouts_the_products_cannot_take_are_copied(dtype, gemm, monkeypatch):
    """issue 21 defects 1 and 2: a row stride below the row (expand along L or S, one row from .mT) made
    MKL refuse the product and the kernel use stale scratch (off by 1.5 on the issue's reproducer); E or
    Ev = 1 with a last stride > 1 was refused. Outputs and gradients match SDPA / float64 autograd."""
    monkeypatch.setenv("ATTNLAB_EXT_GEMM", gemm)
    for name, q, k, v, mask, kw in _layout_cases():
        ins = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]  # the layouts kept
        out = attnlab.attention(*ins, attn_mask=mask, method="compiled", **kw)
        assert out.dtype == dtype
        do = torch.ones_like(out)
        got = torch.autograd.grad(out, ins, do)
        d64 = [t.detach().double().requires_grad_() for t in ins]
        ref = _sdpa(*d64, mask, **kw)
        refg = torch.autograd.grad(ref, d64, do.double())
        low = [t.detach().requires_grad_() for t in ins]  # the naive same-dtype computation
        L, S = q.shape[2], k.shape[2]
        full = torch.ones(L, S, dtype=torch.bool).tril() if kw.get("is_causal") else mask
        naive = compiled_check.attn_ref(*low, full, q.shape[-1] ** -0.5)
        naiveg = torch.autograd.grad(naive, low, do)
        out, naive, ref = out.detach(), naive.detach(), ref.detach()
        assert max_err(out, ref) <= _bound(out, ref, naive, dtype), f"{name} {dtype} {gemm}: out {max_err(out, ref):.3g}"
        for w, g_, r, n in zip("qkv", got, refg, naiveg):
            assert g_.shape == r.shape
            assert max_err(g_, r) <= _bound(g_, r, n, dtype, grad=True), f"{name} {dtype} {gemm}: d{w}"


def test_the_issue_reproducer_prints_nothing():
    """MKL's "Intel oneMKL ERROR: Parameter N was incorrect" went to stdout (fd 1, below Python's sys.stdout):
    every layout reproducer, forward and backward, on every back end, in a subprocess whose fds 1 and 2 are
    captured, prints nothing but the script's own line."""
    code = ("import os, torch, attnlab, test_compiled_backends as t\n"
            "for gemm in ('auto', 'mkl', 'loop'):\n"
            "    os.environ['ATTNLAB_EXT_GEMM'] = gemm\n"
            "    for dt in (torch.float64, torch.float32, torch.bfloat16, torch.float16):\n"
            "        for name, q, k, v, m, kw in t._layout_cases():\n"
            "            ins = [x.to(dt).requires_grad_() for x in (q, k, v)]\n"
            "            attnlab.attention(*ins, attn_mask=m, method='compiled', **kw).sum().backward()\n"
            "print('done')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), str(HERE), str(HERE.parent)]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "done\n" and r.stderr == "", (r.stdout[-2000:], r.stderr[-2000:])


def test_extension_refuses_strides_it_cannot_take():
    """The C++ refuses (a RuntimeError naming the tensor and its strides) what the wrapper would have copied,
    rather than handing MKL a leading dim below the row."""
    ext = compiled._load()
    q = torch.randn(1, 1, 4, 8)
    kv = torch.randn(1, 1, 1, 8).expand(1, 1, 4, 8)
    lay = compiled.build_layout(MaskSpec(4, 4), 16, 16)
    with pytest.raises(RuntimeError, match=r"attnlab._C: k \[1, 1, 4, 8\] has strides \[8, 8, 0, 1\]"):
        ext.forward(q, kv, kv, *lay.tensors, None, None, None, None, 0.3, 0.0, False, 0, 16, 16, 1, False)
    with pytest.raises(RuntimeError, match="attnlab._C: q .* strides"):
        ext.forward(torch.randn(1, 1, 8, 1).mT, q, q, *compiled.build_layout(MaskSpec(1, 4), 16, 16).tensors,
                    None, None, None, None, 0.3, 0.0, False, 0, 16, 16, 1, False)
    with pytest.raises(RuntimeError, match="gemm must be"):
        ext.forward(q, q, q, *lay.tensors, None, None, None, None, 0.3, 0.0, False, 0, 16, 16, 7, False)
    out, lse, _, lse_lo = ext.forward(q, q, q, *lay.tensors, None, None, None, None, 0.3, 0.0, False, 0, 16, 16, 1, False)
    with pytest.raises(RuntimeError, match="dout .* must be a contiguous"):
        ext.backward(torch.ones(()).expand(1, 1, 4, 8), q, q, q, out, lse, lse_lo, *lay.tensors, None, None, None,
                     None, 0.3, 0.0, False, 0, 16, 16, 1, 1, False, False, 1)


@pytest.mark.parametrize("kind", ["keep", "bias"])
def test_masks_are_read_through_any_strides(kind):
    """Bool keep and float bias tensors are read through their strides (a transposed, a sliced and a
    broadcast one), forward and (bias) gradient."""
    torch.manual_seed(2)
    q, k, v = (torch.randn(2, 3, 21, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    base = torch.randn(2, 3, 21, 42, dtype=torch.float64)[..., ::2].mT.mT  # key stride 2
    m = (base > -0.5) if kind == "keep" else base.requires_grad_()
    for mask in (m, m.mT.contiguous().mT, m[:, :1], m[:1, :, :1]):
        ins = (q, k, v) + ((mask,) if kind == "bias" else ())
        out = attnlab.attention(q, k, v, attn_mask=mask, method="compiled", block_size=8)
        ref = _sdpa(q, k, v, mask)
        assert_close(out, ref, **TOL[torch.float64], what=f"{kind} {tuple(mask.stride())}")
        got = torch.autograd.grad(out.sum(), ins)
        want = torch.autograd.grad(ref.sum(), ins)
        for g_, w in zip(got, want):
            assert_close(g_, w, **TOL[torch.float64], what=f"{kind} grad")


# -- block sizes, empty head dims, torch.func -------------------------------------------------------
def test_block_size_is_clipped_to_the_sequence():
    """issue 21 defect 9: block_size=12000 on a 16×16 input took 1.7 GB of scratch and 10**5 tried 80 GB; the
    compiled tiling is clipped to the sequence rounded up to 16, in explain, attention and attention_with_lse."""
    x = torch.randn(1, 2, 16, 8)
    for bs in (12000, 10 ** 5):
        plan = attnlab.explain(x, x, x, pattern=P.causal(), method="compiled", block_size=bs)
        assert plan.block_size == (16, 16)
        assert plan.peak_bytes["compiled"] < 2 ** 24
        out = attnlab.attention(x, x, x, pattern=P.causal(), method="compiled", block_size=bs)
        assert_close(out, _sdpa(x, x, x, is_causal=True), **TOL[torch.float32], what=f"block {bs}")
        o2, _ = attnlab.attention_with_lse(x, x, x, pattern=P.causal(), block_size=bs)
        assert_close(o2, out, **TOL[torch.float32], what="with lse")
    assert compiled.clip_blocks(10 ** 5, 10 ** 5, 16, 33) == (16, 48)
    assert compiled.clip_blocks(64, 32, 1000, 1000) == (64, 32)
    assert compiled.clip_blocks(64, 64, 1, 1) == (16, 16)
    out, _ = compiled.compiled_attention(x, x, x, MaskSpec(16, 16), 0.3, 10 ** 5, 10 ** 5)  # direct callers too
    assert_close(out, _sdpa(x, x, x, scale=0.3), **TOL[torch.float32], what="direct")


@pytest.mark.parametrize("E, Ev", [(0, 5), (6, 0), (0, 0)])
def test_empty_head_dims(E, Ev):
    """issue 21 defect 10: E = 0 or Ev = 0 raised std::bad_alloc. E = 0: every score is 0, a uniform softmax
    over the kept keys (plus the float mask / ALiBi); Ev = 0: out [N, H, L, 0], lse still the scores'."""
    torch.manual_seed(4)
    q = torch.randn(2, 2, 9, E, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 11, E, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 11, Ev, dtype=torch.float64, requires_grad=True)
    keep = torch.rand(9, 11) < 0.6
    bias = torch.randn(9, 11, dtype=torch.float64)
    slopes = torch.tensor([0.5, 0.25])
    for kw in ({}, {"is_causal": True}, {"attn_mask": keep}, {"attn_mask": bias}, {"alibi_slopes": slopes},
               {"pattern": P.sliding_window(3)}):
        out = attnlab.attention(q, k, v, method="compiled", **kw)
        dense = attnlab.attention(q, k, v, method="dense", **kw)
        assert out.shape == (2, 2, 9, Ev)
        assert_close(out, dense, **TOL[torch.float64], what=f"E={E} Ev={Ev} {list(kw)}")
        if "alibi_slopes" not in kw and "pattern" not in kw:
            assert_close(out, _sdpa(q, k, v, kw.get("attn_mask"), is_causal=kw.get("is_causal", False)),
                         **TOL[torch.float64], what="sdpa")
        if Ev:
            grads = torch.autograd.grad(out.sum(), (q, k, v))
            want = torch.autograd.grad(dense.sum(), (q, k, v))
            for g_, w in zip(grads, want):
                assert g_.shape == w.shape
                assert_close(g_, w, **TOL[torch.float64], what="grad")
    _, lse = attnlab.attention_with_lse(q, k, v, attn_mask=bias)
    s = (q.detach() @ k.detach().mT) / max(E, 1) ** 0.5 + bias
    assert_close(lse, torch.logsumexp(s, -1), **TOL[torch.float64], what="lse")


def test_gradcheck_batched_grad():
    """issue 21 defect 17: gradcheck's batched gradients (torch.func.vmap over the backward) failed with
    "Cannot access data pointer of Tensor that doesn't have storage"; tiled passed."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    assert torch.autograd.gradcheck(lambda q, k, v: attnlab.attention(q, k, v, method="compiled"), (q, k, v),
                                    check_batched_grad=True)
    bias = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v, b: attnlab.attention(q, k, v, attn_mask=b, pattern=P.causal(), method="compiled",
                                             block_size=4), (q, k, v, bias), check_batched_grad=True)


def test_vmap_over_forward_and_backward_matches_a_loop():
    """torch.func.vmap over the compiled forward and over its backward (torch.autograd.grad of a vmapped
    gradient: the dispatcher op's vmap rule): one call per slice, the same as looping by hand. grad / vjp
    transforms are refused with a clear error (they would wrap the layout's tensors)."""
    torch.manual_seed(1)
    qs = torch.randn(3, 1, 2, 20, 4)  # over the decode path's 16 queries: the tile kernel both ways
    k, v = torch.randn(1, 2, 22, 4), torch.randn(1, 2, 22, 4)

    def f(q):
        return attnlab.attention(q, k, v, pattern=P.sliding_window(3), method="compiled", block_size=8)
    got = torch.func.vmap(f)(qs)
    want = torch.stack([f(q) for q in qs])
    assert torch.equal(got, want)
    got_f0 = want[0]
    q = qs[0].clone().requires_grad_()
    out = f(q)
    dos = torch.randn(3, 1, 2, 20, 4)
    got = torch.func.vmap(lambda do: torch.autograd.grad(out, q, do, retain_graph=True)[0])(dos)
    want = torch.stack([torch.autograd.grad(out, q, do, retain_graph=True)[0] for do in dos])
    assert_close(got, want, atol=1e-6, rtol=1e-6, what="vmap over the backward")
    with pytest.raises(RuntimeError, match="torch.func.grad"):
        torch.func.vjp(f, qs[0])
    compiled._CACHE.clear()  # the layout built inside the transform next is not cached (its tensors are wrapped)
    with pytest.raises(RuntimeError, match="torch.func.grad"):
        torch.func.grad(lambda x: torch.func.vmap(f)(x).sum())(qs)
    assert torch.equal(f(qs[0]), got_f0)


def test_double_backward_is_refused():
    q, k, v = (torch.randn(1, 1, 5, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    dq, = torch.autograd.grad(attnlab.attention(q, k, v, method="compiled").sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="not differentiable"):
        dq.sum().backward()


# -- back ends --------------------------------------------------------------------------------------
def test_gemm_setting_and_backend_report(monkeypatch):
    """ATTNLAB_EXT_GEMM: each value says which back end runs (gemm_backend); an unknown one is an error that
    lists the valid values, raised before any work."""
    for setting in compiled.GEMM_SETTINGS:
        monkeypatch.setenv("ATTNLAB_EXT_GEMM", setting)
        assert compiled.gemm_setting() == setting
        for dt in DTYPES:
            b = compiled.gemm_backend(dt, 8, 8, 16)
            assert b in ("brgemm", "mkl", "loop", "fp32")
            half = dt in (torch.bfloat16, torch.float16)
            assert (b == "fp32") == (half and (setting == "fp32" or (setting == "auto" and not compiled.half_dot(dt))))
            if setting == "loop":
                assert b == "loop"
            if setting == "mkl":
                assert b == ("mkl" if compiled.has_fast_gemm(dt) else "loop")
            if dt == torch.float64 or setting in ("mkl", "loop"):
                assert b != "brgemm"
            if setting in ("auto", "brgemm", "fp32") and compiled.capability() == "AVX512" and dt == torch.float32:
                assert b == "brgemm"
    monkeypatch.setenv("ATTNLAB_EXT_GEMM", "brgemm")
    lay = compiled.build_layout(MaskSpec(300, 300), 128, 128)  # fp32 tiles over 64x64: auto's backward is MKL
    assert compiled.gemm_backend(torch.float32, 8, 8, 128, backward=True, layout=lay) == \
        compiled.gemm_backend(torch.float32, 8, 8, 128)
    monkeypatch.setenv("ATTNLAB_EXT_GEMM", "auto")
    assert compiled.gemm_backend(torch.float32, 8, 8, 128, backward=True, layout=lay) != "brgemm"
    with pytest.raises(ValueError, match="layout"):
        compiled.gemm_backend(torch.float32, 8, 8, 128, backward=True)
    monkeypatch.setenv("ATTNLAB_EXT_GEMM", "openblas")
    with pytest.raises(ValueError, match="ATTNLAB_EXT_GEMM must be one of auto, brgemm, mkl, loop, fp32.*'openblas'"):
        compiled.gemm_setting()
    x = torch.randn(1, 1, 32, 8)  # over the decode path's 16 queries: the tile kernel, which reads the setting
    with pytest.raises(ValueError, match="ATTNLAB_EXT_GEMM"):
        attnlab.attention(x, x, x, pattern=P.causal(), method="compiled")


def test_half_tiles_take_the_cpus_dot_product(monkeypatch):
    """issue 22 item 4: on a CPU with AVX512-BF16 but no AMX the bf16 tiles ran on MKL's cblas_gemm_bf16bf16f32
    (brgemm waited for cpublas::could_pack, which is AMX only): half the kernel's own fp32 speed. oneDNN's
    avx512_core_bf16 brgemm takes them now (csrc Note [Half-type brgemm without AMX]); a half dtype without its
    dot product in hardware runs as fp32 tiles. The oracle: the CPU's flags as /proc/cpuinfo lists them."""
    if compiled.capability() != "AVX512" or cpu.INFO.flags is None or os.environ.get("ONEDNN_MAX_CPU_ISA"):
        pytest.skip("needs the AVX-512 build, readable CPU flags and oneDNN's ISA uncapped")
    bf16 = bool(cpu.INFO.has("avx512_bf16") or cpu.INFO.has("amx_bf16"))
    fp16 = bool(cpu.INFO.has("avx512_fp16") or cpu.INFO.has("amx_fp16"))
    amx = {torch.bfloat16: bool(cpu.INFO.has("amx_bf16")), torch.float16: bool(cpu.INFO.has("amx_fp16"))}
    for dt, has in ((torch.bfloat16, bf16), (torch.float16, fp16)):
        assert compiled.half_dot(dt) == (("amx" if amx[dt] else "avx512") if has else None), dt
    monkeypatch.setenv("ATTNLAB_EXT_GEMM", "auto")
    assert compiled.gemm_backend(torch.bfloat16, 64, 64, 512) == ("brgemm" if bf16 else "fp32")
    assert compiled.gemm_backend(torch.bfloat16, 63, 64, 512) == ("mkl" if bf16 else "fp32")  # odd E: no VNNI pairs
    if not fp16:
        assert compiled.gemm_backend(torch.float16, 64, 64, 512) == "fp32"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_types_without_a_dot_product_run_as_fp32_tiles(dtype, monkeypatch):
    """A CPU without the half dtype's dot product (AVX2-only; fp16 without AVX512-FP16 / AMX-FP16; here by
    pretending): auto converts q, k, v once and runs the fp32 kernel (csrc Note [Half-type dot products]),
    exactly the fp32 kernel on the converted inputs rounded once, forward and gradients, as
    ATTNLAB_EXT_GEMM=fp32 forces; explain says so in one line and counts the copies in the peak."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, 37, 8, generator=g).to(dtype).requires_grad_() for _ in range(3))
    do = torch.randn(2, 3, 37, 8, generator=g).to(dtype)
    pat = P.sliding_window(9)

    def run(*ins):
        out = attnlab.attention(*ins, pattern=pat, method="compiled", block_size=16)
        return (out,) + torch.autograd.grad(out, ins, do.to(out.dtype))
    monkeypatch.setenv("ATTNLAB_EXT_GEMM", "auto")
    monkeypatch.setattr(compiled, "half_dot", lambda dt: "avx512")
    plain = attnlab.explain(q, k, v, pattern=pat, method="compiled", block_size=16)
    monkeypatch.setattr(compiled, "half_dot", lambda dt: None)
    assert compiled.gemm_backend(dtype, 8, 8, 16) == "fp32"
    plan = attnlab.explain(q, k, v, pattern=pat, method="compiled", block_size=16)
    name = str(dtype).replace("torch.", "")
    assert f"{name} runs as fp32 tiles, no {name} dot product on this CPU" in plan.notes["compiled"]
    assert "runs as fp32 tiles" in str(plan) and "runs as fp32 tiles" not in plain.notes.get("compiled", "")
    assert plan.peak_bytes["compiled"] - plain.peak_bytes["compiled"] == 4 * 2 * (2 * 3 * 37 * (8 + 8))  # q, out; k, v
    got = run(q, k, v)
    want = run(*(t.detach().float().requires_grad_() for t in (q, k, v)))
    for w, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.dtype == dtype and torch.equal(a, b.to(dtype)), w
    monkeypatch.undo()
    monkeypatch.setenv("ATTNLAB_EXT_GEMM", "fp32")
    assert compiled.gemm_backend(dtype, 8, 8, 16) == "fp32"
    assert "ATTNLAB_EXT_GEMM=fp32" in attnlab.explain(q, k, v, pattern=pat, method="compiled").notes["compiled"]
    for w, a, b in zip(("out", "dq", "dk", "dv"), run(q, k, v), got):
        assert torch.equal(a, b), w


def test_serial_conversion_equals_torchs():
    """csrc Note [Serial conversion]: the extension's one-thread conversion (for half types run as fp32 tiles)
    gives exactly Tensor.to's values, contiguous, for every pair of fp32 / bf16 / fp16 and any strides."""
    ext = compiled._load()
    dts = (torch.float32, torch.bfloat16, torch.float16)
    for src in dts:
        x = (torch.randn(2, 3, 17, 9) * 300).to(src)
        x[0, 0, 0, :3] = torch.tensor([float("inf"), float("nan"), -0.0])
        for y in (x, x.transpose(1, 2), x[..., ::2], x.mT, x[:, :1].expand(2, 5, 17, 9), x[0, 0, 0, 0]):
            for dst in dts:
                got = ext.convert(y, str(dst).replace("torch.", ""))
                assert got.is_contiguous() and got.dtype == dst
                assert torch.equal(got.nan_to_num(7.0), y.to(dst).nan_to_num(7.0)), (src, dst, y.stride())
                assert torch.equal(got.isnan(), y.to(dst).isnan())
    with pytest.raises(RuntimeError, match="convert takes"):
        ext.convert(torch.ones(3, dtype=torch.float64), "float32")


def test_half_brgemm_probe_under_a_capped_onednn():
    """Where oneDNN has no bf16 brgemm kernel (its ISA capped at AVX512_CORE: "could not generate a kernel";
    at AVX2 torch refuses), the extension's one-time probe says so and bf16 runs off brgemm, with no error and
    nothing printed; at AVX512_CORE_BF16 it takes brgemm on a CPU with AVX512-BF16."""
    if compiled.capability() != "AVX512":
        pytest.skip("brgemm runs in the AVX-512 build only")
    code = ("import torch, attnlab\n"
            "from attnlab.kernels import compiled\n"
            "q = torch.randn(1, 2, 40, 8).bfloat16().requires_grad_()\n"
            "attnlab.attention(q, q, q, is_causal=True, method='compiled').sum().backward()\n"
            "print(compiled.gemm_backend(torch.bfloat16, 8, 8, 16), bool(torch.isfinite(q.grad).all()))\n")
    amx = bool(cpu.INFO.has("amx_bf16"))
    for isa, want in (("AVX512_CORE", None if amx else "mkl"), ("AVX2", None if amx else "mkl"),
                      ("AVX512_CORE_BF16", "brgemm" if cpu.INFO.has("avx512_bf16") else None)):
        env = dict(os.environ, PYTHONPATH=str(SRC), ONEDNN_MAX_CPU_ISA=isa)
        env.pop("ATTNLAB_EXT_GEMM", None)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0 and r.stderr == "", (isa, r.stderr[-2000:])
        backend, finite = r.stdout.split()
        assert finite == "True", isa
        if want is not None and compiled.half_dot(torch.bfloat16):
            assert backend == want, (isa, backend)


@pytest.mark.parametrize("gemm", ["brgemm", "mkl", "loop", "fp32"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_conformance_on_each_backend(gemm, dtype, monkeypatch):
    """The compact conformance matrix (compiled_check: dense, causal, window + bool mask, learned float mask ×
    canonical, strided-row and head-major layouts, broadcast keys, a .mT row, Ev = 1) with every product on
    one back end, outputs and gradients against float64 autograd. Skipped where this machine cannot run that
    back end for the dtype (brgemm for fp64; for half types without AMX or AVX512-BF16; fp32, the half types
    converted to fp32 tiles, for fp32 and fp64)."""
    monkeypatch.setenv("ATTNLAB_EXT_GEMM", gemm)
    if compiled.gemm_backend(dtype, 8, 6, 16) != gemm:
        pytest.skip(f"{dtype} tiles run on {compiled.gemm_backend(dtype, 8, 6, 16)} here, not {gemm}")
    bad = compiled_check.check(dtype) + compiled_check.check_relative(dtype)
    assert not bad, "\n".join(bad)


@pytest.mark.slow
@pytest.mark.parametrize("gemm", ["auto", "brgemm", "mkl", "loop", "fp32"])
def test_conformance_long_sweep(gemm, monkeypatch):
    """compiled_check --full (more shapes, block sizes 8 / 24 / 64) on each back end, every dtype."""
    monkeypatch.setenv("ATTNLAB_EXT_GEMM", gemm)
    bad = [b for dt in DTYPES for b in compiled_check.check(dt, full=True)]
    assert not bad, "\n".join(bad)


def _run_check(env_extra: dict, *args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), str(HERE)]), **env_extra)
    env.pop("ATTNLAB_EXT_GEMM", None)
    r = subprocess.run([sys.executable, str(HERE / "compiled_check.py"), *args], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr == "", r.stderr[-3000:]  # nothing from MKL or oneDNN
    lines = r.stdout.splitlines()
    assert len(lines) == 1, r.stdout[-3000:]
    return json.loads(lines[0])


@pytest.mark.parametrize("env, capability", [
    ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, None),
    ({"ONEDNN_MAX_CPU_ISA": "AVX2"}, None),
    ({"ATEN_CPU_CAPABILITY": "avx2"}, "AVX2"),
    ({"ATEN_CPU_CAPABILITY": "default"}, "DEFAULT"),
], ids=lambda x: ",".join(f"{k}={v}" for k, v in x.items()) if isinstance(x, dict) else str(x))
def test_other_cpu_paths_in_subprocesses(env, capability):
    """Other CPUs' paths on this one: oneDNN's brgemm capped at AVX512_CORE_BF16 or AVX2, and attnlab's AVX2
    (_C_avx2) and baseline (_C) builds, which have no brgemm, through the compact conformance check."""
    if capability is not None:
        probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                               capture_output=True, text=True, env=dict(os.environ, **env), timeout=120)
        if probe.stdout.strip() != capability:
            pytest.skip(f"this CPU / torch cannot run {env}: torch reports {probe.stdout.strip()}")
    report = _run_check(env)
    assert capability is None or report["capability"] == capability
    if capability is not None:  # no brgemm outside AVX-512 builds
        assert "brgemm" not in report["backends"].values(), report
    assert not report["failures"], "\n".join(report["failures"])
