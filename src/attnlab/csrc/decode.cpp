// attnlab's decode kernel: attention of a few queries (L = 1..16: decode, speculative verification, chunked
// prefill tails) against a long KV cache, bound by memory rather than by tiles (flash-decoding).
//
// Shapes (the Python wrapper, kernels/decode.py, brings every input to this form; last dims contiguous):
//   q    [B, H, L, D]           any strides (a view of flash-attn's [B, L, H, D] or attnlab's [B, H, L, D])
//   out  [B, H, L, Dv]          written in place, any strides, q's dtype
//   k, v [P, T, Hkv, D|Dv]      a pool of P pages of T tokens, any strides: a paged cache as it is, a
//                               contiguous cache [B, S, Hkv, D] as P = B pages of T = S tokens, attnlab's
//                               [B, Hkv, S, D] as its permuted view; q's dtype (fp32, bf16 or fp16) or int8
//   k_scale, v_scale [P, T, Hkv] float32, any strides: with an int8 cache, row (p, t, g) holds
//                               k[p, t, g, :] * k_scale[p, t, g] (Note [Decode int8 cache])
//   block_table [B, maxp] int32 page of each sequence's tokens t*T .. t*T+T-1 (contiguous: [[0], [1], ...])
//   seqlens [B] int64           keys j < seqlens[b] exist for sequence b (per-sequence lengths)
//   mask_off [B] int64          query i sits at position i + mask_off[b] (bottom-right: seqlens[b] - L)
//   left, right                 key j is visible to query i when pos - left <= j <= pos + right
//                               (causal: right = 0; unbounded sides are huge)
//   keep [B, H, L, S] uint8, bias [B, H, L, S] float32: optional, read through their strides (a
//                               broadcast dim has stride 0), S indexing logical key positions
//   alibi [B, H] float32 (strides), alibi_off [B]: adds -slope * |i + alibi_off[b] - j|
// Returns lse [B, H, L] float32 (-inf for a row with no key; its output is 0), and with keep_partials the
// per-split outputs [ns, B, H, L, Dv] and lse [ns, B, H, L] (tests check the merge against kernels/lse.py).
//
// Note [Decode schedule]: a unit is (sequence b, kv head g, key split s). All G = H / Hkv query heads of
// the group and all L queries (R = G * L rows) are computed together, so every K/V row is read from memory
// once per group (GQA / MQA without copies). Keys are split into ns contiguous ranges (multiples of the
// tile) so that B * Hkv * ns units keep every thread busy when B * Hkv alone would not; each split keeps its
// own normalised output and log-sum-exp, merged afterwards by Note [Merging by log-sum-exp]
// (kernels/lse.py), written here in its n-ary form: m = max_s lse_s, w_s = exp(lse_s - m),
// out = sum_s w_s out_s / sum_s w_s, lse = m + log(sum_s w_s); every lse_s = -inf gives out 0, lse -inf.
// Threads pull units from one atomic counter; every unit is computed whole by one thread with the same
// code, so for a fixed ns the result does not depend on the thread count or the schedule.
//
// Note [Decode head span]: a cache laid out [.., S, Hkv, D] (flash-attn's, and every paged pool) holds a
// token's kv heads side by side, so one head's rows are Hkv·D apart: read head by head, each row starts a new
// 4 KiB page at Hkv·D = 1024 floats, which the hardware prefetcher does not follow (measured, 1 thread, GQA
// 32/8, D=128, S=8192, CPU time: fp32 20.3 ms vs 10.3 ms for the [.., Hkv, S, D] layout; bf16 13.5 vs 9.2).
// Such a unit then spans all hs = Hkv heads, tile by tile (every head of the tile's tokens, then the next
// tile), so memory is read in order; the key splits then provide the parallelism B·Hkv no longer does.
// Fewer heads per unit are slower (1 thread, CPU time, S=32768, against the [.., Hkv, S, D] layout's time:
// hs = 2 / 4 / 8: fp32 1.49 / 1.20 / 1.14, bf16 1.50 / 1.25 / 1.02), and so is the split count's choice not
// the cause: 2 or 8 splits of hs = 8 time the same (2 threads, wall: fp32 1.11 vs 1.14, bf16 1.28 vs 1.27).
// The rest of the gap is the layout itself at 2 threads (Note [Decode page walk]). Tried and not kept:
// prefetching the next tile token by token (memory order, a tile ahead) instead of the next item's rows:
// no change at 1 thread (fp32 paged 64: 19.1 vs 19.2 ms, bf16 11.3 vs 11.3).
//
// Note [Decode tiles]: keys go TK at a time, read in place and widened to fp32 in registers by the loops
// that use them (Note [Decode loads]). Scores s = (scale * q) . k, then soft-capping, ALiBi, the key range, keep and bias (masked
// scores are overwritten with -inf, never added), the online softmax per row, and P @ V over the keys
// whose probability is not 0: a key masked for a row is skipped, so a NaN or Inf held in a cache slot
// that row may not see never reaches its output (0 * NaN), and slots past seqlens are never read.
//
// Note [Decode int8 cache]: an int8 cache holds each (token, kv head) row as int8 with one float32 scale
// (symmetric, scale = max|x| / 127: quantised on append by functional/kvcache.py). The kernel widens the int8
// values (int8 -> int32 -> fp32) and folds the scales out of the vector loops: a score is (q . k8) * k_scale
// and a key's probability enters P @ V as p * v_scale against v8 (l sums the unscaled p), one multiplication
// per key and row instead of one per element (measured, 1 thread, GQA 32/8 D=128 S=32768, CPU time, loaded
// machine: 15.6 -> 10.7 ms). The result differs from decoding the dequantised cache in fp32 by the rounding
// of that moved multiplication, and in a SIMD build by the scores' int16 query (Note [Decode int8 scores]);
// tests/functional/test_kvcache_int8.py derives the budget of both. The cache is read
// at 1 byte an element plus 4 bytes a row.
//
// Note [Decode int8 scores]: with an AVX2 or AVX-512 build an int8 cache's scores are integer dot products.
// Each query row, scaled by the softmax scale, is rounded once per unit to int16 on its own grid, q16 =
// round(q / qsc) with qsc = max|q_row| / 32767 (every element off by at most qsc / 2: 2^-16 of the row's
// largest, where the int8 keys are off by 2^-8 of theirs and a bf16 q by 2^-9 of each element); the keys are
// sign-extended int8 -> int16 (one instruction per 2W elements, where the fp32 path took int8 -> int32 ->
// fp32, two per W) and multiplied pairwise into int32 lanes (vpmaddwd), exactly; a score is then
// float(q16 . k8) * qsc * k_scale. That halves the instructions per key of the score loop; the rest of the
// tile (softmax, P @ V against v8 with p * v_scale folded, vectorised per tile) is the fp32 path's. Measured
// (1 thread, CPU time, GQA 32/8, D = 128, interleaved with a bf16 cache in one process, the same build, loaded
// machine): int8 / bf16 at S = 32768 from 1.23-1.27 to 0.87-0.93; at S = 2048 (in cache) 1.38-1.48 to
// 1.09-1.14. So the int8 tile is still compute-bound (P @ V: int8 -> int32 -> fp32 per W elements, 4 FMAs a
// vector; the page walk's per-row pointers and scales): 0.6x came with Note [Decode int8 VNNI]. A query that
// already lies on its grid is taken exactly (tests/functional/test_kvcache_int8.py); otherwise the tests add
// the int16 rounding, (qsc / 2) |k|_1 per score, to the fp32 budget. A default build, and heads over
// kIntDotMaxD, keep the fp32 path. The AVX-512 build rounds the query with vector max and round (the scalar
// loops' results, NaN handling included: a serial max over every row of the unit had been an eighth of the
// unit's time outside its loops, perf, 1 thread, S = 2048). Tried and not kept: a block's 16 dot products summed across lanes in int32
// (the tree of Note [Decode dot products] on vpaddd) and converted once instead of each lane converted and
// summed in fp32: the same time (1 thread, GQA 32/8, D = 128, S = 2048, in cache, interleaved: 0.995 and 1.004
// for the two cache layouts). Passing the int32 accumulators themselves to the out-of-line sum (their address
// taken) instead of a copy kept them in memory through the score loop: 0.336 -> 0.397 ms a call.
//
// Note [Decode int8 VNNI]: where the CPU has avx512_vnni (Ice Lake, Sapphire Rapids, Zen 4 and 5) the score
// loop's multiply-add is one vpdpwssd (the same int16 pairs summed into int32 lanes, exactly: the same bits,
// tested) instead of vpmaddwd + vpaddd. The AVX-512 build does not assume VNNI (Skylake-X lacks it), so the
// instruction is inline assembly behind a run-time check (__builtin_cpu_supports), and set_vnni(False)
// (kernels/decode.py) or ATTNLAB_DECODE_NO_VNNI=1 turns it off. With it, the tile-row fast path (Note [Decode
// tile rows]) and the scores scaled as one vector (put_scores_v), an int8 cache decodes at 0.56-0.64x the bf16
// cache's time (Zen 5, 2 threads, GQA 32/8, D = 128, S = 32768, caches flushed, medians of 15 interleaved
// rounds, five runs; `bench decode`: 0.55, where it had been 0.84-1.15); vpmaddwd + vpaddd instead: 0.63-0.76.
// P @ V on integers too (Note [Decode int8 P @ V]) measured 2.5-3% faster in cache on that Zen 5 (1 thread,
// S = 4096) and no change cold (2.62 vs 2.62 ms), for one more rounding; on the Intel cores, whose FP work
// shares port 0, it took 4-7 % off the int8 call cold, so it is kept (set_int_pv(False) or
// ATTNLAB_DECODE_NO_INT_PV=1 turns it off). Tried and not kept: prefetching the row scales of the tile after
// the next one into L1: cold, with the scales of a [B, S, Hkv] cache, 3.6-5.9 ms against 2.6 ms without (three
// process pairs).
//
// Note [Decode int8 groups]: a group-scaled int8 cache (functional/kvquant.py Note [int8 KV groups]: llama.cpp
// q8_0's grouping) holds one float32 scale per group of gs channels (gs a multiple of 32) of each token and kv
// head, k_scale / v_scale [P, T, Hkv, D / gs]. tile_rows copies a tile's scales group-major ([groups][TK]).
// Scores: per group and key the int16 query against the int8 keys in int32 (one vpdpwssd / vpmaddwd step of 32
// channels at gs = 32 on AVX-512), converted to fp32 and multiplied into the key's fp32 lane accumulators by
// the group's scale (one conversion and one FMA per row, key and group, where the per-row format converts
// once per key); the lanes are summed as before and scaled by the row's qsc. P @ V: p * v_scale is formed per
// (row, key, group), vectorised per tile ([R, groups, TK]), and each column vector of V takes its group's p
// (a broadcast per column vector instead of per row: the FMA's memory operand). Without an integer path the
// scores are per-group fp32 sums (dot_keys_f32g). The result is the dequantised cache's within the same
// roundings as the per-row format (tests/functional/test_kvquant_formats.py). The AVX-512 build takes groups of
// 32 (q8_0's, the HF int8 cache's default) on dot_keys_i8g32, one vpmaddwd a group and no int32 accumulators
// beside the fp32 ones, and group-scaled values on the integer P @ V (Note [Decode int8 P @ V]: each chunk of 64
// columns takes its one or two groups' weights, all rounded on one grid a row and tile). Its scale copies are
// gathers (tile_rows) and its query's int16 rounding is vectorised. Measured on the model-207 AMX Xeon (2 vCPUs,
// KVM), GQA 32/8, D = 128, against a bf16 cache in the same rounds, the build before -> after, one process each,
// alternated: in cache (1 thread, S = 2048, medians of 101 interleaved rounds) 0.74-0.76 -> 0.52-0.57 ms, where
// the per-row format takes 0.40-0.44 and bf16 0.52-0.57; cold (2 threads, S = 32768, each call after a 1 GiB
// read, 15 rounds) time over bf16's 0.78-0.97 -> 0.52-0.76, and `bench decode --dtypes bfloat16,int8,int8g32`
// 0.78 and 0.86 (the per-row format 0.59 and 0.67 in the same runs). The rest of the gap to the per-row format
// is the scores: a group's int32 lanes converted and weighed apiece (2 more vector operations per row, key and
// group) where a row converts once per key. Since, where a kv head has 2 or more rows, the scores take key
// columns (Note [Decode int8 key columns]): one conversion and FMA per (row, group, 16 keys).
//
// Note [Decode page walk]: a tile's rows are located by walking the page table (page and offset advanced
// row by row) instead of a division by the page size T per row (three per row: K, V and the prefetched
// row). With it, paged caches of page size 16, 64 and 256 run within 1.01-1.08x of the same keys in one
// [B, S, Hkv, D] page per sequence (the same schedule; measured 1 thread, CPU time, GQA 32/8, D=128,
// S=4096 and 32768, fp32 and bf16, on a loaded machine). The contiguous cache walks the same way.
// Against attnlab's [B, Hkv, S, D] cache (one head per unit, each head's rows one run: what `bench decode`
// calls contiguous) the gap is the pool's layout, not the walk: 2 threads, wall, GQA 32/8 D=128 S=32768,
// caches flushed before each call, medians of 9 interleaved rounds, a lightly loaded machine; time over the
// [B, Hkv, S, D] cache's: [B, S, Hkv, D] 1.14 (fp32) / 1.27 (bf16), paged 16 / 64 / 256 fp32 1.28 / 1.18 /
// 1.14, bf16 1.39 / 1.28 / 1.26. On 1 thread (CPU time) bf16 closes to 1.01-1.06 and fp32 stays 1.14-1.34.
//
// Compiled once per CPU capability with attention.cpp's flags (setup.py); at::vec picks the vector width.

#include "common.h"


