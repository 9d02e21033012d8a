// Dequantization of 4-bit codes into a float32 buffer for the many-token path (bridge/kernels/dense.py):
// one pass, AVX2, rows split over threads. codes: (n, k / 2) uint8, low nibble first; scale, offset:
// (n, groups) float32 with value = code * scale + offset; signed: two's complement nibbles.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

// out (n, k) fp32 = field * scale + offset, field = 4-bit code (sign bit flipped when signed)
void dequant_int4(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset, bool sign, at::Tensor& out) {
  const int64_t n = codes.size(0), kh = codes.size(1), k = 2 * kh, G = scale.size(1), g = k / G;
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const float* s = scale.data_ptr<float>();
  const float* f = offset.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const uint8_t flip = sign ? 0x88 : 0;
  at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* cr = c + r * kh;
      float* orow = o + r * k;
      for (int64_t gi = 0; gi < G; ++gi) {
        const float sc = s[r * G + gi];
        const float of = f[r * G + gi] - (sign ? 8.0f * sc : 0.0f);
        const __m256 vs = _mm256_set1_ps(sc), vo = _mm256_set1_ps(of);
        const __m128i mask = _mm_set1_epi8(15), vflip = _mm_set1_epi8((char)flip);
        int64_t j = gi * g / 2, end = (gi + 1) * g / 2;
        for (; j + 8 <= end; j += 8) {
          __m128i b = _mm_loadl_epi64((const __m128i*)(cr + j));
          b = _mm_xor_si128(b, vflip);
          __m128i lo = _mm_and_si128(b, mask);
          __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
          __m128i inter = _mm_unpacklo_epi8(lo, hi);  // 16 fields in order
          __m256 a = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(inter));
          __m256 bb = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(inter, 8)));
          _mm256_storeu_ps(orow + 2 * j, _mm256_fmadd_ps(a, vs, vo));
          _mm256_storeu_ps(orow + 2 * j + 8, _mm256_fmadd_ps(bb, vs, vo));
        }
        for (; j < end; ++j) {
          const uint8_t b = cr[j] ^ flip;
          orow[2 * j] = (b & 15) * sc + of;
          orow[2 * j + 1] = (b >> 4) * sc + of;
        }
      }
    }
  });
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("dequant_int4", &dequant_int4, "4-bit codes (n, k / 2) -> out (n, k) fp32: field * scale + offset");
}
