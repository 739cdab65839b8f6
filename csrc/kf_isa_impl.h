// Hot loops of the C++ extension, written once with GCC/Clang vector extensions
// and compiled per instruction set: isa_<name>.cpp defines KF_NS (namespace),
// KF_VL (float lanes of a native register), KF_RB x KF_NV (register block of the
// GEMM micro-kernel: rows x vectors), switches the target on, and includes this.
// Everything here has internal linkage, so the copies never clash.
//
// Attention (per query tile, see attention.cpp for the plan): scores of a row
// block against a chunk of context/window keys come from one register-blocked
// GEMM against K^T, an online softmax in the log2 domain turns them into P, and a
// second GEMM adds P.V; small windows (w <= kDirectWindowMax) do their few
// intra-window keys row by row instead of through a mostly masked tile. The backward recomputes P per
// chunk and does the five products of FlashAttention-2 with the same micro-kernel.
//
// Masked keys. A row never combines with a key outside its intervals, also when K or V
// holds NaN/inf there: the scores are selected (never multiplied) to -inf and P to 0,
// but a tile product would still form 0 * inf = NaN in P.V (forward), dS (dO.V at a
// masked key) and dS.K (dQ). A chunk every row of the product sees whole takes the plain
// products (any non-finite value there is seen by all of them). A chunk with masked keys
// for some row first checks those keys' K/V rows (a read of ncols x Dp values, next to
// the 2 x rows x ncols x Dp of the products); only when one is non-finite does it sum
// P.V (forward: V) or dS.K (backward: K) per row over the row's visible columns only (the
// same terms in the same order, so a row that sees only finite keys gets the same bits as
// with finite masked keys). In the backward such a chunk also selects dS to 0 at masked
// keys (one blend per value): dO.v there may be inf, and a poisoned row's own delta or LSE
// may be NaN, which P (dp - delta) with P = 0 would spread to the keys it does not see.
//
// Sampler: one pass over each row computes per-block (max, sum of exp) in float64;
// the cumulative sum is then walked over block totals, and only the block that
// holds the answer is revisited element by element.

#include "kf_kernels.h"

