// torch.ops.pagedllm.decoder_layers_cpu: every decoder layer of a Llama-family step in one call.
//
// Per layer, the same ops the per-op path (pagedllm/model/llama.py) runs, in the same order on the
// same inputs, so the result is that path's bit for bit:
//
//   h, res = add_rms_norm(x, res)          (layer 0: res = x; h = rms_norm(x))
//   qkv    = h Wqkv^T (+ bias)             [T, (H + 2 Hkv) D]
//   rotary in place on the H + Hkv query and key heads of qkv
//   kv_write(k, v) at slot_mapping;  a = paged_attention(q)   [T, H, D]
//   o      = a Wo^T
//   h, res = add_rms_norm(o, res)
//   x      = (silu(g) * u) Wdown^T   with [g | u] = h Wgate_up^T (+ bias)
//
//   out, res = add_rms_norm(x, res)        after the last layer, with the plan's final norm weight
//
// and returns (out, res) (without a final norm weight: (x, res), whose sum is the last layer's output).
// num_splits and tile_min_rows go to the attention op (0 = its defaults); `invariant` calls the
// linears' batch-invariant kernels (pagedllm/model/batch_invariant.py sets all three). The rotary
// tables come whole, with the step's positions: the call reads row positions[t] for token t (the
// per-op path's index_select gathers the same rows first).
//
// What it removes is the Python between the ops, and then the ops' own overhead: at batch 1 a step of
// the default model ran ~10 small ops per layer, each behind a Python frame, a module call and
// argument checks. The linears, the KV write and attention are reached through their typed dispatcher
// handles (found once; each handle's signature is its kernel's C++ signature exactly), so their
// kernels stay where they are (cpu_gemm_op.cpp, quant_gemm_op.cpp, paged_attention_op.cpp). The norms,
// rotary and SiLU are the plain functions of fused_ops.h, the same loops fused_ops.cpp's ops run,
// writing into three buffers this call allocates once and every layer reuses (the residual stream is
// updated in place): through the dispatcher, each with its own output allocation, those 120 small ops
// cost 3-5 us each at batch 1, several times their arithmetic.
//
// Weights: 18 tensors per layer, in this order:
//   input_norm, qkv[3], qkv_bias, o[3], o_bias, post_attention_norm, gate_up[3], gate_up_bias, down[3], down_bias
// A linear's weight is up to 3 row groups (a Q4_K_M file's q and k in Q4_K, v in Q6_K: each group its own
// kernel, its rows side by side in the output, as layers/quant_groups.py multiplies them), unused slots and a
// missing bias being 0-element tensors; and 10 ints per linear (40 per layer): the number of groups, then
// per group kind (-1 = float32 panels for gemm_packed_cpu, else the quantized kernel type for
// quant_gemm_cpu), n (its output features), isa (quant_gemm_cpu's isa argument; unused for float32).
// pagedllm/model/layers/fused_decoder.py builds these lists once, into a DecoderPlan with the model's
// constants, and decides when the call applies.
//
// LoRA (pagedllm/lora/layers.py): with lora_segments not empty, each linear's output gets the step's
// adapter deltas right after its product, before anything reads it, by the op the per-op path calls
// (lora_sgmv_cpu, lora_sgmv_op.cpp) with the same arguments. lora_weights: 3 tensors per linear (a, b,
// ranks; 12 per layer, in the linears' order above), lora_info: 4 ints per linear (number of parts, 0 =
// no slots on this linear, then up to 3 part sizes), lora_segments: the step's (begin, end, slot) rows.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <chrono>
#include <cstring>
#include <tuple>
#include <vector>

#include "fused_ops.h"
#include "quant_gemm_int8.h"
#include "quant_gemm_kq.h"

namespace pagedllm {
namespace {

using KvWriteSig = void(const at::Tensor&, const at::Tensor&, at::Tensor, const at::Tensor&);
using AttentionSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, double, int64_t, int64_t, int64_t, int64_t, int64_t, double);
using GemmSig = at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, int64_t);
using QuantGemmSig = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                                const c10::optional<at::Tensor>&, int64_t);
using LoraSig = void(const at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                     at::IntArrayRef, at::IntArrayRef, int64_t);

c10::OperatorHandle handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

