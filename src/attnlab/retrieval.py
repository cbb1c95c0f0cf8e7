"""Attention as retrieval: hard lookup, top-k and softmax(q·Kᵀ/τ)·V over an embedded sentence corpus.

The tutorial's database analogy, made runnable (Vaswani et al. 2017 §3.2; dense retrieval as in
Karpukhin et al. 2020). A corpus of sentences is embedded once; its embeddings are the keys K and the
values V. A query q is answered three ways:

    hard lookup   i* = argmax_i q·k_i                      -> v_{i*}
    top-k         the k largest q·k_i, ranked               -> k entries and their scores
    soft          w = softmax(q·Kᵀ / τ),  out = w·V         -> a weighted mix of every value

As τ → 0 the soft answer becomes the hard one (w → one-hot on i*), as τ → ∞ it becomes the mean of V
(w → 1/n). The entropy H(w) and the effective number of entries exp(H) show where in between a τ sits.
A learned projection (W_Q, W_K, fitted by gradient descent on a few labelled query–answer pairs) changes
the matching space: scores become (q W_Q)(K W_K)ᵀ.

Legend: n corpus size, d embedding dim, d_k projected (matching) dim, m number of queries.
"""
from __future__ import annotations

import functools
import hashlib
import math
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from .functional import attention
from .models import minilm
from .report import atomic_write_json
from .resources import output_dir

__all__ = [
    "CorpusEntry", "Corpus", "generate_corpus", "labelled_queries", "RELATIONS",
    "Embedder", "hashing_embedder", "minilm_embedder", "get_embedder", "EMBEDDERS",
    "hard_lookup", "topk_lookup", "soft_lookup", "weight_stats", "temperature_sweep",
    "Projection", "fit_projection", "retrieval_accuracy", "RetrievalResult", "retrieve", "RetrieveConfig",
    "run_retrieve", "DEFAULT_QUERY",
]


# -- 1) the corpus: a template generator, deterministic for a seed (no download) --------------------
NAMES = (
    "Alice", "Bruno", "Chiara", "Dmitri", "Elena", "Farid", "Greta", "Hiroshi", "Ines", "Jonas",
    "Kavya", "Lars", "Maya", "Nikolai", "Olga", "Pedro", "Quinn", "Rosa", "Samir", "Tessa",
    "Umar", "Vera", "Wiktor", "Ximena", "Yusuf", "Zofia", "Amara", "Bjorn", "Celine", "Diego",
    "Esther", "Felix", "Gabriel", "Hana", "Ivan", "Julia", "Kenji", "Leila", "Marco", "Nadia",
    "Oscar", "Priya", "Rafael", "Sofia", "Tomas", "Ursula", "Viktor", "Wen",
)
_VALUES = {
    "lives": ("Lisbon", "Oslo", "Nairobi", "Kyoto", "Lima", "Toronto", "Cairo", "Hanoi", "Zurich", "Perth",
              "Seville", "Krakow"),
    "job": ("pilot", "nurse", "carpenter", "lawyer", "baker", "chemist", "librarian", "plumber", "architect",
            "journalist", "dentist", "farmer"),
    "pet": ("cat", "parrot", "tortoise", "rabbit", "dog", "goldfish", "hamster", "lizard", "ferret", "horse"),
    "food": ("pasta", "sushi", "curry", "dumplings", "tacos", "risotto", "falafel", "pancakes", "paella",
             "ramen"),
    "instrument": ("violin", "piano", "cello", "trumpet", "guitar", "flute", "drums", "harp", "saxophone",
                   "clarinet"),
    "hobby": ("hiking", "sailing", "climbing", "cycling", "fishing", "skiing", "surfing", "running", "rowing",
              "camping"),
}
RELATIONS: tuple[str, ...] = tuple(_VALUES)
# several phrasings per relation so that sentences of one relation do not share every word
_FACT_TEMPLATES = {
    "lives": ("{name} lives in {value}.", "{name} moved to {value} years ago and still lives there.",
              "Home for {name} is a flat in {value}."),
    "job": ("{name} works as {a} {value}.", "By profession, {name} is {a} {value}.",
            "{name} has been employed as {a} {value} for a decade."),
    "pet": ("{name} has a pet {value}.", "{name} keeps {a} {value} at home.", "{name} looks after {a} {value}."),
    "food": ("{name}'s favourite food is {value}.", "{name} loves eating {value}.",
             "Given the choice, {name} orders {value}."),
    "instrument": ("{name} plays the {value}.", "{name} practises the {value} every evening.",
                   "{name} learned to play the {value} as a child."),
    "hobby": ("On weekends {name} goes {value}.", "{name} spends free time {value}.",
              "{name}'s favourite pastime is {value}."),
}
# direct questions: their words point at the relation, so raw similarity already finds the answer
QUESTION_TEMPLATES = {
    "lives": "Where does {name} live?",
    "job": "What is {name}'s profession?",
    "pet": "Which animal does {name} keep at home?",
    "food": "What does {name} like to eat?",
    "instrument": "Which instrument does {name} play?",
    "hobby": "What does {name} do on weekends?",
    # an open question with no relation word: which of the person's sentences answers it is a convention,
    # learned from labelled pairs (the task the projection is fitted on; the answer relation is ``target``)
    "profile": "Tell me about {name}.",
}
DEFAULT_TARGET = "hobby"


