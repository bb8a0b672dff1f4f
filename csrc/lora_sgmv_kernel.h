// The register blocks of lora_sgmv.h, written against a small vector interface (vf, vm, VW, vload,
// vload_m, vstore, vstore_m, vmask, vset1, vzero, vfma) that each ISA file defines before including
// it, with GROUP, the panels a block holds (MR rows x GROUP * 16 columns of sums in registers).
//
// Shrink: rows [0, MR) x NP panels of one slot's A over every k, each panel a contiguous K x 16 run.
// Expand: rows [0, MR) x NP panels of y's columns, starting from y and adding r rank-terms; the last
// panel of a part may be partial (`last` masks its final vector on y).
#include <algorithm>

namespace pagedllm {
namespace sgmv {
namespace {

constexpr int VPP = kLanes / VW;  // vectors per panel

// Software prefetch (to L2) of a slot's lines that a row task reads next, `rate` lines per step() from inside
// the loops of the blocks before them: `runs` runs of `used` bytes, `stride` apart, then nothing.
struct Prefetch {
  const char* p = nullptr;
  int64_t used = 0, stride = 0, runs = 0, off = 0, rate = 0;

  Prefetch() = default;
  Prefetch(const float* base, int64_t runs_, int64_t used_floats, int64_t stride_floats)
      : p(reinterpret_cast<const char*>(base)),
        used(used_floats * int64_t{sizeof(float)}),
        stride(stride_floats * int64_t{sizeof(float)}),
        runs(used_floats > 0 ? runs_ : 0) {}
  int64_t lines() const { return runs * ((used + 63) / 64); }
  // Spread the lines over `steps` calls of step().
  void spread(int64_t steps) { rate = steps > 0 ? (lines() + steps - 1) / steps : 0; }
  inline void step() {
    for (int64_t i = 0; i < rate && runs != 0; ++i) {
      _mm_prefetch(p + off, _MM_HINT_T1);
      off += 64;
      if (off >= used) {
        off = 0;
        p += stride;
        --runs;
      }
    }
  }
};

template <int MR, int NP>
inline void shrink_block(const float* __restrict x, int64_t ldx, const float* __restrict a, int64_t k,
                         float* __restrict s, int64_t lds, Prefetch& pf) {
  constexpr int NV = NP * VPP;
  vf acc[MR][NV];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[i][v] = vzero();
  const int64_t panel_stride = k * kLanes;
  for (int64_t kk = 0; kk < k; ++kk) {
    pf.step();
    vf w[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) w[v] = vload(a + (v / VPP) * panel_stride + kk * kLanes + (v % VPP) * VW);
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const vf xi = vset1(x[i * ldx + kk]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = vfma(xi, w[v], acc[i][v]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) vstore(s + i * lds + v * VW, acc[i][v]);
}

// `cols`: y's columns in these NP panels (NP * 16 but for a part's partial last panel).
template <int MR, int NP>
inline void expand_block(const float* __restrict s, int64_t lds, const float* __restrict b, int64_t panel_stride,
                         int64_t r, int64_t cols, float* __restrict y, int64_t ldy) {
  constexpr int NV = NP * VPP;
  const int full = static_cast<int>(std::min<int64_t>(NV, cols / VW));  // whole vectors of y
  const vm last = vmask(static_cast<int>(cols - full * VW));
  vf acc[MR][NV];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      acc[i][v] = v < full ? vload(y + i * ldy + v * VW) : v == full ? vload_m(y + i * ldy + v * VW, last) : vzero();
  for (int64_t j = 0; j < r; ++j) {
    vf w[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) w[v] = vload(b + (v / VPP) * panel_stride + j * kLanes + (v % VPP) * VW);
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const vf si = vset1(s[i * lds + j]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = vfma(si, w[v], acc[i][v]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      if (v < full) {
        vstore(y + i * ldy + v * VW, acc[i][v]);
      } else if (v == full) {
        vstore_m(y + i * ldy + v * VW, acc[i][v], last);
      }
    }
}

// The block for `rows` (1..kMaxRows) x `np` (1..GROUP) panels: a switch over the instantiations.
template <int MR, int NP = 1>
struct Dispatch {
  static void shrink(int np, const float* x, int64_t ldx, const float* a, int64_t k, float* s, int64_t lds,
                     Prefetch& pf) {
    if constexpr (NP < GROUP) {
      if (np > NP) return Dispatch<MR, NP + 1>::shrink(np, x, ldx, a, k, s, lds, pf);
    }
    shrink_block<MR, NP>(x, ldx, a, k, s, lds, pf);
  }
  static void expand(int np, const float* s, int64_t lds, const float* b, int64_t panel_stride, int64_t r,
                     int64_t cols, float* y, int64_t ldy) {
    if constexpr (NP < GROUP) {
      if (np > NP) return Dispatch<MR, NP + 1>::expand(np, s, lds, b, panel_stride, r, cols, y, ldy);
    }
    expand_block<MR, NP>(s, lds, b, panel_stride, r, cols, y, ldy);
  }
};

template <typename F>
inline void by_rows(int64_t rows, const F& f) {
  switch (rows) {
    case 1: f(Dispatch<1>{}); break;
    case 2: f(Dispatch<2>{}); break;
    case 3: f(Dispatch<3>{}); break;
    default: f(Dispatch<4>{}); break;
  }
}
static_assert(kMaxRows == 4, "by_rows covers 1..4 rows");

void shrink_units(const Args& g, int64_t u_begin, int64_t u_end) {
  for (int64_t u = u_begin; u < u_end; ++u) {
    const Segment& seg = g.segments[g.unit_segment[u]];
    const int64_t row = g.unit_row[u], panel = g.unit_panel[u];
    const int64_t rows = std::min<int64_t>(kMaxRows, seg.end - row);
    const int64_t panels = (g.num_parts * g.ranks[seg.slot] + kLanes - 1) / kLanes;
    const int np = static_cast<int>(std::min<int64_t>(GROUP, panels - panel));
    const float* a = g.a + (seg.slot * g.pa + panel) * g.k * kLanes;
    Prefetch none;
    by_rows(rows, [&](auto d) {
      d.shrink(np, g.x + row * g.ldx, g.ldx, a, g.k, g.s + row * g.lds + panel * kLanes, g.lds, none);
    });
  }
}

void expand_blocks(const Args& g, int64_t b_begin, int64_t b_end) {
  const int64_t panel_stride = g.max_rank * kLanes;
  for (int64_t blk = b_begin; blk < b_end; ++blk) {
    const int p = static_cast<int>(g.block_part[blk]);
    const int64_t panel = g.block_panel[blk];  // within part p
    const int64_t part_panels = (g.part_size[p] + kLanes - 1) / kLanes;
    const int np = static_cast<int>(std::min<int64_t>(GROUP, part_panels - panel));
    const int64_t col = g.part_offset[p] + panel * kLanes;
    const int64_t cols = std::min<int64_t>(np * kLanes, g.part_offset[p] + g.part_size[p] - col);
    for (int64_t i = 0; i < g.num_segments; ++i) {
      const Segment& seg = g.segments[i];
      const int64_t r = g.ranks[seg.slot];
      const float* b = g.b + (seg.slot * g.pb + g.part_panel[p] + panel) * panel_stride;
      for (int64_t row = seg.begin; row < seg.end; row += kMaxRows) {
        const int64_t rows = std::min<int64_t>(kMaxRows, seg.end - row);
        by_rows(rows, [&](auto d) {
          d.expand(np, g.s + row * g.lds + p * r, g.lds, b, panel_stride, r, cols, g.y + row * g.ldy + col, g.ldy);
        });
      }
    }
  }
}

// One pass over row tasks (task t: rows [task_begin[t], task_end[t]) of segment task_segment[t]): each task
// shrinks its rows over all its slot's panels, then expands them over every output panel, so tasks need no
// barrier between the passes and the op hands the pool one job, not two. Each block's sums run in the
// order of shrink_units / expand_blocks (same k order, same rank order from y): the same bits.
//
// With g.prefetch, a task's shrink (streaming its slot's A) also prefetches the B rows its expand reads
// next, a line per k-step; and its expand prefetches the next task's A (when that is another slot's),
// spread over the expand's blocks. Only where the data comes from changes, never the sums.
void row_tasks(const Args& g, int64_t t_begin, int64_t t_end) {
  const int64_t panel_stride = g.max_rank * kLanes;
  int64_t out_blocks = 0;  // expand blocks of a task, for spreading the next task's A prefetch
  for (int p = 0; p < g.num_parts; ++p) out_blocks += (g.part_size[p] + GROUP * kLanes - 1) / (GROUP * kLanes);
  for (int64_t t = t_begin; t < t_end; ++t) {
    const Segment& seg = g.segments[g.task_segment[t]];
    const int64_t first = g.task_begin[t], last = g.task_end[t];
    const int64_t r = g.ranks[seg.slot];
    const int64_t panels = (g.num_parts * r + kLanes - 1) / kLanes;
    // This slot's B: the panels of all parts lie side by side, r rows of each read.
    Prefetch pf_b;
    if (g.prefetch) {  // over the k-steps of the first row block of each panel group
      pf_b = Prefetch(g.b + seg.slot * g.pb * panel_stride, g.pb, r * kLanes, panel_stride);
      pf_b.spread((panels + GROUP - 1) / GROUP * g.k);
    }
    for (int64_t panel = 0; panel < panels; panel += GROUP) {
      const int np = static_cast<int>(std::min<int64_t>(GROUP, panels - panel));
      const float* a = g.a + (seg.slot * g.pa + panel) * g.k * kLanes;
      for (int64_t row = first; row < last; row += kMaxRows) {
        by_rows(std::min<int64_t>(kMaxRows, last - row), [&](auto d) {
          d.shrink(np, g.x + row * g.ldx, g.ldx, a, g.k, g.s + row * g.lds + panel * kLanes, g.lds, pf_b);
        });
      }
    }
    Prefetch pf_a;
    if (g.prefetch && t + 1 < t_end) {
      const int64_t next = g.segments[g.task_segment[t + 1]].slot;
      if (next != seg.slot) {
        const int64_t next_panels = (g.num_parts * g.ranks[next] + kLanes - 1) / kLanes;
        pf_a = Prefetch(g.a + next * g.pa * g.k * kLanes, 1, next_panels * g.k * kLanes, 0);
        pf_a.spread(out_blocks);
      }
    }
    for (int p = 0; p < g.num_parts; ++p) {
      const int64_t part_panels = (g.part_size[p] + kLanes - 1) / kLanes;
      for (int64_t panel = 0; panel < part_panels; panel += GROUP) {
        pf_a.step();
        const int np = static_cast<int>(std::min<int64_t>(GROUP, part_panels - panel));
        const int64_t col = g.part_offset[p] + panel * kLanes;
        const int64_t cols = std::min<int64_t>(np * kLanes, g.part_offset[p] + g.part_size[p] - col);
        const float* b = g.b + (seg.slot * g.pb + g.part_panel[p] + panel) * panel_stride;
        for (int64_t row = first; row < last; row += kMaxRows) {
          by_rows(std::min<int64_t>(kMaxRows, last - row), [&](auto d) {
            d.expand(np, g.s + row * g.lds + p * r, g.lds, b, panel_stride, r, cols, g.y + row * g.ldy + col, g.ldy);
          });
        }
      }
    }
  }
}

}  // namespace
}  // namespace sgmv
}  // namespace pagedllm
