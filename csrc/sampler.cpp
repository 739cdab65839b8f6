// Fused inverse-CDF sampler and noise inversion on CPU: validation and the parallel
// loop over rows. The per-row math (float64, one pass over the logits plus one
// block) is in kf_isa_impl.h.

#include <ATen/Parallel.h>

#include <atomic>
#include <cmath>
#include <vector>

#include "kf_kernels.h"
#include "ops.h"

namespace kf {
namespace {

// Logits as a contiguous [rows, V] tensor of a dtype the row kernels read.
at::Tensor check_logits(const at::Tensor& logits) {
  TORCH_CHECK_VALUE(logits.device().is_cpu(), "logits: expected a CPU tensor, got device ", logits.device());
  TORCH_CHECK_VALUE(at::isFloatingType(logits.scalar_type()), "logits: expected a floating dtype, got ",
                    logits.scalar_type());
  TORCH_CHECK_VALUE(logits.dim() >= 1 && logits.size(-1) >= 1, "logits: expected shape [..., V] with V >= 1, got ",
                    logits.sizes());
  const auto dt = logits.scalar_type();
  at::Tensor x = (dt == at::kFloat || dt == at::kDouble || dt == at::kBFloat16) ? logits : logits.to(at::kFloat);
  return x.contiguous().view({-1, logits.size(-1)});
}

void check_rows_arg(const char* name, const at::Tensor& t, const at::Tensor& logits) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, ": expected a CPU tensor, got device ", t.device());
  TORCH_CHECK_VALUE(t.sizes() == logits.sizes().slice(0, logits.dim() - 1), name, ": expected shape ",
                    logits.sizes().slice(0, logits.dim() - 1), " (logits without V), got ", t.sizes());
}

// float64 [rows] temperatures (a 0-dim tensor is broadcast), all > 0 and finite.
at::Tensor check_temperature(const at::Tensor& tau, const at::Tensor& logits) {
  TORCH_CHECK_VALUE(tau.device().is_cpu(), "temperature: expected a CPU tensor, got device ", tau.device());
  TORCH_CHECK_VALUE(at::isFloatingType(tau.scalar_type()) || at::isIntegralType(tau.scalar_type(), false),
                    "temperature: expected a real dtype, got ", tau.scalar_type());
  const auto rows_shape = logits.sizes().slice(0, logits.dim() - 1);
  TORCH_CHECK_VALUE(tau.dim() == 0 || tau.sizes() == rows_shape, "temperature: expected a scalar or shape ", rows_shape,
                    ", got ", tau.sizes());
  at::Tensor t = tau.to(at::kDouble).contiguous();
  const double* p = t.data_ptr<double>();
  for (int64_t i = 0; i < t.numel(); ++i)
    TORCH_CHECK_VALUE(std::isfinite(p[i]) && p[i] > 0, "temperature: expected finite values > 0, got ", p[i]);
  return t.dim() == 0 ? t.expand(rows_shape).contiguous().view({-1}) : t.view({-1});
}

template <typename F>
void for_rows(int64_t rows, int64_t V, const F& f) {
  // A row costs ~V exps; hand out a few rows per task.
  const int64_t grain = std::max<int64_t>(1, 65536 / V);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<double> scratch(sample_scratch_elems(V));
    for (int64_t r = begin; r < end; ++r) f(r, scratch.data());
  });
}

// The first bad row, whichever thread finds it (the reference backend names the first too).
void note_bad_row(std::atomic<int64_t>& bad, int64_t r) {
  int64_t seen = bad.load();
  while ((seen < 0 || r < seen) && !bad.compare_exchange_weak(seen, r)) {
  }
}

void raise_bad_row(int64_t bad) {
  TORCH_CHECK_VALUE(bad < 0, "logits: expected every row to define a distribution, row ", bad,
                    " has no finite maximum or a non-finite sum (all -inf, +inf or NaN)");
}

}  // namespace

