// quant_dequant_bf16.h for AVX-512 with BF16 (every CPU with AMX has both; the op calls it only there, or where
// a test asks and the CPU has AVX-512 BF16). Per panel of 16 rows and per block, each row's weights are
// unpacked 16 at a time into a vector of int32, formed in float32 by the GGUF formula, and rounded by
// vcvtneps2bf16.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")
#include "quant_dequant_bf16.h"

#include <immintrin.h>

#include <cstring>

#include "exp_avx512.h"
#include "quant_gemm.h"
#include "quant_gemm_int8.h"
#include "quant_gemm_kq.h"

namespace pagedllm {
namespace quant {
namespace {

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline void store16(__m512 w, uint16_t* out) {
  const __m256bh h = _mm512_cvtneps_pbh(w);
  std::memcpy(out, &h, 32);
}

// Row r's 16 bytes of a [group g: 4][row: 16][byte i: 4] run: bytes 4g + i.
inline __m128i row_bytes(const uint8_t* q, int r) {
  int32_t d[4];
  for (int g = 0; g < 4; ++g) std::memcpy(&d[g], q + g * 64 + r * 4, 4);
  return _mm_setr_epi32(d[0], d[1], d[2], d[3]);
}

inline __m512 to_float(__m128i bytes) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)); }

inline __m128i low4(__m128i v) { return _mm_and_si128(v, _mm_set1_epi8(15)); }
inline __m128i high4(__m128i v) { return _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(15)); }

// One 32-block of one row of a Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / IQ4_NL int8 panel (quant_gemm_int8.h) into out[0, 32).
template <int QT>
inline void int8_block_row(const uint8_t* blk, int r, uint16_t* out) {
  const __m512 d = _mm512_set1_ps(half(blk + 2 * r));
  if constexpr (QT == kQ8_0_I8) {
    const __m128i flip = _mm_set1_epi8(static_cast<char>(0x80));
    for (int h = 0; h < 2; ++h) {  // k 0..15 (groups 0-3), 16..31 (groups 4-7); stored + 128
      const __m128i q = _mm_xor_si128(row_bytes(blk + 32 + h * 256, r), flip);
      store16(_mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q))), out + 16 * h);
    }
  } else {
    constexpr int hoff = has_min(QT) ? 64 : 32;
    const __m128i bytes = row_bytes(blk + hoff + (is_q5_type(QT) ? 64 : 0), r);
    __m128i lo = low4(bytes), hi = high4(bytes);
    if constexpr (is_q5_type(QT)) {  // group g's fifth bits to bit 4 of its 4 bytes (quant_gemm_int8.h)
      uint32_t h;
      std::memcpy(&h, blk + hoff + 4 * r, 4);
      const __m128i l5 = _mm_setr_epi32(static_cast<int>(h & 0x10101010u), static_cast<int>((h >> 1) & 0x10101010u),
                                        static_cast<int>((h >> 2) & 0x10101010u), static_cast<int>((h >> 3) & 0x10101010u));
      const __m128i h5 = _mm_setr_epi32(static_cast<int>((h << 4) & 0x10101010u), static_cast<int>((h << 3) & 0x10101010u),
                                        static_cast<int>((h << 2) & 0x10101010u), static_cast<int>((h << 1) & 0x10101010u));
      lo = _mm_or_si128(lo, l5);
      hi = _mm_or_si128(hi, h5);
    }
    if constexpr (has_min(QT)) {
      const __m512 m = _mm512_set1_ps(half(blk + 32 + 2 * r));
      store16(_mm512_add_ps(_mm512_mul_ps(d, to_float(lo)), m), out);
      store16(_mm512_add_ps(_mm512_mul_ps(d, to_float(hi)), m), out + 16);
    } else if constexpr (QT == kIQ4_NL_I8) {
      const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIQ4NL));
      store16(_mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_shuffle_epi8(table, lo)))), out);
      store16(_mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_shuffle_epi8(table, hi)))), out + 16);
    } else if constexpr (QT == kQ5_0_I8) {
      const __m512 sixteen = _mm512_set1_ps(16.0f);
      store16(_mm512_mul_ps(d, _mm512_sub_ps(to_float(lo), sixteen)), out);
      store16(_mm512_mul_ps(d, _mm512_sub_ps(to_float(hi), sixteen)), out + 16);
    } else {
      const __m512 eight = _mm512_set1_ps(8.0f);
      store16(_mm512_mul_ps(d, _mm512_sub_ps(to_float(lo), eight)), out);
      store16(_mm512_mul_ps(d, _mm512_sub_ps(to_float(hi), eight)), out + 16);
    }
  }
}

