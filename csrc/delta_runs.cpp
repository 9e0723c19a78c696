// Deltas cut along byte runs (mesh sync; see delta.h): a trainer rank's in-place diff of its
// snapshot (with the fp32 -> bf16 cast on the way), the cut of its changes along a generator
// rank's runs, and the LEB128 positions of the payload. The checksums the mesh form carries are
// in delta_checksum.cpp.
#include <cstdint>
#include <cstring>

#include "delta.h"
#include "delta_detail.h"

namespace transport::delta {
using namespace detail;

namespace {

template <int ES>
inline uint64_t record(const uint8_t* s, uint64_t i, uint64_t offset, uint64_t* positions, uint8_t* old,
                       uint64_t cap, uint64_t count) {
  if (count < cap) {
    positions[count] = offset + i * ES;
    std::memcpy(old + count * ES, s + i * ES, ES);
  }
  return count + 1;
}

template <int ES>
uint64_t diff_scalar(const uint8_t* f, uint8_t* s, uint64_t from, uint64_t n, uint64_t offset, uint64_t* positions,
                     uint8_t* old, uint64_t cap, uint64_t count) {
  for (uint64_t i = from; i < n; ++i) {
    if (std::memcmp(f + i * ES, s + i * ES, ES) != 0) {
      count = record<ES>(s, i, offset, positions, old, cap, count);
      std::memcpy(s + i * ES, f + i * ES, ES);
    }
  }
  return count;
}

#ifdef TRANSPORT_DELTA_X86
// 32 bytes at a time: one compare, and the changed lanes walked by their mask bits.
template <int ES>
__attribute__((target("avx2"))) uint64_t diff_avx2(const uint8_t* f, uint8_t* s, uint64_t n, uint64_t offset,
                                                   uint64_t* positions, uint8_t* old, uint64_t cap) {
  constexpr uint64_t kLanes = 32 / ES;
  uint64_t count = 0, i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(f + i * ES));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i * ES));
    _mm_prefetch(reinterpret_cast<const char*>(f + i * ES + kPrefetch), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(s + i * ES + kPrefetch), _MM_HINT_T0);
    const __m256i eq = ES == 2 ? _mm256_cmpeq_epi16(a, b) : _mm256_cmpeq_epi32(a, b);
    uint32_t diff = ~static_cast<uint32_t>(_mm256_movemask_epi8(eq));
    if (diff == 0) continue;
    diff &= ES == 2 ? 0x55555555u : 0x11111111u;  // one bit per lane
    while (diff) {
      const uint64_t lane = static_cast<uint64_t>(__builtin_ctz(diff)) / ES;
      count = record<ES>(s, i + lane, offset, positions, old, cap, count);
      diff &= diff - 1;
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(s + i * ES), a);
  }
  return diff_scalar<ES>(f, s, i, n, offset, positions, old, cap, count);
}
#endif

// fp32 -> bf16 as c10::BFloat16 rounds: to nearest, ties to even; every NaN becomes 0x7FC0 (torch's
// vector casts give 0xFFFF, its scalar ones 0x7FC0: one canonical NaN here, wherever it lies).
inline uint16_t to_bf16(uint32_t bits) {
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

uint64_t diff_bf16_scalar(const uint8_t* f, uint8_t* s, uint64_t from, uint64_t n, uint64_t offset,
                          uint64_t* positions, uint8_t* old, uint64_t cap, uint64_t count) {
  for (uint64_t i = from; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, f + i * 4, 4);
    const uint16_t v = to_bf16(bits);
    uint16_t was;
    std::memcpy(&was, s + i * 2, 2);
    if (v != was) {
      count = record<2>(s, i, offset, positions, old, cap, count);
      std::memcpy(s + i * 2, &v, 2);
    }
  }
  return count;
}

