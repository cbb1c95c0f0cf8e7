"""A compact conformance check of attnlab's compiled kernel, run as a script in a subprocess under another
CPU configuration (``ATEN_CPU_CAPABILITY=avx2|default`` loads ``_C_avx2`` / ``_C``; ``ONEDNN_MAX_CPU_ISA``
caps oneDNN's brgemm), so that other CPUs' code paths run on this one (tests/kernels/test_compiled_backends.py).

For each dtype × mask × layout case: the output and the gradients of q, k, v (and of a float mask) against
float64 autograd, within FUSED_ERROR_FACTOR times the naive same-dtype computation's error plus a floor.
Prints one JSON line: the loaded capability, each dtype's forward back end, and every failure (empty when
all pass). ``--full`` runs the long sweep (more shapes and block sizes).
"""
from __future__ import annotations

import json
import math
import sys

import torch

import attnlab
from attnlab import patterns as P
from attnlab.kernels import compiled

#: tests/helpers.py's factor (PyTorch's rule for fused kernels), and per-dtype floors for rows where the
#: naive error happens to be ~0 (tests/kernels/test_compiled.py's FLOOR, ×10 for gradients)
FUSED_ERROR_FACTOR = 3.0
FLOOR = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 4e-3, torch.float16: 5e-4}
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def attn_ref(q, k, v, mask, scale):
    """softmax(q kᵀ·scale + mask) v in q's dtype (float32 softmax for half types), masked rows 0; GQA by
    repeating heads. The float64 oracle when given float64 tensors, the naive baseline otherwise."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-2, -1)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.to(s.dtype)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return torch.softmax(s.to(acc), -1).nan_to_num(0.0).to(q.dtype) @ v


def layout(t: torch.Tensor, kind: str) -> torch.Tensor:
    """The same values as t [N, H, T, D] under another memory layout: 'canonical', 'rows' (rows of a wider
    buffer, row stride > D), 'heads' (T before H in memory), or for a tensor whose T (or D) is 1 'odd': the
    size-1 dim's stride set as .mT leaves it (row stride 1, or last stride D)."""
    if kind == "canonical":
        return t.contiguous()
    if kind == "rows":
        return torch.cat([t, torch.zeros_like(t)], -1)[..., : t.shape[-1]]
    if kind == "heads":
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    if kind == "odd":
        N, H, T, D = t.shape
        if T == 1:
            return t.reshape(N, H, D, 1).mT  # row stride 1 < D: "contiguous" to PyTorch
        if D == 1:
            return t.reshape(N, H, 1, T).mT  # last stride T
    raise ValueError(kind)


def cases(full: bool):
    """(name, q, k, v, attn_mask, pattern, block) tuples: small shapes, awkward sizes."""
    shapes = [(2, 4, 2, 19, 23, 8, 6)] + ([(1, 2, 1, 70, 91, 16, 16), (2, 2, 2, 5, 130, 4, 4)] if full else [])
    for N, H, Hkv, L, S, E, Ev in shapes:
        g = torch.Generator().manual_seed(L * S)
        q = torch.randn(N, H, L, E, generator=g)
        k = torch.randn(N, Hkv, S, E, generator=g)
        v = torch.randn(N, Hkv, S, Ev, generator=g)
        keep = torch.rand(N, 1, L, S, generator=g) < 0.7
        bias = torch.randn(L, S, generator=g)
        for lay in ("canonical", "rows", "heads"):
            qq, kk, vv = (layout(t, lay) for t in (q, k, v))
            yield f"{lay} dense", qq, kk, vv, None, None, 16
            yield f"{lay} causal", qq, kk, vv, None, P.causal("bottom_right"), 16
            yield f"{lay} window+bool", qq, kk, vv, keep, P.sliding_window(5), 16
            yield f"{lay} float mask", qq, kk, vv, bias, None, 16
        # a key broadcast along S (stride 0) and a single query row from .mT
        yield "expand S", q, k[:, :, :1].expand(N, Hkv, S, E), v[:, :, :1].expand(N, Hkv, S, Ev), None, P.causal(), 16
        yield "mT row", layout(q[:, :, :1], "odd"), k, v, None, None, 16
        yield "Ev=1 mT", q, k, layout(v[..., :1], "odd"), None, P.causal(), 16
        if full:
            for block in (8, 24, 64):
                yield f"block {block}", q, k, v, keep, P.causal(), block


