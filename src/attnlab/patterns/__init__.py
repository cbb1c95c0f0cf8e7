"""Structured attention masks that materialise themselves, give a block layout and cost themselves.

A pattern is a predicate ``keep(i, j)`` over query positions i and key positions j (True = the pair
takes part), valid for any (L, S) without rebuilding. Passing ``pattern=p`` to ``attnlab.attention``
gives exactly what passing ``attn_mask=p.materialize(L, S)`` gives, but the kernels use
``block_layout`` to skip empty blocks and to drop the mask on full ones.

Block layouts are *conservative*: EMPTY blocks are truly empty and FULL blocks truly full; anything the
analytic bounds cannot decide is PARTIAL (computed with its mask), which is always correct.

Modules: ``base`` (Pattern, ``&`` / ``|``, ``shifted``, ``sliced_keys``), ``bands`` (causal, windows, prefix LM),
``blocks`` (block tables, fixed, Longformer, BigBird), ``sequences`` (key padding, packed documents),
``mask_mod`` (FlexAttention mask functions), ``block_mask`` (``create_block_mask`` without the L x S grid, torch
``BlockMask`` <-> patterns, ``adjust``, text pictures), ``intervals`` (mask_mods on intervals), ``spec`` (``parse``).
"""
from __future__ import annotations

from .bands import causal, dilated, full, prefix_lm, sliding_window, strided
from .base import EMPTY, FULL, MAX_INT, PARTIAL, Pattern, shifted, sliced_keys, translation_invariant
from .block_mask import (BlockMaskPattern, BuildStats, adjust, as_band, block_codes, block_mask_stats, block_mask_text, create_block_mask,
                         from_block_mask, to_block_mask, torch_layout)
from .blocks import BlockTable, bigbird, block_sparse, fixed, longformer
from .mask_mod import from_mask_mod
from .sequences import document, from_hf_attention_mask, from_key_padding_mask, key_padding
from .spec import MAX_PARSE_TERMS, parse

__all__ = [
    "Pattern", "BlockTable", "EMPTY", "PARTIAL", "FULL", "shifted", "sliced_keys", "translation_invariant",
    "causal", "sliding_window", "dilated", "strided", "fixed", "block_sparse", "longformer", "bigbird",
    "key_padding", "from_key_padding_mask", "from_hf_attention_mask", "full", "parse",
    "document", "prefix_lm", "from_mask_mod", "create_block_mask", "BlockMaskPattern", "BuildStats", "from_block_mask",
    "to_block_mask", "torch_layout", "adjust", "as_band", "block_codes", "block_mask_text", "block_mask_stats",
]
