"""attnlab experiment kvquant (``experiments/kvquant.py``): its q8_0 simulation equals ggml's definition written
here, its group formats (int8-g32, int8-g32-hadamard) equal Note [int8 KV groups]'s definition written here, the
decode kernel's error on attnlab's formats (the group formats included) equals the simulated one within the
kernel's rounding, the chosen format (Hadamard-rotated keys) is at most q8_0's error on keys with outlier channels,
groups of 32 are at most the per-token rows' error on Gaussian keys, the report is written, and the in-model
metrics through the real HF int8 caches (group-scaled among them) match their simulated formats on a tiny random
Llama. SmolLM2 is not loaded (tokens=0): its measurement is the experiment's full run."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from attnlab.experiments import kvquant as E
from attnlab.kernels import decode as dk


def _q8_0(x):
    """ggml quantize_row_q8_0_ref: per 32 channels d = amax / 127, roundf(x / d), dequantised with fp16(d)."""
    xb = x.float().reshape(*x.shape[:-1], -1, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, xb * (1 / d), torch.zeros_like(xb))
    q = torch.sign(q) * torch.floor(q.abs() + 0.5)
    return (q.double() * d.half().double()).reshape(x.shape)


def test_query_rounding_formats():
    """Note [int8 query rounding]: q8_0-dot's query is ggml's q8_0 of it (written above); int8-g32-hadamard-q8's
    is the rotated query q Hᵀ on an int8 grid per 32 channels (d = amax / 127 of the rotated block, within half a
    step of it), rotated back; every other format's query is left as it is. On Gaussian keys each rounded query
    adds error to its cache's (seeded, GQA 8/2, D 64, S 256)."""
    from attnlab.functional import kvquant

    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 4, 64, generator=gen) * 2
    q[..., 7] *= 15
    assert torch.equal(E.round_query("q8_0-dot", q), _q8_0(q))
    assert E.round_query("int8-g32-hadamard", q) is q and E.round_query("int8", q) is q
    h = kvquant.hadamard(64).double()
    y, yq = q.double() @ h.T, E.round_query("int8-g32-hadamard-q8", q) @ h.T  # the rotated query and its rounding
    yb, ybq = y.reshape(*y.shape[:-1], 2, 32), yq.reshape(*y.shape[:-1], 2, 32)
    d = (yb.float().abs().amax(-1, keepdim=True) / 127).double()  # d in float32, as the definition
    n = ybq / d
    assert float((n - n.round()).abs().max()) < 1e-6 and float(n.abs().max()) <= 127 + 1e-6  # on the int8 grid
    assert bool(((ybq - yb).abs() <= d / 2 * (1 + 1e-5)).all())  # to nearest
    qs, k, v = E.synthetic(3, S=256, H=8, Hkv=2, D=64)
    ref = E._attend64(qs, k, v, 1 / 8)
    err = {f: E.decode_error(qs, k, v, f, 64, ref=ref) for f in ("q8_0", "q8_0-dot", "int8-g32-hadamard",
                                                                  "int8-g32-hadamard-q8")}
    assert err["q8_0-dot"] > err["q8_0"] and err["int8-g32-hadamard-q8"] > err["int8-g32-hadamard"], err


def test_q8_0_is_ggml_s():
    x = torch.randn(3, 5, 2, 64, generator=torch.Generator().manual_seed(0)) * 4
    x[0, 0, 0] = 0
    assert torch.equal(E.q8_0(x), _q8_0(x))
    with pytest.raises(ValueError, match="multiple of 32"):
        E.q8_0(torch.zeros(2, 40))


