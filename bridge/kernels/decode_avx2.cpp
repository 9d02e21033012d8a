// Int4 weight-only GEMV for few-token decode on AVX2 + FMA CPUs (built and documented by decode.py).
//
// y[m, n] = sum_g scale[n, g] * sum_{k in g} x[m, k] * nib[n, k]  +  sum_g mzero[n, g] * xsum[m, g]
//         = sum_k x[m, k] * (nib[n, k] * scale[n, g] + mzero[n, g])        (mzero = -scale * zero),
// so the scale is applied once per group and the zero point through per-group sums of x. Weights
// are read once per call at 4 bits (with software prefetch), tokens are taken two at a time.
//
// Two variants, each with its own packed layout (rows in tiles of R = 4; the tile streams linearly):
// * int4_gemv (exact): fp32 FMA over codes widened to fp32. Block of 16 features, 8 bytes per row:
//   byte j = nib[16 b + j] | nib[16 b + 8 + j] << 4; packed (tiles, K/16, 4, 8).
// * int4_gemv_i16: x rounded to int16 per (token, group) (scale max|x_g| / 32767, error at most
//   2^-16 max|x_g| per element), codes widened to int16, vpmaddwd into int32 per group, then fp32.
//   Block of 32 features, 16 bytes per row: byte j = nib[32 b + j] | nib[32 b + 16 + j] << 4;
//   packed (tiles, K/32, 4, 16). Groups of at most 4096 features (a row's int32 group sum
//   stays below 2^31; decode.py splits longer groups).
// scale and mzero are fp32 (tiles, groups, 4) for both.
#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t R = 4;     // rows per tile
constexpr int64_t PF = 4096; // software prefetch distance (bytes of packed weight), measured

inline void prefetch(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p + PF), _MM_HINT_T0); }

// What a tile kernel reads: one tile's weight, scales, and MT tokens' inputs from token m.
struct TileArgs {
  const uint8_t* w;
  const float* sc;
  const float* mz;
  const float* x;      // fp32 tokens (exact variant)
  const int16_t* xq;   // int16 tokens (i16 variant)
  const float* xscale; // (M, G) int16 scales
  const float* xs;     // (M, G) group sums of x
  int64_t K, G, bpg;   // in_features, groups, blocks per group
};

// The 8 lanes of four rows' accumulators summed per row: (a0, a1, a2, a3) -> (sum a0, .., sum a3).
inline __m128i rowsum4(__m256i a0, __m256i a1, __m256i a2, __m256i a3) {
  const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(a0, a1), _mm256_hadd_epi32(a2, a3));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

inline __m128 rowsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Exact variant, MT tokens (1 or 2). One token keeps separate low/high accumulators (8 FMA chains).
template <int MT>
void tile_f32(const TileArgs& a, float* y) {
  __m128 tot[MT];  // four rows' sums (the zero-point term included)
  for (int m = 0; m < MT; ++m) tot[m] = _mm_setzero_ps();
  const __m256i m4 = _mm256_set1_epi32(15);
  for (int64_t gi = 0; gi < a.G; ++gi) {
    __m256 lo_acc[MT][R], hi_acc[MT][R];
    for (int m = 0; m < MT; ++m)
      for (int r = 0; r < R; ++r) lo_acc[m][r] = hi_acc[m][r] = _mm256_setzero_ps();
    for (int64_t b = gi * a.bpg; b < (gi + 1) * a.bpg; ++b) {
      const uint8_t* p = a.w + b * 32;
      prefetch(p);
      for (int r = 0; r < R; ++r) {
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * r)));
        const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, m4));
        const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
        for (int m = 0; m < MT; ++m) {
          const float* xm = a.x + m * a.K + b * 16;
          if constexpr (MT == 1) {
            lo_acc[m][r] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xm), lo_acc[m][r]);
            hi_acc[m][r] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xm + 8), hi_acc[m][r]);
          } else {  // one accumulator per (token, row): 8 registers for two tokens
            lo_acc[m][r] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xm), lo_acc[m][r]);
            lo_acc[m][r] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xm + 8), lo_acc[m][r]);
          }
        }
      }
    }
    for (int m = 0; m < MT; ++m) {
      __m256 acc[R];
      for (int r = 0; r < R; ++r) acc[r] = MT == 1 ? _mm256_add_ps(lo_acc[m][r], hi_acc[m][r]) : lo_acc[m][r];
      const __m128 d = rowsum4(acc[0], acc[1], acc[2], acc[3]);
      tot[m] = _mm_fmadd_ps(d, _mm_loadu_ps(a.sc + gi * R), tot[m]);
      tot[m] = _mm_fmadd_ps(_mm_loadu_ps(a.mz + gi * R), _mm_set1_ps(a.xs[m * a.G + gi]), tot[m]);
    }
  }
  for (int m = 0; m < MT; ++m) _mm_storeu_ps(y + m * R, tot[m]);
}

