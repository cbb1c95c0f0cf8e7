"""Key/value caches for incremental decoding: one ``LayerCache`` per attention layer, grouped in a ``KVCache``.

Legend: B batch, Hkv key/value heads, S cached length, D key head dim, Dv value head dim.

A cache stores the keys *after* positional rotation (RoPE), so a new query at position ``offset + i``
only needs its own rotation. Appends write in place into preallocated storage: ``reserve(n)`` (generate
reserves prompt + new tokens up front) makes every later append a copy of the new rows only; past the
reserve, storage grows by doubling (O(1) amortised). The cached keys are strided views of that storage,
which the decode kernel (kernels/decode.py) reads in place. The storage is ``attnlab.empty_kv_cache``'s
(huge pages where the OS offers them and the storage is >= 2 MiB: functional/storage.py Note [KV cache on
huge pages]); the values are the same as on ordinary pages.
"""
from __future__ import annotations

import torch

from ..functional.storage import append_kv, empty_kv_cache

__all__ = ["LayerCache", "KVCache"]


def _storage_like(ref: torch.Tensor, *shape: int) -> torch.Tensor:
    """Cache storage of ``shape`` with ``ref``'s dtype and device (zeroed; on huge pages where offered)."""
    return empty_kv_cache(*shape, dtype=ref.dtype, device=ref.device)


