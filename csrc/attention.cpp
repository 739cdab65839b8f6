// CPU prefix-window attention: validation, the tile plan, packing, and the
// parallel loop over (batch, head, query tile). The per-tile math is in kf_isa_impl.h.
//
// Tile plan. Every query row sees 1 + S half-open key intervals (interval 0: its
// context part; 1..S: its own window, one per storage stream). They are computed once,
// in Python (WindowLayout.row_intervals(), kforcing_kernels/layouts/intervals.py), and
// passed in as a tensor: this file never re-derives what a row sees. The query tiles
// (which rows are computed together) come from Python too (WindowLayout.cpu_query_tiles,
// layouts/intervals.py: up to CPU_TILE_ROWS = 64 rows, context and window rows never mixed,
// windows of w <= 64 packed whole: k = 4 gives 16 windows per tile) as a row order and tile
// offsets; this file only checks them and sizes its scratch by the largest tile. For each
// slot a tile walks the union of its rows' intervals in chunks of kChunkCols keys, so a
// context K/V chunk is loaded once and applied to every window packed in the tile; rows
// that see no key of a chunk are left out of its products. Windows of w <= 16 do their
// intra-window part row by row (a few dot products) instead of a tile product that would
// be mostly masked.
//
// 64 rows x kChunkCols = 256 keys was the best of {32, 64, 128} x {128, 256, 512}
// on SingleForward, DoubleForward and Jacobi (AVX-512, D = 64), within noise of 128 x 256.

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <numeric>
#include <type_traits>
#include <vector>

#include "kf_kernels.h"
#include "ops.h"

