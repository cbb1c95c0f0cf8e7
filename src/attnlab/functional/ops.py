"""The doors as torch ops (``attnlab::attention``, ``attnlab::attention_with_lse``, ``attnlab::kvcache_step``), so
``torch.compile`` traces them and ``torch.export`` keeps them.

Note [Doors as torch ops]: under ``torch.compile`` (``torch.compiler.is_compiling()``, the first line of each door:
about 0.09 us, not measurable on an 18 us call of q = k = v [1, 8, 16, 64]) the doors hand their call to a
``torch.library.custom_op`` before any code dynamo cannot trace (plan cache, ``shapes.prepare``, pybind calls). Each
op's real implementation is the eager door itself, so a compiled call runs exactly the kernel an eager call runs; its
fake implementation gives shapes and dtypes only. ``flex_attention`` without a score_mod calls the attention op (a
BlockMask as the bool mask it stands for); with one, its definition in plain torch (``flex_call``), which dynamo
traces with score_mod inlined. ``nn.MultiHeadAttention`` and the HF interface function call ``attention``.

- Arguments. Tensors (query, key, value, attn_mask, alibi_slopes, sinks) and plain numbers, flags and strings
  (dropout_p, is_causal, scale, enable_gqa, method, need_weights, strict, block_size, softcap) are op arguments. A
  pattern is not: a pattern holding no tensor (causal, windows, bands, ...) is kept in a process-level registry
  (``_PATTERNS``) under its ``repr`` taken at trace time (``pattern_key``, which dynamo treats as a constant, so the
  key is a string literal in the graph; patterns are frozen dataclasses, so equal reprs are equal patterns, and
  the registry holds one entry per distinct pattern ever compiled); a pattern holding tensors (key padding,
  documents, block tables, BlockMasks) or built inside the compiled function is materialised into the bool mask
  it stands for (``Pattern.materialize``, plain torch that dynamo traces; ``key_padding(lengths)`` as the
  [B, 1, 1, S] mask of its lengths, its length check an assert in the graph) and ANDed into ``attn_mask``. Same
  result, without the pattern's block skipping. One pattern does not trace: a ``&`` / ``|`` with
  ``key_padding(lengths)`` inside (its materialize reads the lengths in Python, a data-dependent guard dynamo
  refuses); ``from_key_padding_mask`` (a bool tensor) does.
- Outputs. ``attention`` always returns (out, weights), weights an empty tensor unless need_weights; the door
  unpacks. Outputs are contiguous (as the fake implementation says; a kernel that wrote another layout is copied)
  and never alias inputs (an op's rule: a kernel that returns an input's storage is copied).
- Backward. ``register_autograd`` may hold only ops, so the backward is an op too (``attnlab::attention_backward``):
  it re-runs the eager door under ``torch.enable_grad()`` on the saved inputs and differentiates it with
  ``torch.autograd.grad`` (the kernels' own backwards, recompute included), for query, key, value, a float
  attn_mask and sinks. Cost: one extra forward per backward (training a compiled call costs forward + forward +
  backward, where eager costs forward + backward), and the saved inputs are the inputs only: no output, no lse, no
  weights are kept between forward and backward. The kernels' autograd state cannot cross the op boundary, and
  not all of them have a backward that starts from (out, lse), so re-running is the one backward every kernel has.
  ``attention_with_lse``'s lse is not differentiable, as the eager door's.
- Dropout. The forward op records the CPU generator's state before it runs (an output, uint8) and the backward
  re-runs the forward from that state, so the dropout mask of the backward's forward is the forward's.
- Refused under compile (an error that names the argument; without ``fullgraph`` dynamo breaks the graph there and
  the call runs eagerly): a pattern that is not an ``attnlab.patterns.Pattern``. ``attention_with_kvcache`` takes
  a plain cache (tensors, ``kvcache_step``: declared as mutating k_cache and v_cache); an int8 ``QuantizedKV``
  cache or a ``Rotary`` under compile raise (``kvcache_refusal``).
"""

from __future__ import annotations

import torch

from .. import patterns as P
from ..kernels.lse import acc_dtype

__all__ = ["attention", "attention_with_lse", "attention_backward", "kvcache_step", "pattern_key", "door_call",
           "lse_door_call", "kvcache_call", "kvcache_refusal", "flex_call"]

