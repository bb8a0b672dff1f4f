// Plain data shared by the op (torch side) and the per-ISA kernels (no torch headers there:
// those translation units are compiled for AVX2 or AVX-512, and any inline function they shared
// with the rest of the library could be linked in place of the baseline copy).
#pragma once
#include <stdint.h>

namespace pagedllm {

constexpr int kKeyChunk = 16;  // keys scored and exponentiated together (per-key path)
constexpr int kKeyTile = 64;   // keys per tile of the tiled (GEMM-like) path
constexpr int kMaxTileMR = 8;  // the most rows any ISA's register tile pads an item to

// Element types a KV cache may hold (the query, output and arithmetic stay float32): tags for the
// kernels' overloads, bit patterns only (IEEE binary16 and bfloat16).
struct f16_t { uint16_t bits; };
struct bf16_t { uint16_t bits; };
enum KvType : int32_t { kKvFloat32 = 0, kKvFloat16 = 1, kKvBFloat16 = 2 };

// kPfBurst: all at the start of a chunk (the old default); kPfInPv: spread through the P.V pass.
enum PfMode : int32_t { kPfBurst = 1, kPfInPv = 2 };

struct AttnParams {
  const float* query;  // [num_tokens, num_heads, head_dim]
  int64_t q_stride_tok, q_stride_head;
  const void* kv;  // [2, num_blocks, block_size, num_kv_heads, head_dim] of kv_type; strides in elements
  int32_t kv_type;
  int64_t kv_stride_kv, kv_stride_block, kv_stride_tok, kv_stride_head;
  const int64_t* block_tables;  // [num_seqs, max_blocks]
  int64_t bt_stride;
  const int64_t* seq_lens;         // [num_seqs]
  const int64_t* query_start_loc;  // [num_seqs + 1]
  float* out;  // [num_tokens, num_heads, head_dim], dense
  float* part_acc;  // [num_parts, max_rows, head_dim]: unnormalised output of a context split
  float* part_max;  // [num_parts, max_rows]
  float* part_sum;  // [num_parts, max_rows]
  int64_t block_size, num_heads, group, head_dim, max_rows;
  int64_t tile_min_rows;  // items with at least this many rows (query rows x group) take the tiled path
  float scale;
  // Sliding window: the query at position q sees keys [q - window + 1, q]; <= 0 = all keys up to q.
  int64_t window;
  // Score soft-capping (Gemma 2): scaled score s -> softcap * tanh(s / softcap); <= 0 = none.
  float softcap;
  // Per-key path software prefetch (see run_item): the chunk this many chunks ahead (0 = none),
  // how its lines are requested (PfMode), and the hint (__builtin_prefetch locality: 3 = L1).
  int32_t pf_dist, pf_mode, pf_hint;
};

// One unit of work: a tile of one sequence's query rows for KV heads [kv_head, kv_head + kv_heads)
// (each with its whole query group), over keys [key_begin, key_end). part < 0: write the final
// output; else write partials there. Rows are ordered head, then query row, then group member.
// Only per-key path items (few rows per head) hold more than one KV head.
struct WorkItem {
  int64_t seq, kv_head, kv_heads, q_begin, q_count, key_begin, key_end, part, cost;
};

// Scratch floats one call needs per thread for items of at most max_rows rows.
static inline int64_t scratch_floats(int64_t max_rows, int64_t head_dim) {
  // Per row: the row's query and output (2 * head_dim), its scores, max, sum and rescale (3), its
  // first and end key (two int64, 4 floats), and slack.
  const int64_t per_key = max_rows * (2 * head_dim + kKeyChunk + 8) + 64;
  const int64_t rp = max_rows + kMaxTileMR;
  const int64_t tiled = rp * (2 * head_dim + kKeyTile + 8) + head_dim * kKeyTile + 64;
  return per_key > tiled ? per_key : tiled;
}

// Runs items[i] for every i taken from *next (an atomic counter shared by the threads) until
// num_items; returns false if head_dim or kv_type has no compiled variant.
bool run_items_avx2(const AttnParams& p, const WorkItem* items, int64_t num_items, int64_t* next,
                    float* scratch);
bool run_items_avx512(const AttnParams& p, const WorkItem* items, int64_t num_items, int64_t* next,
                      float* scratch);

}  // namespace pagedllm
