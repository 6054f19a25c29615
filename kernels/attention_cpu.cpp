// specc_cpu::rows_attention: the attention of a decode step's query rows over the KV cache, on CPU,
// each row's bits independent of the other rows and of where masked keys sit (kernels/cpu_kernels.py
// builds it for the machine; the CPU body of specc::tree_attention, tree_attention.py).
//
// Why by hand: greedy speculation reproduces plain decoding only if a tree node's row gets the bits
// the plain step gets for the same token at the same position. A library attention does not give
// that: its sums over the keys go through vector lanes and GEMM blocks by key position and by the
// number of query rows (measured with ATen's CPU SDPA: float32 rows differ between 2 and 14 query
// rows; bf16 and float32 rows differ when the keys read end elsewhere), and a tree node's ancestors
// sit at other slots than plain decoding puts them (node 4 of a 2x2 tree, child of node 2, sees its
// parent at slot base + 2, plain decoding at base + 1), so even a kernel that ignores the row count
// sums the same terms in other lanes. Here no sum's order depends on a key's slot or on the other rows:
//   score_j = (q . k_j) * scale + mask_j: lane l of 16 sums q_d * k_jd for d = l, l + 16, ... in order,
//             then the 16 lanes by one tree (sum_lanes), for every key and row alike
//   m = max_j score_j;  p_j = exp(score_j - m)             (exp: one formula per value)
//   l = sum_j p_j;  acc_d = sum_j p_j * v_jd               (over the keys one after the other, in slot order)
//   out_d = acc_d / l, rounded to the query's dtype.
// Masked keys (mask -1e9) give p_j = 0 exactly, which adds nothing (the sums never hold -0), so a tree's
// interleaved masked slots and the masked tail past the last key read leave a row's sums as plain
// decoding's: the row's visible keys are summed in the same order (context, then the path's nodes by
// depth). float32 throughout; multiply-adds of whole vectors are fused on x86 CPUs with FMA, and every
// value goes through the same instructions wherever it sits, so vector code and scalar code agree.
// Rows are computed up to four at a time (sharing each load of a key or value row),
// the arithmetic of each row being the one-row arithmetic.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t KEYS = 16;  // keys per block: the lanes of one score vector (a whole line of fp32)
// Output values of one row kept in registers while the keys go by, and rows sharing each value row:
// 4 rows x 64 values take 16 of AVX-512's 32 registers; AVX2 has 16 registers of half the width.
#if defined(__AVX512F__)
constexpr int64_t DCHUNK = 64, WEIGH_ROWS = 4;
#else
constexpr int64_t DCHUNK = 32, WEIGH_ROWS = 2;
#endif
constexpr int64_t MAX_ROWS_PER_TASK = 16;  // query rows of one kv head per task of the thread pool

// exp(x) in place for x <= 0 (scores minus their maximum), float32: x = n ln2 + r, |r| <= ln2 / 2,
// Cephes' degree-5 polynomial for exp(r), then 2^n by the exponent bits. The loop has no branch, so the
// compiler vectorises it (with -fno-trapping-math), and a value computed in a vector lane equals the one computed alone (the same
// operations, each rounded). At -87 and below it gives 0 (exp would be subnormal: at most 1e-38 of the
// row's largest weight), also for NaN (a row with every key masked by -inf).
inline void exp_nonpositive(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float xi = x[i];
    const float xc = xi > -87.0f ? xi : -87.0f;
    const float k = std::floor(xc * 1.44269504088896341f + 0.5f);
    const float r = (xc - k * 0.693359375f) - k * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
    x[i] = xi > -87.0f ? p * __builtin_bit_cast(float, bits) : 0.0f;
  }
}

template <typename T>
inline float to_float(T v) { return static_cast<float>(v); }

// n values to float32: bf16 by its bits (a shift the compiler vectorises; c10's conversion does not
// vectorise), others by their own conversion
template <typename T>
inline void to_floats(const T* __restrict src, float* __restrict dst, int64_t n) {
  if constexpr (std::is_same<T, c10::BFloat16>::value) {
    for (int64_t i = 0; i < n; ++i) dst[i] = __builtin_bit_cast(float, static_cast<uint32_t>(src[i].x) << 16);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
  }
}

