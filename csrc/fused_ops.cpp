// The small per-layer ops of a decode step, one call each instead of several ATen calls:
//   rms_norm_cpu        out = x * rsqrt(mean(x^2) + eps) * w
//   add_rms_norm_cpu    s = x + residual; (rms_norm(s), s)
//   add_rms_norm_inplace_cpu  the same, written into residual (s) and x (the norm)
//   rotary_qk_cpu       HF "rotate half" RoPE, in place on the query and key heads of a qkv row
//   silu_and_mul_cpu    silu(x[:, :d]) * x[:, d:]
// At decode (14 rows x 576) each ATen call costs far more in dispatch and OpenMP fork/join than in
// arithmetic (torch.rms_norm: ~80-110 us for ~2 us of work), so these run on the calling thread
// unless a call has enough elements to pay for a fork (kMinElemsPerTask).
//
// One AVX2 + FMA kernel serves AVX2 and AVX-512 CPUs alike: the ops are bound by dispatch and
// memory, not by vector width, and one kernel gives the same bits on both. The functions pick
// their target with attributes (the file itself is built with the baseline flags, so loading the
// library stays safe on any x86-64 CPU); the Python side calls them only where cpu_isa() >= 1.
//
// Rounding: each op is the reference's operations in its order, without contraction into FMAs
// (the functions doing them are compiled without "fma", or fence it), so they equal the torch
// reference bit for bit: the norm's sum of squares follows ATen's summation order
// (sum_squares_aten), SiLU's exp is torch's vectorized exp (exp_like_torch) and std::exp where
// torch's loop is scalar. Which vector width torch uses is found at run time by checking against
// torch (model/layers/cpu_fused.py); tests/model/test_fused_ops.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

#include "fused_ops.h"
#include "thread_pool.h"

namespace pagedllm {
namespace {

// Below this many output elements per task a call stays on one thread: an OpenMP fork/join costs
// several microseconds (far more when the cores are busy), about what a thread computes of ~32K
// outputs here. At decode (14 rows x 576 or 1536) every op runs on the calling thread.
constexpr int64_t kMinElemsPerTask = 32768;

int64_t grain_rows(int64_t cols) { return std::max<int64_t>(1, kMinElemsPerTask / std::max<int64_t>(1, cols)); }

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, ": float32 CPU tensor expected");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": 2-D tensor with a dense last dim expected");
}

// Sum of x[i]^2 in the order of ATen's vectorized inner-dim sum (cascade_sum in SumKernel.cpp,
// which torch.rms_norm's mean reaches) over W-lane vectors, W = Vectorized<float>::size() of the
// kernels torch dispatches to on this CPU: so the norm equals torch's bit for bit. Vectors go to
// 4 interleaved chains; every 2^power vectors per chain carry into up to 4 cascade levels; leftover
// vectors join chain 0, leftover scalars are summed first, then the lanes in order. Squares are
// rounded before each add (no "fma" target here), as the reference's separate pow(2) rounds them.
template <int W>
__attribute__((target("avx2"))) float sum_squares_aten(const float* __restrict x, int64_t n) {
  constexpr int64_t kIlp = 4, kLevels = 4;
  const int64_t num_vecs = n / W, size = num_vecs / kIlp;
  int64_t ceil_log2 = 1;  // ATen's CeilLog2 (1 for size <= 2)
  while (size > 2 && (int64_t{1} << ceil_log2) < size) ++ceil_log2;
  const int64_t power = std::max<int64_t>(4, ceil_log2 / kLevels), step = int64_t{1} << power, mask = step - 1;
  alignas(64) float acc[kLevels][kIlp][W] = {};
  auto add_vecs = [&](int64_t i) {
    for (int64_t k = 0; k < kIlp; ++k) {
      const float* v = x + (i * kIlp + k) * W;
      for (int l = 0; l < W; ++l) acc[0][k][l] += v[l] * v[l];
    }
  };
  int64_t i = 0;
  while (i + step <= size) {
    for (int64_t j = 0; j < step; ++j, ++i) add_vecs(i);
    for (int64_t lv = 1; lv < kLevels; ++lv) {
      for (int64_t k = 0; k < kIlp; ++k)
        for (int l = 0; l < W; ++l) {
          acc[lv][k][l] += acc[lv - 1][k][l];
          acc[lv - 1][k][l] = 0.f;
        }
      if ((i & (mask << (lv * power))) != 0) break;
    }
  }
  for (; i < size; ++i) add_vecs(i);
  for (int64_t lv = 1; lv < kLevels; ++lv)
    for (int64_t k = 0; k < kIlp; ++k)
      for (int l = 0; l < W; ++l) acc[0][k][l] += acc[lv][k][l];
  for (int64_t v = size * kIlp; v < num_vecs; ++v)
    for (int l = 0; l < W; ++l) acc[0][0][l] += x[v * W + l] * x[v * W + l];
  for (int64_t k = 1; k < kIlp; ++k)
    for (int l = 0; l < W; ++l) acc[0][0][l] += acc[0][k][l];
  float total = 0.f;
  for (int64_t e = num_vecs * W; e < n; ++e) total += x[e] * x[e];
  for (int l = 0; l < W; ++l) total += acc[0][0][l];
  return total;
}

