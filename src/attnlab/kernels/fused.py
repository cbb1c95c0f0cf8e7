"""The one place that calls PyTorch's fused attention, including its private CPU op with log-sum-exp."""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["sdpa", "flash_cpu_with_lse", "HAS_CPU_FLASH", "sdpa_backend"]

_flash = getattr(getattr(torch.ops, "aten", None), "_scaled_dot_product_flash_attention_for_cpu", None)
HAS_CPU_FLASH = _flash is not None and getattr(getattr(torch.ops, "aten", None), "_scaled_dot_product_flash_attention_for_cpu_backward", None) is not None


def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    """PyTorch's scaled_dot_product_attention on 4-D tensors (4-D keeps its fused backends eligible)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale)


def flash_cpu_with_lse(q, k, v, attn_mask=None, is_causal=False, scale=None):
    """(out, lse) from the private CPU flash op; lse [N, H, L] in float32.

    Returns None when the op is missing or does not apply (non-CPU tensors), so callers fall back.
    The op reports lse = 0 for a fully masked row; callers that merge partial results must fix
    such rows to -inf (see Note [Fully masked rows]).
    """
    if not HAS_CPU_FLASH or q.device.type != "cpu":
        return None
    try:
        out, lse = _flash(q, k, v, 0.0, is_causal, attn_mask=attn_mask, scale=scale)
    except RuntimeError:
        return None
    return out, lse


_flash_bwd = getattr(getattr(torch.ops, "aten", None), "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def flash_cpu_backward(grad_out, q, k, v, out, lse, attn_mask, scale):
    """(dq, dk, dv) of one tile from the private CPU flash backward, given the global out and lse."""
    return _flash_bwd(grad_out.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(),
                      lse.contiguous(), 0.0, False, attn_mask=attn_mask, scale=scale)


def sdpa_backend(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None) -> str:
    """Name of the backend PyTorch's SDPA would pick for these inputs ('flash', 'math', ...)."""
    try:
        choice = torch._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal, scale=scale)
        from torch.nn.attention import SDPBackend

        return SDPBackend(choice).name.lower()
    except Exception:  # private API: unknown is an honest answer
        return "unknown"
