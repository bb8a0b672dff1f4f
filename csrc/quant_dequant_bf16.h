// A quantized weight's panels (the int8-activation layouts: quant_gemm_int8.h's Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / IQ4_NL and
// quant_gemm_kq.h's Q3_K / Q4_K / Q5_K / Q6_K) dequantized to bf16 rows [n, K], for the prefill path of CPUs with
// AMX-BF16 tiles: there a step of many rows multiplies faster as bf16 through oneDNN's AMX ukernel (the weight
// unpacked a block of columns at a time, into a block that stays in cache) than through the int8 dot products,
// whose per-block float scaling bounds them. Each weight is w = its GGUF formula in float32, then rounded to the
// nearest bf16 (ties to even), as torch's .to(torch.bfloat16) rounds the dequantized float32 weight.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <memory>

namespace pagedllm {
namespace quant {

// A thread's scratch of bf16 values for the ukernel's operands, 64-byte aligned: a tile row load that straddles
// two cache lines (malloc's 16-byte alignment) ran the ukernel ~20% slower. Grows, never shrinks.
class AlignedScratch {
 public:
  uint16_t* get(size_t values) {
    if (values > capacity_) {
      const size_t bytes = (values * sizeof(uint16_t) + 63) / 64 * 64;
      data_.reset(static_cast<uint16_t*>(std::aligned_alloc(64, bytes)));
      capacity_ = bytes / sizeof(uint16_t);
    }
    return data_.get();
  }

 private:
  struct Free {
    void operator()(uint16_t* p) const { std::free(p); }
  };
  std::unique_ptr<uint16_t, Free> data_;
  size_t capacity_ = 0;
};

// Whether this CPU runs the bf16 ukernel paths (this header's functions, and quant_gemm_op.cpp's and
// bf16_matmul_op.cpp's products): AVX-512 BF16 for the rounding and unpacking, AMX-BF16 for ATen's ukernel.
bool has_bf16_ukernel_path();

// Panels [p_begin, p_end) of `packed` (kernel type `qtype`, K columns) into out [rows of those panels
// below n, K] (row stride K), out's row 0 being panel p_begin's row 0. Needs AVX-512 F/BW and BF16.
void dequant_bf16_panels_avx512(int qtype, const uint8_t* packed, int64_t k, int64_t n, uint16_t* out,
                                int64_t p_begin, int64_t p_end);

// Panels [p_begin, p_end) as one block of the AMX ukernel's B operand: bf16 in VNNI pairs, block_cols columns
// (a multiple of 16; the panels' rows are its columns, rows past n zero). `panel` holds 16 * k values of scratch.
void dequant_bf16_vnni_avx512(int qtype, const uint8_t* packed, int64_t k, int64_t n, uint16_t* block,
                              uint16_t* panel, int64_t p_begin, int64_t p_end, int64_t block_cols);

// x's rows [0, rows) (row stride ldx, k values each) rounded to bf16 (to nearest, ties to even, as torch's
// .to(torch.bfloat16)) into out (row stride ldo), and out's rows [rows, padded_rows) zeroed: the A operand of the
// ukernel's fixed-height tiles. On the calling thread: the ops call it inside their own parallel work, since an
// OpenMP region there (a tensor copy_) would wait on the ops' spinning workers for a core.
// GELU (the erf form) in place over rows x cols floats of y (row stride ld), as torch's gelu computes it to within an
// ulp or two: the bf16 matmul op's epilogue, on each output tile while it is in cache.
void gelu_rows_avx512(float* y, int64_t ld, int64_t rows, int64_t cols);

void round_rows_bf16_avx512(const float* x, int64_t ldx, int64_t rows, int64_t k, uint16_t* out, int64_t ldo,
                            int64_t padded_rows);

}  // namespace quant
}  // namespace pagedllm
