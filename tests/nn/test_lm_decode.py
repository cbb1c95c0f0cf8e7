"""TransformerLM generation on the decode path: each cached step runs the decode kernel (kernels/decode.py)
with K/V read in place from a reserved LayerCache, gives SDPA's greedy tokens, and batched prompts of
different lengths give each prompt's own tokens."""
from __future__ import annotations

import pytest
import torch

from attnlab.functional import storage
from attnlab.kernels import decode as dk
from attnlab.nn import KVCache, LayerCache, TransformerLM

pytestmark = [pytest.mark.usefixtures("one_thread")]
needs_ext = pytest.mark.skipif(not dk.available(), reason=f"decode extension: {dk.unavailable_reason()}")


def _lm(positional="rope", seed=0):
    torch.manual_seed(seed)
    return TransformerLM(61, 32, 4, 2, num_kv_heads=2, max_len=96, positional=positional).eval()


def test_reserved_cache_appends_in_place():
    """After reserve(n), appends up to n positions write into the same storage (no reallocation, no copy of
    the cached rows); past it the storage grows and keeps the rows."""
    c = LayerCache()
    c.reserve(40)
    k, v = torch.randn(2, 2, 5, 4), torch.randn(2, 2, 5, 3)
    c.append(k, v)
    ptr = c.keys.data_ptr()
    assert c.capacity == 40
    for _ in range(7):
        c.append(torch.randn(2, 2, 5, 4), torch.randn(2, 2, 5, 3))
        assert c.keys.data_ptr() == ptr
    assert c.length == 40 and torch.equal(c.keys[:, :, :5], k)
    c.append(torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 3))
    assert c.capacity >= 41 and torch.equal(c.values[:, :, :5], v)
    kv = KVCache(3)
    kv.reserve(12)
    assert all(x.reserved == 12 for x in kv.self_attn)
    with pytest.raises(ValueError, match="reserve takes an int >= 0"):
        c.reserve(-1)


@pytest.mark.skipif(not storage.huge_pages_available(), reason="no transparent huge pages on this OS")
def test_cache_storage_on_huge_pages_gives_the_same_tokens(monkeypatch):
    """LayerCache storage comes from empty_kv_cache (functional/storage.py Note [KV cache on huge pages]): with
    the size threshold lowered, a reserved cache sits in the 2 MiB-aligned mmap, and generation gives the
    tokens of torch storage (huge pages unavailable)."""
    lm = _lm()
    prompt = torch.randint(0, 61, (2, 11), generator=torch.Generator().manual_seed(4))
    monkeypatch.setattr(storage, "huge_pages_available", lambda: False)
    ref = lm.generate(prompt, 8, temperature=0)
    monkeypatch.undo()
    monkeypatch.setattr(storage, "MIN_HUGE_BYTES", 0)
    assert torch.equal(lm.generate(prompt, 8, temperature=0), ref)
    c = LayerCache()
    c.reserve(40)
    c.append(torch.randn(2, 2, 5, 4), torch.randn(2, 2, 5, 3))
    assert c.keys.data_ptr() % storage.HUGE_PAGE_BYTES == 0 and c.values.data_ptr() % storage.HUGE_PAGE_BYTES == 0


@needs_ext
def test_generate_steps_run_the_decode_kernel(monkeypatch):
    """Every cached one-token step's attention goes to the decode kernel (2 layers x 9 steps), and the greedy
    tokens equal the model's on SDPA and without the cache."""
    lm = _lm()
    prompt = torch.randint(0, 61, (2, 11), generator=torch.Generator().manual_seed(1))
    calls = []
    real = dk.decode_attention

    def counting(*a, **kw):
        calls.append(a[1].shape)
        return real(*a, **kw)

    monkeypatch.setattr(dk, "decode_attention", counting)
    out = lm.generate(prompt, 10, temperature=0)
    monkeypatch.undo()
    assert len(calls) == 2 * 9, len(calls)
    assert torch.equal(out, lm.generate(prompt, 10, temperature=0, use_cache=False))
    lm.set_mechanism("sdpa")
    assert torch.equal(out, lm.generate(prompt, 10, temperature=0))


@pytest.mark.parametrize("positional", ["rope", "alibi"])
def test_batched_prompts_of_different_lengths(positional):
    """prompt_lengths: each row's greedy continuation equals generating its prompt alone; pad_id after it."""
    lm = _lm(positional, seed=2)
    gen = torch.Generator().manual_seed(3)
    lengths = torch.tensor([9, 3, 6])
    prompts = torch.randint(1, 61, (3, 9), generator=gen)
    out = lm.generate(prompts, 7, temperature=0, prompt_lengths=lengths, pad_id=0)
    assert out.shape == (3, 16)
    for b in range(3):
        n = int(lengths[b])
        alone = lm.generate(prompts[b: b + 1, :n], 7, temperature=0)[0]
        assert torch.equal(out[b, : n + 7], alone), b
        assert bool((out[b, n + 7:] == 0).all())


def test_batched_prompts_need_relative_positions():
    lm = _lm("sinusoidal")
    with pytest.raises(ValueError, match="needs relative positions.*'sinusoidal'"):
        lm.generate(torch.ones(2, 4, dtype=torch.long), 2, prompt_lengths=torch.tensor([4, 2]))
    lm = _lm()
    with pytest.raises(ValueError, match=r"prompt_lengths must be in \[1, 4\]"):
        lm.generate(torch.ones(2, 4, dtype=torch.long), 2, prompt_lengths=torch.tensor([5, 2]))
