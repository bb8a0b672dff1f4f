// torch.ops.pagedllm.quant_gemm_cpu: y = x W^T (+ bias) on a GGUF-quantized weight repacked in
// 16-row panels (quant_gemm.h). The layout does not depend on the ISA, so `isa` picks the kernel
// per call (0 = the best this CPU runs, 1 = AVX2, 2 = AVX-512; tests run both on one machine).
// Panels are split across the op pool's threads (thread_pool.h), each a contiguous range, so each
// core streams its part of the weight linearly. The int8-activation types (quant_gemm_int8.h) go
// through the same op (so the fused decoder layer calls them as any other kind): x is quantized
// first (rows over the pool), then the panels as above; so do the K-quant types (quant_gemm_kq.h), whose
// panels hold 256-wide super-blocks.
//
// On a CPU with AMX-BF16 tiles, a call of many rows on an int8-activation type takes the bf16 path instead
// (quant_dequant_bf16.h): x rounded to bf16, the weight unpacked to bf16 64 columns at a time into the VNNI
// layout of oneDNN's AMX ukernel (ATen's cpublas::brgemm, as bf16_matmul_op.cpp), the products summed in float32
// straight into y. No oneDNN primitive is built per shape, so no row count grows the process (a primitive held
// ~7 MiB), and no call pads its rows. Prefill steps are bound by
// the int8 kernels' arithmetic, and the tiles do that arithmetic several times faster. Its rounding is not
// the int8 kernels', so the batch-invariant call (quant_gemm_invariant_cpu) never takes it: there a row's
// result must not depend on how many rows share the call.
#include <ATen/ATen.h>
#include <ATen/cpu/Utils.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <tuple>
#include <vector>

#include "bf16_gemm.h"
#include "quant_gemm.h"
#include "quant_gemm_int8.h"
#include "quant_dequant_bf16.h"
#include "quant_gemm_kq.h"
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

bool has_avx512_vnni() {
  static const bool has = [] {
    __builtin_cpu_init();
    return has_avx512() && __builtin_cpu_supports("avx512vnni");
  }();
  return has;
}

// The kernel a call with this `isa` request runs: 2 = AVX-512, 1 = AVX2, 0 = none here.
int64_t quant_gemm_isa(int64_t isa) {
  if ((isa == 0 || isa == 2) && has_avx512()) return 2;
  if ((isa == 0 || isa == 1) && has_avx2()) return 1;
  return 0;
}

// x [M, K] quantized per 32-block (quant_gemm_int8.h): (xq int8 [M, K], xd float32 [M, K / 32],
// xs int32 [M, K / 32]); rows split over the pool.
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_activations(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "quantize_act_cpu: x must be a 2-D float32 CPU tensor");
  TORCH_CHECK(x.stride(1) == 1 || x.size(1) <= 1, "quantize_act_cpu: x's rows must be dense (stride(1) == 1)");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % quant::kBlockK == 0, "quantize_act_cpu: K = ", k, " is not a multiple of ", quant::kBlockK);
  at::Tensor xq = at::empty({m, k}, x.options().dtype(at::kChar));
  at::Tensor xd = at::empty({m, k / quant::kBlockK}, x.options());
  at::Tensor xs = at::empty({m, k / quant::kBlockK}, x.options().dtype(at::kInt));
  const float* xp = x.data_ptr<float>();
  const int64_t lda = x.stride(0);
  int8_t* q = xq.data_ptr<int8_t>();
  float* d = xd.data_ptr<float>();
  int32_t* s = xs.data_ptr<int32_t>();
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(k, 1));
  parallel_for(0, m, grain, [&](int64_t begin, int64_t end) { quant::quantize_rows(xp, lda, k, q, d, s, begin, end); });
  return {xq, xd, xs};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_act_cpu(const at::Tensor& x) {
  return quantize_activations(x);
}

