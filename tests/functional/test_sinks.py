"""Attention sinks (gpt-oss; ``sinks=``): one logit s_h per query head in the softmax denominator only,
out_i = Σ_j exp(x_ij - m) v_j / (exp(s_h - m) + Σ_j exp(x_ij - m)) (Note [Attention sinks] in kernels/lse.py).

Oracles: that formula in float64, written here; a second same-dtype computation (SDPA's math backend with one
extra key of score s_h and value 0, which is exactly a sink) sets each dtype's error budget
(``FUSED_ERROR_FACTOR`` times its error, as for the other fused kernels); transformers' eager GptOss attention.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import attnlab
from attnlab import reference
from attnlab.functional import attention, attention_with_kvcache, attention_with_lse, explain
from attnlab.kernels import compiled as ck
from attnlab.kernels import decode as dk
from helpers import FUSED_ERROR_FACTOR, max_err

pytestmark = pytest.mark.usefixtures("one_thread")

needs_ext = pytest.mark.skipif(not ck.available(), reason="compiled extension not built")
needs_decode = pytest.mark.skipif(not dk.available(), reason="decode extension not built")

B, H, Hkv, E = 2, 4, 2, 16


def _inputs(L, S, dtype=torch.float32, seed=0, sink_scale=2.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, E, generator=g) * 1.5
    k = torch.randn(B, Hkv, S, E, generator=g) * 1.5
    v = torch.randn(B, Hkv, S, E, generator=g)
    s = torch.randn(H, generator=g) * sink_scale + 3  # near the rows' lse (log S + ...): a real share of each row
    return q.to(dtype), k.to(dtype), v.to(dtype), s


def _sink_ref(q, k, v, s, causal=False):
    """(out, weights, lse) in float64 from the definition; causal is bottom-right (L <= S: decode's alignment
    equals top-left when L = S)."""
    q, k, v, s = (t.double() for t in (q, k, v, s))
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    x = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5  # (B, H, L, S)
    L, S = x.shape[-2:]
    if causal:
        x = x.masked_fill(torch.ones(L, S, dtype=torch.bool).tril(S - L).logical_not(), float("-inf"))
    sh = s.view(1, -1, 1, 1)
    m = torch.maximum(x.amax(-1, keepdim=True), sh)
    p = torch.exp(x - m)
    denom = p.sum(-1, keepdim=True) + torch.exp(sh - m)
    w = p / denom
    return w @ v, w, (m + denom.log()).squeeze(-1)


def _sdpa_math_sink(q, k, v, s, causal=False):
    """The same-dtype second oracle: SDPA's math backend over the keys plus one of score s_h and value 0."""
    L, S = q.shape[-2], k.shape[-2]
    kz = torch.cat([k, k.new_zeros(B, Hkv, 1, E)], 2)  # (B, Hkv, S + 1, E): q·0 = 0, the mask adds s_h
    vz = torch.cat([v, v.new_zeros(B, Hkv, 1, E)], 2)
    bias = torch.zeros(H, L, S + 1, dtype=q.dtype)
    if causal:
        bias[:, :, :S] = bias[:, :, :S].masked_fill(torch.ones(L, S, dtype=torch.bool).tril(S - L).logical_not(),
                                                    float("-inf"))
    bias[:, :, S] = s.to(q.dtype).view(H, 1)
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, kz, vz, attn_mask=bias, enable_gqa=True)


def test_reference_takes_sinks():
    q, k, v, s = _inputs(5, 7, torch.float64)
    out, w = reference.attention(q, k, v, enable_gqa=True, sinks=s)
    ref, wref, _ = _sink_ref(q, k, v, s)
    assert max_err(out, ref) < 1e-13 and max_err(w, wref) < 1e-13
    assert (w.sum(-1) < 1).all()


