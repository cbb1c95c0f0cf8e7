"""The self-contained viz page: one HTML file, inline CSS and JS, no network.

Views: a head view (hover or click a query token to see where it attends in the chosen layer, one
colour per head), a model view (layers × heads grid of thumbnails; click one to open it in the head
view) and a pattern view (the mask in use and common patterns, with density and FLOPs saved).
User text reaches the page only as escaped HTML or as JSON inside a script tag whose '<', '>' and '&'
are \\u-escaped; the script writes tokens with ``textContent``, never ``innerHTML``.
"""
from __future__ import annotations

import html
import json
import re
from pathlib import Path

from ..report import atomic_write_text

__all__ = ["render_page", "write_page"]

_CSS = r"""
:root{--fg:#1d1d1f;--mut:#666;--line:#ddd}
*{box-sizing:border-box}body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:0;color:var(--fg)}
header{padding:12px 20px;border-bottom:1px solid var(--line)}header h1{font-size:18px;margin:0 0 4px}
.meta{color:var(--mut);font-size:13px}.note{color:#a55a00;font-size:13px;margin-top:4px}
nav{display:flex;gap:4px;padding:8px 20px;border-bottom:1px solid var(--line)}
nav button{border:1px solid var(--line);background:#fafafa;padding:5px 12px;border-radius:6px;cursor:pointer}
nav button.on{background:#1d1d1f;color:#fff}
section{padding:14px 20px;display:none}section.on{display:block}
.controls{display:flex;flex-wrap:wrap;gap:8px;align-items:center;margin-bottom:10px;font-size:13px}
.chip{display:inline-block;margin:0 3px 3px 0;padding:2px 8px;border-radius:10px;color:#fff;cursor:pointer;font-size:12px;opacity:.35}
.chip.on{opacity:1}
#hv{display:flex;align-items:flex-start}
.col{display:flex;flex-direction:column}
.tok{font-family:ui-monospace,monospace;font-size:13px;padding:0 6px;height:20px;line-height:20px;white-space:pre;
cursor:default;border-radius:3px}
.q .tok{text-align:right;cursor:pointer}.q .tok.active{outline:2px solid #1d1d1f}
#lines{flex:none}
.grid{display:grid;gap:6px}.cell{text-align:center;font-size:11px;color:var(--mut);cursor:pointer}
.cell canvas{border:1px solid var(--line);image-rendering:pixelated;display:block}
.cell.sel canvas{outline:2px solid #1d1d1f}
.pat{display:inline-block;margin:0 18px 18px 0;vertical-align:top;font-size:12px;max-width:220px}
.pat canvas{border:1px solid var(--line);image-rendering:pixelated;width:192px;height:192px}
#readout{font-size:12px;color:var(--mut);min-height:16px;margin-top:8px}
"""

