// attnlab's compiled CPU attention: one flash-attention-2 style kernel driven by a block layout.
//
// Shapes (the Python wrapper brings every input to this form; strides: Note [Operand strides]):
//   q [N, H, L, E], k [N, Hkv, S, E], v [N, Hkv, S, Ev]; H % Hkv == 0 (query head h reads kv head
//   h / (H / Hkv): GQA without copying K/V).
//   Layout, for each of Nl (1 or N) batch elements and each query block of bq rows:
//     kv_num [Nl, nq] int32      how many key blocks (of bk keys) to visit,
//     kv_idx [Nl, nq, maxk]      which ones, ascending,
//     tile_id [Nl, nq, maxk]     -1 for a FULL block, else the row of `tiles` [T, bq, bk] (uint8)
//                                holding the pattern's exact mask inside that block.
//   keep: optional uint8, bias: optional float mask, each 4-D and read through its strides (a
//   broadcast dim has stride 0), so a user L x S mask is never expanded or copied per head.
//
// Forward: online softmax over the visited key blocks; returns out [N, H, L, Ev] and the
// log-sum-exp lse [N, H, L] (float32; float64 for float64), -inf for a row with no key (out 0), and
// for half types when asked (the inputs need grad) out_acc [N, H, L, Ev] float32, O before rounding.
// Backward: recomputes each block's probabilities from lse (FA2), accumulating dq per query block
// and dk, dv in float buffers owned by one unit, (n, kv head, range of key blocks), units pulled by
// threads longest first (Note [Backward balance]); when the
// float mask needs grad, also dbias [N, H, L, S] (the score gradient of the visited blocks, else 0).
//
// Note [Relative bias]: a bias that depends on (head, j - i) only (T5 buckets, a learned relative table, as
// flex_attention's probe finds them) comes as rel [H, L + S - 1], bias(h, i, j) = rel[h, j - i + L - 1]:
// the table is O(L + S), read contiguously along each score row (the row of query i starts at offset
// k0 - i + L - 1), and the layout's block skipping is unchanged. Its gradient, when asked, is the score
// gradient summed along each diagonal: every backward unit sums into its own [groups, L + S - 1] rows,
// added up in unit order after the pass (so the result does not depend on the schedule); the caller
// (autograd) takes it on into whatever the table was computed from.
//
// Note [Masked scores]: masking *overwrites* a score with -inf rather than adding, so a NaN or Inf
// produced by a masked key cannot reach the softmax. Values of keys no query may attend are zeroed
// by the caller (0 * NaN in P @ V would otherwise leak).
//
// The same source is compiled once per CPU capability (DEFAULT, AVX2, AVX512; see setup.py); the
// Python wrapper imports the best module the CPU runs.

#include "common.h"
#include <ATen/native/CPUBlas.h>


// BLAS from the MKL that PyTorch's CPU build carries (what its own CPU flash kernel reaches through
// cpublas::gemm, whose float overloads are not exported). Declared weak: on a torch without MKL the
// pointers are null and a plain loop runs instead (correct, slow; reported by has_blas()).
extern "C" {
void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
            const int*, const float*, const int*, const float*, float*, const int*) __attribute__((weak));
void dgemm_(const char*, const char*, const int*, const int*, const int*, const double*, const double*,
            const int*, const double*, const int*, const double*, double*, const int*) __attribute__((weak));
void cblas_gemm_bf16bf16f32(int, int, int, int, int, int, float, const uint16_t*, int, const uint16_t*, int,
                            float, float*, int) __attribute__((weak));
void cblas_gemm_f16f16f32(int, int, int, int, int, int, float, const uint16_t*, int, const uint16_t*, int,
                          float, float*, int) __attribute__((weak));
}

namespace {

using at::vec::Vectorized;
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;  // CBLAS enum values

template <typename T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };

template <typename T, typename A>
void gemm_loop(bool ta, bool tb, int64_t M, int64_t N, int64_t K, A alpha, const T* a, int64_t lda,
               const T* b, int64_t ldb, A beta, A* c, int64_t ldc) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      A s = 0;
      for (int64_t p = 0; p < K; ++p)
        s += static_cast<A>(ta ? a[p * lda + i] : a[i * lda + p]) * static_cast<A>(tb ? b[j * ldb + p] : b[p * ldb + j]);
      c[i * ldc + j] = alpha * s + (beta == A(0) ? A(0) : beta * c[i * ldc + j]);
    }
}

// Note [Gemm arguments]: every product's arguments are checked before it runs, by the wrappers below,
// so that nothing MKL or oneDNN would refuse reaches them: MKL prints "Intel oneMKL ERROR: Parameter N
// was incorrect" on stdout and returns with C untouched (the kernel then read stale scratch), oneDNN
// throws or computes from the wrong rows. A refused product is a TORCH_CHECK of ours (a RuntimeError in
// Python). Operands reach the products with their row stride as leading dim (q, k, v: stride(2)); the
// wrapper's operand preparation (kernels/compiled.py, Note [Operand strides]) and check_operand below
// make sure every such stride is one the products take.
//
// Row-major X [rows, cols] with leading dim ld, as every back end reads it: ld >= max(1, cols), and all
// of M, N, K, ld within MKL's 32-bit int (LP64 interface).
inline void check_ld(const char* what, int64_t rows, int64_t cols, int64_t ld) {
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  TORCH_CHECK(rows >= 0 && cols >= 0 && rows <= kIntMax && cols <= kIntMax && ld >= std::max<int64_t>(1, cols) &&
                  ld <= kIntMax,
              "attnlab._C: a tile product's ", what, " operand [", rows, ", ", cols, "] has leading dim ", ld,
              ", which the gemm back ends refuse (need max(1, ", cols, ") <= ld <= 2^31 - 1)");
}
// Row-major C[M, N] = op(A)[M, K] @ op(B)[K, N]: A stored [M, K] (or [K, M] when ta), B [K, N] ([N, K]).
inline void check_gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc) {
  check_ld("A", ta ? K : M, ta ? M : K, lda);
  check_ld("B", tb ? N : K, tb ? K : N, ldb);
  check_ld("C", M, N, ldc);
}

// Which back end runs the products that are not on brgemm: MKL's gemm from torch's own build, or
// (kLoop, or where torch has no MKL) gemm_loop. ATTNLAB_EXT_GEMM picks it (kernels/compiled.py).
enum GemmMode : int64_t { kGemmLoop = 0, kGemmBlas = 1, kGemmBrgemm = 2 };

// Row-major C[M, N] = alpha * op(A)[M, K] @ op(B)[K, N] + beta * C, C in the accumulation type.
// Column-major BLAS computes the transpose: C^T = op(B)^T op(A)^T.
inline void blas_gemm(bool blas, bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* a,
                      int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  check_gemm(ta, tb, M, N, K, lda, ldb, ldc);
  if (!blas || !sgemm_) return gemm_loop(ta, tb, M, N, K, alpha, a, lda, b, ldb, beta, c, ldc);
  const char tA = ta ? 'T' : 'N', tB = tb ? 'T' : 'N';
  const int m = M, n = N, k = K, la = lda, lb = ldb, lc = ldc;
  sgemm_(&tB, &tA, &n, &m, &k, &alpha, b, &lb, a, &la, &beta, c, &lc);
}
inline void blas_gemm(bool blas, bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha, const double* a,
                      int64_t lda, const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
  check_gemm(ta, tb, M, N, K, lda, ldb, ldc);
  if (!blas || !dgemm_) return gemm_loop(ta, tb, M, N, K, alpha, a, lda, b, ldb, beta, c, ldc);
  const char tA = ta ? 'T' : 'N', tB = tb ? 'T' : 'N';
  const int m = M, n = N, k = K, la = lda, lb = ldb, lc = ldc;
  dgemm_(&tB, &tA, &n, &m, &k, &alpha, b, &lb, a, &la, &beta, c, &lc);
}
inline void blas_gemm(bool blas, bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha,
                      const at::BFloat16* a, int64_t lda, const at::BFloat16* b, int64_t ldb, float beta, float* c,
                      int64_t ldc) {
  check_gemm(ta, tb, M, N, K, lda, ldb, ldc);
  if (!blas || !cblas_gemm_bf16bf16f32) return gemm_loop(ta, tb, M, N, K, alpha, a, lda, b, ldb, beta, c, ldc);
  cblas_gemm_bf16bf16f32(kRowMajor, ta ? kTrans : kNoTrans, tb ? kTrans : kNoTrans, M, N, K, alpha,
                         reinterpret_cast<const uint16_t*>(a), lda, reinterpret_cast<const uint16_t*>(b), ldb,
                         beta, c, ldc);
}
inline void blas_gemm(bool blas, bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const at::Half* a,
                      int64_t lda, const at::Half* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  check_gemm(ta, tb, M, N, K, lda, ldb, ldc);
  if (!blas || !cblas_gemm_f16f16f32) return gemm_loop(ta, tb, M, N, K, alpha, a, lda, b, ldb, beta, c, ldc);
  cblas_gemm_f16f16f32(kRowMajor, ta ? kTrans : kNoTrans, tb ? kTrans : kNoTrans, M, N, K, alpha,
                       reinterpret_cast<const uint16_t*>(a), lda, reinterpret_cast<const uint16_t*>(b), ldb,
                       beta, c, ldc);
}

// Whether this thread's AMX tile configuration is the one torch's cpublas::brgemm believes loaded
// (Note [AMX tile state]).
inline bool& tiles_trusted() {
  static thread_local bool trusted = false;
  return trusted;
}

// The kernels' `gemm(ta, tb, M, N, K, ...)`: a local object of this type named `gemm` carries the call's
// back end (MKL or the loop) into every product of forward_impl / backward_impl (and their threads).
struct TileGemm {
  bool blas;
  template <typename T, typename A>
  void operator()(bool ta, bool tb, int64_t M, int64_t N, int64_t K, A alpha, const T* a, int64_t lda, const T* b,
                  int64_t ldb, A beta, A* c, int64_t ldc) const {
    blas_gemm(blas, ta, tb, M, N, K, alpha, a, lda, b, ldb, beta, c, ldc);
    if (blas) tiles_trusted() = false;  // MKL may have loaded or released the AMX tiles (Note [AMX tile state])
  }
};


// Everything besides q @ k^T that shapes one block of scores.
template <typename A>
struct ScoreMods {
  A softcap = 0;                   // s -> softcap * tanh(s / softcap) when > 0
  const float* alibi = nullptr;    // [H] slopes (ALiBi, computed from positions, no L x S tensor)
  bool alibi_causal = false;       // slope * (j - i'); else -slope * |j - i'| (i' = i + offset)
  int64_t alibi_offset = 0;        // S - L for bottom-right alignment
  const uint8_t* keep = nullptr;   // user bool mask, 4-D strides ks
  int64_t ks[4] = {0, 0, 0, 0};
  const A* bias = nullptr;         // user float mask, 4-D strides bs
  int64_t bs[4] = {0, 0, 0, 0};
  const A* rel = nullptr;          // relative bias [H, L + S - 1]: rel[h, j - i + L - 1] (Note [Relative bias])
  int64_t rel_w = 0, rel_off = 0;  // its row length L + S - 1 and offset L - 1
  bool plain() const { return softcap <= 0 && !alibi && !keep && !bias && !rel; }
};