namespace {

using at::vec::Vectorized;
using Vf = Vectorized<float>;
constexpr int64_t W = Vf::size();
constexpr int64_t TK = 32;  // keys per tile (Note [Decode tiles])
constexpr float kNinf = -std::numeric_limits<float>::infinity();
// Note [Decode prefetch]: a unit computes items (tile, kv head) in order; the rows of the next item are
// located while the current one runs and prefetched one row per key the score (K) and P @ V (V) loops pass,
// so the misses overlap the arithmetic instead of arriving in bursts. Into L2 (prefetcht1), not L1: a tile
// of fp32 K and V is 32 KiB, and pulling the next one into L1 evicted the current one (measured, 1 thread,
// GQA 32/8 D=128 S=32768, CPU time, loaded machine, the same build: fp32 [B, Hkv, S, D] 37.6 ms into L1
// (= no prefetch, 36.9) vs 21.3 ms into L2; bf16 17.6 vs 10.5; paged fp32 page 64 32.4 vs 22.1).
// set_prefetch(mode) changes it at run time (read once per call), so both levels compare in one process: on
// Zen 5 (2 threads, cold caches, GQA 32/8 D=128, bf16) into L1 measured 3.13 vs 3.58 ms at S = 32768 one hour
// and 4.26 vs 3.68 ms (S = 4096: 0.54 vs 0.45) another, so the default stays L2. Tried and not kept: rows
// found and prefetched two or three items ahead instead of one (the first items' at once): cold, 2 threads,
// GQA 32/8 D = 128, medians of 15 interleaved rounds, time over one item ahead: S = 32768 fp32 1.04-1.09
// (every layout), bf16 0.98-1.02; S = 1024 bf16 0.93-1.06: no gain where the layouts differ most.
// A unit's first item has no item before it to hide its misses behind: its rows are prefetched at once when
// the unit starts, so they arrive together instead of one demand miss per row of the score loop. Cold, 2
// threads, medians of 41 interleaved rounds, time with it over without: MHA 8/8 D = 64 fp32 S = 1024 (8
// units of 1024 keys) 0.93 / 0.96 / 0.93 / 0.97 in four runs; S = 512 and 4096, and GQA 32/8 D = 128 at
// S = 1024 (bf16) and 4096 (fp32), 0.98-1.01.
// ATTNLAB_DECODE_NO_PREFETCH=1 starts with it off, ATTNLAB_DECODE_PREFETCH_LEVEL=1 (or 2) with that level.
// whether an environment variable is set to something other than "" or "0"
bool env_on(const char* name) {
  const char* v = std::getenv(name);
  return v && *v && std::string(v) != "0";
}

std::atomic<int> g_prefetch_mode{[] {  // 0: none, 1: into L1 (prefetcht0), 2: into L2 (prefetcht1, the default)
  if (env_on("ATTNLAB_DECODE_NO_PREFETCH")) return 0;
  const char* lv = std::getenv("ATTNLAB_DECODE_PREFETCH_LEVEL");
  return lv && std::string(lv) == "1" ? 1 : 2;
}()};

struct Args {
  int64_t B, H, Hkv, L, D, Dv, T, maxp, ns, hs;
  const void* q; int64_t qs[4];
  const void* k; int64_t ks[3];  // page, token, head strides of the pool
  const void* v; int64_t vs[3];
  const float* ksc = nullptr; int64_t kss[3] = {0, 0, 0};  // int8 cache: per-row scales [P, T, Hkv]
  const float* vsc = nullptr; int64_t vss[3] = {0, 0, 0};
  int64_t kng = 1, vng = 1;  // scale groups per row (Note [Decode int8 groups]): 1 = one scale per row
  void* out; int64_t os[4];
  const int32_t* table;
  const int64_t* seqlens;
  const int64_t* mask_off;
  int64_t left, right;
  const uint8_t* keep = nullptr; int64_t kps[4] = {0, 0, 0, 0};
  const float* bias = nullptr; int64_t bs[4] = {0, 0, 0, 0};
  const float* alibi = nullptr; int64_t as[2] = {0, 0};
  const int64_t* alibi_off = nullptr;
  float scale, softcap;
  int prefetch = 2;           // Note [Decode prefetch]: 0 none, 1 into L1, 2 into L2
  bool bf16_dot = false;      // Note [Decode bf16 scores]
  bool vnni = false;          // vpdpwssd for an int8 cache's scores (Note [Decode int8 VNNI])
  bool int_pv = false;        // an int8 cache's P @ V on integers (Note [Decode int8 P @ V])
  bool int_cols = false;      // an int8 cache's scores on key columns (Note [Decode int8 key columns])
  float* part_out = nullptr;  // [ns, B, H, L, Dv] when ns > 1
  float* part_lse = nullptr;  // [ns, B, H, L]
  float* lse = nullptr;       // [B, H, L]
};

// The keys [lo, hi) query i of sequence b may see (key range only; keep/bias are applied per score).
inline void row_range(const Args& a, int64_t b, int64_t i, int64_t& lo, int64_t& hi) {
  const int64_t pos = i + a.mask_off[b];
  lo = std::max<int64_t>(0, pos - a.left);
  hi = std::min<int64_t>(a.seqlens[b], pos + a.right + 1);
  if (hi < lo) hi = lo;
}

// Note [Decode loads]: K and V rows are read as stored and widened to fp32 in registers, one vector of W
// elements at a time, by the loop that uses them (no per-tile fp32 copy): bf16 by a zero-extension and a
// 16-bit shift (its bits are the top half of an fp32), fp16 by vcvtph2ps, int8 by a sign extension and one
// int -> float conversion. An int8 vector is then multiplied by its row's scale, so a widened row holds
// exactly the dequantised cache's values (Note [Decode int8 cache]).
template <typename T>
inline Vf load_w(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vf::loadu(p);
#if defined(CPU_CAPABILITY_AVX512)
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
  } else if constexpr (std::is_same_v<T, at::Half>) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  } else if constexpr (std::is_same_v<T, int8_t>) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(CPU_CAPABILITY_AVX2)
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16));
  } else if constexpr (std::is_same_v<T, at::Half>) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else if constexpr (std::is_same_v<T, int8_t>) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#endif
  } else {
    float x[W];
    for (int64_t e = 0; e < W; ++e) x[e] = static_cast<float>(p[e]);
    return Vf::loadu(x);
  }
}

// the first n < W elements, zeros after them (a row's tail when W does not divide its length)
template <typename T>
inline Vf load_tail(const T* p, int64_t n) {
  float x[W] = {};
  for (int64_t e = 0; e < n; ++e) x[e] = static_cast<float>(p[e]);
  return Vf::loadu(x);
}

// Note [Decode tile rows]: a tile's rows (keys j0 .. j0 + nt - 1 of sequence b, kv head g) as pointers into
// the cache, and with an int8 cache their scales; the slots from nt up to the next multiple of W repeat the
// last row, so the score kernel runs whole key blocks (their scores are never read). Rows are found by
// walking the page table (Note [Decode page walk]); a tile inside one page (every tile of a contiguous cache)
// takes them as one strided run instead, without the per-row page lookups: the walk with the scales' loads had
// been a third of the int8 unit's own time outside the score and P @ V loops (1 thread, GQA 32/8, D = 128,
// S = 2048, perf), and the bf16 call went 0.37-0.39 -> 0.32-0.33 ms (1 thread, S = 2048, in L3).
// With ng > 1 scale groups per row (Note [Decode int8 groups]) the scales go group-major, scales[n * TK + t],
// so that a group's scales of a key block, or of every key of the tile, are one vector. A whole tile's scales
// in one page are two gathers a group in the AVX-512 build (the scalar copy, two TK loads and stores a group,
// had been a quarter of the group-scaled unit's time outside the score and P @ V loops: perf, 1 thread, S = 2048).
template <typename T>
inline void tile_rows(const T* base, const int64_t* st, const float* sc, const int64_t* ss, int64_t ng, const Args& a,
                      int64_t b, int64_t g, int64_t j0, int64_t nt, const T** rows, float* scales) {
  const int32_t* tab = a.table + b * a.maxp;
  int64_t pj = j0 / a.T, off = j0 % a.T;  // this row's page index and offset
  if (off + nt <= a.T) {  // the tile within one page (every tile of a contiguous cache): rows st[1] apart
    const int64_t page = tab[pj];
    const T* r0 = base + page * st[0] + off * st[1] + g * st[2];
    const int64_t step = st[1];
    for (int64_t t = 0; t < nt; ++t) rows[t] = r0 + t * step;
    if constexpr (std::is_same_v<T, int8_t>) {
      const float* s0 = sc + page * ss[0] + off * ss[1] + g * ss[2];
      const int64_t sstep = ss[1];
#if defined(CPU_CAPABILITY_AVX512)
      if (nt == TK && sstep <= (int64_t{1} << 26)) {  // two gathers a group (scalar: 2 TK loads and stores)
        const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                               _mm512_set1_epi32(static_cast<int32_t>(sstep)));
        for (int64_t n = 0; n < ng; ++n) {
          _mm512_storeu_ps(scales + n * TK, _mm512_i32gather_ps(idx, s0 + n, 4));
          _mm512_storeu_ps(scales + n * TK + 16, _mm512_i32gather_ps(idx, s0 + 16 * sstep + n, 4));
        }
      } else
#endif
      if (ng == 1) {
        for (int64_t t = 0; t < nt; ++t) scales[t] = s0[t * sstep];
      } else {
        for (int64_t t = 0; t < nt; ++t)
          for (int64_t n = 0; n < ng; ++n) scales[n * TK + t] = s0[t * sstep + n];
      }
    }
  } else {
    for (int64_t t = 0; t < nt; ++t) {
      const int64_t page = tab[pj];
      rows[t] = base + page * st[0] + off * st[1] + g * st[2];
      if constexpr (std::is_same_v<T, int8_t>) {
        const float* sp = sc + page * ss[0] + off * ss[1] + g * ss[2];
        for (int64_t n = 0; n < ng; ++n) scales[n * TK + t] = sp[n];
      }
      if (++off == a.T) { off = 0; ++pj; }
    }
  }
  for (int64_t t = nt; t < (nt + W - 1) / W * W; ++t) {
    rows[t] = rows[nt - 1];
    if constexpr (std::is_same_v<T, int8_t>)
      for (int64_t n = 0; n < ng; ++n) scales[n * TK + t] = scales[n * TK + nt - 1];
  }
}

// The rows of the next (tile, kv head) a unit computes, prefetched one row at a time while the loops over
// this one's rows run (Note [Decode prefetch]); n = 0 prefetches nothing. always_inline: GCC deems a function
// that only prefetches pure (a prefetch is no side effect to it) and drops its calls before inlining them.
template <typename T>
struct NextRows {
  const T* const* rows = nullptr;
  int64_t n = 0, bytes = 0;
  int level = 2;  // 1: into L1, 2: into L2
  __attribute__((always_inline)) inline void row(int64_t t) const {
    if (t < n) {
      const char* p = reinterpret_cast<const char*>(rows[t]);
      if (level == 2)
        for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch(p + c, 0, 2);
      else
        for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch(p + c, 0, 3);
    }
  }
  __attribute__((always_inline)) inline void all() const {  // every row at once
    for (int64_t t = 0; t < n; ++t) row(t);
  }
};

// The sum (the largest) of a vector's lanes: a shuffle tree on AVX-512 (the serial scalar loop was a tenth of
// a bf16 tile's time with the dot products on VDPBF16PS: Note [Decode bf16 scores])
inline float hsum(const Vf& v) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_reduce_add_ps(v);
#else
  float b[W];
  v.store(b);
  float x = 0.f;
  for (int64_t i = 0; i < W; ++i) x += b[i];
  return x;
#endif
}

inline float hmax(const Vf& v) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_reduce_max_ps(v);
#else
  float b[W];
  v.store(b);
  float x = b[0];
  for (int64_t i = 1; i < W; ++i) x = std::max(x, b[i]);
  return x;
#endif
}

// Note [Decode dot products]: out[i] = the sum of acc[i]'s lanes, for W vectors at once: a transpose-add tree
// (pairs within 128-bit lanes, then quads, then across lanes) of 3(W - 1) shuffles and adds for W sums, where
// one reduction per vector costs 2 log2(W) steps each. With K/V widened in registers (Note [Decode loads])
// it took the in-cache cost per (key, kv head) from 44 to 40 ns fp32 and 56 to 39 ns bf16 (1 thread, GQA
// 32/8 D=128 S=512, CPU time, loaded machine; data in L3, so partly memory time).
// always_inline: with a second caller (Note [Decode int8 scores]) GCC stopped inlining it, and the bf16
// path, passing its 16 accumulators through memory, lost 40% (1 thread, S = 2048, 50 -> 70 ns a key).
__attribute__((always_inline)) inline void hsum_all(const Vf* acc, float* out) {
#if defined(CPU_CAPABILITY_AVX512)
  auto pair = [](__m512 x, __m512 y) { return _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y)); };
  auto quad = [](__m512 xy, __m512 zw) {
    return _mm512_add_ps(_mm512_shuffle_ps(xy, zw, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(xy, zw, _MM_SHUFFLE(3, 2, 3, 2)));
  };
  auto lanes = [](__m512 x, __m512 y) {  // [x0+x1, x2+x3, y0+y1, y2+y3] in 128-bit lanes
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
  };
  __m512 q4[4];
  for (int j = 0; j < 4; ++j)  // lane l of q4[j]: the sums of acc[4j .. 4j+3]'s 128-bit lane l
    q4[j] = quad(pair(acc[4 * j], acc[4 * j + 1]), pair(acc[4 * j + 2], acc[4 * j + 3]));
  _mm512_storeu_ps(out, lanes(lanes(q4[0], q4[1]), lanes(q4[2], q4[3])));
#elif defined(CPU_CAPABILITY_AVX2)
  auto pair = [](__m256 x, __m256 y) { return _mm256_add_ps(_mm256_unpacklo_ps(x, y), _mm256_unpackhi_ps(x, y)); };
  auto quad = [](__m256 xy, __m256 zw) {
    return _mm256_add_ps(_mm256_shuffle_ps(xy, zw, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(xy, zw, _MM_SHUFFLE(3, 2, 3, 2)));
  };
  const __m256 lo = quad(pair(acc[0], acc[1]), pair(acc[2], acc[3]));
  const __m256 hi = quad(pair(acc[4], acc[5]), pair(acc[6], acc[7]));
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31)));
#else
  for (int64_t i = 0; i < W; ++i) out[i] = hsum(acc[i]);
#endif
}

// s[rr * TK + t + kk] = scaled(sums[rr * KB + kk], rr, kk) for the RB x KB scores of one dot_keys block
template <int RB, typename F>
__attribute__((always_inline)) inline void put_scores(const float* sums, int64_t t, float* s, F scaled) {
  constexpr int KB = static_cast<int>(W) / RB;
#pragma GCC unroll 4
  for (int rr = 0; rr < RB; ++rr)
#pragma GCC unroll 16
    for (int kk = 0; kk < KB; ++kk) s[rr * TK + t + kk] = scaled(sums[rr * KB + kk], rr, kk);
}

#if defined(CPU_CAPABILITY_AVX512)
// put_scores with the scaling as one vector product, sums[e] * mul[e], and RB stores (scalar, the 16 scores
// of a block took a quarter of the int8 score kernel's time: 1 thread, GQA 32/8, D = 128, S = 2048)
template <int RB>
__attribute__((always_inline)) inline void put_scores_v(const float* sums, __m512 mul, int64_t t, float* s) {
  const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(sums), mul);
  if constexpr (RB == 1) {
    _mm512_storeu_ps(s + t, x);
  } else if constexpr (RB == 2) {
    _mm256_storeu_ps(s + t, _mm512_castps512_ps256(x));
    _mm256_storeu_ps(s + TK + t, _mm512_extractf32x8_ps(x, 1));
  } else {
    static_assert(RB == 4);
    _mm_storeu_ps(s + t, _mm512_castps512_ps128(x));
    _mm_storeu_ps(s + TK + t, _mm512_extractf32x4_ps(x, 1));
    _mm_storeu_ps(s + 2 * TK + t, _mm512_extractf32x4_ps(x, 2));
    _mm_storeu_ps(s + 3 * TK + t, _mm512_extractf32x4_ps(x, 3));
  }
}

// lane rr * KB + kk of the result: qsc[rr] * ksc[kk] (an int8 block's score factors; ksc at the block's key)
template <int RB>
__attribute__((always_inline)) inline __m512 row_key_factors(const float* qsc, const float* ksc) {
  if constexpr (RB == 1) {
    return _mm512_mul_ps(_mm512_set1_ps(qsc[0]), _mm512_loadu_ps(ksc));
  } else if constexpr (RB == 2) {
    const __m512 qv = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(qsc[0]), _mm512_set1_ps(qsc[1]));
    return _mm512_mul_ps(qv, _mm512_broadcast_f32x8(_mm256_loadu_ps(ksc)));
  } else {
    const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512 qv = _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_loadu_ps(qsc)));
    return _mm512_mul_ps(qv, _mm512_broadcast_f32x4(_mm_loadu_ps(ksc)));
  }
}
#endif

