"""attnlab bench decode: decode attention against a KV cache, attnlab vs PyTorch SDPA, against the memory bandwidth.

Per case (KV length S, dtype, heads, batch B, cache layout) one new query token (L = 1) attends to the whole
cache. Every case of one (heads, S, B) is timed side by side in the same interleaved rounds (medians; Note
[Decode bench round groups]): ``attnlab.attention_with_kvcache`` on each dtype's and layout's cache
(contiguous, or paged with the given page size) and ``F.scaled_dot_product_attention(enable_gqa=True)`` on
each dtype's keys in [B, Hkv, S, D], plus the read bandwidth (a sum over a buffer well past the caches, run
before every timed call, so each call reads its K/V cold: Note [Decode bench cold cache]). Reported:
milliseconds, GB/s of K/V read, the memory-bound time (K/V bytes / bandwidth) and attnlab's time over it,
and attnlab's speed over SDPA's. Every case's output is checked against SDPA in float64 (the error budget:
FUSED_ERROR_FACTOR times SDPA's own error in the case's dtype, plus a floor); a case out of budget sets
``exit_code`` 1.

dtype "int8": an int8 cache (``QuantizedKV``, per-token per-head scales) with float32 queries; SDPA runs on the
dequantised float32 keys (the same values), and the int8 target compares its time with the bf16 case's.
dtype "int8g32": the same with one float32 scale per 32 channels (llama.cpp q8_0's blocks: the format of the HF
int8 cache, ``integrations.hf_int8``, whose key rotation is the query's and not timed here), held to the same
target.

Head configurations (the issue-23 shapes): gqa H=32, Hkv=8, D=128; mha H=8, Hkv=8, D=64; mqa H=32, Hkv=1,
D=128. Targets (issue 23, for a quiet machine): gqa, B=1, S=4096 and 32768: time <= 1.25x the memory-bound
time and >= 2x SDPA's speed; mha S=8192 >= 1.0x SDPA; paged <= 1.10x the contiguous case's time; int8 <= 0.6x
the bf16 case's time at S=32768. The figures of a shared machine are not the targets'.

``run(DecodeConfig(...)) -> DecodeBench``: no printing, no argv (the CLI is ``attnlab bench decode``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from ..functional import attention_with_kvcache
from ..functional.kvcache import QuantizedKV
from ..functional.storage import anon_huge_bytes, empty_kv_cache, huge_pages_available, transparent_hugepage_mode
from ..harness import threads
from ..kernels import decode as decode_kernel
from ..report import environment
from ..resources import check_memory
from .files import write_json_and_figure

__all__ = ["DecodeConfig", "DecodeBench", "HEADS", "run"]

#: name -> (H, Hkv, D)
HEADS = {"gqa": (32, 8, 128), "mha": (8, 8, 64), "mqa": (32, 1, 128)}
QUICK = dict(seq_lens=(256, 1024), dtypes=("float32", "bfloat16"), heads=("gqa", "mqa"), batches=(1,),
             layouts=("contiguous", "paged16"), rounds=3, bandwidth_mib=64)
FULL = dict(seq_lens=(1024, 4096, 8192, 32768, 65536), dtypes=("float32", "bfloat16", "int8"), heads=("gqa", "mha", "mqa"),
            batches=(1, 8), layouts=("contiguous", "paged16", "paged64", "paged256"), rounds=9, bandwidth_mib=1024)
#: the --dtypes names; "int8" and "int8g32" are int8 caches (INT8_GROUPS: scale groups of a row, 0 per row)
DTYPES = ("float32", "bfloat16", "float16", "int8", "int8g32")
INT8_GROUPS = {"int8": 0, "int8g32": 32}
#: a case whose caches would take more than this many bytes is skipped (recorded)
CASE_BYTES_LIMIT = 8 * 2**30
#: cases of one (heads, S, B) share rounds while their caches fit in this many bytes (Note [Decode bench round groups])
GROUP_BYTES_LIMIT = 8 * 2**30
#: the error budget's factor over SDPA's own error in the case's dtype (tests/helpers.py FUSED_ERROR_FACTOR)
ERROR_FACTOR = 3.0
TARGETS = {"memory_bound_ratio": 1.25, "gqa_speedup": 2.0, "mha_speedup": 1.0, "paged_over_contiguous": 1.10,
           "int8_over_bf16": 0.6}


@dataclass
class DecodeConfig:
    """What ``bench decode`` measures. A field left None takes ``QUICK``'s value when ``quick`` and ``FULL``'s
    otherwise. layouts: "contiguous" or "paged<page size>"; threads: torch's thread count (None: unchanged)."""
    out: str = "reports/bench-decode"
    quick: bool = False
    seq_lens: tuple[int, ...] | None = None
    dtypes: tuple[str, ...] | None = None
    heads: tuple[str, ...] | None = None
    batches: tuple[int, ...] | None = None
    layouts: tuple[str, ...] | None = None
    rounds: int | None = None
    bandwidth_mib: int | None = None
    threads: int | None = None

    def resolved(self) -> dict:
        """Every setting with the defaults filled in, checked: ValueError naming the option otherwise."""
        base = QUICK if self.quick else FULL
        v = {k: base[k] if getattr(self, k) is None else getattr(self, k) for k in base}
        for d in v["dtypes"]:
            if d not in DTYPES:
                raise ValueError(f"--dtypes: {d!r} is not one of {', '.join(DTYPES)}")
        for h in v["heads"]:
            if h not in HEADS:
                raise ValueError(f"--heads: {h!r} is not one of {', '.join(HEADS)}")
        for lay in v["layouts"]:
            if lay != "contiguous" and not (lay.startswith("paged") and lay[5:].isdigit() and int(lay[5:]) > 0):
                raise ValueError(f"--layouts: {lay!r} is neither 'contiguous' nor 'paged<page size>' (e.g. paged16)")
        if v["rounds"] < 1 or any(s < 1 for s in v["seq_lens"]) or any(b < 1 for b in v["batches"]):
            raise ValueError("--rounds, --seq-lens and --batches must be >= 1")
        if self.threads is not None and self.threads <= 0:
            raise ValueError(f"--threads must be > 0, got {self.threads}")
        return v


