// specc_cpu::gguf_matvec: a few rows times a GGUF block-quantized weight, on CPU (kernels/cpu_kernels.py
// builds it for the machine it runs on). The weights are the ones gguf_linear_reference computes
// (gguf-py's formulas, float32, the same rounding); only the order of the sums differs.
//
// Why by hand: Inductor's loop over the reference converts every code on its own and is
// compute-bound (measured: SmolLM2's LM-head shape in Q4_1 2.6 ms, where int8 weights stream in
// 1.1 ms). With AVX-512 a 4-bit block's 16 possible weights d * c + m are one vector, and each code
// picks its weight with one permute (a 5-bit block's 32: two vectors, one two-table permute), so a
// block of 32 weights costs a widening load, a shift, two permutes and two multiply-adds per input row.
// With AVX2 each code is converted and its weight made with one exact multiply-add (below). Formats:
// Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (the K-quants' super-blocks: gguf_kquants_cpu.cpp).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

// The AVX2 path (an AVX-512 build takes its own; SPECC_GGUF_PORTABLE: the portable loops, for comparison).
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__) && !defined(SPECC_GGUF_PORTABLE)
#define SPECC_GGUF_AVX2 1
#else
#define SPECC_GGUF_AVX2 0
#endif

namespace {

constexpr int64_t BLOCK = 32;
enum Format : int64_t { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2, Q5_0 = 6, Q5_1 = 7 };  // as gguf_linear.FORMATS

// A block's code bytes: Q8_0 32 int8 codes; 4-bit 16 bytes of two codes; 5-bit the 32-bit word of fifth
// bits (qh), then 16 bytes of two codes' low 4 bits.
template <int64_t F>
constexpr int64_t code_bytes() { return F == Q8_0 ? 32 : (F == Q5_0 || F == Q5_1) ? 20 : 16; }
template <int64_t F>
constexpr bool five_bit() { return F == Q5_0 || F == Q5_1; }
template <int64_t F>
constexpr bool has_min() { return F == Q4_1 || F == Q5_1; }

inline uint32_t fifth_bits(const uint8_t* qb) {
  uint32_t qh;
  std::memcpy(&qh, qb, 4);  // little-endian, as the file stores it
  return qh;
}

// For each byte of a 5-bit block's fifth bits, the 8 values' bits as 32-bit lanes of 16 or 0: one load
// (fused into the or) sets 8 codes' fifth bits, where shifting each lane's bit into place took four
// operations (the AVX2 path; 8 KB, read from L1; a few percent faster on Zen 3: BENCHMARKS.md, "GGUF
// products on AVX2").
struct FifthBitLanes {
  alignas(32) int32_t lanes[256][8];
  constexpr FifthBitLanes() : lanes() {
    for (int b = 0; b < 256; ++b)
      for (int i = 0; i < 8; ++i) lanes[b][i] = ((b >> i) & 1) << 4;
  }
};
constexpr FifthBitLanes FIFTH{};

inline float to_float(c10::Half h) {
#if defined(__F16C__)
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}

// The weight of code c (0..15 for 4-bit, 0..31 for 5-bit, -128..127 for Q8_0) in a block with scale d
// and minimum m, computed as the reference does.
template <int64_t F>
inline float weight(float d, float m, float c) {
  if constexpr (F == Q8_0) return c * d;
  else if constexpr (F == Q4_0) return d * (c - 8.0f);
  else if constexpr (F == Q5_0) return d * (c - 16.0f);
  else return d * c + m;
}

#if SPECC_GGUF_AVX2
// The AVX2 path's row sum: its four 8-lane accumulators, added in one fixed order.
inline float sum8x4(const __m256* acc) {
  const __m256 s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_hadd_ps(h, h);
  return _mm_cvtss_f32(_mm_hadd_ps(h, h));
}

// dot_rows' sums over a weight row it kept (K floats): the same multiply-adds in the same order, so a
// row gets the bits dot_rows gives it, without decoding the blocks again for rows 5 and on.
template <int R>
void dot_kept(const float* x, int64_t K, const float* w, int64_t nb, float* out, int64_t N) {
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b)
    for (int j = 0; j < 4; ++j) {
      const __m256 wv = _mm256_loadu_ps(w + b * BLOCK + 8 * j);
      for (int r = 0; r < R; ++r)
        acc[r][j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + r * K + b * BLOCK + 8 * j), acc[r][j]);
    }
  for (int r = 0; r < R; ++r) out[r * N] = sum8x4(acc[r]);
}
#endif

