// The register blocks of lora_sgmv.h, written against a small vector interface (vf, vm, VW, vload,
// vload_m, vstore, vstore_m, vmask, vset1, vzero, vfma) that each ISA file defines before including
// it, with NV_MAX, the vectors of columns a block holds (MR x NV_MAX sums in registers).
//
// Shrink: rows [0, MR) x columns of one slot's A, NV vectors at a time, over every k: the A block
// (NV vectors a k-step) is read once per row block. Expand: rows [0, MR) x NV vectors of y's
// columns, starting from y and adding r rank-terms. The last vector of a block is masked: ranks
// (num_parts * r columns) and part widths need not be multiples of the vector.
#include <algorithm>

namespace pagedllm {
namespace sgmv {
namespace {

template <int MR, int NV>
inline void shrink_block(const float* __restrict x, int64_t ldx, const float* __restrict a, int64_t lda, int64_t k,
                         vm last, float* __restrict s, int64_t lds) {
  vf acc[MR][NV];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) acc[i][c] = vzero();
  for (int64_t kk = 0; kk < k; ++kk) {
    const float* row = a + kk * lda;
    vf w[NV];
#pragma GCC unroll 4
    for (int c = 0; c < NV - 1; ++c) w[c] = vload(row + c * VW);
    w[NV - 1] = vload_m(row + (NV - 1) * VW, last);
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const vf xi = vset1(x[i * ldx + kk]);
#pragma GCC unroll 4
      for (int c = 0; c < NV; ++c) acc[i][c] = vfma(xi, w[c], acc[i][c]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) vstore(s + i * lds + c * VW, acc[i][c]);  // the scratch rows are padded
}

template <int MR, int NV>
inline void expand_block(const float* __restrict s, int64_t lds, const float* __restrict b, int64_t ldb, int64_t r,
                         vm last, float* __restrict y, int64_t ldy) {
  vf acc[MR][NV];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int c = 0; c < NV - 1; ++c) acc[i][c] = vload(y + i * ldy + c * VW);
    acc[i][NV - 1] = vload_m(y + i * ldy + (NV - 1) * VW, last);
  }
  for (int64_t j = 0; j < r; ++j) {
    const float* row = b + j * ldb;
    vf w[NV];
#pragma GCC unroll 4
    for (int c = 0; c < NV - 1; ++c) w[c] = vload(row + c * VW);
    w[NV - 1] = vload_m(row + (NV - 1) * VW, last);
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const vf si = vset1(s[i * lds + j]);
#pragma GCC unroll 4
      for (int c = 0; c < NV; ++c) acc[i][c] = vfma(si, w[c], acc[i][c]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int c = 0; c < NV - 1; ++c) vstore(y + i * ldy + c * VW, acc[i][c]);
    vstore_m(y + i * ldy + (NV - 1) * VW, acc[i][NV - 1], last);
  }
}

// The block for `rows` (1..kMaxRows) x `nv` (1..NV_MAX) vectors: a switch over the instantiations.
template <int MR, int NV = 1>
struct Dispatch {
  static void shrink(int nv, const float* x, int64_t ldx, const float* a, int64_t lda, int64_t k, vm last, float* s,
                     int64_t lds) {
    if constexpr (NV < NV_MAX) {
      if (nv > NV) return Dispatch<MR, NV + 1>::shrink(nv, x, ldx, a, lda, k, last, s, lds);
    }
    shrink_block<MR, NV>(x, ldx, a, lda, k, last, s, lds);
  }
  static void expand(int nv, const float* s, int64_t lds, const float* b, int64_t ldb, int64_t r, vm last, float* y,
                     int64_t ldy) {
    if constexpr (NV < NV_MAX) {
      if (nv > NV) return Dispatch<MR, NV + 1>::expand(nv, s, lds, b, ldb, r, last, y, ldy);
    }
    expand_block<MR, NV>(s, lds, b, ldb, r, last, y, ldy);
  }
};

template <typename F>
inline void by_rows(int64_t rows, const F& f) {
  switch (rows) {
    case 1: f(Dispatch<1>{}); break;
    case 2: f(Dispatch<2>{}); break;
    case 3: f(Dispatch<3>{}); break;
    default: f(Dispatch<4>{}); break;
  }
}
static_assert(kMaxRows == 4, "by_rows covers 1..4 rows");

constexpr int64_t kBlockCols = NV_MAX * VW;

void shrink_units(const Args& g, int64_t u_begin, int64_t u_end) {
  for (int64_t u = u_begin; u < u_end; ++u) {
    const Segment& seg = g.segments[g.unit_segment[u]];
    const int64_t row = g.unit_row[u], rows = std::min<int64_t>(kMaxRows, seg.end - row);
    const int64_t cols = g.num_parts * g.ranks[seg.slot];
    const float* a = g.a + seg.slot * g.width;
    for (int64_t c0 = 0; c0 < cols; c0 += kBlockCols) {
      const int64_t n = std::min(kBlockCols, cols - c0);
      const int nv = static_cast<int>((n + VW - 1) / VW);
      const vm last = vmask(static_cast<int>(n - (nv - 1) * VW));
      by_rows(rows, [&](auto d) {
        d.shrink(nv, g.x + row * g.ldx, g.ldx, a + c0, g.lda, g.k, last, g.s + row * g.lds + c0, g.lds);
      });
    }
  }
}

void expand_blocks(const Args& g, int64_t b_begin, int64_t b_end) {
  for (int64_t blk = b_begin; blk < b_end; ++blk) {
    const int p = static_cast<int>(g.block_part[blk]);
    const int64_t col = g.block_col[blk];
    const int64_t n = std::min(g.block_cols, g.part_offset[p] + g.part_size[p] - col);
    for (int64_t i = 0; i < g.num_segments; ++i) {
      const Segment& seg = g.segments[i];
      const int64_t r = g.ranks[seg.slot];
      if (r == 0) continue;
      const float* b = g.b + (seg.slot * g.width + p * r) * g.ldb + col;
      for (int64_t c0 = 0; c0 < n; c0 += kBlockCols) {
        const int64_t cn = std::min(kBlockCols, n - c0);
        const int nv = static_cast<int>((cn + VW - 1) / VW);
        const vm last = vmask(static_cast<int>(cn - (nv - 1) * VW));
        for (int64_t row = seg.begin; row < seg.end; row += kMaxRows) {
          const int64_t rows = std::min<int64_t>(kMaxRows, seg.end - row);
          by_rows(rows, [&](auto d) {
            d.expand(nv, g.s + row * g.lds + p * r, g.lds, b + c0, g.ldb, r, last, g.y + row * g.ldy + col + c0, g.ldy);
          });
        }
      }
    }
  }
}

}  // namespace
}  // namespace sgmv
}  // namespace pagedllm
