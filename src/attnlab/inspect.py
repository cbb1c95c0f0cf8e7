"""attnlab.inspect: collect per-layer, per-head attention from attnlab modules while they run.

    with attnlab.inspect.capture(model) as cap:          # any nn.Module holding attnlab MultiHeadAttention
        model(x)
    cap.weights()        # [B, H, L, S] per attention module, in module order (mode="weights")
    cap.summaries()      # StreamingSummary per module (mode="summary": no [L, S] tensor is kept)

How: every ``attnlab.nn.MultiHeadAttention`` inside ``module`` (found with ``named_modules``) gets its
``forward_intermediates`` wrapped for the duration of the ``with`` block (blocks call that method
directly, so ordinary forward hooks would miss them). In weights mode the call asks for per-head
weights; the caller still receives exactly what it asked for. In summary mode the projected q, k
(after rotary positions) are summarised by ``attnlab.diagnostics.streaming_summary`` with the same
pattern, causal flag and key padding; additive position biases (ALiBi) are not included there.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

__all__ = ["capture", "Capture", "Record", "attention_modules"]


@dataclass
class Record:
    name: str  # module path inside the captured model, e.g. "layers.3.self_attn"
    index: int  # order of the module among attention modules
    call: int  # how many times this module had been called before (0 = first call)
    weights: torch.Tensor | None = None  # (B, H, L, S) in weights mode
    summary: object | None = None  # StreamingSummary per batch element in summary mode (list)


@dataclass
class Capture:
    mode: str
    names: list[str]
    records: list[Record] = field(default_factory=list)

    def last(self) -> list[Record]:
        """The latest call of each attention module, in module order."""
        latest: dict[int, Record] = {}
        for r in self.records:
            latest[r.index] = r
        return [latest[i] for i in sorted(latest)]

    def weights(self) -> list[torch.Tensor]:
        """Per-head weights [B, H, L, S] of each module's latest call (mode="weights")."""
        if self.mode != "weights":
            raise ValueError("this capture ran in summary mode; use .summaries() or capture(mode='weights')")
        return [r.weights for r in self.last()]

    def summaries(self) -> list:
        """Per module: a list (one per batch element) of StreamingSummary (mode="summary")."""
        if self.mode != "summary":
            raise ValueError("this capture ran in weights mode; use .weights() or capture(mode='summary')")
        return [r.summary for r in self.last()]


def attention_modules(module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) for every attnlab.nn.MultiHeadAttention inside ``module`` (itself included)."""
    from .nn import MultiHeadAttention

    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"capture() needs a torch.nn.Module, got {type(module).__name__}")
    return [(n or "(root)", m) for n, m in module.named_modules() if isinstance(m, MultiHeadAttention)]


@contextlib.contextmanager
def capture(module, mode: str = "weights", *, topk: int = 5):
    """Record attention of every attnlab MultiHeadAttention inside ``module`` during the block.

    mode: "weights" keeps per-head weights [B, H, L, S] (detached); "summary" keeps streaming
    summaries (entropy, max weight, sink mass, top-``topk`` keys, distance histogram) per head.
    """
    if mode not in ("weights", "summary"):
        raise ValueError(f"mode must be 'weights' or 'summary', got {mode!r}")
    mods = attention_modules(module)
    if not mods:
        raise ValueError(f"{type(module).__name__} contains no attnlab.nn.MultiHeadAttention to capture")
    cap = Capture(mode, [n for n, _ in mods])
    calls = [0] * len(mods)
    originals = []
    for idx, (name, m) in enumerate(mods):
        orig = m.forward_intermediates  # bound method
        originals.append((m, "forward_intermediates" in m.__dict__, m.__dict__.get("forward_intermediates")))

        def wrapped(*args, _orig=orig, _idx=idx, _name=name, _m=m, **kwargs):
            asked = kwargs.get("need_weights", False)
            if mode == "weights":
                kwargs["need_weights"] = True
            r = _orig(*args, **kwargs)
            rec = Record(_name, _idx, calls[_idx])
            calls[_idx] += 1
            if mode == "weights":
                w = r.weights
                rec.weights = None if w is None else (w.unsqueeze(0) if w.dim() == 3 else w).detach()
                if not asked:
                    r.weights = None
            else:
                rec.summary = _summarise(_m, r, kwargs, topk)
            cap.records.append(rec)
            return r

        m.forward_intermediates = wrapped
    try:
        yield cap
    finally:
        for m, had, old in originals:
            if had:
                m.forward_intermediates = old
            else:
                del m.forward_intermediates


def _summarise(m, r, kwargs, topk):
    """Streaming summaries of one call from its projected q, k (see the module docstring)."""
    from . import patterns as P
    from .diagnostics import streaming_summary

    q, k = r.q, r.k  # (B, H, L, D), (B, Hkv, S, D)
    if q.dim() == 3:
        q, k = q.unsqueeze(0), k.unsqueeze(0)
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # (B, H, S, D)
    pattern = getattr(m, "pattern", None)
    if kwargs.get("is_causal"):
        pattern = P.causal() if pattern is None else pattern & P.causal()
    am = kwargs.get("attn_mask")
    if isinstance(am, P.Pattern):
        pattern = am if pattern is None else pattern & am
        am = None
    kpm = kwargs.get("key_padding_mask")
    out = []
    for b in range(q.shape[0]):
        pat = pattern
        if kpm is not None:
            kp = P.from_key_padding_mask(kpm[b:b + 1])
            pat = kp if pat is None else pat & kp
        mask_b = None
        if isinstance(am, torch.Tensor):
            mask_b = am if am.dim() == 2 else am[b if am.shape[0] > 1 else 0]
        out.append(streaming_summary(q[b].detach(), k[b].detach(), mask_b, scale=getattr(m, "scale", None),
                                     pattern=pat, k=topk))
    return out
