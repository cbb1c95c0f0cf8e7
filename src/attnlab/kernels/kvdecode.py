"""The compiled kernel's decode path for ``attention()`` calls of decode shape: when it applies, what it does, and
its run on prepared inputs (``attnlab.shapes.Prepared``) through the decode extension (``kernels.decode``).

Legend: N batch, H query heads, Hkv key/value heads, L queries (few: decode, speculative verification), S keys,
E head dim, Ev value head dim.

The planner routes a call here (``CompiledKernel.decodes``) when it has few queries against more keys, in
inference; the masks it carries become the kernel's own arguments (``decode_args``): a band pattern its key
range, key padding by lengths its per-sequence lengths, anything else a bool keep read through strides.
``attnlab.functional.kvcache.attention_with_kvcache`` (flash-attn's API: appends, rotary, int8 caches) calls the
decode extension itself and does not pass through here.
"""
from __future__ import annotations

import math

import torch

from . import decode as decode_kernel

__all__ = ["decode_applies", "decode_reason", "decode_args", "run_prepared", "direct", "and_parts", "is_prefix"]


def decode_applies(r) -> bool:
    """Whether a call (a ``kernels.Request``) takes the decode path of the compiled kernel: CPU, fp32/bf16/
    fp16, 1 <= L <= decode_kernel.MAX_QUERIES queries against more keys than queries (S > L: a KV cache; a short
    self-attention, L = S, such as an encoder's on a short sentence, stays on the planner's prefill choice,
    SDPA's own kernel for HF-equal results), inference (no autograd, dropout or weights) and the decode
    extension loads. Every mask, pattern, softcap and ALiBi is taken (csrc/decode.cpp)."""
    return (r.device == "cpu" and r.dtype in decode_kernel.DTYPES and 1 <= r.L <= decode_kernel.MAX_QUERIES
            and r.S > r.L and not r.needs_grad and r.dropout_p == 0 and not r.need_weights
            and not r.float_mask_grad and decode_kernel.available())


def decode_reason(p, costs: bool = False) -> str:
    """What the decode path does for prepared inputs ``p``: splits, K/V bytes read and, with ``costs``, the
    time that takes at the read bandwidth measured in this process (``decode_kernel.read_bandwidth``); the
    schedule is ``decode_kernel.plan``'s for the cache as ``run_prepared`` passes it."""
    i = p.info
    bw = decode_kernel.read_bandwidth() if costs else None
    return decode_kernel.plan(p.N, i.H, i.Hkv, i.S, i.E, i.Ev, p.q.dtype, k=p.kv_k.transpose(1, 2),
                              bandwidth=bw).describe()


def decode_args(p) -> dict:
    """The decode kernel's keywords for prepared inputs ``p`` (what ``run_prepared`` passes it but the tensors
    and ``out``): a band pattern (causal, sliding windows, any alignment) becomes the kernel's key range; key
    padding by lengths its per-sequence lengths; other patterns and user masks a bool keep [N|1, H|1, L, S]
    (L×S is small at decode sizes) read through strides; ALiBi keeps attnlab's alignment i + S - L."""
    i, mask = p.info, p.mask
    N, L, S = p.N, i.L, i.S
    seqlens = S  # an int until key padding shortens a sequence (Note [Decode call overhead])
    left = right = decode_kernel.UNBOUNDED
    keep = mask.keep
    pat = mask.pattern
    rest = []  # patterns the key range cannot express
    for part in and_parts(pat):
        band = part.band(L, S) if part.batch_size is None else None
        kk = getattr(part, "keep_keys", None)
        if band is not None:
            lo, hi = band
            left = min(left, decode_kernel.UNBOUNDED if lo == -math.inf else max(-(2**40), int(-lo)))
            right = min(right, decode_kernel.UNBOUNDED if hi == math.inf else max(-(2**40), int(hi)))
        elif kk is not None and is_prefix(kk, S):
            lens = kk[:, :S].sum(1).to(torch.int64)  # (N,)
            if isinstance(seqlens, int):
                seqlens = lens.clamp(max=S).expand(N).contiguous()
            else:
                seqlens = torch.minimum(seqlens, lens)
        else:
            rest.append(part)
    for part in rest:
        qi, kj = torch.arange(L).view(L, 1), torch.arange(S).view(1, S)
        m = part.keep(qi, kj, L, S)  # (L, S) or (N, L, S)
        m = m.view(-1, 1, L, S)  # (N|1, 1, L, S)
        keep = m if keep is None else keep & m
    bias = mask.bias
    return dict(scale=i.scale, seqlens=seqlens, mask_offset=0, left=left, right=right,
                keep=None if keep is None else keep.expand(N, i.H, L, S),
                bias=None if bias is None else bias.expand(N, i.H, L, S),
                softcap=mask.softcap_for(torch.float32) or 0.0,
                alibi_slopes=None if mask.alibi is None else mask.alibi.expand(N, i.H), alibi_offset=S - L)


