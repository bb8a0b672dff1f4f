// The int8-activation panel kernel shared by the ISA files (quant_gemm_int8.h has the layout). Each
// file includes its int8_simd_*.h before this, which defines: vf / vi, VW (int32 lanes per vector), NV = 16 / VW, the float
// ops vzero, vset1, vfma, vmul, vadd, vload, vstore, load_f16(p, v) (16 fp16 at p, vector v of them,
// widened), vcvt (int32 -> float), and the integer ones:
//   izero, iset1, iadd, load_w(p, v)  (vector v of a group's 64 bytes), bcast4(p) (4 int8 to every lane)
//   dot_u(acc, u, s)    acc + per lane sum of 4 products uint8 u x int8 s
//   dot_q8(acc, w, s)   the same for Q8_0's stored bytes (int8 + 128); the ISA's kQ8Start * sum(qx)
//                       is what it adds on top of the signed product (AVX-512: 128; AVX2 undoes it)
//   lo_nib / hi_nib     the low / high nibble of each byte
//   ibytes, iand, ior, shl16n / shr16n   Q5_0 / Q5_1's fifth bits: bytes set, bitwise ops, 16-bit shifts
//   table16, lookup16   IQ4_NL's values: a 16-byte table in every 128-bit lane, a byte shuffle by the nibbles
// x's rows go in tiles, panels, then blocks of at most MAXR rows (panel_tiles.h); a block keeps MR x NV float sums
// in registers over the whole K and each K-block's integer sums in S independent chains (a lone row
// would otherwise wait on one chain's latency, 8 dependent dot products a block).
#include <cstring>

#include "panel_tiles.h"

namespace pagedllm {
namespace quant {
namespace {

template <int MR>
constexpr int i8_split() { return MR == 1 ? 4 : MR == 2 ? 2 : 1; }

template <int QT, int MR, int S = i8_split<MR>()>
void micro_i8(const I8Args& a, const uint8_t* __restrict panel, int64_t row0, float* __restrict y,
              const float* bias, int cols) {
  constexpr int64_t BB = int8_block_bytes(QT);
  constexpr int HOFF = has_min(QT) ? 64 : 32;              // Q5's fifth bits, else the nibbles
  constexpr int QOFF = HOFF + (is_q5_type(QT) ? 64 : 0);
  const int64_t k = a.k, nb = k / 32;
  const int8_t* xq = a.xq + row0 * k;
  const float* xd = a.xd + row0 * nb;
  const int32_t* xs = a.xs + row0 * nb;
  vf acc[MR][NV];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) acc[r][v] = vzero();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = panel + b * BB;
#pragma GCC unroll 16
    for (int64_t line = 0; line < BB; line += 64)  // the block 4 ahead, whole
      _mm_prefetch(reinterpret_cast<const char*>(blk + 4 * BB + line), _MM_HINT_T0);
    const uint8_t* q = blk + QOFF;
    vi isum[S][MR][NV];
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s)
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        // Q8_0's +128, Q4_0's -8 and Q5_0's -16 come out of the sum up front: start at -offset * sum(qx)
        constexpr int32_t offset = QT == kQ8_0_I8 || QT == kIQ4_NL_I8 ? kQ8Start : QT == kQ4_0_I8 ? 8
                                   : QT == kQ5_0_I8 ? 16 : 0;
        const int32_t start = s != 0 ? 0 : -offset * xs[r * nb + b];
#pragma GCC unroll 2
        for (int v = 0; v < NV; ++v) isum[s][r][v] = start != 0 ? iset1(start) : izero();
      }
    if (QT == kIQ4_NL_I8) {  // the table's values in Q8_0's stored form, then Q8_0's dot product
      static constexpr Bytes16 stored = iq4nl_stored();
      const vi table = table16(stored.v);
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) {
        const int s0 = (2 * g) % S, s1 = (2 * g + 1) % S;
#pragma GCC unroll 2
        for (int v = 0; v < NV; ++v) {
          const vi w = load_w(q + g * 64, v);
          const vi lo = lookup16(table, lo_nib(w)), hi = lookup16(table, hi_nib(w));
#pragma GCC unroll 16
          for (int r = 0; r < MR; ++r) {
            isum[s0][r][v] = dot_q8(isum[s0][r][v], lo, bcast4(xq + r * k + b * 32 + 4 * g));
            isum[s1][r][v] = dot_q8(isum[s1][r][v], hi, bcast4(xq + r * k + b * 32 + 16 + 4 * g));
          }
        }
      }
    } else if (QT == kQ8_0_I8) {
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) {
        const int s = g % S;
#pragma GCC unroll 2
        for (int v = 0; v < NV; ++v) {
          const vi w = load_w(q + g * 64, v);
#pragma GCC unroll 16
          for (int r = 0; r < MR; ++r) isum[s][r][v] = dot_q8(isum[s][r][v], w, bcast4(xq + r * k + b * 32 + 4 * g));
        }
      }
    } else {
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) {
        const int s0 = (2 * g) % S, s1 = (2 * g + 1) % S;
#pragma GCC unroll 2
        for (int v = 0; v < NV; ++v) {
          const vi w = load_w(q + g * 64, v);
          vi lo = lo_nib(w), hi = hi_nib(w);
          if (is_q5_type(QT)) {  // group g's fifth bits to bit 4 (quant_gemm_int8.h)
            const vi h = load_w(blk + HOFF, v), bit4 = ibytes(0x10);
            lo = ior(lo, iand(shr16n(h, g), bit4));
            hi = ior(hi, iand(shl16n(h, 4 - g), bit4));
          }
#pragma GCC unroll 16
          for (int r = 0; r < MR; ++r) {
            isum[s0][r][v] = dot_u(isum[s0][r][v], lo, bcast4(xq + r * k + b * 32 + 4 * g));
            isum[s1][r][v] = dot_u(isum[s1][r][v], hi, bcast4(xq + r * k + b * 32 + 16 + 4 * g));
          }
        }
      }
    }
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) {
      const vf dw = load_f16(blk, v);
      vf mw;
      if (has_min(QT)) mw = load_f16(blk + 32, v);
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        vi total = isum[0][r][v];
#pragma GCC unroll 4
        for (int s = 1; s < S; ++s) total = iadd(total, isum[s][r][v]);
        const float dx = xd[r * nb + b];
        acc[r][v] = vfma(vcvt(total), vmul(dw, vset1(dx)), acc[r][v]);
        if (has_min(QT)) acc[r][v] = vfma(mw, vset1(dx * static_cast<float>(xs[r * nb + b])), acc[r][v]);
      }
    }
  }
  alignas(64) float row[16];
  alignas(64) float padded_bias[16];
  if (bias != nullptr && cols < 16) {  // never read past the end of bias
    std::memset(padded_bias, 0, sizeof(padded_bias));
    std::memcpy(padded_bias, bias, sizeof(float) * cols);
    bias = padded_bias;
  }
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) {
      vf out = acc[r][v];
      if (bias != nullptr) out = vadd(out, vload(bias + v * VW));
      if (cols == 16) {
        vstore(y + r * a.ldy + v * VW, out);
      } else {
        vstore(row + v * VW, out);
      }
    }
    if (cols < 16) std::memcpy(y + r * a.ldy, row, sizeof(float) * cols);
  }
}

