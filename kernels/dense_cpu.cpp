// specc_cpu::dense_matvec: a few rows times a float32 [N, K] weight, on CPU (kernels/cpu_kernels.py builds
// it for the machine it runs on); the body of specc::rows_linear (rows_linear.py) on CPU float32.
//
// Why by hand: Inductor's reduction over the weight (the `matvec` pass's form) streams it at the
// memory's speed for one row, but its loop does not prefetch, so once 4-16 rows of multiply-adds
// slow each weight line down it waits on memory instead of overlapping with it (measured on SmolLM2's
// 211 products: 15.7 ms at 4 rows, 24.3 at 8, 50.6 at 16, where one row takes 14.7). Here each tile of
// up to 8 input rows times 4 weight rows (2 beyond 4 input rows: at most 16 accumulators) stays in
// registers and the weight is prefetched 8 KB ahead of the lines it reads (from 2 rows: for one, the
// extra instructions cost more than they save, 13.3 against 12.7 ms).
//
// Every output is one thread's sum of 16 lanes over k in steps of 16, reduced the same way whatever
// the number of rows: a row's result does not depend on the rows beside it or on how many there are.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t LANES = 16;
constexpr int64_t PREFETCH = 2048;  // floats ahead of each weight row's read (measured: 1024-4096 alike)
constexpr int64_t MAX_R = 8;        // input rows per tile: 8 x 2 accumulators leave registers to spare
constexpr int64_t BLOCK_N = 32;     // weight rows per block: its lines stay in L1/L2 across row groups

// out[r * N + j] = sum_k x[r * K + k] * w[j * K + k] for R input rows and NB weight rows.
template <int R, int NB>
inline void tile(const float* x, int64_t K, const float* w, float* out, int64_t N) {
#if defined(__AVX512F__)
  __m512 acc[NB][R];
  for (int j = 0; j < NB; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + LANES <= K; k += LANES) {
    __m512 wv[NB];
    for (int j = 0; j < NB; ++j) {
      if constexpr (R > 1) __builtin_prefetch(w + j * K + k + PREFETCH);  // one row: the hardware keeps up
      wv[j] = _mm512_loadu_ps(w + j * K + k);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * K + k);
      for (int j = 0; j < NB; ++j) acc[j][r] = _mm512_fmadd_ps(wv[j], xv, acc[j][r]);
    }
  }
  if (k < K) {  // the last K % 16 inputs, masked: zeros add nothing
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm512_maskz_loadu_ps(mask, w + j * K + k);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + r * K + k);
      for (int j = 0; j < NB; ++j) acc[j][r] = _mm512_fmadd_ps(wv[j], xv, acc[j][r]);
    }
  }
  for (int j = 0; j < NB; ++j)
    for (int r = 0; r < R; ++r) out[r * N + j] = _mm512_reduce_add_ps(acc[j][r]);
#else
  // Portable: 16 lanes in arrays the compiler vectorises (AVX2 machines: two 8-lane halves).
  float acc[NB][R][LANES] = {};
  for (int64_t k0 = 0; k0 < K; k0 += LANES) {
    const int64_t n = std::min(LANES, K - k0);
    if constexpr (R > 1)
      for (int j = 0; j < NB; ++j) __builtin_prefetch(w + j * K + k0 + PREFETCH);
    for (int j = 0; j < NB; ++j)
      for (int r = 0; r < R; ++r)
        for (int64_t l = 0; l < n; ++l) acc[j][r][l] += w[j * K + k0 + l] * x[r * K + k0 + l];
  }
  for (int j = 0; j < NB; ++j)
    for (int r = 0; r < R; ++r) {
      float s = 0.0f;
      for (int64_t l = 0; l < LANES; ++l) s += acc[j][r][l];
      out[r * N + j] = s;
    }
#endif
}

// Weight rows n0..n1 for R input rows: fours while R <= 4 (16 accumulators at most), pairs, the odd one.
template <int R>
void rows(const float* x, int64_t K, const float* w, float* out, int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if constexpr (R <= 4)
    for (; n + 4 <= n1; n += 4) tile<R, 4>(x, K, w + n * K, out + n, N);
  for (; n + 2 <= n1; n += 2) tile<R, 2>(x, K, w + n * K, out + n, N);
  for (; n < n1; ++n) tile<R, 1>(x, K, w + n * K, out + n, N);
}

at::Tensor dense_matvec(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && w.device().is_cpu() &&
                  w.scalar_type() == at::kFloat, "dense_matvec: x and w must be float32 CPU tensors");
  TORCH_CHECK(w.dim() == 2, "dense_matvec: w must be [N, K]");
  const int64_t K = x.size(-1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "dense_matvec: x has ", K, " inputs, the weight ", w.size(1));
  const at::Tensor xr = x.reshape({-1, K}).contiguous();
  const at::Tensor wc = w.contiguous();
  const int64_t M = xr.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  const float* xp = xr.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* op = out.data_ptr<float>();
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
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return out.reshape(shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specc_cpu, lib) { lib.def("dense_matvec(Tensor x, Tensor w) -> Tensor"); }

TORCH_LIBRARY_IMPL(specc_cpu, CPU, lib) { lib.impl("dense_matvec", &dense_matvec); }
