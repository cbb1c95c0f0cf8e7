"""Exact tiled attention: online softmax over key blocks, backward by recomputation.

Forward keeps, per query block, a running max m, denominator l and accumulator o, and visits only
the key blocks the mask layout marks non-empty (FULL blocks need no mask). It saves only the output
and the log-sum-exp, so training memory is O(L·(E + Ev)) plus one block of scores, not O(L·S).

Note [Online softmax rescaling]: when a new key block raises the running max from m to m', the old
denominator and accumulator are multiplied by exp(m - m'); with m = -inf (nothing seen yet) that
factor is 0, and a row that never sees a kept key keeps l = 0, giving output 0 and lse = -inf.

Works on any device with plain tensor ops; computes in float32 for half types.
"""
from __future__ import annotations

import torch

from .. import patterns as P
from . import fused as _fused
from .lse import acc_dtype as _acc_dtype
from .lse import merge as _merge
from .lse import sink_scale
from .dense import repeat_heads
from .masks import MaskSpec
from .kernel import Kernel, dead_per_head, masked_tiling
from .spec import KernelSpec, Request, Tiling, io_bytes

__all__ = ["tiled_attention", "tiled_lse", "iter_blocks", "block_scores", "SPEC", "DEFAULT_BLOCK", "KERNEL", "TiledKernel", "weights_from_lse"]

#: (block_q, block_k) when the caller gives none
DEFAULT_BLOCK = (512, 512)


def _peak(r: Request, t: Tiling | None) -> int:
    """Output, running max/denominator/lse per row, and three block_q × block_k score tiles; plus the
    weights when the second pass returns them."""
    bq, bk = (t.block_q, t.block_k) if t is not None else DEFAULT_BLOCK
    return (io_bytes(r) + r.N * r.H * r.L * (r.Ev + 3) * 4 + 3 * r.N * r.H * bq * bk * 4
            + (r.pairs * r.element_size if r.need_weights else 0))


def _flops(r: Request, t: Tiling | None) -> int:
    computed = t.computed(r.L, r.S) if t is not None else r.L * r.S
    return r.N * r.H * computed * 2 * (r.E + r.Ev)


SPEC = KernelSpec("tiled", "online-softmax tiles (FlashAttention's algorithm), recompute backward; weights by "
                  "a second pass over the saved log-sum-exp", weights="second pass", lse="yes", blocked=True,
                  softcap=True, alibi="positions", sinks=True, peak_bytes=_peak, flops=_flops)


def iter_blocks(layout: torch.Tensor, L: int, S: int, bq: int, bk: int):
    """Yield (q0, q1, k0, k1, kind) for every non-empty block, query-block major."""
    nz = (layout != P.EMPTY).nonzero().tolist()
    lay = layout.tolist()
    for qi, ki in nz:
        yield qi * bq, min(L, (qi + 1) * bq), ki * bk, min(S, (ki + 1) * bk), lay[qi][ki]


def block_scores(qc, kb, mask: MaskSpec, scale, q0, q1, k0, k1, kind, N, with_tanh: bool = False):
    """Scaled, soft-capped, biased, masked scores of one block: [N, H, q1-q0, k1-k0]; masked entries are
    -inf (Note [Score modifications]). ``with_tanh``: (scores, tanh(x / softcap) or None), what the
    backward needs to differentiate the cap."""
    s = torch.matmul(qc, kb.transpose(-2, -1)) * scale  # (N, H, bl, bk)
    t = None
    cap = mask.softcap_for(s.dtype)  # Note [Soft-cap at infinity] (kernels/masks.py)
    if cap is not None:
        t = torch.tanh(s / cap)
        s = t * cap
    if kind == P.PARTIAL:
        i = torch.arange(q0, q1, device=qc.device).unsqueeze(-1)
        j = torch.arange(k0, k1, device=qc.device).unsqueeze(0)
        keep, bias = mask.block(i, j, N)
        if bias is not None:
            s = s + bias.to(s.dtype)
        if keep is not None:
            s = s.masked_fill(~keep, float("-inf"))
    return (s, t) if with_tanh else s


#: "auto" uses PyTorch's private CPU flash op per tile where it applies; "torch" forces plain tensor ops
ENGINE = "auto"