// Soft-capping, ALiBi, the user bias and every mask, applied to a block of scaled scores
// s [rows, cols] (leading dim ld). With `tanh_out`, keeps tanh(s / cap) for the backward.
// `tile` is the pattern's [bq, bk] mask for this block (row stride ld), or null for a full block.
template <typename A>
void modify_scores(A* s, int64_t ld, int64_t rows, int64_t cols, int64_t n, int64_t h, int64_t q0, int64_t k0,
                   const uint8_t* tile, const ScoreMods<A>& mod, A* tanh_out, A mul = A(1)) {
  using V = Vectorized<A>;
  if (mul != A(1)) {  // the score scale, when the product could not apply it (brgemm has no alpha)
    for (int64_t r = 0; r < rows; ++r)
      at::vec::map([mul](V x) { return x * V(mul); }, s + r * ld, s + r * ld, cols);
  }
  if (mod.softcap > 0) {
    const A cap = mod.softcap, inv = A(1) / cap;
    for (int64_t r = 0; r < rows; ++r) {
      A* row = s + r * ld;
      A* t = tanh_out ? tanh_out + r * ld : nullptr;
      int64_t c = 0;
      for (; c + V::size() <= cols; c += V::size()) {
        V th = (V::loadu(row + c) * V(inv)).tanh();
        if (t) th.store(t + c);
        (th * V(cap)).store(row + c);
      }
      for (; c < cols; ++c) {
        A th = std::tanh(row[c] * inv);
        if (t) t[c] = th;
        row[c] = cap * th;
      }
    }
  }
  if (mod.alibi) {
    const A slope = static_cast<A>(mod.alibi[h]);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = q0 + r + mod.alibi_offset;
      A* row = s + r * ld;
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t d = (k0 + c) - i;
        row[c] += mod.alibi_causal ? slope * A(d) : -slope * A(d < 0 ? -d : d);
      }
    }
  }
  if (mod.rel) {  // Note [Relative bias]: row i reads the table from offset k0 - i on, contiguous
    for (int64_t r = 0; r < rows; ++r) {
      const A* b = mod.rel + h * mod.rel_w + (k0 - (q0 + r) + mod.rel_off);
      A* row = s + r * ld;
      int64_t c = 0;
      for (; c + V::size() <= cols; c += V::size()) (V::loadu(row + c) + V::loadu(b + c)).store(row + c);
      for (; c < cols; ++c) row[c] += b[c];
    }
  }
  if (mod.bias) {
    for (int64_t r = 0; r < rows; ++r) {
      const A* b = mod.bias + n * mod.bs[0] + h * mod.bs[1] + (q0 + r) * mod.bs[2] + k0 * mod.bs[3];
      A* row = s + r * ld;
      const int64_t st = mod.bs[3];
      if (st == 1) {
        for (int64_t c = 0; c < cols; ++c) row[c] += b[c];
      } else {
        for (int64_t c = 0; c < cols; ++c) row[c] += b[c * st];
      }
    }
  }
  const A ninf = -std::numeric_limits<A>::infinity();  // Note [Masked scores]: overwrite, never add
  if (tile) {
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t* t = tile + r * ld;
      A* row = s + r * ld;
      for (int64_t c = 0; c < cols; ++c) row[c] = t[c] ? row[c] : ninf;
    }
  }
  if (mod.keep) {
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t* kp = mod.keep + n * mod.ks[0] + h * mod.ks[1] + (q0 + r) * mod.ks[2] + k0 * mod.ks[3];
      A* row = s + r * ld;
      const int64_t st = mod.ks[3];
      for (int64_t c = 0; c < cols; ++c) row[c] = kp[c * st] ? row[c] : ninf;
    }
  }
}

// Note [Row passes]: after each tile product, every score row is read twice: once for its max, once
// for exp (which also sums and stores the probabilities in the second product's dtype). Both passes are
// pure arithmetic over the tile (for a bf16 tile about as long as the AMX products themselves), so they
// keep several independent accumulators (a single max/add chain is bound by its latency, ~4 cycles per
// vector) and the exp pass writes bf16 directly instead of storing fp32 and converting in a third pass.
// A NaN score need not survive the max (x86 max drops it); it reaches the sum through exp and so the
// output (see finish_row).
template <typename A>
inline A row_max(const A* x, int64_t n) {
  using V = Vectorized<A>;
  constexpr int64_t W = V::size();
  A m = -std::numeric_limits<A>::infinity();
  int64_t c = 0;
  if (n >= W) {
    V m0(m), m1(m), m2(m), m3(m);
    for (; c + 4 * W <= n; c += 4 * W) {
      m0 = at::vec::maximum(m0, V::loadu(x + c));
      m1 = at::vec::maximum(m1, V::loadu(x + c + W));
      m2 = at::vec::maximum(m2, V::loadu(x + c + 2 * W));
      m3 = at::vec::maximum(m3, V::loadu(x + c + 3 * W));
    }
    for (; c + W <= n; c += W) m0 = at::vec::maximum(m0, V::loadu(x + c));
    m0 = at::vec::maximum(at::vec::maximum(m0, m1), at::vec::maximum(m2, m3));
    m = at::vec::vec_reduce_all<A>([](V& a, V& b) { return at::vec::maximum(a, b); }, m0);
  }
  for (; c < n; ++c) m = std::max(m, x[c]);
  return m;
}

// The max without NaN propagation (x86's max keeps either operand when one is NaN), for the half-type
// path: a NaN score still reaches the row's sum through exp_sum (exp2_half_target keeps NaN), so the
// row's output is NaN either way, and the max costs one instruction per vector instead of four.
template <typename A>
inline A row_max_loose(const A* x, int64_t n) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<A, float>) {
    const __m512 lo = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __m512 m0 = lo, m1 = lo, m2 = lo, m3 = lo;
    int64_t c = 0;
    for (; c + 64 <= n; c += 64) {
      m0 = _mm512_max_ps(m0, _mm512_loadu_ps(x + c));
      m1 = _mm512_max_ps(m1, _mm512_loadu_ps(x + c + 16));
      m2 = _mm512_max_ps(m2, _mm512_loadu_ps(x + c + 32));
      m3 = _mm512_max_ps(m3, _mm512_loadu_ps(x + c + 48));
    }
    for (; c + 16 <= n; c += 16) m0 = _mm512_max_ps(m0, _mm512_loadu_ps(x + c));
    if (c < n) m1 = _mm512_mask_max_ps(m1, __mmask16((1u << (n - c)) - 1), m1, _mm512_maskz_loadu_ps(__mmask16((1u << (n - c)) - 1), x + c));
    return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3)));
  }
#endif
  return row_max(x, n);
}

template <typename T, typename A>
inline void to_gemm_type(const A* src, T* dst, int64_t n) {
  at::vec::convert(src, dst, n);
}

// dst <- exp(x * mul - shift) (dst may be x, or x's row in the product's dtype); returns the sum in A.
// exp(-inf) is 0 (masked scores).
template <typename T, typename A>
inline A exp_sum(const A* x, int64_t n, A shift, A mul, T* dst, bool /*masked*/ = true) {
  using V = Vectorized<A>;
  constexpr int64_t W = V::size();
  const V vsh(-shift), vm(mul);
  V s0(0), s1(0);
  int64_t c = 0;
  if constexpr (std::is_same_v<T, A>) {
    for (; c + 2 * W <= n; c += 2 * W) {
      V e0 = at::vec::fmadd(V::loadu(x + c), vm, vsh).exp_u20();
      V e1 = at::vec::fmadd(V::loadu(x + c + W), vm, vsh).exp_u20();
      e0.store(dst + c);
      e1.store(dst + c + W);
      s0 = s0 + e0;
      s1 = s1 + e1;
    }
  } else {
    A tmp[2 * W];
    for (; c + 2 * W <= n; c += 2 * W) {
      V e0 = at::vec::fmadd(V::loadu(x + c), vm, vsh).exp_u20();
      V e1 = at::vec::fmadd(V::loadu(x + c + W), vm, vsh).exp_u20();
      s0 = s0 + e0;
      s1 = s1 + e1;
      e0.store(tmp);
      e1.store(tmp + W);
      at::vec::convert(tmp, dst + c, 2 * W);
    }
  }
  s0 = s0 + s1;
  A s = at::vec::vec_reduce_all<A>([](V& a, V& b) { return a + b; }, s0);
  for (; c < n; ++c) {
    const A e = std::exp(x[c] * mul - shift);
    s += e;
    dst[c] = static_cast<T>(e);
  }
  return s;
}

#if defined(CPU_CAPABILITY_AVX512)
// Note [Half-type exp]: probabilities headed for a bf16/fp16 product are rounded to 8 (11) significant
// bits, so their exp need not be at::vec's exp_u20 (~17 instructions with its range checks). This one is
// 2^t with t = (x * mul - shift) * log2(e): f = t - floor(t) in [0, 1] by one vreduceps, a degree-4 fit of
// 2^f on [0, 1] (relative error 2.7e-6 evaluated in fp32, fitted for this kernel: 1/700 of bf16's and 1/180
// of fp16's rounding of the probabilities, about exp_u20's 20 ulp), and vscalefps, which multiplies by
// 2^floor(t) itself (no separate rounding, subtraction or clamp: 3 of the pass's ~12 micro-ops per vector;
// measured 5-15 % of a dense bf16 forward's CPU time, 1 thread). exp(-inf) is 0 (vreduceps(-inf) is 0,
// vscalefps(1, -inf) is 0); NaN is kept. The fp32 row sum is of these values, so the log-sum-exp is
// accurate to ~3e-6 (tests/kernels/test_compiled.py checks it against float64). The exponent is
// (x * mul - shift) by one fma, exact for the scores that matter (near the row's max), then times log2(e):
// folding log2(e) into the fma's constants rounded -shift * log2(e) to fp32, an error of ~|shift| * 2^-24
// in every exponent (scale 1000, |s| ~ 5e4: 0.3 % per probability; fp16 dv 11x the naive fp16 error; the
// backward's fp32 exp then disagreed with the forward's normalisation). One multiply more per 16 scores.
template <bool kMasked>
inline __m512 exp2_half_target(__m512 t) {
  // f = t - floor(t): imm 0x09 = keep 0 fraction bits, round down, no exceptions (AVX512DQ)
  const __m512 f = _mm512_reduce_ps(t, 0x09);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.013534167781472206f), f, _mm512_set1_ps(0.052011460065841675f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2414427548646927f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6930038332939148f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000026226043701f));
  if constexpr (kMasked) {
    // a tile with masked scores (-inf): lanes below 2^-125 become exact 0 by a mask, never by underflow: an
    // underflowing result takes a microcode assist on Intel cores (measured: the causal bf16 forward's exp
    // pass ran 4x slower per value than the dense one). NaN compares unordered and is kept.
    const __mmask16 keep = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-125.f), _CMP_NLT_UQ);
    return _mm512_maskz_scalef_ps(keep, p, t);
  }
  // a full tile has no -inf; its rare scores 87 below the row's max underflow exactly, only slowly
  return _mm512_scalef_ps(p, t);
}

// The CPU's own fp32 -> bf16 conversion (vcvtne2ps2bf16, AVX512-BF16: 32 values in one instruction,
// round to nearest even like at::vec's ~10-instruction integer sequence), chosen at load time from the
// CPU's flags (never assumed from the build). ATTNLAB_EXT_NO_AVX512BF16=1 takes at::vec's sequence
// instead (for comparisons, and so the fallback is tested on CPUs that have the instruction).
const bool kNativeBf16 = [] {
  __builtin_cpu_init();  // we run among the library's constructors: make sure the flags are read
  const char* off = std::getenv("ATTNLAB_EXT_NO_AVX512BF16");
  return __builtin_cpu_supports("avx512bf16") && !(off && *off && std::string(off) != "0");
}();

struct StoreBf16Native {
  __attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl"))) static void store(__m512 lo, __m512 hi, void* dst) {
    _mm512_storeu_si512(dst, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
  }
};
struct StoreBf16 {
  static void store(__m512 lo, __m512 hi, void* dst) {
    at::vec::convert_float_bfloat16(Vectorized<float>(lo), Vectorized<float>(hi)).store(dst);
  }
};
struct StoreHalf {
  static void store(__m512 lo, __m512 hi, void* dst) {
    auto* d = static_cast<__m256i*>(dst);
    _mm256_storeu_si256(d, _mm512_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    _mm256_storeu_si256(d + 1, _mm512_cvtps_ph(hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};

// exp_sum for a half-type destination, 32 scores per step (Note [Half-type exp], Note [Row passes]).
template <bool kMasked, typename Store, typename T>
__attribute__((always_inline)) inline float exp_sum_half(const float* x, int64_t n, float shift, float mul, T* dst) {
  constexpr float kLog2e = 1.4426950408889634f;
  // Note [Half-type exp]: the difference first, then the base change (never fmadd(x, mul * log2e, -shift * log2e))
  const __m512 a = _mm512_set1_ps(mul), b = _mm512_set1_ps(-shift), l2e = _mm512_set1_ps(kLog2e);
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 32 <= n; c += 32) {
    const __m512 e0 = exp2_half_target<kMasked>(_mm512_mul_ps(_mm512_fmadd_ps(_mm512_loadu_ps(x + c), a, b), l2e));
    const __m512 e1 = exp2_half_target<kMasked>(_mm512_mul_ps(_mm512_fmadd_ps(_mm512_loadu_ps(x + c + 16), a, b), l2e));
    s0 = _mm512_add_ps(s0, e0);
    s1 = _mm512_add_ps(s1, e1);
    Store::store(e0, e1, dst + c);
  }
  if (c < n) {  // the tail, zero-padded to 32 (exp of the padding is masked out of the sum)
    alignas(64) T tmp[32];
    const __mmask16 m0 = n - c >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - c)) - 1);
    const __mmask16 m1 = n - c > 16 ? __mmask16((1u << (n - c - 16)) - 1) : __mmask16(0);
    const __m512 e0 = exp2_half_target<kMasked>(_mm512_mul_ps(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(m0, x + c), a, b), l2e));
    const __m512 e1 = exp2_half_target<kMasked>(_mm512_mul_ps(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(m1, x + c + 16), a, b), l2e));
    s0 = _mm512_mask_add_ps(s0, m0, s0, e0);
    s1 = _mm512_mask_add_ps(s1, m1, s1, e1);
    Store::store(e0, e1, tmp);
    for (int64_t i = 0; i < n - c; ++i) dst[c + i] = tmp[i];
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
}

