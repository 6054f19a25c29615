// specc_cpu::dense_matvec: a few float32 rows times a float32 or int8 [N, K] weight, on CPU
// (kernels/cpu_kernels.py builds it for the machine it runs on); the body of specc::rows_linear
// (rows_linear.py) on CPU.
//
// Why by hand: Inductor's reduction over the weight (the `matvec` pass's form) streams it at the
// memory's speed for one or two rows, but its loop does not prefetch, so once more rows of
// multiply-adds slow each weight line down it waits on memory instead of overlapping with it
// (SmolLM2's decode-step products, examples/bench_products.py: 24.9 ms at 8 rows where one row takes
// 11.5; this product 15.6). Here each tile of up to 8 input rows times 4 weight rows (2 beyond 4
// input rows: at most 16 accumulators) stays in registers and the weight is prefetched 8 KB ahead of
// the lines it reads (from 2 rows for float32: at one the hardware's prefetch keeps up, and a
// throwaway build of both measured 12.7 without against 13.3 ms with). An int8 weight (--quant int8:
// its per-row scale is applied after the product, in the graph) is widened to float in registers, a
// quarter of the bytes for the same multiply-adds.
//
// AVX2 machines (no AVX-512) get the same tiles in 8-lane registers, shaped for their 16 registers
// (4 weight rows up to 2 input rows, 2 up to 4, 1 beyond); other CPUs a portable loop.
//
// Every output is summed in the order of Inductor's reduction loop over the same weight (the `matvec`
// pass's other form, rows_linear_reference): lane l of one vector (16 on AVX-512, 8 on AVX2) adds
// w[k] * x[k] for k = l, l + LANES, ... by a fused multiply-add (Inductor's `acc + w * x` contracts to
// one: specc compiles its graphs with floating-point contraction on, backends.INDUCTOR_CONFIGS), a last
// partial vector adds to its own lanes only, and the lanes are summed by at::vec's tree (i + i^8,
// i + i^4, i + i^2, i + i^1), then added to 0. So a row's bits do not depend on how many rows share the
// call, nor on which of the two products computes it (tests/test_row_invariance.py compares them bit
// for bit): a T-row verify gives each row what the 1-row plain step gives (dense_lanes() tells
// rows_linear.py the width, checked against Inductor's).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define SPECC_SIMD 1
#endif

namespace {

constexpr int64_t PREFETCH_BYTES = 8192;  // ahead of each weight row's read (a throwaway sweep: 4-16 KB alike)
constexpr int64_t MAX_R = 8;              // input rows per tile: 8 x 2 accumulators leave registers to spare
constexpr int64_t BLOCK_N = 32;           // weight rows per block: its lines stay in L1/L2 across row groups

// The vector the tiles compute in: what one register holds, its loads (int8 widened to float), fma, sum.
#if defined(__AVX512F__)
using Vec = __m512;
constexpr int64_t LANES = 16;
// steps of k between prefetches of a weight row: every step, as measured (int8 prefetches a line 4 times)
constexpr int64_t prefetch_every(int64_t) { return 1; }
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vload(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// c + a * b, rounded once (Inductor's `acc + w * x`, contracted)
inline Vec vmuladd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
// the same in the first n lanes only, c in the others (Inductor's sum_masked_reduce of a last partial vector)
inline Vec vmuladd_first(Vec a, Vec b, Vec c, int64_t n) {
  return _mm512_mask3_fmadd_ps(a, b, c, static_cast<__mmask16>((1u << n) - 1));
}
// at::vec::vec_reduce_all's tree for 16 lanes
inline float vsum(Vec v) {
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xB1));
  v = _mm512_add_ps(v, _mm512_shuffle_ps(v, v, 0x4E));
  v = _mm512_add_ps(v, _mm512_shuffle_ps(v, v, 0xB1));
  return _mm512_cvtss_f32(v);
}
#elif defined(SPECC_SIMD)  // AVX2 + FMA
using Vec = __m256;
constexpr int64_t LANES = 8;
// once per 64-byte line: two steps of float weights, eight of int8
constexpr int64_t prefetch_every(int64_t weight_bytes) { return 64 / (LANES * weight_bytes); }
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vload(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline Vec vmuladd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vmuladd_first(Vec a, Vec b, Vec c, int64_t n) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lane));
  return _mm256_blendv_ps(c, _mm256_fmadd_ps(a, b, c), keep);
}
// at::vec::vec_reduce_all's tree for 8 lanes
inline float vsum(Vec v) {
  v = _mm256_add_ps(v, _mm256_permute2f128_ps(v, v, 0x1));
  v = _mm256_add_ps(v, _mm256_shuffle_ps(v, v, 0x4E));
  v = _mm256_add_ps(v, _mm256_shuffle_ps(v, v, 0xB1));
  return _mm256_cvtss_f32(v);
}
#else
constexpr int64_t LANES = 16;
#endif

