// y[M, N] = x[M, K] W^T (+ bias) with W kept as bfloat16, widened to float32 in registers (a bf16 is
// the top half of a float32: zero-extend and shift left 16, exact) and accumulated in float32. So
// the product is float32 arithmetic on the bf16-rounded weights, what a float32 model loaded from
// the same bf16 checkpoint computes, up to summation order. No AVX512-BF16 instruction is needed:
// its dot products round x to bf16 too, which the float32 model does not.
//
// Repacked layout (pagedllm/model/layers/quantized.py writes it once at load), the quantized
// kernels' panels with no scales: 16 output rows a panel, K/32 blocks of
//
//   BF16  [16 k-pairs x 16 rows x (w[2p], w[2p + 1]), bf16]   1024 bytes (16 bits a weight)
//
// so two k-steps of a panel are one 64-byte load whose 32-bit lane r holds row r's weights of
// both: the shift-left-16 of the lane is k = 2p's float32, the lane masked to its high half is
// k = 2p + 1's (two integer ops for 32 weights; a widening load per k-step cost three for 16,
// which showed once the weights sat in cache). Rows past N are zeros.
//
// quant_gemm_cpu (quant_gemm_op.cpp) hands a call with qtype kBF16 to bf16_gemm, so the decoder's
// compiled layer loop and every caller of that op reach this kernel with no new entry point.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace pagedllm {
namespace bf16 {

constexpr int kBF16 = 101;  // the kernel type (not a GGUF type; QX is 100)
constexpr int kPanelRows = 16;
constexpr int kBlockK = 32;
constexpr int64_t kBlockBytes = kBlockK * kPanelRows * 2;

struct Args {
  const float* x;           // [M, K], row stride lda
  int64_t lda;
  const uint16_t* packed;   // [panels, K, 16] bf16
  const float* bias;        // [N] or nullptr
  float* y;                 // [M, N], row stride ldy
  int64_t ldy;
  int64_t m, n, k;
};

// Panels [p_begin, p_end), every row of x. One per ISA, each its own translation unit.
void panels_avx512(const Args& args, int64_t p_begin, int64_t p_end);
void panels_avx2(const Args& args, int64_t p_begin, int64_t p_end);

// y for x [M, K] and packed uint8 [panels, K / 32, 1024], shapes checked by quant_gemm_cpu;
// `chosen` is the ISA it chose (2 = AVX-512, 1 = AVX2).
at::Tensor gemm(const at::Tensor& x, const at::Tensor& packed, int64_t n, const float* bias, int64_t chosen);

}  // namespace bf16
}  // namespace pagedllm
