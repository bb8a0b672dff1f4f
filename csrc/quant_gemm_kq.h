// y[M, N] = x[M, K] W^T (+ bias) for GGUF K-quant weights (Q3_K, Q4_K, Q5_K, Q6_K) held at the file's size,
// with x quantized per 32-wide block to int8 exactly as quant_gemm_int8.h's quantize_rows does (dx, the
// block's scale; sx, its sum of qx). One 32-block of x meets one weight sub-block of 32 (Q4_K, Q5_K) or
// two of 16 (Q3_K, Q6_K), so each block's product is integer dot products scaled once in float32:
//
//   Q4_K, Q5_K:  w = d sc_j q - dmin m_j             (q 0..15 / 0..31; sc_j, m_j 6-bit; j = the 32-block)
//                y += (d sc_j) dx (sum_k q qx) - (dmin m_j) dx sx
//   Q6_K:        w = d sc_s (q - 32)                 (q 0..63; sc_s int8; s = the 16-block)
//                y += (d sc_s) dx (sum_k q qx - 32 sx16_s)        (sx16: the sum of qx over the 16-block)
//   Q3_K:        w = d sc_s (q - 4)                  (q 0..7: GGUF's 2 low bits + 4 x its hmask bit;
//                y += (d sc_s) dx (sum_k q qx - 4 sx16_s)         sc_s = the 6-bit scale - 32, int8)
//
// The weights are unsigned (vpdpbusd's unsigned operand; Q6_K's - 32 and Q3_K's - 4 are taken off as a start
// value of -32 sx16 / -4 sx16, the way quant_gemm_int8.h takes off Q4_0's - 8). Repacked once at load from the
// GGUF rows, per panel of 16 rows, per 256-weight super-block (the sub-block scales stay 6-bit integers, a byte each):
//
//   Q4_K (2368 B = 16 x 148):  [d fp16 x16][dmin fp16 x16][sc u8: 8 x16][m u8: 8 x16][nibbles]
//   Q5_K (2880 B = 16 x 180):  [d x16][dmin x16][sc 8 x16][m 8 x16][high bits: 2 quads][nibbles]
//   Q6_K (3360 B = 16 x 210):  [d x16][sc i8: 16 x16][high bits: 4 pairs][nibbles]
//   Q3_K (1824 B = 16 x 114, the file's 110 with its 12 packed scale bytes as 16):
//                              [d x16][sc i8: 16 x16][third bits: 4 pairs][2-bit fields]
//
//   nibbles, per 32-block b (256 B):  [group g: 4][row r: 16][byte i: 4]
//       byte (b, g, r, i) = q[k = 32 b + 4 g + i] | q[k + 16] << 4     (low 4 bits of each)
//   high bits, per group of 32-blocks (256 B: a byte for each (g, r, i) as above):
//       Q5_K quad  (blocks 4t..4t+3):  bit 2u: bit 4 of q[32(4t+u) + 4g+i],  bit 2u+1: of its k + 16
//       Q6_K pair  (blocks 2t, 2t+1):  bits 4u..4u+1: bits 4-5 of q[32(2t+u) + 4g+i],  4u+2..4u+3: k + 16
//
//   Q3_K, per 32-block b (128 B):  [group g: 2][row r: 16][byte i: 4]
//       bits 2j..2j+1 of byte (b, g, r, i) = the low 2 bits of q[k = 32 b + 4 g + i + 8 j]   (j = 0..3)
//   Q3_K third bits, per pair t (blocks 2t, 2t+1; 128 B, bytes as above):
//       bit 4u + j: bit 2 of q[32(2t+u) + 4g+i + 8j]
//
// so one 64-byte load is a dword per row of 4 consecutive k of 16 rows, as vpdpbusd wants, and the
// high bits are moved to bit 4 by one 16-bit shift and a mask (the shifts are at most 4, so no bit of
// the other byte of a 16-bit lane lands in the mask).
#pragma once

#include <cstdint>

namespace pagedllm {
namespace quant {

enum KQType : int { kQ3_K_I8 = 121, kQ4_K_I8 = 122, kQ5_K_I8 = 123, kQ6_K_I8 = 124 };  // 110 + GGUF type

constexpr bool is_kq_type(int64_t t) { return t == kQ3_K_I8 || t == kQ4_K_I8 || t == kQ5_K_I8 || t == kQ6_K_I8; }

constexpr int64_t kSuperK = 256;

// Bytes of one panel's super-block.
constexpr int64_t kq_block_bytes(int64_t t) {
  return t == kQ3_K_I8 ? 1824 : t == kQ4_K_I8 ? 2368 : t == kQ5_K_I8 ? 2880 : t == kQ6_K_I8 ? 3360 : 0;
}

struct KQArgs {
  int qtype;
  const int8_t* xq;        // [M, K] the quantized activations, dense
  const float* xd;         // [M, K / 32] their scales
  const int32_t* xs;       // [M, K / 32] each 32-block's sum of xq
  const int32_t* xs16;     // [M, K / 16] each 16-block's sum of xq (Q3_K, Q6_K), else nullptr
  const float* xds_neg;    // [M, K / 32] - xd xs, the min term's factor (Q4_K, Q5_K), else nullptr
  const uint8_t* packed;   // [panels, K / 256, kq_block_bytes]
  const float* bias;       // [N] or nullptr
  float* y;                // [M, N], row stride ldy
  int64_t ldy;
  int64_t m, n, k;
};

// Panels [p_begin, p_end), every row. One per ISA, each its own translation unit.
void kq_panels_avx512vnni(const KQArgs& args, int64_t p_begin, int64_t p_end);
void kq_panels_avx2(const KQArgs& args, int64_t p_begin, int64_t p_end);

}  // namespace quant
}  // namespace pagedllm
