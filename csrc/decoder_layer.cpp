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
// and returns (x, res): their sum is the last layer's output (the caller applies the final norm).
// num_splits and tile_min_rows go to the attention op (0 = its defaults); `invariant` calls the
// linears' batch-invariant kernels (pagedllm/model/batch_invariant.py sets all three).
//
// What it removes is the Python between the ops: at batch 1 a step of the default model ran ~10
// small ops per layer, each behind a Python frame, a module call and argument checks, which cost
// about as much as the norms, rotary and activation themselves. The ops are reached through their
// typed dispatcher handles (found once): a C++ dispatcher call costs well under a microsecond, and
// the kernels stay where they are (fused_ops.cpp, cpu_gemm_op.cpp, quant_gemm_op.cpp,
// paged_attention_op.cpp) with one definition each. Each handle's signature is its kernel's C++
// signature exactly (the dispatcher calls the unboxed kernel through it).
//
// Weights: 10 tensors per layer, in this order:
//   input_norm, qkv, qkv_bias, o, o_bias, post_attention_norm, gate_up, gate_up_bias, down, down_bias
// a bias being a 0-element tensor where there is none; and 3 ints per linear (12 per layer):
//   kind (-1 = float32 panels for gemm_packed_cpu, else the quantized kernel type for
//   quant_gemm_cpu), n (output features), isa (quant_gemm_cpu's isa argument; unused for float32).
// pagedllm/model/layers/fused_decoder.py builds these lists once and decides when the call applies.
//
// LoRA (pagedllm/lora/layers.py): with lora_segments not empty, each linear's output gets the step's
// adapter deltas right after its product, before anything reads it, by the op the per-op path calls
// (lora_sgmv_cpu, lora_sgmv_op.cpp) with the same arguments. lora_weights: 3 tensors per linear (a, b,
// ranks; 12 per layer, in the linears' order above), lora_info: 4 ints per linear (number of parts, 0 =
// no slots on this linear, then up to 3 part sizes), lora_segments: the step's (begin, end, slot) rows.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <chrono>
#include <tuple>
#include <vector>

namespace pagedllm {
namespace {

using RmsNormSig = at::Tensor(const at::Tensor&, const at::Tensor&, double, int64_t);
using AddRmsNormSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                         double, int64_t);
using RotarySig = void(at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t);
using SiluSig = at::Tensor(const at::Tensor&, int64_t);
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
  c10::TypedOperatorHandle<RmsNormSig> rms_norm;
  c10::TypedOperatorHandle<AddRmsNormSig> add_rms_norm;
  c10::TypedOperatorHandle<RotarySig> rotary;
  c10::TypedOperatorHandle<SiluSig> silu_and_mul;
  c10::TypedOperatorHandle<KvWriteSig> kv_write;
  c10::TypedOperatorHandle<AttentionSig> attention;
  c10::TypedOperatorHandle<GemmSig> gemm;
  c10::TypedOperatorHandle<QuantGemmSig> quant_gemm;
  c10::TypedOperatorHandle<GemmSig> gemm_invariant;
  c10::TypedOperatorHandle<QuantGemmSig> quant_gemm_invariant;
  c10::TypedOperatorHandle<LoraSig> lora_sgmv;

