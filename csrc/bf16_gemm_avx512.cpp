// The bf16 kernel for AVX-512 CPUs: a panel's 16 columns are one zmm; blocks of up to 12 rows.
// Plain AVX-512F widening (a shift and a mask), so any AVX-512 CPU runs it, AVX512-BF16 or not.
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
inline void load_pair(const uint16_t* p, int, vf& w0, vf& w1) {
  const __m512i lanes = _mm512_loadu_si512(p);
  w0 = _mm512_castsi512_ps(_mm512_slli_epi32(lanes, 16));
  w1 = _mm512_castsi512_ps(_mm512_and_si512(lanes, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
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