template <bool kMasked>
__attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl,avx512dq")))
float exp_sum_bf16_native(const float* x, int64_t n, float shift, float mul, at::BFloat16* dst) {
  return exp_sum_half<kMasked, StoreBf16Native>(x, n, shift, mul, dst);
}

template <>
inline float exp_sum<at::BFloat16, float>(const float* x, int64_t n, float shift, float mul, at::BFloat16* dst,
                                          bool masked) {
  if (kNativeBf16)
    return masked ? exp_sum_bf16_native<true>(x, n, shift, mul, dst) : exp_sum_bf16_native<false>(x, n, shift, mul, dst);
  return masked ? exp_sum_half<true, StoreBf16>(x, n, shift, mul, dst)
                : exp_sum_half<false, StoreBf16>(x, n, shift, mul, dst);
}
template <>
inline float exp_sum<at::Half, float>(const float* x, int64_t n, float shift, float mul, at::Half* dst,
                                      bool masked) {
  return masked ? exp_sum_half<true, StoreHalf>(x, n, shift, mul, dst)
                : exp_sum_half<false, StoreHalf>(x, n, shift, mul, dst);
}
#endif

// Note [Lazy max]: the online softmax needs each row's running max m only as the reference point of its
// exponentials; it need not be the exact max. After a row's first tile, the half-type forward runs one pass
// per tile row: p = exp(x - m) against the running max, no max pass over the fp32 tile row first. When the
// row's sum of p is at most kLazySum (nearly always, once a row has seen a few hundred keys: the new keys
// would have to outweigh 2^15 copies of the best one so far) the pass stands: m, the row's sum and its
// output row stay on the old reference (no rescale), with every p <= 2^15, within fp16's range; half types
// hold values above 1 with the same relative precision as below. Otherwise (a sum above kLazySum or
// infinite) the row is redone against its new max, as a first tile is. Removing the max pass measured 5 %
// of a dense bf16 forward (1 thread, n = 2048, CPU time). What changes: the row's largest p is no longer
// exactly 1, so it is rounded to bf16 like the others (measured: mean output error vs float64 +19 % on
// sharp rows, logits std 3, still 1/3 of the naive bf16 computation's error). A NaN sum stands (the row
// is NaN anyway). Half types only: fp32 rows are exponentiated in place, so there is nothing to redo from.
constexpr float kLazySum = 32768.f;

// oneDNN's batch-reduce gemm micro-kernel through cpublas::brgemm (what PyTorch's CPU flash kernel
// uses for half types): C[M, N] (+)= A[M, K] @ B[K, N], no transposes, no alpha, tiny call overhead
// (measured 64x64x64 fp32: 5.8 us vs MKL sgemm's 17 us; bf16 on AMX 1.9 us with B in VNNI layout
// [K/2, N, 2]). Compiled in for AVX-512 builds only.
#if defined(CPU_CAPABILITY_AVX512)
constexpr bool kHaveBrgemm = true;
#else
constexpr bool kHaveBrgemm = false;
#endif

// Note [AMX tile state]: an AMX product runs only on a thread whose tile configuration is loaded (else
// `tilezero` raises #UD: SIGILL). torch's cpublas::brgemm loads a kernel's configuration only when the
// thread's cached "current" kernel (a thread_local in CPUBlas.cpp) differs from the one called, and only
// cpublas::brgemm_release(true) clears that cache. Anything else that loads or releases the tiles on the
// thread leaves the cache believing they are set. The sequence that crashed (bf16 backward, L = S = 64,
// blocks of 16, on a Sapphire Rapids class Xeon): the backward's scores run on brgemm (the forward's back end,
// Note [Same scores]) while its other products run on MKL (compiled.py's backward rule: few visited blocks);
// MKL's cblas_gemm_bf16bf16f32 runs on AMX with its own tile configuration and ends with `tilerelease`; the
// next key tile's score product has the same (M, N, K, ld) key, so torch skips the configuration and
// oneDNN's kernel faults on its first `tilezero`. Other ways to the same state: a user's torch op on oneDNN
// between two of our calls on one thread, or a release elsewhere. So the kernel trusts no state it did not
// set: each thread's work starts untrusted (TileScope), every product off brgemm marks the tiles untrusted
// (TileGemm), and an untrusted half-type brgemm first calls brgemm_release(true), which makes torch load the
// configuration again (one tilerelease and one ldtilecfg per product that follows an MKL one).
// Each thread's work ends with a release, so nothing of ours leaks to the caller's thread.
// One thread's share of a kernel call that may run half-type brgemm products: untrusted tiles at the start,
// released at the end (Note [AMX tile state]).
struct TileScope {
  bool half;
  explicit TileScope(bool half_) : half(half_) { tiles_trusted() = false; }
  ~TileScope() {
    if (kHaveBrgemm && half) at::native::cpublas::brgemm_release(true);
    tiles_trusted() = false;
  }
};

// Note [Gemm arguments]: checked like MKL's, and no empty dim (oneDNN refuses to create such a kernel).
template <typename T>
inline void brg(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add, const T* a,
                const T* b, float* c) {
  TORCH_CHECK(M > 0 && N > 0 && K > 0, "attnlab._C: a brgemm tile product has an empty dim (M ", M, ", N ", N,
              ", K ", K, ")");
  check_gemm(false, false, M, N, K, lda, ldb, ldc);
  if constexpr (std::is_same_v<T, float>) {
    at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add, a, b, c, false);
  } else if constexpr (std::is_same_v<T, at::BFloat16> || std::is_same_v<T, at::Half>) {
    if (!tiles_trusted()) {  // Note [AMX tile state]: make torch load this kernel's configuration
      at::native::cpublas::brgemm_release(true);
      tiles_trusted() = true;
    }
    at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add, a, b, c, true);
  } else {
    TORCH_CHECK(false, "attnlab._C: no brgemm for this dtype");
  }
}

// Note [Chunked reductions]: brgemm sums each C element over K in one fma chain, then adds C (beta = 1);
// MKL's gemm sums chunks of 128 (matched bit for bit on this CPU). At K = 256 one chain rounds 1.4x (rms),
// 1.8x (max) MKL's error, and the fp32 forward at head dim 224 / 256 reached 2.3x the naive fp32
// computation's output error (flash-attn's test allows 2x). The long reductions (the scores' K = E, the
// forward's P @ V over a merged run of up to 512 keys, the backward's dP = dO V^T over Ev) therefore run
// as chunks of kBrgChunk added into C: rms 0.73x MKL's at K = 256, for one more load and store of C per
// chunk. Forward and backward chunk the scores alike (Note [Same scores]). K stays even per chunk (VNNI).
constexpr int64_t kBrgChunk = 64;

template <typename T>
inline void brg_chunked(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add, const T* a,
                        const T* b, float* c) {
  // A [M, K] row-major: chunk k0 starts at column k0; B [K, N] (or VNNI [K / 2, N, 2]): at row k0, k0 * ldb values
  for (int64_t k0 = 0; k0 < K; k0 += kBrgChunk)
    brg<T>(M, N, std::min(kBrgChunk, K - k0), lda, ldb, ldc, add || k0 > 0, a + k0, b + k0 * ldb, c);
}

// dst[e * ldd + c] = src[c * ld + e] for c < cols, e < width, on 4-byte words (a float, or a pair of
// bf16/fp16 values: the VNNI layout of a transpose is the word transpose). ld in words. AVX-512 gathers 16
// rows' word e at once (the scalar loop's strided stores ran ~3 cycles a value: 10% of a bf16 call).
inline void transpose_words(const uint32_t* src, int64_t ld, int64_t cols, int64_t width, uint32_t* dst,
                            int64_t ldd) {
#if defined(CPU_CAPABILITY_AVX512)
  if (ld * 4 * 16 < (int64_t(1) << 31)) {
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(static_cast<int>(ld)));
    for (int64_t c = 0; c < cols; c += 16) {
      const __mmask16 m = cols - c >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (cols - c)) - 1);
      const uint32_t* base = src + c * ld;
      for (int64_t e = 0; e < width; ++e) {
        const __m512i w = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, idx, base + e, 4);
        _mm512_mask_storeu_epi32(dst + e * ldd + c, m, w);
      }
    }
    return;
  }
#endif
  for (int64_t c = 0; c < cols; ++c)
    for (int64_t e = 0; e < width; ++e) dst[e * ldd + c] = src[c * ld + e];
}

// dst[e * ldd + r] = src[r * ld + e] for 16-bit values (bf16 / fp16), r < rows, e < width: AVX-512 gathers 16
// rows' 4-byte word (two values) at once and splits the pairs with one permute (the scalar loop over a 64 x 64
// query tile cost as much as a query block's few AMX products under a sparse layout).
inline void transpose_halves(const uint16_t* src, int64_t ld, int64_t rows, int64_t width, uint16_t* dst,
                             int64_t ldd) {
#if defined(CPU_CAPABILITY_AVX512)
  if (ld % 2 == 0 && width % 2 == 0 && reinterpret_cast<uintptr_t>(src) % 4 == 0 && ld * 2 * 16 < (int64_t(1) << 31)) {
    alignas(64) static const uint16_t kSplit[32] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
                                                    1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    const __m512i split = _mm512_load_si512(kSplit);
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(static_cast<int>(ld / 2)));
    for (int64_t r = 0; r < rows; r += 16) {
      const __mmask16 m = rows - r >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (rows - r)) - 1);
      const uint32_t* base = reinterpret_cast<const uint32_t*>(src + r * ld);
      for (int64_t w = 0; w < width / 2; ++w) {
        const __m512i g = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, idx, base + w, 4);
        const __m512i d = _mm512_permutexvar_epi16(split, g);  // [value 2w of the 16 rows | value 2w + 1]
        _mm256_mask_storeu_epi16(dst + (2 * w) * ldd + r, m, _mm512_castsi512_si256(d));
        _mm256_mask_storeu_epi16(dst + (2 * w + 1) * ldd + r, m, _mm512_extracti64x4_epi64(d, 1));
      }
    }
    return;
  }
#endif
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t e = 0; e < width; ++e) dst[e * ldd + r] = src[r * ld + e];
}

// dst[c * ld_dst + r] = src[r * ld_src + c]: a tile transposed (brgemm takes no transposed operand).
// fp32 tiles go through transpose_words (the fp32 backward transposes P and dS per tile: scalar, that was
// ~10% of a causal window's forward+backward).
template <typename T>
inline void transpose(const T* src, int64_t ld_src, int64_t rows, int64_t cols, T* dst, int64_t ld_dst) {
  if constexpr (sizeof(T) == 4) {
    transpose_words(reinterpret_cast<const uint32_t*>(src), ld_src, rows, cols, reinterpret_cast<uint32_t*>(dst),
                    ld_dst);
  } else {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) dst[c * ld_dst + r] = src[r * ld_src + c];
  }
}