  Ops()
      : rms_norm(handle("pagedllm::rms_norm_cpu").typed<RmsNormSig>()),
        add_rms_norm(handle("pagedllm::add_rms_norm_cpu").typed<AddRmsNormSig>()),
        rotary(handle("pagedllm::rotary_qk_cpu").typed<RotarySig>()),
        silu_and_mul(handle("pagedllm::silu_and_mul_cpu").typed<SiluSig>()),
        kv_write(handle("pagedllm::kv_write_cpu").typed<KvWriteSig>()),
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

constexpr int64_t kWeightsPerLayer = 10;
constexpr int64_t kIntsPerLinear = 3;
constexpr int64_t kIntsPerLayer = 4 * kIntsPerLinear;
constexpr int64_t kLoraWeightsPerLinear = 3;
constexpr int64_t kLoraIntsPerLinear = 4;

// One linear's LoRA arguments for this step, or none (lora == nullptr).
struct Lora {
  const at::Tensor* weights;  // a, b, ranks
  const int64_t* info;        // num_parts, part sizes
  at::IntArrayRef segments;
};

at::Tensor linear(const Ops& o, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                  const int64_t* info, bool invariant, const Lora* lora) {
  const c10::optional<at::Tensor> b = bias.numel() > 0 ? c10::optional<at::Tensor>(bias) : c10::nullopt;
  at::Tensor y = info[0] < 0 ? (invariant ? o.gemm_invariant : o.gemm).call(x, weight, b, info[1])
                             : (invariant ? o.quant_gemm_invariant : o.quant_gemm)
                                   .call(x, weight, info[0], info[1], b, info[2]);
  if (lora != nullptr && lora->info[0] > 0) {
    o.lora_sgmv.call(x, y, lora->weights[0], lora->weights[1], lora->weights[2],
                     at::IntArrayRef(lora->info + 1, lora->info[0]), lora->segments, 0);
  }
  return y;
}

std::tuple<at::Tensor, at::Tensor> decoder_layers_cpu(
    const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& signed_sin, at::TensorList weights,
    at::IntArrayRef linear_info, at::TensorList kv_caches, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, double scale, double eps, int64_t norm_lanes, int64_t silu_block,
    int64_t num_splits, int64_t tile_min_rows, bool invariant, at::TensorList lora_weights, at::IntArrayRef lora_info,
    at::IntArrayRef lora_segments) {
  const int64_t num_layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == num_layers * kWeightsPerLayer,
              "decoder_layers_cpu: ", kWeightsPerLayer, " weights per layer expected, got ", weights.size(), " for ",
              num_layers, " layers");
  TORCH_CHECK(static_cast<int64_t>(linear_info.size()) == num_layers * kIntsPerLayer,
              "decoder_layers_cpu: ", kIntsPerLayer, " ints per layer expected");
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat && hidden.is_contiguous(),
              "decoder_layers_cpu: hidden must be a contiguous float32 [num_tokens, hidden_size] tensor");
  const bool with_lora = !lora_segments.empty();
  TORCH_CHECK(!with_lora || (static_cast<int64_t>(lora_weights.size()) == num_layers * 4 * kLoraWeightsPerLinear &&
                             static_cast<int64_t>(lora_info.size()) == num_layers * 4 * kLoraIntsPerLinear),
              "decoder_layers_cpu: ", 4 * kLoraWeightsPerLinear, " LoRA tensors and ", 4 * kLoraIntsPerLinear,
              " LoRA ints per layer expected with LoRA segments");
  const Ops& o = ops();
  const int64_t num_tokens = hidden.size(0);
  const std::vector<int64_t> head_split{num_heads, num_kv_heads, num_kv_heads};
  at::Tensor x = hidden, residual, h;
  PhaseTimer timer;
  double& linear_s = g_clock.linear_s;
  double& attention_s = g_clock.attention_s;
  double& other_s = g_clock.other_s;
  for (int64_t l = 0; l < num_layers; ++l) {
    const at::Tensor* w = weights.data() + l * kWeightsPerLayer;
    const int64_t* info = linear_info.data() + l * kIntsPerLayer;
    Lora loras[4];
    for (int64_t j = 0; with_lora && j < 4; ++j)
      loras[j] = Lora{lora_weights.data() + (l * 4 + j) * kLoraWeightsPerLinear,
                      lora_info.data() + (l * 4 + j) * kLoraIntsPerLinear, lora_segments};
    const Lora* lora = with_lora ? loras : nullptr;
    if (l == 0) {
      residual = x;
      h = o.rms_norm.call(x, w[0], eps, norm_lanes);
    } else {
      std::tie(h, residual) = o.add_rms_norm.call(x, residual, w[0], eps, norm_lanes);
    }
    timer.lap(other_s);
    at::Tensor qkv = linear(o, h, w[1], w[2], info, invariant, lora);  // [T, (H + 2 Hkv) D]
    timer.lap(linear_s);
    o.rotary.call(qkv, cos, signed_sin, num_heads + num_kv_heads, head_dim);
    // [T, H, D], [T, Hkv, D], [T, Hkv, D]: views of qkv, as the per-op path's split_with_sizes
    const std::vector<at::Tensor> qkv_heads = qkv.view({num_tokens, -1, head_dim}).split_with_sizes(head_split, 1);
    timer.lap(other_s);
    o.kv_write.call(qkv_heads[1], qkv_heads[2], kv_caches[l], slot_mapping);
    const at::Tensor attn = o.attention.call(qkv_heads[0], kv_caches[l], block_tables, seq_lens, query_start_loc,
                                             scale, num_splits, 0, tile_min_rows, 0, -1, 0.0);  // [T, H, D]
    timer.lap(attention_s);
    const at::Tensor out = linear(o, attn.view({num_tokens, num_heads * head_dim}), w[3], w[4],
                                  info + kIntsPerLinear, invariant, lora ? lora + 1 : nullptr);
    timer.lap(linear_s);
    std::tie(h, residual) = o.add_rms_norm.call(out, residual, w[5], eps, norm_lanes);
    timer.lap(other_s);
    const at::Tensor gate_up =
        linear(o, h, w[6], w[7], info + 2 * kIntsPerLinear, invariant, lora ? lora + 2 : nullptr);
    timer.lap(linear_s);
    const at::Tensor act = o.silu_and_mul.call(gate_up, silu_block);
    timer.lap(other_s);
    x = linear(o, act, w[8], w[9], info + 3 * kIntsPerLinear, invariant, lora ? lora + 3 : nullptr);
    timer.lap(linear_s);
  }
  if (g_clock.on) ++g_clock.calls;
  if (num_layers == 0) residual = at::zeros_like(x);
  return {x, residual};
}

}  // namespace
}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def(
      "decoder_layers_cpu(Tensor hidden, Tensor cos, Tensor signed_sin, Tensor[] weights, int[] linear_info, "
      "Tensor(a!)[] kv_caches, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, "
      "int num_heads, int num_kv_heads, int head_dim, float scale, float eps, int norm_lanes, int silu_block, "
      "int num_splits, int tile_min_rows, bool invariant, Tensor[] lora_weights, int[] lora_info, "
      "int[] lora_segments) -> (Tensor, Tensor)");
  m.def("decoder_layers_clock_cpu(bool on) -> float[]", &pagedllm::decoder_layers_clock_cpu);
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("decoder_layers_cpu", &pagedllm::decoder_layers_cpu);
}
