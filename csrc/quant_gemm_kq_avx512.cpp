// The K-quant int8-activation kernel for AVX-512 VNNI CPUs (quant_gemm_kq.h): a panel's 16 rows are
// one zmm of int32 lanes, one vpdpbusd per 4 k-steps of 16 rows. Blocks of up to 6 rows (6 float
// sums, 12 integer sums for Q3_K's and Q6_K's two 16-blocks, the weight, its nibbles and high bits: under 32
// registers). The op calls it only where the CPU reports avx512vnni.
#pragma GCC target("avx512f,avx512bw,avx512vnni,avx2,fma,f16c")
#include "quant_gemm_kq.h"
#include "int8_simd_avx512.h"

#include "quant_gemm_kq_kernel.h"

namespace pagedllm {
namespace quant {
void kq_panels_avx512vnni(const KQArgs& a, int64_t p_begin, int64_t p_end) {
  kq_panels_dispatch<1, 2, 3, 4, 5, 6>(a, p_begin, p_end);
}
}  // namespace quant
}  // namespace pagedllm
