// Plain-pointer interface between the torch-facing drivers (attention.cpp,
// sampler.cpp) and the hot loops in kf_isa_impl.h, which is compiled once per
// instruction set (isa_*.cpp) and picked at run time (dispatch.cpp).
// No torch headers here: the ISA translation units must not instantiate torch's
// inline code with a wider target than the rest of the library.
#pragma once

#include <cstdint>

namespace kf {

// One prefix-window attention call, in the element type T of the math (float or
// double). Tensors are dense; "rows" are D (inputs) or Dp (packed) elements long.
template <typename T>
struct AttnArgs {
  int64_t B, H, Hkv, Lq, Lk, D, Dp;  // Dp: D rounded up to 16 (zero padded)
  T scale;                           // softmax scale (scores are q.k * scale)
  int64_t tile_rows, chunk_cols;     // rows of the largest query tile (scratch sizing), keys per chunk

  const T* q;       // [B, H, Lq, D]
  const T* kt;      // [B, Hkv, Dp, kt_ld]: K transposed, keys [0, kt_cols) (GEMM spans only)
  int64_t kt_ld;
  const T* kr;      // [B, Hkv, Lk, kr_ld]: K rows
  int64_t kr_ld;
  const T* vr;      // [B, Hkv, Lk, vr_ld]: V rows
  int64_t vr_ld;
  const T* vt;      // backward: [B, Hkv, Dp, kt_ld], V transposed like kt
  const T* dout;    // backward: [B, H, Lq, D]
  const T* out_in;  // backward: the forward output [B, H, Lq, D]
  const T* lse_in;  // backward: [B, H, Lq], natural log

  T* out;           // forward: [B, H, Lq, D]
  T* lse;           // forward: [B, H, Lq], natural log
  T* dq;            // backward: [B, H, Lq, D]

  // Tile plan (see attention.cpp; the tiles come from Python): rows of tile t are row_order[tile_begin[t] .. tile_begin[t+1]);
  // intervals[b' * iv_batch + (row * n_slots + slot) * 2 + {0,1}] is the half-open key
  // range row `row` sees through slot `slot` (0: context, 1..S: its window's streams).
  const int32_t* row_order;
  const int32_t* tile_begin;
  const int32_t* intervals;
  int64_t iv_batch;        // 0 when the ranges are shared by the batch
  int64_t n_slots;         // 1 + S
  int64_t first_direct;    // slots >= this are small windows done row by row
  int64_t window_granule;  // keys per window stream: chunk alignment of window spans
  int64_t window_origin;   // key of the first window token (n_ctx): window chunks start at origin + i * step
};

// Scratch elements (of T) one thread needs for attention_forward/backward_item.
int64_t attention_scratch_elems(int64_t tile_rows, int64_t chunk_cols, int64_t Dp, bool backward);

struct Kernels {
  const char* name;
  void (*forward_f)(const AttnArgs<float>&, int64_t b, int64_t h, int64_t tile, float* scratch);
  void (*forward_d)(const AttnArgs<double>&, int64_t b, int64_t h, int64_t tile, double* scratch);
  // Adds the tiles' dK/dV of query head h into dk/dv ([Lk, Dp] each) and writes their dQ rows.
  void (*backward_f)(const AttnArgs<float>&, int64_t b, int64_t h, const int32_t* tiles, int64_t n_tiles,
                     float* dk, float* dv, float* scratch);
  void (*backward_d)(const AttnArgs<double>&, int64_t b, int64_t h, const int32_t* tiles, int64_t n_tiles,
                     double* dk, double* dv, double* scratch);

  // Inverse-CDF sampling of one row of logits (float, double or bfloat16 bits), float64 math.
  // Returns min{v : F(v) > z} (V - 1 when rounding leaves none), or -1 if the row has no
  // distribution (no finite maximum or a non-finite normaliser).
  int64_t (*sample_f)(const float* x, int64_t V, double tau, double z, double* scratch);
  int64_t (*sample_d)(const double* x, int64_t V, double tau, double z, double* scratch);
  int64_t (*sample_bf16)(const uint16_t* x, int64_t V, double tau, double z, double* scratch);
  // z inside token t's CDF bin, at fraction u of it, rounded to float and nudged so that
  // sampling it gives t back when the bin holds a float. NaN if the row has no distribution.
  float (*invert_f)(const float* x, int64_t V, double tau, int64_t t, double u, double* scratch);
  float (*invert_d)(const double* x, int64_t V, double tau, int64_t t, double u, double* scratch);
  float (*invert_bf16)(const uint16_t* x, int64_t V, double tau, int64_t t, double u, double* scratch);
};

// Windows of at most this many tokens do their intra-window part row by row (a few
// dot products) instead of through a mostly masked tile product.
constexpr int64_t kDirectWindowMax = 16;

constexpr int64_t kSampleBlock = 1024;  // logits per block of the sampler's one pass
int64_t sample_scratch_elems(int64_t V);

const Kernels* kernels_generic();
const Kernels* kernels_avx2();    // nullptr when not compiled in
const Kernels* kernels_avx512();  // nullptr when not compiled in

// The kernels in use (best supported ISA, or KFORCING_CPP_ISA / set_isa()).
const Kernels& active_kernels();
// Selects an ISA by name ("generic", "avx2", "avx512"); returns an error message or "" on success.
const char* select_isa(const char* name);
const char* cpu_isa_list();  // comma-separated ISAs this CPU and build support

}  // namespace kf
