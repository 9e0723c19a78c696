// Which vector path a delta call runs: the ISA it names, or for kAuto (every caller's default)
// the best this CPU has.
#include <stdexcept>
#include <string>

#include "delta.h"
#include "delta_detail.h"

namespace transport::delta {

bool supports(int isa) {
  switch (isa) {
    case kScalar:
      return true;
#ifdef TRANSPORT_DELTA_X86
    case kAvx2:
      return __builtin_cpu_supports("avx2");
    case kAvx512:  // with VBMI2 (the 16-bit compress and expand) and BMI2 (pdep)
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi2") &&
             __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi2");
#endif
    default:
      return false;
  }
}

int detail::resolve(int isa) {
  if (isa == kAuto) {
#ifdef TRANSPORT_DELTA_X86
    if (supports(kAvx512)) return kAvx512;
    if (supports(kAvx2)) return kAvx2;
#endif
    return kScalar;
  }
  if (isa < kScalar || isa > kAvx512) throw std::invalid_argument("delta: unknown ISA " + std::to_string(isa));
  if (!supports(isa)) throw std::invalid_argument("delta: this CPU lacks ISA " + std::to_string(isa));
  return isa;
}

std::string best_isa() {
  switch (detail::resolve(kAuto)) {
    case kAvx512:
      return "avx512";
    case kAvx2:
      return "avx2";
    default:
      return "scalar";
  }
}

}  // namespace transport::delta