// s[rr * TK + t + kk] = q[rr] . k[t + kk] for RB rows (q rows D apart) and KB = W / RB keys: W accumulators,
// plain locals of a fully unrolled loop (so they stay in registers), every K load feeding RB rows; their
// sums by one hsum_all. An int8 key's products are taken with its dequantised values (Note [Decode loads]).
template <int RB, typename T>
inline void dot_keys(const float* q, const T* const* krows, const float* ksc, int64_t t, int64_t D, float* s) {
  constexpr int KB = static_cast<int>(W) / RB;
  Vf acc[W];
#pragma GCC unroll 16
  for (int i = 0; i < W; ++i) acc[i] = Vf(0);
  auto step = [&](int64_t d, auto load) {
    Vf qv[RB];
#pragma GCC unroll 4
    for (int rr = 0; rr < RB; ++rr) qv[rr] = load(q + rr * D + d);
#pragma GCC unroll 16
    for (int kk = 0; kk < KB; ++kk) {
      const Vf kv = load(krows[t + kk] + d);
#pragma GCC unroll 4
      for (int rr = 0; rr < RB; ++rr) acc[rr * KB + kk] = at::vec::fmadd(qv[rr], kv, acc[rr * KB + kk]);
    }
  };
  int64_t d = 0;
  for (; d + W <= D; d += W) step(d, [](const auto* p) { return load_w(p); });
  if (d < D) step(d, [n = D - d](const auto* p) { return load_tail(p, n); });
  float sums[W];
  hsum_all(acc, sums);
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (!std::is_same_v<T, int8_t>) {
    put_scores_v<RB>(sums, _mm512_set1_ps(1.f), t, s);
    return;
  }
#endif
  put_scores<RB>(sums, t, s, [&](float x, int, int kk) {
    if constexpr (std::is_same_v<T, int8_t>)
      return x * ksc[t + kk];  // Note [Decode int8 cache]: the scale folded
    else
      return x;
  });
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
constexpr bool kIntDot = true;  // Note [Decode int8 scores]
#else
constexpr bool kIntDot = false;
#endif
constexpr int64_t KW = 2 * W;  // int16 lanes of one vector: the elements one multiply-add step takes
// the longest head the int32 lanes hold exactly: a lane sums 2 D / KW products of at most 32767 * 127
// (< 2^31 up to D = 8256 at KW = 32, 4128 at KW = 16); longer heads take the fp32 path
constexpr int64_t kIntDotMaxD = 4096;

#if defined(CPU_CAPABILITY_AVX512)
using Vi = __m512i;
inline Vi i8_to_i16(const int8_t* p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline Vi i16_load(const int16_t* p) { return _mm512_loadu_si512(p); }
inline Vi i32_madd_add(Vi acc, Vi a, Vi b) { return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b)); }
inline Vi i32_zero() { return _mm512_setzero_si512(); }
inline Vf i32_to_f(Vi x) { return _mm512_cvtepi32_ps(x); }
// vpdpwssd (AVX512_VNNI: the same pairwise int16 products and sum as vpmaddwd + vpaddd, in one instruction;
// Note [Decode int8 VNNI]). Inline assembly: the AVX-512 build does not assume VNNI, so its intrinsic's target
// is off here; callers take it only where the CPU has it (kHasVnni, checked at run time).
inline Vi i32_dot_add(Vi acc, Vi a, Vi b) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}
const bool kHasVnni = __builtin_cpu_supports("avx512vnni");
#elif defined(CPU_CAPABILITY_AVX2)
using Vi = __m256i;
inline Vi i8_to_i16(const int8_t* p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline Vi i16_load(const int16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline Vi i32_madd_add(Vi acc, Vi a, Vi b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
inline Vi i32_zero() { return _mm256_setzero_si256(); }
inline Vf i32_to_f(Vi x) { return _mm256_cvtepi32_ps(x); }
inline Vi i32_dot_add(Vi acc, Vi a, Vi b) { return i32_madd_add(acc, a, b); }  // (no VNNI assumed: AVX-VNNI aside)
constexpr bool kHasVnni = false;
#endif
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// acc + the pairwise products of a and b's int16 lanes, summed into int32 lanes: exact either way
template <bool VNNI>
__attribute__((always_inline)) inline Vi i32_madd(Vi acc, Vi a, Vi b) {
  if constexpr (VNNI) return i32_dot_add(acc, a, b);
  else return i32_madd_add(acc, a, b);
}
#else
constexpr bool kHasVnni = false;
#endif

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// dot_keys for an int8 cache (Note [Decode int8 scores]): s[rr * TK + t + kk] = (q16[rr] . k8[t + kk]) *
// qsc[rr] * ksc[t + kk], the dot products exact in int32 (pairs of int16 products summed by one multiply-add),
// KW elements a step; q16 rows are Dp >= D apart and zero past D, a key's tail is read into a zeroed buffer.
// noinline, and its sums by an out-of-line hsum_all: inlined (either of them) it ran 15-20% slower (1 thread,
// GQA 32/8, D = 128, S = 2048: 48 -> 56 ns a key), its int32 and fp32 accumulators spilled.
__attribute__((noinline)) void hsum_all_call(const Vf* acc, float* out) { hsum_all(acc, out); }

template <int RB, bool VNNI>
__attribute__((noinline)) void dot_keys_i8(const int16_t* q16, int64_t Dp, const float* qsc, const int8_t* const* krows,
                        const float* ksc, int64_t t, int64_t D, float* s) {
  constexpr int KB = static_cast<int>(W) / RB;
  Vi acc[W];
#pragma GCC unroll 16
  for (int i = 0; i < W; ++i) acc[i] = i32_zero();
#if defined(CPU_CAPABILITY_AVX512)
  // one loop, a key's last chunk by a masked load (as dot_keys_bf16): without the lambda and the scalar tail
  // copy GCC moves 4 accumulators between registers per step instead of 12 around the vpdpwssd
  for (int64_t d = 0; d < D; d += KW) {
    const __mmask32 mk = D - d >= KW ? ~__mmask32(0) : (__mmask32(1) << (D - d)) - 1;
    Vi qv[RB];
#pragma GCC unroll 4
    for (int rr = 0; rr < RB; ++rr) qv[rr] = i16_load(q16 + rr * Dp + d);
#pragma GCC unroll 16
    for (int kk = 0; kk < KB; ++kk) {
      const Vi kv = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mk, krows[t + kk] + d));
#pragma GCC unroll 4
      for (int rr = 0; rr < RB; ++rr) acc[rr * KB + kk] = i32_madd<VNNI>(acc[rr * KB + kk], qv[rr], kv);
    }
  }
#else
  auto step = [&](int64_t d, auto load) {
    Vi qv[RB];
#pragma GCC unroll 4
    for (int rr = 0; rr < RB; ++rr) qv[rr] = i16_load(q16 + rr * Dp + d);
#pragma GCC unroll 16
    for (int kk = 0; kk < KB; ++kk) {
      const Vi kv = load(krows[t + kk] + d);
#pragma GCC unroll 4
      for (int rr = 0; rr < RB; ++rr) acc[rr * KB + kk] = i32_madd<VNNI>(acc[rr * KB + kk], qv[rr], kv);
    }
  };
  int64_t d = 0;
  for (; d + KW <= D; d += KW) step(d, [](const int8_t* p) { return i8_to_i16(p); });
  if (d < D)
    step(d, [n = D - d](const int8_t* p) {
      int8_t x[KW] = {};
      for (int64_t e = 0; e < n; ++e) x[e] = p[e];
      return i8_to_i16(x);
    });
#endif
  Vf accf[W];
#pragma GCC unroll 16
  for (int i = 0; i < W; ++i) accf[i] = i32_to_f(acc[i]);
  float sums[W];
  hsum_all_call(accf, sums);
#if defined(CPU_CAPABILITY_AVX512)
  put_scores_v<RB>(sums, row_key_factors<RB>(qsc, ksc + t), t, s);
#else
  put_scores<RB>(sums, t, s, [&](float x, int rr, int kk) { return x * qsc[rr] * ksc[t + kk]; });
#endif
}

// dot_keys_i8 for a group-scaled key cache (Note [Decode int8 groups]): s[rr * TK + t + kk] = qsc[rr] *
// sum_n ksc[n * TK + t + kk] * (q16[rr] . k8[t + kk]) over group n's gs channels (gs a multiple of KW: whole
// steps, no tail), each group's dot product exact in int32, converted and weighed by its scale in fp32 lanes.
template <int RB, bool VNNI>
__attribute__((noinline)) void dot_keys_i8g(const int16_t* q16, int64_t Dp, const float* qsc,
                                            const int8_t* const* krows, const float* ksc, int64_t t, int64_t D,
                                            int64_t gs, float* s) {
  constexpr int KB = static_cast<int>(W) / RB;
  Vf acc[W];
#pragma GCC unroll 16
  for (int i = 0; i < W; ++i) acc[i] = Vf(0);
  for (int64_t d0 = 0; d0 < D; d0 += gs) {
    const float* kg = ksc + (d0 / gs) * TK + t;  // this group's scales of the block's keys
#pragma GCC unroll 16
    for (int kk = 0; kk < KB; ++kk) {
      Vi part[RB];
#pragma GCC unroll 4
      for (int rr = 0; rr < RB; ++rr) part[rr] = i32_zero();
      for (int64_t d = d0; d < d0 + gs; d += KW) {
        const Vi kv = i8_to_i16(krows[t + kk] + d);
#pragma GCC unroll 4
        for (int rr = 0; rr < RB; ++rr) part[rr] = i32_madd<VNNI>(part[rr], i16_load(q16 + rr * Dp + d), kv);
      }
      const Vf f(kg[kk]);
#pragma GCC unroll 4
      for (int rr = 0; rr < RB; ++rr) acc[rr * KB + kk] = at::vec::fmadd(i32_to_f(part[rr]), f, acc[rr * KB + kk]);
    }
  }
  float sums[W];
  hsum_all_call(acc, sums);
#if defined(CPU_CAPABILITY_AVX512)
  alignas(64) static constexpr float kOnes[W] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
  put_scores_v<RB>(sums, row_key_factors<RB>(qsc, kOnes), t, s);
#else
  put_scores<RB>(sums, t, s, [&](float x, int rr, int) { return x * qsc[rr]; });
#endif
}
#endif

#if defined(CPU_CAPABILITY_AVX512)
// dot_keys_i8g at gs = KW = 32 (llama.cpp q8_0's blocks: the HF int8 cache's default, Note [Decode int8
// groups]): one step a group, so a (row, key, group)'s 16 int32 lanes come from one vpmaddwd, are converted and
// weighed by the group's scale into the key's fp32 lanes at once: the same operations in the same order as the
// general loop (the same bits), without its 16 int32 accumulators live beside the 16 fp32 ones, and with the
// query's int16 rows loaded once a group instead of once a key.
template <int RB>
__attribute__((noinline)) void dot_keys_i8g32(const int16_t* q16, int64_t Dp, const float* qsc,
                                              const int8_t* const* krows, const float* ksc, int64_t t, int64_t D,
                                              float* s) {
  constexpr int KB = static_cast<int>(W) / RB;
  __m512 acc[W];
#pragma GCC unroll 16
  for (int i = 0; i < W; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += KW) {
    const float* kg = ksc + (d / KW) * TK + t;  // this group's scales of the block's keys
    __m512i qv[RB];
#pragma GCC unroll 4
    for (int rr = 0; rr < RB; ++rr) qv[rr] = i16_load(q16 + rr * Dp + d);
#pragma GCC unroll 16
    for (int kk = 0; kk < KB; ++kk) {
      const __m512i kv = i8_to_i16(krows[t + kk] + d);
      const __m512 f = _mm512_set1_ps(kg[kk]);
#pragma GCC unroll 4
      for (int rr = 0; rr < RB; ++rr)
        acc[rr * KB + kk] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(qv[rr], kv)), f, acc[rr * KB + kk]);
    }
  }
  Vf accv[W];
#pragma GCC unroll 16
  for (int i = 0; i < W; ++i) accv[i] = Vf(acc[i]);
  float sums[W];
  hsum_all_call(accv, sums);
  alignas(64) static constexpr float kOnes[W] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
  put_scores_v<RB>(sums, row_key_factors<RB>(qsc, kOnes), t, s);
}
#endif

#if defined(CPU_CAPABILITY_AVX512)
// Note [Decode int8 key columns]: the AVX-512 build takes an int8 cache's scores (per-row or group scales, D a
// multiple of 64) with keys in the lanes instead of channels: 16 keys' rows of 64 channels are transposed as 16 x 16
// dwords (64 shuffles), so lane j of column vector c holds key j's channels 4c .. 4c + 3; each column is split into
// two int16 vectors, words (k[4c], k[4c + 2]) and (k[4c + 1], k[4c + 3]) (a shift pair and a shift, shared by every
// row), and multiplied by a row's int16 query words broadcast in the same order (q16_columns), summed into int32
// lanes by vpdpwssd (VNNI) or vpmaddwd + vpaddd: the same exact integer dot products as dot_keys_i8 / dot_keys_i8g32
// (Note [Decode int8 scores]), 16 keys a vector. A group's (or 64 channels', per row) int32 sums are converted and
// weighed by the group's 16 scales at once (one vector: the scales are group-major, Note [Decode tile rows]), and
// the 16 scores leave as one vector per row: no horizontal sums (hsum_all), and one conversion and FMA per (row,
// group, 16 keys) where the lane layout took one per (row, group, key). The sums are the same integers; only the
// fp32 order of a key's group terms differs (within fp32 rounding: tests/functional/test_kvcache_int8.py compares
// both paths). int32 cannot overflow: a lane sums the products of a group (per-row scales: of 64 channels) between
// conversions, |q16| <= 32767 and |k8| <= 127 each, so groups over kColMaxGroup = 512 channels (which 2^31 would not
// hold) keep the lane kernels. set_int_cols(False) (kernels/decode.py) or ATTNLAB_DECODE_NO_INT_COLS=1 turns it off.
// The transpose is shared by a kv head's G L rows, so a unit takes the columns from kColRows rows (kColRowsGroups
// with group scales). Measured on the model-207 AMX Xeon (2 vCPUs, KVM), time on the lane kernels over time on the
// columns, one process toggling set_int_cols, interleaved, medians. In cache (1 thread, 61 rounds), per-row / group
// scales: GQA 32/8 D 128 S 2048 1.06 / 1.14-1.15; 32/4 1.16 / 1.25; 32/8 with 4 queries 1.20 / 1.35; SmolLM2's 9/3 D
// 64 S 4096 1.08 / 1.14; 16/8 (2 rows) 0.94 / 1.03 and MHA 8/8 (1 row) 0.89 / 0.94, hence the row thresholds. Cold
// (2 threads, S 32768, GQA 32/8, each call after a 1 GiB read, 15 rounds, three runs), time over the bf16 cache's:
// groups of 32 0.751 / 0.770 / 0.763 -> 0.709 / 0.756 / 0.720, per-row 0.606 / 0.653 / 0.636 -> 0.631 / 0.656 /
// 0.637 (no change: cold, the memory time is most of the rest). The column kernel is p0-bound on vpdpwssd (512 a
// tile of 32 keys, 4 rows, D 128); an int8 query on vpdpbusd would halve that, for a rounding of q to 2^-8 of its
// group's max (llama.cpp's q8_0 dot rounds q so too): not taken. Tried and not kept: keys widened to int16 before a
// transpose of (k[2c], k[2c + 1]) words (no shifts, two transposes per 64 channels): in cache 0.43-0.44 against 0.40
// ms (GQA 32/8, groups of 32, three process pairs).
constexpr int64_t kColKeys = 16;  // keys of one column vector
// the fewest rows (G L) a unit's kv head needs for the columns to pay: a key block's transpose is shared by
// its rows (measured, Note [Decode int8 key columns]); per-row scales, and group scales
constexpr int64_t kColRows = 3, kColRowsGroups = 2;
// the largest group the columns take: a lane's int32 sum holds a group's products (512 x 32767 x 127 < 2^31)
constexpr int64_t kColMaxGroup = 512;

// q16 in the column kernel's word order: (q[4c], q[4c + 2], q[4c + 1], q[4c + 3]) for every 4 channels
inline void q16_columns(const int16_t* q, int64_t D, int16_t* y) {
  for (int64_t c = 0; c < D; c += 4) {
    y[c] = q[c];
    y[c + 1] = q[c + 2];
    y[c + 2] = q[c + 1];
    y[c + 3] = q[c + 3];
  }
}

// r[j] = 16 dwords of row j -> r[c] lane j = row j's dword c
__attribute__((always_inline)) inline void transpose16(__m512i* r) {
  __m512i t[16], u[16];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {  // u[4i + m], 128-bit lane L: dword 4L + m of rows 4i .. 4i + 3
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
#pragma GCC unroll 4
  for (int m = 0; m < 4; ++m) {
    const __m512i a = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x88), b = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xDD);
    const __m512i c = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x88), d = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xDD);
    r[m] = _mm512_shuffle_i32x4(a, c, 0x88);
    r[8 + m] = _mm512_shuffle_i32x4(a, c, 0xDD);
    r[4 + m] = _mm512_shuffle_i32x4(b, d, 0x88);
    r[12 + m] = _mm512_shuffle_i32x4(b, d, 0xDD);
  }
}

// keys t .. t + 15 as columns: kt[2c] words (k[4c], k[4c + 2]), kt[2c + 1] words (k[4c + 1], k[4c + 3]),
// sign-extended, lane j key t + j (D a multiple of 64)
inline void key_columns(const int8_t* const* krows, int64_t t, int64_t D, __m512i* kt) {
  for (int64_t d = 0; d < D; d += 64) {
    __m512i r[kColKeys];
#pragma GCC unroll 16
    for (int j = 0; j < kColKeys; ++j) {
      r[j] = _mm512_loadu_si512(krows[t + j] + d);
    }
    transpose16(r);
    __m512i* o = kt + d / 2;
#pragma GCC unroll 16
    for (int c = 0; c < kColKeys; ++c) {
      o[2 * c] = _mm512_srai_epi16(_mm512_slli_epi16(r[c], 8), 8);
      o[2 * c + 1] = _mm512_srai_epi16(r[c], 8);
    }
  }
}

