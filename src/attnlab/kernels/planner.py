"""The one planner: which kernel runs an attention call, why the others were refused, and the cost.

It asks every kernel object (``attnlab.kernels.KERNELS``) why it cannot run the request
(``Kernel.not_supported_reasons``, from its declaration), then walks auto's rules (``RULES``: a short,
ordered table; the first that fits chooses, and its name is part of ``Plan.reason``), the last being
"the fastest capable kernel by predicted time" (``Kernel.cost``: FLOPs over a rate measured by
``attnlab calibrate`` or taken from the built-in table, Note [Calibrated rates] in ``kernels.rates``).
The chosen kernel's tiling (``Kernel.tiling``) goes into the plan, and ``attention`` runs
``plan.kernel.run(prepared, plan.tiling, ...)``. Capability checks are cheap; costs (block layouts,
FLOPs, peak bytes) are computed only when a rule compares kernels or ``explain`` asks for them.
``attention``, ``attention_with_lse``, ``explain``, ``nn.MultiHeadAttention`` and the exact mechanisms
all plan here. No rule switches on a kernel's name: they hold the kernel objects.

It lives in ``kernels/`` beside the objects it chooses among, and reads the prepared inputs
(``attnlab.shapes.Prepared``) only through their attributes: data flows functional → shapes (validate,
describe) → planner → kernels, and nothing here calls back up (``attnlab.functional.planner`` re-exports it).

Legend: B batch (leading dims flattened), H heads, Hkv key/value heads, L query length, S key length,
E head dim, Ev value head dim.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from .. import cpu
from .. import kernels as K
from ..files import format_bytes
from . import KERNELS, Kernel, Request, Tiling, rates
from .cacheview import CacheCall
from .rates import (COMPILED_BLOCK_SPEED, COMPILED_DENSE_DTYPES, PLAIN_MHA_DECODE_ON_SDPA, SPARSE_BLOCK_SPEED,
                    SPARSE_OVER_COMPILED)  # the built-in table, read here by its old names
from . import compiled as compiled_kernel
from . import fused as fused_kernel
from . import sparse as sparse_kernel
from . import tiled as tiled_kernel
from .kernel import causal_blocks, nonempty_blocks
from .spec import check_block_size, refusals_of

if TYPE_CHECKING:
    from ..shapes import Prepared

__all__ = ["Plan", "Rule", "RULES", "METHODS", "plan", "plan_cache", "plain_decode_kernel", "refusals", "candidates",
           "choose_lse_kernel",
           "layer_method", "takes_alibi_slopes", "causal_blocks", "nonempty_blocks"]

#: "auto" and every kernel's name, in explain's order (one definition, from the kernel objects)
METHODS: tuple[str, ...] = ("auto",) + tuple(k.name for k in KERNELS)
#: auto returns weights from the dense kernel while its [B, H, L, S] scores stay under this budget
DENSE_WEIGHTS_BUDGET = 256 * 2**20
#: auto uses the gathered block-sparse kernel when at least this fraction of blocks is empty
SPARSE_MIN_EMPTY = 0.25
DEFAULT_SPARSE_BLOCK = sparse_kernel.DEFAULT_SPARSE_BLOCK
DEFAULT_TILED_BLOCK = tiled_kernel.DEFAULT_BLOCK
COMPILED_DENSE_BLOCK = compiled_kernel.COMPILED_DENSE_BLOCK
COMPILED_MASK_BLOCK = compiled_kernel.COMPILED_MASK_BLOCK
#: the kernels that return a log-sum-exp, in attention_with_lse's order of preference (``kernels.LSE_ORDER``)
LSE_ORDER: tuple[str, ...] = tuple(k.name for k in K.LSE_ORDER)
#: auto's order among kernels of equal predicted time (``kernels.FALLBACK_ORDER``); dense (the universal
#: kernel, which materialises L×S) comes last, and a declared kernel missing there goes just before it
FALLBACK_ORDER: tuple[str, ...] = tuple(k.name for k in K.FALLBACK_ORDER)
_FALLBACK: tuple[Kernel, ...] = (tuple(k for k in K.FALLBACK_ORDER if k is not K.DENSE)
                                 + tuple(k for k in KERNELS if k not in K.FALLBACK_ORDER) + (K.DENSE,))


@dataclass
class Plan:
    """What ``attention`` will do for these inputs: the kernel and its tiling, why (the rule that chose it),
    what was refused, and the cost.

    ``peak_bytes`` / ``flops`` / ``seconds`` hold every kernel's predicted cost when built by ``explain``
    (``rate_sources``: where each kernel's rate came from); a plan made for running holds only what auto
    had to compare. ``kernel`` and ``tiling`` are what runs (``plan.kernel.run(p, plan.tiling, ...)``);
    the plan cache keeps them with the plan.
    """

    method: str
    reason: str
    refused: dict[str, str] = field(default_factory=dict)
    peak_bytes: dict[str, int] = field(default_factory=dict)
    flops: dict[str, int] = field(default_factory=dict)
    sdpa_backend: str = "unknown"
    block_size: tuple[int, int] | None = None
    #: what the plan had to assume because the inputs hold no values (meta tensors): see ``meta_assumptions``
    assumptions: list[str] = field(default_factory=list)
    #: where the rates the kernels were compared by come from (Note [Calibrated rates] in ``kernels.rates``)
    rates_source: str = ""
    density: float = 1.0  # fraction of (query, key) blocks that are computed
    #: {kernel: what it would pay beyond its usual work (e.g. ALiBi written out as a mask)}, for kernels not refused
    notes: dict[str, str] = field(default_factory=dict)
    #: the decode kernel runs (L <= 16, inference: kernels/decode.py, csrc/decode.cpp)
    decode: bool = False
    #: the kernel object that runs, and its tiling (None: unblocked)
    kernel: Kernel | None = field(default=None, repr=False, compare=False)
    tiling: Tiling | None = None
    #: the name of auto's rule that chose the kernel ("requested" for an explicit method)
    rule: str = ""
    #: {kernel: predicted seconds} and {kernel: where its rate came from}, for kernels not refused
    seconds: dict[str, float] = field(default_factory=dict)
    rate_sources: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"method: {self.method} — {self.reason}"]
        for m in METHODS[1:]:
            cost = ""
            if m in self.peak_bytes:
                cost = f"peak ≈ {format_bytes(self.peak_bytes[m])}, {self.flops[m] / 1e9:.3g} GFLOP"
            if m in self.seconds:  # a row names its rate's source only where it is not the plan's (printed once below)
                src = self.rate_sources.get(m, "")
                cost += f", ≈ {_format_seconds(self.seconds[m])}" + (f" ({src})" if src and src != self.rates_source else "")
            state = "chosen" if m == self.method else f"refused: {self.refused[m]}" if m in self.refused else "available"
            lines.append(f"  {m:<8} {state:<50} {cost}")
            if m in self.notes:
                lines.append(f"  {'':<8} note: {self.notes[m]}")
        est = {m: t for m, t in self.seconds.items() if m not in self.refused}
        first = min(est, key=est.get) if est else None
        if self.method in est and first != self.method and est[first] < est[self.method]:
            # a rule may choose by a measurement (a size threshold, a decode ratio) or by a capability, where the
            # rows' times are FLOPs over rates: say so where they rank another kernel first (fp32 GQA causal n 8000
            # on the AMX Xeon: compiled ≈ 291 ms, SDPA ≈ 239 ms, and the size threshold rightly picks compiled, 0.93x
            # SDPA's time measured)
            lines.append(f"estimates: the ≈ times (FLOPs over rates) rank {first} first; the rule on the first line "
                         f"chose {self.method}")
        lines += [f"assumed: {a}" for a in self.assumptions]
        if self.rates_source:
            lines.append(f"rates: {self.rates_source}")
        lines.append(f"cpu: {cpu.summary()}")
        return "\n".join(lines)


def _format_seconds(s: float) -> str:
    return f"{s * 1e6:.3g} µs" if s < 1e-3 else f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


@functools.lru_cache(maxsize=512)
def _refusals(r: Request) -> tuple[tuple[str, str], ...]:
    return refusals_of(KERNELS, r)


def refusals(r: Request) -> dict[str, str]:
    """{kernel: every reason it cannot run ``r``, joined by "; "} over all kernels.

    Cached per request: the declarations are constant, and their dynamic facts (whether the extension
    loads) are settled once per process."""
    return dict(_refusals(r))


def sdpa_backend_of(p: Prepared, device: str | None = None) -> str:
    """The backend PyTorch's SDPA would pick for these inputs (shapes and dtypes; GQA's repeated heads
    would force one, so they are described by expanded views instead); with ``device``, for such
    tensors on that device (``fused.sdpa_backend``: meta inputs describing a CPU call)."""
    info, mask = p.info, p.mask
    N, H, S = p.N, info.H, info.S
    kb, vb = (p.kv_k, p.kv_v) if info.H == info.Hkv else (
        p.kv_k[:, :1].expand(N, H, S, info.E), p.kv_v[:, :1].expand(N, H, S, info.Ev))
    m = None if mask.is_trivial or p.is_causal_only else (mask.keep if mask.keep is not None else mask.bias)
    if m is None and mask.alibi is not None:  # SDPA would get ALiBi as a float mask: described by a 0-stride view
        m = torch.zeros((), dtype=p.q.dtype, device=p.q.device).expand(N, H, info.L, S)
    return fused_kernel.sdpa_backend(p.q, kb, vb, m, p.dropout_p, p.is_causal_only, info.scale, device=device)


class _Call:
    """One call as auto's rules see it: the request, the candidates and each kernel's tiling and cost,
    computed on first use (layouts are the costly part)."""

    def __init__(self, p: Prepared, r: Request, block_size: int | None, ok: tuple[Kernel, ...],
                 backend: str | None, explaining: bool):
        self.p, self.r, self.bs, self.ok, self.backend, self.explaining = p, r, block_size, ok, backend, explaining
        self._rates = None
        self._tilings: dict[Kernel, Tiling | None] = {}
        self._seconds: dict[Kernel, float] = {}
        self.r_choice = dataclasses.replace(r, sdpa_backend=None) if r.sdpa_backend is not None else r

    @property
    def rates(self):
        if self._rates is None:
            self._rates = rates.current()
        return self._rates

    def tiling(self, k: Kernel) -> Tiling | None:
        if k not in self._tilings:
            self._tilings[k] = k.tiling(self.p, self.r, self.bs, self.rates)
        return self._tilings[k]

    def flops(self, k: Kernel) -> int:
        return k.spec.flops(self.r, self.tiling(k))

    def seconds(self, k: Kernel) -> float:
        """Predicted seconds, on the request without SDPA's backend (which a running plan does not ask for:
        explain's times are the ones auto compared)."""
        if k not in self._seconds:
            self._seconds[k] = k.seconds(self.r_choice, self.tiling(k), self.rates)
        return self._seconds[k]

    def density(self, k: Kernel) -> float:
        t = self.tiling(k)
        if t is None or t.blocks is None:
            return 1.0
        return t.blocks / max(1, -(-self.r.L // t.block_q) * -(-self.r.S // t.block_k))

    @property
    def plain(self) -> bool:
        """No mask but causal, no score modification."""
        return (self.r.trivial or self.r.causal_only) and not self.r.score_mods

    @property
    def mods(self) -> str:
        return " and ".join(n for n, on in (("soft-capping", self.r.softcap), ("ALiBi", self.r.alibi),
                                            ("a relative bias", self.r.rel_bias)) if on)


@dataclass(frozen=True)
class Rule:
    """One of auto's rules: ``pick(call)`` gives (kernel, why) when the rule fits, else None."""

    name: str
    pick: Callable[[_Call], tuple[Kernel, str] | None]


#: Note [Plain MHA decode]: with one query head per key/value head, float32 and nothing but a causal mask,
#: PyTorch's flash kernel reads K/V about as fast as the decode path, and which is faster turns on the cache
#: length: the decode path's fixed cost loses on short caches, its one read of K/V wins on long ones. On the
#: AVX-512 Zen machine (H = 8, D = 64, 2 threads, load 1.1-1.3, ``bench planner --kinds decode``) SDPA ran
#: S = 1024 1.06x faster, S = 4096 was a tie (the decode path 1.04x SDPA's time) and the decode path ran
#: S = 16384 1.20x faster; the calibration grid measured SDPA's time over the decode path's 0.89 / 0.94 / 1.28x
#: at S = 2048 / 4096 / 8192. GQA (no copies there), bf16/fp16 (SDPA converts: the decode path 10x), masks,
#: patterns and score modifications keep the decode path. ``attnlab calibrate`` times plain decode calls (MHA
#: and GQA, each dtype, a few cache lengths) on both (``Rates.decode_over_sdpa``, per length) and fits the
#: length from which the decode path wins (``Rates.decode_min_keys``: a line through log(ratio) over log(S),
#: ``calibration._least_keys``; 3763 keys in that run); the rule follows it, and explain quotes the ratio
#: measured at the nearest length (``Rates.decode_evidence``). The sweep's one miss before, decode fp32
#: n = 4096 MHA sent to SDPA where the decode path ran 1.06x faster, had two causes: one ratio per (dtype,
#: heads), the mean over the lengths, and a grid that timed the decode path's ``run``, which rebuilds its
#: arguments each call, where a repeated call runs it direct (12-25 us less: Note [Calibrate what runs] in
#: ``functional.calibration_grid``). Uncalibrated, float32 MHA goes to SDPA at every length
#: (``rates.PLAIN_MHA_DECODE_ON_SDPA``, ``Rates.plain_decode_on_sdpa``). The crossing depends on the door: SDPA's
#: step on a KV-cache view pays for views that ``attention``'s SDPA call does not, so the calibration fits one per
#: door (``Rates.step_min_keys`` for the KV-cache API's and the HF step's plain steps) and every door asks the same
#: function with its own (Note [Each door its crossing] in ``functional.calibration_grid``).


def _plain_on_sdpa(rates, r: Request) -> bool:
    """The one SDPA-or-decode decision (Note [Plain MHA decode]): whether a plain decode call (no mask but
    causal, no score modification, no log-sum-exp asked) runs faster on SDPA than on the decode kernel here, at
    its door: a KV-cache view's by the steps' crossing, ``attention``'s by its own (Note [Each door its crossing]
    in ``functional.calibration_grid``)."""
    return rates.plain_decode_on_sdpa(r.dtype, r.H != r.Hkv, r.S, step=r.cache is not None)


def plain_decode_kernel(dtype: torch.dtype, H: int, Hkv: int, S: int, layout: str = "heads-first") -> Kernel:
    """The kernel auto runs a plain decode call on (SDPA or the decode kernel), by the rule ``_decode`` applies,
    for a cache of ``layout`` (Note [Cache layouts]: SDPA reads heads-first caches only): for doors that take
    plain steps without preparing a call (the KV-cache API's one-call step, the HF step): the steps' crossing."""
    if layout not in K.SDPA.spec.cache_layouts:
        return K.DECODE
    return K.SDPA if rates.current().plain_decode_on_sdpa(dtype, H != Hkv, S, step=True) else K.DECODE


def _decode(c: _Call):
    k = K.DECODE
    if k not in c.ok:
        return None
    r, gqa = c.r, c.r.H != c.r.Hkv
    if c.plain and not r.needs_lse and r.N and r.S and K.SDPA in c.ok and _plain_on_sdpa(c.rates, r):
        if not c.explaining:
            return K.SDPA, "plain decode: SDPA faster here (Note [Plain MHA decode])"
        heads, dt = "GQA" if gqa else "multi-head", str(r.dtype).removeprefix("torch.")
        why = c.rates.decode_evidence(r.dtype, gqa, r.S, step=r.cache is not None)
        how = (f"SDPA faster at S = {r.S} here ({why}; {c.rates.source})" if why else
               "PyTorch's fused kernel reads K/V as fast (built-in default)")
        return K.SDPA, f"plain {heads} decode in {dt}: {how} (Note [Plain MHA decode])"
    # (the full reason, with splits and bytes, only when explain asks: it is built on every call otherwise)
    if not c.explaining:
        return k, "decode kernel"
    why = (c.rates.decode_evidence(r.dtype, gqa, r.S, step=r.cache is not None) if c.plain and K.SDPA in c.ok
           else None)
    return k, k.decode_reason(c.p, True) + (f"; over SDPA at S = {r.S}: {why} (Note [Plain MHA decode])" if why else "")


def _small_weights(c: _Call):
    if c.r.need_weights and K.DENSE in c.ok and c.r.pairs * 4 * 3 <= DENSE_WEIGHTS_BUDGET:
        return K.DENSE, "weights requested and the L×S scores are small"


def _second_pass_weights(c: _Call):
    if c.r.need_weights and K.TILED in c.ok:
        return K.TILED, "weights requested: output by online softmax, weights by a second pass over the saved log-sum-exp"


def _only_weights(c: _Call):
    if c.r.need_weights and K.DENSE in c.ok:
        return K.DENSE, "weights requested and only the dense kernel returns them for these inputs"


def _mask_tiles(c: _Call):
    r, cc, sp = c.r, K.COMPILED, K.SPARSE
    if r.need_weights or cc not in c.ok or c.plain:
        return None
    if r.pattern and sp in c.ok and c.flops(sp) * c.rates.sparse_over_compiled < c.flops(cc):
        return None  # the gathered kernel computes enough less: the block-skipping rule below
    t = c.tiling(cc)
    if not (r.pattern or r.keep_mask or r.float_mask or r.causal_only):
        return cc, f"attnlab's compiled kernel: {c.mods} computed inside its {t.block_q}×{t.block_k} tiles"
    return cc, (f"attnlab's compiled kernel visits {c.density(cc):.1%} of {t.block_q}×{t.block_k} blocks, masks "
                "read inside the tiles" + (f", {c.mods} computed there from positions" if c.mods else ""))


def _calibrated_dense(c: _Call):
    r = c.r
    if r.need_weights or K.COMPILED not in c.ok or not c.plain:
        return None
    gqa, grad = r.H != r.Hkv, r.needs_grad
    # Note [Plan the pass that runs]: a call whose inputs require grad will run a backward, and the kernels'
    # backward speeds differ from their forward speeds (Zen 5: compiled fp32 fwd+bwd 1.21x SDPA against 2.05x
    # forward; AMX Xeon bf16: 1.29x against 1.51x), so it is planned by the forward + backward threshold where
    # one was measured (``Rates.compiled_train_min_pairs``), else by the forward's
    what = f"{r.dtype} {'GQA ' if gqa else ''}{'training (forward + backward) ' if grad else ''}calls"
    if c.rates.compiled_dense_wins(r.dtype, r.pairs, r.causal_only, gqa, grad):
        return K.COMPILED, f"attnlab's compiled kernel is faster than SDPA for {what} of this size here"
    if K.SDPA in c.ok and c.rates.dense_threshold(r.dtype, r.causal_only, gqa, grad)[0]:
        # measured, and the compiled kernel loses at this size: its per-call and per-tile overhead is what the
        # size threshold holds, and predicted times (FLOPs over a rate) would not see it
        return K.SDPA, f"SDPA is faster than attnlab's compiled kernel for {what} of this size here (measured size threshold)"


def _block_skipping(c: _Call):
    sp = K.SPARSE
    if not c.r.need_weights and c.r.pattern and sp in c.ok and (
            1 - c.density(sp) >= SPARSE_MIN_EMPTY or K.SDPA not in c.ok):
        t = c.tiling(sp)
        return sp, (f"the pattern leaves {c.density(sp):.1%} of {t.block_q}×{t.block_k} blocks; "
                    "the fused kernel runs on just those")


#: {(request, block size, candidates, id(rates)): (rates, kernel)}: ``_fastest``'s choice for calls whose
#: tilings follow from sizes alone (no pattern or mask: no layout is read), so a layer planning on every
#: call compares the kernels once per shape
_FASTEST: dict = {}


def _fastest(c: _Call):
    if len(c.ok) == 1:  # nothing to compare: no layout is built for it
        k = c.ok[0]
    elif c.r.pattern or c.r.keep_mask or c.r.float_mask:
        k = min(c.ok, key=lambda k: c.seconds(k))  # ties keep FALLBACK_ORDER (min is stable)
    else:
        key = (c.r_choice, c.bs, c.ok, id(c.rates))
        hit = _FASTEST.get(key)
        if hit is None or hit[0] is not c.rates:
            if len(_FASTEST) >= 512:
                _FASTEST.clear()
            hit = _FASTEST[key] = (c.rates, min(c.ok, key=lambda k: c.seconds(k)))
        k = hit[1]
    fields = {}
    if "{backend}" in k.why:
        fields["backend"] = c.backend or "its own choice of"
    if "{mods}" in k.why:
        fields["mods"] = f" ({c.mods} computed per tile)" if c.mods else ""
    if "{refused}" in k.why:
        fields["refused"] = ", ".join(m.name for m in _FALLBACK if m not in c.ok)
    return k, k.why.format(**fields)


#: auto's rules, in order: the first that fits chooses (``Plan.rule`` names it)
RULES: tuple[Rule, ...] = (
    Rule("decode shape -> decode kernel (plain decode where SDPA is faster: SDPA)", _decode),
    Rule("weights, small scores -> dense", _small_weights),
    Rule("weights -> second pass over the log-sum-exp", _second_pass_weights),
    Rule("weights -> the kernel that returns them", _only_weights),
    Rule("masks or score mods -> compiled tiles", _mask_tiles),
    Rule("calibrated: compiled or SDPA by the measured size threshold", _calibrated_dense),
    Rule("pattern with many empty blocks -> block skipping", _block_skipping),
    Rule("fastest capable kernel by predicted time", _fastest),
)


def candidates(refused: dict[str, str]) -> tuple[str, ...]:
    """The kernels auto may choose from: exactly those whose declarations accept the request (every
    kernel not in ``refused``), in ``FALLBACK_ORDER``."""
    return tuple(k.name for k in _FALLBACK if k.name not in refused)


def _choose(c: _Call, refused: dict[str, str]) -> tuple[Kernel, str, str]:
    """(kernel, why, rule name): the first of ``RULES`` that fits. Auto refuses only what every kernel refuses."""
    if not c.ok:
        reasons = "; ".join(f"{m}: {why}" for m, why in refused.items())
        raise ValueError(f"no attention method can run these inputs ({reasons})")
    for rule in RULES:
        got = rule.pick(c)
        if got is not None:
            return got[0], got[1], rule.name
    raise AssertionError("the last rule always chooses")  # pragma: no cover


def plan(p: Prepared, method: str = "auto", need_weights: bool = False, strict: bool = False,
         block_size: int | None = None, *, costs: bool = True, device: str | None = None) -> Plan:
    """The plan for prepared inputs: refusals of every kernel, then the requested method (raising when
    it is refused) or auto's choice, with the chosen kernel's tiling. ``costs=False`` skips the cost of
    kernels auto need not compare; ``device`` plans as if the inputs were on that device type (meta
    tensors describing a CPU call)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    check_block_size(block_size)
    backend = sdpa_backend_of(p, device) if (strict or costs) else None
    r = p.request(need_weights, strict, backend)
    if device is not None:
        r = dataclasses.replace(r, device=device)
    refused = refusals(r)
    c = _Call(p, r, block_size, tuple(k for k in _FALLBACK if k.name not in refused), backend, costs)
    if method != "auto":
        if method in refused:
            raise ValueError(f"method={method!r} cannot run these inputs: {refused[method]}")
        kernel, reason, rule = K.get(method), "requested", "requested"
    else:
        kernel, reason, rule = _choose(c, refused)
    t = c.tiling(kernel)
    decode = kernel is K.DECODE
    if decode and method != "auto":
        reason = "requested; " + (kernel.decode_reason(p, costs) if costs else "decode path")
    if r.dropout_p > 0 and kernel.spec.dropout and kernel.spec.blocked:
        reason += ("; dropout is drawn per block run by SDPA: the same distribution as F.dropout, but not "
                   "the same random stream for the same RNG state (matching it would draw all L×S)")
    if method == "auto":
        reason += f" [rule: {rule}]"
    out = Plan(kernel.name, reason, refused, sdpa_backend=backend or "unknown", decode=decode,
               block_size=(t.block_q, t.block_k) if t is not None and kernel.spec.blocked else None,
               notes={k.name: "; ".join(n) for k in KERNELS if k.name not in refused and (n := k.spec.notes(r))},
               kernel=kernel, tiling=t, rule=rule)
    out.assumptions = meta_assumptions(p)
    if costs:
        out.rates_source = c.rates.source
        every = {k: k.cost(c.r_choice, c.tiling(k), c.rates) for k in KERNELS}  # seconds: what auto compares
        out.peak_bytes = {k.name: k.spec.peak_bytes(r, c.tiling(k)) for k in KERNELS}  # SDPA's backend known
        out.flops = {k.name: k.spec.flops(r, c.tiling(k)) for k in KERNELS}
        out.seconds = {k.name: v.seconds for k, v in every.items() if k.name not in refused}
        out.rate_sources = {k.name: v.source for k, v in every.items() if k.name not in refused}
    if costs or K.SPARSE in c._tilings:
        out.density = c.density(K.SPARSE)
    return out


def plan_cache(call: CacheCall, method: str = "auto", *, costs: bool = False) -> Plan:
    """The plan for a call against a KV cache (``kernels.cacheview.CacheCall``: ``attention_with_kvcache``, the
    Hugging Face generation step): every kernel's refusals (a kernel reads the view only where its declaration
    says so: ``KernelSpec.cache_views``), then the requested kernel or auto's rules, the same table ``plan``
    walks (its decode rule is the one SDPA-or-decode decision). Raises ValueError, naming every kernel's reason,
    when none reads this view (the caller then gathers the cache into ordinary tensors)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    key = None
    if not costs:  # Note [Cache plans]
        q, contiguous = call.q, call.kind == "contiguous"
        # (S only where it can matter: the rule's SDPA test reads a contiguous call's, a window is judged at it)
        S = call.S if contiguous or call.windowed else None
        sdpa_wins = (contiguous and not call.quantized
                     and rates.current().plain_decode_on_sdpa(q.dtype, q.shape[2] != call.k.shape[2], S, step=True))
        key = (call.plan_key(S), method, sdpa_wins, S is None or S > 0)
        hit = _CACHE_PLANS.get(key)
        if hit is not None:
            return hit
    r = call.request()
    refused = refusals(r)
    c = _Call(call, r, None, tuple(k for k in _FALLBACK if k.name not in refused), None, costs)
    if method != "auto":
        if method in refused:
            raise ValueError(f"method={method!r} cannot run this KV-cache call: {refused[method]}")
        kernel, reason, rule = K.get(method), "requested", "requested"
    else:
        kernel, reason, rule = _choose(c, refused)
        reason += f" [rule: {rule}]"
    # (the tiling only for explain: run_cache schedules the call itself, and a generation step plans every layer)
    out = Plan(kernel.name, reason, refused, decode=kernel is K.DECODE, kernel=kernel,
               tiling=c.tiling(kernel) if costs else None, rule=rule)
    if costs:
        out.rates_source = c.rates.source
        every = {k: k.cost(r, c.tiling(k), c.rates) for k in c.ok}
        out.seconds = {k.name: v.seconds for k, v in every.items()}
        out.rate_sources = {k.name: v.source for k, v in every.items()}
        out.flops = {k.name: v.flops for k, v in every.items()}
        out.peak_bytes = {k.name: v.peak_bytes for k, v in every.items()}
    if key is not None and (rule == "requested" or rule == RULES[0].name) and len(_CACHE_PLANS) < 1024:
        _CACHE_PLANS[key] = out
    return out


# Note [Cache plans]: a generation loop plans one KV-cache call per layer and step, and the key count S grows by one
# each step, so a memo keyed by the whole request never hits. For a cache view the declarations' refusals do not
# read S (``KernelSpec.max_queries`` passes any cache call of few queries), and the decode rule reads it only
# through ``Rates.plain_decode_on_sdpa`` (one bool, for a contiguous cache SDPA can read). So a plan made by a
# request or by the decode rule is kept under the request with S set to 0 and that bool: a later step of the same
# shapes reuses it without building the request, the refusal check and the rule walk. The key is the request's
# fields but S, as a tuple (``CacheCall.plan_key``; whether a window hides keys at this S is one of them). Plans made by the later rules (their costs read S) are
# not kept, and none with costs (explain). Forgotten when the rates change.
_CACHE_PLANS: dict[tuple, Plan] = {}
rates.on_change(_CACHE_PLANS.clear)


def meta_assumptions(p: Prepared) -> list[str]:
    """What planning meta inputs (shapes and dtypes, no values) must assume where a real call would read
    values: a meta ``attn_mask`` marks no key dead (Note [Dead keys]) and no block empty; meta per-batch
    ALiBi slopes are taken as differing across the batch. Empty for inputs that hold values."""
    m, out = p.mask, []
    if any(t is not None and t.device.type == "meta" for t in (m.keep, m.bias)):
        out.append("attn_mask holds no values (meta): no key is taken as dead and no block as empty; "
                   "a real mask can only let the kernels skip more")
    if m.alibi is not None and m.alibi.device.type == "meta" and m.alibi.shape[0] > 1:
        out.append("per-batch alibi_slopes hold no values (meta): taken as differing across the batch "
                   "(equal rows would run as [H])")
    return out


def choose_lse_kernel(p: Prepared, block_size: int | None = None) -> tuple[list[tuple[Kernel, Tiling | None]],
                                                                            dict[str, str]]:
    """For ``attention_with_lse``: the kernels that can return (out, lse) for these inputs with their
    tilings, in ``kernels.LSE_ORDER``, and why the others cannot."""
    r = dataclasses.replace(p.request(), needs_lse=True)
    refused = refusals(r)
    usable = [k for k in K.LSE_ORDER if k.name not in refused]
    c = _Call(p, r, block_size, tuple(usable), None, False)
    return [(k, c.tiling(k)) for k in usable], refused


# -- what a layer (nn.MultiHeadAttention) runs --------------------------------------------------------
def layer_method(p: Prepared, method: str, need_weights: bool) -> tuple[str, str | None]:
    """(method to run, why the layer's own method gave way or None) for a layer configured with ``method``:
    the method itself, or "auto" when the planner refuses it only for what the layer brings: weights asked
    for (by the caller or a weights hook), no mask to skip work with (an unpadded batch under a kernel
    that needs sparsity), or a learned float bias that requires grad (the reason is then returned, for the
    layer's one warning). Every exact method gives the same output. Any other refusal (e.g. the compiled
    extension not built) is left to ``plan``, which raises it."""
    if method == "auto":
        return method, None
    r = p.request(need_weights)
    if method not in refusals(r):
        return method, None
    layer_only = dataclasses.replace(r, need_weights=False, float_mask_grad=False, pattern=True)
    if method in refusals(layer_only):
        return method, None  # refused for the inputs themselves: the planner's error says why
    if p.mask_requires_grad and not K.get(method).float_mask_grad and torch.is_grad_enabled():
        # Note [Learned bias and the tiled kernel]: the tiled/sparse backward does not differentiate
        # a float mask; a learned bias (T5) is trained through auto (sdpa/dense/compiled) instead
        return "auto", "learned bias"
    return "auto", None


def takes_alibi_slopes(p: Prepared, method: str, need_weights: bool) -> bool:
    """Whether the kernel ``plan`` picks for ``p`` (prepared with ALiBi slopes) computes ALiBi from
    positions (else a layer writes the bias out into its mask, as before slopes existed)."""
    try:
        return plan(p, method, need_weights, costs=False).kernel.alibi in ("native", "positions")
    except ValueError:
        return False