// out = (x * inv) * w, as the reference rounds it (two products, no FMA: no "fma" target here).
__attribute__((target("avx2"))) void scale_row(const float* __restrict x, const float* __restrict w, float inv,
                                               float* __restrict out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * inv);
}

// r and out may be the same row (decoder_layers_cpu updates the residual stream in place): no restrict.
__attribute__((target("avx2"))) void add_row(const float* __restrict x, const float* r, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] + r[i];
}

// lanes: 16 or 8, the Vectorized<float> width of torch's kernels here (see sum_squares_aten).
float inv_rms(const float* x, int64_t n, float eps, int64_t lanes) {
  // Rows narrower than a vector take ATen's scalar path: the same chains over single floats.
  const float sum = n < lanes ? sum_squares_aten<1>(x, n)
                    : lanes == 16 ? sum_squares_aten<16>(x, n) : sum_squares_aten<8>(x, n);
  const float var = sum / static_cast<float>(n);
  return 1.f / std::sqrt(var + eps);
}

void check_norm_args(const at::Tensor& x, const at::Tensor& weight, int64_t lanes) {
  TORCH_CHECK(lanes == 8 || lanes == 16, "rms_norm_cpu: lanes must be 8 or 16, got ", lanes);
  check_rows(x, "rms_norm_cpu: x");
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 1 &&
                  weight.is_contiguous() && weight.size(0) == x.size(1),
              "rms_norm_cpu: weight must be a contiguous float32 [hidden] tensor matching x");
}

}  // namespace

namespace fused {

void rms_norm_rows(const float* x, int64_t x_stride, const float* w, float eps, int64_t lanes, float* out,
                   int64_t rows, int64_t n) {
  parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      scale_row(x + r * x_stride, w, inv_rms(x + r * x_stride, n, eps, lanes), out + r * n, n);
  });
}

void add_rms_norm_rows(const float* x, int64_t x_stride, const float* residual, int64_t residual_stride,
                       const float* w, float eps, int64_t lanes, float* out, float* sum, int64_t rows, int64_t n) {
  parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* s = sum + r * n;
      add_row(x + r * x_stride, residual + r * residual_stride, s, n);
      scale_row(s, w, inv_rms(s, n, eps, lanes), out + r * n, n);
    }
  });
}

}  // namespace fused

namespace {

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps, int64_t lanes) {
  check_norm_args(x, weight, lanes);
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows, n}, x.options());
  fused::rms_norm_rows(x.data_ptr<float>(), x.stride(0), weight.data_ptr<float>(), static_cast<float>(eps), lanes,
                       out.data_ptr<float>(), rows, n);
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_cpu(const at::Tensor& x, const at::Tensor& residual,
                                                    const at::Tensor& weight, double eps, int64_t lanes) {
  check_norm_args(x, weight, lanes);
  check_rows(residual, "add_rms_norm_cpu: residual");
  TORCH_CHECK(residual.sizes() == x.sizes(), "add_rms_norm_cpu: x and residual shapes differ");
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows, n}, x.options());
  at::Tensor sum = at::empty({rows, n}, x.options());
  fused::add_rms_norm_rows(x.data_ptr<float>(), x.stride(0), residual.data_ptr<float>(), residual.stride(0),
                           weight.data_ptr<float>(), static_cast<float>(eps), lanes, out.data_ptr<float>(),
                           sum.data_ptr<float>(), rows, n);
  return {out, sum};
}