_PATTERNS: dict[str, object] = {}


def _holds_tensors(obj, depth: int = 0) -> bool:
    """Whether a pattern (or a pattern it combines) holds a tensor or a callable (whose closure may)."""
    if isinstance(obj, torch.Tensor):
        return True
    if depth > 8 or not hasattr(obj, "__dict__"):
        return False
    for v in vars(obj).values():
        if isinstance(v, torch.Tensor) or (callable(v) and not isinstance(v, type)):
            return True
        if isinstance(v, (list, tuple)) and any(_holds_tensors(x, depth + 1) for x in v):
            return True
        if hasattr(v, "__dict__") and not isinstance(v, type) and _holds_tensors(v, depth + 1):
            return True
    return False


@torch.compiler.assume_constant_result
def pattern_key(pattern) -> str:
    """The registry key of ``pattern``: "" for None, "*" for a pattern to materialise (it holds tensors), else its
    repr, registered on first sight (Note [Doors as torch ops])."""
    if pattern is None:
        return ""
    if not vars(pattern) or _holds_tensors(pattern):  # an empty __dict__: a pattern built inside the compiled
        return "*"  # function, of which dynamo hands over a bare instance (its fields live in dynamo's trace)
    key = repr(pattern)
    _PATTERNS.setdefault(key, pattern)
    return key


def _pattern(key: str):
    return _PATTERNS[key] if key else None


def _and_pattern(attn_mask, pattern, L: int, S: int):
    """attn_mask (or None) with ``pattern``'s bool mask [L, S] | [B, 1, L, S] ANDed in (-inf where it drops)."""
    lengths = getattr(pattern, "lengths", None)
    if getattr(pattern, "by_key", False) and isinstance(lengths, torch.Tensor) and lengths.dim() == 1:
        # key_padding(lengths): its key_mask checks the lengths in Python, which dynamo cannot guard on; the
        # same check runs in the graph instead
        torch._assert_async((lengths <= S).all(), f"key_padding: a length is longer than the key length S={S}")
        keep = (torch.arange(S, device=lengths.device) < lengths.unsqueeze(1)).view(-1, 1, 1, S)  # (B, 1, 1, S)
    else:
        keep = pattern.materialize(L, S, device=None if attn_mask is None else attn_mask.device)
    if attn_mask is None:
        return keep
    if attn_mask.dtype == torch.bool:
        return attn_mask & keep
    return attn_mask.masked_fill(~keep, float("-inf"))


def _check_pattern(pattern, door: str):
    if pattern is not None and not isinstance(pattern, P.Pattern):
        raise TypeError(f"{door}: under torch.compile pattern must be an attnlab.patterns Pattern or None, got "
                        f"{type(pattern).__name__}")


def door_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, pattern, method, need_weights,
              strict, block_size, softcap, alibi_slopes, sinks):
    """``attnlab.attention``'s call under torch.compile: the op, its pattern keyed or materialised."""
    _check_pattern(pattern, "attention")
    pk = pattern_key(pattern)
    if pk == "*":
        attn_mask, pk = _and_pattern(attn_mask, pattern, query.shape[-2], key.shape[-2]), ""
    out, weights, _ = attention(query, key, value, attn_mask, float(dropout_p), bool(is_causal), scale,
                                bool(enable_gqa), pk, method, bool(need_weights), bool(strict), block_size,
                                softcap, alibi_slopes, sinks)
    return (out, weights) if need_weights else out


def lse_door_call(query, key, value, attn_mask, is_causal, scale, enable_gqa, pattern, block_size, softcap,
                  alibi_slopes, sinks):
    """``attnlab.attention_with_lse``'s call under torch.compile."""
    _check_pattern(pattern, "attention_with_lse")
    pk = pattern_key(pattern)
    if pk == "*":
        attn_mask, pk = _and_pattern(attn_mask, pattern, query.shape[-2], key.shape[-2]), ""
    return attention_with_lse(query, key, value, attn_mask, bool(is_causal), scale, bool(enable_gqa), pk,
                              block_size, softcap, alibi_slopes, sinks)


def _doors():
    from . import attention as door, attention_with_lse as lse_door  # the eager doors: their package imports ops

    return door, lse_door


