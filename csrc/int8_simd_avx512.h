// The AVX-512 VNNI vector helpers of the int8-activation kernels (quant_gemm_int8_kernel.h and
// quant_gemm_kq_kernel.h list what each one means). Include after the file's target pragma.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace pagedllm {
namespace quant {
namespace {
typedef __m512 vf;
typedef __m512i vi;
constexpr int VW = 16;
constexpr int NV = 1;
constexpr int32_t kQ8Start = 128;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset1(float x) { return _mm512_set1_ps(x); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf load_f16(const uint8_t* p, int) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline vf vcvt(vi v) { return _mm512_cvtepi32_ps(v); }
inline vi izero() { return _mm512_setzero_si512(); }
inline vi iset1(int32_t x) { return _mm512_set1_epi32(x); }
inline vi iadd(vi a, vi b) { return _mm512_add_epi32(a, b); }
inline vi load_w(const uint8_t* p, int) { return _mm512_loadu_si512(p); }
inline vi bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
inline vi dot_u(vi acc, vi u, vi s) { return _mm512_dpbusd_epi32(acc, u, s); }
inline vi dot_q8(vi acc, vi w, vi s) { return _mm512_dpbusd_epi32(acc, w, s); }  // w = int8 + 128
inline vi lo_nib(vi v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
inline vi hi_nib(vi v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)); }
// For the K-quants (quant_gemm_kq_kernel.h): 16 bytes widened to int32, bytes set, bitwise ops
// and 16-bit shifts by a constant.
inline vi load_u8(const uint8_t* p, int) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline vi load_i8(const uint8_t* p, int) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline vi ibytes(int8_t x) { return _mm512_set1_epi8(x); }
inline vi iand(vi a, vi b) { return _mm512_and_si512(a, b); }
inline vi ior(vi a, vi b) { return _mm512_or_si512(a, b); }
template <int N>
inline vi shl16(vi v) { return _mm512_slli_epi16(v, N); }
template <int N>
inline vi shr16(vi v) { return _mm512_srli_epi16(v, N); }
// 16-bit shifts by a count known once a loop is unrolled (Q5_0 / Q5_1's fifth bits, quant_gemm_int8.h).
inline vi shl16n(vi v, int n) { return _mm512_sll_epi16(v, _mm_cvtsi32_si128(n)); }
inline vi shr16n(vi v, int n) { return _mm512_srl_epi16(v, _mm_cvtsi32_si128(n)); }
// IQ4_NL's table lookup: 16 bytes at p in every 128-bit lane, then each byte of idx (0..15) replaced by its entry.
inline vi table16(const int8_t* p) { return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline vi lookup16(vi table, vi idx) { return _mm512_shuffle_epi8(table, idx); }
}  // namespace
}  // namespace quant
}  // namespace pagedllm
