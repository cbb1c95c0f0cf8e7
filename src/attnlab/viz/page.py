"""The self-contained viz page: one HTML file, inline CSS and JS, no network.

Views, all drawn at load:
- head view: tokens on the left (queries) and right (keys); at load every query's links in layer 0,
  all heads, one colour-blind-safe colour per head, line opacity = weight (the strongest links up to
  a budget). Hover or click a query to see only its links; the readout says where it attends.
- matrix view: a canvas of the layer's weights (queries down, keys across; one head or the max over
  heads), any length: the wheel or the buttons zoom, dragging pans, the readout follows the pointer.
  Beside it, the distance histogram (attention mass by |i - j|) per head.
- model view: layers × heads thumbnails; click one to open it in the head view.
- pattern view: the mask in use and common patterns, with density and FLOPs saved.
Every view has "export SVG" / "export PNG" buttons. SVG saves the view as drawn at that moment (built in the
page); PNG saves, for the head and matrix views, the figure ``attnlab.viz.save`` writes (the layer's heads as
viridis heatmaps with ticks, colour bars and a title: Note [One export figure]), for the model and pattern
views the SVG rasterised on a canvas at 2x. Cross-attention (L queries, S keys) has key
labels of its own; a sentence pair marks sentence B's first token.
Inputs longer than 512 tokens open on the matrix view; the page never grows past the window (the
token columns scroll inside their box, the readout stays above them).

User text reaches the page only as escaped HTML or as JSON inside a script tag whose '<', '>' and '&'
are \\u-escaped; the script writes tokens with ``textContent``, never ``innerHTML``.
"""
from __future__ import annotations

import functools
import html
import json
import re
from pathlib import Path

from ..report import atomic_write_text

__all__ = ["render_page", "write_page", "HEAD_COLOURS"]

# Okabe & Ito's eight colour-blind-safe colours, then four of Paul Tol's "muted" set that stay apart from
# them (wine, olive, indigo, teal). Past 12 heads the colours repeat and the head's lines are dashed.
HEAD_COLOURS = ("#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00", "#CC79A7", "#000000",
                "#882255", "#999933", "#332288", "#44AA99")

_CSS = r"""
:root{--fg:#1d1d1f;--mut:#555;--line:#ddd}
*{box-sizing:border-box}body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:0;color:var(--fg)}
header{padding:10px 20px 8px;border-bottom:1px solid var(--line)}header h1{font-size:18px;margin:0 0 4px}
.meta{color:var(--mut);font-size:13px}.note{color:#8a4b00;font-size:13px;margin-top:2px}
#textline{display:-webkit-box;-webkit-line-clamp:2;-webkit-box-orient:vertical;overflow:hidden}
nav{display:flex;gap:4px;padding:6px 20px;border-bottom:1px solid var(--line)}
nav button{border:1px solid var(--line);background:#fafafa;padding:4px 12px;border-radius:6px;cursor:pointer;font-size:13px}
nav button.on{background:#1d1d1f;color:#fff}
section{padding:10px 20px;display:none}section.on{display:block}
.controls{display:flex;flex-wrap:wrap;gap:8px;align-items:center;margin-bottom:6px;font-size:13px}
.controls button{font-size:13px;padding:2px 9px;border:1px solid #bbb;background:#f6f6f6;border-radius:5px;cursor:pointer}
.chip{display:inline-block;margin:0 3px 3px 0;padding:2px 8px;border-radius:10px;cursor:pointer;font-size:12px;
font-weight:600;border:2px solid transparent}
.chip.off{background:#fff!important;color:#444!important;font-weight:400}
.readout{font-size:13px;color:#222;min-height:18px;margin:2px 0 6px;white-space:nowrap;overflow:hidden;text-overflow:ellipsis}
#hvbox{overflow:auto;border:1px solid var(--line);border-radius:4px;max-height:480px}
#hv{display:flex;align-items:flex-start}
.col{display:flex;flex-direction:column;min-width:60px}
.tok{font-family:ui-monospace,monospace;font-size:12px;padding:0 6px;height:18px;line-height:18px;white-space:pre;
cursor:default;border-radius:3px;max-width:220px;overflow:hidden;text-overflow:ellipsis}
.q .tok{text-align:right;cursor:pointer}.tok.sentb{border-top:2px solid #888}.q .tok.active{outline:2px solid #1d1d1f}
#lines{flex:none}
#mwrap{display:flex;gap:18px;align-items:flex-start}
#mgrid{display:grid;grid-template-columns:auto auto;grid-template-rows:auto auto}
#mcols{position:relative;height:0;overflow:visible}#mcols.on{height:64px}
#mrows{position:relative;width:0}#mrows.on{width:96px}
.mlab{position:absolute;font-family:ui-monospace,monospace;font-size:11px;white-space:pre;overflow:hidden;
text-overflow:ellipsis;max-width:92px;line-height:13px;color:#333}
#mrows .mlab{right:4px;text-align:right}
#mcols .mlab{bottom:2px;transform-origin:left bottom;transform:rotate(-55deg);max-width:80px}
#mcols .mlab.tick{transform:translateX(-50%);color:#666}#mrows .mlab.tick{color:#666}
#mcols .mlab.axis{transform:none;bottom:18px;color:#333;font-style:italic}#mrows .mlab.axis{font-style:italic}
#mat{border:1px solid #999;image-rendering:pixelated;cursor:crosshair;display:block;touch-action:none}
#tip{position:fixed;pointer-events:none;background:rgba(29,29,31,.92);color:#fff;font-size:12px;padding:3px 6px;
border-radius:4px;display:none;white-space:pre;z-index:5}
#mside{flex:1;min-width:160px}
#hists{display:grid;grid-template-columns:repeat(auto-fill,150px);gap:6px 10px;font-size:11px;color:var(--mut)}
#hists svg{display:block;background:#fbfbfb;border:1px solid #eee}
.grid{display:grid;gap:6px}.cell{text-align:center;font-size:11px;color:var(--mut);cursor:pointer}
.cell canvas{border:1px solid var(--line);image-rendering:pixelated;display:block}
.cell.sel canvas{outline:2px solid #1d1d1f}
.pat{display:inline-block;margin:0 18px 18px 0;vertical-align:top;font-size:12px;max-width:220px}
.pat canvas{border:1px solid var(--line);image-rendering:pixelated;width:192px;height:192px}
"""