struct Ops {
  c10::TypedOperatorHandle<KvWriteSig> kv_write;
  c10::TypedOperatorHandle<AttentionSig> attention;
  c10::TypedOperatorHandle<GemmSig> gemm;
  c10::TypedOperatorHandle<QuantGemmSig> quant_gemm;
  c10::TypedOperatorHandle<GemmSig> gemm_invariant;
  c10::TypedOperatorHandle<QuantGemmSig> quant_gemm_invariant;
  c10::TypedOperatorHandle<LoraSig> lora_sgmv;

  Ops()
      : kv_write(handle("pagedllm::kv_write_cpu").typed<KvWriteSig>()),
        attention(handle("pagedllm::paged_attention_cpu").typed<AttentionSig>()),
        gemm(handle("pagedllm::gemm_packed_cpu").typed<GemmSig>()),
        quant_gemm(handle("pagedllm::quant_gemm_cpu").typed<QuantGemmSig>()),
        gemm_invariant(handle("pagedllm::gemm_packed_invariant_cpu").typed<GemmSig>()),
        quant_gemm_invariant(handle("pagedllm::quant_gemm_invariant_cpu").typed<QuantGemmSig>()),
        lora_sgmv(handle("pagedllm::lora_sgmv_cpu").typed<LoraSig>()) {}
};

const Ops& ops() {
  static const Ops instance;  // looked up at the first call: every fragment of the library is registered by then
  return instance;
}

// An in-place breakdown of the call's wall time (decoder_layers_clock_cpu): what the linears (with their
// LoRA deltas), the KV write with attention, and the rest (norms, rotary, SiLU, views) took, summed over the
// calls since the clock was last read. Replaying the ops alone moves with the machine and counts each
// replay's own call overhead; this measures the very steps it divides. Off by default: one branch a phase.
struct StepClock {
  bool on = false;
  double linear_s = 0, attention_s = 0, other_s = 0;
  int64_t calls = 0;
};
StepClock g_clock;

class PhaseTimer {
 public:
  PhaseTimer() : on_(g_clock.on), last_(on_ ? std::chrono::steady_clock::now() : Clock::time_point()) {}
  void lap(double& bucket) {
    if (!on_) return;
    const Clock::time_point now = Clock::now();
    bucket += std::chrono::duration<double>(now - last_).count();
    last_ = now;
  }

 private:
  using Clock = std::chrono::steady_clock;
  bool on_;
  Clock::time_point last_;
};

std::vector<double> decoder_layers_clock_cpu(bool on) {
  std::vector<double> read{g_clock.linear_s, g_clock.attention_s, g_clock.other_s, static_cast<double>(g_clock.calls)};
  g_clock = StepClock{};
  g_clock.on = on;
  return read;
}

constexpr int64_t kMaxGroups = 3;
constexpr int64_t kWeightsPerLinear = kMaxGroups + 1;  // the groups, then the bias
constexpr int64_t kWeightsPerLayer = 2 + 4 * kWeightsPerLinear;
constexpr int64_t kIntsPerGroup = 3;
constexpr int64_t kIntsPerLinear = 1 + kMaxGroups * kIntsPerGroup;
constexpr int64_t kIntsPerLayer = 4 * kIntsPerLinear;
// Where each linear's weights start in a layer's list (qkv, o, gate_up, down), and the two norms.
constexpr int64_t kLinearAt[4] = {1, 1 + kWeightsPerLinear, 2 + 2 * kWeightsPerLinear, 2 + 3 * kWeightsPerLinear};
constexpr int64_t kInputNormAt = 0, kPostNormAt = 1 + 2 * kWeightsPerLinear;
constexpr int64_t kLoraWeightsPerLinear = 3;
constexpr int64_t kLoraIntsPerLinear = 4;

}  // namespace

// What a model's steps share, handed over once (pagedllm.classes.DecoderPlan): converting ~300 weight
// tensors and ~400 ints from Python lists at every call cost 25-60 us a step. Checked here, once.
struct DecoderPlan : torch::CustomClassHolder {
  std::vector<at::Tensor> weights;
  std::vector<int64_t> linear_info;
  std::vector<at::Tensor> lora_weights;
  std::vector<int64_t> lora_info;
  at::Tensor final_norm;  // the model's final RMSNorm weight, or 0 elements: return (x, residual) unnormed
  int64_t num_layers, num_heads, num_kv_heads, head_dim, norm_lanes, silu_block, num_splits, tile_min_rows;
  bool invariant;
  double scale, eps, final_eps;

