// torch.ops.pagedllm.bf16_matmul_cpu: y = x W^T (+ bias) with x and W rounded to bf16 and the products summed
// and returned in float32, on AMX tiles through oneDNN's batch-reduce GEMM ukernel (ATen's cpublas::brgemm, the
// one its CPU flash attention calls). torch's own bf16 matmul rounds its output to bf16 too; that rounding, as
// large again as the inputs', is what took a 28-layer decoder's vectors under cosine 0.9999 (docs/embeddings.md).
// Pooling models only (pagedllm/model/layers/bf16_matmul.py): the weight is packed once, in VNNI pairs, in column
// blocks of kBlockN; a call splits its rows and column blocks into tasks (split_work), each rounding its rows to
// bf16 into a buffer of the thread's that stays in cache. Outputs go to buffers kept between calls
// (kept_output): a fresh 25 MB output a call cost as much in page faults as the products (docs/embeddings.md).
#include <ATen/ATen.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <vector>

#include "quant_dequant_bf16.h"
#include "thread_pool.h"

namespace pagedllm {
namespace {

namespace cpublas = at::native::cpublas;

constexpr int64_t kBlockN = 64;   // columns of one packed block (32 and 64 measured; 64 best)
constexpr int64_t kBlockM = 64;   // rows of one ukernel call (32 to 256 measured; 64 best)
constexpr int64_t kGroupTiles = 4;      // row tiles a task rounds to bf16 and multiplies by its column blocks
constexpr int64_t kTasksPerThread = 4;  // tasks a thread gets at least, where the rows allow (split_work)
// x's bf16 rows are this many values longer than K: at a row stride of a multiple of 4 KiB, the 16 rows a tile
// load reads would fall in one L1 set.
constexpr int64_t kRowPad = 32;
constexpr int64_t kNoActivation = 0;
constexpr int64_t kGelu = 1;  // the op's activation argument
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
  TORCH_CHECK(quant::has_bf16_ukernel_path(), "bf16_matmul_pack: this CPU has no AMX-BF16 ukernel");
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

// How a call's products are split: tasks of (a group of up to kGroupTiles row tiles) x (a group of column blocks),
// row group major, at least kTasksPerThread a thread so that the pool's contiguous ranges come out even; each
// task rounds its rows to bf16 into the thread's own buffer, so a thread whose tasks share a row group rounds it
// once and a call is one parallel job with no OpenMP region inside (docs/embeddings.md, Speed).
struct Split {
  int64_t tiles, group_tiles, row_groups, col_groups, blocks_per_group;
};

Split split_work(int64_t m, int64_t blocks, int64_t threads) {
  Split s;
  s.tiles = (m + kBlockM - 1) / kBlockM;
  const int64_t groups = (s.tiles + kGroupTiles - 1) / kGroupTiles;
  s.group_tiles = (s.tiles + groups - 1) / groups;  // even groups: 5 tiles are 3 + 2, not 4 + 1
  s.row_groups = (s.tiles + s.group_tiles - 1) / s.group_tiles;
  const int64_t wanted = (kTasksPerThread * threads + s.row_groups - 1) / s.row_groups;
  s.col_groups = std::max<int64_t>(1, std::min(blocks, wanted));
  s.blocks_per_group = (blocks + s.col_groups - 1) / s.col_groups;
  s.col_groups = (blocks + s.blocks_per_group - 1) / s.blocks_per_group;
  return s;
}

at::Tensor bf16_matmul_cpu(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                           int64_t n, int64_t activation) {
  TORCH_CHECK(activation == kNoActivation || activation == kGelu, "bf16_matmul_cpu: activation must be 0 (none) or ",
              kGelu, " (GELU), got ", activation);
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
  const float* bias_p = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous(),
                "bf16_matmul_cpu: bias must be a contiguous float32 [n] tensor");
    bias_p = bias->data_ptr<float>();
  }
  const at::Tensor rows_x = x.stride(1) == 1 ? x : x.contiguous();
  const float* xp = rows_x.data_ptr<float>();
  const int64_t ldx = rows_x.stride(0), lda = (k + 31) / 32 * 32 + kRowPad;  // 64-byte aligned rows
  const at::BFloat16* w = packed.data_ptr<at::BFloat16>();
  float* c = y.data_ptr<float>();
  const Split s = split_work(m, blocks, at::get_num_threads());
  parallel_for(0, s.row_groups * s.col_groups, 1, [&](int64_t t0, int64_t t1) {
    // Every ukernel call is kBlockM rows (ATen keeps a generated kernel per shape it is called with: a last tile of
    // each batch's own row count would add kernels with every new batch size); a group's rows past m are zeros,
    // their products land in tail.
    thread_local quant::AlignedScratch scratch;
    uint16_t* rows_bf16 = scratch.get(kGroupTiles * kBlockM * lda);
    const at::BFloat16* a = reinterpret_cast<const at::BFloat16*>(rows_bf16);
    float tail[kBlockM * kBlockN];  // a last tile's rows past m, the last block's columns past n
    int64_t rounded_group = -1;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t g = t / s.col_groups, cg = t % s.col_groups;
      const int64_t r0 = g * s.group_tiles * kBlockM, r1 = std::min(m, r0 + s.group_tiles * kBlockM);
      const int64_t padded = (r1 - r0 + kBlockM - 1) / kBlockM * kBlockM;
      if (g != rounded_group) {
        quant::round_rows_bf16_avx512(xp + r0 * ldx, ldx, r1 - r0, k, rows_bf16, lda, padded);
        rounded_group = g;
      }
      const int64_t b_end = std::min(blocks, (cg + 1) * s.blocks_per_group);
      for (int64_t b = cg * s.blocks_per_group; b < b_end; ++b) {
        const int64_t col = b * kBlockN, cols = std::min(kBlockN, n - col);
        for (int64_t r = r0; r < r1; r += kBlockM) {
          const int64_t rows = std::min(kBlockM, r1 - r);
          const bool direct = cols == kBlockN && rows == kBlockM;
          float* out = direct ? c + r * n + col : tail;
          const int64_t ldc = direct ? n : kBlockN;
          // the bias written first and the products added to it: no second pass over y
          if (bias_p != nullptr)
            for (int64_t i = 0; i < kBlockM; ++i) std::memcpy(out + i * ldc, bias_p + col, cols * sizeof(float));
          cpublas::brgemm(kBlockM, kBlockN, k, lda, kBlockN, ldc, bias_p != nullptr, a + (r - r0) * lda,
                          w + b * k * kBlockN, out);
          if (activation == kGelu) quant::gelu_rows_avx512(out, ldc, rows, cols);  // the tile still in cache
          if (!direct)
            for (int64_t i = 0; i < rows; ++i) std::memcpy(c + (r + i) * n + col, tail + i * kBlockN, cols * 4);
        }
      }
    }
    cpublas::brgemm_release();
  });
  return y;
}

bool bf16_matmul_available() { return quant::has_bf16_ukernel_path(); }

}  // namespace
}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  // Whether this CPU runs the op: AMX-BF16 for the ukernel, AVX-512 BF16 for the rounding.
  m.def("bf16_matmul_available() -> bool", &pagedllm::bf16_matmul_available);
  m.def("bf16_matmul_pack(Tensor weight) -> Tensor");
  // activation: 0 none, 1 GELU (the erf form) applied to each output tile (an encoder's FFN up projection).
  m.def("bf16_matmul_cpu(Tensor x, Tensor packed, Tensor? bias, int n, int activation=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("bf16_matmul_pack", &pagedllm::bf16_matmul_pack);
  m.impl("bf16_matmul_cpu", &pagedllm::bf16_matmul_cpu);
}