// Packs the transpose of x [S, D] (row stride ld) as brgemm B operands of K = D, N = bk, one contiguous
// [D, bk] panel per key block (plain for float, VNNI [D / 2, bk, 2] for half types, D even). Block-major
// panels keep each tile's rows close: a [D, S] transpose read bk columns at a time strides S apart and
// (at S = 4096 floats) maps every row to one L1 set.
template <typename T>
inline void pack_transposed_blocks(const T* x, int64_t ld, int64_t S, int64_t D, int64_t bk, T* dst) {
  constexpr int64_t per = 4 / sizeof(T);  // values per 4-byte word
  const bool words = (sizeof(T) == 4 || sizeof(T) == 2) && ld % per == 0 && D % per == 0 &&
                     reinterpret_cast<uintptr_t>(x) % 4 == 0;
  for (int64_t k0 = 0; k0 < S; k0 += bk) {
    const int64_t cols = std::min(bk, S - k0);
    T* panel = dst + (k0 / bk) * D * bk;
    if (words) {
      transpose_words(reinterpret_cast<const uint32_t*>(x + k0 * ld), ld / per, cols, D / per,
                      reinterpret_cast<uint32_t*>(panel), bk);
      continue;
    }
    for (int64_t c = 0; c < cols; ++c) {
      const T* row = x + (k0 + c) * ld;
      if constexpr (std::is_same_v<T, float>) {
        for (int64_t e = 0; e < D; ++e) panel[e * bk + c] = row[e];
      } else {
        for (int64_t e = 0; e < D; ++e) panel[((e >> 1) * bk + c) * 2 + (e & 1)] = row[e];
      }
    }
  }
}

// Packs x [rows, cols] (row stride ld) as a VNNI B operand (K = rows, N = cols): [rows_pad / 2, cols, 2],
// an odd last row padded with zeros. Each pair of rows interleaves into 4-byte words (vectorised by -O3).
template <typename T>
inline void pack_vnni(const T* x, int64_t ld, int64_t rows, int64_t cols, T* dst) {
  static_assert(sizeof(T) == 2, "VNNI pairs of 16-bit values");
  const int64_t rp = rows + (rows & 1);
  for (int64_t r = 0; r < rp; r += 2) {
    const uint16_t* a = reinterpret_cast<const uint16_t*>(x + r * ld);
    const uint16_t* b = reinterpret_cast<const uint16_t*>(x + (r + 1) * ld);
    uint16_t* d = reinterpret_cast<uint16_t*>(dst + (r >> 1) * cols * 2);
    if (r + 1 < rows) {
      for (int64_t c = 0; c < cols; ++c) {
        const uint32_t w = uint32_t(a[c]) | (uint32_t(b[c]) << 16);
        std::memcpy(d + 2 * c, &w, 4);
      }
    } else {
      for (int64_t c = 0; c < cols; ++c) {
        d[2 * c] = a[c];
        d[2 * c + 1] = 0;
      }
    }
  }
}

// Work units per task: everything in one task (no thread start-up) when the whole call is too small for
// threads to pay off (a few microseconds of arithmetic; measured to matter for gradcheck-sized calls).
inline int64_t grain(int64_t units, int64_t flops_upper_bound) {
  return flops_upper_bound < (int64_t(1) << 18) ? std::max<int64_t>(units, 1) : 1;
}

// Note [Dynamic schedule]: the forward's units (batch, head, query block) differ in cost (each query
// block visits its own number of key blocks), and on a shared CPU one of our threads may share its core
// with another process. A static split of the unit range makes the call wait for the slowest thread
// (measured: block-sparse rho=0.05 n=16384 fwd kept 0.64 of its quiet speed with a matmul loop running).
// Instead each thread pulls the next unit from one atomic counter, the costliest units first (longest
// processing time first: the cheap ones even out the tail). Every unit is still computed whole by one
// thread with the same code, so results do not depend on the schedule. `work(pull)` runs once per thread
// (its per-thread buffers allocated once) and calls pull() until it returns -1; `serial` runs everything
// on the calling thread (calls too small for threads to pay off, see grain()).
template <typename F>
void parallel_pull(int64_t units, bool serial, F&& work) {
  std::atomic<int64_t> next{0};
  const int64_t tasks = serial ? std::min<int64_t>(units, 1) : std::min<int64_t>(at::get_num_threads(), units);
  // inside another parallel region at::parallel_for runs f(0, tasks) once, inline: that call pulls every unit
  at::parallel_for(0, tasks, 1, [&](int64_t, int64_t) {
    work([&]() -> int64_t {
      const int64_t u = next.fetch_add(1, std::memory_order_relaxed);
      return u < units ? u : -1;
    });
  });
}

// The forward's units (u = (n * H + h) * nq + qb) in the order threads take them: by the number of key
// blocks their query block visits, most first; ties keep u's order (a head's query blocks run together,
// so its K/V stay in cache as under the static split). A stable counting sort, O(units + maxk). Empty
// when every unit costs the same (the identity order).
inline std::vector<int32_t> costliest_first(const int32_t* kv_num, int64_t Nl, int64_t N, int64_t H, int64_t nq,
                                            int64_t maxk) {
  const int64_t units = N * H * nq;
  auto cnt = [&](int64_t u) { return kv_num[(Nl == 1 ? 0 : u / (H * nq)) * nq + u % nq]; };
  bool same = true;
  for (int64_t r = 1; r < Nl * nq && same; ++r) same = kv_num[r] == kv_num[0];
  if (same || units > std::numeric_limits<int32_t>::max()) return {};
  std::vector<int64_t> start(maxk + 2, 0);  // bucket maxk - c holds units visiting c key blocks
  for (int64_t u = 0; u < units; ++u) ++start[maxk - cnt(u) + 1];
  for (int64_t b = 1; b <= maxk + 1; ++b) start[b] += start[b - 1];
  std::vector<int32_t> order(units);
  for (int64_t u = 0; u < units; ++u) order[start[maxk - cnt(u)]++] = static_cast<int32_t>(u);
  return order;
}

struct Layout {
  const int32_t* kv_num;
  const int32_t* kv_idx;
  const int32_t* tile_id;
  const uint8_t* tiles;
  int64_t Nl, nq, maxk, bq, bk;
  int64_t base(int64_t n, int64_t qb) const { return (Nl == 1 ? 0 : n) * nq + qb; }
  const uint8_t* tile(int32_t id) const { return id < 0 ? nullptr : tiles + static_cast<int64_t>(id) * bq * bk; }
};

Layout make_layout(const at::Tensor& kv_num, const at::Tensor& kv_idx, const at::Tensor& tile_id,
                   const at::Tensor& tiles, int64_t N, int64_t L, int64_t S, int64_t bq, int64_t bk) {
  TORCH_CHECK(bq > 0 && bk > 0, "attnlab._C: block sizes must be positive");
  const int64_t nq = (L + bq - 1) / bq;
  for (const auto* t : {&kv_num, &kv_idx, &tile_id})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "attnlab._C: layout tensors must be contiguous int32");
  TORCH_CHECK(kv_num.dim() == 2 && kv_num.size(1) == nq && (kv_num.size(0) == 1 || kv_num.size(0) == N),
              "attnlab._C: kv_num must be [1 or N, ceil(L / bq)], got ", kv_num.sizes());
  TORCH_CHECK(kv_idx.dim() == 3 && kv_idx.size(0) == kv_num.size(0) && kv_idx.size(1) == nq &&
              tile_id.sizes() == kv_idx.sizes(), "attnlab._C: kv_idx / tile_id must be [Nl, nq, maxk]");
  TORCH_CHECK(tiles.scalar_type() == at::kByte && tiles.is_contiguous() && tiles.dim() == 3 &&
              tiles.size(1) == bq && tiles.size(2) == bk, "attnlab._C: tiles must be uint8 [T, bq, bk]");
  // every index is checked once here, so the kernels can trust them
  const int64_t nk = (S + bk - 1) / bk, maxk = kv_idx.size(2), T = tiles.size(0);
  const int32_t* num = kv_num.data_ptr<int32_t>();
  const int32_t* idx = kv_idx.data_ptr<int32_t>();
  const int32_t* tid = tile_id.data_ptr<int32_t>();
  for (int64_t r = 0; r < kv_num.numel(); ++r) {
    TORCH_CHECK(num[r] >= 0 && num[r] <= maxk, "attnlab._C: kv_num out of range");
    for (int64_t t = 0; t < num[r]; ++t) {
      TORCH_CHECK(idx[r * maxk + t] >= 0 && idx[r * maxk + t] < nk, "attnlab._C: kv_idx out of range");
      TORCH_CHECK(tid[r * maxk + t] >= -1 && tid[r * maxk + t] < T, "attnlab._C: tile_id out of range");
    }
  }
  return Layout{num, idx, tid, tiles.data_ptr<uint8_t>(), kv_num.size(0), nq, maxk, bq, bk};
}

template <typename A>
ScoreMods<A> make_mods(const std::optional<at::Tensor>& keep, const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& alibi, const std::optional<at::Tensor>& rel,
                       double softcap, bool alibi_causal, int64_t alibi_offset, at::IntArrayRef shape4) {
  ScoreMods<A> m;
  if (rel && rel->defined()) {  // Note [Relative bias]
    const int64_t W = shape4[2] + shape4[3] - 1;
    TORCH_CHECK(rel->scalar_type() == c10::CppTypeToScalarType<A>::value && rel->is_contiguous() && rel->dim() == 2 &&
                rel->size(0) == shape4[1] && rel->size(1) == W,
                "attnlab._C: rel must be contiguous [H, L + S - 1] = [", shape4[1], ", ", W,
                "] in the accumulation dtype, got ", rel->sizes());
    m.rel = rel->data_ptr<A>();
    m.rel_w = W;
    m.rel_off = shape4[2] - 1;
  }
  // a cap past A's range is the identity (Python's Note [Soft-cap at infinity]); cast, it was inf and inf * 0 NaN
  m.softcap = softcap > static_cast<double>(std::numeric_limits<A>::max()) ? A(0) : static_cast<A>(softcap);
  if (keep && keep->defined()) {
    TORCH_CHECK(keep->scalar_type() == at::kByte || keep->scalar_type() == at::kBool, "attnlab._C: keep must be bool");
    TORCH_CHECK(keep->sizes() == shape4, "attnlab._C: keep must be expanded to ", shape4, ", got ", keep->sizes());
    m.keep = static_cast<const uint8_t*>(keep->data_ptr());
    for (int d = 0; d < 4; ++d) m.ks[d] = keep->stride(d);
  }
  if (bias && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == c10::CppTypeToScalarType<A>::value,
                "attnlab._C: bias must be in the accumulation dtype");
    TORCH_CHECK(bias->sizes() == shape4, "attnlab._C: bias must be expanded to ", shape4, ", got ", bias->sizes());
    m.bias = bias->data_ptr<A>();
    for (int d = 0; d < 4; ++d) m.bs[d] = bias->stride(d);
  }
  if (alibi && alibi->defined()) {
    TORCH_CHECK(alibi->scalar_type() == at::kFloat && alibi->is_contiguous() && alibi->dim() == 1 &&
                alibi->size(0) == shape4[1], "attnlab._C: alibi slopes must be float32 [H]");
    m.alibi = alibi->data_ptr<float>();
    for (int64_t h = 0; h < shape4[1]; ++h)  // an inf slope gives inf * 0 = NaN on the aligned key
      TORCH_CHECK(std::isfinite(m.alibi[h]), "attnlab._C: alibi slopes must be finite float32, got ", m.alibi[h]);
    m.alibi_causal = alibi_causal;
    m.alibi_offset = alibi_offset;
  }
  return m;
}

// Note [Operand strides]: q, k, v are read in place through their strides. Batch and head strides may be
// anything (a broadcast head has stride 0); each row [.., i, :] is one operand row of the tile products,
// whose leading dim is the row stride, so: the last stride 1 (unless the row holds one value), and the row
// stride at least the row's length and at least 1 (Note [Gemm arguments]) -- even for a single row, whose
// stride PyTorch leaves arbitrary (a [1, E] tensor from .mT is "contiguous" with row stride 1; an expand()
// along L or S has row stride 0). kernels/compiled.py copies any other tensor to canonical strides first.
void check_operand(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "attnlab._C: ", name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.dim() == 4, "attnlab._C: ", name, " must be 4-D, got ", t.sizes());
  const int64_t cols = t.size(3);
  TORCH_CHECK(cols > 0, "attnlab._C: ", name, " ", t.sizes(), " has an empty last dim (the wrapper pads it)");
  TORCH_CHECK((t.stride(3) == 1 || cols == 1) && t.stride(2) >= cols &&
                  t.stride(2) <= std::numeric_limits<int>::max(),
              "attnlab._C: ", name, " ", t.sizes(), " has strides ", t.strides(), ", which the tile products cannot "
              "read: the last stride must be 1 and the row stride between ", cols, " and 2^31 - 1 (copy it with "
              ".clone(memory_format=torch.contiguous_format); attnlab.kernels.compiled does)");
}