// Row r's 8 bytes of a Q3_K [group g: 2][row: 16][byte i: 4] run: byte 4g + i of the result.
inline uint64_t row_bytes8(const uint8_t* q, int r) {
  uint32_t d[2];
  for (int g = 0; g < 2; ++g) std::memcpy(&d[g], q + g * 64 + r * 4, 4);
  return static_cast<uint64_t>(d[0]) | static_cast<uint64_t>(d[1]) << 32;
}

// One 256-weight super-block of one row of a Q3_K panel (quant_gemm_kq.h) into out[0, 256): field j of
// byte m (m = 4g + i) is q[8j + m] of the 32-block.
inline void q3k_superblock_row(const uint8_t* sbp, int r, uint16_t* out) {
  const float d = half(sbp + 2 * r);
  const __m512 off = _mm512_set1_ps(4.0f);
  for (int b = 0; b < 8; ++b) {
    const uint64_t low = row_bytes8(sbp + 800 + b * 128, r), high = row_bytes8(sbp + 288 + (b / 2) * 128, r);
    const int u = b % 2;
    uint64_t q[4];
    for (int j = 0; j < 4; ++j)
      q[j] = ((low >> (2 * j)) & 0x0303030303030303ull) | (((high >> (4 * u + j)) & 0x0101010101010101ull) << 2);
    for (int h = 0; h < 2; ++h) {  // k 0..15, then 16..31: fields 2h and 2h + 1
      const __m512 scale = _mm512_set1_ps(d * static_cast<float>(static_cast<int8_t>(sbp[32 + (2 * b + h) * 16 + r])));
      const __m128i bytes = _mm_set_epi64x(static_cast<long long>(q[2 * h + 1]), static_cast<long long>(q[2 * h]));
      store16(_mm512_mul_ps(scale, _mm512_sub_ps(to_float(bytes), off)), out + 32 * b + 16 * h);
    }
  }
}

