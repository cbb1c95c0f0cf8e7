"""FlexAttention's API on the CPU without a compiler: ``flex_attention(query, key, value, score_mod, block_mask)``.

Legend: B batch, H query heads, Hkv key/value heads (GQA: H = G·Hkv, query head h reads kv head h // G),
L query length, S key length, E head dim, Ev value head dim; b, h, q_idx, kv_idx index them.

``score_mod(score, b, h, q_idx, kv_idx)`` is classified from its torch.fx trace (``flex_trace``, Note
[score_mod by its trace]): what it is at every pair is proved from its graph, never sampled, and a fast path
runs only where the proof is complete:

- none / identity: ``attnlab.attention`` with the mask as a pattern (block skipping in the kernel);
- soft-capping ``cap·tanh(A·score)`` (plus a bias): ``attention(..., softcap=cap)``, A·cap folded into scale;
- affine ``A·score + bias(b, h, q_idx, kv_idx)``, A > 0 one known number, folded into ``scale``. A bias
  proved a function of (h, kv_idx - q_idx) only (T5 buckets, a learned relative table, ALiBi) is evaluated
  once per offset, [H, L + S - 1], and the compiled kernel adds it inside its tiles with the mask as a
  pattern, in one call (Note [Relative bias table]); any other bias is evaluated per query block on the key
  blocks the mask keeps only and passed with them as a float ``attn_mask`` (Note [Kept-blocks bias]).
  Either way its gradient flows, through autograd, into the tensors the function reads;
- anything else, or anything the trace cannot prove: ``general``, blockwise over the kept key blocks with an
  online softmax, the function applied to each block's scores, differentiable through autograd
  (checkpointed per query block). Exact; slower.

``flex_plan`` says which path a call takes and why, without running attention.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .. import patterns as P
from ..shapes import AttentionInputError, shape_str
from .flex_trace import ScoreModKind, classify_score_mod

try:  # torch >= 2.5; attnlab patterns work without it
    from torch.nn.attention.flex_attention import AuxOutput, AuxRequest, BlockMask
except ImportError:  # pragma: no cover - older torch
    AuxOutput = AuxRequest = BlockMask = None

__all__ = ["flex_attention", "flex_plan", "FlexPlan", "classify_score_mod", "probe_score_mod", "ScoreModKind",
           "GENERAL_BLOCK"]

#: block edge of the general path when the mask brings no block size of its own (an attnlab pattern, no mask)
GENERAL_BLOCK = 128


def probe_score_mod(score_mod, B: int | None = None, H: int | None = None, L: int | None = None,
                    S: int | None = None, seed: int = 0) -> ScoreModKind:
    """``classify_score_mod(score_mod)``, under the name of the sampling probe it replaced: the shape and seed
    arguments are accepted and unused, as the classification holds at every shape."""
    return classify_score_mod(score_mod)

@dataclass
class FlexPlan:
    """Which path ``flex_attention`` takes for a call: ``path`` "attention" (attnlab's kernels, with
    ``attention_kwargs`` saying what was passed) or "general" (the blockwise fallback); ``score_mod``
    what its trace proved; ``mask`` how block_mask was read; ``reason`` why this path; ``notes`` costs."""

    path: str
    reason: str
    score_mod: ScoreModKind
    mask: str
    attention_kwargs: dict = field(default_factory=dict)
    block_size: tuple[int, int] | None = None
    notes: list[str] = field(default_factory=list)
    #: how a bias runs on the "attention" path: "relative" (one table per offset in the compiled kernel),
    #: "kept blocks" (per query block, Note [Kept-blocks bias]) or None (no bias)
    bias: str | None = None

    def __str__(self):
        lines = [f"flex_attention path: {self.path} ({self.reason})",
                 f"  score_mod: {self.score_mod.kind} ({self.score_mod.reason})", f"  block_mask: {self.mask}"]
        if self.attention_kwargs:
            lines.append("  attnlab.attention(" + ", ".join(f"{k}={v}" for k, v in self.attention_kwargs.items()) + ")")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


# -- inputs -----------------------------------------------------------------------------------------
def _check_inputs(query, key, value, scale, enable_gqa):
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"flex_attention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise AttentionInputError(f"flex_attention: {name} {shape_str(t)} must be 4-D [B, H, L|S, E|Ev], as in "
                                      "torch's flex_attention")
        if t.device.type != "cpu":
            raise AttentionInputError(f"flex_attention: {name} is on {t.device}; attnlab.flex_attention runs on CPU "
                                      "tensors (use torch.compile(torch.nn.attention.flex_attention) elsewhere)")
        if not t.is_floating_point():
            raise AttentionInputError(f"flex_attention: {name} must be floating point, got {t.dtype}")
    if not (query.dtype == key.dtype == value.dtype):
        raise AttentionInputError(f"flex_attention: query, key and value must share a dtype, got {query.dtype}, "
                                  f"{key.dtype}, {value.dtype}")
    B, H, L, E = query.shape
    if key.shape[0] != B or value.shape[0] != B:
        raise AttentionInputError(f"flex_attention: query {shape_str(query)}, key {shape_str(key)} and value "
                                  f"{shape_str(value)} must have one batch size")
    if key.shape[1] != value.shape[1] or key.shape[2] != value.shape[2]:
        raise AttentionInputError(f"flex_attention: key {shape_str(key)} and value {shape_str(value)} must agree "
                                  "in heads and length")
    if key.shape[3] != E:
        raise AttentionInputError(f"flex_attention: query {shape_str(query)} and key {shape_str(key)} must have one "
                                  "head dim E")
    Hkv = key.shape[1]
    if not enable_gqa and H != Hkv:
        raise AttentionInputError(f"flex_attention: query has {H} heads and key/value {Hkv}; "
                                  "try setting enable_gqa=True for GQA")
    if enable_gqa and (Hkv == 0 or H % Hkv):
        raise AttentionInputError(f"flex_attention: enable_gqa needs query heads ({H}) a multiple of key/value "
                                  f"heads ({Hkv})")
    if scale is not None and not (isinstance(scale, (int, float)) and not isinstance(scale, bool)
                                  and math.isfinite(scale)):
        raise AttentionInputError(f"flex_attention: scale must be a finite float or None, got {scale!r}")
    return 1.0 / math.sqrt(E) if scale is None else float(scale)


def _want(return_lse, return_aux, kernel_options):
    """(lse wanted, max_scores wanted, aux form) from torch's two ways of asking."""
    if kernel_options:
        raise ValueError(f"flex_attention: kernel_options {sorted(kernel_options)} are Triton/Inductor settings; "
                         "attnlab has none to honour: pass kernel_options=None")
    if return_aux is not None:
        if return_lse:
            raise ValueError("flex_attention: give return_lse or return_aux, not both (return_lse is deprecated: "
                             "use return_aux=AuxRequest(lse=True))")
        lse, mx = getattr(return_aux, "lse", None), getattr(return_aux, "max_scores", None)
        if not isinstance(lse, bool) or not isinstance(mx, bool):
            raise TypeError(f"flex_attention: return_aux must be an AuxRequest(lse=..., max_scores=...), got {return_aux!r}")
        return lse, mx, True
    return bool(return_lse), False, False