// Sixteen float32 lanes, held as the machine's own vectors (GCC's and Clang's vector extension): one
// AVX-512 register, two AVX ones, four SSE or NEON ones. GCC compiles a vector type wider than the
// machine's lane by lane through memory (one 16-float type made this kernel 5-7x slower on an AVX2
// EPYC), hence the pieces. Each lane is its own value: +, * and madd act lane by lane, rounded as scalar code rounds.
#if defined(__AVX512F__)
constexpr int64_t NATIVE = 16;
#elif defined(__AVX__)
constexpr int64_t NATIVE = 8;
#else
constexpr int64_t NATIVE = 4;
#endif
constexpr int64_t PIECES = KEYS / NATIVE;
typedef float Native __attribute__((vector_size(NATIVE * sizeof(float))));
struct Lanes {
  Native p[PIECES];
};

inline Lanes zero_lanes() {
  Lanes v;
  for (int64_t i = 0; i < PIECES; ++i) v.p[i] = Native{};
  return v;
}

// piece by piece: a copy of the whole struct goes through 16-byte moves, which the next 32-byte read of
// the same memory waits for (GCC, AVX2)
inline Lanes load_lanes(const float* p) {
  Lanes v;
  for (int64_t i = 0; i < PIECES; ++i) std::memcpy(&v.p[i], p + i * NATIVE, sizeof(Native));
  return v;
}

inline void store_lanes(float* p, const Lanes& v) {
  for (int64_t i = 0; i < PIECES; ++i) std::memcpy(p + i * NATIVE, &v.p[i], sizeof(Native));
}

// acc + a * b lane by lane, one fused multiply-add on x86 CPUs that have it (the same instruction for
// every lane of every call, so a value does not depend on where it sits), else a rounded product and a
// sum (ARM included: its compilers are not asked to contract).
inline Native madd(Native acc, Native a, Native b) {
#if defined(__AVX512F__)
  return _mm512_fmadd_ps(a, b, acc);
#elif defined(__FMA__)
  return _mm256_fmadd_ps(a, b, acc);
#else
  return acc + a * b;
#endif
}

inline Lanes madd(const Lanes& acc, const Lanes& a, const Lanes& b) {
  Lanes r;
  for (int64_t i = 0; i < PIECES; ++i) r.p[i] = madd(acc.p[i], a.p[i], b.p[i]);
  return r;
}

inline Lanes madd(const Lanes& acc, float a, const Lanes& b) {
  Lanes r;
  const Native av = a - Native{};  // broadcast
  for (int64_t i = 0; i < PIECES; ++i) r.p[i] = madd(acc.p[i], av, b.p[i]);
  return r;
}

// Sixteen vectors -> one whose lane j is the sum of p[j]'s lanes, each by the same tree: lane l plus
// lane l + 8, then + 4, + 2, + 1 (at::vec's order). Which lane a key lands in does not change its sum.
inline Lanes sum_lanes(const Lanes* p) {
  Lanes out;
#if defined(__AVX512F__)
  typedef int32_t LaneIndex __attribute__((vector_size(KEYS * sizeof(int32_t))));
  const LaneIndex lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const LaneIndex lo4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const LaneIndex lo2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const LaneIndex lo1 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  Native a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = __builtin_shuffle(p[2 * i].p[0], p[2 * i + 1].p[0], lo8) + __builtin_shuffle(p[2 * i].p[0], p[2 * i + 1].p[0], lo8 + 8);
  for (int i = 0; i < 4; ++i) b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], lo4) + __builtin_shuffle(a[2 * i], a[2 * i + 1], lo4 + 4);
  for (int i = 0; i < 2; ++i) c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], lo2) + __builtin_shuffle(b[2 * i], b[2 * i + 1], lo2 + 2);
  out.p[0] = __builtin_shuffle(c[0], c[1], lo1) + __builtin_shuffle(c[0], c[1], lo1 + 1);
#elif defined(__AVX__)
  // eight keys at a time: a_j = lanes 0-7 + lanes 8-15; the 128-bit halves pair keys j and j + 4
  // (+ 4), in-lane shuffles pair lanes l and l + 2 (+ 2), then l and l + 1 (+ 1), leaving keys in order
  for (int64_t h = 0; h < 2; ++h) {
    __m256 a[8], s[4];
    for (int j = 0; j < 8; ++j) a[j] = p[8 * h + j].p[0] + p[8 * h + j].p[1];
    for (int j = 0; j < 4; ++j)
      s[j] = _mm256_add_ps(_mm256_permute2f128_ps(a[j], a[j + 4], 0x20), _mm256_permute2f128_ps(a[j], a[j + 4], 0x31));
    const __m256 v1 = _mm256_add_ps(_mm256_shuffle_ps(s[0], s[1], 0x44), _mm256_shuffle_ps(s[0], s[1], 0xEE));
    const __m256 v2 = _mm256_add_ps(_mm256_shuffle_ps(s[2], s[3], 0x44), _mm256_shuffle_ps(s[2], s[3], 0xEE));
    out.p[h] = _mm256_add_ps(_mm256_shuffle_ps(v1, v2, 0x88), _mm256_shuffle_ps(v1, v2, 0xDD));
  }