class LayerCache:
    """Keys [B, Hkv, S, D] and values [B, Hkv, S, Dv] of one attention layer.

    ``static=True`` is for cross-attention: the projected encoder memory is stored once and reused.
    The first layer that writes into a cache claims it (``owner``); another layer passing the same
    cache later gets a ValueError instead of attending over someone else's keys.
    """

    def __init__(self, static: bool = False):
        self.static = static
        self.owner: object | None = None
        self._k: torch.Tensor | None = None  # (B, Hkv, capacity, D)
        self._v: torch.Tensor | None = None  # (B, Hkv, capacity, Dv)
        self.length = 0
        self.reserved = 0  # positions to allocate at the first append

    @property
    def capacity(self) -> int:
        """Positions the storage holds before it must grow (0 before the first write)."""
        return 0 if self._k is None else self._k.shape[2]

    def reserve(self, n: int) -> None:
        """Make room for ``n`` positions in all, so appends up to that length never reallocate: recorded until
        the first append (which knows B, Hkv, D and the dtype), or the storage grown now."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"reserve takes an int >= 0, got {n!r}")
        self.reserved = max(self.reserved, n)
        if self._k is not None and not self.static and n > self.capacity:
            self._grow(n)

    def _grow(self, cap: int) -> None:
        nk = _storage_like(self._k, *self._k.shape[:2], cap, self._k.shape[3])
        nv = _storage_like(self._v, *self._v.shape[:2], cap, self._v.shape[3])
        nk[:, :, : self.length] = self._k[:, :, : self.length]
        nv[:, :, : self.length] = self._v[:, :, : self.length]
        self._k, self._v = nk, nv

    def __repr__(self) -> str:
        shape = None if self._k is None else [*self._k.shape[:2], self.length, self._k.shape[-1]]
        return f"LayerCache(length={self.length}, keys={shape}, static={self.static})"

    def claim(self, owner: object, what: str) -> None:
        """Record ``owner`` (the attention layer about to write) on first use; raise ValueError, naming
        ``what``, when another layer already filled this cache: its keys would silently be attended over."""
        if self.owner is None:
            self.owner = owner
        elif self.owner is not owner:
            raise ValueError(
                f"this cache was filled by another attention layer ({self.owner!r:.80}), not by {what}; "
                "create a fresh one with model.new_cache() (or attnlab.nn.LayerCache()) for each model"
            )

    @property
    def keys(self) -> torch.Tensor | None:
        """The cached keys [B, Hkv, S, D] (a view of the storage, S = ``length``), or None before the first write."""
        return None if self._k is None else self._k[:, :, : self.length]

    @property
    def values(self) -> torch.Tensor | None:
        """The cached values [B, Hkv, S, Dv] (a view of the storage, S = ``length``), or None before the first write."""
        return None if self._v is None else self._v[:, :, : self.length]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k [B, Hkv, T, D], v [B, Hkv, T, Dv]; return all keys and values so far."""
        if self._k is None:
            cap = max(16, 2 * k.shape[2], self.reserved)
            self._k = _storage_like(k, *k.shape[:2], cap, k.shape[3])  # (B, Hkv, capacity, D)
            self._v = _storage_like(v, *v.shape[:2], cap, v.shape[3])
        else:
            if k.shape[:2] != self._k.shape[:2] or k.shape[3] != self._k.shape[3] or v.shape[3] != self._v.shape[3]:
                raise ValueError(
                    f"cache holds keys [{', '.join(map(str, self._k.shape[:2]))}, S, {self._k.shape[3]}] but got "
                    f"new keys {list(k.shape)}: a cache is for one model and one batch; start a new one"
                )
            if k.dtype != self._k.dtype or k.device != self._k.device:
                raise ValueError(f"cache holds {self._k.dtype} on {self._k.device}, got {k.dtype} on {k.device}")
        need = self.length + k.shape[2]
        if need > self._k.shape[2]:
            self._grow(max(need, 2 * self._k.shape[2]))
        # in-place writes into detached storage: a cache is for inference (generation), not training
        append_kv(self._k, k.detach(), self.length, dim=2)  # the one append (``functional.storage.append_kv``)
        append_kv(self._v, v.detach(), self.length, dim=2)
        self.length = need
        return self.keys, self.values

    def set_static(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k [B, Hkv, S, D], v [B, Hkv, S, Dv] as the whole cache (detached, not copied): the encoder
        memory of cross-attention, projected once and reused at every decoding step."""
        self._k, self._v, self.length = k.detach(), v.detach(), k.shape[2]

    def reorder(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` (beam search, dropping finished sequences)."""
        if self._k is not None:
            self._k, self._v = self._k[index], self._v[index]


class KVCache:
    """One ``LayerCache`` per layer of a model (self-attention, and cross-attention when present).

    Made by ``model.new_cache()``; remembers which model made it so a cache of another model is
    refused with a clear error.
    """

    def __init__(self, num_layers: int, *, cross: bool = False, owner: object | None = None):
        self.owner = owner
        self.self_attn = [LayerCache() for _ in range(num_layers)]
        self.cross_attn = [LayerCache(static=True) for _ in range(num_layers)] if cross else None

    @property
    def length(self) -> int:
        """Number of positions already cached (the position offset of the next token)."""
        return self.self_attn[0].length if self.self_attn else 0

    def __len__(self) -> int:
        return len(self.self_attn)

    def __repr__(self) -> str:
        return f"KVCache(layers={len(self.self_attn)}, length={self.length}, cross={self.cross_attn is not None})"

    def check(self, owner: object, num_layers: int) -> None:
        """Raise before a model uses this cache if it was made by another model (``owner`` is the model
        about to run) or has a different number of layers than ``num_layers`` (ValueError)."""
        if not isinstance(self, KVCache):
            raise TypeError(f"cache must be an attnlab.nn.KVCache, got {type(self).__name__}")
        if self.owner is not None and self.owner is not owner:
            raise ValueError(
                f"this cache was made by another model ({type(self.owner).__name__} at {id(self.owner):#x}); "
                "create one with model.new_cache() for the model you are running"
            )
        if len(self.self_attn) != num_layers:
            raise ValueError(f"cache has {len(self.self_attn)} layers but the model has {num_layers}; "
                             "create one with model.new_cache()")

    def reserve(self, n: int) -> None:
        """Room for ``n`` positions in every self-attention layer's cache (``LayerCache.reserve``), so a
        generation of known length appends in place without reallocating."""
        for c in self.self_attn:
            c.reserve(n)

    def reorder(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` (int64 [B']) in every layer's cache (beam search, dropping finished sequences)."""
        for c in self.self_attn + (self.cross_attn or []):
            c.reorder(index)
