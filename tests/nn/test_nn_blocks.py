"""Blocks against PyTorch's nn.TransformerEncoderLayer / nn.TransformerDecoderLayer; TransformerLM's
KV cache against uncached decoding; training through the tiled and sparse kernels."""
from __future__ import annotations

import pytest
import torch
from helpers import assert_close
from torch import nn

from attnlab import patterns as P
from attnlab.nn import (Decoder, DecoderLayer, Encoder, EncoderLayer, FeedForward, KVCache, MultiHeadAttention,
                        Transformer, TransformerLM)


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.one_thread


def _copy_mha(dst: MultiHeadAttention, src: nn.MultiheadAttention):
    ref = MultiHeadAttention.from_torch(src)
    dst.load_state_dict(ref.state_dict())


def test_feed_forward_formula():
    ff = FeedForward(6, 10, activation="relu")
    x = torch.randn(2, 3, 6)
    ref = torch.relu(x @ ff.linear1.weight.T + ff.linear1.bias) @ ff.linear2.weight.T + ff.linear2.bias
    assert_close(ff(x), ref, atol=1e-6, what="ffn")
    with pytest.raises(ValueError, match="activation must be one of"):
        FeedForward(6, activation="swish2")


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_layer_matches_torch(norm_first):
    d, H, ff = 16, 4, 24
    t = nn.TransformerEncoderLayer(d, H, ff, dropout=0.0, activation="gelu", batch_first=True, norm_first=norm_first)
    a = EncoderLayer(d, H, ff, norm_first=norm_first, activation="gelu", mechanism="tiled")
    _copy_mha(a.self_attn, t.self_attn)
    for mine, theirs in ((a.ffn.linear1, t.linear1), (a.ffn.linear2, t.linear2), (a.norm1, t.norm1), (a.norm2, t.norm2)):
        mine.load_state_dict(theirs.state_dict())
    t.eval(), a.eval()
    x = torch.randn(3, 7, d)
    kpm = torch.zeros(3, 7, dtype=torch.bool)
    kpm[2, 4:] = True
    with torch.no_grad():
        ref = t(x, src_key_padding_mask=kpm)
        out = a(x, key_padding_mask=kpm)
    keep = ~kpm  # torch's fast path may zero padded rows: compare real tokens
    assert_close(out[keep], ref[keep], atol=1e-5, what="encoder layer")


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_layer_matches_torch(norm_first):
    d, H, ff = 16, 2, 20
    t = nn.TransformerDecoderLayer(d, H, ff, dropout=0.0, activation="gelu", batch_first=True, norm_first=norm_first)
    a = DecoderLayer(d, H, ff, norm_first=norm_first, activation="gelu", mechanism="dense")
    _copy_mha(a.self_attn, t.self_attn)
    _copy_mha(a.cross_attn, t.multihead_attn)
    for mine, theirs in ((a.ffn.linear1, t.linear1), (a.ffn.linear2, t.linear2), (a.norm1, t.norm1),
                         (a.norm2, t.norm2), (a.norm3, t.norm3)):
        mine.load_state_dict(theirs.state_dict())
    x, mem = torch.randn(2, 6, d), torch.randn(2, 9, d)
    mkpm = torch.zeros(2, 9, dtype=torch.bool)
    mkpm[1, 7:] = True
    causal = nn.Transformer.generate_square_subsequent_mask(6)
    ref = t(x, mem, tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=mkpm)
    out = a(x, mem, memory_key_padding_mask=mkpm)
    assert_close(out, ref, atol=1e-5, what="decoder layer")


def test_encoder_decoder_cached_decoding_equals_full():
    torch.manual_seed(3)
    model = Transformer(16, 4, 2, 2, d_ff=32).eval()
    src, tgt = torch.randn(2, 9, 16), torch.randn(2, 7, 16)
    skpm = torch.zeros(2, 9, dtype=torch.bool)
    skpm[0, 6:] = True
    with torch.no_grad():
        full = model(src, tgt, src_key_padding_mask=skpm)
        memory = model.encode(src, skpm)
        cache = model.new_cache()
        steps = [model.decode(tgt[:, t: t + 1], memory, memory_key_padding_mask=skpm, cache=cache) for t in range(7)]
    assert_close(torch.cat(steps, 1), full, atol=1e-5, what="cached enc-dec")
    enc = Encoder(16, 4, 2)
    assert enc(src, key_padding_mask=skpm).shape == (2, 9, 16)


LM_CASES = [
    ("rope", "auto", None), ("rope", "tiled", None), ("rope", "dense", None), ("rope", "sdpa", None),
    ("sinusoidal", "auto", None), ("learned", "auto", None), ("alibi", "tiled", None), ("t5", "auto", None),
    ("none", "auto", None), ("rope", "sparse", P.sliding_window(4, causal=True)),
    ("alibi", "auto", P.dilated(3, 2, causal=True)),
]