// The kernel an int8-activation call with this `isa` request runs: 2 = AVX-512 VNNI, 1 = AVX2, 0 =
// none here (an AVX-512 CPU without VNNI runs the AVX2 one).
int64_t quant_gemm_int8_isa(int64_t isa) {
  if ((isa == 0 || isa == 2) && has_avx512_vnni()) return 2;
  if ((isa == 0 || isa == 1 || isa == 2) && has_avx2()) return 1;
  return 0;
}

// sign xd xs for every 32-block of every row: the min terms' factor (Q4_1, Q5_1: + ; Q4_K, Q5_K: -), computed once
// per row here instead of once per row for every panel in the kernels.
at::Tensor scaled_sums(const at::Tensor& xd, const at::Tensor& xs, float sign) {
  at::Tensor out = at::empty_like(xd);
  const float* d = xd.data_ptr<float>();
  const int32_t* s = xs.data_ptr<int32_t>();
  float* o = out.data_ptr<float>();
  for (int64_t i = 0, total = xd.numel(); i < total; ++i) o[i] = sign * d[i] * static_cast<float>(s[i]);
  return out;
}

// - offset xs for every 32-block of every row: the start of its integer sum (quant_gemm_int8.h's int8_offset).
at::Tensor offset_starts(const at::Tensor& xs, int32_t offset) {
  at::Tensor out = at::empty_like(xs);
  const int32_t* s = xs.data_ptr<int32_t>();
  int32_t* o = out.data_ptr<int32_t>();
  for (int64_t i = 0, total = xs.numel(); i < total; ++i) o[i] = -offset * s[i];
  return out;
}

at::Tensor int8_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t n, const float* bias_p,
                     int64_t isa, at::Tensor y) {
  const int64_t chosen = quant_gemm_int8_isa(isa);
  TORCH_CHECK(chosen != 0, "quant_gemm_cpu: no int8-activation kernel for isa ", isa, " on this CPU");
  auto [xq, xd, xs] = quantize_activations(x);
  const int32_t offset = quant::int8_offset(qtype, chosen == 2 ? 128 : 0);  // each ISA's kQ8Start
  const at::Tensor start = offset != 0 ? offset_starts(xs, offset) : at::Tensor();
  const at::Tensor xds = quant::has_min(qtype) ? scaled_sums(xd, xs, 1.0f) : at::Tensor();
  const quant::I8Args args{static_cast<int>(qtype), xq.data_ptr<int8_t>(), xd.data_ptr<float>(), xs.data_ptr<int32_t>(),
                           start.defined() ? start.data_ptr<int32_t>() : nullptr,
                           xds.defined() ? xds.data_ptr<float>() : nullptr, packed.data_ptr<uint8_t>(), bias_p, y.data_ptr<float>(), n, x.size(0), n, x.size(1)};
  auto kernel = chosen == 2 ? &quant::int8_panels_avx512vnni : &quant::int8_panels_avx2;
  parallel_for(0, packed.size(0), 1, [&](int64_t begin, int64_t end) { kernel(args, begin, end); });
  return y;
}

// Each row's sums of xq over its 16-blocks times - offset (Q6_K's - 32, Q3_K's - 4): the start of each
// 16-block's integer sum in the kernel. Rows split over the pool.
at::Tensor starts_of_16(const at::Tensor& xq, int32_t offset) {
  const int64_t m = xq.size(0), k = xq.size(1);
  at::Tensor starts = at::empty({m, k / 16}, xq.options().dtype(at::kInt));
  const int8_t* q = xq.data_ptr<int8_t>();
  int32_t* s = starts.data_ptr<int32_t>();
  parallel_for(0, m, std::max<int64_t>(1, 16384 / std::max<int64_t>(k, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin * (k / 16); i < end * (k / 16); ++i) {
      int32_t sum = 0;
      for (int j = 0; j < 16; ++j) sum += q[i * 16 + j];
      s[i] = -offset * sum;
    }
  });
  return starts;
}