#else
  float o[KEYS];
  for (int64_t j = 0; j < KEYS; ++j) {
    float l[KEYS];
    store_lanes(l, p[j]);
    for (int64_t w = KEYS / 2; w >= 1; w /= 2)
      for (int64_t i = 0; i < w; ++i) l[i] = l[i] + l[i + w];
    o[j] = l[0];
  }
  out = load_lanes(o);
#endif
  return out;
}

// R rows' scores against a block of KEYS keys (rows of Dp floats, zeros past D): s[r][j] = the tree of
// sum_lanes over lane l's sum, in order over c, of q[r][c + l] * k[j][c + l]. The R rows share each load
// of a key; each row's arithmetic is the one-row arithmetic.
template <int R>
inline void score_block(const float* __restrict q, int64_t Dp, const float* __restrict kb, int64_t nj,
                        float* __restrict s, int64_t s_stride) {
  // J keys at a time, so that a one-row call keeps several independent sums in flight (a key's sum over
  // c is a chain of dependent multiply-adds)
  constexpr int64_t J = R == 1 ? 4 : R == 2 ? 2 : 1;
  Lanes part[R][KEYS];
  for (int64_t j0 = 0; j0 < KEYS; j0 += J) {
    Lanes acc[R][J];
    for (int r = 0; r < R; ++r)
      for (int64_t jj = 0; jj < J; ++jj) acc[r][jj] = zero_lanes();
    if (j0 < nj)
      for (int64_t c = 0; c < Dp; c += KEYS)
        for (int64_t jj = 0; jj < J; ++jj) {
          // keys past nj: rows of zeros or stale values whose sums are never stored
          const Lanes kc = j0 + jj < nj ? load_lanes(kb + (j0 + jj) * Dp + c) : zero_lanes();
          for (int r = 0; r < R; ++r) acc[r][jj] = madd(acc[r][jj], load_lanes(q + r * Dp + c), kc);
        }
    for (int r = 0; r < R; ++r)
      for (int64_t jj = 0; jj < J; ++jj)
        for (int64_t i = 0; i < PIECES; ++i) part[r][j0 + jj].p[i] = acc[r][jj].p[i];
  }
  for (int r = 0; r < R; ++r) {
    store_lanes(s + r * s_stride, sum_lanes(part[r]));
  }
}

