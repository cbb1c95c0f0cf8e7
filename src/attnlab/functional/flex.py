"""FlexAttention's API on the CPU without a compiler: ``flex_attention(query, key, value, score_mod, block_mask)``.

Legend: B batch, H query heads, Hkv key/value heads (GQA: H = G·Hkv, query head h reads kv head h // G),
L query length, S key length, E head dim, Ev value head dim; b, h, q_idx, kv_idx index them.

``score_mod(score, b, h, q_idx, kv_idx)`` is told apart by probing it (never by reading its source),
vectorised, on whole lines of (b, h, q_idx, kv_idx) that cover every value of each index and every offset
q_idx - kv_idx, plus random points: O(L + S) points, with several float64 scores each (Notes [Probing
score_mod], [Structured probes]; a departure confined to isolated (q_idx, kv_idx) pairs off those lines is
not seen):

- none / identity: ``attnlab.attention`` with the mask as a pattern (block skipping in the kernel);
- soft-capping ``cap·tanh(score / cap)`` (plus an optional bias): ``attention(..., softcap=cap)``;
- affine in the score ``c·score + bias(b, h, q_idx, kv_idx)``, c > 0 the same everywhere, the factor c
  folded into ``scale``. A bias that probes as relative, ``bias(h, q_idx - kv_idx)`` (T5 buckets, a learned
  relative table, ALiBi), is evaluated once per offset, [H, L + S - 1], and the compiled kernel adds it
  inside its tiles with the mask as a pattern, in one call (Note [Relative bias probe]); any other bias is
  evaluated per query block on the key blocks the mask keeps only and passed with them as a float
  ``attn_mask`` (Note [Kept-blocks bias]). Either way its gradient flows, through autograd, into the
  tensors the function reads;
- anything else: ``general``, blockwise over the kept key blocks with an online softmax, the function
  applied to each block's scores, differentiable through autograd (checkpointed per query block).

``flex_plan`` says which path a call takes and why, without running attention.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .. import patterns as P
from ..shapes import AttentionInputError, shape_str

try:  # torch >= 2.5; attnlab patterns work without it
    from torch.nn.attention.flex_attention import AuxOutput, AuxRequest, BlockMask
except ImportError:  # pragma: no cover - older torch
    AuxOutput = AuxRequest = BlockMask = None

__all__ = ["flex_attention", "flex_plan", "FlexPlan", "probe_score_mod", "ScoreModKind", "GENERAL_BLOCK"]

#: block edge of the general path when the mask brings no block size of its own (an attnlab pattern, no mask)
GENERAL_BLOCK = 128

# Note [Probing score_mod]: scores per probe point. Both signs, zero, magnitudes from 1e-1 to 1e3, so a
# function that is affine only near 0 (tanh gating, clamps), piecewise (where(score > 0, ...)) or
# polynomial cannot pass as affine; float64 so that an affine function's residual is at rounding level
# (relative 1e-9 is ~10^7 ulps of slack and still far below any curvature these scores expose).
# _BIG probes soft-capping: cap·tanh(_BIG / cap) == cap exactly in float64 for any cap < 2e4.
_SCORES = (-1000.0, -37.5, -2.3, -0.71, 0.0, 0.43, 1.9, 11.0, 250.0)
_BIG = 1e6
#: the scores of the line points (Note [Structured probes]), plus one random score and _BIG: fewer, as
#: there are O(L + S) of them; the random points carry all of _SCORES
_LINE_SCORES = (-1000.0, 0.0, 250.0)
_POINTS = 24
_RTOL = 1e-9


@dataclass(frozen=True)
class ScoreModKind:
    """What probing a score_mod found: ``kind`` is "none", "identity", "affine", "softcap" or "general";
    ``factor`` the constant c of an affine ``c·score + bias``; ``softcap`` the cap; ``has_bias`` whether
    the bias term is not identically 0 on the probes; ``reason`` in words; ``reads_grad`` whether its
    value depends on a tensor that requires grad (a captured table)."""

    kind: str
    reason: str
    factor: float = 1.0
    softcap: float | None = None
    has_bias: bool = False
    reads_grad: bool = False


@dataclass
class FlexPlan:
    """Which path ``flex_attention`` takes for a call: ``path`` "attention" (attnlab's kernels, with
    ``attention_kwargs`` saying what was passed) or "general" (the blockwise fallback); ``score_mod``
    the probe's finding; ``mask`` how block_mask was read; ``reason`` why this path; ``notes`` costs."""

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
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
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