// In place: residual = x + residual, x = rms_norm(residual), row by row (each row of x is read before it is
// written). A prefill step holds one [T, hidden] pair less than with the two fresh outputs above.
void add_rms_norm_inplace_cpu(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps,
                              int64_t lanes) {
  check_norm_args(x, weight, lanes);
  check_rows(residual, "add_rms_norm_inplace_cpu: residual");
  TORCH_CHECK(residual.sizes() == x.sizes(), "add_rms_norm_inplace_cpu: x and residual shapes differ");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(x.stride(0) == n && residual.stride(0) == n, "add_rms_norm_inplace_cpu: dense rows expected");
  TORCH_CHECK(x.data_ptr() != residual.data_ptr(), "add_rms_norm_inplace_cpu: x and residual are one tensor");
  fused::add_rms_norm_rows(x.data_ptr<float>(), n, residual.data_ptr<float>(), n, weight.data_ptr<float>(),
                           static_cast<float>(eps), lanes, x.data_ptr<float>(), residual.data_ptr<float>(), rows, n);
}

// One head in place: x[d] = x[d] * c[d] + x[d +- D/2] * ss[d], ss the signed sin (first half
// negated), which is HF's x * cos + rotate_half(x) * sin with the same products and sums.
__attribute__((target("avx2"))) void rotate_head(float* __restrict x, const float* __restrict c,
                                                 const float* __restrict ss, int64_t half) {
  float* __restrict hi = x + half;
  for (int64_t d = 0; d < half; ++d) {
    const float a = x[d], b = hi[d];
    x[d] = a * c[d] + b * ss[d];
    hi[d] = b * c[half + d] + a * ss[half + d];
  }
}

}  // namespace

namespace fused {

void rotary_rows(float* qkv, int64_t qkv_stride, const float* cos, const float* signed_sin, const int64_t* positions,
                 int64_t rows, int64_t num_heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  parallel_for(0, rows, grain_rows(num_heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t row = positions != nullptr ? positions[t] : t;
      for (int64_t h = 0; h < num_heads; ++h)
        rotate_head(qkv + t * qkv_stride + h * head_dim, cos + row * head_dim, signed_sin + row * head_dim, half);
    }
  });
}

}  // namespace fused

namespace {

void rotary_qk_cpu(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& signed_sin, int64_t num_heads,
                   int64_t head_dim) {
  check_rows(qkv, "rotary_qk_cpu: qkv");
  const int64_t tokens = qkv.size(0);
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0 && num_heads >= 0 && num_heads * head_dim <= qkv.size(1),
              "rotary_qk_cpu: num_heads x head_dim (", num_heads, " x ", head_dim, ") exceeds a qkv row of ",
              qkv.size(1));
  for (const at::Tensor* t : {&cos, &signed_sin})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous() &&
                    t->numel() == tokens * head_dim,
                "rotary_qk_cpu: cos and signed_sin must be contiguous float32 [num_tokens, (1,) head_dim]");
  fused::rotary_rows(qkv.data_ptr<float>(), qkv.stride(0), cos.data_ptr<float>(), signed_sin.data_ptr<float>(),
                     nullptr, tokens, num_heads, head_dim);
}

