"""FlexAttention-style ``mask_mod`` functions as patterns, with block layouts evaluated once and cached."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .base import Pattern, _block_sizes, _broadcast_shape, _check_int, _layout


class _HeadUsed(Exception):
    """Raised inside a mask_mod when it reads h (caught by ``_MaskMod.keep``, which names the function)."""


class _HeadIndex(torch.Tensor):
    """h as a mask_mod sees it: a 0-d int64 zero whose every use (an op, a comparison, ``int(h)``, indexing
    by it) raises ``_HeadUsed``. Patterns are shared by all heads, so a mask that reads h is refused rather
    than silently evaluated at h = 0."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise _HeadUsed(getattr(func, "__name__", str(func)))


@dataclass(frozen=True, eq=False)
class _MaskMod(Pattern):
    """A FlexAttention mask_mod as a pattern; block layouts found from the full grid, cached."""

    fn: object
    B: int | None
    name: str
    # (L, S, block_q, block_k, device) -> (any, all) per block; shared across calls (the function is pure)
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def batch_size(self):  # type: ignore[override]
        return self.B

    def keep(self, i, j, L, S):
        # Note [One index dtype]: q_idx, kv_idx (and b) are int64 wherever a pattern is evaluated
        # (materialize, block layouts, kernel tiles), so arithmetic such as i * 2**20 + j gives one answer
        # everywhere and ``pattern=p`` equals ``attn_mask=p.materialize(L, S)``
        i, j = i.to(torch.long), j.to(torch.long)
        shape = _broadcast_shape(i.shape, j.shape)
        zero = torch.zeros((), dtype=torch.long, device=i.device)
        b = zero if self.B is None else torch.arange(self.B, device=i.device).view(-1, *([1] * len(shape)))
        h = zero.as_subclass(_HeadIndex)
        try:
            m = self.fn(b, h, i, j)
        except _HeadUsed as e:
            raise ValueError(f"mask_mod {self.name} reads h (the head index: {e} on h); attnlab patterns are "
                             "shared by all heads, so per-head mask_mods are refused. Write the mask without h, "
                             "or pass a per-head bool attn_mask [B, H, L, S] instead") from None
        if m is None or not isinstance(m, (torch.Tensor, bool)):
            raise TypeError(f"mask_mod {self.name} must return a bool tensor (True = keep) built from q_idx and "
                            f"kv_idx, got {type(m).__name__}")
        if not isinstance(m, torch.Tensor):
            m = torch.tensor(m, device=i.device)
        if m.device != i.device:
            what = "a meta tensor (a shape without values)" if m.device.type == "meta" else f"a tensor on {m.device}"
            raise TypeError(f"mask_mod {self.name} returned {what}, but its indices are on {i.device}; build the "
                            "mask from q_idx and kv_idx with tensor operations")
        if m.dtype != torch.bool:
            raise TypeError(f"mask_mod {self.name} must return a bool tensor, got {m.dtype}")
        out_shape = ((self.B,) if self.B is not None else ()) + tuple(shape)
        try:
            return torch.broadcast_to(m, out_shape)
        except RuntimeError:
            raise ValueError(f"mask_mod {self.name} returned shape {list(m.shape)}, which does not broadcast to "
                             f"the index grid {list(out_shape)} (b, q_idx, kv_idx broadcast)") from None

    def block_layout(self, L: int, S: int, block_q: int, block_k: int | None = None,
                     device: torch.device | str | None = None) -> torch.Tensor:
        """As ``Pattern.block_layout``, exact, evaluated once per (L, S, block shape) and cached; a block
        shape that is a multiple of a cached one is pooled from it instead of evaluated again."""
        block_q, block_k = _block_sizes(block_q, block_k)
        dev = str(torch.device(device)) if device is not None else "cpu"
        key = (L, S, block_q, block_k, dev)
        if key not in self._cache:
            base = next((k for k in self._cache if k[:2] == (L, S) and k[4] == dev
                         and block_q % k[2] == 0 and block_k % k[3] == 0), None)
            if base is not None:
                any_, all_ = self._cache[base]
                fq, fk = block_q // base[2], block_k // base[3]
                self._cache[key] = (_reduce_grid(any_, fq, fk, "any"), _reduce_grid(all_, fq, fk, "all"))
            else:
                self._cache[key] = self._grid_bounds(L, S, block_q, block_k, device)
            while len(self._cache) > 32:  # bounded: a long-running process sees many shapes
                self._cache.pop(next(iter(self._cache)))
        any_, all_ = self._cache[key]
        return _layout(any_, all_)

    def _slices(self, L, S, rows, device):
        """(r0, r1, mask [r1 - r0, S] or [B, r1 - r0, S]) over the grid, about 1M pairs each: small enough to
        stay in cache between the function's element-wise ops. Indices are int64, as everywhere a pattern is
        evaluated (Note [One index dtype]: int32 here once overflowed where the kernels' int64 did not)."""
        j = torch.arange(S, device=device).unsqueeze(0)  # (1, S)
        step = max(1, (1 << 20) // max(1, rows * S)) * rows
        for r0 in range(0, L, step):
            r1 = min(L, r0 + step)
            i = torch.arange(r0, r1, device=device).unsqueeze(1)  # (r, 1)
            yield r0, r1, self.keep(i, j, L, S)

    def _grid_bounds(self, L, S, block_q, block_k, device):
        """Exact (any, all) per block from the full L x S grid, slice by slice of whole query blocks."""
        nq, nk = -(-L // block_q), -(-S // block_k)
        any_ = torch.zeros(nq, nk, dtype=torch.bool, device=device)
        all_ = torch.zeros(nq, nk, dtype=torch.bool, device=device)
        alive = torch.zeros(self.B or 1, S, dtype=torch.bool, device=device)  # keys some query keeps
        for r0, r1, m in self._slices(L, S, block_q, device):
            m_any, m_all = (m.any(0), m.all(0)) if self.B is not None else (m, m)
            alive |= m.any(-2).view(-1, S)
            q0, q1 = r0 // block_q, -(-r1 // block_q)
            any_[q0:q1] = _reduce_grid(m_any, block_q, block_k, "any")
            all_[q0:q1] = _reduce_grid(m_all, block_q, block_k, "all")
        self._cache[("dead", L, S)] = ~alive.cpu()
        return any_, all_

    def dead_keys(self, L: int, S: int) -> torch.Tensor:
        """As ``Pattern.dead_keys``: found in the same pass over the grid as the block layout and cached
        with it (a first call builds the 128 x 128 layout, which coarser layouts are pooled from)."""
        key = ("dead", L, S)
        if key not in self._cache:
            if L <= 0 or S <= 0:
                return super().dead_keys(L, S)
            self._cache[(L, S, 128, 128, "cpu")] = self._grid_bounds(L, S, 128, 128, "cpu")  # fills key
            dead = self._cache[key]
            while len(self._cache) > 32:
                self._cache.pop(next(iter(self._cache)))
            return dead
        return self._cache[key]

    def nnz(self, L: int, S: int) -> int:
        """Kept pairs (averaged over the batch when per-batch), counted once per (L, S) and cached."""
        key = ("nnz", L, S)
        if key not in self._cache:
            total = sum(int(m.sum()) for _, _, m in self._slices(L, S, 1, "cpu"))
            self._cache[key] = int(round(total / (self.B or 1)))
        return self._cache[key]

    def __repr__(self):
        return f"from_mask_mod({self.name}" + (f", B={self.B})" if self.B is not None else ")")


def _reduce_blocks(m: torch.Tensor, b: int, dim: int, how: str) -> torch.Tensor:
    """any/all over consecutive runs of ``b`` along ``dim`` (0 or 1) of a 2-D bool tensor; a shorter last
    run is reduced on its own, so no padded copy is made."""
    n = m.shape[dim]
    nf = n // b * b
    red = torch.any if how == "any" else torch.all
    x = m.narrow(dim, 0, nf)
    full = red(x.reshape(n // b, b, m.shape[1]), 1) if dim == 0 else red(x.reshape(m.shape[0], n // b, b), 2)
    if nf == n:
        return full
    tail = red(m.narrow(dim, nf, n - nf), dim, keepdim=True)
    return torch.cat([full, tail], dim)


def _reduce_grid(m: torch.Tensor, bq: int, bk: int, how: str) -> torch.Tensor:
    """any/all over (bq x bk) tiles of a 2-D bool grid [n, k] -> [ceil(n / bq), ceil(k / bk)]; edge tiles
    are reduced over what they hold. Serves both a pair grid (to blocks) and a block grid (to coarser blocks)."""
    return _reduce_blocks(_reduce_blocks(m, bk, 1, how), bq, 0, how)


def from_mask_mod(mask_mod, B: int | None = None, H: int | None = None, name: str | None = None) -> Pattern:
    """A pattern from a FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor`` (True = keep).

    The function is called on index tensors that broadcast against each other (never per element), so
    it must use tensor operations (``&``, ``|``, ``torch.where``, indexing a tensor by q_idx). As in
    ``torch.nn.attention.flex_attention.create_block_mask``, ``B=None`` evaluates it at b = 0 and the
    mask is shared by the whole batch; ``B=n`` evaluates b = 0 .. n-1 and the pattern is per batch
    element (its batch size must then match the input's). Heads: the mask is shared by all heads, so it
    must not read h: a function that uses h in any way raises ValueError naming it (pass ``H=None`` or 1;
    for per-head masks give a per-head bool ``attn_mask`` [B, H, L, S] instead).

    The function gets b: int64 [B, 1, 1] (or a 0-d zero when ``B=None``), h: a 0-d stand-in that refuses
    every use, q_idx: int64 [r, 1] and kv_idx: int64 [1, S] for a strip of r query rows (int64 wherever the
    pattern is evaluated, so ``pattern=p`` equals ``attn_mask=p.materialize(L, S)``), and returns a bool
    tensor that broadcasts to [r, S] ([B, r, S]). The pattern materialises to bool [L, S] ([B, 1, L, S]
    when ``B`` is given). It is called once on a 1 x 1 grid at construction, so a function that reads h
    or returns something other than a bool tensor is refused there, with its name.

    The block layout comes from evaluating the function on the full L x S grid in slices (O(L·S) work,
    vectorised), once per (L, S, block shape), and is cached on the pattern: the function must be pure.
    """
    if not callable(mask_mod):
        raise TypeError(f"mask_mod must be callable as mask_mod(b, h, q_idx, kv_idx), got {type(mask_mod).__name__}")
    if B is not None:
        _check_int("B", B, 1)
    if H is not None:
        _check_int("H", H, 1)
        if H != 1:
            raise ValueError(f"from_mask_mod: per-head masks are not supported (H={H}); use H=None (shared by all "
                             "heads) or a per-head bool attn_mask [B, H, L, S]")
    nm = name or getattr(mask_mod, "__name__", None) or type(mask_mod).__name__
    p = _MaskMod(mask_mod, B, nm)
    p.keep(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long), 1, 1)  # refuse h, None, meta now
    return p
