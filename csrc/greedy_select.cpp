// torch.ops.pagedllm.greedy_select_cpu: each row's float32 argmax of hidden @ weight^T, found from
// approximate bfloat16 logits (pagedllm/model/layers/greedy_head.py explains the bound).
//
// Per row, two passes over its approximate logits: the best lower bound of the largest exact logit,
// then every logit whose upper bound reaches it is a candidate, whose exact float32 dot product is
// computed here; the first largest wins, as argmax picks.
// A row returns -1 (the caller then uses the float32 logits) when a logit is NaN or infinite, or
// when it has more than `max_candidates` candidates.
//
// Built with the library's baseline flags; the AVX-512 loops are functions with their own target
// attribute, called only where the CPU reports AVX-512 (the greedy head is used only on CPUs with
// AMX, which all have it); elsewhere (tests force the head on any CPU) scalar loops do the same
// (`scalar` forces them: tests of that path on AVX-512 machines).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "thread_pool.h"

namespace pagedllm {
namespace {

bool cpu_has_avx512bw() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  }();
  return has;
}

inline float bf16_to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

// Every logit's exact value z_v lies within e_v = scale * norm_v + rel * |y_v| of its approximation
// y_v (the caller's bound: scale = g |h| per row, norm_v = |w_v|, rel for the output rounding).
// floor = max_v (y_v - e_v) is then a lower bound of max z, and only v with y_v + e_v >= floor can
// be the argmax.
struct RowFloor {
  float floor;
  bool finite;
};

RowFloor floor_scalar(const uint16_t* y, const float* norms, int64_t n, float scale, float rel) {
  RowFloor f{-INFINITY, true};
  for (int64_t i = 0; i < n; ++i) {
    const float v = bf16_to_float(y[i]);
    if (!std::isfinite(v)) f.finite = false;
    f.floor = std::max(f.floor, v - scale * norms[i] - rel * std::fabs(v));
  }
  return f;
}

