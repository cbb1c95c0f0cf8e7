"""Attention kernels on 4-D tensors [B, H, L, E] (B: leading dims flattened), inputs already validated
by ``attnlab.shapes.prepare``. Each kernel module declares its capabilities as a :class:`KernelSpec`
(``SPEC``) and exposes one :class:`Kernel` object (``KERNEL``: capabilities, tiling, cost, run);
``KERNELS`` lists them in the order ``explain`` shows them.
"""
from . import compiled, decode, dense, fused, sparse, tiled
from .cacheview import CacheCall
from .extension import transformed
from .kernel import Cost, Declined, Kernel
from .masks import MaskSpec
from .spec import KernelSpec, Request, Tiling

__all__ = ["MaskSpec", "KernelSpec", "Kernel", "Cost", "Declined", "Request", "Tiling", "KERNELS", "get",
           "transformed", "CacheCall", "METHODS", "DENSE", "SDPA", "TILED", "SPARSE", "COMPILED", "DECODE", "LSE_ORDER", "FALLBACK_ORDER"]

DENSE, SDPA, TILED, SPARSE, COMPILED, DECODE = (dense.KERNEL, fused.KERNEL, tiled.KERNEL, sparse.KERNEL, compiled.KERNEL,
                                                decode.KERNEL)
#: every kernel, in explain's order (auto's preferences are the planner's rules)
KERNELS: tuple[Kernel, ...] = (DENSE, SDPA, TILED, SPARSE, COMPILED, DECODE)
#: the kernels that return a log-sum-exp, in attention_with_lse's order of preference
LSE_ORDER: tuple[Kernel, ...] = (SDPA, COMPILED, TILED)
#: auto's order among kernels its predicted times cannot tell apart; dense (the universal kernel, which
#: materialises L×S) last
FALLBACK_ORDER: tuple[Kernel, ...] = (SDPA, DECODE, COMPILED, TILED, SPARSE, DENSE)
_BY_NAME = {k.name: k for k in KERNELS}
#: every kernel's name (``attnlab.attention(method=...)`` also takes "auto")
METHODS: tuple[str, ...] = tuple(_BY_NAME)


def get(name: str) -> Kernel:
    """Kernel ``name`` ("dense", "sdpa", "tiled", "sparse", "compiled", "decode")."""
    if name not in _BY_NAME:
        raise ValueError(f"unknown kernel {name!r}; kernels: {', '.join(_BY_NAME)}")
    return _BY_NAME[name]
