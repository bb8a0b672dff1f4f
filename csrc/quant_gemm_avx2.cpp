// The quantized kernel for AVX2 + FMA + F16C CPUs: a panel's 16 columns are two ymm; blocks of up
// to 5 rows (10 sums, 2 scales, 2 mins, 2 weights: the 16 registers). Compiled for that target by
// the pragma below.
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include "quant_gemm.h"

namespace pagedllm {
namespace quant {
namespace {
typedef __m256 vf;
typedef __m256i vi;
constexpr int VW = 8;
constexpr int NV = 2;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset1(float x) { return _mm256_set1_ps(x); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf load_f16(const uint8_t* p, int v) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * v)));
}
inline vi load_u8(const uint8_t* p, int v) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * v)));
}
inline vi load_i8(const uint8_t* p, int v) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * v)));
}
inline vi vand15(vi v) { return _mm256_and_si256(v, _mm256_set1_epi32(15)); }
inline vi vshr4(vi v) { return _mm256_srli_epi32(v, 4); }
inline vf vcvt(vi v) { return _mm256_cvtepi32_ps(v); }
}  // namespace
}  // namespace quant
}  // namespace pagedllm

#include "quant_gemm_kernel.h"

namespace pagedllm {
namespace quant {
void quant_panels_avx2(const Args& a, int64_t p_begin, int64_t p_end) {
  switch (a.qtype) {
    case kQ8_0: panels_for<kQ8_0, 0, 1, 2, 3, 4, 5>(a, p_begin, p_end); break;
    case kQ4_0: panels_for<kQ4_0, 0, 1, 2, 3, 4, 5>(a, p_begin, p_end); break;
    case kQ4_1: panels_for<kQ4_1, 0, 1, 2, 3, 4, 5>(a, p_begin, p_end); break;
    case kQX: panels_for<kQX, 0, 1, 2, 3, 4, 5>(a, p_begin, p_end); break;
  }
}
// The batch-invariant order: 2 sets in blocks of up to 2 rows (8 sums).
void quant_panels_invariant_avx2(const Args& a, int64_t p_begin, int64_t p_end) {
  switch (a.qtype) {
    case kQ8_0: panels_for<kQ8_0, 2, 1, 2>(a, p_begin, p_end); break;
    case kQ4_0: panels_for<kQ4_0, 2, 1, 2>(a, p_begin, p_end); break;
    case kQ4_1: panels_for<kQ4_1, 2, 1, 2>(a, p_begin, p_end); break;
    case kQX: panels_for<kQX, 2, 1, 2>(a, p_begin, p_end); break;
  }
}
}  // namespace quant
}  // namespace pagedllm
