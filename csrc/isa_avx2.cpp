// AVX2 + FMA (256-bit vectors) build of the hot loops; used only when the CPU reports the ISA.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "kf_kernels.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,bmi2"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi2")
#endif

#define KF_NS avx2
#define KF_NAME "avx2"
#define KF_VL 8
#define KF_RB 6
#define KF_NV 2
#include "kf_isa_impl.h"

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace kf {
const Kernels* kernels_avx2() { return &avx2::table; }
}  // namespace kf
#else
namespace kf {
const Kernels* kernels_avx2() { return nullptr; }
}  // namespace kf
#endif
