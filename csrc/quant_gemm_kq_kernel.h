// The K-quant int8-activation panel kernel shared by the ISA files (quant_gemm_kq.h has the layout).
// Each file includes its int8_simd_*.h first: the helpers of quant_gemm_int8_kernel.h plus
//   load_u8 / load_i8(p, v)   vector v of 16 bytes at p widened to int32 (a panel's 16 rows' scales)
//   ibytes, iand, ior, shl16<N>, shr16<N>   bytes set, bitwise ops, 16-bit lane shifts
// x's rows go in tiles, panels, then blocks of at most MAXR rows (panel_tiles.h), each row's float sums kept in
// registers over the whole K in one fixed order (super-block, then 32-block): a row's result does not
// depend on how many rows share the call. Integer sums go in S independent chains (exact, so their
// number, which follows the block's row count, changes nothing).
#include <cstring>
#include <utility>

#include "panel_tiles.h"

namespace pagedllm {
namespace quant {
namespace {

template <int MR>
constexpr int kq_split() { return MR == 1 ? 4 : MR == 2 ? 2 : 1; }

// Bit P of each byte of h moved to bit 4 (mask 0x10, one bit) or P..P+1 to 4..5 (mask 0x30).
template <int P>
inline vi bits_to_4(vi h, int8_t mask) {
  if constexpr (P < 4) {
    return iand(shl16<4 - P>(h), ibytes(mask));
  } else if constexpr (P > 4) {
    return iand(shr16<P - 4>(h), ibytes(mask));
  } else {
    return iand(h, ibytes(mask));
  }
}

// The 32-block u of a Q5_K quad / Q6_K pair: its low and high 16 k's upper bits, in place at bit 4.
template <int QT, int U>
inline void add_high_bits(vi h, vi& lo, vi& hi) {
  if constexpr (QT == kQ5_K_I8) {
    lo = ior(lo, bits_to_4<2 * U>(h, 0x10));
    hi = ior(hi, bits_to_4<2 * U + 1>(h, 0x10));
  } else {
    lo = ior(lo, bits_to_4<4 * U>(h, 0x30));
    hi = ior(hi, bits_to_4<4 * U + 2>(h, 0x30));
  }
}

// Bit P of each byte of h moved to bit 2 (Q3_K's third bit, mask 0x04).
template <int P>
inline vi bit_to_2(vi h) {
  if constexpr (P < 2) {
    return iand(shl16<2 - P>(h), ibytes(0x04));
  } else if constexpr (P > 2) {
    return iand(shr16<P - 2>(h), ibytes(0x04));
  } else {
    return iand(h, ibytes(0x04));
  }
}

// The 2-bit field J of each byte of w (bits 2J..2J+1) at bits 0-1.
template <int J>
inline vi low2(vi w) {
  if constexpr (J == 0) {
    return iand(w, ibytes(0x03));
  } else {
    return iand(shr16<2 * J>(w), ibytes(0x03));
  }
}

// Q3_K and Q6_K: int8 scales per 16-block and an offset taken off every q (q - 4, q - 32).
template <int QT>
constexpr bool kq_signed() { return QT == kQ3_K_I8 || QT == kQ6_K_I8; }

template <int QT>
struct KQOffsets {  // byte offsets inside one panel's super-block (quant_gemm_kq.h)
  static constexpr int64_t kScales = kq_signed<QT>() ? 32 : 64;
  static constexpr int64_t kMins = 192;
  static constexpr int64_t kHigh = kq_signed<QT>() ? 288 : 320;
  static constexpr int64_t kNibbles = QT == kQ4_K_I8 ? 320 : QT == kQ5_K_I8 ? 832 : QT == kQ3_K_I8 ? 800 : 1312;
  static constexpr int32_t kOffset = QT == kQ3_K_I8 ? 4 : 32;  // of the signed types
};

// Q3_K's 32-block B for MR rows: per group g (4 k's a row), the 2-bit fields J = 0..3 hold k + 8 J, the
// pair's byte the third bits (bit 4 u + J, u = B % 2); J 0-1 are the first 16-block, 2-3 the second.
template <int U, int MR>
inline void q3k_block_sums(const uint8_t* __restrict sbp, const int8_t* __restrict x, int64_t k, int B,
                           vi (&isum)[2][MR][NV]) {
  using O = KQOffsets<kQ3_K_I8>;
  const uint8_t* q = sbp + O::kNibbles + B * 128;
  const uint8_t* hb = sbp + O::kHigh + (B / 2) * 128;
#pragma GCC unroll 2
  for (int g = 0; g < 2; ++g) {
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) {
      const vi w = load_w(q + g * 64, v), h = load_w(hb + g * 64, v);
      const vi q0 = ior(low2<0>(w), bit_to_2<4 * U>(h)), q1 = ior(low2<1>(w), bit_to_2<4 * U + 1>(h));
      const vi q2 = ior(low2<2>(w), bit_to_2<4 * U + 2>(h)), q3 = ior(low2<3>(w), bit_to_2<4 * U + 3>(h));
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        const int8_t* xr = x + r * k + B * 32 + 4 * g;
        isum[0][r][v] = dot_u(isum[0][r][v], q0, bcast4(xr));
        isum[0][r][v] = dot_u(isum[0][r][v], q1, bcast4(xr + 8));
        isum[1][r][v] = dot_u(isum[1][r][v], q2, bcast4(xr + 16));
        isum[1][r][v] = dot_u(isum[1][r][v], q3, bcast4(xr + 24));
      }
    }
  }
}

// One 32-block B of a super-block for MR rows: the integer sums of its low and high 16 k's. U = B's place in
// its quad (Q5_K) or pair (Q6_K), which fixes the high bits' shifts.
template <int QT, int U, int MR, int S>
inline void kq_block_sums(const uint8_t* __restrict sbp, const int8_t* __restrict x, int64_t k, int B,
                          vi (&isum)[S][MR][NV]) {
  using O = KQOffsets<QT>;
  const uint8_t* q = sbp + O::kNibbles + B * 256;
  const uint8_t* hb = QT == kQ5_K_I8 ? sbp + O::kHigh + (B / 4) * 256 : sbp + O::kHigh + (B / 2) * 256;
#pragma GCC unroll 4
  for (int g = 0; g < 4; ++g) {
    // Q6_K keeps its two 16-blocks apart (their scales differ); Q4_K / Q5_K spread them over S chains
    const int s0 = QT == kQ6_K_I8 ? 0 : (2 * g) % S, s1 = QT == kQ6_K_I8 ? 1 : (2 * g + 1) % S;
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) {
      const vi w = load_w(q + g * 64, v);
      vi lo = lo_nib(w), hi = hi_nib(w);
      if constexpr (QT != kQ4_K_I8) add_high_bits<QT, U>(load_w(hb + g * 64, v), lo, hi);
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        isum[s0][r][v] = dot_u(isum[s0][r][v], lo, bcast4(x + r * k + B * 32 + 4 * g));
        isum[s1][r][v] = dot_u(isum[s1][r][v], hi, bcast4(x + r * k + B * 32 + 16 + 4 * g));
      }
    }
  }
}

