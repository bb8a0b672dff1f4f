// The int8-activation kernel for AVX2 CPUs: a panel's 16 columns are two ymm of int32 lanes; a dot
// product of 4 bytes is vpmaddubsw (uint8 x int8 pairs into int16) then vpmaddwd by ones (pairs of
// those into int32). vpmaddubsw saturates its int16 sums, which Q8_0's weight + 128 (255 x 127 x 2)
// would overflow: Q8_0 takes the sign trick instead (|w| x sign(x, w), at most 128 x 127 x 2), so
// its offset is undone here and the block starts at 0 (kQ8Start). Q4 nibbles (15 x 127 x 2) fit.
// Blocks of up to 3 rows (6 float sums, 6 integer sums, the weight, its nibbles: the 16 registers).
#pragma GCC target("avx2,fma,f16c")
#include "quant_gemm_int8.h"
#include "int8_simd_avx2.h"

#include "quant_gemm_int8_kernel.h"

namespace pagedllm {
namespace quant {
void int8_panels_avx2(const I8Args& a, int64_t p_begin, int64_t p_end) {
  int8_panels_dispatch<1, 2, 3>(a, p_begin, p_end);
}
}  // namespace quant
}  // namespace pagedllm
