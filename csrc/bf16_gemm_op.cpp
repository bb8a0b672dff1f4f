// bf16::gemm: quant_gemm_cpu's work for kernel type kBF16 (bf16_gemm.h), once that op has checked
// the shapes and chosen the ISA. Panels are split across the op pool's threads in contiguous
// ranges, as for the quantized types.
#include "bf16_gemm.h"

#include "thread_pool.h"

namespace pagedllm {
namespace bf16 {

at::Tensor gemm(const at::Tensor& x, const at::Tensor& packed, int64_t n, const float* bias, int64_t chosen) {
  const int64_t m = x.size(0), k = x.size(1), num_panels = packed.size(0);
  at::Tensor y = at::empty({m, n}, x.options());
  const Args args{x.data_ptr<float>(), x.stride(0), reinterpret_cast<const uint16_t*>(packed.data_ptr<uint8_t>()),
                  bias, y.data_ptr<float>(), n, m, n, k};
  auto kernel = chosen == 2 ? &panels_avx512 : &panels_avx2;
  parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) { kernel(args, begin, end); });
  return y;
}

}  // namespace bf16
}  // namespace pagedllm