namespace kf {
namespace KF_NS {
namespace {

constexpr int kVecBytes = KF_VL * 4;
constexpr int kRB = KF_RB;  // micro-kernel rows
constexpr int kNV = KF_NV;  // micro-kernel vectors per row
constexpr double kLog2e = 1.4426950408889634;
constexpr double kLn2 = 0.6931471805599453;

template <typename T> struct Vec;
template <> struct Vec<float> {
  typedef float type __attribute__((vector_size(kVecBytes)));
  typedef int32_t itype __attribute__((vector_size(kVecBytes)));
  static constexpr int lanes = kVecBytes / 4;
};
template <> struct Vec<double> {
  typedef double type __attribute__((vector_size(kVecBytes)));
  typedef int64_t itype __attribute__((vector_size(kVecBytes)));
  static constexpr int lanes = kVecBytes / 8;
};
template <typename T> using vec = typename Vec<T>::type;
template <typename T> using ivec = typename Vec<T>::itype;
template <typename T> using ielem = typename std::conditional<sizeof(T) == 4, int32_t, int64_t>::type;

template <typename T> inline vec<T> vload(const T* p) { vec<T> r; std::memcpy(&r, p, sizeof r); return r; }
template <typename T> inline void vstore(T* p, vec<T> x) { std::memcpy(p, &x, sizeof x); }
template <typename T> inline vec<T> vsplat(T x) { return vec<T>{} + x; }
template <typename T> inline vec<T> vmax(vec<T> a, vec<T> b) { return a > b ? a : b; }
template <typename T> inline T hsum(vec<T> x) {
  T s = 0;
  for (int i = 0; i < Vec<T>::lanes; ++i) s += x[i];
  return s;
}
template <typename T> inline T hmax(vec<T> x) {
  T m = x[0];
  for (int i = 1; i < Vec<T>::lanes; ++i) m = x[i] > m ? x[i] : m;
  return m;
}
template <typename T> inline ivec<T> iota() {
  ivec<T> r;
  for (int i = 0; i < Vec<T>::lanes; ++i) r[i] = i;
  return r;
}
inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// ---------------------------------------------------------------- exp

// 2^x for float lanes, ~1e-7 relative; 0 below -126 (and for -inf).
inline vec<float> vexp2(vec<float> x) {
  using V = vec<float>;
  using I = ivec<float>;
  const V magic = vsplat(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer
  V xc = x < -126.f ? vsplat(-126.f) : x;
  xc = xc > 127.f ? vsplat(127.f) : xc;
  V t = xc + magic;
  V f = xc - (t - magic);  // in [-0.5, 0.5]
  V p = vsplat(1.5403530393381606e-4f);
  p = p * f + 1.3333558146428441e-3f;
  p = p * f + 9.618129107628477e-3f;
  p = p * f + 5.5504108664821576e-2f;
  p = p * f + 0.2402265069591007f;
  p = p * f + 0.6931471805599453f;
  p = p * f + 1.f;
  I e = ((I)t - (I)magic) << 23;
  V r = (V)((I)p + e);
  return x < -126.f ? V{} : r;
}

// e^r for |r| <= 0.35 (Taylor to degree 13: below double rounding).
inline vec<double> exp_poly(vec<double> r) {
  vec<double> p = vsplat(1.6059043836821613e-10);
  p = p * r + 2.08767569878681e-09;
  p = p * r + 2.505210838544172e-08;
  p = p * r + 2.755731922398589e-07;
  p = p * r + 2.7557319223985893e-06;
  p = p * r + 2.48015873015873e-05;
  p = p * r + 1.984126984126984e-04;
  p = p * r + 1.388888888888889e-03;
  p = p * r + 8.333333333333333e-03;
  p = p * r + 4.1666666666666664e-02;
  p = p * r + 0.16666666666666666;
  p = p * r + 0.5;
  p = p * r + 1.0;
  p = p * r + 1.0;
  return p;
}

// p * 2^n for integral n in [-1076, 1023] (two factors keep subnormal results exact).
inline vec<double> scale_pow2(vec<double> p, vec<double> n_rounded_plus_magic, vec<double> magic) {
  using I = ivec<double>;
  I n = (I)n_rounded_plus_magic - (I)magic;
  I n1 = n >> 1;
  I n2 = n - n1;
  vec<double> s1 = (vec<double>)((n1 + 1023) << 52);
  vec<double> s2 = (vec<double>)((n2 + 1023) << 52);
  return p * s1 * s2;
}

// e^x for double lanes (~1 ulp), exact 0 for -inf, NaN for NaN.
inline vec<double> vexp(vec<double> x) {
  using V = vec<double>;
  const V magic = vsplat(6755399441055744.0);  // 1.5 * 2^52
  V xc = x < -746.0 ? vsplat(-746.0) : x;
  xc = xc > 709.0 ? vsplat(709.0) : xc;
  V t = xc * kLog2e + magic;
  V n = t - magic;
  V r = (xc - n * 0.693147180369123816490) - n * 1.90821492927058770002e-10;  // Cody-Waite ln2
  V e = scale_pow2(exp_poly(r), t, magic);
  return x < -745.2 ? V{} : e;
}

// 2^x for double lanes.
inline vec<double> vexp2(vec<double> x) {
  using V = vec<double>;
  const V magic = vsplat(6755399441055744.0);
  V xc = x < -1075.0 ? vsplat(-1075.0) : x;
  xc = xc > 1023.0 ? vsplat(1023.0) : xc;
  V t = xc + magic;
  V f = xc - (t - magic);
  V e = scale_pow2(exp_poly(f * kLn2), t, magic);
  return x < -1075.0 ? V{} : e;
}

template <typename T> inline T exp2_scalar(T x) { return std::exp2(x); }

// ---------------------------------------------------------------- GEMM micro-kernel

// C[i, 0:NV*lanes] (+)= sum_k A[i*a_rs + k*a_cs] * B[k*ldb + 0:NV*lanes], i < R.
template <typename T, int R, int NV>
void gemm_block(int64_t K, const T* A, int64_t a_rs, int64_t a_cs, const T* Bm, int64_t ldb, T* C, int64_t ldc,
                bool accumulate) {
  using V = vec<T>;
  constexpr int L = Vec<T>::lanes;
  V acc[R][NV];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = accumulate ? vload(C + i * ldc + j * L) : V{};
  for (int64_t k = 0; k < K; ++k) {
    const T* b = Bm + k * ldb;
    const T* a = A + k * a_cs;
    V bv[NV];
    for (int j = 0; j < NV; ++j) bv[j] = vload(b + j * L);
    for (int i = 0; i < R; ++i) {
      V ai = vsplat(a[i * a_rs]);
      for (int j = 0; j < NV; ++j) acc[i][j] += ai * bv[j];
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < NV; ++j) vstore(C + i * ldc + j * L, acc[i][j]);
}

template <typename T, int R, int NV = kNV>
inline void gemm_block_nv(int nv, int64_t K, const T* A, int64_t a_rs, int64_t a_cs, const T* B, int64_t ldb, T* C,
                          int64_t ldc, bool accumulate) {
  if constexpr (NV >= 1) {
    if (nv == NV) return gemm_block<T, R, NV>(K, A, a_rs, a_cs, B, ldb, C, ldc, accumulate);
    return gemm_block_nv<T, R, NV - 1>(nv, K, A, a_rs, a_cs, B, ldb, C, ldc, accumulate);
  }
}

template <typename T, int R = kRB>
inline void gemm_block_rows(int rows, int nv, int64_t K, const T* A, int64_t a_rs, int64_t a_cs, const T* B,
                            int64_t ldb, T* C, int64_t ldc, bool accumulate) {
  if constexpr (R >= 1) {
    if (rows == R) return gemm_block_nv<T, R>(nv, K, A, a_rs, a_cs, B, ldb, C, ldc, accumulate);
    return gemm_block_rows<T, R - 1>(rows, nv, K, A, a_rs, a_cs, B, ldb, C, ldc, accumulate);
  }
}

// C[M x N] (+)= A[M x K] B[K x N], A strided (a_rs, a_cs), B and C row-major; N % lanes == 0.
// Column panels outside, row blocks inside, so a K x panel slice of B stays in L1.
template <typename T>
void gemm(int64_t M, int64_t N, int64_t K, const T* A, int64_t a_rs, int64_t a_cs, const T* B, int64_t ldb, T* C,
          int64_t ldc, bool accumulate) {
  constexpr int L = Vec<T>::lanes;
  for (int64_t n0 = 0; n0 < N; n0 += kNV * L) {
    const int nv = (int)std::min<int64_t>(kNV, (N - n0) / L);
    for (int64_t i0 = 0; i0 < M; i0 += kRB) {
      const int rows = (int)std::min<int64_t>(kRB, M - i0);
      gemm_block_rows<T>(rows, nv, K, A + i0 * a_rs, a_rs, a_cs, B + n0, ldb, C + i0 * ldc + n0, ldc, accumulate);
    }
  }
}

template <typename T> inline T dot(const T* a, const T* b, int64_t n) {
  constexpr int L = Vec<T>::lanes;
  vec<T> s0{}, s1{};
  int64_t i = 0;
  for (; i + 2 * L <= n; i += 2 * L) {
    s0 += vload(a + i) * vload(b + i);
    s1 += vload(a + i + L) * vload(b + i + L);
  }
  for (; i < n; i += L) s0 += vload(a + i) * vload(b + i);
  return hsum<T>(s0 + s1);
}

template <typename T> inline void axpy(T alpha, const T* x, T* y, int64_t n) {  // y += alpha x
  constexpr int L = Vec<T>::lanes;
  const vec<T> a = vsplat(alpha);
  for (int64_t i = 0; i < n; i += L) vstore(y + i, vload(y + i) + a * vload(x + i));
}

template <typename T> inline void scale_row(T alpha, T* y, int64_t n) {
  constexpr int L = Vec<T>::lanes;
  const vec<T> a = vsplat(alpha);
  for (int64_t i = 0; i < n; i += L) vstore(y + i, vload(y + i) * a);
}

// Whether rows [r0, r1) of x (row stride ld, n % lanes == 0 values each) hold a NaN or inf:
// x * 0 is 0 for finite x and NaN otherwise (no -ffast-math here, so it is not folded).
template <typename T> inline bool any_nonfinite(const T* x, int64_t ld, int64_t r0, int64_t r1, int64_t n) {
  constexpr int L = Vec<T>::lanes;
  vec<T> acc{};
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t i = 0; i < n; i += L) acc += vload(x + r * ld + i) * T(0);
  return !(hsum<T>(acc) == T(0));
}

// ---------------------------------------------------------------- attention rows

// One row of a chunk: s holds raw scores q.k for npad columns, of which [va, vb) are
// visible. Folds them into the running (m, l, o) of the row (log2 domain, c = scale *
// log2 e) and leaves the unnormalised probabilities in s (0 where not visible).
template <typename T>
void softmax_row(T* s, int64_t npad, int64_t va, int64_t vb, T c, T& m, T& l, T* o, int64_t Dp) {
  using V = vec<T>;
  constexpr int L = Vec<T>::lanes;
  const T neg_inf = -std::numeric_limits<T>::infinity();
  if (va >= vb) {
    std::memset(s, 0, sizeof(T) * npad);
    return;
  }
  V vm = vsplat(neg_inf);
  if (va == 0 && vb == npad) {
    for (int64_t j = 0; j < npad; j += L) {
      V x = vload(s + j) * c;
      vstore(s + j, x);
      vm = vmax<T>(vm, x);
    }
  } else {
    const ivec<T> lane = iota<T>();
    const ielem<T> lo = (ielem<T>)va, hi = (ielem<T>)vb;
    for (int64_t j = 0; j < npad; j += L) {
      const ivec<T> idx = lane + (ielem<T>)j;
      V x = vload(s + j) * c;
      x = (idx >= lo) & (idx < hi) ? x : vsplat(neg_inf);
      vstore(s + j, x);
      vm = vmax<T>(vm, x);
    }
  }
  const T m_new = std::max(m, hmax<T>(vm));
  const T alpha = exp2_scalar(m - m_new);  // 0 on the first visible chunk (m = -inf)
  const V vmn = vsplat(m_new);
  V sum{};
  for (int64_t j = 0; j < npad; j += L) {
    V p = vexp2(vload(s + j) - vmn);
    vstore(s + j, p);
    sum += p;
  }
  l = l * alpha + hsum<T>(sum);
  if (alpha != T(1)) scale_row(alpha, o, Dp);
  m = m_new;
}

// Backward row: s (raw scores) -> P = 2^(s c - lse2) on [va, vb), 0 elsewhere; dp (dO.v)
// -> dS = P (dp - delta) * scale. kSelectDs: dS is selected to 0 off [va, vb) too (a
// non-finite dO.v at a masked key, or a non-finite delta or LSE of the row, would make
// P (dp - delta) NaN there); with finite values it is the same zero either way (0 * x).
template <typename T, bool kSelectDs = false>
void grad_row(T* s, T* dp, int64_t npad, int64_t va, int64_t vb, T c, T lse2, T delta, T scale) {
  using V = vec<T>;
  constexpr int L = Vec<T>::lanes;
  if (va >= vb) {
    std::memset(s, 0, sizeof(T) * npad);
    std::memset(dp, 0, sizeof(T) * npad);
    return;
  }
  const ivec<T> lane = iota<T>();
  const ielem<T> lo = (ielem<T>)va, hi = (ielem<T>)vb;
  const V vl = vsplat(lse2), vd = vsplat(delta);
  for (int64_t j = 0; j < npad; j += L) {
    const ivec<T> idx = lane + (ielem<T>)j;
    V p = vexp2(vload(s + j) * c - vl);
    const auto seen = (idx >= lo) & (idx < hi);
    p = seen ? p : V{};
    vstore(s + j, p);
    V ds = p * (vload(dp + j) - vd) * scale;
    if constexpr (kSelectDs) ds = seen ? ds : V{};
    vstore(dp + j, ds);
  }
}

// Per-tile views shared by forward and backward.
template <typename T>
struct TileView {
  const AttnArgs<T>& a;
  int64_t b, h;
  const T *q, *kt, *kr, *vr, *vt;
  const int32_t* iv;

  TileView(const AttnArgs<T>& args, int64_t b_, int64_t h_) : a(args), b(b_), h(h_) {
    const int64_t hk = h / (a.H / a.Hkv);
    const int64_t bhk = b * a.Hkv + hk;
    q = a.q + (b * a.H + h) * a.Lq * a.D;
    kt = a.kt ? a.kt + bhk * a.Dp * a.kt_ld : nullptr;
    vt = a.vt ? a.vt + bhk * a.Dp * a.kt_ld : nullptr;
    kr = a.kr + bhk * a.Lk * a.kr_ld;
    vr = a.vr + bhk * a.Lk * a.vr_ld;
    iv = a.intervals + b * a.iv_batch;
  }
  int64_t lo(int64_t row, int64_t slot) const { return iv[(row * a.n_slots + slot) * 2]; }
  int64_t hi(int64_t row, int64_t slot) const { return iv[(row * a.n_slots + slot) * 2 + 1]; }

  // Gathers a tile row of src ([Lq, D]) into dst ([Dp], zero padded).
  void gather(const T* src, int64_t row, T* dst) const {
    std::memcpy(dst, src + row * a.D, sizeof(T) * a.D);
    std::memset(dst + a.D, 0, sizeof(T) * (a.Dp - a.D));
  }

  // Calls f(c0, c1, ra, rb, sa, sb) for each key chunk [c0, c1) of the span of `slot` over
  // the tile's rows, with [ra, rb) the tile rows (in tile order) that see some key of it and
  // [sa, sb) the keys of the chunk every row of [ra, rb) sees (sa >= sb: none). The chunk
  // holds masked keys for some row unless [sa, sb) = [c0, c1).
  template <typename F>
  void for_each_chunk(const int32_t* rows, int64_t nr, int64_t slot, int32_t* lo_buf, int32_t* hi_buf, F&& f) const {
    int64_t ka = INT64_MAX, kb = INT64_MIN;
    for (int64_t r = 0; r < nr; ++r) {
      lo_buf[r] = (int32_t)lo(rows[r], slot);
      hi_buf[r] = (int32_t)hi(rows[r], slot);
      if (lo_buf[r] < hi_buf[r]) {
        ka = std::min<int64_t>(ka, lo_buf[r]);
        kb = std::max<int64_t>(kb, hi_buf[r]);
      }
    }
    if (ka >= kb) return;
    // Window spans are cut at window boundaries so that a chunk's rows are few.
    const int64_t g = slot == 0 ? 1 : a.window_granule;
    const int64_t step = g <= a.chunk_cols ? a.chunk_cols / g * g : a.chunk_cols;
    // Chunks start at fixed key positions (multiples of the step; window chunks counted from the first
    // window key, so they still start at window boundaries), not at the tile's first key: a row's chunks,
    // the column of each of its keys in them, hence its bits, then do not depend on which rows share its
    // tile, so a row gets the same bits in a full layout and in any row subset (QueryRowsLayout) holding it.
    // The products of the first chunk skip its whole groups of 16 columns before the tile's first key: 16 is
    // a multiple of every vector width, so each kept key keeps its lane, and a skipped group only adds
    // exact zeros to every row's sums (no masked columns of another document computed for nothing).
    const int64_t origin = slot == 0 ? 0 : a.window_origin;
    for (int64_t chunk = ka - (ka - origin) % step; chunk < kb; chunk += step) {
      const int64_t c0 = chunk + (std::max(chunk, ka) - chunk) / 16 * 16;
      const int64_t c1 = std::min(chunk + step, kb);
      int64_t ra = nr, rb = 0, n_seeing = 0, sa = c0, sb = c1;
      for (int64_t r = 0; r < nr; ++r) {
        if (lo_buf[r] < hi_buf[r] && lo_buf[r] < c1 && hi_buf[r] > c0) {
          ra = std::min(ra, r);
          rb = r + 1;
          ++n_seeing;
          sa = std::max<int64_t>(sa, lo_buf[r]);
          sb = std::min<int64_t>(sb, hi_buf[r]);
        }
      }
      if (n_seeing != rb - ra) sb = sa;  // a row between them sees none of the chunk
      if (ra < rb) f(c0, c1, ra, rb, sa, sb);
    }
  }

  // Whether x (K or V rows, stride ld) holds a NaN/inf at a key of chunk [c0, c1) outside
  // [sa, sb), the keys every row of the chunk's product sees.
  static bool masked_nonfinite(const T* x, int64_t ld, int64_t Dp, int64_t c0, int64_t c1, int64_t sa, int64_t sb) {
    if (sa >= sb) return any_nonfinite<T>(x, ld, c0, c1, Dp);
    return any_nonfinite<T>(x, ld, c0, sa, Dp) || any_nonfinite<T>(x, ld, sb, c1, Dp);
  }

  // Keys a small-window row sees inside its own window; returns their count.
  int64_t direct_keys(int64_t row, int32_t* keys) const {
    int64_t n = 0;
    for (int64_t slot = a.first_direct; slot < a.n_slots; ++slot)
      for (int64_t u = lo(row, slot); u < hi(row, slot) && n < kDirectWindowMax; ++u) keys[n++] = (int32_t)u;
    return n;
  }
};

template <typename T>
void forward_item(const AttnArgs<T>& a, int64_t b, int64_t h, int64_t tile, T* scratch) {
  const TileView<T> tv(a, b, h);
  const int64_t Dp = a.Dp, R = a.tile_rows, KC = a.chunk_cols;
  const int32_t* rows = a.row_order + a.tile_begin[tile];
  const int64_t nr = a.tile_begin[tile + 1] - a.tile_begin[tile];
  T* qp = scratch;
  T* o = qp + R * Dp;
  T* s = o + R * Dp;
  T* m = s + R * KC;
  T* l = m + R;
  int32_t* lo = reinterpret_cast<int32_t*>(l + R);
  int32_t* hi = lo + R;
  const T c = a.scale * T(kLog2e);

  for (int64_t r = 0; r < nr; ++r) {
    tv.gather(tv.q, rows[r], qp + r * Dp);
    m[r] = -std::numeric_limits<T>::infinity();
    l[r] = 0;
  }
  std::memset(o, 0, sizeof(T) * nr * Dp);

  const int64_t gemm_slots = std::min(a.first_direct, a.n_slots);
  for (int64_t slot = 0; slot < gemm_slots; ++slot) {
    tv.for_each_chunk(rows, nr, slot, lo, hi,
                      [&](int64_t c0, int64_t c1, int64_t ra, int64_t rb, int64_t sa, int64_t sb) {
      const int64_t ncols = c1 - c0, npad = round_up(ncols, 16);
      gemm<T>(rb - ra, npad, Dp, qp + ra * Dp, Dp, 1, tv.kt + c0, a.kt_ld, s, KC, false);
      for (int64_t r = ra; r < rb; ++r) {
        const int64_t va = std::max<int64_t>(lo[r], c0) - c0, vb = std::min<int64_t>(hi[r], c1) - c0;
        softmax_row<T>(s + (r - ra) * KC, npad, va, std::max(va, vb), c, m[r], l[r], o + r * Dp, Dp);
      }
      // Scores at masked keys are selected away above; only P.V could mix in a masked V (0 * inf).
      const bool whole = sa == c0 && sb == c1;
      if (whole || !TileView<T>::masked_nonfinite(tv.vr, a.vr_ld, Dp, c0, c1, sa, sb)) {
        gemm<T>(rb - ra, Dp, ncols, s, KC, 1, tv.vr + c0 * a.vr_ld, a.vr_ld, o + ra * Dp, Dp, true);
        return;
      }
      for (int64_t r = ra; r < rb; ++r) {  // each row over its visible columns only
        const int64_t va = std::max<int64_t>(lo[r], c0) - c0, vb = std::min<int64_t>(hi[r], c1) - c0;
        if (va < vb)
          gemm<T>(1, Dp, vb - va, s + (r - ra) * KC + va, KC, 1, tv.vr + (c0 + va) * a.vr_ld, a.vr_ld, o + r * Dp,
                  Dp, true);
      }
    });
  }

  if (a.first_direct < a.n_slots) {
    int32_t keys[kDirectWindowMax];
    T sc[kDirectWindowMax];
    for (int64_t r = 0; r < nr; ++r) {
      const int64_t n = tv.direct_keys(rows[r], keys);
      if (n == 0) continue;
      T mx = -std::numeric_limits<T>::infinity();
      for (int64_t i = 0; i < n; ++i) {
        sc[i] = dot<T>(qp + r * Dp, tv.kr + keys[i] * a.kr_ld, Dp) * c;
        mx = std::max(mx, sc[i]);
      }
      const T m_new = std::max(m[r], mx);
      const T alpha = exp2_scalar(m[r] - m_new);
      T* orow = o + r * Dp;
      if (alpha != T(1)) scale_row(alpha, orow, Dp);
      T sum = 0;
      for (int64_t i = 0; i < n; ++i) {
        const T p = exp2_scalar(sc[i] - m_new);
        sum += p;
        axpy<T>(p, tv.vr + keys[i] * a.vr_ld, orow, Dp);
      }
      l[r] = l[r] * alpha + sum;
      m[r] = m_new;
    }
  }

  T* out = a.out + (b * a.H + h) * a.Lq * a.D;
  T* lse = a.lse + (b * a.H + h) * a.Lq;
  for (int64_t r = 0; r < nr; ++r) {
    // A row that sees no key (a blank slot) has l = 0: output 0, LSE -inf.
    const T inv = l[r] > T(0) ? T(1) / l[r] : T(0);
    T* dst = out + rows[r] * a.D;
    for (int64_t d = 0; d < a.D; ++d) dst[d] = o[r * Dp + d] * inv;
    lse[rows[r]] = l[r] > T(0) ? (m[r] + std::log2(l[r])) * T(kLn2) : -std::numeric_limits<T>::infinity();
  }
}

template <typename T>
void backward_item(const AttnArgs<T>& a, int64_t b, int64_t h, const int32_t* tiles, int64_t n_tiles, T* dk, T* dv,
                   T* scratch) {
  const TileView<T> tv(a, b, h);
  const int64_t Dp = a.Dp, D = a.D, R = a.tile_rows, KC = a.chunk_cols;
  T* qp = scratch;
  T* dop = qp + R * Dp;
  T* dqp = dop + R * Dp;
  T* s = dqp + R * Dp;
  T* dp = s + R * KC;
  T* lse2 = dp + R * KC;
  T* delta = lse2 + R;
  int32_t* lo = reinterpret_cast<int32_t*>(delta + R);
  int32_t* hi = lo + R;
  const T c = a.scale * T(kLog2e), scale = a.scale;
  const int64_t bh = b * a.H + h;
  const T* dout = a.dout + bh * a.Lq * D;
  const T* out = a.out_in + bh * a.Lq * D;
  const T* lse = a.lse_in + bh * a.Lq;
  T* dq = a.dq + bh * a.Lq * D;

  for (int64_t ti = 0; ti < n_tiles; ++ti) {
    const int64_t tile = tiles[ti];
    const int32_t* rows = a.row_order + a.tile_begin[tile];
    const int64_t nr = a.tile_begin[tile + 1] - a.tile_begin[tile];
    for (int64_t r = 0; r < nr; ++r) {
      const int64_t row = rows[r];
      tv.gather(tv.q, row, qp + r * Dp);
      tv.gather(dout, row, dop + r * Dp);
      T dl = 0;
      for (int64_t d = 0; d < D; ++d) dl += dout[row * D + d] * out[row * D + d];
      delta[r] = dl;
      // LSE -inf (a row that sees no key): +inf makes every p = 0, so no gradient flows.
      lse2[r] = lse[row] == -std::numeric_limits<T>::infinity() ? std::numeric_limits<T>::infinity() : lse[row] * T(kLog2e);
    }
    std::memset(dqp, 0, sizeof(T) * nr * Dp);

    const int64_t gemm_slots = std::min(a.first_direct, a.n_slots);
    for (int64_t slot = 0; slot < gemm_slots; ++slot) {
      tv.for_each_chunk(rows, nr, slot, lo, hi,
                        [&](int64_t c0, int64_t c1, int64_t ra, int64_t rb, int64_t sa, int64_t sb) {
        const int64_t ncols = c1 - c0, npad = round_up(ncols, 16), nrows = rb - ra;
        gemm<T>(nrows, npad, Dp, qp + ra * Dp, Dp, 1, tv.kt + c0, a.kt_ld, s, KC, false);
        gemm<T>(nrows, npad, Dp, dop + ra * Dp, Dp, 1, tv.vt + c0, a.kt_ld, dp, KC, false);
        // Masked keys: dS selected to 0 there (a NaN/inf dO.v at a masked key, or a row whose own
        // delta or LSE is non-finite, would make P (dp - delta) NaN); with a non-finite K there,
        // dQ summed over each row's seen columns.
        const bool whole = sa == c0 && sb == c1;
        const bool restricted = !whole && TileView<T>::masked_nonfinite(tv.kr, a.kr_ld, Dp, c0, c1, sa, sb);
        for (int64_t r = ra; r < rb; ++r) {
          const int64_t va = std::max<int64_t>(lo[r], c0) - c0, vb = std::min<int64_t>(hi[r], c1) - c0;
          if (!whole)
            grad_row<T, true>(s + (r - ra) * KC, dp + (r - ra) * KC, npad, va, std::max(va, vb), c, lse2[r], delta[r],
                              scale);
          else
            grad_row<T>(s + (r - ra) * KC, dp + (r - ra) * KC, npad, va, std::max(va, vb), c, lse2[r], delta[r], scale);
        }
        gemm<T>(ncols, Dp, nrows, s, 1, KC, dop + ra * Dp, Dp, dv + c0 * Dp, Dp, true);   // dV += P^T dO
        gemm<T>(ncols, Dp, nrows, dp, 1, KC, qp + ra * Dp, Dp, dk + c0 * Dp, Dp, true);   // dK += dS^T Q
        if (!restricted) {
          gemm<T>(nrows, Dp, ncols, dp, KC, 1, tv.kr + c0 * a.kr_ld, a.kr_ld, dqp + ra * Dp, Dp, true);  // dQ += dS K
          return;
        }
        for (int64_t r = ra; r < rb; ++r) {  // dQ += dS K, each row over its visible columns only
          const int64_t va = std::max<int64_t>(lo[r], c0) - c0, vb = std::min<int64_t>(hi[r], c1) - c0;
          if (va < vb)
            gemm<T>(1, Dp, vb - va, dp + (r - ra) * KC + va, KC, 1, tv.kr + (c0 + va) * a.kr_ld, a.kr_ld, dqp + r * Dp,
                    Dp, true);
        }
      });
    }

    if (a.first_direct < a.n_slots) {
      int32_t keys[kDirectWindowMax];
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t n = tv.direct_keys(rows[r], keys);
        for (int64_t i = 0; i < n; ++i) {
          const T* krow = tv.kr + keys[i] * a.kr_ld;
          const T* vrow = tv.vr + keys[i] * a.vr_ld;
          const T p = exp2_scalar(dot<T>(qp + r * Dp, krow, Dp) * c - lse2[r]);
          const T ds = p * (dot<T>(dop + r * Dp, vrow, Dp) - delta[r]) * scale;
          axpy<T>(ds, krow, dqp + r * Dp, Dp);
          axpy<T>(ds, qp + r * Dp, dk + keys[i] * Dp, Dp);
          axpy<T>(p, dop + r * Dp, dv + keys[i] * Dp, Dp);
        }
      }
    }

    for (int64_t r = 0; r < nr; ++r) std::memcpy(dq + rows[r] * D, dqp + r * Dp, sizeof(T) * D);
  }
}

// ---------------------------------------------------------------- sampler

inline double to_double(float x) { return x; }
inline double to_double(double x) { return x; }
inline double to_double(uint16_t bf16) {
  const uint32_t bits = uint32_t(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Row statistics of softmax(x / tau) over blocks of kSampleBlock logits:
// bmax[b] (block max of x / tau), brel[b] = e^(bmax[b] - M), bcum[b] = sum of the
// block totals before b (bcum[nb] = Z). The CDF is F(v) = (bcum[b] + E_v brel[b]) / Z,
// with E_v the running sum of e^(x_u / tau - bmax[b]) inside v's block.
struct RowStats {
  int64_t nb;
  double *buf, *bmax, *brel, *bcum;
};

inline RowStats row_layout(int64_t V, double* scratch) {
  RowStats st;
  st.nb = (V + kSampleBlock - 1) / kSampleBlock;
  st.buf = scratch;
  st.bmax = st.buf + kSampleBlock;
  st.brel = st.bmax + st.nb;
  st.bcum = st.brel + st.nb;
  return st;
}

// Loads block b as x / tau into buf, padded with -inf to whole vectors; returns its length.
template <typename X>
int64_t load_block(const X* x, int64_t V, double tau, int64_t b, double* buf) {
  constexpr int L = Vec<double>::lanes;
  const int64_t n = std::min(kSampleBlock, V - b * kSampleBlock);
  const X* src = x + b * kSampleBlock;
  for (int64_t i = 0; i < n; ++i) buf[i] = to_double(src[i]) / tau;
  for (int64_t i = n; i < round_up(n, L); ++i) buf[i] = -std::numeric_limits<double>::infinity();
  return n;
}

template <typename X>
bool row_stats(const X* x, int64_t V, double tau, RowStats& st) {
  constexpr int L = Vec<double>::lanes;
  using Vd = vec<double>;
  const double neg_inf = -std::numeric_limits<double>::infinity();
  double M = neg_inf;
  for (int64_t b = 0; b < st.nb; ++b) {
    const int64_t np = round_up(load_block(x, V, tau, b, st.buf), L);
    Vd vm = vsplat(neg_inf);
    for (int64_t i = 0; i < np; i += L) vm = vmax<double>(vm, vload(st.buf + i));
    const double mb = hmax<double>(vm);
    double sb = 0;
    if (mb > neg_inf) {
      const Vd vmb = vsplat(mb);
      Vd acc{};
      for (int64_t i = 0; i < np; i += L) acc += vexp(vload(st.buf + i) - vmb);
      sb = hsum<double>(acc);
    }
    st.bmax[b] = mb;
    st.brel[b] = sb;  // the block sum until M is known
    M = std::max(M, mb);
  }
  if (!std::isfinite(M)) return false;
  st.bcum[0] = 0;
  for (int64_t b = 0; b < st.nb; ++b) {
    const double rel = st.bmax[b] > neg_inf ? std::exp(st.bmax[b] - M) : 0.0;
    st.bcum[b + 1] = st.bcum[b] + st.brel[b] * rel;
    st.brel[b] = rel;
  }
  const double Z = st.bcum[st.nb];
  return std::isfinite(Z) && Z > 0;
}

// e^(x_u / tau - bmax[b]) of block b into buf; returns the block length.
template <typename X>
int64_t block_exps(const X* x, int64_t V, double tau, const RowStats& st, int64_t b) {
  constexpr int L = Vec<double>::lanes;
  const int64_t n = load_block(x, V, tau, b, st.buf);
  const vec<double> vmb = vsplat(st.bmax[b]);
  for (int64_t i = 0; i < round_up(n, L); i += L) vstore(st.buf + i, vexp(vload(st.buf + i) - vmb));
  return n;
}

template <typename X>
int64_t sample_row(const X* x, int64_t V, double tau, double z, double* scratch) {
  RowStats st = row_layout(V, scratch);
  if (!row_stats(x, V, tau, st)) return -1;
  const double target = z * st.bcum[st.nb];
  int64_t b = 0;
  while (b < st.nb && !(st.bcum[b + 1] > target)) ++b;
  if (b == st.nb) return V - 1;  // rounding: clamp
  const int64_t n = block_exps(x, V, tau, st, b);
  double run = 0;
  int64_t last_positive = 0;
  for (int64_t i = 0; i < n; ++i) {
    run += st.buf[i];
    if (st.buf[i] > 0) last_positive = i;
    if (st.bcum[b] + run * st.brel[b] > target) return b * kSampleBlock + i;
  }
  return b * kSampleBlock + last_positive;  // rounding inside the block: its last bin absorbs it
}

// The [lower, upper) of target = z Z for which sample_row returns t, nudged onto floats.
template <typename X>
float invert_row(const X* x, int64_t V, double tau, int64_t t, double u, double* scratch) {
  RowStats st = row_layout(V, scratch);
  if (!row_stats(x, V, tau, st)) return std::numeric_limits<float>::quiet_NaN();
  const int64_t b = t / kSampleBlock, i_t = t % kSampleBlock;
  const int64_t n = block_exps(x, V, tau, st, b);
  double before = 0, upto = 0;
  int64_t last_positive = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (i < i_t) before += st.buf[i];
    if (i <= i_t) upto += st.buf[i];
    if (st.buf[i] > 0) last_positive = i;
  }
  const double Z = st.bcum[st.nb];
  const double lower = st.bcum[b] + before * st.brel[b];
  double upper = i_t == last_positive ? st.bcum[b + 1] : std::min(st.bcum[b] + upto * st.brel[b], st.bcum[b + 1]);
  float zf = (float)((lower + u * (upper - lower)) / Z);
  zf = std::min(zf, std::nextafter(1.0f, 0.0f));
  for (int step = 0; step < 8 && (double)zf * Z >= upper && zf > 0.0f; ++step) zf = std::nextafter(zf, 0.0f);
  for (int step = 0; step < 8 && (double)zf * Z < lower && zf < 1.0f; ++step) zf = std::nextafter(zf, 1.0f);
  // Never 1.0 (the sampler takes z in [0, 1)): a top bin narrower than the last float32 ulp below 1
  // holds no float32 z; it gets the largest one, which samples the token before it.
  return std::min(zf, std::nextafter(1.0f, 0.0f));
}

}  // namespace

extern const Kernels table;
const Kernels table = {
    KF_NAME,
    &forward_item<float>,
    &forward_item<double>,
    &backward_item<float>,
    &backward_item<double>,
    &sample_row<float>,
    &sample_row<double>,
    &sample_row<uint16_t>,
    &invert_row<float>,
    &invert_row<double>,
    &invert_row<uint16_t>,
};

}  // namespace KF_NS
}  // namespace kf
