"""Multi-head attention as an nn.Module, running on attnlab's attention (any method or mechanism).

Legend: B batch, L query length, S key length (cache included), T new key length, H heads,
Hkv key/value heads (GQA/MQA when Hkv < H), D query/key head dim, Dv value head dim.

    MultiHead(Q, K, V) = Concat(head_1, ..., head_H) W_O,  head_h = Attention(Q W_Q^h, K W_K^h, V W_V^h)
(Vaswani et al. 2017, §3.2.2; grouped-query heads: Ainslie et al. 2023; multi-query: Shazeer 2019).
"""
from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from .. import mechanisms
from .. import patterns as P
from ..functional import METHODS, attention, planner, run
from ..positional.base import AttentionPositional
from ..shapes import AttentionDtypeError, check_softcap, prepare
from .cache import LayerCache
from .hooks import AttentionHooks, HookContext

__all__ = ["MultiHeadAttention", "AttentionIntermediates", "resolve_mechanism"]

_ids = itertools.count()


def resolve_mechanism(mechanism):
    """A core method name stays a string (run through attnlab.attention); anything else goes through
    ``attnlab.mechanisms.resolve`` (the shared mechanism signature) and becomes a callable."""
    if isinstance(mechanism, str) and mechanism in METHODS:
        return mechanism

    return mechanisms.resolve(mechanism)


@dataclass
class AttentionIntermediates:
    """What one call computed, on request: output, weights and the per-head q, k, v.

    q: [B, H, L, D] (after RoPE); k: [B, Hkv, S, D]; v: [B, Hkv, S, Dv]; weights [B, H, L, S] or None.
    """

    output: torch.Tensor
    weights: torch.Tensor | None
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


