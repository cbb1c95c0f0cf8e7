"""attnlab bench planner: does ``method="auto"`` run the fastest kernel on this CPU? (issue 22's sweep)

For each configuration (a kind of mask × dtype × length × batch/heads/GQA) the inputs are built once and
timed, forward under ``torch.no_grad``, side by side in interleaved rounds (medians; Note [Median,
interleaved] in ``attnlab.timing``): ``attnlab.attention(method="auto")`` beside every kernel
of ``METHODS`` that accepts the inputs (a kernel that refuses them stays in the table as "refused", with
its reason; one far too slow to time, as "skipped": Note [Kernels too slow to time]). Auto is timed
paired with the kernel it picks (by ``attnlab.explain``): back to back in every round, the order flipped
each round (Note [Paired samples] in ``attnlab.timing``), so auto's own cost over its pick is a paired
figure and auto does not carry the rounds' spread twice. Per configuration the row holds each kernel's
median and auto's (``ms``, raw), the fastest kernel, auto's pick, and

- ``pick_ratio`` = the pick's median / the fastest's (did auto choose well),
- ``auto_over_pick`` = the median over rounds of auto's sample / its pick's sample of the same round (what
  auto's planning costs on top of the kernel; None when the pick is no kernel of ``METHODS``),
- ``ratio`` = auto / fastest = ``auto_over_pick`` × ``pick_ratio`` (``raw_ratio`` where it is None),
- ``raw_ratio`` = auto's median / the fastest's (two separate medians: kept for comparison).

The summary: the fraction of configurations with ``ratio`` within ``TOLERANCE`` of the fastest (and the
same by ``raw_ratio`` and by ``pick_ratio``), and the worst ratio (targets: >= 95 %, never under 0.8x the
fastest, i.e. a ratio <= 1.25).

Kinds: dense, causal, window (causal sliding window), block_sparse (a seeded random block layout),
document (packed causal documents of seeded random lengths), decode (L = 1 query against S = n keys,
the KV-cache shape). Only public APIs are used (``attnlab.attention``, ``attnlab.explain``).

Long runs resume: every finished configuration lands at once in ``results.partial.json`` (Note
[Partial results] in ``attnlab.harness.store``); ``resume`` keeps the configurations an earlier run with
the same settings measured. Files (atomically): results.json, report.md, report.html, planner.png
(auto / fastest per configuration).

``run(PlannerConfig(...)) -> PlannerResult``: no printing, no argv (the CLI is ``attnlab bench planner``).

Legend: B batch, H query heads, Hkv key/value heads (GQA when < H), L query length, S key length,
D head dim, n the sequence length (L = S = n, except decode: L = 1, S = n).
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

import attnlab
from attnlab import patterns as P

from ..harness import ResultStore, pyplot, save_plot, threads
from ..timing import interleaved, paired_ratio
from ..report import environment
from ..resources import check_memory

__all__ = ["Case", "PlannerConfig", "PlannerResult", "METHODS", "KINDS", "HEADS", "TOLERANCE", "full_cases",
           "quick_cases", "run", "ratios", "summarize", "replay", "FORMAT"]

#: results.json's row format: 2 = auto timed paired with its pick (``auto_over_pick``; format 1, before it, had
#: auto's separate median only). A row of another format is measured again, never resumed.
FORMAT = 2
#: the kernels auto is compared with (each where it accepts the inputs)
METHODS = ("sdpa", "compiled", "decode", "tiled", "sparse")
KINDS = ("dense", "causal", "window", "block_sparse", "document", "decode")
#: name -> (B, H, Hkv, D)
HEADS = {"mha": (1, 8, 8, 64), "gqa": (2, 8, 2, 64), "decode": (1, 32, 8, 128), "decode-b4": (4, 32, 8, 128),
         "decode-mha": (1, 8, 8, 64), "tiny": (1, 2, 2, 16), "tiny-gqa": (2, 4, 2, 16)}
#: auto is "within" when its time is at most this much over the fastest's
TOLERANCE = 1.05
#: the issue's floor: auto never slower than 1 / WORST_TARGET of the fastest's speed (0.8x)
WORST_TARGET = 1.25
WINDOW = 256
SPARSE_BLOCK = 128
SPARSE_DENSITY = 0.15
#: Note [Kernels too slow to time]: a capable kernel is not timed (kept in the table as "skipped", with why)
#: when the planner predicts it does at least SKIP_WORK times the FLOPs of the kernel doing least and at
#: least SKIP_FLOPS in all (SDPA on a 32768-token window: the whole n x n mask, 128x the work, a minute a
#: call in bf16 on 2 cores), or when its first call took SKIP_TIME times the quickest first call and at
#: least SKIP_SECONDS (the tiled kernel on 16384-token documents: 9 s a call, 18x the compiled kernel's).
#: Either way it cannot be the fastest (rounds on the shared 2-core machine spread by about ±50 %, not 4x),
#: and timing it would take most of the sweep.
SKIP_WORK, SKIP_FLOPS = 8.0, 2e11
SKIP_TIME, SKIP_SECONDS = 4.0, 1.0


@dataclass(frozen=True)
class Case:
    """One configuration: ``kind`` of mask, dtype name, n, and a ``heads`` name of ``HEADS``."""

    kind: str
    dtype: str
    n: int
    heads: str

    @property
    def label(self) -> str:
        """e.g. "causal bf16 n=4096 gqa(B=2,H=8,Hkv=2,D=64)"."""
        B, H, Hkv, D = HEADS[self.heads]
        dt = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(self.dtype, self.dtype)
        return f"{self.kind} {dt} n={self.n} {self.heads}(B={B},H={H},Hkv={Hkv},D={D})"


def full_cases() -> list[Case]:
    """The full sweep: 66 configurations, n = 512 … 32768 (dense work only up to 4096, where one call of the
    slowest kernel takes seconds on 2 cores)."""
    cases = []
    dts = ("float32", "bfloat16")
    for kind in ("dense", "causal"):
        for n in (512, 1024, 2048, 4096):
            for h in (("mha", "gqa") if n <= 2048 else ("mha",)):
                cases += [Case(kind, d, n, h) for d in dts]
    for n, h in ((1024, "mha"), (2048, "mha"), (8192, "mha"), (8192, "gqa"), (32768, "mha")):
        cases += [Case("window", d, n, h) for d in dts]
    for n, h in ((2048, "mha"), (4096, "gqa"), (8192, "mha")):
        cases += [Case("block_sparse", d, n, h) for d in dts]
    for n, h in ((4096, "mha"), (8192, "gqa"), (16384, "mha"), (32768, "mha")):
        cases += [Case("document", d, n, h) for d in dts]
    # decode-mha on both sides of the plain MHA decode crossover (Note [Plain MHA decode] in kernels.planner)
    for n, h in ((1024, "decode"), (8192, "decode"), (32768, "decode"), (8192, "decode-b4"), (1024, "decode-mha"),
                 (4096, "decode-mha"), (16384, "decode-mha")):
        cases += [Case("decode", d, n, h) for d in dts]
    return cases


def quick_cases() -> list[Case]:
    """Tiny sizes, one configuration of every kind (seconds; for tests and a first look)."""
    return [Case("dense", "float32", 96, "tiny"), Case("dense", "bfloat16", 64, "tiny-gqa"),
            Case("causal", "float32", 80, "tiny-gqa"), Case("window", "float32", 160, "tiny"),
            Case("block_sparse", "float32", 128, "tiny"), Case("document", "bfloat16", 144, "tiny"),
            Case("decode", "float32", 200, "tiny-gqa")]


@dataclass
class PlannerConfig:
    """What ``bench planner`` measures. ``kinds`` / ``dtypes`` / ``max_n`` filter the grid (``quick``: the
    tiny one); ``rounds`` interleaved rounds per configuration (median), each sample at least
    ``min_sample_s`` long; ``budget_s`` per configuration; ``threads``: torch's thread count (None:
    unchanged); ``resume``: keep what an earlier run with the same settings left in ``out``."""

    out: str = "reports/bench-planner"
    quick: bool = False
    kinds: tuple[str, ...] = KINDS
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    max_n: int = 32768
    rounds: int = 5
    min_sample_s: float = 0.05
    budget_s: float = 60.0
    threads: int | None = None
    resume: bool = False

    def validate(self) -> None:
        """ValueError naming the option for a setting that cannot be measured."""
        bad = [k for k in self.kinds if k not in KINDS]
        if bad:
            raise ValueError(f"--kinds: {', '.join(map(repr, bad))} not among {', '.join(KINDS)}")
        bad = [d for d in self.dtypes if d not in ("float32", "bfloat16", "float16")]
        if bad:
            raise ValueError(f"--dtypes: {', '.join(map(repr, bad))} not among float32, bfloat16, float16")
        if self.rounds < 1 or self.max_n < 1 or self.budget_s <= 0 or self.min_sample_s < 0:
            raise ValueError(f"--rounds and --max-n must be >= 1 and the budgets > 0, got rounds={self.rounds}, "
                             f"max_n={self.max_n}, budget_s={self.budget_s}, min_sample_s={self.min_sample_s}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")
        if not self.cases():
            raise ValueError("--kinds / --dtypes / --max-n leave no configuration to measure")

    def cases(self) -> list[Case]:
        """The configurations this run measures, in order."""
        grid = quick_cases() if self.quick else full_cases()
        return [c for c in grid if c.kind in self.kinds and c.dtype in self.dtypes and c.n <= self.max_n]

    def settings(self) -> dict:
        """What a resumed configuration's record must have been measured with."""
        return {"format": FORMAT, "rounds": self.rounds, "min_sample_s": self.min_sample_s, "budget_s": self.budget_s,
                "threads": torch.get_num_threads(), "onednn_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
                "torch_isa": os.environ.get("ATEN_CPU_CAPABILITY", ""),
                "calibration": os.environ.get("ATTNLAB_CALIBRATION", "")}