@dataclass
class DecodeBench:
    """Result of one ``bench decode`` run: one row per case (times, GB/s, bandwidth, ratios, error), the
    issue-23 targets where this run has their cases, the environment, the files written, and
    ``exit_code`` (1 if any case's output is out of its error budget)."""
    out_dir: str
    rows: list[dict] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)
    targets: list[dict] = field(default_factory=list)
    env: dict = field(default_factory=dict)
    threads: int = 0
    files: list[str] = field(default_factory=list)
    exit_code: int = 0

    def write(self) -> list[str]:
        """Write decode.json and decode.png into ``out_dir``; returns both paths."""
        self.files = write_json_and_figure(self.out_dir, "decode", {
            "suite": "decode", "threads": self.threads, "rows": self.rows, "skipped": self.skipped,
            "targets": self.targets, "env": self.env,
            "storage": {"allocator": "attnlab.empty_kv_cache (contiguous and paged caches alike)",
                        "huge_pages_available": huge_pages_available(), "transparent_hugepage": transparent_hugepage_mode()},
            "note": ("ms: medians of interleaved rounds shared by the cases of one round_group (every dtype and layout "
                     "of a heads, S, B), each call after a bandwidth probe that flushes the caches "
                     "(cold K/V); memory_bound_ms = K/V bytes / the read bandwidth measured in the same rounds; "
                     "speedup = SDPA ms / attnlab ms; huge_pages_fraction: the K cache's bytes on huge pages "
                     "(/proc/self/smaps AnonHugePages)")},
            lambda ax: _draw(self, ax), figsize=(6, 3.5))
        return self.files


