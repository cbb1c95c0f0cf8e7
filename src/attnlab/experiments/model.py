"""The experiments' model: ``attnlab.nn``'s pre-norm encoder layers with the switches the tutorials'
failure modes need (no softmax, cosine similarity, any score scale), and weight statistics per layer.

Legend: B batch, T sequence length, H heads, D head dim (d_k), d d_model, C classes.

Built from ``attnlab.nn.EncoderLayer`` (MultiHeadAttention + FeedForward, pre-norm) and the final
LayerNorm of ``attnlab.nn.Encoder``. The switches use the library's public extension points only:
the cosine arm normalises q and k in MultiHeadAttention's ``q``/``k`` hooks; the no-softmax arm is an
unregistered mechanism (:class:`NoSoftmax`); statistics come from ``forward_intermediates``' q and k.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from attnlab.mechanisms import Mechanism, Spec
from attnlab.nn import Encoder, TransformerLM

from .attention import choose

__all__ = ["SCORES", "scale_value", "NoSoftmax", "weight_stats", "ExperimentModel", "LibraryLM", "build_model",
           "loss_fn_for"]

SCORES = ("softmax", "none", "cosine")


def scale_value(scale: str | float | None, head_dim: int) -> float:
    """"sqrt" -> 1/sqrt(d_k), "none" -> 1, "dk" -> 1/d_k, a number -> itself."""
    if scale is None or scale == "sqrt":
        return 1.0 / math.sqrt(head_dim)
    if scale == "none":
        return 1.0
    if scale == "dk":
        return 1.0 / head_dim
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        return float(scale)
    raise ValueError(f"scale must be 'sqrt', 'none', 'dk' or a number, got {scale!r}")


@dataclass(frozen=True)
class NoSoftmax(Mechanism):
    """The tutorial's "remove the softmax" arm as an (unregistered) mechanism: weights = scale·q kᵀ
    (unbounded, possibly negative, rows not normalised), zeroed above the diagonal when causal;
    out = weights · v.

    q [B, H, L, D], k [B, H, S, D], v [B, H, S, Dv] -> [B, H, L, Dv] (and weights [B, H, L, S] with
    ``need_weights``). Cost O(L·S·D) time, O(L·S) memory. Masks are refused (its Spec): with no softmax
    there is no -inf that removes a key."""

    name: ClassVar[str] = "no_softmax"
    spec: ClassVar[Spec] = Spec(exact=False, causal=True, masks="none", weights=True,
                                summary="weights = scaled scores, no softmax (a failure mode, not a method)")

    def _forward(self, q, k, v, *, key_keep, attn_mask, is_causal, scale, dropout_p, need_weights):
        w = (q @ k.transpose(-2, -1)) * scale  # (B, H, L, S)
        if is_causal:
            L, S = w.shape[-2:]
            w = w * torch.ones(L, S, device=w.device, dtype=w.dtype).tril()  # zero, not -inf: no softmax follows
        return w @ v, w  # (B, H, L, Dv), (B, H, L, S)


def weight_stats(q: torch.Tensor, k: torch.Tensor, scale: float, score: str, causal: bool, max_items: int = 4) -> dict:
    """Entropy (nats) and mean max of the softmax rows, and the std of the scaled scores, from
    q [B, H, T, D], k [B, H, T, D] on the first ``max_items`` items. Entropy and max weight are None
    for ``score == "none"`` (no probability rows); ``entropy_uniform`` is log(keys each row sees)."""
    q, k = q[:max_items].detach().float(), k[:max_items].detach().float()
    s = (q @ k.transpose(-2, -1)) * scale  # (b, H, T, T)
    T = s.shape[-1]
    if causal:
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=s.device).tril(), float("-inf"))
    finite = torch.isfinite(s)
    res = {"score_std": float(s[finite].std()) if finite.sum() > 1 else 0.0}
    if score == "none":
        res.update(entropy=None, max_weight=None)
        return res
    w = torch.softmax(s, dim=-1)
    ent = -(w * torch.log(w.clamp_min(1e-30))).sum(-1)  # (b, H, T)
    res.update(entropy=float(ent.mean()), max_weight=float(w.amax(-1).mean()),
               entropy_uniform=float(torch.log(finite.sum(-1).float()).mean()))
    return res


def _unit_norm(x, ctx):
    return F.normalize(x, dim=-1)  # (B, H, T, D): cos(q, k) = q̂·k̂


class ExperimentModel(nn.Module):
    """Token + learned position embeddings (+ token shift), ``attnlab.nn`` pre-norm encoder layers, a
    linear read-out. ids [B, T] -> logits [B, C] (mean or last read-out), [B, m, C] (``target_positions``)
    or [B, T, C] ("all").

    score: "softmax" (the chosen ``attention``), "none" (:class:`NoSoftmax`) or "cosine" (softmax over
    cos(q, k) times ``cosine_temperature``); scale: the score scale of the softmax and no-softmax arms;
    attention: a name for :func:`attnlab.experiments.attention.choose`; qk_init "unit" draws W_Q, W_K
    with std d^-1/2 (q, k entries of unit variance for unit-variance inputs: the premise of
    Var(q·k) = d_k), "torch" keeps nn.Linear's default. Submodules: ``tok``, ``pos``, ``prev``,
    ``encoder`` (an ``attnlab.nn.Encoder``), ``head``."""

    def __init__(self, vocab_size: int, num_classes: int, max_len: int, *, d_model: int = 64, num_heads: int = 2,
                 head_dim: int = 32, num_layers: int = 2, token_shift: bool = False, score: str = "softmax",
                 scale: float | None = None, attention: str = "sdpa", causal: bool = False,
                 cosine_temperature: float = 1.0, qk_init: str = "unit"):
        super().__init__()
        if score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {score!r}")
        if qk_init not in ("unit", "torch"):
            raise ValueError(f"qk_init must be 'unit' or 'torch', got {qk_init!r}")
        self.score, self.causal = score, causal
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        nn.init.normal_(self.pos.weight, std=0.02)
        # Note [Token shift]: each position also gets an embedding of the token before it (a 2-tap causal
        # convolution over tokens, as in RWKV's token shift and H3/Based's short convolutions). One attention
        # layer can then match a query key against "value whose predecessor is that key" (associative
        # recall) instead of first having to learn a previous-token head from position embeddings.
        self.prev = nn.Embedding(vocab_size, d_model) if token_shift else None
        if score == "none":
            mechanism, pattern = NoSoftmax(), None
        else:
            c = choose(attention, max_len, causal)
            mechanism, pattern = c.mechanism, c.pattern
        scale = scale if scale is not None else head_dim ** -0.5
        self.encoder = Encoder(d_model, num_heads, num_layers, head_dim=head_dim, mechanism=mechanism,
                               pattern=pattern, scale=cosine_temperature if score == "cosine" else scale)
        for layer in self.encoder.layers:
            attn = layer.self_attn
            if score == "cosine":
                attn.hooks.add("q", _unit_norm)
                attn.hooks.add("k", _unit_norm)
            if qk_init == "unit":
                for lin in (attn.q_proj, attn.k_proj):
                    nn.init.normal_(lin.weight, std=d_model ** -0.5)
                    nn.init.zeros_(lin.bias)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, ids: torch.Tensor, target_positions: torch.Tensor | None = None, *, readout: str = "mean",
                stats: list | None = None) -> torch.Tensor:
        """ids [B, T] -> logits; readout "mean" (pool non-pad tokens) [B, C], "last" [B, C], "all" [B, T, C];
        ``target_positions`` [m] -> [B, m, C]. With ``stats`` a list, each layer appends :func:`weight_stats`."""
        B, T = ids.shape
        x = self.tok(ids) + self.pos(torch.arange(T, device=ids.device))  # (B, T, d)
        if self.prev is not None:
            x = x + self.prev(F.pad(ids, (1, 0))[:, :T])  # (B, T, d): token t-1's embedding (0 = pad before t=0)
        for layer in self.encoder.layers:
            x, r = layer.forward_intermediates(x, is_causal=self.causal)  # (B, T, d)
            if stats is not None:
                stats.append(weight_stats(r.q, r.k, layer.self_attn.scale, self.score, self.causal))
        x = self.encoder.norm(x)
        if target_positions is not None:
            return self.head(x[:, target_positions])  # (B, m, C)
        if readout == "mean":
            keep = (ids != 0).unsqueeze(-1).to(x.dtype)  # (B, T, 1)
            return self.head((x * keep).sum(1) / keep.sum(1).clamp_min(1.0))  # (B, C)
        if readout == "last":
            return self.head(x[:, -1])  # (B, C)
        return self.head(x)  # (B, T, C)


class LibraryLM(nn.Module):
    """``attnlab.nn.TransformerLM`` behind :class:`ExperimentModel`'s call: ids [B, T] -> logits [B, T, V]
    (no weight statistics: ``stats`` stays empty)."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, ids, target_positions=None, *, readout="all", stats=None):
        """ids [B, T] -> next-token logits [B, T, V]; the other arguments are accepted and ignored."""
        return self.lm(ids)  # (B, T, V)


