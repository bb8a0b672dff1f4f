// Segmented LoRA shrink/expand for one linear (torch.ops.pagedllm.lora_sgmv_cpu): the step's rows come
// grouped by adapter slot in segments, and each segment adds its own adapter's delta in place,
//
//   y[rows of segment] += (x[rows] A_slot) B_slot          float32 accumulation
//
// over the slots as pagedllm/lora/layers.py packs them, in panels of 16 columns (one layout for both ISAs):
//
//   a [L, PA, K, 16]   slot s, rank r: its columns c = p*r + j (part p's A^T, j < r), column c in panel
//                      c / 16, lane c % 16; PA = ceil(num_parts * max_rank / 16); zero past num_parts * r
//   b [L, PB, R, 16]   part p's output columns in its own panels (from part_panel[p]), row j < r of a panel
//                      = row j of part p's scaled B^T; R = max_rank; zero past each part's width
//
// so a segment's shrink streams only ceil(num_parts * r / 16) panels of its slot's A, each one contiguous
// run of K x 16 floats, and its expand only r rows of each of its slot's B panels: the arithmetic and the
// memory of the adapters present, read linearly (a row-major [K, L*W] A read 3 cache lines in 24 per
// k-step, which ran at ~0.7x the packed speed).
//
// Split across the op pool (thread_pool.h) one of two ways. With rows enough for a task per thread, one
// pass over row tasks: each shrinks its rows into a scratch s [T, lds] and expands them (one pool job a
// call). Else two passes: shrink over (row block, panel group) units into s; then expand over groups of
// output panels (every segment). A row's sums run in one order whatever the segment sizes, the split,
// the thread count or the other rows (batch-invariant).
#pragma once

#include <cstdint>

namespace pagedllm {
namespace sgmv {

constexpr int kMaxParts = 3;  // q, k, v
constexpr int kMaxRows = 4;   // rows per register block
constexpr int kLanes = 16;    // columns per panel

struct Segment {
  int64_t begin, end, slot;  // rows [begin, end) of x and y use slot `slot`
};

struct Args {
  const float* x;  // [T, k], row stride ldx
  int64_t ldx;
  float* y;        // [T, out], row stride ldy
  int64_t ldy;
  const float* a;  // [L, pa, k, 16]
  int64_t pa;
  const float* b;  // [L, pb, max_rank, 16]
  int64_t pb, max_rank;
  int64_t k;
  const int64_t* ranks;  // [L]; 0 = the slot has nothing for this linear
  int num_parts;
  int64_t part_offset[kMaxParts], part_size[kMaxParts], part_panel[kMaxParts];
  const Segment* segments;
  int64_t num_segments;
  float* s;  // scratch [T, lds]: row t's shrunk values (num_parts * rank of its slot, padded to panels)
  int64_t lds;
  // shrink units: (segment index, first row of a block of at most kMaxRows, first panel of a group)
  const int64_t* unit_segment;
  const int64_t* unit_row;
  const int64_t* unit_panel;
  // expand units: (part, first panel of a group within the part)
  const int64_t* block_part;
  const int64_t* block_panel;
  // row tasks (the one-pass split): rows [task_begin, task_end) of segment task_segment, every panel
  const int64_t* task_segment;
  const int64_t* task_begin;
  const int64_t* task_end;
  bool prefetch;  // the one-pass split prefetches the data its tasks read next (lora_sgmv_kernel.h)
};

// Panels per register block of an ISA (2 zmm or 2 ymm of sums a row).
constexpr int64_t kGroupAvx512 = 2;
constexpr int64_t kGroupAvx2 = 1;

void shrink_avx512(const Args& args, int64_t u_begin, int64_t u_end);
void expand_avx512(const Args& args, int64_t b_begin, int64_t b_end);
void rows_avx512(const Args& args, int64_t t_begin, int64_t t_end);
void shrink_avx2(const Args& args, int64_t u_begin, int64_t u_end);
void expand_avx2(const Args& args, int64_t b_begin, int64_t b_end);
void rows_avx2(const Args& args, int64_t t_begin, int64_t t_end);

}  // namespace sgmv
}  // namespace pagedllm
