// The tiled path for items with many query rows (prefill chunks), included by
// paged_attention_kernel.h inside each ISA's anonymous namespace. Each ISA file defines MR (rows
// per register tile) and NB (vectors per register tile) so MR * NB accumulators plus the loads fit
// its register file.
//
// Prefill is compute-bound, and per-key dot products (the decode path) spend their time in
// horizontal reductions. Here keys go in tiles of kKeyTile: the tile's K rows are gathered through
// the block table into a transposed, contiguous [D, kKeyTile] buffer, so the score tile
// S = Q K^T is a register-blocked micro-GEMM (broadcast one query element, FMA a row of keys);
// then an online softmax per row over the tile, and O = alpha O + P V as a second micro-GEMM
// that reads the tile's V rows in place (each is D contiguous floats, and the tile stays in L1/L2).

// Stands in for keys past a tile's end: all-zero bits are 0.0 in every cache element type.
alignas(64) static const float kZeroRow[256] = {};

// Eight cache elements widened to float32 (F16C for binary16; bfloat16 is float32's top half).
static inline __m256 load8_kv(const float* x) { return _mm256_loadu_ps(x); }
static inline __m256 load8_kv(const f16_t* x) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)x)); }
static inline __m256 load8_kv(const bf16_t* x) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)x)), 16));
}

// dst[k * ld + i] = rows[i][d0 + k] for i, k < 8: eight keys' dims d0..d0+7, transposed.
template <typename T>
static inline void transpose8x8(const T* const* rows, int d0, float* dst, int64_t ld) {
  __m256 r[8], t[8], u[8];
  for (int i = 0; i < 8; ++i) r[i] = load8_kv(rows[i] + d0);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int k = 0; k < 4; ++k) {
    _mm256_storeu_ps(dst + k * ld, _mm256_permute2f128_ps(u[k], u[k + 4], 0x20));
    _mm256_storeu_ps(dst + (k + 4) * ld, _mm256_permute2f128_ps(u[k], u[k + 4], 0x31));
  }
}

