"""attnlab.distributed in one process: layouts, the ring schedule, the block backward, and input errors.

The multi-process runs (gloo, 2 and 4 ranks) are in test_distributed_ring.py.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from attnlab.distributed import (LAYOUTS, chunk_sizes, ring_attention, shard_segments, shard_sequence,
                                 unshard_sequence)
from attnlab.distributed import ring as R
from helpers import assert_close

LENGTHS = (0, 1, 3, 5, 13, 16, 17)
WORLDS = (1, 2, 3, 4)


def _positions(L: int, P: int, r: int, layout: str) -> list[int]:
    """Independent statement of the layouts with torch.tensor_split."""
    idx = torch.arange(L)
    if layout == "contiguous":
        return torch.tensor_split(idx, P)[r].tolist()
    chunks = torch.tensor_split(idx, 2 * P)
    return chunks[r].tolist() + chunks[2 * P - 1 - r].tolist()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_segments_follow_tensor_split_and_cover_every_position_once(layout):
    for L in LENGTHS:
        for P in WORLDS:
            assert chunk_sizes(L, P) == [len(c) for c in torch.tensor_split(torch.arange(L), P)]
            seen = []
            for r in range(P):
                pos = [i for a, b in shard_segments(L, P, r, layout) for i in range(a, b)]
                assert pos == _positions(L, P, r, layout)
                assert pos == sorted(pos)  # ring attention relies on increasing local positions
                seen += pos
            assert sorted(seen) == list(range(L))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_shard_then_unshard_is_identity(layout):
    for L in LENGTHS:
        for P in WORLDS:
            x = torch.randn(2, L, 3)  # [B, L, E]: the sequence dim is 1 here
            shards = [shard_sequence(x, r, P, layout=layout, dim=1) for r in range(P)]
            for r, s in enumerate(shards):
                assert torch.equal(s, x[:, _positions(L, P, r, layout)])
            assert torch.equal(unshard_sequence(shards, layout=layout, dim=1), x)


def test_layout_errors_name_the_argument():
    x = torch.randn(1, 1, 8, 2)
    with pytest.raises(ValueError, match="layout must be one of"):
        shard_sequence(x, 0, 2, layout="striped")
    with pytest.raises(ValueError, match="rank must be in"):
        shard_sequence(x, 2, 2)
    with pytest.raises(ValueError, match="pass rank= and world_size="):
        shard_sequence(x)
    with pytest.raises(ValueError, match="shard 0 has length 4 along dim -2, but the .zigzag. layout of a length-7"):
        unshard_sequence([x[:, :, :4], x[:, :, :3]], layout="zigzag")
    with pytest.raises(TypeError, match="torch.Tensor"):
        shard_sequence([1, 2], 0, 1)


def test_ring_attention_input_errors():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"query must be 4-D .* got \[2, 4, 8\]"):
        ring_attention(q[0], q[0], q[0])
    with pytest.raises(ValueError, match="no GQA"):
        ring_attention(q, q[:, :1], q[:, :1])
    with pytest.raises(ValueError, match="same positions"):
        ring_attention(q, q[:, :, :3], q[:, :, :3])
    with pytest.raises(TypeError, match="share a dtype"):
        ring_attention(q, q.double(), q)
    with pytest.raises(TypeError, match="floating point"):
        ring_attention(q.long(), q.long(), q.long())
    with pytest.raises(ValueError, match="layout must be one of"):
        ring_attention(q, q, q, layout="ring")
    with pytest.raises(RuntimeError, match="init_process_group"):
        ring_attention(q, q, q)  # no process group in this process


def _schedule(lengths, rank, layout, causal, block):
    return R._build_schedule(lengths, rank, layout, causal, block)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
def test_schedule_visits_exactly_the_allowed_query_key_pairs(layout, causal):
    """Note [Causal blocks]: over all ring steps, each rank's queries meet each allowed key exactly once."""
    for L in (1, 5, 13, 16):
        for P in WORLDS:
            lengths = [b - a for r in range(P) for a, b in [(0, sum(e - s for s, e in shard_segments(L, P, r, layout)))]]
            for block in (1, 2, 3, 2048):
                for r in range(P):
                    sched = _schedule(lengths, r, layout, causal, block)
                    qpos = _positions(L, P, r, layout)
                    count = torch.zeros(len(qpos), L, dtype=torch.int64)
                    assert len({len(ps) for ps in sched.pieces}) == 1  # lock-step: same piece count everywhere
                    for src in range(P):
                        kpos = _positions(L, P, src, layout)
                        for piece in sched.pieces[src]:
                            assert piece.n <= block
                            keys = kpos[piece.l0:piece.l1]
                            assert keys == list(range(piece.g0, piece.g1))
                            diag, full = sched.rows(piece)
                            if full:
                                count[full[0]:full[1], piece.g0:piece.g1] += 1
                            if diag:
                                for i in range(diag[0], diag[1]):
                                    for j in range(piece.n):
                                        count[i, piece.g0 + j] += int(j <= i - diag[0])
                    allowed = torch.ones(len(qpos), L, dtype=torch.int64)
                    if causal:
                        allowed = (torch.arange(L).unsqueeze(0) <= torch.tensor(qpos).unsqueeze(-1)).long()
                    assert torch.equal(count, allowed), (L, P, r, block)


