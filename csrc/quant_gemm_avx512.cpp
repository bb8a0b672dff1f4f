// The quantized kernel for AVX-512 CPUs: a panel's 16 columns are one zmm; blocks of up to 12
// rows (12 sums, 1-2 scales, 2 weights, the bytes: under 32 registers). Compiled for that target
// by the pragma below; the op calls it only where the CPU reports avx512f + avx512bw.
#pragma GCC target("avx512f,avx512bw,avx2,fma,f16c")
#include <immintrin.h>

#include "quant_gemm.h"

namespace pagedllm {
namespace quant {
namespace {
typedef __m512 vf;
typedef __m512i vi;
constexpr int VW = 16;
constexpr int NV = 1;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset1(float x) { return _mm512_set1_ps(x); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf load_f16(const uint8_t* p, int) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline vi load_u8(const uint8_t* p, int) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline vi load_i8(const uint8_t* p, int) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline vi vand15(vi v) { return _mm512_and_si512(v, _mm512_set1_epi32(15)); }
inline vi vshr4(vi v) { return _mm512_srli_epi32(v, 4); }
inline vf vcvt(vi v) { return _mm512_cvtepi32_ps(v); }
}  // namespace
}  // namespace quant
}  // namespace pagedllm

#include "quant_gemm_kernel.h"

namespace pagedllm {
namespace quant {
void quant_panels_avx512(const Args& a, int64_t p_begin, int64_t p_end) {
  switch (a.qtype) {
    case kQ8_0: panels_for<kQ8_0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12>(a, p_begin, p_end); break;
    case kQ4_0: panels_for<kQ4_0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12>(a, p_begin, p_end); break;
    case kQ4_1: panels_for<kQ4_1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12>(a, p_begin, p_end); break;
    case kQX: panels_for<kQX, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12>(a, p_begin, p_end); break;
  }
}
// The batch-invariant order: 4 sets, as the default's 1-row blocks (its batch-1 speed), in
// blocks of up to 6 rows (24 sums).
void quant_panels_invariant_avx512(const Args& a, int64_t p_begin, int64_t p_end) {
  switch (a.qtype) {
    case kQ8_0: panels_for<kQ8_0, 4, 1, 2, 3, 4, 5, 6>(a, p_begin, p_end); break;
    case kQ4_0: panels_for<kQ4_0, 4, 1, 2, 3, 4, 5, 6>(a, p_begin, p_end); break;
    case kQ4_1: panels_for<kQ4_1, 4, 1, 2, 3, 4, 5, 6>(a, p_begin, p_end); break;
    case kQX: panels_for<kQX, 4, 1, 2, 3, 4, 5, 6>(a, p_begin, p_end); break;
  }
}
}  // namespace quant
}  // namespace pagedllm
