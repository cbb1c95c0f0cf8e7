"""attnlab.capture on generic attnlab.nn modules (no MiniLM): recorded scores of cross-attention under a
pattern (issue 21, defect 12) and mean ablation under KV-cache decoding (defect 13, Note [Mean ablation])."""
from __future__ import annotations

import pytest
import torch
from helpers import assert_close

from attnlab import capture as C
from attnlab import patterns as P
from attnlab.nn import MultiHeadAttention, TransformerLM

pytestmark = pytest.mark.usefixtures("one_thread", "no_grad")
NAMES = [C.activation_name(0, k) for k in ("q", "k", "scores", "weights")]


def _reference_scores(mha, query, memory, keep):
    """float64 scale · q kᵀ from the module's own projections, -inf where ``keep`` is False: [B, H, L, S]."""
    B, L, _ = query.shape
    S = memory.shape[1]
    H, D = mha.num_heads, mha.head_dim
    q = torch.nn.functional.linear(query, mha.q_proj.weight, mha.q_proj.bias).view(B, L, H, D).transpose(1, 2)
    k = torch.nn.functional.linear(memory, mha.k_proj.weight, mha.k_proj.bias).view(B, S, H, D).transpose(1, 2)
    s = (q @ k.transpose(-1, -2)) * D ** -0.5  # (B, H, L, S)
    return s.masked_fill(~keep, float("-inf"))


CROSS = [(3, 8), (8, 3), (5, 5)]  # L < S (rows of an [S, S] mask were recorded), L > S (crashed), L = S
PATTERNS = ["sliding_window(1)", "longformer(1, [2])", "causal()"]


@pytest.mark.parametrize("L,S", CROSS, ids=[f"L{L}-S{S}" for L, S in CROSS])
@pytest.mark.parametrize("spec", PATTERNS)
@pytest.mark.parametrize("where", ["module", "attn_mask"])
def test_cross_attention_scores_use_the_patterns_own_mask(L, S, spec, where):
    torch.manual_seed(L * 10 + S)
    pattern = P.parse(spec)
    E = 12
    mha = MultiHeadAttention(E, 3, pattern=pattern if where == "module" else None).double()
    x, mem = torch.randn(2, L, E, dtype=torch.float64), torch.randn(2, S, E, dtype=torch.float64)
    kw = {} if where == "module" else {"attn_mask": pattern}
    with C.cache_activations(mha, NAMES) as got:
        mha(x, mem, mem, **kw)
    keep = pattern.materialize(L, S)  # (L, S)
    s = got[NAMES[2]]
    want = _reference_scores(mha, x, mem, keep)
    assert torch.equal(torch.isinf(s), torch.isinf(want)), "masked pairs differ from the pattern's [L, S] mask"
    fin = torch.isfinite(want)
    assert_close(s[fin], want[fin], 1e-12, what=f"scores vs float64 recompute, {spec}, L={L}, S={S}")
    # the same call with the mask written out as a bool tensor records the same scores
    plain = MultiHeadAttention(E, 3).double()
    plain.load_state_dict(mha.state_dict())
    with C.cache_activations(plain, NAMES) as dense:
        plain(x, mem, mem, attn_mask=keep)
    assert torch.equal(s, dense[NAMES[2]])
    sm = torch.nan_to_num(torch.softmax(s, -1))  # a row with no key left: zeros, as attention gives
    assert_close(sm, got[NAMES[3]], 1e-12, what="softmax(recorded scores) vs the layer's weights")


def test_scores_under_a_kv_cache_are_rows_of_the_full_pattern():
    """The KV-cache case the old code handled (queries are the last rows) still holds."""
    from attnlab.nn import LayerCache

    torch.manual_seed(1)
    pattern = P.longformer(1, [0])
    mha = MultiHeadAttention(8, 2, pattern=pattern).double()
    x = torch.randn(1, 7, 8, dtype=torch.float64)
    cache = LayerCache()
    mha(x[:, :5], cache=cache)
    with C.cache_activations(mha, NAMES) as step:
        mha(x[:, 5:], cache=cache)
    keep = pattern.materialize(7, 7)[5:]  # (2, 7)
    assert torch.equal(torch.isinf(step[NAMES[2]]), ~keep.expand(1, 2, 2, 7))


