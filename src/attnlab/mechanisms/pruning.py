"""Token pruning: keep the most important keys, then exact softmax attention over just those.

Legend: N batch, H heads, L queries, S keys, r kept keys, P probe queries, E head dim, Ev value dim.

Importance of key j (per batch element and head):
  "attention": attention it receives in a cheap pass, Σ_p softmax(q_p Kᵀ s)_j over P evenly spaced
               probe queries (cost O(P·S·E)) — the signal of SpAtten / dynamic token pruning;
  "key_norm":  ‖k_j‖ (cost O(S·E); depends on key j alone).
The top r = ceil(keep_ratio·S) keys (or ``keep``) go through exact ``attnlab.attention`` with the
user's mask restricted to them. keep_ratio = 1 keeps every key: exact attention.

Causal: a score that looks at every query would let a later token choose which earlier keys survive
(a leak), so with is_causal the queries are cut into blocks of ``block_size``; a block keeps its own
keys (under the causal mask) plus the top keys among those *before* the block, scored by key norm.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import Inputs, Mechanism, Spec, register
from ..functional import attention

__all__ = ["TokenPruning"]

SCORES = ("attention", "key_norm")


def _gather_keys(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [N, H, S, D], idx [N, H, r] -> [N, H, r, D]."""
    return torch.gather(x, 2, idx.unsqueeze(-1).expand(*idx.shape, x.shape[-1]))


def _gather_mask(mask: torch.Tensor | None, idx: torch.Tensor, L: int) -> torch.Tensor | None:
    """mask [N|1, H|1, L|1, S] -> [N, H, L|1, r] (the columns of the kept keys)."""
    if mask is None:
        return None
    N, H, r = idx.shape
    m = mask.expand(N, H, mask.shape[-2], mask.shape[-1])
    return torch.gather(m, 3, idx.unsqueeze(2).expand(N, H, m.shape[-2], r))


@register("token_pruning", Spec(
    exact=False, causal=True, masks="any", weights=True, dropout=True,
    time="O(P·S·D + L·r·D)", memory="O(L·r)",
    paper="Wang et al. 2021 (SpAtten, arXiv:2012.09852); Goyal et al. 2020 (PoWER-BERT)",
    summary="keep the top keys by attention received (cheap probe pass) or key norm; exact over those",
    error_band=2.5))  # Note [Error bands] in mechanisms/__init__.py: max 1.81 measured, median 1.38
