// The microkernel and the row blocking shared by the ISA files, written against a small vector
// interface (vf, VW, vload, vstore, vset1, vzero, vadd, vfma) that each file defines before
// including it; each instantiates panels<1, 2, ..., the most rows its registers hold>.
//
// Per panel, rows go in blocks of at most that many, split evenly (16 rows -> 8 + 8, not 14 + 2)
// so every block keeps enough independent FMAs in flight. Blocks of few rows also split K over
// k_split() accumulator sets: one row has only 2 sums, and an FMA's 4-cycle latency would cap it
// at half a vector per cycle.
//
// With two to four blocks, the panel is swept in chunks of kChunk k-steps, every block over a
// chunk before the next chunk (the sums parked in a small buffer between chunks), and each block
// prefetches its share of the chunk ahead. Sweeping the whole panel block after block read it from
// memory during the first block only and left memory idle while the others re-read it from L2: at
// 16-32 rows time was about the memory time plus the later blocks' compute. Chunks took 0.89-0.93x
// the time at 16-48 rows (1 thread, 120 linears, scripts/cpu_gemm_sweep.py --vs whole).
#include <cstring>
#include <vector>

namespace pagedllm {
namespace gemm {
namespace {

constexpr int NR = 2 * VW;
// One block: software prefetch this far ahead in the panel (4 KB: 32 k-steps of 32 columns; past
// a panel's end it reaches into the next one, which the same thread reads next). Measured over the
// 120 linears, 1 thread, interleaved: 0.5x the time without it at 1-14 rows, 0.75x at 32; 512,
// 2048 and 4096 floats and the T1 / T2 hints did no better.
constexpr int64_t kPrefetchFloats = 1024;
// FAR: a second software prefetch, to L2 (T1), further ahead: 16 KB past the current step for
// whole panels, 32 KB past the chunk-ahead share for chunks. On its own (T1 instead of T0) it did
// nothing; with the near T0 prefetch, 1 thread over the 120 linears: 0.84-0.94x the time at 4-14
// rows, 0.95-0.97x at 16-24, 0.97-0.98x at 64 (8192 floats for whole panels did no better).
constexpr int64_t kFarFloats = 4096;
constexpr int64_t kChunkFarFloats = 8192;
// Several blocks: k-steps per chunk (16 KB of panel at 32 columns: this chunk and the next fit L1;
// 32, 64 and 256 did worse).
constexpr int64_t kChunk = 128;

template <int MR>
constexpr int k_split() { return MR <= 2 ? 4 : MR <= 4 ? 2 : 1; }

// A chunk's sums and prefetches (CHUNKED micro only).
struct Chunk {
  const float* pf;      // its share of the chunk ahead: line pf + (i * pf_q8 >> 8) floats at k-step i
  int64_t pf_q8;        // (and the line after it if pf_two); floats advanced per k-step, times 256
  bool pf_two;
  const float* acc_in;  // nullptr: start from zero; else MR x NR partial sums to continue from
  float* acc_out;       // nullptr: finish (bias, store to y); else park the MR x NR sums here
};

// Rows [0, MR) of x times kn k-steps of one panel b [kn][NR]. Whole panels (!CHUNKED): x is the
// caller's rows (row stride lda), prefetch kPrefetchFloats ahead (and kFarFloats if FAR). Chunks:
// x is packed [kn][MR] (lda unused), and `ch` says where to prefetch and where the sums come from
// and go. Finishing, only the first `cols` columns are stored to y (row stride ldy; the ragged
// last panel).
template <int MR, bool CHUNKED, bool FAR, int S = k_split<MR>()>
inline void micro(const float* __restrict x, int64_t lda, const float* __restrict b, int64_t kn,
                  const Chunk& ch, const float* bias, float* __restrict y, int64_t ldy, int cols) {
  vf acc[S][MR][2];
#pragma GCC unroll 4
  for (int s = 0; s < S; ++s)
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) acc[s][m][0] = acc[s][m][1] = vzero();
  if (CHUNKED && ch.acc_in != nullptr) {
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      acc[0][m][0] = vload(ch.acc_in + m * NR);
      acc[0][m][1] = vload(ch.acc_in + m * NR + VW);
    }
  }
  int64_t k = 0;
  for (; k + S <= kn; k += S) {
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) {
      if (CHUNKED) {
        const char* p = reinterpret_cast<const char*>(ch.pf + (((k + s) * ch.pf_q8) >> 8));
        _mm_prefetch(p, _MM_HINT_T0);
        if (ch.pf_two) _mm_prefetch(p + 64, _MM_HINT_T0);
        if (FAR) {
          _mm_prefetch(p + 4 * kChunkFarFloats, _MM_HINT_T1);
          if (ch.pf_two) _mm_prefetch(p + 4 * kChunkFarFloats + 64, _MM_HINT_T1);
        }
      } else {  // NR floats are 1 (AVX2) or 2 (AVX-512) cache lines
        for (int line = 0; line < NR; line += 16)
          _mm_prefetch(reinterpret_cast<const char*>(b + (k + s) * NR + kPrefetchFloats + line), _MM_HINT_T0);
        if (FAR)
          for (int line = 0; line < NR; line += 16)
            _mm_prefetch(reinterpret_cast<const char*>(b + (k + s) * NR + kFarFloats + line), _MM_HINT_T1);
      }
    }
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) {
      const vf b0 = vload(b + (k + s) * NR), b1 = vload(b + (k + s) * NR + VW);
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) {
        const vf a = vset1(CHUNKED ? x[(k + s) * MR + m] : x[m * lda + k + s]);
        acc[s][m][0] = vfma(a, b0, acc[s][m][0]);
        acc[s][m][1] = vfma(a, b1, acc[s][m][1]);
      }
    }
  }
  for (; k < kn; ++k) {
    const vf b0 = vload(b + k * NR), b1 = vload(b + k * NR + VW);
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const vf a = vset1(CHUNKED ? x[k * MR + m] : x[m * lda + k]);
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
  if (CHUNKED && ch.acc_out != nullptr) {
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      vstore(ch.acc_out + m * NR, acc[0][m][0]);
      vstore(ch.acc_out + m * NR + VW, acc[0][m][1]);
    }
    return;
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

using MicroFn = void (*)(const float*, int64_t, const float*, int64_t, const Chunk&, const float*, float*, int64_t,
                         int);

// The batch-invariant order (INV below): every row's sum is one FMA chain over k = 0..K-1, then
// the bias, whatever the rows around it: micro<MR, ..., 1>'s order. A block of 1-2 rows keeps too
// few chains in flight for the FMA latency, so it takes P whole panels at once (P chains a vector
// instead of splitting K): more independent sums, the same order per column.
template <int MR, int P, bool FAR>
inline void micro_panels(const float* __restrict x, int64_t lda, const float* __restrict b, int64_t K,
                         const float* bias, float* __restrict y, int64_t ldy) {
  vf acc[MR][P][2];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) acc[m][p][0] = acc[m][p][1] = vzero();
  for (int64_t k = 0; k < K; ++k) {
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) {
      const float* bp = b + p * K * NR + k * NR;
      for (int line = 0; line < NR; line += 16) {
        _mm_prefetch(reinterpret_cast<const char*>(bp + kPrefetchFloats + line), _MM_HINT_T0);
        if (FAR) _mm_prefetch(reinterpret_cast<const char*>(bp + kFarFloats + line), _MM_HINT_T1);
      }
      const vf b0 = vload(bp), b1 = vload(bp + VW);
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) {
        const vf a = vset1(x[m * lda + k]);
        acc[m][p][0] = vfma(a, b0, acc[m][p][0]);
        acc[m][p][1] = vfma(a, b1, acc[m][p][1]);
      }
    }
  }
