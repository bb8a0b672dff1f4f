// y[M, N] = x[M, K] W^T (+ bias) with W kept as GGUF blocks (Q8_0, Q4_0, Q4_1), dequantized in
// registers and accumulated in float32.
//
// Repacked layout (pagedllm/model/layers/quantized.py writes it once at load): rows go in panels
// of 16 output rows; a panel is its K/32 blocks in order, and each block holds the 16 rows' scales
// and quants interleaved so one k-step of 16 rows is one contiguous load:
//
//   Q8_0  [d: 16 x fp16][q: 32 k x 16 rows, int8]                          544 bytes
//   Q4_0  [d: 16 x fp16][q: 16 bytes j x 16 rows, byte = q(j) | q(j+16) << 4 as in GGUF]  288 bytes
//   Q4_1  [d: 16 x fp16][m: 16 x fp16][q: as Q4_0]                          320 bytes
//
//   QX    [scale: 2 halves x 16 rows, fp32][min: the same][q: 32 k x 16 rows, int8]  768 bytes
//
// (the GGUF sizes per weight exactly for the first three: 8.5, 4.5 and 5 bits). QX is what the
// K-quants (Q4_K, Q5_K, Q6_K) are expanded into at load: their per-16 or per-32 weight scale and
// min (d * sc, -dmin * m) as float32, products exact in float32 as gguf computes them, and the
// 4-6 bit values as int8; 12 bits per weight, weight = fma(q, scale, min), one rounding as gguf's. Weight = d * q (Q8_0), d * (q - 8)
// (Q4_0: computed as fma(q, d, -8 d), exact since every term fits float32's mantissa), d * q + m
// (Q4_1, one rounding as in gguf's numpy): bit for bit the float32 the dequantize path holds, so
// the result differs from it only in summation order. Rows past N are zero blocks.
#pragma once

#include <cstdint>

namespace pagedllm {
namespace quant {

enum QType : int { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQX = 100 };  // GGMLQuantizationType values; QX ours

constexpr int kPanelRows = 16;
constexpr int kBlockK = 32;

constexpr int64_t block_bytes(int qtype) {
  return qtype == kQ8_0 ? 32 + 32 * 16 : qtype == kQ4_0 ? 32 + 16 * 16 : qtype == kQ4_1 ? 64 + 16 * 16
         : qtype == kQX ? 256 + 32 * 16 : 0;
}

struct Args {
  int qtype;
  const float* x;          // [M, K], row stride lda
  int64_t lda;
  const uint8_t* packed;   // [panels, K / 32, block_bytes]
  const float* bias;       // [N] or nullptr
  float* y;                // [M, N], row stride ldy
  int64_t ldy;
  int64_t m, n, k;
};

// Panels [p_begin, p_end), every row of x. One per ISA, each its own translation unit.
void quant_panels_avx512(const Args& args, int64_t p_begin, int64_t p_end);
void quant_panels_avx2(const Args& args, int64_t p_begin, int64_t p_end);
// The same product with every row's sum in one order, whatever the row count (batch-invariant
// mode; quant_gemm_kernel.h): quant_gemm_invariant_cpu.
void quant_panels_invariant_avx512(const Args& args, int64_t p_begin, int64_t p_end);
void quant_panels_invariant_avx2(const Args& args, int64_t p_begin, int64_t p_end);

}  // namespace quant
}  // namespace pagedllm
