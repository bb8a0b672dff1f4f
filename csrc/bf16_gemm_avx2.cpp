// The bf16 kernel for AVX2 + FMA CPUs: a panel's 16 columns are two ymm; blocks of up to 5 rows.
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include "bf16_gemm.h"

namespace pagedllm {
namespace bf16 {
namespace {
typedef __m256 vf;
constexpr int VW = 8;
constexpr int NV = 2;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset1(float x) { return _mm256_set1_ps(x); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline void load_pair(const uint16_t* p, int v, vf& w0, vf& w1) {
  const __m256i lanes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * v));
  w0 = _mm256_castsi256_ps(_mm256_slli_epi32(lanes, 16));
  w1 = _mm256_castsi256_ps(_mm256_and_si256(lanes, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
}  // namespace
}  // namespace bf16
}  // namespace pagedllm

#include "bf16_gemm_kernel.h"

namespace pagedllm {
namespace bf16 {
void panels_avx2(const Args& a, int64_t p_begin, int64_t p_end) {
  panels_for<1, 2, 3, 4, 5>(a, p_begin, p_end);
}
}  // namespace bf16
}  // namespace pagedllm
