// specc_cpu::gguf_kquant_matvec: a few rows times a weight in GGUF K-quant super-blocks (Q4_K, Q5_K,
// Q6_K), on CPU; kernels/cpu_kernels.py builds it with the other products for the machine it runs on.
// qs [N, n_super, 144 / 176 / 210] uint8: the file's super-blocks as they are (layouts: the docstring
// of gguf_linear.py). The weights are gguf_linear_reference's bit for bit (gguf-py's float32
// formulas); only the order of the sums differs.
//
// Why the weights come out exact on every path: a sub-block's scale d * sc and min dmin * mn are
// exact float32 products (an 11-bit float16 significand times an integer of at most 8 bits), and so
// is (d * sc) * q (at most 23 bits). A Q6_K weight is that product; a Q4_K / Q5_K weight rounds once,
// at the subtraction of dmin * mn, which a fused multiply-subtract over the exact product does too.
//
// Row invariance: each input row has its own accumulators and the same operations in the same order
// whatever the number of rows R beside it, so row r of an R-row call is the 1-row call's bits (a
// verify row computes the plain step's).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t SUPER = 256;                     // weights per super-block
enum Format : int64_t { Q4_K = 3, Q5_K = 4, Q6_K = 5 };  // as gguf_linear.FORMATS

template <int64_t F>
constexpr int64_t block_bytes() {
  return F == Q4_K ? 144 : F == Q5_K ? 176 : 210;
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);  // Q6_K keeps its d at byte 208: no aligned float16 load
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// A super-block's sub-block scales: Q4_K / Q5_K scale[j] = d * sc_j and min[j] = dmin * mn_j (j < 8),
// the 6-bit sc_j, mn_j packed in 12 bytes (bytes 0-3: sub-blocks 0-3's scales in their low 6 bits,
// 4-7 their mins; sub-blocks 4-7: low 4 bits in bytes 8-11, top 2 bits in the top bits of 0-7);
// Q6_K scale[j] = d * sc_j (j < 16, int8 sc_j).
template <int64_t F>
inline void sub_scales(const uint8_t* blk, float* scale, float* min) {
  if constexpr (F == Q6_K) {
    const float d = half_at(blk + 208);
    for (int j = 0; j < 16; ++j) scale[j] = d * static_cast<float>(static_cast<int8_t>(blk[192 + j]));
  } else {
    const float d = half_at(blk), dmin = half_at(blk + 2);
    const uint8_t* s = blk + 4;
    for (int j = 0; j < 8; ++j) {
      const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
      const int mn = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
      scale[j] = d * static_cast<float>(sc);
      min[j] = dmin * static_cast<float>(mn);
    }
  }
}

// Where step j's 32 values (values 32j..32j+31 of the super-block) keep their bits. Q4_K / Q5_K: they are
// sub-block j, the low (j even) or high nibbles of code bytes 32 * (j / 2).. (Q5_K: bit j of qh's 32
// bytes). Q6_K: in half j / 4 (64 low-bit bytes, 32 high-bit bytes each), low 4 bits from the bytes at
// 32 * (j % 2) shifted by 4 * ((j % 4) / 2), high 2 bits shifted by 2 * (j % 4); sub-blocks 2j, 2j + 1.
template <int64_t F>
struct Step {
  const uint8_t* low;   // 32 bytes of low bits
  const uint8_t* high;  // 32 bytes of high bits (Q5_K, Q6_K)
  int low_shift, high_shift;
  Step(const uint8_t* blk, int j) {
    if constexpr (F == Q6_K) {
      low = blk + 64 * (j / 4) + 32 * (j % 2);
      high = blk + 128 + 32 * (j / 4);
      low_shift = 4 * ((j % 4) / 2);
      high_shift = 2 * (j % 4);
    } else {
      low = blk + (F == Q4_K ? 16 : 48) + 32 * (j / 2);
      high = blk + 16;
      low_shift = 4 * (j % 2);
      high_shift = j;
    }
  }
  // the code of value l (0..31), as an integer (Q6_K: -32..31)
  int code(int l) const {
    int q = (low[l] >> low_shift) & 15;
    if constexpr (F == Q5_K) q |= ((high[l] >> high_shift) & 1) << 4;
    if constexpr (F == Q6_K) q = (q | (((high[l] >> high_shift) & 3) << 4)) - 32;
    return q;
  }
};