@dataclass(frozen=True)
class TokenPruning(Mechanism):
    """keep_ratio: fraction of keys kept (ceil); keep: an absolute number instead (overrides);
    score: "attention" | "key_norm"; probe_queries: P for the attention score;
    block_size: query block for causal pruning."""

    keep_ratio: float = 0.25
    keep: int | None = None
    score: str = "attention"
    probe_queries: int = 64
    block_size: int = 64

    def __post_init__(self):
        if isinstance(self.keep_ratio, bool) or not isinstance(self.keep_ratio, (int, float)) \
                or not (0.0 < self.keep_ratio <= 1.0):
            raise ValueError(f"keep_ratio must be a float in (0, 1], got {self.keep_ratio!r}")
        if self.keep is not None and (isinstance(self.keep, bool) or not isinstance(self.keep, int) or self.keep < 1):
            raise ValueError(f"keep must be None or an int >= 1, got {self.keep!r}")
        if self.score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {self.score!r}")
        for name in ("probe_queries", "block_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")

    def _extra_reasons(self, inputs: Inputs) -> list[str]:
        if inputs.is_causal and self.score == "attention":
            return ["token_pruning: score='attention' looks at every query, so later tokens would choose "
                    "which earlier keys survive; use score='key_norm' with is_causal=True"]
        return []

    def kept(self, S: int) -> int:
        """r, the number of keys kept out of S: ``keep`` or ceil(keep_ratio·S), clipped to [1, S]."""
        return max(1, min(S, self.keep if self.keep is not None else math.ceil(self.keep_ratio * S)))

    # -- importance ------------------------------------------------------------------------------
    def importance(self, q, k, mask, scale) -> torch.Tensor:
        """[N, H, S] importance of each key; keys masked for every query get -inf."""
        with torch.no_grad():
            L, S = q.shape[-2], k.shape[-2]
            if self.score == "key_norm":
                imp = k.float().norm(dim=-1)  # (N, H, S)
            else:
                P = min(self.probe_queries, L)
                rows = torch.linspace(0, L - 1, P, device=q.device).round().long()
                qp = q[:, :, rows].float()  # (N, H, P, E)
                m = None
                if mask is not None:
                    m = mask if mask.shape[-2] == 1 else mask[:, :, rows]
                attn = attention(qp, k.float(), torch.zeros(*k.shape[:-1], 1, dtype=torch.float32,
                                                             device=k.device),
                                 attn_mask=None if m is None else (m if m.dtype == torch.bool else m.float()),
                                 scale=scale, need_weights=True, method="dense")[1]  # (N, H, P, S)
                imp = attn.sum(-2)
            if mask is not None and mask.dtype == torch.bool:
                dead = ~mask.any(-2)  # (N|1, H|1, S): masked for every query
                imp = imp.masked_fill(dead, float("-inf"))
            return imp

    # -- attention -------------------------------------------------------------------------------
    def _forward(self, q, k, v, *, key_keep, attn_mask, is_causal, scale, dropout_p, need_weights):
        if is_causal:
            return self._causal(q, k, v, attn_mask, scale, dropout_p, need_weights)
        N, H, L, _ = q.shape
        S = k.shape[-2]
        r = self.kept(S)
        imp = self.importance(q, k, attn_mask, scale)
        idx = imp.topk(r, dim=-1).indices.sort(dim=-1).values  # (N, H, r), in sequence order
        kg, vg = _gather_keys(k, idx), _gather_keys(v, idx)  # (N, H, r, E), (N, H, r, Ev)
        mg = _gather_mask(attn_mask, idx, L)  # (N, H, L|1, r)
        res = attention(q, kg, vg, attn_mask=mg, dropout_p=dropout_p, scale=scale, need_weights=need_weights)
        if not need_weights:
            return res, None
        out, wg = res
        w = torch.zeros(N, H, L, S, dtype=wg.dtype, device=wg.device)
        w.scatter_(3, idx.unsqueeze(2).expand(N, H, L, r), wg)
        return out, w

    def _causal(self, q, k, v, attn_mask, scale, dropout_p, need_weights):
        N, H, L, E = q.shape
        S, Ev = k.shape[-2], v.shape[-1]
        b = self.block_size
        imp = k.detach().float().norm(dim=-1)  # (N, H, S): key norm only depends on key j itself
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            imp = imp.masked_fill(~attn_mask.any(-2), float("-inf"))
        outs, w = [], (torch.zeros(N, H, L, S, dtype=q.dtype, device=q.device) if need_weights else None)
        for q0 in range(0, L, b):
            q1 = min(L, q0 + b)
            before = min(q0, S)
            local = torch.arange(before, min(q1, S), device=q.device)
            parts = []
            if before:
                r = max(1, min(before, self.keep if self.keep is not None else math.ceil(self.keep_ratio * before)))
                parts.append(imp[:, :, :before].topk(r, dim=-1).indices.sort(dim=-1).values)  # (N, H, r)
            parts.append(local.expand(N, H, -1))
            idx = torch.cat(parts, -1)  # (N, H, r + local)
            qpos = torch.arange(q0, q1, device=q.device)
            mg = idx.unsqueeze(2) <= qpos.view(1, 1, -1, 1)  # (N, H, b, r): causal on positions
            if attn_mask is not None:
                um = _gather_mask(attn_mask[:, :, q0:q1] if attn_mask.shape[-2] > 1 else attn_mask, idx, q1 - q0)
                if um.dtype == torch.bool:
                    mg = mg & um
                else:
                    mg = torch.zeros(mg.shape, dtype=q.dtype, device=q.device).masked_fill(~mg, float("-inf")) \
                        + um.to(q.dtype)
            if idx.shape[-1] == 0:
                outs.append(torch.zeros(N, H, q1 - q0, Ev, dtype=q.dtype, device=q.device) + 0 * q[:, :, q0:q1, :1])
                continue
            res = attention(q[:, :, q0:q1], _gather_keys(k, idx), _gather_keys(v, idx), attn_mask=mg,
                            dropout_p=dropout_p, scale=scale, need_weights=need_weights)
            if need_weights:
                o, wg = res
                w[:, :, q0:q1].scatter_(3, idx.unsqueeze(2).expand(N, H, q1 - q0, idx.shape[-1]), wg)
            else:
                o = res
            outs.append(o)
        return torch.cat(outs, dim=2), w

    def flops(self, L, S, E, Ev=None):
        Ev = E if Ev is None else Ev
        r = self.kept(S)
        score = 2 * min(self.probe_queries, L) * S * E if self.score == "attention" else 2 * S * E
        return score + 2 * L * r * (E + Ev)

    def memory(self, L, S, E, Ev=None, element_size=4):
        Ev = E if Ev is None else Ev
        r = self.kept(S)
        return (3 * L * r + r * (E + Ev) + min(self.probe_queries, L) * S + S) * element_size
