// The bf16 panel kernel shared by the ISA files (bf16_gemm.h has the layout). Each file defines,
// before including this: vf, VW (floats per vector), NV = 16 / VW, vzero, vset1, vfma, vadd,
// vload, vstore and load_pair(p, v, w0, w1): the 32-bit lanes v*VW .. v*VW+VW of the k-pair at p
// (rows' bf16 of k in the low half, of k + 1 in the high half) as two float vectors.
// As in quant_gemm_kernel.h: x's rows go in blocks of at most MAXR (split evenly), each keeping
// MR x NV sums in registers over the whole K; a lone row splits the k-steps over S sums so an
// FMA's latency never gates it.
#include <cstring>

namespace pagedllm {
namespace bf16 {
namespace {

template <int MR>
constexpr int k_split() { return MR == 1 ? 4 : MR == 2 ? 2 : 1; }

template <int MR>
void micro(const Args& a, const uint16_t* __restrict panel, const float* __restrict x, float* __restrict y,
           const float* bias, int cols) {
  constexpr int S = k_split<MR>();
  const int64_t lda = a.lda, k = a.k;
  vf acc[S][MR][NV];
#pragma GCC unroll 4
  for (int s = 0; s < S; ++s)
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) acc[s][r][v] = vzero();
  for (int64_t kb = 0; kb < k; kb += kBlockK) {
    const uint16_t* blk = panel + kb * kPanelRows;
#pragma GCC unroll 16
    for (int line = 0; line < kBlockBytes / 2; line += 32)  // the block 4 ahead, whole
      _mm_prefetch(reinterpret_cast<const char*>(blk + 4 * kBlockBytes / 2 + line), _MM_HINT_T0);
    const float* xb = x + kb;
#pragma GCC unroll 16
    for (int kp = 0; kp < kBlockK / 2; ++kp) {  // k = 2 kp and 2 kp + 1 share a load
      const int s0 = (2 * kp) % S, s1 = (2 * kp + 1) % S;
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) {
        vf w0, w1;
        load_pair(blk + kp * 2 * kPanelRows, v, w0, w1);
#pragma GCC unroll 16
        for (int r = 0; r < MR; ++r) {
          acc[s0][r][v] = vfma(vset1(xb[r * lda + 2 * kp]), w0, acc[s0][r][v]);
          acc[s1][r][v] = vfma(vset1(xb[r * lda + 2 * kp + 1]), w1, acc[s1][r][v]);
        }
      }
    }
  }
#pragma GCC unroll 4
  for (int s = 1; s < S; ++s)
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) acc[0][r][v] = vadd(acc[0][r][v], acc[s][r][v]);
  alignas(64) float row[kPanelRows];
  alignas(64) float padded_bias[kPanelRows];
  if (bias != nullptr && cols < kPanelRows) {  // never read past the end of bias
    std::memset(padded_bias, 0, sizeof(padded_bias));
    std::memcpy(padded_bias, bias, sizeof(float) * cols);
    bias = padded_bias;
  }
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) {
      vf out = acc[0][r][v];
      if (bias != nullptr) out = vadd(out, vload(bias + v * VW));
      if (cols == kPanelRows) {
        vstore(y + r * a.ldy + v * VW, out);
      } else {
        vstore(row + v * VW, out);
      }
    }
    if (cols < kPanelRows) std::memcpy(y + r * a.ldy, row, sizeof(float) * cols);
  }
}

using MicroFn = void (*)(const Args&, const uint16_t*, const float*, float*, const float*, int);

template <int... R>
void panels_for(const Args& a, int64_t p_begin, int64_t p_end) {
  static constexpr MicroFn table[] = {nullptr, &micro<R>...};
  constexpr int64_t kMaxRows = sizeof...(R);
  const int64_t num_blocks = (a.m + kMaxRows - 1) / kMaxRows;
  const int64_t base = a.m / num_blocks, extra = a.m % num_blocks;
  for (int64_t p = p_begin; p < p_end; ++p) {
    const uint16_t* panel = a.packed + p * a.k * kPanelRows;
    const int64_t col = p * kPanelRows;
    const int cols = static_cast<int>(a.n - col < kPanelRows ? a.n - col : kPanelRows);
    const float* bias = a.bias != nullptr ? a.bias + col : nullptr;
    for (int64_t blk = 0, row = 0; blk < num_blocks; ++blk) {
      const int64_t rows = base + (blk < extra ? 1 : 0);
      table[rows](a, panel, a.x + row * a.lda, a.y + row * a.ldy + col, bias, cols);
      row += rows;
    }
  }
}

}  // namespace
}  // namespace bf16
}  // namespace pagedllm
