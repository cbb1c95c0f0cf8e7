"""Dense attention: materialise the [N, H, L, S] scores. Simple, supports everything, O(L·S) memory."""
from __future__ import annotations

import torch

from .masks import MaskSpec
from .kernel import Kernel, dead_per_head
from .spec import KernelSpec, Request, Tiling, io_bytes

__all__ = ["dense_attention", "masked_softmax", "repeat_heads", "SPEC", "KERNEL", "DenseKernel"]


def _peak(r: Request, t: Tiling | None) -> int:
    """Inputs and outputs, the float32 scores, weights and one temporary [N, H, L, S]; plus the returned weights."""
    return io_bytes(r) + 3 * r.pairs * 4 + (r.pairs * r.element_size if r.need_weights else 0)


def _flops(r: Request, t: Tiling | None) -> int:
    return r.pairs * 2 * (r.E + r.Ev)


SPEC = KernelSpec("dense", "materialises the [B, H, L, S] scores; supports everything", weights="yes",
                  dropout=True, float_mask_grad=True, materializes="scores", softcap=True, alibi="positions", sinks=True,
                  peak_bytes=_peak, flops=_flops)


def masked_softmax(scores: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim where masked entries get exactly 0 and a row with nothing kept is 0.

    # Note [Fully masked rows]: PyTorch's kernels return 0 for a query row whose every key is masked;
    # attnlab does the same in every kernel (no NaN), and the log-sum-exp of such a row is -inf.
    """
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(scores - row_max)
    denom = p.sum(dim=-1, keepdim=True)
    return p / torch.where(denom == 0, torch.ones_like(denom), denom)


def repeat_heads(t: torch.Tensor, H: int, dead: torch.Tensor | None = None) -> torch.Tensor:
    """t [N, Hkv, S, D] -> [N, H, S, D]: each key/value head repeated for its group of H / Hkv query heads
    (t itself when Hkv = H), with the keys ``dead`` [N|1, H, S] (dead for only some heads of a group) zeroed
    per head. Called on t in the accumulation dtype, so that autograd sums the group's gradients there
    (Note [GQA gradients in the accumulation dtype])."""
    if t.shape[1] == H:
        return t
    t = t.repeat_interleave(H // t.shape[1], dim=1)
    return t if dead is None else t.masked_fill(dead.unsqueeze(-1), 0)


# Note [GQA gradients in the accumulation dtype]: under GQA a key/value head's gradient is the sum of its
# group's H / Hkv per-head gradients. With half-type inputs, repeating k and v before the kernel upcasts
# them makes autograd round each per-head gradient to the input dtype and then sum the rounded ones: an
# error of u·Σ_h |dv_h| instead of u·|Σ_h dv_h|, far larger when the heads' gradients cancel (hypothesis:
# bf16, 3 heads per key head, per-head dv ~ -4.8, 5.9, -0.3 summing to 0.79; dense's dv 9 ulps off).
# So dense and tiled take the key/value heads as given (``Prepared.kv_k``/``kv_v``) and repeat them in
# float32 (dense: ``repeat_heads`` after the upcast; tiled: its backward sums the group in float32), and
# the group's gradient is rounded to the input dtype once, as the compiled kernel does.
def dense_attention(q, k, v, mask: MaskSpec, scale: float, dropout_p: float = 0.0, training_dropout: bool = True,
                    dead: torch.Tensor | None = None):
    """q [N, H, L, E], k [N, H|Hkv, S, E], v [N, H|Hkv, S, Ev] -> (out [N, H, L, Ev], weights [N, H, L, S]).

    Computes in float32 for half types (as PyTorch's math path does), returns the input dtype. Soft-capping
    and ALiBi as ``mask`` says (Note [Score modifications]); autograd differentiates the cap. Under GQA
    (Hkv < H) k and v are repeated after the upcast, with ``dead`` [N|1, H, S] keys zeroed per head
    (``repeat_heads``; Note [GQA gradients in the accumulation dtype]). ``mask.sinks`` [H]: attention sinks in
    the softmax, as a last column of score s_h whose weight is dropped (the weights then sum to < 1; Note
    [Attention sinks]); autograd differentiates them.
    """
    compute = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    L, S, H = q.shape[-2], k.shape[-2], q.shape[1]
    k, v = repeat_heads(k.to(compute), H, dead), repeat_heads(v.to(compute), H, dead)  # (N, H, S, E|Ev)
    scores = mask.cap(torch.matmul(q.to(compute), k.transpose(-2, -1)) * scale)  # (N, H, L, S)
    i = torch.arange(L, device=q.device).unsqueeze(-1)
    j = torch.arange(S, device=q.device).unsqueeze(0)
    keep, bias = mask.block(i, j, q.shape[0]) if not mask.is_trivial else (None, None)
    if bias is not None:
        scores = scores + bias.to(compute)
    if mask.sinks is None:
        weights = masked_softmax(scores, keep)
    else:  # (N, H, L, S + 1): the sink's column never masked, so no row is empty
        if keep is not None:
            scores = scores.masked_fill(~keep, float("-inf"))
        sink = mask.sinks.to(compute).view(1, H, 1, 1).expand(*scores.shape[:-1], 1)
        weights = masked_softmax(torch.cat([scores, sink], dim=-1), None)[..., :S]
    attn = weights
    if dropout_p > 0.0 and training_dropout:
        attn = torch.nn.functional.dropout(weights, p=dropout_p)
    out = torch.matmul(attn, v)  # (N, H, L, Ev)
    return out.to(q.dtype), weights.to(q.dtype)


# -- the kernel object ------------------------------------------------------------------------------
class DenseKernel(Kernel):
    """The dense kernel's door: no tiling; runs ``dense_attention`` on the key/value heads as given."""

    def run(self, p, t: Tiling | None, need_weights: bool = False, need_lse: bool = False):
        """(out, weights, None): GQA's kv heads repeated in the compute dtype (Note [GQA gradients in the
        accumulation dtype])."""
        out, weights = dense_attention(p.q, p.kv_k, p.kv_v, p.mask, p.info.scale, p.dropout_p, dead=dead_per_head(p))
        return out, weights, None


#: GFLOP/s: an estimate (materialising [N, H, L, S] in float32 makes it memory-bound), below every fused kernel
KERNEL = DenseKernel(SPEC, gflops=15.0, title="Dense", memory="O(L·S)",
                     why="the dense kernel runs everything; the others are refused ({refused}: see refused)")