#ifdef TRANSPORT_DELTA_X86
// 8 fp32 a step, cast in the lanes, compared with 8 bf16 of the snapshot; only changed blocks stored.
__attribute__((target("avx2"))) uint64_t diff_bf16_avx2(const uint8_t* f, uint8_t* s, uint64_t n, uint64_t offset,
                                                        uint64_t* positions, uint8_t* old, uint64_t cap) {
  const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7FFF);
  const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF), inf = _mm256_set1_epi32(0x7F800000);
  const __m256i qnan = _mm256_set1_epi32(0x7FC0);
  uint64_t count = 0, i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(f + i * 4));
    _mm_prefetch(reinterpret_cast<const char*>(f + i * 4 + 2 * kPrefetch), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(s + i * 2 + kPrefetch), _MM_HINT_T0);
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(x, bias), _mm256_and_si256(_mm256_srli_epi32(x, 16), one)), 16);
    r = _mm256_blendv_epi8(r, qnan, _mm256_cmpgt_epi32(_mm256_and_si256(x, abs_mask), inf));
    const __m128i v = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    const __m128i was = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i * 2));
    uint32_t diff = ~static_cast<uint32_t>(_mm_movemask_epi8(_mm_cmpeq_epi16(v, was))) & 0xFFFFu;
    if (diff == 0) continue;
    diff &= 0x5555u;  // one bit per lane
    while (diff) {
      count = record<2>(s, i + static_cast<uint64_t>(__builtin_ctz(diff)) / 2, offset, positions, old, cap, count);
      diff &= diff - 1;
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(s + i * 2), v);
  }
  return diff_bf16_scalar(f, s, i, n, offset, positions, old, cap, count);
}
#endif

}  // namespace

uint64_t diff_in_place(const void* fresh, void* snap, uint64_t n, int es, uint64_t offset, uint64_t* positions,
                       void* old, uint64_t cap, int isa) {
  check_es(es);
  const auto* f = static_cast<const uint8_t*>(fresh);
  auto* s = static_cast<uint8_t*>(snap);
  auto* o = static_cast<uint8_t*>(old);
#ifdef TRANSPORT_DELTA_X86
  if (resolve(isa) != kScalar)
    return es == 2 ? diff_avx2<2>(f, s, n, offset, positions, o, cap) : diff_avx2<4>(f, s, n, offset, positions, o, cap);
#else
  resolve(isa);
#endif
  return es == 2 ? diff_scalar<2>(f, s, 0, n, offset, positions, o, cap, 0)
                 : diff_scalar<4>(f, s, 0, n, offset, positions, o, cap, 0);
}

uint64_t diff_bf16_in_place(const void* fresh, void* snap, uint64_t n, uint64_t offset, uint64_t* positions,
                            void* old, uint64_t cap, int isa) {
  const auto* f = static_cast<const uint8_t*>(fresh);
  auto* s = static_cast<uint8_t*>(snap);
  auto* o = static_cast<uint8_t*>(old);
#ifdef TRANSPORT_DELTA_X86
  if (resolve(isa) != kScalar) return diff_bf16_avx2(f, s, n, offset, positions, o, cap);
#else
  resolve(isa);
#endif
  return diff_bf16_scalar(f, s, 0, n, offset, positions, o, cap, 0);
}

uint64_t cut_runs(const uint64_t* units, const uint16_t* old_vals, const uint16_t* new_vals, uint64_t count,
                  const int64_t* runs, uint64_t nruns, uint64_t* out_units, uint16_t* out_old, uint16_t* out_new) {
  uint64_t m = 0, r = 0;
  for (uint64_t k = 0; k < count && r < nruns; ++k) {
    const uint64_t u = units[k];
    // Runs ending at or before u are behind us (both lists are sorted by snapshot position).
    while (r < nruns && static_cast<uint64_t>(runs[3 * r] + runs[3 * r + 2]) / 2 <= u) ++r;
    if (r == nruns) break;
    const uint64_t a = static_cast<uint64_t>(runs[3 * r]) / 2;
    if (u < a) continue;
    out_units[m] = static_cast<uint64_t>(runs[3 * r + 1]) / 2 + (u - a);
    out_old[m] = old_vals[k];
    out_new[m] = new_vals[k];
    ++m;
  }
  return m;
}

uint64_t encode_positions(const uint64_t* positions, uint64_t count, void* out, uint64_t cap) {
  auto* o = static_cast<uint8_t*>(out);
  uint64_t len = 0, next = 0;
  for (uint64_t k = 0; k < count; ++k) {
    const uint64_t p = positions[k];
    if (p < next) return UINT64_MAX;
    uint8_t one[16];  // put_varint may store past the varint: out has no room to spare
    const uint64_t n = put_varint(one, p - next);
    next = p + 1;
    if (n > cap - len) return UINT64_MAX;
    std::memcpy(o + len, one, n);
    len += n;
  }
  return len;
}

}  // namespace transport::delta
