// Two per-step ops of a decode step that ran as a dozen small ATen calls each, now one call each:
//   quant_rows_cpu    rows `ids` of a repacked GGUF weight (quant_gemm.h's panels, quant_gemm_kq.h's, or the Q5_0 /
//                     Q5_1 ones of quant_gemm_int8.h) as float32: the quantized embedding lookup
//                     (pagedllm/model/layers/quantized.py, dequantize_rows)
//   argmax_rows_cpu   each row's argmax of float32 logits (pagedllm/model/sampling/sampler.py, argmax_rows)
// At batch 1 the torch forms cost ~15 and ~10 ATen calls (0.1-0.2 ms a step each with their Python)
// for a few microseconds of work.
//
// Rounding: quant_rows_cpu forms each weight as the torch reference does, one rounded float32
// operation at a time (scale * q, then + min): this file is built with the baseline flags and
// these functions take no "fma" target, so nothing is contracted; fp16 scales widen exactly.
// argmax_rows_cpu returns what torch.argmax does: the first NaN of a row if it has one, else the
// first occurrence of its maximum (-0.0 and 0.0 compare equal).
#include <ATen/ATen.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "thread_pool.h"

namespace pagedllm {
namespace {

constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQX = 100;  // quantized.py's kernel types
constexpr int64_t kQ3_K = 121, kQ4_K = 122, kQ5_K = 123, kQ6_K = 124;  // kquant.py's (csrc/quant_gemm_kq.h)
constexpr int64_t kQ5_0 = 116, kQ5_1 = 117, kIQ4_NL = 130;  // q5.py's and iq4nl.py's (csrc/quant_gemm_int8.h)
constexpr int8_t kIQ4NLValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
constexpr int64_t kLanes = 16;                                   // rows per panel

constexpr bool is_kq(int64_t qtype) { return qtype == kQ3_K || qtype == kQ4_K || qtype == kQ5_K || qtype == kQ6_K; }

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

inline float float_at(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// One row (panel lane `lane`) of nb K-blocks of `bb` bytes each -> out[nb * 32].
void dequantize_row(const uint8_t* panel, int64_t nb, int64_t bb, int64_t qtype, int64_t lane, float* out) {
  for (int64_t b = 0; b < nb; ++b, out += 32) {
    const uint8_t* block = panel + b * bb;
    if (qtype == kQX) {  // [scale x2 halves x16 lanes][min x2 x16][int8 q: 32 k-steps x 16 lanes]
      for (int64_t h = 0; h < 2; ++h) {
        const float scale = float_at(block + (h * kLanes + lane) * 4);
        const float min = float_at(block + 128 + (h * kLanes + lane) * 4);
        for (int64_t j = 0; j < 16; ++j) {
          const float q = static_cast<float>(static_cast<int8_t>(block[256 + (h * 16 + j) * kLanes + lane]));
          const float scaled = q * scale;
          out[h * 16 + j] = scaled + min;
        }
      }
      continue;
    }
    const float d = half_at(block + 2 * lane);
    if (qtype == kQ8_0) {  // [d x16][int8 q: 32 k-steps x 16 lanes]
      for (int64_t j = 0; j < 32; ++j) {
        out[j] = static_cast<float>(static_cast<int8_t>(block[32 + j * kLanes + lane])) * d;
      }
    } else if (qtype == kQ4_0) {  // [d x16][byte j x 16 lanes]: k = j low nibble, j + 16 high
      for (int64_t j = 0; j < 16; ++j) {
        const uint8_t byte = block[32 + j * kLanes + lane];
        out[j] = (static_cast<float>(byte & 15) - 8.0f) * d;
        out[j + 16] = (static_cast<float>(byte >> 4) - 8.0f) * d;
      }
    } else {  // Q4_1: [d x16][m x16][byte j x 16 lanes]
      const float m = half_at(block + 32 + 2 * lane);
      for (int64_t j = 0; j < 16; ++j) {
        const uint8_t byte = block[64 + j * kLanes + lane];
        const float lo = d * static_cast<float>(byte & 15), hi = d * static_cast<float>(byte >> 4);
        out[j] = lo + m;
        out[j + 16] = hi + m;
      }
    }
  }
}

// One row (panel lane `lane`) of nsb Q3_K super-blocks (quant_gemm_kq.h's layout) -> out[nsb * 256], each
// weight (d sc)(q - 4) as gguf's numpy dequantize forms it (every product exact in float32).
void dequantize_q3k_row(const uint8_t* panel, int64_t nsb, int64_t lane, float* out) {
  constexpr int64_t bb = 1824, high = 288, low = 800;
  for (int64_t sb = 0; sb < nsb; ++sb, out += 256) {
    const uint8_t* s = panel + sb * bb;
    const float d = half_at(s + 2 * lane);
    for (int64_t b = 0; b < 8; ++b) {
      for (int64_t g = 0; g < 2; ++g) {
        for (int64_t i = 0; i < 4; ++i) {
          const int64_t at = g * 64 + lane * 4 + i;  // [group][row][4 bytes]
          const uint8_t l = s[low + b * 128 + at], h = s[high + (b / 2) * 128 + at];
          for (int64_t j = 0; j < 4; ++j) {
            const int32_t q = ((l >> (2 * j)) & 3) | (((h >> (4 * (b % 2) + j)) & 1) << 2);
            const float scale = d * static_cast<float>(static_cast<int8_t>(s[32 + (2 * b + j / 2) * kLanes + lane]));
            out[b * 32 + 8 * j + 4 * g + i] = scale * static_cast<float>(q - 4);
          }
        }
      }
    }
  }
}

// One row (panel lane `lane`) of nsb K-quant super-blocks of `bb` bytes each (quant_gemm_kq.h's
// layout) -> out[nsb * 256], each weight formed as gguf's numpy dequantize does: (d sc) q - dmin m,
// Q6_K (d sc)(q - 32).
void dequantize_kq_row(const uint8_t* panel, int64_t nsb, int64_t bb, int64_t qtype, int64_t lane, float* out) {
  const int64_t nibbles = qtype == kQ4_K ? 320 : qtype == kQ5_K ? 832 : 1312;
  for (int64_t sb = 0; sb < nsb; ++sb, out += 256) {
    const uint8_t* s = panel + sb * bb;
    const float d = half_at(s + 2 * lane);
    for (int64_t b = 0; b < 8; ++b) {
      for (int64_t half = 0; half < 2; ++half) {
        float scale, min = 0.0f;
        if (qtype == kQ6_K) {
          scale = d * static_cast<float>(static_cast<int8_t>(s[32 + (2 * b + half) * kLanes + lane]));
        } else {
          scale = d * static_cast<float>(s[64 + b * kLanes + lane]);
          min = half_at(s + 32 + 2 * lane) * static_cast<float>(s[192 + b * kLanes + lane]);
        }
        for (int64_t g = 0; g < 4; ++g) {
          for (int64_t i = 0; i < 4; ++i) {
            const int64_t at = g * 64 + lane * 4 + i;  // [group][row][4 bytes]
            const uint8_t byte = s[nibbles + b * 256 + at];
            int32_t q = half != 0 ? byte >> 4 : byte & 15;
            float w;
            if (qtype == kQ6_K) {
              q |= ((s[288 + (b / 2) * 256 + at] >> (4 * (b % 2) + 2 * half)) & 3) << 4;
              w = scale * static_cast<float>(q - 32);
            } else {
              if (qtype == kQ5_K) q |= ((s[320 + (b / 4) * 256 + at] >> (2 * (b % 4) + half)) & 1) << 4;
              const float scaled = scale * static_cast<float>(q);
              w = scaled - min;
            }
            out[b * 32 + half * 16 + g * 4 + i] = w;
          }
        }
      }
    }
  }
}

// One row (panel lane `lane`) of nb Q5_0 / Q5_1 blocks (quant_gemm_int8.h's layout) -> out[nb * 32], each
// weight d (q - 16) or d q + m as gguf's numpy dequantize forms it.
void dequantize_q5_row(const uint8_t* panel, int64_t nb, int64_t qtype, int64_t lane, float* out) {
  const bool has_min = qtype == kQ5_1;
  const int64_t bb = has_min ? 384 : 352, high = has_min ? 64 : 32, nibbles = high + 64;
  for (int64_t b = 0; b < nb; ++b, out += 32) {
    const uint8_t* block = panel + b * bb;
    const float d = half_at(block + 2 * lane);
    const float m = has_min ? half_at(block + 32 + 2 * lane) : 0.0f;
    const uint8_t* h = block + high + 4 * lane;
    for (int64_t g = 0; g < 4; ++g) {
      for (int64_t i = 0; i < 4; ++i) {  // k = 4 g + i (low nibble), k + 16 (high)
        const uint8_t byte = block[nibbles + g * 64 + lane * 4 + i];
        const int lo = (byte & 15) | (((h[i] >> (4 + g)) & 1) << 4), hi = (byte >> 4) | (((h[i] >> g) & 1) << 4);
        if (has_min) {
          const float slo = d * static_cast<float>(lo), shi = d * static_cast<float>(hi);
          out[4 * g + i] = slo + m;
          out[4 * g + i + 16] = shi + m;
        } else {
          out[4 * g + i] = d * static_cast<float>(lo - 16);
          out[4 * g + i + 16] = d * static_cast<float>(hi - 16);
        }
      }
    }
  }
}

// One row (panel lane `lane`) of nb IQ4_NL blocks (Q4_0's int8 layout, quant_gemm_int8.h) -> out[nb * 32], each
// weight d * table[nibble] as gguf's numpy dequantize forms it.
void dequantize_iq4nl_row(const uint8_t* panel, int64_t nb, int64_t lane, float* out) {
  for (int64_t b = 0; b < nb; ++b, out += 32) {
    const uint8_t* block = panel + b * 288;
    const float d = half_at(block + 2 * lane);
    for (int64_t g = 0; g < 4; ++g) {
      for (int64_t i = 0; i < 4; ++i) {  // k = 4 g + i (low nibble), k + 16 (high)
        const uint8_t byte = block[32 + g * 64 + lane * 4 + i];
        out[4 * g + i] = d * static_cast<float>(kIQ4NLValues[byte & 15]);
        out[4 * g + i + 16] = d * static_cast<float>(kIQ4NLValues[byte >> 4]);
      }
    }
  }
}

at::Tensor quant_rows_cpu(const at::Tensor& packed, int64_t qtype, const at::Tensor& ids) {
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.dim() == 3 &&
                  packed.is_contiguous(), "quant_rows_cpu: contiguous uint8 panels [P, nb, block bytes] expected");
  TORCH_CHECK(qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ8_0 || qtype == kQX || is_kq(qtype) || qtype == kQ5_0 ||
                  qtype == kQ5_1 || qtype == kIQ4_NL, "quant_rows_cpu: qtype ", qtype);
  const int64_t block_bytes = qtype == kQ4_0 ? 32 + 256 : qtype == kQ4_1 ? 64 + 256 : qtype == kQ8_0 ? 32 + 512
                              : qtype == kQ5_0 ? 352 : qtype == kQ5_1 ? 384 : qtype == kIQ4_NL ? 288
                              : qtype == kQ3_K ? 1824 : qtype == kQ4_K ? 2368 : qtype == kQ5_K ? 2880
                              : qtype == kQ6_K ? 3360 : 768;
  const int64_t block_k = is_kq(qtype) ? 256 : 32;  // K-quants: 256-wide super-blocks
  TORCH_CHECK(packed.size(2) == block_bytes, "quant_rows_cpu: ", packed.size(2), " bytes a block for type ", qtype);
  TORCH_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kLong, "quant_rows_cpu: int64 CPU ids expected");
  const at::Tensor flat = ids.reshape(-1).contiguous();
  const int64_t num = flat.numel(), num_panels = packed.size(0), nb = packed.size(1);
  const int64_t* id = flat.data_ptr<int64_t>();
  for (int64_t t = 0; t < num; ++t) {
    TORCH_CHECK(id[t] >= 0 && id[t] < num_panels * kLanes, "quant_rows_cpu: row ", id[t], " out of range");
  }
  at::Tensor out = at::empty({num, nb * block_k}, packed.options().dtype(at::kFloat));
  const uint8_t* base = packed.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  // ~1 us a row of 576: a prompt of a few thousand tokens is worth the threads
  parallel_for(0, num, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* panel = base + (id[t] / kLanes) * nb * block_bytes;
      if (qtype == kIQ4_NL) {
        dequantize_iq4nl_row(panel, nb, id[t] % kLanes, dst + t * nb * block_k);
      } else if (qtype == kQ5_0 || qtype == kQ5_1) {
        dequantize_q5_row(panel, nb, qtype, id[t] % kLanes, dst + t * nb * block_k);
      } else if (qtype == kQ3_K) {
        dequantize_q3k_row(panel, nb, id[t] % kLanes, dst + t * nb * block_k);
      } else if (is_kq(qtype)) {
        dequantize_kq_row(panel, nb, block_bytes, qtype, id[t] % kLanes, dst + t * nb * block_k);
      } else {
        dequantize_row(panel, nb, block_bytes, qtype, id[t] % kLanes, dst + t * nb * 32);
      }
    }
  });
  return out;
}

