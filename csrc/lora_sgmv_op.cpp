// torch.ops.pagedllm.lora_sgmv_cpu: one linear's LoRA deltas for a step's rows grouped by slot, added to
// the linear's output in place (lora_sgmv.h). `isa` picks the kernel per call (0 = the best this CPU
// runs, 1 = AVX2, 2 = AVX-512; tests run both on one machine). pagedllm/lora/layers.py calls it on the
// per-op path, csrc/decoder_layer.cpp on the fused step, with the same arguments: the two paths add
// the same float32 sums.
//
//   segments: (row begin, row end, slot) triples; rows outside every segment are left as they are
//   ranks:    int64 [L]: the rank of slot s's adapter on this linear (0: none)
//   a, b:     the slots' panels (lora_sgmv.h)
#include <ATen/ATen.h>
#include <torch/library.h>

#include <atomic>
#include <vector>

#include "lora_sgmv.h"
#include "thread_pool.h"

namespace pagedllm {
namespace {

bool has_avx512() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;
  }();
  return has;
}

bool has_avx2() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return has;
}

// The kernel a call with this `isa` request runs: 2 = AVX-512, 1 = AVX2, 0 = none here.
int64_t lora_sgmv_isa(int64_t isa) {
  if ((isa == 0 || isa == 2) && has_avx512()) return 2;
  if ((isa == 0 || isa == 1) && has_avx2()) return 1;
  return 0;
}

// The one-pass split's software prefetch (lora_sgmv_kernel.h, row_tasks): on by default; an A/B switch for
// scripts/lora_kernel_bench.py (lora_sgmv_prefetch(0) turns it off). It never changes the sums.
std::atomic<bool> prefetch{true};

int64_t lora_sgmv_prefetch(int64_t value) { return value < 0 ? prefetch.load() : prefetch.exchange(value != 0); }

// Below this many multiply-adds (shrink and expand together) the call runs on the calling thread (about what
// handing it to the pool costs). Above it even one row is split: its slot's A and B (~100-200 KB a linear
// at rank 16) come from memory, and two threads stream them faster than one.
constexpr int64_t kSerialFmas = 1 << 14;

// Rows a one-pass task covers at most: its slot's A and B (~100-300 KB a linear at rank 16) are read from
// L2 once per task, so a long prefill segment is cut into tasks of this many rows.
constexpr int64_t kTaskRows = 16;

