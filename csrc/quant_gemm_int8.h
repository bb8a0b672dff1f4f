// y[M, N] = x[M, K] W^T (+ bias) with the activations quantized too: each 32-wide block of a row of x
// becomes int8 with one float32 scale (d = max|x| / 127, q = round-to-even(x * 127 / max|x|)), and a
// block's product is an integer dot product of the int8 activations with the weight's integers
// (vpdpbusd on AVX-512 VNNI; vpmaddubsw + vpmaddwd on AVX2), scaled once per block in float32:
//
//   y[m, n] = sum_b  dw[n, b] dx[m, b] (sum_k qw[n, k] qx[m, k])        Q8_0, Q4_0 (qw = nibble - 8),
//                                                                        Q5_0 (qw = 5-bit q - 16)
//           (+ mw[n, b] dx[m, b] sum_k qx[m, k])                         Q4_1, Q5_1 (w = dw q + mw)
//                                                                        IQ4_NL: qw = kIQ4NL[nibble]
//
// The weight panels are those of quant_gemm.h (16 rows, the same bytes per block) with the quant
// bytes of a block reordered so one 32-bit lane holds 4 consecutive bytes of one row, the operand
// order of vpdpbusd (a dword of row r, 4 k-steps):
//
//   q part: [group g][row r][4 bytes]   byte (g, r, i) = quant_gemm.h's byte j = 4 g + i of row r
//
// (Q8_0: 8 groups, 512 bytes, each byte stored XOR 0x80, i.e. the int8 value + 128 as a uint8, so the
// weight is vpdpbusd's unsigned operand; the 128 sum(qx) it adds is taken off by starting the block's
// sum at -128 sum(qx). Q4_0 / Q4_1: 4 groups, 256 bytes, a byte's low nibble k = j, high k = j + 16
// as in GGUF; Q4_0's "- 8" is the same start, -8 sum(qx).) The weight is one copy, in this layout
// instead of quant_gemm.h's: the types below are their own kernel types.
//
// Q5_0 / Q5_1 (no quant_gemm.h panels: repacked straight from the GGUF rows, pagedllm/model/layers/q5.py)
// keep Q4's nibbles and add each row's 32 fifth bits as one dword, at the file's size exactly:
//
//   Q5_0 (352 B = 16 x 22):  [d fp16 x16][fifth bits: [row r][4 bytes]][nibbles: [g: 4][row r][byte i: 4]]
//   Q5_1 (384 B = 16 x 24):  [d x16][m fp16 x16][fifth bits][nibbles]
//   fifth bits, byte i of row r's dword:  bit g = bit 4 of q[4 g + i + 16],  bit 4 + g = bit 4 of q[4 g + i]
//
// so group g's fifth bits reach bit 4 of each byte by one 16-bit shift (right by g for the low nibbles, left
// by 4 - g for the high ones) and a mask, no bit of the other byte landing in it; Q5_0's "- 16" is the start
// -16 sum(qx). The 5-bit q (31 x 127 x 2) fits AVX2's int16 pair sums.
//
// IQ4_NL (288 B = 16 x 18, Q4_0's layout: [d x16][nibbles]): each nibble indexes the fixed non-linear table
// kIQ4NL, looked up by one byte shuffle (vpshufb) per 16 nibbles; the int8 values then take Q8_0's path (stored
// + 128 for vpdpbusd, the sign trick on AVX2, |w| <= 127).
#pragma once

#include <cstdint>

namespace pagedllm {
namespace quant {

enum I8Type : int {  // 110 + GGUF type
  kQ4_0_I8 = 112, kQ4_1_I8 = 113, kQ5_0_I8 = 116, kQ5_1_I8 = 117, kQ8_0_I8 = 118, kIQ4_NL_I8 = 130
};

// llama.cpp's kvalues_iq4nl: the IQ4_NL value of each nibble.
constexpr int8_t kIQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// The same values + 128 (XOR 0x80) as bytes: the form Q8_0's weights are stored in for the kernels' dot_q8.
struct Bytes16 {
  alignas(16) int8_t v[16];
};
constexpr Bytes16 iq4nl_stored() {
  Bytes16 t{};
  for (int i = 0; i < 16; ++i) t.v[i] = static_cast<int8_t>(kIQ4NL[i] ^ 0x80);
  return t;
}

constexpr bool is_int8_type(int64_t t) {
  return t == kQ4_0_I8 || t == kQ4_1_I8 || t == kQ5_0_I8 || t == kQ5_1_I8 || t == kQ8_0_I8 || t == kIQ4_NL_I8;
}
constexpr bool is_q5_type(int64_t t) { return t == kQ5_0_I8 || t == kQ5_1_I8; }
constexpr bool has_min(int64_t t) { return t == kQ4_1_I8 || t == kQ5_1_I8; }  // an fp16 m per row after d

constexpr int64_t int8_block_bytes(int64_t t) {
  return t == kQ8_0_I8 ? 32 + 512 : t == kQ4_0_I8 || t == kIQ4_NL_I8 ? 32 + 256 : t == kQ4_1_I8 ? 64 + 256
         : t == kQ5_0_I8 ? 32 + 64 + 256 : t == kQ5_1_I8 ? 64 + 64 + 256 : 0;
}

struct I8Args {
  int qtype;
  const int8_t* xq;        // [M, K] the quantized activations, dense
  const float* xd;         // [M, K / 32] their scales
  const int32_t* xs;       // [M, K / 32] each block's sum of xq
  const uint8_t* packed;   // [panels, K / 32, int8_block_bytes]
  const float* bias;       // [N] or nullptr
  float* y;                // [M, N], row stride ldy
  int64_t ldy;
  int64_t m, n, k;
};

// Rows [r_begin, r_end) of x [M, K] (row stride lda) quantized into xq, xd, xs (scalar: a small
// part of a call's time; round half to even as numpy's rint).
void quantize_rows(const float* x, int64_t lda, int64_t k, int8_t* xq, float* xd, int32_t* xs, int64_t r_begin,
                   int64_t r_end);

// Panels [p_begin, p_end), every row. One per ISA, each its own translation unit.
void int8_panels_avx512vnni(const I8Args& args, int64_t p_begin, int64_t p_end);
void int8_panels_avx2(const I8Args& args, int64_t p_begin, int64_t p_end);

}  // namespace quant
}  // namespace pagedllm
