"""The doors are torch ops (issue 41 item 6; Note [Doors as torch ops] in ``attnlab.functional.ops``):
``torch.compile(fullgraph=True)`` traces every public door forward and backward, with results equal to the eager
door and to PyTorch's SDPA (the independent oracle), and ``torch.export`` keeps ``nn.MultiHeadAttention``.

Small shapes, float64 (tolerances from ``helpers.TOL``), the ``eager`` / ``aot_eager`` backends (fast: no code
generation); one inductor test. Legend: B batch, H heads, Hkv key/value heads, L queries, S keys, E head dim.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

import attnlab
from attnlab import patterns as P
from attnlab.functional.kvquant import QuantizedKV
from attnlab.nn import MultiHeadAttention
from helpers import TOL, assert_close

F64 = TOL[torch.float64]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _qkv(B=1, H=2, Hkv=2, L=7, S=9, E=8, dtype=torch.float64, grad=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, E, generator=g, dtype=dtype)
    k = torch.randn(B, Hkv, S, E, generator=g, dtype=dtype)
    v = torch.randn(B, Hkv, S, E, generator=g, dtype=dtype)
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


def _tuple(r):
    return r if isinstance(r, tuple) else (r,)


def _grads(outs, inputs):
    """Gradients of a fixed weighted sum of the (differentiable) outputs (zeros for an input they do not read)."""
    g = torch.Generator().manual_seed(1)
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() for o in outs if o.requires_grad)
    got = torch.autograd.grad(loss, inputs, allow_unused=True)
    return [torch.zeros_like(t) if d is None else d for t, d in zip(inputs, got)]


def _same_compiled(f, inputs, backend="aot_eager", tol=F64, oracle=None):
    """f eager vs torch.compile(f, fullgraph=True): outputs and gradients; and the first output against ``oracle``
    (a plain-torch function of the same inputs) when given, with the gradients too where f has one output."""
    eager = _tuple(f(*inputs))
    compiled = _tuple(torch.compile(f, fullgraph=True, backend=backend)(*inputs))
    assert len(eager) == len(compiled)
    for i, (a, b) in enumerate(zip(compiled, eager)):
        assert_close(a, b, **tol, what=f"output {i}")
    wrt = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    gc = _grads(compiled, wrt) if wrt else []
    if wrt:
        for i, (a, b) in enumerate(zip(gc, _grads(eager, wrt))):
            assert_close(a, b, **tol, what=f"grad {i}")
    if oracle is not None:
        ref = _tuple(oracle(*inputs))
        assert_close(compiled[0], ref[0], **tol, what="output vs oracle")
        if wrt and len(compiled) == 1:
            for i, (a, b) in enumerate(zip(gc, _grads(ref[:1], wrt))):
                assert_close(a, b, **tol, what=f"grad {i} vs oracle")
    return compiled


def test_attention_plain_pattern_and_gqa():
    q, k, v = _qkv(H=4, Hkv=2)
    win = P.sliding_window(3)
    keep = win.materialize(7, 9)

    def f(q, k, v):  # a pattern made outside (keyed) and one made inside the compiled function (materialised)
        return (attnlab.attention(q, k, v, pattern=win, enable_gqa=True)
                + attnlab.attention(q, k, v, pattern=P.causal() & win, enable_gqa=True))

    def oracle(q, k, v):
        return (sdpa(q, k, v, attn_mask=keep, enable_gqa=True)
                + sdpa(q, k, v, attn_mask=keep & P.causal().materialize(7, 9), enable_gqa=True))

    _same_compiled(f, (q, k, v), oracle=oracle)


def test_attention_mask_weights_softcap_alibi_sinks():
    q, k, v = _qkv()
    mask = torch.randn(1, 1, 7, 9, dtype=torch.float64, requires_grad=True)  # a float mask gets its gradient
    sinks = torch.randn(2, dtype=torch.float64, requires_grad=True)
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float64)

    def f(q, k, v, mask, sinks):
        out, w = attnlab.attention(q, k, v, mask, need_weights=True, softcap=4.0, is_causal=True)
        return out, w, attnlab.attention(q, k, v, alibi_slopes=slopes, sinks=sinks, method="tiled", block_size=4)

    def oracle(q, k, v, mask, sinks):  # SDPA has no softcap: the definition in plain torch
        return (_softcapped(q, k, v, mask),)

    _same_compiled(f, (q, k, v, mask, sinks), oracle=oracle)


def _softcapped(q, k, v, mask):
    """softcap 4 then the float mask, causal: the definition in plain torch."""
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5  # (B, H, L, S)
    s = 4.0 * torch.tanh(s / 4.0) + mask
    s = s.masked_fill(~torch.ones(7, 9, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, -1) @ v


def test_attention_with_lse_and_key_padding_pattern():
    q, k, v = _qkv()
    pad = P.key_padding(torch.tensor([6]), 9)  # a pattern holding a tensor: materialised under compile

    def f(q, k, v):
        return attnlab.attention_with_lse(q, k, v, pattern=pad)

    def oracle(q, k, v):
        return (sdpa(q, k, v, attn_mask=pad.materialize(7, 9)),)

    out, lse = _same_compiled(f, (q, k, v), oracle=oracle)
    s = (q @ k.transpose(-2, -1) * 8 ** -0.5)[..., :6]  # (B, H, L, 6): the kept keys
    assert_close(lse, torch.logsumexp(s, -1), **F64, what="lse")


def test_dropout_backward_replays_the_forward_mask():
    q, k, v = _qkv()

    def f(q, k, v):
        return attnlab.attention(q, k, v, dropout_p=0.3)

    cf = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.manual_seed(5)
    eager = f(q, k, v)
    ge = _grads((eager,), (q, k, v))
    torch.manual_seed(5)
    comp = cf(q, k, v)
    gc = _grads((comp,), (q, k, v))
    assert_close(comp, eager, **F64, what="out")
    for i, (a, b) in enumerate(zip(gc, ge)):
        assert_close(a, b, **F64, what=f"grad {i}")


def test_attention_with_kvcache_mutates_the_cache():
    B, S, Hkv, H, D = 2, 12, 2, 4, 8
    g = torch.Generator().manual_seed(0)
    q, kn, vn = (torch.randn(B, 1, n, D, generator=g) for n in (H, Hkv, Hkv))  # (B, L, H|Hkv, D)
    kc, vc = torch.randn(B, S, Hkv, D, generator=g), torch.randn(B, S, Hkv, D, generator=g)
    seqlens = torch.tensor([3, 7], dtype=torch.int32)

    def f(q, kc, vc, kn, vn, seqlens):
        return attnlab.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seqlens, return_lse=True)

    kc_e, vc_e = kc.clone(), vc.clone()
    out_e, lse_e = f(q, kc_e, vc_e, kn, vn, seqlens)
    for backend in ("eager", "aot_eager"):
        torch._dynamo.reset()
        kc_c, vc_c = kc.clone(), vc.clone()
        out_c, lse_c = torch.compile(f, fullgraph=True, backend=backend)(q, kc_c, vc_c, kn, vn, seqlens)
        assert_close(out_c, out_e, **TOL[torch.float32], what=f"{backend} out")
        assert_close(lse_c, lse_e, **TOL[torch.float32], what=f"{backend} lse")
        assert torch.equal(kc_c, kc_e) and torch.equal(vc_c, vc_e), f"{backend}: the append differs"
    for b in range(B):  # the oracle: SDPA over each sequence's keys after the append
        n = int(seqlens[b]) + 1
        ref = sdpa(q[b].transpose(0, 1), kc_e[b, :n].transpose(0, 1), vc_e[b, :n].transpose(0, 1), enable_gqa=True)
        assert_close(out_e[b], ref.transpose(0, 1), **TOL[torch.float32], what=f"sequence {b} vs SDPA")


def test_attention_with_kvcache_refuses_a_quantized_cache():
    q = torch.randn(1, 1, 2, 32)
    kc = QuantizedKV.quantize(torch.randn(1, 8, 2, 32))
    vc = QuantizedKV.quantize(torch.randn(1, 8, 2, 32))

    def f(q):
        return attnlab.attention_with_kvcache(q, kc, vc, cache_seqlens=4)

    with pytest.raises(Exception, match="under torch.compile the cache must be plain tensors"):
        torch.compile(f, fullgraph=True, backend="eager")(q)


def test_flex_attention_block_mask_and_score_mod():
    from torch.nn.attention.flex_attention import create_block_mask

    q, k, v = _qkv(L=20, S=20)
    bm = create_block_mask(lambda b, h, i, j: i >= j, 1, 1, 20, 20, device="cpu", BLOCK_SIZE=8)
    bias = torch.tensor([0.3, -0.2], dtype=torch.float64)

    def rel(s, b, h, i, j):
        return s + bias[h] * (j - i)

    def f(q, k, v):
        return (attnlab.flex_attention(q, k, v, block_mask=bm),
                attnlab.flex_attention(q, k, v, score_mod=rel, block_mask=bm))

    causal = torch.ones(20, 20, dtype=torch.bool).tril()
    d = torch.arange(20).view(1, 20) - torch.arange(20).view(20, 1)  # (L, S): kv_idx - q_idx
    rel_mask = (bias.view(2, 1, 1) * d).masked_fill(~causal, float("-inf"))  # (H, L, S)

    def oracle(q, k, v):
        return (sdpa(q, k, v, attn_mask=causal) + sdpa(q, k, v, attn_mask=rel_mask),)

    _same_compiled(lambda q, k, v: sum(f(q, k, v)), (q, k, v), oracle=oracle)
    out, lse = _same_compiled(lambda q, k, v: attnlab.flex_attention(q, k, v, block_mask=bm, return_lse=True),
                              (q, k, v))
    s = (q @ k.transpose(-2, -1) * 8 ** -0.5).masked_fill(~causal, float("-inf"))
    assert_close(lse, torch.logsumexp(s, -1), **F64, what="lse")


def test_hf_attention_function():
    hf = pytest.importorskip("attnlab.integrations.hf")
    fn = hf.attention_function()

    class Module(torch.nn.Module):
        is_causal = True

    mod = Module().eval()
    q, k, v = _qkv(H=4, Hkv=2, L=6, S=6)

    def f(q, k, v):  # prefill: causal, GQA; returns (B, L, H, E)
        return fn(mod, q, k, v, None, scaling=0.3)[0]

    def oracle(q, k, v):
        return sdpa(q, k, v, is_causal=True, scale=0.3, enable_gqa=True).transpose(1, 2)

    _same_compiled(f, (q, k, v), oracle=oracle)
    qd = q[:, :, -1:].detach()  # a generation step: one query against the cache's keys (the decode route eagerly)
    with torch.no_grad():
        _same_compiled(f, (qd, k.detach(), v.detach()), backend="eager",
                       oracle=lambda q, k, v: sdpa(q, k, v, scale=0.3, enable_gqa=True).transpose(1, 2))


def test_multi_head_attention_compiles_and_exports():
    torch.manual_seed(0)
    m = MultiHeadAttention(16, 4, num_kv_heads=2).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    kpm = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])  # True = ignore (nn.MultiheadAttention's polarity)
    params = list(m.parameters())

    def f(x):
        return m(x, key_padding_mask=kpm, is_causal=True)[0]

    eager = f(x)
    comp = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    assert_close(comp, eager, **F64, what="out")
    for i, (a, b) in enumerate(zip(_grads((comp,), [x] + params), _grads((eager,), [x] + params))):
        assert_close(a, b, **F64, what=f"grad {i}")

    ep = torch.export.export(m, (x.detach(),))
    assert any("attnlab.attention" in str(n.target) for n in ep.graph.nodes), "the door is one op in the program"
    with torch.no_grad():
        assert_close(ep.module()(x.detach())[0], m(x.detach())[0], **F64, what="exported")


def test_inductor():
    q, k, v = _qkv(dtype=torch.float32)

    def f(q, k, v):
        return torch.nn.functional.gelu(attnlab.attention(q, k, v, is_causal=True)) * 2

    def oracle(q, k, v):
        return torch.nn.functional.gelu(sdpa(q, k, v, is_causal=True)) * 2

    _same_compiled(f, (q, k, v), backend="inductor", tol=TOL[torch.float32], oracle=oracle)


@pytest.mark.parametrize("positional", ["alibi", "rope"])
def test_multi_head_attention_positional(positional):
    from attnlab.positional import ALiBi, RotaryEmbedding

    torch.manual_seed(0)
    pos = ALiBi(4) if positional == "alibi" else RotaryEmbedding(8)
    m = MultiHeadAttention(32, 4, positional=pos).double()
    x = torch.randn(1, 6, 32, dtype=torch.float64, requires_grad=True)
    _same_compiled(lambda x: m(x, is_causal=True)[0], (x,))


def test_hf_llama_compiles_and_exports():
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    from attnlab.integrations import hf

    hf.register()
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = "attnlab"
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (2, 9))

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, ids):
            return self.model(ids, use_cache=False).logits

    f = Logits()
    with torch.no_grad():
        eager = f(ids)
        ref = LlamaForCausalLM(copy.deepcopy(cfg)).eval()  # its own config: the oracle runs transformers' SDPA
        ref.config._attn_implementation = "sdpa"
        ref.load_state_dict(model.state_dict())
        assert_close(eager, ref(ids, use_cache=False).logits, **TOL[torch.float32], what="attnlab vs sdpa")
        assert_close(torch.compile(f, fullgraph=True, backend="eager")(ids), eager, **TOL[torch.float32],
                     what="compiled")
        ep = torch.export.export(f, (ids,))
        assert sum("attnlab.attention" in str(n.target) for n in ep.graph.nodes) == 2, "one op per layer"
        assert_close(ep.module()(ids), eager, **TOL[torch.float32], what="exported")


def test_patterns_as_arguments_are_not_baked_in():
    """A pattern passed to the compiled function: a new one of another size (keyed by repr) or other lengths (a
    tensor pattern, materialised in the graph) gives its own result, never the first call's."""
    q, k, v = _qkv(grad=False)

    f = torch.compile(lambda q, k, v, p: attnlab.attention(q, k, v, pattern=p), fullgraph=True, backend="eager")
    for p in (P.sliding_window(2), P.sliding_window(5), P.key_padding(torch.tensor([4]), 9),
              P.key_padding(torch.tensor([7]), 9), P.from_key_padding_mask(torch.tensor([[True] * 3 + [False] * 6]))):
        assert_close(f(q, k, v, p), sdpa(q, k, v, attn_mask=p.materialize(7, 9)), **F64, what=repr(p))
    with pytest.raises(RuntimeError, match="longer than the key length"):
        f(q, k, v, P.key_padding(torch.tensor([12]), 12))


