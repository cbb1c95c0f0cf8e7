"""The explorer page: one HTML document, inline CSS and JS, no network beyond its own JSON API.

Everything that came from a user or a model (tokens, error messages, pattern text) is written with
``textContent`` or as an attribute value, never with ``innerHTML``. Each weight cell carries its exact
value in ``data-w``; ``body[data-seq]`` counts finished updates, ``body[data-busy]`` is "1" while a
request is in flight and ``window.shownSettings`` holds the settings the drawn weights were computed
with (tests wait on them).
"""
from __future__ import annotations

__all__ = ["PAGE"]

PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>attnlab explorer</title>
<link rel="icon" href="data:,">
<style>
:root{--fg:#1d1d1f;--mut:#666;--line:#ddd;--err:#b00020;--warn:#8a5300}
*{box-sizing:border-box}
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:0;color:var(--fg);background:#fff}
header{padding:10px 20px;border-bottom:1px solid var(--line);display:flex;gap:12px;align-items:baseline;flex-wrap:wrap}
header h1{font-size:18px;margin:0}#model{color:var(--mut);font-size:13px}
#banner{background:#fff3cd;color:var(--warn);padding:8px 20px;font-size:14px}
main{padding:10px 20px}
.row{display:flex;flex-wrap:wrap;gap:10px 16px;align-items:center;margin:6px 0;font-size:13px}
.row label{display:inline-flex;gap:5px;align-items:center}
#text{width:min(900px,90vw);font-size:15px;padding:6px 8px;border:1px solid #bbb;border-radius:6px}
input[type=text]{padding:3px 6px;border:1px solid #bbb;border-radius:4px}
select,button{font-size:13px}
#params{width:190px}#pattern{width:190px}
output{font-variant-numeric:tabular-nums;min-width:2.5em;display:inline-block}
#status{min-height:20px;font-size:13px;color:var(--mut);margin:4px 0}
#status.error{color:var(--err);font-weight:600}
#notes{font-size:12px;color:var(--warn)}
table.stats{border-collapse:collapse;font-size:13px;margin:6px 0}
table.stats td,table.stats th{padding:3px 10px;border-bottom:1px solid var(--line);text-align:right;
font-variant-numeric:tabular-nums}table.stats th:first-child,table.stats td:first-child{text-align:left}
.views{display:flex;flex-wrap:wrap;gap:24px;align-items:flex-start}
.views h2{font-size:14px;margin:8px 0 4px;font-weight:600}
.mat{display:grid;gap:1px;align-items:center;justify-content:start;font-family:ui-monospace,monospace;font-size:11px}
.mat .lab{white-space:pre;overflow:hidden;text-overflow:ellipsis;color:#333}
.mat .rl{text-align:right;padding-right:4px;max-width:110px;justify-self:end}
.mat .cl{writing-mode:vertical-rl;transform:rotate(180deg);max-height:90px;text-align:left;justify-self:center}
.mat .cell{border-radius:1px;font-size:9px;line-height:1;display:flex;align-items:center;justify-content:center;
overflow:hidden;white-space:nowrap;font-variant-numeric:tabular-nums}
.mat.stale{opacity:.35;filter:grayscale(1)}
.stale-mark{display:none;color:var(--err);font-size:12px;font-weight:600;margin:2px 0}
body[data-stale="1"] .stale-mark{display:block}
.chip-legend{font-size:11px;color:var(--mut);display:inline-flex;align-items:center;gap:4px}
.chip-legend i{display:inline-block;width:90px;height:10px;border:1px solid var(--line);
background:linear-gradient(to right,rgb(253,231,37),rgb(94,201,98),rgb(33,145,140),rgb(59,82,139),rgb(68,1,84))}
.mat .cell.hi{outline:2px solid #000;outline-offset:-1px}
#readout{font-size:13px;min-height:20px;margin-top:6px;font-family:ui-monospace,monospace;white-space:pre}
.legend{font-size:11px;color:var(--mut);margin-top:4px}
details{margin-top:16px;border-top:1px solid var(--line);padding-top:8px}
summary{cursor:pointer;font-weight:600}
#step-title{font-weight:600;margin:8px 0 2px}
#step-formula{display:inline-block;background:#f4f4f6;padding:4px 8px;border-radius:4px;font-size:14px;margin:4px 0}
#step-note,#step-shape{font-size:12px;color:var(--mut)}
.steps{display:flex;flex-wrap:wrap;gap:4px;margin:6px 0}
.steps button{border:1px solid var(--line);background:#fafafa;border-radius:12px;padding:2px 10px;cursor:pointer}
.steps button.on{background:#1d1d1f;color:#fff}
.steps button small{display:block;font-size:10px;font-family:ui-monospace,monospace;opacity:.8;max-width:220px;overflow:hidden;
text-overflow:ellipsis;white-space:nowrap}
#step-head{display:flex;flex-wrap:wrap;gap:4px 12px;align-items:baseline}
#step-matrix{overflow:auto;max-height:70vh;max-width:100%}
.heads{display:inline-flex;gap:3px;flex-wrap:wrap}
.heads button{border:1px solid var(--line);border-radius:4px;padding:2px 6px;font-size:12px;cursor:pointer;min-width:34px}
.heads button.on{outline:2px solid #000}
</style></head>
<body data-seq="0" data-busy="0">
<header><h1>attnlab explorer</h1><span id="model">loading…</span></header>
<div id="banner" hidden></div>
<main>
<div class="row"><input id="text" type="text" aria-label="sentence" autocomplete="off" spellcheck="false"
 value="The cat sat on the mat because it was tired."><span id="ntok"></span></div>
<div class="row">
 <label>layer <select id="layer"></select></label>
 <label>head <select id="head"></select></label>
 <label>scale <select id="scale"><option value="sqrt">÷√d_k (standard)</option><option value="none">÷1 (scaling off)</option>
  <option value="dk">÷d_k</option></select></label>
 <label title="log scale: each step multiplies τ by the same factor; the API takes 0.05 … 20">temperature τ
  <input id="temperature" type="range" min="-130" max="130" step="1" value="0"
  aria-label="temperature (log scale)"><output id="temperature-value">1.00</output></label>
 <label><input id="softmax" type="checkbox" checked> softmax</label>
 <label>similarity <select id="similarity"><option value="dot">dot product</option><option value="cosine">cosine</option></select></label>
</div>
<div class="row">
 <label>mechanism <select id="mechanism"><option value="">exact (the model's own)</option></select></label>
 <label>params <input id="params" type="text" placeholder='e.g. {"num_features": 64}' autocomplete="off"></label>
 <label>pattern <input id="pattern" type="text" list="pattern-examples" placeholder="e.g. sliding_window(3)" autocomplete="off"></label>
 <datalist id="pattern-examples"><option value="sliding_window(3)"><option value="causal()"><option value="dilated(4, 2)">
  <option value="strided(4)"><option value="longformer(3, 1)"><option value="sliding_window(2) | causal()"></datalist>
 <label title="remove the chosen head's output (its weights stay) and see the embedding move">ablate head
  <select id="ablate"><option value="">no</option><option value="zero">zero</option><option value="mean">mean</option></select></label>
 <label>apply to <select id="scope"><option value="all">every layer</option><option value="layer">this layer only</option></select></label>
 <button id="reset" type="button">reset</button>
</div>
<div id="status" role="status"></div>
<table class="stats"><thead><tr><th>measure</th><th>unmodified</th><th>now</th></tr></thead><tbody>
 <tr><td title="mean over query rows of −Σ w log w">entropy (nats, mean over rows)</td><td id="ent-base"></td><td id="ent-now"></td></tr>
 <tr><td>max weight (mean over rows)</td><td id="max-base"></td><td id="max-now"></td></tr>
 <tr><td title="cosine similarity of the sentence embedding to the unmodified model's">output: embedding cosine to unmodified</td>
  <td>1</td><td id="cos-now"></td></tr>
</tbody></table>
<div id="notes"></div>
<div class="row"><span title="every head of this layer under the experiment; darker = sharper (lower entropy or higher max weight)">heads of this layer:</span>
 <span id="heads" class="heads"></span>
 <span class="chip-legend" id="chip-legend">chip colour: <span>diffuse</span><i></i><span>sharp</span>
  (1 − entropy / log T; without softmax, the mean max weight) · outlined = the head shown · click one to show it</span></div>
<div class="stale-mark" id="stale-mark" role="alert"></div>
<div class="views">
 <div><h2 id="now-title">weights</h2><div id="matrix" class="mat"></div><div class="legend" id="legend"></div><div id="readout"></div></div>
 <div><h2>unmodified model</h2><div id="baseline" class="mat"></div></div>
</div>
<details id="trace-box"><summary>Trace: X → Q, K, V → scores → scaled → mask → softmax → output, step by step</summary>
 <div class="row"><button id="prev" type="button">◀ prev</button><button id="next" type="button">next ▶</button>
  <label title="write each cell's value in it (off: colour only)"><input id="numbers" type="checkbox" checked> numbers in the cells</label>
  <span id="trace-status"></span></div>
 <div class="steps" id="steps"></div>
 <div id="step-head"><div id="step-title"></div><code id="step-formula"></code> <span id="step-shape"></span></div>
 <div id="step-note"></div><div id="step-matrix" class="mat"></div>
</details>
</main>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
const INFO = {};
let seq = 0, traceSeq = 0, timer = null, trace = null, stepIndex = 0, hover = null;

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}
function fmt(x, d) { return (x === null || x === undefined) ? "—" : Number(x).toFixed(d === undefined ? 3 : d); }

// viridis, 5 stops: sequential colour for non-negative values
const VIR = [[68,1,84],[59,82,139],[33,145,140],[94,201,98],[253,231,37]];
function seqColour(t) {
  t = Math.max(0, Math.min(1, t)); const x = t * 4, i = Math.min(3, Math.floor(x)), f = x - i;
  const a = VIR[i], b = VIR[i + 1];
  return "rgb(" + a.map((c, k) => Math.round(c + (b[k] - c) * f)).join(",") + ")";
}
// blue - white - red for signed values
function divColour(t) {
  t = Math.max(-1, Math.min(1, t));
  const w = Math.round(255 * (1 - Math.abs(t)));
  return t >= 0 ? "rgb(255," + w + "," + w + ")" : "rgb(" + w + "," + w + ",255)";
}
function colourer(rows) {
  let lo = Infinity, hi = -Infinity;
  for (const r of rows) for (const v of r) if (v !== null && isFinite(v)) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
  if (!isFinite(lo)) { lo = 0; hi = 1; }
  if (lo < 0) { const m = Math.max(Math.abs(lo), Math.abs(hi)) || 1;
    return {f: (v) => v === null ? "#ccc" : divColour(v / m), text: "blue −" + m.toPrecision(3) + " · white 0 · red +" + m.toPrecision(3)}; }
  const m = hi || 1;
  return {f: (v) => v === null ? "#ccc" : seqColour(v / m), text: "dark 0 → yellow " + m.toPrecision(3)};
}

// a cell's value as text: 3 significant digits, exponent form when very large or small, −∞ for masked
function cellText(v) {
  if (v === null) return "\u2212\u221e";
  const a = Math.abs(v);
  if (a !== 0 && (a >= 1000 || a < 0.001)) return v.toExponential(1);
  return String(Number(v.toPrecision(3)));
}
// black or white text, whichever reads on an "rgb(r,g,b)" background
function inkOn(rgb) {
  const m = rgb.match(/\d+/g); if (!m) return "#000";
  const l = m.slice(0, 3).map((x) => { x = x / 255; return x <= 0.03928 ? x / 12.92 : Math.pow((x + 0.055) / 1.055, 2.4); });
  const L = 0.2126 * l[0] + 0.7152 * l[1] + 0.0722 * l[2];
  return (L + 0.05) / 0.05 >= 1.05 / (L + 0.05) ? "#000" : "#fff";
}
// a heat-coloured matrix with row/column labels; cells carry data-i, data-j, data-w (opts.numbers: the value
// written in each cell, which then is 44 × 18 px)
function drawMatrix(box, rows, rowLabels, colLabels, opts) {
  opts = opts || {};
  box.replaceChildren();
  const R = rows.length, Cn = R ? rows[0].length : 0;
  const size = opts.size || Math.max(4, Math.min(26, Math.floor(520 / Math.max(R, Cn, 1))));
  const labels = opts.numbers || size >= 9, cw = opts.numbers ? 44 : size, chh = opts.numbers ? 18 : size;
  box.style.gridTemplateColumns = (labels ? "auto " : "") + "repeat(" + Cn + ", " + cw + "px)";
  const col = colourer(rows);
  if (labels && colLabels) {
    box.appendChild(el("div"));
    for (let j = 0; j < Cn; j++) box.appendChild(el("div", "lab cl", colLabels[j] === undefined ? "" : colLabels[j]));
  }
  for (let i = 0; i < R; i++) {
    if (labels) box.appendChild(el("div", "lab rl", rowLabels && rowLabels[i] !== undefined ? rowLabels[i] : ""));
    for (let j = 0; j < Cn; j++) {
      const v = rows[i][j], c = el("div", "cell");
      c.style.width = cw + "px"; c.style.height = chh + "px";
      c.style.background = col.f(v);
      if (opts.numbers) { c.textContent = cellText(v); c.style.color = inkOn(c.style.background); }
      c.dataset.i = i; c.dataset.j = j; c.dataset.w = v === null ? "-inf" : String(v);
      box.appendChild(c);
    }
  }
  return col.text;
}

// the temperature slider is log-scale over the API's range 0.05 … 20: position k in -130 … 130 is
// τ = 20^(k/130) (0.05 = 1/20), kept to 3 significant digits; 1 in the middle
function tau() { return Number(Math.pow(20, Number($("temperature").value) / 130).toPrecision(3)); }
function showTau() { $("temperature-value").textContent = tau().toPrecision(3); }
function settings() {
  let params = null;
  const p = $("params").value.trim();
  if (p) { try { params = JSON.parse(p); } catch (e) { throw new Error("params: not valid JSON (" + e.message + ")"); } }
  return {
    text: $("text").value, layer: Number($("layer").value), head: Number($("head").value),
    scale: $("scale").value, temperature: tau(), softmax: $("softmax").checked,
    similarity: $("similarity").value, mechanism: $("mechanism").value || null, params: params,
    pattern: $("pattern").value.trim() || null, scope: $("scope").value, ablate: $("ablate").value || null,
  };
}

function setStatus(msg, error) { const s = $("status"); s.textContent = msg; s.className = error ? "error" : ""; }

async function post(url, body) {
  const r = await fetch(url, {method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body)});
  let data = null;
  try { data = await r.json(); } catch (e) { data = {error: "the server answered " + r.status + " without JSON"}; }
  if (!r.ok) throw new Error(data && data.error ? data.error : "HTTP " + r.status);
  return data;
}

function schedule() { clearTimeout(timer); timer = setTimeout(update, 120); }

async function update() {
  const my = ++seq;
  document.body.dataset.busy = "1";
  let body;
  try { body = settings(); } catch (e) { markStale(e.message); return finish(my, e.message, true); }
  // an emptied box (the moment before typing) is not a request: the server would only refuse it
  if (!body.text.trim()) { markStale("the box is empty: type a sentence to see its attention"); return finish(my, "type a sentence to see its attention", false); }
  setStatus("computing…");
  try {
    const r = await post("/api/attention", body);
    if (my !== seq) return;
    render(r);
    markStale(null);
    window.shownSettings = r.settings;  // what the drawn weights were computed with
    finish(my, r.tokens.length + " tokens · layer " + r.layer + ", head " + r.head, false);
    if ($("trace-box").open) loadTrace();
  } catch (e) {
    if (my !== seq) return;
    markStale("this request failed: " + e.message);
    finish(my, e.message, true);
  }
}
// after a failed (or empty) request the heatmaps still show the last settings that worked: grey them and say so
function markStale(why) {
  const drawn = $("matrix").childElementCount > 0;
  const on = why !== null && drawn;
  for (const id of ["matrix", "baseline"]) $(id).classList.toggle("stale", on);
  document.body.dataset.stale = on ? "1" : "";
  $("stale-mark").textContent = on ? "STALE \u2014 the heatmaps show the last settings that worked (" +
    (window.shownSettings ? "layer " + window.shownSettings.layer + ", head " + window.shownSettings.head + ", τ = " +
     window.shownSettings.temperature : "earlier") + "), not the current ones; " + why : "";
}
function finish(my, msg, error) {
  if (my !== seq) return;
  setStatus(msg, error);
  document.body.dataset.error = error ? "1" : "";
  document.body.dataset.seq = String(my);
  document.body.dataset.busy = "0";
}

function render(r) {
  const t = r.labels || r.tokens;  // readable labels; the raw token shows on hover (below)
  $("now-title").textContent = "weights now · layer " + r.layer + ", head " + r.head + " (rows: queries, columns: keys)";
  $("legend").textContent = drawMatrix($("matrix"), r.weights, t, t);
  drawMatrix($("baseline"), r.baseline_weights, t, t, {size: Math.max(3, Math.min(12, Math.floor(260 / t.length)))});
  $("ent-base").textContent = fmt(r.baseline_stats.entropy);
  $("ent-now").textContent = r.stats.entropy === null ? "— (no softmax)" : fmt(r.stats.entropy);
  $("max-base").textContent = fmt(r.baseline_stats.max_weight);
  $("max-now").textContent = fmt(r.stats.max_weight);
  $("cos-now").textContent = fmt(r.output.cosine_to_baseline, 4);
  $("ntok").textContent = t.length + " tokens";
  [$("matrix"), $("baseline")].forEach((box) => {
    const rl = box.querySelectorAll(".lab.rl"), cl = box.querySelectorAll(".lab.cl");
    r.tokens.forEach((raw, i) => { if (rl[i]) rl[i].title = raw; if (cl[i]) cl[i].title = raw; });
  });
  $("notes").textContent = r.notes.join(" ");
  const hb = $("heads"); hb.replaceChildren();
  const logT = Math.log(Math.max(2, t.length));
  r.heads.forEach((h, k) => {
    // sharpness in [0, 1]: 1 - entropy / log T with softmax, the mean max weight (clipped) without
    const sharp = h.entropy === null ? Math.min(1, Math.abs(h.max_weight)) : 1 - h.entropy / logT;
    const b = el("button", k === r.head ? "on" : "", "h" + k);
    b.type = "button"; b.dataset.head = k;
    b.style.background = seqColour(1 - sharp); b.style.color = sharp > 0.45 ? "#fff" : "#000";
    b.title = "head " + k + ": entropy " + fmt(h.entropy) + ", max weight " + fmt(h.max_weight);
    b.addEventListener("click", () => { $("head").value = String(k); schedule(); });
    hb.appendChild(b);
  });
  const cells = $("matrix").querySelectorAll(".cell");
  const read = (c) => {
    cells.forEach((x) => x.classList.remove("hi")); c.classList.add("hi");
    const i = Number(c.dataset.i), j = Number(c.dataset.j);
    hover = {i: i, j: j};
    $("readout").textContent = "layer " + r.layer + ", head " + r.head + ": query " + i + " “" + t[i] + "” → key " + j +
      " “" + t[j] + "”: " + Number(c.dataset.w).toFixed(4) + "   (unmodified " + r.baseline_weights[i][j].toFixed(4) + ")";
  };
  cells.forEach((c) => c.addEventListener("mouseenter", () => read(c)));
  // new weights (another head, layer, setting): the readout reads the same cell again, or clears
  const again = hover && hover.i < t.length && hover.j < t.length ? cells[hover.i * t.length + hover.j] : null;
  if (again) read(again);
  else { hover = null; $("readout").textContent = "hover a cell to read its weight"; }
}

// -- the trace --------------------------------------------------------------------------------------
async function loadTrace() {
  const my = ++traceSeq;
  let body;
  try { body = settings(); } catch (e) { $("trace-status").textContent = e.message; return; }
  $("trace-status").textContent = "tracing…";
  try {
    const r = await post("/api/trace", body);
    if (my !== traceSeq) return;
    trace = r;
    const names = r.steps.map((s) => s.name);
    if (stepIndex >= names.length) stepIndex = names.indexOf("weights");
    const box = $("steps"); box.replaceChildren();
    r.steps.forEach((s, k) => { const b = el("button", "", s.name); b.type = "button"; b.dataset.step = s.name;
      b.title = s.title + ": " + s.formula; b.appendChild(el("small", "", s.formula));
      b.addEventListener("click", () => { stepIndex = k; showStep(); }); box.appendChild(b); });
    $("trace-status").textContent = "layer " + r.layer + ", head " + r.head + (r.notes.length ? " · " + r.notes.join(" · ") : "");
    showStep();
  } catch (e) { if (my === traceSeq) $("trace-status").textContent = e.message; }
}
function showStep() {
  if (!trace) return;
  const s = trace.steps[stepIndex];
  document.querySelectorAll("#steps button").forEach((b, k) => b.classList.toggle("on", k === stepIndex));
  $("step-title").textContent = s.title;
  $("step-formula").textContent = s.formula;
  $("step-shape").textContent = "shape [" + s.shape.join(" × ") + "]" + (s.cut ? " · showing the top-left corner" : "");
  $("step-note").textContent = s.note || "";
  const rows = s.value ? (Array.isArray(s.value[0]) ? s.value : [s.value]) : [];
  const numbers = $("numbers").checked;
  // colour only: cells of 12 px, tall enough for the row labels beside them
  drawMatrix($("step-matrix"), rows, s.rows, s.cols, {size: numbers ? undefined : 12, numbers: numbers});
  document.body.dataset.step = s.name;
}

// -- wiring -----------------------------------------------------------------------------------------
async function init() {
  let info;
  try { info = await (await fetch("/api/info")).json(); } catch (e) { setStatus("cannot reach the server: " + e.message, true); return; }
  Object.assign(INFO, info);
  if (!info.available) {
    const b = $("banner"); b.hidden = false; b.textContent = info.message;
    $("model").textContent = "no model";
    document.body.dataset.ready = "1";
    return;
  }
  $("model").textContent = info.model + " · " + info.layers + " layers × " + info.heads + " heads · d_k = " + info.d_k +
    " · at most " + info.max_tokens + " tokens";
  for (let i = 0; i < info.layers; i++) $("layer").appendChild(new Option(String(i), String(i)));
  for (let h = 0; h < info.heads; h++) $("head").appendChild(new Option(String(h), String(h)));
  for (const m of info.mechanisms) {
    const o = new Option(m.name + " (" + m.kind + (m.weights ? "" : ", no weights") + ")", m.name);
    o.title = (m.summary || "") + " · params: " + m.params; $("mechanism").appendChild(o);
  }
  for (const id of ["text", "params", "pattern"]) $(id).addEventListener("input", schedule);
  for (const id of ["layer", "head", "scale", "softmax", "similarity", "mechanism", "scope", "ablate"]) $(id).addEventListener("change", schedule);
  $("temperature").addEventListener("input", () => { showTau(); schedule(); });
  $("numbers").addEventListener("change", showStep);
  $("reset").addEventListener("click", () => {
    $("scale").value = "sqrt"; $("temperature").value = "0"; showTau();
    $("softmax").checked = true; $("similarity").value = "dot"; $("mechanism").value = ""; $("params").value = "";
    $("pattern").value = ""; $("scope").value = "all"; $("ablate").value = ""; schedule();
  });
  $("trace-box").addEventListener("toggle", () => { if ($("trace-box").open) loadTrace(); });
  $("prev").addEventListener("click", () => { if (trace) { stepIndex = Math.max(0, stepIndex - 1); showStep(); } });
  $("next").addEventListener("click", () => { if (trace) { stepIndex = Math.min(trace.steps.length - 1, stepIndex + 1); showStep(); } });
  document.body.dataset.ready = "1";
  update();
}
init();
</script>
</body></html>
"""
