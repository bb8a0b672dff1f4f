// The small per-layer kernels of fused_ops.cpp as plain functions over raw rows: the ops there wrap
// them, and decoder_layers_cpu (decoder_layer.cpp) calls them directly into buffers it reuses across
// layers, without a dispatcher call or an output allocation each. Same loops, same threads, same bits.
//
// Rows are `rows` x `n` floats, row i at base + i * stride; `lanes` and `block` as the ops take them.
#pragma once

#include <cstdint>

namespace pagedllm {
namespace fused {

// out = x * rsqrt(mean(x^2) + eps) * w; out dense [rows, n]
void rms_norm_rows(const float* x, int64_t x_stride, const float* w, float eps, int64_t lanes, float* out,
                   int64_t rows, int64_t n);

// sum = x + residual; out = rms_norm(sum); out and sum dense [rows, n]. sum may be residual itself
// (residual_stride == n), an in-place update of the residual stream.
void add_rms_norm_rows(const float* x, int64_t x_stride, const float* residual, int64_t residual_stride,
                       const float* w, float eps, int64_t lanes, float* out, float* sum, int64_t rows, int64_t n);

// RoPE in place on the first num_heads heads of each row; row t uses cos[t] and signed_sin[t] (rows of
// head_dim floats), or their rows positions[t] where positions is given (a gather from the tables).
void rotary_rows(float* qkv, int64_t qkv_stride, const float* cos, const float* signed_sin, const int64_t* positions,
                 int64_t rows, int64_t num_heads, int64_t head_dim);

// out = silu(x[:, :d]) * x[:, d:]; out dense [rows, d]
void silu_mul_rows(const float* x, int64_t x_stride, float* out, int64_t rows, int64_t d, int64_t block);

}  // namespace fused
}  // namespace pagedllm