def test_ops_pass_opcheck_and_gradcheck():
    """torch.library.opcheck (schema, autograd registration, fake tensors, AOT dispatch) on each op, and gradcheck
    in float64 of the custom backward (``attnlab::attention_backward``) for q, k, v, a float mask and sinks."""
    q, k, v = _qkv(L=5, S=5, E=4)
    mask = torch.randn(1, 1, 5, 5, dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(2, dtype=torch.float64, requires_grad=True)
    attn, lse = torch.ops.attnlab.attention.default, torch.ops.attnlab.attention_with_lse.default
    torch.library.opcheck(attn, (q, k, v, None, 0.0, True, None, False, "", "auto", False, False, None, None, None, None))
    torch.library.opcheck(attn, (q, k, v, mask, 0.0, False, None, False, "", "auto", True, False, None, 3.0, None, sinks))
    torch.library.opcheck(lse, (q, k, v, None, True, None, False, "", None, None, None, None))
    B, S, Hkv, D = 2, 8, 2, 4
    g = torch.Generator().manual_seed(2)
    cache = [torch.randn(B, S, Hkv, D, generator=g) for _ in range(2)]
    new = [torch.randn(B, 1, Hkv, D, generator=g) for _ in range(2)]
    torch.library.opcheck(torch.ops.attnlab.kvcache_step.default,
                          (torch.randn(B, 1, 4, D, generator=g), *cache, *new, torch.tensor([2, 5], dtype=torch.int32),
                           None, None, True, None, None, None, None, None, True, None))

    def f(q, k, v, mask, sinks):
        return attn(q, k, v, mask, 0.0, False, None, False, "", "auto", True, False, None, 3.0, None, sinks)[:2]

    assert torch.autograd.gradcheck(f, (q, k, v, mask, sinks))