at::Tensor kq_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t n, const float* bias_p,
                   int64_t isa, at::Tensor y) {
  const int64_t chosen = quant_gemm_int8_isa(isa);
  TORCH_CHECK(chosen != 0, "quant_gemm_cpu: no int8-activation kernel for isa ", isa, " on this CPU");
  auto [xq, xd, xs] = quantize_activations(x);
  const bool per_16 = qtype == quant::kQ6_K_I8 || qtype == quant::kQ3_K_I8;  // an offset per 16-block
  const at::Tensor start16 = per_16 ? starts_of_16(xq, qtype == quant::kQ6_K_I8 ? 32 : 4) : at::Tensor();
  const at::Tensor xds_neg = per_16 ? at::Tensor() : scaled_sums(xd, xs, -1.0f);
  const quant::KQArgs args{static_cast<int>(qtype), xq.data_ptr<int8_t>(), xd.data_ptr<float>(),
                           xs.data_ptr<int32_t>(), start16.defined() ? start16.data_ptr<int32_t>() : nullptr,
                           xds_neg.defined() ? xds_neg.data_ptr<float>() : nullptr,
                           packed.data_ptr<uint8_t>(), bias_p, y.data_ptr<float>(), n, x.size(0), n, x.size(1)};
  auto kernel = chosen == 2 ? &quant::kq_panels_avx512vnni : &quant::kq_panels_avx2;
  parallel_for(0, packed.size(0), 1, [&](int64_t begin, int64_t end) { kernel(args, begin, end); });
  return y;
}

bool cpu_has(const std::unordered_map<std::string, c10::IValue>& caps, const char* key) {
  const auto it = caps.find(key);
  return it != caps.end() && it->second.isBool() && it->second.toBool();
}

bool has_avx512_bf16() {
  static const bool has = cpu_has(at::cpu::get_cpu_capabilities(), "avx512_bf16");
  return has;
}


// Rows from which an int8-activation call takes the bf16 path; 0 = never. Where the CPU runs it,
// PAGEDLLM_BF16_PREFILL_ROWS or 96 (pagedllm/envs.py validates the variable before the library loads);
// elsewhere 0. quant_gemm_bf16_rows changes it (tests, A/B runs).
constexpr int64_t kDefaultBf16Rows = 96;
std::atomic<int64_t> g_bf16_rows{[] {
  if (!quant::has_bf16_ukernel_path()) return int64_t{0};
  const char* text = std::getenv("PAGEDLLM_BF16_PREFILL_ROWS");
  return text != nullptr && *text != '\0' ? static_cast<int64_t>(std::atoll(text)) : kDefaultBf16Rows;
}()};

int64_t quant_gemm_bf16_rows(int64_t rows) {
  if (rows < 0) return g_bf16_rows.load();
  TORCH_CHECK(rows == 0 || quant::has_bf16_ukernel_path(),
              "quant_gemm_bf16_rows: the bf16 path needs AVX-512 BF16 and AMX-BF16");
  return g_bf16_rows.exchange(rows);
}

// The bf16 path's blocking. Rows are rounded to bf16 a chunk at a time (the weight is unpacked once per chunk;
// 512 = the CPU's default step budget). A thread unpacks a part of its weight blocks (64 columns: four 16-row
// panels), as many as fit kBf16PartBytes, then multiplies each 64-row tile of the chunk by each block of the part,
// kBf16KStep of K at a time: the tile's slice of x and the block's slice of weight (256 KiB each) stay in L2
// while the tile is reused across the part.
constexpr int64_t kBf16ChunkRows = 512;
constexpr int64_t kVnniCols = 64;
constexpr int64_t kBrgemmRows = 64;
constexpr int64_t kBf16KStep = 2048;
constexpr int64_t kBf16PartBytes = 1 << 20;
// x's bf16 rows are this many values longer than K: at a row stride of a multiple of 4 KiB, the 16 rows a tile
// load reads would fall in one L1 set.
constexpr int64_t kBf16RowPad = 32;

