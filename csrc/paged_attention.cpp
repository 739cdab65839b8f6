// CPU decode attention over a paged KV cache (kforcing_kernels.ops.paged_attention, backend "cpp").
//
// Cache layout (vLLM / FlashInfer "NHD"): k_pages/v_pages [num_pages, page_size, Hkv, D]; request b's context
// token t is in page block_table[b, t / page_size], slot t % page_size. Window row i of request b sees context
// [0, context_lens[b]) and window slots 0..i.
//
// One work item per (batch, kv head): its g = H / Hkv query heads x W window rows are processed together, so
// each cached key/value row is read (and converted to the math type) once per item, in place, a chunk of whole
// pages (~128 keys) at a time: scores of all rows against the chunk, then one online-softmax update per row and
// chunk. The window's own keys come last. Math in float (double for double inputs). Items are independent and
// each is computed by one thread in a fixed order, so the result does not depend on the thread count or on the
// other requests.

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "ops.h"

namespace kf {
namespace {

constexpr int64_t kChunkKeys = 128;

template <typename scalar_t, typename acc_t>
void paged_kernel(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new, const at::Tensor& k_pages,
                  const at::Tensor& v_pages, const std::vector<int64_t>& table, int64_t max_pages,
                  const std::vector<int64_t>& lens, acc_t scale, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), W = q.size(2), D = q.size(3);
  const int64_t Hkv = k_new.size(1), G = H / Hkv, R = G * W, S = k_pages.size(1);
  const scalar_t* qp = q.const_data_ptr<scalar_t>();
  const scalar_t* knp = k_new.const_data_ptr<scalar_t>();
  const scalar_t* vnp = v_new.const_data_ptr<scalar_t>();
  const scalar_t* kpp = k_pages.const_data_ptr<scalar_t>();
  const scalar_t* vpp = v_pages.const_data_ptr<scalar_t>();
  scalar_t* op = out.mutable_data_ptr<scalar_t>();
  // Context keys per fold: whole pages, about kChunkKeys of them (one max/rescale per row and chunk).
  const int64_t ctx_chunk = S * std::max<int64_t>(1, kChunkKeys / S);
  const int64_t chunk = std::max<int64_t>(ctx_chunk, W);

  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> qs(R * D), acc(R * D), m(R), l(R), s(R * chunk), kt(D * chunk), vc(chunk * D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, hk = item % Hkv;
      // Rows r = gi * W + i: query head hk * G + gi, window slot i; pre-scaled.
      for (int64_t gi = 0; gi < G; ++gi)
        for (int64_t i = 0; i < W; ++i) {
          const scalar_t* src = qp + ((b * H + hk * G + gi) * W + i) * D;
          for (int64_t d = 0; d < D; ++d) qs[(gi * W + i) * D + d] = static_cast<acc_t>(src[d]) * scale;
        }
      std::fill(acc.begin(), acc.end(), acc_t(0));
      std::fill(m.begin(), m.end(), -std::numeric_limits<acc_t>::infinity());
      std::fill(l.begin(), l.end(), acc_t(0));

      // Fold the keys in kt (transposed) / vc into every row; row r sees keys [0, visible(r)).
      auto fold = [&](auto visible) {
        for (int64_t r = 0; r < R; ++r) {
          const int64_t nv = visible(r);
          if (nv <= 0) continue;
          const acc_t* qr = &qs[r * D];
          acc_t* sr = &s[r * chunk];
          // Scores against K^T [D, chunk]: the inner loop runs over keys, no reduction, so it vectorises.
          for (int64_t j = 0; j < nv; ++j) sr[j] = 0;
          for (int64_t d = 0; d < D; ++d) {
            const acc_t qd = qr[d];
            const acc_t* kd = &kt[d * chunk];
            for (int64_t j = 0; j < nv; ++j) sr[j] += qd * kd[j];
          }
          acc_t mx = m[r];
          for (int64_t j = 0; j < nv; ++j) mx = std::max(mx, sr[j]);
          const acc_t alpha = std::exp(m[r] - mx);  // 0 on the first fold (m = -inf)
          acc_t* ar = &acc[r * D];
          acc_t sum = 0;
          for (int64_t d = 0; d < D; ++d) ar[d] *= alpha;
          for (int64_t j = 0; j < nv; ++j) {
            const acc_t p = std::exp(sr[j] - mx);
            sum += p;
            const acc_t* vj = &vc[j * D];
            for (int64_t d = 0; d < D; ++d) ar[d] += p * vj[d];
          }
          l[r] = l[r] * alpha + sum;
          m[r] = mx;
        }
      };

      const int64_t len = lens[b];
      for (int64_t t0 = 0; t0 < len; t0 += ctx_chunk) {
        const int64_t n = std::min(ctx_chunk, len - t0);
        for (int64_t j = 0; j < n; ++j) {
          const int64_t t = t0 + j, page = table[b * max_pages + t / S];
          const int64_t off = ((page * S + t % S) * Hkv + hk) * D;
          for (int64_t d = 0; d < D; ++d) {
            kt[d * chunk + j] = static_cast<acc_t>(kpp[off + d]);
            vc[j * D + d] = static_cast<acc_t>(vpp[off + d]);
          }
        }
        fold([n](int64_t) { return n; });
      }
      for (int64_t j = 0; j < W; ++j) {
        const int64_t off = ((b * Hkv + hk) * W + j) * D;
        for (int64_t d = 0; d < D; ++d) {
          kt[d * chunk + j] = static_cast<acc_t>(knp[off + d]);
          vc[j * D + d] = static_cast<acc_t>(vnp[off + d]);
        }
      }
      fold([W](int64_t r) { return r % W + 1; });  // slot i sees slots 0..i

      for (int64_t gi = 0; gi < G; ++gi)
        for (int64_t i = 0; i < W; ++i) {
          const int64_t r = gi * W + i;
          scalar_t* dst = op + ((b * H + hk * G + gi) * W + i) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(acc[r * D + d] / l[r]);
        }
    }
  });
}