// e^x as torch's Vectorized<float>::exp computes it (SLEEF's expf_u10 with FMA: Cody-Waite
// reduction by ln 2 in two parts, a degree-5 polynomial, the scale split in two halves), so SiLU
// equals torch's bit for bit. The empty asm keeps the caller's "1 + e" from being contracted
// with the final product into an FMA.
__attribute__((target("avx2,fma"))) inline __m256 exp_like_torch(__m256 d) {
  const __m256 log2e = _mm256_set1_ps(1.442695040888963407359924681001892137426645954152985934135449406931f);
  const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(d, log2e));  // to nearest, ties to even
  const __m256 qf = _mm256_cvtepi32_ps(q);
  __m256 s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-0.693145751953125f), d);
  s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-1.428606765330187045e-06f), s);
  __m256 u = _mm256_set1_ps(0.000198527617612853646278381f);
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00139304355252534151077271f));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00833336077630519866943359f));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.0416664853692054748535156f));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.166666671633720397949219f));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.5f));
  __m256 ss = _mm256_mul_ps(s, s);
  asm("" : "+x"(ss));
  u = _mm256_add_ps(_mm256_set1_ps(1.f), _mm256_fmadd_ps(ss, u, s));
  const __m256i half = _mm256_srai_epi32(q, 1);
  const __m256i bias = _mm256_set1_epi32(127);
  u = _mm256_mul_ps(u, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23)));
  u = _mm256_mul_ps(u, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(q, half), bias), 23)));
  u = _mm256_andnot_ps(_mm256_cmp_ps(d, _mm256_set1_ps(-104.f), _CMP_LT_OQ), u);
  u = _mm256_blendv_ps(u, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(_mm256_set1_ps(100.f), d, _CMP_LT_OQ));
  asm("" : "+x"(u));
  return u;
}

// silu(g) * u over one row: vectors over whole blocks of `block` floats, then the scalar formula
// with std::exp, as torch's vectorized loop does (block = 2 x its vector width; its tail is scalar).
__attribute__((target("avx2,fma"))) void silu_mul_row(const float* __restrict g, const float* __restrict u,
                                                      float* __restrict out, int64_t n, int64_t block) {
  const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
  const int64_t vec_end = n / block * block;
  for (int64_t i = 0; i < vec_end; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 silu = _mm256_div_ps(x, _mm256_add_ps(one, exp_like_torch(_mm256_sub_ps(zero, x))));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
  }
  for (int64_t i = vec_end; i < n; ++i) {
    float e = std::exp(-g[i]);
    asm("" : "+x"(e));
    out[i] = g[i] / (1.f + e) * u[i];
  }
}

}  // namespace

namespace fused {

void silu_mul_rows(const float* x, int64_t x_stride, float* out, int64_t rows, int64_t d, int64_t block) {
  parallel_for(0, rows, grain_rows(d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) silu_mul_row(x + r * x_stride, x + r * x_stride + d, out + r * d, d, block);
  });
}

}  // namespace fused

namespace {

at::Tensor silu_and_mul_cpu(const at::Tensor& x, int64_t block) {
  check_rows(x, "silu_and_mul_cpu: x");
  TORCH_CHECK(block == 16 || block == 32, "silu_and_mul_cpu: block must be 16 or 32, got ", block);
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_and_mul_cpu: the last dim must be even (gate, then up)");
  const int64_t rows = x.size(0), d = x.size(1) / 2;
  at::Tensor out = at::empty({rows, d}, x.options());
  fused::silu_mul_rows(x.data_ptr<float>(), x.stride(0), out.data_ptr<float>(), rows, d, block);
  return out;
}

}  // namespace
}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("rms_norm_cpu(Tensor x, Tensor weight, float eps, int lanes) -> Tensor");
  m.def("add_rms_norm_cpu(Tensor x, Tensor residual, Tensor weight, float eps, int lanes) -> (Tensor, Tensor)");
  m.def("add_rms_norm_inplace_cpu(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps, int lanes) -> ()");
  m.def("rotary_qk_cpu(Tensor(a!) qkv, Tensor cos, Tensor signed_sin, int num_heads, int head_dim) -> ()");
  m.def("silu_and_mul_cpu(Tensor x, int block) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("rms_norm_cpu", &pagedllm::rms_norm_cpu);
  m.impl("add_rms_norm_cpu", &pagedllm::add_rms_norm_cpu);
  m.impl("add_rms_norm_inplace_cpu", &pagedllm::add_rms_norm_inplace_cpu);
  m.impl("rotary_qk_cpu", &pagedllm::rotary_qk_cpu);
  m.impl("silu_and_mul_cpu", &pagedllm::silu_and_mul_cpu);
}