// A tensor the kernel indexes as if it had canonical strides (dout, out, lse): PyTorch's contiguity, under
// which a size-1 dim's stride is never used.
void check_dense(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "attnlab._C: ", name, " ", t.sizes(), " with strides ",
              t.strides(), " must be a contiguous CPU tensor");
}

void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  check_operand(q, "q");
  check_operand(k, "k");
  check_operand(v, "v");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "attnlab._C: q, k, v must share one dtype, got ", q.scalar_type(), ", ", k.scalar_type(), ", ",
              v.scalar_type());
  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0) && v.size(1) == k.size(1) && k.size(2) == v.size(2) &&
              k.size(3) == q.size(3) && k.size(1) > 0 && q.size(1) % k.size(1) == 0,
              "attnlab._C: shapes q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes(), " do not agree");
}

// The widest tile a run of full key blocks merges into (Note [Merged runs]): the dense tile's width.
constexpr int64_t kMergeCols = 512;

// Note [Split log-sum-exp]: the backward recomputes P = exp(s - lse) (FA2). With lse rounded to the
// accumulation dtype, every probability carries its rounding, |lse| * eps / 2 relative (lse ~ 500: 3e-5),
// where the naive softmax's largest weight is exact (exp(0) = 1, normalised); the gradients then lost up to
// 25x the naive fp32 computation's accuracy (causal, L = S = 99, E = 32, inputs std 3, scale 10: dv 1.4e-4
// vs 5.4e-5). The forward therefore returns lse = m + log(l) as an unevaluated sum hi + lo: hi is the
// public lse (rounded as before) and lo its exact rounding error (TwoSum: no fast-math, no contraction of
// additions), and the backward exponentiates (s - hi) - lo: s - hi is exact where it matters (s near hi,
// Sterbenz), so P is as accurate as exp itself. A row with no key: hi = -inf, lo = 0. Recomputing P this
// way also needs the backward's scores to be the forward's, bit for bit (Note [Same scores]).
//
// Note [Same scores]: P = exp(s - lse) is the forward's softmax only if the backward's s is the forward's,
// bit for bit: a score off by d moves its probability by a factor exp(d), and any other summation order of
// q . k, or the scale rounded into the score where the forward folded it into exp's fma, is off by
// ~|s| * eps. The fp32 forward always multiplies on brgemm (AVX-512 builds) while the backward took MKL's
// gemm for tiles over BACKWARD_BRGEMM_MAX_TILE (compiled.py): at scale 1000 (|s| ~ 5e4) dv was 0.14 off
// float64, the naive fp32 computation 5e-7. So the backward computes its scores on the forward's engine
// (score_brgemm: the forward's gemm mode) whatever engine its other four products take, and folds the
// scale into the exp exactly where the forward did (a full tile with no score modification). Left: MKL's
// gemm on both sides (AVX2 / DEFAULT builds, ATTNLAB_EXT_GEMM=mkl) may still round a score differently
// for the forward's merged tile than for the backward's block (its kernels follow shape and alignment).
template <typename A>
inline void split_lse(A m, A log_l, A& hi, A& lo) {
  hi = m + log_l;
  const A b = hi - m;
  lo = (m - (hi - b)) + (log_l - b);
  if (!std::isfinite(lo)) lo = A(0);  // hi = +-inf or NaN: nothing to add
}

template <typename T>
void forward_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Layout& lay,
                  const ScoreMods<typename Acc<T>::type>& mod, double scale_d, bool use_brg, bool blas,
                  at::Tensor& out, at::Tensor& lse, at::Tensor& lse_lo, at::Tensor& out_acc) {
  using A = typename Acc<T>::type;
  const TileGemm gemm{blas};  // the products off brgemm: MKL's or the loop (Note [Gemm arguments])
  constexpr bool kSame = std::is_same_v<T, A>;
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), E = q.size(3);
  const int64_t Hkv = k.size(1), S = k.size(2), Ev = v.size(3), groups = H / Hkv;
  const int64_t bq = lay.bq, bk = lay.bk, nq = lay.nq;
  const T* Q = q.data_ptr<T>();
  const T* K = k.data_ptr<T>();
  const T* Vp = v.data_ptr<T>();
  T* O = out.data_ptr<T>();
  A* LSE = lse.data_ptr<A>();
  A* LO = lse_lo.data_ptr<A>();  // Note [Split log-sum-exp]
  A* OA = out_acc.defined() ? out_acc.data_ptr<A>() : nullptr;  // Note [fp32 O for delta]
  const A scale = static_cast<A>(scale_d);
  const A ninf = -std::numeric_limits<A>::infinity();
  const int64_t flops = N * H * L * S * (E + Ev);
  // brgemm operands: K^T per kv head ([E, S], VNNI for half types) and, for half types, V in VNNI
  constexpr bool kHalf = std::is_same_v<T, at::BFloat16> || std::is_same_v<T, at::Half>;
  const int64_t Sp = S + (S & 1), nk = (S + bk - 1) / bk;
  at::Tensor kt, vv;
  if (use_brg) {
    kt = at::empty({N * Hkv, nk * E * bk}, q.options());
    if (kHalf) vv = at::empty({N * Hkv, Sp * Ev}, q.options());
    T* KT = kt.data_ptr<T>();
    T* VV = kHalf ? vv.data_ptr<T>() : nullptr;
    // pulled like the units below (Note [Dynamic schedule]): equal costs, but a thread may be slowed
    parallel_pull(N * Hkv, grain(N * Hkv, flops) > 1, [&](auto pull) {
      for (int64_t u = pull(); u >= 0; u = pull()) {
        const int64_t n = u / Hkv, g = u % Hkv;
        // K^T as B of q @ k^T (K = E, N = S); rows past S are never read
        pack_transposed_blocks(K + n * k.stride(0) + g * k.stride(1), k.stride(2), S, E, bk, KT + u * nk * E * bk);
        if constexpr (kHalf) pack_vnni(Vp + n * v.stride(0) + g * v.stride(1), v.stride(2), S, Ev, VV + u * Sp * Ev);
      }
    });
  }
  const T* KT = use_brg ? kt.data_ptr<T>() : nullptr;
  const int64_t W = std::max(bk, kMergeCols);  // Note [Merged runs]
  const T* VV = use_brg && kHalf ? vv.data_ptr<T>() : nullptr;
  const int64_t units = N * H * nq;
  const std::vector<int32_t> order = costliest_first(lay.kv_num, lay.Nl, N, H, nq, lay.maxk);
  parallel_pull(units, grain(units, flops) > 1, [&](auto pull) {  // Note [Dynamic schedule]
    const TileScope tiles(kHalf && use_brg);  // Note [AMX tile state]
    std::vector<A> sbuf(bq * W), obuf(bq * Ev), mrow(bq), lrow(bq);
    std::vector<T> pbuf(kSame ? 0 : bq * (W + 1));
    for (int64_t i = pull(); i >= 0; i = pull()) {
      const int64_t u = order.empty() ? i : order[i];
      const int64_t n = u / (H * nq), h = (u / nq) % H, qb = u % nq;
      const int64_t q0 = qb * bq, rows = std::min(bq, L - q0), kvh = h / groups;
      const T* qp = Q + n * q.stride(0) + h * q.stride(1) + q0 * q.stride(2);
      const T* kp = K + n * k.stride(0) + kvh * k.stride(1);
      const T* vp = Vp + n * v.stride(0) + kvh * v.stride(1);
      const int64_t base = lay.base(n, qb);
      const int32_t cnt = lay.kv_num[base];
      const int32_t* kidx = lay.kv_idx + base * lay.maxk;
      const int32_t* tids = lay.tile_id + base * lay.maxk;
      std::fill(mrow.begin(), mrow.begin() + rows, ninf);
      std::fill(lrow.begin(), lrow.begin() + rows, A(0));
      std::fill(obuf.begin(), obuf.begin() + rows * Ev, A(0));
      for (int32_t t = 0; t < cnt;) {
        const int64_t kb0 = kidx[t], k0 = kb0 * bk;
        const uint8_t* tile = lay.tile(tids[t]);
        // Note [Merged runs]: consecutive FULL key blocks run as one tile up to W keys wide (one max/exp
        // pass per row and one P @ V product over the run instead of one per block)
        int32_t run = 1;
        if (tile == nullptr)
          while (t + run < cnt && (run + 1) * bk <= W && kidx[t + run] == kb0 + run && tids[t + run] < 0) ++run;
        t += run;
        const int64_t cols = std::min(run * bk, S - k0), ls = run > 1 ? W : bk;
        A* s = sbuf.data();
        A mul = A(1);
        if constexpr (!std::is_same_v<T, double>) {
          if (use_brg) {
            for (int32_t j = 0; j < run; ++j) {
              const T* ktp = KT + ((n * Hkv + kvh) * nk + kb0 + j) * E * bk;
              brg_chunked<T>(rows, std::min(bk, S - k0 - j * bk), E, q.stride(2), bk, ls, false, qp, ktp,
                             s + j * bk);
            }
            mul = scale;
          }
        }
        if (!use_brg) gemm(false, true, rows, cols, E, scale, qp, q.stride(2), kp + k0 * k.stride(2), k.stride(2), A(0), s, ls);
        // a full tile with nothing to add: the scale is folded into the max and exp passes (one pass fewer)
        const bool fold = tile == nullptr && mod.plain() && mul > A(0);
        if (!fold) {
          modify_scores<A>(s, ls, rows, cols, n, h, q0, k0, tile, mod, nullptr, mul);
          mul = A(1);
        }
        for (int64_t r = 0; r < rows; ++r) {
          A* row = s + r * ls;
          if constexpr (!kSame) {
            if (mrow[r] != ninf) {  // Note [Lazy max]
              const A sum = exp_sum(row, cols, mrow[r], mul, pbuf.data() + r * ls, !fold);
              if (!(sum > A(kLazySum))) {
                lrow[r] += sum;
                if (use_brg && (cols & 1)) pbuf[r * ls + cols] = T(0);  // pairs with V's zero pad row
                continue;
              }
            }
          }
          const A mnew = std::max(mrow[r], (kSame ? row_max(row, cols) : row_max_loose(row, cols)) * mul);
          const A shift = mnew == ninf ? A(0) : mnew;  // a row with nothing kept yet: exp(-inf) = 0
          A sum;
          if constexpr (kSame) {
            sum = exp_sum(row, cols, shift, mul, row);
          } else {
            sum = exp_sum(row, cols, shift, mul, pbuf.data() + r * ls, !fold);
            if (use_brg && (cols & 1)) pbuf[r * ls + cols] = T(0);  // pairs with V's zero pad row
          }
          const A alpha = std::exp(mrow[r] - shift);
          lrow[r] = lrow[r] * alpha + sum;
          mrow[r] = mnew;
          if (alpha != A(1)) {
            A* o = obuf.data() + r * Ev;
            at::vec::map([alpha](Vectorized<A> x) { return x * Vectorized<A>(alpha); }, o, o, Ev);
          }
        }
        if constexpr (kSame) {
          if constexpr (std::is_same_v<T, float>) {
            if (use_brg) {
              brg_chunked<T>(rows, Ev, cols, ls, v.stride(2), Ev, true, s, vp + k0 * v.stride(2), obuf.data());
              continue;
            }
          }
          gemm(false, false, rows, Ev, cols, A(1), s, ls, vp + k0 * v.stride(2), v.stride(2), A(1), obuf.data(), Ev);
        } else {
          if (use_brg) {
            brg_chunked<T>(rows, Ev, cols + (cols & 1), ls, Ev, Ev, true, pbuf.data(),
                           VV + (n * Hkv + kvh) * Sp * Ev + k0 * Ev, obuf.data());
          } else {
            gemm(false, false, rows, Ev, cols, A(1), pbuf.data(), ls, vp + k0 * v.stride(2), v.stride(2), A(1),
                 obuf.data(), Ev);
          }
        }
      }
      T* op = O + ((n * H + h) * L + q0) * Ev;
      A* lp = LSE + (n * H + h) * L + q0;
      A* lop = LO + (n * H + h) * L + q0;
      for (int64_t r = 0; r < rows; ++r) {
        // a fully masked row: output 0; a NaN score kept in the row: NaN (its sum is NaN), as in SDPA
        const bool any = !(lrow[r] == A(0));
        const A inv = any ? A(1) / lrow[r] : A(0);
        const A* o = obuf.data() + r * Ev;
        for (int64_t c = 0; c < Ev; ++c) op[r * Ev + c] = static_cast<T>(o[c] * inv);
        if (OA) {
          A* oa = OA + ((n * H + h) * L + q0 + r) * Ev;
          for (int64_t c = 0; c < Ev; ++c) oa[c] = o[c] * inv;
        }
        if (any) {
          split_lse(mrow[r], std::log(lrow[r]), lp[r], lop[r]);
        } else {
          lp[r] = ninf;
          lop[r] = A(0);
        }
      }
    }
  });
}

