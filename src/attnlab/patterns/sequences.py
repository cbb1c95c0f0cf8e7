"""Which keys belong to which sequence: key padding (lengths, boolean and HF masks) and packed documents.

Legend: B batch, L queries, S keys. Key padding patterns are per batch element (``batch_size == B``)
and materialise to bool [B, 1, L, S]; document patterns are shared and materialise to bool [L, S].
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .base import Pattern, _check_align, _check_bool, _check_int, _check_lengths


class _ByKey(Pattern):
    """Per-batch patterns that keep (i, j) by key alone: ``key_mask(S)[b, j]`` True = key j of batch element b
    takes part, for every query. Subclasses give ``key_mask``; keep, bounds and dead keys follow from it."""

    name: str = "key_padding"
    #: keep(i, j) depends on (b, j) only: an ``&`` with it finds its dead keys exactly (``Pattern.dead_keys``)
    by_key = True

    def key_mask(self, S: int) -> torch.Tensor:
        """Bool [B, S]: True = key j of batch element b takes part (raises ValueError when S does not fit)."""
        raise NotImplementedError

    def _keys(self, S, device):
        """``key_mask(S)`` on ``device``, cached for the last (S, device): tiles ask for it once per block."""
        key = (S, str(device))
        hit = self._memo.get("keys")
        if hit is None or hit[0] != key:
            hit = (key, self.key_mask(S).to(device))
            self._memo["keys"] = hit
        return hit[1]

    def keep(self, i, j, L, S):
        kk = self._keys(S, j.device)[:, j]  # (B, *j.shape)
        return kk & torch.ones_like(i, dtype=torch.bool)  # broadcast over i

    def bounds(self, qlo, qhi, klo, khi, L, S):
        # Some element keeps a pair of the block iff the batch's union keeps a key in [klo, khi]; every
        # element keeps all of it iff the intersection keeps every key there. Prefix counts over those
        # two [S] rows answer any key ranges exactly in O(B·S + blocks).
        kk = self._keys(S, klo.device)
        rows = torch.stack([kk.any(0), kk.all(0)])  # (2, S): union, intersection over the batch
        c = torch.nn.functional.pad(rows.to(torch.int32).cumsum(1), (1, 0))  # (2, S + 1)
        n = c[:, khi + 1] - c[:, klo]  # (2, *klo.shape)
        any_ = (n[0] > 0) & torch.ones_like(qlo, dtype=torch.bool)  # broadcast over query blocks
        all_ = (n[1] == khi - klo + 1) & torch.ones_like(qlo, dtype=torch.bool)
        return any_, all_

    def dead_keys(self, L: int, S: int) -> torch.Tensor:
        """Bool [B, S]: the keys each batch element pads (no query sees them; none at all when L = 0)."""
        return ~self._keys(S, "cpu") if L > 0 else torch.ones(self.batch_size, S, dtype=torch.bool)


@dataclass(frozen=True, eq=False)
class _KeyKeep(_ByKey):
    """Per-batch key mask: keep[b, j] True = key j of batch element b takes part (the mask's S keys)."""

    keep_keys: torch.Tensor
    name: str = "key_padding"
    extends: bool = False  # a mask covers its own S keys only
    _memo: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def batch_size(self):  # type: ignore[override]
        return self.keep_keys.shape[0]

    def key_mask(self, S: int) -> torch.Tensor:
        """The stored mask's first S keys, bool [B, S]; ValueError when it covers fewer than S."""
        kk = self.keep_keys
        if S > kk.shape[1]:
            raise ValueError(f"{self.name} covers {kk.shape[1]} keys but attention has S={S}")
        return kk[:, :S]

    def __repr__(self):
        return f"{self.name}(batch={self.keep_keys.shape[0]}, S={self.keep_keys.shape[1]})"


@dataclass(frozen=True, eq=False)
class _KeyLengths(_ByKey):
    """Right padding by lengths: key j takes part for batch element b when j < lengths[b]. Stored as the
    lengths, so a length costs nothing until a call builds the [B, S] mask it needs."""

    lengths: torch.Tensor  # int64 [B], each in [0, 2**62]
    max_len: int | None = None
    name: str = "key_padding"
    extends: bool = True  # keys past the lengths are padding for any S
    _memo: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def batch_size(self):  # type: ignore[override]
        return self.lengths.shape[0]

    @property
    def keep_keys(self) -> torch.Tensor:
        """Bool [B, max_len] (default width max(lengths)): the lengths as a key mask."""
        return self.key_mask(self._width(), check=False)

    def _width(self) -> int:
        return self.max_len if self.max_len is not None else int(self.lengths.max()) if self.lengths.numel() else 0

    def key_mask(self, S: int, check: bool = True) -> torch.Tensor:
        """Bool [B, S] with key j < lengths[b] kept. ValueError when a length exceeds S: it would describe
        keys that are not there (a lengths tensor for another, longer batch)."""
        if check and self.lengths.numel() and int(self.lengths.max()) > S:
            b = int(self.lengths.argmax())
            raise ValueError(f"key_padding lengths[{b}] = {int(self.lengths[b])} is longer than the attention's "
                             f"key length S={S}: each length must be in [0, S] (lengths "
                             f"{self.lengths.tolist()[:8]}{'...' if len(self.lengths) > 8 else ''})")
        return torch.arange(S).unsqueeze(0) < self.lengths.unsqueeze(1)

    def __repr__(self):
        return f"key_padding(batch={self.lengths.shape[0]}, S={self._width()})"


def key_padding(lengths: torch.Tensor | list[int], max_len: int | None = None) -> Pattern:
    """Keys j < lengths[b] take part for batch element b (right padding).

    ``lengths``: int [B] (tensor or list), each in [0, 2**62]; at a call each must be <= S (ValueError
    naming the length and S otherwise). ``max_len`` (default max(lengths); at least every length) is only
    the width ``keep_keys`` shows: keys past the lengths are padding for any S, so one pattern serves any
    key length. Stored as the lengths: no [B, S] mask exists until a call needs one.
    Materialises to bool [B, 1, L, S]; block bounds are exact (union / intersection over the batch).
    """
    t = _check_lengths("lengths", lengths)
    if max_len is not None:
        _check_int("max_len", max_len, 0)
        if t.numel() and max_len < int(t.max()):
            raise ValueError(f"max_len={max_len} is shorter than the longest of lengths ({int(t.max())}); "
                             "leave max_len=None, or give max_len >= max(lengths)")
    return _KeyLengths(t, max_len)


def from_key_padding_mask(mask: torch.Tensor) -> Pattern:
    """From an ``nn.MultiheadAttention``-style ``key_padding_mask`` bool [B, S] (True = ignore): keys where
    it is False take part. It covers its S keys: attention over more keys raises ValueError (over fewer,
    the first ones are used). A float (additive) mask is refused with TypeError: pass it as ``attn_mask``."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        raise ValueError(f"key_padding_mask must be a 2-D tensor [batch, S], got {getattr(mask, 'shape', mask)}")
    if mask.dtype == torch.bool:
        return _KeyKeep(~mask, name="key_padding_mask")
    if mask.dtype.is_floating_point:
        raise TypeError("a float key_padding_mask is additive; pass it as attn_mask instead")
    raise TypeError(f"key_padding_mask must be bool (True = ignore), got {mask.dtype}")


def from_hf_attention_mask(mask: torch.Tensor) -> Pattern:
    """From a Hugging Face 2-D ``attention_mask`` [B, S] (1 = attend, 0 = padding; any dtype, nonzero =
    attend), the polarity attnlab uses throughout. Covers its S keys, as ``from_key_padding_mask``."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        raise ValueError(f"attention_mask must be a 2-D tensor [batch, S], got {getattr(mask, 'shape', mask)}")
    return _KeyKeep(mask != 0, name="hf_attention_mask")


@dataclass(frozen=True, eq=False)
class _Document(Pattern):
    """Block-diagonal over packed sequences: query i of document d sees keys of document d only.

    Document d holds queries [qs[d], qs[d+1]) and keys [ks[d], ks[d+1]) (cumulative offsets, flash-attn's
    cu_seqlens). Causal keeps local key index <= local query index (+ klen - qlen when bottom_right),
    i.e. j - i <= c[d] with c[d] = ks[d] - qs[d] (+ klen[d] - qlen[d]).
    """

    q_lengths: tuple[int, ...]
    k_lengths: tuple[int, ...]
    causal: bool
    align: str

    def _tables(self, device):
        ql = torch.tensor(self.q_lengths, dtype=torch.long, device=device)
        kl = torch.tensor(self.k_lengths, dtype=torch.long, device=device)
        qs = torch.nn.functional.pad(ql.cumsum(0), (1, 0))  # (D + 1,)
        ks = torch.nn.functional.pad(kl.cumsum(0), (1, 0))
        c = ks[:-1] - qs[:-1] + ((kl - ql) if self.align == "bottom_right" else 0)  # (D,)
        return ql, kl, qs, ks, c

    def _check(self, L, S):
        tq, tk = sum(self.q_lengths), sum(self.k_lengths)
        if L != tq or S != tk:
            raise ValueError(f"{self!r} packs {tq} queries x {tk} keys, but attention has L={L}, S={S}; "
                             "the lengths must add up to the sequence lengths")

    @staticmethod
    def _doc(pos, starts):
        # document of each position: the last d with starts[d] <= pos (empty documents are skipped)
        return torch.bucketize(pos, starts[1:-1], right=True)

    def keep(self, i, j, L, S):
        self._check(L, S)
        _, _, qs, ks, c = self._tables(i.device)
        di, dj = self._doc(i, qs), self._doc(j, ks)
        m = di == dj
        return m & (j - i <= c[di]) if self.causal else m

    def bounds(self, qlo, qhi, klo, khi, L, S):
        # Documents meeting both ranges lie in [d_lo, d_hi]; those strictly inside lie wholly in the block
        # on both sides, so they keep a pair exactly when they have a query and a key. The two end
        # documents are checked on their clipped ranges. Exact, O(blocks).
        self._check(L, S)
        ql, kl, qs, ks, c = self._tables(qlo.device)
        dq0, dq1, dk0, dk1 = self._doc(qlo, qs), self._doc(qhi, qs), self._doc(klo, ks), self._doc(khi, ks)
        d_lo, d_hi = torch.maximum(dq0, dk0), torch.minimum(dq1, dk1)

        def keeps(d):
            d = d.clamp(0, len(ql) - 1)
            qa, qb = torch.maximum(qlo, qs[d]), torch.minimum(qhi, qs[d + 1] - 1)
            ka, kb = torch.maximum(klo, ks[d]), torch.minimum(khi, ks[d + 1] - 1)
            m = (qa <= qb) & (ka <= kb)
            return m & (ka - qb <= c[d]) if self.causal else m

        both = ((ql > 0) & (kl > 0)).to(torch.int32)
        pre = torch.nn.functional.pad(both.cumsum(0), (1, 0))  # documents with a query and a key, before d
        inner = pre[d_hi.clamp(min=0)] - pre[(d_lo + 1).clamp(max=len(ql))] > 0
        any_ = (d_lo <= d_hi) & (keeps(d_lo) | keeps(d_hi) | ((d_hi - d_lo >= 2) & inner))
        all_ = (dq0 == dq1) & (dk0 == dk1) & (dq0 == dk0)
        if self.causal:
            all_ = all_ & (khi - qlo <= c[dq0.clamp(0, len(ql) - 1)])
        return any_, all_

    def counts_analytically(self):
        return True

    def nnz(self, L: int, S: int) -> int:
        """Kept pairs in O(L): each query counts the keys of its document it may see."""
        self._check(L, S)
        ql, kl, qs, ks, c = self._tables("cpu")
        i = torch.arange(L)
        d = self._doc(i, qs)
        if not self.causal:
            return int(kl[d].sum())
        last = torch.minimum(i + c[d], ks[d + 1] - 1)  # last visible key of each query's document
        return int((last - ks[d] + 1).clamp(min=0).sum())

    def __repr__(self):
        kv = "" if self.k_lengths == self.q_lengths else f", kv_lengths={list(self.k_lengths)}"
        al = f", align={self.align!r}" if self.align != "top_left" else ""
        return f"document({list(self.q_lengths)}, causal={self.causal}{kv}{al})"


def document(lengths, causal: bool = False, kv_lengths=None, align: str = "top_left") -> Pattern:
    """Packed variable-length sequences (xformers' BlockDiagonalMask, flash-attn's varlen cu_seqlens):
    query i of document d attends only to keys of document d. Boundaries may fall at any token.

    ``lengths``: tokens per document (queries; also keys unless ``kv_lengths`` is given); they must add
    up to L (and S). ``causal``: within each document, local key index <= local query index
    (``align="bottom_right"`` shifts it by that document's kv_len - q_len, as flash-attn >= 2.1 and
    xformers' BlockDiagonalCausalFromBottomRightMask do). Zero-length documents are allowed.

    ``lengths``, ``kv_lengths``: int [D] (list or tensor), each >= 0. Materialises to bool [L, S]
    (block-diagonal); any other (L, S) raises ValueError naming both totals. Block bounds are exact in
    O(blocks) and ``nnz`` is O(L), so the kernels skip every off-diagonal block without building the mask.
    """
    ql = _check_lengths("lengths", lengths, allow_empty=False)
    kl = ql if kv_lengths is None else _check_lengths("kv_lengths", kv_lengths, allow_empty=False)
    _check_bool("causal", causal)
    if kl.numel() != ql.numel():
        raise ValueError(f"kv_lengths has {kl.numel()} documents but lengths has {ql.numel()}")
    _check_align(align)
    return _Document(tuple(ql.tolist()), tuple(kl.tolist()), causal, align)