namespace kf {
namespace {

constexpr int64_t kChunkCols = 256;

struct Geometry {
  int64_t n_ctx, M, w, last, S, s;  // s: slots per stream
  bool queries_all;
  int64_t n_win, Lk, Lq, qoff;

};

// n_rows: the query rows of this call, -1 for all of the layout's; a row subset (QueryRowsLayout,
// layouts/query_rows.py) passes its row count with its own intervals and tiles, the geometry staying its
// parent's: the kernels read only the intervals and the tiles, the geometry sizes the keys.
Geometry check_geometry(int64_t n_ctx, int64_t M, int64_t w, int64_t last, int64_t S, bool queries_all,
                        int64_t n_rows) {
  TORCH_CHECK_VALUE(n_ctx >= 0, "n_ctx: expected >= 0, got ", n_ctx);
  TORCH_CHECK_VALUE(M >= 0, "num_windows: expected >= 0, got ", M);
  TORCH_CHECK_VALUE(w >= 1, "window_size: expected >= 1, got ", w);
  TORCH_CHECK_VALUE(last >= 1 && last <= w, "last_window_size: expected a value in [1, ", w, "], got ", last);
  TORCH_CHECK_VALUE(S >= 1 && w % S == 0, "n_streams: expected a divisor of window_size=", w, ", got ", S);
  TORCH_CHECK_VALUE(S == 1 || M == 0 || last == w, "last_window_size: stream-major storage (n_streams=", S,
                    ") needs equal windows, got ", last, " != ", w);
  TORCH_CHECK_VALUE(n_ctx + M > 0, "n_ctx: a layout needs at least one token (n_ctx=0 and num_windows=0)");
  TORCH_CHECK_VALUE(queries_all || M > 0, "num_windows: queries='windows' needs at least one window, got 0");
  Geometry g{n_ctx, M, w, M ? last : w, S, w / S, queries_all, 0, 0, 0, 0};
  g.n_win = M ? (M - 1) * w + g.last : 0;
  g.Lk = n_ctx + g.n_win;
  g.Lq = queries_all ? g.Lk : g.n_win;
  g.qoff = queries_all ? 0 : n_ctx;
  TORCH_CHECK_VALUE(n_rows == -1 || (n_rows >= 1 && n_rows <= g.Lq), "n_rows: expected -1 (every query row) or a "
                    "row count in [1, ", g.Lq, "] (the layout's queries), got ", n_rows);
  if (n_rows != -1) g.Lq = n_rows;
  TORCH_CHECK_VALUE(g.Lk < (int64_t(1) << 31), "k: expected fewer than 2^31 keys, got ", g.Lk);
  return g;
}

// The row intervals: int32 [B', Lq, 1 + S, 2] with B' = 1 (shared) or the batch,
// each interval half-open inside [0, Lk).
at::Tensor check_intervals(const at::Tensor& iv, const Geometry& g, int64_t batch) {
  TORCH_CHECK_VALUE(iv.scalar_type() == at::kInt, "row_intervals: expected dtype int32, got ", iv.scalar_type());
  TORCH_CHECK_VALUE(iv.device().is_cpu(), "row_intervals: expected a CPU tensor, got device ", iv.device());
  TORCH_CHECK_VALUE(iv.dim() == 4 && (iv.size(0) == 1 || iv.size(0) == batch) && iv.size(1) == g.Lq &&
                        iv.size(2) == 1 + g.S && iv.size(3) == 2,
                    "row_intervals: expected shape [1 or ", batch, ", ", g.Lq, ", ", 1 + g.S, ", 2], got ", iv.sizes());
  at::Tensor c = iv.contiguous();
  const int32_t* p = c.data_ptr<int32_t>();
  for (int64_t i = 0; i < c.numel(); i += 2) {
    TORCH_CHECK_VALUE(p[i] >= 0 && p[i] <= p[i + 1] && p[i + 1] <= g.Lk, "row_intervals: expected 0 <= lo <= hi <= ",
                      g.Lk, ", got [", p[i], ", ", p[i + 1], ") at flat index ", i / 2);
  }
  return c;
}

void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Geometry& g, double scale) {
  for (auto [name, t] : {std::pair<const char*, const at::Tensor&>{"q", q}, {"k", k}, {"v", v}}) {
    TORCH_CHECK_VALUE(t.device().is_cpu(), name, ": expected a CPU tensor, got device ", t.device());
    TORCH_CHECK_VALUE(t.dim() == 4, name, ": expected rank 4 [B, H, L, D], got shape ", t.sizes());
    const auto dt = t.scalar_type();
    TORCH_CHECK_VALUE(dt == at::kFloat || dt == at::kDouble || dt == at::kBFloat16 || dt == at::kHalf, name,
                      ": expected dtype float32, bfloat16, float16 or float64, got ", dt);
  }
  TORCH_CHECK_VALUE(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "k, v: expected dtype ",
                    q.scalar_type(), " (q's), got k ", k.scalar_type(), ", v ", v.scalar_type());
  TORCH_CHECK_VALUE(k.sizes() == v.sizes(), "v: expected the shape of k ", k.sizes(), ", got ", v.sizes());
  TORCH_CHECK_VALUE(k.size(0) == q.size(0), "k: expected batch ", q.size(0), " (q's), got ", k.size(0));
  TORCH_CHECK_VALUE(k.size(3) == q.size(3), "k: expected head dim ", q.size(3), " (q's), got ", k.size(3));
  TORCH_CHECK_VALUE(q.size(3) >= 1, "q: expected head dim >= 1, got ", q.size(3));
  TORCH_CHECK_VALUE(k.size(1) >= 1 && q.size(1) % k.size(1) == 0,
                    "q: expected a head count that is a multiple of k's ", k.size(1), " (GQA), got ", q.size(1));
  TORCH_CHECK_VALUE(q.size(2) == g.Lq, "q: expected length ", g.Lq, " (the layout's queries), got ", q.size(2));
  TORCH_CHECK_VALUE(k.size(2) == g.Lk, "k: expected length ", g.Lk, " (the layout's keys), got ", k.size(2));
  TORCH_CHECK_VALUE(std::isfinite(scale) && scale > 0, "scale: expected a positive finite number, got ", scale);
}

struct Plan {
  int64_t Bp = 1, n_slots = 2, first_direct = 2, kt_cols = 0, tile_rows = 1;
  std::vector<int32_t> intervals;   // [Bp, Lq, n_slots, 2]
  std::vector<int32_t> row_order;   // tile order -> query row
  std::vector<int32_t> tile_begin;  // [n_tiles + 1]
  std::vector<double> tile_cost;    // [Bp, n_tiles]: visible pairs of each batch element, plus a per-row overhead
  int64_t n_tiles() const { return (int64_t)tile_begin.size() - 1; }
  const double* cost(int64_t b) const { return tile_cost.data() + (Bp > 1 ? b : 0) * n_tiles(); }
  // Tiles in decreasing cost of batch element b (b's own intervals only: see backward_impl).
  std::vector<int32_t> tiles_by_cost(int64_t b) const {
    std::vector<int32_t> order(n_tiles());
    std::iota(order.begin(), order.end(), 0);
    const double* c = cost(b);
    std::stable_sort(order.begin(), order.end(), [&](int32_t x, int32_t y) { return c[x] > c[y]; });
    return order;
  }
};

// The query tiles: row_order int32 [Lq], a permutation of the query rows (tile order ->
// row), and tile_begin int32 [T + 1], increasing from 0 to Lq (tile t holds rows
// row_order[tile_begin[t] .. tile_begin[t + 1])). Any grouping is correct; the layout's
// (WindowLayout.cpu_query_tiles) is the fast one.
void check_tiles(const at::Tensor& order, const at::Tensor& begin, const Geometry& g, Plan& p) {
  for (auto [name, t] : {std::pair<const char*, const at::Tensor&>{"row_order", order}, {"tile_begin", begin}}) {
    TORCH_CHECK_VALUE(t.scalar_type() == at::kInt, name, ": expected dtype int32, got ", t.scalar_type());
    TORCH_CHECK_VALUE(t.device().is_cpu(), name, ": expected a CPU tensor, got device ", t.device());
    TORCH_CHECK_VALUE(t.dim() == 1, name, ": expected rank 1, got shape ", t.sizes());
  }
  TORCH_CHECK_VALUE(order.size(0) == g.Lq, "row_order: expected length ", g.Lq, " (the layout's queries), got ",
                    order.size(0));
  TORCH_CHECK_VALUE(begin.size(0) >= 2, "tile_begin: expected at least 2 offsets (one tile), got ", begin.size(0));
  const at::Tensor oc = order.contiguous(), bc = begin.contiguous();
  p.row_order.assign(oc.data_ptr<int32_t>(), oc.data_ptr<int32_t>() + oc.numel());
  p.tile_begin.assign(bc.data_ptr<int32_t>(), bc.data_ptr<int32_t>() + bc.numel());
  std::vector<char> seen(g.Lq, 0);
  for (int64_t i = 0; i < g.Lq; ++i) {
    const int32_t r = p.row_order[i];
    TORCH_CHECK_VALUE(r >= 0 && r < g.Lq, "row_order: expected rows in [0, ", g.Lq, "), got ", r, " at index ", i);
    TORCH_CHECK_VALUE(!seen[r], "row_order: expected each row once (a permutation), got row ", r, " again at index ", i);
    seen[r] = 1;
  }
  TORCH_CHECK_VALUE(p.tile_begin.front() == 0 && p.tile_begin.back() == g.Lq, "tile_begin: expected offsets from 0 to ",
                    g.Lq, ", got ", p.tile_begin.front(), " .. ", p.tile_begin.back());
  for (int64_t t = 0; t < p.n_tiles(); ++t) {
    const int64_t n = (int64_t)p.tile_begin[t + 1] - p.tile_begin[t];
    TORCH_CHECK_VALUE(n >= 1, "tile_begin: expected increasing offsets (non-empty tiles), got ", p.tile_begin[t],
                      " then ", p.tile_begin[t + 1], " at index ", t);
    p.tile_rows = std::max(p.tile_rows, n);
  }
}

Plan make_plan(const Geometry& g, const at::Tensor& iv, const at::Tensor& row_order, const at::Tensor& tile_begin) {
  Plan p;
  p.Bp = iv.size(0);
  p.n_slots = 1 + g.S;
  p.first_direct = (g.M > 0 && g.w <= kDirectWindowMax) ? 1 : p.n_slots;
  p.kt_cols = p.first_direct == 1 ? g.n_ctx : g.Lk;
  p.intervals.assign(iv.data_ptr<int32_t>(), iv.data_ptr<int32_t>() + iv.numel());
  check_tiles(row_order, tile_begin, g, p);
  p.tile_cost.assign(p.Bp * p.n_tiles(), 0.0);
  for (int64_t b = 0; b < p.Bp; ++b) {
    const int32_t* iv = p.intervals.data() + b * g.Lq * p.n_slots * 2;
    for (int64_t t = 0; t < p.n_tiles(); ++t) {
      double cost = 0;
      for (int32_t r = p.tile_begin[t]; r < p.tile_begin[t + 1]; ++r) {
        const int32_t* row = iv + p.row_order[r] * p.n_slots * 2;
        for (int64_t j = 0; j < p.n_slots; ++j) cost += row[2 * j + 1] - row[2 * j] + 16.0;
      }
      p.tile_cost[b * p.n_tiles() + t] = cost;
    }
  }
  return p;
}

// Runs f(item, scratch) for item in [0, n_items) on torch's intra-op threads
// (OpenMP), handing out items dynamically: tiles differ in cost.
template <typename T, typename F>
void run_items(int64_t n_items, int64_t scratch_elems, const F& f) {
  if (n_items == 0) return;
  std::atomic<int64_t> next{0};
  const int64_t n_threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_items));
  at::parallel_for(0, n_threads, 1, [&](int64_t, int64_t) {
    std::vector<T> scratch(scratch_elems);
    for (int64_t item; (item = next.fetch_add(1, std::memory_order_relaxed)) < n_items;) f(item, scratch.data());
  });
}