void lora_sgmv_cpu(const at::Tensor& x, at::Tensor& y, const at::Tensor& a, const at::Tensor& b,
                   const at::Tensor& ranks, at::IntArrayRef part_sizes, at::IntArrayRef segments, int64_t isa) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  (x.stride(1) == 1 || x.size(1) <= 1),
              "lora_sgmv_cpu: x must be a 2-D float32 CPU tensor with dense rows");
  TORCH_CHECK(y.device().is_cpu() && y.scalar_type() == at::kFloat && y.dim() == 2 &&
                  (y.stride(1) == 1 || y.size(1) <= 1),
              "lora_sgmv_cpu: y must be a 2-D float32 CPU tensor with dense rows");
  const int64_t num_rows = x.size(0), k = x.size(1), out = y.size(1);
  TORCH_CHECK(y.size(0) == num_rows, "lora_sgmv_cpu: x has ", num_rows, " rows, y ", y.size(0));
  TORCH_CHECK(ranks.device().is_cpu() && ranks.scalar_type() == at::kLong && ranks.dim() == 1 && ranks.is_contiguous(),
              "lora_sgmv_cpu: ranks must be a contiguous int64 [max_loras] tensor");
  const int64_t num_slots = ranks.size(0);
  TORCH_CHECK(a.device().is_cpu() && a.scalar_type() == at::kFloat && a.dim() == 4 && a.is_contiguous() &&
                  a.size(0) == num_slots && a.size(2) == k && a.size(3) == sgmv::kLanes,
              "lora_sgmv_cpu: a must be a contiguous float32 [max_loras, panels, in, 16] tensor");
  TORCH_CHECK(b.device().is_cpu() && b.scalar_type() == at::kFloat && b.dim() == 4 && b.is_contiguous() &&
                  b.size(0) == num_slots && b.size(3) == sgmv::kLanes,
              "lora_sgmv_cpu: b must be a contiguous float32 [max_loras, panels, max_rank, 16] tensor");
  const int num_parts = static_cast<int>(part_sizes.size());
  TORCH_CHECK(num_parts >= 1 && num_parts <= sgmv::kMaxParts, "lora_sgmv_cpu: 1 to ", sgmv::kMaxParts,
              " parts expected, got ", num_parts);
  TORCH_CHECK(segments.size() % 3 == 0, "lora_sgmv_cpu: segments are (begin, end, slot) triples");
  const int64_t chosen = lora_sgmv_isa(isa);
  TORCH_CHECK(chosen != 0, "lora_sgmv_cpu: no kernel for isa ", isa, " on this CPU");

  sgmv::Args g{};
  int64_t offset = 0, panels = 0;
  for (int p = 0; p < num_parts; ++p) {
    TORCH_CHECK(part_sizes[p] >= 0, "lora_sgmv_cpu: a negative part size");
    g.part_offset[p] = offset;
    g.part_size[p] = part_sizes[p];
    g.part_panel[p] = panels;
    offset += part_sizes[p];
    panels += (part_sizes[p] + sgmv::kLanes - 1) / sgmv::kLanes;
  }
  TORCH_CHECK(offset == out, "lora_sgmv_cpu: the parts cover ", offset, " columns, y has ", out);
  TORCH_CHECK(panels == b.size(1), "lora_sgmv_cpu: the parts take ", panels, " panels of b, b has ", b.size(1));
  const int64_t max_rank = b.size(2);
  const int64_t* rank = ranks.data_ptr<int64_t>();
  for (int64_t s = 0; s < num_slots; ++s)
    TORCH_CHECK(rank[s] >= 0 && rank[s] <= max_rank && num_parts * rank[s] <= a.size(1) * sgmv::kLanes,
                "lora_sgmv_cpu: slot ", s, "'s rank ", rank[s], " does not fit a and b (max rank ", max_rank, ")");

  const int64_t group = chosen == 2 ? sgmv::kGroupAvx512 : sgmv::kGroupAvx2;
  thread_local std::vector<sgmv::Segment> segs;
  thread_local std::vector<int64_t> unit_segment, unit_row, unit_panel, block_part, block_panel, task_segment,
      task_begin, task_end;
  thread_local std::vector<float> scratch;
  segs.clear();
  unit_segment.clear();
  unit_row.clear();
  unit_panel.clear();
  block_part.clear();
  block_panel.clear();
  task_segment.clear();
  task_begin.clear();
  task_end.clear();
  int64_t fmas = 0, max_cols = 0, adapted_rows = 0;
  for (size_t i = 0; i < segments.size(); i += 3) {
    const sgmv::Segment seg{segments[i], segments[i + 1], segments[i + 2]};
    TORCH_CHECK(seg.begin >= 0 && seg.begin <= seg.end && seg.end <= num_rows, "lora_sgmv_cpu: segment rows [",
                seg.begin, ", ", seg.end, ") outside [0, ", num_rows, ")");
    TORCH_CHECK(seg.slot >= 0 && seg.slot < num_slots, "lora_sgmv_cpu: slot ", seg.slot, " of ", num_slots);
    const int64_t r = rank[seg.slot];
    if (seg.end == seg.begin || r == 0) continue;
    const int64_t cols = num_parts * r, slot_panels = (cols + sgmv::kLanes - 1) / sgmv::kLanes;
    for (int64_t row = seg.begin; row < seg.end; row += sgmv::kMaxRows)
      for (int64_t panel = 0; panel < slot_panels; panel += group) {
        unit_segment.push_back(static_cast<int64_t>(segs.size()));
        unit_row.push_back(row);
        unit_panel.push_back(panel);
      }
    segs.push_back(seg);
    adapted_rows += seg.end - seg.begin;
    fmas += (seg.end - seg.begin) * r * (num_parts * k + out);
    max_cols = std::max(max_cols, slot_panels * sgmv::kLanes);
  }
  if (segs.empty() || k == 0) return;
  // One pass when the rows make a task per thread: each segment in equal tasks of at most task_rows rows.
  const int64_t threads = at::get_num_threads();
  const int64_t task_rows =
      std::min(kTaskRows, std::max<int64_t>(sgmv::kMaxRows, (adapted_rows + threads - 1) / std::max<int64_t>(1, threads)));
  for (size_t i = 0; i < segs.size(); ++i) {
    const int64_t rows = segs[i].end - segs[i].begin, tasks = (rows + task_rows - 1) / task_rows;
    for (int64_t t = 0; t < tasks; ++t) {
      task_segment.push_back(static_cast<int64_t>(i));
      task_begin.push_back(segs[i].begin + rows * t / tasks);
      task_end.push_back(segs[i].begin + rows * (t + 1) / tasks);
    }
  }
  for (int p = 0; p < num_parts; ++p)
    for (int64_t panel = 0; panel * sgmv::kLanes < g.part_size[p]; panel += group) {
      block_part.push_back(p);
      block_panel.push_back(panel);
    }
  const int64_t lds = max_cols;  // whole panels: the shrink stores them whole
  if (static_cast<int64_t>(scratch.size()) < num_rows * lds) scratch.resize(num_rows * lds);

  g.x = x.data_ptr<float>();
  g.ldx = x.stride(0);
  g.y = y.data_ptr<float>();
  g.ldy = y.stride(0);
  g.a = a.data_ptr<float>();
  g.pa = a.size(1);
  g.b = b.data_ptr<float>();
  g.pb = b.size(1);
  g.max_rank = max_rank;
  g.k = k;
  g.ranks = rank;
  g.num_parts = num_parts;
  g.segments = segs.data();
  g.num_segments = static_cast<int64_t>(segs.size());
  g.s = scratch.data();
  g.lds = lds;
  g.unit_segment = unit_segment.data();
  g.unit_row = unit_row.data();
  g.unit_panel = unit_panel.data();
  g.block_part = block_part.data();
  g.block_panel = block_panel.data();
  g.task_segment = task_segment.data();
  g.task_begin = task_begin.data();
  g.task_end = task_end.data();
  g.prefetch = prefetch.load(std::memory_order_relaxed);
  auto shrink = chosen == 2 ? &sgmv::shrink_avx512 : &sgmv::shrink_avx2;
  auto expand = chosen == 2 ? &sgmv::expand_avx512 : &sgmv::expand_avx2;
  const int64_t num_units = static_cast<int64_t>(unit_row.size()), num_blocks = static_cast<int64_t>(block_part.size());
  if (fmas < kSerialFmas) {
    shrink(g, 0, num_units);
    expand(g, 0, num_blocks);
    return;
  }
  const int64_t num_tasks = static_cast<int64_t>(task_begin.size());
  if (threads > 1 && num_tasks >= threads) {
    auto rows = chosen == 2 ? &sgmv::rows_avx512 : &sgmv::rows_avx2;
    parallel_for(0, num_tasks, 1, [&](int64_t begin, int64_t end) { rows(g, begin, end); });
    return;
  }
  parallel_for(0, num_units, 1, [&](int64_t begin, int64_t end) { shrink(g, begin, end); });
  parallel_for(0, num_blocks, 1, [&](int64_t begin, int64_t end) { expand(g, begin, end); });
}

}  // namespace
}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("lora_sgmv_isa(int isa) -> int", &pagedllm::lora_sgmv_isa);
  m.def("lora_sgmv_prefetch(int value) -> int", &pagedllm::lora_sgmv_prefetch);
  m.def(
      "lora_sgmv_cpu(Tensor x, Tensor(a!) y, Tensor a, Tensor b, Tensor ranks, int[] part_sizes, int[] segments, "
      "int isa=0) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("lora_sgmv_cpu", &pagedllm::lora_sgmv_cpu);
}