void check_tensor(const at::Tensor& t, const char* name, const at::Tensor& q, int64_t dim) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, ": expected a CPU tensor, got device ", t.device());
  TORCH_CHECK_VALUE(t.dim() == dim, name, ": expected rank ", dim, ", got shape ", t.sizes());
  TORCH_CHECK_VALUE(t.scalar_type() == q.scalar_type(), name, ": expected dtype ", q.scalar_type(), " (q's), got ",
                    t.scalar_type());
  TORCH_CHECK_VALUE(t.is_contiguous(), name, ": expected a contiguous tensor");
}

}  // namespace

at::Tensor paged_attention_forward(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                                   const at::Tensor& k_pages, const at::Tensor& v_pages,
                                   const at::Tensor& block_table, const at::Tensor& context_lens, double scale) {
  check_tensor(q, "q", q, 4);
  check_tensor(k_new, "k_new", q, 4);
  check_tensor(v_new, "v_new", q, 4);
  check_tensor(k_pages, "k_pages", q, 4);
  check_tensor(v_pages, "v_pages", q, 4);
  const auto st = q.scalar_type();
  TORCH_CHECK_VALUE(st == at::kFloat || st == at::kDouble || st == at::kBFloat16 || st == at::kHalf,
                    "q: expected float32, float64, bfloat16 or float16, got ", st);
  const int64_t B = q.size(0), H = q.size(1), W = q.size(2), D = q.size(3);
  TORCH_CHECK_VALUE(k_new.size(0) == B && k_new.size(2) == W && k_new.size(3) == D, "k_new: expected [", B,
                    ", Hkv, ", W, ", ", D, "], got ", k_new.sizes());
  TORCH_CHECK_VALUE(v_new.sizes() == k_new.sizes(), "v_new: expected the shape of k_new ", k_new.sizes(), ", got ",
                    v_new.sizes());
  const int64_t Hkv = k_new.size(1);
  TORCH_CHECK_VALUE(Hkv > 0 && H % Hkv == 0, "q: expected a head count that is a multiple of k_new's ", Hkv,
                    " (GQA), got ", H);
  TORCH_CHECK_VALUE(k_pages.size(2) == Hkv && k_pages.size(3) == D && k_pages.size(1) >= 1,
                    "k_pages: expected [num_pages, page_size >= 1, ", Hkv, ", ", D, "], got ", k_pages.sizes());
  TORCH_CHECK_VALUE(v_pages.sizes() == k_pages.sizes(), "v_pages: expected the shape of k_pages ", k_pages.sizes(),
                    ", got ", v_pages.sizes());
  TORCH_CHECK_VALUE(block_table.device().is_cpu() && block_table.dim() == 2 && block_table.size(0) == B &&
                        (block_table.scalar_type() == at::kInt || block_table.scalar_type() == at::kLong),
                    "block_table: expected an int32/int64 CPU tensor [", B, ", max_pages], got ",
                    block_table.scalar_type(), " ", block_table.sizes());
  TORCH_CHECK_VALUE(context_lens.device().is_cpu() && context_lens.dim() == 1 && context_lens.size(0) == B &&
                        context_lens.scalar_type() == at::kLong,
                    "context_lens: expected an int64 CPU tensor [", B, "], got ", context_lens.scalar_type(), " ",
                    context_lens.sizes());
  TORCH_CHECK_VALUE(std::isfinite(scale) && scale > 0, "scale: expected a positive finite number, got ", scale);

  // Copy the (small) table and lengths out once, checking every entry that will be read.
  const int64_t num_pages = k_pages.size(0), S = k_pages.size(1), max_pages = block_table.size(1);
  const at::Tensor table_l = block_table.to(at::kLong).contiguous();
  std::vector<int64_t> table(table_l.const_data_ptr<int64_t>(), table_l.const_data_ptr<int64_t>() + B * max_pages);
  std::vector<int64_t> lens(context_lens.const_data_ptr<int64_t>(), context_lens.const_data_ptr<int64_t>() + B);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(lens[b] >= 0, "context_lens: expected lengths >= 0, got ", lens[b], " for request ", b);
    const int64_t need = (lens[b] + S - 1) / S;
    TORCH_CHECK_VALUE(need <= max_pages, "context_lens: request ", b, " has length ", lens[b], ", which needs ", need,
                      " pages of ", S, ", but block_table has ", max_pages, " per request");
    for (int64_t j = 0; j < need; ++j) {
      const int64_t p = table[b * max_pages + j];
      TORCH_CHECK_VALUE(p >= 0 && p < num_pages, "block_table: request ", b, " page ", j, " is ", p,
                        ", outside the pool of ", num_pages, " pages");
    }
  }

  at::Tensor out = at::empty_like(q);
  if (q.numel() == 0) return out;
  switch (st) {
    case at::kDouble:
      paged_kernel<double, double>(q, k_new, v_new, k_pages, v_pages, table, max_pages, lens, scale, out);
      break;
    case at::kFloat:
      paged_kernel<float, float>(q, k_new, v_new, k_pages, v_pages, table, max_pages, lens, float(scale), out);
      break;
    case at::kBFloat16:
      paged_kernel<c10::BFloat16, float>(q, k_new, v_new, k_pages, v_pages, table, max_pages, lens, float(scale), out);
      break;
    default:
      paged_kernel<c10::Half, float>(q, k_new, v_new, k_pages, v_pages, table, max_pages, lens, float(scale), out);
  }
  return out;
}

}  // namespace kf