  DecoderPlan(std::vector<at::Tensor> weights_, std::vector<int64_t> linear_info_, std::vector<at::Tensor> lora_weights_,
              std::vector<int64_t> lora_info_, at::Tensor final_norm_, std::vector<int64_t> ints,
              std::vector<double> floats)
      : weights(std::move(weights_)), linear_info(std::move(linear_info_)), lora_weights(std::move(lora_weights_)),
        lora_info(std::move(lora_info_)), final_norm(std::move(final_norm_)) {
    TORCH_CHECK(ints.size() == 8 && floats.size() == 3,
                "DecoderPlan: ints (num_heads, num_kv_heads, head_dim, norm_lanes, silu_block, num_splits, "
                "tile_min_rows, invariant) and floats (scale, eps, final_eps) expected");
    num_heads = ints[0], num_kv_heads = ints[1], head_dim = ints[2], norm_lanes = ints[3], silu_block = ints[4];
    num_splits = ints[5], tile_min_rows = ints[6], invariant = ints[7] != 0;
    scale = floats[0], eps = floats[1], final_eps = floats[2];
    num_layers = static_cast<int64_t>(weights.size()) / kWeightsPerLayer;
    TORCH_CHECK(num_layers > 0 && static_cast<int64_t>(weights.size()) == num_layers * kWeightsPerLayer,
                "DecoderPlan: ", kWeightsPerLayer, " weights per layer expected, got ", weights.size());
    TORCH_CHECK(static_cast<int64_t>(linear_info.size()) == num_layers * kIntsPerLayer,
                "DecoderPlan: ", kIntsPerLayer, " ints per layer expected");
    TORCH_CHECK(lora_weights.empty() ||
                    (static_cast<int64_t>(lora_weights.size()) == num_layers * 4 * kLoraWeightsPerLinear &&
                     static_cast<int64_t>(lora_info.size()) == num_layers * 4 * kLoraIntsPerLinear),
                "DecoderPlan: ", 4 * kLoraWeightsPerLinear, " LoRA tensors and ", 4 * kLoraIntsPerLinear,
                " LoRA ints per layer expected, or none");
    TORCH_CHECK(norm_lanes == 8 || norm_lanes == 16, "DecoderPlan: norm_lanes must be 8 or 16");
    TORCH_CHECK(silu_block == 16 || silu_block == 32, "DecoderPlan: silu_block must be 16 or 32");
    TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0 && num_heads > 0 && num_kv_heads > 0, "DecoderPlan: heads");
    // The norms run as plain functions on raw rows (fused_ops.h): their weights are checked here.
    const int64_t hidden = weights[0].numel();
    auto check_norm = [hidden](const at::Tensor& w) {
      TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 1 && w.is_contiguous() &&
                      w.numel() == hidden, "DecoderPlan: norm weights must be contiguous float32 [hidden]");
    };
    for (int64_t l = 0; l < num_layers; ++l) {
      check_norm(weights[l * kWeightsPerLayer + kInputNormAt]);
      check_norm(weights[l * kWeightsPerLayer + kPostNormAt]);
      for (int64_t j = 0; j < 4; ++j) {
        const int64_t* info = linear_info.data() + l * kIntsPerLayer + j * kIntsPerLinear;
        TORCH_CHECK(info[0] >= 1 && info[0] <= kMaxGroups, "DecoderPlan: 1 to ", kMaxGroups,
                    " row groups per linear expected, got ", info[0]);
        const at::Tensor& bias = weights[l * kWeightsPerLayer + kLinearAt[j] + kMaxGroups];
        int64_t n = 0;
        for (int64_t g = 0; g < info[0]; ++g) n += info[1 + g * kIntsPerGroup + 1];
        TORCH_CHECK(bias.numel() == 0 || (bias.dim() == 1 && bias.numel() == n && bias.is_contiguous() &&
                                          bias.scalar_type() == at::kFloat),
                    "DecoderPlan: a bias must be contiguous float32 [the linear's output features]");
      }
    }
    if (final_norm.numel() > 0) check_norm(final_norm);
  }
};

