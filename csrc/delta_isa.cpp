// Which vector path a delta call runs: the ISA it names, or for kAuto (every caller's default)
// the best this CPU has, unless $TRANSPORT_DELTA_ISA forces one. The override is for
// benchmarks, which compare the paths over whole runs (publisher and subscribers in their own
// processes) without an isa= threaded through every layer. It is read once per process; a forced
// ISA this CPU lacks, or a name that is no ISA, fails every call that would use it: whoever
// forces a path must not measure another one without knowing.
#include <cstdlib>
#include <initializer_list>
#include <stdexcept>
#include <string>

#include "delta.h"
#include "delta_detail.h"

namespace transport::delta {
namespace {

const char* isa_name(int isa) {
  switch (isa) {
    case kAvx512:
      return "avx512";
    case kAvx2:
      return "avx2";
    default:
      return "scalar";
  }
}

int best_on_this_cpu() {
#ifdef TRANSPORT_DELTA_X86
  if (supports(kAvx512)) return kAvx512;
  if (supports(kAvx2)) return kAvx2;
#endif
  return kScalar;
}

// What kAuto stands for in this process: an ISA, or why $TRANSPORT_DELTA_ISA cannot be honoured.
struct AutoIsa {
  int isa;
  std::string error;  // empty when isa holds
};

AutoIsa read_auto_isa() {
  const char* env = std::getenv("TRANSPORT_DELTA_ISA");
  const std::string want = env != nullptr ? env : "";
  if (want.empty() || want == "auto") return {best_on_this_cpu(), ""};
  const std::string var = "TRANSPORT_DELTA_ISA='" + want + "'";
  for (int isa : {kAvx512, kAvx2, kScalar}) {
    if (want != isa_name(isa)) continue;
    if (supports(isa)) return {isa, ""};
    return {kScalar, var + " names an ISA this CPU lacks (the best it has is " + isa_name(best_on_this_cpu()) + ")"};
  }
  return {kScalar, var + " is not one of avx512, avx2, scalar, auto"};
}

}  // namespace

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
    // Read at the first call, once (a function-local static is initialised once, thread-safely);
    // a bad value is kept as its error, so every later call fails the same way.
    static const AutoIsa chosen = read_auto_isa();
    if (!chosen.error.empty()) throw std::invalid_argument("delta: " + chosen.error);
    return chosen.isa;
  }
  if (isa < kScalar || isa > kAvx512) throw std::invalid_argument("delta: unknown ISA " + std::to_string(isa));
  if (!supports(isa)) throw std::invalid_argument("delta: this CPU lacks ISA " + std::to_string(isa));
  return isa;
}

std::string best_isa() { return isa_name(detail::resolve(kAuto)); }

}  // namespace transport::delta