// s[rr * TK + t + j] for RB rows and the 16 keys of kt (Note [Decode int8 key columns]): qt rows Dp apart in
// q16_columns order; kgs > 0: group scales (ksc group-major), else one scale a key (ksc[t + j])
template <int RB, bool VNNI>
__attribute__((noinline)) void dot_cols_i8(const int16_t* qt, int64_t Dp, const float* qsc, const __m512i* kt,
                                           const float* ksc, int64_t t, int64_t D, int64_t kgs, float* s) {
  const int64_t cs = kgs ? kgs : 64;  // channels between conversions
  __m512 f[RB];
#pragma GCC unroll 4
  for (int rr = 0; rr < RB; ++rr) f[rr] = _mm512_setzero_ps();
  for (int64_t d0 = 0; d0 < D; d0 += cs) {
    __m512i a0[RB], a1[RB];  // two chains a row: the words of k[4c], k[4c + 2] and of k[4c + 1], k[4c + 3]
#pragma GCC unroll 4
    for (int rr = 0; rr < RB; ++rr) a0[rr] = a1[rr] = _mm512_setzero_si512();
    for (int64_t d = d0; d < d0 + cs; d += 4) {
      const __m512i x = kt[d / 2], y = kt[d / 2 + 1];
#pragma GCC unroll 4
      for (int rr = 0; rr < RB; ++rr) {
        int32_t w0, w1;
        std::memcpy(&w0, qt + rr * Dp + d, 4);
        std::memcpy(&w1, qt + rr * Dp + d + 2, 4);
        a0[rr] = i32_madd<VNNI>(a0[rr], _mm512_set1_epi32(w0), x);
        a1[rr] = i32_madd<VNNI>(a1[rr], _mm512_set1_epi32(w1), y);
      }
    }
    if (kgs) {
      const __m512 sv = _mm512_loadu_ps(ksc + (d0 / kgs) * TK + t);
#pragma GCC unroll 4
      for (int rr = 0; rr < RB; ++rr)
        f[rr] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a0[rr], a1[rr])), sv, f[rr]);
    } else {
#pragma GCC unroll 4
      for (int rr = 0; rr < RB; ++rr) f[rr] = _mm512_add_ps(f[rr], _mm512_cvtepi32_ps(_mm512_add_epi32(a0[rr], a1[rr])));
    }
  }
  const __m512 ks = kgs ? _mm512_set1_ps(1.f) : _mm512_loadu_ps(ksc + t);
#pragma GCC unroll 4
  for (int rr = 0; rr < RB; ++rr)
    _mm512_storeu_ps(s + rr * TK + t, _mm512_mul_ps(f[rr], _mm512_mul_ps(_mm512_set1_ps(qsc[rr]), ks)));
}

// every row's scores against the tile's nt keys on key columns (rows whole key blocks of 16: Note [Decode tile
// rows]); kt: D / 2 vectors of scratch
template <bool VNNI>
void dot_tile_cols(const int16_t* qt, int64_t Dp, const float* qsc, int64_t R, const int8_t* const* krows,
                   const float* ksc, int64_t kgs, int64_t nt, int64_t D, float* s, __m512i* kt,
                   const NextRows<int8_t>& next) {
  for (int64_t t = 0; t < nt; t += kColKeys) {
    key_columns(krows, t, D, kt);
    for (int64_t e = t; e < t + kColKeys; ++e) next.row(e);
    int64_t r0 = 0;
    for (; r0 + 4 <= R; r0 += 4) dot_cols_i8<4, VNNI>(qt + r0 * Dp, Dp, qsc + r0, kt, ksc, t, D, kgs, s + r0 * TK);
    for (; r0 + 2 <= R; r0 += 2) dot_cols_i8<2, VNNI>(qt + r0 * Dp, Dp, qsc + r0, kt, ksc, t, D, kgs, s + r0 * TK);
    for (; r0 < R; ++r0) dot_cols_i8<1, VNNI>(qt + r0 * Dp, Dp, qsc + r0, kt, ksc, t, D, kgs, s + r0 * TK);
  }
  if (nt < next.n)
    for (int64_t e = (nt + kColKeys - 1) / kColKeys * kColKeys; e < next.n; ++e) next.row(e);
}
#endif

// The scores of a group-scaled key cache where no integer path runs (a default build, heads over kIntDotMaxD):
// per group an fp32 dot product of the scaled query with the int8 values, times the group's scale.
template <int RB>
void dot_keys_f32g(const float* q, const int8_t* const* krows, const float* ksc, int64_t t, int64_t D, int64_t gs,
                   float* s) {
  constexpr int KB = static_cast<int>(W) / RB;
  for (int rr = 0; rr < RB; ++rr)
    for (int kk = 0; kk < KB; ++kk) {
      const int8_t* k = krows[t + kk];
      float tot = 0.f;
      for (int64_t d0 = 0; d0 < D; d0 += gs) {
        float part = 0.f;
        for (int64_t d = d0; d < d0 + gs; ++d) part += q[rr * D + d] * static_cast<float>(k[d]);
        tot += part * ksc[(d0 / gs) * TK + t + kk];
      }
      s[rr * TK + t + kk] = tot;
    }
}

// Note [Decode bf16 scores]: with a bf16 cache on a CPU with avx512_bf16 (Cooper Lake, Sapphire Rapids, Zen 4
// and 5) the scores are VDPBF16PS dot products of the unscaled bf16 query against the bf16 keys as stored: one
// instruction multiplies 32 pairs and adds them into 16 fp32 lanes, where the widening path took a
// zero-extension, a shift and two FMAs for the same 32 elements. The products of two bf16 values are exact in
// fp32 either way; the sums differ in their order (and the instruction flushes denormal inputs, below 2^-126,
// to zero), and the softmax scale multiplies the sum instead of the query (one rounding moved). The query row
// is copied once per unit into qb [RR, Dp] (Dp a multiple of 32, zeros past D), a key's last chunk is read
// with a masked load. Chosen at run time: __builtin_cpu_supports, and set_bf16_dot(False) (kernels/decode.py)
// turns it off so the tests compare both paths on a CPU that has it. Measured (Zen 5, 1 thread, GQA 32/8,
// D = 128, interleaved in one process, the same build; time per call): S = 1024 / 4096 in cache 28.9 / 82.8 us
// -> 27.8 / 78.3 (min of 41 rounds), S = 2048 x 8 kv heads 0.59 -> 0.35 ms and 28 -> 19 ns a key-head on a
// quieter hour of the same machine; cold caches, 2 threads, S = 4096 0.71 -> 0.63 ms, S = 32768 no change
// (4.69 vs 4.80 ms: memory-bound). Tried and not kept: P @ V on VDPBF16PS too (p rounded to bf16 in key pairs,
// the V rows of a pair interleaved by two vpermt2w per 32 columns): no gain at any size (in cache 78.5 vs
// 78.5 us; cold S = 32768 5.17 vs 4.80 ms) for one more rounding of p. Tried again with the pair's rows
// interleaved by in-lane unpacks (vpunpcklwd / vpunpckhwd, the unit's output rows kept in the permuted column
// order and put back as they are written; one target call per row block and tile): half the instructions of
// the widening P @ V, and in cache faster (1 thread, S = 4096, interleaved: 0.547 -> 0.515 ms), but cold
// slower (2 threads, S = 32768, caches flushed, three runs: 4.22 / 4.45 / 4.29 -> 4.59 / 4.75 / 4.64 ms):
// not kept. Cold decode here is not bound by the tile's instructions alone: Note [Decode memory and compute].
//
// Note [Decode memory and compute]: on this machine (a 2-vCPU Zen 5 VM) a decode call's cold time is close to
// its compute time plus its memory time, not the larger of the two. Measured (2 threads, GQA 32/8, D = 128,
// bf16, S = 32768, caches flushed): 1 thread takes 7.7 ms where its in-cache compute (16 ns a key and kv
// head) is 4.2 ms and reading the K/V alone (a sum) 3.7 ms; 2 threads 4.3-4.9 ms against 2.1 + 2.9. A C++
// stream of the same shape (per thread K and V tiles of 32 rows of 256 B, 2 threads, 268 MB) reads at
// 38.6 GB/s with one FMA per loaded vector and 28.7 GB/s with eight (the tile's density): the memory time
// does not hide behind the arithmetic. Software prefetch into L2 (Note [Decode
// prefetch]) is what this kernel needs (without it 9.8 vs 4.6 ms), but it does not buy overlap either: the
// same stream with it reads at 28.0 (one FMA) and 25.1 GB/s (eight). So the remaining gap to the bound is
// compute: every instruction saved per key shows in the cold time, and at 1.25x the bound the tile would
// have to cost under a third of what it does.

std::atomic<bool> g_vnni{!env_on("ATTNLAB_DECODE_NO_VNNI")};
std::atomic<bool> g_int_pv{!env_on("ATTNLAB_DECODE_NO_INT_PV")};  // Note [Decode int8 P @ V]
std::atomic<bool> g_int_cols{!env_on("ATTNLAB_DECODE_NO_INT_COLS")};  // Note [Decode int8 key columns]
#if defined(CPU_CAPABILITY_AVX512)
constexpr bool kHasIntPv = true;
#else
constexpr bool kHasIntPv = false;
#endif

#if defined(CPU_CAPABILITY_AVX512)
const bool kHasBf16Dot = __builtin_cpu_supports("avx512bf16");
std::atomic<bool> g_bf16_dot{!env_on("ATTNLAB_DECODE_NO_BF16_DOT")};
constexpr int64_t kBW = 32;  // bf16 elements of one VDPBF16PS

template <int RB>
__attribute__((target("avx512bf16"), noinline)) void dot_keys_bf16(const at::BFloat16* qb, int64_t Dp,
                                                                   const at::BFloat16* const* krows, int64_t t,
                                                                   int64_t D, float scale, float* s) {
  constexpr int KB = static_cast<int>(W) / RB;
  __m512 acc[W];
#pragma GCC unroll 16
  for (int i = 0; i < W; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += kBW) {  // (no lambda here: a lambda does not inherit the target)
    const __mmask32 mk = D - d >= kBW ? ~__mmask32(0) : (__mmask32(1) << (D - d)) - 1;
    __m512bh qv[RB];
#pragma GCC unroll 4
    for (int rr = 0; rr < RB; ++rr) qv[rr] = (__m512bh)_mm512_loadu_si512(qb + rr * Dp + d);
#pragma GCC unroll 16
    for (int kk = 0; kk < KB; ++kk) {
      const __m512bh kv = (__m512bh)_mm512_maskz_loadu_epi16(mk, krows[t + kk] + d);
#pragma GCC unroll 4
      for (int rr = 0; rr < RB; ++rr) acc[rr * KB + kk] = _mm512_dpbf16_ps(acc[rr * KB + kk], qv[rr], kv);
    }
  }
  Vf accv[W];
#pragma GCC unroll 16
  for (int i = 0; i < W; ++i) accv[i] = Vf(acc[i]);
  float sums[W];
  hsum_all(accv, sums);
  put_scores_v<RB>(sums, _mm512_set1_ps(scale), t, s);
}
#else
constexpr bool kHasBf16Dot = false;
std::atomic<bool> g_bf16_dot{false};
#endif

// every row's scores against the tile's nt keys (rows whole key blocks: Note [Decode tile rows])
// (kgs > 0: a group-scaled key cache, groups of kgs channels, ksc group-major: Note [Decode int8 groups])
template <typename T>
inline void dot_tile(const float* q, const int16_t* q16, int64_t Dp, const float* qsc, const at::BFloat16* qb,
                     int64_t Db, float scale, int64_t R, const T* const* krows, const float* ksc, int64_t kgs,
                     int64_t nt, int64_t D, float* s, const NextRows<T>& next, bool vnni) {
  int64_t r0 = 0;
  auto block = [&](auto rb, int64_t t) {  // the first row block also prefetches the next rows of K
    constexpr int RB = decltype(rb)::value;
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      if (qb) {
        dot_keys_bf16<RB>(qb + r0 * Db, Db, krows, t, D, scale, s + r0 * TK);
      } else {
        dot_keys<RB>(q + r0 * D, krows, ksc, t, D, s + r0 * TK);
      }
    } else
#endif
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
    if constexpr (std::is_same_v<T, int8_t>) {
      if (q16 && kgs) {
#if defined(CPU_CAPABILITY_AVX512)
        if (kgs == KW)
          dot_keys_i8g32<RB>(q16 + r0 * Dp, Dp, qsc + r0, krows, ksc, t, D, s + r0 * TK);
        else
#endif
        if (vnni)
          dot_keys_i8g<RB, true>(q16 + r0 * Dp, Dp, qsc + r0, krows, ksc, t, D, kgs, s + r0 * TK);
        else
          dot_keys_i8g<RB, false>(q16 + r0 * Dp, Dp, qsc + r0, krows, ksc, t, D, kgs, s + r0 * TK);
      } else if (q16) {
        if (vnni)
          dot_keys_i8<RB, true>(q16 + r0 * Dp, Dp, qsc + r0, krows, ksc, t, D, s + r0 * TK);
        else
          dot_keys_i8<RB, false>(q16 + r0 * Dp, Dp, qsc + r0, krows, ksc, t, D, s + r0 * TK);
      } else if (kgs) {
        dot_keys_f32g<RB>(q + r0 * D, krows, ksc, t, D, kgs, s + r0 * TK);
      } else {
        dot_keys<RB>(q + r0 * D, krows, ksc, t, D, s + r0 * TK);
      }
    } else
#endif
    if constexpr (std::is_same_v<T, int8_t>) {
      if (kgs)
        dot_keys_f32g<RB>(q + r0 * D, krows, ksc, t, D, kgs, s + r0 * TK);
      else
        dot_keys<RB>(q + r0 * D, krows, ksc, t, D, s + r0 * TK);
    } else {
      dot_keys<RB>(q + r0 * D, krows, ksc, t, D, s + r0 * TK);
    }
    if (r0 == 0)
      for (int64_t e = t; e < t + W / RB; ++e) next.row(e);
  };
  for (; r0 + 4 <= R; r0 += 4)
    for (int64_t t = 0; t < nt; t += W / 4) block(std::integral_constant<int, 4>{}, t);
  for (; r0 + 2 <= R; r0 += 2)
    for (int64_t t = 0; t < nt; t += W / 2) block(std::integral_constant<int, 2>{}, t);
  for (; r0 < R; ++r0)
    for (int64_t t = 0; t < nt; t += W) block(std::integral_constant<int, 1>{}, t);
  if (nt < next.n)
    for (int64_t e = (nt + W - 1) / W * W; e < next.n; ++e) next.row(e);
}

// O[rr] += sum_t p[rr * TK + t] * V[t] over columns [d, d + NV W) for RB rows sharing each V load (the tile's
// every key weighed by every row: Note [Decode tiles]); with an int8 cache V[t] is the dequantised row.
// With value groups (vgs > 0: Note [Decode int8 groups]) p holds, per row, one [TK] run per group (p * the
// group's v_scale), ps = groups * TK apart, and column vector c reads its group's run.
template <int RB, int NV, bool GROUPED, typename T>
inline void pv_cols(const float* p, const T* const* vrows, int64_t ps, int64_t vgs, int64_t nt, float* o, int64_t Dv,
                    int64_t d, const NextRows<T>* next) {
  int64_t go[NV];  // column vector c's group run, or 0
#pragma GCC unroll 8
  for (int c = 0; c < NV; ++c) go[c] = GROUPED ? (d + c * W) / vgs * TK : 0;
  Vf acc[RB][NV];
#pragma GCC unroll 4
  for (int rr = 0; rr < RB; ++rr)
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) acc[rr][c] = Vf::loadu(o + rr * Dv + d + c * W);
  for (int64_t t = 0; t < nt; ++t) {
    if (next) next->row(t);
    Vf vv[NV];
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) {
      vv[c] = load_w(vrows[t] + d + c * W);
    }
#pragma GCC unroll 4
    for (int rr = 0; rr < RB; ++rr) {
      if constexpr (GROUPED) {
#pragma GCC unroll 8
        for (int c = 0; c < NV; ++c) acc[rr][c] = at::vec::fmadd(Vf(p[rr * ps + go[c] + t]), vv[c], acc[rr][c]);
      } else {
        const Vf pv(p[rr * TK + t]);  // an int8 row's scale is already in p (pv_rows' caller)
#pragma GCC unroll 8
        for (int c = 0; c < NV; ++c) acc[rr][c] = at::vec::fmadd(pv, vv[c], acc[rr][c]);
      }
    }
  }
