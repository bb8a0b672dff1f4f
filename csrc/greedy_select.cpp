// torch.ops.pagedllm.greedy_select_cpu: each row's float32 argmax of hidden @ weight^T, found from
// approximate bfloat16 logits (pagedllm/model/layers/greedy_head.py explains the bound).
//
// Per row, two passes over its approximate logits: the largest value and the largest magnitude
// (which bound the error), then every logit within twice the bound of the largest is a candidate
// whose exact float32 dot product is computed here; the first largest wins, as argmax picks.
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

struct RowStats {
  float top, largest;
  bool finite;
};

RowStats stats_scalar(const uint16_t* y, int64_t n) {
  RowStats s{-INFINITY, 0.f, true};
  for (int64_t i = 0; i < n; ++i) {
    const float v = bf16_to_float(y[i]);
    if (!std::isfinite(v)) s.finite = false;
    s.top = std::max(s.top, v);
    s.largest = std::max(s.largest, std::fabs(v));
  }
  return s;
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

__attribute__((target("avx512f,avx512bw"))) RowStats stats_avx512(const uint16_t* y, int64_t n) {
  __m512 top = _mm512_set1_ps(-INFINITY), largest = _mm512_setzero_ps();
  __mmask16 bad = 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = load_bf16x16(y + i);
    top = _mm512_max_ps(top, v);
    largest = _mm512_max_ps(largest, _mm512_abs_ps(v));
    // NaN is unordered; infinities are caught by the magnitude test
    bad |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(_mm512_abs_ps(v), _mm512_set1_ps(INFINITY), _CMP_EQ_OQ);
  }
  RowStats s{_mm512_reduce_max_ps(top), _mm512_reduce_max_ps(largest), bad == 0};
  if (i < n) {
    const RowStats tail = stats_scalar(y + i, n - i);
    s.top = std::max(s.top, tail.top);
    s.largest = std::max(s.largest, tail.largest);
    s.finite = s.finite && tail.finite;
  }
  return s;
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

int64_t select_row_scalar(const uint16_t* y, int64_t vocab, float threshold, const float* h, const float* w,
                          int64_t dim, int64_t max_candidates) {
  Best best;
  for (int64_t v = 0; v < vocab; ++v)
    if (bf16_to_float(y[v]) >= threshold && !best.take(v, dot_scalar(h, w + v * dim, dim), max_candidates))
      return -1;
  return best.id;
}

__attribute__((target("avx512f,avx512bw"))) int64_t select_row_avx512(const uint16_t* y, int64_t vocab,
                                                                      float threshold, const float* h,
                                                                      const float* w, int64_t dim,
                                                                      int64_t max_candidates) {
  Best best;
  const __m512 thr = _mm512_set1_ps(threshold);
  int64_t i = 0;
  for (; i + 16 <= vocab; i += 16) {
    __mmask16 hits = _mm512_cmp_ps_mask(load_bf16x16(y + i), thr, _CMP_GE_OQ);
    while (hits) {  // in index order, so the first largest wins
      const int64_t v = i + __builtin_ctz(hits);
      hits &= hits - 1;
      if (!best.take(v, dot_avx512(h, w + v * dim, dim), max_candidates)) return -1;
    }
  }
  for (; i < vocab; ++i)
    if (bf16_to_float(y[i]) >= threshold && !best.take(i, dot_avx512(h, w + i * dim, dim), max_candidates))
      return -1;
  return best.id;
}

at::Tensor greedy_select_cpu(const at::Tensor& approx, const at::Tensor& hidden, const at::Tensor& weight,
                             const at::Tensor& bound, double output_rel_error, int64_t max_candidates,
                             bool scalar) {
  TORCH_CHECK(approx.device().is_cpu() && approx.scalar_type() == at::kBFloat16 && approx.dim() == 2 &&
                  approx.is_contiguous(),
              "greedy_select_cpu: approx must be a contiguous bfloat16 [N, V] CPU tensor");
  TORCH_CHECK(hidden.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat &&
                  bound.scalar_type() == at::kFloat,
              "greedy_select_cpu: hidden, weight and bound must be float32");
  const int64_t rows = approx.size(0), vocab = approx.size(1);
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(0) == rows && weight.dim() == 2 && weight.size(0) == vocab &&
                  weight.size(1) == hidden.size(1) && bound.dim() == 1 && bound.size(0) == rows,
              "greedy_select_cpu: shapes disagree (approx [N, V], hidden [N, H], weight [V, H], bound [N])");
  const at::Tensor h = hidden.contiguous(), w = weight.contiguous(), b = bound.contiguous();
  const int64_t dim = h.size(1);
  at::Tensor out = at::empty({rows}, approx.options().dtype(at::kLong));
  const auto* y = reinterpret_cast<const uint16_t*>(approx.data_ptr<at::BFloat16>());
  const float* hp = h.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const bool avx512 = cpu_has_avx512bw() && !scalar;
  const float rel = static_cast<float>(output_rel_error);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* row = y + r * vocab;
      const RowStats s = avx512 ? stats_avx512(row, vocab) : stats_scalar(row, vocab);
      if (!s.finite || vocab == 0) {
        op[r] = -1;
        continue;
      }
      const float threshold = s.top - 2.f * (bp[r] + rel * s.largest);
      op[r] = avx512 ? select_row_avx512(row, vocab, threshold, hp + r * dim, wp, dim, max_candidates)
                     : select_row_scalar(row, vocab, threshold, hp + r * dim, wp, dim, max_candidates);
    }
  });
  return out;
}

}  // namespace
}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("greedy_select_cpu(Tensor approx, Tensor hidden, Tensor weight, Tensor bound, float output_rel_error, "
        "int max_candidates, bool scalar=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("greedy_select_cpu", &pagedllm::greedy_select_cpu);
}