def _own(t: torch.Tensor, inputs) -> torch.Tensor:
    """``t`` contiguous (the strides the fake implementation promises: a kernel may write its output in another
    layout), copied when it shares storage with an input (an op's output never aliases its inputs)."""
    t = t.contiguous()
    if t.numel() == 0:
        return t.clone()
    p = t.untyped_storage().data_ptr()
    return t.clone() if any(x is not None and x.untyped_storage().data_ptr() == p for x in inputs) else t


def _run(lse, q, k, v, mask, slopes, sinks, dropout_p, is_causal, scale, enable_gqa, pattern, method, need_weights,
         strict, block_size, softcap):
    """The eager door: (out, weights or lse or None)."""
    door, lse_door = _doors()
    if lse:
        return lse_door(q, k, v, mask, is_causal, scale, enable_gqa, pattern=_pattern(pattern), block_size=block_size,
                        softcap=softcap, alibi_slopes=slopes, sinks=sinks)
    r = door(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa, pattern=_pattern(pattern), method=method,
             need_weights=need_weights, strict=strict, block_size=block_size, softcap=softcap,
             alibi_slopes=slopes, sinks=sinks)
    return r if need_weights else (r, None)


# -- attnlab::attention ------------------------------------------------------------------------------
@torch.library.custom_op("attnlab::attention", mutates_args=())
def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
              dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool, pattern: str, method: str,
              need_weights: bool, strict: bool, block_size: int | None, softcap: float | None,
              alibi_slopes: torch.Tensor | None, sinks: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``attnlab.attention`` as an op: (out [..., L, Ev], weights [..., L, S] or empty, the generator state the
    forward started from, uint8 (empty without dropout)); ``pattern`` is a ``pattern_key``."""
    ins = (query, key, value, attn_mask, alibi_slopes, sinks)
    state = torch.get_rng_state() if dropout_p > 0 else torch.empty(0, dtype=torch.uint8)
    out, weights = _run(False, query, key, value, attn_mask, alibi_slopes, sinks, dropout_p, is_causal, scale,
                        enable_gqa, pattern, method, need_weights, strict, block_size, softcap)
    weights = _own(weights, ins) if weights is not None else query.new_empty(0)
    return _own(out, ins), weights, state


@attention.register_fake
def _(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, pattern, method, need_weights, strict,
      block_size, softcap, alibi_slopes, sinks):
    out = query.new_empty(query.shape[:-1] + value.shape[-1:])  # (..., L, Ev)
    weights = query.new_empty(query.shape[:-1] + key.shape[-2:-1]) if need_weights else query.new_empty(0)
    n = torch.get_rng_state().numel() if dropout_p > 0 else 0
    return out, weights, query.new_empty(n, dtype=torch.uint8)


def _setup(ctx, inputs, output):
    q, k, v, mask = inputs[:4]
    slopes, sinks = inputs[-2:]
    ctx.save_for_backward(q, k, v, mask, slopes, sinks, output[2])
    ctx.args = inputs[4:-2]


def _backward(ctx, grad_out, grad_weights, _grad_state):
    q, k, v, mask, slopes, sinks, state = ctx.saved_tensors
    need = ctx.needs_input_grad
    dropout_p, is_causal, scale, enable_gqa, pattern, method, need_weights, strict, block_size, softcap = ctx.args
    gq, gk, gv, gm, gs = attention_backward(
        grad_out, grad_weights if need_weights else None, q, k, v, mask, slopes, sinks, state, False, dropout_p,
        is_causal, scale, enable_gqa, pattern, method, need_weights, strict, block_size, softcap,
        bool(need[3]), bool(need[15]))
    return gq, gk, gv, gm if need[3] else None, *([None] * 11), gs if need[15] else None


attention.register_autograd(_backward, setup_context=_setup)


# -- attnlab::attention_with_lse ---------------------------------------------------------------------
@torch.library.custom_op("attnlab::attention_with_lse", mutates_args=())
def attention_with_lse(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                       is_causal: bool, scale: float | None, enable_gqa: bool, pattern: str, block_size: int | None,
                       softcap: float | None, alibi_slopes: torch.Tensor | None,
                       sinks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``attnlab.attention_with_lse`` as an op: (out [..., L, Ev], lse [..., L] float32; float64 for float64)."""
    out, lse = _run(True, query, key, value, attn_mask, alibi_slopes, sinks, 0.0, is_causal, scale, enable_gqa,
                    pattern, "auto", False, False, block_size, softcap)
    ins = (query, key, value, attn_mask, alibi_slopes, sinks)
    return _own(out, ins), _own(lse, ins)


