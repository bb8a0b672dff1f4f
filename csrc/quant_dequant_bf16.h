// A quantized weight's panels (the int8-activation layouts: quant_gemm_int8.h's Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / IQ4_NL and
// quant_gemm_kq.h's Q3_K / Q4_K / Q5_K / Q6_K) dequantized to bf16 rows [n, K], for the prefill path of CPUs with
// AMX-BF16 tiles: there a step of many rows multiplies faster as bf16 through oneDNN's AMX ukernel (the weight
// unpacked a block of columns at a time, into a block that stays in cache) than through the int8 dot products,
// whose per-block float scaling bounds them. Each weight is w = its GGUF formula in float32, then rounded to the
// nearest bf16 (ties to even), as torch's .to(torch.bfloat16) rounds the dequantized float32 weight.
#pragma once

#include <cstdint>

namespace pagedllm {
namespace quant {

// Panels [p_begin, p_end) of `packed` (kernel type `qtype`, K columns) into out [rows of those panels
// below n, K] (row stride K), out's row 0 being panel p_begin's row 0. Needs AVX-512 F/BW and BF16.
void dequant_bf16_panels_avx512(int qtype, const uint8_t* packed, int64_t k, int64_t n, uint16_t* out,
                                int64_t p_begin, int64_t p_end);

// Panels [p_begin, p_end) as one block of the AMX ukernel's B operand: bf16 in VNNI pairs, block_cols columns
// (a multiple of 16; the panels' rows are its columns, rows past n zero). `panel` holds 16 * k values of scratch.
void dequant_bf16_vnni_avx512(int qtype, const uint8_t* packed, int64_t k, int64_t n, uint16_t* block,
                              uint16_t* panel, int64_t p_begin, int64_t p_end, int64_t block_cols);

}  // namespace quant
}  // namespace pagedllm