// int16 variant, MT tokens (1 or 2): 32 products per vpmaddwd pair, int32 per group, then fp32.
template <int MT>
void tile_i16(const TileArgs& a, float* y) {
  __m128 tot[MT];  // four rows' sums (the zero-point term included)
  for (int m = 0; m < MT; ++m) tot[m] = _mm_setzero_ps();
  const __m256i m4 = _mm256_set1_epi16(15);
  for (int64_t gi = 0; gi < a.G; ++gi) {
    __m256i acc[MT][R];
    for (int m = 0; m < MT; ++m)
      for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_si256();
    for (int64_t b = gi * a.bpg; b < (gi + 1) * a.bpg; ++b) {
      const uint8_t* p = a.w + b * 64;
      prefetch(p);
      __m256i xl[MT], xh[MT];
      for (int m = 0; m < MT; ++m) {
        xl[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.xq + m * a.K + b * 32));
        xh[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.xq + m * a.K + b * 32 + 16));
      }
      for (int r = 0; r < R; ++r) {
        const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * r)));
        const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_srli_epi16(v, 4);
        for (int m = 0; m < MT; ++m)
          acc[m][r] = _mm256_add_epi32(acc[m][r], _mm256_add_epi32(_mm256_madd_epi16(lo, xl[m]),
                                                                    _mm256_madd_epi16(hi, xh[m])));
      }
    }
    for (int m = 0; m < MT; ++m) {  // exact int32 row sums, then scale * xscale in fp32
      const __m128 d = _mm_cvtepi32_ps(rowsum4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));
      const __m128 s = _mm_mul_ps(_mm_loadu_ps(a.sc + gi * R), _mm_set1_ps(a.xscale[m * a.G + gi]));
      tot[m] = _mm_fmadd_ps(d, s, tot[m]);
      tot[m] = _mm_fmadd_ps(_mm_loadu_ps(a.mz + gi * R), _mm_set1_ps(a.xs[m * a.G + gi]), tot[m]);
    }
  }
  for (int m = 0; m < MT; ++m) _mm_storeu_ps(y + m * R, tot[m]);
}

// Checks shared by both ops; returns (M, K, tiles, groups).
std::array<int64_t, 4> check(const char* op, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                             const at::Tensor& mzero, int64_t group, int64_t n, int64_t block, int64_t max_group) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.is_cpu(), op,
              ": x must be a contiguous 2-D float32 CPU tensor");
  TORCH_CHECK(packed.is_cpu() && scale.is_cpu() && mzero.is_cpu(), op, ": the packed weight must be on the CPU");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 4 &&
                  packed.size(2) == R && packed.size(3) == block / 2,
              op, ": packed must be contiguous uint8 (tiles, K/", block, ", 4, ", block / 2, ")");
  const int64_t M = x.size(0), K = x.size(1), T = packed.size(0);
  TORCH_CHECK(K == packed.size(1) * block && group > 0 && group % block == 0 && K % group == 0 && group <= max_group,
              op, ": in_features ", K, " and group ", group, " do not match the packed weight");
  const int64_t G = K / group;
  TORCH_CHECK(scale.scalar_type() == at::kFloat && mzero.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  mzero.is_contiguous() && scale.numel() == T * G * R && mzero.numel() == T * G * R &&
                  n > (T - 1) * R && n <= T * R,
              op, ": scale / mzero must be contiguous float32 (tiles, groups, 4) for ", n, " rows");
  return {M, K, T, G};
}

