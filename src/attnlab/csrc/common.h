// The preamble both extensions share (the compiled attention kernel, attention.cpp, and the decode kernel,
// decode.cpp): the headers, the capability's intrinsics, and the attributes every build's module exports.
// Each .cpp is compiled once per CPU capability (DEFAULT, AVX2, AVX512; setup.py): CPU_CAPABILITY names it.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/cpu/vec/functional.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#define ATTNLAB_STR2(x) #x
#define ATTNLAB_STR(x) ATTNLAB_STR2(x)

// Every module says which capability it was built for (the Python wrapper checks it against the one it asked for)
// and its Python-facing ABI version (bumped whenever a signature changes: a stale build is refused, not called).
#define ATTNLAB_MODULE_ATTRS(m, abi)                     \
  do {                                                   \
    (m).attr("capability") = ATTNLAB_STR(CPU_CAPABILITY); \
    (m).attr("abi_version") = (abi);                     \
  } while (0)