// One row of the score gradient, in place over dr = dP: g = P (dP - delta) is the gradient of the final
// score, hence of an additive float mask (modify_scores adds the bias after the soft-cap), stored to db
// when asked; the gradient of the scaled q k^T score is g (1 - tanh^2) under a soft-cap; `mul` is the
// score scale when the next products cannot apply it (brgemm has no alpha).
template <typename A>
inline void score_grad_row(A* dr, const A* pr, const A* tr, A delta, A mul, int64_t cols, A* db, A* dacc = nullptr) {
  using V = Vectorized<A>;
  const V dl(delta), vm(mul), one(A(1));
  int64_t c = 0;
  for (; c + V::size() <= cols; c += V::size()) {
    V g = V::loadu(pr + c) * (V::loadu(dr + c) - dl);
    if (db) g.store(db + c);
    if (dacc) (V::loadu(dacc + c) + g).store(dacc + c);
    if (tr) {
      const V t = V::loadu(tr + c);
      g = g * (one - t * t);
    }
    (g * vm).store(dr + c);
  }
  for (; c < cols; ++c) {
    A g = pr[c] * (dr[c] - delta);
    if (db) db[c] = g;
    if (dacc) dacc[c] += g;
    if (tr) g *= A(1) - tr[c] * tr[c];
    dr[c] = g * mul;
  }
}

template <typename T>
void backward_impl(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& out, const at::Tensor& lse, const at::Tensor& lse_lo, const Layout& lay,
                   const ScoreMods<typename Acc<T>::type>& mod, double scale_d, bool use_brg, bool score_brg,
                   bool blas, int64_t splits, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv, at::Tensor& dbias,
                   at::Tensor& drel) {
  using A = typename Acc<T>::type;
  const TileGemm gemm{blas};  // the products off brgemm: MKL's or the loop (Note [Gemm arguments])
  using Vec = Vectorized<A>;
  constexpr bool kSame = std::is_same_v<T, A>;
  constexpr bool kHalf = std::is_same_v<T, at::BFloat16> || std::is_same_v<T, at::Half>;
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), E = q.size(3);
  const int64_t Hkv = k.size(1), S = k.size(2), Ev = v.size(3), groups = H / Hkv;
  const int64_t bq = lay.bq, bk = lay.bk, nq = lay.nq;
  const T* Q = q.data_ptr<T>();
  const T* K = k.data_ptr<T>();
  const T* Vp = v.data_ptr<T>();
  const T* DO = dout.data_ptr<T>();
  // Note [fp32 O for delta]: delta = rowsum(dO * O) is a difference of nearly equal sums when one value
  // dominates a row; from O rounded to bf16 its error reaches the gradients unscaled (hypothesis found dk
  // 10x the naive bf16 error at L=1, S=3). Half types get the forward's fp32 O when it was kept.
  const bool out_acc = !kSame && out.scalar_type() == c10::CppTypeToScalarType<A>::value;
  const T* O = out_acc ? nullptr : out.data_ptr<T>();
  const A* OA = out_acc ? out.data_ptr<A>() : nullptr;
  const A* LSE = lse.data_ptr<A>();
  const A* LO = lse_lo.data_ptr<A>();  // Note [Split log-sum-exp]
  T* DQ = dq.data_ptr<T>();
  A* DK = dk.data_ptr<A>();  // [N, Hkv, S, E] accumulation dtype, zeroed
  A* DV = dv.data_ptr<A>();
  A* DB = dbias.defined() ? dbias.data_ptr<A>() : nullptr;  // [N, H, L, S] zeroed, when the float mask needs grad
  const A scale = static_cast<A>(scale_d);
  const A inf = std::numeric_limits<A>::infinity();
  // Note [Backward balance]: a unit is (n, kv head, range of key blocks). It alone writes the dk, dv rows of
  // its keys, and dq of its kv head's query heads: directly when each kv head is one unit (splits = 1), else
  // into its range's fp32 partial dq, summed at the end. Threads pull units (parallel_pull, Note [Dynamic
  // schedule]), most visited blocks first, so a thread slowed by another process takes fewer units instead of
  // holding up a static split (B=1, H=8 is only 8 units over the threads). Ranges cost a partial dq each and
  // a pass over the query blocks per range, so the wrapper asks for them only when there are fewer (n, kv
  // head) pairs than threads (MQA at B=1; compiled.backward_splits has the measurements).
  const int64_t nk = (S + bk - 1) / bk;
  const int64_t ranges = std::max<int64_t>(1, std::min(splits, nk));
  const int64_t span = (nk + ranges - 1) / ranges;  // key blocks per range
  const int64_t units = N * Hkv * ranges;
  at::Tensor dq_part;
  if (ranges > 1) dq_part = at::zeros({ranges, N, H, L, E}, q.options().dtype(dk.scalar_type()));
  A* DQP = ranges > 1 ? dq_part.data_ptr<A>() : nullptr;
  // Note [Relative bias]: each unit sums its score gradients per (query head, offset j - i) into its own row
  // of drel_part [units, groups, L + S - 1], added up in unit order at the end (independent of the schedule)
  const int64_t W = L + S - 1;
  at::Tensor drel_part;
  if (drel.defined()) drel_part = at::zeros({units, groups, W}, drel.options());
  A* DRP = drel.defined() ? drel_part.data_ptr<A>() : nullptr;
  std::vector<int64_t> cost(units, 0), order(units);
  for (int64_t u = 0; u < units; ++u) {
    const int64_t n = u / (Hkv * ranges), cr = u % ranges, lo = cr * span, hi = std::min(nk, lo + span);
    if (lay.Nl == 1 && n > 0) {
      cost[u] = cost[u % (Hkv * ranges)];
      continue;
    }
    int64_t c = 0;
    for (int64_t qb = 0; qb < nq; ++qb) {
      const int64_t base = lay.base(n, qb);
      for (int32_t t = 0; t < lay.kv_num[base]; ++t) {
        const int32_t kb = lay.kv_idx[base * lay.maxk + t];
        c += kb >= lo && kb < hi;
      }
    }
    cost[u] = c;
  }
  for (int64_t u = 0; u < units; ++u) order[u] = u;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  parallel_pull(units, grain(units, 2 * N * H * L * S * (E + Ev)) > 1, [&](auto pull) {
    const TileScope tiles(kHalf && (use_brg || score_brg));  // Note [AMX tile state]
    std::vector<A> pbuf(bq * bk), dpbuf(bq * bk), tbuf(mod.softcap > 0 ? bq * bk : 0), dqacc(bq * E), delta(bq),
        lsafe(bq), lsafe_lo(bq);
    std::vector<T> pT(kSame ? 0 : bq * bk), dsT(kSame ? 0 : bq * bk);
    // brgemm (fp32): K^T, V^T of this unit's key blocks, and transposed P, dS tiles (brgemm takes no transposes)
    // (K^T also whenever the forward's scores came from brgemm: Note [Same scores])
    std::vector<T> kt(score_brg ? span * E * bk : 0), vt(use_brg ? span * Ev * bk : 0),
        ptile(use_brg && kSame ? bk * bq : 0), dstile(use_brg && kSame ? bk * bq : 0);
    // Note [Half-type backward on brgemm]: all five products on oneDNN's brgemm (AMX / AVX512-BF16), whose B
    // operand is VNNI-packed [K/2, N, 2] and which takes no transposes. dK and dV are accumulated transposed,
    // dK^T += Q^T dS and dV^T += dO^T P, so the per-tile operands are P and dS packed in row pairs (a cheap
    // interleave) and Q^T, dO^T are transposed once per query block, not per tile; dQ += dS K reads K
    // VNNI-packed once per unit. dK^T, dV^T [E | Ev, keys] are written back to dk, dv when the unit ends.
    const bool hb = kHalf && use_brg;
    const int64_t bqp = bq + (bq & 1), ldt = span * bk;
    std::vector<T> kv(hb ? span * bk * E : 0), qT(hb ? E * bqp : 0), doT(hb ? Ev * bqp : 0), pv(hb ? bqp * bk : 0),
        dsv(hb ? bqp * bk : 0);
    std::vector<A> dkT(hb ? E * ldt : 0), dvT(hb ? Ev * ldt : 0);
    for (int64_t i; (i = pull()) >= 0;) {
      const int64_t u = order[i];
      const int64_t n = u / (Hkv * ranges), kvh = (u / ranges) % Hkv, cr = u % ranges;
      const int64_t kb_lo = cr * span, kb_hi = std::min(nk, kb_lo + span);
      const T* kp = K + n * k.stride(0) + kvh * k.stride(1);
      const T* vp = Vp + n * v.stride(0) + kvh * v.stride(1);
      const int64_t s0 = kb_lo * bk, s1 = std::min(S, kb_hi * bk);
      if (score_brg) pack_transposed_blocks(kp + s0 * k.stride(2), k.stride(2), s1 - s0, E, bk, kt.data());
      if (use_brg) pack_transposed_blocks(vp + s0 * v.stride(2), v.stride(2), s1 - s0, Ev, bk, vt.data());
      if constexpr (kHalf) {
        if (hb) {
          for (int64_t j = 0; s0 + j * bk < s1; ++j)
            pack_vnni(kp + (s0 + j * bk) * k.stride(2), k.stride(2), std::min(bk, s1 - s0 - j * bk), E,
                      kv.data() + j * bk * E);
          std::fill(dkT.begin(), dkT.end(), A(0));
          std::fill(dvT.begin(), dvT.end(), A(0));
        }
      }
      A* dkp = DK + (n * Hkv + kvh) * S * E;
      A* dvp = DV + (n * Hkv + kvh) * S * Ev;
      for (int64_t h = kvh * groups; h < (kvh + 1) * groups; ++h) {
        for (int64_t qb = 0; qb < nq; ++qb) {
          const int64_t q0 = qb * bq, rows = std::min(bq, L - q0);
          const int64_t base = lay.base(n, qb);
          const int32_t cnt = lay.kv_num[base];
          const int32_t* kidx = lay.kv_idx + base * lay.maxk;
          int32_t t0 = 0, t1;
          while (t0 < cnt && kidx[t0] < kb_lo) ++t0;  // kv_idx ascends
          for (t1 = t0; t1 < cnt && kidx[t1] < kb_hi; ++t1) {}
          const T* qp = Q + n * q.stride(0) + h * q.stride(1) + q0 * q.stride(2);
          const T* dop = DO + ((n * H + h) * L + q0) * Ev;
          const int64_t o0 = ((n * H + h) * L + q0) * Ev;
          const A* lp = LSE + (n * H + h) * L + q0;
          const A* lop = LO + (n * H + h) * L + q0;
          T* dqp = DQ + ((n * H + h) * L + q0) * E;
          // this unit's drel row for head h at offset -(q0) + L - 1: row r, key k0 + c adds at [k0 - r + c]
          A* drp = DRP ? DRP + (u * groups + (h - kvh * groups)) * W + (L - 1 - q0) : nullptr;
          if (t0 == t1) {
            if (!DQP) std::fill(dqp, dqp + rows * E, T(0));  // partial dq buffers start at 0
            continue;
          }
          for (int64_t r = 0; r < rows; ++r) {
            A d = 0;
            if (OA) {
              for (int64_t c = 0; c < Ev; ++c) d += static_cast<A>(dop[r * Ev + c]) * OA[o0 + r * Ev + c];
            } else {
              for (int64_t c = 0; c < Ev; ++c) d += static_cast<A>(dop[r * Ev + c]) * static_cast<A>(O[o0 + r * Ev + c]);
            }
            delta[r] = d;
            lsafe[r] = lp[r] == -inf ? inf : lp[r];  // a row with no key: P = exp(-inf) = 0
            lsafe_lo[r] = lp[r] == -inf ? A(0) : lop[r];
          }
          std::fill(dqacc.begin(), dqacc.begin() + rows * E, A(0));
          if constexpr (kHalf) {
            if (hb) {  // Q^T, dO^T of this query block as brgemm A operands [E | Ev, rows (+ a zero column)]
              transpose_halves(reinterpret_cast<const uint16_t*>(qp), q.stride(2), rows, E,
                               reinterpret_cast<uint16_t*>(qT.data()), bqp);
              transpose_halves(reinterpret_cast<const uint16_t*>(dop), Ev, rows, Ev,
                               reinterpret_cast<uint16_t*>(doT.data()), bqp);
              if (rows & 1) {
                for (int64_t e = 0; e < E; ++e) qT[e * bqp + rows] = T(0);
                for (int64_t e = 0; e < Ev; ++e) doT[e * bqp + rows] = T(0);
              }
            }
          }
          for (int32_t t = t0; t < t1; ++t) {
            const int64_t k0 = static_cast<int64_t>(kidx[t]) * bk, panel = kidx[t] - kb_lo;
            const int64_t cols = std::min(bk, S - k0);
            A* p = pbuf.data();
            A* ds = dpbuf.data();
            // Note [Same scores]: the scores exactly as the forward computed them (its product, its scale folded
            // or applied the same way), so that P = exp((s - hi) - lo) is the forward's normalised softmax
            A mul = A(1);
            if constexpr (!std::is_same_v<T, double>) {
              if (score_brg) {
                brg_chunked<T>(rows, cols, E, q.stride(2), bk, bk, false, qp, kt.data() + panel * E * bk, p);
                mul = scale;
              }
            }
            if (!score_brg) gemm(false, true, rows, cols, E, scale, qp, q.stride(2), kp + k0 * k.stride(2), k.stride(2), A(0), p, bk);
            const uint8_t* tile = lay.tile(lay.tile_id[base * lay.maxk + t]);
            if (!(tile == nullptr && mod.plain() && mul > A(0))) {  // the forward's fold test
              modify_scores<A>(p, bk, rows, cols, n, h, q0, k0, tile, mod, tbuf.empty() ? nullptr : tbuf.data(), mul);
              mul = A(1);
            }
            for (int64_t r = 0; r < rows; ++r) {
              A* row = p + r * bk;
              const Vec vm(mul), sh(-lsafe[r]), lo(lsafe_lo[r]);
              int64_t c = 0;
              for (; c + Vec::size() <= cols; c += Vec::size())
                (at::vec::fmadd(Vec::loadu(row + c), vm, sh) - lo).exp_u20().store(row + c);
              for (; c < cols; ++c) row[c] = std::exp(std::fma(row[c], mul, -lsafe[r]) - lsafe_lo[r]);
              if constexpr (!kSame) to_gemm_type(row, pT.data() + r * bk, cols);
            }
            if constexpr (kHalf) {
              if (hb) {  // Note [Half-type backward on brgemm]
                const int64_t rp = rows + (rows & 1), cp = cols + (cols & 1);
                pack_vnni(pT.data(), bk, rows, cols, pv.data());
                brg<T>(Ev, cols, rp, bqp, cols, ldt, true, doT.data(), pv.data(), dvT.data() + panel * bk);
                brg_chunked<T>(rows, cols, Ev, Ev, bk, bk, false, dop, vt.data() + panel * Ev * bk, ds);
                for (int64_t r = 0; r < rows; ++r) {
                  A* dr = ds + r * bk;
                  score_grad_row<A>(dr, p + r * bk, tbuf.empty() ? nullptr : tbuf.data() + r * bk, delta[r], scale,
                                    cols, DB ? DB + ((n * H + h) * L + q0 + r) * S + k0 : nullptr,
                                    drp ? drp + k0 - r : nullptr);
                  to_gemm_type(dr, dsT.data() + r * bk, cols);
                  if (cols & 1) dsT[r * bk + cols] = T(0);  // pairs with K's zero pad row
                }
                brg<T>(rows, E, cp, bk, E, E, true, dsT.data(), kv.data() + panel * bk * E, dqacc.data());
                pack_vnni(dsT.data(), bk, rows, cols, dsv.data());
                brg<T>(E, cols, rp, bqp, cols, ldt, true, qT.data(), dsv.data(), dkT.data() + panel * bk);
                continue;
              }
            }
            if constexpr (std::is_same_v<T, float>) {
              if (use_brg) {
                // dV += P^T dO; dP = dO V^T; dS = P (dP - delta) scale; dQ += dS K; dK += dS^T Q
                transpose(p, bk, rows, cols, ptile.data(), bq);
                brg<T>(cols, Ev, rows, bq, Ev, Ev, true, ptile.data(), dop, dvp + k0 * Ev);
                brg_chunked<T>(rows, cols, Ev, Ev, bk, bk, false, dop, vt.data() + panel * Ev * bk, ds);
                for (int64_t r = 0; r < rows; ++r)
                  score_grad_row<A>(ds + r * bk, p + r * bk, tbuf.empty() ? nullptr : tbuf.data() + r * bk, delta[r],
                                    scale, cols, DB ? DB + ((n * H + h) * L + q0 + r) * S + k0 : nullptr,
                                    drp ? drp + k0 - r : nullptr);
                transpose(ds, bk, rows, cols, dstile.data(), bq);
                brg<T>(rows, E, cols, bk, k.stride(2), E, true, ds, kp + k0 * k.stride(2), dqacc.data());
                brg<T>(cols, E, rows, bq, q.stride(2), E, true, dstile.data(), qp, dkp + k0 * E);
                continue;
              }
            }
            // dV += P^T dO
            if constexpr (kSame) {
              gemm(true, false, cols, Ev, rows, A(1), p, bk, dop, Ev, A(1), dvp + k0 * Ev, Ev);
            } else {
              gemm(true, false, cols, Ev, rows, A(1), pT.data(), bk, dop, Ev, A(1), dvp + k0 * Ev, Ev);
            }
            // dP = dO V^T; dS = P * (dP - delta), through the soft-cap's tanh
            gemm(false, true, rows, cols, Ev, A(1), dop, Ev, vp + k0 * v.stride(2), v.stride(2), A(0), ds, bk);
            for (int64_t r = 0; r < rows; ++r) {
              A* dr = ds + r * bk;
              score_grad_row<A>(dr, p + r * bk, tbuf.empty() ? nullptr : tbuf.data() + r * bk, delta[r], A(1), cols,
                                DB ? DB + ((n * H + h) * L + q0 + r) * S + k0 : nullptr,
                                drp ? drp + k0 - r : nullptr);
              if constexpr (!kSame) to_gemm_type(dr, dsT.data() + r * bk, cols);
            }
            const T* kb = kp + k0 * k.stride(2);
            if constexpr (kSame) {
              gemm(false, false, rows, E, cols, scale, ds, bk, kb, k.stride(2), A(1), dqacc.data(), E);
              gemm(true, false, cols, E, rows, scale, ds, bk, qp, q.stride(2), A(1), dkp + k0 * E, E);
            } else {
              gemm(false, false, rows, E, cols, scale, dsT.data(), bk, kb, k.stride(2), A(1), dqacc.data(), E);
              gemm(true, false, cols, E, rows, scale, dsT.data(), bk, qp, q.stride(2), A(1), dkp + k0 * E, E);
            }
          }
          if (DQP) {
            std::copy(dqacc.begin(), dqacc.begin() + rows * E, DQP + (((cr * N + n) * H + h) * L + q0) * E);
          } else {
            for (int64_t i = 0; i < rows * E; ++i) dqp[i] = static_cast<T>(dqacc[i]);
          }
        }
      }
      if (hb) {  // this unit's keys alone: dk, dv rows [s0, s1) from dK^T, dV^T
        for (int64_t c = 0; c < s1 - s0; ++c) {
          for (int64_t e = 0; e < E; ++e) dkp[(s0 + c) * E + e] = dkT[e * ldt + c];
          for (int64_t e = 0; e < Ev; ++e) dvp[(s0 + c) * Ev + e] = dvT[e * ldt + c];
        }
      }
    }
  });
  if (DQP) dq.copy_(dq_part.sum(0));
  if (DRP) {  // Note [Relative bias]: units (n, kv head, range) in order, query heads kv head's groups
    A* DR = drel.data_ptr<A>();
    for (int64_t u = 0; u < units; ++u) {
      const int64_t kvh = (u / ranges) % Hkv;
      for (int64_t g = 0; g < groups; ++g) {
        const A* src = DRP + (u * groups + g) * W;
        A* dst = DR + (kvh * groups + g) * W;
        for (int64_t x = 0; x < W; ++x) dst[x] += src[x];
      }
    }
  }
}