at::ScalarType math_type(at::ScalarType dt) { return dt == at::kDouble ? at::kDouble : at::kFloat; }

int64_t round16(int64_t x) { return (x + 15) / 16 * 16; }

// Row-major [B, Hkv, Lk, Dp] in the math dtype (the input itself when it already is).
at::Tensor rows_packed(const at::Tensor& x, at::ScalarType mt, int64_t Dp) {
  if (x.scalar_type() == mt && x.size(3) == Dp) return x.contiguous();
  at::Tensor r = at::zeros({x.size(0), x.size(1), x.size(2), Dp}, x.options().dtype(mt));
  r.narrow(3, 0, x.size(3)).copy_(x);
  return r;
}

// Transposed [B, Hkv, Dp, ld] of keys [0, cols), zero padded; ld leaves room for a
// chunk's last vector and breaks 4 KiB aliasing between the rows of D.
at::Tensor transposed_packed(const at::Tensor& x, at::ScalarType mt, int64_t Dp, int64_t cols, int64_t& ld) {
  ld = round16(cols) + 16;
  at::Tensor t = at::zeros({x.size(0), x.size(1), Dp, ld}, x.options().dtype(mt));
  if (cols > 0) t.narrow(2, 0, x.size(3)).narrow(3, 0, cols).copy_(x.narrow(2, 0, cols).transpose(2, 3));
  return t;
}

