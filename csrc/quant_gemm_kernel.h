// The quantized panel kernel shared by the ISA files (quant_gemm.h has the layout). Each file
// defines, before including this: vf / vi, VW (floats per vector), NV = 16 / VW (vectors per
// panel row of 16 columns), vzero, vset1, vfma, vmul, vadd, vstore, and the loaders
//   load_f16(p, v)   16 fp16 at p, vector v of them, widened
//   load_u8(p, v)    bytes p[v*VW .. v*VW+VW) zero-extended to int32
//   load_i8(p, v)    the same, sign-extended
//   vand15 / vshr4 / vcvt (int32 -> float)
// Per panel, x's rows go in blocks of at most MAXR (split evenly); a block keeps MR x NV sums per
// accumulator set in registers over the whole K and re-reads the panel (a few KB, L1) per block.
// Few rows split the k-steps over S accumulator sets, so an FMA's latency never gates a lone row.
#include <cstring>

namespace pagedllm {
namespace quant {
namespace {

template <int MR>
constexpr int k_split() { return MR == 1 ? 4 : MR == 2 ? 2 : 1; }

template <int QT, int MR, int S = k_split<MR>()>
void micro(const Args& a, const uint8_t* __restrict panel, const float* __restrict x, float* __restrict y,
           const float* bias, int cols) {
  constexpr int64_t BB = block_bytes(QT);
  constexpr int QOFF = QT == kQX ? 256 : QT == kQ4_1 ? 64 : 32;
  const int64_t lda = a.lda, nb = a.k / kBlockK;
  vf acc[S][MR][NV];
#pragma GCC unroll 4
  for (int s = 0; s < S; ++s)
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) acc[s][r][v] = vzero();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = panel + b * BB;
    const float* xb = x + b * kBlockK;
#pragma GCC unroll 16
    for (int64_t line = 0; line < BB; line += 64)  // the block 4 ahead, whole
      _mm_prefetch(reinterpret_cast<const char*>(blk + 4 * BB + line), _MM_HINT_T0);
    const uint8_t* q = blk + QOFF;
    if (QT == kQX) {
      const float* scale = reinterpret_cast<const float*>(blk);
      const float* minv = reinterpret_cast<const float*>(blk + 128);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        vf sc[NV], mn[NV];
#pragma GCC unroll 2
        for (int v = 0; v < NV; ++v) {
          sc[v] = vload(scale + h * 16 + v * VW);
          mn[v] = vload(minv + h * 16 + v * VW);
        }
#pragma GCC unroll 16
        for (int kk = h * 16; kk < h * 16 + 16; ++kk) {
          const int s = kk % S;
#pragma GCC unroll 2
          for (int v = 0; v < NV; ++v) {
            const vf w = vfma(vcvt(load_i8(q + kk * 16, v)), sc[v], mn[v]);
#pragma GCC unroll 16
            for (int r = 0; r < MR; ++r) acc[s][r][v] = vfma(vset1(xb[r * lda + kk]), w, acc[s][r][v]);
          }
        }
      }
      continue;
    }
    vf d[NV], mn[NV];
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) {
      d[v] = load_f16(blk, v);
      if (QT == kQ4_1) mn[v] = load_f16(blk + 32, v);
      if (QT == kQ4_0) mn[v] = vmul(d[v], vset1(-8.0f));
    }
    if (QT == kQ8_0) {
#pragma GCC unroll 32
      for (int kk = 0; kk < kBlockK; ++kk) {
        const int s = kk % S;
#pragma GCC unroll 2
        for (int v = 0; v < NV; ++v) {
          const vf w = vmul(vcvt(load_i8(q + kk * 16, v)), d[v]);
#pragma GCC unroll 16
          for (int r = 0; r < MR; ++r) acc[s][r][v] = vfma(vset1(xb[r * lda + kk]), w, acc[s][r][v]);
        }
      }
    } else {
// byte kp holds k = kp (low nibble) and k = kp + 16 (high), as in GGUF
#pragma GCC unroll 16
      for (int kp = 0; kp < kBlockK / 2; ++kp) {
        const int s0 = (2 * kp) % S, s1 = (2 * kp + 1) % S;
#pragma GCC unroll 2
        for (int v = 0; v < NV; ++v) {
          const vi bytes = load_u8(q + kp * 16, v);
          const vf w0 = vfma(vcvt(vand15(bytes)), d[v], mn[v]);
          const vf w1 = vfma(vcvt(vshr4(bytes)), d[v], mn[v]);
#pragma GCC unroll 16
          for (int r = 0; r < MR; ++r) {
            acc[s0][r][v] = vfma(vset1(xb[r * lda + kp]), w0, acc[s0][r][v]);
            acc[s1][r][v] = vfma(vset1(xb[r * lda + kp + 16]), w1, acc[s1][r][v]);
          }
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

using MicroFn = void (*)(const Args&, const uint8_t*, const float*, float*, const float*, int);

// INV_SPLIT > 0: every block, whatever its rows, splits K over that many accumulator sets (the
// batch-invariant order: a row's sum does not depend on the rows around it; the ISA file gives
// this as few rows a block as keep the sums in registers). 0: k_split's, which depends on the rows.
template <int QT, int INV_SPLIT, int... R>
void panels_for(const Args& a, int64_t p_begin, int64_t p_end) {
  static constexpr MicroFn table[] = {nullptr, &micro<QT, R, (INV_SPLIT > 0 ? INV_SPLIT : k_split<R>())>...};
  constexpr int64_t kMaxRows = sizeof...(R);
  const int64_t num_blocks = (a.m + kMaxRows - 1) / kMaxRows;
  const int64_t base = a.m / num_blocks, extra = a.m % num_blocks;
  const int64_t panel_bytes = (a.k / kBlockK) * block_bytes(QT);
  for (int64_t p = p_begin; p < p_end; ++p) {
    const uint8_t* panel = a.packed + p * panel_bytes;
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
}  // namespace quant
}  // namespace pagedllm