@attention_with_lse.register_fake
def _(query, key, value, attn_mask, is_causal, scale, enable_gqa, pattern, block_size, softcap, alibi_slopes, sinks):
    return (query.new_empty(query.shape[:-1] + value.shape[-1:]),  # (..., L, Ev)
            query.new_empty(query.shape[:-1], dtype=acc_dtype(query.dtype)))  # (..., L)


def _lse_setup(ctx, inputs, output):
    q, k, v, mask = inputs[:4]
    slopes, sinks = inputs[-2:]
    ctx.save_for_backward(q, k, v, mask, slopes, sinks)
    ctx.args = inputs[4:-2]
    ctx.mark_non_differentiable(output[1])  # as the eager door's: the kernels' lse is not differentiable


def _lse_backward(ctx, grad_out, _grad_lse):
    q, k, v, mask, slopes, sinks = ctx.saved_tensors
    need = ctx.needs_input_grad
    is_causal, scale, enable_gqa, pattern, block_size, softcap = ctx.args
    gq, gk, gv, gm, gs = attention_backward(
        grad_out, None, q, k, v, mask, slopes, sinks, None, True, 0.0, is_causal, scale, enable_gqa, pattern,
        "auto", False, False, block_size, softcap, bool(need[3]), bool(need[11]))
    return gq, gk, gv, gm if need[3] else None, *([None] * 7), gs if need[11] else None


attention_with_lse.register_autograd(_lse_backward, setup_context=_lse_setup)


# -- attnlab::attention_backward ---------------------------------------------------------------------
def _autograd_on():
    """A guard under which autograd records again inside an op's implementation: an op called through its
    registered autograd runs below the Autograd dispatch keys (``torch._C._AutoDispatchBelowAutograd``), where
    ``torch.enable_grad()`` alone records nothing."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for k in (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.AutogradOther,
              torch._C.DispatchKey.AutogradNestedTensor):
        exclude = exclude.remove(k)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


@torch.library.custom_op("attnlab::attention_backward", mutates_args=())
def attention_backward(grad_out: torch.Tensor, grad_second: torch.Tensor | None, query: torch.Tensor,
                       key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                       alibi_slopes: torch.Tensor | None, sinks: torch.Tensor | None, rng_state: torch.Tensor | None,
                       lse: bool, dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool,
                       pattern: str, method: str, need_weights: bool, strict: bool, block_size: int | None,
                       softcap: float | None, mask_grad: bool, sinks_grad: bool
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (query, key, value, attn_mask or empty, sinks or empty) of ``attention`` (``lse`` False: the
    second output is the weights) or ``attention_with_lse`` (True: its lse is not differentiable), by re-running
    the eager door under autograd (Note [Doors as torch ops])."""
    q, k, v = (t.detach().requires_grad_(True) for t in (query, key, value))
    wrt = [q, k, v]
    mask = attn_mask
    if mask_grad:
        mask = attn_mask.detach().requires_grad_(True)
        wrt.append(mask)
    s = sinks
    if sinks_grad:
        s = sinks.detach().requires_grad_(True)
        wrt.append(s)
    replay = rng_state is not None and rng_state.numel() > 0
    with _autograd_on(), torch.enable_grad(), torch.random.fork_rng(devices=[], enabled=replay):
        if replay:  # the forward's dropout mask (Note [Doors as torch ops])
            torch.set_rng_state(rng_state)
        out, second = _run(lse, q, k, v, mask, alibi_slopes, s, dropout_p, is_causal, scale, enable_gqa, pattern,
                           method, need_weights, strict, block_size, softcap)
        outs, grads = [out], [grad_out]
        if grad_second is not None and second is not None and second.requires_grad:
            outs.append(second)
            grads.append(grad_second)
        got = torch.autograd.grad(outs, wrt, grads, allow_unused=True)
    got = [torch.zeros_like(t) if g is None else g for t, g in zip(wrt, got)]
    got = [g.contiguous() for g in got]  # the strides the fake implementation promises
    gm = got[3] if mask_grad else query.new_empty(0)
    gs = got[-1] if sinks_grad else query.new_empty(0)
    return got[0], got[1], got[2], gm, gs


