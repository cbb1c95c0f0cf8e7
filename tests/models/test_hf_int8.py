"""The int8 KV cache for transformers (``integrations.hf_int8``, Note [HF int8 cache]) on a tiny random Llama (no
download): a prefill and single-token steps through the int8 cache (the default group format, per-token rows,
unrotated groups) give every layer's attention output equal to float64 attention on the K/V the cache stores,
within the int8 decode kernel's budget, and a padded batch's dequantised path likewise; the stored rows are the
format's definition written here (Hadamard rotation from Sylvester's construction, then symmetric int8 per group
of channels or per row, round to nearest), through growth past capacity, crop, reorder / batch selection /
expansion; greedy and beam generate run on it; misuse (a bad group_size among it) refuses with one line."""
from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from attnlab.functional import kvquant
from attnlab.integrations import hf_int8
from attnlab.kernels import decode as dk
from helpers import check_int8_searched

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not dk.available(), reason=f"decode extension: {dk.unavailable_reason()}")]


def _sylvester(D: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < D:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(D)


def _scales(c, n: int) -> torch.Tensor:
    """Each stored element's scale, float64 [B, n, Hkv, D]: its row's, or its group's (scale [.., Hkv, D / gs])."""
    s = c.scale[:, :n].double()
    return s.repeat_interleave(c.shape[3] // s.shape[3], -1) if s.dim() == 4 else s[..., None].expand(c.data[:, :n].shape)


def _stored(c, n: int) -> torch.Tensor:
    """The first n rows as stored (rotated keys still rotated), float64: data times its element's scale."""
    return c.data[:, :n].double() * _scales(c, n)


def _model(head_dim: int = 64):
    """A tiny random Llama, GQA 4/2; head_dim 64: two groups of 32 per row."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, head_dim=head_dim)
    return LlamaForCausalLM(cfg).eval()


def _spied(model):
    """Runs ``model`` on the int8 attention function watched: a list that collects, per call, (query, key cache,
    value cache, cached rows, output, scaling, mask) as the function saw and returned them."""
    name = hf_int8.register()
    model.set_attn_implementation(name)
    fn = transformers.AttentionInterface._global_mapping[name]
    seen = []

    def spy(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        out, w = fn(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
        kc, vc, n = key._attnlab_int8
        seen.append((query.detach().double(), kc, vc, n, out.detach().double(), float(scaling), attention_mask))
        return out, w

    transformers.AttentionInterface.register("attnlab_int8_spy", spy)
    transformers.AttentionMaskInterface.register("attnlab_int8_spy", transformers.masking_utils.sdpa_mask)
    model.config._attn_implementation = "attnlab_int8_spy"  # the int8 function itself, watched
    return seen


def _check_against_float64(seen, rotate: bool):
    """Each call's output against float64 attention on the keys the cache stands for (stored rows, rotated back
    by Sylvester's Hadamard when ``rotate``) and its values, bottom-right causal, and the mask the call got (a
    query row it masks entirely is left out). Budget (tests/functional/test_kvcache_int8.py): a score is off by
    the int16 query's rounding, half a step of max|q'| D^-1/2 / 32767 per element times |k'|_1 (a group's scale
    applied to its own exact int32 dot product: the same sum over the row), plus 2 (D + 2) eps |q| |k| D^-1/2 for
    float32 (the rotation of q and k included), a probability by twice that relative, an output by that times
    max|v| plus 2 eps max|v|; twice that; plus twice the integer P @ V's rounding where the values have one scale
    per row (``dk.int_pv_bound``). The dequantised path (a mask) rounds no query: within it too."""
    eps = torch.finfo(torch.float32).eps
    for q, kc, vc, n, out, scale, mask in seen:
        B, H, L, D = q.shape
        G = H // kc.shape[2]
        r = _sylvester(D) if rotate else torch.eye(D, dtype=torch.float64)
        stored = _stored(kc, n)  # (B, n, Hkv, D): k Rᵀ, rounded
        k = stored @ r  # the keys the cache stands for
        v = _stored(vc, n)
        kk, vv = k.repeat_interleave(G, 2).transpose(1, 2), v.repeat_interleave(G, 2).transpose(1, 2)  # (B, H, n, D)
        s = q @ kk.transpose(-1, -2) * scale  # (B, H, L, n)
        keep = (torch.arange(n) <= torch.arange(L).unsqueeze(1) + (n - L)).expand(B, 1, L, n)
        if mask is not None:
            keep = keep & (mask if mask.dtype == torch.bool else mask == 0)
        s = s.masked_fill(~keep, float("-inf"))
        rows = keep.any(-1).expand(B, H, L).transpose(1, 2)  # (B, L, H): query rows that see a key
        want = (s.softmax(-1) @ vv).transpose(1, 2)  # (B, L, H, D)
        qr = q @ r.T
        step = float(qr.abs().amax()) * scale / 32767
        ds = step / 2 * float(stored.abs().sum(-1).max()) \
            + 2 * (D + 2) * eps * float(q.norm(dim=-1).max() * k.norm(dim=-1).max()) * scale
        vs = vc.scale[:, :n].double()
        vs = (vs.amax(-1) if vs.dim() == 4 else vs).repeat_interleave(G, 2).permute(0, 2, 1).unsqueeze(2)
        pv = float(dk.int_pv_bound(s.softmax(-1).nan_to_num(0.0), vs).max())  # csrc Note [Decode int8 P @ V]
        tol = 2 * (2 * ds + 2 * eps) * float(v.abs().max()) + 2 * pv
        assert float((out - want)[rows].abs().max()) <= tol


@pytest.mark.parametrize(("group_size", "rotate"), [(32, True), (None, True), (32, False), (64, True)])
def test_steps_match_float64_on_the_quantised_cache(group_size, rotate):
    """Per layer and call (prefill of 20, then 4 steps), the attention output through the int8 cache (groups of
    32: the default; per-token rows; unrotated groups; one group of the whole head dim) against float64 attention
    on what the cache holds (_check_against_float64); the stored scales have the format's shape."""
    model = _model()
    seen = _spied(model)
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(1))
    cache = hf_int8.int8_cache(None, group_size=group_size, rotate=rotate)
    with torch.no_grad():
        model(ids[:, :20], cache=cache)
        for t in range(20, 24):
            model(ids[:, t:t + 1], cache=cache)
    assert len(seen) == 2 * 5 and cache.get_seq_length() == 24
    for c in (cache.layers[0].k_cache, cache.layers[0].v_cache):
        assert tuple(c.scale.shape[2:]) == ((2, 64 // group_size) if group_size else (2,))
    assert (cache.layers[0].k_cache.rotation is not None) == rotate
    _check_against_float64(seen, rotate)


def test_default_is_rotated_groups_of_32():
    """int8_cache() stores the group format of Note [int8 KV groups] (kvquant.GROUP_SIZE = 32 channels a scale,
    keys and values) with rotated keys; group_size=None or 0 one scale per token and kv head."""
    from attnlab.functional import kvquant

    assert kvquant.GROUP_SIZE == 32
    k, v = torch.randn(2, 1, 3, 5, 64, generator=torch.Generator().manual_seed(4)).unbind(0)  # (1, Hkv 3, 5, 64)
    for kw, ng in (({}, 2), ({"group_size": None}, 0), ({"group_size": 0}, 0), ({"group_size": 64}, 1)):
        layer = hf_int8.int8_cache(None, **kw).layer_class_to_replicate()
        layer.update(k, v)
        for c in (layer.k_cache, layer.v_cache):
            assert tuple(c.scale.shape) == (1, 16, 3, *((ng,) if ng else ())), kw
        assert layer.k_cache.rotation is not None and layer.v_cache.rotation is None


def _check_rows(layer, k: torch.Tensor, v: torch.Tensor, gs: int | None):
    """The layer holds k, v [B, Hkv, n, D] as the format defines them: keys k Rᵀ (R Sylvester's Hadamard), each
    element within half its own scale's step (its group's, or its row's) of the float64 rotation, plus the float32
    rotation's rounding (D eps max|k|) and that step's float32 rounding; each scale max|group| / m of k Rᵀ for an
    integer m of Note [int8 scale search] within that rounding (so a row's scales are its groups' own, not the
    row's); values v rounded the same way without the rotation, each group at the best candidate scale's error
    (``check_int8_searched``, float64)."""
    B, Hkv, n, D = k.shape
    eps = torch.finfo(torch.float32).eps
    kc, vc = layer.k_cache, layer.v_cache
    assert layer.get_seq_length() == n and layer.keys.shape == (B, Hkv, n, D) and kc.shape[0] == B
    assert tuple(kc.scale.shape[2:]) == ((Hkv, D // gs) if gs else (Hkv,))
    rot = k.transpose(1, 2).double() @ _sylvester(D).T  # (B, n, Hkv, D)
    slack = D * eps * float(k.abs().max())
    steps = _scales(kc, n)
    assert bool(((_stored(kc, n) - rot).abs() <= steps / 2 * (1 + 2 * eps) + slack).all())
    amax = rot.abs().reshape(B, n, Hkv, -1, gs or D).amax(-1).repeat_interleave(gs or D, -1)
    m = amax / steps  # an integer m in [128 - candidates, 127], to the rotation's rounding
    tol = (slack + eps * amax) / steps
    assert bool(((m - m.round()).abs() <= tol).all())
    assert bool(((m.round() <= 127) & (m.round() >= 128 - kvquant.SCALE_CANDIDATES)).all())
    vg, ng = v.transpose(1, 2), (D // gs) if gs else 1
    check_int8_searched(vg.reshape(B, n, Hkv, ng, -1), vc.data[:, :n].reshape(B, n, Hkv, ng, -1),
                        vc.scale[:, :n].reshape(B, n, Hkv, ng), kvquant.SCALE_CANDIDATES, "values")


@pytest.mark.parametrize("gs", [32, None])
def test_layer_stores_rounded_rotated_rows(gs):
    """An Int8Layer's update stores k Rᵀ rounded per group of gs channels (or per row) and v rounded likewise
    (_check_rows), and the storage grows past its capacity (4, twice: 3 + 3 + 30 rows) keeping rows and scales."""
    layer = hf_int8._int8_classes()[0](capacity=4, group_size=gs)
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(1, 2, 36, 64, generator=g) * 3, torch.randn(1, 2, 36, 64, generator=g)
    k[..., 5] *= 20  # an outlier channel
    layer.update(k[:, :, :3], v[:, :, :3])
    assert layer.k_cache.shape[1] == 16
    layer.update(k[:, :, 3:6], v[:, :, 3:6])
    _check_rows(layer, k[:, :, :6], v[:, :, :6], gs)
    layer.update(k[:, :, 6:], v[:, :, 6:])
    assert layer.k_cache.shape[1] >= 36 and layer.v_cache.shape[1] == layer.k_cache.shape[1]
    _check_rows(layer, k, v, gs)


def test_crop_reorder_select_repeat_with_groups():
    """On a group-scaled layer, batch of 3: reorder_cache, batch_select_indices, batch_repeat_interleave give the
    rows (int8 data and group scales, bit for bit) of those sequences in that order, and what follows appends to
    them; crop drops rows from the end, and the next update overwrites them; reset drops everything, the next update starting fresh in the same format."""
    layer = hf_int8._int8_classes()[0](capacity=8, group_size=32)
    g = torch.Generator().manual_seed(6)
    k, v = torch.randn(3, 2, 12, 64, generator=g), torch.randn(3, 2, 12, 64, generator=g)
    layer.update(k[:, :, :5], v[:, :, :5])
    before = [(c.data[:, :5].clone(), c.scale[:, :5].clone()) for c in (layer.k_cache, layer.v_cache)]

    def same(order):
        for c, (d, s) in zip((layer.k_cache, layer.v_cache), before):
            assert torch.equal(c.data[:, :5], d[order]) and torch.equal(c.scale[:, :5], s[order])

    layer.reorder_cache(torch.tensor([2, 0, 1]))
    same([2, 0, 1])
    k, v = k[[2, 0, 1]], v[[2, 0, 1]]
    layer.update(k[:, :, 5:7], v[:, :, 5:7])
    _check_rows(layer, k[:, :, :7], v[:, :, :7], 32)
    layer.batch_select_indices(torch.tensor([2, 0]))
    k, v = k[[2, 0]], v[[2, 0]]
    assert layer.keys.shape == (2, 2, 7, 64) and layer.k_cache.scale.shape[0] == 2
    layer.update(k[:, :, 7:9], v[:, :, 7:9])
    _check_rows(layer, k[:, :, :9], v[:, :, :9], 32)
    layer.crop(-3)  # 9 -> 6 rows
    assert layer.get_seq_length() == 6 and layer.keys.shape[2] == 6
    k2, v2 = torch.randn(2, 2, 3, 64, generator=g), torch.randn(2, 2, 3, 64, generator=g)
    layer.update(k2, v2)
    k, v = torch.cat([k[:, :, :6], k2], 2), torch.cat([v[:, :, :6], v2], 2)
    _check_rows(layer, k, v, 32)
    layer.crop(-5)  # 9 -> 4 rows
    assert layer.get_seq_length() == 4
    layer.batch_repeat_interleave(2)
    k, v = k[:, :, :4].repeat_interleave(2, 0), v[:, :, :4].repeat_interleave(2, 0)
    _check_rows(layer, k, v, 32)
    layer.reset()
    assert layer.get_seq_length() == 0 and layer.k_cache is None
    layer.update(k[:1, :, :2], v[:1, :, :2])
    _check_rows(layer, k[:1, :, :2], v[:1, :, :2], 32)


def test_crop_follows_the_installed_dynamic_layer():
    """Note [Crop semantics]: the same crops on transformers' own DynamicLayer (the oracle) and the int8 layer
    leave the same lengths, and the int8 rows kept are the first ones as they were; whatever DynamicLayer
    refuses (a positive count in transformers 5) the int8 layer refuses with the same error type."""
    from transformers.cache_utils import DynamicLayer

    g = torch.Generator().manual_seed(11)
    k, v = torch.randn(2, 2, 10, 64, generator=g), torch.randn(2, 2, 10, 64, generator=g)
    ref, layer = DynamicLayer(), hf_int8._int8_classes()[0](capacity=4)
    ref.update(k, v)
    layer.update(k, v)
    data = layer.k_cache.data.clone()
    for n in (0, -2, 0, 7, 3, -1, 0, -20):
        want = err = None
        try:
            ref.crop(n)
            want = ref.get_seq_length()
        except Exception as e:  # noqa: BLE001 - the oracle's refusal is what the layer must match
            err = type(e)
        if err is not None:
            with pytest.raises(err):
                layer.crop(n)
            continue
        layer.crop(n)
        assert layer.get_seq_length() == want, (n, layer.get_seq_length(), want)
        assert layer.keys.shape[2] == want and torch.equal(layer.k_cache.data[:, :want], data[:, :want])
    assert ref.get_seq_length() < 10  # the sequence did crop something


def test_reordered_cache_steps_like_a_fresh_one():
    """Through the model: a batch of 3 prefilled, reordered, and stepped gives the cache (bit for bit) and the
    step's logits of a cache prefilled with the reordered batch (the same rows quantised the same way, at the same
    batch size); then selecting two sequences gives those sequences' logits at the next step within float32's
    rounding of a batch of 2 prefilled fresh (a different batch size may block the matmuls differently)."""
    model = _model()
    model.set_attn_implementation(hf_int8.register())
    ids = torch.randint(0, 97, (3, 10), generator=torch.Generator().manual_seed(7))
    order = torch.tensor([1, 2, 0])
    with torch.no_grad():
        a, b = hf_int8.int8_cache(model.config), hf_int8.int8_cache(model.config)
        model(ids[:, :8], cache=a)
        a.reorder_cache(order)
        model(ids[order, :8], cache=b)
        la, lb = model(ids[order, 8:9], cache=a).logits, model(ids[order, 8:9], cache=b).logits
        for x, y in zip(a.layers, b.layers):
            for cx, cy in ((x.k_cache, y.k_cache), (x.v_cache, y.v_cache)):
                assert torch.equal(cx.data[:, :9], cy.data[:, :9]) and torch.equal(cx.scale[:, :9], cy.scale[:, :9])
        torch.testing.assert_close(la, lb, rtol=0, atol=0)
        a.batch_select_indices(torch.tensor([2, 0]))
        c = hf_int8.int8_cache(model.config)
        model(ids[order][[2, 0], :9], cache=c)
        lc, ld = model(ids[order][[2, 0], 9:10], cache=a).logits, model(ids[order][[2, 0], 9:10], cache=c).logits
    assert a.get_seq_length() == 10 and a.layers[0].k_cache.scale.shape[0] == 2
    eps = torch.finfo(torch.float32).eps
    torch.testing.assert_close(lc, ld, rtol=0, atol=64 * eps * float(ld.abs().max()))


def test_generate_and_misuse():
    """greedy generate on the int8 cache (group_size=32) advances it by the new tokens, and so does beam search
    (reorder_cache on group scales); the cache refuses a model on another implementation and bad arguments, a
    group_size that is no positive multiple of 32 dividing the head dim among them (at construction where the
    config states the head dim, else at the first update, before any row is written), each in one line."""
    model = _model()
    model.set_attn_implementation(hf_int8.register())
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(2))
    cache = hf_int8.int8_cache(model.config, group_size=32)
    out = model.generate(ids, cache=cache, max_new_tokens=5, do_sample=False, min_new_tokens=5)
    assert out.shape == (1, 17) and cache.get_seq_length() == 16
    cache = hf_int8.int8_cache(model.config)
    out = model.generate(ids.repeat(2, 1), attention_mask=torch.ones(2, 12, dtype=torch.long), cache=cache,
                         num_beams=3, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 16) and cache.get_seq_length() == 15 and cache.layers[0].k_cache.scale.shape[0] == 6
    assert torch.equal(out[0], out[1])
    errors = []
    for bad in (48, 16, -32, 128, True, 32.0, "32"):
        with pytest.raises(ValueError, match="int8_cache: group_size must be a positive multiple of 32 dividing the "
                                             "head dim D=64") as e:
            hf_int8.int8_cache(model.config, group_size=bad)
        errors.append(str(e.value))
    assert all("\n" not in m and "got" in m for m in errors)
    layer = hf_int8.int8_cache(None, group_size=128).layer_class_to_replicate()  # the head dim known at the update
    with pytest.raises(ValueError, match=r"int8_cache: group_size must .* dividing the head dim D=64 .*got 128"):
        layer.update(torch.zeros(1, 2, 3, 64), torch.zeros(1, 2, 3, 64))
    assert layer.k_cache is None and layer.get_seq_length() == 0
    small = _model(16)
    small.set_attn_implementation(hf_int8.register())
    with pytest.raises(ValueError, match="dividing the head dim D=16 "):  # groups of 32 asked on a head dim of 16
        hf_int8.int8_cache(small.config, group_size=32)
    # the default, "auto": groups of 32 where 32 divides the head dim, one scale per token where not, whether the
    # config states the head dim or the first update shows it
    for m, config, groups in ((small, small.config, None), (small, None, None), (model, model.config, 2),
                              (model, None, 2)):
        m.set_attn_implementation(hf_int8.register())
        cache = hf_int8.int8_cache(config)
        m.generate(torch.tensor([[3, 5, 7, 9]]), cache=cache, max_new_tokens=2, do_sample=False, pad_token_id=0)
        scale = cache.layers[0].k_cache.scale
        assert (scale.dim() == 3) if groups is None else (scale.shape[3] == groups)
    model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="int8_cache: the model runs attn_implementation='sdpa'") as e:
        hf_int8.int8_cache(model.config)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="int8_cache: capacity"):
        hf_int8.int8_cache(None, -1)
    with pytest.raises(TypeError, match="int8_cache: rotate must be a bool"):
        hf_int8.int8_cache(None, rotate="yes")


@pytest.mark.parametrize("group_size", [32, None])
def test_padded_batch_takes_the_dequantised_cache(group_size):
    """A left-padded batch carries a mask, so each call attends through "attnlab" on the dequantised int8 cache
    (Note [HF int8 cache]; ``_dequantized`` expands a group's scale over its channels): generate runs, every call's
    output (the padded sequence's real tokens) equals float64 attention on what the cache holds under the mask
    (_check_against_float64), the cache holds every position's int8 rows and advances by the new tokens."""
    model = _model()
    model.set_attn_implementation(hf_int8.register())
    cache = hf_int8.int8_cache(model.config, group_size=group_size)
    seen = _spied(model)
    ids = torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0  # sequence 1 is left-padded by 3
    out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=4, do_sample=False, min_new_tokens=4,
                         pad_token_id=0)
    assert out.shape == (2, 13) and cache.get_seq_length() == 12
    assert len(seen) == 2 * 4 and all(m is not None for *_, m in seen)
    _check_against_float64(seen, rotate=True)
    kc = cache.layers[0].k_cache
    assert kc.data.dtype == torch.int8 and kc.rotation is not None and bool(kc.scale[1, 3:12].gt(0).all())
    assert kc.scale.dim() == (4 if group_size else 3)


def test_int8_cache_takes_the_sinks():
    """gpt-oss's attention sinks (``s_aux``) reach the int8 cache's kernel call (they had been dropped there: the
    logits did not move with the sinks). A tiny random GptOss (no download), the full-attention layer's sinks set
    to 3 (weighty) and to -1e4 (none): the int8 cache's distance from eager with the sinks stays within 4x its own
    distance without them (the int8 rounding), while the sinks move eager's logits by far more."""
    import copy
    import warnings

    from transformers import GptOssConfig, GptOssForCausalLM

    name = hf_int8.register()
    torch.manual_seed(0)
    cfg = GptOssConfig(vocab_size=97, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, sliding_window=7, num_local_experts=4, num_experts_per_tok=2,
                       layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512)
    cfg._experts_implementation = "eager"
    base = GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in base.named_parameters():
            if p.dim() == 2 and "proj" in n:
                p.normal_(0, 0.15)
    ids = torch.randint(3, 97, (1, 24))

    def logits(impl, sink, int8):
        m = copy.deepcopy(base)
        m.set_attn_implementation(impl)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m.model.layers[1].self_attn.sinks.fill_(sink)
            kw = {"past_key_values": hf_int8.int8_cache(m.config)} if int8 else {}
            return m(input_ids=ids, use_cache=True, **kw).logits

    err = {s: float((logits(name, s, True) - logits("eager", s, False)).abs().max()) for s in (3.0, -1e4)}
    moved = float((logits("eager", 3.0, False) - logits("eager", -1e4, False)).abs().max())
    assert err[3.0] <= 4 * err[-1e4] and moved > 20 * err[-1e4], (err, moved)