at::Tensor bf16_gemm_path(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t n,
                          const float* bias, at::Tensor y) {
  namespace cpublas = at::native::cpublas;
  const int64_t m = x.size(0), k = x.size(1), num_panels = packed.size(0);
  constexpr int64_t panels_per_block = kVnniCols / quant::kPanelRows;
  const int64_t blocks = (num_panels + panels_per_block - 1) / panels_per_block;
  const int64_t block_values = k * kVnniCols;
  const int64_t part_blocks = std::max<int64_t>(1, kBf16PartBytes / (block_values * 2));
  const int64_t lda = (k + 31) / 32 * 32 + kBf16RowPad;  // 64-byte aligned rows
  // Every ukernel call is kBrgemmRows rows: ATen keeps a generated kernel for each shape it is called with, so a
  // last tile of the step's own row count would add kernels with every new prompt length (the process grew ~390
  // MiB over prompts of 90-270 tokens). The chunk's rows past m are zeros; their products land in `tail`.
  const int64_t chunk_rows = std::min(m, kBf16ChunkRows);
  at::Tensor xb = at::empty({(chunk_rows + kBrgemmRows - 1) / kBrgemmRows * kBrgemmRows, lda},
                            x.options().dtype(at::kBFloat16));
  const at::BFloat16* a = xb.data_ptr<at::BFloat16>();
  const uint8_t* weight = packed.data_ptr<uint8_t>();
  float* c = y.data_ptr<float>();
  const at::Tensor rows_x = x.stride(1) == 1 ? x : x.contiguous();
  const float* xp = rows_x.data_ptr<float>();
  const int64_t ldx = rows_x.stride(0);
  uint16_t* xb_values = reinterpret_cast<uint16_t*>(xb.data_ptr<at::BFloat16>());
  for (int64_t m0 = 0; m0 < m; m0 += kBf16ChunkRows) {
    const int64_t m1 = std::min(m, m0 + kBf16ChunkRows);
    const int64_t padded_rows = (m1 - m0 + kBrgemmRows - 1) / kBrgemmRows * kBrgemmRows;
    // rounded on the pool's threads, not by a tensor copy_: an OpenMP region here waits on the pool's spinning
    // workers for a core (thread_pool.cpp)
    parallel_for(0, padded_rows, quant::kPanelRows, [&](int64_t r0, int64_t r1) {
      const int64_t valid = std::max<int64_t>(0, std::min(r1, m1 - m0) - r0);
      quant::round_rows_bf16_avx512(xp + (m0 + r0) * ldx, ldx, valid, k, xb_values + r0 * lda, lda, r1 - r0);
    });
    parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      thread_local quant::AlignedScratch unpacked_scratch;  // a part's blocks, kept by each thread
      thread_local std::vector<uint16_t> panel;
      uint16_t* unpacked = unpacked_scratch.get(part_blocks * block_values);
      if (panel.size() < static_cast<size_t>(k * quant::kPanelRows)) panel.resize(k * quant::kPanelRows);
      float tail[kBrgemmRows * kVnniCols];  // a last tile's rows past m, the last block's columns past n
      for (int64_t pb = b0; pb < b1; pb += part_blocks) {
        const int64_t pe = std::min(b1, pb + part_blocks);
        for (int64_t b = pb; b < pe; ++b) {
          const int64_t p0 = b * panels_per_block, p1 = std::min(num_panels, p0 + panels_per_block);
          quant::dequant_bf16_vnni_avx512(static_cast<int>(qtype), weight, k, n,
                                          unpacked + (b - pb) * block_values, panel.data(), p0, p1, kVnniCols);
        }
        for (int64_t r = m0; r < m1; r += kBrgemmRows) {
          const int64_t rows = std::min(kBrgemmRows, m1 - r);
          for (int64_t b = pb; b < pe; ++b) {
            const int64_t col = b * kVnniCols, cols = std::min(kVnniCols, n - col);
            const bool direct = cols == kVnniCols && rows == kBrgemmRows;
            float* out = direct ? c + r * n + col : tail;
            const int64_t ldc = direct ? n : kVnniCols;
            // the bias written first and the products added to it: no second pass over y
            if (bias != nullptr)
              for (int64_t i = 0; i < kBrgemmRows; ++i) std::memcpy(out + i * ldc, bias + col, cols * sizeof(float));
            const at::BFloat16* w = reinterpret_cast<const at::BFloat16*>(unpacked + (b - pb) * block_values);
            for (int64_t kk = 0; kk < k; kk += kBf16KStep)  // a K step's VNNI rows start at kk * kVnniCols
              cpublas::brgemm(kBrgemmRows, kVnniCols, std::min(kBf16KStep, k - kk), lda, kVnniCols, ldc,
                              bias != nullptr || kk > 0, a + (r - m0) * lda + kk, w + kk * kVnniCols, out);
            if (!direct)
              for (int64_t i = 0; i < rows; ++i) std::memcpy(c + (r + i) * n + col, tail + i * kVnniCols, cols * 4);
          }
        }
      }
      cpublas::brgemm_release();
    });
  }
  return y;
}