_JS = r"""
(function(){
"use strict";
const D = JSON.parse(document.getElementById("attn-data").textContent);
// T (= L) queries, S keys: S = T for self-attention; cross-attention has its own key labels
const T = D.T, S = D.S===undefined?D.T:D.S, NL = D.layers, NH = D.heads, PAL = D.palette;
const KT = D.key_tokens||D.tokens, N = Math.max(T,S);
// raw tokens (the tokenizer's own strings, e.g. "\u0120capital") behind the readable labels, shown on hover
const RQ = D.raw_tokens||null, RK = D.key_tokens?(D.raw_key_tokens||null):RQ;
function hover(e,raw,t){if(raw&&raw[t]!==undefined)e.title="token "+t+": "+JSON.stringify(raw[t]);}
const NS = "http://www.w3.org/2000/svg";
function b64u8(s){const b=atob(s);const a=new Uint8Array(b.length);for(let i=0;i<b.length;i++)a[i]=b.charCodeAt(i);return a;}
function colour(h){return PAL[h%PAL.length];}
function rgba(h,a){const c=colour(h);return "rgba("+parseInt(c.substr(1,2),16)+","+parseInt(c.substr(3,2),16)+","+parseInt(c.substr(5,2),16)+","+a+")";}
function luminance(hex){const v=[1,3,5].map(function(i){const x=parseInt(hex.substr(i,2),16)/255;
  return x<=0.03928?x/12.92:Math.pow((x+0.055)/1.055,2.4);});return 0.2126*v[0]+0.7152*v[1]+0.0722*v[2];}
// chip text: black or white, whichever contrasts more with the head's colour (WCAG contrast ratio)
function ink(hex){const L=luminance(hex);return (L+0.05)/0.05>=1.05/(L+0.05)?"#000000":"#ffffff";}
function tokName(i){return "\u201c"+D.tokens[i]+"\u201d";}
function keyName(j){return "\u201c"+KT[j]+"\u201d";}
// ---- weights: W[l] is the layer's data; each(l,h,i,j0,j1,f) calls f(j,w) for keys j0 <= j < j1 with w > 0
const W = [];
for (let l=0;l<NL;l++){
  if (D.mode==="dense") W.push(b64u8(D.dense.b64[l]));
  else {const iu8=b64u8(D.summary.idx[l]);W.push({idx:new Uint16Array(iu8.buffer), w:b64u8(D.summary.w[l])});}
}
function each(l,h,i,j0,j1,f){
  if (D.mode==="dense"){const a=W[l],o=(h*T+i)*S;for(let j=j0;j<j1;j++){const v=a[o+j];if(v)f(j,v/255);}}
  else {const k=D.summary.k,o=(h*T+i)*k,L=W[l];for(let t=0;t<k;t++){const j=L.idx[o+t],v=L.w[o+t];if(v&&j>=j0&&j<j1)f(j,v/255);}}
}
function row(l,h,i){const r=new Float32Array(S);each(l,h,i,0,S,function(j,w){r[j]+=w;});return r;}
// ---- tabs
function show(view){
  document.querySelectorAll("nav button").forEach(function(x){x.classList.toggle("on",x.dataset.view===view);});
  document.querySelectorAll("section").forEach(function(s){s.classList.toggle("on",s.id===view);});
  fit();
  if(view==="matrix"&&typeof drawLabels==="function")drawLabels();
}
document.querySelectorAll("nav button").forEach(function(b){b.addEventListener("click",function(){show(b.dataset.view);});});
// ---- head view
const ROW=18, SVGW=170, MINW=0.02, BUDGET=4000;
const state={layer:0, heads:new Set(Array.from({length:NH},function(_,h){return h;})), sel:null, pinned:false};
const layerSel=document.getElementById("layer"), mlayerSel=document.getElementById("mlayer");
for(let l=0;l<NL;l++){[layerSel,mlayerSel].forEach(function(s){const o=document.createElement("option");o.value=l;o.textContent="layer "+l;s.appendChild(o);});}
layerSel.addEventListener("change",function(){state.layer=+layerSel.value;render();});
const chips=document.getElementById("chips");
function paintChip(c,h){const on=state.heads.has(h);c.classList.toggle("off",!on);
  c.style.background=colour(h);c.style.color=ink(colour(h));c.style.borderColor=colour(h);}
for(let h=0;h<NH;h++){
  const c=document.createElement("span");c.className="chip";c.dataset.head=h;c.textContent="head "+h;
  c.title="click: show or hide head "+h+"; double-click: this head only";
  c.addEventListener("click",function(){if(state.heads.has(h))state.heads.delete(h);else state.heads.add(h);render();});
  c.addEventListener("dblclick",function(){state.heads=new Set([h]);render();});
  chips.appendChild(c);
}
document.getElementById("allheads").addEventListener("click",function(){for(let h=0;h<NH;h++)state.heads.add(h);render();});
const qcol=document.getElementById("qcol"), kcol=document.getElementById("kcol"), svg=document.getElementById("lines");
const qs=[], ks=[], fq=document.createDocumentFragment(), fk=document.createDocumentFragment();
D.tokens.forEach(function(t,i){
  const a=document.createElement("div");a.className="tok";a.textContent=t;a.dataset.i=i;hover(a,RQ,i);fq.appendChild(a);qs.push(a);
  if(D.sentence_b_start===i)a.classList.add("sentb");
});
KT.forEach(function(t,j){
  const b=document.createElement("div");b.className="tok";b.textContent=t;b.dataset.j=j;hover(b,RK,j);fk.appendChild(b);ks.push(b);
  if(D.sentence_b_start===j)b.classList.add("sentb");
});
qcol.appendChild(fq);kcol.appendChild(fk);
qcol.addEventListener("mouseover",function(e){const i=e.target.dataset.i;if(i!==undefined&&!state.pinned){state.sel=+i;render();}});
qcol.addEventListener("mouseleave",function(){if(!state.pinned&&state.sel!==null){state.sel=null;render();}});
qcol.addEventListener("click",function(e){const d=e.target.dataset.i;if(d===undefined)return;const i=+d;
  if(state.pinned&&state.sel===i){state.pinned=false;}else{state.pinned=true;state.sel=i;}render();});
svg.setAttribute("width",String(SVGW));svg.setAttribute("height",String(Math.max(ROW,N*ROW)));
const readout=document.getElementById("readout");
function render(){
  for(let h=0;h<NH;h++)paintChip(chips.children[h],h);
  while(svg.firstChild)svg.removeChild(svg.firstChild);
  qs.forEach(function(q,i){q.classList.toggle("active",i===state.sel);});
  const l=state.layer, heads=Array.from(state.heads).sort(function(a,b){return a-b;});
  const rows=state.sel===null?null:[state.sel];
  // candidate links (weight, query, key, head), strongest first, at most BUDGET drawn
  const cw=[],ci=[],cj=[],ch=[];
  heads.forEach(function(h){
    const add=function(i){each(l,h,i,0,S,function(j,w){if(w>=MINW){cw.push(w);ci.push(i);cj.push(j);ch.push(h);}});};
    if(rows)add(rows[0]);else for(let i=0;i<T;i++)add(i);
  });
  let order=cw.map(function(_,t){return t;});
  if(order.length>BUDGET){order.sort(function(a,b){return cw[b]-cw[a];});order=order.slice(0,BUDGET);}
  const frag=document.createDocumentFragment();
  order.forEach(function(t){
    const ln=document.createElementNS(NS,"line"),h=ch[t];
    ln.setAttribute("x1","0");ln.setAttribute("y1",String(ci[t]*ROW+ROW/2));
    ln.setAttribute("x2",String(SVGW));ln.setAttribute("y2",String(cj[t]*ROW+ROW/2));
    ln.setAttribute("stroke",colour(h));ln.setAttribute("stroke-opacity",String(Math.min(1,cw[t]).toFixed(3)));
    ln.setAttribute("stroke-width",rows?"2.5":"1.6");
    if(h>=PAL.length)ln.setAttribute("stroke-dasharray","5 3");
    frag.appendChild(ln);
  });
  svg.appendChild(frag);
  const hs=heads.length===NH?"all "+NH+" heads":(heads.length===1?"head "+heads[0]:heads.length+" heads");
  if(state.sel===null){
    ks.forEach(function(k){k.style.background="";k.dataset.w="0";});
    readout.textContent="layer "+l+", "+hs+": links of every query (line opacity = weight; weights < "+MINW+
      " hidden"+(cw.length>BUDGET?"; the "+BUDGET+" strongest of "+cw.length+" shown":"")+
      "). Hover or click a token on the left for one query.";
    return;
  }
  const i=state.sel, best=new Float32Array(S), arg=new Int16Array(S).fill(-1);
  heads.forEach(function(h){each(l,h,i,0,S,function(j,w){if(w>best[j]){best[j]=w;arg[j]=h;}});});
  let top=-1;
  ks.forEach(function(k,j){
    k.dataset.w=best[j].toFixed(3);
    k.style.background=arg[j]>=0?rgba(arg[j],Math.min(1,0.12+best[j])):"";
    if(top<0||best[j]>best[top])top=j;
  });
  readout.textContent=(state.pinned?"[pinned] ":"")+"layer "+l+", "+hs+", query "+i+" "+tokName(i)+": strongest key "+
    (top>=0&&best[top]>0?top+" "+keyName(top)+" ("+best[top].toFixed(3)+(arg[top]>=0?", head "+arg[top]:"")+")":"none")+
    (D.mode==="summary"?" \u2014 top-"+D.summary.k+" keys per query only":"")+(state.pinned?"; click it again to unpin":"");
  if(kcol.parentNode&&top>=0){const box=document.getElementById("hvbox");const y=top*ROW;
    if(y<box.scrollTop||y>box.scrollTop+box.clientHeight-ROW){/* keep the strongest key in sight */}}
}
// ---- matrix view (canvas; zoom and pan; the readout follows the pointer)
const mat=document.getElementById("mat"), mctx=mat.getContext("2d"), MSZ=512;
mat.width=MSZ;mat.height=MSZ;
const mhead=document.getElementById("mhead"), mread=document.getElementById("mreadout"), tip=document.getElementById("tip");
(function(){const o=document.createElement("option");o.value="-1";o.textContent="max over heads";mhead.appendChild(o);
  for(let h=0;h<NH;h++){const p=document.createElement("option");p.value=h;p.textContent="head "+h;mhead.appendChild(p);}})();
const ms={layer:0, head:-1, i0:0, j0:0, nr:T, nc:S, pin:null, G:null, AI:null, AJ:null, AH:null, mr:1, mc:1};
function clampView(){ms.nr=Math.max(Math.min(T,8),Math.min(T,Math.round(ms.nr)));ms.nc=Math.max(Math.min(S,8),Math.min(S,Math.round(ms.nc)));
  ms.i0=Math.max(0,Math.min(T-ms.nr,Math.round(ms.i0)));ms.j0=Math.max(0,Math.min(S-ms.nc,Math.round(ms.j0)));}
function mrender(){
  clampView();
  const nr=ms.nr, nc=ms.nc, mr=Math.min(nr,MSZ), mc=Math.min(nc,MSZ), l=ms.layer;
  const G=new Float32Array(mr*mc), AI=new Int32Array(mr*mc).fill(-1), AJ=new Int32Array(mr*mc), AH=new Int16Array(mr*mc);
  const heads=ms.head<0?Array.from({length:NH},function(_,h){return h;}):[ms.head];
  for(let i=ms.i0;i<ms.i0+nr;i++){
    const r=Math.floor((i-ms.i0)*mr/nr)*mc;
    for(const h of heads)each(l,h,i,ms.j0,ms.j0+nc,function(j,w){const c=r+Math.floor((j-ms.j0)*mc/nc);
      if(w>G[c]){G[c]=w;AI[c]=i;AJ[c]=j;AH[c]=h;}});
  }
  const off=document.createElement("canvas");off.width=mc;off.height=mr;
  const octx=off.getContext("2d"), img=octx.createImageData(mc,mr);
  for(let c=0;c<mr*mc;c++){const v=Math.sqrt(G[c]),o=4*c;  // square-root scale: small weights stay visible
    img.data[o]=255-Math.round(v*247);img.data[o+1]=255-Math.round(v*207);img.data[o+2]=255-Math.round(v*148);img.data[o+3]=255;}
  octx.putImageData(img,0,0);
  mctx.imageSmoothingEnabled=false;mctx.clearRect(0,0,MSZ,MSZ);mctx.drawImage(off,0,0,MSZ,MSZ);
  Object.assign(ms,{G:G,AI:AI,AJ:AJ,AH:AH,mr:mr,mc:mc});
  document.getElementById("mview").textContent="queries "+ms.i0+"\u2013"+(ms.i0+nr-1)+" (down) \u00d7 keys "+ms.j0+"\u2013"+
    (ms.j0+nc-1)+" (across); "+(Math.max(nr,nc)>MSZ?"one pixel = up to "+(Math.max(nr,nc)/MSZ).toFixed(1)+" tokens (max shown)":"one cell = one token pair")+
    "; darker = more weight (square-root scale)";
  if(ms.pin)describe(ms.pin.x,ms.pin.y,true);
  drawLabels();
  drawHists();
}
// token labels beside the matrix once a cell is tall enough to read them; before that, position numbers
// every few cells (query positions down the side, key positions across the top), so every view has axes
const mrows=document.getElementById("mrows"), mcols=document.getElementById("mcols");
function drawLabels(){
  while(mrows.firstChild)mrows.removeChild(mrows.firstChild);
  while(mcols.firstChild)mcols.removeChild(mcols.firstChild);
  const size=mat.clientWidth||MSZ, ch=size/ms.nr, cw=size/ms.nc, on=Math.min(ch,cw)>=12;
  mrows.classList.add("on");mcols.classList.add("on");ms.toklabels=on;
  if(!on){
    const nice=function(n,px){const want=n*48/size;for(const s of [1,2,4,5,8,10,16,20,25,32,50,64,100,128,200,250,256,500,512,1000,1024,2000,2048,5000,10000,20000,50000])
      if(s>=want)return s;return Math.ceil(want);};
    const sr=nice(ms.nr), sc=nice(ms.nc);
    for(let i=Math.ceil(ms.i0/sr)*sr;i<ms.i0+ms.nr;i+=sr){
      const a=document.createElement("div");a.className="mlab tick";a.textContent=String(i);hover(a,RQ,i);
      a.style.top=((i-ms.i0+0.5)*ch-6.5)+"px";mrows.appendChild(a);}
    for(let j=Math.ceil(ms.j0/sc)*sc;j<ms.j0+ms.nc;j+=sc){
      const b=document.createElement("div");b.className="mlab tick";b.textContent=String(j);hover(b,RK,j);
      b.style.left=((j-ms.j0+0.5)*cw)+"px";mcols.appendChild(b);}
    const qa=document.createElement("div");qa.className="mlab axis";qa.textContent="query \u2193";qa.style.top="-14px";mrows.appendChild(qa);
    const ka=document.createElement("div");ka.className="mlab axis";ka.textContent="key \u2192";ka.style.left="0px";mcols.appendChild(ka);
    return;
  }
  for(let t=0;t<ms.nr;t++){
    const a=document.createElement("div");a.className="mlab";a.textContent=D.tokens[ms.i0+t];hover(a,RQ,ms.i0+t);
    a.style.top=((t+0.5)*ch-6.5)+"px";mrows.appendChild(a);
  }
  for(let t=0;t<ms.nc;t++){
    const b=document.createElement("div");b.className="mlab";b.textContent=KT[ms.j0+t];hover(b,RK,ms.j0+t);
    b.style.left=((t+0.5)*cw)+"px";mcols.appendChild(b);
  }
}
function cellAt(x,y){const c=Math.min(ms.mc-1,Math.max(0,Math.floor(x*ms.mc))),r=Math.min(ms.mr-1,Math.max(0,Math.floor(y*ms.mr)));return r*ms.mc+c;}
function span(a,b){return a===b?String(a):a+"\u2013"+b;}
function describe(x,y,pinned){
  const mr=ms.mr,mc=ms.mc,nr=ms.nr,nc=ms.nc,c=cellAt(x,y),r=Math.floor(c/mc),cc=c%mc;
  const qa=ms.i0+Math.ceil(r*nr/mr),qb=ms.i0+Math.ceil((r+1)*nr/mr)-1,ka=ms.j0+Math.ceil(cc*nc/mc),kb=ms.j0+Math.ceil((cc+1)*nc/mc)-1;
  let s;
  if(ms.AI[c]<0)s="queries "+span(qa,qb)+" \u00d7 keys "+span(ka,kb)+": no weight shown there";
  else s="query "+ms.AI[c]+" "+tokName(ms.AI[c])+" \u2192 key "+ms.AJ[c]+" "+keyName(ms.AJ[c])+": weight "+ms.G[c].toFixed(3)+
    ", head "+ms.AH[c]+(qb>qa||kb>ka?" (strongest in queries "+span(qa,qb)+" \u00d7 keys "+span(ka,kb)+")":"");
  mread.textContent=(pinned?"[pinned] ":"")+"layer "+ms.layer+": "+s;
  return s;
}
function rel(e){const b=mat.getBoundingClientRect();return [(e.clientX-b.left)/b.width,(e.clientY-b.top)/b.height];}
let drag=null;
mat.addEventListener("mousemove",function(e){const p=rel(e);
  if(drag){const b=mat.getBoundingClientRect();ms.j0=drag.j0-(e.clientX-drag.x)*ms.nc/b.width;ms.i0=drag.i0-(e.clientY-drag.y)*ms.nr/b.height;
    if(Math.abs(e.clientX-drag.x)+Math.abs(e.clientY-drag.y)>3){drag.moved=true;mrender();}return;}
  const s=describe(p[0],p[1],false);tip.textContent=s;tip.style.display="block";
  tip.style.left=Math.min(innerWidth-tip.offsetWidth-4,e.clientX+14)+"px";tip.style.top=(e.clientY+14)+"px";});
mat.addEventListener("mouseleave",function(){tip.style.display="none";drag=null;if(ms.pin)describe(ms.pin.x,ms.pin.y,true);});
mat.addEventListener("mousedown",function(e){drag={x:e.clientX,y:e.clientY,i0:ms.i0,j0:ms.j0,moved:false};});
mat.addEventListener("mouseup",function(e){const d=drag;drag=null;if(d&&d.moved)return;const p=rel(e);
  ms.pin=(ms.pin&&Math.abs(ms.pin.x-p[0])<1e-3&&Math.abs(ms.pin.y-p[1])<1e-3)?null:{x:p[0],y:p[1]};
  if(ms.pin)describe(p[0],p[1],true);else describe(p[0],p[1],false);});
function zoom(f,x,y){const ci=ms.i0+y*ms.nr,cj=ms.j0+x*ms.nc;ms.nr=ms.nr/f;ms.nc=ms.nc/f;clampView();
  ms.i0=ci-y*ms.nr;ms.j0=cj-x*ms.nc;ms.pin=null;mrender();}
mat.addEventListener("wheel",function(e){e.preventDefault();const p=rel(e);zoom(e.deltaY<0?2:0.5,p[0],p[1]);
  const s=describe(p[0],p[1],false);tip.textContent=s;},{passive:false});
document.getElementById("zin").addEventListener("click",function(){zoom(2,0.5,0.5);});
document.getElementById("zout").addEventListener("click",function(){zoom(0.5,0.5,0.5);});
document.getElementById("zreset").addEventListener("click",function(){ms.nr=T;ms.nc=S;ms.i0=0;ms.j0=0;ms.pin=null;mrender();});
document.getElementById("zdiag").addEventListener("click",function(){ms.nr=Math.min(T,64);ms.nc=Math.min(S,64);ms.j0=ms.i0;ms.pin=null;mrender();});
mlayerSel.addEventListener("change",function(){ms.layer=+mlayerSel.value;mrender();});
mhead.addEventListener("change",function(){ms.head=+mhead.value;mrender();});
// distance histogram: mean attention mass per query by |i - j| bin, one small chart per head
const hists=document.getElementById("hists");
function binLabel(b){const e=D.distance.edges,a=e[b],z=b+1<e.length?e[b+1]-1:null;return z===null?"\u2265"+a:(z===a?String(a):a+"\u2013"+z);}
function drawHists(){
  while(hists.firstChild)hists.removeChild(hists.firstChild);
  const H=D.distance.hist[ms.layer], nb=D.distance.edges.length, w=150, h=78, pad=14;
  document.getElementById("histtitle").textContent="attention mass by distance |i \u2212 j|, layer "+ms.layer+
    " (bins "+(nb>4?[0,1,2,3].map(binLabel).join(", ")+", \u2026, "+binLabel(nb-1):D.distance.edges.map(function(_,b){return binLabel(b);}).join(", "))+
    "; bar = mean weight per query)";
  for(let hd=0;hd<NH;hd++){
    const box=document.createElement("div"),s=document.createElementNS(NS,"svg");
    s.setAttribute("width",String(w));s.setAttribute("height",String(h));s.dataset.head=hd;
    const mx=Math.max(1e-9,Math.max.apply(null,H[hd])),bw=(w-4)/nb;
    for(let b=0;b<nb;b++){const v=H[hd][b],rh=(h-pad-4)*v/mx,r=document.createElementNS(NS,"rect");
      r.setAttribute("x",String(2+b*bw+0.5));r.setAttribute("y",String(h-pad-rh));r.setAttribute("width",String(Math.max(1,bw-1)));
      r.setAttribute("height",String(Math.max(0,rh)));r.setAttribute("fill",colour(hd));
      const t=document.createElementNS(NS,"title");t.textContent="|i\u2212j| "+binLabel(b)+": "+v.toFixed(3);r.appendChild(t);s.appendChild(r);}
    [[0,"start",2],[nb>>1,"middle",2+((nb>>1)+0.5)*bw],[nb-1,"end",w-2]].forEach(function(p){const tx=document.createElementNS(NS,"text");
      tx.setAttribute("x",String(p[2]));tx.setAttribute("y",String(h-3));tx.setAttribute("font-size","9");
      tx.setAttribute("text-anchor",p[1]);tx.setAttribute("fill","#555");tx.textContent=binLabel(p[0]);s.appendChild(tx);});
    const cap=document.createElement("div");cap.textContent="head "+hd+" (max "+mx.toFixed(2)+")";
    box.appendChild(cap);box.appendChild(s);hists.appendChild(box);
  }
}
// ---- model view
const grid=document.getElementById("grid");
grid.style.gridTemplateColumns="repeat("+NH+", 68px)";
const pr=Math.min(T,64), pc=Math.min(S,64);
for(let l=0;l<NL;l++)for(let h=0;h<NH;h++){
  const cell=document.createElement("div");cell.className="cell";cell.dataset.layer=l;cell.dataset.head=h;
  const cv=document.createElement("canvas");cv.width=pc;cv.height=pr;cv.style.width="64px";cv.style.height="64px";
  const ctx=cv.getContext("2d"), img=ctx.createImageData(pc,pr);
  for(let y=0;y<pr;y++){
    const i=Math.floor(y*T/pr), r=row(l,h,i);
    let mx=0;for(let j=0;j<S;j++)if(r[j]>mx)mx=r[j];
    for(let x=0;x<pc;x++){
      const j0=Math.floor(x*S/pc), j1=Math.max(j0+1,Math.floor((x+1)*S/pc));
      let v=0;for(let j=j0;j<j1;j++)v=Math.max(v,r[j]);
      const a=mx>0?v/mx:0, o=(y*pc+x)*4;
      img.data[o]=255-Math.round(a*247);img.data[o+1]=255-Math.round(a*207);img.data[o+2]=255-Math.round(a*148);img.data[o+3]=255;
    }
  }
  ctx.putImageData(img,0,0);
  const st=D.head_stats[l][h];
  const cap=document.createElement("div");cap.textContent="L"+l+" H"+h;
  cell.title="layer "+l+", head "+h+": mean entropy "+st.entropy.toFixed(2)+" nats, mean max weight "+st.max_weight.toFixed(2)+
    (st.sink!==undefined?", mean weight on token 0 "+st.sink.toFixed(2):"");
  cell.appendChild(cv);cell.appendChild(cap);
  cell.addEventListener("click",function(){
    state.layer=l;layerSel.value=String(l);state.heads=new Set([h]);state.sel=null;state.pinned=false;
    document.querySelectorAll(".cell").forEach(function(c){c.classList.toggle("sel",c===cell);});
    show("head");render();
  });
  grid.appendChild(cell);
}
// ---- pattern view
const pv=document.getElementById("patterns");
if(!D.patterns.length){const m=document.createElement("div");m.className="meta";
  m.textContent="cross-attention ("+T+" queries \u00d7 "+S+" keys): structured patterns are drawn for self-attention only";pv.appendChild(m);}
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
// ---- export: the view as it is drawn now, as SVG (built here) or PNG (that SVG rasterised on a canvas)
function el(name,attrs,text){const e=document.createElementNS(NS,name);
  for(const k in attrs)e.setAttribute(k,String(attrs[k]));if(text!==undefined)e.textContent=text;return e;}
function svgText(x,y,t,o){return el("text",Object.assign({x:x,y:y,"font-size":12,"font-family":"monospace",fill:"#1d1d1f"},o||{}),t);}
function headSvg(root){
  const qw=Math.max(60,qcol.offsetWidth), kw=Math.max(60,kcol.offsetWidth), top=24, w=qw+SVGW+kw, h=top+N*ROW+6;
  root.appendChild(svgText(4,15,readout.textContent,{"font-family":"sans-serif"}));
  qs.forEach(function(q,i){root.appendChild(svgText(qw-6,top+i*ROW+13,D.tokens[i],{"text-anchor":"end","font-weight":i===state.sel?"bold":"normal"}));});
  ks.forEach(function(k,j){if(k.style.background)root.appendChild(el("rect",{x:qw+SVGW,y:top+j*ROW,width:kw,height:ROW,fill:k.style.background}));
    root.appendChild(svgText(qw+SVGW+6,top+j*ROW+13,KT[j]));});
  const g=el("g",{transform:"translate("+qw+","+top+")"});
  Array.from(svg.childNodes).forEach(function(n){g.appendChild(n.cloneNode(true));});
  root.appendChild(g);return [w,h];
}
function matrixSvg(root){
  const size=512, toks=ms.toklabels, lab=toks?100:40, top=24+(toks?70:20);
  root.appendChild(svgText(4,15,mread.textContent+" \u2014 "+document.getElementById("mview").textContent,{"font-family":"sans-serif"}));
  root.appendChild(el("image",{x:lab,y:top,width:size,height:size,href:mat.toDataURL("image/png"),"image-rendering":"pixelated",
    preserveAspectRatio:"none"}));
  const ch=size/ms.nr,cw=size/ms.nc;
  if(toks){
    for(let t=0;t<ms.nr;t++)root.appendChild(svgText(lab-4,top+(t+0.5)*ch+4,D.tokens[ms.i0+t],{"text-anchor":"end","font-size":11}));
    for(let t=0;t<ms.nc;t++){const x=lab+(t+0.5)*cw,y=top-4;
      root.appendChild(svgText(x,y,KT[ms.j0+t],{"font-size":11,transform:"rotate(-55 "+x+" "+y+")"}));}}
  else{  // position numbers, as the page shows them when cells are too small for tokens
    mrows.querySelectorAll(".tick").forEach(function(a){const i=+a.textContent;
      root.appendChild(svgText(lab-4,top+(i-ms.i0+0.5)*ch+4,a.textContent,{"text-anchor":"end","font-size":10}));});
    mcols.querySelectorAll(".tick").forEach(function(b){const j=+b.textContent;
      root.appendChild(svgText(lab+(j-ms.j0+0.5)*cw,top-4,b.textContent,{"text-anchor":"middle","font-size":10}));});
    root.appendChild(svgText(4,top-4,"query \u2193 key \u2192",{"font-size":10,"font-family":"sans-serif"}));}
  return [lab+size+8,top+size+8];
}
function canvasGridSvg(root,boxes,cols,cw,chh,title){
  root.appendChild(svgText(4,15,title,{"font-family":"sans-serif"}));
  boxes.forEach(function(b,t){const x=4+(t%cols)*cw,y=24+Math.floor(t/cols)*chh,s=cw-12;
    root.appendChild(el("image",{x:x,y:y,width:s,height:s,href:b[0].toDataURL("image/png"),"image-rendering":"pixelated",preserveAspectRatio:"none"}));
    root.appendChild(el("rect",{x:x,y:y,width:s,height:s,fill:"none",stroke:"#999"}));
    root.appendChild(svgText(x,y+s+12,b[1],{"font-size":10,"font-family":"sans-serif"}));});
  return [8+cols*cw,32+Math.ceil(boxes.length/cols)*chh];
}
function viewSvg(view){
  const root=el("svg",{xmlns:NS,version:"1.1"});
  root.appendChild(el("rect",{x:0,y:0,width:"100%",height:"100%",fill:"#ffffff"}));
  let wh;
  if(view==="head")wh=headSvg(root);
  else if(view==="matrix")wh=matrixSvg(root);
  else if(view==="model")wh=canvasGridSvg(root,Array.from(grid.children).map(function(c){return [c.querySelector("canvas"),c.lastChild.textContent];}),
    NH,76,92,D.title+": rows = layers, columns = heads");
  else wh=canvasGridSvg(root,Array.from(pv.querySelectorAll(".pat")).map(function(c){return [c.querySelector("canvas"),c.lastChild.textContent];}),
    3,240,262,D.title+": patterns");
  const t0=root.querySelector("text");if(t0)wh[0]=Math.max(wh[0],12+7*t0.textContent.length);  // the title line fits
  root.setAttribute("width",String(Math.ceil(wh[0])));root.setAttribute("height",String(Math.ceil(wh[1])));
  root.setAttribute("viewBox","0 0 "+Math.ceil(wh[0])+" "+Math.ceil(wh[1]));
  return new XMLSerializer().serializeToString(root);
}
function download(name,url){const a=document.createElement("a");a.download=name;a.href=url;document.body.appendChild(a);a.click();a.remove();}
// ---- the PNG of the head and matrix views: the figure attnlab.viz.save writes (Note [One export figure])
const VIR=(function(){const h=D.viridis,a=[];for(let i=0;i<256;i++)a.push([parseInt(h.substr(6*i,2),16),
  parseInt(h.substr(6*i+2,2),16),parseInt(h.substr(6*i+4,2),16)]);return a;})();
function figureCanvas(l,heads){
  // one panel per head, up to 4 across: heatmap (rows = queries, columns = keys), viridis from 0 to the head's
  // max, token ticks up to 40 per axis, a colour bar; the title names the page, the layer and the model
  const k=2, PW=408, PH=384, top=34, cols=Math.min(4,heads.length), rows=Math.ceil(heads.length/cols);
  const tl=T<=40, kl=S<=40, lw=tl?Math.min(120,12+7*Math.max.apply(null,D.tokens.map(function(t){return t.length;}))):34;
  const bh=kl?Math.min(110,26+7*Math.max.apply(null,KT.map(function(t){return t.length;}))):36;
  const c=document.createElement("canvas");c.width=cols*PW*k;c.height=(top+rows*PH)*k;
  const x=c.getContext("2d");x.scale(k,k);x.fillStyle="#fff";x.fillRect(0,0,cols*PW,top+rows*PH);
  x.fillStyle="#000";x.textAlign="center";x.font="16px sans-serif";
  x.fillText(D.title+": layer "+l+" ("+D.model+")",cols*PW/2,22,cols*PW-8);
  const panels=[];
  heads.forEach(function(h,n){
    const ox=(n%cols)*PW, oy=top+Math.floor(n/cols)*PH, gx=ox+lw+22, gy=oy+22, gw=PW-lw-22-62, gh=PH-22-bh-18;
    const R=Math.min(T,1024), C=Math.min(S,1024), M=new Float32Array(R*C);let mx=0;  // past 1024: max per bin
    for(let i=0;i<T;i++){const r=Math.floor(i*R/T)*C;
      each(l,h,i,0,S,function(j,w){const c=r+Math.floor(j*C/S);if(w>M[c])M[c]=w;if(w>mx)mx=w;});}
    mx=Math.max(mx,1e-12);
    const off=document.createElement("canvas");off.width=C;off.height=R;
    const o=off.getContext("2d"),img=o.createImageData(C,R);
    for(let t=0;t<R*C;t++){const v=VIR[Math.min(255,Math.max(0,Math.round(255*M[t]/mx)))];
      img.data[4*t]=v[0];img.data[4*t+1]=v[1];img.data[4*t+2]=v[2];img.data[4*t+3]=255;}
    o.putImageData(img,0,0);x.imageSmoothingEnabled=false;x.drawImage(off,gx,gy,gw,gh);
    x.strokeStyle="#000";x.lineWidth=0.8;x.strokeRect(gx,gy,gw,gh);
    x.fillStyle="#000";x.font="13px sans-serif";x.textAlign="center";x.fillText("head "+h,gx+gw/2,gy-7);
    x.font="11px sans-serif";
    if(tl){x.textAlign="right";for(let i=0;i<T;i++)x.fillText(D.tokens[i],gx-4,gy+(i+0.5)*gh/T+4,lw-4);}
    if(kl){for(let j=0;j<S;j++){x.save();x.translate(gx+(j+0.5)*gw/S+4,gy+gh+4);x.rotate(-Math.PI/2);x.textAlign="right";
      x.fillText(KT[j],0,0,bh-22);x.restore();}}
    x.font="12px sans-serif";x.textAlign="center";x.fillText("key",gx+gw/2,oy+PH-8);
    x.save();x.translate(ox+12,gy+gh/2);x.rotate(-Math.PI/2);x.fillText("query",0,0);x.restore();
    const bx=gx+gw+10;  // colour bar, 0 .. the head's max
    for(let t=0;t<gh;t++){const v=VIR[Math.round(255*(1-t/gh))];x.fillStyle="rgb("+v[0]+","+v[1]+","+v[2]+")";x.fillRect(bx,gy+t,12,1.5);}
    x.strokeRect(bx,gy,12,gh);x.fillStyle="#000";x.textAlign="left";x.font="10px sans-serif";
    [0,0.5,1].forEach(function(f){x.fillText((mx*f).toFixed(2),bx+15,gy+gh*(1-f)+4);});
    panels.push({head:h,x:gx,y:gy,w:gw,h:gh,max:mx});
  });
  window.attnlabFigure={scale:k,panels:panels,layer:l,width:c.width,height:c.height};  // for tests: where each panel is
  return c;
}
function exportView(view,fmt){
  const s=viewSvg(view), url="data:image/svg+xml;charset=utf-8,"+encodeURIComponent(s), name="attnlab-"+view+"-layer"+
    (view==="matrix"?ms.layer:state.layer);
  if(fmt==="svg"){download(name+".svg",url);return;}
  if(view==="head"||view==="matrix"){
    const all=Array.from({length:NH},function(_,h){return h;});
    const heads=view==="head"?Array.from(state.heads).sort(function(a,b){return a-b;}):(ms.head<0?all:[ms.head]);
    download(name+".png",figureCanvas(view==="head"?state.layer:ms.layer,heads.length?heads:all).toDataURL("image/png"));
    return;
  }
  const im=new Image();
  im.onload=function(){const c=document.createElement("canvas"),k=2;c.width=im.width*k;c.height=im.height*k;
    const x=c.getContext("2d");x.fillStyle="#fff";x.fillRect(0,0,c.width,c.height);x.scale(k,k);x.drawImage(im,0,0);
    download(name+".png",c.toDataURL("image/png"));};
  im.onerror=function(){alert("PNG export failed; the SVG export still works");};
  im.src=url;
}
document.querySelectorAll("button.export").forEach(function(b){b.addEventListener("click",function(){
  exportView(b.closest("section").id,b.dataset.fmt);});});
// ---- fit the page to the window: the token box and the matrix take what is left, the readout stays above
function fit(){
  const box=document.getElementById("hvbox");
  if(box.offsetParent!==null){box.style.maxHeight=Math.max(160,innerHeight-box.getBoundingClientRect().top-16)+"px";}
  if(mat.offsetParent!==null){const s=Math.max(240,Math.min(640,innerHeight-mat.getBoundingClientRect().top-16));
    mat.style.width=s+"px";mat.style.height=s+"px";}
}
addEventListener("resize",function(){fit();drawLabels();});
show(N>D.matrix_first?"matrix":"head");
render();mrender();fit();drawLabels();
document.body.dataset.ready="1";
window.attnlabReadyMs=performance.now();
requestAnimationFrame(function(){requestAnimationFrame(function(){document.body.dataset.painted=String(performance.now());});});
})();
"""