# -- probing score_mod ------------------------------------------------------------------------------
# Note [Structured probes]: random points alone miss a score_mod that singles out one index value (a bias
# on key 7 only, on one query, one head, one batch element): 24 points out of L·S almost never land on it,
# and the call would be misread as the identity, silently wrong. So the probe points hold lines that cover
# every value of each index on its own: _LINES query rows (every kv_idx at a fixed q_idx), _LINES key
# columns (every q_idx at a fixed kv_idx), every offset kv_idx - q_idx once (the diagonal band), every h
# and every b; b and h cycle along the long lines, so each row and column meets every head and batch
# element too; plus the _POINTS random points (the corners among them). That is O(L + S + H + B) points
# (about 5·L for L = S), each with the scores of Note [Probing score_mod], never O(L·S). What it proves:
# a score_mod whose departure from the kind found depends on one index alone (b, h, q_idx, kv_idx or
# q_idx - kv_idx, any value) is seen. What it does not: a departure confined to isolated (q_idx, kv_idx)
# pairs, or to a conjunction such as (q_idx == 5) & (kv_idx == 7), off those lines, can still pass; and a
# block_mask does not narrow the probe (a bias misread outside the kept blocks is harmless, inside not).
# The values are classified on every point; the gradient check of a score_mod that reads a tensor requiring
# grad (_grad_only_in_bias: that tensor enters through the bias only) runs on the random points and on
# _GRAD_POINTS random line points, not on all O(L + S): its two backward passes over every line point were
# most of a first call's probe (260 ms at L = S = 4096). So a learned factor confined to one index value whose
# value now equals the others' (s * w[k] with w = 1 everywhere, say at initialisation) can pass that check;
# once its values differ, the value check on the lines sees it.
_LINES = 2


def _probe_points(B, H, L, S, g):
    """The probe's (b, h, q_idx, kv_idx), each int64 [n], of Note [Structured probes]."""
    n = _POINTS
    idx = [torch.randint(0, max(1, d), (n,), generator=g) for d in (B, H, L, S)]
    for t, d in zip(idx, (B, H, L, S)):
        t[0], t[1] = 0, max(0, d - 1)
    pts = [idx]

    def rnd(d, m):
        return torch.randint(0, max(1, d), (m,), generator=g)

    def cyc(d, m, k=0):
        return (torch.arange(m) + k) % max(1, d)
    for k in range(_LINES):
        q0, k0 = int(rnd(L, 1)), int(rnd(S, 1))
        pts.append([cyc(B, S, k), cyc(H, S, k), torch.full((S,), q0), torch.arange(S)])  # row q_idx = q0
        pts.append([cyc(B, L, k + 1), cyc(H, L, k + 1), torch.arange(L), torch.full((L,), k0)])  # column kv_idx = k0
    if L > 0 and S > 0:
        d = torch.arange(-(L - 1), S)  # every offset kv_idx - q_idx, at a random q_idx it has
        lo, hi = (-d).clamp(min=0), (S - 1 - d).clamp(max=L - 1)
        qd = lo + (torch.rand(d.numel(), generator=g, dtype=torch.float64) * (hi - lo + 1)).long().clamp(max=hi - lo)
        pts.append([rnd(B, d.numel()), rnd(H, d.numel()), qd, qd + d])
    pts.append([rnd(B, H), torch.arange(H), rnd(L, H), rnd(S, H)])  # every head
    pts.append([torch.arange(B), rnd(H, B), rnd(L, B), rnd(S, B)])  # every batch element
    return [torch.cat([p[a] for p in pts]) for a in range(4)]


def _probe_count(B, H, L, S) -> int:
    """How many (b, h, q_idx, kv_idx) points probe_score_mod evaluates (Note [Structured probes])."""
    return _POINTS + _LINES * (L + S) + (L + S - 1 if L and S else 0) + H + B


def probe_score_mod(score_mod, B: int, H: int, L: int, S: int, seed: int = 0) -> ScoreModKind:
    """Tell a score_mod's kind apart by calling it, vectorised, on the (b, h, q_idx, kv_idx) points of Note
    [Structured probes] (lines covering every value of each index, every offset q_idx - kv_idx, and random
    points) with the float64 scores of Note [Probing score_mod]; see the module docstring for the kinds."""
    if score_mod is None:
        return ScoreModKind("none", "no score_mod")
    if not callable(score_mod):
        raise TypeError(f"flex_attention: score_mod must be callable as score_mod(score, b, h, q_idx, kv_idx), "
                        f"got {type(score_mod).__name__}")
    return _probe(score_mod, B, H, L, S, seed)[0]