class MultiHeadAttention(nn.Module):
    """Batch-first multi-head attention with separate W_Q, W_K, W_V, W_O (``q_proj``, ``k_proj``,
    ``v_proj``, ``out_proj``).

    Args:
        embed_dim: model width d (query features in, output features out).
        num_heads: query heads H.
        num_kv_heads: key/value heads Hkv (default H); H % Hkv == 0. 1 is multi-query attention.
        head_dim: query/key head dim D (default embed_dim // num_heads, which must then divide).
        kdim, vdim: features of the key and value inputs (default embed_dim), for cross-attention.
        value_head_dim: value head dim Dv (default D), so d_k != d_v is possible.
        bias: biases on the four projections.
        dropout: dropout on the attention weights while training.
        mechanism: one of ``attnlab.METHODS`` ("auto", "dense", "sdpa", "tiled", "sparse", "compiled": exact,
            attnlab.attention), or a
            name / instance accepted by ``attnlab.mechanisms.resolve``.
        pattern: an ``attnlab.patterns`` pattern applied on every call (AND with the other masks).
        positional: an ``attnlab.positional.AttentionPositional`` (RoPE, ALiBi, T5 bias) or None. ALiBi
            goes to the kernel as slopes (no L×S bias) when the kernel that runs computes it from
            positions and the queries are the last L of the S keys (self-attention, with or without a
            cache); otherwise its bias is written out and added as a float mask (the same values).
        scale: score scale; None means 1/sqrt(D).
        softcap: tanh soft-capping of the scores (Gemma 2): x -> softcap·tanh(x / softcap) on each scaled
            product (``attnlab.attention(softcap=)``); None (default) for none. Exact methods only.

    Cost per call: O(B·L·d·(H·D)) for the projections plus whatever the mechanism costs.
    """

    def __init__(self, embed_dim: int, num_heads: int, *, num_kv_heads: int | None = None,
                 head_dim: int | None = None, kdim: int | None = None, vdim: int | None = None,
                 value_head_dim: int | None = None, bias: bool = True, dropout: float = 0.0,
                 mechanism="auto", pattern: P.Pattern | None = None,
                 positional: AttentionPositional | None = None, scale: float | None = None,
                 softcap: float | None = None):
        super().__init__()
        for name, val in (("embed_dim", embed_dim), ("num_heads", num_heads)):
            if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        if head_dim is None:
            if embed_dim % num_heads:
                raise ValueError(
                    f"num_heads ({num_heads}) must divide embed_dim ({embed_dim}) when head_dim is not given; "
                    f"pick a divisor of {embed_dim} or pass head_dim explicitly"
                )
            head_dim = embed_dim // num_heads
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int) or num_kv_heads <= 0:
            raise ValueError(f"num_kv_heads must be a positive int, got {num_kv_heads!r}")
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads}): each key/value head serves "
                f"a whole group of query heads"
            )
        value_head_dim = head_dim if value_head_dim is None else value_head_dim
        for name, val in (("head_dim", head_dim), ("value_head_dim", value_head_dim),
                          ("kdim", kdim if kdim is not None else 1), ("vdim", vdim if vdim is not None else 1)):
            if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        if not (isinstance(dropout, (int, float)) and 0.0 <= dropout < 1.0):
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        if pattern is not None and not isinstance(pattern, P.Pattern):
            raise TypeError(f"pattern must be an attnlab.patterns.Pattern or None, got {type(pattern).__name__}")
        if positional is not None and not isinstance(positional, AttentionPositional):
            raise TypeError(
                "positional must be an attnlab.positional.AttentionPositional (RotaryEmbedding, ALiBi, "
                f"T5RelativeBias) or None, got {type(positional).__name__}; absolute encodings are added to "
                "the embeddings, not given to attention"
            )
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
            raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim, self.value_head_dim = head_dim, value_head_dim
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        self.dropout, self.scale, self.pattern = float(dropout), scale, pattern
        self.softcap = check_softcap(softcap)
        self.positional = positional
        self.mechanism = mechanism
        self.q_proj = nn.Linear(embed_dim, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(self.kdim, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(self.vdim, num_kv_heads * value_head_dim, bias=bias)
        self.out_proj = nn.Linear(num_heads * value_head_dim, embed_dim, bias=bias)
        self._id = next(_ids)
        self._warned_bias = False
        self._packed: tuple | None = None  # see pack_qkv
        self.hooks = AttentionHooks()  # public hook points (q, k, v, weights, z, out): see attnlab.nn.hooks

    # -- configuration -----------------------------------------------------------------------------
    @property
    def mechanism(self):
        """The attention this layer runs, as given: a method name of ``attnlab.METHODS`` or anything
        ``attnlab.mechanisms.resolve`` accepts. Assigning it swaps the mechanism (a name resolves again;
        with ``softcap`` set, only exact method names are accepted)."""
        return self._mechanism_spec

    @mechanism.setter
    def mechanism(self, spec) -> None:
        resolved = resolve_mechanism(spec)
        if getattr(self, "softcap", None) is not None and not isinstance(resolved, str):
            raise ValueError(f"softcap={self.softcap} needs an exact method ({', '.join(METHODS)}); the mechanism "
                             f"{spec!r} takes no soft-capping")
        self._modules.pop("_mechanism", None)  # a module mechanism may be replaced by a name, and back
        self._mechanism = resolved  # a stateful mechanism module registers as a child (its parameters train)
        object.__setattr__(self, "_mechanism_spec", spec)  # as given; not a second child registration

    def __setattr__(self, name: str, value) -> None:
        # nn.Module.__setattr__ registers a Module value as a child without calling the property's setter,
        # which left a mechanism given as a module unresolved (AttributeError: _mechanism)
        if name == "mechanism":
            type(self).mechanism.fset(self, value)
        else:
            super().__setattr__(name, value)

    # -- import from PyTorch ---------------------------------------------------------------------
    @classmethod
    def from_torch(cls, m: nn.MultiheadAttention, **kwargs) -> "MultiHeadAttention":
        """Copy an ``nn.MultiheadAttention`` (packed or separate projections). The result is always
        batch-first: give it [B, L, E] whatever ``m.batch_first`` was. ``kwargs`` (mechanism, pattern,
        ...) go to the constructor."""
        if not isinstance(m, nn.MultiheadAttention):
            raise TypeError(f"from_torch expects an nn.MultiheadAttention, got {type(m).__name__}")
        if m.bias_k is not None or m.add_zero_attn:
            raise ValueError("nn.MultiheadAttention with add_bias_kv=True or add_zero_attn=True is not supported")
        has_bias = m.in_proj_bias is not None
        new = cls(m.embed_dim, m.num_heads, kdim=m.kdim, vdim=m.vdim, bias=has_bias, dropout=m.dropout, **kwargs)
        E = m.embed_dim
        with torch.no_grad():
            if m._qkv_same_embed_dim:
                wq, wk, wv = m.in_proj_weight.split(E, dim=0)
            else:
                wq, wk, wv = m.q_proj_weight, m.k_proj_weight, m.v_proj_weight
            new.to(dtype=wq.dtype, device=wq.device)
            new.q_proj.weight.copy_(wq)
            new.k_proj.weight.copy_(wk)
            new.v_proj.weight.copy_(wv)
            new.out_proj.weight.copy_(m.out_proj.weight)
            if has_bias:
                bq, bk, bv = m.in_proj_bias.split(E, dim=0)
                new.q_proj.bias.copy_(bq)
                new.k_proj.bias.copy_(bk)
                new.v_proj.bias.copy_(bv)
                new.out_proj.bias.copy_(m.out_proj.bias)
        return new

    # -- one input projection ------------------------------------------------------------------
    def pack_qkv(self) -> "MultiHeadAttention":
        """Store W_Q, W_K, W_V (and their biases) as row blocks of one [H·D + 2·Hkv·D', embed_dim] tensor,
        so that self-attention without gradients projects with one matmul instead of three (D' = Dv for
        the value rows). ``q_proj.weight`` etc. stay the same Parameters with the same values; their
        storage becomes a view of the packed tensor, so any in-place edit of them is seen by the packed
        matmul. Replacing a parameter (``load_state_dict(assign=True)``, ``.to(...)``) unpacks the layer
        again: it then projects with three matmuls, the same result. Needs kdim == vdim == embed_dim.

        Note [Packed QKV]: one [B·L, E] x [E, 3E] matmul runs the same dot products as three [E, E]
        ones (bit-identical outputs on MKL); on MiniLM's 32 x 128 batch it saved ~12% of the projection time.
        """
        if not (self.kdim == self.vdim == self.embed_dim):
            raise ValueError(f"pack_qkv needs kdim == vdim == embed_dim (self-attention), got kdim={self.kdim}, "
                             f"vdim={self.vdim}, embed_dim={self.embed_dim}")
        lins = (self.q_proj, self.k_proj, self.v_proj)
        with torch.no_grad():
            w = torch.cat([m.weight for m in lins])  # (H*D + Hkv*D + Hkv*Dv, E)
            b = torch.cat([m.bias for m in lins]) if self.q_proj.bias is not None else None
            rows = [m.weight.shape[0] for m in lins]
            for m, wi, bi in zip(lins, w.split(rows), b.split(rows) if b is not None else (None,) * 3):
                m.weight.data = wi  # same Parameter object, storage now inside w
                if bi is not None:
                    m.bias.data = bi
        self._packed = (w, b, tuple(rows))
        return self

    def unpack_qkv(self) -> "MultiHeadAttention":
        """Undo :meth:`pack_qkv`: each projection's weight and bias get storage of their own again (same
        Parameters, same values). Needed only by tools that refuse parameters sharing one storage, e.g.
        ``safetensors.torch.save_model`` (``save_file(m.state_dict())`` and ``torch.save`` accept them)."""
        with torch.no_grad():
            for m in (self.q_proj, self.k_proj, self.v_proj):
                m.weight.data = m.weight.data.clone()
                if m.bias is not None:
                    m.bias.data = m.bias.data.clone()
        self._packed = None
        return self

    def _packed_weights(self):
        """(weight [rows, E], bias [rows] | None, row split) when pack_qkv's tensor is still the storage of
        all three input projections and may stand in for them, else None."""
        pk = self._packed
        if pk is None or torch.compiler.is_compiling():  # under compile the three projections (no data_ptr checks)
            return None
        lins = (self.q_proj, self.k_proj, self.v_proj)
        if any(type(m) is not nn.Linear or _torch_hooked(m) for m in lins):
            return None  # a subclass or a torch hook on one projection must see its own call
        w, b, rows = pk
        if torch.is_grad_enabled() and any(t.requires_grad for m in lins for t in m.parameters()):
            return None  # gradients must reach the three Parameters themselves
        start = 0
        for m, n in zip(lins, rows):
            # a parameter whose memory is not the packed tensor's rows was replaced: unpack for good
            if m.weight.dtype != w.dtype or m.weight.device != w.device or m.weight.data_ptr() != w[start].data_ptr():
                self._packed = None
                return None
            if b is not None and (m.bias is None or m.bias.dtype != b.dtype or m.bias.device != b.device
                                  or m.bias.data_ptr() != b[start].data_ptr()):
                self._packed = None
                return None
            start += n
        return pk

    # -- forward ---------------------------------------------------------------------------------
    def forward(self, query: torch.Tensor, key: torch.Tensor | None = None, value: torch.Tensor | None = None, *,
                key_padding_mask: torch.Tensor | None = None, attn_mask=None, is_causal: bool = False,
                need_weights: bool = False, average_attn_weights: bool = True,
                cache: LayerCache | None = None):
        """Attend from query [B, L, embed_dim] to key [B, S, kdim] / value [B, S, vdim] (both default
        to query: self-attention). Unbatched [L, embed_dim] inputs work too.

        key_padding_mask: bool [B, S], True = ignore that key (nn.MultiheadAttention's polarity),
            S counting cached keys; or a key-padding Pattern (``patterns.from_hf_attention_mask``,
            ``key_padding``, ``from_key_padding_mask``: True = takes part), which a model builds once at
            its boundary and hands to every layer unchanged.
        attn_mask: bool (True = takes part; attnlab/SDPA polarity, NOT nn.MultiheadAttention's) or
            float (added) of shape [L, S], [B, L, S] or [B, H|1, L, S]; or an attnlab Pattern.
        is_causal: query i sees keys at absolute positions <= its own (cache offset included).
        cache: a ``LayerCache``; new keys/values are appended (self-attention) or, for a static
            (cross-attention) cache, computed once from key/value and reused.

        Returns (output [B, L, embed_dim], weights) with weights [B, L, S] averaged over heads,
        [B, H, L, S] with average_attn_weights=False, or None unless need_weights.
        """
        r = self.forward_intermediates(query, key, value, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                                       is_causal=is_causal, need_weights=need_weights, cache=cache)
        w = r.weights
        if w is not None and average_attn_weights:
            w = w.mean(dim=-3)  # (B, L, S)
        return r.output, w

    def _check_input(self, name: str, x, features: int, what: str) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3:
            raise ValueError(f"{name} must be [batch, seq, {what}] (batch first), got {list(x.shape)}")
        if x.shape[-1] != features:
            raise ValueError(
                f"{name} has {x.shape[-1]} features (shape {list(x.shape)}) but this layer expects "
                f"{what}={features}"
            )
        w = self.q_proj.weight
        # else the projection fails inside torch with "mat1 and mat2 ..." (autocast casts floats itself)
        if x.dtype != w.dtype and not (x.dtype.is_floating_point and torch.is_autocast_enabled(x.device.type)):
            fix = f"pass {name}.to({w.dtype})" + (f" or convert the layer with .to({x.dtype})"
                                                 if x.dtype.is_floating_point else "")
            raise AttentionDtypeError(f"{name} has dtype {x.dtype} but this layer's parameters are {w.dtype}; {fix}")

    def forward_intermediates(self, query, key=None, value=None, *, key_padding_mask=None, attn_mask=None,
                              is_causal=False, need_weights=False, cache=None) -> AttentionIntermediates:
        """Same as ``forward`` but returns per-head weights and the projected q, k, v as well."""
        unbatched = isinstance(query, torch.Tensor) and query.dim() == 2
        if unbatched:
            query = query.unsqueeze(0)
            key = key.unsqueeze(0) if isinstance(key, torch.Tensor) else key
            value = value.unsqueeze(0) if isinstance(value, torch.Tensor) else value
            if isinstance(key_padding_mask, torch.Tensor) and key_padding_mask.dim() == 1:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        key = query if key is None else key
        value = key if value is None else value
        self._check_input("query", query, self.embed_dim, "embed_dim")
        static = cache is not None and cache.static
        if cache is not None:
            if not isinstance(cache, LayerCache):
                raise TypeError(f"cache must be an attnlab.nn.LayerCache, got {type(cache).__name__}")
            cache.claim(self, f"MultiHeadAttention #{self._id}")
        reuse = static and cache.length > 0
        if not reuse:
            self._check_input("key", key, self.kdim, "kdim")
            self._check_input("value", value, self.vdim, "vdim")
            if key.shape[:2] != value.shape[:2]:
                raise ValueError(f"key {list(key.shape)} and value {list(value.shape)} must agree on [batch, seq]")
            if key.shape[0] != query.shape[0]:
                raise ValueError(f"query {list(query.shape)} and key {list(key.shape)} must agree on batch size")
        B, L, _ = query.shape
        H, Hkv, D, Dv = self.num_heads, self.num_kv_heads, self.head_dim, self.value_head_dim
        offset = cache.length if (cache is not None and not static) else 0

        # 1) project and split heads
        packed = self._packed_weights() if (key is query and value is query and not reuse) else None
        if packed is not None:
            w, b, rows = packed  # Note [Packed QKV]
            q, k, v = nn.functional.linear(query, w, b).split(rows, dim=-1)  # (B, L, H*D), (B, L, Hkv*D), ...
            q = q.view(B, L, H, D).transpose(1, 2)  # (B, H, L, D)
            k = k.view(B, L, Hkv, D).transpose(1, 2)  # (B, Hkv, L, D)
            v = v.view(B, L, Hkv, Dv).transpose(1, 2)  # (B, Hkv, L, Dv)
        else:
            q = self.q_proj(query).view(B, L, H, D).transpose(1, 2)  # (B, H, L, D)
        if reuse:
            k, v = cache.keys, cache.values  # (B, Hkv, S, D), (B, Hkv, S, Dv)
            if k.shape[0] != B:
                raise ValueError(f"cross-attention cache holds batch {k.shape[0]} but query has batch {B}")
        elif packed is None:
            T = key.shape[1]
            k = self.k_proj(key).view(B, T, Hkv, D).transpose(1, 2)  # (B, Hkv, T, D)
            v = self.v_proj(value).view(B, T, Hkv, Dv).transpose(1, 2)  # (B, Hkv, T, Dv)

        # 2) positions: rotate q and the *new* keys, then extend the cache
        pos = self.positional
        q_pos = torch.arange(offset, offset + L, device=query.device)
        if pos is not None and not reuse:
            k_new_pos = torch.arange(offset, offset + k.shape[2], device=query.device)
            q, k = pos.apply(q, k, q_pos, k_new_pos)
        elif pos is not None:
            q, _ = pos.apply(q, q[:, :0], q_pos, q_pos[:0])
        S = k.shape[2] + (offset if cache is not None and not reuse else 0)  # keys after the cache update
        # masks are checked before the cache is touched, so a bad call leaves it intact
        key_pattern = None if key_padding_mask is None else self._key_padding_pattern(key_padding_mask, B, S)
        mask = self._attn_mask(attn_mask, B, L, S) if not isinstance(attn_mask, P.Pattern) else None
        if cache is not None and not reuse:
            if static:
                cache.set_static(k, v)
            else:
                k, v = cache.append(k, v)
        ctx = None
        if self.hooks:
            kpm = key_padding_mask
            if isinstance(kpm, P.Pattern):  # hooks see nn.MultiheadAttention's polarity, as documented there
                kpm = ~_keys_kept(kpm, S)  # (B, S), True = ignore
            ctx = HookContext(self, "", kpm, attn_mask, self.pattern, bool(is_causal), offset,
                              self.scale if self.scale is not None else D ** -0.5)
            q, k, v = (self.hooks.run(n, t, ctx) for n, t in (("q", q), ("k", k), ("v", v)))

        # 3) masks: pattern (+ causal, + key padding) as typed patterns, attn_mask and position bias as tensors
        pattern = self.pattern
        if isinstance(attn_mask, P.Pattern):
            pattern = attn_mask if pattern is None else pattern & attn_mask
        causal_flag = False
        if is_causal:
            if pattern is None and offset == 0 and L == S:
                causal_flag = True  # plain top-left causal: PyTorch's fused causal path
            elif not (L == 1 and offset == S - 1 and pattern is None):  # one new token sees every key
                pattern = P.causal() if pattern is None else pattern & P.causal()
        if pattern is not None and offset:
            pattern = P.shifted(pattern, offset)  # the cached rows' absolute positions
        slopes = None
        if pos is not None and pos.has_bias:
            k_pos = torch.arange(S, device=query.device)
            # queries at the last L of the S key positions: the bias is flash-attn's ALiBi, −slope·|i + S − L − j|
            slopes = pos.kernel_slopes() if offset == S - L and isinstance(self._mechanism, str) else None
            if slopes is None:
                mask = _add_bias(mask, pos.bias(q_pos, k_pos).to(q.dtype).unsqueeze(0))  # (1, H, L, S)
            else:
                def written_out(m):  # the fallback: the same bias as a float mask (1, H, L, S)
                    return _add_bias(m, pos.bias(q_pos, k_pos).to(q.dtype).unsqueeze(0))
                slopes = (slopes.to(query.device), written_out)

        # 4) attend
        hook_weights = ctx is not None and self.hooks.has("weights")
        out, weights = self._attend(q, k, v, mask, causal_flag, pattern, key_pattern, need_weights or hook_weights,
                                    slopes)
        if ctx is not None:
            if weights is not None:
                self.hooks.run("weights", weights, ctx)
            weights = weights if need_weights else None
            out = self.hooks.run("z", out, ctx)  # (B, H, L, Dv)

        # 5) merge heads and project out
        y = out.transpose(1, 2).reshape(B, L, H * Dv)  # (B, L, H*Dv)
        y = self.out_proj(y)  # (B, L, embed_dim)
        if ctx is not None:
            y = self.hooks.run("out", y, ctx)
        if unbatched:
            y = y.squeeze(0)
            weights = weights.squeeze(0) if weights is not None else None
        return AttentionIntermediates(y, weights, q, k, v)

    def _key_padding_pattern(self, kpm, B: int, S: int) -> P.Pattern:
        """key_padding_mask (bool [B, S], True = ignore, or a key-padding Pattern) -> one key-padding
        Pattern (True = takes part), the only form used past this point."""
        if isinstance(kpm, P.Pattern):
            kk = getattr(kpm, "keep_keys", None)  # per-key patterns carry their [B, S'] keep vector
            if not isinstance(kk, torch.Tensor):
                raise TypeError(f"key_padding_mask must be a bool tensor [batch, S] (True = ignore) or a key-padding "
                                f"pattern (attnlab.patterns.key_padding, from_hf_attention_mask, "
                                f"from_key_padding_mask), got the pattern {kpm!r}; other patterns go in attn_mask")
            if kk.shape[0] != B or (kk.shape[1] != S and not getattr(kpm, "extends", False)):
                raise ValueError(f"key_padding_mask {kpm!r} must cover [batch, S] = [{B}, {S}] keys "
                                 f"(S counts cached keys), got [{kk.shape[0]}, {kk.shape[1]}]")
            return kpm
        if not isinstance(kpm, torch.Tensor):
            raise TypeError(f"key_padding_mask must be a bool tensor [batch, S] (True = ignore), got {type(kpm).__name__}")
        if kpm.dim() != 2 or kpm.shape[0] != B or kpm.shape[1] != S:
            raise ValueError(
                f"key_padding_mask must be [batch, S] = [{B}, {S}] (S counts cached keys), got {list(kpm.shape)}"
            )
        if kpm.dtype != torch.bool:
            raise TypeError(
                f"key_padding_mask must be bool with True = ignore (nn.MultiheadAttention's polarity), got {kpm.dtype}; "
                "for a Hugging Face 0/1 attention_mask pass key_padding_mask=attention_mask == 0; "
                "an additive float mask goes in attn_mask"
            )
        return P.from_key_padding_mask(kpm)  # the one polarity flip: True = takes part from here on

    def _attn_mask(self, m, B: int, L: int, S: int):
        if m is None:
            return None
        if not isinstance(m, torch.Tensor):
            raise TypeError(f"attn_mask must be a tensor, an attnlab Pattern or None, got {type(m).__name__}")
        if m.dtype != torch.bool and not m.dtype.is_floating_point:
            raise TypeError(
                f"attn_mask must be bool (True = takes part) or float (added to scores), got {m.dtype}"
            )
        H = self.num_heads
        shape = list(m.shape)
        if m.dim() == 2 and shape == [L, S]:
            return m.view(1, 1, L, S)
        if m.dim() == 3 and shape == [B, L, S]:
            return m.unsqueeze(1)
        if m.dim() == 4 and m.shape[0] in (1, B) and m.shape[1] in (1, H) and m.shape[2] in (1, L) and m.shape[3] == S:
            return m
        raise ValueError(
            f"attn_mask has shape {shape}; expected [L, S] = [{L}, {S}], [B, L, S] = [{B}, {L}, {S}] or "
            f"[B|1, H|1, L, S] = [{B}, {H}, {L}, {S}] (S counts cached keys)"
        )

    def _attend(self, q, k, v, mask, is_causal, pattern, key_pattern, need_weights, alibi=None):
        """q [B, H, L, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv] -> (out [B, H, L, Dv], weights | None).

        key_pattern (a key-padding Pattern, True = takes part) is ANDed into the pattern for the core
        methods, and becomes a [B, 1, 1, S] bool mask for mechanisms (which can then treat it as key
        padding); it is never materialised to [B, L, S]. alibi: (slopes [H], f(mask) -> mask with the
        bias added) for the core methods: the slopes go to the kernel when it computes ALiBi from
        positions, else the bias is written out (``planner.takes_alibi_slopes``).
        """
        dropout_p = self.dropout if self.training else 0.0
        gqa = self.num_kv_heads != self.num_heads
        mech = self._mechanism
        if isinstance(mech, str):
            # key padding goes to the core as a typed pattern; the core zeroes its dead keys once
            # (functional's Note [Dead keys])
            if key_pattern is not None:
                pattern = key_pattern if pattern is None else pattern & key_pattern
            if torch.compiler.is_compiling():  # functional's Note [Doors as torch ops]: the door is the op dynamo
                # sees; prepare and the planner below are not traced (the door plans inside the op)
                r = attention(q, k, v, mask, dropout_p, is_causal, self.scale, gqa, pattern=pattern, method=mech,
                              need_weights=need_weights, softcap=self.softcap,
                              alibi_slopes=None if alibi is None else alibi[0])
                return r if need_weights else (r, None)
            slopes = None
            if alibi is not None:
                slopes, written_out = alibi
                p = prepare(q, k, v, mask, dropout_p, is_causal, self.scale, gqa, pattern, softcap=self.softcap,
                            alibi_slopes=slopes)
                method = self._method_for(p, mech, need_weights)
                if not planner.takes_alibi_slopes(p, method, need_weights):
                    slopes, mask = None, written_out(mask)
            if slopes is None:
                p = prepare(q, k, v, mask, dropout_p, is_causal, self.scale, gqa, pattern,
                            softcap=self.softcap)  # validated once
                method = self._method_for(p, mech, need_weights)
            r = run(p, method=method, need_weights=need_weights)
            return r if need_weights else (r, None)
        key_keep = None if key_pattern is None else _keys_kept(key_pattern, k.shape[2]).to(k.device)  # (B, S)
        if key_keep is not None:
            # Note [Padded keys are zeroed]: a padded key's score is masked, but NaN/inf in its key
            # (uninitialised padding) would still reach the output through NaN - inf = NaN in fused
            # kernels; zeroing padded keys and values makes padding content irrelevant everywhere.
            dead = ~key_keep[:, None, :, None]  # (B, 1, S, 1)
            k, v = k.masked_fill(dead, 0.0), v.masked_fill(dead, 0.0)
        # a mechanism callable (contract 1) takes no pattern: give it the pattern as a bool mask
        if pattern is not None:
            keep = pattern.materialize(q.shape[2], k.shape[2], device=q.device)  # (L, S) or (B, 1, L, S)
            mask = _and_keep(mask, keep.view(1, 1, *keep.shape) if keep.dim() == 2 else keep)
        if key_keep is not None:
            mask = _and_keep(mask, key_keep.view(key_keep.shape[0], 1, 1, -1))  # (B, 1, 1, S)
        r = mech(q, k, v, attn_mask=mask, is_causal=is_causal, scale=self.scale, dropout_p=dropout_p,
                 enable_gqa=gqa, need_weights=need_weights)
        return r if need_weights else (r, None)

    def _method_for(self, p, method: str, need_weights: bool) -> str:
        """What the planner says this layer runs (``planner.layer_method``), with the layer's one warning
        when a learned bias makes it give up its own method while gradients are on."""
        run_method, why = planner.layer_method(p, method, need_weights)
        if why is not None and not self._warned_bias:
            warnings.warn(f"mechanism={method!r} cannot train a learned attention bias "
                          f"({type(self.positional).__name__}); this layer uses method='auto' while "
                          "gradients are on", stacklevel=5)
            self._warned_bias = True
        return run_method

    def extra_repr(self) -> str:
        """The settings shown by ``repr(module)``."""
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, value_head_dim={self.value_head_dim}, mechanism={self._mechanism_spec!r}, "
                f"pattern={self.pattern!r}, scale={self.scale}, dropout={self.dropout}"
                + (f", softcap={self.softcap}" if self.softcap is not None else ""))


def _add_bias(mask: torch.Tensor | None, bias: torch.Tensor) -> torch.Tensor:
    """An SDPA-style mask (None, bool True = takes part, or float) with a float bias [1, H, L, S] added."""
    if mask is None:
        return bias
    if mask.dtype == torch.bool:
        return bias.masked_fill(~mask, float("-inf"))
    return mask + bias


def _and_keep(mask: torch.Tensor | None, keep: torch.Tensor) -> torch.Tensor:
    """Combine an SDPA-style mask (None, bool True = takes part, or float bias) with a bool keep mask."""
    if mask is None:
        return keep
    if mask.dtype == torch.bool:
        return mask & keep
    return mask.masked_fill(~keep, float("-inf"))


def _keys_kept(p: P.Pattern, S: int) -> torch.Tensor:
    """The bool [B, S] keep vector (True = takes part) of a key-padding pattern checked by
    ``_key_padding_pattern``; keys past a lengths-based pattern's width are padding."""
    return p.key_mask(S)  # [B, S]; a length past S is refused there


def _torch_hooked(m: nn.Module) -> bool:
    """Whether torch forward hooks (the module's own or global ones) run around ``m``'s call. torch has
    no public query for this; its own ``Module.__call__`` reads the same dicts."""
    from torch.nn.modules import module as _m

    return bool(m._forward_hooks or m._forward_pre_hooks or _m._global_forward_hooks
                or _m._global_forward_pre_hooks)
