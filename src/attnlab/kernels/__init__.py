"""Attention kernels on 4-D tensors [B, H, L, E] (B: leading dims flattened), inputs already validated
by ``attnlab.shapes.prepare``. Each kernel module declares its capabilities and cost as a
:class:`KernelSpec` (``SPEC``); ``KERNELS`` lists them in the order ``explain`` shows them.
"""
from . import compiled, dense, fused, sparse, tiled
from .extension import transformed
from .masks import MaskSpec
from .spec import KernelSpec, Request, Tiling

__all__ = ["MaskSpec", "KernelSpec", "Request", "Tiling", "KERNELS", "get", "transformed"]

#: every kernel's declaration, in explain's order (auto's preferences are the planner's rules)
KERNELS: tuple[KernelSpec, ...] = (dense.SPEC, fused.SPEC, tiled.SPEC, sparse.SPEC, compiled.SPEC)
_BY_NAME = {s.name: s for s in KERNELS}


def get(name: str) -> KernelSpec:
    """The declaration of kernel ``name`` ("dense", "sdpa", "tiled", "sparse", "compiled")."""
    if name not in _BY_NAME:
        raise ValueError(f"unknown kernel {name!r}; kernels: {', '.join(_BY_NAME)}")
    return _BY_NAME[name]