# -- block masks ------------------------------------------------------------------------------------
def _is_noop(mask_mod) -> bool:
    """Whether a BlockMask's mask_mod keeps everything (torch's noop_mask), found by name: that one is ours
    to know, as torch builds it."""
    return getattr(mask_mod, "__name__", "") == "noop_mask"


@dataclass
class _Mask:
    """block_mask as both paths need it: ``pattern`` for attnlab.attention (None when there is none to
    give, see ``refusal``), ``codes`` int8 [Bm|1, Hm|1, nq, nk] and the block for the general path, and
    ``keep(b, h, i, j)`` the exact per-pair predicate there (None: every pair of a non-empty block)."""

    describe: str
    pattern: P.Pattern | None
    refusal: str | None
    codes: torch.Tensor
    block: tuple[int, int]
    keep: object


def _read_block_mask(block_mask, B, H, L, S, block_size) -> _Mask:
    bq = bk = block_size or GENERAL_BLOCK
    nq, nk = -(-L // bq), -(-S // bk)
    if block_mask is None:
        return _Mask("none", None, None, torch.full((1, 1, nq, nk), P.FULL, dtype=torch.int8), (bq, bk), None)
    if isinstance(block_mask, P.Pattern):
        if block_mask.batch_size not in (None, B):
            raise AttentionInputError(f"flex_attention: block_mask pattern {block_mask!r} is for batch size "
                                      f"{block_mask.batch_size}, query has {B}")
        codes = block_mask.block_layout(L, S, bq, bk).view(1, 1, nq, nk)
        pat = block_mask

        def keep(b, h, i, j):  # (B|1, 1, r, c)
            m = pat.keep(i.view(-1, 1), j.view(1, -1), L, S)
            return m.view(m.shape[0], 1, *m.shape[1:]) if pat.batch_size else m
        return _Mask(f"attnlab pattern {block_mask!r}", block_mask, None, codes, (bq, bk), keep)
    if BlockMask is None or not isinstance(block_mask, BlockMask):
        raise TypeError(f"flex_attention: block_mask must be a torch BlockMask (create_block_mask) or an "
                        f"attnlab.patterns Pattern, got {type(block_mask).__name__}")
    return _read_torch_block_mask(block_mask, B, H, L, S)


def _read_torch_block_mask(bm, B, H, L, S) -> _Mask:
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
    return _Mask(desc, pattern, refusal, codes, (bq, bk), keep)


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
    import weakref

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


# -- the paths -------------------------------------------------------------------------------------
def _leaves(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors requiring grad that ``t`` was computed from (its autograd graph's leaves)."""
    seen, out, todo = set(), [], [t.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if hasattr(fn, "variable"):  # AccumulateGrad
            out.append(fn.variable)
        todo.extend(f for f, _ in fn.next_functions)
    return out


def _row_keys(mask: "_Mask", qb: int, S: int):
    """Key positions of the blocks query block ``qb`` keeps (for any b, h) as a slice when they are one
    range, else an int64 index; and the positions (within those keys) of the blocks that are PARTIAL for
    some (b, h), None when every kept block is FULL everywhere."""
    bq, bk = mask.block
    kept = (mask.codes[:, :, qb] != P.EMPTY).any(0).any(0)  # (nk,)
    kbs = kept.nonzero().view(-1)
    if kbs.numel() == 0:
        return None, None
    part = ~(mask.codes[:, :, qb, kbs] == P.FULL).all(0).all(0)  # (kept,) PARTIAL somewhere
    lo, hi = int(kbs[0]), int(kbs[-1])
    if hi - lo + 1 == kbs.numel():
        cols = slice(lo * bk, min(S, (hi + 1) * bk))
        j = torch.arange(cols.start, cols.stop)
    else:
        j = (kbs.view(-1, 1) * bk + torch.arange(bk)).view(-1)
        cols = j = j[j < S]
    if not bool(part.any()):
        return cols, None
    pblocks = kbs[part]
    return cols, torch.isin(torch.div(j, bk, rounding_mode="floor"), pblocks).nonzero().view(-1)


def _bias_blocks(score_mod, B, H, i, j, dtype):
    """score_mod(0, b, h, q_idx, kv_idx) on rows i [r] x keys j [c] only: float [B|1, H|1, r, c] (broadcast
    over what it does not read; differentiable into the tensors it reads)."""
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    # a zero score with dims, as torch's [B, H, L, S] score has: a float32 bias mixed with it then computes in
    # ``dtype`` (a 0-dim zero would leave ``(s + x) * c`` in float32)
    y = score_mod(torch.zeros(1, 1, 1, 1, dtype=dtype), b, h, i.view(1, 1, -1, 1), j.view(1, 1, 1, -1))
    y = y.view(*([1] * (4 - y.dim())), *y.shape) if y.dim() < 4 else y
    return y.to(dtype).expand(*y.shape[:2], i.numel(), j.numel())


# Note [Relative bias table]: a bias proved a function of (h, kv_idx - q_idx) only (Note [score_mod by its
# trace]) is a table of L + S - 1 values per head: evaluated once per offset (not once per kept pair: the
# per-pair gathers were most of the time of a T5 or learned relative bias) and added by the compiled kernel
# inside its tiles (csrc Note [Relative bias]), whose gradient, summed per diagonal, autograd takes on into the
# captured tensors. The table is score_mod(0, 0, h, lo(d), lo(d) + d) for every h and offset d (lo(d) the
# first q_idx that has it), in float64 (under autograd when it is on), rounded by the kernel to its
# accumulation dtype; a bias made of one operation on float32 tensors rounds to the same float32 value as
# when evaluated in float32 (IEEE operations are correctly rounded). Nothing is sampled: the trace proved
# that every pair of an offset has the table's value (an offset's pairs compute it by the same operations
# on the same (h, kv_idx - q_idx), the q and k coefficients of every index combination cancelling exactly).
def _relative_table(score_mod, H, L, S, dtype):
    """score_mod(0, 0, h, q_idx, kv_idx) once per offset kv_idx - q_idx = t - (L - 1): [H, L + S - 1] in
    ``dtype`` (differentiable into the tensors it reads)."""
    d = torch.arange(-(L - 1), S)  # (W,)
    i = (-d).clamp(min=0)
    h = torch.arange(H).view(H, 1)
    y = score_mod(torch.zeros(1, 1, dtype=dtype), torch.zeros(1, 1, dtype=torch.long), h, i.view(1, -1),
                  (i + d).view(1, -1))
    return torch.broadcast_to(y.to(dtype), (H, d.numel()))


def _relative_bias_attention(query, key, value, rel, mask: "_Mask", kind, scale, enable_gqa):
    """Note [Relative bias table]: one compiled-kernel call with the mask as a pattern and the bias as the
    table per offset ``rel`` [H, L + S - 1] (float64: the kernel rounds it to the
    accumulation dtype, differentiably). Returns out [B, H, L, Ev] and lse [B, H, L] (not differentiable)."""
    from ..kernels import compiled as compiled_kernel
    from ..shapes import prepare
    from . import rates

    p = prepare(query, key, value, None, 0.0, False, scale * kind.factor, enable_gqa, mask.pattern,
                softcap=kind.softcap)
    out, lse = compiled_kernel.compiled_attention(p.q, p.kv_k, p.kv_v, p.mask, p.info.scale,
                                                  *compiled_kernel.compiled_blocks(
                                                      p, None, rates.current().compiled_block_speed),
                                                  rel_bias=rel)
    return out.reshape(p.out_shape), lse.reshape(p.out_shape[:-1])


def _kept_bias_attention(query, key, value, score_mod, mask: "_Mask", kind, scale, enable_gqa, want_lse):
    """Note [Kept-blocks bias]: an affine (or soft-capping) score_mod with a bias runs one query block at a
    time on the key blocks the mask keeps: the bias is evaluated on those (rows x kept keys) only, the
    partial blocks' mask folded in as -inf, and attnlab.attention runs the slab with it as a float
    attn_mask (so its gradient reaches the captured tensors by autograd). Memory: the kept blocks' bias,
    never L x S; keys of a row that form one range are a view, else gathered.
    Returns out [B, H, L, Ev] and lse [B, H, L] (None unless want_lse)."""
    from . import attention, attention_with_lse

    B, H, L, _ = query.shape
    S = key.shape[2]
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    bq, _ = mask.block
    bidx = torch.arange(B).view(B, 1, 1, 1)
    hidx = torch.arange(H).view(1, H, 1, 1)
    outs, lses = [], []
    kw = dict(scale=scale * kind.factor, enable_gqa=enable_gqa, softcap=kind.softcap)
    for qb in range(-(-L // bq)):
        q0, q1 = qb * bq, min(L, (qb + 1) * bq)
        cols, pcols = _row_keys(mask, qb, S)
        if cols is None:  # no key: output 0, lse -inf (as flex_attention)
            outs.append(query.new_zeros(B, H, q1 - q0, value.shape[-1]))
            lses.append(torch.full((B, H, q1 - q0), float("-inf"), dtype=acc))
            continue
        i = torch.arange(q0, q1)
        j = torch.arange(S)[cols]
        bias = _bias_blocks(score_mod, B, H, i, j, acc)  # (B|1, H|1, r, c)
        if pcols is not None and mask.keep is not None:  # the mask, on the partial blocks' keys only
            keep = mask.keep(bidx, hidx, i, j[pcols])
            keep = keep.view(*([1] * (4 - keep.dim())), *keep.shape)  # (B|1, H|1, r, c_partial)
            # the dropped pairs set to -inf (not -inf added: a NaN the bias holds at a dropped pair must vanish
            # there, as in torch, where the mask replaces the score; Note [NaN rows stay NaN])
            kept = torch.ones(*(max(x, y) for x, y in zip(bias.shape[:2], keep.shape[:2])), i.numel(), j.numel(),
                              dtype=torch.bool)
            kept[..., pcols] = keep
            bias = bias.masked_fill(~kept, float("-inf"))
        k, v = key[:, :, cols], value[:, :, cols]
        if want_lse:
            o, lse = attention_with_lse(query[:, :, q0:q1], k, v, attn_mask=bias, **kw)
            lses.append(lse)
        else:
            o = attention(query[:, :, q0:q1], k, v, attn_mask=bias, **kw)
        outs.append(o)
    out = torch.cat(outs, 2) if outs else query.new_zeros(B, H, 0, value.shape[-1])
    lse = (torch.cat(lses, 2) if lses else query.new_zeros(B, H, 0, dtype=acc)) if want_lse else None
    return out, lse


# -- plan -------------------------------------------------------------------------------------------
def _plan(query, key, value, score_mod, block_mask, scale, enable_gqa, want_lse, want_max, block_size):
    B, H, L, _ = query.shape
    S = key.shape[2]
    mask = _read_block_mask(block_mask, B, H, L, S, block_size)
    kind = classify_score_mod(score_mod)
    needs_grad = torch.is_grad_enabled() and (kind.reads_grad or any(t.requires_grad for t in (query, key, value)))
    notes = []
    why = None
    if kind.kind == "general":
        why = "score_mod is not proved affine in the score or soft-capping (its trace: " + kind.reason + ")"
    elif want_max:
        why = "max_scores asked for: the attnlab kernels do not return it"
    elif want_lse and needs_grad:
        why = "lse asked for under autograd: the kernels' lse is not differentiable, the general path's is"
    elif mask.refusal is not None and not kind.has_bias:
        why = f"block_mask: {mask.refusal}"
    bq, bk = mask.block
    if why is not None:
        kept = int((mask.codes != P.EMPTY).any(0).any(0).sum())
        notes.append(f"general path: {kept} of {mask.codes.shape[-2] * mask.codes.shape[-1]} blocks of {bq}x{bk} "
                     f"kept; score_mod called once per kept block on [B, H, {bq}, {bk}] scores; "
                     "checkpointed per query block under autograd (scores recomputed in backward)")
        return FlexPlan("general", why, kind, mask.describe, block_size=(bq, bk), notes=notes), mask, None
    kw = {"scale": f"{scale * kind.factor:.6g}", "enable_gqa": enable_gqa}
    if mask.pattern is not None and not kind.has_bias:
        kw["pattern"] = repr(mask.pattern)
    if kind.softcap is not None:
        kw["softcap"] = f"{kind.softcap:.6g}"
    bias = rel = None
    if kind.has_bias:
        from ..kernels import compiled as compiled_kernel

        if kind.relative and mask.refusal is None and L and S and compiled_kernel.available(query):
            rel = _relative_table(score_mod, H, L, S, torch.float64)
        if rel is not None:
            bias = "relative"
            kw["pattern"] = repr(mask.pattern)
            kw["rel_bias"] = f"score_mod(0, 0, h, q_idx, kv_idx) once per offset kv_idx - q_idx: [{H}, {L + S - 1}]"
            notes.append("the bias is proved a function of (h, kv_idx - q_idx) only by its trace: one compiled-kernel "
                         "call adds it from a table per offset, the mask as a pattern (Note [Relative bias table]); "
                         "memory and gradient O(H·(L + S))")
            if needs_grad and kind.reads_grad:
                from ..kernels.spec import Request
                from ..report import format_bytes

                r = Request(B, H, key.shape[1], L, S, query.shape[-1], value.shape[-1], query.dtype, needs_grad=True,
                            rel_bias_grad=True)
                notes.append(f"backward: the table's gradient is summed in per-unit rows, at most "
                             f"{format_bytes(compiled_kernel.rel_bias_grad_bytes(r, 16))} "
                             "(units x groups x (L + S - 1), csrc Note [Relative bias])")
        else:
            bias = "kept blocks"
            kw["attn_mask"] = "score_mod(0, b, h, q_idx, kv_idx) on the kept blocks, per query block"
            kept = int((mask.codes != P.EMPTY).any(0).any(0).sum())
            nq, nk = mask.codes.shape[-2:]
            notes.append(f"the bias is evaluated per query block of {bq} on the key blocks the mask keeps ({kept} of "
                         f"{nq * nk} blocks of {bq}x{bk}), one attention call per query block (Note [Kept-blocks "
                         "bias]); its memory and gradient are the kept blocks', not L×S")
    reason = {"none": "no score_mod", "identity": "score_mod is the identity",
              "affine": "score_mod is affine in the score: its bias goes in as a float attn_mask",
              "softcap": "score_mod is soft-capping: attention's softcap"}[kind.kind]
    return FlexPlan("attention", reason, kind, mask.describe, attention_kwargs=kw, notes=notes, bias=bias), mask, rel


def flex_plan(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod=None, block_mask=None,
              scale: float | None = None, enable_gqa: bool = False, return_lse: bool = False,
              kernel_options: dict | None = None, *, return_aux=None, block_size: int | None = None) -> FlexPlan:
    """Which path ``flex_attention`` takes for these arguments and why (``FlexPlan``; ``print`` it), from
    score_mod's trace and reading block_mask. Runs no attention."""
    scale = _check_inputs(query, key, value, scale, enable_gqa)
    want_lse, want_max, _ = _want(return_lse, return_aux, kernel_options)
    return _plan(query, key, value, score_mod, block_mask, scale, enable_gqa, want_lse, want_max, block_size)[0]


# -- the general path -------------------------------------------------------------------------------
def _row_block(q, k, v, score_mod, mask: _Mask, scale, q0, blocks, B, H, want_max):
    """Online softmax over the kept key blocks of one query block: q [B, H, r, E] (accumulation dtype),
    k [B, H, S, E], v [B, H, S, Ev] -> out [B, H, r, Ev], lse [B, H, r], max [B, H, r]."""
    r = q.shape[2]
    acc = q.dtype
    bidx = torch.arange(B).view(B, 1, 1, 1)
    hidx = torch.arange(H).view(1, H, 1, 1)
    i = torch.arange(q0, q0 + r)
    m = q.new_full((B, H, r), float("-inf"))
    l = q.new_zeros(B, H, r)
    o = q.new_zeros(B, H, r, v.shape[-1])
    mx = m.clone()
    for k0, k1, partial in blocks:
        j = torch.arange(k0, k1)
        s = torch.matmul(q, k[:, :, k0:k1].transpose(-1, -2)) * scale  # (B, H, r, c)
        if score_mod is not None:
            s = torch.broadcast_to(score_mod(s, bidx, hidx, i.view(1, 1, -1, 1), j.view(1, 1, 1, -1)), s.shape).to(acc)
        if partial and mask.keep is not None:
            s = s.masked_fill(~mask.keep(bidx, hidx, i, j), float("-inf"))
        if want_max:
            mx = torch.maximum(mx, s.amax(-1))
        # Note [Online softmax rescaling]: the running max is detached (the result does not depend on it);
        # a row with nothing kept yet keeps max -inf, shifted by 0 instead
        m_new = torch.maximum(m, s.detach().amax(-1))
        shift = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        p = torch.exp(s - shift.unsqueeze(-1))  # (B, H, r, c)
        alpha = torch.exp(m - shift)  # (B, H, r): 0 where m was -inf
        l = l * alpha + p.sum(-1)
        o = o * alpha.unsqueeze(-1) + torch.matmul(p, v[:, :, k0:k1])
        m = m_new
    # Note [NaN rows stay NaN]: only a row with no kept key (l == 0) gives 0 and lse -inf; a NaN from score_mod
    # (or from the inputs) at any kept pair makes l NaN, and its row NaN, as torch's softmax does: a NaN is
    # the user's signal of a bug, never hidden as a zero row (issue 40, D6)
    dead = l == 0
    l_safe = torch.where(dead, torch.ones_like(l), l)
    out = torch.where(dead.unsqueeze(-1), torch.zeros_like(o), o / l_safe.unsqueeze(-1))
    shift = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    lse = torch.where(dead, torch.full_like(l, float("-inf")), shift + torch.log(l_safe))
    return out, lse, mx


# Note [Recomputed query blocks]: under autograd the general path keeps no scores: each query block's
# forward runs without a graph and its backward runs it again with one (activation checkpointing). Not with
# torch.utils.checkpoint: its first call imports torch._dynamo, and with it torch.fx's symbolic shapes and
# sympy (0.5-1.4 s of a first call in a fresh process; tests/functional/test_flex.py
# test_first_call_imports_no_compiler_stack). _Recomputed takes the block's queries, k, v and the leaves
# score_mod reads (found from one call of it on a single pair: a score_mod that reads a tensor requiring grad
# at some pairs only, by Python control flow on values, would not be seen) as inputs, so autograd routes the
# gradients the recomputation finds to them; the recomputation differentiates through the captured tensors'
# own graph to those leaves (retained, as every query block walks it). One backward only (no double backward).
class _Recomputed(torch.autograd.Function):
    """(out, lse, max) of ``run(qs)`` for one query block, recomputed in the backward (Note [Recomputed
    query blocks]). Inputs: run, qs [B, H, r, E], k, v (which run reads), then the leaves score_mod reads."""

    @staticmethod
    def forward(ctx, run, qs, k, v, *leaves):
        # the very tensors (not saved copies): the recomputation's graph must reach these objects
        ctx.run, ctx.inputs = run, (qs, k, v, *leaves)
        return run(qs)  # autograd is off inside forward: no graph, no scores kept

    @staticmethod
    def backward(ctx, *grads):
        qs, k, v, *leaves = ctx.inputs  # kept: a retained graph may run this backward again (gradcheck does)
        wrt = [qs.detach().requires_grad_(ctx.needs_input_grad[1])] + [k, v] + list(leaves)
        need = [ctx.needs_input_grad[1], ctx.needs_input_grad[2], ctx.needs_input_grad[3],
                *ctx.needs_input_grad[4:]]
        pick = [i for i, n in enumerate(need) if n]
        with torch.enable_grad():
            outs = ctx.run(wrt[0])
            pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad]
            # a scalar sum(o · g), not grad_outputs=g: torch.autograd.grad imports torch.fx's symbolic shapes
            # and sympy on its first call with grad_outputs (the vector-Jacobian product is the same, exactly)
            total = sum((o * g).sum() for o, g in pairs) if pairs else None
        got = torch.autograd.grad(total, [wrt[i] for i in pick], allow_unused=True,
                                  retain_graph=True) if pairs and pick else []
        res = [None] * len(wrt)
        for i, gi in zip(pick, got):
            res[i] = gi
        return (None, *res)


def _general(query, key, value, score_mod, mask: _Mask, scale, want_max):
    """out [B, H, L, Ev] (query's dtype), lse [B, H, L] and max [B, H, L] (accumulation dtype) by online
    softmax over the blocks ``mask.codes`` keeps (union over batch and heads), per query block."""
    B, H, L, _ = query.shape
    S = key.shape[2]
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    G = H // key.shape[1]
    q, k, v = query.to(acc), key.to(acc), value.to(acc)
    if G > 1:  # (B, Hkv, S, E) -> (B, H, S, E): query head h reads kv head h // G
        k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    bq, bk = mask.block
    kept = mask.codes.amax(dim=(0, 1))  # (nq, nk): EMPTY only where every (b, h) is empty
    full_all = (mask.codes == P.FULL).all(0).all(0)
    grad = torch.is_grad_enabled()
    leaves = []
    if grad and score_mod is not None:  # the tensors requiring grad score_mod reads (Note [Recomputed query blocks])
        z = torch.zeros(1, 1, 1, 1, dtype=torch.long)
        y = score_mod(torch.zeros(1, 1, 1, 1, dtype=acc), z, z, z, z)
        leaves = _leaves(y) if isinstance(y, torch.Tensor) and y.requires_grad else []
    outs, lses, maxes = [], [], []
    for qb in range(-(-L // bq)):
        q0, q1 = qb * bq, min(L, (qb + 1) * bq)
        blocks = [(kb * bk, min(S, (kb + 1) * bk), not bool(full_all[qb, kb]))
                  for kb in range(kept.shape[1]) if int(kept[qb, kb]) != P.EMPTY]

        def run(qs, q0=q0, blocks=blocks):
            return _row_block(qs, k, v, score_mod, mask, scale, q0, blocks, B, H, want_max)
        if grad and (q.requires_grad or k.requires_grad or v.requires_grad or leaves):
            o, lse, mx = _Recomputed.apply(run, q[:, :, q0:q1], k, v, *leaves)
        else:
            o, lse, mx = run(q[:, :, q0:q1])
        outs.append(o), lses.append(lse), maxes.append(mx)
    out = torch.cat(outs, 2).to(query.dtype) if outs else query.new_zeros(B, H, 0, value.shape[-1])
    lse = torch.cat(lses, 2) if lses else q.new_zeros(B, H, 0)
    mx = torch.cat(maxes, 2) if maxes else q.new_zeros(B, H, 0)
    return out, lse, mx


# -- the API ----------------------------------------------------------------------------------------
def flex_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod=None, block_mask=None,
                   scale: float | None = None, enable_gqa: bool = False, return_lse: bool = False,
                   kernel_options: dict | None = None, *, return_aux=None, block_size: int | None = None):
    """``torch.nn.attention.flex_attention`` on CPU tensors, forward and backward, with no compile step.

    Args:
        query: [B, H, L, E]; key: [B, Hkv, S, E]; value: [B, Hkv, S, Ev] (Hkv = H, or H = G·Hkv with enable_gqa).
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, applied to each scaled score
            ``q·k·scale`` before the softmax. It is called on broadcasting index tensors (int64), never
            per element, so it must use tensor operations (indexing a captured table by ``q_idx - kv_idx``
            works). Tensors it reads that require grad get their gradient.
        block_mask: a torch ``BlockMask`` (``create_block_mask``, ``BlockMask.from_kv_blocks``: its full and
            partial blocks and its ``mask_mod`` on the partial ones) or an ``attnlab.patterns`` Pattern
            (e.g. ``from_mask_mod``); None keeps every pair.
        scale: default 1/sqrt(E). enable_gqa: as in torch.
        return_lse / return_aux: as in torch: ``return_aux=AuxRequest(lse=True, max_scores=True)`` returns
            ``(out, AuxOutput(lse, max_scores))``; ``return_lse=True`` (deprecated in torch) ``(out, lse)``.
            lse [B, H, L] is the natural log-sum-exp of the modified, masked scores; max_scores [B, H, L]
            their maximum; both float32 (float64 for float64 inputs), -inf for a row with no key.
        kernel_options: torch's Triton settings; attnlab has none, so anything but None/{} is an error.
        block_size: (attnlab) block edge of the general path when block_mask brings none (default 128).

    Returns: out [B, H, L, Ev] in query's dtype (0 for a row with no key), and lse / AuxOutput as asked.

    Paths (``flex_plan`` says which one a call takes and why): score_mod is classified from its torch.fx
    trace, once per score_mod object (``classify_score_mod``, Note [score_mod by its trace]): what it is at
    every pair is proved from its graph, and a score_mod the trace does not prove runs the exact general
    path. None / identity / soft-capping run ``attnlab.attention`` with the mask as a
    pattern (a BlockMask proved to be a band runs as attnlab's band pattern, Note [Bands proved once per
    BlockMask]); a score_mod affine in the score, ``A·score + bias(b, h, q_idx, kv_idx)``, whose bias is proved
    a function of (h, kv_idx - q_idx) only evaluates it once per offset and runs one compiled-kernel call
    (Note [Relative bias table]: memory O(H·(L + S))); another bias is evaluated on the kept blocks only, one
    query block at a time (memory: the kept blocks', never L×S). Either way its gradient reaches the
    captured tensors by autograd. Any other score_mod, or
    max_scores, or lse under autograd, or a per-head BlockMask, takes the general path: O(L·S·E) time over
    the kept blocks, scores of one query block at a time in memory (recomputed in backward).

    Equivalent to: ``s = q @ k.transpose(-2, -1) * scale; s = score_mod(s, b, h, i, j); s[~mask] = -inf;
    out = softmax(s, -1) @ v``.
    """
    scale = _check_inputs(query, key, value, scale, enable_gqa)
    want_lse, want_max, aux = _want(return_lse, return_aux, kernel_options)
    if block_size is not None and (not isinstance(block_size, int) or block_size < 1):
        raise ValueError(f"flex_attention: block_size must be a positive int or None, got {block_size!r}")
    plan, mask, rel = _plan(query, key, value, score_mod, block_mask, scale, enable_gqa, want_lse, want_max, block_size)
    B, H, L, _ = query.shape
    S = key.shape[2]
    lse = mx = None
    if plan.path == "general":
        out, lse, mx = _general(query, key, value, score_mod, mask, scale, want_max)
    else:
        from . import attention, attention_with_lse

        kind = plan.score_mod
        kw = dict(scale=scale * kind.factor, enable_gqa=enable_gqa, pattern=mask.pattern, softcap=kind.softcap)
        if plan.bias == "relative":
            out, lse = _relative_bias_attention(query, key, value, rel, mask, kind, scale, enable_gqa)
            lse = lse if want_lse else None
        elif kind.has_bias:
            out, lse = _kept_bias_attention(query, key, value, score_mod, mask, kind, scale, enable_gqa, want_lse)
        elif want_lse:
            out, lse = attention_with_lse(query, key, value, **kw)
        else:
            out = attention(query, key, value, **kw)
    if aux:
        return out, AuxOutput(lse=lse if want_lse else None, max_scores=mx if want_max else None)
    return (out, lse) if want_lse else out