// Runs tile kernels over all tiles (threads split the tiles) and tokens (two at a time).
template <class F1, class F2>
void drive(int64_t M, int64_t K, int64_t T, int64_t n, float* yp, F1 one, F2 two) {
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / (R * K));
  at::parallel_for(0, T, grain, [&](int64_t t0, int64_t t1) {
    float buf[2 * R];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t rows = std::min<int64_t>(R, n - t * R);
      for (int64_t m = 0; m < M; m += 2) {
        const int64_t mt = std::min<int64_t>(2, M - m);
        if (mt == 2) two(t, m, buf); else one(t, m, buf);
        for (int64_t i = 0; i < mt; ++i)
          for (int64_t r = 0; r < rows; ++r) yp[(m + i) * n + t * R + r] = buf[i * R + r];
      }
    }
  });
}

at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                     const at::Tensor& mzero, int64_t group, int64_t n) {
  const auto [M, K, T, G] = check("int4_gemv", x, packed, scale, mzero, group, n, 16, INT64_MAX);
  at::Tensor y = at::empty({M, n}, x.options());
  if (M == 0 || n == 0) return y;
  at::Tensor xs = x.view({M, G, group}).sum(-1).contiguous();
  TileArgs a{packed.data_ptr<uint8_t>(), scale.data_ptr<float>(), mzero.data_ptr<float>(), x.data_ptr<float>(),
             nullptr, nullptr, xs.data_ptr<float>(), K, G, group / 16};
  auto at_tile = [&](int64_t t, int64_t m) {
    TileArgs b = a;
    b.w += t * K * 2, b.sc += t * G * R, b.mz += t * G * R, b.x += m * K, b.xs += m * G;
    return b;
  };
  drive(M, K, T, n, y.data_ptr<float>(), [&](int64_t t, int64_t m, float* o) { tile_f32<1>(at_tile(t, m), o); },
        [&](int64_t t, int64_t m, float* o) { tile_f32<2>(at_tile(t, m), o); });
  return y;
}

at::Tensor int4_gemv_i16(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                         const at::Tensor& mzero, int64_t group, int64_t n) {
  const auto [M, K, T, G] = check("int4_gemv_i16", x, packed, scale, mzero, group, n, 32, 4096);
  at::Tensor y = at::empty({M, n}, x.options());
  if (M == 0 || n == 0) return y;
  std::vector<int16_t> xq(M * K);
  std::vector<float> xscale(M * G), xs(M * G);
  const float* xp = x.data_ptr<float>();
  for (int64_t i = 0; i < M * G; ++i) {  // per (token, group): int16 codes, their scale, the fp32 sum
    const float* xg = xp + i * group;
    float amax = 0.f, sum = 0.f;
    for (int64_t j = 0; j < group; ++j) {
      amax = std::max(amax, std::abs(xg[j]));
      sum += xg[j];
    }
    const float s = amax > 0.f ? amax / 32767.f : 1.f, inv = 1.f / s;
    xscale[i] = s;
    xs[i] = sum;
    for (int64_t j = 0; j < group; ++j) xq[i * group + j] = static_cast<int16_t>(std::nearbyint(xg[j] * inv));
  }
  TileArgs a{packed.data_ptr<uint8_t>(), scale.data_ptr<float>(), mzero.data_ptr<float>(), nullptr,
             xq.data(), xscale.data(), xs.data(), K, G, group / 32};
  auto at_tile = [&](int64_t t, int64_t m) {
    TileArgs b = a;
    b.w += t * K * 2, b.sc += t * G * R, b.mz += t * G * R, b.xq += m * K, b.xscale += m * G, b.xs += m * G;
    return b;
  };
  drive(M, K, T, n, y.data_ptr<float>(), [&](int64_t t, int64_t m, float* o) { tile_i16<1>(at_tile(t, m), o); },
        [&](int64_t t, int64_t m, float* o) { tile_i16<2>(at_tile(t, m), o); });
  return y;
}

}  // namespace

TORCH_LIBRARY(qtransform_decode, m) {
  m.def("int4_gemv(Tensor x, Tensor packed, Tensor scale, Tensor mzero, int group, int n) -> Tensor");
  m.def("int4_gemv_i16(Tensor x, Tensor packed, Tensor scale, Tensor mzero, int group, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(qtransform_decode, CPU, m) {
  m.impl("int4_gemv", &int4_gemv);
  m.impl("int4_gemv_i16", &int4_gemv_i16);
}

// Direct Python bindings: eager calls skip the dispatcher (a few microseconds on small layers);
// torch.compile goes through the registered ops above.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_gemv", &int4_gemv);
  m.def("int4_gemv_i16", &int4_gemv_i16);
}
