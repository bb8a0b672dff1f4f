// The paged-attention kernel body, written once over a small vector vocabulary that each ISA file
// defines before including it (vf, VW, vload, vstore, vset1, vzero, vfma, vmul, vmax, vexp,
// vreduce_add). Included inside an anonymous namespace, so each ISA gets its own private copy.
//
// One item = (sequence, KV head, tile of query rows, key range). The KV head's query group is
// folded into the rows (row = query_row * group + g), so each K/V row is read from memory once
// per item and reused from L1 by every row. Keys are streamed in chunks of kKeyChunk through the
// block table with an online softmax; row r of a sequence with query_len Q and seq_len L sees
// keys [0, L - Q + r] (causal over the cached prefix and the chunk itself).

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

// Offsets (in floats, relative to this KV head's base) of keys [c0, c0 + n) through the table.
static inline void key_offsets(const AttnParams& p, const int64_t* table, int64_t c0, int64_t n,
                               int64_t* offs) {
  int64_t b = c0 / p.block_size, o = c0 - b * p.block_size;
  int64_t base = table[b] * p.kv_stride_block;
  for (int64_t j = 0; j < n; ++j) {
    offs[j] = base + o * p.kv_stride_tok;
    if (++o == p.block_size) {
      o = 0;
      ++b;
      if (j + 1 < n) base = table[b] * p.kv_stride_block;
    }
  }
}

// An item's rows leave the kernel: normalised into the output when the item covers the whole
// context, or as a partial (unnormalised acc, running max and sum) for the split merge.
// Row r is query qi = r / G, head g = r % G of the item's KV head (both paths order rows so).
template <int D>
static inline void store_item_rows(const AttnParams& p, const WorkItem& w, int64_t q0, const float* acc,
                                   const float* mx, const float* sm) {
  constexpr int NV = D / VW;
  const int64_t G = p.group, R = w.q_count * G;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t qi = r / G, g = r - qi * G;
    if (w.part < 0) {
      float* dst = p.out + ((q0 + w.q_begin + qi) * p.num_heads + w.kv_head * G + g) * D;
      const vf inv = vset1(sm[r] > 0.f ? 1.f / sm[r] : 0.f);
      for (int v = 0; v < NV; ++v) vstore(dst + v * VW, vmul(vload(acc + r * D + v * VW), inv));
    } else {
      const int64_t row = w.part * p.max_rows + r;
      for (int v = 0; v < NV; ++v) vstore(p.part_acc + row * D + v * VW, vload(acc + r * D + v * VW));
      p.part_max[row] = mx[r];
      p.part_sum[row] = sm[r];
    }
  }
}

