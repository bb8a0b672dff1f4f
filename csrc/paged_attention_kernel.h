// The paged-attention kernel body, written once over a small vector vocabulary that each ISA file
// defines before including it (vf, VW, vload, vstore, vset1, vzero, vfma, vmul, vmax, vexp,
// vreduce_add, vreduce_max, vsum_lanes, vmax_lanes, and vload_kv: VW cache elements of type T = float, f16_t
// or bf16_t widened to float32). Included inside an anonymous namespace, so each ISA gets its own
// private copy. K/V elements are converted in registers as they are loaded; all arithmetic is
// float32, so a 16-bit cache halves the bytes read and changes nothing else.
//
// One item = (sequence, KV heads, tile of query rows, key range). Each KV head's query group is
// folded into the rows (row = (head * query_rows + query_row) * group + g), so each K/V row is
// read from memory once per item and reused from L1 by every row. Keys are streamed in chunks of kKeyChunk through the
// block table with an online softmax; row r of a sequence with query_len Q and seq_len L sees
// keys [0, L - Q + r] (causal over the cached prefix and the chunk itself); with a sliding window
// W only the last W of those, [L - Q + r - W + 1, L - Q + r] (keys before it are masked per row).

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

// Offsets (in elements, relative to this KV head's base) of keys [c0, c0 + n) through the table.
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

// One 64-byte line into the cache level `hint` names (__builtin_prefetch wants a constant).
static inline void prefetch_line(const void* a, int32_t hint) {
  switch (hint) {
    case 0: __builtin_prefetch(a, 0, 0); break;
    case 1: __builtin_prefetch(a, 0, 1); break;
    case 3: __builtin_prefetch(a, 0, 3); break;
    default: __builtin_prefetch(a, 0, 2); break;
  }
}

// Every line of heads [0, heads) of the rows at offs[0, n) from base.
template <int D, typename T>
static inline void prefetch_rows(const AttnParams& p, const T* base, const int64_t* offs, int64_t n, int64_t heads) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t d = 0; d < D; d += 64 / (int64_t)sizeof(T))
        prefetch_line(base + h * p.kv_stride_head + offs[j] + d, p.pf_hint);
}

// key_offsets for a chunk of kKeyChunk, the slots past n filled with key c0's (a valid row, read
// and then masked) so the chunk is always scored whole.
static inline void chunk_offsets(const AttnParams& p, const int64_t* table, int64_t c0, int64_t n, int64_t* offs) {
  key_offsets(p, table, c0, n, offs);
  for (int64_t j = n; j < kKeyChunk; ++j) offs[j] = offs[0];
}