// out[r * N] = sum_k x[r * K + k] * w[k] for one output row n of the weight, R input rows. AVX2: with
// `kept`, the row's weights are also stored there (K floats) for dot_kept to run more rows over them.
template <int64_t F, int R>
void dot_rows(const float* x, int64_t K, const uint8_t* q, const c10::Half* d, const c10::Half* m, int64_t nb,
              float* out, int64_t N, float* kept = nullptr) {
  constexpr int64_t qbytes = code_bytes<F>();
  (void)kept;  // only the AVX2 path keeps weights
#if defined(__AVX512F__) && !defined(SPECC_GGUF_PORTABLE)  // the macro: the portable loops, for comparison
  __m512 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* qb = q + b * qbytes;
    const __m512 dv = _mm512_set1_ps(to_float(d[b]));
    __m512 lo, hi;
    if constexpr (F == Q8_0) {
      const __m512 c0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qb))));
      const __m512 c1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qb + 16))));
      lo = _mm512_mul_ps(c0, dv);
      hi = _mm512_mul_ps(c1, dv);
    } else if constexpr (five_bit<F>()) {
      // the block's 32 weights as two 16-lane tables; a two-table permute reads each lane's low 5 bits
      const __m512 c_hi = _mm512_add_ps(codes, _mm512_set1_ps(16.0f));
      __m512 t0, t1;
      if constexpr (F == Q5_0) {
        t0 = _mm512_mul_ps(dv, _mm512_sub_ps(codes, _mm512_set1_ps(16.0f)));
        t1 = _mm512_mul_ps(dv, codes);
      } else {
        const __m512 mv = _mm512_set1_ps(to_float(m[b]));
        t0 = _mm512_add_ps(_mm512_mul_ps(dv, codes), mv);
        t1 = _mm512_add_ps(_mm512_mul_ps(dv, c_hi), mv);
      }
      const __m512i qh = _mm512_set1_epi32(static_cast<int>(fifth_bits(qb)));
      const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      const __m512i one = _mm512_set1_epi32(1);
      const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qb + 4)));
      const __m512i b_lo = _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(qh, lane), one), 4);
      const __m512i b_hi = _mm512_slli_epi32(
          _mm512_and_si512(_mm512_srlv_epi32(qh, _mm512_add_epi32(lane, _mm512_set1_epi32(16))), one), 4);
      lo = _mm512_permutex2var_ps(t0, _mm512_or_si512(_mm512_and_si512(w, _mm512_set1_epi32(15)), b_lo), t1);
      hi = _mm512_permutex2var_ps(t0, _mm512_or_si512(_mm512_srli_epi32(w, 4), b_hi), t1);
    } else {
      // the block's 16 weights, then one permute per 16 codes (it reads each lane's low 4 bits)
      const __m512 table = F == Q4_0 ? _mm512_mul_ps(dv, _mm512_sub_ps(codes, _mm512_set1_ps(8.0f)))
                                     : _mm512_add_ps(_mm512_mul_ps(dv, codes), _mm512_set1_ps(to_float(m[b])));
      const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qb)));
      lo = _mm512_permutexvar_ps(w, table);
      hi = _mm512_permutexvar_ps(_mm512_srli_epi32(w, 4), table);
    }
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * K + b * BLOCK;
      acc0[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xb), acc0[r]);
      acc1[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + 16), acc1[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r * N] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[r], acc1[r]));