@dataclass
class PlannerResult:
    """One ``bench planner`` run: a row per configuration (see the module docstring), the summary, notes
    (resumed rows, load averages: the machine may be shared), the environment and the files written."""

    out_dir: str
    rows: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    env: dict = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    seconds: float = 0.0
    exit_code: int = 0


# -- inputs -----------------------------------------------------------------------------------------------
def _doc_lengths(n: int, gen: torch.Generator) -> list[int]:
    """Seeded document lengths of 128 … 1024 tokens adding up to n (the last one takes the rest)."""
    out, left = [], n
    while left > 0:
        d = min(left, int(torch.randint(128, 1025, (1,), generator=gen)))
        out.append(d)
        left -= d
    return out


def _inputs(case: Case, seed: int = 0) -> tuple[tuple, dict]:
    """(q, k, v) and the keyword arguments of ``attnlab.attention`` for ``case``."""
    B, H, Hkv, D = HEADS[case.heads]
    dt = getattr(torch, case.dtype)
    gen = torch.Generator().manual_seed(seed)
    L = 1 if case.kind == "decode" else case.n
    q = torch.randn(B, H, L, D, generator=gen).to(dt)
    k = torch.randn(B, Hkv, case.n, D, generator=gen).to(dt)
    v = torch.randn(B, Hkv, case.n, D, generator=gen).to(dt)
    kw: dict = {"enable_gqa": Hkv != H}
    if case.kind == "causal":
        kw["is_causal"] = True
    elif case.kind == "window":
        kw["pattern"] = P.sliding_window(min(WINDOW, case.n // 4), causal=True)
    elif case.kind == "block_sparse":
        bs = SPARSE_BLOCK if case.n >= 4 * SPARSE_BLOCK else 32
        nb = -(-case.n // bs)
        layout = torch.rand(nb, nb, generator=gen) < SPARSE_DENSITY
        layout |= torch.eye(nb, dtype=torch.bool)  # every query block keeps a key block
        kw["pattern"] = P.block_sparse(layout, bs)
    elif case.kind == "document":
        kw["pattern"] = P.document(_doc_lengths(case.n, gen), causal=True)
    return (q, k, v), kw


# -- one configuration ---------------------------------------------------------------------------------------
def _measure(case: Case, cfg: PlannerConfig) -> dict:
    (q, k, v), kw = _inputs(case)
    B, H, Hkv, D = HEADS[case.heads]
    row = {"config": case.label, **asdict(case), "B": B, "H": H, "Hkv": Hkv, "D": D,
           "L": q.shape[-2], "S": k.shape[-2], "refused": {}, "skipped": {}, "ms": {}, "samples_ms": {}}
    calls: dict[str, Callable[[], object]] = {}
    with torch.no_grad():
        plan = attnlab.explain(q, k, v, **kw)
        row["auto_pick"], row["auto_reason"] = plan.method, plan.reason
        row["decode_path"], row["rates_source"] = plan.decode, plan.rates_source
        row["density"] = plan.density
        for m in METHODS:
            try:
                attnlab.explain(q, k, v, method=m, **kw)
            except ValueError as e:  # the kernel refuses these inputs: kept in the table
                row["refused"][m] = str(e)
                continue
            calls[m] = lambda m=m: attnlab.attention(q, k, v, method=m, **kw)
        _skip_slow(calls, plan.flops, row["skipped"], keep=plan.method)
        calls["auto"] = lambda: attnlab.attention(q, k, v, **kw)
        pairs = {"auto": plan.method} if plan.method in calls else {}
        load_before = os.getloadavg()[0]
        t = interleaved(calls, rounds=cfg.rounds, min_rounds=min(3, cfg.rounds), min_sample_s=cfg.min_sample_s,
                        budget_s=cfg.budget_s, pairs=pairs)
    for name, tm in t.items():
        row["ms"][name] = tm.median * 1e3
        row["samples_ms"][name] = [s * 1e3 for s in tm.times]
    row["load_avg"] = [load_before, os.getloadavg()[0]]
    row["auto_over_pick"] = paired_ratio(t["auto"], t[plan.method]) if pairs else None
    row.update(ratios(row))
    # the spread of the rounds: how far one median can be trusted on a shared machine
    row["spread"] = {name: (max(s) - min(s)) / statistics.median(s) if len(s) > 1 else 0.0
                     for name, s in row["samples_ms"].items()}
    return row


def ratios(row: dict) -> dict:
    """A row's ``fastest``, ``pick_ratio``, ``raw_ratio`` and ``ratio`` from its medians ``ms`` and its paired
    ``auto_over_pick`` (the module docstring: ratio = auto_over_pick × pick_ratio, raw_ratio without it)."""
    measured = {m: row["ms"][m] for m in METHODS if m in row["ms"]}
    fastest = min(measured, key=measured.get)
    best = measured[fastest]
    pick = measured[row["auto_pick"]] / best if row["auto_pick"] in measured else None
    raw = row["ms"]["auto"] / best
    paired = row.get("auto_over_pick")
    return {"fastest": fastest, "pick_ratio": pick, "raw_ratio": raw,
            "ratio": paired * pick if paired is not None and pick is not None else raw}


def _skip_slow(calls: dict, flops: dict, skipped: dict, keep: str) -> None:
    """Drop from ``calls`` the kernels Note [Kernels too slow to time] leaves untimed, recording why in
    ``skipped``; auto's pick ``keep`` is always timed (a slow pick is what the sweep is for)."""
    least = min(flops[m] for m in calls)
    for m in list(calls):
        if m != keep and flops[m] >= SKIP_WORK * least and flops[m] >= SKIP_FLOPS:
            skipped[m] = f"predicted {flops[m] / least:.0f}x the FLOPs of the least ({flops[m] / 1e9:.0f} GFLOP): not timed"
            del calls[m]
    first = {}
    for m, f in calls.items():
        t = time.perf_counter()
        f()
        first[m] = time.perf_counter() - t
    quickest = min(first.values())
    for m, t in first.items():
        if m != keep and t >= SKIP_TIME * quickest and t >= SKIP_SECONDS:
            skipped[m] = f"one call took {t:.1f} s, {t / quickest:.0f}x the quickest kernel's: not timed further"
            del calls[m]


def summarize(rows: list[dict]) -> dict:
    """The sweep's summary: configurations, the fraction with auto within ``TOLERANCE`` of the fastest (by
    ``ratio``: paired auto / pick × pick / fastest; by ``raw_ratio``, auto's separate median; by its pick's
    time alone), the worst of each and the worst ratio's configuration, auto's cost over its pick (paired:
    median and worst), and whether the issue's targets hold."""
    if not rows:
        return {"configs": 0}
    worst = max(rows, key=lambda r: r["ratio"])
    picks = [r["pick_ratio"] for r in rows if r["pick_ratio"] is not None]
    over = [r["auto_over_pick"] for r in rows if r.get("auto_over_pick") is not None]
    within = sum(r["ratio"] <= TOLERANCE for r in rows) / len(rows)
    return {"configs": len(rows), "within_5pct": within,
            "raw_within_5pct": sum(r["raw_ratio"] <= TOLERANCE for r in rows) / len(rows),
            "pick_within_5pct": sum(p <= TOLERANCE for p in picks) / max(1, len(picks)),
            "worst_ratio": worst["ratio"], "worst_config": worst["config"],
            "worst_raw_ratio": max(r["raw_ratio"] for r in rows),
            "worst_pick_ratio": max(picks, default=None),
            "paired_configs": len(over),
            "median_auto_over_pick": statistics.median(over) if over else None,
            "worst_auto_over_pick": max(over, default=None),
            "auto_is_fastest": sum(r["auto_pick"] == r["fastest"] for r in rows) / len(rows),
            "median_spread": statistics.median(s for r in rows for s in r["spread"].values()),
            "targets_met": within >= 0.95 and worst["ratio"] <= WORST_TARGET}


def replay(rows: list[dict], rates) -> dict:
    """An offline oracle for a calibration: what ``rates`` (an ``attnlab.kernels.rates.Rates``) would pick
    for each recorded row of an earlier sweep, scored against that sweep's measured times.

    Only the plain dense/causal rows are decided again (by ``Rates.compiled_dense_wins``, the planner's
    size-threshold rule, between SDPA and the compiled kernel); every other row keeps its recorded pick.
    Returns {"configs", "pick_within_5pct", "misses": [(config, pick, pick / fastest)]}."""
    misses, n_within, n = [], 0, 0
    for r in rows:
        pick = r["auto_pick"]
        if r["kind"] in ("dense", "causal") and "compiled" in r["ms"] and "sdpa" in r["ms"]:
            B, H, L, S = r["B"], r["H"], r["L"], r["S"]
            wins = rates.compiled_dense_wins(getattr(torch, r["dtype"]), B * H * L * S, r["kind"] == "causal",
                                             r["Hkv"] != H)
            pick = "compiled" if wins else "sdpa"
        measured = {m: r["ms"][m] for m in METHODS if m in r["ms"]}
        if pick not in measured:
            continue
        n += 1
        ratio = measured[pick] / min(measured.values())
        if ratio <= TOLERANCE:
            n_within += 1
        else:
            misses.append((r["config"], pick, round(ratio, 3)))
    return {"configs": n, "pick_within_5pct": n_within / max(1, n), "misses": misses}


# -- the run ---------------------------------------------------------------------------------------------------
def run(config: PlannerConfig | None = None, progress: Callable[[int, int, str], None] | None = None) -> PlannerResult:
    """Measure every configuration of ``config`` and write the report into ``config.out``; returns it.

    ``progress(done, total, label)`` before each configuration and once at the end. Raises ValueError for
    a config that cannot be measured, or whose largest inputs would not fit in memory, before measuring."""
    cfg = config or PlannerConfig()
    cfg.validate()
    big = max(cfg.cases(), key=lambda c: c.n * HEADS[c.heads][0] * HEADS[c.heads][1] * HEADS[c.heads][3])
    B, H, _, D = HEADS[big.heads]
    # q, k, v, the output and the kernels' float32 copies and scratch, at the largest configuration
    check_memory(f"--max-n {big.n}", 8 * 4 * B * H * big.n * D, f"the inputs and outputs of {big.label}")
    with threads(cfg.threads):
        return _run(cfg, progress)


def _run(cfg: PlannerConfig, progress) -> PlannerResult:
    t0 = time.perf_counter()
    cases = cfg.cases()
    res = PlannerResult(str(cfg.out), env=environment())
    settings = cfg.settings()
    store = ResultStore(cfg.out, sections=("rows",), context=settings, resume=cfg.resume)
    kept = 0
    for i, case in enumerate(cases):
        job = asdict(case)
        rec = store.lookup(job)
        if rec is not None:
            kept += 1
            store.add(rec, job=job)
            continue
        if progress:
            progress(i, len(cases), case.label)
        store.add(_measure(case, cfg), job=job)
    res.rows = store.state["rows"]  # each with its settings_key: a finished run's results.json resumes too
    if kept:
        res.notes.append(f"--resume: kept {kept} configuration(s) measured by an earlier run ({store.source})")
    loads = [x for r in res.rows for x in r["load_avg"]]
    res.notes.append(f"1-minute load average {min(loads):.1f} … {max(loads):.1f} on {os.cpu_count()} CPUs "
                     "during the run: a shared machine; every figure is a median of interleaved rounds "
                     "(spread = (max - min) / median of a kernel's rounds)")
    res.summary = summarize(res.rows)
    res.seconds = time.perf_counter() - t0
    results = {"suite": "planner", "settings": settings, "summary": res.summary, "rows": res.rows,
               "notes": res.notes, "env": res.env, "seconds": res.seconds,
               "note": ("ms: medians of interleaved rounds, forward under no_grad (auto timed beside its pick, "
                        "order flipped each round); pick_ratio = auto's pick's ms / fastest ms; auto_over_pick = "
                        "median over rounds of auto / pick in the same round; ratio = auto_over_pick x pick_ratio; "
                        "raw_ratio = auto ms / fastest ms")}
    paths = store.finish(results, report_markdown(res), "attnlab bench planner")
    fig = _figure(res)
    save_plot(fig, cfg.out + "/planner.png")
    res.files = [paths["results"], paths["report"], paths["html"], str(cfg.out) + "/planner.png"]
    if progress:
        progress(len(cases), len(cases), "done")
    return res


def _fmt_ms(row: dict, m: str) -> str:
    if m in row["refused"]:
        return "refused"
    if m in row.get("skipped", {}):
        return "skipped"
    return f"{row['ms'][m]:.3g}"


def report_markdown(res: PlannerResult) -> str:
    """report.md: the summary, then one row per configuration (each kernel's ms, fastest, auto's pick, ratios)."""
    s = res.summary
    lines = ["# attnlab bench planner: auto against the fastest kernel", ""]
    if s.get("configs"):
        over = ("" if s.get("median_auto_over_pick") is None else
                f"- auto / its pick, paired in each round ({s['paired_configs']} configurations): median "
                f"{s['median_auto_over_pick']:.3f}, worst {s['worst_auto_over_pick']:.3f}")
        lines += [f"- configurations: {s['configs']}",
                  f"- auto within {TOLERANCE - 1:.0%} of the fastest (auto / pick paired × pick / fastest): "
                  f"{s['within_5pct']:.1%}; target >= 95 %",
                  f"  - by its pick's time alone: {s['pick_within_5pct']:.1%}; by auto's separate median: "
                  f"{s['raw_within_5pct']:.1%}",
                  f"- worst auto / fastest: {s['worst_ratio']:.2f} ({s['worst_config']}); target <= {WORST_TARGET} "
                  f"(by the separate medians {s['worst_raw_ratio']:.2f})",
                  *([over] if over else []),
                  f"- auto picks the fastest kernel in {s['auto_is_fastest']:.1%}",
                  f"- median spread of a kernel's rounds: {s['median_spread']:.1%}", ""]
    lines += [f"- {n}" for n in res.notes] + [""]
    lines += ["![auto / fastest per configuration](planner.png)", ""]  # written beside report.md by run()
    cols = ["config", *METHODS, "auto", "fastest", "auto's pick", "auto/fastest", "pick/fastest", "auto/pick paired",
            "auto/fastest raw"]
    lines += ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in res.rows:
        pick = r["auto_pick"] + (" (decode)" if r["decode_path"] else "")
        pr = "" if r["pick_ratio"] is None else f"{r['pick_ratio']:.2f}"
        op = "" if r.get("auto_over_pick") is None else f"{r['auto_over_pick']:.3f}"
        flag = "" if r["ratio"] <= TOLERANCE else " ⚠"
        lines.append("| " + " | ".join([r["config"], *(_fmt_ms(r, m) for m in METHODS), f"{r['ms']['auto']:.3g}",
                                        r["fastest"], pick, f"{r['ratio']:.2f}{flag}", pr, op,
                                        f"{r['raw_ratio']:.2f}"]) + " |")
    lines += ["", "Times in ms (medians). auto/fastest = auto/pick paired × pick/fastest; auto/pick paired: the median "
              "over rounds of auto's time / its pick's in the same round (timed back to back, order flipped each "
              "round); auto/fastest raw: auto's median / the fastest's. refused: the kernel does not accept these "
              "inputs; skipped: predicted or "
              "measured far slower than the fastest, not timed (the reasons for both are in results.json)."]
    return "\n".join(lines) + "\n"


def _figure(res: PlannerResult):
    fig, ax = pyplot().subplots(figsize=(max(6, 0.14 * len(res.rows)), 3.5))
    xs = range(len(res.rows))
    colors = {k: f"C{i}" for i, k in enumerate(KINDS)}
    ax.bar(list(xs), [r["ratio"] for r in res.rows], color=[colors[r["kind"]] for r in res.rows])
    ax.axhline(TOLERANCE, color="gray", lw=0.8, ls="--", label=f"{TOLERANCE:g}")
    ax.axhline(WORST_TARGET, color="red", lw=0.8, ls=":", label=f"{WORST_TARGET:g} (0.8x)")
    for k, c in colors.items():
        if any(r["kind"] == k for r in res.rows):
            ax.bar([0], [0], color=c, label=k)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([r["config"].split(" (")[0] for r in res.rows], rotation=90, fontsize=4)
    ax.set_ylabel("auto / fastest (time)")
    ax.set_ylim(bottom=min([0.8] + [0.95 * r["ratio"] for r in res.rows]))  # noise puts some under 1
    ax.legend(fontsize=5, ncol=4)
    fig.tight_layout()
    return fig