def _paged(x: torch.Tensor, table: torch.Tensor, page: int) -> torch.Tensor:
    """x [B, S, Hkv, *] -> a pool [P, page, Hkv, *] holding its rows where ``table`` [B, pages] says."""
    B, S = x.shape[:2]
    pool = empty_kv_cache(table.numel(), page, *x.shape[2:], dtype=x.dtype)  # like the contiguous case's storage
    j = torch.arange(S)
    pool[table.long()[:, j // page], j % page] = x
    return pool


# Note [Decode bench cold cache]: every timed call follows a bandwidth probe, whose buffer (1 GiB by default)
# is far past the L3, so each call reads its K/V from memory, as the memory-bound time assumes. One probe per
# round, after both calls, let the second call of a round read warm data wherever it shared memory with the
# first: SDPA's k, v [B, Hkv, S, D] are the memory of the contiguous cache (a view), so in the
# rounds SDPA went first the contiguous case found up to 32 MiB of its K/V in the L3 (all of a bf16 cache at
# S = 4096, 16.8 MB), while a paged pool (a copy) never did: its ratio to the contiguous case was biased
# against it by the L3, and at S <= 4096 the contiguous case's time against the bound mixed cold and warm
# rounds.
def _bandwidth_once(buf: torch.Tensor) -> float:
    t = time.perf_counter()
    buf.sum()
    return buf.numel() * buf.element_size() / (time.perf_counter() - t)


def _torch_dtype(name: str) -> torch.dtype:
    return torch.int8 if name in INT8_GROUPS else getattr(torch, name)


def _kv_bytes(B, Hkv, S, D, name: str) -> int:
    """K/V bytes a call reads (``kernels.decode.kv_bytes``; a group-scaled cache one scale per group)."""
    gs = INT8_GROUPS.get(name, 0)
    return decode_kernel.kv_bytes(B, Hkv, S, D, D, _torch_dtype(name), groups=D // gs if gs else 1)


def _quantized_cache(x: torch.Tensor, group_size: int = 0):
    """x [B, S, Hkv, D] -> a QuantizedKV laid out as the other dtypes' contiguous case: data and scales in
    [B, Hkv, S, ·] storage (``empty_kv_cache``: huge pages where offered) seen as [B, S, Hkv, ·] views, so the
    int8 target compares like with like (the same layout, head span and splits as the bf16 cache)."""

    q = QuantizedKV.quantize(x, group_size=group_size or None)
    B, S, Hkv, D = x.shape
    data = empty_kv_cache(B, Hkv, S, D, dtype=torch.int8).transpose(1, 2)
    scale = empty_kv_cache(B, Hkv, S, *q.scale.shape[3:], dtype=torch.float32).transpose(1, 2)
    data.copy_(q.data)
    scale.copy_(q.scale)
    return QuantizedKV(data, scale)


def _huge_fraction(t: torch.Tensor) -> float | None:
    """The share of t's bytes the kernel backs with huge pages (smaps AnonHugePages), capped at 1."""
    got = anon_huge_bytes(t)
    return None if got is None else min(1.0, got / max(1, t.numel() * t.element_size()))


def _inputs(name, S, dtype, B, gen):
    """One dtype's inputs: q [B, H, 1, D], SDPA's k, v [B, Hkv, S, D] and attnlab's contiguous cache (views of
    the same memory in [B, S, Hkv, D]; an int8 cache's SDPA keys are its dequantised values)."""
    H, Hkv, D = HEADS[name]
    dt = _torch_dtype(dtype)
    int8 = dtype in INT8_GROUPS
    if int8:  # float32 queries against an int8 cache; SDPA on the dequantised values
        dt = torch.float32
    q = torch.randn(B, H, 1, D, generator=gen).to(dt)
    # (B, Hkv, S, D) in attnlab's cache storage, as a paged pool's (huge pages where offered: like with like)
    k = empty_kv_cache(B, Hkv, S, D, dtype=dt).copy_(torch.randn(B, Hkv, S, D, generator=gen))
    v = empty_kv_cache(B, Hkv, S, D, dtype=dt).copy_(torch.randn(B, Hkv, S, D, generator=gen))
    kc, vc = k.transpose(1, 2), v.transpose(1, 2)  # views: the same memory SDPA reads
    if int8:
        kc, vc = _quantized_cache(kc, INT8_GROUPS[dtype]), _quantized_cache(vc, INT8_GROUPS[dtype])
        k, v = kc.dequantize().transpose(1, 2), vc.dequantize().transpose(1, 2)
    return q, k, v, kc, vc


def _layout(kc, vc, layout: str, B: int, S: int, gen):
    """The contiguous cache (kc, vc) as ``layout``: itself, or a paged pool over shuffled pages; -> (k, v, table)."""

    if layout == "contiguous":
        return kc, vc, None
    page = int(layout[5:])
    table = torch.randperm(B * -(-S // page), generator=gen).view(B, -1).to(torch.int32)  # shuffled pages
    if isinstance(kc, QuantizedKV):
        return (QuantizedKV(_paged(kc.data, table, page), _paged(kc.scale, table, page)),
                QuantizedKV(_paged(vc.data, table, page), _paged(vc.scale, table, page)), table)
    return _paged(kc, table, page), _paged(vc, table, page), table


def _budget(dtype: str, q, k, v, sdpa_err: float, exact, v_scale=None) -> float:
    """A case's error budget: ERROR_FACTOR x SDPA's own error plus a floor of 4 eps; an int8 cache adds its
    int16 query's rounding (csrc Note [Decode int8 scores]): half a step of max|q| D^-1/2 / 32767 per element
    moves a score by ds <= that times max |k|_1, an output by 2 ds max|v|; twice that; and twice its integer
    P @ V's rounding (csrc Note [Decode int8 P @ V]: ``int_pv_bound`` on float64 probabilities, v_scale
    [B, S, Hkv] each key's value scale, or [B, S, Hkv, groups] its group scales, whose largest stands for the
    row)."""
    budget = ERROR_FACTOR * sdpa_err + 4 * torch.finfo(q.dtype).eps * max(1.0, float(exact.abs().max()))
    if dtype in INT8_GROUPS:
        ds = float(q.abs().amax()) * q.shape[-1] ** -0.5 / 32767 / 2 * float(k.abs().sum(-1).max())
        budget += 2 * 2 * ds * float(v.abs().max())
        B, H, _, D = q.shape
        Hkv, S = k.shape[1], k.shape[2]
        G = H // Hkv
        # each kv head's G query heads against its keys, without repeating K (GB at S 65536, B 8)
        s = q.double().reshape(B, Hkv, G, D) @ k.double().transpose(-1, -2) * D ** -0.5  # (B, Hkv, G, S)
        probs = s.softmax(-1).reshape(B, H, 1, S)
        v_scale = v_scale.amax(-1) if v_scale.dim() == 4 else v_scale
        vs = v_scale.double().repeat_interleave(G, 2).permute(0, 2, 1).unsqueeze(2)  # (B, H, 1, S)
        budget += 2 * float(decode_kernel.int_pv_bound(probs, vs).max())
    return budget


# Note [Decode bench round groups]: the targets are ratios between cases (paged over contiguous, int8 over bf16),
# and this VM's read bandwidth moves by up to 2x between phases seconds apart. So every case of one (heads, S, B)
# is timed in the same rounds: each round calls attnlab on every (dtype, layout) and SDPA once per dtype, each
# call after its own bandwidth probe (Note [Decode bench cold cache]), in an order rotated by one each round so
# every call takes every place once in len(calls) rounds. A group whose caches would pass GROUP_BYTES_LIMIT is
# split in order (dtypes, then layouts); rows carry their ``round_group`` and each ratio target says whether
# its two cases shared rounds (``side_by_side``).
def _group(gid, name, S, B, variants, rounds, buf, gen) -> list[dict]:
    """Time every (dtype, layout) of ``variants`` for one (heads, S, B) in shared rounds; one row each."""
    H, Hkv, D = HEADS[name]
    dtypes = list(dict.fromkeys(d for d, _ in variants))
    ins = {d: _inputs(name, S, d, B, gen) for d in dtypes}
    calls, meta = [], {}  # calls: (key, fn); meta[(d, lay)]: the row's fixed fields
    for d in dtypes:
        q, k, v, kc, vc = ins[d]
        qf = q.transpose(1, 2)  # (B, 1, H, D): flash-attn's layout, a view
        outs = []
        for dd, lay in variants:
            if dd != d:
                continue
            kl, vl, table = _layout(kc, vc, lay, B, S, gen)
            fn = (lambda qf=qf, kl=kl, vl=vl, table=table: decode_kernel_call(qf, kl, vl, table, S))
            calls.append(((d, lay), fn))
            outs.append(((d, lay), kl, fn()))
        theirs = lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
        calls.append(((d, "sdpa"), theirs))
        ref_lo = theirs()
        exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), enable_gqa=True)
        sdpa_err = float((ref_lo.double() - exact).abs().max())
        budget = _budget(d, q, k, v, sdpa_err, exact, vc.scale if isinstance(vc, QuantizedKV) else None)
        for key, kl, out in outs:
            data = kl.data if d in INT8_GROUPS else kl
            meta[key] = {"max_err": float((out.transpose(1, 2).double() - exact).abs().max()), "sdpa_err": sdpa_err,
                         "err_budget": budget, "splits": decode_kernel.num_splits_for(data, B, S),
                         "huge_pages_fraction": _huge_fraction(data)}
    times = {key: [] for key, _ in calls}
    bw = []
    n = len(calls)
    for r in range(rounds):  # Note [Decode bench round groups]: the order rotated by one each round
        for key, f in calls[r % n:] + calls[:r % n]:
            bw.append(_bandwidth_once(buf))  # Note [Decode bench cold cache]: also flushes the caches
            t = time.perf_counter()
            f()
            times[key].append(time.perf_counter() - t)
    bwm = float(np.median(bw))
    rows = []
    for (d, lay), m in meta.items():
        nbytes = _kv_bytes(B, Hkv, S, D, d)
        ms = float(np.median(times[d, lay])) * 1e3
        ss = float(np.median(times[d, "sdpa"])) * 1e3
        bound_ms = nbytes / bwm * 1e3
        rows.append({"heads": name, "H": H, "Hkv": Hkv, "D": D, "S": S, "dtype": d, "B": B, "layout": lay,
                     "kv_bytes": nbytes, "attnlab_ms": ms, "sdpa_ms": ss, "bandwidth_gbs": bwm / 1e9,
                     "attnlab_gbs": nbytes / ms / 1e6, "sdpa_gbs": nbytes / ss / 1e6, "memory_bound_ms": bound_ms,
                     "attnlab_over_bound": ms / bound_ms, "speedup": ss / ms, "splits": m["splits"],
                     "max_err": m["max_err"], "sdpa_err": m["sdpa_err"], "err_budget": m["err_budget"],
                     "correct": m["max_err"] <= m["err_budget"], "huge_pages_fraction": m["huge_pages_fraction"],
                     "round_group": gid, "calls_per_round": n})
    return rows


def _group_bytes(name, S, B, variants) -> int:
    """Memory a round group holds: per dtype SDPA's K/V (and an int8 cache beside its dequantised keys), plus
    every paged pool."""
    H, Hkv, D = HEADS[name]
    total = 0
    for d in dict.fromkeys(d for d, _ in variants):
        cache = _kv_bytes(B, Hkv, S, D, d)
        total += cache + (decode_kernel.kv_bytes(B, Hkv, S, D, D, torch.float32) if d in INT8_GROUPS else 0)
        total += cache * sum(1 for dd, lay in variants if dd == d and lay != "contiguous")
    return total


def _chunks(name, S, B, variants) -> list[list]:
    """``variants`` split in order into round groups of at most GROUP_BYTES_LIMIT (one variant at least)."""
    out: list[list] = []
    for var in variants:
        if out and _group_bytes(name, S, B, out[-1] + [var]) <= GROUP_BYTES_LIMIT:
            out[-1].append(var)
        else:
            out.append([var])
    return out


def decode_kernel_call(q, k_cache, v_cache, block_table, S: int):
    """The call the bench times: ``attnlab.attention_with_kvcache`` of q [B, 1, H, D] over S cached keys
    (a paged cache's last page may hold fewer than its page size)."""
    return attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=S, block_table=block_table, is_causal=False)


def _targets(rows: list[dict]) -> list[dict]:
    out = []
    by = {(r["heads"], r["S"], r["dtype"], r["B"], r["layout"]): r for r in rows}
    for r in rows:
        c = by.get((r["heads"], r["S"], r["dtype"], r["B"], "contiguous"))
        if r["layout"] != "contiguous" and c is not None:
            ratio = r["attnlab_ms"] / c["attnlab_ms"]
            out.append({"case": f"{r['heads']} S={r['S']} {r['dtype']} B={r['B']} {r['layout']} vs contiguous",
                        "paged_over_contiguous": ratio, "met": ratio <= TARGETS["paged_over_contiguous"],
                        "side_by_side": r["round_group"] == c["round_group"]})
        b16 = by.get((r["heads"], r["S"], "bfloat16", r["B"], r["layout"]))
        if r["dtype"] in INT8_GROUPS and r["S"] == 32768 and b16 is not None:
            ratio = r["attnlab_ms"] / b16["attnlab_ms"]
            out.append({"case": f"{r['heads']} S=32768 {r['dtype']} vs bf16 B={r['B']} {r['layout']}", "int8_over_bf16": ratio,
                        "met": ratio <= TARGETS["int8_over_bf16"], "side_by_side": r["round_group"] == b16["round_group"]})
    for r in rows:
        if r["layout"] != "contiguous" or r["B"] != 1:
            continue
        if r["heads"] == "gqa" and r["S"] in (4096, 32768):
            out.append({"case": f"gqa S={r['S']} {r['dtype']}", "attnlab_over_bound": r["attnlab_over_bound"],
                        "speedup": r["speedup"], "met": r["attnlab_over_bound"] <= TARGETS["memory_bound_ratio"]
                        and r["speedup"] >= TARGETS["gqa_speedup"]})
        if r["heads"] == "mha" and r["S"] == 8192:
            out.append({"case": f"mha S=8192 {r['dtype']}", "speedup": r["speedup"],
                        "met": r["speedup"] >= TARGETS["mha_speedup"]})
    return out


def run(config: DecodeConfig, *, progress: Callable[[int, int, str], None] | None = None) -> DecodeBench:
    """Measure every case of ``config``; writes decode.json and decode.png to ``out``. Cases whose caches
    exceed CASE_BYTES_LIMIT are skipped (listed in ``skipped``). Raises ValueError for bad settings or
    when the decode extension is not built (nothing of attnlab's would be measured). Torch's thread count
    is restored afterwards."""
    v = config.resolved()
    if not decode_kernel.available():
        raise ValueError(f"bench decode measures attnlab's decode kernel, which is unavailable: "
                         f"{decode_kernel.unavailable_reason()}")
    check_memory("--bandwidth-mib", v["bandwidth_mib"] * 2**20, "the bandwidth probe's buffer")
    with threads(config.threads):
        return _run(config, v, progress)


def _run(config: DecodeConfig, v: dict, progress) -> DecodeBench:
    res = DecodeBench(str(config.out), env=environment(), threads=torch.get_num_threads())
    buf = torch.ones(v["bandwidth_mib"] * 2**20 // 4)
    gen = torch.Generator().manual_seed(0)
    groups = []  # (heads, S, B, [(dtype, layout), ...]): Note [Decode bench round groups]
    for h in v["heads"]:
        for B in v["batches"]:
            for S in v["seq_lens"]:
                H, Hkv, D = HEADS[h]
                variants = []
                for d in v["dtypes"]:
                    for lay in v["layouts"]:
                        nbytes = _kv_bytes(B, Hkv, S, D, d) * (2 if lay != "contiguous" else 1)
                        if nbytes > CASE_BYTES_LIMIT:
                            res.skipped.append({"case": f"{h} S={S} {d} B={B} {lay}",
                                                "why": f"caches {nbytes / 2**30:.1f} GiB > {CASE_BYTES_LIMIT / 2**30:.0f}"})
                        else:
                            variants.append((d, lay))
                groups += [(h, S, B, c) for c in _chunks(h, S, B, variants)] if variants else []
    for n, (h, S, B, variants) in enumerate(groups):
        if progress:
            progress(n, len(groups), f"{h} S={S} B={B}: {len(variants)} cases")
        with torch.inference_mode():
            res.rows += _group(n, h, S, B, variants, v["rounds"], buf, gen)
    res.targets = _targets(res.rows)
    if not all(r["correct"] for r in res.rows):
        res.exit_code = 1
    res.write()
    if progress:
        progress(len(groups), len(groups), "done")
    return res


def _colors(n: int) -> list:
    """n distinct colours (tab10 up to 10, then tab20): a colour cycle that repeats would pair two cases."""
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i) for i in range(n)]


def _draw(res: DecodeBench, ax) -> None:
    sel = [r for r in res.rows if r["layout"] == "contiguous" and r["B"] == 1]
    keys = sorted({(r["heads"], r["dtype"]) for r in sel})
    colors = _colors(len(keys))
    for key, color in zip(keys, colors):  # one colour per (heads, dtype): attnlab solid, SDPA dashed
        rs = sorted((r for r in sel if (r["heads"], r["dtype"]) == key), key=lambda r: r["S"])
        ax.plot([r["S"] for r in rs], [r["attnlab_gbs"] for r in rs], "o-", color=color,
                label=f"attnlab {key[0]} {key[1]}")
        ax.plot([r["S"] for r in rs], [r["sdpa_gbs"] for r in rs], "x--", color=color, alpha=0.6,
                label=f"sdpa {key[0]} {key[1]}")
    if res.rows:
        ax.axhline(float(np.median([r["bandwidth_gbs"] for r in res.rows])), color="gray", lw=0.8,
                   label="read bandwidth")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("KV length S (B=1, contiguous)")
    ax.set_ylabel("K/V GB/s")
    ax.legend(fontsize=5, ncol=2)
    if not sel:
        ax.text(0.5, 0.5, "no contiguous B=1 case", ha="center", transform=ax.transAxes)
