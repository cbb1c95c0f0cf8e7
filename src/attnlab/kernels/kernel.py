"""One door per kernel: a :class:`Kernel` object holds everything attnlab knows about one attention kernel.

- its declared capabilities (``spec``, a :class:`~attnlab.kernels.spec.KernelSpec`; the fields read
  through the object: ``kernel.weights``, ``kernel.not_supported_reasons(r)``, ...),
- ``tiling(p, r, block_size, rates)``: the tile shape it would run a prepared call with, and how many
  tiles it visits (None for unblocked kernels),
- ``cost(r, tiling, rates)``: FLOPs, peak bytes and predicted seconds, with where the rate came from,
- ``run(p, tiling, need_weights, need_lse)``: (out [N, H, L, Ev], weights [N, H, L, S] | None,
  lse [N, H, L] | None) on prepared inputs (``attnlab.shapes.Prepared``, live view).

The planner (``attnlab.kernels.planner``) chooses among these objects; ``attnlab.attention`` calls
``plan.kernel.run``. Nothing outside ``kernels/`` switches on a kernel's name.

``rates`` is the cost model's rate table (``attnlab.kernels.rates.Rates``: a calibration of this CPU
or the built-in table); the planner passes it in, so a kernel reads no file itself.

Legend: N batch (leading dims flattened), H heads, Hkv key/value heads, L query length, S key length,
E head dim, Ev value head dim.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import patterns as P
from .spec import KernelSpec, Request, Tiling

__all__ = ["Kernel", "Cost", "Declined", "nonempty_blocks", "causal_blocks", "dead_per_head", "BUILTIN_SOURCE"]

#: where a rate the kernel declares itself comes from (``Cost.source``)
BUILTIN_SOURCE = "built-in table, not calibrated"


class Declined(Exception):
    """``Kernel.run`` found at run time that it cannot serve the call after all (PyTorch's private CPU op
    refused the inputs): the caller moves on to its next kernel."""


@dataclass(frozen=True)
class Cost:
    """What a kernel is predicted to pay for one call: FLOPs, peak bytes, seconds at ``gflops``, and
    where that rate came from ("built-in table", or the calibration's source line)."""

    flops: int
    peak_bytes: int
    seconds: float
    gflops: float
    source: str


class Kernel:
    """One attention kernel: capabilities (``spec``), tiling, cost and run (see the module docstring).

    gflops: the built-in rate (GFLOP/s on the 2-core reference machine) its predicted time uses when no
        calibration measured it (``Rates.kernel_gflops``); a subclass may scale it by the calibrated rates
        (``rate``).
    why: what ``explain`` says when auto picks it as the fastest capable kernel; may name ``{backend}``
        (SDPA's), ``{mods}`` (" (soft-capping and ALiBi computed per tile)" or "") and ``{refused}``.
    title: the exact mechanism's class name (``attnlab.mechanisms.exact``); time / memory / paper: its
        registry entry; default_block: the (block_q, block_k) its registry entry's memory estimate assumes.
    """

    def __init__(self, spec: KernelSpec, *, gflops: float, title: str, why: str, time: str = "O(L·S·D)",
                 memory: str = "", paper: str = "Vaswani et al. 2017, Attention Is All You Need",
                 default_block: tuple[int, int] = (128, 128)):
        self.spec, self.gflops, self.title, self.why = spec, float(gflops), title, why
        self.name = spec.name  # the kernel's method name (``attnlab.attention(method=...)``)
        self.time, self.memory, self.paper, self.default_block = time, memory, paper, default_block

    # -- capabilities: the declaration, read through the object --------------------------------------
    def __getattr__(self, name):
        if name in ("spec", "name"):  # not set yet (copy/pickle): no recursion
            raise AttributeError(name)
        return getattr(self.spec, name)

    def __repr__(self) -> str:
        return f"<kernel {self.spec.name}>"

    # one object per kernel: copies (``dataclasses.asdict`` of a plan) and pickles are the kernel itself
    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return (_kernel_named, (self.spec.name,))

    def unavailable_reason(self) -> str | None:
        """Why this kernel cannot run on this machine at all (its extension is not built or does not load), or
        None: its declaration's dynamic fact (``KernelSpec.unavailable``), asked without a request."""
        return self.spec.unavailable(None) if self.spec.unavailable is not None else None

    def not_supported_reasons(self, r: Request) -> list[str]:
        """Every reason this kernel cannot run ``r`` (empty: it can): ``KernelSpec.not_supported_reasons``."""
        return self.spec.not_supported_reasons(r)

    def notes(self, r: Request) -> list[str]:
        """What running ``r`` here costs beyond the kernel's usual work (``KernelSpec.notes``)."""
        return self.spec.notes(r)

    def decodes(self, p, r: Request) -> bool:
        """Whether this kernel runs ``p`` on a decode path (few queries against a KV cache); False here."""
        return False

    def decode_reason(self, p, costs: bool = False) -> str:
        """What this kernel's decode path does for ``p`` (splits, bytes read; with ``costs`` the time), for
        ``explain``; only asked of a kernel that ``decodes``."""
        return "decode path"

    # -- tiling and cost -----------------------------------------------------------------------------
    def tiling(self, p, r: Request, block_size: int | None, rates) -> Tiling | None:
        """The tiles this kernel would run prepared inputs ``p`` with (None: unblocked, every pair computed)."""
        return None

    def rate(self, r: Request, t: Tiling | None, rates) -> tuple[float, str]:
        """(GFLOP/s, where it came from) this kernel is predicted to reach on ``r`` with tiling ``t``: the
        calibration's measured rate (``rates.kernel_gflops``), else the built-in ``gflops``."""
        measured = rates.kernel_gflops.get(self.spec.name)
        return (measured, rates.source) if measured else (self.gflops, BUILTIN_SOURCE)

    def seconds(self, r: Request, t: Tiling | None, rates) -> float:
        """Predicted seconds: the declared FLOPs over ``rate`` (what auto compares kernels by), counting no
        more pairs than L×S: tiles at the sequence's edges (and tiles larger than it) compute only the part
        they cover, which ``Tiling.computed``'s whole-tile count overstates."""
        flops = min(self.spec.flops(r, t), self.spec.flops(r, None)) if t is not None else self.spec.flops(r, t)
        return flops / (self.rate(r, t, rates)[0] * 1e9)

    def cost(self, r: Request, t: Tiling | None, rates) -> Cost:
        """FLOPs and peak bytes from the declaration, ``seconds`` and the rate with where it came from."""
        gflops, source = self.rate(r, t, rates)
        return Cost(self.spec.flops(r, t), self.spec.peak_bytes(r, t), self.seconds(r, t, rates), gflops, source)

    # -- running -------------------------------------------------------------------------------------
    def direct(self, p, t: Tiling | None, need_weights: bool = False):
        """``run`` for inputs of ``p``'s signature as one callable ``f(query, key, value) -> out`` on the
        caller's own tensors (the plan cache keeps it: a repeated small call then does no Python work but
        the signature), or None when running needs the prepared inputs (masks, dead keys, reshapes)."""
        return None

    def run(self, p, t: Tiling | None, need_weights: bool = False, need_lse: bool = False):
        """(out [N, H, L, Ev], weights [N, H, L, S] or None, lse [N, H, L] or None) for prepared inputs ``p``."""
        raise NotImplementedError

    def run_cache(self, c):
        """(out [B, L, H, Dv], lse [B, H, L] or None) for a KV-cache view (``kernels.cacheview.CacheCall``), in
        the kind its declaration reads (``KernelSpec.cache_views``)."""
        raise NotImplementedError(f"kernel {self.spec.name} reads no KV-cache view")


def _kernel_named(name: str) -> "Kernel":
    from . import get  # the package imports this module (unpickling a kernel by name)

    return get(name)


def dead_per_head(p):
    """The keys [B|1, H, S] dead for only some heads of a GQA group, which kernels repeating ``kv_k``/``kv_v``
    zero per head (the copies ``Prepared.k``/``v`` zero), or None."""
    return p.dead if p.dead_per_head else None


def nonempty_blocks(p, bq: int, bk: int) -> int:
    """Non-empty (bq x bk) blocks of the combined mask. A band alone (causal, sliding windows) is counted
    by the pattern in O(L / bq) (``Pattern.nonempty_blocks``); otherwise from the mask's layout, which
    is cached for the kernel that runs next."""
    pat, mask = p.mask.pattern, p.mask
    L, S = p.info.L, p.info.S
    if pat is not None and mask.keep is None and pat.band(L, S) is not None:
        return pat.nonempty_blocks(L, S, bq, bk)
    return int((mask.layout(bq, bk) != P.EMPTY).sum())


def causal_blocks(L: int, S: int, bq: int, bk: int) -> int:
    """Non-empty (bq x bk) blocks of a top-left causal mask, counted without building the layout."""
    nk = -(-S // bk)
    return sum(min(nk, min(L - 1, qi * bq + bq - 1) // bk + 1) for qi in range(-(-L // bq)))


def masked_tiling(p, bq: int, bk: int) -> Tiling:
    """(bq, bk) tiles over ``p``'s mask: the causal blocks, the mask's non-empty blocks, or every block
    (None) without a mask."""
    if p.is_causal_only:
        return Tiling(bq, bk, causal_blocks(p.info.L, p.info.S, bq, bk))
    return Tiling(bq, bk, None if p.mask.is_trivial else nonempty_blocks(p, bq, bk))


def materialize(mask, p, dtype: torch.dtype | None = None) -> torch.Tensor:
    """One SDPA mask (bool, or float in ``dtype``, default q's, when there is a bias) for the whole
    [B|1, H|1, L, S]."""
    if getattr(mask.pattern, "by_key", False) and mask.keep is None and mask.bias is None and mask.alibi is None:
        # key padding alone: SDPA broadcasts a [B, 1, 1, S] mask, so no L×S tensor is built
        kk = mask.pattern.key_mask(mask.S)
        return kk.to(p.q.device).view(kk.shape[0], 1, 1, mask.S)
    i = torch.arange(mask.L, device=p.q.device).unsqueeze(-1)
    j = torch.arange(mask.S, device=p.q.device).unsqueeze(0)
    keep, bias = mask.block(i, j, p.N)
    if bias is None:
        return keep
    b = bias.to(dtype or p.q.dtype)
    return b.masked_fill(~keep, float("-inf")) if keep is not None else b
