// lora_sgmv.h for AVX-512 CPUs: blocks of up to 4 rows x 2 panels (2 zmm, 32 columns): 8 sums, 2 of A
// or B, 1 broadcast. Compiled for that target by the pragma below; the op calls it only where the CPU
// reports avx512f.
#pragma GCC target("avx512f,avx2,fma")
#include <immintrin.h>

#include "lora_sgmv.h"

namespace pagedllm {
namespace sgmv {
namespace {
typedef __m512 vf;
typedef __mmask16 vm;
constexpr int VW = 16;
constexpr int GROUP = kGroupAvx512;
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vload_m(const float* p, vm m) { return _mm512_maskz_loadu_ps(m, p); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline void vstore_m(float* p, vf v, vm m) { _mm512_mask_storeu_ps(p, m, v); }
inline vm vmask(int n) { return static_cast<vm>(n >= VW ? 0xFFFF : (1u << n) - 1); }
inline vf vset1(float x) { return _mm512_set1_ps(x); }
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
}  // namespace
}  // namespace sgmv
}  // namespace pagedllm

#include "lora_sgmv_kernel.h"

namespace pagedllm {
namespace sgmv {
void shrink_avx512(const Args& args, int64_t u_begin, int64_t u_end) { shrink_units(args, u_begin, u_end); }
void expand_avx512(const Args& args, int64_t b_begin, int64_t b_end) { expand_blocks(args, b_begin, b_end); }
void rows_avx512(const Args& args, int64_t t_begin, int64_t t_end) { row_tasks(args, t_begin, t_end); }
}  // namespace sgmv
}  // namespace pagedllm
