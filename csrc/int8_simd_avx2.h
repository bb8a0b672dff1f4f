// The AVX2 vector helpers of the int8-activation kernels (quant_gemm_int8_kernel.h and
// quant_gemm_kq_kernel.h list what each one means). Include after the file's target pragma.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace pagedllm {
namespace quant {
namespace {
typedef __m256 vf;
typedef __m256i vi;
constexpr int VW = 8;
constexpr int NV = 2;
constexpr int32_t kQ8Start = 0;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset1(float x) { return _mm256_set1_ps(x); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf load_f16(const uint8_t* p, int v) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * v)));
}
inline vf vcvt(vi v) { return _mm256_cvtepi32_ps(v); }
inline vi izero() { return _mm256_setzero_si256(); }
inline vi iset1(int32_t x) { return _mm256_set1_epi32(x); }
inline vi iadd(vi a, vi b) { return _mm256_add_epi32(a, b); }
inline vi load_w(const uint8_t* p, int v) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * v)); }
inline vi bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
inline vi dot_u(vi acc, vi u, vi s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
inline vi dot_q8(vi acc, vi stored, vi s) {
  const vi w = _mm256_xor_si256(stored, _mm256_set1_epi8(static_cast<char>(0x80)));  // the int8 weight
  return dot_u(acc, _mm256_abs_epi8(w), _mm256_sign_epi8(s, w));
}
inline vi lo_nib(vi v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
inline vi hi_nib(vi v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }
// For the K-quants (quant_gemm_kq_kernel.h): 16 / VW lanes of bytes widened to int32, bytes set,
// bitwise ops and 16-bit shifts by a constant.
inline vi load_u8(const uint8_t* p, int v) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * v)));
}
inline vi load_i8(const uint8_t* p, int v) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * v)));
}
inline vi ibytes(int8_t x) { return _mm256_set1_epi8(x); }
inline vi iand(vi a, vi b) { return _mm256_and_si256(a, b); }
inline vi ior(vi a, vi b) { return _mm256_or_si256(a, b); }
template <int N>
inline vi shl16(vi v) { return _mm256_slli_epi16(v, N); }
template <int N>
inline vi shr16(vi v) { return _mm256_srli_epi16(v, N); }
// 16-bit shifts by a count known once a loop is unrolled (Q5_0 / Q5_1's fifth bits, quant_gemm_int8.h).
inline vi shl16n(vi v, int n) { return _mm256_sll_epi16(v, _mm_cvtsi32_si128(n)); }
inline vi shr16n(vi v, int n) { return _mm256_srl_epi16(v, _mm_cvtsi32_si128(n)); }
// IQ4_NL's table lookup: 16 bytes at p in every 128-bit lane, then each byte of idx (0..15) replaced by its entry.
inline vi table16(const int8_t* p) { return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline vi lookup16(vi table, vi idx) { return _mm256_shuffle_epi8(table, idx); }
}  // namespace
}  // namespace quant
}  // namespace pagedllm