_JS = r"""
(function(){
"use strict";
const D = JSON.parse(document.getElementById("attn-data").textContent);
const T = D.T, NL = D.layers, NH = D.heads;
function b64u8(s){const b=atob(s);const a=new Uint8Array(b.length);for(let i=0;i<b.length;i++)a[i]=b.charCodeAt(i);return a;}
function hue(h){return Math.round(h*360/NH);}
function col(h,a){return "hsla("+hue(h)+",75%,45%,"+a+")";}
// weights[l][h] -> function(i) giving Float32Array row of length T
const W = [];
if (D.mode === "dense") {
  for (let l=0;l<NL;l++){ W.push(b64u8(D.dense.b64[l])); }
} else {
  for (let l=0;l<NL;l++){
    const iu8=b64u8(D.summary.idx[l]);
    W.push({idx:new Uint16Array(iu8.buffer), w:b64u8(D.summary.w[l])});
  }
}
function row(l,h,i){
  const r=new Float32Array(T);
  if (D.mode==="dense"){const a=W[l];const o=(h*T+i)*T;for(let j=0;j<T;j++)r[j]=a[o+j]/255;}
  else {const k=D.summary.k;const o=(h*T+i)*k;for(let t=0;t<k;t++){r[W[l].idx[o+t]]+=W[l].w[o+t]/255;}}
  return r;
}
// ---- tabs
document.querySelectorAll("nav button").forEach(function(b){
  b.addEventListener("click",function(){
    document.querySelectorAll("nav button").forEach(function(x){x.classList.toggle("on",x===b);});
    document.querySelectorAll("section").forEach(function(s){s.classList.toggle("on",s.id===b.dataset.view);});
  });
});
// ---- head view
const state={layer:0, heads:new Set(Array.from({length:NH},function(_,h){return h;})), sel:null, pinned:false};
const layerSel=document.getElementById("layer");
for(let l=0;l<NL;l++){const o=document.createElement("option");o.value=l;o.textContent="layer "+l;layerSel.appendChild(o);}
layerSel.addEventListener("change",function(){state.layer=+layerSel.value;render();});
const chips=document.getElementById("chips");
for(let h=0;h<NH;h++){
  const c=document.createElement("span");c.className="chip on";c.dataset.head=h;c.textContent="head "+h;
  c.style.background=col(h,1);
  c.addEventListener("click",function(){if(state.heads.has(h))state.heads.delete(h);else state.heads.add(h);
    c.classList.toggle("on",state.heads.has(h));render();});
  chips.appendChild(c);
}
const qcol=document.getElementById("qcol"), kcol=document.getElementById("kcol"), svg=document.getElementById("lines");
const qs=[], ks=[];
D.tokens.forEach(function(t,i){
  const a=document.createElement("div");a.className="tok";a.textContent=t;a.dataset.i=i;qcol.appendChild(a);qs.push(a);
  const b=document.createElement("div");b.className="tok";b.textContent=t;b.dataset.j=i;kcol.appendChild(b);ks.push(b);
  a.addEventListener("mouseenter",function(){if(!state.pinned){state.sel=i;render();}});
  a.addEventListener("mouseleave",function(){if(!state.pinned){state.sel=null;render();}});
  a.addEventListener("click",function(){if(state.pinned&&state.sel===i){state.pinned=false;}else{state.pinned=true;state.sel=i;}render();});
});
svg.setAttribute("height", String(Math.max(20, T*20)));
const NS="http://www.w3.org/2000/svg";
function render(){
  while(svg.firstChild)svg.removeChild(svg.firstChild);
  qs.forEach(function(q,i){q.classList.toggle("active",i===state.sel);});
  const readout=document.getElementById("readout");
  if(state.sel===null){ks.forEach(function(k){k.style.background="";k.dataset.w="0";});readout.textContent="hover or click a token on the left";return;}
  const i=state.sel, best=new Float32Array(T), arg=new Int16Array(T).fill(-1);
  state.heads.forEach(function(h){
    const r=row(state.layer,h,i);
    for(let j=0;j<T;j++){
      if(r[j]>best[j]){best[j]=r[j];arg[j]=h;}
      if(r[j]>0.02){
        const ln=document.createElementNS(NS,"line");
        ln.setAttribute("x1","0");ln.setAttribute("y1",String(i*20+10));ln.setAttribute("x2","160");ln.setAttribute("y2",String(j*20+10));
        ln.setAttribute("stroke",col(h,1));ln.setAttribute("stroke-opacity",String(Math.min(1,r[j])));ln.setAttribute("stroke-width","2");
        svg.appendChild(ln);
      }
    }
  });
  let top=-1;
  ks.forEach(function(k,j){
    k.dataset.w=best[j].toFixed(3);
    k.style.background=arg[j]>=0&&best[j]>0?col(arg[j],Math.min(1,0.15+best[j])):"";
    if(top<0||best[j]>best[top])top=j;
  });
  readout.textContent="layer "+state.layer+", query \u201c"+D.tokens[i]+"\u201d: strongest key \u201c"+
    (top>=0?D.tokens[top]:"")+"\u201d ("+(top>=0?best[top].toFixed(3):"0")+")"+(D.mode==="summary"?" \u2014 top-"+D.summary.k+" keys only":"");
}
// ---- model view
const grid=document.getElementById("grid");
grid.style.gridTemplateColumns="repeat("+NH+", 68px)";
const px=Math.min(T,64);
for(let l=0;l<NL;l++)for(let h=0;h<NH;h++){
  const cell=document.createElement("div");cell.className="cell";cell.dataset.layer=l;cell.dataset.head=h;
  const cv=document.createElement("canvas");cv.width=px;cv.height=px;cv.style.width="64px";cv.style.height="64px";
  const ctx=cv.getContext("2d"), img=ctx.createImageData(px,px);
  for(let y=0;y<px;y++){
    const i=Math.floor(y*T/px), r=row(l,h,i);
    let mx=0;for(let j=0;j<T;j++)if(r[j]>mx)mx=r[j];
    for(let x=0;x<px;x++){
      const j0=Math.floor(x*T/px), j1=Math.max(j0+1,Math.floor((x+1)*T/px));
      let v=0;for(let j=j0;j<j1;j++)v=Math.max(v,r[j]);
      const a=mx>0?v/mx:0, o=(y*px+x)*4;
      img.data[o]=255-Math.round(a*200);img.data[o+1]=255-Math.round(a*120);img.data[o+2]=255-Math.round(a*40);img.data[o+3]=255;
    }
  }
  ctx.putImageData(img,0,0);
  const st=D.head_stats[l][h];
  const cap=document.createElement("div");cap.textContent="L"+l+" H"+h;
  cell.title="layer "+l+", head "+h+": mean entropy "+st.entropy.toFixed(2)+" nats, mean max weight "+st.max_weight.toFixed(2);
  cell.appendChild(cv);cell.appendChild(cap);
  cell.addEventListener("click",function(){
    state.layer=l;layerSel.value=String(l);state.heads=new Set([h]);
    document.querySelectorAll(".chip").forEach(function(c){c.classList.toggle("on",+c.dataset.head===h);});
    document.querySelectorAll(".cell").forEach(function(c){c.classList.toggle("sel",c===cell);});
    document.querySelector("nav button[data-view=head]").click();render();
  });
  grid.appendChild(cell);
}
// ---- pattern view
const pv=document.getElementById("patterns");
D.patterns.forEach(function(p){
  const box=document.createElement("div");box.className="pat";
  const cv=document.createElement("canvas");cv.width=p.n;cv.height=p.n;
  const ctx=cv.getContext("2d"),img=ctx.createImageData(p.n,p.n),g=b64u8(p.grid);
  for(let t=0;t<p.n*p.n;t++){const v=g[t]?30:245;img.data[4*t]=v;img.data[4*t+1]=v;img.data[4*t+2]=v;img.data[4*t+3]=255;}
  ctx.putImageData(img,0,0);
  const cap=document.createElement("div");
  cap.textContent=p.name+": density "+(100*p.density).toFixed(1)+"%, saves "+(100*p.flops_saved).toFixed(0)+"% of the FLOPs";
  box.appendChild(cv);box.appendChild(cap);pv.appendChild(box);
});
render();
document.body.dataset.ready="1";
})();
"""