def _use_flash(q, v, mask: MaskSpec) -> bool:
    """The fused CPU op applies: CPU tensors, equal query/value head dims (its backward needs that), no
    float mask finer than the inputs (the op takes it in their dtype; Note [Bias precision]) and no
    soft-capping (the op adds its mask to the raw product; ALiBi is such a mask, computed per tile), and
    float32 or float64 inputs.

    Note [Half types off the fused op]: the op takes and returns half inputs' output in their dtype, and its
    backward computes rowsum(dO ∘ O) from that rounded O. For a row that sees one key, the exact dS is 0, but
    dO·(v - round(v)) is not: the layout fuzz (attnlab verify, seed 41613: bf16, H 3 on 1 kv head, L 33, S 8,
    a causal window, block 4) found dq off by 0.094 where the naive bf16 computation was off by 0.0098 (9.6x;
    the budget is 8x). Half inputs therefore run the tiles in float32 (Note [Tiled output precision])."""
    return (ENGINE == "auto" and _fused.HAS_CPU_FLASH and q.device.type == "cpu" and q.shape[-1] == v.shape[-1]
            and not mask.bias_finer_than(q.dtype) and mask.softcap is None
            and q.dtype not in (torch.float16, torch.bfloat16))


def _tile_mask(mask: MaskSpec, q0, q1, k0, k1, N, device, dtype):
    """SDPA-style mask of one PARTIAL tile and the rows it leaves empty: (mask, dead [N|1, H|1, bl])."""
    i = torch.arange(q0, q1, device=device).unsqueeze(-1)
    j = torch.arange(k0, k1, device=device).unsqueeze(0)
    keep, bias = mask.block(i, j, N)
    if keep is None and bias is None:
        return None, None
    m = torch.zeros((), dtype=dtype, device=device) if bias is None else bias.to(dtype)
    if keep is not None:
        m = m.masked_fill(~keep, float("-inf"))  # the private op takes additive masks only
    alive = torch.isfinite(m).any(-1)
    return m, ~alive


def _flash_tile(qc, kb, vb, mask, scale, q0, q1, k0, k1, kind, N):
    """(o [N, H, bl, Ev] float, lse [N, H, bl]) of one tile by the fused CPU op; lse -inf on empty rows."""
    attn_mask, dead = (None, None)
    if kind == P.PARTIAL:
        attn_mask, dead = _tile_mask(mask, q0, q1, k0, k1, N, qc.device, qc.dtype)
    r = _fused.flash_cpu_with_lse(qc, kb, vb, attn_mask, False, scale)
    acc = _acc_dtype(qc.dtype)
    if r is None:  # the op refused these inputs: the same tile with plain tensor ops
        s = block_scores(qc.to(acc), kb.to(acc), mask, scale, q0, q1, k0, k1, kind, N)
        lse = torch.logsumexp(s, dim=-1)  # -inf for an empty row
        p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1))
        return torch.matmul(p, vb.to(acc)), lse
    o, lse = r
    o, lse = o.to(acc), lse.to(acc)
    if dead is not None and bool(dead.any()):
        lse = lse.masked_fill(dead, float("-inf"))
        o = o.masked_fill(dead.unsqueeze(-1), 0.0)
    return o, lse


def _forward(q, k, v, mask: MaskSpec, scale: float, bq: int, bk: int):
    N, H, L, _ = q.shape
    S, Ev = k.shape[2], v.shape[-1]
    acc = _acc_dtype(q.dtype)
    flash = _use_flash(q, v, mask)
    if flash:
        qa, ka, va = q.contiguous(), k.contiguous(), v.contiguous()
    else:
        qa, ka, va = q.to(acc), k.to(acc), v.to(acc)
    out = torch.zeros(N, H, L, Ev, dtype=acc, device=q.device)  # Note [Tiled output precision]
    lse = torch.full((N, H, L), float("-inf"), dtype=acc, device=q.device)
    layout = mask.layout(bq, bk, device="cpu")
    cur = None
    for q0, q1, k0, k1, kind in iter_blocks(layout, L, S, bq, bk):
        if cur != q0:
            if cur is not None:
                _finish(out, lse, cur, cq1, m, l, o) if not flash else _finish_lse(out, lse, cur, cq1, m, o)
            cur, cq1 = q0, q1
            qc = qa[:, :, q0:q1]
            m = torch.full((N, H, q1 - q0), float("-inf"), dtype=acc, device=q.device)
            l = torch.zeros_like(m)
            o = torch.zeros(N, H, q1 - q0, Ev, dtype=acc, device=q.device)
        if flash:
            # merge the tile's normalised output by log-sum-exp (Note [Merging by log-sum-exp], kernels/lse.py)
            o_t, lse_t = _flash_tile(qc, ka[:, :, k0:k1], va[:, :, k0:k1], mask, scale, q0, q1, k0, k1, kind, N)
            o, m = _merge(o, m, o_t, lse_t)
            continue
        s = block_scores(qc, ka[:, :, k0:k1], mask, scale, q0, q1, k0, k1, kind, N)
        m_new = torch.maximum(m, s.amax(dim=-1))
        m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        p = torch.exp(s - m_safe.unsqueeze(-1))  # (N, H, bl, bk)
        alpha = torch.exp(m - m_safe)  # Note [Online softmax rescaling]
        l = l * alpha + p.sum(dim=-1)
        o = o * alpha.unsqueeze(-1) + torch.matmul(p, va[:, :, k0:k1])
        m = m_new
    if cur is not None:
        _finish(out, lse, cur, cq1, m, l, o) if not flash else _finish_lse(out, lse, cur, cq1, m, o)
    return out, lse


