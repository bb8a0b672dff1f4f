// torch.ops.pagedllm.paged_attention_cpu: varlen paged attention over the engine's KV layout,
// reading K/V blocks in place through the block tables (see paged_attention_kernel.h).
//
// This file is built with the library's baseline flags (no AVX), so loading the library is safe
// on any x86-64 CPU; the AVX2 or AVX-512 kernel is picked at run time.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "paged_attention.h"
#include "thread_pool.h"

namespace pagedllm {
namespace {

constexpr int64_t kIsaAvx2 = 1, kIsaAvx512 = 2;
// A context split keeps at least this many keys: below it the merge costs more than it frees.
constexpr int64_t kMinSplitKeys = 256;
// Items of at least this many rows (query rows x group) take the tiled path; below it the
// per-key path wins (measured, 1 thread, AVX-512, context 512: tiled/per-key 1.1-2x at 1-6
// rows, about even at 8, 0.4-0.9x from 12 rows up, since each gathered key tile is reused by
// more rows).
constexpr int64_t kDefaultTileMinRows = 10;
// Rows (query rows x group) per item of a long chunk: more rows reuse each gathered key tile
// more (192 measured 5-10% faster than 96 on 1x512 and 4x256 prefill, 1 thread), fewer leave
// more items for the threads (the balance below caps it).
constexpr int64_t kDefaultTileRows = 192;
// The most rows (KV heads x query rows x group) a per-key path item groups: a decode item of the
// default model (3 KV heads x 3 query heads) reads each whole block in one pass; 16 rows of state
// stay in L1.
constexpr int64_t kMaxGroupedRows = 16;

int64_t best_isa() {
  static const int64_t isa = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vl"))
      return kIsaAvx512;
    // F16C (16-bit KV caches) came with the same CPUs as FMA; required so every kernel can use it.
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
      return kIsaAvx2;
    return int64_t{0};
  }();
  return isa;
}

int32_t kv_type_of(const at::Tensor& kv_cache) {
  switch (kv_cache.scalar_type()) {
    case at::kFloat: return kKvFloat32;
    case at::kHalf: return kKvFloat16;
    case at::kBFloat16: return kKvBFloat16;
    default: TORCH_CHECK(false, "paged_attention_cpu: kv_cache must be float32, float16 or bfloat16, got ",
                         kv_cache.scalar_type());
  }
  return kKvFloat32;  // not reached
}

bool head_dim_supported(int64_t d) {
  return d == 32 || d == 64 || d == 80 || d == 96 || d == 128 || d == 256;
}

struct SplitGroup {  // the parts of one item split over its context, merged at the end
  WorkItem item;
  int64_t first_part, num_parts;
};

// Cuts items over their key range when there are too few to keep every thread busy (few long
// sequences) or when `forced` > 0 (tests). Returns the number of partial-result slots used.
int64_t split_items(std::vector<WorkItem>& items, std::vector<SplitGroup>& groups, int64_t num_threads,
                    int64_t forced) {
  const int64_t n = static_cast<int64_t>(items.size());
  if (forced <= 0 && n >= 2 * num_threads) return 0;
  const int64_t want = forced > 0 ? forced : (2 * num_threads + n - 1) / n;
  std::vector<WorkItem> out;
  int64_t parts = 0;
  for (const WorkItem& w : items) {
    const int64_t keys = w.key_end - w.key_begin;
    const int64_t cap = forced > 0 ? (keys + kKeyChunk - 1) / kKeyChunk : keys / kMinSplitKeys;
    const int64_t ns = std::min(want, cap);
    if (ns <= 1) {
      out.push_back(w);
      continue;
    }
    // Split boundaries on whole key chunks.
    int64_t per = (keys + ns - 1) / ns;
    per = (per + kKeyChunk - 1) / kKeyChunk * kKeyChunk;
    SplitGroup g{w, parts, 0};
    for (int64_t k = w.key_begin; k < w.key_end; k += per) {
      WorkItem s = w;
      s.key_begin = k;
      s.key_end = std::min(w.key_end, k + per);
      s.part = parts++;
      s.cost = (s.key_end - s.key_begin) * (w.q_count * w.kv_heads + 4);
      out.push_back(s);
      ++g.num_parts;
    }
    groups.push_back(g);
  }
  items.swap(out);
  return parts;
}

// out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s over the parts of each split item.
void merge_splits(const AttnParams& p, const std::vector<SplitGroup>& groups) {
  const int64_t D = p.head_dim, G = p.group;
  parallel_for(0, static_cast<int64_t>(groups.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t gi = begin; gi < end; ++gi) {
      const SplitGroup& g = groups[gi];
      const WorkItem& w = g.item;
      const int64_t q0 = p.query_start_loc[w.seq];
      const int64_t Rh = w.q_count * G;
      for (int64_t r = 0; r < w.kv_heads * Rh; ++r) {  // rows ordered as in store_item_rows
        float m = -INFINITY;
        for (int64_t s = 0; s < g.num_parts; ++s) m = std::max(m, p.part_max[(g.first_part + s) * p.max_rows + r]);
        const int64_t h = r / Rh, tok = q0 + w.q_begin + (r - h * Rh) / G;
        float* dst = p.out + (tok * p.num_heads + (w.kv_head + h) * G + r % G) * D;
        std::fill(dst, dst + D, 0.f);
        float total = 0.f;
        for (int64_t s = 0; s < g.num_parts; ++s) {
          const int64_t row = (g.first_part + s) * p.max_rows + r;
          if (p.part_sum[row] == 0.f) continue;  // a part past this row's causal limit
          const float wgt = std::exp(p.part_max[row] - m);
          total += wgt * p.part_sum[row];
          const float* src = p.part_acc + row * D;
          for (int64_t d = 0; d < D; ++d) dst[d] += wgt * src[d];
        }
        const float inv = 1.f / total;
        for (int64_t d = 0; d < D; ++d) dst[d] *= inv;
      }
    }
  });
}