#pragma GCC unroll 4
  for (int rr = 0; rr < RB; ++rr)
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) acc[rr][c].store(o + rr * Dv + d + c * W);
}

// columns [0, Dv / W * W) of RB rows: chunks of as many vectors as the registers hold (RB x NV accumulators)
// (with `next`, the first chunk prefetches the next rows of V)
template <int RB, typename T>
inline void pv_rows(const float* p, const T* const* vrows, int64_t ps, int64_t vgs, int64_t nt, float* o, int64_t Dv,
                    const NextRows<T>* next) {
  constexpr int NV = (W == 16 ? 16 : 8) / RB > 4 ? 4 : (W == 16 ? 16 : 8) / RB;
  const int64_t nv = Dv / W;
  int64_t c = 0;
  if (vgs) {
    for (; c + NV <= nv; c += NV, next = nullptr) pv_cols<RB, NV, true>(p, vrows, ps, vgs, nt, o, Dv, c * W, next);
    for (; c < nv; ++c, next = nullptr) pv_cols<RB, 1, true>(p, vrows, ps, vgs, nt, o, Dv, c * W, next);
  } else {
    for (; c + NV <= nv; c += NV, next = nullptr) pv_cols<RB, NV, false>(p, vrows, ps, vgs, nt, o, Dv, c * W, next);
    for (; c < nv; ++c, next = nullptr) pv_cols<RB, 1, false>(p, vrows, ps, vgs, nt, o, Dv, c * W, next);
  }
  if (next)
    next->all();
}

#if defined(CPU_CAPABILITY_AVX512)
// Note [Decode int8 P @ V]: P @ V of a per-row-scaled int8 cache on integers, for RB rows weighing all nt keys
// of a tile: per row, w = p * v_scale (pw, the caller's) is rounded to int16 on the row's own grid for this
// tile, f = max|w| / 32767 (each weight off by at most f / 2); pairs of keys' V rows are sign-extended to int16
// and interleaved (vpunpck{l,h}wd), each 16 channels of a pair summed into int32 lanes by one vpdpwssd (VNNI) or
// vpmaddwd + vpaddd (exactly the same sums: the same bits either way, tested), and each row's int32 sums
// converted once per tile, unpermuted, and added to its fp32 output by one FMA with f. int32 cannot overflow:
// a lane sums 2 x 16 products of |w| <= 32767 and |v8| <= 127 per tile (2^27 at most). Returns false, having
// written nothing, where a row's weights are not finite or too small for their grid (max|w| < 2^-100; the
// caller's fp32 P @ V then takes the rows). Columns in steps of 64 (Dv % 64 == 0, checked by the caller). The
// AVX2 and default builds and other Dv keep the fp32 P @ V. Group-scaled values (Note [Decode int8 groups],
// up to kPvMaxGroups a row) take it with w = p * the group's v_scale: a chunk's first and last 32 columns each
// lie in one group; a row's weights of every group share one grid (f = the largest over its groups), so the
// error bound is the per-row one with each key's largest group scale (int_pv_bound), and the per-group grids
// first tried (a max and a sum reduced per row and group) cost more than the integer sums saved.
// Why: on an Intel core the fp32 P @ V widens every V vector (vpmovsxbd, then vcvtdq2ps on port 0) and runs 4
// FMAs per vector and key for 4 rows: 48 vector uops a key against 16 vpdpwssd and 8 shuffles here. Measured
// on the model-207 AMX Xeon (2 vCPUs, KVM), int8 over bf16 cache time, fp32 P @ V -> integer. `bench decode`
// (2 threads, S = 32768, GQA 32/8 D = 128, each call after a 1 GiB read, medians of 15 interleaved rounds; one
// process per setting, ATTNLAB_DECODE_NO_INT_PV, alternated): 0.658 / 0.644 -> 0.620 / 0.637 / 0.622 / 0.655.
// One process toggling set_int_pv, caches flushed by writing 256 MiB (dirty lines, which slow the bf16 call
// more, so lower ratios than the bench's), 15 interleaved rounds: GQA 0.609 / 0.592 / 0.579 -> 0.572 / 0.559 /
// 0.555; MHA 8/8 D = 64 (one row a block) 0.591 -> 0.577; MQA 32/1 D = 128 0.776 -> 0.689; 1 thread, S = 2048
// in cache, 201 rounds, GQA 0.791 -> 0.731. Cold, 33 % of the variant's samples (perf, 1 thread) sit on its
// prefetcht1 of the next item's V rows: the misses pace it at least as much as the arithmetic. Output error
// against float64 (GQA 32/8, S = 4097): relative L2 2.7e-5 -> 4.3e-5, far below the int8 cache's own. With the accumulators
// through the vpdpwssd intrinsic (its target attribute on the function) GCC copied them every step and the
// variant was slower; the inline assembly of i32_dot_add keeps them in registers. Tried and not kept: the next
// int8 item's rows prefetched into L1 instead of L2 (a tile of int8 K and V is 8 KiB): 0.591 / 0.575 / 0.558
// against the 0.572 / 0.559 / 0.555 above, MHA 0.560, 1 thread in cache 0.722: no consistent gain. Those
// prefetches spread over every (column chunk, pair) step instead of issued in the first chunk: `bench decode`
// 0.639 / 0.602 against 0.622 / 0.655 in the same alternation, no difference within its spread.

// one chunk of 64 columns of pv_i8: its first 32 take group ga's weights, its last 32 group gb's (groups are
// multiples of 32 columns); SAME (ga == gb): one broadcast a row and key pair
template <int RB, bool VNNI, bool SAME>
__attribute__((always_inline)) inline void pv_i8_chunk(const int16_t (*w)[TK + 2], const float* f, int64_t ng,
                                                       int64_t ga, int64_t gb, int64_t d0,
                                                       const int8_t* const* vrows, int64_t nt, float* o, int64_t Dv,
                                                       const NextRows<int8_t>* next) {
  const int64_t np = (nt + 1) / 2;
  const __m512i i0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i i1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  __m512i acc[RB][4];
#pragma GCC unroll 4
  for (int rr = 0; rr < RB; ++rr)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) acc[rr][c] = _mm512_setzero_si512();
  for (int64_t j = 0; j < np; ++j) {
    if (next && d0 == 0) {  // the next item's V rows, two a pair (Note [Decode prefetch])
      next->row(2 * j);
      next->row(2 * j + 1);
    }
    const int8_t* a0 = vrows[2 * j] + d0;
    const int8_t* a1 = 2 * j + 1 < nt ? vrows[2 * j + 1] + d0 : a0;  // (weighed 0)
    const __m512i x0 = i8_to_i16(a0), x1 = i8_to_i16(a0 + 32), y0 = i8_to_i16(a1), y1 = i8_to_i16(a1 + 32);
    // int16 lanes (k0[c], k1[c]) pairs: unpack works within 128-bit lanes, undone by i0 / i1 below
    const __m512i v[4] = {_mm512_unpacklo_epi16(x0, y0), _mm512_unpackhi_epi16(x0, y0),
                          _mm512_unpacklo_epi16(x1, y1), _mm512_unpackhi_epi16(x1, y1)};
#pragma GCC unroll 4
    for (int rr = 0; rr < RB; ++rr) {
      int32_t pair;
      std::memcpy(&pair, &w[rr * ng + ga][2 * j], 4);
      const __m512i pa = _mm512_set1_epi32(pair);
      __m512i pb = pa;
      if constexpr (!SAME) {
        std::memcpy(&pair, &w[rr * ng + gb][2 * j], 4);
        pb = _mm512_set1_epi32(pair);
      }
      acc[rr][0] = i32_madd<VNNI>(acc[rr][0], pa, v[0]);
      acc[rr][1] = i32_madd<VNNI>(acc[rr][1], pa, v[1]);
      acc[rr][2] = i32_madd<VNNI>(acc[rr][2], pb, v[2]);
      acc[rr][3] = i32_madd<VNNI>(acc[rr][3], pb, v[3]);
    }
  }
#pragma GCC unroll 4
  for (int rr = 0; rr < RB; ++rr) {
    float* orow = o + rr * Dv + d0;
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m512 fv = _mm512_set1_ps(f[rr]);
      const __m512 lo = _mm512_cvtepi32_ps(acc[rr][2 * h]), hi = _mm512_cvtepi32_ps(acc[rr][2 * h + 1]);
      float* oo = orow + 32 * h;
      _mm512_storeu_ps(oo, _mm512_fmadd_ps(_mm512_permutex2var_ps(lo, i0, hi), fv, _mm512_loadu_ps(oo)));
      _mm512_storeu_ps(oo + 16, _mm512_fmadd_ps(_mm512_permutex2var_ps(lo, i1, hi), fv, _mm512_loadu_ps(oo + 16)));
    }
  }
}

// the most scale groups per value row the integer P @ V takes (Dv / vgs; more take the fp32 P @ V)
constexpr int64_t kPvMaxGroups = 16;

// GROUPED: vgs > 0 channels a value scale, each row's weights p * v_scale one [TK] run per group (ps apart a row)
template <int RB, bool VNNI, bool GROUPED>
bool pv_i8(const float* pw, int64_t ps, int64_t vgs, const int8_t* const* vrows, int64_t nt, float* o, int64_t Dv,
           const NextRows<int8_t>* next) {
  const int64_t ng = GROUPED ? Dv / vgs : 1;
  alignas(64) int16_t w[RB * (GROUPED ? kPvMaxGroups : 1)][TK + 2];
  float f[RB];
  constexpr float kTiny = 0x1p-100f;
  for (int rr = 0; rr < RB; ++rr) {  // one grid a row for all its groups' weights (w[rr * ng + group])
    const float* p = pw + rr * ps;
    float amax = 0.f, tot = 0.f;  // tot: a NaN that max may drop
    if (nt == TK) {
      __m512 mx = _mm512_setzero_ps(), sm = _mm512_setzero_ps();
      for (int64_t n = 0; n < ng; ++n) {
        const __m512 a = _mm512_loadu_ps(p + n * TK), b = _mm512_loadu_ps(p + n * TK + 16);
        mx = _mm512_max_ps(mx, _mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        sm = _mm512_add_ps(sm, _mm512_add_ps(a, b));
      }
      amax = _mm512_reduce_max_ps(mx);
      tot = _mm512_reduce_add_ps(sm);
    } else {
      for (int64_t n = 0; n < ng; ++n)
        for (int64_t t = 0; t < nt; ++t) { amax = std::max(amax, std::abs(p[n * TK + t])); tot += p[n * TK + t]; }
    }
    if (!std::isfinite(amax) || !std::isfinite(tot) || (amax > 0.f && amax < kTiny)) return false;
    const float inv = amax > 0.f ? 32767.f / amax : 0.f;
    f[rr] = amax / 32767.f;
    for (int64_t n = 0; n < ng; ++n) {
      const float* pn = p + n * TK;
      int16_t* wn = w[rr * ng + n];
      if (nt == TK) {
        const __m512 iv = _mm512_set1_ps(inv);
        _mm256_store_si256(reinterpret_cast<__m256i*>(wn),
                           _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(pn), iv))));
        _mm256_store_si256(reinterpret_cast<__m256i*>(wn + 16),
                           _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(pn + 16), iv))));
      } else {
        for (int64_t t = 0; t < nt; ++t) wn[t] = static_cast<int16_t>(std::nearbyint(pn[t] * inv));
        wn[nt] = 0;  // an odd tile's last pair weighs its second key 0
      }
    }
  }
  for (int64_t d0 = 0; d0 < Dv; d0 += 64) {
    if constexpr (GROUPED) {
      const int64_t ga = d0 / vgs, gb = (d0 + 32) / vgs;
      if (ga == gb)
        pv_i8_chunk<RB, VNNI, true>(w, f, ng, ga, gb, d0, vrows, nt, o, Dv, next);
      else
        pv_i8_chunk<RB, VNNI, false>(w, f, ng, ga, gb, d0, vrows, nt, o, Dv, next);
    } else {
      pv_i8_chunk<RB, VNNI, true>(w, f, 1, 0, 0, d0, vrows, nt, o, Dv, next);
    }
  }
  if (next)  // the next item's rows past this tile's pairs (a partial tile before a whole one)
    for (int64_t e = 2 * ((nt + 1) / 2); e < next->n; ++e) next->row(e);
  return true;
}
#endif

// TQ: q's and out's type; T: the cache's (TQ, or int8: Note [Decode int8 cache])
template <typename TQ, typename T>
void decode_impl(const Args& a) {
  // hs kv heads per unit (Note [Decode head span]); RR = hs * G * L rows
  const int64_t G = a.H / a.Hkv, R = G * a.L, D = a.D, Dv = a.Dv, ns = a.ns, hs = a.hs, RR = hs * R;
  const TQ* Q = static_cast<const TQ*>(a.q);
  const T* K = static_cast<const T*>(a.k);
  const T* V = static_cast<const T*>(a.v);
  const int64_t spans = a.Hkv / hs, units = a.B * spans * ns;
  std::atomic<int64_t> next{0};
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), units));
  at::parallel_for(0, tasks, 1, [&](int64_t, int64_t) {
    std::vector<float> qs(RR * D), o(RR * Dv), sc(R * TK), m(RR), l(RR);
    // an int8 cache's scores take q as int16 rows (Note [Decode int8 scores]): q16 [RR, Dp], qsc [RR]
    const bool i8dot = kIntDot && std::is_same_v<T, int8_t> && D <= kIntDotMaxD;
    const int64_t Dp = (D + KW - 1) / KW * KW;
    std::vector<int16_t> q16(i8dot ? RR * Dp : 0);
    std::vector<float> qsc(i8dot ? RR : 0);
#if defined(CPU_CAPABILITY_AVX512)
    // the scores on key columns (Note [Decode int8 key columns]): q16 in their word order, qt [RR, Dp], and a
    // key block's columns, kt [D / 2]
    const bool icols = i8dot && a.int_cols && D % 64 == 0 && R >= (a.kng > 1 ? kColRowsGroups : kColRows) &&
                       (a.kng == 1 || D / a.kng <= kColMaxGroup);
    std::vector<int16_t> qt(icols ? RR * Dp : 0);
    std::vector<__m512i> kt(icols ? D / 2 : 0);
#endif
    // a bf16 cache's scores by VDPBF16PS take the unscaled bf16 query: qb [RR, Db] (Note [Decode bf16 scores])
    const bool bdot = std::is_same_v<TQ, at::BFloat16> && std::is_same_v<T, at::BFloat16> && a.bf16_dot;
    const int64_t Db = (D + 31) / 32 * 32;
    std::vector<at::BFloat16> qb(bdot ? RR * Db : 0);
    // an int8 tile's p * v_scale [R, TK], or [R, vng, TK] per value group (Note [Decode int8 groups])
    std::vector<float> pw(std::is_same_v<T, int8_t> ? R * a.vng * TK : 0);
    std::vector<int64_t> rlo(R), rhi(R);
    std::vector<int32_t> nz(R * TK), nnz(R);
    std::vector<uint8_t> zfull(R);
    const T* kr[2][TK];  // this item's rows and the next one's (Note [Decode prefetch])
    const T* vr[2][TK];
    // an int8 cache's row scales, [2][ng][TK] (group-major: tile_rows)
    std::vector<float> ks2(std::is_same_v<T, int8_t> ? 2 * a.kng * TK : 0), vs2(std::is_same_v<T, int8_t> ? 2 * a.vng * TK : 0);
    const int64_t kgs = a.kng > 1 ? D / a.kng : 0, vgs = a.vng > 1 ? Dv / a.vng : 0;  // group sizes (0: per row)
    for (int64_t u; (u = next.fetch_add(1, std::memory_order_relaxed)) < units;) {
      const int64_t s = u % ns, g0 = ((u / ns) % spans) * hs, b = u / (ns * spans);
      // 1) the groups' query rows, scaled, in fp32; each row's key range; the unit's key range
      int64_t ulo = std::numeric_limits<int64_t>::max(), uhi = 0;
      for (int64_t rr = 0; rr < RR; ++rr) {
        const int64_t i = rr % a.L, h = g0 * G + rr / a.L;
        const TQ* qp = Q + b * a.qs[0] + h * a.qs[1] + i * a.qs[2];
        for (int64_t d = 0; d < D; ++d) qs[rr * D + d] = static_cast<float>(qp[d]) * a.scale;
        if (bdot) {
          at::BFloat16* y = qb.data() + rr * Db;
          for (int64_t d = 0; d < Db; ++d) y[d] = d < D ? static_cast<at::BFloat16>(qp[d]) : at::BFloat16(0.f);
        }
        if (i8dot) {  // q16 = round(qs / qsc), qsc = max|qs| / 32767: each element off by <= qsc / 2
          const float* x = qs.data() + rr * D;
          int16_t* y = q16.data() + rr * Dp;
          float amax = 0.f;
          int64_t d = 0;
#if defined(CPU_CAPABILITY_AVX512)
          // (max_ps returns its second operand where the first is NaN: a NaN dropped, as std::max drops it)
          __m512 mx = _mm512_setzero_ps();
          for (; d + 16 <= D; d += 16) mx = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + d)), mx);
          amax = _mm512_reduce_max_ps(mx);
#endif
          for (; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
          const bool ok = std::isfinite(amax) && amax > 0.f;
          const float inv = ok ? 32767.f / amax : 0.f;
          d = 0;
#if defined(CPU_CAPABILITY_AVX512)
          // the scalar loop's clamps: min_ps / max_ps return the bound where the value is NaN, as it does
          const __m512 iv = _mm512_set1_ps(inv), hi = _mm512_set1_ps(32767.f), lo = _mm512_set1_ps(-32767.f);
          for (; d + 16 <= D; d += 16) {
            const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(x + d), iv),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + d),
                                _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_max_ps(_mm512_min_ps(r, hi), lo))));
          }