# (kernel, L, S, causal): the prefill kernels at L = S and L < S, decode at a few queries against more keys
CASES = [("dense", 33, 33, True), ("tiled", 33, 33, True), ("tiled", 9, 70, False),
         pytest.param("compiled", 33, 33, True, marks=needs_ext), pytest.param("compiled", 9, 70, False, marks=needs_ext),
         pytest.param("decode", 3, 70, True, marks=needs_decode), pytest.param("decode", 1, 70, False, marks=needs_decode)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method,L,S,causal", CASES)
def test_kernels_match_float64(method, L, S, causal, dtype):
    """Each kernel that takes sinks, against float64: at most FUSED_ERROR_FACTOR x the same-dtype SDPA math
    error, plus half an ulp of max |out|: the decode kernel returns its output rounded to the dtype and the
    rescale rounds once more (bf16: measured up to 2.9x the naive error without that half ulp)."""
    q, k, v, s = _inputs(L, S, dtype)
    kw = dict(pattern=attnlab.patterns.causal("bottom_right")) if causal else {}
    out = attention(q, k, v, enable_gqa=True, method=method, sinks=s, **kw)
    ref = _sink_ref(q, k, v, s, causal)[0]
    naive = _sdpa_math_sink(q, k, v, s, causal)
    eps = torch.finfo(dtype).eps
    budget = FUSED_ERROR_FACTOR * max_err(naive, ref) + eps / 2 * float(ref.abs().max())
    assert max_err(out, ref) <= budget, (method, max_err(out, ref), max_err(naive, ref))
    no_sink = attention(q, k, v, enable_gqa=True, method=method, **kw)
    assert max_err(no_sink, ref) > 4 * budget  # the sinks matter at these sizes


@pytest.mark.parametrize("method", ["dense", "tiled", pytest.param("compiled", marks=needs_ext)])
def test_gradcheck_float64(method):
    """fwd + bwd in float64 through q, k, v and the sinks (causal, GQA), and the sinks' gradient alone."""
    q, k, v, s = (t.double() for t in _inputs(4, 4, seed=1))
    q, k, v = q[:1, :, :, :4].clone(), k[:1, :, :, :4].clone(), v[:1, :, :, :3].clone()  # small: few perturbations
    args = [t.requires_grad_() for t in (q, k, v, s)]

    def f(q, k, v, s):
        return attention(q, k, v, is_causal=True, enable_gqa=True, method=method, block_size=2
                         if method == "tiled" else None, sinks=s)

    assert torch.autograd.gradcheck(f, args, atol=1e-8, rtol=1e-6)
    only_s = lambda s: f(q.detach(), k.detach(), v.detach(), s)  # noqa: E731 (q, k, v need no grad)
    assert torch.autograd.gradcheck(only_s, (s,), atol=1e-8, rtol=1e-6)


#: gradients: a fused backward recomputes the weights from the (sinked) log-sum-exp and takes rowsum(dO∘O) from the
#: output, so its error may be this factor times the naive same-dtype one (tests/functional/test_differential.py's
#: GRAD_ERROR_FACTOR). Measured here with sinks: at most 3.3x (tiled bf16 dq; tiled fp32 dq 3.2x, as without sinks)
GRAD_ERROR_FACTOR = 8.0


def _grads(f, tensors, dout):
    ts = [t.detach().clone().requires_grad_() for t in tensors]
    (f(*ts).double() * dout).sum().backward()
    return [t.grad for t in ts]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method,L,S,causal", [("dense", 33, 33, True), ("tiled", 33, 33, True),
                                               ("tiled", 20, 70, False),
                                               pytest.param("compiled", 33, 33, True, marks=needs_ext),
                                               pytest.param("compiled", 20, 70, False, marks=needs_ext)])
