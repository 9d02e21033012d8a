// W8A8 int8 with dynamic per-token inputs on AVX2 CPUs (built and documented by int8dyn.py).
//
// Each token (row of x) is quantized as qtransform's general path does for an int8 PerChannel(0)
// dynamic spec (min/max observer, float32 scales, round half to even):
// * symmetric: scale = max(max(-min, max) / half, FLT_MIN), code = rne(clamp(x / scale, qlo, 127));
// * asymmetric (integer zero point): lo = min(min, 0), hi = max(max, 0), scale = max(w / 255, FLT_MIN)
//   with w = hi - lo (hi / 255 - lo / 255 when that overflows), zero = clamp(-128 - rne(lo / scale),
//   -128, 127), code = rne(clamp(x / scale + zero, -128, 127)).
// Then y[m, n] = float(sum_k a[m, k] b[n, k] - zero[m] rowsum[n]) * scale[m] * wscale[n], the int32
// sum exact (codes widened to int16, _mm256_madd_epi16: AVX2 has no int8 dot product without VNNI):
// the same numbers as torch._int_mm on the same codes (int8mm.py). A row with a non-finite value
// makes the op return ok = false (the caller takes the general path, which raises).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t R = 4;  // weight rows per tile

struct RowParams {
  float scale, zero;
};

inline float hmin(__m256 v) {
  __m128 a = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_min_ps(a, _mm_movehl_ps(a, a));
  a = _mm_min_ss(a, _mm_shuffle_ps(a, a, 1));
  return _mm_cvtss_f32(a);
}

inline float hmax(__m256 v) {
  __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_max_ps(a, _mm_movehl_ps(a, a));
  a = _mm_max_ss(a, _mm_shuffle_ps(a, a, 1));
  return _mm_cvtss_f32(a);
}

// Scale and zero point of one row (false: a non-finite value).
bool row_params(const float* x, int64_t K, bool symmetric, float half, RowParams& p) {
  __m256 vmin = _mm256_set1_ps(INFINITY), vmax = _mm256_set1_ps(-INFINITY), bad = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256 v = _mm256_loadu_ps(x + k);
    vmin = _mm256_min_ps(vmin, v);
    vmax = _mm256_max_ps(vmax, v);
    const __m256 d = _mm256_sub_ps(v, v);  // NaN for Inf and NaN
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(d, d, _CMP_UNORD_Q));
  }
  float lo = hmin(vmin), hi = hmax(vmax);
  bool finite = _mm256_movemask_ps(bad) == 0;
  for (; k < K; ++k) {
    finite = finite && std::isfinite(x[k]);
    lo = std::min(lo, x[k]);
    hi = std::max(hi, x[k]);
  }
  if (!finite || K == 0) return false;
  if (symmetric) {
    const float amax = std::max(-lo, hi);
    p.scale = std::max(amax / half, FLT_MIN);
    p.zero = 0.f;
    return true;
  }
  lo = std::min(lo, 0.f);
  hi = std::max(hi, 0.f);
  const float w = hi - lo;
  const float ideal = std::isinf(w) ? hi / 255.f - lo / 255.f : w / 255.f;
  p.scale = std::max(ideal, FLT_MIN);
  p.zero = std::min(std::max(-128.f - std::nearbyint(lo / p.scale), -128.f), 127.f);
  return true;
}

// Codes of one row as int16 (what the dot product reads).
void row_codes(const float* x, int64_t K, const RowParams& p, float qlo, int16_t* out) {
  const __m256 vs = _mm256_set1_ps(p.scale), vz = _mm256_set1_ps(p.zero);
  const __m256 vlo = _mm256_set1_ps(qlo), vhi = _mm256_set1_ps(127.f);
  const bool asym = p.zero != 0.f;
  auto code8 = [&](const float* xp) {
    __m256 v = _mm256_div_ps(_mm256_loadu_ps(xp), vs);
    if (asym) v = _mm256_add_ps(v, vz);
    v = _mm256_min_ps(_mm256_max_ps(v, vlo), vhi);
    return _mm256_cvtps_epi32(_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  };
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m256i c = _mm256_permute4x64_epi64(_mm256_packs_epi32(code8(x + k), code8(x + k + 8)), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k), c);
  }
  for (; k < K; ++k) {
    float v = x[k] / p.scale;
    if (asym) v = v + p.zero;
    out[k] = static_cast<int16_t>(std::nearbyint(std::min(std::max(v, qlo), 127.f)));
  }
}

// Quantize all rows: int16 codes (M, K), params; false when a row is not finite.
bool quantize_rows(const at::Tensor& x, bool symmetric, double qlo, double half, std::vector<int16_t>& codes,
                   std::vector<RowParams>& params) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.is_cpu(),
              "int8dyn: x must be a contiguous 2-D float32 CPU tensor");
  TORCH_CHECK(qlo == -128.0 || qlo == -127.0, "int8dyn: qlo must be -128 or -127");
  const int64_t M = x.size(0), K = x.size(1);
  codes.resize(M * K);
  params.resize(M);
  const float* xp = x.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    if (!row_params(xp + m * K, K, symmetric, static_cast<float>(half), params[m])) return false;
    row_codes(xp + m * K, K, params[m], static_cast<float>(qlo), codes.data() + m * K);
  }
  return true;
}

