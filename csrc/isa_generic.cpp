// Portable build of the hot loops (any CPU; 128-bit vectors).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#define KF_NS generic
#define KF_NAME "generic"
#define KF_VL 4
#define KF_RB 4
#define KF_NV 2
#include "kf_isa_impl.h"

namespace kf {
const Kernels* kernels_generic() { return &generic::table; }
}  // namespace kf