// The weight of an int8-activation type as bf16 rows [n, K] (what the bf16 path multiplies; tests read it).
at::Tensor dequant_bf16_cpu(const at::Tensor& packed, int64_t qtype, int64_t n) {
  TORCH_CHECK(quant::is_int8_type(qtype) || quant::is_kq_type(qtype), "dequant_bf16_cpu: not an int8-activation "
              "type: ", qtype);
  TORCH_CHECK(has_avx512_bf16(), "dequant_bf16_cpu: needs AVX-512 BF16");
  const bool is_kq = quant::is_kq_type(qtype);
  const int64_t bb = is_kq ? quant::kq_block_bytes(qtype) : quant::int8_block_bytes(qtype);
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.dim() == 3 &&
                  packed.is_contiguous() && packed.size(2) == bb, "dequant_bf16_cpu: packed must be contiguous uint8 "
              "[panels, blocks, ", bb, "]");
  const int64_t num_panels = packed.size(0);
  TORCH_CHECK(n > (num_panels - 1) * quant::kPanelRows && n <= num_panels * quant::kPanelRows,
              "dequant_bf16_cpu: n = ", n, " does not fit ", num_panels, " panels");
  const int64_t k = packed.size(1) * (is_kq ? quant::kSuperK : quant::kBlockK);
  at::Tensor w = at::empty({n, k}, packed.options().dtype(at::kBFloat16));
  uint16_t* out = reinterpret_cast<uint16_t*>(w.data_ptr<at::BFloat16>());
  parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    quant::dequant_bf16_panels_avx512(static_cast<int>(qtype), packed.data_ptr<uint8_t>(), k, n,
                                      out + begin * quant::kPanelRows * k, begin, end);
  });
  return w;
}

