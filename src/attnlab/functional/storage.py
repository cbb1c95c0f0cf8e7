"""empty_kv_cache: zeroed KV-cache storage on transparent huge pages (2 MiB) where the OS offers them.

Note [KV cache on huge pages]: decode reads a kv head's rows Hkv * D elements apart in a [B, S, Hkv, D] cache
or a [P, T, Hkv, D] page pool (4 KiB for fp32 at 8 heads x 128), so one 32-token tile of K and V touches 64
distinct 4 KiB pages and the walk pays a TLB miss per row (csrc Notes [Decode head span] / [Decode page walk]).
With transparent huge pages set to ``madvise`` (a common default) torch's tensors get 4 KiB pages; an
anonymous mmap advised MADV_HUGEPAGE gets 2 MiB ones, so the same tile touches one or two. Measured (empty_kv_cache's docstring), huge pages speed up the
contiguous [B, Hkv, S, D] cache about as much as the strided ones, so they do not by themselves close the
paged / contiguous gap; they are a win for every layout. Anonymous memory
is zero-filled by the kernel, so the storage needs no clearing pass. ``torch.frombuffer`` holds the mmap
alive for as long as any view of the tensor lives (test_storage.py drops every other reference).

Detection only (``huge_pages_available``): Python's ``mmap.MADV_HUGEPAGE`` exists (Linux) and
/sys/kernel/mm/transparent_hugepage/enabled is not ``[never]``; whether the kernel actually backs the mapping
with huge pages (free contiguous memory, khugepaged) is never promised — ``anon_huge_bytes`` reads it back.
"""
from __future__ import annotations

import mmap
import operator
import re

import torch

from ..files import format_bytes
from ..shapes import AttentionInputError

__all__ = ["empty_kv_cache", "append_kv", "huge_pages_available", "transparent_hugepage_mode", "anon_huge_bytes", "HUGE_PAGE_BYTES",
           "MIN_HUGE_BYTES"]

#: The x86-64 / arm64 (4 KiB base) PMD huge page: the mapping's alignment.
HUGE_PAGE_BYTES = 2 * 1024 * 1024
#: Auto (huge_pages=None) storage below this size takes torch.zeros: it cannot fill one huge page.
MIN_HUGE_BYTES = HUGE_PAGE_BYTES
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def transparent_hugepage_mode() -> str | None:
    """The bracketed word of /sys/kernel/mm/transparent_hugepage/enabled ("always", "madvise", "never"), or None."""
    try:
        with open(_THP_ENABLED) as f:
            m = re.search(r"\[(\w+)\]", f.read())
    except OSError:
        return None
    return m.group(1) if m else None


def huge_pages_available() -> bool:
    """True when an anonymous mmap can be advised MADV_HUGEPAGE: Python's mmap has the flag and transparent
    huge pages are not ``[never]``. Says nothing about whether the kernel will find 2 MiB pages."""
    return hasattr(mmap, "MADV_HUGEPAGE") and transparent_hugepage_mode() in ("always", "madvise")


def _check_shape(shape) -> tuple[int, ...]:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    try:
        dims = tuple(_dim(s) for s in shape)
    except TypeError:
        dims = None
    if dims is None or any(s < 0 for s in dims):
        raise AttentionInputError(f"empty_kv_cache: shape must be ints >= 0, got {list(shape)!r}")
    return dims


def _dim(s) -> int:
    """One dimension: an int or anything with __index__ (numpy ints), not a bool."""
    if isinstance(s, bool):
        raise TypeError("a bool is not a dimension")
    return operator.index(s)


def _huge_tensor(shape: tuple[int, ...], dtype: torch.dtype, nbytes: int) -> torch.Tensor:
    """A zeroed tensor in an anonymous mmap advised MADV_HUGEPAGE, its start aligned to HUGE_PAGE_BYTES (the
    mapping is over-allocated by one huge page: mmap only promises 4 KiB alignment, and a huge page must be
    naturally aligned)."""
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(mm, dtype=torch.uint8)  # keeps mm alive (the buffer protocol's export)
    off = -raw.data_ptr() % HUGE_PAGE_BYTES
    return raw[off: off + nbytes].view(dtype).view(shape)