#endif
          for (; d < Dp; ++d)
            y[d] = d < D ? static_cast<int16_t>(std::max(-32767.f, std::min(32767.f, std::nearbyint(x[d] * inv)))) : 0;
          // a non-finite q gives NaN scores (its row's output NaN, as an fp32 q . k would make it)
          qsc[rr] = ok ? amax / 32767.f : (amax > 0.f ? std::numeric_limits<float>::quiet_NaN() : 0.f);
#if defined(CPU_CAPABILITY_AVX512)
          if (icols) q16_columns(y, Dp, qt.data() + rr * Dp);
#endif
        }
      }
      for (int64_t r = 0; r < R; ++r) {  // ranges depend on the query only
        row_range(a, b, r % a.L, rlo[r], rhi[r]);
        if (rhi[r] > rlo[r]) { ulo = std::min(ulo, rlo[r]); uhi = std::max(uhi, rhi[r]); }
      }
      std::fill(m.begin(), m.end(), kNinf);
      std::fill(l.begin(), l.end(), 0.f);
      std::fill(o.begin(), o.end(), 0.f);
      // this split's share of the keys, in whole tiles (Note [Decode schedule])
      int64_t j0 = 0, j1 = 0;
      if (uhi > ulo) {
        const int64_t tiles = (uhi - ulo + TK - 1) / TK, per = (tiles + ns - 1) / ns;
        j0 = std::min(uhi, ulo + s * per * TK);
        j1 = std::min(uhi, ulo + (s + 1) * per * TK);
      }
      // items (tile t0, kv head g0 + gl) in order; each one's rows are found while the item before it runs
      int cur = 0;
      auto rows_of = [&](int c, int64_t t0, int64_t g, int64_t nt) {
        tile_rows(K, a.ks, a.ksc, a.kss, a.kng, a, b, g, t0, nt, kr[c], ks2.data() + c * a.kng * TK);
        tile_rows(V, a.vs, a.vsc, a.vss, a.vng, a, b, g, t0, nt, vr[c], vs2.data() + c * a.vng * TK);
      };
      if (j0 < j1) {
        const int64_t n0 = std::min(TK, j1 - j0);
        rows_of(0, j0, g0, n0);
        if (a.prefetch > 0) {  // the first item's rows at once (Note [Decode prefetch]): no item runs before it
          NextRows<T>{kr[0], n0, D * static_cast<int64_t>(sizeof(T)), a.prefetch}.all();
          NextRows<T>{vr[0], n0, Dv * static_cast<int64_t>(sizeof(T)), a.prefetch}.all();
        }
      }
      for (int64_t t0 = j0; t0 < j1; t0 += TK)
      for (int64_t gl = 0; gl < hs; ++gl) {
        const int64_t nt = std::min(TK, j1 - t0), g = g0 + gl;
        const int c = cur;
        cur ^= 1;
        const T* const* krows = kr[c];
        const T* const* vrows = vr[c];
        const float* kscl = ks2.data() + c * a.kng * TK;
        const float* vscl = vs2.data() + c * a.vng * TK;
        NextRows<T> next_k, next_v;
        {
          const int64_t u0 = gl + 1 < hs ? t0 : t0 + TK, ug = gl + 1 < hs ? g + 1 : g0;
          if (u0 < j1) {
            const int64_t un = std::min(TK, j1 - u0);
            rows_of(c ^ 1, u0, ug, un);
            if (a.prefetch > 0) {
              next_k = {kr[c ^ 1], un, D * static_cast<int64_t>(sizeof(T)), a.prefetch};
              next_v = {vr[c ^ 1], un, Dv * static_cast<int64_t>(sizeof(T)), a.prefetch};
            }
          }
        }
        float* const m_g = m.data() + gl * R;
        float* const l_g = l.data() + gl * R;
        float* const o_g = o.data() + gl * R * Dv;
        const float* const qs_g = qs.data() + gl * R * D;
        // 2) scores of every row against the tile's keys
#if defined(CPU_CAPABILITY_AVX512)
        if constexpr (std::is_same_v<T, int8_t>) {
          if (icols) {
            if (a.vnni)
              dot_tile_cols<true>(qt.data() + gl * R * Dp, Dp, qsc.data() + gl * R, R, krows, kscl, kgs, nt, D,
                                  sc.data(), kt.data(), next_k);
            else
              dot_tile_cols<false>(qt.data() + gl * R * Dp, Dp, qsc.data() + gl * R, R, krows, kscl, kgs, nt, D,
                                   sc.data(), kt.data(), next_k);
          }
        }
        if (!(std::is_same_v<T, int8_t> && icols))
#endif
        dot_tile(qs_g, i8dot ? q16.data() + gl * R * Dp : nullptr, Dp, i8dot ? qsc.data() + gl * R : nullptr,
                 bdot ? qb.data() + gl * R * Db : nullptr, Db, a.scale, R,
                 krows, kscl, kgs, nt, D, sc.data(), next_k, a.vnni);  // rows sharing each K load
        for (int64_t r = 0; r < R; ++r) {
          float* srow = sc.data() + r * TK;
          const int64_t lo = rlo[r], hi = rhi[r];
          if (hi <= t0 || lo >= t0 + nt) {  // this row sees none of the tile
            for (int64_t t = 0; t < nt; ++t) srow[t] = kNinf;
            continue;
          }
          const int64_t gi = r / a.L, i = r % a.L, h = g * G + gi;
          if (a.softcap > 0) {
            const float cap = a.softcap, inv = 1.f / cap;
            at::vec::map([cap, inv](Vf x) { return (x * Vf(inv)).tanh() * Vf(cap); }, srow, srow, nt);
          }
          if (a.alibi) {
            const float slope = a.alibi[b * a.as[0] + h * a.as[1]];
            const int64_t pos = i + a.alibi_off[b];
            for (int64_t t = 0; t < nt; ++t) {
              const int64_t dd = pos - (t0 + t);
              srow[t] -= slope * static_cast<float>(dd < 0 ? -dd : dd);
            }
          }
          if (a.bias) {
            const float* bp = a.bias + b * a.bs[0] + h * a.bs[1] + i * a.bs[2];
            for (int64_t t = 0; t < nt; ++t) srow[t] += bp[(t0 + t) * a.bs[3]];
          }
          // Note [Decode tiles]: masking overwrites with -inf
          if (t0 < lo || t0 + nt > hi)
            for (int64_t t = 0; t < nt; ++t)
              if (t0 + t < lo || t0 + t >= hi) srow[t] = kNinf;
          if (a.keep) {
            const uint8_t* kp = a.keep + b * a.kps[0] + h * a.kps[1] + i * a.kps[2];
            for (int64_t t = 0; t < nt; ++t)
              if (!kp[(t0 + t) * a.kps[3]]) srow[t] = kNinf;
          }
        }
        // 3) online softmax per row; the keys each row weighs (p != 0, NaN included). Note [Decode softmax]:
        // the max and the exp-sum are vector reductions; the list of weighed keys is built only for a row with
        // a zero weight in the tile (masked or underflowed keys), else the row weighs all nt keys
        bool any = false, every = true;
        for (int64_t r = 0; r < R; ++r) {
          float* srow = sc.data() + r * TK;
          float mt = m_g[r];
          {
            int64_t t = 0;
            Vf mv(mt);
            for (; t + W <= nt; t += W) mv = at::vec::maximum(mv, Vf::loadu(srow + t));
            mt = std::max(mt, hmax(mv));
            for (; t < nt; ++t) mt = std::max(mt, srow[t]);
          }
          nnz[r] = 0;
          if (mt == kNinf) {  // no key seen yet: this row weighs nothing, so the rows cannot share V loads
            every = false;    // (its scores stay -inf, not exponentiated: a shared pass would add -inf * v = NaN)
            continue;
          }
          if (mt != m_g[r]) {
            const float alpha = m_g[r] == kNinf ? 0.f : std::exp(m_g[r] - mt);
            l_g[r] *= alpha;
            float* orow = o_g + r * Dv;
            at::vec::map([alpha](Vf x) { return x * Vf(alpha); }, orow, orow, Dv);
            m_g[r] = mt;
          }
          float sum = 0.f;
          bool zero = false;
          {
            int64_t t = 0;
            const Vf mvv(mt);
            Vf acc(0);
            for (; t + W <= nt; t += W) {
              const Vf e = (Vf::loadu(srow + t) - mvv).exp_u20();
              e.store(srow + t);
              acc = acc + e;
              zero = zero || e.zero_mask() != 0;
            }
            sum = hsum(acc);
            if (t < nt) {  // the tail through a partial vector: the same exp_u20 as the full ones
              (Vf::loadu(srow + t, nt - t) - mvv).exp_u20().store(srow + t, nt - t);
              for (; t < nt; ++t) {
                sum += srow[t];
                zero = zero || srow[t] == 0.f;
              }
            }
          }
          int32_t* z = nz.data() + r * TK;
          zfull[r] = !zero;  // a row weighing all nt keys lists them only if a pass below needs the list
          if (zero) {
            for (int64_t t = 0; t < nt; ++t)
              if (srow[t] != 0.f) z[nnz[r]++] = static_cast<int32_t>(t);
          } else {
            nnz[r] = static_cast<int32_t>(nt);
          }
          l_g[r] += sum;
          any = any || nnz[r] > 0;
          every = every && nnz[r] == nt;
        }
        if (!any) {
          next_v.all();
          continue;
        }
        // 4) O += P @ V over the weighed keys
        const int64_t d_vec = Dv / W * W;  // columns the vector passes do; the rest one by one
        int64_t r_first = 0;  // rows the blocked pass below has done
        if (every) {  // every row weighs every key: rows share each V load, 4 at a time
          const NextRows<T>* nv = &next_v;  // prefetched by the first row block
          const float* pp = sc.data();
          int64_t ps = TK;  // p's row stride
          if constexpr (std::is_same_v<T, int8_t>) {  // p * v_scale, once per (row, key[, group]), vectorised
            ps = a.vng * TK;
            for (int64_t r = 0; r < R; ++r)
              for (int64_t n = 0; n < a.vng; ++n)
                at::vec::map2([](Vf x, Vf y) { return x * y; }, pw.data() + r * ps + n * TK, sc.data() + r * TK,
                              vscl + n * TK, nt);
            pp = pw.data();
          }
#if defined(CPU_CAPABILITY_AVX512)
          if constexpr (std::is_same_v<T, int8_t>) {  // Note [Decode int8 P @ V]
            if (a.int_pv && Dv % 64 == 0 && a.vng <= kPvMaxGroups) {
              auto run = [&](auto rb) {
                constexpr int RB = decltype(rb)::value;
                for (; r_first + RB <= R; r_first += RB, nv = nullptr) {
                  const float* pr = pp + r_first * ps;
                  float* orr = o_g + r_first * Dv;
                  const bool ok = vgs ? (a.vnni ? pv_i8<RB, true, true>(pr, ps, vgs, vrows, nt, orr, Dv, nv)
                                                : pv_i8<RB, false, true>(pr, ps, vgs, vrows, nt, orr, Dv, nv))
                                      : (a.vnni ? pv_i8<RB, true, false>(pr, ps, vgs, vrows, nt, orr, Dv, nv)
                                                : pv_i8<RB, false, false>(pr, ps, vgs, vrows, nt, orr, Dv, nv));
                  if (!ok) return false;
                }
                return true;
              };
              run(std::integral_constant<int, 4>{}) && run(std::integral_constant<int, 2>{}) &&
                  run(std::integral_constant<int, 1>{});
            }
          }
#endif
          for (; r_first + 4 <= R; r_first += 4, nv = nullptr)
            pv_rows<4>(pp + r_first * ps, vrows, ps, vgs, nt, o_g + r_first * Dv, Dv, nv);
          for (; r_first + 2 <= R; r_first += 2, nv = nullptr)
            pv_rows<2>(pp + r_first * ps, vrows, ps, vgs, nt, o_g + r_first * Dv, Dv, nv);
          for (; r_first < R; ++r_first, nv = nullptr)
            pv_rows<1>(pp + r_first * ps, vrows, ps, vgs, nt, o_g + r_first * Dv, Dv, nv);
        } else {
          next_v.all();
        }
        for (int64_t r = 0; r < R; ++r) {
          const int32_t n = nnz[r];
          if (!n || (r < r_first && d_vec == Dv)) continue;
          const float* p = sc.data() + r * TK;
          int32_t* const z = nz.data() + r * TK;
          if (zfull[r])
            for (int32_t t = 0; t < n; ++t) z[t] = t;
          float* orow = o_g + r * Dv;
          auto vrow = [&](int32_t e, int64_t d) { return load_w(vrows[z[e]] + d); };  // V[z[e]], d .. d + W - 1
          // p of key z[e] for column d, an int8 row's (or d's group's) scale folded in (Note [Decode int8 cache])
          auto pz = [&](int32_t e, int64_t d) {
            return std::is_same_v<T, int8_t> ? p[z[e]] * vscl[(vgs ? d / vgs : 0) * TK + z[e]] : p[z[e]];
          };
          int64_t d = r < r_first ? d_vec : 0;
          for (; d + 2 * W <= d_vec; d += 2 * W) {
            Vf acc0 = Vf::loadu(orow + d), acc1 = Vf::loadu(orow + d + W);
            for (int32_t e = 0; e < n; ++e) {  // (d and d + W in one group: groups are multiples of 32 >= 2 W)
              const Vf pv(pz(e, d));
              acc0 = at::vec::fmadd(pv, vrow(e, d), acc0);
              acc1 = at::vec::fmadd(pv, vrow(e, d + W), acc1);
            }
            acc0.store(orow + d);
            acc1.store(orow + d + W);
          }
          for (; d < d_vec; d += W) {
            Vf acc = Vf::loadu(orow + d);
            for (int32_t e = 0; e < n; ++e) acc = at::vec::fmadd(Vf(pz(e, d)), vrow(e, d), acc);
            acc.store(orow + d);
          }
          for (; d < Dv; ++d) {
            float acc = orow[d];
            for (int32_t e = 0; e < n; ++e) acc += pz(e, d) * static_cast<float>(vrows[z[e]][d]);
            orow[d] = acc;
          }
        }
      }
      // 5) normalise; write the output (one split) or this split's partial
      for (int64_t rr = 0; rr < RR; ++rr) {
        const int64_t i = rr % a.L, h = g0 * G + rr / a.L;
        const bool seen = l[rr] > 0.f || std::isnan(l[rr]);
        const float inv = seen ? 1.f / l[rr] : 0.f;
        const float lse_r = seen ? m[rr] + std::log(l[rr]) : kNinf;
        const float* orow = o.data() + rr * Dv;
        const int64_t row = (b * a.H + h) * a.L + i;
        if (ns == 1) {
          TQ* op = static_cast<TQ*>(a.out) + b * a.os[0] + h * a.os[1] + i * a.os[2];
          for (int64_t d = 0; d < Dv; ++d) op[d] = static_cast<TQ>(orow[d] * inv);
          a.lse[row] = lse_r;
        } else {
          const int64_t rows = a.B * a.H * a.L;
          float* pp = a.part_out + (s * rows + row) * Dv;
          for (int64_t d = 0; d < Dv; ++d) pp[d] = orow[d] * inv;
          a.part_lse[s * rows + row] = lse_r;
        }
      }
    }
  });
  if (ns == 1) return;
  // Note [Decode schedule]: the n-ary form of Note [Merging by log-sum-exp]
  const int64_t rows = a.B * a.H * a.L;
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> acc(Dv), w(ns);
    for (int64_t row = r0; row < r1; ++row) {
      float mx = kNinf;
      for (int64_t s = 0; s < ns; ++s) mx = std::max(mx, a.part_lse[s * rows + row]);
      const int64_t i = row % a.L, h = (row / a.L) % a.H, b = row / (a.L * a.H);
      TQ* op = static_cast<TQ*>(a.out) + b * a.os[0] + h * a.os[1] + i * a.os[2];
      if (mx == kNinf) {
        for (int64_t d = 0; d < Dv; ++d) op[d] = static_cast<TQ>(0.f);
        a.lse[row] = kNinf;
        continue;
      }
      float tot = 0.f;
      for (int64_t s = 0; s < ns; ++s) tot += (w[s] = std::exp(a.part_lse[s * rows + row] - mx));
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t s = 0; s < ns; ++s) {
        if (w[s] == 0.f) continue;  // a split that saw no key (its lse -inf) weighs exactly 0
        const float ws = w[s] / tot;
        const float* pp = a.part_out + (s * rows + row) * Dv;
        for (int64_t d = 0; d < Dv; ++d) acc[d] += ws * pp[d];
      }
      for (int64_t d = 0; d < Dv; ++d) op[d] = static_cast<TQ>(acc[d]);
      a.lse[row] = mx + std::log(tot);
    }
  });
}