// One 256-weight super-block of one row of a K-quant panel (quant_gemm_kq.h's layout and formulas) into
// out[0, 256).
template <int QT>
inline void kq_superblock_row(const uint8_t* sbp, int r, uint16_t* out) {
  const float d = half(sbp + 2 * r);
  constexpr int64_t nibbles = QT == kQ4_K_I8 ? 320 : QT == kQ5_K_I8 ? 832 : 1312;
  for (int b = 0; b < 8; ++b) {
    const __m128i bytes = row_bytes(sbp + nibbles + b * 256, r);
    __m128i lo = low4(bytes), hi = high4(bytes);  // k 0..15 and 16..31 of the 32-block
    if constexpr (QT == kQ5_K_I8) {  // bit 2u / 2u + 1 of the quad's byte: bit 4 of k / k + 16
      const __m128i h = row_bytes(sbp + 320 + (b / 4) * 256, r);
      const int u = b % 4;
      const __m128i one = _mm_set1_epi8(1);
      lo = _mm_or_si128(lo, _mm_slli_epi16(_mm_and_si128(_mm_srl_epi16(h, _mm_cvtsi32_si128(2 * u)), one), 4));
      hi = _mm_or_si128(hi, _mm_slli_epi16(_mm_and_si128(_mm_srl_epi16(h, _mm_cvtsi32_si128(2 * u + 1)), one), 4));
    } else if constexpr (QT == kQ6_K_I8) {  // bits 4u..4u+1 / 4u+2..4u+3 of the pair's byte: bits 4-5
      const __m128i h = row_bytes(sbp + 288 + (b / 2) * 256, r);
      const int u = b % 2;
      const __m128i three = _mm_set1_epi8(3);
      lo = _mm_or_si128(lo, _mm_slli_epi16(_mm_and_si128(_mm_srl_epi16(h, _mm_cvtsi32_si128(4 * u)), three), 4));
      hi = _mm_or_si128(hi, _mm_slli_epi16(_mm_and_si128(_mm_srl_epi16(h, _mm_cvtsi32_si128(4 * u + 2)), three), 4));
    }
    uint16_t* ob = out + 32 * b;
    if constexpr (QT == kQ6_K_I8) {
      const __m512 s0 = _mm512_set1_ps(d * static_cast<float>(static_cast<int8_t>(sbp[32 + (2 * b) * 16 + r])));
      const __m512 s1 = _mm512_set1_ps(d * static_cast<float>(static_cast<int8_t>(sbp[32 + (2 * b + 1) * 16 + r])));
      const __m512 off = _mm512_set1_ps(32.0f);
      store16(_mm512_mul_ps(s0, _mm512_sub_ps(to_float(lo), off)), ob);
      store16(_mm512_mul_ps(s1, _mm512_sub_ps(to_float(hi), off)), ob + 16);
    } else {
      const __m512 scale = _mm512_set1_ps(d * static_cast<float>(sbp[64 + b * 16 + r]));
      const __m512 min = _mm512_set1_ps(half(sbp + 32 + 2 * r) * static_cast<float>(sbp[192 + b * 16 + r]));
      store16(_mm512_sub_ps(_mm512_mul_ps(scale, to_float(lo)), min), ob);
      store16(_mm512_sub_ps(_mm512_mul_ps(scale, to_float(hi)), min), ob + 16);
    }
  }
}

template <int QT>
void dequant_panels(const uint8_t* packed, int64_t k, int64_t n, uint16_t* out, int64_t p_begin, int64_t p_end) {
  constexpr bool kq = is_kq_type(QT);
  constexpr int64_t block_k = kq ? kSuperK : kBlockK;
  const int64_t bb = kq ? kq_block_bytes(QT) : int8_block_bytes(QT);
  const int64_t nb = k / block_k;
  for (int64_t p = p_begin; p < p_end; ++p) {
    const int rows = static_cast<int>(n - p * kPanelRows < kPanelRows ? n - p * kPanelRows : kPanelRows);
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = packed + (p * nb + b) * bb;
      for (int r = 0; r < rows; ++r) {
        uint16_t* row_out = out + ((p - p_begin) * kPanelRows + r) * k + b * block_k;
        if constexpr (QT == kQ3_K_I8) {
          q3k_superblock_row(blk, r, row_out);
        } else if constexpr (kq) {
          kq_superblock_row<QT>(blk, r, row_out);
        } else {
          int8_block_row<QT>(blk, r, row_out);
        }
      }
    }
  }
}


// rows[i] lane j -> rows[j] lane i, for 16 vectors of 16 32-bit lanes.
inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {  // 32-bit pairs of rows i and i + 1
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // in each 128-bit lane L of u[i + j]: column 4L + j of rows i..i+3
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int j = 0; j < 4; ++j) {  // column 4L + j: lane L of u[j], u[4 + j], u[8 + j], u[12 + j]
    const __m512i even_lo = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88), odd_lo = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xDD);
    const __m512i even_hi = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88),
                  odd_hi = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xDD);
    r[j] = _mm512_shuffle_i32x4(even_lo, even_hi, 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(even_lo, even_hi, 0xDD);
    r[4 + j] = _mm512_shuffle_i32x4(odd_lo, odd_hi, 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(odd_lo, odd_hi, 0xDD);
  }
}

