// The GEMM for AVX2 + FMA CPUs: 16-column panels (2 ymm), blocks of up to 6 rows (12 ymm of sums,
// 2 of panel, 1 broadcast: 15 of the 16 registers). Compiled for that target by the pragma below.
#pragma GCC target("avx2,fma")
#include <immintrin.h>

#include "cpu_gemm.h"

namespace pagedllm {
namespace gemm {
namespace {
typedef __m256 vf;
constexpr int VW = 8;
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf vset1(float x) { return _mm256_set1_ps(x); }
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
}  // namespace
}  // namespace gemm
}  // namespace pagedllm

#include "cpu_gemm_kernel.h"

namespace pagedllm {
namespace gemm {
static_assert(NR == kNrAvx2, "panel width");
void gemm_panels_avx2(const Args& args, int64_t p_begin, int64_t p_end) {
  panels<false, 1, 2, 3, 4, 5, 6>(args, p_begin, p_end);
}
void gemm_panels_invariant_avx2(const Args& args, int64_t p_begin, int64_t p_end) {
  panels<true, 1, 2, 3, 4, 5, 6>(args, p_begin, p_end);
}
}  // namespace gemm
}  // namespace pagedllm