# -- mean ablation under a KV cache -------------------------------------------------------------------
def _lm():
    torch.manual_seed(0)
    return TransformerLM(23, 16, 4, 2, max_len=32).double().eval()


@pytest.mark.parametrize("how", ["zero", "mean"])
def test_ablated_generation_is_the_same_with_and_without_the_cache(how):
    lm = _lm()
    prompt = torch.tensor([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]])
    plain_c, plain_lc = lm.generate(prompt, 8, temperature=0, use_cache=True, return_logits=True)
    plain_u, plain_lu = lm.generate(prompt, 8, temperature=0, use_cache=False, return_logits=True)
    spread = float((plain_lc - plain_lu).abs().max())  # the cache's own float64 rounding, no ablation
    with C.ablate_heads(lm, 1, [0, 2], how=how):
        ids_c, logits_c = lm.generate(prompt, 8, temperature=0, use_cache=True, return_logits=True)
    with C.ablate_heads(lm, 1, [0, 2], how=how):
        ids_u, logits_u = lm.generate(prompt, 8, temperature=0, use_cache=False, return_logits=True)
    assert torch.equal(ids_c, ids_u)
    # summation order differs (running sums vs one cumsum): a few float64 ulps of the logits, on top of the spread
    budget = 10 * spread + 64 * torch.finfo(torch.float64).eps * float(logits_u.abs().max())
    assert_close(logits_c, logits_u, budget, what=f"cached vs uncached logits under {how} ablation")
    assert float((logits_u - plain_lu).abs().max()) > 1e3 * budget  # the ablation really changes the logits


def test_mean_ablation_of_a_causal_call_is_the_prefix_mean():
    """Oracle: position t's z replaced by the mean of the head's z over positions 0..t (and the batch)."""
    torch.manual_seed(2)
    mha = MultiHeadAttention(8, 2).double()
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    z_name = C.activation_name(0, "z")
    with C.cache_activations(mha, [z_name]) as got:
        mha(x, is_causal=True)
    z = got[z_name][:, 1]  # (B, L, Dv)
    prefix = z.sum(0).cumsum(0) / (2 * torch.arange(1, 7, dtype=torch.float64)).unsqueeze(-1)  # (L, Dv)
    want = got[z_name].clone()
    want[:, 1] = prefix
    with C.ablate_heads(mha, 0, [1], how="mean"):
        out, _ = mha(x, is_causal=True)
    y = mha.out_proj(want.transpose(1, 2).reshape(2, 6, 8))  # (B, L, E)
    assert_close(out, y, 1e-12, what="causal mean ablation vs prefix-mean oracle")


def test_mean_ablation_refuses_a_cache_it_did_not_see_from_the_start():
    lm = _lm()
    cache = lm.new_cache()
    lm(torch.tensor([[1, 2, 3]]), cache=cache)
    with C.ablate_heads(lm, 0, [1], how="mean"), pytest.raises(ValueError, match="enter ablate_heads before"):
        lm(torch.tensor([[4]]), cache=cache)


def test_summary_mode_under_a_kv_cache_sees_the_cached_keys():
    """capture(mode="summary") on a causal decoding step: the step's query sees every cached key (the
    pattern's rows under the offset), so its entropy and max weight are those of the layer's weights."""
    from attnlab.nn import LayerCache

    torch.manual_seed(3)
    mha = MultiHeadAttention(8, 2, pattern=P.sliding_window(3)).double()
    x = torch.randn(1, 7, 8, dtype=torch.float64)
    cache = LayerCache()
    mha(x[:, :6], is_causal=True, cache=cache)
    with C.capture(mha, mode="summary") as cap:
        _, w = mha(x[:, 6:], is_causal=True, cache=cache, need_weights=True, average_attn_weights=False)
    summ = cap.summaries()[0][0]
    w = w[0]  # (H, 1, 7)
    ent = -(w * torch.log(torch.where(w > 0, w, torch.ones_like(w)))).sum(-1)
    assert_close(summ.max_weight, w.amax(-1), 1e-12, what="summary max weight vs the layer's weights")
    assert_close(summ.entropy, ent, 1e-10, what="summary entropy vs the layer's weights")