// Panels [p_begin, p_end) unpacked into one VNNI block of block_cols columns: the pair (k, k + 1) of weight row
// (column) c at 32-bit word (k / 2) * block_cols + c, as the AMX ukernel reads B. Each panel is unpacked row by
// row into `panel` [16, k] first and its 16 x 16 tiles of 32-bit pairs transposed into place.
template <int QT>
void dequant_vnni(const uint8_t* packed, int64_t k, int64_t n, uint16_t* block, uint16_t* panel, int64_t p_begin,
                  int64_t p_end, int64_t block_cols) {
  const int64_t pairs = k / 2;
  for (int64_t p = p_begin; p < p_end; ++p) {
    dequant_panels<QT>(packed, k, n, panel, p, p + 1);
    const int64_t rows = n - p * kPanelRows < kPanelRows ? n - p * kPanelRows : kPanelRows;
    if (rows < kPanelRows) std::memset(panel + rows * k, 0, (kPanelRows - rows) * k * sizeof(uint16_t));
    const uint32_t* src = reinterpret_cast<const uint32_t*>(panel);
    uint32_t* dst = reinterpret_cast<uint32_t*>(block) + (p - p_begin) * kPanelRows;
    for (int64_t kp = 0; kp < pairs; kp += 16) {
      __m512i t[16];
      for (int r = 0; r < 16; ++r) t[r] = _mm512_loadu_si512(src + r * pairs + kp);
      transpose16(t);
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(dst + (kp + j) * block_cols, t[j]);
    }
  }
}

}  // namespace

void dequant_bf16_panels_avx512(int qtype, const uint8_t* packed, int64_t k, int64_t n, uint16_t* out,
                                int64_t p_begin, int64_t p_end) {
  switch (qtype) {
    case kQ4_0_I8: dequant_panels<kQ4_0_I8>(packed, k, n, out, p_begin, p_end); break;
    case kQ4_1_I8: dequant_panels<kQ4_1_I8>(packed, k, n, out, p_begin, p_end); break;
    case kQ8_0_I8: dequant_panels<kQ8_0_I8>(packed, k, n, out, p_begin, p_end); break;
    case kQ5_0_I8: dequant_panels<kQ5_0_I8>(packed, k, n, out, p_begin, p_end); break;
    case kQ5_1_I8: dequant_panels<kQ5_1_I8>(packed, k, n, out, p_begin, p_end); break;
    case kIQ4_NL_I8: dequant_panels<kIQ4_NL_I8>(packed, k, n, out, p_begin, p_end); break;
    case kQ3_K_I8: dequant_panels<kQ3_K_I8>(packed, k, n, out, p_begin, p_end); break;
    case kQ4_K_I8: dequant_panels<kQ4_K_I8>(packed, k, n, out, p_begin, p_end); break;
    case kQ5_K_I8: dequant_panels<kQ5_K_I8>(packed, k, n, out, p_begin, p_end); break;
    case kQ6_K_I8: dequant_panels<kQ6_K_I8>(packed, k, n, out, p_begin, p_end); break;
    default: break;
  }
}

void dequant_bf16_vnni_avx512(int qtype, const uint8_t* packed, int64_t k, int64_t n, uint16_t* block,
                              uint16_t* panel, int64_t p_begin, int64_t p_end, int64_t block_cols) {
  switch (qtype) {
    case kQ4_0_I8: dequant_vnni<kQ4_0_I8>(packed, k, n, block, panel, p_begin, p_end, block_cols); break;
    case kQ4_1_I8: dequant_vnni<kQ4_1_I8>(packed, k, n, block, panel, p_begin, p_end, block_cols); break;
    case kQ8_0_I8: dequant_vnni<kQ8_0_I8>(packed, k, n, block, panel, p_begin, p_end, block_cols); break;
    case kQ5_0_I8: dequant_vnni<kQ5_0_I8>(packed, k, n, block, panel, p_begin, p_end, block_cols); break;
    case kQ5_1_I8: dequant_vnni<kQ5_1_I8>(packed, k, n, block, panel, p_begin, p_end, block_cols); break;
    case kIQ4_NL_I8: dequant_vnni<kIQ4_NL_I8>(packed, k, n, block, panel, p_begin, p_end, block_cols); break;
    case kQ3_K_I8: dequant_vnni<kQ3_K_I8>(packed, k, n, block, panel, p_begin, p_end, block_cols); break;
    case kQ4_K_I8: dequant_vnni<kQ4_K_I8>(packed, k, n, block, panel, p_begin, p_end, block_cols); break;
    case kQ5_K_I8: dequant_vnni<kQ5_K_I8>(packed, k, n, block, panel, p_begin, p_end, block_cols); break;
    case kQ6_K_I8: dequant_vnni<kQ6_K_I8>(packed, k, n, block, panel, p_begin, p_end, block_cols); break;
    default: break;
  }
}