using MicroI8Fn = void (*)(const I8Args&, const uint8_t*, int64_t, float*, const float*, int);

template <int QT, int... R>
void int8_panels_for(const I8Args& a, int64_t p_begin, int64_t p_end) {
  static constexpr MicroI8Fn table[] = {nullptr, &micro_i8<QT, R>...};
  const int64_t panel_bytes = (a.k / 32) * int8_block_bytes(QT);
  for_panel_row_blocks<sizeof...(R)>(a.m, a.k, p_begin, p_end, [&](int64_t p, int64_t row, int64_t rows) {
    const int64_t col = p * 16;
    const int cols = static_cast<int>(a.n - col < 16 ? a.n - col : 16);
    table[rows](a, a.packed + p * panel_bytes, row, a.y + row * a.ldy + col, a.bias != nullptr ? a.bias + col : nullptr,
                cols);
  });
}

template <int... R>
void int8_panels_dispatch(const I8Args& a, int64_t p_begin, int64_t p_end) {
  switch (a.qtype) {
    case kQ8_0_I8: int8_panels_for<kQ8_0_I8, R...>(a, p_begin, p_end); break;
    case kQ4_0_I8: int8_panels_for<kQ4_0_I8, R...>(a, p_begin, p_end); break;
    case kQ4_1_I8: int8_panels_for<kQ4_1_I8, R...>(a, p_begin, p_end); break;
    case kQ5_0_I8: int8_panels_for<kQ5_0_I8, R...>(a, p_begin, p_end); break;
    case kQ5_1_I8: int8_panels_for<kQ5_1_I8, R...>(a, p_begin, p_end); break;
    case kIQ4_NL_I8: int8_panels_for<kIQ4_NL_I8, R...>(a, p_begin, p_end); break;
  }
}

}  // namespace
}  // namespace quant
}  // namespace pagedllm