namespace {

// One linear's LoRA arguments for this step, or none (lora == nullptr).
struct Lora {
  const at::Tensor* weights;  // a, b, ranks
  const int64_t* info;        // num_parts, part sizes
  at::IntArrayRef segments;
};

// One row group's product (x @ W^T + bias), by the kernel the per-op path calls for it.
at::Tensor group_product(const Ops& o, const at::Tensor& x, const at::Tensor& weight,
                         const c10::optional<at::Tensor>& b, const int64_t* group, bool invariant) {
  return group[0] < 0 ? (invariant ? o.gemm_invariant : o.gemm).call(x, weight, b, group[1])
                      : (invariant ? o.quant_gemm_invariant : o.quant_gemm)
                            .call(x, weight, group[0], group[1], b, group[2]);
}

at::Tensor view_of(const at::Tensor& base, at::IntArrayRef sizes, at::IntArrayRef strides, int64_t offset);

// weights: the linear's kMaxGroups group slots, then its bias; info: its kIntsPerLinear ints.
at::Tensor linear(const Ops& o, const at::Tensor& x, const at::Tensor* weights, const int64_t* info, bool invariant,
                  const Lora* lora) {
  const at::Tensor& bias = weights[kMaxGroups];
  const int64_t num_groups = info[0];
  at::Tensor y;
  if (num_groups == 1) {
    const c10::optional<at::Tensor> b = bias.numel() > 0 ? c10::optional<at::Tensor>(bias) : c10::nullopt;
    y = group_product(o, x, weights[0], b, info + 1, invariant);
  } else {  // each group's columns of the output in turn, as QuantizedRowGroups.matmul's cat lays them out
    const int64_t rows = x.size(0);
    int64_t n = 0;
    for (int64_t g = 0; g < num_groups; ++g) n += info[1 + g * kIntsPerGroup + 1];
    y = at::empty({rows, n}, x.options());
    float* out = y.data_ptr<float>();
    int64_t start = 0;
    for (int64_t g = 0; g < num_groups; ++g) {
      const int64_t* group = info + 1 + g * kIntsPerGroup;
      const int64_t cols = group[1];
      const c10::optional<at::Tensor> b =
          bias.numel() > 0 ? c10::optional<at::Tensor>(view_of(bias, {cols}, {1}, start)) : c10::nullopt;
      const at::Tensor part = group_product(o, x, weights[g], b, group, invariant);
      TORCH_CHECK(part.scalar_type() == at::kFloat && part.dim() == 2 && part.size(0) == rows &&
                      part.size(1) == cols && part.stride(1) == 1,
                  "decoder_layers_cpu: a row group's product of an unexpected layout");
      const float* src = part.data_ptr<float>();
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(out + r * n + start, src + r * part.stride(0), cols * sizeof(float));
      start += cols;
    }
  }
  if (lora != nullptr && lora->info[0] > 0) {
    o.lora_sgmv.call(x, y, lora->weights[0], lora->weights[1], lora->weights[2],
                     at::IntArrayRef(lora->info + 1, lora->info[0]), lora->segments, 0);
  }
  return y;
}

// A view of `base`'s storage, made without a dispatcher call (as at::alias does it): the q, k, v heads
// of a qkv row and the attention output as the linears read it, four a layer.
at::Tensor view_of(const at::Tensor& base, at::IntArrayRef sizes, at::IntArrayRef strides, int64_t offset) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::TensorImpl::VIEW, c10::Storage(base.storage()),
                                                   base.key_set(), base.dtype());
  impl->set_sizes_and_strides(sizes, strides, base.storage_offset() + offset);
  return at::Tensor(std::move(impl));
}

void check_float_rows(const at::Tensor& t, int64_t cols, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 && t.stride(1) == 1 &&
                  t.size(1) == cols, "decoder_layers_cpu: ", what, " must be float32 rows of ", cols);
}