def build_model(cfg, data) -> nn.Module:
    """The model of a run config (``experiments.training.RunConfig``) for ``data`` (its vocabulary and
    classes), initialised from ``torch.manual_seed(cfg.seed)``: :class:`ExperimentModel`, or with
    ``cfg.model == "lm"`` ``attnlab.nn.TransformerLM`` (text task, softmax only; RoPE, tied embeddings)."""
    torch.manual_seed(cfg.seed)
    if cfg.model == "lm":
        if data.name != "text" or cfg.score != "softmax":
            raise ValueError("--model lm (attnlab.nn.TransformerLM) runs the text task with softmax attention only")
        lm = TransformerLM(data.vocab_size, cfg.num_heads * cfg.head_dim, cfg.num_heads, cfg.num_layers,
                           max_len=cfg.seq_len, mechanism=choose(cfg.attention, cfg.seq_len, True).mechanism,
                           scale=scale_value(cfg.scale, cfg.head_dim))
        return LibraryLM(lm)
    if cfg.model != "tiny":
        raise ValueError(f"model must be 'tiny' or 'lm', got {cfg.model!r}")
    return ExperimentModel(data.vocab_size, data.num_classes, cfg.seq_len, d_model=cfg.d_model,
                           num_heads=cfg.num_heads, head_dim=cfg.head_dim, num_layers=cfg.num_layers,
                           score=cfg.score, scale=scale_value(cfg.scale, cfg.head_dim), attention=cfg.attention,
                           causal=cfg.causal, cosine_temperature=cfg.cosine_temperature, qk_init=cfg.qk_init,
                           token_shift=cfg.token_shift)


def loss_fn_for(data):
    """``loss_fn(model, ids [B, T], targets, stats) -> (loss, correct)`` for ``attnlab.harness.train_run``:
    next-token cross-entropy at every position for the text task, else at the task's read-out."""
    def loss_fn(model, ids, tgt, stats=None):
        if data.name == "text":
            logits = model(ids, readout="all", stats=stats)  # (B, T, C)
        else:
            logits = model(ids, data.target_positions, readout=data.readout, stats=stats)  # (B, C) or (B, m, C)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))
        return loss, (logits.argmax(-1) == tgt).float()
    return loss_fn