#if defined(SPECC_SIMD)
// The last n < LANES values, zeros after them (zeros add nothing).
template <typename W>
inline Vec vload_tail(const W* p, int64_t n) {
  W buf[LANES] = {};
  std::memcpy(buf, p, n * sizeof(W));
  return vload(buf);
}
#endif

// out[r * N + j] = sum_k x[r * K + k] * w[j * K + k] for R input rows and NB weight rows.
template <int R, int NB, typename W>
inline void tile(const float* x, int64_t K, const W* w, float* out, int64_t N) {
  constexpr int64_t PREFETCH = PREFETCH_BYTES / sizeof(W);
#if defined(SPECC_SIMD)
  constexpr int64_t EVERY = prefetch_every(sizeof(W));
  Vec acc[NB][R];
  for (int j = 0; j < NB; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = vzero();
  int64_t k = 0;
  for (; k + LANES <= K; k += LANES) {
    Vec wv[NB];
    for (int j = 0; j < NB; ++j) {
      // One float row: the hardware prefetcher keeps up; int8 rows go by four times faster, it does not.
      if constexpr (R > 1 || sizeof(W) == 1)
        if (EVERY == 1 || (k / LANES) % EVERY == 0) __builtin_prefetch(w + j * K + k + PREFETCH);
      wv[j] = vload(w + j * K + k);
    }
    for (int r = 0; r < R; ++r) {
      const Vec xv = vload(x + r * K + k);
      for (int j = 0; j < NB; ++j) acc[j][r] = vmuladd(wv[j], xv, acc[j][r]);
    }
  }
  if (k < K) {
    Vec wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = vload_tail(w + j * K + k, K - k);
    for (int r = 0; r < R; ++r) {
      const Vec xv = vload_tail(x + r * K + k, K - k);
      for (int j = 0; j < NB; ++j) acc[j][r] = vmuladd_first(wv[j], xv, acc[j][r], K - k);
    }
  }
  for (int j = 0; j < NB; ++j)
    for (int r = 0; r < R; ++r) out[r * N + j] = 0.0f + vsum(acc[j][r]);
#else
  // Portable: 16 lanes in arrays the compiler vectorises.
  float acc[NB][R][LANES] = {};
  for (int64_t k0 = 0; k0 < K; k0 += LANES) {
    const int64_t n = std::min(LANES, K - k0);
    if constexpr (R > 1 || sizeof(W) == 1)
      for (int j = 0; j < NB; ++j) __builtin_prefetch(w + j * K + k0 + PREFETCH);
    for (int j = 0; j < NB; ++j)
      for (int r = 0; r < R; ++r)
        for (int64_t l = 0; l < n; ++l) acc[j][r][l] += static_cast<float>(w[j * K + k0 + l]) * x[r * K + k0 + l];
  }
  for (int j = 0; j < NB; ++j)
    for (int r = 0; r < R; ++r) {
      float s = 0.0f;
      for (int64_t l = 0; l < LANES; ++l) s += acc[j][r][l];
      out[r * N + j] = s;
    }
#endif
}

// How many weight rows a tile of R input rows takes at most: as many as keep the accumulators, the
// weight vectors and an input vector in registers (AVX-512: 32 of them; AVX2: 16).
template <int R>
constexpr int widest() {
#if defined(SPECC_SIMD) && !defined(__AVX512F__)
  return R <= 2 ? 4 : R <= 4 ? 2 : 1;
#else
  return R <= 4 ? 4 : 2;
#endif
}

// Weight rows n0..n1 for R input rows: tiles of widest<R>() weight rows, then pairs, then the odd one.
template <int R, typename W>
void rows(const float* x, int64_t K, const W* w, float* out, int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if constexpr (widest<R>() >= 4)
    for (; n + 4 <= n1; n += 4) tile<R, 4>(x, K, w + n * K, out + n, N);
  if constexpr (widest<R>() >= 2)
    for (; n + 2 <= n1; n += 2) tile<R, 2>(x, K, w + n * K, out + n, N);
  for (; n < n1; ++n) tile<R, 1>(x, K, w + n * K, out + n, N);
}

template <typename W>
void product(const float* xp, const W* wp, float* op, int64_t M, int64_t N, int64_t K) {
  at::parallel_for(0, N, 2 * BLOCK_N, [&](int64_t n0, int64_t n1) {
    for (int64_t b0 = n0; b0 < n1; b0 += BLOCK_N) {
      const int64_t b1 = std::min(n1, b0 + BLOCK_N);
      for (int64_t r0 = 0; r0 < M; r0 += MAX_R) {
        const float* xx = xp + r0 * K;
        float* oo = op + r0 * N;
        switch (std::min(MAX_R, M - r0)) {
          case 8: rows<8>(xx, K, wp, oo, N, b0, b1); break;
          case 7: rows<7>(xx, K, wp, oo, N, b0, b1); break;
          case 6: rows<6>(xx, K, wp, oo, N, b0, b1); break;
          case 5: rows<5>(xx, K, wp, oo, N, b0, b1); break;
          case 4: rows<4>(xx, K, wp, oo, N, b0, b1); break;
          case 3: rows<3>(xx, K, wp, oo, N, b0, b1); break;
          case 2: rows<2>(xx, K, wp, oo, N, b0, b1); break;
          default: rows<1>(xx, K, wp, oo, N, b0, b1);
        }
      }
    }
  });
}

at::Tensor dense_matvec(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && w.device().is_cpu() &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == at::kChar),
              "dense_matvec: x must be a float32 CPU tensor and w a float32 or int8 one");
  TORCH_CHECK(w.dim() == 2, "dense_matvec: w must be [N, K]");
  const int64_t K = x.size(-1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "dense_matvec: x has ", K, " inputs, the weight ", w.size(1));
  const at::Tensor xr = x.reshape({-1, K}).contiguous();
  const at::Tensor wc = w.contiguous();
  const int64_t M = xr.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  if (w.scalar_type() == at::kFloat)
    product(xr.data_ptr<float>(), wc.data_ptr<float>(), out.data_ptr<float>(), M, N, K);
  else
    product(xr.data_ptr<float>(), wc.data_ptr<int8_t>(), out.data_ptr<float>(), M, N, K);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return out.reshape(shape);
}

// The lanes of the vector each output is summed in (0: the portable loop, whose order is its own).
int64_t dense_lanes() {
#if defined(SPECC_SIMD)
  return LANES;
#else
  return 0;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specc_cpu, lib) {
  lib.def("dense_matvec(Tensor x, Tensor w) -> Tensor");
  lib.def("dense_lanes() -> int", &dense_lanes);
}

TORCH_LIBRARY_IMPL(specc_cpu, CPU, lib) { lib.impl("dense_matvec", &dense_matvec); }