int64_t argmax_scalar(const float* x, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > x[best]) best = i;
  }
  return best;
}

// The maximum by 4 chains of 8-lane max (NaNs tracked apart: max_ps drops them), then the first
// index equal to it; a row with a NaN takes the scalar scan for its first NaN.
__attribute__((target("avx2"))) int64_t argmax_avx2(const float* x, int64_t n) {
  const int64_t n32 = n / 32 * 32;
  __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
  __m256 nan = _mm256_setzero_ps();
  for (int64_t i = 0; i < n32; i += 32) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
    const __m256 c = _mm256_loadu_ps(x + i + 16), d = _mm256_loadu_ps(x + i + 24);
    nan = _mm256_or_ps(nan, _mm256_or_ps(_mm256_or_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q), _mm256_cmp_ps(b, b, _CMP_UNORD_Q)),
                                         _mm256_or_ps(_mm256_cmp_ps(c, c, _CMP_UNORD_Q), _mm256_cmp_ps(d, d, _CMP_UNORD_Q))));
    m0 = _mm256_max_ps(m0, a);
    m1 = _mm256_max_ps(m1, b);
    m2 = _mm256_max_ps(m2, c);
    m3 = _mm256_max_ps(m3, d);
  }
  if (_mm256_movemask_ps(nan)) return argmax_scalar(x, n);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
  float m = -INFINITY;
  for (float v : lanes) m = v > m ? v : m;
  for (int64_t i = n32; i < n; ++i) {
    if (std::isnan(x[i])) return argmax_scalar(x, n);
    m = x[i] > m ? x[i] : m;
  }
  const __m256 target = _mm256_set1_ps(m);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), target, _CMP_EQ_OQ));
    if (mask) return i + __builtin_ctz(mask);
  }
  for (; i < n; ++i) {
    if (x[i] == m) return i;
  }
  return 0;  // every value -inf and none equal: unreachable (m is one of them), kept for the compiler
}

bool cpu_has_avx2() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
  }();
  return has;
}

at::Tensor argmax_rows_cpu(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "argmax_rows_cpu: contiguous float32 [N, V] expected");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(n > 0, "argmax_rows_cpu: an empty row has no argmax");
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* src = x.data_ptr<float>();
  int64_t* dst = out.data_ptr<int64_t>();
  const bool avx2 = cpu_has_avx2();
  // ~5 us a row of 49152: rows of a batch split over the threads only past 8 of them
  parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      dst[r] = avx2 ? argmax_avx2(src + r * n, n) : argmax_scalar(src + r * n, n);
    }
  });
  return out;
}

}  // namespace
}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("quant_rows_cpu(Tensor packed, int qtype, Tensor ids) -> Tensor");
  m.def("argmax_rows_cpu(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("quant_rows_cpu", &pagedllm::quant_rows_cpu);
  m.impl("argmax_rows_cpu", &pagedllm::argmax_rows_cpu);
}