_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:">
<link rel="icon" href="data:,">
<title>__TITLE__</title><style>__CSS__</style></head>
<body>
<header><h1>__TITLE__</h1>
<div class="meta">model: __MODEL__ · mechanism: __MECH__ · __T__ tokens · __LAYERS__ layers × __HEADS__ heads · mode: __MODE__</div>
<div class="meta">text: <span id="text">__TEXT__</span></div>
__NOTES__
</header>
<nav><button class="on" data-view="head">head view</button><button data-view="model">model view</button><button data-view="pattern">pattern view</button></nav>
<section id="head" class="on">
<div class="controls"><label>layer <select id="layer"></select></label><span id="chips"></span></div>
<div id="hv"><div class="col q" id="qcol"></div><svg id="lines" width="160" height="20"></svg><div class="col k" id="kcol"></div></div>
<div id="readout"></div>
</section>
<section id="model"><div class="meta">rows: layers, columns: heads (darker = more weight, each row scaled to its max). Click one to open it.</div><div class="grid" id="grid"></div></section>
<section id="pattern"><div class="meta">which (query, key) pairs take part; dark = computed</div><div id="patterns"></div></section>
<script id="attn-data" type="application/json">__DATA__</script>
<script>__JS__</script>
</body></html>
"""


def _json_for_script(data: dict) -> str:
    """JSON safe inside <script>: no '<', '>' or '&' survives unescaped (so no '</script>' breakout)."""
    s = json.dumps(data, separators=(",", ":"), allow_nan=False)
    return s.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_page(data: dict) -> str:
    """The whole page as a string (see ``attnlab.viz.data.attention_data`` for ``data``)."""
    e = lambda s: html.escape(str(s), quote=True)  # noqa: E731
    notes = "".join(f'<div class="note">{e(n)}</div>' for n in data.get("notes", []))
    text = data["text"]
    if len(text) > 600:
        text = text[:600] + "…"
    rep = {"__TITLE__": e(data.get("title", "attnlab viz")), "__MODEL__": e(data["model"]),
           "__MECH__": e(data["mechanism"]), "__T__": str(int(data["T"])), "__LAYERS__": str(int(data["layers"])),
           "__HEADS__": str(int(data["heads"])), "__MODE__": e(data["mode"]), "__TEXT__": e(text),
           "__NOTES__": notes, "__CSS__": _CSS, "__JS__": _JS}
    rep["__DATA__"] = _json_for_script(data)
    # one pass: text inserted for one placeholder is never scanned for another
    return re.sub(r"__[A-Z]+__", lambda m: rep.get(m.group(0), m.group(0)), _HTML)


def write_page(out_dir, data: dict) -> Path:
    """Write ``out_dir/index.html`` atomically and return its path."""
    return atomic_write_text(Path(out_dir) / "index.html", render_page(data))
