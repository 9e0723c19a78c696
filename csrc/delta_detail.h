// Internal to the delta pass (csrc/delta_*.cpp), not part of delta.h's API: the checksum term
// mix() in scalar and vector form, the constants the passes share, LEB128 varints, and the ISA
// and element-size checks the entry points start with.
//
// The translation units, one concept each (as transport/weights/_codec/ is split):
//   delta_isa.cpp       which vector path runs: supports, resolve (with TRANSPORT_DELTA_ISA), best_isa
//   delta_encode.cpp    the fused copy + checksum + diff + encode pass (scalar, AVX2, AVX-512),
//                       encode and sample_changed
//   delta_checksum.cpp  the checksums: of a tensor piece (the pass above without a base), of values
//                       at positions (terms), of byte runs (checksum_runs)
//   delta_apply.cpp     the subscriber's checked scatter, one-pass apply and undo
//   delta_runs.cpp      the mesh form: in-place diffs, cut_runs, encode_positions
//
// Shared code has external linkage in transport::delta::detail (the extension is built with
// hidden visibility, so none of it is exported); code used by one unit stays in that unit's
// anonymous namespace.
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TRANSPORT_DELTA_X86 1
#endif

namespace transport::delta::detail {

constexpr uint32_t kIndexMul = 0x9E3779B9u;
constexpr uint32_t kMix = 0x85EBCA6Bu;
// Bytes ahead of the compare loops to prefetch both streams: one core alone does not keep enough
// loads in flight to read two streams at memory speed (a core's diff of 200 MB against 200 MB
// took a fifth less with it; a prefetch past the end of a buffer is harmless).
constexpr uint64_t kPrefetch = 2048;

// The steps form (kVarstep, delta.h): a step in [-kStepMax, kStepMax] is written as itself, any
// other change as kEscape followed (among the escapes) by the value.
constexpr int kStepMax = 127;
constexpr uint8_t kEscape = 0x80;  // (int8) -128

// The checksum term of value x at index i (delta.h).
inline uint32_t mix(uint32_t x, uint64_t i) {
  uint32_t y = (x ^ (static_cast<uint32_t>(i) * kIndexMul)) * kMix;
  return y ^ (y >> 15);
}

inline uint32_t load_elem(const uint8_t* p, int es) {
  if (es == 2) {
    uint16_t v;
    std::memcpy(&v, p, 2);
    return v;
  }
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline uint64_t align8(uint64_t n) { return (n + 7) & ~uint64_t{7}; }

// Writes gap as a LEB128 varint at out and returns its length. Up to three bytes without a
// branch on the length (gaps are short and unpredictable); it may store one byte past them, so
// the caller leaves room for 10.
inline uint64_t put_varint(uint8_t* out, uint64_t gap) {
  if (gap < (uint64_t{1} << 21)) {
    uint64_t word = (gap & 0x7f) | ((gap >> 7 & 0x7f) << 8) | ((gap >> 14 & 0x7f) << 16);
    const unsigned len = 1 + (gap >= 0x80) + (gap >= 0x4000);
    word |= (len > 1 ? 0x80u : 0u) | (len > 2 ? 0x8000u : 0u);
    std::memcpy(out, &word, 4);
    return len;
  }
  uint64_t len = 0;
  do {
    const uint8_t b = gap & 0x7f;
    gap >>= 7;
    out[len++] = b | (gap ? 0x80 : 0);
  } while (gap);
  return len;
}

inline void check_es(int es) {
  if (es != 2 && es != 4) throw std::invalid_argument("delta: element size must be 2 or 4, not " + std::to_string(es));
}

// The ISA a call runs on (delta_isa.cpp): isa itself when this CPU has it; for kAuto the one
// TRANSPORT_DELTA_ISA names, else the best this CPU has. Throws std::invalid_argument for an
// unknown isa, one this CPU lacks, or a TRANSPORT_DELTA_ISA that is either.
int resolve(int isa);

// The encoder's pass without a base (delta_encode.cpp): copies n elements of es bytes from p to
// dst (when not null) and returns their checksum, their indices starting at first.
uint64_t checksum_pass(const uint8_t* p, uint8_t* dst, uint64_t n, int es, uint64_t first, int isa);

#ifdef TRANSPORT_DELTA_X86

// mix() in vector lanes: x holds the values (zero-extended to 32 bits), h their keys
// (index * kIndexMul); add*() adds the 32-bit terms into 64-bit sums.

__attribute__((target("avx2"))) inline __m256i mix8_avx2(__m256i x, __m256i h) {
  __m256i y = _mm256_mullo_epi32(_mm256_xor_si256(x, h), _mm256_set1_epi32(static_cast<int>(kMix)));
  return _mm256_xor_si256(y, _mm256_srli_epi32(y, 15));
}

__attribute__((target("avx2"))) inline __m256i add8_avx2(__m256i acc, __m256i y) {
  acc = _mm256_add_epi64(acc, _mm256_cvtepu32_epi64(_mm256_castsi256_si128(y)));
  return _mm256_add_epi64(acc, _mm256_cvtepu32_epi64(_mm256_extracti128_si256(y, 1)));
}

__attribute__((target("avx2"))) inline uint64_t hsum_avx2(__m256i acc) {
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc);
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

// AVX2 has no compress or expand: its passes look them up by an 8-bit mask of lanes. kept: the
// set lanes' indices first (vpermd's operand for a compress of 32-bit lanes; with the lanes'
// first index added, the kept indices themselves); spread: lane j's rank among the set lanes
// (vpermd's for an expand); kept16 and spread16: the same for 16-bit lanes as pshufb operands,
// the lanes they leave zero; varint: the pshufb operand that packs the varints of 8 gaps under
// 2**14 held as two bytes each (bit j: lane j takes both bytes, else its low one).
struct LaneTables {
  alignas(32) uint32_t kept[256][8];
  alignas(32) uint32_t spread[256][8];
  alignas(16) uint8_t kept16[256][16];
  alignas(16) uint8_t spread16[256][16];
  alignas(16) uint8_t varint[256][16];
};

constexpr LaneTables make_lane_tables() {
  LaneTables t{};
  for (unsigned m = 0; m < 256; ++m) {
    for (unsigned b = 0; b < 16; ++b) t.kept16[m][b] = t.spread16[m][b] = t.varint[m][b] = 0x80;  // pshufb: zero
    unsigned k = 0, v = 0;
    for (unsigned j = 0; j < 8; ++j) {
      t.varint[m][v++] = static_cast<uint8_t>(2 * j);
      if ((m >> j & 1) == 0) continue;
      t.varint[m][v++] = static_cast<uint8_t>(2 * j + 1);
      t.kept[m][k] = j;
      t.spread[m][j] = k;
      t.kept16[m][2 * k] = static_cast<uint8_t>(2 * j);
      t.kept16[m][2 * k + 1] = static_cast<uint8_t>(2 * j + 1);
      t.spread16[m][2 * j] = static_cast<uint8_t>(2 * k);
      t.spread16[m][2 * j + 1] = static_cast<uint8_t>(2 * k + 1);
      ++k;
    }
  }
  return t;
}

inline constexpr LaneTables kLaneTables = make_lane_tables();

#define TRANSPORT_AVX512 "avx512f,avx512bw,avx512vl,avx512vbmi2,avx2,bmi2"
// GCC 12 flags the self-initialised placeholder inside its own _mm512_undefined_*() (used by the
// unmasked AVX-512 intrinsics) as maybe uninitialised: a false positive in its headers. Every
// unit's AVX-512 code lies between these two (clang has neither the warning nor its name).
#if defined(__GNUC__) && !defined(__clang__)
#define TRANSPORT_AVX512_BEGIN                                 \
  _Pragma("GCC diagnostic push")                              \
  _Pragma("GCC diagnostic ignored \"-Wmaybe-uninitialized\"") \
  _Pragma("GCC diagnostic ignored \"-Wuninitialized\"")
#define TRANSPORT_AVX512_END _Pragma("GCC diagnostic pop")
#else
#define TRANSPORT_AVX512_BEGIN
#define TRANSPORT_AVX512_END
#endif

TRANSPORT_AVX512_BEGIN

__attribute__((target(TRANSPORT_AVX512))) inline __m512i mix16_avx512(__m512i x, __m512i h) {
  __m512i y = _mm512_mullo_epi32(_mm512_xor_si512(x, h), _mm512_set1_epi32(static_cast<int>(kMix)));
  return _mm512_xor_si512(y, _mm512_srli_epi32(y, 15));
}

__attribute__((target(TRANSPORT_AVX512))) inline __m512i add16_avx512(__m512i acc, __m512i y) {
  acc = _mm512_add_epi64(acc, _mm512_cvtepu32_epi64(_mm512_castsi512_si256(y)));
  return _mm512_add_epi64(acc, _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(y, 1)));
}

TRANSPORT_AVX512_END

#endif  // TRANSPORT_DELTA_X86

}  // namespace transport::delta::detail