#pragma GCC unroll 4
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      vf c0 = acc[m][p][0], c1 = acc[m][p][1];
      if (bias != nullptr) {
        c0 = vadd(c0, vload(bias + p * NR));
        c1 = vadd(c1, vload(bias + p * NR + VW));
      }
      vstore(y + m * ldy + p * NR, c0);
      vstore(y + m * ldy + p * NR + VW, c1);
    }
}

// Whole panels of `a` from p on, P at a time while they are full (not the ragged last): the panel after them.
template <int MR, int P>
int64_t panels_at_once(const Args& a, int64_t p, int64_t p_end) {
  const int64_t K = a.k;
  for (; p + P <= p_end && (p + P) * NR <= a.n; p += P) {
    const int64_t col = p * NR;
    const float* bias = a.bias != nullptr ? a.bias + col : nullptr;
    if (a.far_prefetch)
      micro_panels<MR, P, true>(a.x, a.lda, a.packed + p * K * NR, K, bias, a.y + col, a.ldy);
    else
      micro_panels<MR, P, false>(a.x, a.lda, a.packed + p * K * NR, K, bias, a.y + col, a.ldy);
  }
  return p;
}

// Panels [p_begin, p_end), all rows; R... = 1, 2, ..., the most rows a block keeps in registers.
// INV: the batch-invariant order (micro_panels above); else k_split's, which depends on the block's rows.
template <bool INV, int... R>
void panels(const Args& a, int64_t p_begin, int64_t p_end) {
  static constexpr MicroFn whole_near[] = {nullptr, &micro<R, false, false, INV ? 1 : k_split<R>()>...};
  static constexpr MicroFn whole_far[] = {nullptr, &micro<R, false, true, INV ? 1 : k_split<R>()>...};
  static constexpr MicroFn chunked_near[] = {nullptr, &micro<R, true, false, INV ? 1 : k_split<R>()>...};
  static constexpr MicroFn chunked_far[] = {nullptr, &micro<R, true, true, INV ? 1 : k_split<R>()>...};
  const MicroFn* whole = a.far_prefetch ? whole_far : whole_near;
  const MicroFn* chunked = a.far_prefetch ? chunked_far : chunked_near;
  constexpr int64_t kMaxRows = sizeof...(R);
  static_assert(kMaxRows <= 16, "micro unrolls rows 16 at a time");
  const int64_t num_blocks = (a.m + kMaxRows - 1) / kMaxRows;
  const int64_t base = a.m / num_blocks, extra = a.m % num_blocks;  // first `extra` blocks get base + 1
  const int64_t K = a.k;
  if (INV && a.m <= 2) {
    p_begin = a.m == 1 ? panels_at_once<1, 4>(a, p_begin, p_end) : panels_at_once<2, 2>(a, p_begin, p_end);
  }
  if (num_blocks == 1 || num_blocks > a.chunk_max_blocks) {
    const Chunk none{};
    for (int64_t p = p_begin; p < p_end; ++p) {
      const float* b = a.packed + p * K * NR;
      const int64_t col = p * NR;
      const int cols = static_cast<int>(a.n - col < NR ? a.n - col : NR);
      for (int64_t blk = 0, row = 0; blk < num_blocks; ++blk) {
        const int64_t rows = base + (blk < extra ? 1 : 0);
        whole[rows](a.x + row * a.lda, a.lda, b, K, none, a.bias != nullptr ? a.bias + col : nullptr,
                    a.y + row * a.ldy + col, a.ldy, cols);
        row += rows;
      }
    }
    return;
  }
  // x packed block by block as [K][rows], so a k-step's broadcasts read one line, not one per row.
  thread_local std::vector<float> xbuf, accbuf;
  xbuf.resize(static_cast<size_t>(a.m * K));
  accbuf.resize(static_cast<size_t>(a.m * NR));
  for (int64_t blk = 0, row = 0; blk < num_blocks; ++blk) {
    const int64_t rows = base + (blk < extra ? 1 : 0);
    float* dst = xbuf.data() + row * K;
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t k = 0; k < K; ++k) dst[k * rows + i] = a.x[(row + i) * a.lda + k];
    row += rows;
  }
  // Equal chunks of at most kChunk steps (K = 576: 4 x 116 + 112, not 4 x 128 + 64), so every
  // chunk's prefetch covers the next chunk whole.
  const int64_t num_chunks = (K + kChunk - 1) / kChunk, kc = (K + num_chunks - 1) / num_chunks;
  for (int64_t p = p_begin; p < p_end; ++p) {
    const float* b = a.packed + p * K * NR;
    const int64_t col = p * NR;
    const int cols = static_cast<int>(a.n - col < NR ? a.n - col : NR);
    const float* bias = a.bias != nullptr ? a.bias + col : nullptr;
    for (int64_t k0 = 0; k0 < K; k0 += kc) {
      const int64_t kn = K - k0 < kc ? K - k0 : kc;
      const bool last = k0 + kn == K;
      // The kc steps ahead (into the next panel, which follows in memory, from the last), a share
      // of them per block, spread over this chunk's steps.
      const float* ahead = b + (k0 + kc) * NR;
      for (int64_t blk = 0, row = 0; blk < num_blocks; ++blk) {
        const int64_t rows = base + (blk < extra ? 1 : 0);
        float* acc = accbuf.data() + row * NR;
        const Chunk ch{ahead + blk * kc * NR / num_blocks, NR * 256 / num_blocks, NR / num_blocks > 16,
                       k0 == 0 ? nullptr : acc, last ? nullptr : acc};
        chunked[rows](xbuf.data() + row * K + k0 * rows, 0, b + k0 * NR, kn, ch, bias, a.y + row * a.ldy + col,
                      a.ldy, cols);
        row += rows;
      }
    }
  }
}

}  // namespace
}  // namespace gemm
}  // namespace pagedllm
