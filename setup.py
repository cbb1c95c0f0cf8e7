"""Build of attnlab's optional compiled CPU attention kernel (attnlab._C*); metadata is in pyproject.toml.

The kernel builds against the torch already installed (``pip install --no-build-isolation -e .``),
once per CPU capability: ``attnlab._C`` (baseline x86-64 / any CPU), ``_C_avx2`` and ``_C_avx512``, and
its decode kernel likewise (``attnlab._decode``, ``_decode_avx2``, ``_decode_avx512``);
at run time attnlab imports the best one the CPU runs. Any failure (no torch at build time, no
compiler, a compile error) prints one line and the package installs without it: the pure-PyTorch
kernels then run instead. ``ATTNLAB_NO_BUILD_EXT=1`` skips the build.
"""
from __future__ import annotations

import os
import platform
import sys

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join("src", "attnlab", "csrc")


def _say(msg: str) -> None:
    print(f"attnlab: {msg}", file=sys.stderr)


def _extensions():
    if os.environ.get("ATTNLAB_NO_BUILD_EXT"):
        _say("ATTNLAB_NO_BUILD_EXT set: compiled CPU kernel not built (pure-PyTorch kernels only)")
        return [], {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except Exception as e:  # build isolation without torch, or a broken torch
        _say(f"compiled CPU kernel not built: torch is not importable at build time ({type(e).__name__}: {e}); "
             "install with `pip install --no-build-isolation -e .` after torch")
        return [], {}

    class OptionalBuildExt(BuildExtension):
        """Builds each kernel variant; a failure is one line, never a failed install."""

        def run(self):
            try:
                super().run()
            except Exception as e:  # e.g. no compiler at all
                _say(f"compiled CPU kernel not built ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                     "attnlab falls back to its pure-PyTorch kernels")

        def copy_extensions_to_source(self):
            # editable / --inplace: copy only the variants that built (a missing one would stop the rest)
            saved = self.extensions
            self.extensions = [e for e in saved if os.path.exists(
                os.path.join(self.build_lib, self.get_ext_filename(self.get_ext_fullname(e.name))))]
            try:
                super().copy_extensions_to_source()
            finally:
                self.extensions = saved

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as e:
                _say(f"{ext.name} not built ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                     "attnlab falls back to another variant or to its pure-PyTorch kernels")

    # -g0: no debug info (Python's CFLAGS add -g): 0.6 MB per variant instead of 15, and a quarter less compile
    # time (measured: _C_avx512 + _decode_avx512 62 s against 88 s, one core)
    common = ["-O3", "-g0", "-fopenmp", "-fvisibility=hidden", "-Wno-unknown-pragmas"]
    variants = [("attnlab._C", "attention.cpp", ["-DCPU_CAPABILITY=DEFAULT"])]
    if platform.machine().lower() in ("x86_64", "amd64"):
        variants += [
            ("attnlab._C_avx2", "attention_avx2.cpp",
             ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]),
            ("attnlab._C_avx512", "attention_avx512.cpp",
             ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
              "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]),
        ]
    # the decode kernel (csrc/decode.cpp): its own module per variant, attnlab._decode, _decode_avx2, _decode_avx512
    variants += [(name.replace("._C", "._decode"), src.replace("attention", "decode"), flags)
                 for name, src, flags in variants]
    only = os.environ.get("ATTNLAB_EXT_ONLY")  # development: build one variant, e.g. "_C_avx512"
    if only:
        variants = [v for v in variants if v[0].endswith(only) or v[0].endswith(only.replace("_C", "_decode"))]
    # each variant is one C++ file compiled on one core, one after another (measured with -g0: about 31 s each
    # on a Sapphire Rapids class Xeon): say so before the silence
    _say(f"building {len(variants)} compiled kernel variants, one after another: about "
         f"{max(1, round(len(variants) * 40 / 60))} minutes on a current x86 core (ATTNLAB_NO_BUILD_EXT=1 skips them; "
         "attnlab then runs its pure-PyTorch kernels)")
    exts = [CppExtension(name, [os.path.join(CSRC, src)], extra_compile_args=common + flags,
                         depends=[os.path.join(CSRC, "common.h"), os.path.join(CSRC, base)],
                         extra_link_args=["-fopenmp"]) for name, src, flags in variants
            for base in [src.replace("_avx2", "").replace("_avx512", "")]]  # the source the per-ISA wrapper includes
    return exts, {"build_ext": OptionalBuildExt}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
