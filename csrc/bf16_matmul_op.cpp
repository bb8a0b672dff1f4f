// torch.ops.pagedllm.bf16_matmul_cpu: y = x W^T (+ bias) with x and W rounded to bf16 and the products summed
// and returned in float32, on AMX tiles through oneDNN's batch-reduce GEMM ukernel (ATen's cpublas::brgemm, the
// one its CPU flash attention calls). torch's own bf16 matmul rounds its output to bf16 too; that rounding, as
// large again as the inputs', is what took a 28-layer decoder's vectors under cosine 0.9999 (docs/embeddings.md).
// Pooling models only (pagedllm/model/layers/bf16_matmul.py): the weight is packed once, in VNNI pairs, in column
// blocks of kBlockN; a call walks its rows kChunkM at a time (the chunk's rows rounded to bf16 into a buffer that
// stays in cache) and splits the column blocks over the threads. Outputs go to buffers kept between calls
// (kept_output): a fresh 25 MB output a call cost as much in page faults as the products (docs/embeddings.md).
#include <ATen/ATen.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <vector>

#include "thread_pool.h"

namespace pagedllm {
namespace {

namespace cpublas = at::native::cpublas;

constexpr int64_t kBlockN = 64;   // columns of one packed block (32 and 64 measured; 64 best)
constexpr int64_t kBlockM = 64;   // rows of one ukernel call (32 to 256 measured; 64 best)
constexpr int64_t kChunkM = 256;  // rows whose bf16 copy the threads share before the next chunk
// A transformer layer holds at most four linear outputs at once (q/k/v, o, up, down); two more leave room for
// the next layer's first outputs while the previous layer's last ones are still held.
constexpr size_t kMaxKept = 6;

std::mutex kept_mutex;
std::vector<c10::Storage> kept;  // float32 buffers; one is free when no tensor but this list refers to it

// An uninitialized float32 [m, n] tensor over a kept buffer, whose pages are already mapped. A buffer is handed
// out only while nothing else holds its storage: a caller's previous result (the next layer's input), or any view
// of it, keeps its buffer out of reuse until it is dropped, so no kept output is ever written under a live one.
at::Tensor kept_output(int64_t m, int64_t n, const at::TensorOptions& options) {
  const size_t bytes = static_cast<size_t>(m * n) * sizeof(float);
  std::lock_guard<std::mutex> lock(kept_mutex);
  int64_t best = -1, smallest_free = -1;
  for (size_t i = 0; i < kept.size(); ++i) {
    if (kept[i].use_count() != 1) continue;
    const size_t size = kept[i].nbytes();
    if (size >= bytes && (best < 0 || size < kept[best].nbytes())) best = static_cast<int64_t>(i);
    if (smallest_free < 0 || size < kept[smallest_free].nbytes()) smallest_free = static_cast<int64_t>(i);
  }
  c10::Storage storage;
  if (best >= 0) {
    storage = kept[best];
  } else {
    storage = at::empty({m * n}, options).storage();
    if (kept.size() < kMaxKept)
      kept.push_back(storage);
    else if (smallest_free >= 0)
      kept[smallest_free] = storage;  // too small for this shape: the larger one replaces it
  }
  at::Tensor y = at::empty({0}, options);
  y.set_(storage, 0, {m, n}, {n, 1});
  return y;
}

// W [n, K] float32 or bf16 -> [ceil(n / kBlockN), K * kBlockN] bf16, each block VNNI-packed (zero columns past n).
at::Tensor bf16_matmul_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2, "bf16_matmul_pack: weight must be a 2-D CPU tensor");
  TORCH_CHECK(cpublas::could_pack(at::kBFloat16), "bf16_matmul_pack: this CPU has no AMX-BF16 ukernel");
  const int64_t n = weight.size(0), k = weight.size(1), blocks = (n + kBlockN - 1) / kBlockN;
  TORCH_CHECK(k % 2 == 0, "bf16_matmul_pack: K must be even (VNNI pairs), got ", k);
  at::Tensor wt = at::zeros({k, blocks * kBlockN}, weight.options().dtype(at::kBFloat16));
  wt.narrow(1, 0, n).copy_(weight.t());
  at::Tensor packed = at::empty({blocks, k * kBlockN}, wt.options());
  for (int64_t b = 0; b < blocks; ++b)
    cpublas::pack(k, kBlockN, blocks * kBlockN, kBlockN, at::kBFloat16, at::kBFloat16,
                  wt.data_ptr<at::BFloat16>() + b * kBlockN, packed[b].data_ptr<at::BFloat16>());
  return packed;
}

