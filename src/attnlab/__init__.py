"""attnlab: exact and efficient self-attention for PyTorch that you can see, trace, measure and scale."""
from . import cpu, patterns, reference
from .functional import METHODS, Plan, attention, attention_with_kvcache, attention_with_lse, empty_kv_cache, explain, merge_partials
from .functional.flex import FlexPlan, flex_attention, flex_plan
from .probe import AttentionProbe, probe
from .shapes import AttentionDtypeError, AttentionInputError



def _version() -> str:
    """The installed distribution's version (pyproject.toml's ``[project] version``, the one source);
    a source tree on ``PYTHONPATH`` without an install reads that pyproject.toml itself."""
    from importlib import metadata
    from pathlib import Path

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    if pyproject.is_file() and (pyproject.parent / "src" / "attnlab").is_dir():  # a source checkout
        import re

        m = re.search(r'(?m)^version\s*=\s*"([^"]+)"', pyproject.read_text())
        if m:
            return m.group(1)
    try:
        return metadata.version("attnlab")
    except metadata.PackageNotFoundError:
        return "0+unknown"


__version__ = _version()
__all__ = [
    "attention", "explain", "attention_with_lse", "attention_with_kvcache", "empty_kv_cache", "merge_partials", "Plan", "METHODS",
    "flex_attention", "flex_plan", "FlexPlan", "probe", "AttentionProbe", "patterns", "reference", "cpu", "AttentionInputError", "AttentionDtypeError",
]