template <typename T>
auto forward_kernel() {
  if constexpr (std::is_same<T, float>::value) return active_kernels().forward_f;
  else return active_kernels().forward_d;
}

template <typename T>
auto backward_kernel() {
  if constexpr (std::is_same<T, float>::value) return active_kernels().backward_f;
  else return active_kernels().backward_d;
}

template <typename T>
AttnArgs<T> base_args(const at::Tensor& q, const at::Tensor& k, const Plan& p, double scale) {
  AttnArgs<T> a{};
  a.B = q.size(0);
  a.H = q.size(1);
  a.Hkv = k.size(1);
  a.Lq = q.size(2);
  a.Lk = k.size(2);
  a.D = q.size(3);
  a.Dp = round16(a.D);
  a.scale = (T)scale;
  a.tile_rows = p.tile_rows;
  a.chunk_cols = kChunkCols;
  a.row_order = p.row_order.data();
  a.tile_begin = p.tile_begin.data();
  a.intervals = p.intervals.data();
  a.iv_batch = p.Bp > 1 ? a.Lq * p.n_slots * 2 : 0;
  a.n_slots = p.n_slots;
  a.first_direct = p.first_direct;
  return a;
}

template <typename T>
std::tuple<at::Tensor, at::Tensor> forward_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                const Plan& p, const Geometry& g, double scale) {
  const at::ScalarType mt = math_type(q.scalar_type());
  AttnArgs<T> a = base_args<T>(q, k, p, scale);
  a.window_granule = g.s;
  a.window_origin = g.n_ctx;
  const at::Tensor qf = q.to(mt).contiguous();
  const at::Tensor kt = transposed_packed(k, mt, a.Dp, p.kt_cols, a.kt_ld);
  const at::Tensor kr = rows_packed(k, mt, a.Dp), vr = rows_packed(v, mt, a.Dp);
  at::Tensor out = at::empty(q.sizes(), q.options().dtype(mt));
  at::Tensor lse = at::empty({a.B, a.H, a.Lq}, q.options().dtype(mt));
  a.q = qf.data_ptr<T>();
  a.kt = kt.data_ptr<T>();
  a.kr = kr.data_ptr<T>();
  a.kr_ld = kr.size(3);
  a.vr = vr.data_ptr<T>();
  a.vr_ld = vr.size(3);
  a.out = out.data_ptr<T>();
  a.lse = lse.data_ptr<T>();

  // Costliest tiles first (batch element 0's costs, over all heads), so the dynamic schedule ends
  // evenly. Only the schedule depends on it: each item writes its own rows.
  const std::vector<int32_t> order = p.tiles_by_cost(0);
  const int64_t BH = a.B * a.H;
  const auto kernel = forward_kernel<T>();
  run_items<T>(p.n_tiles() * BH, attention_scratch_elems(p.tile_rows, kChunkCols, a.Dp, false),
               [&](int64_t item, T* scratch) {
                 const int64_t bh = item % BH;
                 kernel(a, bh / a.H, bh % a.H, order[item / BH], scratch);
               });
  return {out.scalar_type() == q.scalar_type() ? out : out.to(q.scalar_type()), lse};
}