def empty_kv_cache(*shape: int, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                   huge_pages: bool | None = None) -> torch.Tensor:
    """A zeroed tensor of ``shape`` (ints, or one tuple) and ``dtype`` for a KV cache or a page pool, e.g.
    [B, S, Hkv, D], [B, Hkv, S, D] or [P, T, Hkv, D]; equivalent to ``torch.zeros(*shape, dtype=dtype)``
    except where its storage lives.

    On CPU, with ``huge_pages=None`` (auto), a tensor of at least 2 MiB gets an anonymous mmap advised
    MADV_HUGEPAGE (Note [KV cache on huge pages]) when ``huge_pages_available()``; otherwise torch.zeros.
    ``huge_pages=True`` asks for the mmap at any size (raising when the OS does not offer it),
    ``False`` always takes torch.zeros; a device other than CPU always takes torch.zeros on that device.

    What it buys (measured here: 1-thread CPU time, medians of interleaved rounds with cold caches, then the
    median over 4 runs (run-to-run spread up to ±0.1: a loaded 2-core EPYC); decode GQA 32/8 D 128 S 32768):
    huge / normal storage, fp32 [B, Hkv, S, D] 1.02, [B, S, Hkv, D] 0.98, page pools 16/64/256 0.96; bf16
    0.94, 0.87, 0.88/0.92/0.91; int8 (one run) 1.02, 0.86, 0.86/0.92/0.95. Strided layouts gain the most,
    but the contiguous cache gains too, so paged / contiguous with both on huge pages is fp32 1.19/1.17/1.15
    (normal pages 1.22/1.17/1.15), bf16 1.16/1.10/1.06 (1.28/1.13/1.10), int8 1.11/1.05/1.03 (1.31/1.16/1.10).
    At S = 4096 huge / normal is 0.88-1.03. A cache a user allocates with plain torch.zeros works everywhere
    this one does, on 4 KiB pages.
    Cost: O(numel) virtual memory, touched (and so resident) only where written; one extra 2 MiB of address
    space for alignment.
    """
    shape = _check_shape(shape)
    if not isinstance(dtype, torch.dtype):
        raise AttentionInputError(f"empty_kv_cache: dtype must be a torch.dtype, got {dtype!r}")
    if huge_pages is not None and not isinstance(huge_pages, bool):
        raise AttentionInputError(f"empty_kv_cache: huge_pages must be None (auto), True or False, got {huge_pages!r}")
    numel = 1
    for d in shape:
        numel *= d
    if numel * dtype.itemsize > _MAX_BYTES:  # Python ints: no overflow before the check (issue 40)
        raise AttentionInputError(f"empty_kv_cache: shape {list(shape)} of {dtype} is {numel * dtype.itemsize:.3g} "
                                  f"bytes, past the {_MAX_BYTES:.3g} one tensor can address; pass a smaller shape")
    try:
        return _allocate(shape, dtype, device, huge_pages)
    except (MemoryError, OSError, RuntimeError) as e:
        if isinstance(e, AttentionInputError):
            raise
        why = " ".join(str(e).split())[:160]
        raise AttentionInputError(f"empty_kv_cache: shape {list(shape)} of {dtype} ({format_bytes(numel * dtype.itemsize)}) "
                                  f"could not be allocated ({type(e).__name__}: {why})") from None


#: the most bytes one tensor's storage can hold (its size is an int64 count of bytes)
_MAX_BYTES = 2**63 - 1


def _allocate(shape: tuple[int, ...], dtype: torch.dtype, device, huge_pages: bool | None) -> torch.Tensor:
    """empty_kv_cache's storage, its arguments checked."""
    dev = torch.device("cpu") if device is None else torch.device(device)
    if dev.type != "cpu" or huge_pages is False:
        return torch.zeros(shape, dtype=dtype, device=dev)
    if huge_pages is True and not huge_pages_available():
        raise AttentionInputError(
            f"empty_kv_cache: huge_pages=True but this OS offers no transparent huge pages (mmap.MADV_HUGEPAGE "
            f"{'present' if hasattr(mmap, 'MADV_HUGEPAGE') else 'absent'}, {_THP_ENABLED}: {transparent_hugepage_mode()}); "
            "pass huge_pages=None to fall back to torch.zeros")
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if huge_pages is None and (nbytes < MIN_HUGE_BYTES or not huge_pages_available()):
        return torch.zeros(shape, dtype=dtype)
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return _huge_tensor(shape, dtype, nbytes)


def anon_huge_bytes(t: torch.Tensor) -> int | None:
    """Bytes of ``t``'s storage the kernel backs with huge pages now: the AnonHugePages of the /proc/self/smaps
    mapping holding its first byte (None where smaps cannot be read). Touch the pages first: an unwritten
    mapping has none."""
    addr = t.untyped_storage().data_ptr()
    try:
        with open("/proc/self/smaps") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            inside = int(m.group(1), 16) <= addr < int(m.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return None


def append_kv(cache, new, start: int | None = None, *, pos: torch.Tensor | None = None,
              block_table: torch.Tensor | None = None, dim: int = 1) -> None:
    """Write new key or value rows into a cache in place: the one append of attnlab's caches
    (``attention_with_kvcache``, ``nn``'s ``KVCache``, the Hugging Face in-place cache).

    With ``start``: rows ``start .. start + n - 1`` along ``dim`` (one length for every sequence: a slice copy;
    dim 1 of flash-attn's [B, S, Hkv, D], dim 2 of attnlab's and transformers' [B, Hkv, S, D]). With ``pos``
    [B, n]: sequence b's rows at positions ``pos[b]`` of a [B, S, Hkv, D] cache, or through ``block_table``
    [B, pages] into a page pool [P, T, Hkv, D] (an index_put). An int8 cache (``functional.kvquant.QuantizedKV``:
    ``.data`` and ``.scale``) takes the (data, scale) pair its format encoded, written before nothing else fails
    (Note [Checked, then appended] in ``functional.kvcache``).
    """
    if isinstance(new, tuple):  # an int8 cache: (int8 rows, their scales), written side by side
        data, scale = new
        append_kv(cache.data, data, start, pos=pos, block_table=block_table, dim=dim)
        append_kv(cache.scale, scale, start, pos=pos, block_table=block_table, dim=dim)
        return
    if pos is None:
        cache.narrow(dim, start, new.shape[dim]).copy_(new)
        return
    if block_table is None:
        idx = (torch.arange(pos.shape[0]).unsqueeze(1), pos)  # [B, n, ...] into [B, S, ...]
    else:
        T = cache.shape[1]
        idx = (block_table.long().gather(1, pos // T), pos % T)  # (B, n) pages and offsets
    cache[idx] = new.to(cache.dtype)