@attention_backward.register_fake
def _(grad_out, grad_second, query, key, value, attn_mask, alibi_slopes, sinks, rng_state, lse, dropout_p, is_causal,
      scale, enable_gqa, pattern, method, need_weights, strict, block_size, softcap, mask_grad, sinks_grad):
    gm = attn_mask.new_empty(attn_mask.shape) if mask_grad else query.new_empty(0)
    gs = sinks.new_empty(sinks.shape) if sinks_grad else query.new_empty(0)
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape), gm, gs


# -- attnlab::kvcache_step ---------------------------------------------------------------------------
def kvcache_refusal(k_cache, v_cache, rotary, rotary_cos, rotary_sin) -> str | None:
    """Why ``attention_with_kvcache``'s arguments cannot run as the op under torch.compile, or None."""
    if not isinstance(k_cache, torch.Tensor) or not isinstance(v_cache, torch.Tensor):
        return (f"attention_with_kvcache: under torch.compile the cache must be plain tensors (k_cache "
                f"{type(k_cache).__name__}, v_cache {type(v_cache).__name__}); an int8 QuantizedKV cache runs eagerly "
                "only: call it outside the compiled region (torch.compiler.disable)")
    if rotary is not None or rotary_cos is not None or rotary_sin is not None:
        return ("attention_with_kvcache: rotary is not supported under torch.compile; rotate q and k first "
                "(attnlab.positional) or call it outside the compiled region (torch.compiler.disable)")
    return None


