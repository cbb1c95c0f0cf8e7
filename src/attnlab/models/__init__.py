"""Pretrained models running on attnlab's attention (checkpoint key names live only here)."""
from __future__ import annotations

from . import gguf, minilm

__all__ = ["gguf", "minilm"]