def run_prepared(p, return_lse: bool = False):
    """``attention`` on prepared inputs through the decode kernel: out [N, H, L, Ev] (and lse [N, H, L]);
    the masks as ``decode_args`` turns them into the kernel's arguments."""
    out = torch.empty(p.N, p.info.H, p.info.L, p.info.Ev, dtype=p.q.dtype)
    # the kernel reads flash-attn's [N, S, Hkv, E] layout through strides: (N, Hkv, S, E) -> (N, S, Hkv, E) views
    out, lse = decode_kernel.decode_attention(p.q, p.kv_k.transpose(1, 2), p.kv_v.transpose(1, 2), out=out,
                                              **decode_args(p))
    return (out, lse) if return_lse else out


def direct(p):
    """``run_prepared`` for inputs of ``p``'s signature as one callable ``f(query, key, value) -> out`` on the
    caller's 4-D tensors, its arguments built once (Note [Decode direct call]), or None when running reads
    more than the signature holds (a mask tensor, key padding lengths, dead keys, non-4-D inputs)."""
    i = p.info
    if (p.empty or len(p.out_shape) != 4 or p.dead is not None
            or (p.key_range is not None and p.key_range[:2] != (0, p.key_range[2]))):
        return None
    kw = decode_args(p)
    if kw["keep"] is not None or kw["bias"] is not None or kw["alibi_slopes"] is not None \
            or not isinstance(kw["seqlens"], int):
        return None
    # Note [Decode direct call]: a repeated decode call (the plan cache's hit) then does the signature, these
    # few lines and decode_attention's own O(1) checks: the lengths and offsets are fixed int64 tensors the
    # kernel only reads, the keywords fixed; only ``out`` is new each call (the caller keeps it)
    N, H, L, Ev, dtype = p.N, i.H, i.L, i.Ev, p.q.dtype
    n_keys, scale = kw["seqlens"], kw["scale"]
    # one query seeing every key: the kernel through the one-call step (csrc Note [One-call decode step]),
    # which skips decode_attention's Python (it declines, and the wrapper runs, for anything it does not take)
    one_call = (L == 1 and kw["left"] == decode_kernel.UNBOUNDED and kw["right"] == decode_kernel.UNBOUNDED
                and not kw["softcap"])
    kw["seqlens"] = torch.full((N,), kw["seqlens"], dtype=torch.int64)
    kw["mask_offset"] = torch.zeros(N, dtype=torch.int64)
    del kw["alibi_slopes"], kw["alibi_offset"], kw["keep"], kw["bias"]
    run, step = decode_kernel.decode_attention, decode_kernel.step_heads_first

    def decode_direct(query, key, value):  # (N, H, L, E), (N, Hkv, S, E|Ev) -> (N, H, L, Ev)
        if one_call and key.shape[2] == n_keys:
            out = step(query, key, value, False, scale)
            if out is not None:
                return out.transpose(1, 2)  # (N, 1, H, Ev) -> (N, H, 1, Ev): a view, its size-1 dim moved
        out = torch.empty(N, H, L, Ev, dtype=dtype)
        return run(query, key.transpose(1, 2), value.transpose(1, 2), out=out, **kw)[0]

    return decode_direct


def and_parts(pat) -> list:
    """The operands of a pattern's ANDs (a pattern that is no AND is its own single part)."""
    if pat is None:
        return []
    if getattr(pat, "op", None) == "and":
        return and_parts(pat.a) + and_parts(pat.b)
    return [pat]


def is_prefix(kk: torch.Tensor, S: int) -> bool:
    """A key-padding mask [N, >=S] that keeps exactly each row's first n keys (lengths, right padding)."""
    k = kk[:, :S]
    n = k.sum(1, keepdim=True)  # (N, 1)
    return bool((k == (torch.arange(k.shape[1]).unsqueeze(0) < n)).all())
