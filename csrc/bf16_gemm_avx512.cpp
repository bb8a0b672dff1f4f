// The bf16 kernel for AVX-512 CPUs: a panel's 16 columns are one zmm; blocks of up to 12 rows.
// Plain AVX-512F widening (vpmovzxwd + shift), so any AVX-512 CPU runs it, AVX512-BF16 or not.
#pragma GCC target("avx512f,avx512bw,avx2,fma,f16c")
#include <immintrin.h>

#include "bf16_gemm.h"

namespace pagedllm {
namespace bf16 {
namespace {
typedef __m512 vf;
constexpr int VW = 16;
constexpr int NV = 1;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset1(float x) { return _mm512_set1_ps(x); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf load_bf16(const uint16_t* p, int) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
}  // namespace
}  // namespace bf16
}  // namespace pagedllm

#include "bf16_gemm_kernel.h"

namespace pagedllm {
namespace bf16 {
void panels_avx512(const Args& a, int64_t p_begin, int64_t p_end) {
  panels_for<1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12>(a, p_begin, p_end);
}
}  // namespace bf16
}  // namespace pagedllm