// out[r * N] = sum_k x[r * K + k] * w[k] for one output row of the weight (its super-blocks q), R input rows.
template <int64_t F, int R>
void dot_rows(const float* x, int64_t K, const uint8_t* q, int64_t nb, float* out, int64_t N) {
  constexpr int64_t bytes = block_bytes<F>();
  float scale[16], min[8];
#if defined(__AVX512F__) && !defined(SPECC_GGUF_PORTABLE)  // the macro: the portable loops, for comparison
  // AVX-512: a step's 32 weights as two 16-lane vectors (Q6_K: one sub-block each).
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi32(15);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = q + b * bytes;
    sub_scales<F>(blk, scale, min);
    for (int j = 0; j < 8; ++j) {
      const Step<F> s(blk, j);
      const __m128i ls = _mm_cvtsi32_si128(s.low_shift), hs = _mm_cvtsi32_si128(s.high_shift);
      __m512 w[2];
      for (int v = 0; v < 2; ++v) {
        const __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s.low + 16 * v)));
        __m512i c = _mm512_and_si512(_mm512_srl_epi32(lo, ls), low4);
        if constexpr (F != Q4_K) {
          const __m512i hi = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s.high + 16 * v)));
          const __m512i bits = _mm512_and_si512(_mm512_srl_epi32(hi, hs), _mm512_set1_epi32(F == Q5_K ? 1 : 3));
          c = _mm512_or_si512(c, _mm512_slli_epi32(bits, 4));
        }
        if constexpr (F == Q6_K) {
          c = _mm512_sub_epi32(c, _mm512_set1_epi32(32));
          w[v] = _mm512_mul_ps(_mm512_set1_ps(scale[2 * j + v]), _mm512_cvtepi32_ps(c));
        } else {  // one rounding over the exact product, as the reference's subtraction
          w[v] = _mm512_fmsub_ps(_mm512_set1_ps(scale[j]), _mm512_cvtepi32_ps(c), _mm512_set1_ps(min[j]));
        }
      }
      for (int r = 0; r < R; ++r) {
        const float* xs = x + r * K + b * SUPER + 32 * j;
        acc[r][0] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xs), acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xs + 16), acc[r][1]);
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r * N] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
#elif defined(__AVX2__) && defined(__FMA__) && !defined(SPECC_GGUF_PORTABLE)
  // AVX2: a step's 32 weights as four 8-lane vectors; each code widened to int32, converted with
  // _mm256_cvtepi32_ps and made a weight with the reference's float operations. Q5_K / Q6_K make the 32
  // codes as bytes at once (16-bit shifts, byte masks), then widen them: 16 integer operations per 32
  // Q6_K codes against 36 when each 8 were unpacked on their own (widening loads of low and high bits),
  // faster on Zen 3 (BENCHMARKS.md, "GGUF products on AVX2"); Q4_K's codes alone are widened by loads
  // (the bytes were slower there).
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(15), high_mask = _mm256_set1_epi8(F == Q5_K ? 1 : 3);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = q + b * bytes;
    sub_scales<F>(blk, scale, min);
    for (int j = 0; j < 8; ++j) {
      const Step<F> s(blk, j);
      const __m128i ls = _mm_cvtsi32_si128(s.low_shift), hs = _mm_cvtsi32_si128(s.high_shift);
      __m128i halves[2];  // Q5_K, Q6_K: the 32 codes as bytes
      if constexpr (F != Q4_K) {
        // the shifts move 16-bit pairs; the byte masks drop what crossed from the neighbouring byte
        __m256i c = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s.low)), ls), low4);
        const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s.high));
        c = _mm256_or_si256(c, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(hi, hs), high_mask), 4));
        if constexpr (F == Q6_K) c = _mm256_sub_epi8(c, _mm256_set1_epi8(32));  // -32..31
        halves[0] = _mm256_castsi256_si128(c);
        halves[1] = _mm256_extracti128_si256(c, 1);
      }
      __m256 w[4];
      for (int v = 0; v < 4; ++v) {
        __m256i code;
        if constexpr (F == Q4_K) {  // 4-bit codes alone: widening loads measured faster than the bytes
          const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s.low + 8 * v)));
          code = _mm256_and_si256(_mm256_srl_epi32(lo, ls), _mm256_set1_epi32(15));
        } else {
          const __m128i eight = v % 2 ? _mm_srli_si128(halves[v / 2], 8) : halves[v / 2];
          code = F == Q6_K ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight);
        }
        const __m256 cf = _mm256_cvtepi32_ps(code);
        if constexpr (F == Q6_K) {
          w[v] = _mm256_mul_ps(_mm256_set1_ps(scale[2 * j + v / 2]), cf);
        } else {  // one rounding over the exact product, as the reference's subtraction
          w[v] = _mm256_fmsub_ps(_mm256_set1_ps(scale[j]), cf, _mm256_set1_ps(min[j]));
        }
      }
      for (int r = 0; r < R; ++r) {
        const float* xs = x + r * K + b * SUPER + 32 * j;
        for (int v = 0; v < 4; ++v) acc[r][v] = _mm256_fmadd_ps(w[v], _mm256_loadu_ps(xs + 8 * v), acc[r][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m256 s = _mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]), _mm256_add_ps(acc[r][2], acc[r][3]));
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_hadd_ps(h, h);
    out[r * N] = _mm_cvtss_f32(_mm_hadd_ps(h, h));
  }