template <typename T>
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_impl(const at::Tensor& dout, const at::Tensor& q,
                                                             const at::Tensor& k, const at::Tensor& v,
                                                             const at::Tensor& out, const at::Tensor& lse,
                                                             const Plan& p, const Geometry& g, double scale) {
  const at::ScalarType mt = math_type(q.scalar_type());
  AttnArgs<T> a = base_args<T>(q, k, p, scale);
  a.window_granule = g.s;
  a.window_origin = g.n_ctx;
  const at::Tensor qf = q.to(mt).contiguous(), df = dout.to(mt).contiguous(), of = out.to(mt).contiguous();
  const at::Tensor lf = lse.to(mt).contiguous();
  int64_t ld = 0;
  const at::Tensor kt = transposed_packed(k, mt, a.Dp, p.kt_cols, a.kt_ld);
  const at::Tensor vt = transposed_packed(v, mt, a.Dp, p.kt_cols, ld);
  const at::Tensor kr = rows_packed(k, mt, a.Dp), vr = rows_packed(v, mt, a.Dp);
  at::Tensor dq = at::empty(q.sizes(), q.options().dtype(mt));
  a.q = qf.data_ptr<T>();
  a.dout = df.data_ptr<T>();
  a.out_in = of.data_ptr<T>();
  a.lse_in = lf.data_ptr<T>();
  a.kt = kt.data_ptr<T>();
  a.vt = vt.data_ptr<T>();
  a.kr = kr.data_ptr<T>();
  a.kr_ld = kr.size(3);
  a.vr = vr.data_ptr<T>();
  a.vr_ld = vr.size(3);
  a.dq = dq.data_ptr<T>();

  // One work item per (batch, head), its tiles in cost order. Splitting a head's tiles
  // over several dK/dV buffers would keep more threads busy when B * H is small, but the
  // final sum over buffers would then depend on the thread count and on the batch size;
  // we promise bitwise-identical results for any thread count and batch composition.
  // The tiles add into dK/dV in this order, so it must come from the element's own intervals
  // (per-batch ranges: its own costs), never from another element's: an element alone and
  // inside any batch then sums the same terms in the same order.
  const int64_t BH = a.B * a.H, group = a.H / a.Hkv;
  std::vector<std::vector<int32_t>> tiles(p.Bp);
  for (int64_t b = 0; b < p.Bp; ++b) tiles[b] = p.tiles_by_cost(b);
  const bool in_place = group == 1 && a.Dp == a.D && k.scalar_type() == mt;
  at::Tensor dk_acc, dv_acc;
  if (in_place) {
    dk_acc = at::zeros(k.sizes(), k.options());
    dv_acc = at::zeros(v.sizes(), v.options());
  } else {
    dk_acc = at::zeros({a.B, a.H, a.Lk, a.Dp}, q.options().dtype(mt));
    dv_acc = at::zeros_like(dk_acc);
  }
  T* dk_base = dk_acc.data_ptr<T>();
  T* dv_base = dv_acc.data_ptr<T>();
  const auto kernel = backward_kernel<T>();
  run_items<T>(BH, attention_scratch_elems(p.tile_rows, kChunkCols, a.Dp, true), [&](int64_t bh, T* scratch) {
    const int64_t offset = bh * a.Lk * a.Dp;
    const std::vector<int32_t>& t = tiles[p.Bp > 1 ? bh / a.H : 0];
    kernel(a, bh / a.H, bh % a.H, t.data(), (int64_t)t.size(), dk_base + offset, dv_base + offset, scratch);
  });
  at::Tensor dk = dk_acc, dv = dv_acc;
  if (!in_place) {  // GQA: the group's query heads summed in a fixed order
    dk = dk_acc.view({a.B, a.Hkv, group, a.Lk, a.Dp}).sum(2).narrow(3, 0, a.D).to(k.scalar_type()).contiguous();
    dv = dv_acc.view({a.B, a.Hkv, group, a.Lk, a.Dp}).sum(2).narrow(3, 0, a.D).to(v.scalar_type()).contiguous();
  }
  return {dq.scalar_type() == q.scalar_type() ? dq : dq.to(q.scalar_type()), dk, dv};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     const at::Tensor& row_intervals, const at::Tensor& row_order,
                                                     const at::Tensor& tile_begin, int64_t n_ctx,
                                                     int64_t num_windows, int64_t window_size,
                                                     int64_t last_window_size, int64_t n_streams, bool queries_all,
                                                     double scale, int64_t n_rows) {
  const Geometry g = check_geometry(n_ctx, num_windows, window_size, last_window_size, n_streams, queries_all, n_rows);
  check_qkv(q, k, v, g, scale);
  const Plan p = make_plan(g, check_intervals(row_intervals, g, q.size(0)), row_order, tile_begin);
  if (q.scalar_type() == at::kDouble) return forward_impl<double>(q, k, v, p, g, scale);
  return forward_impl<float>(q, k, v, p, g, scale);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& row_intervals, const at::Tensor& row_order, const at::Tensor& tile_begin,
    int64_t n_ctx, int64_t num_windows, int64_t window_size,
    int64_t last_window_size, int64_t n_streams, bool queries_all, double scale, int64_t n_rows) {
  const Geometry g = check_geometry(n_ctx, num_windows, window_size, last_window_size, n_streams, queries_all, n_rows);
  check_qkv(q, k, v, g, scale);
  for (auto [name, t] : {std::pair<const char*, const at::Tensor&>{"dout", dout}, {"out", out}}) {
    TORCH_CHECK_VALUE(t.device().is_cpu(), name, ": expected a CPU tensor, got device ", t.device());
    TORCH_CHECK_VALUE(t.sizes() == q.sizes(), name, ": expected shape ", q.sizes(), " (q's), got ", t.sizes());
    TORCH_CHECK_VALUE(t.scalar_type() == q.scalar_type(), name, ": expected dtype ", q.scalar_type(), " (q's), got ",
                      t.scalar_type());
  }
  TORCH_CHECK_VALUE(lse.device().is_cpu(), "lse: expected a CPU tensor, got device ", lse.device());
  TORCH_CHECK_VALUE(lse.sizes() == q.sizes().slice(0, 3), "lse: expected shape ", q.sizes().slice(0, 3),
                    " ([B, H, Lq]), got ", lse.sizes());
  TORCH_CHECK_VALUE(at::isFloatingType(lse.scalar_type()), "lse: expected a floating dtype, got ", lse.scalar_type());
  const Plan p = make_plan(g, check_intervals(row_intervals, g, q.size(0)), row_order, tile_begin);
  if (q.scalar_type() == at::kDouble) return backward_impl<double>(dout, q, k, v, out, lse, p, g, scale);
  return backward_impl<float>(dout, q, k, v, out, lse, p, g, scale);
}

}  // namespace kf