def _fwht32(x):
    """x Rᵀ for R the normalised Sylvester Hadamard matrix of a power-of-2 D, in float32 as Note [int8 key
    rotation] defines the transform: butterflies [a + b, a - b] from the widest level down, then times
    float32(D^-1/2)."""
    y = x.float().clone()
    D = y.shape[-1]
    h = D // 2
    while h >= 1:
        z = y.reshape(*y.shape[:-1], D // (2 * h), 2, h)
        a, b = z[..., 0, :].clone(), z[..., 1, :].clone()
        z[..., 0, :], z[..., 1, :] = a + b, a - b
        y = z.reshape(y.shape)
        h //= 2
    return y * torch.tensor(1 / math.sqrt(D), dtype=torch.float32)


def _groups(x, gs, rotate, candidates):
    """Note [int8 KV groups] with Note [int8 scale search] (float64 out): keys rotated in float32 first (x Rᵀ),
    then per gs channels s = max|group| / m in float32 for the m in 127, 126, ... whose float64 squared error is
    least, q = round(x / s) (half to even), dequantised as q · s (@ R). Also: the groups whose two best candidates
    are within the quantiser's float32 comparison of each other (either may be taken there)."""
    xf = _fwht32(x) if rotate else x.float()
    xg = xf.reshape(*xf.shape[:-1], -1, gs)
    amax = xg.abs().amax(-1, keepdim=True)
    m = 127.0 - torch.arange(candidates, dtype=torch.float32)
    s = (amax / m).unsqueeze(-1)  # (.., ng, K, 1), float32 as stored
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = (xg.unsqueeze(-2) / safe).round().clamp(-127, 127)  # (.., ng, K, gs)
    err = (xg.unsqueeze(-2).double() - q.double() * s.double()).square().sum(-1)  # (.., ng, K)
    two = err.topk(2, -1, largest=False).values
    unsure = two[..., 1] <= two[..., 0] * (1 + 8 * gs * torch.finfo(torch.float32).eps)
    j = err.argmin(-1)
    pick = lambda t: t.gather(-2, j[..., None, None].expand(*j.shape, 1, t.shape[-1])).squeeze(-2)  # noqa: E731
    y = (pick(q).double() * pick(s.expand_as(q)).double()).reshape(x.shape)
    h = _fwht32(torch.eye(x.shape[-1])).double()  # R, rows of the transform of the identity: R = Rᵀ
    return (y @ h if rotate else y), unsure.repeat_interleave(gs, -1).reshape(x.shape)


@pytest.mark.parametrize("shape", [(1, 512, 2, 128), (1, 300, 3, 64)])
def test_group_formats_are_the_notes(shape):
    """Bit for bit, keys and values, at the experiment's sizes (synthetic [1, S, Hkv, 128] and SmolLM2's
    [1, S, 3, 64]), with an outlier channel and an all-zero row (scale 0); only a group whose two best scales
    are within the float32 rounding of the errors compared may differ (at most 1 % of them)."""
    from attnlab.functional import kvquant

    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 3
    x[..., 5] *= 20
    x[0, 0, 0] = 0
    for name, rot in (("int8-g32", False), ("int8-g32-hadamard", True)):
        assert name in E.FORMATS and name in E.KERNEL_FORMATS
        for kind, r in (("k", rot), ("v", False)):  # values never rotated
            want, unsure = _groups(x, 32, r, kvquant.SCALE_CANDIDATES)
            got = E.fake_quant(name, x, kind, 64)
            if not r:
                assert torch.equal(got[~unsure], want[~unsure]), (name, kind)
            else:  # the same stored rows, rotated back in float64 by two different R products
                torch.testing.assert_close(got[~unsure], want[~unsure], rtol=0, atol=1e-12 * float(x.abs().max()))
            assert float(unsure.float().mean()) <= 0.01, (name, kind)


@pytest.mark.skipif(not dk.available(), reason="decode extension")
def test_quick_run_and_report(tmp_path, one_thread):
    """Kernel and simulation agree within 1 % of the error itself (the kernel's float32 and int16-query
    rounding are 2^-16 of a score where int8 rounding is 2^-8: tests/functional/test_kvcache_int8.py)."""
    cfg = E.KvquantConfig(quick=True, seeds=(0,), S=512, H=8, Hkv=2, D=128, n0=64, tokens=0)
    r = E.run(cfg)
    assert set(r.errors) == {"outlier keys", "gaussian keys"}
    assert set(r.kernel) == set(r.errors)
    for data, e in r.kernel.items():
        assert set(e) == set(E.KERNEL_FORMATS) >= {"int8-g32", "int8-g32-hadamard"}, data
        for f, x in e.items():
            assert abs(x - r.errors[data][f]) <= 0.01 * r.errors[data][f], (data, f)
    out, gauss = r.errors["outlier keys"], r.errors["gaussian keys"]
    assert out["int8-hadamard"] <= out["q8_0"] < out["int8"]
    assert out["int8-g32-hadamard"] <= out["q8_0"] and out["int8-g32"] <= out["int8"]
    # a block of 32 Gaussians has a smaller max than a row of 128 (Note [int8 KV groups]): a smaller step
    assert gauss["int8-g32"] <= gauss["int8"] and gauss["int8-g32-hadamard"] <= gauss["int8-hadamard"]
    paths = r.write(tmp_path)
    res = json.loads(Path(paths["results"]).read_text())
    assert res["experiment"] == "kvquant" and (tmp_path / "kvquant.png").exists()
    with pytest.raises(ValueError, match="unknown formats"):
        E.KvquantConfig(formats=("int4",)).resolved()


#: each real-cache row of model_metrics and the simulated format it stores
_CACHE_FORMATS = {"int8 (HF cache)": "int8", "int8-hadamard (HF cache)": "int8-hadamard",
                  "int8-g32-hadamard (HF cache)": "int8-g32-hadamard"}


@pytest.mark.skipif(not dk.available(), reason="decode extension")
def test_model_metrics_through_the_real_caches(one_thread, monkeypatch):
    """On a tiny random Llama (head dim 64: two groups of 32), model_metrics runs the real HF int8 cache in every
    CACHE_ROWS format, the group-scaled one included (its key and value caches group-scaled), and each row's KL
    against the fp32 cache is its simulated format's within 4 %: the decode kernel's rounding (int16 query, float32)
    is at most 1 % of the output error the format's rounding makes (test_quick_run_and_report), and the KL is
    quadratic in that error, (1.01)^2 - 1 = 2 %; twice that. Weights drawn at std 0.2 (transformers' default: 0.02)
    put the KL near SmolLM2's (1e-4 nats and up), far above float32's rounding of the log-probabilities (eps |log p|
    ~ 5e-7), which at the default's KL (4e-7) moved it by 5 %."""
    transformers = pytest.importorskip("transformers")
    from attnlab.integrations import hf_int8

    assert set(E.CACHE_ROWS) == set(_CACHE_FORMATS)
    assert E.CACHE_ROWS["int8-g32-hadamard (HF cache)"] == {"rotate": True, "group_size": 32}
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   head_dim=64, initializer_range=0.2)
    model = E._sim_model(transformers.LlamaForCausalLM(cfg).eval())
    ids = torch.randint(0, 97, (1, 48), generator=torch.Generator().manual_seed(1))
    seen = []
    make = hf_int8.int8_cache

    def spy(*a, **kw):
        seen.append(make(*a, **kw))
        return seen[-1]

    monkeypatch.setattr(hf_int8, "int8_cache", spy)
    m = E.model_metrics(model, ids, list(dict.fromkeys(_CACHE_FORMATS.values())), 16, cache_chunk=4)
    assert [c.get_seq_length() for c in seen] == [48] * 3
    assert [c.layers[0].v_cache.scale.shape[3:] for c in seen] == [(), (), (2,)]
    assert model.config._attn_implementation == "attnlab_kvquant_sim"  # put back
    for row, f in _CACHE_FORMATS.items():
        assert m[f]["kl"] > 0 and abs(m[row]["kl"] - m[f]["kl"]) <= 0.04 * m[f]["kl"], (row, m[row], m[f])


def test_simulation_only_run():
    """``--no-kernel`` (kernel=False) simulates every format and runs no kernel: it had divided by the kernel's
    empty error lists."""
    cfg = E.KvquantConfig(quick=True, seeds=(0,), S=256, H=8, Hkv=2, D=64, n0=32, tokens=0, kernel=False)
    r = E.run(cfg)
    assert r.kernel == {} and set(r.errors["gaussian keys"]) == set(E.FORMATS)
