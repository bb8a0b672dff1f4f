// A small-row-count float32 GEMM for the CPU decode step: y[M, N] = x[M, K] W^T (+ bias), with W
// packed once into panels of NR output columns, each panel K-major and contiguous:
//
//   packed[p][k][j] = W[p * NR + j, k]     (0 <= j < NR; columns past N are zero)
//
// so a panel is read as one linear stream (the hardware prefetcher's favourite), and the
// microkernel keeps MR rows x NR columns of sums in registers over the whole K. Decode is bound
// by reading the weights (~106M floats for the default model at 1-16 rows), which this reads once
// per call; MKL's packed GEMM reached only half the machine's FMA rate at 8-32 rows.
#pragma once

#include <cstdint>

namespace pagedllm {
namespace gemm {

// Panel widths: two vector registers of columns per row.
constexpr int kNrAvx512 = 32;
constexpr int kNrAvx2 = 16;

struct Args {
  const float* x;       // [M, K], row stride lda
  int64_t lda;
  const float* packed;  // [P, K, NR]
  const float* bias;    // [N] or nullptr
  float* y;             // [M, N], row stride ldy
  int64_t ldy;
  int64_t m, n, k;
  int64_t chunk_max_blocks;  // sweep the panel in chunks for 2..this many row blocks (1: never)
  bool far_prefetch;         // also prefetch to L2 further ahead (cpu_gemm_kernel.h)
};

// Panels [p_begin, p_end) of the product, every row. One per ISA, each its own translation unit
// compiled for its target; the op calls the one the CPU supports.
void gemm_panels_avx512(const Args& args, int64_t p_begin, int64_t p_end);
void gemm_panels_avx2(const Args& args, int64_t p_begin, int64_t p_end);
// The same product with every row's sum in one order, whatever the row count (batch-invariant
// mode; cpu_gemm_kernel.h): gemm_packed_invariant_cpu.
void gemm_panels_invariant_avx512(const Args& args, int64_t p_begin, int64_t p_end);
void gemm_panels_invariant_avx2(const Args& args, int64_t p_begin, int64_t p_end);

}  // namespace gemm
}  // namespace pagedllm
