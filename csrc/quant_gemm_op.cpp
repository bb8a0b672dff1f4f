// torch.ops.pagedllm.quant_gemm_cpu: y = x W^T (+ bias) on a GGUF-quantized weight repacked in
// 16-row panels (quant_gemm.h). The layout does not depend on the ISA, so `isa` picks the kernel
// per call (0 = the best this CPU runs, 1 = AVX2, 2 = AVX-512; tests run both on one machine).
// Panels are split across the op pool's threads (thread_pool.h), each a contiguous range, so each
// core streams its part of the weight linearly.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "bf16_gemm.h"
#include "quant_gemm.h"
#include "thread_pool.h"

namespace pagedllm {
namespace {

bool has_avx512() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  }();
  return has;
}

bool has_avx2() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }();
  return has;
}

// The kernel a call with this `isa` request runs: 2 = AVX-512, 1 = AVX2, 0 = none here.
int64_t quant_gemm_isa(int64_t isa) {
  if ((isa == 0 || isa == 2) && has_avx512()) return 2;
  if ((isa == 0 || isa == 1) && has_avx2()) return 1;
  return 0;
}

at::Tensor quant_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t n,
                      const c10::optional<at::Tensor>& bias, int64_t isa, bool invariant) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "quant_gemm_cpu: x must be a 2-D float32 CPU tensor");
  TORCH_CHECK(x.stride(1) == 1 || x.size(1) <= 1, "quant_gemm_cpu: x's rows must be dense (stride(1) == 1)");
  const bool is_bf16 = qtype == bf16::kBF16;  // bf16 weights: same panels, no scales (bf16_gemm.h)
  const int64_t bb = is_bf16 ? bf16::kBlockBytes : quant::block_bytes(static_cast<int>(qtype));
  TORCH_CHECK(bb > 0, "quant_gemm_cpu: unsupported quantization type ", qtype);
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.dim() == 3 &&
                  packed.is_contiguous() && packed.size(2) == bb,
              "quant_gemm_cpu: packed must be a contiguous uint8 [panels, K / 32, ", bb, "] tensor");
  const int64_t m = x.size(0), k = x.size(1), num_panels = packed.size(0);
  TORCH_CHECK(packed.size(1) * quant::kBlockK == k, "quant_gemm_cpu: x has ", k, " columns, the weight ",
              packed.size(1) * quant::kBlockK);
  TORCH_CHECK(n > (num_panels - 1) * quant::kPanelRows && n <= num_panels * quant::kPanelRows,
              "quant_gemm_cpu: n = ", n, " does not fit ", num_panels, " panels of ", quant::kPanelRows);
  const int64_t chosen = quant_gemm_isa(isa);
  TORCH_CHECK(chosen != 0, "quant_gemm_cpu: no kernel for isa ", isa, " on this CPU");
  const float* bias_p = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kFloat && bias->dim() == 1 &&
                    bias->size(0) == n && bias->is_contiguous(),
                "quant_gemm_cpu: bias must be a contiguous float32 [n] tensor");
    bias_p = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  if (k == 0) return bias_p != nullptr ? y.copy_(bias->unsqueeze(0).expand({m, n})) : y.zero_();
  if (is_bf16) return bf16::gemm(x, packed, n, bias_p, chosen);
  const quant::Args args{static_cast<int>(qtype), x.data_ptr<float>(), x.stride(0), packed.data_ptr<uint8_t>(),
                         bias_p, y.data_ptr<float>(), n, m, n, k};
  auto kernel = invariant ? (chosen == 2 ? &quant::quant_panels_invariant_avx512 : &quant::quant_panels_invariant_avx2)
                          : (chosen == 2 ? &quant::quant_panels_avx512 : &quant::quant_panels_avx2);
  parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) { kernel(args, begin, end); });
  return y;
}

at::Tensor quant_gemm_cpu(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t n,
                          const c10::optional<at::Tensor>& bias, int64_t isa) {
  return quant_gemm(x, packed, qtype, n, bias, isa, false);
}

// The batch-invariant mode's call: each row's sum order is fixed (one chain per column), so a row's
// result does not depend on the other rows, their number or the thread count.
at::Tensor quant_gemm_invariant_cpu(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t n,
                                    const c10::optional<at::Tensor>& bias, int64_t isa) {
  return quant_gemm(x, packed, qtype, n, bias, isa, true);
}

}  // namespace
}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("quant_gemm_isa(int isa) -> int", &pagedllm::quant_gemm_isa);
  m.def("quant_gemm_cpu(Tensor x, Tensor packed, int qtype, int n, Tensor? bias, int isa) -> Tensor");
  m.def("quant_gemm_invariant_cpu(Tensor x, Tensor packed, int qtype, int n, Tensor? bias, int isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("quant_gemm_cpu", &pagedllm::quant_gemm_cpu);
  m.impl("quant_gemm_invariant_cpu", &pagedllm::quant_gemm_invariant_cpu);
}