std::vector<at::Tensor> decode_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                                       const at::Tensor& block_table, const std::optional<at::Tensor>& seqlens,
                                       int64_t seqlen_all, const std::optional<at::Tensor>& mask_off,
                                       int64_t mask_off_all, int64_t left, int64_t right,
                                       const std::optional<at::Tensor>& keep, const std::optional<at::Tensor>& bias,
                                       const std::optional<at::Tensor>& alibi,
                                       const std::optional<at::Tensor>& alibi_off, double scale, double softcap,
                                       int64_t num_splits, int64_t head_span, bool keep_partials,
                                       const std::optional<at::Tensor>& k_scale,
                                       const std::optional<at::Tensor>& v_scale, bool blhd) {
  for (const at::Tensor* t : {&q, &k, &v, const_cast<const at::Tensor*>(&out)}) {
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 4 && t->stride(3) == 1,
                "attnlab._decode: q, k, v, out must be 4-D CPU tensors with a contiguous last dim");
  }
  const auto dt = q.scalar_type();
  const bool int8 = k.scalar_type() == at::kChar;
  TORCH_CHECK(out.scalar_type() == dt && k.scalar_type() == v.scalar_type() && (int8 || k.scalar_type() == dt),
              "attnlab._decode: q and out must share one dtype, k and v q's or int8; got q ", dt, ", k ",
              k.scalar_type(), ", v ", v.scalar_type(), ", out ", out.scalar_type());
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "attnlab._decode: float32, bfloat16 or float16 only, got ", dt);
  TORCH_CHECK(int8 == (k_scale && k_scale->defined()) && int8 == (v_scale && v_scale->defined()),
              "attnlab._decode: k_scale and v_scale go with an int8 cache, and only with one");
  Args a;
  // q and out [B, H, L, D], or with blhd [B, L, H, D] (flash-attn's layout, read through its strides: no view
  // to make per call, Note [Decode call overhead])
  const int dh = blhd ? 2 : 1, dl = blhd ? 1 : 2;
  a.B = q.size(0); a.H = q.size(dh); a.L = q.size(dl); a.D = q.size(3);
  a.T = k.size(1); a.Hkv = k.size(2); a.Dv = v.size(3);
  TORCH_CHECK(k.size(3) == a.D && v.size(0) == k.size(0) && v.size(1) == a.T && v.size(2) == a.Hkv && a.Hkv > 0 &&
              a.H % a.Hkv == 0 && out.size(0) == a.B && out.size(dh) == a.H && out.size(dl) == a.L &&
              out.size(3) == a.Dv,
              "attnlab._decode: shapes q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes(), ", out ", out.sizes(),
              " do not agree");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.is_contiguous() && block_table.dim() == 2 &&
              block_table.size(0) == a.B, "attnlab._decode: block_table must be contiguous int32 [B, pages]");
  // Note [Decode call overhead]: one length (and offset) for every sequence comes as an int, not a tensor
  // (a tensor each a call is one more allocation: tens of microseconds once the caches are cold)
  std::vector<int64_t> one_len, one_off;
  for (auto [t, all, vec, ptr] : {std::tuple{&seqlens, seqlen_all, &one_len, &a.seqlens},
                                  std::tuple{&mask_off, mask_off_all, &one_off, &a.mask_off}}) {
    if (*t && (*t)->defined()) {
      TORCH_CHECK((*t)->scalar_type() == at::kLong && (*t)->is_contiguous() && (*t)->dim() == 1 &&
                  (*t)->size(0) == a.B, "attnlab._decode: seqlens / mask_off must be contiguous int64 [B]");
      *ptr = (*t)->data_ptr<int64_t>();
    } else {
      vec->assign(std::max<int64_t>(a.B, 1), all);
      *ptr = vec->data();
    }
  }
  a.maxp = block_table.size(1);
  a.table = block_table.data_ptr<int32_t>();
  // every page a visible key can reach is checked here, so the kernel can trust the table
  const int64_t P = k.size(0);
  for (int64_t b = 0; b < a.B; ++b) {
    TORCH_CHECK(a.seqlens[b] >= 0 && a.seqlens[b] <= a.maxp * a.T, "attnlab._decode: seqlens[", b, "] = ",
                a.seqlens[b], " exceeds the sequence's capacity ", a.maxp * a.T);
    for (int64_t p = 0; p * a.T < a.seqlens[b]; ++p) {
      const int32_t page = a.table[b * a.maxp + p];
      TORCH_CHECK(page >= 0 && page < P, "attnlab._decode: block_table[", b, ", ", p, "] = ", page,
                  " is outside the pool of ", P, " pages");
    }
  }
  if (int8) {
    for (auto [sc, name, Dx, ng] : {std::tuple{&*k_scale, "k_scale", a.D, &a.kng},
                                    std::tuple{&*v_scale, "v_scale", a.Dv, &a.vng}}) {
      TORCH_CHECK(sc->scalar_type() == at::kFloat && (sc->dim() == 3 || sc->dim() == 4) && sc->size(0) == k.size(0) &&
                  sc->size(1) == a.T && sc->size(2) == a.Hkv, "attnlab._decode: ", name, " must be float32 "
                  "[P, T, Hkv] = ", k.sizes().slice(0, 3), " or [P, T, Hkv, groups], got ", sc->sizes(), " ",
                  sc->scalar_type());
      *ng = sc->dim() == 4 ? sc->size(3) : 1;  // Note [Decode int8 groups]
      TORCH_CHECK(*ng >= 1 && Dx % *ng == 0 && (*ng == 1 || ((Dx / *ng) % 32 == 0 && sc->stride(3) == 1)),
                  "attnlab._decode: ", name, " ", sc->sizes(), " has ", *ng, " groups per row of ", Dx,
                  " channels: a group size must divide it, be a multiple of 32, and the groups be contiguous");
    }
    a.ksc = k_scale->data_ptr<float>();
    a.vsc = v_scale->data_ptr<float>();
    for (int d = 0; d < 3; ++d) { a.kss[d] = k_scale->stride(d); a.vss[d] = v_scale->stride(d); }
  }
  a.left = left; a.right = right;
  a.q = q.data_ptr(); a.k = k.data_ptr(); a.v = v.data_ptr(); a.out = out.data_ptr();
  for (int d = 0; d < 4; ++d) {
    const int e = d == 1 ? dh : d == 2 ? dl : d;
    a.qs[d] = q.stride(e);
    a.os[d] = out.stride(e);
  }
  for (int d = 0; d < 3; ++d) { a.ks[d] = k.stride(d); a.vs[d] = v.stride(d); }
  if (keep && keep->defined()) {
    TORCH_CHECK((keep->scalar_type() == at::kByte || keep->scalar_type() == at::kBool) && keep->dim() == 4 &&
                keep->size(0) == a.B && keep->size(1) == a.H && keep->size(2) == a.L && keep->size(3) >= 1,
                "attnlab._decode: keep must be bool [B, H, L, S'], got ", keep->sizes());
    a.keep = static_cast<const uint8_t*>(keep->data_ptr());
    for (int d = 0; d < 4; ++d) a.kps[d] = keep->stride(d);
    for (int64_t b = 0; b < a.B; ++b)
      TORCH_CHECK(a.seqlens[b] <= keep->size(3), "attnlab._decode: keep covers ", keep->size(3), " keys, seqlens[",
                  b, "] = ", a.seqlens[b]);
  }
  if (bias && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 4 && bias->size(0) == a.B &&
                bias->size(1) == a.H && bias->size(2) == a.L, "attnlab._decode: bias must be float32 [B, H, L, S'], got ",
                bias->sizes());
    a.bias = bias->data_ptr<float>();
    for (int d = 0; d < 4; ++d) a.bs[d] = bias->stride(d);
    for (int64_t b = 0; b < a.B; ++b)
      TORCH_CHECK(a.seqlens[b] <= bias->size(3), "attnlab._decode: bias covers ", bias->size(3), " keys, seqlens[",
                  b, "] = ", a.seqlens[b]);
  }
  if (alibi && alibi->defined()) {
    TORCH_CHECK(alibi->scalar_type() == at::kFloat && alibi->dim() == 2 && alibi->size(0) == a.B &&
                alibi->size(1) == a.H, "attnlab._decode: alibi slopes must be float32 [B, H]");
    TORCH_CHECK(alibi_off && alibi_off->defined() && alibi_off->scalar_type() == at::kLong &&
                alibi_off->is_contiguous() && alibi_off->numel() == a.B, "attnlab._decode: alibi_off must be int64 [B]");
    a.alibi = alibi->data_ptr<float>();
    a.as[0] = alibi->stride(0); a.as[1] = alibi->stride(1);
    a.alibi_off = alibi_off->data_ptr<int64_t>();
  }
  a.scale = static_cast<float>(scale);
  a.softcap = static_cast<float>(softcap);
  a.prefetch = g_prefetch_mode.load(std::memory_order_relaxed);
  a.bf16_dot = kHasBf16Dot && g_bf16_dot.load(std::memory_order_relaxed);
  a.vnni = kHasVnni && g_vnni.load(std::memory_order_relaxed);
  a.int_pv = kHasIntPv && g_int_pv.load(std::memory_order_relaxed);
  a.int_cols = kHasIntPv && g_int_cols.load(std::memory_order_relaxed);
  TORCH_CHECK(num_splits >= 1, "attnlab._decode: num_splits must be >= 1");
  a.ns = num_splits;
  TORCH_CHECK(head_span >= 1 && a.Hkv % head_span == 0, "attnlab._decode: head_span must divide Hkv = ", a.Hkv);
  a.hs = head_span;
  at::Tensor lse = at::empty({a.B, a.H, a.L}, q.options().dtype(at::kFloat));
  a.lse = lse.data_ptr<float>();
  at::Tensor part_out, part_lse;
  if (a.ns > 1) {
    part_out = at::empty({a.ns, a.B, a.H, a.L, a.Dv}, q.options().dtype(at::kFloat));
    part_lse = at::empty({a.ns, a.B, a.H, a.L}, q.options().dtype(at::kFloat));
    a.part_out = part_out.data_ptr<float>();
    a.part_lse = part_lse.data_ptr<float>();
  }
  if (a.B * a.H * a.L > 0) {
    if (int8) {
      if (dt == at::kFloat) decode_impl<float, int8_t>(a);
      else if (dt == at::kBFloat16) decode_impl<at::BFloat16, int8_t>(a);
      else decode_impl<at::Half, int8_t>(a);
    } else if (dt == at::kFloat) decode_impl<float, float>(a);
    else if (dt == at::kBFloat16) decode_impl<at::BFloat16, at::BFloat16>(a);
    else decode_impl<at::Half, at::Half>(a);
  }
  if (!keep_partials) return {lse};
  return {lse, part_out, part_lse};
}

