// The kernel for AVX-512 CPUs. Compiled for that target by the pragma below, independent of the
// build's global flags; the op calls it only where the CPU reports avx512f at run time.
#pragma GCC target("avx512f,avx512dq,avx512vl,avx2,fma,f16c")
#include <immintrin.h>
#include <math.h>

#include "exp_avx512.h"
#include "paged_attention.h"

namespace pagedllm {
namespace {

typedef __m512 vf;
constexpr int VW = 16;
static inline vf vload(const float* x) { return _mm512_loadu_ps(x); }
static inline void vstore(float* x, vf v) { _mm512_storeu_ps(x, v); }
static inline vf vload_kv(const float* x) { return _mm512_loadu_ps(x); }
static inline vf vload_kv(const f16_t* x) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)x)); }
static inline vf vload_kv(const bf16_t* x) {  // bfloat16 is the top half of a float32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)x)), 16));
}
static inline vf vset1(float x) { return _mm512_set1_ps(x); }
static inline vf vzero() { return _mm512_setzero_ps(); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline float vreduce_max(vf v) { return _mm512_reduce_max_ps(v); }
static inline float vreduce_add(vf v) {
  __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// out[j] = the sum (Max: the max) of a[j]'s lanes, for VW vectors at once: a transpose-and-combine
// tree (45 shuffles and adds for 16 vectors, against about 6 dependent ones per vector alone).
template <bool Max>
static inline vf vcomb(vf x, vf y) { return Max ? _mm512_max_ps(x, y) : _mm512_add_ps(x, y); }
template <bool Max>
static inline vf vlanes(const vf* a) {
  vf t[8], u[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of vectors 2i, 2i+1
    t[i] = vcomb<Max>(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: vectors 4i..4i+3, that lane's partial results
    u[i] = vcomb<Max>(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44), _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
  const vf w01 = vcomb<Max>(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const vf w23 = vcomb<Max>(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return vcomb<Max>(_mm512_shuffle_f32x4(w01, w23, 0x88), _mm512_shuffle_f32x4(w01, w23, 0xDD));
}
static inline vf vsum_lanes(const vf* a) { return vlanes<false>(a); }
static inline vf vmax_lanes(const vf* a) { return vlanes<true>(a); }
// exp(x - m) for x <= m; see the AVX2 file. Below -87 (and -inf) gives exactly 0.
static inline vf vexp(vf x, vf m) { return exp_nonpositive_avx512(_mm512_sub_ps(x, m)); }

// The tiled path's register tile: MR rows x NB vectors of accumulators (24 of the
// 32 vector registers), plus NB loads and one broadcast.
constexpr int MR = 6;
constexpr int NB = 4;

// The per-key path's registers: P.V blocks of 3 rows x PV_W vectors of accumulators (plus PV_W
// loads and a broadcast); scores hold SCORE_QV query vectors beside the VW key accumulators.
constexpr int PV_W = 4;
constexpr int SCORE_QV = 8;
constexpr int SCORE_KG = 4;

#include "paged_attention_kernel.h"

}  // namespace

bool run_items_avx512(const AttnParams& p, const WorkItem* items, int64_t num_items, int64_t* next,
                      float* scratch) {
  return run_items(p, items, num_items, next, scratch);
}

}  // namespace pagedllm