@dataclass(frozen=True)
class CorpusEntry:
    """One fact sentence: ``text`` states that ``subject``'s ``relation`` (one of RELATIONS) is ``value``."""
    text: str
    subject: str
    relation: str
    value: str


@dataclass(frozen=True)
class Corpus:
    """The generated fact sentences, in shuffled order (row i of the key matrix embeds ``entries[i]``),
    and the seed that generated them. ``len(corpus)`` is the number of entries n."""
    entries: tuple[CorpusEntry, ...]
    seed: int

    @property
    def texts(self) -> list[str]:
        """The n sentences, in entry order (what the embedder turns into keys [n, d])."""
        return [e.text for e in self.entries]

    @property
    def subjects(self) -> list[str]:
        """The distinct subjects (people), in NAMES order."""
        return sorted({e.subject for e in self.entries}, key=NAMES.index)

    def __len__(self) -> int:
        return len(self.entries)

    def index(self, subject: str, relation: str) -> int:
        """Position of ``subject``'s ``relation`` sentence in ``entries``; KeyError if there is none."""
        for i, e in enumerate(self.entries):
            if e.subject == subject and e.relation == relation:
                return i
        raise KeyError(f"no entry for subject={subject!r}, relation={relation!r}")


def generate_corpus(num_subjects: int = 48, seed: int = 0) -> Corpus:
    """``num_subjects`` people x 6 relations (``RELATIONS``) = 6·num_subjects fact sentences.

    Each person gets one sentence per relation with a randomly drawn value and phrasing; entries are
    shuffled so that position carries no information. Deterministic for a given ``seed``."""
    if not isinstance(num_subjects, int) or not 1 <= num_subjects <= len(NAMES):
        raise ValueError(f"num_subjects must be an int in [1, {len(NAMES)}], got {num_subjects!r}")
    rng = random.Random(seed)
    entries = []
    for name in NAMES[:num_subjects]:
        for rel in RELATIONS:
            value = rng.choice(_VALUES[rel])
            template = rng.choice(_FACT_TEMPLATES[rel])
            article = "an" if value[0] in "aeiou" else "a"
            entries.append(CorpusEntry(template.format(name=name, value=value, a=article), name, rel, value))
    rng.shuffle(entries)
    return Corpus(tuple(entries), seed)


def labelled_queries(corpus: Corpus, relation: str, subjects: Sequence[str] | None = None,
                     target: str = DEFAULT_TARGET) -> tuple[list[str], list[int]]:
    """Questions of one kind (a key of ``QUESTION_TEMPLATES``) and the index of the entry answering each;
    "profile" questions are answered by the subject's ``target`` sentence."""
    if relation not in QUESTION_TEMPLATES:
        raise ValueError(f"relation must be one of {sorted(QUESTION_TEMPLATES)}, got {relation!r}")
    if target not in RELATIONS:
        raise ValueError(f"target must be one of {list(RELATIONS)}, got {target!r}")
    target = target if relation == "profile" else relation
    subjects = list(corpus.subjects if subjects is None else subjects)
    queries = [QUESTION_TEMPLATES[relation].format(name=s) for s in subjects]
    answers = [corpus.index(s, target) for s in subjects]
    return queries, answers


# -- 2) embedders: texts -> L2-normalised rows [m, d]; swap freely -----------------------------------
Embedder = Callable[[Sequence[str]], torch.Tensor]


