// The int8-activation kernel for AVX-512 VNNI CPUs: a panel's 16 columns are one zmm of int32 lanes,
// each lane 4 bytes of one weight row, one vpdpbusd per 4 k-steps of 16 rows. Blocks of up to 8
// rows (8 float sums, 8 integer sums, the weight and its nibbles: under 32 registers). Compiled for
// that target by the pragma below; the op calls it only where the CPU reports avx512vnni.
#pragma GCC target("avx512f,avx512bw,avx512vnni,avx2,fma,f16c")
#include "quant_gemm_int8.h"
#include "int8_simd_avx512.h"

#include "quant_gemm_int8_kernel.h"

namespace pagedllm {
namespace quant {
void int8_panels_avx512vnni(const I8Args& a, int64_t p_begin, int64_t p_end) {
  int8_panels_dispatch<1, 2, 3, 4, 5, 6, 7, 8>(a, p_begin, p_end);
}
}  // namespace quant
}  // namespace pagedllm