void round_rows_bf16_avx512(const float* x, int64_t ldx, int64_t rows, int64_t k, uint16_t* out, int64_t ldo,
                            int64_t padded_rows) {
  const __mmask16 tail = static_cast<__mmask16>((1u << (k % 16)) - 1);
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = x + r * ldx;
    uint16_t* dst = out + r * ldo;
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) store16(_mm512_loadu_ps(src + i), dst + i);
    if (tail != 0) {
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(tail, src + i));
      _mm256_mask_storeu_epi16(dst + i, tail, reinterpret_cast<const __m256i&>(h));
    }
  }
  for (int64_t r = rows; r < padded_rows; ++r) std::memset(out + r * ldo, 0, k * sizeof(uint16_t));
}

namespace {

// Float bit operations through the integer unit (AVX-512F only: the float forms need AVX-512 DQ).
inline __m512 xor_ps(__m512 a, __m512 b) {
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_castps_si512(b)));
}
inline __m512 and_ps(__m512 a, __m512 b) {
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a), _mm512_castps_si512(b)));
}

// 0.5 x (1 + erf(x / sqrt 2)), erf as ATen's vectorized one computes it (Abramowitz and Stegun 7.1.26:
// sign(x) (1 - poly(t) t exp(-x^2)), t = 1 / (1 + p |x|)), so the result is within an ulp or two of torch's GELU.
inline __m512 gelu_ps(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 z = _mm512_mul_ps(x, _mm512_set1_ps(0.70710678118654752440f));
  const __m512 sign = and_ps(z, _mm512_set1_ps(-0.0f));
  const __m512 az = _mm512_abs_ps(z);
  const __m512 t = _mm512_div_ps(one, _mm512_fmadd_ps(_mm512_set1_ps(0.3275911f), az, one));
  __m512 poly = _mm512_fmadd_ps(_mm512_set1_ps(1.061405429f), t, _mm512_set1_ps(-1.453152027f));
  poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(1.421413741f));
  poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(-0.284496736f));
  poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(0.254829592f));
  const __m512 e = exp_nonpositive_avx512(xor_ps(_mm512_mul_ps(z, z), _mm512_set1_ps(-0.0f)));
  const __m512 erf_abs = _mm512_fnmadd_ps(_mm512_mul_ps(e, t), poly, one);
  const __m512 erf = xor_ps(erf_abs, sign);
  return _mm512_mul_ps(_mm512_mul_ps(x, _mm512_set1_ps(0.5f)), _mm512_add_ps(one, erf));
}

}  // namespace

void gelu_rows_avx512(float* y, int64_t ld, int64_t rows, int64_t cols) {
  const __mmask16 tail = static_cast<__mmask16>((1u << (cols % 16)) - 1);
  for (int64_t r = 0; r < rows; ++r) {
    float* row = y + r * ld;
    int64_t i = 0;
    for (; i + 16 <= cols; i += 16) _mm512_storeu_ps(row + i, gelu_ps(_mm512_loadu_ps(row + i)));
    if (tail != 0) _mm512_mask_storeu_ps(row + i, tail, gelu_ps(_mm512_maskz_loadu_ps(tail, row + i)));
  }
}

}  // namespace quant
}  // namespace pagedllm
