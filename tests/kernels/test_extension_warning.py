"""A missing compiled extension warns once per process, saying why and how to build it; ATTNLAB_NO_EXT=1 (a
choice, not an accident) stays silent."""
from __future__ import annotations

import warnings

import pytest

from attnlab.kernels import extension


def _loads(ext) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        assert ext.load() is None
        assert ext.load() is None  # tried once: no second warning from the same extension
    return [w for w in got if issubclass(w.category, RuntimeWarning)]


def test_a_missing_build_warns_once_per_process(monkeypatch):
    monkeypatch.delenv("ATTNLAB_NO_EXT", raising=False)
    monkeypatch.setattr(extension, "_warned", False)
    got = _loads(extension.Extension("_no_such_kernel", 1, "test extension"))
    assert len(got) == 1
    msg = str(got[0].message)
    assert "test extension is not built" in msg and "fallback" in msg
    assert "pip install --no-build-isolation" in msg and "ATTNLAB_NO_EXT=1" in msg
    assert "\n" not in msg
    # a second missing extension in the same process: already said
    assert _loads(extension.Extension("_no_such_kernel_either", 1, "other extension")) == []


def test_the_explicit_opt_out_is_silent(monkeypatch):
    monkeypatch.setenv("ATTNLAB_NO_EXT", "1")
    monkeypatch.setattr(extension, "_warned", False)
    ext = extension.Extension("_no_such_kernel", 1, "test extension")
    assert _loads(ext) == []
    assert ext.reason == "ATTNLAB_NO_EXT is set"


def test_a_stale_build_warns_too(monkeypatch):
    """A build from older sources (wrong ABI) is as unusable as a missing one: same warning, naming the rebuild."""
    from attnlab.kernels import compiled

    if compiled.variant() is None:
        pytest.skip("no compiled extension here to find stale")
    monkeypatch.delenv("ATTNLAB_NO_EXT", raising=False)
    monkeypatch.setattr(extension, "_warned", False)
    base = compiled.variant().rsplit(".", 1)[1].split("_avx")[0]
    got = _loads(extension.Extension(base, -1, "compiled extension"))  # no build carries ABI -1
    assert len(got) == 1 and "failed to load" in str(got[0].message) and "older sources" in str(got[0].message)
