"""Ring attention across the ranks of a job: shard one sequence, attend across ranks, check against one process.

    torchrun --standalone --nproc-per-node 4 -m attnlab.cli.ring_demo --seq-len 4096 --causal

``run_ring_demo`` is the work on one rank (the command line above parses the options and prints each
rank's report). Uses NCCL and one GPU per rank when CUDA is available, gloo on CPU otherwise. Every rank
builds the same full inputs from one seed (only to check the result), takes its shard, runs
ring_attention forward and backward, and compares its rows of the output and gradients with PyTorch
SDPA over the whole sequence (``check=False`` skips that for sequences one process cannot hold).
"""
from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .layout import LAYOUTS, shard_sequence
from .ring import ring_attention

__all__ = ["RingDemoConfig", "run_ring_demo"]


@dataclass
class RingDemoConfig:
    """The demo's sizes: query, key, value [batch, heads, seq_len, head_dim] split across the ranks with
    ``layout``; ``causal`` masking; ``check`` against SDPA in one process; the process group's timeout."""

    seq_len: int = 4096
    batch: int = 1
    heads: int = 4
    head_dim: int = 64
    layout: str = "zigzag"
    causal: bool = False
    check: bool = True
    timeout: float = 120.0

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        for name in ("seq_len", "batch", "heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def run_ring_demo(config: RingDemoConfig) -> dict:
    """Run the demo on this rank (under torchrun) and return its report.

    Every rank builds the same seeded query, key, value and output gradient [B, H, n, E], shards them
    with ``config.layout``, runs ``ring_attention`` forward and backward on its shard, and (with
    ``config.check``) compares its rows of the output and of dq, dk, dv with PyTorch SDPA over the whole
    sequence. Returns {rank, world, backend, local_len, seconds, max_abs_error: {out, dq, dk, dv}}.
    Joins the process group from torchrun's environment and destroys it on the way out.
    """
    args = config
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda") if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        B, H, n, E = args.batch, args.heads, args.seq_len, args.head_dim
        g = torch.Generator(device=device).manual_seed(0)
        full = [torch.randn(B, H, n, E, generator=g, device=device) for _ in range(4)]  # q, k, v, dO
        q, k, v = (shard_sequence(x, layout=args.layout).clone().requires_grad_() for x in full[:3])
        grad_out = shard_sequence(full[3], layout=args.layout)
        t0 = time.perf_counter()
        out = ring_attention(q, k, v, is_causal=args.causal, layout=args.layout)
        out.backward(grad_out)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        errors = {}
        if args.check:
            fq, fk, fv = (x.clone().requires_grad_() for x in full[:3])
            ref = F.scaled_dot_product_attention(fq, fk, fv, is_causal=args.causal)
            ref.backward(full[3])
            for name, a, b in (("out", out, ref), ("dq", q.grad, fq.grad), ("dk", k.grad, fk.grad),
                               ("dv", v.grad, fv.grad)):
                errors[name] = float((a.detach() - shard_sequence(b.detach(), layout=args.layout)).abs().max())
        report = dict(rank=rank, world=world, backend=dist.get_backend(), local_len=q.shape[2],
                      seconds=round(seconds, 4), max_abs_error=errors)
        return report
    finally:
        dist.destroy_process_group()