std::tuple<at::Tensor, at::Tensor> decoder_layers_cpu(
    const at::Tensor& hidden, const at::Tensor& cos_cache, const at::Tensor& signed_sin_cache,
    const at::Tensor& positions, const c10::intrusive_ptr<DecoderPlan>& plan, at::TensorList kv_caches,
    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
    const at::Tensor& query_start_loc, at::IntArrayRef lora_segments) {
  const DecoderPlan& p = *plan;
  const int64_t num_layers = p.num_layers, num_heads = p.num_heads, num_kv_heads = p.num_kv_heads;
  const int64_t head_dim = p.head_dim, lanes = p.norm_lanes;
  const float eps = static_cast<float>(p.eps);
  TORCH_CHECK(static_cast<int64_t>(kv_caches.size()) == num_layers, "decoder_layers_cpu: one KV cache per layer (",
              num_layers, ") expected, got ", kv_caches.size());
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat && hidden.is_contiguous() && hidden.is_cpu(),
              "decoder_layers_cpu: hidden must be a contiguous float32 [num_tokens, hidden_size] tensor");
  const int64_t num_tokens = hidden.size(0), width = hidden.size(1);
  TORCH_CHECK(width == p.weights[0].numel(), "decoder_layers_cpu: hidden size ", width, " is not the plan's ",
              p.weights[0].numel());
  for (const at::Tensor* t : {&cos_cache, &signed_sin_cache})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 2 && t->is_contiguous() &&
                    t->size(1) == head_dim && t->size(0) == cos_cache.size(0),
                "decoder_layers_cpu: the rotary tables must be contiguous float32 [max_positions, head_dim]");
  TORCH_CHECK(positions.device().is_cpu() && positions.scalar_type() == at::kLong && positions.dim() == 1 &&
                  positions.is_contiguous() && positions.size(0) == num_tokens,
              "decoder_layers_cpu: one contiguous int64 position per token expected");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos_cache.size(0), "decoder_layers_cpu: position ", pos[t],
                " past the rotary tables' ", cos_cache.size(0));
  const bool with_lora = !lora_segments.empty();
  TORCH_CHECK(!with_lora || !p.lora_weights.empty(), "decoder_layers_cpu: LoRA segments for a plan without slots");
  const Ops& o = ops();
  const float* cos = cos_cache.data_ptr<float>();
  const float* signed_sin = signed_sin_cache.data_ptr<float>();
  const int64_t qkv_cols = (num_heads + 2 * num_kv_heads) * head_dim;
  // This call's buffers, reused by every layer: the normed input of a linear (h), the residual stream,
  // updated in place (res), and the SiLU product (act, sized at the first layer). The per-op path
  // allocates each op's output, ~4 small allocations a layer.
  at::Tensor h = at::empty({num_tokens, width}, hidden.options());
  at::Tensor res = at::empty({num_tokens, width}, hidden.options());
  at::Tensor act;
  float* hp = h.data_ptr<float>();
  float* rp = res.data_ptr<float>();
  at::Tensor x = hidden;
  PhaseTimer timer;
  double& linear_s = g_clock.linear_s;
  double& attention_s = g_clock.attention_s;
  double& other_s = g_clock.other_s;
  for (int64_t l = 0; l < num_layers; ++l) {
    const at::Tensor* w = p.weights.data() + l * kWeightsPerLayer;
    const int64_t* info = p.linear_info.data() + l * kIntsPerLayer;
    Lora loras[4];
    for (int64_t j = 0; with_lora && j < 4; ++j)
      loras[j] = Lora{p.lora_weights.data() + (l * 4 + j) * kLoraWeightsPerLinear,
                      p.lora_info.data() + (l * 4 + j) * kLoraIntsPerLinear, lora_segments};
    const Lora* lora = with_lora ? loras : nullptr;
    if (l == 0) {  // the residual stream starts as the input itself (read from `hidden` until the first add)
      fused::rms_norm_rows(hidden.data_ptr<float>(), width, w[kInputNormAt].data_ptr<float>(), eps, lanes, hp,
                           num_tokens, width);
    } else {
      check_float_rows(x, width, "a down projection's output");
      fused::add_rms_norm_rows(x.data_ptr<float>(), x.stride(0), rp, width, w[kInputNormAt].data_ptr<float>(), eps,
                               lanes, hp, rp, num_tokens, width);
    }
    timer.lap(other_s);
    at::Tensor qkv = linear(o, h, w + kLinearAt[0], info, p.invariant, lora);  // [T, (H + 2 Hkv) D]
    timer.lap(linear_s);
    check_float_rows(qkv, qkv_cols, "the qkv projection's output");
    const int64_t qs = qkv.stride(0);
    fused::rotary_rows(qkv.data_ptr<float>(), qs, cos, signed_sin, pos, num_tokens, num_heads + num_kv_heads,
                       head_dim);
    // [T, H, D], [T, Hkv, D], [T, Hkv, D]: views of qkv, as the per-op path's split_with_sizes
    const at::Tensor q = view_of(qkv, {num_tokens, num_heads, head_dim}, {qs, head_dim, 1}, 0);
    const at::Tensor k = view_of(qkv, {num_tokens, num_kv_heads, head_dim}, {qs, head_dim, 1}, num_heads * head_dim);
    const at::Tensor v = view_of(qkv, {num_tokens, num_kv_heads, head_dim}, {qs, head_dim, 1},
                                 (num_heads + num_kv_heads) * head_dim);
    timer.lap(other_s);
    o.kv_write.call(k, v, kv_caches[l], slot_mapping);
    const at::Tensor attn = o.attention.call(q, kv_caches[l], block_tables, seq_lens, query_start_loc, p.scale,
                                             p.num_splits, 0, p.tile_min_rows, 0, -1, 0.0);  // [T, H, D]
    timer.lap(attention_s);
    TORCH_CHECK(attn.is_contiguous() && attn.numel() == num_tokens * num_heads * head_dim,
                "decoder_layers_cpu: attention output of an unexpected layout");
    const at::Tensor attn_rows = view_of(attn, {num_tokens, num_heads * head_dim}, {num_heads * head_dim, 1}, 0);
    const at::Tensor out = linear(o, attn_rows, w + kLinearAt[1], info + kIntsPerLinear, p.invariant,
                                  lora ? lora + 1 : nullptr);
    timer.lap(linear_s);
    check_float_rows(out, width, "the o projection's output");
    fused::add_rms_norm_rows(out.data_ptr<float>(), out.stride(0), l == 0 ? hidden.data_ptr<float>() : rp, width,
                             w[kPostNormAt].data_ptr<float>(), eps, lanes, hp, rp, num_tokens, width);
    timer.lap(other_s);
    const at::Tensor gate_up =
        linear(o, h, w + kLinearAt[2], info + 2 * kIntsPerLinear, p.invariant, lora ? lora + 2 : nullptr);
    timer.lap(linear_s);
    TORCH_CHECK(gate_up.scalar_type() == at::kFloat && gate_up.dim() == 2 && gate_up.stride(1) == 1 &&
                    gate_up.size(0) == num_tokens && gate_up.size(1) % 2 == 0,
                "decoder_layers_cpu: the gate/up projection's output must be float32 rows of gate, then up");
    const int64_t d = gate_up.size(1) / 2;
    if (!act.defined() || act.size(1) != d) act = at::empty({num_tokens, d}, hidden.options());
    fused::silu_mul_rows(gate_up.data_ptr<float>(), gate_up.stride(0), act.data_ptr<float>(), num_tokens, d,
                         p.silu_block);
    timer.lap(other_s);
    x = linear(o, act, w + kLinearAt[3], info + 3 * kIntsPerLinear, p.invariant, lora ? lora + 3 : nullptr);
    timer.lap(linear_s);
  }
  check_float_rows(x, width, "a down projection's output");
  if (p.final_norm.numel() == 0) {
    if (g_clock.on) ++g_clock.calls;
    return {x, res};
  }
  // The final norm, as LlamaModel's `norm(x, residual)`: (normed, the stream's sum); h and res are this
  // call's own buffers, so they are returned as they are.
  fused::add_rms_norm_rows(x.data_ptr<float>(), x.stride(0), rp, width, p.final_norm.data_ptr<float>(),
                           static_cast<float>(p.final_eps), lanes, hp, rp, num_tokens, width);
  timer.lap(other_s);
  if (g_clock.on) ++g_clock.calls;
  return {h, res};
}

}  // namespace
}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.class_<pagedllm::DecoderPlan>("DecoderPlan")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<at::Tensor>, std::vector<int64_t>,
                       at::Tensor, std::vector<int64_t>, std::vector<double>>());
  m.def(
      "decoder_layers_cpu(Tensor hidden, Tensor cos_cache, Tensor signed_sin_cache, Tensor positions, "
      "__torch__.torch.classes.pagedllm.DecoderPlan plan, Tensor(a!)[] kv_caches, Tensor slot_mapping, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, int[] lora_segments) -> (Tensor, Tensor)");
  m.def("decoder_layers_clock_cpu(bool on) -> float[]", &pagedllm::decoder_layers_clock_cpu);
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("decoder_layers_cpu", &pagedllm::decoder_layers_cpu);
}