// s[r, 0:KT] = q[r, :] . kt[:, 0:KT] for the MR rows from q (row stride D).
template <int D>
static inline void score_rows(const float* q, const float* kt, float* s) {
  static_assert(kKeyTile % (NB * VW) == 0, "key tile must be a whole number of register tiles");
  for (int j0 = 0; j0 < kKeyTile; j0 += NB * VW) {
    vf acc[MR][NB];
    for (int r = 0; r < MR; ++r)
      for (int b = 0; b < NB; ++b) acc[r][b] = vzero();
    for (int d = 0; d < D; ++d) {
      vf k[NB];
      for (int b = 0; b < NB; ++b) k[b] = vload(kt + d * kKeyTile + j0 + b * VW);
      for (int r = 0; r < MR; ++r) {
        const vf qv = vset1(q[r * D + d]);
        for (int b = 0; b < NB; ++b) acc[r][b] = vfma(qv, k[b], acc[r][b]);
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int b = 0; b < NB; ++b) vstore(s + r * kKeyTile + j0 + b * VW, acc[r][b]);
  }
}

// o[r, d0:d0+W*VW] = alpha[r] o[r, ...] + sum_{j<n} p[r, j] v_j[d0:...] for the MR rows.
template <int D, int W, typename T>
static inline void pv_rows(float* o, const float* p, const float* alpha, const T* vbase,
                           const int64_t* offs, int64_t n, int d0) {
  vf acc[MR][W];
  for (int r = 0; r < MR; ++r) {
    const vf a = vset1(alpha[r]);
    for (int b = 0; b < W; ++b) acc[r][b] = vmul(vload(o + r * D + d0 + b * VW), a);
  }
  for (int64_t j = 0; j < n; ++j) {
    const T* v = vbase + offs[j] + d0;
    vf vv[W];
    for (int b = 0; b < W; ++b) vv[b] = vload_kv(v + b * VW);
    for (int r = 0; r < MR; ++r) {
      const vf pj = vset1(p[r * kKeyTile + j]);
      for (int b = 0; b < W; ++b) acc[r][b] = vfma(pj, vv[b], acc[r][b]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < W; ++b) vstore(o + r * D + d0 + b * VW, acc[r][b]);
}

static_assert(MR <= kMaxTileMR, "scratch_floats assumes at most kMaxTileMR padding rows");

template <int D, typename T>
static void run_item_tiled(const AttnParams& p, const WorkItem& w, float* scratch) {
  constexpr int NV = D / VW;
  constexpr int KT = kKeyTile;
  const int64_t G = p.group, R = w.q_count * G;
  const int64_t Rp = (R + MR - 1) / MR * MR;  // padded rows: masked out, never written back
  float* qb = scratch;        // [Rp, D] scaled queries
  float* acc = qb + Rp * D;   // [Rp, D] unnormalised outputs
  float* st = acc + Rp * D;   // [Rp, KT] scores, then probabilities
  float* kt = st + Rp * KT;   // [D, KT] the key tile, transposed
  float* mx = kt + D * KT;    // [Rp] running max
  float* sm = mx + Rp;        // [Rp] running sum
  float* alpha = sm + Rp;     // [Rp] this tile's rescale of acc
  int64_t* row_end = (int64_t*)(((uintptr_t)(alpha + Rp) + 7) & ~(uintptr_t)7);  // [Rp]
  int64_t* row_begin = row_end + Rp;  // [Rp] first key per row (its sliding window's start)

  const int64_t seq_len = p.seq_lens[w.seq];
  const int64_t q0 = p.query_start_loc[w.seq];
  const int64_t first_pos = seq_len - (p.query_start_loc[w.seq + 1] - q0);
  const vf vscale = vset1(p.scale);
  int64_t key_stop = w.key_begin;
  for (int64_t r = 0; r < Rp; ++r) {
    mx[r] = -INFINITY;
    sm[r] = 0.f;
    for (int v = 0; v < NV; ++v) vstore(acc + r * D + v * VW, vzero());
    if (r >= R) {
      for (int v = 0; v < NV; ++v) vstore(qb + r * D + v * VW, vzero());
      row_end[r] = row_begin[r] = w.key_begin;  // sees no key
      continue;
    }
    const int64_t qi = r / G, g = r - qi * G;
    const int64_t tok = q0 + w.q_begin + qi;
    const float* src = p.query + tok * p.q_stride_tok + (w.kv_head * G + g) * p.q_stride_head;
    for (int v = 0; v < NV; ++v) vstore(qb + r * D + v * VW, vmul(vload(src + v * VW), vscale));
    row_end[r] = min64(first_pos + w.q_begin + qi + 1, w.key_end);
    // From the row's own position (row_end is clipped by a context split's key_end).
    row_begin[r] = p.window > 0 ? max64(w.key_begin, first_pos + w.q_begin + qi + 1 - p.window) : w.key_begin;
    key_stop = max64(key_stop, row_end[r]);
  }

  const int64_t* table = p.block_tables + w.seq * p.bt_stride;
  const T* kbase = static_cast<const T*>(p.kv) + w.kv_head * p.kv_stride_head;
  const T* vbase = kbase + p.kv_stride_kv;
  int64_t offs[KT];
  for (int64_t c0 = w.key_begin; c0 < key_stop; c0 += KT) {
    const int64_t n = min64(KT, key_stop - c0);
    key_offsets(p, table, c0, n, offs);
    for (int64_t j0 = 0; j0 < KT; j0 += 8) {  // keys past n read as zeros
      const T* rows[8];
      for (int i = 0; i < 8; ++i) rows[i] = j0 + i < n ? kbase + offs[j0 + i] : reinterpret_cast<const T*>(kZeroRow);
      for (int d0 = 0; d0 < D; d0 += 8) transpose8x8(rows, d0, kt + d0 * KT + j0, KT);
    }

    // Rows are in query order, so their key limits only grow: skip the leading row tiles that
    // see none of this key tile.
    int64_t r_first = 0;
    for (; r_first < Rp; r_first += MR) {
      int64_t last = 0;
      for (int r = 0; r < MR; ++r) last = max64(last, row_end[r_first + r]);
      if (last > c0) break;
    }
    for (int64_t r0 = r_first; r0 < Rp; r0 += MR) score_rows<D>(qb + r0 * D, kt, st + r0 * KT);

    for (int64_t r = r_first; r < Rp; ++r) {
      float* s = st + r * KT;
      const int64_t nr = min64(n, row_end[r] - c0);
      const int64_t lo = max64(0, row_begin[r] - c0);  // keys before the row's window
      if (nr <= lo) {  // the row sees none of this tile
        for (int j = 0; j < KT; ++j) s[j] = 0.f;
        alpha[r] = 1.f;
        continue;
      }
      if (p.softcap > 0.f)
        for (int64_t j = lo; j < nr; ++j) s[j] = p.softcap * tanhf(s[j] / p.softcap);
      for (int64_t j = 0; j < lo; ++j) s[j] = -INFINITY;
      for (int64_t j = nr; j < KT; ++j) s[j] = -INFINITY;
      vf vmx = vload(s);
      for (int j = VW; j < KT; j += VW) vmx = vmax(vmx, vload(s + j));
      const float tile_max = vreduce_max(vmx);
      const float m_new = tile_max > mx[r] ? tile_max : mx[r];
      const vf vm = vset1(m_new);
      vf tot = vzero();
      for (int j = 0; j < KT; j += VW) {
        const vf e = vexp(vload(s + j), vm);
        vstore(s + j, e);
        tot = vfma(e, vset1(1.f), tot);
      }
      alpha[r] = expf(mx[r] - m_new);  // 0 on the row's first keys (mx = -inf)
      sm[r] = sm[r] * alpha[r] + vreduce_add(tot);
      mx[r] = m_new;
    }
    for (int64_t r0 = r_first; r0 < Rp; r0 += MR) {
      int64_t nb = 0;
      for (int r = 0; r < MR; ++r) nb = max64(nb, min64(n, row_end[r0 + r] - c0));
      int d0 = 0;
      for (; d0 + NB * VW <= D; d0 += NB * VW)
        pv_rows<D, NB, T>(acc + r0 * D, st + r0 * KT, alpha + r0, vbase, offs, nb, d0);
      for (; d0 < D; d0 += VW) pv_rows<D, 1, T>(acc + r0 * D, st + r0 * KT, alpha + r0, vbase, offs, nb, d0);
    }
  }

  store_item_rows<D>(p, w, q0, acc, mx, sm);
}