#else
  // Portable: 32 lanes in arrays the compiler vectorises (ARM's NEON among them); -ffp-contract=off
  // keeps each weight's multiply and subtraction two operations, as the reference's.
  float acc[R][32] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = q + b * bytes;
    sub_scales<F>(blk, scale, min);
    for (int j = 0; j < 8; ++j) {
      const Step<F> s(blk, j);
      float w[32];
      for (int l = 0; l < 32; ++l) {
        const float c = static_cast<float>(s.code(l));
        if constexpr (F == Q6_K) w[l] = scale[2 * j + l / 16] * c;
        else w[l] = scale[j] * c - min[j];
      }
      for (int r = 0; r < R; ++r) {
        const float* xs = x + r * K + b * SUPER + 32 * j;
        for (int l = 0; l < 32; ++l) acc[r][l] += w[l] * xs[l];
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    float t = 0.0f;
    for (int l = 0; l < 32; ++l) t += acc[r][l];
    out[r * N] = t;
  }
#endif
}

template <int64_t F>
void matvec(const float* x, int64_t M, int64_t K, const uint8_t* q, int64_t N, int64_t nb, float* out) {
  // Threads split the output rows; each weight row is read once for every input row (4 at a time).
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* qn = q + n * nb * block_bytes<F>();
      for (int64_t r0 = 0; r0 < M; r0 += 4) {
        const float* xr = x + r0 * K;
        float* o = out + r0 * N + n;
        switch (std::min<int64_t>(4, M - r0)) {
          case 4: dot_rows<F, 4>(xr, K, qn, nb, o, N); break;
          case 3: dot_rows<F, 3>(xr, K, qn, nb, o, N); break;
          case 2: dot_rows<F, 2>(xr, K, qn, nb, o, N); break;
          default: dot_rows<F, 1>(xr, K, qn, nb, o, N);
        }
      }
    }
  });
}

at::Tensor gguf_kquant_matvec(const at::Tensor& x, const at::Tensor& qs, int64_t fmt) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat,
              "gguf_kquant_matvec: x must be a float32 CPU tensor");
  TORCH_CHECK(fmt == Q4_K || fmt == Q5_K || fmt == Q6_K, "gguf_kquant_matvec: unknown K-quant format ", fmt);
  const int64_t bytes = fmt == Q4_K ? block_bytes<Q4_K>() : fmt == Q5_K ? block_bytes<Q5_K>() : block_bytes<Q6_K>();
  TORCH_CHECK(qs.dim() == 3 && qs.scalar_type() == at::kByte && qs.size(2) == bytes,
              "gguf_kquant_matvec: qs must be uint8 [N, n_super, ", bytes, "]");
  const int64_t K = x.size(-1), N = qs.size(0), nb = qs.size(1);
  TORCH_CHECK(K == nb * SUPER, "gguf_kquant_matvec: x has ", K, " inputs, the weight ", nb * SUPER);
  const at::Tensor rows = x.reshape({-1, K}).contiguous();
  const at::Tensor q = qs.contiguous();
  const int64_t M = rows.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  const float* xp = rows.data_ptr<float>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  if (fmt == Q4_K) matvec<Q4_K>(xp, M, K, qp, N, nb, op);
  else if (fmt == Q5_K) matvec<Q5_K>(xp, M, K, qp, N, nb, op);
  else matvec<Q6_K>(xp, M, K, qp, N, nb, op);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return out.reshape(shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specc_cpu, lib) { lib.def("gguf_kquant_matvec(Tensor x, Tensor qs, int fmt) -> Tensor"); }

TORCH_LIBRARY_IMPL(specc_cpu, CPU, lib) { lib.impl("gguf_kquant_matvec", &gguf_kquant_matvec); }