// An item's rows leave the kernel: normalised into the output when the item covers the whole
// context, or as a partial (unnormalised acc, running max and sum) for the split merge.
// Row r is KV head h = r / (q_count * G), then query qi, then group member g (both paths order
// rows so).
template <int D>
static inline void store_item_rows(const AttnParams& p, const WorkItem& w, int64_t q0, const float* acc,
                                   const float* mx, const float* sm) {
  constexpr int NV = D / VW;
  const int64_t G = p.group, Rh = w.q_count * G, R = w.kv_heads * Rh;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t h = r / Rh, qi = (r - h * Rh) / G, g = r - h * Rh - qi * G;
    if (w.part < 0) {
      float* dst = p.out + ((q0 + w.q_begin + qi) * p.num_heads + (w.kv_head + h) * G + g) * D;
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

// o[r, d0:d0+W*VW] = alpha[r] o[r, ...] + sum_{j<n} p[r, j] v_j[d0:...] for RB rows (row stride
// D in o, KC in p): each V row is loaded once for the RB rows, and RB * W independent
// accumulator chains keep the FMA units busy (one row alone is a chain of n dependent FMAs).
// Rows per P.V register block: a decode item of a GQA group of 3 is one block.
constexpr int PV_RB = 3;
static_assert(PV_RB == 3, "run_item's P.V handles a remainder of at most 2 rows");

// Rows a P.V pass prefetches as it goes (one key's K and V rows of one head per key applied):
// spread through the compute, the prefetches never stall it the way a burst does.
template <typename T>
struct PfRows {
  const T* k;
  const T* v;
  const int64_t* offs;
  int64_t n;
  int32_t hint;
};

template <int D, int RB, int W, typename T>
static inline void pv_chunk(float* o, const float* pk, const float* alpha, const T* vbase,
                            const int64_t* offs, int64_t n, int d0, const PfRows<T>* pf) {
  constexpr int KC = kKeyChunk;
  vf acc[RB][W];
  for (int r = 0; r < RB; ++r) {
    const vf a = vset1(alpha[r]);
    for (int b = 0; b < W; ++b) acc[r][b] = vmul(vload(o + r * D + d0 + b * VW), a);
  }
  for (int64_t j = 0; j < n; ++j) {
    if (pf != nullptr && j < pf->n)
      for (int d = 0; d < D; d += 64 / (int)sizeof(T)) {
        prefetch_line(pf->k + pf->offs[j] + d, pf->hint);
        prefetch_line(pf->v + pf->offs[j] + d, pf->hint);
      }
    const T* v = vbase + offs[j] + d0;
    vf vv[W];
    for (int b = 0; b < W; ++b) vv[b] = vload_kv(v + b * VW);
    for (int r = 0; r < RB; ++r) {
      const vf pj = vset1(pk[r * KC + j]);
      for (int b = 0; b < W; ++b) acc[r][b] = vfma(pj, vv[b], acc[r][b]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int b = 0; b < W; ++b) vstore(o + r * D + d0 + b * VW, acc[r][b]);
}

// P.V of rows [r0, r0 + RB) over D in register tiles of up to PV_W vectors.
template <int D, int RB, typename T>
static inline void pv_rows_chunk(float* acc, const float* st, const float* alpha, const T* vbase,
                                 const int64_t* offs, int64_t n, int64_t r0, const PfRows<T>* pf = nullptr) {
  constexpr int NV = D / VW;
  constexpr int W = NV < PV_W ? NV : PV_W;
  int d0 = 0;
  for (; d0 + W * VW <= D; d0 += W * VW, pf = nullptr)
    pv_chunk<D, RB, W, T>(acc + r0 * D, st + r0 * kKeyChunk, alpha + r0, vbase, offs, n, d0, pf);
  for (; d0 < D; d0 += VW, pf = nullptr)
    pv_chunk<D, RB, 1, T>(acc + r0 * D, st + r0 * kKeyChunk, alpha + r0, vbase, offs, n, d0, pf);
}

// Online softmax of one chunk's scores st[R, KC] (row r of a head sees keys below
// row_end[r % Rh]; keys past n and past a row's limit are masked here), VW rows at a time: the
// rows' maxima and sums come out of one transpose-and-combine tree each, and the rescale factors
// of VW rows out of one vector exp, instead of two horizontal reductions and a scalar exp per row.
// A row that has seen no key yet keeps max -inf and gets alpha 0 and probabilities 0 (vexp of
// -inf - -inf, a NaN, is 0); a row that sees none of this chunk gets alpha exactly 1.
static inline void softmax_chunk(float* st, int64_t R, int64_t Rh, const int64_t* row_begin,
                                 const int64_t* row_end, int64_t c0, int64_t n, float* mx, float* sm, float* alpha,
                                 float softcap) {
  constexpr int KC = kKeyChunk;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t nr = max64(0, min64(n, row_end[r % Rh] - c0));
    // Keys before the row's sliding window (row_begin is the item's key_begin without one).
    const int64_t lo = max64(0, min64(KC, row_begin[r % Rh] - c0));
    if (softcap > 0.f)  // the visible scores only (the others may be any value)
      for (int64_t j = lo; j < nr; ++j) st[r * KC + j] = softcap * tanhf(st[r * KC + j] / softcap);
    for (int64_t j = nr; j < KC; ++j) st[r * KC + j] = -INFINITY;
    for (int64_t j = 0; j < lo; ++j) st[r * KC + j] = -INFINITY;
  }
  for (int64_t rg = 0; rg < R; rg += VW) {
    const int64_t rows = min64(VW, R - rg);
    vf part[VW];
    for (int i = 0; i < VW; ++i) {
      if (i < rows) {
        const float* s = st + (rg + i) * KC;
        vf m = vload(s);
        for (int b = VW; b < KC; b += VW) m = vmax(m, vload(s + b));
        part[i] = m;
      } else {
        part[i] = vset1(-INFINITY);
      }
    }
    const vf m_old = vload(mx + rg);
    const vf m_new = vmax(m_old, vmax_lanes(part));
    const vf al = vexp(m_old, m_new);
    vstore(mx + rg, m_new);
    vstore(alpha + rg, al);
    for (int i = 0; i < VW; ++i) {
      vf tot = vzero();
      if (i < rows) {
        float* s = st + (rg + i) * KC;
        const vf vm = vset1(mx[rg + i]);
        for (int b = 0; b < KC; b += VW) {
          const vf e = vexp(vload(s + b), vm);
          vstore(s + b, e);
          tot = vfma(e, vset1(1.f), tot);
        }
      }
      part[i] = tot;
    }
    vstore(sm + rg, vfma(vload(sm + rg), al, vsum_lanes(part)));
  }
}

// s[r, 0:KC] = q[r, :] . k_j for RS rows of one KV head (row stride D in q, KC in s) over a
// chunk's keys (keys past the chunk's n read key c0 again; masked later). Keys go SCORE_KG at a
// time with RS x SCORE_KG accumulators (vertical FMAs over head_dim), so each K vector is loaded
// once for the RS rows instead of once per row; each row's KC per-key partial vectors are then
// reduced by one transpose-and-add tree per VW keys, so no key pays a horizontal sum alone.
template <int D, int RS, typename T>
static inline void score_rows(const float* q, const T* kb, const int64_t* offs, float* s) {
  constexpr int NV = D / VW, KC = kKeyChunk, KG = SCORE_KG;
  static_assert(KC % KG == 0, "a key chunk is whole key groups");
  vf part[RS][KC];
  for (int j0 = 0; j0 < KC; j0 += KG) {
    const T* k[KG];
    for (int j = 0; j < KG; ++j) k[j] = kb + offs[j0 + j];
    vf a[RS][KG];
    for (int v = 0; v < NV; ++v)
      for (int j = 0; j < KG; ++j) {
        const vf kv = vload_kv(k[j] + v * VW);
        for (int r = 0; r < RS; ++r)
          a[r][j] = v == 0 ? vmul(vload(q + r * D), kv) : vfma(vload(q + r * D + v * VW), kv, a[r][j]);
      }
    for (int r = 0; r < RS; ++r)
      for (int j = 0; j < KG; ++j) part[r][j0 + j] = a[r][j];
  }
  for (int r = 0; r < RS; ++r)
    for (int b = 0; b < KC; b += VW) vstore(s + r * KC + b, vsum_lanes(&part[r][b]));
}

template <int D, typename T>
static void run_item(const AttnParams& p, const WorkItem& w, float* scratch) {
  constexpr int NV = D / VW;
  constexpr int KC = kKeyChunk;
  static_assert(KC % VW == 0, "a key chunk is whole score vectors");
  const int64_t G = p.group, Rh = w.q_count * G, R = w.kv_heads * Rh;
  float* qb = scratch;        // [R, D] scaled queries
  float* acc = qb + R * D;    // [R, D] unnormalised outputs
  float* st = acc + R * D;    // [R, KC] this chunk's scores, then probabilities
  // The softmax state is padded to whole vectors (it is updated VW rows at a time).
  const int64_t Rp = (R + VW - 1) / VW * VW;
  float* mx = st + R * KC;    // [Rp] running max
  float* sm = mx + Rp;        // [Rp] running sum
  float* alpha = sm + Rp;     // [Rp] this chunk's rescale of acc
  // [Rh] exclusive key limit per row of a head (the same for every head), 8-byte aligned
  int64_t* row_end = (int64_t*)(((uintptr_t)(alpha + Rp) + 7) & ~(uintptr_t)7);
  int64_t* row_begin = row_end + Rh;  // [Rh] first key per row (its sliding window's start)

  const int64_t seq_len = p.seq_lens[w.seq];
  const int64_t q0 = p.query_start_loc[w.seq];
  const int64_t first_pos = seq_len - (p.query_start_loc[w.seq + 1] - q0);
  const vf vscale = vset1(p.scale);
  int64_t key_stop = w.key_begin;
  for (int64_t qi = 0; qi < w.q_count; ++qi) {
    const int64_t end = min64(first_pos + w.q_begin + qi + 1, w.key_end);
    // The window starts window keys before the row's own position + 1 (not before `end`, which a
    // context split clips).
    const int64_t pos_end = first_pos + w.q_begin + qi + 1;
    const int64_t begin = p.window > 0 ? max64(w.key_begin, pos_end - p.window) : w.key_begin;
    for (int64_t g = 0; g < G; ++g) {
      row_end[qi * G + g] = end;
      row_begin[qi * G + g] = begin;
    }
    key_stop = max64(key_stop, end);
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t h = r / Rh, qi = (r - h * Rh) / G, g = r - h * Rh - qi * G;
    const float* src = p.query + (q0 + w.q_begin + qi) * p.q_stride_tok + ((w.kv_head + h) * G + g) * p.q_stride_head;
    for (int v = 0; v < NV; ++v) {
      vstore(qb + r * D + v * VW, vmul(vload(src + v * VW), vscale));
      vstore(acc + r * D + v * VW, vzero());
    }
  }
  for (int64_t r = 0; r < Rp; ++r) {
    mx[r] = -INFINITY;
    sm[r] = 0.f;
  }

  // All the item's KV heads go through a chunk together: a token's K (and V) rows of adjacent
  // heads are adjacent in memory, so a block is read as one run instead of one stride per head
  // (and two threads never pull the same block's lines into both their caches).
  const int64_t* table = p.block_tables + w.seq * p.bt_stride;
  const T* kbase = static_cast<const T*>(p.kv) + w.kv_head * p.kv_stride_head;
  const T* vbase0 = kbase + p.kv_stride_kv;
  int64_t offs[KC], pf_offs[KC];
  // The chunks before the first one the loop prefetches pf_dist ahead (chunk 0 is read at once).
  for (int64_t c = w.key_begin + KC; c < min64(key_stop, w.key_begin + p.pf_dist * KC); c += KC) {
    const int64_t nc = min64(KC, key_stop - c);
    key_offsets(p, table, c, nc, pf_offs);
    prefetch_rows<D>(p, kbase, pf_offs, nc, w.kv_heads);
    prefetch_rows<D>(p, vbase0, pf_offs, nc, w.kv_heads);
  }
  for (int64_t c0 = w.key_begin; c0 < key_stop; c0 += KC) {
    const int64_t n = min64(KC, key_stop - c0);
    chunk_offsets(p, table, c0, n, offs);
    // Software prefetch of the chunk pf_dist chunks ahead, its block looked up now: the blocks
    // are scattered, so the hardware prefetchers restart at every block (and every 4 KB page).
    // By default (kPfInPv, T0, 1 chunk ahead) its lines are requested during this chunk's P.V,
    // one key's K and V rows per key applied, instead of in one burst here: a burst of 24 KB of
    // prefetches fills the line-fill buffers and stalls the core until they drain, while spread
    // through the FMAs they overlap it. Measured with scripts/attention_scattered.py (1 thread,
    // AVX-512, 9 query / 3 KV heads, block 16, shared 2-vCPU Xeon): blocks scattered over 4 GB
    // 1.13-1.19x faster than the burst into L2 (the previous default), hot contiguous KV
    // 1.19-1.22x; a burst into L1 was 1.1x on scattered, even on hot; bursts ordered K then V,
    // 2+ chunks ahead, or every other line were slower. K spread through the scores and V
    // through P.V, into L2, was 1.05-1.08x faster again on hot KV but up to 0.9x on scattered.
    const int64_t cp = c0 + p.pf_dist * KC;
    int64_t np = 0;
    if (p.pf_dist > 0 && cp < key_stop) {
      np = min64(KC, key_stop - cp);
      key_offsets(p, table, cp, np, pf_offs);
      if (p.pf_mode == kPfBurst)
        for (int64_t j = 0; j < np; ++j)
          for (int64_t h = 0; h < w.kv_heads; ++h)
            for (int64_t d = 0; d < D; d += 64 / (int64_t)sizeof(T)) {
              prefetch_line(kbase + h * p.kv_stride_head + pf_offs[j] + d, p.pf_hint);
              prefetch_line(vbase0 + h * p.kv_stride_head + pf_offs[j] + d, p.pf_hint);
            }
    }
    const bool in_pv = np > 0 && p.pf_mode == kPfInPv;
    // A head's rows are in query order, so their key limits only grow: skip the leading rows
    // that see none of this chunk (causal rows of a short chunk).
    int64_t r_first = 0;
    while (r_first < Rh && row_end[r_first] <= c0) ++r_first;

    for (int64_t h = 0; h < w.kv_heads; ++h) {
      const T* kb = kbase + h * p.kv_stride_head;
      const int64_t rb = h * Rh + r_first, re = (h + 1) * Rh;
      int64_t r0 = rb;
      for (; r0 + PV_RB <= re; r0 += PV_RB) score_rows<D, PV_RB, T>(qb + r0 * D, kb, offs, st + r0 * KC);
      if (re - r0 == 2) score_rows<D, 2, T>(qb + r0 * D, kb, offs, st + r0 * KC);
      if (re - r0 == 1) score_rows<D, 1, T>(qb + r0 * D, kb, offs, st + r0 * KC);
    }
    softmax_chunk(st, R, Rh, row_begin, row_end, c0, n, mx, sm, alpha, p.softcap);
    for (int64_t h = 0; h < w.kv_heads; ++h) {
      const T* vb = vbase0 + h * p.kv_stride_head;
      const int64_t rb = h * Rh + r_first, re = (h + 1) * Rh;
      // P.V: each V row loaded once per block of PV_RB rows. Every key up to n is applied to
      // every row: a row's masked keys have probability 0.
      const PfRows<T> pfr{kbase + h * p.kv_stride_head, vb, pf_offs, in_pv ? np : 0, p.pf_hint};
      const PfRows<T>* pf = in_pv ? &pfr : nullptr;
      int64_t r0 = rb;
      for (; r0 + PV_RB <= re; r0 += PV_RB, pf = nullptr) pv_rows_chunk<D, PV_RB, T>(acc, st, alpha, vb, offs, n, r0, pf);
      if (re - r0 == 2) pv_rows_chunk<D, 2, T>(acc, st, alpha, vb, offs, n, r0, pf);
      if (re - r0 == 1) pv_rows_chunk<D, 1, T>(acc, st, alpha, vb, offs, n, r0, pf);
    }
  }

  store_item_rows<D>(p, w, q0, acc, mx, sm);
}

#include "paged_attention_tile.h"

template <int D, typename T>
static void run_all(const AttnParams& p, const WorkItem* items, int64_t num_items, int64_t* next,
                    float* scratch) {
  for (;;) {
    const int64_t i = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED);
    if (i >= num_items) return;
    if (items[i].q_count * p.group >= p.tile_min_rows)
      run_item_tiled<D, T>(p, items[i], scratch);
    else
      run_item<D, T>(p, items[i], scratch);
  }
}

template <typename T>
static bool run_items_typed(const AttnParams& p, const WorkItem* items, int64_t num_items, int64_t* next,
                            float* scratch) {
  switch (p.head_dim) {
    case 32: run_all<32, T>(p, items, num_items, next, scratch); return true;
    case 64: run_all<64, T>(p, items, num_items, next, scratch); return true;
    case 80: run_all<80, T>(p, items, num_items, next, scratch); return true;
    case 96: run_all<96, T>(p, items, num_items, next, scratch); return true;
    case 128: run_all<128, T>(p, items, num_items, next, scratch); return true;
    case 256: run_all<256, T>(p, items, num_items, next, scratch); return true;
    default: return false;
  }
}

static bool run_items(const AttnParams& p, const WorkItem* items, int64_t num_items, int64_t* next,
                      float* scratch) {
  switch (p.kv_type) {
    case kKvFloat32: return run_items_typed<float>(p, items, num_items, next, scratch);
    case kKvFloat16: return run_items_typed<f16_t>(p, items, num_items, next, scratch);
    case kKvBFloat16: return run_items_typed<bf16_t>(p, items, num_items, next, scratch);
    default: return false;
  }
}
