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
// sums the same terms in other lanes. Here every sum runs over the keys one after the other in slot
// order, and every other operation acts on one value at a time:
//   score_j = (sum over d, in order, of q_d * k_jd) * scale + mask_j   (16 keys per vector, a lane each)
//   m = max_j score_j;  p_j = exp(score_j - m)                         (exp: one formula per value)
//   l = sum_j p_j;  acc_d = sum_j p_j * v_jd   (in slot order; p_j = 0 adds nothing and is skipped)
//   out_d = acc_d / l, rounded to the query's dtype.
// Masked keys (mask -1e9) give p_j = 0 exactly, so a tree's interleaved masked slots and the masked
// tail after the last key read add nothing, and the row's visible keys are summed in the same order
// as plain decoding sums them (context, then the path's nodes by depth). All in float32, products and
// sums rounded separately (built with -ffp-contract=off): vector code and scalar code agree bit for bit.
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

namespace {

constexpr int64_t KEYS = 16;  // keys per block: the lanes of one score vector (a whole line of fp32)
constexpr int64_t ROWS_PER_TASK = 16;  // query rows of one kv head per task of the thread pool

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

// Keys j0 .. j0 + nj of one head, transposed to kt[d * KEYS + j] in float (zeros past nj).
template <typename T>
inline void transpose_keys(const T* __restrict k, int64_t nj, int64_t D, float* __restrict kt) {
  for (int64_t j = 0; j < nj; ++j)
    for (int64_t d = 0; d < D; ++d) kt[d * KEYS + j] = to_float(k[j * D + d]);
  for (int64_t j = nj; j < KEYS; ++j)
    for (int64_t d = 0; d < D; ++d) kt[d * KEYS + j] = 0.0f;
}

// Sixteen float32 lanes (GCC's and Clang's vector extension: one AVX-512 register, two AVX2 ones, four
// NEON ones). Each lane is its own value: +, * act lane by lane, rounded as scalar code rounds.
typedef float Lanes __attribute__((vector_size(KEYS * sizeof(float))));

inline Lanes load_lanes(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// R rows' scores against one transposed block of keys: s[r][j] = sum over d, in order, of q[r][d] * k[j][d].
template <int R>
inline void score_block(const float* __restrict q, int64_t D, const float* __restrict kt, float* __restrict s) {
  Lanes acc[R];
  for (int r = 0; r < R; ++r) acc[r] = Lanes{} ;
  for (int64_t d = 0; d < D; ++d) {
    const Lanes kd = load_lanes(kt + d * KEYS);
    for (int r = 0; r < R; ++r) acc[r] = acc[r] + q[r * D + d] * kd;
  }
  for (int r = 0; r < R; ++r) std::memcpy(s + r * KEYS, &acc[r], sizeof(Lanes));
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

constexpr int64_t DCHUNK = 64;  // output values of one row kept in registers while the keys go by

template <typename T>
void attend(const T* q, const T* k, const T* v, const T* mask, T* out, int64_t KV, int64_t M, int64_t S, int64_t D,
            int64_t n, float scale, int64_t mask_rows, int64_t mask_cols) {
  const int64_t groups = (M + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
  const int64_t blocks = (n + KEYS - 1) / KEYS, width = blocks * KEYS;
  const int64_t Dp = (D + DCHUNK - 1) / DCHUNK * DCHUNK;  // value rows padded with zeros to whole chunks
  at::parallel_for(0, KV * groups, 1, [&](int64_t t0, int64_t t1) {
    // float32 values whose rows are whole chunks are read in place; others are converted (and padded) once per task
    constexpr bool in_place_ok = std::is_same<T, float>::value;
    const bool in_place = in_place_ok && Dp == D;
    std::vector<float> kt(D * KEYS), qf(ROWS_PER_TASK * D), sc(ROWS_PER_TASK * width), vf(in_place ? 0 : n * Dp, 0.0f),
        s(4 * KEYS);
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t h = task / groups, r0 = (task % groups) * ROWS_PER_TASK;
      const int64_t rows = std::min(ROWS_PER_TASK, M - r0);
      const T* kh = k + h * S * D;
      const T* vh = v + h * S * D;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t d = 0; d < D; ++d) qf[r * D + d] = to_float(q[(h * M + r0 + r) * D + d]);
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t j0 = b * KEYS, nj = std::min(KEYS, n - j0);
        transpose_keys(kh + j0 * D, nj, D, kt.data());
        for (int64_t r = 0; r < rows;) {
          const int64_t R = rows - r >= 4 ? 4 : 1;  // four rows share each load of the keys
          if (R == 4) score_block<4>(&qf[r * D], D, kt.data(), s.data());
          else score_block<1>(&qf[r * D], D, kt.data(), s.data());
          for (int64_t i = 0; i < R; ++i, ++r) {
            // the mask as stored: [mask_rows, mask_cols], a dimension of size 1 broadcast
            const T* mr = mask + (mask_rows > 1 ? (r0 + r) * mask_cols : 0);
            float* sr = &sc[r * width + j0];
            for (int64_t j = 0; j < nj; ++j) sr[j] = s[i * KEYS + j] * scale + to_float(mr[mask_cols > 1 ? j0 + j : 0]);
            for (int64_t j = nj; j < KEYS; ++j) sr[j] = -std::numeric_limits<float>::infinity();
          }
        }
      }
      const float* vrows = vf.data();
      if (in_place) vrows = reinterpret_cast<const float*>(vh);
      else
        for (int64_t j = 0; j < n; ++j)
          for (int64_t d = 0; d < D; ++d) vf[j * Dp + d] = to_float(vh[j * D + d]);
      for (int64_t r = 0; r < rows; ++r) {
        float* sr = &sc[r * width];
        const float m = row_max(sr, width);
        for (int64_t j = 0; j < width; ++j) sr[j] = sr[j] - m;
        exp_nonpositive(sr, width);
        float l = 0.0f;  // in slot order; a masked key's 0 adds nothing
        for (int64_t j = 0; j < n; ++j) l = l + sr[j];
        const int64_t o = (h * M + r0 + r) * D;
        for (int64_t d0 = 0; d0 < D; d0 += DCHUNK) {
          Lanes acc[DCHUNK / KEYS];
          for (auto& a : acc) a = Lanes{};
          for (int64_t j = 0; j < n; ++j) {  // in slot order, skipping the keys masked for this row
            const float p = sr[j];
            if (p == 0.0f) continue;
            const float* vj = vrows + j * Dp + d0;
            for (int64_t c = 0; c < DCHUNK / KEYS; ++c) acc[c] = acc[c] + p * load_lanes(vj + c * KEYS);
          }
          float y[DCHUNK];
          std::memcpy(y, acc, sizeof(y));
          for (int64_t d = 0; d < std::min(DCHUNK, D - d0); ++d) out[o + d0 + d] = static_cast<T>(y[d] / l);
        }
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