// For R rows at once (their weights p[r][0 .. n), `width` apart): y[r][0 .. DCHUNK) = the sum over keys j
// in slot order of p[r][j] * v[j][0 .. DCHUNK), and l[r] = the sum of p[r][j] in slot order. A key with
// p[r][j] = 0 adds exactly nothing to row r (the sums never hold -0), so keys masked for every row are
// skipped and a key masked for some rows only is added to all: a row's bits do not depend on its
// neighbours. The R rows share each load of a value row and keep 4R independent sums in flight.
template <int R>
inline void weigh_values(const float* __restrict p, int64_t width, int64_t n, const float* __restrict v, int64_t Dv,
                         float* __restrict y, float* __restrict l) {
  Lanes acc[R][DCHUNK / KEYS];
  float sum[R];
  for (int r = 0; r < R; ++r) {
    sum[r] = 0.0f;
    for (auto& a : acc[r]) a = zero_lanes();
  }
  for (int64_t j = 0; j < n; ++j) {
    bool any = false;
    for (int r = 0; r < R; ++r) any |= p[r * width + j] != 0.0f;
    if (!any) continue;
    Lanes vj[DCHUNK / KEYS];
    for (int64_t c = 0; c < DCHUNK / KEYS; ++c) vj[c] = load_lanes(v + j * Dv + c * KEYS);
    for (int r = 0; r < R; ++r) {
      const float pj = p[r * width + j];
      sum[r] = sum[r] + pj;
      for (int64_t c = 0; c < DCHUNK / KEYS; ++c) acc[r][c] = madd(acc[r][c], pj, vj[c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int64_t c = 0; c < DCHUNK / KEYS; ++c) store_lanes(y + r * DCHUNK + c * KEYS, acc[r][c]);
    l[r] = sum[r];
  }
}

// The largest of x[0 .. n) (n a multiple of KEYS); a maximum is exact in any order, so lanes may split it.
inline float row_max(const float* __restrict x, int64_t n) {
  float m[KEYS];
  for (int64_t j = 0; j < KEYS; ++j) m[j] = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; i += KEYS)
    for (int64_t j = 0; j < KEYS; ++j) m[j] = x[i + j] > m[j] ? x[i + j] : m[j];
  float top = m[0];
  for (int64_t j = 1; j < KEYS; ++j) top = m[j] > top ? m[j] : top;
  return top;
}


// Per-thread scratch that grows to the largest call and stays: a decode step calls this once per layer.
inline float* scratch(std::vector<float>& buf, size_t n) {
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

template <typename T>
void attend(const T* q, const T* k, const T* v, const T* mask, T* out, int64_t KV, int64_t M, int64_t S, int64_t D,
            int64_t n, float scale, int64_t mask_rows, int64_t mask_cols) {
  // rows per task: up to 16 (sharing each key's load), fewer where that leaves threads idle (a plain step
  // of a model with 3 kv heads has 3 rows per head: 3 tasks would keep one of 2 threads waiting a third)
  const int64_t want_tasks = 4 * static_cast<int64_t>(at::get_num_threads());
  int64_t rows_per_task = std::max<int64_t>(1, std::min(MAX_ROWS_PER_TASK, (KV * M) / want_tasks));
  if (rows_per_task > 4) rows_per_task -= rows_per_task % 4;  // whole groups of 4 rows sharing key loads
  const int64_t groups = (M + rows_per_task - 1) / rows_per_task;
  const int64_t blocks = (n + KEYS - 1) / KEYS, width = blocks * KEYS;
  const int64_t Dk = (D + KEYS - 1) / KEYS * KEYS;        // query and key rows padded with zeros to whole vectors
  const int64_t Dv = (D + DCHUNK - 1) / DCHUNK * DCHUNK;  // value rows padded to whole chunks
  // float32 rows already whole are read in place; others are converted (and padded) once per call
  constexpr bool is_float = std::is_same<T, float>::value;
  const bool keys_in_place = is_float && Dk == D, values_in_place = is_float && Dv == D;
  // the calling thread's scratch (a thread_local named inside the pool's lambda would be each worker's own)
  thread_local std::vector<float> key_buf, value_buf;
  float* key_f = keys_in_place ? nullptr : scratch(key_buf, KV * n * Dk);
  float* value_f = values_in_place ? nullptr : scratch(value_buf, KV * n * Dv);
  const float* keys = keys_in_place ? reinterpret_cast<const float*>(k) : key_f;
  const float* values = values_in_place ? reinterpret_cast<const float*>(v) : value_f;
  if (!keys_in_place || !values_in_place)
    at::parallel_for(0, KV, 1, [&](int64_t h0, int64_t h1) {
      for (int64_t h = h0; h < h1; ++h)
        for (int64_t j = 0; j < n; ++j) {
          const T* kj = k + (h * S + j) * D;
          const T* vj = v + (h * S + j) * D;
          if (!keys_in_place) {
            float* kf = key_f + (h * n + j) * Dk;
            to_floats(kj, kf, D);
            std::fill(kf + D, kf + Dk, 0.0f);
          }
          if (!values_in_place) {
            float* vf = value_f + (h * n + j) * Dv;
            to_floats(vj, vf, D);
            std::fill(vf + D, vf + Dv, 0.0f);
          }
        }
    });
  // in place, a head's rows are S apart; converted, n apart
  const int64_t key_head = keys_in_place ? S * D : n * Dk, value_head = values_in_place ? S * D : n * Dv;
  at::parallel_for(0, KV * groups, 1, [&](int64_t t0, int64_t t1) {
    thread_local std::vector<float> q_buf, score_buf;
    float* qf = scratch(q_buf, rows_per_task * Dk);
    float* sc = scratch(score_buf, rows_per_task * width);
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t h = task / groups, r0 = (task % groups) * rows_per_task;
      const int64_t rows = std::min(rows_per_task, M - r0);
      const float* krows = keys + h * key_head;
      const float* vrows = values + h * value_head;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t d = 0; d < Dk; ++d) qf[r * Dk + d] = d < D ? to_float(q[(h * M + r0 + r) * D + d]) : 0.0f;
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t j0 = b * KEYS, nj = std::min(KEYS, n - j0);
        for (int64_t r = 0; r < rows;) {
          const int64_t R = std::min<int64_t>(4, rows - r);
          const float* qr = qf + r * Dk;
          float* sr = sc + r * width + j0;
          switch (R) {
            case 4: score_block<4>(qr, Dk, krows + j0 * Dk, nj, sr, width); break;
            case 3: score_block<3>(qr, Dk, krows + j0 * Dk, nj, sr, width); break;
            case 2: score_block<2>(qr, Dk, krows + j0 * Dk, nj, sr, width); break;
            default: score_block<1>(qr, Dk, krows + j0 * Dk, nj, sr, width);
          }
          r += R;
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* sr = sc + r * width;
        // the mask as stored: [mask_rows, mask_cols], a dimension of size 1 broadcast
        const T* mr = mask + (mask_rows > 1 ? (r0 + r) * mask_cols : 0);
        for (int64_t j = 0; j < n; ++j) sr[j] = sr[j] * scale + to_float(mr[mask_cols > 1 ? j : 0]);
        for (int64_t j = n; j < width; ++j) sr[j] = -std::numeric_limits<float>::infinity();
        const float m = row_max(sr, width);
        for (int64_t j = 0; j < width; ++j) sr[j] = sr[j] - m;
        exp_nonpositive(sr, width);
      }
      for (int64_t r = 0; r < rows;) {
        const int64_t R = std::min<int64_t>(WEIGH_ROWS, rows - r);
        for (int64_t d0 = 0; d0 < D; d0 += DCHUNK) {
          float y[4 * DCHUNK], l[4];
          const float* pr = sc + r * width;
          const int64_t vstride = values_in_place ? D : Dv;
          switch (R) {
            case 4: weigh_values<WEIGH_ROWS >= 4 ? 4 : 1>(pr, width, n, vrows + d0, vstride, y, l); break;
            case 3: weigh_values<WEIGH_ROWS >= 3 ? 3 : 1>(pr, width, n, vrows + d0, vstride, y, l); break;
            case 2: weigh_values<2>(pr, width, n, vrows + d0, vstride, y, l); break;
            default: weigh_values<1>(pr, width, n, vrows + d0, vstride, y, l);
          }
          for (int64_t i = 0; i < R; ++i) {
            const int64_t o = (h * M + r0 + r + i) * D;
            for (int64_t d = 0; d < std::min(DCHUNK, D - d0); ++d) out[o + d0 + d] = static_cast<T>(y[i * DCHUNK + d] / l[i]);
          }
        }
        r += R;
      }
    }
  });
}

