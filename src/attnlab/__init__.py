"""attnlab: exact and efficient self-attention for PyTorch that you can see, trace, measure and scale."""
from . import cpu, patterns, reference
from .functional import METHODS, Plan, attention, attention_with_kvcache, attention_with_lse, explain, merge_partials
from .probe import AttentionProbe, probe
from .shapes import AttentionDtypeError, AttentionInputError

__version__ = "0.1.0"
__all__ = [
    "attention", "explain", "attention_with_lse", "attention_with_kvcache", "merge_partials", "Plan", "METHODS",
    "probe", "AttentionProbe", "patterns", "reference", "cpu", "AttentionInputError", "AttentionDtypeError",
]
