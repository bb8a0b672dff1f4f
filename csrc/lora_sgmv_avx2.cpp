// lora_sgmv.h for AVX2 + FMA CPUs: blocks of up to 4 rows x 1 panel (2 ymm, 16 columns): 8 sums, 2 of A
// or B, 1 broadcast. Compiled for that target by the pragma below.
#pragma GCC target("avx2,fma")
#include <immintrin.h>

#include "lora_sgmv.h"

namespace pagedllm {
namespace sgmv {
namespace {
typedef __m256 vf;
typedef __m256i vm;
constexpr int VW = 8;
constexpr int GROUP = kGroupAvx2;
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf vload_m(const float* p, vm m) { return _mm256_maskload_ps(p, m); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline void vstore_m(float* p, vf v, vm m) { _mm256_maskstore_ps(p, m, v); }
inline vm vmask(int n) { return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); }
inline vf vset1(float x) { return _mm256_set1_ps(x); }
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
}  // namespace
}  // namespace sgmv
}  // namespace pagedllm

#include "lora_sgmv_kernel.h"

namespace pagedllm {
namespace sgmv {
void shrink_avx2(const Args& args, int64_t u_begin, int64_t u_end) { shrink_units(args, u_begin, u_end); }
void expand_avx2(const Args& args, int64_t b_begin, int64_t b_end) { expand_blocks(args, b_begin, b_end); }
void rows_avx2(const Args& args, int64_t t_begin, int64_t t_end) { row_tasks(args, t_begin, t_end); }
}  // namespace sgmv
}  // namespace pagedllm