#elif SPECC_GGUF_AVX2
  // AVX2: each code converted to float and its weight made with one multiply-add, fma(d, c, m), which is
  // the reference's d * c + m bit for bit: d is a float16 (11 significant bits) and c has at most 8, so
  // d * c is exact in float32 and the add is the one rounding (Q4_0: fma(d, c, -8d) = d * (c - 8), exact;
  // Q5_0 likewise with -16d). Measured against picking each weight from the block's 16 as two 8-lane
  // halves (two permutes and a blend per 8 codes): 1.2-1.7x faster at one row on an AVX2 EPYC (Zen 3).
  // At one row the codes come out of the 16 bytes by two in-lane byte shuffles (not widening loads,
  // which cross lanes), and the scales are converted 8 blocks at a time (Q4_1 gate/up at one row:
  // 0.12-0.16 ms against 0.19-0.20, bench_gguf_isa.py, Zen 3).
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
  // a 4-bit block's 16 code bytes in both 128-bit halves; one in-lane byte shuffle puts bytes 0-7 (8-15)
  // in the eight 32-bit lanes, whose low nibbles are the codes of values 0-7 (8-15) and high nibbles
  // those of values 16-23 (24-31)
  const __m256i bytes0_7 = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
                                            4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1);
  const __m256i bytes8_15 = _mm256_add_epi32(bytes0_7, _mm256_set1_epi32(8));  // -1 bytes stay negative
  const __m256i low4 = _mm256_set1_epi32(15);
  float dm[2][8];  // d (and m) of the next 8 blocks as float32, converted 8 at a time
  // Only for one row of 4- and 5-bit blocks: with more rows the sums leave too few registers for the
  // shuffles' constants, and Q8_0 has no codes to unpack; there the scales are converted one by one and
  // the codes widened by loads (paired on Zen 3, bench_gguf_isa.py: faster that way from 2 rows, and for
  // Q8_0 at any row count).
  constexpr bool few_rows = R == 1 && F != Q8_0;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* qb = q + b * qbytes;
    if (few_rows && b % 8 == 0) {
      const int64_t n8 = std::min<int64_t>(8, nb - b);
      if (n8 == 8) {
        _mm256_storeu_ps(dm[0], _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + b))));
        if constexpr (has_min<F>())
          _mm256_storeu_ps(dm[1], _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + b))));
      } else {
        for (int64_t i = 0; i < n8; ++i) {
          dm[0][i] = to_float(d[b + i]);
          if constexpr (has_min<F>()) dm[1][i] = to_float(m[b + i]);
        }
      }
    }
    const __m256 dv = few_rows ? _mm256_broadcast_ss(&dm[0][b % 8]) : _mm256_set1_ps(to_float(d[b]));
    __m256 wv[4];  // the block's weights of values 0-7, 8-15, 16-23, 24-31
    if constexpr (F == Q8_0) {
      for (int j = 0; j < 4; ++j) {
        const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb + 8 * j));
        wv[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)), dv);
      }
    } else {
      const __m256 mv = !has_min<F>() ? _mm256_mul_ps(dv, _mm256_set1_ps(F == Q5_0 ? -16.0f : -8.0f))
                        : few_rows    ? _mm256_broadcast_ss(&dm[1][b % 8])
                                      : _mm256_set1_ps(to_float(m[b]));
      const uint8_t* codes = qb + (five_bit<F>() ? 4 : 0);
      __m256i code[4];
      if constexpr (few_rows) {
        const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
        const __m256i lo = _mm256_shuffle_epi8(raw, bytes0_7), hi = _mm256_shuffle_epi8(raw, bytes8_15);
        code[0] = _mm256_and_si256(lo, low4);
        code[1] = _mm256_and_si256(hi, low4);
        code[2] = _mm256_srli_epi32(lo, 4);
        code[3] = _mm256_srli_epi32(hi, 4);
      } else {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)), nib = _mm_set1_epi8(15);
        const __m128i lo = _mm_and_si128(raw, nib), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), nib);
        code[0] = _mm256_cvtepu8_epi32(lo);
        code[1] = _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8));
        code[2] = _mm256_cvtepu8_epi32(hi);
        code[3] = _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8));
      }
      if constexpr (five_bit<F>()) {  // values 8j..8j+7 take their fifth bits from byte j of qh, as 16 or 0
        const uint32_t qh = fifth_bits(qb);
        for (int j = 0; j < 4; ++j)
          code[j] = _mm256_or_si256(code[j], _mm256_load_si256(reinterpret_cast<const __m256i*>(FIFTH.lanes[(qh >> (8 * j)) & 255])));
      }
      for (int j = 0; j < 4; ++j) wv[j] = _mm256_fmadd_ps(dv, _mm256_cvtepi32_ps(code[j]), mv);
    }
    if (R > 1 && kept != nullptr)
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(kept + b * BLOCK + 8 * j, wv[j]);
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * K + b * BLOCK;
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_fmadd_ps(wv[j], _mm256_loadu_ps(xb + 8 * j), acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r) out[r * N] = sum8x4(acc[r]);
#else
  // Portable: 16 lanes in arrays the compiler vectorises (ARM's NEON among them).
  float acc[R][16] = {};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* qb = q + b * qbytes;
    const float db = to_float(d[b]);
    const float mb = has_min<F>() ? to_float(m[b]) : 0.0f;
    float lo[16], hi[16];
    for (int i = 0; i < 16; ++i) {
      if constexpr (F == Q8_0) {
        lo[i] = weight<F>(db, mb, static_cast<float>(static_cast<int8_t>(qb[i])));
        hi[i] = weight<F>(db, mb, static_cast<float>(static_cast<int8_t>(qb[16 + i])));
      } else if constexpr (five_bit<F>()) {
        const uint32_t qh = fifth_bits(qb);
        lo[i] = weight<F>(db, mb, static_cast<float>((qb[4 + i] & 15) | (((qh >> i) & 1) << 4)));
        hi[i] = weight<F>(db, mb, static_cast<float>((qb[4 + i] >> 4) | (((qh >> (16 + i)) & 1) << 4)));
      } else {
        lo[i] = weight<F>(db, mb, static_cast<float>(qb[i] & 15));
        hi[i] = weight<F>(db, mb, static_cast<float>(qb[i] >> 4));
      }
    }
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * K + b * BLOCK;
      for (int i = 0; i < 16; ++i) acc[r][i] += lo[i] * xb[i] + hi[i] * xb[16 + i];
    }
  }
  for (int r = 0; r < R; ++r) {
    float t = 0.0f;
    for (int i = 0; i < 16; ++i) t += acc[r][i];
    out[r * N] = t;
  }
