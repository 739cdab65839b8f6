// Run-time choice of the ISA build of the hot loops (kf_isa_impl.h).
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#include "kf_kernels.h"

namespace kf {

int64_t attention_scratch_elems(int64_t tile_rows, int64_t chunk_cols, int64_t Dp, bool backward) {
  // Row buffers of Dp (q, o | q, dO, dQ), chunk buffers (s | s, dP), per-row scalars,
  // and two int32 arrays (lo, hi) stored in 2 * tile_rows elements.
  const int64_t R = tile_rows;
  return backward ? 3 * R * Dp + 2 * R * chunk_cols + 4 * R : 2 * R * Dp + R * chunk_cols + 4 * R;
}

int64_t sample_scratch_elems(int64_t V) {
  const int64_t nb = (V + kSampleBlock - 1) / kSampleBlock;
  return kSampleBlock + 3 * nb + 1;
}

namespace {

bool cpu_has(const char* isa) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (std::strcmp(isa, "avx512") == 0)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
  if (std::strcmp(isa, "avx2") == 0) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  return std::strcmp(isa, "generic") == 0;
}

const Kernels* by_name(const char* isa) {
  if (std::strcmp(isa, "avx512") == 0) return kernels_avx512();
  if (std::strcmp(isa, "avx2") == 0) return kernels_avx2();
  if (std::strcmp(isa, "generic") == 0) return kernels_generic();
  return nullptr;
}

const Kernels* best() {
  for (const char* isa : {"avx512", "avx2"})
    if (cpu_has(isa) && by_name(isa)) return by_name(isa);
  return kernels_generic();
}

std::atomic<const Kernels*>& current() {
  static std::atomic<const Kernels*> k{[] {
    const char* forced = std::getenv("KFORCING_CPP_ISA");
    if (forced && *forced && cpu_has(forced) && by_name(forced)) return by_name(forced);
    return best();
  }()};
  return k;
}

}  // namespace

const Kernels& active_kernels() { return *current().load(std::memory_order_relaxed); }

const char* select_isa(const char* name) {
  const Kernels* k = by_name(name);
  if (!k) return "isa: expected one of generic, avx2, avx512 (compiled into this build)";
  if (!cpu_has(name)) return "isa: this CPU does not support the requested instruction set";
  current().store(k);
  return "";
}

const char* cpu_isa_list() {
  static const std::string list = [] {
    std::string s;
    for (const char* isa : {"generic", "avx2", "avx512"})
      if (cpu_has(isa) && by_name(isa)) s += (s.empty() ? "" : ",") + std::string(isa);
    return s;
  }();
  return list.c_str();
}

}  // namespace kf