# Note [Tiled output precision]: the forward keeps the output in the accumulation dtype (float32 for
# half inputs) and the autograd Function saves that copy: the backward's rowsum(dO ∘ O) from a bf16-rounded
# O cost up to 11x the naive bf16 computation's error in dk (found by test_differential's hypothesis
# search: L=1, S=3, E=1, Ev=5, scale 2). Memory: L·Ev·4 bytes per head saved instead of L·Ev·2.
def _finish_lse(out, lse, q0, q1, m, o):
    out[:, :, q0:q1] = o.to(out.dtype)
    lse[:, :, q0:q1] = m


def _finish(out, lse, q0, q1, m, l, o):
    nonzero = l > 0
    out[:, :, q0:q1] = (o / torch.where(nonzero, l, torch.ones_like(l)).unsqueeze(-1)).to(out.dtype)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    lse[:, :, q0:q1] = torch.where(nonzero, m_safe + torch.log(torch.where(nonzero, l, torch.ones_like(l))),
                                   torch.full_like(l, float("-inf")))


def _backward(dout, q, k, v, out, lse, mask: MaskSpec, scale: float, bq: int, bk: int):
    """(dq, dk, dv) per head (k, v [N, H, S, E|Ev]), in the accumulation dtype."""
    N, H, L, _ = q.shape
    S = k.shape[2]
    acc = _acc_dtype(q.dtype)
    lse_b = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, float("inf")))  # masked rows: p = 0
    layout = mask.layout(bq, bk, device="cpu")
    if _use_flash(q, v, mask):
        # Each tile's gradient from the fused backward, given the *global* output and log-sum-exp:
        # P = exp(S - lse) and D = rowsum(dO ∘ O) are then exactly the full-attention quantities.
        qc_, kc_, vc_, do_ = q.contiguous(), k.contiguous(), v.contiguous(), dout.contiguous().to(q.dtype)
        oc_, lf = out.to(q.dtype).contiguous(), lse_b.contiguous()  # the op takes q's dtype
        dq, dk, dv = {}, {}, {}  # block start -> summed gradient (Note [Out-of-place gradient sums])
        for q0, q1, k0, k1, kind in iter_blocks(layout, L, S, bq, bk):
            tm = _tile_mask(mask, q0, q1, k0, k1, N, q.device, q.dtype)[0] if kind == P.PARTIAL else None
            gq, gk, gv = _fused.flash_cpu_backward(
                do_.narrow(2, q0, q1 - q0), qc_[:, :, q0:q1], kc_[:, :, k0:k1], vc_[:, :, k0:k1], oc_[:, :, q0:q1],
                lf[:, :, q0:q1], tm, scale)
            _add(dq, q0, gq.to(acc))
            _add(dk, k0, gk.to(acc))
            _add(dv, k0, gv.to(acc))
        return _assemble(dq, q, bq, acc), _assemble(dk, k, bk, acc), _assemble(dv, v, bk, acc)
    qa, ka, va, doa = q.to(acc), k.to(acc), v.to(acc), dout.to(acc)
    delta = (doa * out.to(acc)).sum(dim=-1)  # (N, H, L): rowsum(dO ∘ O)
    dq, dk, dv = {}, {}, {}  # block start -> summed gradient (Note [Out-of-place gradient sums])
    for q0, q1, k0, k1, kind in iter_blocks(layout, L, S, bq, bk):
        qc, kb, vb, doc = qa[:, :, q0:q1], ka[:, :, k0:k1], va[:, :, k0:k1], doa.narrow(2, q0, q1 - q0)  # narrow: vmap-able
        s, t = block_scores(qc, kb, mask, scale, q0, q1, k0, k1, kind, N, with_tanh=True)
        p = torch.exp(s - lse_b[:, :, q0:q1].unsqueeze(-1))  # (N, H, bl, bk)
        _add(dv, k0, torch.matmul(p.transpose(-2, -1), doc))
        dp = torch.matmul(doc, vb.transpose(-2, -1))
        ds = p * (dp - delta.narrow(2, q0, q1 - q0).unsqueeze(-1))
        if t is not None:  # through the cap: d(c·tanh(x / c)) / dx = 1 − tanh²
            ds = ds * (1 - t * t)
        _add(dq, q0, torch.matmul(ds, kb) * scale)
        _add(dk, k0, torch.matmul(ds.transpose(-2, -1), qc) * scale)
    return _assemble(dq, q, bq, acc), _assemble(dk, k, bk, acc), _assemble(dv, v, bk, acc)