at::Tensor bf16_matmul_cpu(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                           int64_t n) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kFloat,
              "bf16_matmul_cpu: x must be a 2-D float32 CPU tensor");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 2 && packed.is_contiguous(),
              "bf16_matmul_cpu: packed must come from bf16_matmul_pack");
  const int64_t m = x.size(0), k = x.size(1), blocks = packed.size(0);
  TORCH_CHECK(packed.size(1) == k * kBlockN, "bf16_matmul_cpu: x has ", k, " columns, the weight ",
              packed.size(1) / kBlockN);
  TORCH_CHECK(n > (blocks - 1) * kBlockN && n <= blocks * kBlockN, "bf16_matmul_cpu: n = ", n, " does not fit ",
              blocks, " blocks");
  if (m == 0) return at::empty({0, n}, x.options());
  at::Tensor y = kept_output(m, n, x.options());
  // x is rounded to bf16 a chunk at a time into one chunk-sized buffer that stays in cache for the chunk's
  // products: no [m, k] bf16 copy of x allocated and written out to memory a call. Every ukernel call is kBlockM
  // rows (ATen keeps a generated kernel per shape it is called with: a last tile of each batch's own row count
  // would add kernels with every new batch size); the chunk's rows past m are zeros, their products land in tail.
  const int64_t chunk_rows = std::min(m, kChunkM);
  at::Tensor xb = at::empty({(chunk_rows + kBlockM - 1) / kBlockM * kBlockM, k}, x.options().dtype(at::kBFloat16));
  const at::BFloat16* a = xb.data_ptr<at::BFloat16>();
  const at::BFloat16* w = packed.data_ptr<at::BFloat16>();
  float* c = y.data_ptr<float>();
  const float* bias_p = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous(),
                "bf16_matmul_cpu: bias must be a contiguous float32 [n] tensor");
    bias_p = bias->data_ptr<float>();
  }
  for (int64_t m0 = 0; m0 < m; m0 += kChunkM) {
    const int64_t m1 = std::min(m, m0 + kChunkM);
    xb.narrow(0, 0, m1 - m0).copy_(x.narrow(0, m0, m1 - m0));
    const int64_t padded_rows = (m1 - m0 + kBlockM - 1) / kBlockM * kBlockM;
    if (padded_rows > m1 - m0) xb.narrow(0, m1 - m0, padded_rows - (m1 - m0)).zero_();
    parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      float tail[kBlockM * kBlockN];  // a last tile's rows past m, the last block's columns past n
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t col = b * kBlockN, cols = std::min(kBlockN, n - col);
        for (int64_t r = m0; r < m1; r += kBlockM) {
          const int64_t rows = std::min(kBlockM, m1 - r);
          const bool direct = cols == kBlockN && rows == kBlockM;
          float* out = direct ? c + r * n + col : tail;
          const int64_t ldc = direct ? n : kBlockN;
          // the bias written first and the products added to it: no second pass over y
          if (bias_p != nullptr)
            for (int64_t i = 0; i < kBlockM; ++i) std::memcpy(out + i * ldc, bias_p + col, cols * sizeof(float));
          cpublas::brgemm(kBlockM, kBlockN, k, k, kBlockN, ldc, bias_p != nullptr, a + (r - m0) * k,
                          w + b * k * kBlockN, out);
          if (!direct)
            for (int64_t i = 0; i < rows; ++i) std::memcpy(c + (r + i) * n + col, tail + i * kBlockN, cols * 4);
        }
      }
      cpublas::brgemm_release();
    });
  }
  return y;
}

bool bf16_matmul_available() { return cpublas::could_pack(at::kBFloat16); }

}  // namespace
}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  // Whether this CPU runs the AMX-BF16 ukernel the op needs.
  m.def("bf16_matmul_available() -> bool", &pagedllm::bf16_matmul_available);
  m.def("bf16_matmul_pack(Tensor weight) -> Tensor");
  m.def("bf16_matmul_cpu(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("bf16_matmul_pack", &pagedllm::bf16_matmul_pack);
  m.impl("bf16_matmul_cpu", &pagedllm::bf16_matmul_cpu);
}