// (codes int8 (M, K), scale (M, 1) fp32, zero (M, 1) fp32, ok)
std::tuple<at::Tensor, at::Tensor, at::Tensor, bool> quantize_tokens(const at::Tensor& x, bool symmetric, double qlo,
                                                                     double half) {
  std::vector<int16_t> c;
  std::vector<RowParams> p;
  const bool ok = quantize_rows(x, symmetric, qlo, half, c, p);
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor codes = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor scale = at::empty({M, 1}, x.options()), zero = at::empty({M, 1}, x.options());
  if (!ok) return {codes, scale, zero, false};
  int8_t* cp = codes.data_ptr<int8_t>();
  for (int64_t i = 0; i < M * K; ++i) cp[i] = static_cast<int8_t>(c[i]);
  for (int64_t m = 0; m < M; ++m) {
    scale.data_ptr<float>()[m] = p[m].scale;
    zero.data_ptr<float>()[m] = p[m].zero;
  }
  return {codes, scale, zero, true};
}

inline __m128i rowsum4(__m256i a0, __m256i a1, __m256i a2, __m256i a3) {
  const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(a0, a1), _mm256_hadd_epi32(a2, a3));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// Exact int32 dot products of MT tokens (int16 codes) with four weight rows (int8 codes).
template <int MT>
void tile(const int8_t* const* w, const int16_t* xq, int64_t K, int64_t pf, int32_t* out) {
  __m256i acc[MT][R];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_si256();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m256i xv[MT];
    for (int m = 0; m < MT; ++m) xv[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + m * K + k));
    if ((k & 63) == 0)
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(w[r] + k + pf), _MM_HINT_T0);
    for (int r = 0; r < R; ++r) {
      const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w[r] + k)));
      for (int m = 0; m < MT; ++m) acc[m][r] = _mm256_add_epi32(acc[m][r], _mm256_madd_epi16(wv, xv[m]));
    }
  }
  for (int m = 0; m < MT; ++m) {
    alignas(16) int32_t s[R];
    _mm_store_si128(reinterpret_cast<__m128i*>(s), rowsum4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));
    for (int64_t kk = k; kk < K; ++kk)
      for (int r = 0; r < R; ++r) s[r] += int32_t(w[r][kk]) * int32_t(xq[m * K + kk]);
    for (int r = 0; r < R; ++r) out[m * R + r] = s[r];
  }
}

// (y (M, N) fp32, ok): x (M, K) fp32 quantized per token, weight codes (N, K) int8, wscale (N) fp32,
// wrowsum (N) int32 (sum of each weight row's codes, for the zero point); chunk: the least work per thread.
std::tuple<at::Tensor, bool> linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& wscale,
                                    const at::Tensor& wrowsum, bool symmetric, double qlo, double half,
                                    int64_t chunk) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous() && w.is_cpu(),
              "int8dyn.linear: w must be contiguous int8 (N, K) on the CPU");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "int8dyn.linear: x must be (M, ", K, ")");
  TORCH_CHECK(wscale.scalar_type() == at::kFloat && wscale.is_contiguous() && wscale.numel() == N &&
                  wrowsum.scalar_type() == at::kInt && wrowsum.is_contiguous() && wrowsum.numel() == N,
              "int8dyn.linear: wscale (N) float32 and wrowsum (N) int32, contiguous");
  TORCH_CHECK(K <= 65535, "int8dyn.linear: in_features ", K, " > 65535 (int32 sums could overflow)");
  std::vector<int16_t> xq;
  std::vector<RowParams> p;
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (!quantize_rows(x, symmetric, qlo, half, xq, p)) return {y, false};
  if (M == 0 || N == 0) return {y, true};
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sb = wscale.data_ptr<float>();
  const int32_t* rs = wrowsum.data_ptr<int32_t>();
  float* yp = y.data_ptr<float>();
  const int64_t T = (N + R - 1) / R;
  // software prefetch two tiles ahead (the tiles stream linearly): 2.8x on cold weights (SmolLM2's shapes,
  // 1 thread), where the hardware prefetcher alone reached half of fp32 F.linear's bandwidth
  const int64_t pf = 2 * R * K;
  // threads split the tiles in chunks of at least `chunk` multiply-adds (tokens x weights)
  const int64_t grain = std::max<int64_t>(1, chunk / std::max<int64_t>(1, R * K * M));
  at::parallel_for(0, T, grain, [&](int64_t t0, int64_t t1) {
    int32_t acc[2 * R];
    const int8_t* rows[R];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * R, nr = std::min<int64_t>(R, N - n0);
      for (int r = 0; r < R; ++r) rows[r] = wp + (n0 + std::min<int64_t>(r, nr - 1)) * K;
      for (int64_t m = 0; m < M; m += 2) {
        const int64_t mt = std::min<int64_t>(2, M - m);
        if (mt == 2) tile<2>(rows, xq.data() + m * K, K, pf, acc); else tile<1>(rows, xq.data() + m * K, K, pf, acc);
        for (int64_t i = 0; i < mt; ++i) {
          const RowParams& q = p[m + i];
          const int32_t za = static_cast<int32_t>(q.zero);
          for (int64_t r = 0; r < nr; ++r) {
            const int32_t d = acc[i * R + r] - za * rs[n0 + r];
            yp[(m + i) * N + n0 + r] = (static_cast<float>(d) * q.scale) * sb[n0 + r];
          }
        }
      }
    }
  });
  return {y, true};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantize_tokens", &quantize_tokens, "per-token int8 codes, scales and zero points (M, K) fp32 -> ...");
  m.def("linear", &linear, "W8A8 int8 linear with dynamic per-token input quantization");
}
