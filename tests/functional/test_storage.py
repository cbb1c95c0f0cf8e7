"""KV-cache storage on huge pages (functional/storage.py, Note [KV cache on huge pages]): empty_kv_cache is
zeroed, has the shape and dtype asked for, outlives every other reference to its mmap, falls back to
torch.zeros when detection says no, and names the argument on bad input; decode through it equals decode
through torch.zeros storage."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

import attnlab
from attnlab.functional import storage
from attnlab.functional.kvcache import QuantizedKV
from attnlab.kernels import decode as dk

BIG = (1, 4099, 2, 128)  # 4 MiB of fp32: past the 2 MiB threshold, an awkward length
huge_ok = pytest.mark.skipif(not storage.huge_pages_available(), reason="no transparent huge pages on this OS")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
@pytest.mark.parametrize("huge", [None, True, False])
def test_zeroed_with_shape_and_dtype(dtype, huge):
    if huge is True and not storage.huge_pages_available():
        pytest.skip("no transparent huge pages on this OS")
    t = attnlab.empty_kv_cache(*BIG, dtype=dtype, huge_pages=huge)
    assert t.shape == BIG and t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
    assert int((t != 0).sum()) == 0
    t[0, -1, -1, -1] = 3  # writable, and the last element is inside the mapping
    assert int(t.sum()) == 3


def test_tuple_shape_and_empty_dims():
    assert attnlab.empty_kv_cache((2, 3, 4)).shape == (2, 3, 4)
    assert attnlab.empty_kv_cache(0, 5, huge_pages=None).numel() == 0


@huge_ok
def test_huge_storage_is_an_aligned_mmap():
    t = attnlab.empty_kv_cache(*BIG, huge_pages=True)
    assert t.data_ptr() % storage.HUGE_PAGE_BYTES == 0  # a huge page must be naturally aligned
    small = attnlab.empty_kv_cache(2, 3, huge_pages=True)  # True: the mmap at any size
    assert small.data_ptr() % storage.HUGE_PAGE_BYTES == 0


@huge_ok
def test_lifetime_outlives_every_other_reference():
    t = attnlab.empty_kv_cache(*BIG, huge_pages=True)
    t.fill_(1.5)
    view = t[0, 7:9, 1]  # a view is the only reference left
    base = weakref.ref(t)
    del t
    gc.collect()
    assert base() is None
    filler = [torch.full((1 << 20,), 9.0) for _ in range(4)]  # reuse freed memory, were it freed
    assert float(view.sum()) == 1.5 * 2 * 128
    del filler


def test_fallback_when_detection_says_no(monkeypatch):
    monkeypatch.setattr(storage, "huge_pages_available", lambda: False)
    t = attnlab.empty_kv_cache(*BIG)  # auto: plain torch.zeros
    assert t.shape == BIG and int((t != 0).sum()) == 0
    with pytest.raises(attnlab.AttentionInputError, match="huge_pages=True"):
        attnlab.empty_kv_cache(*BIG, huge_pages=True)


def test_detection_reads_the_sysfs_mode(monkeypatch, tmp_path):
    f = tmp_path / "enabled"
    monkeypatch.setattr(storage, "_THP_ENABLED", str(f))
    f.write_text("always madvise [never]\n")
    assert storage.transparent_hugepage_mode() == "never" and not storage.huge_pages_available()
    f.write_text("always [madvise] never\n")
    assert storage.transparent_hugepage_mode() == "madvise"
    assert storage.huge_pages_available() == hasattr(storage.mmap, "MADV_HUGEPAGE")
    monkeypatch.delattr(storage.mmap, "MADV_HUGEPAGE", raising=False)
    assert not storage.huge_pages_available()
    f.unlink()
    assert storage.transparent_hugepage_mode() is None


def test_small_tensors_take_torch_zeros(monkeypatch):
    calls = []
    monkeypatch.setattr(storage, "_huge_tensor", lambda *a: calls.append(a))
    attnlab.empty_kv_cache(1, 16, 2, 64)  # 8 KiB
    assert not calls


@pytest.mark.parametrize("args, kwargs, name", [
    ((2, -1), {}, "shape"), ((2, 3.0), {}, "shape"), ((True, 3), {}, "shape"),
    ((2, 3), {"dtype": "float32"}, "dtype"), ((2, 3), {"huge_pages": 1}, "huge_pages"),
])
def test_bad_args_name_the_argument(args, kwargs, name):
    with pytest.raises(attnlab.AttentionInputError, match=name):
        attnlab.empty_kv_cache(*args, **kwargs)


@huge_ok
def test_fresh_allocation_reports_its_huge_pages():
    """smaps is read back without asserting the kernel found 2 MiB pages (it may not: memory pressure)."""
    t = attnlab.empty_kv_cache(*BIG, huge_pages=True)
    t.fill_(1)
    got = storage.anon_huge_bytes(t)
    assert got is None or 0 <= got <= t.numel() * 4 + storage.HUGE_PAGE_BYTES
    other = storage.anon_huge_bytes(torch.zeros(3))  # any tensor's mapping is found
    assert other is None or other >= 0


@pytest.mark.parametrize("huge", [True, False])
def test_quantized_empty_uses_the_storage(huge):
    if huge and not storage.huge_pages_available():
        pytest.skip("no transparent huge pages on this OS")
    c = QuantizedKV.empty(*BIG, huge_pages=huge)
    assert c.data.dtype == torch.int8 and c.data.shape == BIG and c.scale.shape == BIG[:3]
    assert int((c.data != 0).sum()) == 0 and int((c.scale != 0).sum()) == 0
    if huge:
        assert c.data.data_ptr() % storage.HUGE_PAGE_BYTES == 0


@pytest.mark.skipif(not dk.available(), reason=f"decode extension: {dk.unavailable_reason()}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_through_huge_storage_is_identical(dtype):
    g = torch.Generator().manual_seed(3)
    B, S, Hkv, H, D, T = 1, 4099, 4, 8, 128, 16
    k, v = (torch.randn(B, S, Hkv, D, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(B, 1, H, D, generator=g).to(dtype)
    table = torch.randperm(-(-S // T), generator=g).view(1, -1).to(torch.int32)
    j = torch.arange(S)
    outs = []
    for huge in (False, None):
        kc, vc = (attnlab.empty_kv_cache(*x.shape, dtype=dtype, huge_pages=huge).copy_(x) for x in (k, v))
        pk, pv = (attnlab.empty_kv_cache(table.numel(), T, Hkv, D, dtype=dtype, huge_pages=huge) for _ in range(2))
        pk[table.long()[:, j // T], j % T], pv[table.long()[:, j // T], j % T] = k, v
        outs.append((attnlab.attention_with_kvcache(q, kc, vc, cache_seqlens=S),
                     attnlab.attention_with_kvcache(q, pk, pv, cache_seqlens=S, block_table=table)))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@huge_ok
def test_mapping_is_released_with_the_last_view():
    """The mmap is unmapped once no tensor refers to it (no leak per reallocation of a growing cache)."""
    def mapped(addr):
        with open("/proc/self/maps") as f:
            spans = [line.split()[0].split("-") for line in f]
        return any(int(lo, 16) <= addr < int(hi, 16) for lo, hi in spans)

    t = attnlab.empty_kv_cache(*BIG, huge_pages=True)
    addr = t.data_ptr()
    view = t[0, 1]
    del t
    gc.collect()
    assert mapped(addr)
    del view
    gc.collect()
    assert not mapped(addr)
