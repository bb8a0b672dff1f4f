// The row order of the int8-activation kernels (quant_gemm_int8_kernel.h, quant_gemm_kq_kernel.h). A
// call's rows of x go in tiles of about kTileBytes of quantized activations, and within a tile in
// blocks of at most kMaxRows (split evenly), each block passing over the whole K of one panel:
//
//   for tile:  for panel p in [p_begin, p_end):  for block of the tile:  block(p, row, rows)
//
// so a tile of x stays in L2 while the thread's panels pass (without tiles, every panel re-read all
// of x: 4 MB at 2048 rows of K = 2048, from L3). A decode step's rows are one tile. Each row's own
// sums do not depend on its tile or block, so neither does its result.
#pragma once

#include <algorithm>
#include <cstdint>

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

}  // namespace
}  // namespace quant
}  // namespace pagedllm
