// The row order of the int8-activation kernels (quant_gemm_int8_kernel.h, quant_gemm_kq_kernel.h), and how a
// block of rows is stored. A call's rows of x go in tiles of about kTileBytes of quantized activations, and
// within a tile in blocks of at most kMaxRows (split evenly), each block passing over the whole K of one panel:
//
//   for tile:  for panel p in [p_begin, p_end):  for block of the tile:  block(p, row, rows)
//
// so a tile of x stays in L2 while the thread's panels pass (without tiles, every panel re-read all
// of x: 4 MB at 2048 rows of K = 2048, from L3). A decode step's rows are one tile. Each row's own
// sums do not depend on its tile or block, so neither does its result.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace pagedllm {
namespace quant {
namespace {  // each ISA's translation unit its own copy

constexpr int64_t kTileBytes = 256 * 1024;

template <int64_t kMaxRows, typename Block>
inline void for_panel_row_blocks(int64_t m, int64_t k, int64_t p_begin, int64_t p_end, Block&& block) {
  const int64_t tile = std::max<int64_t>(kMaxRows, kTileBytes / std::max<int64_t>(k, 1) / kMaxRows * kMaxRows);
  for (int64_t t0 = 0; t0 < m; t0 += tile) {
    const int64_t tm = std::min(tile, m - t0);
    const int64_t num_blocks = (tm + kMaxRows - 1) / kMaxRows;
    const int64_t base = tm / num_blocks, extra = tm % num_blocks;
    for (int64_t p = p_begin; p < p_end; ++p) {
      for (int64_t blk = 0, row = t0; blk < num_blocks; ++blk) {
        const int64_t rows = base + (blk < extra ? 1 : 0);
        block(p, row, rows);
        row += rows;
      }
    }
  }
}

// A block's MR rows of float sums (one panel's 16 columns) stored to y, row stride ldy, bias added. A panel
// narrower than 16 columns (the weight's last) goes through a row buffer, and bias is never read past its end.
// Needs the ISA's vector helpers (int8_simd_*.h) included first.
template <int MR>
inline void store_panel_rows(const vf (&acc)[MR][NV], float* __restrict y, int64_t ldy, const float* bias, int cols) {
  alignas(64) float row[16];
  alignas(64) float padded_bias[16];
  if (bias != nullptr && cols < 16) {
    std::memset(padded_bias, 0, sizeof(padded_bias));
    std::memcpy(padded_bias, bias, sizeof(float) * cols);
    bias = padded_bias;
  }
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) {
      vf out = acc[r][v];
      if (bias != nullptr) out = vadd(out, vload(bias + v * VW));
      vstore(cols == 16 ? y + r * ldy + v * VW : row + v * VW, out);
    }
    if (cols < 16) std::memcpy(y + r * ldy, row, sizeof(float) * cols);
  }
}

}  // namespace
}  // namespace quant
}  // namespace pagedllm