@torch.library.custom_op("attnlab::kvcache_step", mutates_args=("k_cache", "v_cache"))
def kvcache_step(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor | None,
                 v: torch.Tensor | None, cache_seqlens: torch.Tensor | None, cache_seqlens_int: int | None,
                 block_table: torch.Tensor | None, is_causal: bool, window_size: list[int] | None,
                 softcap: float | None, alibi_slopes: torch.Tensor | None, scale: float | None, num_splits: int | None,
                 return_lse: bool, sinks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``attnlab.attention_with_kvcache`` on a plain cache as an op: (out [B, L, H, Dv], lse [B, H, L] float32 or
    empty), k and v appended into k_cache and v_cache in place. Forward only, as the door."""
    from . import attention_with_kvcache as door  # the eager door: its package imports ops

    seqlens = cache_seqlens if cache_seqlens is not None else cache_seqlens_int
    r = door(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, block_table=block_table, is_causal=is_causal,
             window_size=None if window_size is None else tuple(window_size), softcap=softcap,
             alibi_slopes=alibi_slopes, scale=scale, num_splits=num_splits, return_lse=return_lse, sinks=sinks)
    out, lse = r if return_lse else (r, q.new_empty(0, dtype=torch.float32))
    ins = (q, k_cache, v_cache, k, v, cache_seqlens, block_table, alibi_slopes, sinks)
    return _own(out, ins), _own(lse, ins)


@kvcache_step.register_fake
def _(q, k_cache, v_cache, k, v, cache_seqlens, cache_seqlens_int, block_table, is_causal, window_size, softcap,
      alibi_slopes, scale, num_splits, return_lse, sinks):
    B, L, H, _ = q.shape
    lse = q.new_empty(B, H, L, dtype=torch.float32) if return_lse else q.new_empty(0, dtype=torch.float32)
    return q.new_empty(B, L, H, v_cache.shape[-1]), lse  # (B, L, H, Dv), (B, H, L)


def kvcache_call(q, k_cache, v_cache, k, v, cache_seqlens, block_table, is_causal, window_size, softcap,
                 alibi_slopes, rotary, rotary_cos, rotary_sin, scale, num_splits, return_lse, sinks):
    """``attnlab.attention_with_kvcache``'s call under torch.compile: ``kvcache_step`` on a plain cache."""
    why = kvcache_refusal(k_cache, v_cache, rotary, rotary_cos, rotary_sin)
    if why is not None:
        raise TypeError(why)
    t = isinstance(cache_seqlens, torch.Tensor)
    out, lse = kvcache_step(q, k_cache, v_cache, k, v, cache_seqlens if t else None, None if t else cache_seqlens,
                            block_table, bool(is_causal), None if window_size is None else list(window_size), softcap,
                            alibi_slopes, scale, num_splits, bool(return_lse), sinks)
    return (out, lse) if return_lse else out


# -- flex_attention under compile --------------------------------------------------------------------
def _dense_blocks(num, idx, nk: int) -> torch.Tensor:
    """A BlockMask's (kv_num_blocks [Bm, Hm, nq], kv_indices [Bm, Hm, nq, E]) as bool [Bm, Hm, nq, nk]."""
    valid = torch.arange(idx.shape[-1]) < num.unsqueeze(-1)  # (Bm, Hm, nq, E)
    hit = (idx.unsqueeze(-1) == torch.arange(nk)) & valid.unsqueeze(-1)  # (Bm, Hm, nq, E, nk)
    return hit.any(-2)


def _block_mask_keep(bm, L: int, S: int) -> torch.Tensor:
    """A torch BlockMask as the bool mask [Bm, Hm, L, S] it stands for: every pair of its full blocks, and the
    pairs of its partial blocks where mask_mod keeps (torch's semantics)."""
    bq, bk = (int(x) for x in bm.BLOCK_SIZE)
    nk = bm.kv_indices.shape[-1]
    i = torch.arange(L).view(1, 1, L, 1)
    j = torch.arange(S).view(1, 1, 1, S)
    rows, cols = torch.arange(L) // bq, torch.arange(S) // bk
    part = _dense_blocks(bm.kv_num_blocks, bm.kv_indices, nk)[:, :, rows][..., cols]  # (Bm, Hm, L, S)
    b = torch.arange(part.shape[0]).view(-1, 1, 1, 1)
    h = torch.arange(part.shape[1]).view(1, -1, 1, 1)
    keep = part & bm.mask_mod(b, h, i, j)
    if bm.full_kv_num_blocks is not None:
        keep = keep | _dense_blocks(bm.full_kv_num_blocks, bm.full_kv_indices, nk)[:, :, rows][..., cols]
    return keep


def flex_call(query, key, value, score_mod, block_mask, scale, enable_gqa, want_lse, want_max, aux, AuxOutput):
    """``attnlab.flex_attention``'s call under torch.compile (Note [Doors as torch ops]). Without a score_mod: the
    attention op (an attnlab pattern as itself, a BlockMask as the bool mask it stands for). With one: the
    definition in plain torch, which dynamo traces with score_mod inlined (O(B·H·L·S) memory)."""
    B, H, L, _ = query.shape
    S = key.shape[2]
    pattern = keep = None
    if block_mask is not None:
        if isinstance(block_mask, P.Pattern):
            pattern = block_mask
        else:
            keep = _block_mask_keep(block_mask, L, S)  # (Bm, Hm, L, S)
    lse_grad = want_lse and torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if score_mod is None and not want_max and not lse_grad:  # the eager door's lse is differentiable only there
        if want_lse:
            out, lse = lse_door_call(query, key, value, keep, False, scale, enable_gqa, pattern, None, None, None, None)
        else:
            out, lse = door_call(query, key, value, keep, 0.0, False, scale, enable_gqa, pattern, "auto", False, False,
                                 None, None, None, None), None
        mx = None
    else:
        if pattern is not None:
            keep = pattern.materialize(L, S)  # (L, S) or (B, 1, L, S)
        acc = acc_dtype(query.dtype)
        G = H // key.shape[1]
        k = key.repeat_interleave(G, 1) if G > 1 else key  # (B, H, S, E)
        v = value.repeat_interleave(G, 1) if G > 1 else value  # (B, H, S, Ev)
        s = torch.matmul(query.to(acc), k.to(acc).transpose(-2, -1)) * scale  # (B, H, L, S)
        if score_mod is not None:
            s = score_mod(s, torch.arange(B).view(B, 1, 1, 1), torch.arange(H).view(1, H, 1, 1),
                          torch.arange(L).view(1, 1, L, 1), torch.arange(S).view(1, 1, 1, S)).to(acc)
        if keep is not None:
            s = s.masked_fill(~keep, float("-inf"))
        lse = torch.logsumexp(s, -1)  # (B, H, L): -inf for a row with no key
        p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))  # (B, H, L, S): 0 where masked
        out = torch.matmul(p, v.to(acc)).to(query.dtype)  # (B, H, L, Ev)
        mx = s.amax(-1) if want_max else None
    if aux:
        return out, AuxOutput(lse=lse if want_lse else None, max_scores=mx)
    return (out, lse) if want_lse else out