_STOPWORDS = frozenset("a an the is as of to in at for and does do did what which where who s".split())


def _stem(word: str) -> str:
    """Crude plural / third-person stemming: "plays" -> "play", "lives" -> "live" (not "class")."""
    return word[:-1] if len(word) > 3 and word.endswith("s") and not word.endswith("ss") else word


def hashing_embedder(dim: int = 1024) -> Embedder:
    """A bag-of-words embedder with no weights: each lower-cased word outside a short stop list (and each
    such word bigram, after stripping a plural "s") is hashed (md5, stable across runs) to a bucket and a sign; rows are L2-normalised.
    Matches on shared words only — the "superficial similarity" a learned projection is meant to go
    beyond. A stand-in for MiniLM in fast tests; rows with no word left are zero."""
    if not isinstance(dim, int) or dim < 8:
        raise ValueError(f"dim must be an int >= 8, got {dim!r}")

    def bucket(token: str) -> tuple[int, float]:
        h = int.from_bytes(hashlib.md5(token.encode()).digest()[:8], "little")
        return h % dim, 1.0 if (h >> 63) & 1 else -1.0

    def embed(texts: Sequence[str]) -> torch.Tensor:
        texts = _check_texts(texts)
        out = torch.zeros(len(texts), dim)  # (m, d)
        for row, text in enumerate(texts):
            words = [_stem(w) for w in re.findall(r"[a-z0-9]+", text.lower()) if w not in _STOPWORDS]
            for tok in words + [a + "_" + b for a, b in zip(words, words[1:])]:
                j, s = bucket(tok)
                out[row, j] += s
        return torch.nn.functional.normalize(out, dim=-1)

    embed.name = f"hashing(dim={dim})"  # type: ignore[attr-defined]
    return embed


@functools.lru_cache(maxsize=2)
def _minilm_model(mechanism: str):
    return minilm.load(mechanism=mechanism)


def minilm_embedder(mechanism: str = "auto", batch_size: int = 32) -> Embedder:
    """all-MiniLM-L6-v2 sentence embeddings (384-d, mean pooled, L2-normalised) from
    ``attnlab.models.minilm`` — the model loads once per process, from the installed package (no download)."""

    def embed(texts: Sequence[str]) -> torch.Tensor:
        texts = _check_texts(texts)
        with torch.no_grad():
            e = _minilm_model(mechanism).encode(texts, batch_size=batch_size)  # (m, 384)
        return torch.nn.functional.normalize(e.detach().float(), dim=-1)

    embed.name = f"minilm(mechanism={mechanism})"  # type: ignore[attr-defined]
    return embed


EMBEDDERS: dict[str, Callable[[], Embedder]] = {"minilm": minilm_embedder, "hashing": hashing_embedder}


def get_embedder(name: str | Embedder) -> Embedder:
    """``"minilm"`` (default of the CLI), ``"hashing"``, or any callable texts -> [m, d]."""
    if callable(name):
        return name
    if name not in EMBEDDERS:
        raise ValueError(f"embedder must be one of {sorted(EMBEDDERS)} or a callable, got {name!r}")
    return EMBEDDERS[name]()


def _check_texts(texts) -> list[str]:
    if isinstance(texts, str):
        texts = [texts]
    texts = list(texts)
    if not texts or not all(isinstance(t, str) for t in texts):
        raise TypeError("texts must be a non-empty list of str")
    return texts


# -- 3) three ways to answer a query ------------------------------------------------------------------
def _check_qk(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor | None = None) -> None:
    if query.dim() != 1 or keys.dim() != 2 or query.shape[0] != keys.shape[1]:
        raise ValueError(f"query must be [d] and keys [n, d] with the same d; got query {tuple(query.shape)}, "
                         f"keys {tuple(keys.shape)}")
    if values is not None and (values.dim() != 2 or values.shape[0] != keys.shape[0]):
        raise ValueError(f"values must be [n, dv] with n = keys.shape[0] = {keys.shape[0]}; "
                         f"got {tuple(values.shape)}")


def hard_lookup(query: torch.Tensor, keys: torch.Tensor) -> tuple[int, float]:
    """The database: the one entry whose key has the largest dot product with the query.
    query: [d], keys: [n, d] -> (index, score). Equivalent to ``int((keys @ query).argmax())``."""
    _check_qk(query, keys)
    scores = keys @ query  # (n,)
    i = int(scores.argmax())
    return i, float(scores[i])