def check(dtype: torch.dtype, full: bool = False) -> list[str]:
    """Every case in dtype: forward and gradients against float64; returns the failures."""
    bad = []
    for name, q, k, v, mask, pattern, block in cases(full):
        fm = mask is not None and mask.dtype != torch.bool
        ins = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        if fm:  # a learned mask in the accumulation dtype (its gradient's dtype)
            mask = mask.to(acc)
        m = mask.detach().requires_grad_() if fm else mask
        out = attnlab.attention(*ins, attn_mask=m, pattern=pattern, enable_gqa=True, method="compiled",
                                block_size=block)
        do = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
        got = torch.autograd.grad(out, ins + ([m] if fm else []), do)
        full_mask = mask
        if pattern is not None:
            pm = pattern.materialize(q.shape[2], k.shape[2])
            full_mask = pm if mask is None else (mask & pm)
        scale = 1 / math.sqrt(q.shape[-1])

        def ref(dt):
            t = [x.detach().to(dt).requires_grad_() for x in (q, k, v)]
            mm = mask.detach().to(torch.float64 if dt == torch.float64 else acc).requires_grad_() if fm else full_mask
            o = attn_ref(*t, mm, scale)
            return (o,) + torch.autograd.grad(o, t + ([mm] if fm else []), do.to(dt))
        r64, naive = ref(torch.float64), ref(dtype)
        for what, g, r, n in zip(("out", "dq", "dk", "dv", "dmask"), (out,) + got, r64, naive):
            g, r, n = g.detach(), r.detach(), n.detach()
            err = float((g.double() - r.double()).abs().max())
            bound = FUSED_ERROR_FACTOR * float((n.double() - r.double()).abs().max()) + FLOOR[dtype] * (
                1 if what == "out" else 10)
            if not err <= bound:
                bad.append(f"{dtype} {name} {what}: {err:.3g} > {bound:.3g}")
    return bad


def check_relative(dtype: torch.dtype) -> list[str]:
    """A relative bias table rel [H, L + S - 1] (``compiled_attention(rel_bias=...)``, csrc Note [Relative
    bias]) under no pattern, a bottom-right causal one and a window, GQA, blocks of 16: output and the
    gradients of q, k, v and rel against float64 autograd through the table's gather; returns the failures."""
    from attnlab.kernels.masks import MaskSpec

    bad = []
    N, H, Hkv, L, S, E, Ev = 2, 4, 2, 19, 23, 8, 6
    g = torch.Generator().manual_seed(7)
    base = [torch.randn(N, H, L, E, generator=g), torch.randn(N, Hkv, S, E, generator=g),
            torch.randn(N, Hkv, S, Ev, generator=g), torch.randn(H, L + S - 1, generator=g)]
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    offset = torch.arange(S).view(1, -1) - torch.arange(L).view(-1, 1) + L - 1  # (L, S): j - i + L - 1
    scale = 1 / math.sqrt(E)
    for pname, pattern in (("dense", None), ("causal", P.causal("bottom_right")), ("window", P.sliding_window(5))):
        ins = [t.to(dtype).requires_grad_() for t in base[:3]] + [base[3].to(acc).requires_grad_()]
        out, _ = compiled.compiled_attention(*ins[:3], MaskSpec(L, S, pattern=pattern), scale, 16, 16,
                                             rel_bias=ins[3])
        do = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
        got = torch.autograd.grad(out, ins, do)
        keep = pattern.materialize(L, S) if pattern is not None else torch.ones(L, S, dtype=torch.bool)

        def ref(dt):
            t = [x.detach().to(dt).requires_grad_() for x in base[:3]]
            rel = base[3].detach().to(torch.float64 if dt == torch.float64 else acc).requires_grad_()
            o = attn_ref(*t, rel[:, offset].masked_fill(~keep, float("-inf")), scale)  # bias (H, L, S)
            return (o,) + torch.autograd.grad(o, t + [rel], do.to(dt))
        r64, naive = ref(torch.float64), ref(dtype)
        for what, gg, r, n in zip(("out", "dq", "dk", "dv", "drel"), (out,) + got, r64, naive):
            gg, r, n = gg.detach(), r.detach(), n.detach()
            err = float((gg.detach().double() - r.double()).abs().max())
            bound = FUSED_ERROR_FACTOR * float((n.double() - r.double()).abs().max()) + FLOOR[dtype] * (
                1 if what == "out" else 10)
            if not err <= bound:
                bad.append(f"{dtype} relative bias {pname} {what}: {err:.3g} > {bound:.3g}")
    return bad


def main(argv: list[str]) -> int:
    full = "--full" in argv
    torch.manual_seed(0)
    report = {"capability": compiled.capability(),
              "backends": {str(d): compiled.gemm_backend(d, 8, 6, 16) for d in DTYPES}, "failures": []}
    for dtype in DTYPES:
        report["failures"] += check(dtype, full) + check_relative(dtype)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