def test_zigzag_balances_causal_work():
    """The point of zigzag: causal query-key pairs per rank are equal (contiguous: rank P-1 does most)."""
    L, P = 64, 4
    work = {}
    for layout in LAYOUTS:
        work[layout] = [sum(p + 1 for p in _positions(L, P, r, layout)) for r in range(P)]
    assert len(set(work["zigzag"])) == 1
    assert max(work["contiguous"]) > 3 * min(work["contiguous"])


def test_zigzag_refuses_shards_that_are_not_zigzag():
    with pytest.raises(ValueError, match=r"zigzag layout of a length-9 sequence over 2 ranks gives \[5, 4\]"):
        _schedule([4, 5], 0, "zigzag", True, 2048)


def _dense(q, k, v, causal, scale):
    s = q @ k.transpose(-2, -1) * scale
    if causal:
        L = q.shape[-2]
        s = s.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block", [1, 3, 2048])
def test_block_backward_matches_autograd_float64(causal, block):
    """The ring's FlashAttention-style backward (one rank, several pieces) against autograd of dense attention."""
    B, H, L, E, Ev = 2, 3, 7, 4, 5
    q, k, v = (torch.randn(B, H, L, d, dtype=torch.float64, requires_grad=True) for d in (E, E, Ev))
    scale = 1 / math.sqrt(E)
    out, lse = _dense(q, k, v, causal, scale)
    dout = torch.randn_like(out)
    out.backward(dout)
    sched = _schedule([L], 0, "contiguous", causal, block)
    dq, dk, dv = R._ring_backward(dout, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), sched,
                                  scale, R._Comm(sched))
    for name, a, b in (("dq", dq, q.grad), ("dk", dk, k.grad), ("dv", dv, v.grad)):
        assert_close(a, b, atol=1e-12, rtol=1e-10, what=name)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
def test_one_rank_ring_equals_sdpa_fp32(layout, causal):
    """With one rank the ring is its piece loop and merge alone: output and gradients equal SDPA (fp32 <= 1e-5)."""
    B, H, L, E, Ev = 2, 2, 11, 8, 6
    q, k, v = (torch.randn(B, H, L, d, requires_grad=True) for d in (E, E, Ev))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    g = torch.randn_like(ref)
    ref.backward(g)
    grads = [x.grad for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    sched = _schedule([L], 0, layout, causal, 3)
    out = R._RingAttentionFunction.apply(q, k, v, sched, 1 / math.sqrt(E))
    out.backward(g)
    assert_close(out, ref, atol=1e-5, what="out")
    for name, x, gr in zip("qkv", (q, k, v), grads):
        assert_close(x.grad, gr, atol=1e-5, what=f"d{name}")


def test_merge_into_equals_merge_partials():
    import attnlab
    from attnlab.kernels.lse import merge_into

    q, k, v = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 9, 4), torch.randn(1, 2, 9, 3)
    o1, l1 = attnlab.attention_with_lse(q, k[:, :, :4], v[:, :, :4])
    o2, l2 = attnlab.attention_with_lse(q, k[:, :, 4:], v[:, :, 4:])
    out, lse = torch.zeros(1, 2, 5, 3), torch.full((1, 2, 5), float("-inf"))
    merge_into(out, lse, o1, l1)
    merge_into(out, lse, o2, l2)
    assert_close(out, F.scaled_dot_product_attention(q, k, v), atol=1e-6, what="merged out")
    ref_o, ref_l = attnlab.merge_partials(o1, l1, o2, l2)
    assert_close(lse, ref_l, atol=1e-6, what="merged lse")


def test_gradcheck_one_rank_ring_float64():
    """gradcheck of the custom backward through the whole Function (zigzag: two segments, pieces of 2, causal)."""
    q, k, v = (torch.randn(1, 1, 5, d, dtype=torch.float64, requires_grad=True) for d in (2, 2, 3))
    sched = _schedule([5], 0, "zigzag", True, 2)
    assert torch.autograd.gradcheck(lambda a, b, c: R._RingAttentionFunction.apply(a, b, c, sched, 0.7), (q, k, v),
                                   fast_mode=True)
