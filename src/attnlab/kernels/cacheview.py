"""A call against a KV cache, prepared: what ``attention_with_kvcache`` and the Hugging Face generation step hand
the planner (``kernels.planner.plan_cache``) once their arguments are checked and the new rows appended.

Legend: B batch, L queries, H query heads, Hkv key/value heads, S keys seen (the longest sequence's), D head dim,
Dv value head dim, P pages of T tokens.

The cache is read where it lies, in flash-attn's layout: q [B, L, H, D], k / v [P, T, Hkv, D|Dv] (a contiguous
cache is P = B pages of T = capacity tokens; any strides with a dense last dim), an optional block table, one
length for every sequence or a length per sequence, a key window, and an int8 cache's per-row scales. As
xformers carries paging in its bias types, the view says what kind of cache it is (``Request.cache``: contiguous,
lengths, paged; ``Request.quantized``), and each kernel declares which it reads (``KernelSpec.cache_views``);
the planner refuses the others with that reason. A kernel that reads a view implements ``Kernel.run_cache``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .spec import Request

__all__ = ["CacheCall", "UNBOUNDED", "layout_of", "dequantize_rows"]

#: a window side that is not bounded (keys i - left .. i + right; far beyond any cache, no int64 overflow)
UNBOUNDED = 1 << 50


# Note [Cache layouts]: the view is flash-attn's [P, T, Hkv, D], over either memory order. A heads-first cache
# (attnlab's and transformers' [B, Hkv, S, D], passed transposed) keeps each head's rows contiguous, as SDPA
# reads them; flash-attn's own tokens-first memory interleaves the heads, and SDPA on such views reads strided
# rows. The decode kernel reads both through strides. The planner's plain-decode rule (Note [Plain MHA decode])
# was measured heads-first, and on tokens-first caches SDPA lost to the decode kernel at every length measured
# (MHA 8 x 64 fp32, 2 threads, per call: S 512 135 vs 60 us, S 4096 628 vs 354 us), so SDPA declares
# heads-first caches only (``KernelSpec.cache_layouts``) and a tokens-first call is refused there with this note.
def layout_of(t: torch.Tensor) -> str:
    """The memory order of a [P, T, Hkv, D] cache view t: "heads-first" when a head's rows are contiguous in
    memory (stride of a head >= T rows of it, or one head), else "tokens-first"."""
    return "heads-first" if t.shape[2] == 1 or t.stride(2) >= t.shape[1] * t.stride(1) else "tokens-first"


def dequantize_rows(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 data [.., D] and its float32 scale [..] (per row) or [.., groups] (per group of D / groups channels:
    functional.kvquant's Note [int8 KV groups]) -> data · scale, float32 [.., D]. The one dequantisation of
    attnlab's int8 rows (``functional.kvquant`` reads it from here)."""
    x = data.to(torch.float32)
    if scale.dim() == data.dim():  # (.., groups): each group of D / groups channels times its scale
        ng = scale.shape[-1]
        return (x.reshape(*x.shape[:-1], ng, -1) * scale.unsqueeze(-1)).reshape(x.shape)
    return x * scale.unsqueeze(-1)