at::Tensor inverse_cdf_sample(const at::Tensor& logits, const at::Tensor& z, const at::Tensor& temperature) {
  const at::Tensor x = check_logits(logits);
  check_rows_arg("z", z, logits);
  TORCH_CHECK_VALUE(at::isFloatingType(z.scalar_type()), "z: expected a floating dtype, got ", z.scalar_type());
  const at::Tensor tau = check_temperature(temperature, logits);
  const at::Tensor zd = z.to(at::kDouble).contiguous().view({-1});
  const double* zp = zd.data_ptr<double>();
  for (int64_t i = 0; i < zd.numel(); ++i)
    TORCH_CHECK_VALUE(zp[i] >= 0 && zp[i] <= 1, "z: expected values in [0, 1], got ", zp[i]);
  const int64_t rows = x.size(0), V = x.size(1);
  at::Tensor ids = at::empty({rows}, z.options().dtype(at::kLong));
  int64_t* out = ids.data_ptr<int64_t>();
  const double* tp = tau.data_ptr<double>();
  const Kernels& kern = active_kernels();
  std::atomic<int64_t> bad{-1};
  for_rows(rows, V, [&](int64_t r, double* scratch) {
    int64_t id;
    switch (x.scalar_type()) {
      case at::kDouble: id = kern.sample_d(x.data_ptr<double>() + r * V, V, tp[r], zp[r], scratch); break;
      case at::kBFloat16:
        id = kern.sample_bf16(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) + r * V, V, tp[r], zp[r],
                              scratch);
        break;
      default: id = kern.sample_f(x.data_ptr<float>() + r * V, V, tp[r], zp[r], scratch);
    }
    if (id < 0) note_bad_row(bad, r);
    out[r] = id < 0 ? V - 1 : id;
  });
  raise_bad_row(bad.load());
  return ids.view(z.sizes());
}

at::Tensor noise_inversion(const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& temperature,
                           const at::Tensor& u) {
  const at::Tensor x = check_logits(logits);
  check_rows_arg("tokens", tokens, logits);
  check_rows_arg("u", u, logits);
  TORCH_CHECK_VALUE(at::isIntegralType(tokens.scalar_type(), false), "tokens: expected an integer dtype, got ",
                    tokens.scalar_type());
  TORCH_CHECK_VALUE(at::isFloatingType(u.scalar_type()), "u: expected a floating dtype, got ", u.scalar_type());
  const at::Tensor tau = check_temperature(temperature, logits);
  const int64_t rows = x.size(0), V = x.size(1);
  const at::Tensor tk = tokens.to(at::kLong).contiguous().view({-1});
  const at::Tensor ud = u.to(at::kDouble).contiguous().view({-1});
  const int64_t* tp = tk.data_ptr<int64_t>();
  const double* up = ud.data_ptr<double>();
  for (int64_t i = 0; i < rows; ++i) {
    TORCH_CHECK_VALUE(tp[i] >= 0 && tp[i] < V, "tokens: expected ids in [0, ", V, "), got ", tp[i]);
    TORCH_CHECK_VALUE(up[i] >= 0 && up[i] < 1, "u: expected values in [0, 1), got ", up[i]);
  }
  at::Tensor z = at::empty({rows}, u.options().dtype(at::kFloat));
  float* out = z.data_ptr<float>();
  const double* taup = tau.data_ptr<double>();
  const Kernels& kern = active_kernels();
  std::atomic<int64_t> bad{-1};
  for_rows(rows, V, [&](int64_t r, double* scratch) {
    float zr;
    switch (x.scalar_type()) {
      case at::kDouble: zr = kern.invert_d(x.data_ptr<double>() + r * V, V, taup[r], tp[r], up[r], scratch); break;
      case at::kBFloat16:
        zr = kern.invert_bf16(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) + r * V, V, taup[r], tp[r],
                              up[r], scratch);
        break;
      default: zr = kern.invert_f(x.data_ptr<float>() + r * V, V, taup[r], tp[r], up[r], scratch);
    }
    if (std::isnan(zr)) note_bad_row(bad, r);
    out[r] = zr;
  });
  raise_bad_row(bad.load());
  return z.view(tokens.sizes());
}

}  // namespace kf
