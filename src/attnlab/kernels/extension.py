"""Loading attnlab's compiled extensions: the variant built for the best CPU capability this machine runs.

Each extension (the tile kernel ``attnlab._C*``, the decode kernel ``attnlab._decode*``) is built by the
package's install once per capability (baseline, AVX2, AVX-512; setup.py); at run time the best variant
that imports and carries the wrapper's ABI version is used. A missing or broken build is never an error:
``Extension.load()`` returns None and ``reason`` says why (``ATTNLAB_NO_EXT=1`` turns every extension off).
A build that is missing or fails to load warns once per process (a RuntimeWarning saying why and how to
build it), so nobody runs on the slower fallback without knowing; ``ATTNLAB_NO_EXT=1`` is a choice and
stays silent.
"""
from __future__ import annotations

import importlib
import os
import sys
import warnings

import torch

__all__ = ["Extension", "transformed", "BUILD_HINT"]

#: how to build the extensions, in the words of the warning below
BUILD_HINT = ("build it with a C++ compiler: pip install --no-build-isolation -e . (a few minutes: setup.py compiles "
              "each CPU variant in turn and says how long first); ATTNLAB_NO_EXT=1 runs on the fallback without this "
              "warning")
_warned = False  # one warning per process, whichever extension is missing first


def _warn_missing(reason: str) -> None:
    """Warn once per process that a compiled extension is missing (Extension.load's first failure), pointing at
    the first frame outside attnlab: the user's call that would have used it."""
    global _warned
    if _warned:
        return
    _warned = True
    inside = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the attnlab package
    frame, level = sys._getframe(0), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(inside + os.sep):
        frame, level = frame.f_back, level + 1
    warnings.warn(f"attnlab: {reason}, so attention runs on the slower PyTorch fallback; {BUILD_HINT}",
                  RuntimeWarning, stacklevel=level)


class Extension:
    """One compiled extension: ``Extension("_C", abi=8, what="compiled extension")`` loads ``attnlab._C_avx512``,
    ``_C_avx2`` or ``_C``, whichever is the best this CPU runs (``torch.backends.cpu.get_cpu_capability()``,
    which ``ATEN_CPU_CAPABILITY`` overrides), once per process."""

    def __init__(self, base: str, abi: int, what: str):
        self.base, self.abi, self.what = base, abi, what
        self.module = None
        self.reason: str | None = None

    def variants(self) -> tuple[str, ...]:
        """The module names to try, best first, for this CPU's capability."""
        try:
            cap = torch.backends.cpu.get_cpu_capability()
        except Exception:  # very old torch: the baseline build runs everywhere
            cap = "DEFAULT"
        b = self.base
        return {"AVX512": (f"{b}_avx512", f"{b}_avx2", b), "AVX2": (f"{b}_avx2", b)}.get(cap, (b,))

    def load(self):
        """The loaded module, or None (``reason`` says why); tried once per process."""
        if self.module is not None or self.reason is not None:
            return self.module
        if os.environ.get("ATTNLAB_NO_EXT", "") not in ("", "0"):
            self.reason = "ATTNLAB_NO_EXT is set"
            return None
        errors = []
        for name in self.variants():
            try:
                mod = importlib.import_module(f"attnlab.{name}")
            except ImportError as e:
                errors.append(f"{name}: {e}")
                continue
            except Exception as e:  # a broken build must not break attnlab
                errors.append(f"{name}: {type(e).__name__}: {e}")
                continue
            if getattr(mod, "abi_version", None) != self.abi:
                errors.append(f"{name}: built from older sources (abi {getattr(mod, 'abi_version', None)}, "
                              f"need {self.abi}); rebuild: pip install --no-build-isolation -e .")
                continue
            self.module = mod
            return mod
        missing = all("No module named" in e for e in errors)
        self.reason = (f"the {self.what} is not built (pip install --no-build-isolation -e . builds it)" if missing
                       else f"the {self.what} failed to load (" + "; ".join(errors) + ")")
        _warn_missing(f"the {self.what} is not built" if missing else self.reason)  # ATTNLAB_NO_EXT returned above
        return None


def transformed(*tensors) -> bool:
    """Whether any tensor is a vmap or grad transform's wrapper (torch.func's, or the legacy vmap of
    gradcheck's batched gradients): an extension cannot read a wrapper's data, so such calls go through the
    dispatcher or a pure-PyTorch path."""
    for t in tensors:  # a plain loop: every plan-cache hit asks (Note [Small call overhead])
        if t is not None and (_WRAPPED(t) or _LEGACY_BATCHED(t)):
            return True
    return False


_WRAPPED = torch._C._functorch.is_functorch_wrapped_tensor
_LEGACY_BATCHED = torch._C._functorch.is_legacy_batchedtensor
