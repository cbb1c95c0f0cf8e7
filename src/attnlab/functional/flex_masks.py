"""``flex_attention``'s block masks read for attnlab (beside ``patterns.block_mask``'s conversions): a torch
``BlockMask`` or an attnlab pattern becomes the pattern the planner's door runs (a band proved once per BlockMask:
Note [Bands proved once per BlockMask]), the block codes of the general path and its exact per-pair predicate.

Legend: B batch, H query heads, L query length, S key length; bq, bk the block edges.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from .. import patterns as P
from ..shapes import AttentionInputError

try:  # torch >= 2.5; attnlab patterns work without it
    from torch.nn.attention.flex_attention import BlockMask
except ImportError:  # pragma: no cover - older torch
    BlockMask = None

__all__ = ["FlexMask", "read_block_mask", "GENERAL_BLOCK"]

#: block edge of the general path when the mask brings no block size of its own (an attnlab pattern, no mask)
GENERAL_BLOCK = 128


def _is_noop(mask_mod) -> bool:
    """Whether a BlockMask's mask_mod keeps everything (torch's noop_mask), found by name: that one is ours
    to know, as torch builds it."""
    return getattr(mask_mod, "__name__", "") == "noop_mask"


@dataclass
class FlexMask:
    """block_mask as both paths need it: ``pattern`` for attnlab.attention (None when there is none to
    give, see ``refusal``), ``codes`` int8 [Bm|1, Hm|1, nq, nk] and the block for the general path, and
    ``keep(b, h, i, j)`` the exact per-pair predicate there (None: every pair of a non-empty block)."""

    describe: str
    pattern: P.Pattern | None
    refusal: str | None
    codes: torch.Tensor
    block: tuple[int, int]
    keep: object


def read_block_mask(block_mask, B, H, L, S, block_size) -> FlexMask:
    """``flex_attention``'s block_mask (None, an attnlab pattern or a torch BlockMask) for inputs of (B, H, L, S):
    the pattern the planner's door runs, the block codes and the exact per-pair predicate of the general path."""
    bq = bk = block_size or GENERAL_BLOCK
    nq, nk = -(-L // bq), -(-S // bk)
    if block_mask is None:
        return FlexMask("none", None, None, torch.full((1, 1, nq, nk), P.FULL, dtype=torch.int8), (bq, bk), None)
    if isinstance(block_mask, P.Pattern):
        if block_mask.batch_size not in (None, B):
            raise AttentionInputError(f"flex_attention: block_mask pattern {block_mask!r} is for batch size "
                                      f"{block_mask.batch_size}, query has {B}")
        codes = block_mask.block_layout(L, S, bq, bk).view(1, 1, nq, nk)
        pat = block_mask

        def keep(b, h, i, j):  # (B|1, 1, r, c)
            m = pat.keep(i.view(-1, 1), j.view(1, -1), L, S)
            return m.view(m.shape[0], 1, *m.shape[1:]) if pat.batch_size else m
        return FlexMask(f"attnlab pattern {block_mask!r}", block_mask, None, codes, (bq, bk), keep)
    if BlockMask is None or not isinstance(block_mask, BlockMask):
        raise TypeError(f"flex_attention: block_mask must be a torch BlockMask (create_block_mask) or an "
                        f"attnlab.patterns Pattern, got {type(block_mask).__name__}")
    return _read_torch_block_mask(block_mask, B, H, L, S)


def _read_torch_block_mask(bm, B, H, L, S) -> FlexMask:
    bq, bk = (int(x) for x in bm.BLOCK_SIZE)
    huge = bq >= 2**29 and bk >= 2**29  # torch's stand-in for "no mask"
    if not huge and tuple(bm.seq_lengths) != (L, S):
        raise AttentionInputError(f"flex_attention: block_mask was built for (Q_LEN, KV_LEN) = {tuple(bm.seq_lengths)}, "
                                  f"the inputs have ({L}, {S}); build it again for these lengths, or attnlab.patterns.adjust(block_mask, "
                                  f"{L}, {S}, align=...) it "
                                  "(torch's _adjust crops to the top left, wrong for bottom-right masks)")
    if bm.kv_num_blocks.device.type != "cpu":
        raise AttentionInputError(f"flex_attention: block_mask is on {bm.kv_num_blocks.device}; build it with "
                                  "device='cpu'")
    codes = P.block_codes(bm)  # (Bm, Hm, nq, nk)
    Bm, Hm = codes.shape[:2]
    if Bm not in (1, B) or Hm not in (1, H):
        raise AttentionInputError(f"flex_attention: block_mask has (B, H) = ({Bm}, {Hm}), the query ({B}, {H}); "
                                  "each must be 1 or equal")
    nq, nk = -(-L // bq), -(-S // bk)
    codes = codes[..., :nq, :nk]
    mm = bm.mask_mod
    noop = _is_noop(mm)

    def keep(b, h, i, j):  # exact torch semantics: full blocks, and partial blocks where mask_mod keeps
        c = codes[:, :, torch.div(i, bq, rounding_mode="floor").view(-1, 1), torch.div(j, bk, rounding_mode="floor").view(1, -1)]
        if noop:
            return c != P.EMPTY
        m = mm(b, h, i.view(1, 1, -1, 1), j.view(1, 1, 1, -1))
        return (c == P.FULL) | ((c == P.PARTIAL) & m)

    desc = f"torch BlockMask (blocks {bq}x{bk}, (B, H) = ({Bm}, {Hm}), mask_mod {getattr(mm, '__name__', mm)!r})"
    memo = _memo_of(bm)
    if ("pattern", B) not in memo:  # one pattern object per BlockMask: the kernels' layouts are cached per pattern
        try:
            memo[("pattern", B)] = P.from_block_mask(bm, B=B), None
        except (ValueError, TypeError) as e:
            memo[("pattern", B)] = None, f"not an attnlab pattern ({e})"
    pattern, refusal = memo[("pattern", B)]
    if pattern is not None and not noop and pattern.batch_size is None:
        band = _band_of(bm, mm, codes, L, S, bq, bk)
        if band is not None:
            pattern = band
            desc += f", proved equal to {band!r}"
    return FlexMask(desc, pattern, refusal, codes, (bq, bk), keep)


# Note [Bands proved once per BlockMask]: a BlockMask whose mask_mod is a band (causal, sliding windows)
# runs as attnlab's band pattern, whose kernels need no mask_mod call per tile (one mask tile per
# diagonal); the BlockMask's own blocks must be the band's, and ``patterns.as_band(..., blocks=)`` proves
# mask_mod equal to the band on the BlockMask's PARTIAL blocks only (every pair of them that intervals on
# sub-tiles of an eighth of a block cannot settle): torch never calls mask_mod on a FULL or EMPTY block, so those are
# settled by the layout check, and the proof skips as_band's search over the whole grid (21 -> 15 ms for a
# causal window at L = S = 16384, fresh process). The answer is kept per BlockMask object
# (weakly: a mask built once per training run pays once), so mask_mod must be pure, as for every pattern;
# so is the pattern ``from_block_mask`` makes of it (the kernels cache their layouts per pattern object, so a
# new pattern per call rebuilt the mask tiles of every partial block on every call). Before the proof, a
# necessary condition on the BlockMask's own blocks (square ones): a band's block (I, J) depends on J - I
# only, so blocks one step down the diagonal must be equal (the last row and column, which the lengths may
# cut, aside); a mask that fails it (documents, prefix LM) is no band, without evaluating mask_mod
# (as_band's proof cost a document mask 45 ms at L = S = 16384).
_MEMO: "weakref.WeakKeyDictionary" = None  # BlockMask -> {(L, S): band pattern | None, ("pattern", B): ...}


def _memo_of(bm) -> dict:
    """The per-BlockMask memo of Note [Bands proved once per BlockMask] (a fresh dict when ``bm`` is not
    weak-referenceable)."""
    global _MEMO
    if _MEMO is None:
        _MEMO = weakref.WeakKeyDictionary()
    try:
        return _MEMO.setdefault(bm, {})
    except TypeError:  # not weak-referenceable
        return {}


def _diagonal_invariant(c: torch.Tensor) -> bool:
    """Whether block codes c [nq, nk] depend on J - I only, off the last row and column (a band's, for
    square blocks: Note [Bands proved once per BlockMask])."""
    return c.shape[0] < 3 or c.shape[1] < 3 or torch.equal(c[1:-1, 1:-1], c[:-2, :-2])


def _band_of(bm, mm, codes, L, S, bq, bk):
    memo = _memo_of(bm)
    if (L, S) not in memo:
        if bq == bk and not _diagonal_invariant(codes[0, 0]):
            memo[(L, S)] = None
            return None
        pq, pk = (codes[0, 0] == P.PARTIAL).nonzero(as_tuple=True)  # the only blocks that call mask_mod
        band = P.as_band(mm, L, S, (bq, bk), blocks=(pq, pk))
        if band is not None:
            want = P.torch_layout(band, L, S, (bq, bk))
            if not torch.equal(want, codes[0, 0]) or not bool((codes == codes[:1, :1]).all()):
                band = None
        memo[(L, S)] = band
    return memo[(L, S)]