// Note [Half-type dot products]: whether this CPU multiplies bf16 / fp16 pairs in hardware (AMX tiles, or
// the AVX-512 vector dot products VDPBF16PS / VDPPHPS), from its flags at run time, never from the build. Where
// it does not (AVX2-only CPUs; fp16 without AVX512-FP16), a half-type product is a conversion followed by fp32
// arithmetic, slower than fp32 tiles: the wrapper then converts q, k, v once and runs the fp32 kernel
// (kernels/compiled.py, ``gemm_backend`` "fp32"). Measured fp16 on a Zen 5 (no AVX512-FP16), dense n = 4096,
// H = 8, D = 64, 2 threads (attnlab.bench.half_tiles): MKL's cblas_gemm_f16f16f32 tiles 0.53x the kernel's
// fp32 forward (0.44x forward + backward), fp32 tiles on converted inputs 0.96x (0.95x).
bool native_half_dot(at::ScalarType dt) {
  if (dt != at::kBFloat16 && dt != at::kHalf) return false;
  if (at::native::cpublas::could_pack(dt)) return true;  // AMX-BF16 / AMX-FP16 (torch's cpuinfo)
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  return dt == at::kBFloat16 ? __builtin_cpu_supports("avx512bf16") : __builtin_cpu_supports("avx512fp16");
#else
  return false;
#endif
}

// Note [Half-type brgemm without AMX]: torch's cpublas::brgemm takes bf16 (VNNI-packed B) to oneDNN's ukernel
// on any CPU whose oneDNN ISA has a bf16 dot product: AMX, and also AVX512-BF16 (Cooper Lake, Zen 4 / 5), where
// oneDNN's avx512_core_bf16 brgemm runs on VDPBF16PS (measured on a Zen 5, one thread, 64x64x64: 215 GFLOP/s,
// torch.matmul bf16 210, fp32 brgemm 113). cpublas::could_pack answers only "AMX" (it is about packing), so it
// is not the test. Instead one tiny product is tried once per process: it fails where oneDNN has no bf16 kernel
// for this CPU or its ISA cap (ONEDNN_MAX_CPU_ISA=AVX512_CORE: "could not generate a kernel"; AVX2: torch
// refuses), and fp16 needs AMX-FP16 (torch refuses VNNI fp16 otherwise). A CPU without the dot product in
// hardware is not tried (Note [Half-type dot products]).
template <typename T>
bool try_half_brgemm() {
#if defined(CPU_CAPABILITY_AVX512)
  try {
    // A [2, 2] = [[1, 2], [3, 4]], B [2, 16] in VNNI [1, 16, 2] with B[0][j] = 1, B[1][j] = j:
    // C[i][j] = A[i][0] + A[i][1] j, exact in fp32
    T a[4] = {T(1.f), T(2.f), T(3.f), T(4.f)}, b[32];
    for (int j = 0; j < 16; ++j) {
      b[2 * j] = T(1.f);
      b[2 * j + 1] = T(static_cast<float>(j));
    }
    float c[32];
    at::native::cpublas::brgemm(2, 16, 2, 2, 16, 16, false, a, b, c, true);
    at::native::cpublas::brgemm_release(true);
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 16; ++j)
        if (c[i * 16 + j] != static_cast<float>(a[2 * i]) + static_cast<float>(a[2 * i + 1]) * j) return false;
    return true;
  } catch (...) {
    return false;
  }
#else
  return false;
#endif
}

template <typename T>
bool half_brgemm_runs_for(at::ScalarType dt) {
  static const bool ok = at::native::cpublas::could_pack(dt) || (native_half_dot(dt) && try_half_brgemm<T>());
  return ok;
}

bool half_brgemm_runs(at::ScalarType dt) {
  if (dt == at::kBFloat16) return half_brgemm_runs_for<at::BFloat16>(dt);
  if (dt == at::kHalf) return half_brgemm_runs_for<at::Half>(dt);
  return false;
}

