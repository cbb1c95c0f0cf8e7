"""The one place that calls PyTorch's fused attention, including its private CPU op with log-sum-exp."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .decode import decode_step
from .kernel import Declined, Kernel, materialize
from .spec import KernelSpec, Request, Tiling, alibi_mask_bytes, io_bytes

__all__ = ["sdpa", "flash_cpu_with_lse", "flash_cpu_backward", "HAS_CPU_FLASH", "sdpa_backend", "stand_in", "SPEC", "KERNEL", "SDPAKernel"]

#: F.scaled_dot_product_attention takes enable_gqa (torch >= 2.5)
SDPA_GQA = "enable_gqa" in (getattr(F.scaled_dot_product_attention, "__doc__", "") or "")
_flash = getattr(getattr(torch.ops, "aten", None), "_scaled_dot_product_flash_attention_for_cpu", None)
HAS_CPU_FLASH = _flash is not None and getattr(getattr(torch.ops, "aten", None), "_scaled_dot_product_flash_attention_for_cpu_backward", None) is not None


def _positive_scale(q, is_causal, scale):
    """(q, scale) with the same scores q·k·scale and scale > 0 when causal.

    # Note [Causal with scale <= 0]: PyTorch's CPU flash kernel returns NaN for is_causal=True with
    # scale 0 or < 0 (torch 2.13; its causal fill is scaled with the scores, -inf·0 or -inf·(-s)), while
    # an explicit mask is right. q·k·s equals (-q)·k·|s| exactly (negation is exact in every dtype), and
    # scale 0 is zero scores: 0·k with scale 1.
    """
    if not is_causal or scale is None or scale > 0:
        return q, scale
    return (q * 0.0, 1.0) if scale == 0 else (-q, -scale)


def _empty(q, k) -> bool:
    """A zero batch, head, query or key dim: nothing to attend (head dims E, Ev of 0 are not empty)."""
    return 0 in q.shape[:-1] or k.shape[-2] == 0


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its last dim dense (a copy only when its stride there is not 1).

    # Note [Private flash op strides]: PyTorch's private CPU flash op reads q, k and v as if their last
    # dim had stride 1 (torch 2.13): ``x[..., ::2]``, ``.mT`` or a stride-0 ``expand`` of the head dim
    # gives silently wrong outputs (public SDPA checks this and copies or takes its math path). Other
    # dims may have any stride, 0 included; masks are read correctly in any layout.
    """
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def _tidy_unit_strides(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed with row-major strides on its size-1 dims (no copy; the values are the same).

    Note [Size-1 dim strides]: PyTorch's CPU flash kernel, private op and public SDPA alike (torch 2.13),
    returns garbage (1e35, or NaN in fp32) for q [1, 2, 33, 11] with strides [1, 66, 0, 1]: a size-1 batch dim
    whose stride is below the next dim's, with the query dim expanded (stride 0); the same values with the
    batch stride 132 come out right (found by test_differential's layout fuzz through attention_with_lse).
    A size-1 dim's stride is never used to address an element, so it is set to the row-major one. Where a dim
    after it is expanded (stride 0), no stride fixes it: the fuzz found q [1, 3, 33, 5] with strides [0, 0, 0, 1]
    right as it was and wrong once its batch stride was set to 1 (errors up to 1e29, and NaN, changing from call
    to call: the kernel reads past the data). Such a tensor is copied row-major instead (a layout that odd is
    rare, and the copy is what SDPA's math path would make), also when its size-1 strides are already the ones
    this rule would give: q [1, 2, 2] with strides [1, 0, 1] (4-D: [1, 1, 2, 2], strides [1, 1, 0, 1]) gave one
    uninitialised output element from public SDPA (found by the layout fuzz in `attnlab verify`, seed 4219)."""
    shape, st = t.shape, list(t.stride())
    expanded = False  # a dim of size >= 2 with stride 0 after the one looked at
    for d in range(t.dim() - 1, -1, -1):
        if shape[d] > 1 and st[d] == 0:
            expanded = True
        elif shape[d] == 1 and expanded:  # whatever its stride (the fuzz found [1, 2, 2] strides [1, 0, 1],
            return t.clone(memory_format=torch.contiguous_format)  # already "tidy", wrong in SDPA's output)
    changed = False
    for d in range(t.dim() - 2, -1, -1):
        if shape[d] == 1:
            want = max(1, abs(st[d + 1]) * shape[d + 1])
            if st[d] != want:
                st[d], changed = want, True
    if not changed:
        return t
    return t.as_strided(shape, st, t.storage_offset())


def _dense_if_expanded(t: torch.Tensor) -> torch.Tensor:
    """``t`` copied row-major when it needs a gradient and a dim of size >= 2 has stride 0 (an ``expand``).

    Note [SDPA backward of expanded operands]: PyTorch's CPU SDPA backward (torch 2.13) returns a wrong
    gradient for an operand expanded along its sequence dim when a size-1 dim carries an unusual stride
    (q [1, 1, 2, 2] with strides [2, 1, 0, 1]: dq off by 0.1, found by test_differential's layout fuzz);
    the forward is right. A copy under autograd sums the expanded rows' gradients exactly, and only such
    operands pay it."""
    if not t.requires_grad or not any(st == 0 and n >= 2 for st, n in zip(t.stride(), t.shape)):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """PyTorch's scaled_dot_product_attention on 4-D tensors (4-D keeps its fused backends eligible);
    ``enable_gqa`` with k, v of Hkv < H heads: PyTorch reads the groups without attnlab copying them."""
    q, scale = _positive_scale(q, is_causal, scale)
    q, k, v = (_tidy_unit_strides(t) for t in (q, k, v))  # Note [Size-1 dim strides]
    if torch.is_grad_enabled():
        q, k, v = (_dense_if_expanded(t) for t in (q, k, v))
    if enable_gqa:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale)


def _direct_sdpa(dropout_p: float, causal: bool, scale: float, gqa: bool):
    """``sdpa`` with these arguments as one callable on the caller's (q, k, v), for a plan-cache hit (Note [Small
    call overhead]). A hit's tensors have its signature's shapes, strides, dtypes and grad flags, so whether
    ``sdpa`` would re-stride or copy them (Note [Size-1 dim strides], Note [SDPA backward of expanded
    operands]) is the same on every call: the first call finds out, and when nothing needs it (the usual case)
    later calls go straight to PyTorch's op."""
    kw = dict(attn_mask=None, dropout_p=dropout_p, is_causal=causal, scale=scale)
    if gqa:
        kw["enable_gqa"] = True
    plain = []

    def call(q, k, v):
        if plain:
            return F.scaled_dot_product_attention(q, k, v, **kw)
        same = _positive_scale(q, causal, scale)[0] is q and all(
            _tidy_unit_strides(t) is t and (not torch.is_grad_enabled() or _dense_if_expanded(t) is t)
            for t in (q, k, v))
        if same:
            plain.append(True)
        return sdpa(q, k, v, None, dropout_p, causal, scale, gqa)

    return call


def flash_cpu_with_lse(q, k, v, attn_mask=None, is_causal=False, scale=None):
    """(out, lse) from the private CPU flash op; lse [N, H, L] in float32.

    Returns None when the op is missing or does not apply (non-CPU tensors), so callers fall back.
    The op reports lse = 0 for a fully masked row; callers that merge partial results must fix
    such rows to -inf (see Note [Fully masked rows]).
    """
    if not HAS_CPU_FLASH or q.device.type != "cpu" or _empty(q, k):
        return None  # zero-size dims: the op divides by them (SIGFPE, torch 2.13)
    q, k, v = (_tidy_unit_strides(_unit_last_stride(t)) for t in (q, k, v))  # Note [Size-1 dim strides]
    q, scale = _positive_scale(q, is_causal, scale)
    try:
        out, lse = _flash(q, k, v, 0.0, is_causal, attn_mask=attn_mask, scale=scale)
    except RuntimeError:
        return None
    return out, lse


_flash_bwd = getattr(getattr(torch.ops, "aten", None), "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def flash_cpu_backward(grad_out, q, k, v, out, lse, attn_mask, scale):
    """(dq, dk, dv) of one tile from the private CPU flash backward, given the global out and lse."""
    if _empty(q, k):  # zero-size dims: nothing to differentiate, and the op would divide by 0
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    return _flash_bwd(grad_out.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(),
                      lse.contiguous(), 0.0, False, attn_mask=attn_mask, scale=scale)


def stand_in(t: torch.Tensor | None, device: str) -> torch.Tensor | None:
    """A tensor on ``device`` with ``t``'s shape, dtype and requires_grad, and a last-dim stride of 1 exactly
    when ``t``'s is (every other stride 0), holding at most one row: what SDPA's backend choice reads
    (shapes, dtypes, the last stride; never values) for a meta tensor describing a call on ``device``."""
    if t is None or t.device.type == device:
        return t
    last = t.shape[-1] if t.dim() and (t.shape[-1] <= 1 or t.stride(-1) == 1) else 1
    base = torch.zeros(last if t.dim() else (), dtype=t.dtype, device=device, requires_grad=t.requires_grad)
    return base.expand(t.shape)


def sdpa_backend(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, device: str | None = None) -> str:
    """Name of the backend PyTorch's SDPA would pick for these inputs ('flash', 'math', ...); with
    ``device`` ("cpu"), for tensors of these shapes, strides and dtypes there (``stand_in``: meta inputs
    describe a call on that device without its storage)."""
    if device is not None:
        try:
            q, k, v, attn_mask = (stand_in(t, device) for t in (q, k, v, attn_mask))
        except Exception:  # a device this build cannot place tensors on
            return "unknown"
    try:
        choice = torch._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal, scale=scale)
        from torch.nn.attention import SDPBackend

        return SDPBackend(choice).name.lower()
    except Exception:  # private API: unknown is an honest answer
        return "unknown"


def _peak(r: Request, t: Tiling | None) -> int:
    """Fused backends keep O(L) state per row; a pattern or mask is passed as an L×S tensor; the math
    backend builds [N, H, L, S] scores. ALiBi is written out per head (``alibi_mask_bytes``)."""
    mask = 0 if (r.trivial or r.causal_only) else r.L * r.S * (4 if r.float_mask else 1)
    return (io_bytes(r) + r.N * r.H * r.L * 4 + mask + alibi_mask_bytes(r)
            + (3 * r.pairs * 4 if r.sdpa_backend == "math" else 0))


def _flops(r: Request, t: Tiling | None) -> int:
    return r.pairs * 2 * (r.E + r.Ev) // (2 if r.causal_only and r.sdpa_backend != "math" else 1)


# no softcap: SDPA adds a mask to q·kᵀ·scale and cannot apply tanh in between
SPEC = KernelSpec("sdpa", "PyTorch's scaled_dot_product_attention (patterns passed as an L×S mask)",
                  lse="inference", dropout=True, float_mask_grad=True, materializes="mask", alibi="mask",
                  cache_views=("contiguous",), cache_layouts=("heads-first",), peak_bytes=_peak, flops=_flops)


# -- the kernel object ------------------------------------------------------------------------------
class SDPAKernel(Kernel):
    """PyTorch's fused attention as a kernel: no tiling; a pattern or mask is passed as one L×S mask
    (``materialize``), ALiBi written out into it."""

    def direct(self, p, t: Tiling | None, need_weights: bool = False):
        """SDPA on the caller's 4-D tensors for plain or causal inputs with no dead key: what ``run`` calls
        for them, with the arguments fixed once (Note [Plan cache])."""
        info, mask = p.info, p.mask
        gqa = info.H != info.Hkv
        cut = p.key_range is not None and p.key_range[:2] != (0, p.key_range[2])  # live keys are a slice
        if (need_weights or p.empty or p.dead is not None or cut or len(p.out_shape) != 4
                or not (mask.is_trivial or p.is_causal_only) or (gqa and not SDPA_GQA)):
            return None
        dropout_p, causal, scale = p.dropout_p, p.is_causal_only, info.scale
        return _direct_sdpa(dropout_p, causal, scale, gqa)

    def run(self, p, t: Tiling | None, need_weights: bool = False, need_lse: bool = False):
        """(out, None, None), or with ``need_lse`` (out, None, lse) from the private CPU flash op (plain or
        causal inputs only, as declared; raises ``Declined`` when the op is missing or refuses them)."""
        info, mask = p.info, p.mask
        if need_lse:
            r = flash_cpu_with_lse(p.q, p.k, p.v, None, p.is_causal_only, info.scale)
            if r is None:
                raise Declined("PyTorch's private CPU flash op is missing or refused these inputs")
            return r[0], None, r[1]
        # GQA: SDPA reads the kv heads in place (enable_gqa), unless per-head dead keys needed copies
        gqa = info.H != info.Hkv and not p.dead_per_head and SDPA_GQA
        k, v = (p.kv_k, p.kv_v) if gqa else (p.k, p.v)
        if mask.is_trivial or p.is_causal_only:
            return sdpa(p.q, k, v, None, p.dropout_p, p.is_causal_only, info.scale, gqa), None, None
        if mask.bias_finer_than(p.q.dtype):
            # SDPA takes a float mask in q's dtype only: compute in float32 (Note [Bias precision])
            out = sdpa(p.q.float(), k.float(), v.float(), materialize(mask, p, torch.float32), p.dropout_p, False,
                       info.scale, gqa).to(p.q.dtype)
            return out, None, None
        return sdpa(p.q, k, v, materialize(mask, p), p.dropout_p, False, info.scale, gqa), None, None


    def step(self, q, k_cache, v_cache, k, v, n0: int, scale: float):
        """A plain step on a heads-first cache (every query sees every key), its direct path (csrc Note [SDPA
        steps]): the decode extension checks and appends k, v [B, Lnew, Hkv, D|Dv] at token n0 (one length), then
        SDPA on views of the cache's first n0 + Lnew rows: out [B, L, H, Dv] (a view), or None, nothing written,
        where the checks do not pass (the caller's full path then names the error)."""
        if decode_step(q, k_cache, v_cache, k, v, n0, None, False, scale, attend=False) is None:
            return None
        n = n0 + (k.shape[1] if k is not None else 0)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k_cache[:, :n].transpose(1, 2),
                                             v_cache[:, :n].transpose(1, 2), scale=scale,
                                             enable_gqa=q.shape[2] != k_cache.shape[2])
        return out.transpose(1, 2)

    def run_cache(self, c):
        """(out [B, L, H, Dv], None) for a contiguous KV-cache view (the one cache view it declares): SDPA on views
        of the cache's first S rows, no copy; a window, a padded batch's mask or ALiBi as one [B, H|1, L, S] mask
        (``CacheCall.mask``, a float one computed in float32: Note [Bias precision]). No log-sum-exp (Declined)."""
        if c.need_lse:
            raise Declined("SDPA returns no log-sum-exp for a KV-cache view")
        S, gqa = c.S, c.q.shape[2] != c.k.shape[2]
        q, k, v = c.q.transpose(1, 2), c.k[:, :S].transpose(1, 2), c.v[:, :S].transpose(1, 2)
        m = c.mask()
        if m is not None and m.dtype != torch.bool:
            out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=m, scale=c.scale,
                                                 enable_gqa=gqa).to(q.dtype)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=c.scale, enable_gqa=gqa)
        return out.transpose(1, 2), None


#: GFLOP/s on the 2-core reference machine: its fused kernel on whole problems (it reached 77 on 256-row
#: blocks, ``planner.SPARSE_BLOCK_SPEED``). One rate whatever backend PyTorch picks: a running plan does not
#: ask which (explain does), and explain must predict what the call does
KERNEL = SDPAKernel(SPEC, gflops=80.0, title="SDPA", memory="O(L) (fused) or O(L·S) (math)",
                    why="delegated to PyTorch's fused attention ({backend} backend)")