def _probe(score_mod, B, H, L, S, seed=0):
    """(probe_score_mod's answer, [((b, h, q_idx, kv_idx) (n, 1) each, score_mod(0, ...) float64 (n,))] at
    the probe points, for _relative_probe to reuse: Note [Relative bias probe])."""
    if score_mod is None:
        return ScoreModKind("none", "no score_mod"), []
    if not callable(score_mod):
        raise TypeError(f"flex_attention: score_mod must be callable as score_mod(score, b, h, q_idx, kv_idx), "
                        f"got {type(score_mod).__name__}")
    name = getattr(score_mod, "__name__", type(score_mod).__name__)
    biases = []
    groups = [_classify(score_mod, name, s, idx, scores, seed, where, biases)
              for s, idx, scores, where in _probe_inputs(B, H, L, S, seed)]
    return _combine(*groups), biases


# Note [Probe inputs per shape]: the probe's points and scores (Notes [Structured probes], [Relative bias
# probe]) depend on (B, H, L, S, seed) only, not on the score_mod: they are drawn once per shape and kept for
# the last _SHAPES shapes (a training loop calls one shape again and again; at L = S = 16384 they are about
# 8 MB). Nothing writes to them: a score_mod that modified its score argument in place would corrupt them,
# as it would corrupt the probe's own comparison.
_SHAPES = 4
_PROBE_INPUTS: dict = {}  # (what, B, H, L, S, seed) -> inputs


def _memo(key, make):
    hit = _PROBE_INPUTS.get(key)
    if hit is None:
        hit = make()
        while len(_PROBE_INPUTS) >= 2 * _SHAPES:  # the oldest first (dicts keep insertion order)
            _PROBE_INPUTS.pop(next(iter(_PROBE_INPUTS)), None)
        _PROBE_INPUTS[key] = hit
    return hit


