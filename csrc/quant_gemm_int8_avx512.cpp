// The int8-activation kernel for AVX-512 VNNI CPUs: a panel's 16 columns are one zmm of int32 lanes,
// each lane 4 bytes of one weight row, one vpdpbusd per 4 k-steps of 16 rows. Blocks of up to 8
// rows (8 float sums, 8 integer sums, the weight and its nibbles: under 32 registers). Compiled for
// that target by the pragma below; the op calls it only where the CPU reports avx512vnni.
#pragma GCC target("avx512f,avx512bw,avx512vnni,avx2,fma,f16c")
#include <immintrin.h>

#include <cstring>

#include "quant_gemm_int8.h"

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
}  // namespace
}  // namespace quant
}  // namespace pagedllm

#include "quant_gemm_int8_kernel.h"

namespace pagedllm {
namespace quant {
void int8_panels_avx512vnni(const I8Args& a, int64_t p_begin, int64_t p_end) {
  int8_panels_dispatch<1, 2, 3, 4, 5, 6, 7, 8>(a, p_begin, p_end);
}
}  // namespace quant
}  // namespace pagedllm
