// Entry points of kforcing_kernels._C (bound in module.cpp). All validate their
// arguments with TORCH_CHECK_VALUE (ValueError in Python), naming the argument and
// giving the expected vs the actual shape / dtype / device / value.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace kf {

// Prefix-window attention (docs/DESIGN.md). q [B, H, Lq, D], k/v [B, Hkv, Lk, D]
// (float32, bfloat16, float16 or float64, CPU); row_intervals int32 [1 or B, Lq, 1 + S, 2]
// (WindowLayout.row_intervals(): what each query row sees); row_order int32 [Lq] and
// tile_begin int32 [T + 1] (WindowLayout.cpu_query_tiles: which rows form a query tile);
// the geometry ints give the sizes. Returns out [B, H, Lq, D] (q's dtype) and lse [B, H, Lq]
// (natural log; float32, float64 for float64 inputs). A row that sees no key gets out 0,
// lse -inf. A NaN/inf in K or V at a key a row does not see never reaches that row.
std::tuple<at::Tensor, at::Tensor> attention_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& row_intervals,
    const at::Tensor& row_order, const at::Tensor& tile_begin, int64_t n_ctx, int64_t num_windows,
    int64_t window_size, int64_t last_window_size, int64_t n_streams, bool queries_all, double scale,
    int64_t n_rows = -1);

// Gradients (dq, dk, dv) given the forward's out and lse.
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& row_intervals, const at::Tensor& row_order, const at::Tensor& tile_begin,
    int64_t n_ctx, int64_t num_windows, int64_t window_size, int64_t last_window_size, int64_t n_streams,
    bool queries_all, double scale, int64_t n_rows = -1);

// Decode attention over a paged KV cache (paged_attention.cpp): q [B, H, W, D], k_new/v_new [B, Hkv, W, D],
// k_pages/v_pages [num_pages, page_size, Hkv, D], block_table int32/int64 [B, max_pages], context_lens int64 [B].
// Row i of request b sees context [0, context_lens[b]) and window slots 0..i. Returns out [B, H, W, D].
at::Tensor paged_attention_forward(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                                   const at::Tensor& k_pages, const at::Tensor& v_pages,
                                   const at::Tensor& block_table, const at::Tensor& context_lens, double scale);

// token = min{v : F(v) > z} of softmax(logits / temperature), clamped to V - 1.
// logits [..., V] float (CPU); z [...]; temperature a 0-dim tensor or [...]. Returns int64 [...].
at::Tensor inverse_cdf_sample(const at::Tensor& logits, const at::Tensor& z, const at::Tensor& temperature);

// z inside each token's CDF bin [F(t-1), F(t)) at fraction u [...] of it (float32 [...]).
at::Tensor noise_inversion(const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& temperature,
                           const at::Tensor& u);

}  // namespace kf