def _probe_inputs(B, H, L, S, seed):
    """[(scores float64 (n, k + 1), (b, h, q_idx, kv_idx) int64 (n, 1) each, the fixed scores, words)] for the
    random points and the line points (Note [Probe inputs per shape])."""
    def make():
        g = torch.Generator().manual_seed(seed)
        idx = _probe_points(B, H, L, S, g)
        out = []
        for part, scores in ((slice(0, _POINTS), _SCORES), (slice(_POINTS, None), _LINE_SCORES)):
            b, h, qi, ki = (t[part] for t in idx)
            n = b.numel()
            if n == 0:
                continue
            b, h, qi, ki = (t.view(n, 1) for t in (b, h, qi, ki))  # (n, 1): broadcast against the scores
            k = len(scores)  # (n, k + k // 3 + 1): the fixed scores, random ones in [-10, 10), _BIG; in place
            s = torch.empty(n, k + k // 3 + 1, dtype=torch.float64)
            s[:, :k] = torch.tensor(scores, dtype=torch.float64)
            s[:, k:-1] = torch.rand(n, k // 3, generator=g, dtype=torch.float64).mul_(20).sub_(10)
            s[:, -1] = _BIG
            where = f"{n} {'random' if part.start == 0 else 'line'} points x {s.shape[1] - 1} scores"
            out.append((s, (b, h, qi, ki), scores, where))
        return out
    return _memo(("points", B, H, L, S, seed), make)


def _classify(score_mod, name, s, idx, scores, seed, where, biases=None):
    """(ScoreModKind, factor free) from score_mod at the points idx ((n, 1) each) and scores s (n, k + 1),
    the last column _BIG; ``free``: every pair was -inf, so any factor fits. Appends (idx, score_mod at score
    0) to ``biases`` when it gets that far."""
    b, h, qi, ki = idx
    zero, lo, hi = scores.index(0.0), scores.index(-1000.0), scores.index(250.0)
    y = score_mod(s, b, h, qi, ki)
    if not isinstance(y, torch.Tensor) or not y.is_floating_point():
        raise TypeError(f"flex_attention: score_mod {name} must return a float tensor built from score with tensor "
                        f"operations, got {type(y).__name__ if not isinstance(y, torch.Tensor) else y.dtype}")
    try:
        y = torch.broadcast_to(y, s.shape)
    except RuntimeError:
        raise ValueError(f"flex_attention: score_mod {name} returned shape {list(y.shape)} for scores "
                         f"{list(s.shape)}; it must act element-wise (b, h, q_idx, kv_idx broadcast)") from None
    reads_grad = y.requires_grad
    if reads_grad and not _grad_only_in_bias(score_mod, y, s, idx, seed):
        return ScoreModKind("general", "a tensor that requires grad enters through more than an additive bias "
                            "(its gradient depends on the score)", reads_grad=True), False
    y = y.detach().to(torch.float64)
    ys, yb, sb = y[:, :-1], y[:, -1], s[:, :-1]
    c = ys[:, zero]  # the bias term: score_mod(0, ...)
    if biases is not None:
        biases.append((idx, c))
    # identity needs c == 0 (the score 0 column): checked first, an (n,) pass instead of an (n, k) one
    if bool((c == 0).all()) and bool((ys == sb).all()):
        if reads_grad:  # a learned bias that is 0 now (a zero-initialised table): still a bias, for its gradient
            return ScoreModKind("affine", "score_mod(score) == score + bias, the bias 0 on the probes but read from "
                                "a tensor that requires grad", has_bias=True, reads_grad=True), False
        return ScoreModKind("identity", f"score_mod(score) == score on {where}"), False
    if _FAST_CHECKS and _sum_is_finite(y):  # Note [Fused probe checks]: every value finite, none masked
        return _classify_finite(ys, yb, sb, c, lo, hi, where, reads_grad), False
    # points whose every value is -inf are masked pairs: consistent with any kind that has a bias
    masked = torch.isneginf(y).all(1)
    any_masked = bool(masked.any())
    live = ~masked
    if not bool(torch.isfinite(y[live] if any_masked else y).all()):
        return ScoreModKind("general", "non-finite values on some scores of a pair (not affine, not soft-capping)",
                            reads_grad=reads_grad), False
    if any_masked:  # (a boolean index copies: skipped when every pair is live)
        ys, yb, sb, c = ys[live], yb[live], sb[live], c[live]
    if ys.shape[0] == 0:
        return ScoreModKind("affine", "every probed pair is -inf: a mask written as a score_mod", has_bias=True,
                            reads_grad=reads_grad), True
    return _classify_finite(ys, yb, sb, c, lo, hi, where, reads_grad, any_masked, exact=True), False


# Note [Fused probe checks]: _classify's checks are full passes over (n, k) float64 values, n the ~5·L line
# points of Note [Structured probes] (at L = S = 16384, 98k points x 4 scores, 3 MB per temporary, each a fresh
# allocation that faults its pages in): a dozen of them were most of the probe's 20 ms even for
# ``score + 0.5``. The answers stay exactly those of the plain checks (kept as the ``exact`` branch, and run
# whenever a fused one does not settle it; _FAST_CHECKS = False runs them alone, and the tests compare):
# - identity needs score_mod(0) == 0 at every point, an (n,) check before the (n, k) one;
# - a finite sum of every value proves every value finite (an inf or NaN makes the sum inf or NaN; an
#   overflowing sum of finite values only sends the call to the plain checks), so no pair is masked and the
#   isneginf/isfinite passes are skipped;
# - the affine check |y - fit| <= tol, tol = _RTOL·(|score|·|slope| + |c| + 1) >= _RTOL, holds everywhere if
#   max |y - fit| <= _RTOL, with fit computed by the same operations (so bitwise the same values) in one
#   temporary, in place; the soft-capping check likewise against _RTOL·(cap + 1) <= its tolerance (rounding
#   is monotone); where the max exceeds that bound, the plain check decides. After a fused affine check that
#   fails, the plain one runs on one column of scores first (an (n,) pass: the -1000 score, where a
#   soft-capping or curved function departs most), so that a soft-capping score_mod leaves it after (n,) work.
_FAST_CHECKS = True


def _classify_finite(ys, yb, sb, c, lo, hi, where, reads_grad, any_masked=False, exact=False):
    """_classify's affine and soft-capping checks on points whose values are all finite (Note [Fused probe
    checks]): ys (n, k) at the scores sb (n, k), yb (n,) at _BIG, c (n,) at score 0; ``exact`` runs the plain
    checks only."""
    # affine: slope from the widest pair of scores, residual on every other score
    slope = (ys[:, hi] - ys[:, lo]) / (sb[:, hi] - sb[:, lo])  # scores 250 and -1000
    if _affine_fits(ys, sb, slope, c, lo, exact):
        a = float(slope[0])
        if bool((slope - a).abs().le(_RTOL * abs(a)).all()) and a > 0:
            has_bias = bool((c != 0).any()) or any_masked or reads_grad
            return ScoreModKind("affine", f"score_mod(score) == {a:.6g}·score + bias(b, h, q_idx, kv_idx) on "
                                f"{where}", factor=a, has_bias=has_bias, reads_grad=reads_grad)
        return ScoreModKind("general", "affine in the score, but its factor varies with (b, h, q_idx, kv_idx) or "
                            "is not > 0 (only a constant positive factor folds into scale)", reads_grad=reads_grad)
    # soft-capping (plus a bias): y - y(0) == cap·tanh(score / cap), cap = y(_BIG) - y(0)
    cap = yb - c
    cap0 = float(cap[0])
    if cap0 > 0 and math.isfinite(cap0) and bool(((cap - cap0).abs() <= _RTOL * cap0).all()):
        if _softcap_fits(ys, sb, cap0, c, exact):
            has_bias = bool((c != 0).any()) or any_masked or reads_grad
            return ScoreModKind("softcap", f"score_mod(score) == {cap0:.6g}·tanh(score / {cap0:.6g})"
                                + (" + bias(b, h, q_idx, kv_idx)" if has_bias else "")
                                + f" on {where}", softcap=cap0, has_bias=has_bias, reads_grad=reads_grad)
    return ScoreModKind("general", f"neither affine in the score nor soft-capping on {where}", reads_grad=reads_grad)


def _affine_fits(ys, sb, slope, c, lo, exact):
    """Whether |ys - (slope·sb + c)| <= _RTOL·(|sb|·|slope| + |c| + 1) everywhere (Note [Fused probe checks])."""
    def fits(ys, sb, slope, c):
        fit = slope * sb + c
        return bool(((ys - fit).abs() <= _RTOL * (sb.abs() * slope.abs() + c.abs() + 1)).all())
    if not exact:
        if _fused_affine(ys, sb, slope, c):
            return True
        if not fits(ys[:, lo], sb[:, lo], slope, c):  # one column, (n,) temporaries: soft-capping fails here
            return False
    return fits(ys, sb, slope.unsqueeze(1), c.unsqueeze(1))


def _sum_is_finite(y: torch.Tensor) -> bool:
    """A sufficient condition for every value of y being finite: its sum is (Note [Fused probe checks])."""
    return math.isfinite(float(y.sum()))


def _fused_affine(ys, sb, slope, c) -> bool:
    """A sufficient condition for _affine_fits: max |ys - fit| <= _RTOL, fit by the plain check's operations
    in one (n, k) temporary (Note [Fused probe checks]); a NaN max fails."""
    r = slope.unsqueeze(1) * sb
    r.add_(c.unsqueeze(1)).sub_(ys).abs_()
    return float(r.max()) <= _RTOL


def _fused_softcap(ys, sb, cap0, c) -> bool:
    """A sufficient condition for _softcap_fits: max |ys - want| <= _RTOL·(cap0 + 1) (Note [Fused probe
    checks])."""
    r = sb / cap0
    r.tanh_().mul_(cap0).add_(c.unsqueeze(1)).sub_(ys).abs_()
    return float(r.max()) <= _RTOL * (cap0 + 1)


def _softcap_fits(ys, sb, cap0, c, exact):
    """Whether |ys - (cap0·tanh(sb / cap0) + c)| <= _RTOL·(cap0 + |c| + 1) everywhere (Note [Fused probe
    checks])."""
    if not exact and _fused_softcap(ys, sb, cap0, c):
        return True
    want = cap0 * torch.tanh(sb / cap0) + c.unsqueeze(1)
    return bool(((ys - want).abs() <= _RTOL * (cap0 + c.abs().unsqueeze(1) + 1)).all())


def _combine(*groups) -> ScoreModKind:
    """One ScoreModKind from the (kind, factor free) of each group of probe points: they must agree on the
    kind (the identity is an affine kind of factor 1 without bias), the factor and the cap."""
    kinds = [k for k, _ in groups]
    reads_grad = any(k.reads_grad for k in kinds)
    for k in kinds:
        if k.kind == "general":
            return k
    if all(k.kind == "identity" for k in kinds):
        return ScoreModKind("identity", "; ".join(k.reason for k in kinds))
    caps = {k.softcap for k in kinds if k.kind == "softcap"}
    softcap = any(k.kind == "softcap" for k in kinds)
    free_ok = all(free or (k.kind == "softcap") == softcap for k, free in groups)
    factors = [k.factor for k, free in groups if not free and k.kind != "softcap"]
    reason = "; ".join(k.reason for k in kinds)
    if not free_ok or len(caps) > 1 or any(abs(f - factors[0]) > _RTOL * abs(factors[0]) for f in factors):
        return ScoreModKind("general", "the probe points disagree on the kind, factor or cap: " + reason,
                            reads_grad=reads_grad)
    has_bias = any(k.has_bias for k in kinds)
    if softcap:
        return ScoreModKind("softcap", reason, softcap=caps.pop(), has_bias=has_bias, reads_grad=reads_grad)
    return ScoreModKind("affine", reason, factor=factors[0] if factors else 1.0, has_bias=has_bias,
                        reads_grad=reads_grad)


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


#: probe points (rows) the gradient check of _grad_only_in_bias evaluates at most (Note [Structured probes])
_GRAD_POINTS = 256


def _grad_only_in_bias(score_mod, y, s, idx, seed) -> bool:
    """Whether the tensors requiring grad that score_mod reads enter only through an additive bias: the
    gradient of sum(r · score_mod(score)) into them is the same at the probe scores as at score 0, for
    random weights r. (The factor c of an affine score_mod is folded into ``scale`` as a number, so a
    learned factor must not pass; nor may a learned cap.) On at most _GRAD_POINTS of the rows of s (random
    ones, score_mod evaluated again there): the line points are O(L + S) and two backward passes through
    score_mod on all of them were most of a first call's probe (Note [Structured probes])."""
    n = s.shape[0]
    if n > _GRAD_POINTS:
        sel = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 3))[:_GRAD_POINTS]
        s, idx = s[sel], tuple(t[sel] for t in idx)
        y = torch.broadcast_to(score_mod(s, *idx), s.shape)
    leaves = _leaves(y)
    if not leaves:
        return True
    r = torch.rand(s.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    keep = torch.isfinite(y.detach())
    r = torch.where(keep, r, torch.zeros_like(r))
    y0 = torch.broadcast_to(score_mod(torch.zeros_like(s), *idx), s.shape)
    g = torch.autograd.grad((torch.where(keep, y, 0) * r).sum(), leaves, allow_unused=True)
    g0 = torch.autograd.grad((torch.where(keep, y0, 0) * r).sum(), leaves, allow_unused=True)
    for a, e in zip(g, g0):
        a = torch.zeros((), dtype=e.dtype if e is not None else torch.float64) if a is None else a
        e = torch.zeros((), dtype=a.dtype) if e is None else e
        a, e = torch.broadcast_tensors(a, e)
        differ = a != e  # (a bias's gradients are mostly bitwise equal: compare the others, not the whole table)
        if bool(differ.any()):
            a, e = a[differ].double(), e[differ].double()
            if not bool(((a - e).abs() <= _RTOL * (a.abs() + e.abs() + 1)).all()):
                return False
    return True


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


# Note [Relative bias probe]: a bias that depends on (h, q_idx - kv_idx) only is a table of L + S - 1 values
# per head: evaluated once per offset (not once per kept pair: the per-pair gathers were most of the time
# of a T5 or learned relative bias) and added by the compiled kernel inside its tiles (csrc Note [Relative
# bias]), whose gradient, summed per diagonal, autograd takes on into the captured tensors. The probe
# evaluates the table itself, score_mod(0, 0, h, lo(d), lo(d) + d) for every h and every offset d (lo(d)
# the first q_idx that has it, as _relative_table does), and checks, within _RTOL (-inf matching -inf),
# that every offset has the same value at _REL_SETS other (b, q_idx) along the whole offset range (the
# last q_idx of the offset, a middle one, a random one; b and h cycling, so every b and h meets many
# offsets), and on _LINES whole query rows and key columns (every kv_idx at one q_idx, every q_idx at one
# kv_idx) against the table. That is O(H·(L + S)) evaluations, the table's own size. What it proves: a
# bias that departs from a table of (h, offset) at any single b, h, q_idx, kv_idx or offset value is
# refused (a bias on key 7, on one batch element, on one offset's far end); what it does not: a departure
# confined to isolated (q_idx, kv_idx) pairs off those lines and off the sampled q_idx of their offset
# ((q_idx == 5) & (kv_idx == 7), say) can pass; flex_plan says the probe found it ("bias: relative").
# In flex_attention the structured probe's points (Note [Structured probes]: its rows, columns, one random
# q_idx per offset, every head and batch element) already hold score_mod(0, ...): they are compared with the
# table as they are, and only the last and middle q_idx of each offset are evaluated afresh (same coverage).
# The table the probe checked is the one the kernel gets: evaluated once, in float64 (under autograd when it
# is on), rounded by the kernel to its accumulation dtype; a bias made of one operation on float32 tensors
# rounds to the same float32 value as when evaluated in float32 (IEEE operations are correctly rounded).
_REL_SETS = 3


def _relative_points(B, H, L, S, seed, own_lines=True):
    """(b, h, q_idx, kv_idx) int64 [n] each of Note [Relative bias probe] (per shape: Note [Probe inputs per
    shape]); without ``own_lines`` only the last and middle q_idx of each offset (the structured probe's
    points stand for the random q_idx, the rows and the columns)."""
    def make():
        g = torch.Generator().manual_seed(seed + 2)
        d = torch.arange(-(L - 1), S)
        W = d.numel()
        lo, hi = (-d).clamp(min=0), (S - 1 - d).clamp(max=L - 1)
        rq = lo + (torch.rand(W, generator=g, dtype=torch.float64) * (hi - lo + 1)).long().clamp(max=hi - lo)
        ar = torch.arange(W)
        sets = [(ar % max(1, B), ar % max(1, H), hi), ((ar + 1) % max(1, B), (ar + 1) % max(1, H), (lo + hi) // 2),
                (torch.randint(0, max(1, B), (W,), generator=g), torch.randint(0, max(1, H), (W,), generator=g), rq)]
        sets = sets if own_lines else sets[:2]
        bs, hs, qs, ks = ([s[0] for s in sets], [s[1] for s in sets], [s[2] for s in sets], [s[2] + d for s in sets])
        for k in range(_LINES if own_lines else 0):  # whole rows and columns
            q0, k0 = int(torch.randint(0, L, (1,), generator=g)), int(torch.randint(0, S, (1,), generator=g))
            jr, ic = torch.arange(S), torch.arange(L)
            bs += [(jr + k) % max(1, B), (ic + k + 1) % max(1, B)]
            hs += [(jr + k) % max(1, H), (ic + k + 1) % max(1, H)]
            qs += [torch.full((S,), q0), ic]
            ks += [jr, torch.full((L,), k0)]
        return tuple(torch.cat(t) for t in (bs, hs, qs, ks))
    return _memo(("relative", B, H, L, S, seed, own_lines), make)


def _relative_probe(score_mod, B, H, L, S, seed=0, seen=None) -> torch.Tensor | None:
    """The table [H, L + S - 1] of _relative_table (float64, differentiable into the tensors score_mod reads
    when autograd is on) when score_mod(0, b, h, q_idx, kv_idx) depends on (h, q_idx - kv_idx) only on the
    probes of Note [Relative bias probe], else None. The kernel is given this same table (evaluated once).
    ``seen``: the structured probe's [(idx, score_mod(0, ...))] (``_probe``), compared instead of evaluating
    the random q_idx per offset and the rows and columns again."""
    if L == 0 or S == 0:
        return None
    table = _relative_table(score_mod, H, L, S, torch.float64)  # (H, W): offset d at column d + L - 1
    ref = table.detach().double().reshape(-1)  # (H·W,)
    b, h, qi, ki = _relative_points(B, H, L, S, seed, own_lines=seen is None)
    n = b.numel()
    with torch.no_grad():
        z = torch.zeros(n, 1, dtype=torch.float64)
        y = torch.broadcast_to(score_mod(z, b.view(n, 1), h.view(n, 1), qi.view(n, 1), ki.view(n, 1)), (n, 1))
        pieces = [(y.double().view(n), (h, qi, ki))] + [(yp, (hp.view(-1), qp.view(-1), kp.view(-1)))
                                                       for (_, hp, qp, kp), yp in seen or ()]
        for y, (h, qi, ki) in pieces:  # each piece on its own: all() of their concatenation, without it
            want = ref[_table_index(h, qi, ki, H, L, S)] if H else y
            if not _matches(y, want):
                return None
    return table


def _table_index(h, qi, ki, H, L, S) -> torch.Tensor:
    """(h mod H)·(L + S - 1) + kv_idx - q_idx + L - 1: where the points (h, q_idx, kv_idx) [n] read the
    flattened table of _relative_table, kept with the points (per shape, Note [Probe inputs per shape]): keyed
    by the h tensor, which the memo holds, so a key is never a freed tensor's reused id."""
    key = ("table index", id(h), H, L, S)
    hit = _PROBE_INPUTS.get(key)
    if hit is not None and hit[0] is h:
        return hit[1]
    flat = (h % H).mul_(L + S - 1).add_(ki).sub_(qi).add_(L - 1)
    _memo(key, lambda: (h, flat))
    return flat


def _matches(y: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether y == want, or both finite and within _RTOL·(|y| + |want| + 1), at every point (-inf matches
    -inf only: with a tolerance that grew with |y| a -inf at a point whose table value is finite passed, and
    the kernel added the finite table value there); first by the fused bound max |y - want| <= _RTOL, which
    implies it (Note [Fused probe checks])."""
    d = (y - want).abs_()  # inf where one side is infinite and the other not: never within a tolerance
    if _FAST_CHECKS and y.numel() and float(d.max()) <= _RTOL:
        return True
    return bool(((y == want) | ((d <= _RTOL * (y.abs() + want.abs() + 1)) & torch.isfinite(d))).all())


def _relative_probe_count(L, S) -> int:
    """How many points _relative_probe compares against its table (Note [Relative bias probe])."""
    return _REL_SETS * (L + S - 1) + _LINES * (L + S)


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
    """Note [Relative bias probe]: one compiled-kernel call with the mask as a pattern and the bias as the
    table per offset ``rel`` [H, L + S - 1] the probe evaluated (float64: the kernel rounds it to the
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
            add = torch.zeros(*(max(x, y) for x, y in zip(bias.shape[:2], keep.shape[:2])), i.numel(), j.numel(), dtype=acc)
            add[..., pcols] = torch.where(keep, 0.0, float("-inf")).to(acc)
            bias = bias + add
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
    kind, seen = _probe(score_mod, B, H, L, S)
    needs_grad = torch.is_grad_enabled() and (kind.reads_grad or any(t.requires_grad for t in (query, key, value)))
    notes = []
    why = None
    if kind.kind == "general":
        why = "score_mod is neither affine in the score nor soft-capping"
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

        if mask.refusal is None and compiled_kernel.available(query):
            rel = _relative_probe(score_mod, B, H, L, S, seen=seen)
        if rel is not None:
            bias = "relative"
            kw["pattern"] = repr(mask.pattern)
            kw["rel_bias"] = f"score_mod(0, 0, h, q_idx, kv_idx) once per offset kv_idx - q_idx: [{H}, {L + S - 1}]"
            notes.append(f"the bias probed as a function of (h, q_idx - kv_idx) only (every offset's table value "
                         f"against {_REL_SETS} other (b, q_idx) each and {_LINES} whole rows and columns; a departure "
                         "on isolated (q_idx, kv_idx) pairs off those can pass): one compiled-kernel call adds it from a table per offset, the "
                         "mask as a pattern (Note [Relative bias probe]); memory and gradient O(H·(L + S))")
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
    probing score_mod and reading block_mask. Runs no attention."""
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
    live = l > 0
    l_safe = torch.where(live, l, torch.ones_like(l))
    out = torch.where(live.unsqueeze(-1), o / l_safe.unsqueeze(-1), torch.zeros_like(o))
    shift = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    lse = torch.where(live, shift + torch.log(l_safe), torch.full_like(l, float("-inf")))
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

    Paths (``flex_plan`` says which one a call takes and why): score_mod is probed, vectorised, on lines of
    points covering every value of each of b, h, q_idx, kv_idx and every offset, plus random points: O(L + S)
    calls' worth, never L×S (Notes [Probing score_mod], [Structured probes]). It sees a score_mod that
    singles out any one index value; a departure confined to isolated (q_idx, kv_idx) pairs off those lines
    can pass unseen. None / identity / soft-capping run ``attnlab.attention`` with the mask as a
    pattern (a BlockMask proved to be a band runs as attnlab's band pattern, Note [Bands proved once per
    BlockMask]); a score_mod affine in the score, ``c·score + bias(b, h, q_idx, kv_idx)``, whose bias probes
    as a function of (h, q_idx - kv_idx) only evaluates it once per offset and runs one compiled-kernel call
    (Note [Relative bias probe]: memory O(H·(L + S))); another bias is evaluated on the kept blocks only, one
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