#endif
}

template <int64_t F>
void matvec(const float* x, int64_t M, int64_t K, const uint8_t* q, const c10::Half* d, const c10::Half* m,
            int64_t N, int64_t nb, float* out) {
  constexpr int64_t qbytes = code_bytes<F>();
  // Threads split the output rows; each weight row is read once for every input row (4 at a time). AVX2,
  // past 4 rows: the first 4 keep the row's weights (K floats, in L1) and the others run over them, so the
  // blocks are decoded once (Q4_1 gate/up at 8 rows: 0.58 against 0.91 ms; at 5 rows within the noise).
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
#if SPECC_GGUF_AVX2
    std::vector<float> kept(M > 4 ? K : 0);
#endif
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* qn = q + n * nb * qbytes;
      const c10::Half* dn = d + n * nb;
      const c10::Half* mn = has_min<F>() ? m + n * nb : nullptr;
#if SPECC_GGUF_AVX2
      if (M > 4) {
        dot_rows<F, 4>(x, K, qn, dn, mn, nb, out + n, N, kept.data());
        for (int64_t r0 = 4; r0 < M; r0 += 4) {
          const float* xr = x + r0 * K;
          float* o = out + r0 * N + n;
          switch (std::min<int64_t>(4, M - r0)) {
            case 4: dot_kept<4>(xr, K, kept.data(), nb, o, N); break;
            case 3: dot_kept<3>(xr, K, kept.data(), nb, o, N); break;
            case 2: dot_kept<2>(xr, K, kept.data(), nb, o, N); break;
            default: dot_kept<1>(xr, K, kept.data(), nb, o, N);
          }
        }
        continue;
      }
#endif
      for (int64_t r0 = 0; r0 < M; r0 += 4) {
        const float* xr = x + r0 * K;
        float* o = out + r0 * N + n;
        switch (std::min<int64_t>(4, M - r0)) {
          case 4: dot_rows<F, 4>(xr, K, qn, dn, mn, nb, o, N); break;
          case 3: dot_rows<F, 3>(xr, K, qn, dn, mn, nb, o, N); break;
          case 2: dot_rows<F, 2>(xr, K, qn, dn, mn, nb, o, N); break;
          default: dot_rows<F, 1>(xr, K, qn, dn, mn, nb, o, N);
        }
      }
    }
  });
}