float dot_scalar(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

__attribute__((target("avx512f,avx512bw"))) inline __m512 load_bf16x16(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// e_v for 16 logits: scale * norm + rel * |y|.
__attribute__((target("avx512f,avx512bw"))) inline __m512 margin16(__m512 y, const float* norms, __m512 scale,
                                                                   __m512 rel) {
  return _mm512_fmadd_ps(scale, _mm512_loadu_ps(norms), _mm512_mul_ps(rel, _mm512_abs_ps(y)));
}

__attribute__((target("avx512f,avx512bw"))) RowFloor floor_avx512(const uint16_t* y, const float* norms, int64_t n,
                                                                   float scale, float rel) {
  const __m512 vs = _mm512_set1_ps(scale), vr = _mm512_set1_ps(rel), inf = _mm512_set1_ps(INFINITY);
  __m512 floor = _mm512_set1_ps(-INFINITY);
  __mmask16 bad = 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = load_bf16x16(y + i);
    floor = _mm512_max_ps(floor, _mm512_sub_ps(v, margin16(v, norms + i, vs, vr)));
    // NaN is unordered; infinities are caught by the magnitude test
    bad |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(_mm512_abs_ps(v), inf, _CMP_EQ_OQ);
  }
  RowFloor f{_mm512_reduce_max_ps(floor), bad == 0};
  if (i < n) {
    const RowFloor tail = floor_scalar(y + i, norms + i, n - i, scale, rel);
    f.floor = std::max(f.floor, tail.floor);
    f.finite = f.finite && tail.finite;
  }
  return f;
}

__attribute__((target("avx512f,avx512bw"))) float dot_avx512(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// Tracks the candidates of one row: the first largest exact logit, and whether there were too many.
struct Best {
  int64_t id = -1, count = 0;
  float logit = -INFINITY;
  bool take(int64_t v, float exact, int64_t max_candidates) {  // false once past max_candidates
    if (id < 0 || exact > logit) {
      logit = exact;
      id = v;
    }
    return ++count <= max_candidates;
  }
};

int64_t select_row_scalar(const uint16_t* y, const float* norms, int64_t vocab, float floor, float scale, float rel,
                          const float* h, const float* w, int64_t dim, int64_t max_candidates) {
  Best best;
  for (int64_t v = 0; v < vocab; ++v) {
    const float y_v = bf16_to_float(y[v]);
    if (y_v + scale * norms[v] + rel * std::fabs(y_v) >= floor &&
        !best.take(v, dot_scalar(h, w + v * dim, dim), max_candidates))
      return -1;
  }
  return best.id;
}

__attribute__((target("avx512f,avx512bw"))) int64_t select_row_avx512(const uint16_t* y, const float* norms,
                                                                      int64_t vocab, float floor, float scale,
                                                                      float rel, const float* h, const float* w,
                                                                      int64_t dim, int64_t max_candidates) {
  Best best;
  const __m512 vf = _mm512_set1_ps(floor), vs = _mm512_set1_ps(scale), vr = _mm512_set1_ps(rel);
  int64_t i = 0;
  for (; i + 16 <= vocab; i += 16) {
    const __m512 v = load_bf16x16(y + i);
    __mmask16 hits = _mm512_cmp_ps_mask(_mm512_add_ps(v, margin16(v, norms + i, vs, vr)), vf, _CMP_GE_OQ);
    while (hits) {  // in index order, so the first largest wins
      const int64_t t = i + __builtin_ctz(hits);
      hits &= hits - 1;
      if (!best.take(t, dot_avx512(h, w + t * dim, dim), max_candidates)) return -1;
    }
  }
  for (; i < vocab; ++i) {
    const float y_v = bf16_to_float(y[i]);
    if (y_v + scale * norms[i] + rel * std::fabs(y_v) >= floor &&
        !best.take(i, dot_avx512(h, w + i * dim, dim), max_candidates))
      return -1;
  }
  return best.id;
}

at::Tensor greedy_select_cpu(const at::Tensor& approx, const at::Tensor& hidden, const at::Tensor& weight,
                             const at::Tensor& weight_norms, const at::Tensor& row_scale, double output_rel_error,
                             int64_t max_candidates, bool scalar) {
  TORCH_CHECK(approx.device().is_cpu() && approx.scalar_type() == at::kBFloat16 && approx.dim() == 2 &&
                  approx.is_contiguous(),
              "greedy_select_cpu: approx must be a contiguous bfloat16 [N, V] CPU tensor");
  TORCH_CHECK(hidden.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat &&
                  weight_norms.scalar_type() == at::kFloat && row_scale.scalar_type() == at::kFloat,
              "greedy_select_cpu: hidden, weight, weight_norms and row_scale must be float32");
  const int64_t rows = approx.size(0), vocab = approx.size(1);
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(0) == rows && weight.dim() == 2 && weight.size(0) == vocab &&
                  weight.size(1) == hidden.size(1) && weight_norms.dim() == 1 && weight_norms.size(0) == vocab &&
                  row_scale.dim() == 1 && row_scale.size(0) == rows,
              "greedy_select_cpu: shapes disagree (approx [N, V], hidden [N, H], weight [V, H], weight_norms [V], "
              "row_scale [N])");
  const at::Tensor h = hidden.contiguous(), w = weight.contiguous(), n = weight_norms.contiguous(),
                   sc = row_scale.contiguous();
  const int64_t dim = h.size(1);
  at::Tensor out = at::empty({rows}, approx.options().dtype(at::kLong));
  const auto* y = reinterpret_cast<const uint16_t*>(approx.data_ptr<at::BFloat16>());
  const float* hp = h.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* np_ = n.data_ptr<float>();
  const float* sp = sc.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const bool avx512 = cpu_has_avx512bw() && !scalar;
  const float rel = static_cast<float>(output_rel_error);
  parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* row = y + r * vocab;
      const float scale = sp[r];
      const RowFloor f = avx512 ? floor_avx512(row, np_, vocab, scale, rel) : floor_scalar(row, np_, vocab, scale, rel);
      if (!f.finite || vocab == 0 || !std::isfinite(scale)) {
        op[r] = -1;
        continue;
      }
      op[r] = avx512 ? select_row_avx512(row, np_, vocab, f.floor, scale, rel, hp + r * dim, wp, dim, max_candidates)
                     : select_row_scalar(row, np_, vocab, f.floor, scale, rel, hp + r * dim, wp, dim, max_candidates);
    }
  });
  return out;
}

}  // namespace
}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("greedy_select_cpu(Tensor approx, Tensor hidden, Tensor weight, Tensor weight_norms, Tensor row_scale, "
        "float output_rel_error, int max_candidates, bool scalar=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("greedy_select_cpu", &pagedllm::greedy_select_cpu);
}