at::Tensor quant_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t n,
                      const c10::optional<at::Tensor>& bias, int64_t isa, bool invariant) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "quant_gemm_cpu: x must be a 2-D float32 CPU tensor");
  TORCH_CHECK(x.stride(1) == 1 || x.size(1) <= 1, "quant_gemm_cpu: x's rows must be dense (stride(1) == 1)");
  const bool is_bf16 = qtype == bf16::kBF16;  // bf16 weights: same panels, no scales (bf16_gemm.h)
  const bool is_kq = quant::is_kq_type(qtype);  // K-quants, int8 activations (quant_gemm_kq.h)
  const bool is_int8 = quant::is_int8_type(qtype) || is_kq;  // int8 activations (quant_gemm_int8.h)
  const int64_t bb = is_bf16    ? bf16::kBlockBytes
                     : is_kq   ? quant::kq_block_bytes(qtype)
                     : is_int8 ? quant::int8_block_bytes(qtype)
                               : quant::block_bytes(static_cast<int>(qtype));
  TORCH_CHECK(bb > 0, "quant_gemm_cpu: unsupported quantization type ", qtype);
  const int64_t block_k = is_kq ? quant::kSuperK : quant::kBlockK;
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.dim() == 3 &&
                  packed.is_contiguous() && packed.size(2) == bb,
              "quant_gemm_cpu: packed must be a contiguous uint8 [panels, K / ", block_k, ", ", bb, "] tensor");
  const int64_t m = x.size(0), k = x.size(1), num_panels = packed.size(0);
  TORCH_CHECK(packed.size(1) * block_k == k, "quant_gemm_cpu: x has ", k, " columns, the weight ",
              packed.size(1) * block_k);
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
  // The int8-activation kernels are batch-invariant as they are (each row quantized on its own, its sums in
  // one fixed order): the invariant call runs them, never the bf16 path.
  if (is_int8 && !invariant && g_bf16_rows.load(std::memory_order_relaxed) > 0 &&
      m >= g_bf16_rows.load(std::memory_order_relaxed))
    return bf16_gemm_path(x, packed, qtype, n, bias_p, y);
  if (is_kq) return kq_gemm(x, packed, qtype, n, bias_p, isa, y);
  if (is_int8) return int8_gemm(x, packed, qtype, n, bias_p, isa, y);
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

namespace quant {
bool has_bf16_ukernel_path() {
  static const bool has = has_avx512_bf16() && at::native::cpublas::could_pack(at::kBFloat16);
  return has;
}

void quantize_rows(const float* x, int64_t lda, int64_t k, int8_t* xq, float* xd, int32_t* xs, int64_t r_begin,
                   int64_t r_end) {
  const int64_t nb = k / kBlockK;
  for (int64_t r = r_begin; r < r_end; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* src = x + r * lda + b * kBlockK;
      int8_t* dst = xq + r * k + b * kBlockK;
      float amax = 0.0f;
      for (int i = 0; i < kBlockK; ++i) amax = std::max(amax, std::fabs(src[i]));
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      int32_t sum = 0;
      for (int i = 0; i < kBlockK; ++i) {
        const int32_t q = static_cast<int32_t>(std::nearbyint(src[i] * inv));  // the default mode: half to even
        const int32_t c = q > 127 ? 127 : q < -127 ? -127 : q;
        dst[i] = static_cast<int8_t>(c);
        sum += c;
      }
      xd[r * nb + b] = amax / 127.0f;
      xs[r * nb + b] = sum;
    }
  }
}
}  // namespace quant
}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("quant_gemm_isa(int isa) -> int", &pagedllm::quant_gemm_isa);
  m.def("quant_gemm_int8_isa(int isa) -> int", &pagedllm::quant_gemm_int8_isa);
  m.def("quantize_act_cpu(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("quant_gemm_cpu(Tensor x, Tensor packed, int qtype, int n, Tensor? bias, int isa) -> Tensor");
  m.def("quant_gemm_invariant_cpu(Tensor x, Tensor packed, int qtype, int n, Tensor? bias, int isa) -> Tensor");
  m.def("quant_gemm_bf16_rows(int rows) -> int", &pagedllm::quant_gemm_bf16_rows);
  m.def("dequant_bf16_cpu(Tensor packed, int qtype, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("quant_gemm_cpu", &pagedllm::quant_gemm_cpu);
  m.impl("quantize_act_cpu", &pagedllm::quantize_act_cpu);
  m.impl("quant_gemm_invariant_cpu", &pagedllm::quant_gemm_invariant_cpu);
  m.impl("dequant_bf16_cpu", &pagedllm::dequant_bf16_cpu);
}