_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>__TITLE__</title><style>__CSS__</style></head>
<body>
<header><h1>__TITLE__</h1>
<div class="meta">model: __MODEL__ · mechanism: __MECH__ · __SHAPE__ · __LAYERS__ layers × __HEADS__ heads · mode: __MODE__</div>
<div class="meta" id="textline">text: <span id="text">__TEXT__</span></div>
__NOTES__
</header>
<nav><button data-view="head">head view</button><button data-view="matrix">matrix view</button><button data-view="model">model view</button><button data-view="pattern">pattern view</button></nav>
<section id="head">
<div class="controls"><label>layer <select id="layer"></select></label><span id="chips"></span><button id="allheads">all heads</button><button class="export" data-fmt="svg" title="save this view as drawn now (SVG)">export SVG</button><button class="export" data-fmt="png" title="save this layer's heads shown as heatmaps: the figure attnlab.viz.save writes (PNG)">export PNG</button></div>
<div id="readout" class="readout"></div>
<div id="hvbox"><div id="hv"><div class="col q" id="qcol"></div><svg id="lines" width="170" height="18"></svg><div class="col k" id="kcol"></div></div></div>
</section>
<section id="matrix">
<div class="controls"><label>layer <select id="mlayer"></select></label><label>show <select id="mhead"></select></label>
<button id="zin" title="zoom in (or the mouse wheel)">zoom in</button><button id="zout">zoom out</button><button id="zreset">whole matrix</button>
<button id="zdiag" title="64 tokens at the top-left of the view, on the diagonal">diagonal close-up</button><button class="export" data-fmt="svg" title="save this view as drawn now (SVG)">export SVG</button><button class="export" data-fmt="png" title="save this layer's heads shown as heatmaps: the figure attnlab.viz.save writes (PNG)">export PNG</button></div>
<div id="mreadout" class="readout">move the pointer over the matrix (wheel: zoom, drag: pan, click: pin)</div>
<div id="mwrap"><div id="mgrid"><div></div><div id="mcols"></div><div id="mrows"></div><canvas id="mat"></canvas></div><div id="mside"><div class="meta" id="mview"></div><div class="meta" id="histtitle" style="margin:8px 0 4px"></div><div id="hists"></div></div></div>
</section>
<section id="model"><div class="controls"><button class="export" data-fmt="svg" title="save this view as drawn now (SVG)">export SVG</button><button class="export" data-fmt="png" title="save this view as drawn now (PNG)">export PNG</button></div><div class="meta">rows: layers, columns: heads (darker = more weight, each row scaled to its max). Click one to open it in the head view.</div><div class="grid" id="grid"></div></section>
<section id="pattern"><div class="controls"><button class="export" data-fmt="svg" title="save this view as drawn now (SVG)">export SVG</button><button class="export" data-fmt="png" title="save this view as drawn now (PNG)">export PNG</button></div><div class="meta">which (query, key) pairs take part; dark = computed</div><div id="patterns"></div></section>
<div id="tip"></div>
<script id="attn-data" type="application/json">__DATA__</script>
<script>__JS__</script>
</body></html>
"""

MATRIX_FIRST = 512  # inputs longer than this open on the matrix view


def _json_for_script(data: dict) -> str:
    """JSON safe inside <script>: no '<', '>' or '&' survives unescaped (so no '</script>' breakout)."""
    s = json.dumps(data, separators=(",", ":"), allow_nan=False)
    return s.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _shape_text(data: dict) -> str:
    T, S = int(data["T"]), int(data.get("S", data["T"]))
    if S == T and "key_tokens" not in data:
        return f"{T} tokens, causal" if data.get("causal") else f"{T} tokens"
    return f"cross-attention: {T} queries × {S} keys"


# Note [One export figure]: the page's "export PNG" on the head and matrix views draws, in the browser, the figure
# ``attnlab.viz.save`` (``plot_heads``) writes from Python: the layer's heads (those shown) as heatmaps, rows =
# queries, columns = keys, each head on matplotlib's viridis from 0 to its own maximum, with token ticks, axis
# names, a colour bar and a title. viridis travels in the page as matplotlib's own 256 colours, so both routes
# colour a weight alike (tests/instruments/test_browser_views.py compares the two). "export SVG" stays the view
# as drawn; the model and pattern views export as drawn in both formats.
@functools.lru_cache(maxsize=1)
def _viridis_hex() -> str:
    """matplotlib's viridis as 256 RRGGBB values in one string (what the page's PNG export colours with)."""
    import matplotlib

    rgb = matplotlib.colormaps["viridis"](range(256))[:, :3]
    return "".join(f"{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}" for r, g, b in rgb)


def render_page(data: dict) -> str:
    """The whole page as a string (see ``attnlab.viz.data.attention_data`` for ``data``)."""
    e = lambda s: html.escape(str(s), quote=True)  # noqa: E731
    notes = "".join(f'<div class="note">{e(n)}</div>' for n in data.get("notes", []))
    text = data["text"]
    if len(text) > 600:
        text = text[:600] + "…"
    rep = {"__TITLE__": e(data.get("title", "attnlab viz")), "__MODEL__": e(data["model"]),
           "__MECH__": e(data["mechanism"]), "__SHAPE__": _shape_text(data), "__LAYERS__": str(int(data["layers"])),
           "__HEADS__": str(int(data["heads"])), "__MODE__": e(data["mode"]), "__TEXT__": e(text),
           "__NOTES__": notes, "__CSS__": _CSS, "__JS__": _JS}
    rep["__DATA__"] = _json_for_script({**data, "palette": list(HEAD_COLOURS), "matrix_first": MATRIX_FIRST,
                                        "viridis": _viridis_hex()})
    # one pass: text inserted for one placeholder is never scanned for another
    return re.sub(r"__[A-Z]+__", lambda m: rep.get(m.group(0), m.group(0)), _HTML)


def write_page(out_dir, data: dict) -> Path:
    """Write ``out_dir/index.html`` atomically and return its path."""
    return atomic_write_text(Path(out_dir) / "index.html", render_page(data))