template <int D>
static void run_item(const AttnParams& p, const WorkItem& w, float* scratch) {
  constexpr int NV = D / VW;
  constexpr int KC = kKeyChunk;
  const int64_t G = p.group, R = w.q_count * G;
  float* qb = scratch;       // [R, D] scaled queries
  float* acc = qb + R * D;   // [R, D] unnormalised outputs
  float* mx = acc + R * D;   // [R] running max
  float* sm = mx + R;        // [R] running sum
  float* pr = sm + R;        // [KC] one row's probabilities for the chunk
  // [R] exclusive key limit per row, 8-byte aligned
  int64_t* row_end = (int64_t*)(((uintptr_t)(pr + KC) + 7) & ~(uintptr_t)7);

  const int64_t seq_len = p.seq_lens[w.seq];
  const int64_t q0 = p.query_start_loc[w.seq];
  const int64_t first_pos = seq_len - (p.query_start_loc[w.seq + 1] - q0);
  const vf vscale = vset1(p.scale);
  int64_t key_stop = w.key_begin;
  for (int64_t qi = 0; qi < w.q_count; ++qi) {
    const int64_t tok = q0 + w.q_begin + qi;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = qi * G + g;
      const float* src = p.query + tok * p.q_stride_tok + (w.kv_head * G + g) * p.q_stride_head;
      for (int v = 0; v < NV; ++v) {
        vstore(qb + r * D + v * VW, vmul(vload(src + v * VW), vscale));
        vstore(acc + r * D + v * VW, vzero());
      }
      mx[r] = -INFINITY;
      sm[r] = 0.f;
      row_end[r] = min64(first_pos + w.q_begin + qi + 1, w.key_end);
      key_stop = max64(key_stop, row_end[r]);
    }
  }

  const int64_t* table = p.block_tables + w.seq * p.bt_stride;
  const float* kbase = p.kv + w.kv_head * p.kv_stride_head;
  const float* vbase = kbase + p.kv_stride_kv;
  int64_t offs[KC], next_offs[KC];
  if (w.key_begin < key_stop) key_offsets(p, table, w.key_begin, min64(KC, key_stop - w.key_begin), offs);
  for (int64_t c0 = w.key_begin; c0 < key_stop; c0 += KC) {
    const int64_t n = min64(KC, key_stop - c0);
    const int64_t c1 = c0 + KC;
    if (c1 < key_stop) {  // look the next chunk up now and start its loads early
      const int64_t n1 = min64(KC, key_stop - c1);
      key_offsets(p, table, c1, n1, next_offs);
      for (int64_t j = 0; j < n1; ++j)
        for (int d = 0; d < D; d += 16) {
          __builtin_prefetch(kbase + next_offs[j] + d);
          __builtin_prefetch(vbase + next_offs[j] + d);
        }
    }
    for (int64_t r = 0; r < R; ++r) {
      const int64_t nr = min64(n, row_end[r] - c0);
      if (nr <= 0) continue;
      vf q[NV];
      for (int v = 0; v < NV; ++v) q[v] = vload(qb + r * D + v * VW);
      float chunk_max = -INFINITY;
      for (int64_t j = 0; j < nr; ++j) {
        const float* k = kbase + offs[j];
        vf a = vmul(q[0], vload(k));
        for (int v = 1; v < NV; ++v) a = vfma(q[v], vload(k + v * VW), a);
        const float s = vreduce_add(a);
        pr[j] = s;
        chunk_max = s > chunk_max ? s : chunk_max;
      }
      const float m_new = chunk_max > mx[r] ? chunk_max : mx[r];
      const float alpha = expf(mx[r] - m_new);  // 0 on the row's first chunk (mx = -inf)
      for (int64_t j = nr; j < KC; ++j) pr[j] = -INFINITY;
      const vf vm = vset1(m_new);
      float total = 0.f;
      for (int j = 0; j < KC; j += VW) {
        const vf e = vexp(vload(pr + j), vm);
        vstore(pr + j, e);
        total += vreduce_add(e);
      }
      sm[r] = sm[r] * alpha + total;
      mx[r] = m_new;
      vf o[NV];
      const vf va = vset1(alpha);
      for (int v = 0; v < NV; ++v) o[v] = vmul(vload(acc + r * D + v * VW), va);
      for (int64_t j = 0; j < nr; ++j) {
        const float* vv = vbase + offs[j];
        const vf pj = vset1(pr[j]);
        for (int v = 0; v < NV; ++v) o[v] = vfma(pj, vload(vv + v * VW), o[v]);
      }
      for (int v = 0; v < NV; ++v) vstore(acc + r * D + v * VW, o[v]);
    }
    for (int64_t j = 0; j < KC; ++j) offs[j] = next_offs[j];
  }

  store_item_rows<D>(p, w, q0, acc, mx, sm);
}

#include "paged_attention_tile.h"

template <int D>
static void run_all(const AttnParams& p, const WorkItem* items, int64_t num_items, int64_t* next,
                    float* scratch) {
  for (;;) {
    const int64_t i = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED);
    if (i >= num_items) return;
    if (items[i].q_count * p.group >= p.tile_min_rows)
      run_item_tiled<D>(p, items[i], scratch);
    else
      run_item<D>(p, items[i], scratch);
  }
}

static bool run_items(const AttnParams& p, const WorkItem* items, int64_t num_items, int64_t* next,
                      float* scratch) {
  switch (p.head_dim) {
    case 32: run_all<32>(p, items, num_items, next, scratch); return true;
    case 64: run_all<64>(p, items, num_items, next, scratch); return true;
    case 80: run_all<80>(p, items, num_items, next, scratch); return true;
    case 96: run_all<96>(p, items, num_items, next, scratch); return true;
    case 128: run_all<128>(p, items, num_items, next, scratch); return true;
    case 256: run_all<256>(p, items, num_items, next, scratch); return true;
    default: return false;
  }
}