at::Tensor gguf_matvec(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m,
                       int64_t fmt) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, "gguf_matvec: x must be a float32 CPU tensor");
  TORCH_CHECK(fmt == Q8_0 || fmt == Q4_0 || fmt == Q4_1 || fmt == Q5_0 || fmt == Q5_1,
              "gguf_matvec: unknown block format ", fmt);
  const int64_t bytes = fmt == Q8_0 ? 32 : (fmt == Q5_0 || fmt == Q5_1) ? 20 : 16;
  TORCH_CHECK(qs.dim() == 3 && qs.size(2) == bytes, "gguf_matvec: qs must be [N, nb, ", bytes, "]");
  const bool with_min = fmt == Q4_1 || fmt == Q5_1;
  TORCH_CHECK(d.scalar_type() == at::kHalf && (!with_min || m.scalar_type() == at::kHalf),
              "gguf_matvec: d and m must be float16");
  const int64_t K = x.size(-1), N = qs.size(0), nb = qs.size(1);
  TORCH_CHECK(K == nb * BLOCK, "gguf_matvec: x has ", K, " inputs, the weight ", nb * BLOCK);
  const at::Tensor rows = x.reshape({-1, K}).contiguous();
  const at::Tensor q = qs.contiguous(), dc = d.contiguous(), mc = m.contiguous();
  const int64_t M = rows.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  const float* xp = rows.data_ptr<float>();
  const uint8_t* qp = static_cast<const uint8_t*>(q.data_ptr());
  const c10::Half* dp = dc.data_ptr<c10::Half>();
  const c10::Half* mp = with_min ? mc.data_ptr<c10::Half>() : nullptr;
  float* op = out.data_ptr<float>();
  if (fmt == Q8_0) matvec<Q8_0>(xp, M, K, qp, dp, mp, N, nb, op);
  else if (fmt == Q4_0) matvec<Q4_0>(xp, M, K, qp, dp, mp, N, nb, op);
  else if (fmt == Q4_1) matvec<Q4_1>(xp, M, K, qp, dp, mp, N, nb, op);
  else if (fmt == Q5_0) matvec<Q5_0>(xp, M, K, qp, dp, mp, N, nb, op);
  else matvec<Q5_1>(xp, M, K, qp, dp, mp, N, nb, op);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return out.reshape(shape);
}

}  // namespace

TORCH_LIBRARY(specc_cpu, lib) {
  lib.def("gguf_matvec(Tensor x, Tensor qs, Tensor d, Tensor m, int fmt) -> Tensor");
}

TORCH_LIBRARY_IMPL(specc_cpu, CPU, lib) { lib.impl("gguf_matvec", &gguf_matvec); }
