// The K-quant int8-activation kernel for AVX2 CPUs (quant_gemm_kq.h): a dot product of 4 bytes is
// vpmaddubsw (uint8 x int8 pairs into int16, saturating) then vpmaddwd by ones. The weights here are
// at most 6 bits (Q6_K: 63; Q5_K: 31; Q4_K: 15; Q3_K: 7) and the activations at most 127 in magnitude, so a
// pair's sum is at most 2 x 63 x 127 = 16002 < 32767: it never saturates (the offsets, Q6_K's - 32,
// Q3_K's - 4 and the mins, are applied outside the integer products). Blocks of up to 3 rows.
#pragma GCC target("avx2,fma,f16c")
#include "quant_gemm_kq.h"
#include "int8_simd_avx2.h"

#include "quant_gemm_kq_kernel.h"

namespace pagedllm {
namespace quant {
void kq_panels_avx2(const KQArgs& a, int64_t p_begin, int64_t p_end) {
  kq_panels_dispatch<1, 2, 3>(a, p_begin, p_end);
}
}  // namespace quant
}  // namespace pagedllm