# Note [Out-of-place gradient sums]: the backward sums each block's gradient into a dict and assembles
# the result with one cat, instead of adding into slices of a zero tensor in place: under torch.func.vmap
# (batched gradients, gradcheck's check_batched_grad) the incoming gradient is batched and an in-place
# add into an unbatched buffer is impossible. Memory: one gradient-sized set of block sums each, plus the
# cat's copy at the end.
def _add(parts: dict, start: int, g: torch.Tensor) -> None:
    parts[start] = g if start not in parts else parts[start] + g


def _assemble(parts: dict, like: torch.Tensor, b: int, dtype: torch.dtype) -> torch.Tensor:
    """[N, H, T, D] from per-block sums keyed by block start along dim 2 (zeros where none)."""
    T = like.shape[2]
    chunks = [parts[a] if a in parts else torch.zeros_like(like[:, :, a:a + b], dtype=dtype) for a in range(0, T, b)]
    return torch.cat(chunks, dim=2) if chunks else torch.zeros_like(like, dtype=dtype)


class _TiledFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, scale, bq, bk, dead, sinks=None):
        H, Hkv = q.shape[1], k.shape[1]
        k, v = repeat_heads(k, H, dead), repeat_heads(v, H, dead)  # GQA: exact copies in the input dtype
        out, lse = _forward(q, k, v, mask, scale, bq, bk)  # out in the accumulation dtype
        if sinks is not None:  # Note [Attention sinks]: the backward runs on the sinked (out, lse)
            a, lse = sink_scale(lse, sinks.detach())
            out = out * a.unsqueeze(-1).to(out.dtype)
        ctx.save_for_backward(q, k, v, out, lse, dead, sinks)
        ctx.mask, ctx.scale, ctx.bq, ctx.bk, ctx.Hkv = mask, scale, bq, bk, Hkv
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, dead, sinks = ctx.saved_tensors
        dq, dk, dv = _backward(dout, q, k, v, out, lse, ctx.mask, ctx.scale, ctx.bq, ctx.bk)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[8]:  # ds_h = -Σ (1 - a)·rowsum(dO ∘ O'), Note [Attention sinks]
            delta = (dout.to(out.dtype) * out).sum(-1)  # (N, H, L)
            rest = torch.exp(sinks.detach().to(lse.dtype).view(-1, 1) - lse)  # 1 - a = exp(s - lse')
            dsinks = -(rest * delta).sum((0, 2)).to(sinks.dtype)
        if ctx.Hkv != q.shape[1]:  # the group's sum in the accumulation dtype (Note [GQA gradients in the ...])
            if dead is not None:  # zeroed per head in the forward
                dk, dv = dk.masked_fill(dead.unsqueeze(-1), 0), dv.masked_fill(dead.unsqueeze(-1), 0)
            dk, dv = (g.unflatten(1, (ctx.Hkv, -1)).sum(2) for g in (dk, dv))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, dsinks


