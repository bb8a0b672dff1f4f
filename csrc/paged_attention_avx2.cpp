// The kernel for AVX2 + FMA + F16C CPUs (the baseline the op requires). Compiled for that target by the
// pragma below, independent of the build's global flags; chosen at run time by the op.
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>
#include <math.h>

#include "paged_attention.h"

namespace pagedllm {
namespace {

typedef __m256 vf;
constexpr int VW = 8;
static inline vf vload(const float* x) { return _mm256_loadu_ps(x); }
static inline void vstore(float* x, vf v) { _mm256_storeu_ps(x, v); }
static inline vf vload_kv(const float* x) { return _mm256_loadu_ps(x); }
static inline vf vload_kv(const f16_t* x) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)x)); }
static inline vf vload_kv(const bf16_t* x) {  // bfloat16 is the top half of a float32
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)x)), 16));
}
static inline vf vset1(float x) { return _mm256_set1_ps(x); }
static inline vf vzero() { return _mm256_setzero_ps(); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline float vreduce_max(vf v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
static inline float vreduce_add(vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// out[j] = the sum (Max: the max) of a[j]'s lanes, for VW vectors at once (a transpose-and-combine
// tree: 21 shuffles and adds for 8 vectors instead of about 5 dependent ones per vector).
template <bool Max>
static inline vf vcomb(vf x, vf y) { return Max ? _mm256_max_ps(x, y) : _mm256_add_ps(x, y); }
template <bool Max>
static inline vf vlanes(const vf* a) {
  vf t[4], u[2];
  for (int i = 0; i < 4; ++i)
    t[i] = vcomb<Max>(_mm256_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm256_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 2; ++i)
    u[i] = vcomb<Max>(_mm256_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44), _mm256_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
  return vcomb<Max>(_mm256_permute2f128_ps(u[0], u[1], 0x20), _mm256_permute2f128_ps(u[0], u[1], 0x31));
}
static inline vf vsum_lanes(const vf* a) { return vlanes<false>(a); }
static inline vf vmax_lanes(const vf* a) { return vlanes<true>(a); }
// exp(x - m) for x <= m (Cephes-style: 2^n * p(r), |r| <= ln2/2); -inf and anything below
// -87 give exactly 0, so masked keys contribute nothing.
static inline vf vexp(vf x, vf m) {
  x = _mm256_sub_ps(x, m);
  const vf keep = _mm256_cmp_ps(x, vset1(-87.f), _CMP_GE_OQ);
  x = _mm256_max_ps(x, vset1(-87.f));
  const vf n = _mm256_round_ps(_mm256_mul_ps(x, vset1(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vf r = _mm256_fnmadd_ps(n, vset1(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, vset1(-2.12194440e-4f), r);
  vf y = vset1(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, vset1(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, vset1(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, vset1(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, vset1(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, vset1(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, vset1(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), keep);
}

// The tiled path's register tile: MR rows x NB vectors of accumulators (12 of the
// 16 vector registers), plus NB loads and one broadcast.
constexpr int MR = 6;
constexpr int NB = 2;

// The per-key path's registers: P.V blocks of 3 rows x PV_W vectors of accumulators (plus PV_W
// loads and a broadcast); scores hold up to SCORE_QV query vectors beside the VW key
// accumulators, the rest of a long query re-read per pass. Measured (decode 16x512, K/V in L1,
// 1 thread): PV_W 2 and 4 equal (2 leaves registers spare); SCORE_QV 4 (two passes at head_dim
// 64) 5% slower than 8 (the compiler folds the query loads into the FMAs).
constexpr int PV_W = 2;
constexpr int SCORE_QV = 8;
constexpr int SCORE_KG = 2;

#include "paged_attention_kernel.h"

}  // namespace

bool run_items_avx2(const AttnParams& p, const WorkItem* items, int64_t num_items, int64_t* next,
                    float* scratch) {
  return run_items(p, items, num_items, next, scratch);
}

}  // namespace pagedllm