at::Tensor paged_attention_cpu(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                               const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                               int64_t num_splits, int64_t isa, int64_t tile_min_rows, int64_t tile_rows,
                               int64_t window, double softcap) {
  TORCH_CHECK(query.device().is_cpu() && kv_cache.device().is_cpu(), "paged_attention_cpu: CPU tensors only");
  TORCH_CHECK(query.scalar_type() == at::kFloat, "paged_attention_cpu: float32 query only");
  const int32_t kv_type = kv_type_of(kv_cache);
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [num_tokens, num_heads, head_dim], last dim dense");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.stride(4) == 1,
              "kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], last dim dense");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  query_start_loc.scalar_type() == at::kLong,
              "block_tables, seq_lens and query_start_loc must be int64");
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = kv_cache.size(3), num_seqs = seq_lens.size(0);
  TORCH_CHECK(kv_cache.size(4) == head_dim && num_heads % num_kv_heads == 0, "query and kv_cache shapes disagree");
  TORCH_CHECK(head_dim_supported(head_dim), "paged_attention_cpu: unsupported head_dim ", head_dim);
  TORCH_CHECK(query_start_loc.size(0) == num_seqs + 1 && block_tables.size(0) == num_seqs, "metadata shapes disagree");
  if (isa == 0) isa = best_isa();
  TORCH_CHECK(isa >= kIsaAvx2 && isa <= best_isa(), "paged_attention_cpu: this CPU does not support ISA level ", isa);

  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lens = seq_lens.contiguous();
  const at::Tensor starts = query_start_loc.contiguous();
  at::Tensor out = at::empty({num_tokens, num_heads, head_dim}, query.options());
  if (num_tokens == 0) return out;
  const int64_t* len_p = lens.data_ptr<int64_t>();
  const int64_t* start_p = starts.data_ptr<int64_t>();
  const int64_t group = num_heads / num_kv_heads;
  if (tile_min_rows <= 0) tile_min_rows = kDefaultTileMinRows;
  if (tile_rows <= 0) tile_rows = kDefaultTileRows;
  const int64_t tile = std::max<int64_t>(1, std::min<int64_t>(16, 64 / group));  // query rows per item
  const int64_t num_threads = at::get_num_threads();
  // Query rows per item of chunks longer than `tile`: tile_rows / group, but small enough that
  // the long chunks make about 4 items per thread (one short chunk alone must still spread over
  // the threads), and never under the tiled path's minimum.
  int64_t long_queries = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = start_p[s + 1] - start_p[s];
    if (q_len > tile) long_queries += q_len;
  }
  const int64_t balanced = (long_queries * num_kv_heads + 4 * num_threads - 1) / (4 * num_threads);
  const int64_t most = std::max<int64_t>(1, tile_rows / group);
  const int64_t least = std::min(most, (tile_min_rows + group - 1) / group);
  const int64_t long_tile = std::max(least, std::min(most, balanced));

  std::vector<WorkItem> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = start_p[s + 1] - start_p[s];
    const int64_t first_pos = len_p[s] - q_len;
    TORCH_CHECK(q_len >= 0 && first_pos >= 0, "sequence ", s, ": query_len exceeds seq_len");
    const int64_t t = q_len > tile ? long_tile : tile;
    for (int64_t qb = 0; qb < q_len; qb += t) {
      const int64_t qc = std::min(t, q_len - qb);
      const int64_t key_end = first_pos + qb + qc;
      // With a sliding window the item's first row (position first_pos + qb) sees the lowest keys.
      const int64_t key_begin = window > 0 ? std::max<int64_t>(0, first_pos + qb + 1 - window) : 0;
      // Per-key path items take several KV heads (up to kMaxGroupedRows rows) so each block is
      // read as one run; tiled items keep one head (their rows already reuse each key tile).
      const int64_t rows = qc * group;
      const int64_t heads = rows >= tile_min_rows ? 1 : std::max<int64_t>(1, std::min(num_kv_heads, kMaxGroupedRows / rows));
      for (int64_t h = 0; h < num_kv_heads; h += heads) {
        const int64_t nh = std::min(heads, num_kv_heads - h);
        items.push_back(WorkItem{s, h, nh, qb, qc, key_begin, key_end, -1, (key_end - key_begin) * (rows * nh + 4)});
      }
    }
  }
  std::vector<SplitGroup> groups;
  const int64_t num_parts = split_items(items, groups, num_threads, num_splits);
  // Longest first: the atomic work queue then balances a prefill chunk against many decodes.
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });

  int64_t max_rows = 0;
  for (const WorkItem& w : items) max_rows = std::max(max_rows, w.kv_heads * w.q_count * group);
  at::Tensor part_acc, part_max, part_sum;
  if (num_parts > 0) {
    part_acc = at::empty({num_parts, max_rows, head_dim}, query.options());
    part_max = at::empty({num_parts, max_rows}, query.options());
    part_sum = at::empty({num_parts, max_rows}, query.options());
  }
  AttnParams p{};
  p.query = query.data_ptr<float>();
  p.q_stride_tok = query.stride(0);
  p.q_stride_head = query.stride(1);
  p.kv = kv_cache.data_ptr();
  p.kv_type = kv_type;
  p.kv_stride_kv = kv_cache.stride(0);
  p.kv_stride_block = kv_cache.stride(1);
  p.kv_stride_tok = kv_cache.stride(2);
  p.kv_stride_head = kv_cache.stride(3);
  p.block_tables = tables.data_ptr<int64_t>();
  p.bt_stride = tables.size(1);
  p.seq_lens = len_p;
  p.query_start_loc = start_p;
  p.out = out.data_ptr<float>();
  p.part_acc = num_parts ? part_acc.data_ptr<float>() : nullptr;
  p.part_max = num_parts ? part_max.data_ptr<float>() : nullptr;
  p.part_sum = num_parts ? part_sum.data_ptr<float>() : nullptr;
  p.block_size = kv_cache.size(2);
  p.num_heads = num_heads;
  p.group = group;
  p.head_dim = head_dim;
  p.max_rows = max_rows;
  p.tile_min_rows = tile_min_rows;
  p.scale = static_cast<float>(scale);
  p.window = window;
  p.softcap = static_cast<float>(softcap);
  // PAGEDLLM_ATTN_PF=dist[,mode[,hint]] overrides the per-key path's prefetch (0 = none), for
  // A/B runs of scripts/attention_scattered.py; values are clamped, the output never changes.
  p.pf_dist = 1;
  p.pf_mode = kPfInPv;
  p.pf_hint = 3;
  if (const char* pf = std::getenv("PAGEDLLM_ATTN_PF")) {
    int d = p.pf_dist, m = p.pf_mode, h = p.pf_hint;
    std::sscanf(pf, "%d,%d,%d", &d, &m, &h);
    p.pf_dist = std::max(0, std::min(d, 8));
    p.pf_mode = m == kPfBurst ? kPfBurst : kPfInPv;
    p.pf_hint = std::max(0, std::min(h, 3));
  }

  const auto run = isa == kIsaAvx512 ? run_items_avx512 : run_items_avx2;
  const int64_t num_items = static_cast<int64_t>(items.size());
  int64_t next = 0;
  parallel_for(0, std::min(num_threads, num_items), 1, [&](int64_t, int64_t) {
    std::vector<float> scratch(scratch_floats(max_rows, head_dim));
    run(p, items.data(), num_items, &next, scratch.data());
  });
  if (num_parts > 0) merge_splits(p, groups);
  return out;
}

