// The GEMM for AVX-512 CPUs: 32-column panels (2 zmm), blocks of up to 14 rows (28 zmm of sums,
// 2 of panel, 1 broadcast: 31 of the 32 registers). Compiled for that target by the pragma below,
// independent of the build's flags; the op calls it only where the CPU reports avx512f.
#pragma GCC target("avx512f,avx2,fma")
#include <immintrin.h>

#include "cpu_gemm.h"

namespace pagedllm {
namespace gemm {
namespace {
typedef __m512 vf;
constexpr int VW = 16;
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf vset1(float x) { return _mm512_set1_ps(x); }
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
}  // namespace
}  // namespace gemm
}  // namespace pagedllm

#include "cpu_gemm_kernel.h"

namespace pagedllm {
namespace gemm {
static_assert(NR == kNrAvx512, "panel width");
void gemm_panels_avx512(const Args& args, int64_t p_begin, int64_t p_end) {
  panels<false, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14>(args, p_begin, p_end);
}
void gemm_panels_invariant_avx512(const Args& args, int64_t p_begin, int64_t p_end) {
  panels<true, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14>(args, p_begin, p_end);
}
}  // namespace gemm
}  // namespace pagedllm
