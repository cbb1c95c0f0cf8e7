"""Conformance of every registered mechanism against the float64 oracle, on given shapes and edge cases.

Cases: random inputs, causal, key padding with a fully masked batch element, a full [L, S] bool mask
with fully masked rows, an additive float mask, L != S, L = 1 (a decoding step), GQA, bfloat16.
For each (mechanism, case): the max abs and relative error against ``attnlab.reference``, the path that
ran (the method the planner picked, or the approximation), or the reasons it was skipped (the
mechanism's declared ``not_supported_reasons``).

Tolerance for exact mechanisms (PyTorch's rule for fused kernels): error against float64 at most
TOL_FACTOR × the error of the naive same-dtype computation against float64, plus a per-dtype floor.
``run_conformance`` returns a :class:`ConformanceResult`; ``attnlab check`` (cli/check.py) only parses
arguments and prints it.

Shapes: query [B, H, L, E], key [B, Hkv, S, E], value [B, Hkv, S, Ev] (Ev = E here).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from . import mechanisms as M
from . import reference
from .functional import explain
from .mechanisms.exact import Exact
from .resources import check_memory

__all__ = ["run_conformance", "ConformanceResult", "check", "check_budget", "make_cases", "sized_instance",
           "Case", "CASES", "DTYPES", "TOL_FACTOR", "TOL_FLOOR"]

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOL_FACTOR = 3.0
TOL_FLOOR = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
CASES = ("random", "causal", "key_padding", "full_mask", "float_mask", "L!=S", "L=1", "gqa", "bf16")


@dataclass
class ConformanceResult:
    """Rows (one dict per mechanism and case: status ok | FAIL | approx | skip, errors, tolerance, path,
    reasons; approximations also ``band`` and ``within_band``), and the failure counts. ``exit_code`` is
    1 when anything failed."""

    rows: list[dict]
    shape: tuple[int, int, int, int]
    S: int
    dtype: torch.dtype

    @property
    def failures(self) -> list[dict]:
        """Rows with status FAIL (an exact mechanism off tolerance, or any crash / non-finite output)."""
        return [r for r in self.rows if r["status"] == "FAIL"]

    @property
    def exact_failures(self) -> list[dict]:
        """Failures of mechanisms that declare themselves exact."""
        return [r for r in self.failures if r["exact"]]

    @property
    def outside_band(self) -> list[dict]:
        """Approximation rows whose relative error fell outside the mechanism's declared ``Spec.error_band``
        (Note [Error bands] in attnlab.mechanisms): a verdict, not a failure (``exit_code`` ignores it)."""
        return [r for r in self.rows if r["status"] == "approx" and r.get("within_band") is False]

    @property
    def exit_code(self) -> int:
        """1 when anything failed, else 0 (``attnlab check``'s exit status)."""
        return 1 if self.failures else 0


def run_conformance(names=None, shape=(2, 4, 77, 32), S=None, dtype=torch.float32, seed=0,
                    only=None, progress=None) -> ConformanceResult:
    """Check ``names`` (default: every registered mechanism) on the cases built from query ``shape``
    [B, H, L, E] and key length ``S`` (default L). Raises ValueError for an unknown mechanism and
    ``attnlab.resources.OptionError`` when the oracle's scores would not fit the memory budget.
    ``progress(done, total, label)``, when given, is called before each (mechanism, case) and at the end."""
    check_budget(shape, S, only)
    rows = check(names, shape, S, dtype, seed, only, progress=progress)
    return ConformanceResult(rows, tuple(shape), S or shape[2], dtype)


@dataclass
class Case:
    """One case's inputs: q [B, H, L, E], k [B, Hkv, S, E], v [B, Hkv, S, E] and the keyword arguments
    (attn_mask, is_causal, enable_gqa) every mechanism gets."""

    name: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kwargs: dict = field(default_factory=dict)


#: float64 [B, H, L, S] arrays alive at once while a case is checked (reference scores, weights and
#: their temporaries, the naive same-dtype yardstick's scores and weights)
_SCORE_COPIES = 6


def check_budget(shape, S=None, only=None, text=None) -> None:
    """Refuse, before anything is allocated, shapes whose [B, H, L, S] score matrices do not fit the
    memory budget (``attnlab.resources.memory_budget``): the oracle is dense and float64."""

    B, H, L, E = shape
    S = L if S is None else S
    S_max = 2 * S + 3 if only is None or "L!=S" in only else S  # the L != S case doubles the keys
    where = f"--shape {text or ','.join(map(str, shape))}" + (f" --kv-len {S}" if S != L else "")
    # the scores, and the q, k, v (and out) in float64 with their copies in the case's dtype: E had been left
    # out, so a head dim of 10^8 passed the budget and allocated gigabytes
    check_memory(where, _SCORE_COPIES * 8 * B * H * L * S_max + 2 * 8 * B * H * (2 * L + 2 * S_max) * E,
                 f"the float64 reference's [B, H, L, S] scores (S up to {S_max}) and its q, k, v, out [.., E]")


def make_cases(shape, S=None, dtype=torch.float32, seed=0, only=None) -> list[Case]:
    """The inputs of every case, built from one query shape [B, H, L, E]."""
    B, H, L, E = shape
    S = L if S is None else S
    g = torch.Generator().manual_seed(seed)

    def r(*s, dt=dtype):
        return torch.randn(*s, generator=g, dtype=torch.float64).to(dt)

    cases = []

    def add(name, q, k, v, **kw):
        if only is None or name in only:
            cases.append(Case(name, q, k, v, kw))

    add("random", r(B, H, L, E), r(B, H, S, E), r(B, H, S, E))
    add("causal", r(B, H, L, E), r(B, H, S, E), r(B, H, S, E), is_causal=True)
    keep = torch.rand(B, 1, 1, S, generator=g) > 0.3
    keep[0] = False  # batch element 0: every key masked -> fully masked rows, output 0
    add("key_padding", r(B, H, L, E), r(B, H, S, E), r(B, H, S, E), attn_mask=keep)
    full = torch.rand(L, S, generator=g) > 0.4
    full[: max(1, L // 7)] = False  # some fully masked query rows
    add("full_mask", r(B, H, L, E), r(B, H, S, E), r(B, H, S, E), attn_mask=full)
    add("float_mask", r(B, H, L, E), r(B, H, S, E), r(B, H, S, E), attn_mask=r(L, S, dt=dtype))
    S2 = 2 * S + 3
    add("L!=S", r(B, H, L, E), r(B, H, S2, E), r(B, H, S2, E))
    add("L=1", r(B, H, 1, E), r(B, H, S, E), r(B, H, S, E))
    Hkv = H // 2 if H % 2 == 0 and H > 1 else 1
    add("gqa", r(B, H, L, E), r(B, Hkv, S, E), r(B, Hkv, S, E), enable_gqa=True)
    if dtype != torch.bfloat16:
        add("bf16", r(B, H, L, E, dt=torch.bfloat16), r(B, H, S, E, dt=torch.bfloat16),
            r(B, H, S, E, dt=torch.bfloat16))
    return cases


def _naive_same_dtype(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False):
    """softmax(q kᵀ s + mask) v computed in the inputs' dtype: the yardstick for the tolerance."""
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        g = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(g, -3), v.repeat_interleave(g, -3)
    s = (q @ k.transpose(-2, -1)) * (1 / math.sqrt(q.shape[-1]))
    L, S = s.shape[-2:]
    keep = torch.ones(L, S, dtype=torch.bool)
    if is_causal:
        keep = keep.tril()
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            keep = keep & attn_mask
        else:
            s = s + attn_mask
    s = s.masked_fill(~keep, float("-inf"))
    w = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return w @ v


def _reference(case: Case, pattern):
    mask = case.kwargs.get("attn_mask")
    if pattern is not None:
        pm = pattern.materialize(case.q.shape[-2], case.k.shape[-2])
        if mask is None:
            mask = pm
        elif mask.dtype == torch.bool:
            mask = mask & pm
        else:  # float mask and a pattern: the pattern's zeros become -inf
            mask = mask.double().masked_fill(~pm, float("-inf"))
    out, _ = reference.attention(case.q, case.k, case.v, mask, is_causal=case.kwargs.get("is_causal", False),
                                 enable_gqa=case.kwargs.get("enable_gqa", False))
    return torch.from_numpy(out), mask


def _path(mech, case: Case) -> str:
    if isinstance(mech, Exact):
        try:
            plan = explain(case.q, case.k, case.v, pattern=mech.pattern_for(), method=mech.method,
                                   **case.kwargs)
            return plan.method + (f" ({plan.sdpa_backend})" if plan.method == "sdpa" else "")
        except ValueError as e:
            return f"refused: {e}"
    return f"{mech.name}{' causal' if case.kwargs.get('is_causal') else ''}"


def sized_instance(name: str, L: int, S: int):
    """The mechanism with its window/block/budget sized to the inputs (about an eighth of the length),
    so that patterns really mask and approximations really approximate at the checked shape."""

    n = max(L, S)
    w, blk = max(1, n // 8), max(1, n // 8)
    sized = {
        "sliding_window": dict(window=w), "dilated": dict(window=max(1, w // 2), dilation=2),
        "strided": dict(stride=max(1, round(math.sqrt(n)))), "fixed": dict(block=blk, summary=max(1, blk // 4)),
        "longformer": dict(window=w, global_tokens=1), "bigbird": dict(block_size=blk),
        "block_sparse": dict(layout=_layout(-(-n // blk)), block_size=blk),
        "linformer": dict(k=max(1, S // 4)), "nystrom": dict(num_landmarks=max(1, min(L, S) // 4)),
        "hierarchical": dict(block_size=blk), "performer": dict(num_features=64),
    }
    return M.get(name, **sized.get(name, {}))


def _layout(nb: int) -> torch.Tensor:
    """Block layout: the diagonal band plus the first block column (a local + global pattern)."""
    i = torch.arange(nb)
    return ((i.unsqueeze(1) - i.unsqueeze(0)).abs() <= 1) | (i.unsqueeze(0) == 0)


def check(names=None, shape=(2, 4, 77, 32), S=None, dtype=torch.float32, seed=0, only=None,
          progress=None) -> list[dict]:
    """Run the check; one dict per (mechanism, case) (see ``run_conformance`` for the summary and
    ``progress``)."""

    names = list(M.available()) if not names else names
    for n in names:
        if n not in M.available():
            raise ValueError(f"unknown mechanism {n!r}; available: {', '.join(M.available())}")
    cases = make_cases(shape, S, dtype, seed, only)
    refs: dict[tuple, tuple] = {}
    rows = []
    total = len(names) * len(cases)
    for n in names:
        for c in cases:
            if progress is not None:
                progress(len(rows), total, f"{n} · {c.name}")
            mech = sized_instance(n, shape[2], max(c.k.shape[-2], S or shape[2]))
            row = dict(mechanism=n, params=repr(mech), case=c.name, exact=mech.spec.exact,
                       dtype=str(c.q.dtype).replace("torch.", ""))
            inputs = M.Inputs.from_tensors(c.q, c.k, c.v, c.kwargs.get("attn_mask"), c.kwargs.get("is_causal", False),
                                           0.0, c.kwargs.get("enable_gqa", False))
            reasons = mech.not_supported_reasons(inputs)
            if reasons:
                rows.append(dict(row, status="skip", path="", reasons=reasons))
                continue
            pat = mech.pattern_for() if mech.spec.exact else None
            key = (c.name, repr(pat))
            if key not in refs:
                refs[key] = _reference(c, pat)
            want, ref_mask = refs[key]
            try:
                out = mech(c.q, c.k, c.v, **c.kwargs)
            except Exception as e:  # a crash on inputs the spec claims: a failure, reported
                rows.append(dict(row, status="FAIL", path=_path(mech, c), reasons=[f"{type(e).__name__}: {e}"]))
                continue
            o = out.detach().double()
            err = float((o - want).abs().max()) if o.numel() else 0.0
            rel = float((o - want).norm() / want.norm().clamp_min(1e-300)) if o.numel() else 0.0
            row.update(path=_path(mech, c), max_abs_err=err, rel_fro_err=rel, reasons=[])
            finite = bool(torch.isfinite(o).all())
            if mech.spec.exact:
                naive_kw = dict(c.kwargs)
                naive_kw["attn_mask"] = ref_mask.to(c.q.dtype) if (
                    ref_mask is not None and ref_mask.dtype != torch.bool) else ref_mask
                naive = _naive_same_dtype(c.q, c.k, c.v, **naive_kw)
                naive_err = float((naive.double() - want).abs().max()) if naive.numel() else 0.0
                tol = TOL_FACTOR * naive_err + TOL_FLOOR[c.q.dtype]
                row.update(naive_err=naive_err, tol=tol)
                row["status"] = "ok" if (finite and err <= tol) else "FAIL"
            else:
                row["status"] = "approx" if finite else "FAIL"
                band = mech.spec.error_band  # Note [Error bands] in attnlab.mechanisms
                row.update(band=band, within_band=None if band is None else bool(finite and rel <= band))
                if not finite:
                    row["reasons"] = ["non-finite output"]
            rows.append(row)
    if progress is not None:
        progress(total, total, "done")
    return rows
