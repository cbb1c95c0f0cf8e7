"""Least-recently-used caches bounded by bytes, for the tensors attnlab keeps between calls.

A cache bounded only by its number of entries holds whatever those entries weigh: 64 random-feature
matrices of a million rows are gigabytes that stay. :class:`ByteLRU` counts what each entry holds (its
tensors' storage and its key's size, ``entry_bytes``), evicts the least recently used entries past
``max_bytes`` and never stores an entry that alone weighs more than ``max_bytes`` (it is computed,
returned and dropped). Every cache made here is listed by :func:`caches`, so a test can see what the
process keeps.

    >>> c = ByteLRU("demo", max_bytes=1 << 20)
    >>> w = c.get_or_compute(("seed", 0), lambda: torch.zeros(16, 16))   # computed once, then reused
    >>> c.nbytes <= c.max_bytes
    True
"""
from __future__ import annotations

import dataclasses
import sys
import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable, Hashable

import torch

__all__ = ["ByteLRU", "caches", "entry_bytes", "key_bytes", "tensor_bytes"]

_ALL: "weakref.WeakSet[ByteLRU]" = weakref.WeakSet()


def _walk(obj: Any, *, objects: bool) -> int:
    """Tensor storage bytes reachable through tuples, lists, dicts, frozensets and dataclass fields (each
    storage once), plus, with ``objects``, the Python objects themselves by ``sys.getsizeof``."""
    seen: set[int] = set()
    total = 0
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            st = x.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
            continue
        if objects:
            total += sys.getsizeof(x)
        if isinstance(x, (tuple, list)) and x and all(type(e) in (int, float, bool) for e in x[:8]):
            if objects:  # numbers (judged from the first few): counted, not walked one by one
                total += len(x) * 32
        elif isinstance(x, (tuple, list, frozenset)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            stack.extend(getattr(x, f.name) for f in dataclasses.fields(x))
    return total


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensor storage ``obj`` holds: a tensor, or tensors inside tuples, lists, dicts and
    dataclasses (each storage counted once)."""
    return _walk(obj, objects=False)


def key_bytes(key: Any) -> int:
    """An upper estimate of the bytes a key keeps alive: its Python objects by ``sys.getsizeof`` (a key
    holding a 30-million-entry tuple weighs about a gigabyte) and any tensors in it (a pattern used as
    its own key keeps its tensors alive)."""
    return _walk(key, objects=True)


def entry_bytes(key: Any, value: Any) -> int:
    """What an entry costs: its key (``key_bytes``) plus its value's tensors (``tensor_bytes``); an upper
    estimate (a storage shared by key and value counts twice)."""
    return key_bytes(key) + tensor_bytes(value)


class ByteLRU:
    """A thread-safe LRU map whose entries together weigh at most ``max_bytes`` (and number at most
    ``max_entries``, if given). ``nbytes`` is what it holds now."""

    def __init__(self, name: str, max_bytes: int, max_entries: int | None = None):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
        self.name, self.max_bytes, self.max_entries = name, max_bytes, max_entries
        self._data: OrderedDict = OrderedDict()  # key -> (value, nbytes)
        self._lock = threading.Lock()
        self.nbytes = 0
        _ALL.add(self)

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._data

    def get(self, key: Hashable, default=None):
        """The value under ``key`` (now the most recently used), else ``default``."""
        with self._lock:
            hit = self._data.get(key)
            if hit is None:
                return default
            self._data.move_to_end(key)
            return hit[0]

    def put(self, key: Hashable, value: Any, nbytes: int | None = None) -> Any:
        """Store ``value`` (weighing ``nbytes``, default ``entry_bytes(key, value)``), evicting the least
        recently used entries past the bounds; an entry heavier than ``max_bytes`` is not stored.
        Returns ``value``."""
        n = entry_bytes(key, value) if nbytes is None else int(nbytes)
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self.nbytes -= old[1]
            if n > self.max_bytes:
                return value
            self._data[key] = (value, n)
            self.nbytes += n
            while self._data and (self.nbytes > self.max_bytes
                                  or (self.max_entries is not None and len(self._data) > self.max_entries)):
                _, (_, m) = self._data.popitem(last=False)
                self.nbytes -= m
        return value

    def get_or_compute(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        """The cached value under ``key``, else ``compute()`` stored (``put``) and returned."""
        sentinel = object()
        hit = self.get(key, sentinel)
        if hit is not sentinel:
            return hit
        return self.put(key, compute())

    def clear(self) -> None:
        """Drop every entry."""
        with self._lock:
            self._data.clear()
            self.nbytes = 0

    def __repr__(self) -> str:
        return (f"ByteLRU({self.name!r}, {len(self._data)} entries, {self.nbytes} of {self.max_bytes} bytes"
                + (f", at most {self.max_entries} entries)" if self.max_entries is not None else ")"))


def caches() -> list[ByteLRU]:
    """Every ByteLRU alive in this process (the kernel's layouts, random features, projections, ...)."""
    return sorted(_ALL, key=lambda c: c.name)