def test_gradients_match_float64(method, L, S, causal, dtype):
    """dq, dk, dv and d(sinks) against float64 autograd of the definition: at most GRAD_ERROR_FACTOR x the naive
    same-dtype (SDPA math, sink key) gradients' error, plus half an ulp of the largest gradient."""
    q, k, v, s = _inputs(L, S, dtype, seed=6)
    dout = torch.randn(B, H, L, E, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    kw = dict(pattern=attnlab.patterns.causal("bottom_right")) if causal else {}
    ref = _grads(lambda *t: _sink_ref(*t, causal)[0], [t.double() for t in (q, k, v, s)], dout)
    got = _grads(lambda q, k, v, s: attention(q, k, v, enable_gqa=True, method=method, sinks=s, **kw),
                 (q, k, v, s), dout)
    naive = _grads(lambda *t: _sdpa_math_sink(*t, causal), (q, k, v, s), dout)
    eps = torch.finfo(dtype).eps
    for name, g, n, r in zip(("dq", "dk", "dv", "dsinks"), got, naive, ref):
        budget = GRAD_ERROR_FACTOR * max_err(n, r) + eps / 2 * float(r.abs().max())
        assert max_err(g, r) <= budget, (name, max_err(g, r), max_err(n, r))


@pytest.mark.parametrize("method", ["dense", "tiled"])
def test_weights_sum_below_one(method):
    q, k, v, s = _inputs(6, 6, torch.float64, seed=2)
    out, w = attention(q, k, v, is_causal=True, enable_gqa=True, method=method, need_weights=True, sinks=s)
    ref, wref, _ = _sink_ref(q, k, v, s, causal=True)
    assert max_err(out, ref) < 1e-12 and max_err(w, wref) < 1e-12
    assert (w.sum(-1) < 1).all() and (w.sum(-1) < 0.9).any()


@pytest.mark.parametrize("method", [None, "tiled"])
def test_attention_with_lse_includes_the_sink(method, monkeypatch):
    """lse = logaddexp(lse, s_h); a row with no key left: out 0, lse s_h; the merge of two halves equals the
    whole (the sink counted once: merged without it, then the sink joined once)."""
    q, k, v, s = _inputs(5, 9, torch.float64, seed=3)
    if method == "tiled":
        monkeypatch.setattr(attnlab.kernels, "LSE_ORDER", (attnlab.kernels.TILED,))
        monkeypatch.setattr(attnlab.kernels.planner.K, "LSE_ORDER", (attnlab.kernels.TILED,))
    out, lse = attention_with_lse(q, k, v, enable_gqa=True, sinks=s)
    ref, _, lref = _sink_ref(q, k, v, s)
    assert max_err(out, ref) < 1e-12 and max_err(lse, lref) < 1e-12
    keep = torch.ones(5, 9, dtype=torch.bool)
    keep[2] = False  # row 2 sees no key
    out, lse = attention_with_lse(q, k, v, attn_mask=keep, enable_gqa=True, sinks=s)
    assert out[:, :, 2].abs().max() == 0 and torch.equal(lse[:, :, 2], s.double().expand(B, H))
    empty = attention_with_lse(q, k[:, :, :0], v[:, :, :0], enable_gqa=True, sinks=s)[1]
    assert torch.equal(empty, s.double().view(1, H, 1).expand(B, H, 5))


def test_explain_and_refusals_name_the_sinks():
    q, k, v, s = _inputs(16, 16)
    plan = explain(q, k, v, enable_gqa=True, sinks=s)
    assert plan.method != "sdpa" and "sinks=" in plan.refused["sdpa"] and "sinks=" in plan.refused["sparse"]
    with pytest.raises(ValueError, match=r"method='sdpa' cannot run.*sinks="):
        attention(q, k, v, enable_gqa=True, method="sdpa", sinks=s)


@pytest.mark.parametrize("bad,match", [
    (torch.zeros(3), r"sinks \[3\] must be \[H\] = \[4\]"),
    (torch.zeros(2, 4), r"sinks \[2, 4\] must be \[H\] = \[4\]"),
    (torch.zeros(4, dtype=torch.int64), "sinks must be a floating tensor"),
    (torch.tensor([0.0, float("-inf"), 0.0, 0.0]), "sinks must be finite"),
    (torch.tensor([0.0, float("nan"), 0.0, 0.0]), "sinks must be finite"),
    ([0.0] * 4, "sinks must be a torch.Tensor"),
    (torch.zeros(4, device="meta"), "sinks is on meta but query is on cpu"),
])
def test_bad_sinks_one_line(bad, match):
    q, k, v, _ = _inputs(4, 4)
    for door in (lambda: attention(q, k, v, enable_gqa=True, sinks=bad),
                 lambda: attention_with_lse(q, k, v, enable_gqa=True, sinks=bad),
                 lambda: attention_with_kvcache(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), sinks=bad)):
        with pytest.raises((ValueError, TypeError), match=match) as e:
            door()
        assert "\n" not in str(e.value)


