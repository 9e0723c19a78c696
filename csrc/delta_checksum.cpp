// The checksum of delta.h (a sum of mix(bits_i, i) mod 2^64) over the three shapes its callers
// hold: a piece of a tensor (with its copy: the encoder's pass without a base, delta_encode.cpp),
// values at positions (a change's terms), and the byte runs of a mesh slot.
#include <cstdint>
#include <stdexcept>

#include "delta.h"
#include "delta_detail.h"

namespace transport::delta {
using namespace detail;

uint64_t checksum(const void* p, uint64_t n, int es, uint64_t first, void* dst, int isa) {
  check_es(es);
  return checksum_pass(static_cast<const uint8_t*>(p), static_cast<uint8_t*>(dst), n, es, first, isa);
}

uint64_t terms(const void* values, const uint64_t* positions, uint64_t count, int es) {
  check_es(es);
  const auto* v = static_cast<const uint8_t*>(values);
  uint64_t sum = 0;
  for (uint64_t k = 0; k < count; ++k) sum += mix(load_elem(v + k * es, es), positions[k]);
  return sum;
}

uint64_t checksum_runs(const void* base, const int64_t* runs, uint64_t count, int addr_col, int pos_col, int isa) {
  if (addr_col < 0 || addr_col > 1 || pos_col < 0 || pos_col > 1)
    throw std::invalid_argument("delta: run columns must be 0 or 1");
  const auto* b = static_cast<const uint8_t*>(base);
  uint64_t sum = 0;
  for (uint64_t k = 0; k < count; ++k) {
    const int64_t* r = runs + 3 * k;
    if (r[0] < 0 || r[1] < 0 || r[2] < 0 || ((r[0] | r[1] | r[2]) & 1))
      throw std::invalid_argument("delta: a run with a negative or odd offset or length");
    sum += checksum_pass(b + r[addr_col], nullptr, static_cast<uint64_t>(r[2]) / 2, 2,
                         static_cast<uint64_t>(r[pos_col]) / 2, isa);
  }
  return sum;
}

}  // namespace transport::delta