at::Tensor rows_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                          double scale, const c10::optional<at::Tensor>& kv_len) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && mask.device().is_cpu(),
              "rows_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 4 && q.size(0) == 1 && k.dim() == 4 && k.sizes() == v.sizes() && k.size(0) == 1 &&
                  k.size(1) == q.size(1) && k.size(3) == q.size(3),
              "rows_attention: q must be [1, KV, M, D] and k, v [1, KV, S, D]");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                  q.scalar_type() == mask.scalar_type(),
              "rows_attention: q, k, v and the mask must share a dtype");
  const int64_t KV = q.size(1), M = q.size(2), D = q.size(3), S = k.size(2);
  TORCH_CHECK(mask.dim() == 4 && mask.size(0) == 1 && mask.size(1) == 1 && (mask.size(2) == 1 || mask.size(2) == M) &&
                  (mask.size(3) == 1 || mask.size(3) == S),
              "rows_attention: the mask must broadcast to [1, 1, M, S]");
  int64_t n = S;
  if (kv_len.has_value()) n = std::min<int64_t>(S, std::max<int64_t>(1, kv_len->item<int64_t>()));
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  // mask rows and columns as stored (a broadcast dimension of size 1 is read at index 0)
  const at::Tensor mc = mask.contiguous();
  at::Tensor out = at::empty_like(qc);
  const auto run = [&](auto zero) {
    using T = decltype(zero);
    attend<T>(qc.data_ptr<T>(), kc.data_ptr<T>(), vc.data_ptr<T>(), mc.data_ptr<T>(), out.data_ptr<T>(), KV, M, S,
              D, n, static_cast<float>(scale), mc.size(2), mc.size(3));
  };
  switch (q.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, "rows_attention: float32, bfloat16 or float16 only");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specc_cpu, lib) {
  lib.def("rows_attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scale, Tensor? kv_len=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(specc_cpu, CPU, lib) { lib.impl("rows_attention", &rows_attention); }