@needs_decode
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["contiguous", "lengths", "paged"])
def test_attention_with_kvcache(kind, dtype):
    """Sinks on the KV-cache door (appending 2 new keys), per kind of cache, with return_lse; the int length
    call would otherwise take the one-call plain step, which has no sinks."""
    L, cap, T = 2, 48, 16
    g = torch.Generator().manual_seed(4)
    q = torch.randn(B, L, H, E, generator=g).to(dtype)
    kc = torch.randn(B, cap, Hkv, E, generator=g).to(dtype)
    vc = torch.randn(B, cap, Hkv, E, generator=g).to(dtype)
    kn, vn = (torch.randn(B, L, Hkv, E, generator=g).to(dtype) for _ in range(2))
    s = torch.randn(H, generator=g) * 2
    n0 = 30 if kind != "lengths" else torch.tensor([30, 17])
    kw = {}
    if kind == "paged":  # pages in reverse order: sequence b's page p at 2·(3 - p) + b
        table = torch.tensor([[6, 4, 2, 0], [7, 5, 3, 1]], dtype=torch.int32)
        pool_k, pool_v = kc.new_zeros(8, T, Hkv, E), vc.new_zeros(8, T, Hkv, E)
        for b in range(B):
            for p in range(cap // T):
                pool_k[table[b, p]], pool_v[table[b, p]] = kc[b, p * T:(p + 1) * T], vc[b, p * T:(p + 1) * T]
        kw["block_table"] = table
        kc_in, vc_in = pool_k, pool_v
    else:
        kc_in, vc_in = kc.clone(), vc.clone()
    with torch.no_grad():
        out, lse = attention_with_kvcache(q, kc_in, vc_in, kn, vn, cache_seqlens=n0, sinks=s, return_lse=True, **kw)
    lengths = [30, 30] if kind != "lengths" else [30, 17]
    for b, n in enumerate(lengths):
        kb = torch.cat([kc[b, :n], kn[b]]).transpose(0, 1)[None]  # (1, Hkv, n + L, E)
        vb = torch.cat([vc[b, :n], vn[b]]).transpose(0, 1)[None]
        qb = q[b].transpose(0, 1)[None]  # (1, H, L, E)
        ref, _, lref = _sink_ref(qb, kb, vb, s, causal=True)
        naive = _sdpa_math_sink(qb.expand(B, -1, -1, -1), kb.expand(B, -1, -1, -1), vb.expand(B, -1, -1, -1), s,
                                causal=True)[:1]
        budget = FUSED_ERROR_FACTOR * max_err(naive, ref) + torch.finfo(dtype).eps / 2 * float(ref.abs().max())
        assert max_err(out[b].transpose(0, 1)[None], ref) <= budget, (b, max_err(out[b].transpose(0, 1), ref[0]))
        assert max_err(lse[b], lref[0]) < 1e-5  # float32 lse of the fp32-accumulated scores


@needs_decode
def test_decode_sinks_gradient_flows():
    """The decode kernel rescales from its lse (inference in q, k, v): the sinks' gradient still flows, exactly."""
    q, k, v, s = (t.double() for t in _inputs(2, 40, seed=5))
    q, k, v, s = q.float(), k.float(), v.float(), s.float().requires_grad_()
    out = attention(q, k, v, enable_gqa=True, method="decode", sinks=s)
    (out * torch.linspace(-1, 1, E)).sum().backward()
    s64 = s.detach().double().requires_grad_()
    (_sink_ref(q, k, v, s64)[0] * torch.linspace(-1, 1, E).double()).sum().backward()
    assert max_err(s.grad, s64.grad) < 1e-5 * max(1.0, float(s64.grad.abs().max()))


def _gptoss():
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    cfg = GptOssConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                       num_experts_per_tok=2, sliding_window=8, max_position_embeddings=64,
                       layer_types=["sliding_attention", "full_attention"])
    model = GptOssForCausalLM(cfg).eval()
    model.config._experts_implementation = "eager"  # the grouped-mm experts take no float64
    with torch.no_grad():  # sinks of the scores' order (the init's std 0.02 leaves them near 0)
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(4) * 1.5)
            layer.self_attn.q_proj.weight.mul_(20)
            layer.self_attn.k_proj.weight.mul_(20)
    return model


@needs_decode
def test_gptoss_logits_and_generation_match_eager(monkeypatch):
    """A tiny random GptOss (sliding and full layers, GQA 4/2, no download): attnlab's logits equal eager's
    within 4x eager's own float32-vs-float64 spread (GptOss has no sdpa path: sdpa takes no sinks), the sinks
    matter, and greedy generation gives eager's tokens with every step on the decode kernel."""
    pytest.importorskip("transformers")
    from attnlab.integrations import hf

    hf.register_all()
    model = _gptoss()
    ids = torch.randint(1, 64, (2, 13), generator=torch.Generator().manual_seed(7))

    def logits(impl, dtype=torch.float32):
        model.to(dtype).set_attn_implementation(impl)
        with torch.no_grad():
            return model(ids).logits.double()

    e64, e32, ours = logits("eager", torch.float64), logits("eager"), logits("attnlab")
    spread = max_err(e32, e64)
    assert 0 < spread < 1e-4
    assert max_err(ours, e32) <= 4 * spread, (max_err(ours, e32), spread)
    with torch.no_grad():
        kept = [layer.self_attn.sinks.clone() for layer in model.model.layers]
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)  # no sink
        no_sink = logits("eager")
        for layer, s in zip(model.model.layers, kept):
            layer.self_attn.sinks.copy_(s)
    assert max_err(no_sink, e32) > 1e3 * spread
    steps = []
    run_cache = dk.DecodeKernel.run_cache
    monkeypatch.setattr(dk.DecodeKernel, "run_cache", lambda self, c: steps.append(c.sinks is not None)
                        or run_cache(self, c))
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    outs = {}
    for impl in ("eager", "attnlab"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            outs[impl] = model.generate(ids, **kw)
    assert torch.equal(outs["attnlab"].sequences, outs["eager"].sequences)
    assert len(steps) == 4 * 2 and all(steps)  # 4 steps after the prefill, 2 layers, each with its sinks
    for a, b in zip(outs["attnlab"].logits, outs["eager"].logits):
        assert max_err(a, b) <= 4 * spread
