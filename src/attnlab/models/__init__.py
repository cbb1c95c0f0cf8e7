"""Pretrained models running on attnlab's attention (checkpoint key names live only here)."""
from __future__ import annotations

from . import minilm

__all__ = ["minilm"]
