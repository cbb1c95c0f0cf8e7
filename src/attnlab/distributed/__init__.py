"""Ring attention on torch.distributed: exact attention over a sequence sharded across processes."""
from .launch import LocalRunError, RankResult, run_local
from .layout import LAYOUTS, chunk_sizes, gather_sequence, shard_segments, shard_sequence, unshard_sequence
from .ring import DEFAULT_BLOCK_SIZE, RingAttentionError, comm_stats, ring_attention

__all__ = [
    "ring_attention", "RingAttentionError", "DEFAULT_BLOCK_SIZE", "comm_stats",
    "shard_sequence", "gather_sequence", "unshard_sequence", "shard_segments", "chunk_sizes", "LAYOUTS",
    "run_local", "RankResult", "LocalRunError",
]
