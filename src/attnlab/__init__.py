"""attnlab: exact and efficient self-attention for PyTorch that you can see, trace, measure and scale."""
from . import cpu, patterns, reference
from .functional import METHODS, Plan, attention, attention_with_kvcache, attention_with_lse, empty_kv_cache, explain, merge_partials
from .functional.flex import FlexPlan, flex_attention, flex_plan
from .probe import AttentionProbe, probe
from .shapes import AttentionDtypeError, AttentionInputError
from .version import __version__

__all__ = [
    "attention", "explain", "attention_with_lse", "attention_with_kvcache", "empty_kv_cache", "merge_partials", "Plan", "METHODS",
    "flex_attention", "flex_plan", "FlexPlan", "probe", "AttentionProbe", "patterns", "reference", "cpu", "AttentionInputError", "AttentionDtypeError",
]
