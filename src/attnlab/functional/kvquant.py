"""int8 KV caches for ``attention_with_kvcache`` and the decode kernel: the stored format (``QuantizedKV``),
quantisation on append, the key transforms folded into the query (Note [int8 key rotation], Note [int8 key
channel smoothing]) and the error budget (Note [int8 KV error budget]).

Legend: B batch, L queries, H query heads, G = H / Hkv, P pages of T tokens, S cache capacity, Hkv key/value
heads, D head dim.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ..kernels import decode as kdecode
from ..kernels.cacheview import dequantize_rows
from ..shapes import AttentionDtypeError, AttentionInputError, shape_str
from .storage import _check_shape, empty_kv_cache

__all__ = ["QuantizedKV", "transform_quantize", "INT8_ERROR_BUDGET", "SMOOTH_ALPHA", "GROUP_SIZE", "GROUP_MULTIPLE",
           "quantize_rows", "dequantize_rows", "channel_scales", "hadamard", "encode", "query", "SCALE_CANDIDATES"]

#: Note [int8 KV error budget]: an int8 row is x ≈ data · scale with scale = max|x| / 127 (symmetric, per token
#: and kv head, round to nearest), so each element is off by at most scale / 2 = max|x| / 254 (since Note [int8
#: scale search] the scale is max|x| / m for the best m of 127, 126, ...: still at most scale / 2, and never a
#: larger squared error than m = 127's). On Gaussian rows
#: (D = 64..128, max|x| ≈ 2.5 σ) that is an RMS element error 3.9x bf16 rounding's (measured over 10^5 rows; a
#: per-row clipped scale only makes it worse), and decode's output error is to first order a linear image of
#: the K/V element errors, while a bf16 cache also rounds q and the output: so through an int8 cache (fp32 q and
#: output) the output's RMS error against fp32 is at most about that element ratio times a bf16 cache's (bf16 q,
#: K, V, output) against the same fp32 result; INT8_ERROR_BUDGET is it rounded up. The kernel's int16 query
#: (csrc Note [Decode int8 scores]) adds 2^-16 of a row's largest element: the ratios below did not move in
#: the 2nd decimal. Measured (kernel, randn, 6 seeds, q · 1 / 3 / 5): RMS 2.3-3.3x (max error 2.0-3.3x) at GQA
#: 8/2, D = 64, S = 300; 2.9-3.4x (2.1-4.2x) at D = 128, S = 1500; 2.3-3.6x (1.6-6.2x) at GQA 32/8, D = 128,
#: S = 4096. So the issue-23 target of <= 2x bf16's is NOT met by this format. Other formats, simulated (the
#: cache dequantised to fp32 and decoded; GQA 8/2 at D, S = 64, 300 / 128, 1500 / 128, 4096, 6 seeds each; RMS
#: ratio, range and median): per row symmetric
#: 1.9-3.4 (2.84); per 32 channels symmetric 1.9-3.2 (2.33); per row asymmetric (min / max, zero point)
#: 1.7-3.8 (2.42); per 32 channels asymmetric 1.5-2.4 (1.97); per 16 channels asymmetric 1.0-2.0 (1.65).
#: Only groups of 16 with an fp16 scale and zero each stay near 2x, at 20 bytes per 16 elements: 0.625x a bf16
#: cache's bytes, above the speed target's 0.6x before any compute (groups of 32: 0.5625x bytes, 1.97x error in
#: the median, up to 2.4x). No format meets both targets; this one keeps the fewest bytes (1 + 4 / D per element)
#: and one scale per (row, key) in the kernel, which the speed target needs (csrc Note [Decode int8 scores]).
#: Issue 43 measures against llama.cpp's q8_0 instead (experiments/kvquant.py, Note [int8 KV format choice]):
#: per-token rows are 1.2x its error on Gaussian keys and 1.7x on keys with outlier channels; the rotated keys
#: of Note [int8 key rotation] are 0.40x there and 0.90x on SmolLM2's K/V.
INT8_ERROR_BUDGET = 4.0


#: Note [int8 key rotation]: keys of real models carry a few outlier channels, and one scale per row then spends
#: the int8 grid on them: every other channel of the row is off by up to max|row| / 254. A rotated key cache
#: stores k Rᵀ per row (the per-token format above) with R an orthogonal [D, D] matrix, and the query becomes
#: q Rᵀ: (q Rᵀ) · (k Rᵀ) = q · k, so the decode kernel is unchanged (QuaRot's and QuIP#'s incoherence processing,
#: folded into the query). R is the normalised Hadamard matrix (``hadamard``; block-diagonal in blocks of the
#: largest power of 2 dividing D): it spreads an outlier channel over every channel of its block, so a row's
#: max falls towards its RMS. It needs no calibration, so it cannot go stale as RoPE turns a channel pair's
#: mass from one channel to the other at later positions, which is what undid channel smoothing fixed by the
#: prefill on SmolLM2 (Note [int8 KV format choice] in experiments/kvquant.py has the measurements). On
#: Gaussian keys a rotation changes nothing (a rotated Gaussian is Gaussian): there the per-token format stays
#: about 1.2x q8_0's error (groups of 32 have a smaller max than rows of 128), which only smaller groups in
#: the kernel would change. Values are not rotated (no hook after the kernel).
#:
#: Note [int8 key channel smoothing]: the other answer to outlier channels (Note [int8 key rotation]). A smoothed
#: key cache stores k / c per row (the per-token format above) with c one scale
#: per kv head and channel, and the query becomes q ⊙ c: q · k = (q ⊙ c) · (k / c), so the decode kernel is
#: unchanged (SmoothQuant's migration, folded into the query as KIVI's per-channel key scales are). c is fixed
#: by the cache's first append (the prefill) from each channel's max|k| m over those rows: c = max(m, median_D m)
#: ^ SMOOTH_ALPHA. The median floor leaves ordinary channels at one common c (the per-token format where it is
#: enough: Gaussian keys are quantised as before, and a first append of one token cannot blow up a channel that
#: happened to be small there); alpha < 1 leaves outlier channels somewhat above the others, which spends the
#: grid between them instead of on them (alpha = 1 makes every channel's error scale with its own max). Values
#: are not smoothed (no hook after the kernel). Measured (experiments/kvquant.py, Note [int8 KV format choice]):
#: 0.26x q8_0's error on keys with fixed outlier channels, but 1.8x on SmolLM2's keys (RoPE: see Note [int8
#: key rotation], the default transform of the HF int8 cache); kept for keys whose outliers do not rotate.
SMOOTH_ALPHA = 0.75

#: Note [int8 KV groups]: the per-token row spends one scale on max|row| over all D channels; llama.cpp's q8_0
#: spends one on each block of 32, whose max is smaller (a Gaussian row of 128 has max ≈ 2.9 σ, a block of 32
#: ≈ 2.3 σ), so its elements are off by less. The group format keeps q8_0's grouping with a float32 scale per
#: GROUP_SIZE channels of each token and kv head (scale [.., Hkv, D / GROUP_SIZE]; 1 + 4 / 32 bytes an element,
#: 0.5625x a bf16 cache's), for keys after the Hadamard rotation of Note [int8 key rotation] (rotation, then
#: groups) and for values as they are. The decode kernel applies a key group's scale to that group's exact
#: int32 dot product and a value group's to p for that group's columns (csrc Note [Decode int8 groups]);
#: groups are multiples of GROUP_MULTIPLE channels (one AVX-512 int16 step, two AVX2 ones).
GROUP_SIZE = 32
GROUP_MULTIPLE = 32

#: Note [int8 scale search] (csrc/decode.cpp has the measurements): every format's scale, per row or per
#: group, is max|x| / m for the m of 127, 126, ..., 128 - SCALE_CANDIDATES whose rounding leaves the least
#: squared error (the first on a tie, so m = 127 where it is best); no element is clipped. On Gaussian groups of
#: 32 the element error is 0.89x llama.cpp q8_0's (0.9998x with m = 127 alone). The extension's quantiser
#: (``kernels.decode.quantize_rows``) runs it with the rotation of Note [int8 key rotation]; ``_search``, the
#: same search in torch, runs where the extension does not.
SCALE_CANDIDATES = 16


@dataclass(frozen=True)
class QuantizedKV:
    """An int8 KV cache: ``data`` int8 [B, S, Hkv, D] (or a page pool [P, T, Hkv, D]) and ``scale`` float32
    [B, S, Hkv] ([P, T, Hkv]); row (b, t, g) holds ``data[b, t, g] * scale[b, t, g]`` (symmetric, one scale
    per token and kv head: Note [int8 KV error budget]). Group-scaled (Note [int8 KV groups]): ``scale``
    float32 [B, S, Hkv, D / gs] (gs, ``group_size``, a multiple of 32: llama.cpp q8_0's blocks at gs = 32),
    and channels ``n gs .. n gs + gs - 1`` of row (b, t, g) hold ``data[b, t, g, n gs:] * scale[b, t, g, n]``. Pass it as ``k_cache`` / ``v_cache`` of
    ``attention_with_kvcache`` (a plain ``(data, scale)`` pair works too): new keys/values are quantised on
    append, in place, and the decode kernel dequantises as it reads (csrc Note [Decode int8 cache]).
    Reads 1 byte an element plus 4 a row (4 a group): about half a bf16 cache's bytes at D = 128.

    ``channel`` (key caches only): None, or float32 [Hkv, D], the key channel smoothing of Note [int8 key
    channel smoothing]: row (b, t, g) then holds ``data[b, t, g] * scale[b, t, g] * channel[g]``; all zeros
    means "not fixed yet" (the first append fixes it, ``QuantizedKV.empty(..., smooth=True)``).

    ``rotation`` (key caches only): None, or float32 [D, D] orthogonal R (Note [int8 key rotation]): the rows
    hold k Rᵀ, so row (b, t, g) dequantises to ``(data[b, t, g] * scale[b, t, g]) @ R`` (then ``* channel``)."""

    data: torch.Tensor
    scale: torch.Tensor
    channel: torch.Tensor | None = None
    rotation: torch.Tensor | None = None

    def __post_init__(self):
        d, sc, ch = self.data, self.scale, self.channel
        if not isinstance(d, torch.Tensor) or d.dtype != torch.int8 or d.dim() != 4:
            raise AttentionDtypeError(f"QuantizedKV.data must be an int8 tensor [B|P, S|T, Hkv, D], got "
                                      f"{shape_str(d) if isinstance(d, torch.Tensor) else type(d).__name__}"
                                      f"{' ' + str(d.dtype) if isinstance(d, torch.Tensor) else ''}")
        if not isinstance(sc, torch.Tensor) or sc.dtype != torch.float32 or tuple(sc.shape[:3]) != tuple(d.shape[:3]) \
                or sc.dim() not in (3, 4):
            raise AttentionInputError(
                f"QuantizedKV.scale must be float32 [B|P, S|T, Hkv] = {list(d.shape[:3])} (one scale per token and "
                f"kv head of data {shape_str(d)}) or [B|P, S|T, Hkv, D / group_size] (one per group of channels), "
                f"got {(shape_str(sc) + ' ' + str(sc.dtype)) if isinstance(sc, torch.Tensor) else type(sc).__name__}")
        if sc.dim() == 4:
            D, ng = d.shape[3], sc.shape[3]
            if ng < 1 or D % ng or (ng > 1 and (D // ng) % GROUP_MULTIPLE):
                raise AttentionInputError(
                    f"QuantizedKV.scale {shape_str(sc)} has {ng} groups per row, but a group size must divide the "
                    f"head dim D={D} of data {shape_str(d)} and be a multiple of {GROUP_MULTIPLE} (e.g. "
                    f"[{', '.join(map(str, d.shape[:3]))}, {D // 32 if D % 32 == 0 else 1}]); "
                    f"QuantizedKV.quantize(x, group_size=32) makes one")
        if sc.device != d.device:
            raise AttentionInputError(f"QuantizedKV.data is on {d.device} but its scale on {sc.device}")
        if ch is not None:
            if (not isinstance(ch, torch.Tensor) or ch.dtype != torch.float32
                    or tuple(ch.shape) != (d.shape[2], d.shape[3]) or ch.device != d.device):
                raise AttentionInputError(
                    f"QuantizedKV.channel must be None or float32 [Hkv, D] = {list(d.shape[2:])} on {d.device} (one "
                    f"key scale per kv head and channel of data {shape_str(d)}), got "
                    f"{(shape_str(ch) + ' ' + str(ch.dtype) + ' on ' + str(ch.device)) if isinstance(ch, torch.Tensor) else type(ch).__name__}")
        r = self.rotation
        if r is not None:
            D = d.shape[3]
            if (not isinstance(r, torch.Tensor) or r.dtype != torch.float32 or tuple(r.shape) != (D, D)
                    or r.device != d.device):
                raise AttentionInputError(
                    f"QuantizedKV.rotation must be None or float32 [D, D] = [{D}, {D}] on {d.device} (an orthogonal "
                    f"matrix, e.g. kvquant.hadamard({D})), got "
                    f"{(shape_str(r) + ' ' + str(r.dtype) + ' on ' + str(r.device)) if isinstance(r, torch.Tensor) else type(r).__name__}")

    @classmethod
    def empty(cls, *shape: int, huge_pages: bool | None = None, rotate: bool = False,
              smooth: bool = False, group_size: int | None = None) -> "QuantizedKV":
        """A zero cache of shape [B|P, S|T, Hkv, D] (every row 0, scale 0), data and scale in ``empty_kv_cache``
        storage (huge pages where the OS offers them: Note [KV cache on huge pages]). For a key cache: ``rotate``,
        the Hadamard rotation (Note [int8 key rotation]); ``smooth``, channel smoothing fixed by the first
        append (Note [int8 key channel smoothing]); ``group_size``: one scale per that many channels (Note [int8
        KV groups]; None: one per row)."""
        shape = _check_shape(shape)
        _check_flags("QuantizedKV.empty", rotate=rotate, smooth=smooth)
        ng = _groups("QuantizedKV.empty", shape[3], group_size)
        return cls(empty_kv_cache(*shape, dtype=torch.int8, huge_pages=huge_pages),
                   empty_kv_cache(*shape[:3], *((ng,) if ng else ()), dtype=torch.float32, huge_pages=huge_pages),
                   torch.zeros(shape[2], shape[3]) if smooth else None, hadamard(shape[3]) if rotate else None)

    @classmethod
    def quantize(cls, x: torch.Tensor, *, rotate: bool = False, smooth: bool = False,
                 group_size: int | None = None) -> "QuantizedKV":
        """x [.., Hkv, D] floating -> the int8 rows and their scales (scale = max|row| / m, m the best of 127,
        126, ... by Note [int8 scale search], round to nearest; with ``group_size``, one such scale per group of
        that many channels: Note [int8 KV groups]); for keys
        ``rotate`` (Note [int8 key rotation]: rotation, then groups) and ``smooth`` (channel scales fixed from x
        itself: Note [int8 key channel smoothing])."""
        _check_flags("QuantizedKV.quantize", rotate=rotate, smooth=smooth)
        ng = _groups("QuantizedKV.quantize", x.shape[-1], group_size)
        if not (rotate or smooth):
            return cls(*_quantize(x, ng))
        c = channel_scales(x) if smooth else None
        r = hadamard(x.shape[-1]) if rotate else None
        return cls(*transform_quantize(x, c, r, ng), c, r)

    @property
    def shape(self) -> torch.Size:
        """The cache's shape, [B|P, S|T, Hkv, D]."""
        return self.data.shape

    @property
    def group_size(self) -> int:
        """Channels per scale: D for the per-token format (scale [.., Hkv]), D / scale.shape[-1] for groups."""
        return self.data.shape[3] // self.scale.shape[3] if self.scale.dim() == 4 else self.data.shape[3]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """data · scale (@ rotation, · channel) as ``dtype``, same shape as data."""
        x = dequantize_rows(self.data, self.scale)
        if self.rotation is not None:
            x = x @ self.rotation
        return (x * self.channel if self.channel is not None else x).to(dtype)


def _groups(where: str, D: int, group_size) -> int:
    """The scale's group count for ``group_size`` (0: per-token rows, scale [.., Hkv]); ValueError naming it."""
    if group_size is None:
        return 0
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 or D % group_size \
            or (group_size != D and group_size % GROUP_MULTIPLE):
        raise ValueError(f"{where}: group_size must divide the head dim D={D} and be a multiple of "
                         f"{GROUP_MULTIPLE} (or D itself), got {group_size!r}")
    return D // group_size


def _check_flags(where: str, **flags) -> None:
    for name, val in flags.items():
        if not isinstance(val, bool):
            raise TypeError(f"{where}: {name} must be a bool, got {type(val).__name__}")


def hadamard(D: int) -> torch.Tensor:
    """The orthogonal [D, D] float32 matrix of Note [int8 key rotation]: block-diagonal, each block the normalised
    Sylvester Hadamard matrix of the largest power of 2 dividing D (the identity for odd D). Symmetric."""
    if isinstance(D, bool) or not isinstance(D, int) or D < 1:
        raise ValueError(f"hadamard: D must be an int >= 1, got {D!r}")
    return _hadamard(D).clone()


@functools.cache
def _hadamard(D: int) -> torch.Tensor:
    n = D & -D  # the largest power of 2 dividing D
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return torch.block_diag(*([h / math.sqrt(n)] * (D // n))).to(torch.float32)


#: below this many elements _rotate runs the elementwise transform (PyTorch's serial grain: no thread pool)
_SERIAL_ROTATE = 1 << 15
#: at most this many multiply-adds (rows x D x D) _rotate takes as one GEMM all the same (Note [Tiny rotation])
_TINY_ROTATE = 1 << 16


def _rotate(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """x Rᵀ for x [.., D] float32. For ``hadamard(D)`` and a decode step's few rows, the fast Walsh-Hadamard
    transform (Sylvester's H_2n [a; b] = [H_n (a + b); H_n (a - b)], log2 n elementwise levels, each op under
    PyTorch's parallel grain); otherwise one matmul. Measured on the busy 2-core machine, GQA 32/8, D 128: a
    decode step's query as a [32, 128] x [128, 128] GEMM took 30 µs in the median but 6.5 ms at the 90th
    percentile (the GEMM's second thread waiting for a core), which made a rotated cache's decode 1.05x bf16's
    time against 0.76x unrotated; the elementwise transform takes 77 µs median, 122 µs at most.

    Note [Tiny rotation]: the elementwise transform is a few dozen PyTorch calls, 68-118 µs whatever the size
    (model-207 AMX Xeon, 2 threads, quiet and busy, 2800 calls: [9, 64] 76 / 84 µs at p50 / p90, [32, 128] 118
    / 129), a decode step's query rotated in each layer: 30 layers of SmolLM2 spent more on it than its int8
    cache saved in reading, and its int8 cache decoded at 0.90x the float32 cache's speed. A GEMM of at most
    _TINY_ROTATE multiply-adds, 8x under the one that stalled, takes 4.5-4.7 µs at p50 and 7.0-7.7 at p99 on
    that machine, quiet and busy ([9, 64], SmolLM2's step: 36,864)."""
    D = x.shape[-1]
    if (x.numel() * D <= _TINY_ROTATE or x.numel() >= _SERIAL_ROTATE or r.device != x.device
            or not torch.equal(r, _hadamard(D).to(r.device))):
        return x @ r.T
    n = D & -D
    if n == 1:
        return x
    y = x.reshape(-1, n)  # (rows · D/n, n): each block of n channels
    h = n // 2
    while h >= 1:
        y = y.reshape(-1, 2, h)  # (.., 2, h): the halves a, b of each 2h-block
        a, b = y[:, 0], y[:, 1]
        y = torch.cat((a + b, a - b), 1)
        h //= 2
    return y.reshape(x.shape) * (1.0 / math.sqrt(n))


def transform_quantize(x: torch.Tensor, c: torch.Tensor | None, r: torch.Tensor | None, groups: int = 0):
    """x [.., Hkv, D] -> the int8 rows and scales of (x / c) Rᵀ (either transform may be None; ``groups`` as
    ``_quantize``'s: the rotation first, then the groups). ``hadamard(D)`` as R runs inside the quantiser."""
    xf = x.detach().to(torch.float32)
    if c is not None:
        xf = xf / c
    if r is not None:
        D = xf.shape[-1]
        n = D & -D
        if r.device == xf.device and torch.equal(r, _hadamard(D).to(r.device)):
            return _quantize(xf, groups, n if n > 1 else 0)
        xf = _rotate(xf, r)
    return _quantize(xf, groups)


def channel_scales(x: torch.Tensor, alpha: float = SMOOTH_ALPHA) -> torch.Tensor:
    """x [.., Hkv, D] keys -> c float32 [Hkv, D] (Note [int8 key channel smoothing]): m = max|x| per kv head and
    channel over the leading dims, c = max(m, median_D m) ^ alpha (1 for a head whose keys are all 0)."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or not x.is_floating_point():
        raise AttentionInputError(f"channel_scales: x must be a floating tensor [.., Hkv, D], got "
                                  f"{shape_str(x) if isinstance(x, torch.Tensor) else type(x).__name__}")
    m = x.detach().to(torch.float32).abs().reshape(-1, *x.shape[-2:]).amax(0)  # (Hkv, D)
    if not bool(torch.isfinite(m).all()):
        raise AttentionInputError("an int8 cache takes finite keys and values only (k or v holds inf or NaN)")
    floor = m.median(-1, keepdim=True).values  # (Hkv, 1)
    c = torch.maximum(m, floor).pow_(alpha)
    return torch.where(c.amax(-1, keepdim=True) > 0, c, torch.ones_like(c)).clamp_min_(torch.finfo(torch.float32).tiny)


def _quantize(x: torch.Tensor, groups: int = 0, hadamard_n: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [.., D] -> (int8 [.., D], float32 scale [..]) with x ≈ data · scale (Note [int8 KV error budget], the
    scale searched: Note [int8 scale search]); with ``groups`` > 0, scale [.., groups], one per D / groups
    channels (Note [int8 KV groups]). ``hadamard_n`` > 0: rows of x Rᵀ instead, R = ``hadamard(D)`` (blocks of
    hadamard_n channels, Note [int8 key rotation])."""
    xf = x.detach().to(torch.float32)
    D = xf.shape[-1]
    rows = xf.reshape(-1, D)  # (N, D)
    ng = groups or 1
    got = kdecode.quantize_rows(rows, ng, hadamard_n, SCALE_CANDIDATES) if rows.device.type == "cpu" else None
    if got is None:
        got = _search(_rotate(rows, _hadamard(D).to(rows.device)) if hadamard_n else rows, ng)
    data, scale = got
    if not bool(torch.isfinite(scale).all()):  # a group holding inf or NaN (Note [int8 scale search])
        raise AttentionInputError("an int8 cache takes finite keys and values only (k or v holds inf or NaN)")
    return data.reshape(xf.shape), scale.reshape(*xf.shape[:-1], groups) if groups else scale.reshape(xf.shape[:-1])


#: rows per pass of ``_search`` (its candidates' products are SCALE_CANDIDATES times the rows' size)
_SEARCH_ROWS = 4096


def _search(rows: torch.Tensor, ng: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Note [int8 scale search] in torch: rows float32 [N, D] -> (int8 [N, D], float32 scale [N, ng]); a group
    holding inf or NaN gets a NaN scale."""
    N, D = rows.shape
    m = 127.0 - torch.arange(SCALE_CANDIDATES, dtype=torch.float32, device=rows.device)  # (K,)
    data = torch.empty(N, D, dtype=torch.int8, device=rows.device)
    scale = torch.empty(N, ng, dtype=torch.float32, device=rows.device)
    for r0 in range(0, N, _SEARCH_ROWS):
        xg = rows[r0:r0 + _SEARCH_ROWS].reshape(-1, ng, D // ng)  # (n, ng, gs)
        amax = xg.abs().amax(-1)  # (n, ng)
        s = amax.unsqueeze(-1) / m  # (n, ng, K)
        div = torch.where(s > 0, s, torch.ones_like(s)).unsqueeze(-1)
        u = xg.unsqueeze(-2) / div  # (n, ng, K, gs): x in units of each candidate's step
        q = u.round().clamp_(-127, 127)
        err = (u - q).square_().sum(-1) / m.square()  # (n, ng, K), the order of the squared error / max|x|^2
        j = err.nan_to_num(nan=math.inf).argmin(-1, keepdim=True)  # the first least error
        best = s.gather(-1, j).squeeze(-1)  # (n, ng)
        qb = q.gather(-2, j.unsqueeze(-1).expand(*j.shape[:-1], 1, xg.shape[-1])).squeeze(-2)  # (n, ng, gs)
        finite = torch.isfinite(xg).all(-1)
        scale[r0:r0 + _SEARCH_ROWS] = torch.where(finite, best, torch.full_like(best, float("nan")))
        data[r0:r0 + _SEARCH_ROWS] = torch.where(finite.unsqueeze(-1), qb, torch.zeros_like(qb)).to(torch.int8).reshape(-1, D)
    return data, scale


def quantize_rows(x: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [.., D] -> (int8 data, float32 scale): one scale per row ([..]), or per ``group_size`` channels
    ([.., D / group_size]; Note [int8 KV groups])."""
    return _quantize(x, _groups("quantize_rows", x.shape[-1], group_size))


# -- the two points where a cache's format meets a decode call (attention_with_kvcache, the HF int8 cache) ----
def encode(cache: "QuantizedKV", new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (int8 data, float32 scale) rows that ``cache`` stores for new keys or values ``new`` [.., Hkv, D],
    made before any row is written (Note [Checked, then appended] in ``functional.kvcache``). A smoothed key
    cache whose channel scales are not fixed yet (all 0) fixes them here from ``new`` (its first append), in
    place, once ``new`` is known finite: Note [int8 key channel smoothing]."""
    c, r = cache.channel, cache.rotation
    ng = cache.scale.shape[3] if cache.scale.dim() == 4 else 0
    if c is None and r is None:
        return _quantize(new, ng)
    if c is not None and not bool(c.any()):
        c.copy_(channel_scales(new))
    return transform_quantize(new, c, r, ng)


def query(k_cache: "QuantizedKV", q: torch.Tensor) -> torch.Tensor:
    """The query [B, L, H, D] that the decode kernel multiplies against ``k_cache``'s stored rows (the format's
    per-row scale is applied by the kernel): q itself for the per-token format, (q ⊙ c) Rᵀ for a smoothed and /
    or rotated one (kv head g's channel scales on its G query heads): q · k = ((q ⊙ c) Rᵀ) · ((k / c) Rᵀ). Computed
    in float32 and returned in q's dtype (a bf16 q is rounded once more after the rotation)."""
    c, r = k_cache.channel, k_cache.rotation
    if c is None and r is None:
        return q
    B, L, H, D = q.shape
    qf = q.to(torch.float32)
    if c is not None:
        Hkv = c.shape[0]
        qf = (qf.reshape(B, L, Hkv, H // Hkv, D) * c.unsqueeze(1)).reshape(B, L, H, D)  # (B, L, Hkv, G, D) -> back
    if r is not None:
        qf = _rotate(qf, r)
    return qf.to(q.dtype)
