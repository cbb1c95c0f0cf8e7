"""Ring attention under torchrun: shard one sequence, attend across ranks, check against one process.

    torchrun --standalone --nproc-per-node 4 -m attnlab.distributed.demo --seq-len 4096 --causal

Uses NCCL and one GPU per rank when CUDA is available, gloo on CPU otherwise. Every rank builds the
same full inputs from one seed (only to check the result), takes its shard, runs ring_attention
forward and backward, and compares its rows of the output and gradients with PyTorch SDPA over the
whole sequence (``--no-check`` skips that for sequences one process cannot hold).
"""
from __future__ import annotations

import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .layout import LAYOUTS, shard_sequence
from .ring import ring_attention


def main(argv: list[str] | None = None) -> dict:
    """Run the demo on this rank (under torchrun) and return its report; ``argv`` as on the command line.

    Every rank builds the same seeded query, key, value and output gradient [B, H, n, E], shards them
    with ``--layout``, runs ``ring_attention`` forward and backward on its shard, and (unless
    ``--no-check``) compares its rows of the output and of dq, dk, dv with PyTorch SDPA over the whole
    sequence. Returns {rank, world, backend, local_len, seconds, max_abs_error: {out, dq, dk, dv}} and
    prints it (this is a script's entry point). Destroys the process group on the way out.
    """
    p = argparse.ArgumentParser(prog="python -m attnlab.distributed.demo", description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layout", choices=LAYOUTS, default="zigzag")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--no-check", action="store_true", help="skip the single-process comparison")
    p.add_argument("--timeout", type=float, default=120.0, help="process group timeout (s)")
    args = p.parse_args(argv)

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
        if not args.no_check:
            fq, fk, fv = (x.clone().requires_grad_() for x in full[:3])
            ref = F.scaled_dot_product_attention(fq, fk, fv, is_causal=args.causal)
            ref.backward(full[3])
            for name, a, b in (("out", out, ref), ("dq", q.grad, fq.grad), ("dk", k.grad, fk.grad),
                               ("dv", v.grad, fv.grad)):
                errors[name] = float((a.detach() - shard_sequence(b.detach(), layout=args.layout)).abs().max())
        report = dict(rank=rank, world=world, backend=dist.get_backend(), local_len=q.shape[2],
                      seconds=round(seconds, 4), max_abs_error=errors)
        print(report, flush=True)
        return report
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
