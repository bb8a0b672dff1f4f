// Segmented LoRA shrink/expand for one linear (torch.ops.pagedllm.lora_sgmv_cpu): the step's rows come
// grouped by adapter slot in segments, and each segment adds its own adapter's delta in place,
//
//   y[rows of segment] += (x[rows] A_slot) B_slot          float32 accumulation
//
// over slot layouts that pagedllm/lora/layers.py keeps (W = num_parts * max_rank columns a slot):
//
//   a [in, L*W]   slot s, rank r: columns s*W + p*r .. s*W + (p+1)*r - 1 hold part p's A^T
//   b [L*W, out]  those rows hold part p's scaled B^T in part p's output columns (zero elsewhere)
//
// so a slot's shrink reads only num_parts*r columns of a, and its expand only r rows of b per part,
// over that part's columns: the arithmetic of the adapters present, never of every slot.
//
// Two passes, each split across the op pool (thread_pool.h): shrink over blocks of rows (each a
// segment's rows, so a thread reads only its segments' A), into a scratch s [T, lds]; then expand
// over blocks of output columns (every segment, each thread its columns of every B). A row's sums run
// in one order whatever the segment sizes, the thread count or the other rows (batch-invariant).
#pragma once

#include <cstdint>

namespace pagedllm {
namespace sgmv {

constexpr int kMaxParts = 3;  // q, k, v
constexpr int kMaxRows = 4;   // rows per register block

struct Segment {
  int64_t begin, end, slot;  // rows [begin, end) of x and y use slot `slot`
};

struct Args {
  const float* x;  // [T, k], row stride ldx
  int64_t ldx;
  float* y;        // [T, out], row stride ldy
  int64_t ldy;
  const float* a;  // [k, L*W], row stride lda = L*W
  int64_t lda;
  const float* b;  // [L*W, out], row stride ldb = out
  int64_t ldb;
  int64_t k;
  int64_t width;          // W
  const int64_t* ranks;   // [L]; 0 = the slot has nothing for this linear
  int num_parts;
  int64_t part_offset[kMaxParts], part_size[kMaxParts];
  const Segment* segments;
  int64_t num_segments;
  float* s;               // scratch [T, lds]: row t's shrunk values (num_parts * rank of its slot)
  int64_t lds;
  // shrink units: row blocks (segment index, first row), at most kMaxRows rows each
  const int64_t* unit_segment;
  const int64_t* unit_row;
  // expand units: column blocks (part, first column), at most block_cols columns each
  const int64_t* block_part;
  const int64_t* block_col;
  int64_t block_cols;
};

// Columns per expand block for an ISA (the kernel's register block).
constexpr int64_t kBlockColsAvx512 = 64;
constexpr int64_t kBlockColsAvx2 = 16;

void shrink_avx512(const Args& args, int64_t u_begin, int64_t u_end);
void expand_avx512(const Args& args, int64_t b_begin, int64_t b_end);
void shrink_avx2(const Args& args, int64_t u_begin, int64_t u_end);
void expand_avx2(const Args& args, int64_t b_begin, int64_t b_end);

}  // namespace sgmv
}  // namespace pagedllm