// fp32 tiles always run through brgemm on AVX-512 builds; half types where oneDNN's brgemm has a kernel with the
// CPU's dot product (AMX, AVX512-BF16: Note [Half-type brgemm without AMX]) and the reduction dims are even
// (VNNI pairs).
bool brgemm_applies(at::ScalarType dt, int64_t E, int64_t Ev, int64_t bk, bool allow) {
  if (!kHaveBrgemm || !allow) return false;
  if (dt == at::kFloat) return true;
  if (dt == at::kBFloat16 || dt == at::kHalf) return half_brgemm_runs(dt) && E % 2 == 0 && Ev % 2 == 0 && bk % 2 == 0;
  return false;
}

void check_gemm_mode(int64_t gemm) {
  TORCH_CHECK(gemm == kGemmLoop || gemm == kGemmBlas || gemm == kGemmBrgemm,
              "attnlab._C: gemm must be 0 (loop), 1 (MKL) or 2 (brgemm where it applies, else MKL), got ", gemm);
}

std::vector<at::Tensor> attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                          const at::Tensor& kv_num, const at::Tensor& kv_idx,
                                          const at::Tensor& tile_id, const at::Tensor& tiles,
                                          const std::optional<at::Tensor>& keep, const std::optional<at::Tensor>& bias,
                                          const std::optional<at::Tensor>& alibi, const std::optional<at::Tensor>& rel,
                                          double scale, double softcap, bool alibi_causal, int64_t alibi_offset,
                                          int64_t bq, int64_t bk, int64_t gemm, bool keep_out_acc) {
  check_qkv(q, k, v);
  check_gemm_mode(gemm);
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), S = k.size(2), Ev = v.size(3);
  const bool use_brg = brgemm_applies(q.scalar_type(), q.size(3), Ev, bk, gemm == kGemmBrgemm);
  const Layout lay = make_layout(kv_num, kv_idx, tile_id, tiles, N, L, S, bq, bk);
  const auto acc = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor out = at::empty({N, H, L, Ev}, q.options());
  at::Tensor lse = at::empty({N, H, L}, q.options().dtype(acc));
  at::Tensor lse_lo = at::empty({N, H, L}, q.options().dtype(acc));  // Note [Split log-sum-exp]
  // Note [fp32 O for delta]: for half types the backward's delta reads O in the accumulation dtype
  at::Tensor out_acc;
  if (keep_out_acc && acc != q.scalar_type()) out_acc = at::empty({N, H, L, Ev}, q.options().dtype(acc));
  const std::vector<int64_t> shape4{N, H, L, S};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "attnlab_forward", [&] {
    using A = typename Acc<scalar_t>::type;
    auto mod = make_mods<A>(keep, bias, alibi, rel, softcap, alibi_causal, alibi_offset, shape4);
    forward_impl<scalar_t>(q, k, v, lay, mod, scale, use_brg, gemm != kGemmLoop, out, lse, lse_lo, out_acc);
  });
  return {out, lse, out_acc, lse_lo};
}

std::vector<at::Tensor> attention_backward(const at::Tensor& dout_in, const at::Tensor& q, const at::Tensor& k,
                                           const at::Tensor& v, const at::Tensor& out_in, const at::Tensor& lse_in,
                                           const std::optional<at::Tensor>& lse_lo_in,
                                           const at::Tensor& kv_num, const at::Tensor& kv_idx,
                                           const at::Tensor& tile_id, const at::Tensor& tiles,
                                           const std::optional<at::Tensor>& keep,
                                           const std::optional<at::Tensor>& bias,
                                           const std::optional<at::Tensor>& alibi,
                                           const std::optional<at::Tensor>& rel, double scale, double softcap,
                                           bool alibi_causal, int64_t alibi_offset, int64_t bq, int64_t bk,
                                           int64_t gemm, int64_t score_gemm, bool bias_grad, bool rel_grad,
                                           int64_t splits) {
  check_qkv(q, k, v);
  check_gemm_mode(gemm);
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), S = k.size(2);
  TORCH_CHECK(!bias_grad || (bias && bias->defined()), "attnlab._C: bias_grad needs a bias");
  TORCH_CHECK(!rel_grad || (rel && rel->defined()), "attnlab._C: rel_grad needs rel");
  // fp32 and (Note [Half-type backward on brgemm]) bf16 / fp16 where oneDNN packs them for this CPU
  const bool use_brg = q.scalar_type() != at::kDouble && brgemm_applies(q.scalar_type(), q.size(3), v.size(3), bk,
                                                                       gemm == kGemmBrgemm);
  // Note [Same scores]: the scores on brgemm wherever the forward took it (score_gemm: the forward's gemm
  // mode), whatever engine the other four products take
  check_gemm_mode(score_gemm);
  const bool score_brg = use_brg || (q.scalar_type() != at::kDouble &&
                                     brgemm_applies(q.scalar_type(), q.size(3), v.size(3), bk, score_gemm == kGemmBrgemm));
  const Layout lay = make_layout(kv_num, kv_idx, tile_id, tiles, N, L, S, bq, bk);
  const auto acc = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor dout = dout_in.to(q.scalar_type());
  check_dense(dout, "dout");  // read with canonical offsets (the wrapper brings it to them)
  // out: the forward's output in q's dtype, or (half types) its fp32 copy (Note [fp32 O for delta])
  at::Tensor out = out_in.scalar_type() == acc ? out_in.contiguous() : out_in.to(q.scalar_type()).contiguous();
  at::Tensor lse = lse_in.to(acc).contiguous();
  // Note [Split log-sum-exp]: lse's rounding error from the forward (absent: taken as 0)
  at::Tensor lse_lo = lse_lo_in && lse_lo_in->defined() ? lse_lo_in->to(acc).contiguous() : at::zeros_like(lse);
  TORCH_CHECK(dout.sizes() == out.sizes() && out.size(0) == N && out.size(1) == H && out.size(2) == L &&
              out.size(3) == v.size(3) && lse.sizes() == at::IntArrayRef({N, H, L}) && lse_lo.sizes() == lse.sizes(),
              "attnlab._C: dout / out / lse shapes do not match q, v");
  at::Tensor dq = at::empty(q.sizes(), q.options());
  at::Tensor dk = at::zeros(k.sizes(), k.options().dtype(acc));
  at::Tensor dv = at::zeros(v.sizes(), v.options().dtype(acc));
  // the float mask's gradient, dense: the bias may broadcast (stride 0), so the caller sums it to its shape;
  // blocks the layout skips stay 0 (their probabilities are 0)
  at::Tensor dbias;
  if (bias_grad) dbias = at::zeros({N, H, L, S}, q.options().dtype(acc));
  at::Tensor drel;  // Note [Relative bias]: [H, L + S - 1], summed over the batch
  if (rel_grad) drel = at::zeros({H, L + S - 1}, q.options().dtype(acc));
  const std::vector<int64_t> shape4{N, H, L, S};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "attnlab_backward", [&] {
    using A = typename Acc<scalar_t>::type;
    auto mod = make_mods<A>(keep, bias, alibi, rel, softcap, alibi_causal, alibi_offset, shape4);
    backward_impl<scalar_t>(dout, q, k, v, out, lse, lse_lo, lay, mod, scale, use_brg, score_brg, gemm != kGemmLoop,
                            splits, dq, dk, dv, dbias, drel);
  });
  return {dq, dk.to(q.scalar_type()), dv.to(q.scalar_type()), dbias, drel};
}

bool has_blas() { return sgemm_ != nullptr && dgemm_ != nullptr; }
bool brgemm_for(const std::string& dtype, int64_t E, int64_t Ev, int64_t bk) {
  const auto dt = dtype == "float32" ? at::kFloat : dtype == "bfloat16" ? at::kBFloat16 : dtype == "float16" ? at::kHalf
                                                                                                             : at::kDouble;
  return brgemm_applies(dt, E, Ev, bk, true);
}
bool native_bf16_convert() {
#if defined(CPU_CAPABILITY_AVX512)
  return kNativeBf16;
#else
  return false;
#endif
}
bool has_half_blas() { return cblas_gemm_bf16bf16f32 != nullptr && cblas_gemm_f16f16f32 != nullptr; }

// Note [Serial conversion]: half types that run as fp32 tiles (Note [Half-type dot products]) are converted
// to fp32 and back on the calling thread. Each of PyTorch's own conversions is a parallel region, and on a
// shared CPU a region waits for its slowest thread: measured on 2 busy cores, the four conversions of an
// n = 1024 call (q, k, v, out) took 31 ms, the whole fp32 forward 40 ms; one thread converts 2M values in ~1 ms.
// Returns a contiguous tensor of x's values in `dtype` (x: any strides; a row of the last dim is converted at
// once when its stride is 1).
at::Tensor convert_serial(const at::Tensor& x, const std::string& dtype) {
  const auto dt = dtype == "float32" ? at::kFloat : dtype == "bfloat16" ? at::kBFloat16 : dtype == "float16" ? at::kHalf
                                                                                                          : at::kDouble;
  TORCH_CHECK(dt != at::kDouble && x.device().is_cpu() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf),
              "attnlab._C: convert takes CPU float32 / bfloat16 / float16 tensors to one of those, got ",
              x.scalar_type(), " to ", dtype);
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(dt));
  if (x.numel() == 0) return out;
  const int64_t D = x.dim() ? x.size(-1) : 1, rows = x.numel() / D;
  const bool unit = x.dim() == 0 || x.stride(-1) == 1 || D == 1;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "attnlab_convert_src", [&] {
    using S = scalar_t;
    const S* src = x.data_ptr<S>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dt, "attnlab_convert_dst", [&] {
      scalar_t* dst = out.data_ptr<scalar_t>();
      std::vector<int64_t> pos(std::max<int64_t>(x.dim() - 1, 0), 0);  // row r's index over the leading dims
      for (int64_t r = 0; r < rows; ++r) {
        int64_t off = 0;
        for (size_t d = 0; d < pos.size(); ++d) off += pos[d] * x.stride(d);
        if (unit) {
          at::vec::convert(src + off, dst + r * D, D);
        } else {
          const int64_t st = x.stride(-1);
          for (int64_t c = 0; c < D; ++c) dst[r * D + c] = static_cast<scalar_t>(static_cast<float>(src[off + c * st]));
        }
        for (int64_t d = static_cast<int64_t>(pos.size()) - 1; d >= 0; --d) {  // next row index
          if (++pos[d] < x.size(d)) break;
          pos[d] = 0;
        }
      }
    });
  });
  return out;
}
// "amx", "avx512" (the vector dot products) or "" (none): Note [Half-type dot products]
std::string half_dot_for(const std::string& dtype) {
  const auto dt = dtype == "bfloat16" ? at::kBFloat16 : dtype == "float16" ? at::kHalf : at::kFloat;
  if (!native_half_dot(dt)) return "";
  return at::native::cpublas::could_pack(dt) ? "amx" : "avx512";
}

}  // namespace


PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "attnlab's compiled CPU attention kernel (block-layout driven, flash-attention-2 style)";
  m.def("forward", &attention_forward,
        "(out, lse, out_acc) of block-layout attention; out_acc: O in fp32 for half types when asked, else None");
  m.def("backward", &attention_backward,
        "(dq, dk, dv, dbias) by recomputation from (out or out_acc, lse); dbias [N, H, L, S] when asked, else None");
  m.def("has_blas", &has_blas, "fp32/fp64 tiles run through MKL's gemm (else a plain loop)");
  m.def("native_bf16_convert", &native_bf16_convert,
        "bf16 probabilities are converted by the CPU's AVX512-BF16 instruction (else at::vec's integer sequence)");
  m.def("has_half_blas", &has_half_blas, "bf16/fp16 tiles run through MKL's mixed-precision gemm");
  m.def("convert", &convert_serial, "x's values in dtype (name: float32 / bfloat16 / float16), contiguous, "
        "converted on the calling thread (Note [Serial conversion])");
  m.def("brgemm_for", &brgemm_for, "whether tiles of this dtype (name) and head dims run on oneDNN's brgemm");
  m.def("half_dot", &half_dot_for,
        "how this CPU multiplies pairs of this half dtype (name) in hardware: 'amx', 'avx512' (AVX512-BF16 / "
        "AVX512-FP16) or '' (it does not)");
  ATTNLAB_MODULE_ATTRS(m, 10);
}
