// The microkernel and the row blocking shared by the ISA files, written against a small vector
// interface (vf, VW, vload, vstore, vset1, vzero, vadd, vfma) that each file defines before
// including it; each instantiates panels<1, 2, ..., the most rows its registers hold>.
//
// Per panel, rows go in blocks of at most that many, split evenly (16 rows -> 8 + 8, not 14 + 2)
// so every block keeps enough independent FMAs in flight; the panel (K x NR floats: 72 KB for
// K = 576) stays in L2 between blocks. Blocks of few rows also split K over k_split() accumulator
// sets: one row has only 2 sums, and an FMA's 4-cycle latency would cap it at half a vector per cycle.
#include <cstring>

namespace pagedllm {
namespace gemm {
namespace {

constexpr int NR = 2 * VW;
// Software prefetch this far ahead in the panel (4 KB: 32 k-steps of 32 columns; past a panel's
// end it reaches into the next one, which the same thread reads next). Measured over the 120
// linears, 1 thread, interleaved: 0.5x the time without it at 1-14 rows, 0.75x at 32; 512 and
// 2048 floats did no better.
constexpr int64_t kPrefetchFloats = 1024;

template <int MR>
constexpr int k_split() { return MR <= 2 ? 4 : MR <= 4 ? 2 : 1; }

// Rows [0, MR) of x (row stride lda) times one panel b [K][NR], into y (row stride ldy); only
// the first `cols` columns are stored (the ragged last panel).
template <int MR>
inline void micro(const float* __restrict x, int64_t lda, const float* __restrict b, int64_t K,
                  const float* bias, float* __restrict y, int64_t ldy, int cols) {
  constexpr int S = k_split<MR>();
  vf acc[S][MR][2];
#pragma GCC unroll 4
  for (int s = 0; s < S; ++s)
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) acc[s][m][0] = acc[s][m][1] = vzero();
  int64_t k = 0;
  for (; k + S <= K; k += S) {
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s)  // NR floats are 1 (AVX2) or 2 (AVX-512) cache lines
      for (int line = 0; line < NR; line += 16)
        _mm_prefetch(reinterpret_cast<const char*>(b + (k + s) * NR + kPrefetchFloats + line), _MM_HINT_T0);
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) {
      const vf b0 = vload(b + (k + s) * NR), b1 = vload(b + (k + s) * NR + VW);
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) {
        const vf a = vset1(x[m * lda + k + s]);
        acc[s][m][0] = vfma(a, b0, acc[s][m][0]);
        acc[s][m][1] = vfma(a, b1, acc[s][m][1]);
      }
    }
  }
  for (; k < K; ++k) {
    const vf b0 = vload(b + k * NR), b1 = vload(b + k * NR + VW);
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const vf a = vset1(x[m * lda + k]);
      acc[0][m][0] = vfma(a, b0, acc[0][m][0]);
      acc[0][m][1] = vfma(a, b1, acc[0][m][1]);
    }
  }
#pragma GCC unroll 4
  for (int s = 1; s < S; ++s)
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      acc[0][m][0] = vadd(acc[0][m][0], acc[s][m][0]);
      acc[0][m][1] = vadd(acc[0][m][1], acc[s][m][1]);
    }
  alignas(64) float padded_bias[NR];
  if (bias != nullptr && cols < NR) {  // never read past the end of bias
    std::memset(padded_bias, 0, sizeof(padded_bias));
    std::memcpy(padded_bias, bias, sizeof(float) * cols);
    bias = padded_bias;
  }
  if (bias != nullptr) {
    const vf c0 = vload(bias), c1 = vload(bias + VW);
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      acc[0][m][0] = vadd(acc[0][m][0], c0);
      acc[0][m][1] = vadd(acc[0][m][1], c1);
    }
  }
  if (cols == NR) {
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      vstore(y + m * ldy, acc[0][m][0]);
      vstore(y + m * ldy + VW, acc[0][m][1]);
    }
  } else {
    alignas(64) float row[NR];
    for (int m = 0; m < MR; ++m) {
      vstore(row, acc[0][m][0]);
      vstore(row + VW, acc[0][m][1]);
      std::memcpy(y + m * ldy, row, sizeof(float) * cols);
    }
  }
}

using MicroFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t, int);

// Panels [p_begin, p_end), all rows; R... = 1, 2, ..., the most rows a block keeps in registers.
template <int... R>
void panels(const Args& a, int64_t p_begin, int64_t p_end) {
  static constexpr MicroFn fns[] = {nullptr, &micro<R>...};
  constexpr int64_t kMaxRows = sizeof...(R);
  static_assert(kMaxRows <= 16, "micro unrolls rows 16 at a time");
  const int64_t num_blocks = (a.m + kMaxRows - 1) / kMaxRows;
  const int64_t base = a.m / num_blocks, extra = a.m % num_blocks;  // first `extra` blocks get base + 1
  for (int64_t p = p_begin; p < p_end; ++p) {
    const float* b = a.packed + p * a.k * NR;
    const int64_t col = p * NR;
    const int cols = static_cast<int>(a.n - col < NR ? a.n - col : NR);
    const float* bias = a.bias != nullptr ? a.bias + col : nullptr;
    int64_t row = 0;
    for (int64_t blk = 0; blk < num_blocks; ++blk) {
      const int64_t rows = base + (blk < extra ? 1 : 0);
      fns[rows](a.x + row * a.lda, a.lda, b, a.k, bias, a.y + row * a.ldy + col, a.ldy, cols);
      row += rows;
    }
  }
}

}  // namespace
}  // namespace gemm
}  // namespace pagedllm