@dataclass
class CacheCall:
    """One checked call against a KV cache (see the module docstring).

    q: [B, L, H, D]; k, v: [P, T, Hkv, D|Dv] (int8 data with ``k_scale`` / ``v_scale`` float32 [P, T, Hkv], or
    [P, T, Hkv, D|Dv / group size] for the group format of functional.kvquant's Note [int8 KV groups]);
    seqlens: keys per sequence, an int (every sequence) or int64 [B]; query i of sequence b sits at position
    ``seqlens[b] - L + i`` and sees keys ``pos - left .. pos + right`` (causal: right = 0) below seqlens[b];
    block_table: int32 [B, pages] or None (sequence b is page b); keep: bool [B|1, H|1, L|1, >=S] (a padded
    batch's mask, True = attend) or None; alibi_slopes: float32 [H] or [B, H]; splits: forced key splits;
    sinks: attention sinks [H], one logit per query head (Note [Attention sinks] in ``kernels.lse``) or None.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: float
    seqlens: int | torch.Tensor
    block_table: torch.Tensor | None = None
    left: int = UNBOUNDED
    right: int = UNBOUNDED
    softcap: float | None = None
    alibi_slopes: torch.Tensor | None = None
    keep: torch.Tensor | None = None
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    splits: int | None = None
    need_lse: bool = False
    sinks: torch.Tensor | None = None

    @property
    def S(self) -> int:
        """The most keys any sequence sees."""
        s = self.seqlens
        return s if isinstance(s, int) else (int(s.max()) if s.numel() else 0)

    @property
    def kind(self) -> str:
        """"paged", "lengths" (a length per sequence) or "contiguous" (one length, sequence b in rows [b, :S])."""
        return "paged" if self.block_table is not None else "contiguous" if isinstance(self.seqlens, int) else "lengths"

    @property
    def layout(self) -> str:
        """"heads-first" (each kv head's rows contiguous in memory: a [B, Hkv, S, D] cache read through a
        transposed view) or "tokens-first" (flash-attn's [B, S, Hkv, D] memory): Note [Cache layouts]."""
        return layout_of(self.k) if layout_of(self.v) == "heads-first" else "tokens-first"

    @property
    def quantized(self) -> bool:
        """An int8 cache (k and v int8 with per-row scales)."""
        return self.k_scale is not None

    @property
    def windowed(self) -> bool:
        """Whether the window can hide a key at some S (else no key is hidden at any S: ``banded`` is False)."""
        return self.left < UNBOUNDED or self.right < self.q.shape[1] - 1

    def banded(self, S: int | None = None) -> bool:
        """Whether the window hides some key from some query (the last query at S - 1 sees back to key 0 when
        left >= S - 1; the first, at S - L, sees the last key when right >= L - 1)."""
        S = self.S if S is None else S
        L = self.q.shape[1]
        return not (self.left >= S - 1 and self.right >= L - 1)

    def request(self) -> Request:
        """The call as the planner sees it: sizes and flags (a window that hides keys is a pattern)."""
        B, L, H, D = self.q.shape
        S = self.S
        a = self.alibi_slopes
        return Request(B, H, self.k.shape[2], L, S, D, self.v.shape[3], self.q.dtype, self.q.device.type,
                       pattern=self.banded(S), keep_mask=self.keep is not None, softcap=bool(self.softcap),
                       alibi=None if a is None else "[H]" if a.dim() == 1 else "[B, H]", needs_lse=self.need_lse,
                       cache=self.kind, cache_layout=self.layout, quantized=self.quantized, sinks=self.sinks is not None)

    def plan_key(self, S: int | None) -> tuple:
        """Everything of ``request()`` but the key count ``S`` (the call's, given; None where the call has no
        window), as a tuple: the memo key of ``planner.plan_cache`` (Note [Cache plans]). Whether the window
        hides keys is judged at S."""
        a, q = self.alibi_slopes, self.q
        return (self.kind, self.layout, self.k_scale is not None, q.shape, q.dtype, q.device.type, self.k.shape[2], self.v.shape[3],
                self.windowed and self.banded(S), self.keep is not None, bool(self.softcap),
                None if a is None else a.dim(), self.need_lse, self.sinks is not None)

    # -- the cache as ordinary tensors, for kernels that read no view (and for other devices) -----------------
    def lengths(self) -> torch.Tensor:
        """int64 [B]: each sequence's keys."""
        B = self.q.shape[0]
        return torch.full((B,), self.seqlens, dtype=torch.int64) if isinstance(self.seqlens, int) else self.seqlens

    def gathered(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) [B, Hkv, S, D|Dv]: each sequence's first S keys gathered through the block table (an int8
        cache dequantised, in ``dtype``, default the stored or q's); a sequence's rows past its own length
        are page 0's or whatever the rows hold, never seen (``mask`` hides them)."""
        B, S = self.q.shape[0], self.S
        k, v = self.k, self.v
        if self.quantized:
            k, v = dequantize_rows(k, self.k_scale), dequantize_rows(v, self.v_scale)
        if self.block_table is None:
            kd, vd = k[:, :S], v[:, :S]
        else:
            T = k.shape[1]
            j = torch.arange(S)
            used = torch.arange(self.block_table.shape[1]).unsqueeze(0) * T < self.lengths().unsqueeze(1)
            table = self.block_table.long().masked_fill(~used, 0)
            page = table[:, j // T] if S else torch.zeros(B, 0, dtype=torch.long)
            kd, vd = k[page, j % T], v[page, j % T]  # (B, S, Hkv, D)
        dt = dtype or (self.q.dtype if self.quantized else kd.dtype)
        return kd.transpose(1, 2).to(dt), vd.transpose(1, 2).to(dt)

    def mask(self) -> torch.Tensor | None:
        """The keys each query sees as one SDPA mask [B, H|1, L, S]: bool, or float with ALiBi (-inf where
        hidden); None when every query sees every key of every sequence."""
        B, L, H, _ = self.q.shape
        S = self.S
        n = self.lengths()
        j = torch.arange(S).view(1, 1, S)
        pos = torch.arange(L).view(1, L, 1) + (n - L).view(B, 1, 1)  # (B, L, 1)
        keep = None
        if not isinstance(self.seqlens, int) or self.banded(S):
            keep = ((j < n.view(B, 1, 1)) & (j >= pos - self.left) & (j <= pos + self.right)).unsqueeze(1)
        if self.keep is not None:
            kk = self.keep[..., :S].to(torch.bool)
            keep = kk if keep is None else keep & kk
        if self.alibi_slopes is None:
            return None if keep is None else keep.to(self.q.device)
        sl = self.alibi_slopes.to(torch.float32).view(-1, H, 1, 1)
        bias = -sl * (pos.unsqueeze(1) - j.view(1, 1, 1, S)).abs().to(torch.float32)  # (B, H, L, S)
        if keep is not None:
            bias = bias.masked_fill(~keep, float("-inf"))
        return bias.to(self.q.device)