def tiled_lse(q, k, v, mask: MaskSpec, scale: float, block_q: int = 512, block_k: int = 512):
    """q [N, H, L, E], k [N, H, S, E], v [N, H, S, Ev] -> (out [N, H, L, Ev], lse [N, H, L]) by one
    forward pass, outside autograd (nothing saved for a backward). lse is in ``acc_dtype(q.dtype)``,
    -inf for a row with no key. For callers that need only the log-sum-exp (``attnlab.probe``), v may
    have Ev = 0."""
    with torch.no_grad():
        out, lse = _forward(q, k, v, mask, scale, block_q, block_k)
        return out.to(q.dtype), lse


def tiled_attention(q, k, v, mask: MaskSpec, scale: float, block_q: int = 512, block_k: int = 512,
                    dead: torch.Tensor | None = None, sinks: torch.Tensor | None = None):
    """q [N, H, L, E], k [N, H|Hkv, S, E], v [N, H|Hkv, S, Ev] -> (out [N, H, L, Ev], lse [N, H, L]).

    Differentiable in q, k, v (not in a float attn_mask; functional refuses that case). Under GQA
    (Hkv < H) the heads are repeated inside, ``dead`` [N|1, H, S] keys zeroed per head, and the backward
    sums each group's gradient in the accumulation dtype (Note [GQA gradients in the accumulation dtype]).
    Time O(L·S·(E+Ev)) over non-empty blocks; memory O(L·(E+Ev) + block_q·block_k) per head.
    ``sinks`` [H] (may require grad): attention sinks, lse then includes them (Note [Attention sinks]).
    """
    return _TiledFunction.apply(q, k, v, mask, scale, block_q, block_k, dead, sinks)


# -- the kernel object ------------------------------------------------------------------------------
def weights_from_lse(p, lse: torch.Tensor, bq: int, bk: int) -> torch.Tensor:
    """Second streaming pass: weights [B, H, L, S] = exp(scores - lse), block by block, no extra L×S scratch."""
    info = p.info
    w = torch.zeros(p.N, info.H, info.L, info.S, dtype=p.q.dtype, device=p.q.device)
    acc = _acc_dtype(p.q.dtype)
    lse_b = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, float("inf")))
    qa, ka = p.q.detach().to(acc), p.k.detach().to(acc)
    for q0, q1, k0, k1, kind in iter_blocks(p.mask.layout(bq, bk), info.L, info.S, bq, bk):
        s = block_scores(qa[:, :, q0:q1], ka[:, :, k0:k1], p.mask, info.scale, q0, q1, k0, k1, kind, p.N)
        w[:, :, q0:q1, k0:k1] = torch.exp(s - lse_b[:, :, q0:q1].unsqueeze(-1)).to(w.dtype)
    return w


class TiledKernel(Kernel):
    """The tiled kernel's door: ``block_size`` square tiles (default ``DEFAULT_BLOCK``), the mask's
    non-empty blocks visited; weights by a second pass over the saved log-sum-exp. Its block walk is offered
    to the streaming probe (``attnlab.probe``), which computes summaries of the weights tile by tile."""

    DEFAULT_BLOCK = DEFAULT_BLOCK
    iter_blocks = staticmethod(iter_blocks)
    block_scores = staticmethod(block_scores)
    tiled_lse = staticmethod(tiled_lse)

    def tiling(self, p, r: Request, block_size: int | None, rates) -> Tiling:
        """(block_size, block_size) or ``DEFAULT_BLOCK``, with the blocks the mask leaves non-empty."""
        bq, bk = (block_size, block_size) if block_size else DEFAULT_BLOCK
        return masked_tiling(p, bq, bk)

    def run(self, p, t: Tiling | None, need_weights: bool = False, need_lse: bool = False):
        """(out, weights or None, lse)."""
        bq, bk = (t.block_q, t.block_k) if t is not None else DEFAULT_BLOCK
        out, lse = tiled_attention(p.q, p.kv_k, p.kv_v, p.mask, p.info.scale, bq, bk, dead=dead_per_head(p),
                                   sinks=p.mask.sinks)
        return out, (weights_from_lse(p, lse, bq, bk) if need_weights else None), lse


#: GFLOP/s: an estimate for plain PyTorch tiles (a few matmuls and elementwise passes per block), well
#: below the fused kernels, so it runs where they cannot
KERNEL = TiledKernel(SPEC, gflops=25.0, title="Tiled", memory="O(L·D + block²)",
                     why="exact online softmax without materialising L×S{mods}",
                     paper="Dao et al. 2022, FlashAttention", default_block=DEFAULT_BLOCK)
