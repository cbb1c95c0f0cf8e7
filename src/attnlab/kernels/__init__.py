"""Attention kernels on 4-D tensors [N, H, L, E]; inputs are already validated by attnlab.functional."""
from .masks import MaskSpec

__all__ = ["MaskSpec"]