inline void store_row(const float* src, int64_t n, float* dst) { std::copy_n(src, n, dst); }
// c10's conversions round to nearest even, as torch's own .to(float16 / bfloat16) does.
inline void store_row(const float* src, int64_t n, c10::Half* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = c10::Half(src[i]);
}
inline void store_row(const float* src, int64_t n, c10::BFloat16* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = c10::BFloat16(src[i]);
}

template <typename T>
void kv_write_rows(const float* k, const float* v, int64_t ks0, int64_t ks1, int64_t vs0, int64_t vs1, T* kc,
                   int64_t num_slots, int64_t heads, int64_t dim, const int64_t* slot_p, int64_t num_tokens) {
  const int64_t row = heads * dim;
  T* vc = kc + num_slots * row;
  // A decode step's few rows are copied faster than threads start; long prompts are split.
  parallel_for(0, num_tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slot_p[t] < 0) continue;
      T* kd = kc + slot_p[t] * row;
      T* vd = vc + slot_p[t] * row;
      for (int64_t h = 0; h < heads; ++h) {
        store_row(k + t * ks0 + h * ks1, dim, kd + h * dim);
        store_row(v + t * vs0 + h * vs1, dim, vd + h * dim);
      }
    }
  });
}

// kv_cache[0 / 1] at each token's flat slot = its key / value rows (in place), converted to the
// cache's element type. Reads strided views (the fused QKV projection's K and V columns) as they
// are; a slot < 0 skips the token.
void kv_write_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor kv_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.device().is_cpu() && value.device().is_cpu() && kv_cache.device().is_cpu(),
              "kv_write_cpu: CPU tensors only");
  const auto cache_type = kv_cache.scalar_type();
  TORCH_CHECK(key.scalar_type() == at::kFloat && value.scalar_type() == at::kFloat &&
                  (cache_type == at::kFloat || cache_type == at::kHalf || cache_type == at::kBFloat16) &&
                  slot_mapping.scalar_type() == at::kLong,
              "kv_write_cpu: float32 key and value, a float32, float16 or bfloat16 kv_cache, int64 slot_mapping");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous [2, num_blocks, block_size, num_kv_heads, head_dim]");
  const int64_t num_tokens = key.size(0), heads = kv_cache.size(3), dim = kv_cache.size(4);
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.size(1) == heads && key.size(2) == dim &&
                  key.stride(2) == 1 && value.stride(2) == 1,
              "key and value must be [num_tokens, num_kv_heads, head_dim] with a dense last dim");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == num_tokens, "one slot per token");
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t* slot_p = slots.data_ptr<int64_t>();
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(slot_p[t] < num_slots, "kv_write_cpu: slot ", slot_p[t], " past the cache's ", num_slots);
  const float* k = key.data_ptr<float>();
  const float* v = value.data_ptr<float>();
  const int64_t ks0 = key.stride(0), ks1 = key.stride(1), vs0 = value.stride(0), vs1 = value.stride(1);
  if (cache_type == at::kFloat)
    kv_write_rows(k, v, ks0, ks1, vs0, vs1, kv_cache.data_ptr<float>(), num_slots, heads, dim, slot_p, num_tokens);
  else if (cache_type == at::kHalf)
    kv_write_rows(k, v, ks0, ks1, vs0, vs1, kv_cache.data_ptr<c10::Half>(), num_slots, heads, dim, slot_p, num_tokens);
  else
    kv_write_rows(k, v, ks0, ks1, vs0, vs1, kv_cache.data_ptr<c10::BFloat16>(), num_slots, heads, dim, slot_p,
                  num_tokens);
}

}  // namespace
}  // namespace pagedllm

TORCH_LIBRARY(pagedllm, m) {
  m.def(
      "paged_attention_cpu(Tensor query, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, "
      "Tensor query_start_loc, float scale, int num_splits=0, int isa=0, int tile_min_rows=0, "
      "int tile_rows=0, int window=-1, float softcap=0.) -> Tensor");
  // 2 = AVX-512, 1 = AVX2 + FMA + F16C, 0 = neither (the op then refuses to run).
  m.def("cpu_isa() -> int", &pagedllm::best_isa);
  m.def("kv_write_cpu(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("paged_attention_cpu", &pagedllm::paged_attention_cpu);
  m.impl("kv_write_cpu", &pagedllm::kv_write_cpu);
}