def topk_lookup(query: torch.Tensor, keys: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
    """Dense retrieval: the k entries with the largest dot products, best first.
    query: [d], keys: [n, d] -> (k indices, k scores). Equivalent to ``torch.topk(keys @ query, k)``;
    raises ValueError unless 1 <= k <= n."""
    _check_qk(query, keys)
    if not isinstance(k, int) or not 1 <= k <= keys.shape[0]:
        raise ValueError(f"k must be an int in [1, n={keys.shape[0]}], got {k!r}")
    s, idx = torch.topk(keys @ query, k)  # (k,), (k,)
    return idx.tolist(), s.tolist()


def soft_lookup(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tau: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the corpus: w = softmax(q·Kᵀ/τ), out = w·V, via ``attnlab.attention`` with
    scale = 1/τ. query: [d], keys: [n, d], values: [n, dv] -> (out [dv], weights [n]). Cost O(n·d)."""
    _check_qk(query, keys, values)
    if not isinstance(tau, (int, float)) or not math.isfinite(tau) or tau <= 0:
        raise ValueError(f"tau must be a finite float > 0, got {tau!r}")
    out, w = attention(query[None], keys, values, scale=1.0 / tau, need_weights=True, method="dense")
    return out[0], w[0]  # (dv,), (n,)


def weight_stats(weights: torch.Tensor) -> dict:
    """How spread a weight vector is: entropy H (nats), effective number of entries exp(H) (1 for a
    one-hot, n for uniform), inverse participation 1/Σw², and the largest weight."""
    w = weights.double().clamp_min(0)
    h = float(-(w * torch.log(w.clamp_min(1e-300))).sum())
    return {"entropy": h, "effective_entries": math.exp(h), "participation": float(1.0 / (w * w).sum()),
            "max_weight": float(w.max())}


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0))


def temperature_sweep(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      taus: Sequence[float]) -> list[dict]:
    """For each τ: weight statistics, and how close the soft answer is to the hard answer and to the
    mean of the values (cosine and Euclidean distance)."""
    i_hard, _ = hard_lookup(query, keys)
    hard, mean = values[i_hard], values.mean(0)
    rows = []
    for tau in taus:
        out, w = soft_lookup(query, keys, values, float(tau))
        rows.append({"tau": float(tau), **weight_stats(w),
                     "cos_to_hard": _cos(out, hard), "cos_to_mean": _cos(out, mean),
                     "dist_to_hard": float((out - hard).norm()), "dist_to_mean": float((out - mean).norm()),
                     "argmax": int(w.argmax())})
    return rows


# -- 4) a learned matching space: scores = (q W_Q)(K W_K)ᵀ -------------------------------------------
@dataclass
class Projection:
    """W_Q = I + A_Q B_Q and W_K = I + A_K B_K, each [d, d] (A: [d, rank], B: [rank, d]); with B = 0 this is
    raw dot-product matching. Applied in factored form, O(d·rank) per vector."""
    a_q: torch.Tensor
    b_q: torch.Tensor
    a_k: torch.Tensor
    b_k: torch.Tensor
    losses: list[float] = field(default_factory=list)

    @property
    def w_q(self) -> torch.Tensor:
        """W_Q = I + A_Q B_Q, materialised: [d, d]."""
        return torch.eye(self.a_q.shape[0]) + self.a_q @ self.b_q  # (d, d)

    @property
    def w_k(self) -> torch.Tensor:
        """W_K = I + A_K B_K, materialised: [d, d]."""
        return torch.eye(self.a_k.shape[0]) + self.a_k @ self.b_k  # (d, d)

    def queries(self, q: torch.Tensor) -> torch.Tensor:
        """q [..., d] -> q W_Q [..., d], in factored form (O(d·rank) per row, W_Q never built)."""
        return q + (q @ self.a_q) @ self.b_q  # (..., d) = q W_Q

    def keys(self, k: torch.Tensor) -> torch.Tensor:
        """k [n, d] -> K W_K [n, d], in factored form (O(d·rank) per row, W_K never built)."""
        return k + (k @ self.a_k) @ self.b_k  # (n, d) = K W_K


def fit_projection(queries: torch.Tensor, keys: torch.Tensor, answers: Sequence[int], *, rank: int = 1,
                   steps: int = 60, lr: float = 0.01, tau: float = 0.05, seed: int = 0) -> Projection:
    """Fit W_Q = I + A_Q B_Q and W_K = I + A_K B_K (A: [d, rank], B: [rank, d]) by gradient descent (Adam)
    on labelled pairs: minimise the cross-entropy of softmax((q W_Q)(K W_K)ᵀ/τ) against the answer index —
    the attention weights read as a classifier over the corpus. queries: [m, d], keys: [n, d], answers: m
    indices into keys. B starts at 0, so step 0 is raw dot-product matching. A low rank keeps a handful of
    pairs from being memorised: higher ranks fit the training pairs as well but learn each training subject
    rather than the convention, and held-out accuracy falls (docs/retrieval-and-layers.md)."""
    if queries.dim() != 2 or keys.dim() != 2 or queries.shape[1] != keys.shape[1]:
        raise ValueError(f"queries must be [m, d] and keys [n, d]; got {tuple(queries.shape)}, "
                         f"{tuple(keys.shape)}")
    answers_t = torch.as_tensor(list(answers), dtype=torch.long)
    if answers_t.shape != (queries.shape[0],) or (answers_t < 0).any() or (answers_t >= keys.shape[0]).any():
        raise ValueError(f"answers must be {queries.shape[0]} indices in [0, {keys.shape[0]}), got {answers!r}")
    d = queries.shape[1]
    if not isinstance(rank, int) or not 1 <= rank <= d:
        raise ValueError(f"rank must be an int in [1, d={d}], got {rank!r}")
    if not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be an int >= 0, got {steps!r}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
    gen = torch.Generator().manual_seed(seed)
    a_q = (0.01 * torch.randn(d, rank, generator=gen)).requires_grad_()  # (d, rank)
    a_k = (0.01 * torch.randn(d, rank, generator=gen)).requires_grad_()
    b_q = torch.zeros(rank, d, requires_grad=True)  # (rank, d)
    b_k = torch.zeros(rank, d, requires_grad=True)
    params = [a_q, b_q, a_k, b_k]
    proj = Projection(*params)
    # Adam (Kingma & Ba 2015), written out: torch.optim's first construction imports torch._dynamo, seconds
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    m1 = [torch.zeros_like(p) for p in params]
    m2 = [torch.zeros_like(p) for p in params]
    losses = []
    for step in range(steps + 1):
        scores = proj.queries(queries) @ proj.keys(keys).T / tau  # (m, n)
        loss = torch.nn.functional.cross_entropy(scores, answers_t)
        losses.append(float(loss.detach()))
        if not math.isfinite(losses[-1]):  # a diverged fit would report the accuracy of NaN scores
            raise ValueError(f"fitting the projection diverged: the loss is {losses[-1]} at step {step} with "
                             f"lr={lr:g}, tau={tau:g}; use a smaller lr")
        if step == steps:
            break
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for p, g, u, v in zip(params, grads, m1, m2):
                u.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                u_hat, v_hat = u / (1 - beta1 ** (step + 1)), v / (1 - beta2 ** (step + 1))
                p.sub_(lr * u_hat / (v_hat.sqrt() + eps))
    return Projection(a_q.detach(), b_q.detach(), a_k.detach(), b_k.detach(), losses)


def retrieval_accuracy(queries: torch.Tensor, keys: torch.Tensor, answers: Sequence[int],
                       projection: Projection | None = None) -> dict:
    """Top-1 accuracy and mean rank (1 = best) of the labelled answer under raw or projected matching.
    queries: [m, d], keys: [n, d], answers: m indices into keys -> {"top1", "mean_rank", "n"}. Ties with
    the answer's score do not count against it. Cost O(m·n·d)."""
    if projection is not None:
        queries, keys = projection.queries(queries), projection.keys(keys)
    scores = queries @ keys.T  # (m, n)
    ans = torch.as_tensor(list(answers), dtype=torch.long)
    target = scores.gather(1, ans[:, None])  # (m, 1)
    rank = (scores > target).sum(1) + 1  # (m,)
    return {"top1": float((rank == 1).double().mean()), "mean_rank": float(rank.double().mean()),
            "n": int(ans.numel())}


# -- 5) everything at once --------------------------------------------------------------------------
@dataclass
class RetrievalResult:
    """What :func:`retrieve` found for one query, JSON-ready: the corpus entries, the hard, top-k and soft
    answers (soft: the ``show`` largest weights, the rest's total weight, weight statistics, every weight
    and score), the τ sweep, and with ``learn`` the fitted projection's accuracies (train, held-out,
    direct questions; raw vs learned) and its answers to the query."""
    query: str
    embedder: str
    corpus: list[dict]
    tau: float
    k: int
    hard: dict
    topk: list[dict]
    soft: dict
    sweep: list[dict]
    projection: dict | None
    files: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """The result as a JSON-able dict; the corpus is reduced to its size (``corpus_size``)."""
        return {"query": self.query, "embedder": self.embedder, "corpus_size": len(self.corpus),
                "tau": self.tau, "k": self.k, "hard": self.hard, "topk": self.topk, "soft": self.soft,
                "sweep": self.sweep, "projection": self.projection, "files": self.files}


def default_taus(num: int = 19) -> list[float]:
    """Log-spaced from 1e-3 to 1e2 (scores of unit vectors lie in [-1, 1])."""
    return [float(t) for t in torch.logspace(-3, 2, num, dtype=torch.float64)]


def retrieve(query: str, *, embedder: str | Embedder = "minilm", num_subjects: int = 48, seed: int = 0,
             tau: float = 0.05, k: int = 5, taus: Sequence[float] | None = None, learn: bool = True,
             target: str = DEFAULT_TARGET, train_subjects: int = 8, rank: int = 1, steps: int = 60,
             lr: float = 0.01, show: int = 12,
             progress: Callable[[str], None] | None = None) -> RetrievalResult:
    """Embed a generated corpus, answer ``query`` hard / top-k / soft, sweep τ, and (``learn``) fit a
    projection on ``train_subjects`` labelled "Tell me about X." -> "X's ``target`` sentence" pairs, then
    compare raw and projected matching on held-out subjects and on ``query``."""
    if not isinstance(query, str) or not query.strip():
        raise ValueError(f"query must be a non-empty string, got {query!r}")
    if not isinstance(show, int) or show < 1:
        raise ValueError(f"show must be an int >= 1, got {show!r}")
    note = progress or (lambda msg: None)
    corpus = generate_corpus(num_subjects, seed)
    if not 1 <= k <= len(corpus):
        raise ValueError(f"k must be in [1, corpus size {len(corpus)}], got {k!r}")
    if isinstance(embedder, str):
        note(f"loading the {embedder} embedder")
    embed = get_embedder(embedder)
    note(f"embedding {len(corpus)} sentences with {getattr(embed, 'name', 'a custom embedder')}")
    keys = embed(corpus.texts)  # (n, d) — keys and values are the same embeddings
    values = keys
    q = embed([query])[0]  # (d,)
    entries = [{"index": i, "text": e.text, "subject": e.subject, "relation": e.relation}
               for i, e in enumerate(corpus.entries)]

    # 1) hard, 2) top-k, 3) soft
    i_hard, s_hard = hard_lookup(q, keys)
    top_idx, top_s = topk_lookup(q, keys, k)
    out, w = soft_lookup(q, keys, values, tau)
    order = torch.argsort(w, descending=True)[:show].tolist()
    nearest = int((values @ out).argmax())
    soft = {"weights": [{"index": i, "weight": float(w[i]), "score": float(keys[i] @ q),
                         "text": corpus.entries[i].text} for i in order],
            "rest_weight": float(1 - w[order].sum()), **weight_stats(w),
            "cos_to_hard": _cos(out, values[i_hard]), "cos_to_mean": _cos(out, values.mean(0)),
            "nearest_entry": nearest, "nearest_text": corpus.entries[nearest].text,
            "all_weights": w.tolist(), "all_scores": (keys @ q).tolist()}
    sweep = temperature_sweep(q, keys, values, taus if taus is not None else default_taus())

    projection = None
    if learn:
        subjects = corpus.subjects
        if not 1 <= train_subjects < len(subjects):
            raise ValueError(f"train_subjects must be in [1, {len(subjects) - 1}] (some must be held out), "
                             f"got {train_subjects!r}")
        rng = random.Random(seed + 1)
        shuffled = subjects[:]
        rng.shuffle(shuffled)
        train, held = shuffled[:train_subjects], shuffled[train_subjects:]
        tq_text, t_ans = labelled_queries(corpus, "profile", train, target)
        hq_text, h_ans = labelled_queries(corpus, "profile", held, target)
        note(f"fitting W_Q, W_K on {len(train)} labelled pairs ({steps} steps)")
        tq, hq = embed(tq_text), embed(hq_text)  # (m, d)
        proj = fit_projection(tq, keys, t_ans, rank=rank, steps=steps, lr=lr, seed=seed)
        # direct questions about the held-out subjects: does the projection keep what raw matching did well?
        dq_text, d_ans = [], []
        for rel in RELATIONS:
            a, b = labelled_queries(corpus, rel, held)
            dq_text += a
            d_ans += b
        dq = embed(dq_text)
        pq, pk = proj.queries(q), proj.keys(keys)  # (d_k,), (n, d_k)
        p_top, p_s = topk_lookup(pq, pk, k)
        p_out, p_w = soft_lookup(pq, pk, values, tau)
        projection = {
            "task": f"'{QUESTION_TEMPLATES['profile']}' -> the subject's {target} sentence", "target": target,
            "train_subjects": train, "heldout_subjects": len(held), "rank": rank, "steps": steps, "lr": lr,
            "loss_first": proj.losses[0], "loss_last": proj.losses[-1], "losses": proj.losses,
            "train": {"raw": retrieval_accuracy(tq, keys, t_ans), "learned": retrieval_accuracy(tq, keys, t_ans, proj)},
            "heldout": {"raw": retrieval_accuracy(hq, keys, h_ans), "learned": retrieval_accuracy(hq, keys, h_ans, proj)},
            "direct_questions": {"raw": retrieval_accuracy(dq, keys, d_ans),
                                 "learned": retrieval_accuracy(dq, keys, d_ans, proj)},
            "query_topk": [{"index": i, "score": s, "text": corpus.entries[i].text} for i, s in zip(p_top, p_s)],
            "query_soft": {"nearest_entry": int((values @ p_out).argmax()), **weight_stats(p_w)},
            "query_weights_raw": w.tolist(), "query_weights_learned": p_w.tolist(),
        }
    return RetrievalResult(
        query=query, embedder=getattr(embed, "name", "custom"), corpus=entries, tau=float(tau), k=k,
        hard={"index": i_hard, "score": s_hard, "text": corpus.entries[i_hard].text},
        topk=[{"index": i, "score": s, "text": corpus.entries[i].text} for i, s in zip(top_idx, top_s)],
        soft=soft, sweep=sweep, projection=projection)


DEFAULT_QUERY = "Tell me about Maya."


@dataclass
class RetrieveConfig:
    """One ``attnlab retrieve`` run: the query, the corpus (``num_subjects`` people, 6 sentences each,
    from ``seed``), the lookup (τ, k, the ``show`` largest weights kept), the learned projection
    (``learn``; ``train_subjects`` labelled pairs answering with the ``target`` sentence, rank, steps, lr)
    and the folder for retrieve.json and retrieve.png. See :func:`retrieve`."""

    query: str = DEFAULT_QUERY
    embedder: str | Embedder = "minilm"
    num_subjects: int = 48
    seed: int = 0
    tau: float = 0.05
    k: int = 5
    learn: bool = True
    target: str = DEFAULT_TARGET
    train_subjects: int = 8
    rank: int = 1
    steps: int = 60
    lr: float = 0.01
    show: int = 10
    out: str | Path = "reports/retrieve"


def run_retrieve(config: RetrieveConfig, progress: Callable[[str], None] | None = None) -> RetrievalResult:
    """:func:`retrieve` as ``config`` says, then write retrieve.png and retrieve.json (atomically) into
    ``config.out``; the result, with ``files`` naming both."""
    from .viz.retrieval import plot_retrieval  # defers matplotlib (viz) to the run that writes the PNG

    c = config
    out = output_dir(c.out)
    result = retrieve(c.query, embedder=c.embedder, num_subjects=c.num_subjects, seed=c.seed, tau=c.tau, k=c.k,
                      learn=c.learn, target=c.target, train_subjects=c.train_subjects, rank=c.rank, steps=c.steps,
                      lr=c.lr, show=c.show, progress=progress)
    if progress is not None:
        progress(f"writing {out / 'retrieve.png'} and retrieve.json")
    result.files["png"] = str(plot_retrieval(result, out / "retrieve.png"))
    result.files["json"] = str(out / "retrieve.json")
    atomic_write_json(out / "retrieve.json", result.to_dict())
    return result
