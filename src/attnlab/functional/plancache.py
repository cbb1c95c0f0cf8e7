"""The plan cache: a repeated ``attention`` call skips the input checks and the planning it already did.

Note [Plan cache]: what ``shapes.prepare`` checks and what ``planner.plan`` decides depend on the call's
*signature* (shapes, strides, dtypes, devices, requires_grad and grad mode, the flags and numbers passed,
the pattern, the thread count and the environment the planner reads), never on the inputs' values —
except where a value is read: a user ``attn_mask`` (its dead keys and empty blocks) and ``alibi_slopes``
(their finiteness and equal rows), and a pattern holding a tensor or a function (its content may change
in place). Those calls are not cached. For the others the live view of the first call (Note [Dead keys]),
stripped of its tensors, and its plan are kept under the signature; a hit rebinds the new tensors to them
(``Prepared.rebind``), which is what ``prepare(...).live()`` would have built. Bounded (``MAX_ENTRIES``,
oldest first out: a hit does not refresh its entry, which would hash the signature a second time, Note [Small
call overhead]; a plan evicted while in use is made again once); ``clear()`` empties it (whenever the planner's
rates change: ``kernels.rates.on_change``).

Note [Small call overhead]: a plan-cache hit on q = k = v [1, 8, 16, 64] fp32 (2 threads, one process,
interleaved rounds of 2,000 calls, medians; Sapphire Rapids class Xeon, load ~2.6 from other work): SDPA alone
11.2 us, ``attention`` 17.1 us before this note's changes (1.53x): the signature 2.5 us (three tensors' shape,
stride, dtype, device and grad flag 0.36 us each; the vmap/grad-wrapper test 0.5 us; the rest flags and
environment), the lookup 1.2 us (the signature's hash, 0.25 us, twice with the LRU refresh, and the counters),
the kernel's direct call 0.7 us over SDPA's own (its argument checks: ``sdpa``'s re-striding tests, now made
once per plan: ``fused._direct_sdpa``), ``attention``'s own frame and argument binding about 1.5 us. After
(one lookup, a plain-loop wrapper test, the direct call's checks once per plan), two runs: 15.4 us against
SDPA's 10.7-10.8 (1.43-1.44x); at [1, 12, 128, 64] 1.026-1.028x of SDPA's 217 us. ``attnlab verify``
records these two ratios, quiet and busy, with its headline ratios.
"""
from __future__ import annotations

import dataclasses
import os
import weakref
from collections import OrderedDict

import torch

from .. import kernels
from .. import patterns as P
from ..kernels import rates

__all__ = ["MAX_ENTRIES", "ENV_VARS", "signature", "get", "put", "clear", "stats"]

MAX_ENTRIES = 256
#: environment variables the planner (or the kernels' plans) may read: part of every signature
ENV_VARS = ("ATTNLAB_EXT_GEMM", "ATTNLAB_CALIBRATION", "ATTNLAB_CACHE_DIR")
# os.environ encodes each key on every lookup (about 1 µs); on POSIX its raw bytes dict is read instead
_RAW_ENV = getattr(os.environ, "_data", None)
_RAW_KEYS = tuple(os.fsencode(k) for k in ENV_VARS)
_ENTRIES: OrderedDict = OrderedDict()
_STATS = {"hits": 0, "misses": 0}
_SCALARS = (int, float, str, bool, type(None))
_PATTERN_OK: "weakref.WeakKeyDictionary[P.Pattern, bool]" = weakref.WeakKeyDictionary()


def _value_only(pat) -> bool:
    """Whether a pattern is described by its fields' values alone (ints, floats, strings, tuples of them,
    other such patterns): then its identity is a safe part of a signature."""
    if not dataclasses.is_dataclass(pat):
        return False
    for f in dataclasses.fields(pat):
        x = getattr(pat, f.name)
        if isinstance(x, P.Pattern):
            if not _value_only(x):
                return False
        elif isinstance(x, tuple):
            if not all(isinstance(e, _SCALARS) for e in x):
                return False
        elif not isinstance(x, _SCALARS):
            return False
    return True


def _pattern_ok(pat) -> bool:
    try:
        return _PATTERN_OK[pat]
    except KeyError:
        ok = _PATTERN_OK[pat] = _value_only(pat)
        return ok
    except TypeError:  # not weak-referenceable: not cached
        return False


def _tensor_sig(t):
    return (t.shape, t.stride(), t.dtype, t.device, t.requires_grad)


def signature(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, pattern, softcap,
              alibi_slopes, method, need_weights, strict, block_size):
    """The call's signature (hashable), or None when the call reads values that a signature cannot
    hold (Note [Plan cache]) or is not plain enough to be sure it validates the same way."""
    if attn_mask is not None or alibi_slopes is not None:
        return None
    if not (type(query) is torch.Tensor and type(key) is torch.Tensor and type(value) is torch.Tensor):
        return None  # subclasses (and non-tensors, which raise) take the full path
    if kernels.transformed(query, key, value):
        return None  # a vmap / grad transform's wrappers: the plan may differ (no decode path for them)
    if type(is_causal) is not bool or type(enable_gqa) is not bool or type(need_weights) is not bool \
            or type(strict) is not bool:
        return None
    if pattern is not None and not _pattern_ok(pattern):
        return None
    qs = _tensor_sig(query)
    ks = qs if key is query else _tensor_sig(key)
    vs = ks if value is key else qs if value is query else _tensor_sig(value)
    env = (tuple(map(_RAW_ENV.get, _RAW_KEYS)) if isinstance(_RAW_ENV, dict)
           else tuple(os.environ.get(k) for k in ENV_VARS))
    return (qs, ks, vs, torch.is_grad_enabled(),
            type(dropout_p), dropout_p, is_causal, type(scale), scale, enable_gqa, pattern, type(softcap), softcap,
            method, need_weights, strict, type(block_size), block_size, torch.get_num_threads(), env)


def get(sig):
    """(template, plan, direct) cached under ``sig`` (``put``), or None."""
    if sig is None:
        return None
    hit = _ENTRIES.get(sig)
    if hit is None:
        _STATS["misses"] += 1
        return None
    _STATS["hits"] += 1
    return hit


def put(sig, template, plan, direct=None) -> None:
    """Keep ``(template, plan, direct)`` under ``sig`` (a None signature keeps nothing). ``direct``: the
    plan's kernel as one callable on the caller's (query, key, value), when the kernel has one for these
    inputs (``Kernel.direct``): a hit then skips rebuilding the prepared inputs too."""
    if sig is None:
        return
    _ENTRIES[sig] = (template, plan, direct)
    _ENTRIES.move_to_end(sig)
    while len(_ENTRIES) > MAX_ENTRIES:
        _ENTRIES.popitem(last=False)


def clear() -> None:
    """Forget every cached plan (and the hit/miss counts)."""
    _ENTRIES.clear()
    _STATS.update(hits=0, misses=0)


def stats() -> dict:
    """{"entries", "hits", "misses"} since the last ``clear``."""
    return {"entries": len(_ENTRIES), **_STATS}


rates.on_change(clear)  # a plan made with the old rates is not the one the new ones make