template <int QT, int U, int MR, int S>
inline void kq_block(const uint8_t* __restrict sbp, const KQArgs& a, int64_t row0, int64_t sb, int B,
                     vf (&acc)[MR][NV]) {
  using O = KQOffsets<QT>;
  const int64_t k = a.k, nb = k / 32, b = sb * 8 + B;
  const int8_t* x = a.xq + row0 * k + sb * kSuperK;
  vi isum[S][MR][NV];
#pragma GCC unroll 4
  for (int s = 0; s < S; ++s)
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) {
        // Q6_K's - 32 (Q3_K's - 4) comes out up front: each 16-block's chain starts at -32 sx16
        const int32_t start = kq_signed<QT>() ? -O::kOffset * a.xs16[(row0 + r) * (nb * 2) + 2 * b + s] : 0;
        isum[s][r][v] = start != 0 ? iset1(start) : izero();
      }
  if constexpr (QT == kQ3_K_I8) {
    q3k_block_sums<U, MR>(sbp, x, k, B, isum);
  } else {
    kq_block_sums<QT, U, MR, S>(sbp, x, k, B, isum);
  }
#pragma GCC unroll 2
  for (int v = 0; v < NV; ++v) {
    const vf d = load_f16(sbp, v);
    if constexpr (kq_signed<QT>()) {
      const vf scale0 = vmul(d, vcvt(load_i8(sbp + O::kScales + (2 * B) * 16, v)));  // d sc, exact in float32
      const vf scale1 = vmul(d, vcvt(load_i8(sbp + O::kScales + (2 * B + 1) * 16, v)));
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        const vf dx = vset1(a.xd[(row0 + r) * nb + b]);
        acc[r][v] = vfma(vcvt(isum[0][r][v]), vmul(scale0, dx), acc[r][v]);
        acc[r][v] = vfma(vcvt(isum[1][r][v]), vmul(scale1, dx), acc[r][v]);
      }
    } else {
      const vf scale = vmul(d, vcvt(load_u8(sbp + O::kScales + B * 16, v)));
      const vf min = vmul(load_f16(sbp + 32, v), vcvt(load_u8(sbp + O::kMins + B * 16, v)));  // dmin m
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        vi total = isum[0][r][v];
#pragma GCC unroll 4
        for (int s = 1; s < S; ++s) total = iadd(total, isum[s][r][v]);
        acc[r][v] = vfma(vcvt(total), vmul(scale, vset1(a.xd[(row0 + r) * nb + b])), acc[r][v]);
        acc[r][v] = vfma(min, vset1(a.xds_neg[(row0 + r) * nb + b]), acc[r][v]);
      }
    }
  }
}

