// torch.ops.pagedllm.gemm_packed_cpu: y = x W^T (+ bias) on a weight packed in panels
// (cpu_gemm.h; packed by pagedllm/model/layers/cpu_gemm.py). The panel width tells which kernel
// packed it: 32 columns -> AVX-512, 16 -> AVX2 + FMA; the op refuses a width this CPU cannot run.
// Panels are split across the intra-op threads (parallel_for, thread_pool.h), each thread a contiguous
// range, so each core streams its part of the weight linearly.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>

#include "cpu_gemm.h"
#include "thread_pool.h"

namespace pagedllm {
namespace {

bool cpu_has_avx512() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;
  }();
  return has;
}

bool cpu_has_avx2_fma() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return has;
}

// The panel width to pack for: isa 2 = AVX-512, 1 = AVX2, 0 = the best this CPU runs; 0 if none.
int64_t gemm_panel_width(int64_t isa) {
  if ((isa == 0 || isa == 2) && cpu_has_avx512()) return gemm::kNrAvx512;
  if ((isa == 0 || isa == 1) && cpu_has_avx2_fma()) return gemm::kNrAvx2;
  return 0;
}

// Chunked sweeps for 2..this many row blocks (cpu_gemm_kernel.h): 15-56 rows on AVX-512, 7-24 on
// AVX2. At 5+ blocks the blocks' packed x (~66 KB a chunk at 13 rows) no longer fits L1 and compute
// dominates anyway: chunks ran 1.03-1.07x slower at 96-128 rows (1 thread, 120 linears).
constexpr int64_t kDefaultChunkMaxBlocks = 4;
std::atomic<int64_t> chunk_max_blocks{kDefaultChunkMaxBlocks};

// Sets the limit (1 = never chunk: the previous schedule, an A/B switch for scripts/cpu_gemm_sweep.py;
// 0 = the default) and returns the previous one; a negative value only reads it.
int64_t gemm_chunk_max_blocks(int64_t value) {
  if (value < 0) return chunk_max_blocks.load();
  return chunk_max_blocks.exchange(value == 0 ? kDefaultChunkMaxBlocks : value);
}

std::atomic<bool> far_prefetch{true};

// Turns the far L2 prefetch on (1) or off (0: as before it, an A/B switch) and returns the
// previous setting; a negative value only reads it.
int64_t gemm_far_prefetch(int64_t value) {
  return value < 0 ? far_prefetch.load() : far_prefetch.exchange(value != 0);
}

at::Tensor gemm_packed(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       int64_t n, bool invariant) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "gemm_packed_cpu: x must be a 2-D float32 CPU tensor");
  TORCH_CHECK(x.stride(1) == 1 || x.size(1) <= 1, "gemm_packed_cpu: x's rows must be dense (stride(1) == 1)");
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kFloat && packed.dim() == 3 &&
                  packed.is_contiguous(),
              "gemm_packed_cpu: packed must be a contiguous float32 [panels, K, NR] tensor");
  const int64_t m = x.size(0), k = x.size(1), nr = packed.size(2), num_panels = packed.size(0);
  TORCH_CHECK(packed.size(1) == k, "gemm_packed_cpu: x has ", k, " columns, the packed weight K = ", packed.size(1));
  TORCH_CHECK(n > (num_panels - 1) * nr && n <= num_panels * nr, "gemm_packed_cpu: n = ", n, " does not fit ",
              num_panels, " panels of ", nr);
  void (*kernel)(const gemm::Args&, int64_t, int64_t) = nullptr;
  if (nr == gemm::kNrAvx512 && cpu_has_avx512())
    kernel = invariant ? &gemm::gemm_panels_invariant_avx512 : &gemm::gemm_panels_avx512;
  if (nr == gemm::kNrAvx2 && cpu_has_avx2_fma())
    kernel = invariant ? &gemm::gemm_panels_invariant_avx2 : &gemm::gemm_panels_avx2;
  TORCH_CHECK(kernel != nullptr, "gemm_packed_cpu: no kernel for ", nr, "-column panels on this CPU");
  const float* bias_p = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kFloat && bias->dim() == 1 &&
                    bias->size(0) == n && bias->is_contiguous(),
                "gemm_packed_cpu: bias must be a contiguous float32 [n] tensor");
    bias_p = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  if (k == 0) {
    return bias_p != nullptr ? y.copy_(bias->unsqueeze(0).expand({m, n})) : y.zero_();
  }
  const gemm::Args args{x.data_ptr<float>(), x.stride(0), packed.data_ptr<float>(), bias_p,
                        y.data_ptr<float>(), n, m, n, k, chunk_max_blocks.load(std::memory_order_relaxed),
                        far_prefetch.load(std::memory_order_relaxed)};
  parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) { kernel(args, begin, end); });
  return y;
}

at::Tensor gemm_packed_cpu(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                           int64_t n) {
  return gemm_packed(x, packed, bias, n, false);
}

// The batch-invariant mode's GEMM: each row's sum order is fixed (one chain over k, then the bias),
// so a row's result does not depend on the other rows, their number or the thread count.
at::Tensor gemm_packed_invariant_cpu(const at::Tensor& x, const at::Tensor& packed,
                                     const c10::optional<at::Tensor>& bias, int64_t n) {
  return gemm_packed(x, packed, bias, n, true);
}

}  // namespace
}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  // The panel width to pack a weight in for an ISA (2 = AVX-512, 1 = AVX2, 0 = best); 0 = none.
  m.def("gemm_panel_width(int isa) -> int", &pagedllm::gemm_panel_width);
  m.def("gemm_chunk_max_blocks(int value) -> int", &pagedllm::gemm_chunk_max_blocks);
  m.def("gemm_far_prefetch(int value) -> int", &pagedllm::gemm_far_prefetch);
  m.def("gemm_packed_cpu(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
  m.def("gemm_packed_invariant_cpu(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("gemm_packed_cpu", &pagedllm::gemm_packed_cpu);
  m.impl("gemm_packed_invariant_cpu", &pagedllm::gemm_packed_invariant_cpu);
}