// Note [One-call decode step]: the plain step of a decode loop (one int cache length, the new k, v appended at it,
// a contiguous or paged floating cache, causal or not, no window, softcap, ALiBi, rotary or lse) in one call:
// checks, append and kernel here, where attention_with_kvcache's Python took some twenty tensor attribute
// reads, a torch.empty and a slice copy per call, each one slow once a step's other work has evicted the
// caches (measured after the bench's 1 GiB flush: the wrapper's Python 95 us over the kernel call's 81 us at
// S = 64, and the API's checks about 100 us more). It returns None for anything else, and for any input it
// would reject, before writing anything: attention_with_kvcache then takes its full path, which gives the
// error naming the argument (or runs the call it has more paths for). Every page the read reaches is
// checked before the append, so a bad table never leaves a half-done step. The result is the kernel's with
// the arguments the full path passes it (the same splits and head span: kernels/decode.py num_splits).
// The step always runs the decode kernel, also where the full path sends multi-head fp32 to SDPA (Note
// [Plain decode on SDPA here]: that rule was fitted to the full path's overhead): MHA 8 x 64 fp32, 2 threads,
// interleaved, per call hot / after the bench's 1 GiB flush, the step's kernel against the same step running
// SDPA on views of the cache (a variant tried: checks and append here, then at::scaled_dot_product_attention)
// and SDPA called direct: S = 512 32 / 246 us vs 38 / 377 vs 30 / 204; S = 1024 64 / 281 vs 72 / 397 vs
// 65 / 258; S = 2048 146 / 451 vs 149 / 573 vs 138 / 446; S = 4096 216 / 658 vs 210 / 696 vs 251 / 727; beside
// a CPU-bound process, hot, S = 512 39 vs 52 vs 39 us, S = 4096 377 vs 420 vs 525.
//
// Note [One-call step lengths]: a batch whose sequences hold different lengths (``cache_seqlens`` an integer
// tensor [B], int32 or int64: vLLM's and flash-attn's usual call) takes the same one call, ``lens_in`` giving
// each sequence's start: the full path's Python (checks, two index_put appends, the plan) cost 60-90 us over
// the kernel at S = 512 once the kernel had evicted the caches. Other dtypes, a negative length or an overflow
// return None, as above.
//
// Note [SDPA steps]: where the planner's plain-decode rule gives a plain step to SDPA (a heads-first cache,
// kernels/planner.py Note [Plain MHA decode]), the step's checks and append run here (``attend`` false: an empty
// tensor says they passed) and SDPA attends on views of the cache. The full path's Python in front of SDPA cost
// bench decode's cold-cache MHA calls 1.5-1.7x SDPA's time at S 4,096 (B 1, H 8, D 64).
std::optional<at::Tensor> decode_step(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                                      const std::optional<at::Tensor>& kn, const std::optional<at::Tensor>& vn,
                                      int64_t n0, const std::optional<at::Tensor>& table_in, bool causal,
                                      double scale, int64_t forced_splits, int64_t units_per_thread,
                                      int64_t min_split_keys, int64_t max_queries, int64_t unbounded,
                                      const std::optional<at::Tensor>& lens_in, bool attend) {
  const bool has_new = kn && kn->defined();
  if (has_new != (vn && vn->defined())) return std::nullopt;
  const auto dt = q.scalar_type();
  if (dt != at::kFloat && dt != at::kBFloat16 && dt != at::kHalf) return std::nullopt;
  const bool grad = at::GradMode::is_enabled();
  for (const at::Tensor* t : {&q, &kc, &vc, has_new ? &*kn : &q, has_new ? &*vn : &q}) {
    if (!t->device().is_cpu() || t->dim() != 4 || t->scalar_type() != dt || t->stride(3) != 1 ||
        (grad && t->requires_grad()))
      return std::nullopt;
  }
  const int64_t B = q.size(0), L = q.size(1), H = q.size(2), D = q.size(3);
  const int64_t P = kc.size(0), T = kc.size(1), Hkv = kc.size(2), Dv = vc.size(3);
  if (B < 1 || L < 1 || L > max_queries || Hkv < 1 || H % Hkv || kc.size(3) != D || vc.size(0) != P ||
      vc.size(1) != T || vc.size(2) != Hkv || n0 < 0)
    return std::nullopt;
  const int64_t Lnew = has_new ? kn->size(1) : 0;
  if (has_new && (kn->size(0) != B || kn->size(2) != Hkv || kn->size(3) != D || vn->size(0) != B ||
                  vn->size(1) != Lnew || vn->size(2) != Hkv || vn->size(3) != Dv))
    return std::nullopt;
  at::Tensor table;
  if (table_in && table_in->defined()) {
    table = *table_in;
    if (table.scalar_type() != at::kInt || !table.is_contiguous() || table.dim() != 2 || table.size(0) != B ||
        !table.device().is_cpu())
      return std::nullopt;
  } else {
    if (P != B) return std::nullopt;
    static thread_local std::vector<at::Tensor> tables;  // [[0], [1], ...] per batch size (read only)
    if (B < 256) {
      if (static_cast<int64_t>(tables.size()) <= B) tables.resize(B + 1);
      if (!tables[B].defined()) tables[B] = at::arange(B, at::TensorOptions().dtype(at::kInt)).view({B, 1});
      table = tables[B];
    } else {
      table = at::arange(B, at::TensorOptions().dtype(at::kInt)).view({B, 1});
    }
  }
  // sequence b's keys before the append: n0 for every sequence, or lens_in[b] (int32 or int64 [B]: Note
  // [One-call step lengths])
  const bool per_seq = lens_in && lens_in->defined();
  std::vector<int64_t> start(B, n0);
  if (per_seq) {
    const at::Tensor& l = *lens_in;
    if (!l.device().is_cpu() || l.dim() != 1 || l.size(0) != B ||
        (l.scalar_type() != at::kInt && l.scalar_type() != at::kLong))
      return std::nullopt;
    const at::Tensor l64 = l.to(at::kLong).contiguous();
    const int64_t* lp = l64.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) start[b] = lp[b];
  }
  const int64_t maxp = table.size(1);
  int64_t n = 0;  // the most keys a sequence sees after the append
  for (int64_t b = 0; b < B; ++b) {
    if (start[b] < 0 || start[b] + Lnew > maxp * T) return std::nullopt;  // the full path names the error
    n = std::max(n, start[b] + Lnew);
  }
  const int32_t* tab = table.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b)  // every page the read reaches (the append's among them)
    for (int64_t p = 0; p * T < start[b] + Lnew; ++p)
      if (tab[b * maxp + p] < 0 || tab[b * maxp + p] >= P) return std::nullopt;
  if (has_new) {  // row (b, i, g) of the new k, v -> token start[b] + i of sequence b, in place
    const int64_t es = q.element_size();
    for (auto [src, dst, w] : {std::tuple{&*kn, &kc, D}, std::tuple{&*vn, &vc, Dv}}) {
      const char* s0 = static_cast<const char*>(src->data_ptr());
      char* d0 = static_cast<char*>(dst->data_ptr());
      for (int64_t b = 0; b < B; ++b)
        for (int64_t i = 0; i < Lnew; ++i) {
          const int64_t t = start[b] + i, page = tab[b * maxp + t / T], off = t % T;
          for (int64_t g = 0; g < Hkv; ++g)
            std::memcpy(d0 + (page * dst->stride(0) + off * dst->stride(1) + g * dst->stride(2)) * es,
                        s0 + (b * src->stride(0) + i * src->stride(1) + g * src->stride(2)) * es, w * es);
        }
    }
  }
  if (!attend) return at::empty({0}, q.options());  // checked and appended: SDPA attends (Note [SDPA steps])
  // the head span and split count of kernels/decode.py (head_span, num_splits)
  const int64_t hs = Hkv > 1 && T > 1 && std::abs(kc.stride(2)) < std::abs(kc.stride(1)) ? Hkv : 1;
  int64_t ns = forced_splits;
  if (ns <= 0) {
    const int64_t threads = at::get_num_threads(), want = units_per_thread * threads;
    const int64_t pairs = std::max<int64_t>(1, B * (Hkv / hs)), top = std::max<int64_t>(1, n / min_split_keys);
    ns = pairs >= want ? 1 : std::max<int64_t>(1, std::min<int64_t>((want + pairs - 1) / pairs, top));
    // kernels/decode.py balanced_splits (Note [Decode balanced units]), unbalanced = 0.05
    const int64_t units = pairs * ns, rounds = (units + threads - 1) / threads;
    if (threads > 1 && units % threads != 0 && static_cast<double>(rounds * threads) > units * 1.05)
      for (int64_t c = ns + 1; c <= std::min(top, 2 * ns); ++c)
        if ((pairs * c) % threads == 0) {
          ns = c;
          break;
        }
  }
  at::Tensor out = at::empty({B, L, H, Dv}, q.options());
  if (!per_seq) {
    decode_forward(q, kc, vc, out, table, std::nullopt, n, std::nullopt, n - L, unbounded, causal ? 0 : unbounded,
                   std::nullopt, std::nullopt, std::nullopt, std::nullopt, scale, 0.0, ns, hs, false, std::nullopt,
                   std::nullopt, true);
    return out;
  }
  // the lengths after the append, and each sequence's query offset (bottom-right: seqlens[b] - L), as the
  // full path passes them (kernels/decode.py decode_attention)
  at::Tensor seqlens = at::empty({B}, at::TensorOptions().dtype(at::kLong));
  at::Tensor moff = at::empty({B}, at::TensorOptions().dtype(at::kLong));
  int64_t* sp = seqlens.data_ptr<int64_t>();
  int64_t* mp = moff.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    sp[b] = start[b] + Lnew;
    mp[b] = sp[b] - L;
  }
  decode_forward(q, kc, vc, out, table, seqlens, 0, moff, 0, unbounded, causal ? 0 : unbounded, std::nullopt,
                 std::nullopt, std::nullopt, std::nullopt, scale, 0.0, ns, hs, false, std::nullopt, std::nullopt, true);
  return out;
}

// Note [int8 scale search]: an int8 row (or group of gs channels) stores round(x / s) with one scale s. The
// plain choice, s = max|x| / 127, spends the grid's top code on the largest element, but the rounding error of
// the others depends on where their values fall between codes, which changes with s. quantize_rows tries
// s = max|x| / m for m = 127, 126, ..., 128 - candidates (every m <= 127, so no element is ever clipped and each
// is still off by at most s / 2) and keeps the first with the least squared error sum_i (x_i - s round(x_i /
// s))^2 (ggml's make_qx_quants searches its k-quants' scales the same way). m = 127 comes first, so the result
// is never worse than the plain scale, and equal to it where that is best. Measured on Gaussian groups of 32
// (200,000 groups, float64, against llama.cpp q8_0's amax / 127 with a float16 scale): the element error's L2
// norm 0.9998x q8_0's for the plain scale; 0.904x with 8 candidates, 0.894x with 16 (the default,
// kvquant.SCALE_CANDIDATES), 0.887x with 32 at steps of 1/4. It costs ``candidates`` divisions, roundings and
// squared errors per element, once, on append.
//
// With ``hadamard`` = n (a power of 2 dividing D) each row is first rotated by the normalised Walsh-Hadamard
// transform on blocks of n channels (Note [int8 key rotation] in functional/kvquant.py): the butterflies of
// Sylvester's H_2n [a; b] = [H_n (a + b); H_n (a - b)] from the widest level down, then the factor n^-1/2 in
// float32, the same operations in the same order as kvquant._rotate's elementwise transform.
//
// A group holding inf or NaN gets a NaN scale (its data 0), which the caller turns into an error before any
// row is written (Note [Checked, then appended] in functional/kvcache.py).
void quantize_group(const float* y, int64_t n, int8_t* q8, float* sc, int64_t candidates, float* buf) {
  float amax = 0.f, chk = 0.f;  // chk = sum x * 0: NaN where any x is inf or NaN
  {
    Vf am(0.f), ck(0.f);
    int64_t i = 0;
    for (; i + W <= n; i += W) {
      const Vf x = Vf::loadu(y + i);
      am = at::vec::maximum(am, x.abs());
      ck = ck + x * Vf(0.f);
    }
    amax = hmax(am);
    chk = hsum(ck);
    for (; i < n; ++i) {
      amax = std::max(amax, std::fabs(y[i]));
      chk += y[i] * 0.f;
    }
  }
  const bool finite = std::isfinite(amax) && chk == 0.f;
  if (!finite || amax == 0.f) {
    std::memset(q8, 0, static_cast<size_t>(n));
    *sc = finite ? 0.f : std::numeric_limits<float>::quiet_NaN();
    return;
  }
  // Each candidate's error is summed in units of its own step, sum_i (x_i / s - q_i)^2, and compared divided by m^2
  // (the same order as the squared error over max|x|^2): it cannot underflow where x does not (the squared error
  // of a row of 1e-30s would be 0 in float32 for every candidate). x / s is taken as x times the reciprocal (a
  // multiply, where a division costs a vector divider's throughput per candidate): it can round differently
  // only within an ulp of a half-way point, where either code is off by the same half step. m = 127 is taken
  // first whatever its error (a scale whose reciprocal overflows gives an infinite error to every candidate).
  float best_s = 0.f, best_err = 0.f;
  for (int64_t j = 0; j < candidates; ++j) {
    const float mj = static_cast<float>(127 - j);
    const float s = amax / mj;
    const float inv = s > 0.f ? 1.f / s : 0.f;  // a scale that underflows to 0 stores 0s (as kvquant's torch path)
    const Vf vi(inv), lo(-127.f), hi(127.f);
    Vf acc(0.f);
    int64_t i = 0;
    for (; i + W <= n; i += W) {
      const Vf u = Vf::loadu(y + i) * vi;
      const Vf e = u - at::vec::clamp(u.round(), lo, hi);
      acc = at::vec::fmadd(e, e, acc);
    }
    float err = hsum(acc);
    for (; i < n; ++i) {
      const float u = y[i] * inv;
      const float e = u - std::min(127.f, std::max(-127.f, std::nearbyint(u)));
      err += e * e;
    }
    err /= mj * mj;
    if (j == 0 || err < best_err) {
      best_err = err;
      best_s = s;
    }
  }
  const float div = best_s > 0.f ? best_s : 1.f;
  const Vf vd(div), lo(-127.f), hi(127.f);
  int64_t i = 0;
  for (; i + W <= n; i += W) at::vec::clamp((Vf::loadu(y + i) / vd).round(), lo, hi).store(buf + i);
  for (; i < n; ++i) buf[i] = std::min(127.f, std::max(-127.f, std::nearbyint(y[i] / div)));
  for (i = 0; i < n; ++i) q8[i] = static_cast<int8_t>(buf[i]);
  *sc = best_s;
}

// x float32 [N, D] (contiguous) -> [data int8 [N, D], scale float32 [N, groups]] (Note [int8 scale search])
std::vector<at::Tensor> quantize_rows(const at::Tensor& x, int64_t groups, int64_t hadamard, int64_t candidates) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "attnlab._decode.quantize: x must be a contiguous float32 CPU tensor [N, D], got ", x.sizes(), " ",
              x.scalar_type());
  const int64_t N = x.size(0), D = x.size(1);
  TORCH_CHECK(groups >= 1 && D % groups == 0, "attnlab._decode.quantize: groups must divide D = ", D, ", got ", groups);
  TORCH_CHECK(hadamard == 0 || (hadamard > 1 && (hadamard & (hadamard - 1)) == 0 && D % hadamard == 0),
              "attnlab._decode.quantize: hadamard must be 0 or a power of 2 dividing D = ", D, ", got ", hadamard);
  TORCH_CHECK(candidates >= 1 && candidates <= 127, "attnlab._decode.quantize: candidates must be in 1..127, got ",
              candidates);
  at::Tensor data = at::empty({N, D}, x.options().dtype(at::kChar));
  at::Tensor scale = at::empty({N, groups}, x.options());
  const float* X = x.data_ptr<float>();
  int8_t* Q = data.data_ptr<int8_t>();
  float* S = scale.data_ptr<float>();
  const int64_t gs = D / groups;
  const float norm = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hadamard > 0 ? hadamard : 1)));
  at::parallel_for(0, N, std::max<int64_t>(1, 4096 / std::max<int64_t>(1, D * candidates / 16)),
                   [&](int64_t r0, int64_t r1) {
    std::vector<float> y(static_cast<size_t>(std::max<int64_t>(D, 1))), buf(static_cast<size_t>(std::max<int64_t>(gs, 1)));
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = X + r * D;
      if (hadamard > 0) {
        std::memcpy(y.data(), row, static_cast<size_t>(D) * sizeof(float));
        for (int64_t h = hadamard / 2; h >= 1; h /= 2)
          for (int64_t o = 0; o < D; o += 2 * h)
            for (int64_t i = 0; i < h; ++i) {
              const float a = y[o + i], b = y[o + h + i];
              y[o + i] = a + b;
              y[o + h + i] = a - b;
            }
        for (int64_t i = 0; i < D; ++i) y[i] *= norm;
        row = y.data();
      }
      for (int64_t g = 0; g < groups; ++g)
        quantize_group(row + g * gs, gs, Q + r * D + g * gs, S + r * groups + g, candidates, buf.data());
    }
  });
  return {data, scale};
}

}  // namespace


PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "attnlab's decode kernel: a few queries against a (paged) KV cache, keys split across threads";
  m.def("forward", &decode_forward,
        "writes out in place; returns [lse] (float32 [B, H, L]), with keep_partials also the per-split "
        "outputs [ns, B, H, L, Dv] and lse [ns, B, H, L] (None for one split)");
  m.def("step", &decode_step,
        "the plain decode step in one call (Note [One-call decode step]): out [B, L, H, Dv], or None where the "
        "full path must run");
  m.def("set_prefetch", [](int64_t mode) {
    TORCH_CHECK(mode >= 0 && mode <= 2, "attnlab._decode: prefetch mode must be 0 (none), 1 (L1) or 2 (L2), got ", mode);
    g_prefetch_mode.store(static_cast<int>(mode), std::memory_order_relaxed);
  }, "0: no software prefetch, 1: into L1, 2: into L2 (Note [Decode prefetch level])");
  m.def("set_bf16_dot", [](bool on) { g_bf16_dot.store(on, std::memory_order_relaxed); },
        "a bf16 cache's scores on VDPBF16PS where the CPU has avx512_bf16 (Note [Decode bf16 scores])");
  m.def("bf16_dot", [] { return kHasBf16Dot && g_bf16_dot.load(std::memory_order_relaxed); },
        "whether a bf16 cache's scores run on VDPBF16PS: the CPU has avx512_bf16 and set_bf16_dot left it on");
  m.def("set_vnni", [](bool on) { g_vnni.store(on, std::memory_order_relaxed); },
        "an int8 cache's integer dot products on vpdpwssd where the CPU has avx512_vnni");
  m.def("vnni", [] { return kHasVnni && g_vnni.load(std::memory_order_relaxed); },
        "whether an int8 cache's integer dot products run on vpdpwssd: the CPU has avx512_vnni and set_vnni left it on");
  m.def("set_int_pv", [](bool on) { g_int_pv.store(on, std::memory_order_relaxed); },
        "an int8 cache's P @ V on integers in the AVX-512 build (Note [Decode int8 P @ V])");
  m.def("int_pv", [] { return kHasIntPv && g_int_pv.load(std::memory_order_relaxed); },
        "whether an int8 cache's P @ V runs on integers: an AVX-512 build and set_int_pv left it on");
  m.def("set_int_cols", [](bool on) { g_int_cols.store(on, std::memory_order_relaxed); },
        "an int8 cache's scores on key columns (AVX-512 builds, D a multiple of 64)");
  m.def("int_cols", [] { return kHasIntPv && g_int_cols.load(std::memory_order_relaxed); },
        "whether an int8 cache's scores run on key columns: an AVX-512 build and set_int_cols left it on");
  m.def("prefetch", [] { return static_cast<int64_t>(g_prefetch_mode.load(std::memory_order_relaxed)); });
  m.def("quantize", &quantize_rows,
        "x float32 [N, D] -> [int8 data [N, D], float32 scale [N, groups]], each group's scale searched (Note [int8 "
        "scale search]), rows first rotated by the Walsh-Hadamard transform on blocks of `hadamard` channels (0: none)");
  ATTNLAB_MODULE_ATTRS(m, 12);
}