// 32-blocks per pass of a super-block's loop. Unrolling all eight made each micro-kernel larger than the
// decoded-instruction cache, and prefill ran at the front end's pace; a pass holds only the blocks whose bit
// positions differ (Q5_K's quad, Q6_K's pair). Q3_K stays whole: its rolled loop measured slower at one row.
template <int QT>
constexpr int kq_unrolled() { return QT == kQ4_K_I8 ? 1 : QT == kQ5_K_I8 ? 4 : QT == kQ6_K_I8 ? 2 : 8; }

template <int QT>
using Unrolled = std::make_integer_sequence<int, kq_unrolled<QT>()>;

template <int QT, int MR, int S, int... I>
inline void kq_blocks(const uint8_t* __restrict sbp, const KQArgs& a, int64_t row0, int64_t sb, int b0,
                      vf (&acc)[MR][NV], std::integer_sequence<int, I...>) {
  (kq_block<QT, I % (QT == kQ5_K_I8 ? 4 : QT == kQ4_K_I8 ? 1 : 2), MR, S>(sbp, a, row0, sb, b0 + I, acc), ...);
}

template <int QT, int MR, int S = kq_signed<QT>() ? 2 : kq_split<MR>()>
void micro_kq(const KQArgs& a, const uint8_t* __restrict panel, int64_t row0, float* __restrict y, const float* bias,
              int cols) {
  constexpr int64_t BB = kq_block_bytes(QT);
  const int64_t nsb = a.k / kSuperK;
  vf acc[MR][NV];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) acc[r][v] = vzero();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* sbp = panel + sb * BB;
    for (int64_t line = 0; line < BB; line += 64)  // the next super-block, whole
      _mm_prefetch(reinterpret_cast<const char*>(sbp + BB + line), _MM_HINT_T0);
    for (int b = 0; b < 8; b += kq_unrolled<QT>()) kq_blocks<QT, MR, S>(sbp, a, row0, sb, b, acc, Unrolled<QT>{});
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

using MicroKQFn = void (*)(const KQArgs&, const uint8_t*, int64_t, float*, const float*, int);

template <int QT, int... R>
void kq_panels_for(const KQArgs& a, int64_t p_begin, int64_t p_end) {
  static constexpr MicroKQFn table[] = {nullptr, &micro_kq<QT, R>...};
  const int64_t panel_bytes = (a.k / kSuperK) * kq_block_bytes(QT);
  for_panel_row_blocks<sizeof...(R)>(a.m, a.k, p_begin, p_end, [&](int64_t p, int64_t row, int64_t rows) {
    const int64_t col = p * 16;
    const int cols = static_cast<int>(a.n - col < 16 ? a.n - col : 16);
    table[rows](a, a.packed + p * panel_bytes, row, a.y + row * a.ldy + col, a.bias != nullptr ? a.bias + col : nullptr,
                cols);
  });
}

template <int... R>
void kq_panels_dispatch(const KQArgs& a, int64_t p_begin, int64_t p_end) {
  switch (a.qtype) {
    case kQ3_K_I8: kq_panels_for<kQ3_K_I8, R...>(a, p_begin, p_end); break;
    case kQ4_K_I8: kq_panels_for<kQ4_K_I8, R...>(a, p_begin, p_end); break;
    case kQ5_K_I8: kq_panels_for<kQ5_K_I8, R...>(a, p_begin, p_end); break;
    case kQ6_K_I8: kq_panels_for<kQ6_K_I8, R...>(a, p_begin, p_end); break;
  }
}

}  // namespace
}  // namespace quant
}  // namespace pagedllm