@pytest.mark.parametrize("positional,mechanism,pattern", LM_CASES)
def test_lm_cached_logits_equal_uncached(positional, mechanism, pattern):
    torch.manual_seed(0)
    lm = TransformerLM(40, 32, 4, 2, positional=positional, mechanism=mechanism, pattern=pattern, max_len=64,
                       num_kv_heads=2).eval()
    ids = torch.randint(0, 40, (2, 23))
    with torch.no_grad():
        full = lm(ids)
        cache = lm.new_cache()
        parts = [lm(ids[:, :6], cache=cache)]  # a prompt, one token at a time, then a chunk of 5
        parts += [lm(ids[:, t: t + 1], cache=cache) for t in range(6, 18)]
        parts.append(lm(ids[:, 18:], cache=cache))
    assert cache.length == 23
    assert_close(torch.cat(parts, 1), full, atol=1e-5, what=f"{positional}/{mechanism}")
    a, la = lm.generate(ids[:, :5], 12, temperature=0.9, top_k=20, top_p=0.9, seed=7, return_logits=True)
    b, lb = lm.generate(ids[:, :5], 12, temperature=0.9, top_k=20, top_p=0.9, seed=7, use_cache=False,
                        return_logits=True)
    assert torch.equal(a, b)
    assert_close(la, lb, atol=1e-5, what="generate logits")


def test_generate_greedy_topk_topp_and_eos():
    torch.manual_seed(1)
    lm = TransformerLM(30, 16, 2, 1, max_len=40)
    prompt = torch.randint(0, 30, (3, 4))
    greedy, logits = lm.generate(prompt, 8, temperature=0, return_logits=True)
    assert greedy.shape == (3, 12) and torch.equal(greedy[:, :4], prompt)
    assert torch.equal(greedy[:, 4:], logits.argmax(-1))
    assert torch.equal(lm.generate(prompt, 8, top_k=1, seed=0), greedy)
    assert torch.equal(lm.generate(prompt, 8, top_p=1e-6, seed=0), greedy)
    eos = int(greedy[0, 5])
    out = lm.generate(prompt, 8, temperature=0, eos_id=eos)
    first = (out[0, 4:] == eos).nonzero()[0, 0] + 4
    assert (out[0, first:] == eos).all()
    assert lm.training  # generate restores the mode


@pytest.mark.parametrize("mechanism,pattern", [("tiled", None), ("sparse", P.sliding_window(3, causal=True)),
                                               ("sdpa", None), ("tiled", P.bigbird(4) & P.causal())])
def test_training_gradients_match_dense(mechanism, pattern):
    torch.manual_seed(2)
    lm = TransformerLM(20, 16, 2, 2, mechanism="dense", pattern=pattern, max_len=32)
    ids = torch.randint(0, 20, (2, 19))

    def grads():
        lm.zero_grad()
        logits = lm(ids[:, :-1])
        nn.functional.cross_entropy(logits.reshape(-1, 20), ids[:, 1:].reshape(-1)).backward()
        return [p.grad.clone() for p in lm.parameters()]

    ref = grads()
    lm.set_mechanism(mechanism, pattern)
    for g, r in zip(grads(), ref):
        assert_close(g, r, atol=2e-5, rtol=1e-4, what=f"{mechanism} grad")


def test_training_reduces_loss_through_tiled():
    torch.manual_seed(0)
    lm = TransformerLM(12, 32, 4, 1, mechanism="tiled", max_len=32)
    opt = torch.optim.Adam(lm.parameters(), lr=3e-3)
    ids = torch.arange(12).repeat(4, 2)[:, :20]  # a fixed cycle: learnable
    losses = []
    for _ in range(30):
        loss = nn.functional.cross_entropy(lm(ids[:, :-1]).reshape(-1, 12), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_bad_input():
    lm, other = TransformerLM(10, 8, 2, 2, max_len=16), TransformerLM(10, 8, 2, 2, max_len=16)
    cache = other.new_cache()
    with pytest.raises(ValueError, match="made by another model"):
        lm(torch.zeros(1, 2, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="cache has 3 layers but the model has 2"):
        KVCache(3, owner=lm.decoder).check(lm.decoder, 2)
    with pytest.raises(TypeError, match="KVCache"):
        lm(torch.zeros(1, 2, dtype=torch.long), cache=[])
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 10\)"):
        lm(torch.tensor([[3, 10]]))
    with pytest.raises(ValueError, match="max_len=16"):
        lm.generate(torch.zeros(1, 10, dtype=torch.long), 7)
    with pytest.raises(ValueError, match="num_heads \\(3\\) must divide d_model \\(8\\)"):
        TransformerLM(10, 8, 3, 1)
    with pytest.raises(ValueError, match="cross_attention=False"):
        Decoder(8, 2, 1, cross_attention=False)(torch.randn(1, 2, 8), torch.randn(1, 2, 8))
    with pytest.raises(ValueError, match="pass memory"):
        DecoderLayer(8, 2)(torch.randn(1, 2, 8))
