// The subscriber's side of delta sync (see delta.h): the bounds-checked scatter of an encoded
// delta into a live tensor, its one-pass apply (check, save for undo, store, sum) and the undo.
// Every byte of a payload is a peer's: each position is checked against n before its store, and
// each value is read once, so what is stored is what is summed. A bitmask payload goes a vector
// of elements at a time on AVX-512 and AVX2; varints, and bitmasks on the scalar path, one
// position at a time. The steps form (kVarstep) is read the same way: each step once, each
// escape once, an escape past the count the payload declared refused before it is stored.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "delta.h"
#include "delta_detail.h"

namespace transport::delta {
using namespace detail;

namespace {

template <int ES>
inline uint32_t load_es(const uint8_t* p) {
  if constexpr (ES == 2) {
    uint16_t v;
    std::memcpy(&v, p, 2);
    return v;
  } else {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
  }
}

template <int ES>
inline void store_es(uint8_t* p, uint32_t v) {
  if constexpr (ES == 2) {
    const uint16_t h = static_cast<uint16_t>(v);
    std::memcpy(p, &h, 2);
  } else {
    std::memcpy(p, &v, 4);
  }
}

// The one-pass apply (see apply()) of the k-th changed element, at position p: the live value
// saved to undo, the new value read once from vals (what is stored is what is summed, whatever
// the peer does), stored, and both added to the sums.
template <int ES>
inline void apply_at(uint8_t* l, uint64_t p, const uint8_t* vals, uint64_t k, uint8_t* undo, ApplyResult* r) {
  uint8_t* dst = l + p * ES;
  const uint32_t now = load_es<ES>(vals + k * ES);
  const uint32_t old = load_es<ES>(dst);
  store_es<ES>(undo + k * ES, old);
  store_es<ES>(dst, now);
  r->sum_old += mix(old, p);
  r->sum_new += mix(now, p);
}

// The elements [from, n) of a bitmask scatter one by one, after a vector walk that took k of the
// count values and summed their new terms into sum: the rest summed (and with write stored),
// then the count checked; *sum_new set on success. Returns the refusal.
template <int ES>
int scatter_mask_rest(uint8_t* l, uint64_t n, const uint8_t* vals, uint64_t count, const uint8_t* mask, bool write,
                      uint64_t from, uint64_t k, uint64_t sum, uint64_t* sum_new) {
  for (uint64_t i = from; i < n; ++i) {
    if (!((mask[i / 8] >> (i % 8)) & 1)) continue;
    if (k >= count) return kCountMismatch;
    sum += mix(load_elem(vals + k * ES, ES), i);
    if (write) std::memcpy(l + i * ES, vals + k * ES, ES);
    ++k;
  }
  if (k != count) return kCountMismatch;
  *sum_new = sum;
  return kOk;
}

// The elements [from, n) of a one-pass bitmask apply one by one (none once r is refused), after a
// vector walk that stored k of the count values; then the count checked and r->stored set.
template <int ES>
void apply_mask_rest(uint8_t* l, uint64_t n, const uint8_t* vals, uint64_t count, const uint8_t* mask,
                     uint8_t* undo, uint64_t from, uint64_t k, ApplyResult* r) {
  for (uint64_t i = r->refusal == kOk ? from : n; i < n; ++i) {
    if (!((mask[i / 8] >> (i % 8)) & 1)) continue;
    if (k >= count) {
      r->refusal = kCountMismatch;
      break;
    }
    apply_at<ES>(l, i, vals, k, undo, r);
    ++k;
  }
  if (r->refusal == kOk && k != count) r->refusal = kCountMismatch;
  r->stored = k;
}

#ifdef TRANSPORT_DELTA_X86
TRANSPORT_AVX512_BEGIN

// The bits of a bitmask for the vector of 64 / ES elements from element i (a multiple of it).
template <int ES>
inline uint64_t mask_bits(const uint8_t* mask, uint64_t i) {
  if constexpr (ES == 2) {
    uint32_t x;
    std::memcpy(&x, mask + i / 8, 4);
    return x;
  } else {
    uint16_t x;
    std::memcpy(&x, mask + i / 8, 2);
    return x;
  }
}

// The checksum keys (index * kIndexMul, as mix() takes them) of elements 0..15.
__attribute__((target(TRANSPORT_AVX512))) inline __m512i first_keys_avx512() {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_mullo_epi32(lane, _mm512_set1_epi32(static_cast<int>(kIndexMul)));
}

// acc plus the checksum terms of the elements of v at the set bits of m: ES-byte elements, one
// vector of 64 / ES of them whose first 16 have the keys h (the next 16 of 2-byte ones h + step16).
template <int ES>
__attribute__((target(TRANSPORT_AVX512))) inline __m512i add_terms_avx512(__m512i acc, __m512i v, uint64_t m,
                                                                          __m512i h, __m512i step16) {
  if constexpr (ES == 2) {
    const __m512i lo = mix16_avx512(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), h);
    const __m512i hi =
        mix16_avx512(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), _mm512_add_epi32(h, step16));
    acc = add16_avx512(acc, _mm512_maskz_mov_epi32(static_cast<__mmask16>(m), lo));
    return add16_avx512(acc, _mm512_maskz_mov_epi32(static_cast<__mmask16>(m >> 16), hi));
  } else {
    return add16_avx512(acc, _mm512_maskz_mov_epi32(static_cast<__mmask16>(m), mix16_avx512(v, h)));
  }
}

// The bitmask scatter, 64 bytes of the tensor a step: one expand-load of the block's new values
// and one masked store; the new values' checksum terms by masked lanes. The bitmask's size, tail
// and popcount are checked by the caller; the running count is checked again here before every
// load (the payload is a peer's memory), and stores never leave [0, n).
template <int ES>
__attribute__((target(TRANSPORT_AVX512))) int scatter_mask_avx512(uint8_t* l, uint64_t n, const uint8_t* vals,
                                                                  uint64_t count, const uint8_t* mask, bool write,
                                                                  uint64_t* sum_new) {
  constexpr uint64_t kLanes = 64 / ES;
  const uint64_t body = n / kLanes * kLanes;
  const __m512i step16 = _mm512_set1_epi32(static_cast<int>(16u * kIndexMul));
  const __m512i stepk = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(kLanes) * kIndexMul));
  __m512i h0 = first_keys_avx512();
  __m512i acc = _mm512_setzero_si512();
  uint64_t k = 0;
  for (uint64_t i = 0; i < body; i += kLanes) {
    const uint64_t m = mask_bits<ES>(mask, i);
    const __m512i hb = h0;
    h0 = _mm512_add_epi32(h0, stepk);
    if (!m) continue;
    const uint64_t pc = static_cast<uint64_t>(__builtin_popcountll(m));
    if (k + pc > count) return kCountMismatch;
    if constexpr (ES == 2) {
      const __m512i v = _mm512_maskz_expandloadu_epi16(static_cast<__mmask32>(m), vals + k * 2);
      if (write) _mm512_mask_storeu_epi16(l + i * 2, static_cast<__mmask32>(m), v);
      acc = add_terms_avx512<2>(acc, v, m, hb, step16);
    } else {
      const __m512i v = _mm512_maskz_expandloadu_epi32(static_cast<__mmask16>(m), vals + k * 4);
      if (write) _mm512_mask_storeu_epi32(l + i * 4, static_cast<__mmask16>(m), v);
      acc = add_terms_avx512<4>(acc, v, m, hb, step16);
    }
    k += pc;
  }
  return scatter_mask_rest<ES>(l, n, vals, count, mask, write, body, k,
                               static_cast<uint64_t>(_mm512_reduce_add_epi64(acc)), sum_new);
}

// The one-pass apply of a bitmask payload (see apply()), a vector of elements at a time: the
// live values at the set bits are saved to undo in position order (as the scalar walk saves
// them, so undo() restores them), the new values read once from vals, stored, and both summed.
// mask is the private copy apply() checked. stored: the positions stored to.
template <int ES>
__attribute__((target(TRANSPORT_AVX512))) ApplyResult apply_mask_avx512(uint8_t* l, uint64_t n, const uint8_t* vals,
                                                                        uint64_t count, const uint8_t* mask,
                                                                        uint8_t* undo) {
  constexpr uint64_t kLanes = 64 / ES;
  const uint64_t body = n / kLanes * kLanes;
  const __m512i step16 = _mm512_set1_epi32(static_cast<int>(16u * kIndexMul));
  const __m512i stepk = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(kLanes) * kIndexMul));
  __m512i h0 = first_keys_avx512();
  __m512i acc_new = _mm512_setzero_si512();
  __m512i acc_old = _mm512_setzero_si512();
  ApplyResult r{kOk, 0, 0, 0};
  uint64_t k = 0;
  uint64_t i = 0;
  for (; i < body; i += kLanes) {
    const uint64_t m = mask_bits<ES>(mask, i);
    const __m512i hb = h0;
    h0 = _mm512_add_epi32(h0, stepk);
    if (!m) continue;
    const uint64_t pc = static_cast<uint64_t>(__builtin_popcountll(m));
    if (k + pc > count) {
      r.refusal = kCountMismatch;
      break;
    }
    uint8_t* dst = l + i * ES;
    __builtin_prefetch(dst + kPrefetch, 1);
    const __m512i old = _mm512_loadu_si512(dst);  // the vector lies inside the tensor (i < body)
    __m512i v;
    if constexpr (ES == 2) {
      const auto mm = static_cast<__mmask32>(m);
      // Compressed in a register, then stored under a mask of the first pc lanes: a compress
      // straight to memory is microcoded on some CPUs (6x slower on this VM's AMD EPYC).
      _mm512_mask_storeu_epi16(undo + k * 2, static_cast<__mmask32>((uint64_t{1} << pc) - 1),
                               _mm512_maskz_compress_epi16(mm, old));
      v = _mm512_maskz_expandloadu_epi16(mm, vals + k * 2);
      _mm512_mask_storeu_epi16(dst, mm, v);
    } else {
      const auto mm = static_cast<__mmask16>(m);
      _mm512_mask_storeu_epi32(undo + k * 4, static_cast<__mmask16>((uint64_t{1} << pc) - 1),
                               _mm512_maskz_compress_epi32(mm, old));
      v = _mm512_maskz_expandloadu_epi32(mm, vals + k * 4);
      _mm512_mask_storeu_epi32(dst, mm, v);
    }
    acc_new = add_terms_avx512<ES>(acc_new, v, m, hb, step16);
    acc_old = add_terms_avx512<ES>(acc_old, old, m, hb, step16);
    k += pc;
  }
  r.sum_new = static_cast<uint64_t>(_mm512_reduce_add_epi64(acc_new));
  r.sum_old = static_cast<uint64_t>(_mm512_reduce_add_epi64(acc_old));
  apply_mask_rest<ES>(l, n, vals, count, mask, undo, body, k, &r);
  return r;
}

TRANSPORT_AVX512_END
#endif  // TRANSPORT_DELTA_X86

#ifdef TRANSPORT_DELTA_X86
// The bitmask paths for AVX2, a bitmask byte (8 elements) a step: it has neither expand-loads
// nor compresses nor 16-bit masked stores, so the new values are expanded and the saved live
// ones compressed by table (kLaneTables), and the vector of 8 is stored whole, its unchanged
// lanes as they were read (the vector lies inside the tensor: nothing outside it is written).
// The payload is a peer's memory: the values are loaded a vector at a time while one fits
// before vals_end (each value a step uses is read by that step's one load), else copied out
// first; the running count is checked before every load.

// The vector of 8 elements at p (ES == 2: in the low 128 bits).
template <int ES>
__attribute__((target("avx2"))) inline __m256i load8_avx2(const uint8_t* p) {
  if constexpr (ES == 2) return _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// The 8 values from vals (at most vals_end): a vector load while one fits, else the pc there.
template <int ES>
__attribute__((target("avx2"))) inline __m256i load8_avx2(const uint8_t* vals, const uint8_t* vals_end,
                                                          uint64_t pc) {
  if (vals + 8 * ES <= vals_end) return load8_avx2<ES>(vals);
  alignas(32) uint8_t tmp[32] = {};
  std::memcpy(tmp, vals, pc * ES);
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(tmp));
}

// The 32-bit lanes of the set bits of m (all ones).
__attribute__((target("avx2"))) inline __m256i lanes_of(unsigned m) {
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i b = _mm256_set1_epi32(static_cast<int>(m));
  return _mm256_cmpeq_epi32(_mm256_and_si256(b, bit), bit);
}

// v's 8 values moved by one mask's table operands (kLaneTables): lanes for 4-byte values
// (vpermd), bytes for 2-byte ones, in the low 128 bits (pshufb; the lanes it leaves, zero). With
// spread[m] the packed new values of a bitmask step go to their lanes; with kept[m] the values
// of the set lanes are packed first.
template <int ES>
__attribute__((target("avx2"))) inline __m256i permute8_avx2(__m256i v, const uint32_t* lanes, const uint8_t* bytes) {
  if constexpr (ES == 2) {
    return _mm256_castsi128_si256(
        _mm_shuffle_epi8(_mm256_castsi256_si128(v), _mm_load_si128(reinterpret_cast<const __m128i*>(bytes))));
  }
  return _mm256_permutevar8x32_epi32(v, _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes)));
}

// Stores v over the live vector at dst in the lanes on (32-bit lanes, all ones where on), the
// others as old holds them.
template <int ES>
__attribute__((target("avx2"))) inline void store8_avx2(uint8_t* dst, __m256i old, __m256i v, __m256i on) {
  if constexpr (ES == 2) {
    const __m128i on16 = _mm_packs_epi32(_mm256_castsi256_si128(on), _mm256_extracti128_si256(on, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                     _mm_blendv_epi8(_mm256_castsi256_si128(old), _mm256_castsi256_si128(v), on16));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_blendv_epi8(old, v, on));
  }
}

// Values of 8 elements (ES == 2: the low 128 bits) zero-extended to 32-bit lanes, for mix8_avx2.
template <int ES>
__attribute__((target("avx2"))) inline __m256i widen_avx2(__m256i v) {
  if constexpr (ES == 2) return _mm256_cvtepu16_epi32(_mm256_castsi256_si128(v));
  return v;
}

// The first pc of the packed values at dst: the whole vector of 8 (whole: dst has room for it),
// else the pc of them alone.
template <int ES>
__attribute__((target("avx2"))) inline void put8_avx2(uint8_t* dst, __m256i packed, uint64_t pc, bool whole) {
  if (whole) {
    if constexpr (ES == 2) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(packed));
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), packed);
    }
    return;
  }
  alignas(32) uint8_t tmp[32];
  _mm256_store_si256(reinterpret_cast<__m256i*>(tmp), packed);
  std::memcpy(dst, tmp, pc * ES);
}

// The walk of a bitmask by both AVX2 paths: a 32-bit word of it (32 elements) at a time, words
// with no bit set skipped, and each of a word's bytes (8 elements) a step taken by step(i, m,
// keys) without a branch on whether any of its bits is set (at the densities a bitmask is
// chosen for, a third of the bytes are zero at random: with a branch on them the walk took
// about 1.3x as long at 13% changed as at 30%); a byte with none stores its vector unchanged
// and adds nothing. Returns the first element past the walk (the tail from
// there goes one by one), or UINT64_MAX when step refused (returned false).
template <class Step>
__attribute__((target("avx2"))) inline uint64_t walk_mask_avx2(uint64_t n, const uint8_t* mask, Step&& step) {
  const uint64_t words = n / 32 * 32;
  const __m256i step8 = _mm256_set1_epi32(static_cast<int>(8u * kIndexMul));
  const __m256i step32 = _mm256_set1_epi32(static_cast<int>(32u * kIndexMul));
  __m256i h = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                 _mm256_set1_epi32(static_cast<int>(kIndexMul)));
  uint64_t i = 0;
  for (; i < words; i += 32) {
    uint32_t w;
    std::memcpy(&w, mask + i / 8, 4);
    if (w != 0) {
      __m256i hj = h;
      for (unsigned j = 0; j < 4; ++j, hj = _mm256_add_epi32(hj, step8)) {
        if (!step(i + 8 * j, (w >> (8 * j)) & 0xFFu, hj)) return UINT64_MAX;
      }
    }
    h = _mm256_add_epi32(h, step32);
  }
  for (; i + 8 <= n; i += 8, h = _mm256_add_epi32(h, step8)) {
    if (!step(i, mask[i / 8], h)) return UINT64_MAX;
  }
  return i;
}

// scatter_mask_avx512's form for AVX2: the sums of the new values at the set bits and, with
// write, their stores.
template <int ES>
__attribute__((target("avx2"))) int scatter_mask_avx2(uint8_t* l, uint64_t n, const uint8_t* vals,
                                                      const uint8_t* vals_end, uint64_t count, const uint8_t* mask,
                                                      bool write, uint64_t* sum_new) {
  __m256i acc = _mm256_setzero_si256();
  uint64_t k = 0;
  const uint64_t body = walk_mask_avx2(n, mask, [&](uint64_t i, unsigned m,
                                                            __m256i keys) __attribute__((target("avx2"))) {
    const uint64_t pc = static_cast<uint64_t>(__builtin_popcount(m));
    if (k + pc > count) return false;
    const __m256i on = lanes_of(m);
    const __m256i v = permute8_avx2<ES>(load8_avx2<ES>(vals + k * ES, vals_end, pc), kLaneTables.spread[m],
                                          kLaneTables.spread16[m]);
    if (write) store8_avx2<ES>(l + i * ES, load8_avx2<ES>(l + i * ES), v, on);
    acc = add8_avx2(acc, _mm256_and_si256(mix8_avx2(widen_avx2<ES>(v), keys), on));
    k += pc;
    return true;
  });
  if (body == UINT64_MAX) return kCountMismatch;
  return scatter_mask_rest<ES>(l, n, vals, count, mask, write, body, k, hsum_avx2(acc), sum_new);
}

// apply_mask_avx512's form for AVX2: the live values at the set bits saved to undo in position
// order, the new values read once, stored, and both summed. mask is the private copy apply()
// checked; stored: the positions stored to.
template <int ES>
__attribute__((target("avx2"))) ApplyResult apply_mask_avx2(uint8_t* l, uint64_t n, const uint8_t* vals,
                                                            const uint8_t* vals_end, uint64_t count,
                                                            const uint8_t* mask, uint8_t* undo) {
  __m256i acc_new = _mm256_setzero_si256();
  __m256i acc_old = _mm256_setzero_si256();
  ApplyResult r{kOk, 0, 0, 0};
  uint64_t k = 0;
  const uint64_t body = walk_mask_avx2(n, mask, [&](uint64_t i, unsigned m,
                                                            __m256i keys) __attribute__((target("avx2"))) {
    const uint64_t pc = static_cast<uint64_t>(__builtin_popcount(m));
    if (k + pc > count) return false;
    uint8_t* dst = l + i * ES;
    __builtin_prefetch(dst + kPrefetch, 1);
    const __m256i on = lanes_of(m);
    const __m256i old = load8_avx2<ES>(dst);
    const __m256i v = permute8_avx2<ES>(load8_avx2<ES>(vals + k * ES, vals_end, pc), kLaneTables.spread[m],
                                          kLaneTables.spread16[m]);
    // The saved values, packed: a whole vector's store where the undo area has room for it (its
    // lanes past pc are overwritten by the next step's), else the pc of them.
    const __m256i saved = permute8_avx2<ES>(old, kLaneTables.kept[m], kLaneTables.kept16[m]);
    put8_avx2<ES>(undo + k * ES, saved, pc, k + 8 <= count);
    store8_avx2<ES>(dst, old, v, on);
    acc_new = add8_avx2(acc_new, _mm256_and_si256(mix8_avx2(widen_avx2<ES>(v), keys), on));
    acc_old = add8_avx2(acc_old, _mm256_and_si256(mix8_avx2(widen_avx2<ES>(old), keys), on));
    k += pc;
    return true;
  });
  r.sum_new = hsum_avx2(acc_new);
  r.sum_old = hsum_avx2(acc_old);
  if (body == UINT64_MAX) r.refusal = kCountMismatch;
  apply_mask_rest<ES>(l, n, vals, count, mask, undo, body, k, &r);
  return r;
}
#endif  // TRANSPORT_DELTA_X86

// Reads the LEB128 gap at pos + *at (pos_bytes in all, a peer's bytes) and moves *at past it.
// One- and two-byte gaps (nearly all of them) take a short path while ten bytes are left.
inline int next_gap(const uint8_t* pos, uint64_t pos_bytes, uint64_t* at, uint64_t* gap) {
  uint64_t a = *at;
  if (a + 10 <= pos_bytes) {
    // One or two bytes without a branch on which: at 1-2% changed a quarter to a tenth of the
    // gaps take two, at random, and a branch on it mispredicted that often.
    const uint64_t b0 = pos[a], b1 = pos[a + 1];
    const uint64_t two = b0 >> 7;  // b0 continues
    if ((two & (b1 >> 7)) == 0) {
      *gap = (b0 & 0x7fu) | ((b1 << 7) & (0 - two));
      *at = a + 1 + two;
      return kOk;
    }
  }
  uint64_t g = 0;
  int shift = 0;
  while (true) {
    if (a >= pos_bytes) return kCountMismatch;
    const uint8_t byte = pos[a++];
    if (shift == 63 && (byte & 0x7e) != 0) return kBadVarint;
    g |= static_cast<uint64_t>(byte & 0x7f) << shift;
    if (!(byte & 0x80)) break;
    shift += 7;
    if (shift > 63) return kBadVarint;
  }
  *gap = g;
  *at = a;
  return kOk;
}

// The next position of a varint payload: the gap at pos + *at (read by next_gap), checked so
// that the position, *next + gap, lies in [0, n); *next then moves past it. *next is the
// smallest position the gap may name (0 at first).
inline int next_position(const uint8_t* pos, uint64_t pos_bytes, uint64_t n, uint64_t* at, uint64_t* next,
                         uint64_t* p) {
  uint64_t gap = 0;
  const int refusal = next_gap(pos, pos_bytes, at, &gap);
  if (refusal != kOk) return refusal;
  if (gap >= n || *next > n - 1 - gap) return kOutOfRange;  // next + gap would be >= n
  *p = *next + gap;
  *next = *p + 1;
  return kOk;
}

// Varint positions decoded ahead of their visit (walk_positions with an ahead), so that the
// lines of the live tensor they name are loaded while the ones before are visited: where
// changes lie hundreds of bytes apart at random the hardware's prefetch does not follow them
// and each visit waits on memory (0.5% of bf16 changed, on this VM: the one-pass apply took 40 ns
// a change, 1.5x the two-pass scatter, and 0.6x of that with them prefetched by position).
constexpr uint64_t kAheadBlock = 32;

// Whether count changes of n elements lie far enough apart (64 elements or more on average) to
// be prefetched by position. Denser changes touch most lines of the tensor in order, which the
// hardware prefetches by itself; there the blocks only cost (3% changed: up to 2x slower).
inline bool sparse_changes(uint64_t n, uint64_t count) { return n / 64 >= count; }

// Walks the positions of a sparse payload (pos: its position bytes, in memory nobody else
// writes), each checked against n before visit(k, p) is called for the k-th. Returns the
// refusal; the positions visited before a refusal are the first ones, in order, whoever walks
// the same bytes again (undo relies on that).
template <typename Visit>
int walk_positions(const uint8_t* pos, uint64_t pos_bytes, uint32_t kind, uint64_t n, uint64_t count, Visit&& visit) {
  if (kind == kVarint) {  // (one gap at a time: see walk_ahead for sparse changes)
    uint64_t at = 0, next = 0;
    for (uint64_t k = 0; k < count; ++k) {
      uint64_t p = 0;
      const int refusal = next_position(pos, pos_bytes, n, &at, &next, &p);
      if (refusal != kOk) return refusal;
      visit(k, p);
    }
    return at == pos_bytes ? kOk : kCountMismatch;
  }
  if (pos_bytes != (n + 7) / 8) return kBadBitmask;
  uint64_t k = 0;
  for (uint64_t i = 0; i < pos_bytes; ++i) {
    unsigned bits = pos[i];
    while (bits) {
      const uint64_t p = i * 8 + static_cast<uint64_t>(__builtin_ctz(bits));
      if (p >= n) return kOutOfRange;  // callers check the bitmask first: only a peer rewriting it
      if (k >= count) return kCountMismatch;
      visit(k, p);
      ++k;
      bits &= bits - 1;
    }
  }
  return k == count ? kOk : kCountMismatch;
}

// walk_positions of varint positions of sparse changes (sparse_changes), read a block
// (kAheadBlock) ahead of their visits, ahead(p) called for each as it is read. The same checks
// and the same order: the positions visited before a refusal are the first ones.
template <typename Visit, typename Ahead>
int walk_ahead(const uint8_t* pos, uint64_t pos_bytes, uint64_t n, uint64_t count, Visit&& visit, Ahead&& ahead) {
  uint64_t blocks[2][kAheadBlock];
  uint64_t at = 0, next = 0, read = 0;
  int refusal = kOk;
  auto fill = [&](uint64_t* block) {
    uint64_t m = 0;
    for (; m < kAheadBlock && read < count; ++m, ++read) {
      refusal = next_position(pos, pos_bytes, n, &at, &next, &block[m]);
      if (refusal != kOk) break;
      ahead(block[m]);
    }
    return m;
  };
  uint64_t k = 0, len = fill(blocks[0]);
  for (int cur = 0; len > 0; cur = 1 - cur) {
    const uint64_t following = refusal == kOk ? fill(blocks[1 - cur]) : 0;
    for (uint64_t j = 0; j < len; ++j) visit(k++, blocks[cur][j]);
    len = following;
  }
  if (refusal != kOk) return refusal;
  return at == pos_bytes ? kOk : kCountMismatch;
}

// walk_positions, or walk_ahead with ahead where the changes are sparse varints.
template <typename Visit, typename Ahead>
int walk_positions(const uint8_t* pos, uint64_t pos_bytes, uint32_t kind, uint64_t n, uint64_t count, Visit&& visit,
                   Ahead&& ahead) {
  if (kind == kVarint && sparse_changes(n, count)) return walk_ahead(pos, pos_bytes, n, count, visit, ahead);
  return walk_positions(pos, pos_bytes, kind, n, count, visit);
}

// The bits set in the n bytes at p, a word of 8 at a time. (This unit's generic code is built for
// any x86-64, which has no popcnt instruction: __builtin_popcount there is a libgcc call, which
// per byte of the bitmask took 6% of a 13%-changed apply.)
inline uint64_t bits_set(const uint8_t* p, uint64_t n) {
  uint64_t total = 0;
  for (uint64_t i = 0; i < n; i += 8) {
    uint64_t x = 0;
    std::memcpy(&x, p + i, std::min<uint64_t>(8, n - i));
    x -= (x >> 1) & 0x5555555555555555ull;
    x = (x & 0x3333333333333333ull) + ((x >> 2) & 0x3333333333333333ull);
    x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0Full;
    total += (x * 0x0101010101010101ull) >> 56;
  }
  return total;
}

// The bitmask's own checks, before any position is visited: its size, no bit past n, exactly
// count bits set.
int check_bitmask(const uint8_t* pos, uint64_t pos_bytes, uint64_t n, uint64_t count) {
  if (pos_bytes != (n + 7) / 8) return kBadBitmask;
  if (n % 8 != 0 && (pos[pos_bytes - 1] >> (n % 8)) != 0) return kBadBitmask;
  return bits_set(pos, pos_bytes) == count ? kOk : kCountMismatch;
}

// The layout of a kVarstep payload (delta.h): its escape count, read once from the peer's
// bytes and checked against count and the payload's size. Returns the refusal.
int steps_layout(const uint8_t* payload, uint64_t payload_len, uint64_t count, uint64_t pos_bytes, uint64_t* escapes) {
  if (pos_bytes > payload_len || payload_len - pos_bytes < 8) return kBadSize;
  uint64_t e = 0;
  std::memcpy(&e, payload, 8);
  if (e > count || payload_len - pos_bytes != align8(8 + count + 2 * e)) return kBadSize;  // (count <= n < 2**61)
  *escapes = e;
  return kOk;
}

// The new values of a kVarstep payload, in order: the k-th is the value it replaces plus step k
// (mod 2**16), or for an escape step the next escaped value. Every byte is read once (a peer's
// memory); an escape past the declared count makes it bad, and no value is given from then on.
struct StepValues {
  static constexpr bool kReadsOld = true;  // a step is added to the value it replaces
  const uint8_t* steps;
  const uint8_t* esc;
  uint64_t escapes;
  uint64_t used = 0;
  bool bad = false;

  // Whether the k-th new value, replacing old, is known (at *now).
  inline bool next(uint64_t k, uint32_t old, uint32_t* now) {
    const uint8_t step = steps[k];
    if (step != kEscape) {
      *now = static_cast<uint16_t>(old + static_cast<uint32_t>(static_cast<int32_t>(static_cast<int8_t>(step))));
      return true;
    }
    if (used >= escapes) {
      bad = true;
      return false;
    }
    uint16_t v;
    std::memcpy(&v, esc + 2 * used++, 2);
    *now = v;
    return true;
  }

  // Once every position was walked: an escape too many, or escapes left unread.
  int refusal() const { return bad ? kBadSteps : used != escapes ? kCountMismatch : kOk; }
};

// The new values of a payload of values: the k-th read once from vals (never refused).
template <int ES>
struct PlainValues {
  static constexpr bool kReadsOld = false;
  const uint8_t* vals;
  bool bad = false;

  inline bool next(uint64_t k, uint32_t /*old*/, uint32_t* now) const {
    *now = load_es<ES>(vals + k * ES);
    return true;
  }
  int refusal() const { return kOk; }
};

// The stores of a payload into live (n elements), every position checked before its store; the
// new values from values (PlainValues or StepValues).
template <int ES, class Values>
int store_all(uint8_t* l, uint64_t n, Values& values, uint32_t kind, uint64_t count, const uint8_t* pos,
              uint64_t pos_bytes) {
  const bool sparse = sparse_changes(n, count);
  const int refusal = walk_positions(
      pos, pos_bytes, kind, n, count,
      [&](uint64_t k, uint64_t p) {
        if (values.bad) return;
        // The positions ascend: the line a little ahead in the tensor is about to be stored to
        // (sparse ones were prefetched by position).
        if (!sparse) __builtin_prefetch(l + p * ES + kPrefetch / 2, 1);
        uint8_t* dst = l + p * ES;
        uint32_t now = 0;
        if (values.next(k, Values::kReadsOld ? load_es<ES>(dst) : 0, &now)) store_es<ES>(dst, now);
      },
      [&](uint64_t p) { __builtin_prefetch(l + p * ES, 1); });
  return refusal != kOk ? refusal : values.refusal();
}

// The sums of a payload's check without stores: over the new values at its positions and, with
// l not null, over the live values there (which a StepValues' new values need).
template <int ES, class Values>
int sum_all(const uint8_t* l, uint64_t n, Values& values, uint32_t kind, uint64_t count, const uint8_t* pos,
            uint64_t pos_bytes, ScatterResult* r) {
  const int refusal = walk_positions(
      pos, pos_bytes, kind, n, count,
      [&](uint64_t k, uint64_t p) {
        if (values.bad) return;
        const uint32_t old = l != nullptr ? load_es<ES>(l + p * ES) : 0;
        uint32_t now = 0;
        if (!values.next(k, old, &now)) return;
        r->sum_new += mix(now, p);
        if (l != nullptr) r->sum_old += mix(old, p);
      },
      [&](uint64_t p) {
        if (l != nullptr) __builtin_prefetch(l + p * ES, 0);
      });
  return refusal != kOk ? refusal : values.refusal();
}

// scatter() walked one position at a time: with write the stores (checked before: the sums were
// taken by the check), else the sums.
template <int ES, class Values>
ScatterResult scatter_es(uint8_t* l, uint64_t n, Values values, uint32_t kind, uint64_t count, const uint8_t* pos,
                         uint64_t pos_bytes, bool write) {
  ScatterResult r{kOk, 0, 0};
  const int refusal = write ? store_all<ES>(l, n, values, kind, count, pos, pos_bytes)
                            : sum_all<ES>(l, n, values, kind, count, pos, pos_bytes, &r);
  if (refusal != kOk) return {refusal, 0, 0};
  return write ? ScatterResult{kOk, 0, 0} : r;
}

// The one-pass apply (see apply()) walked one position at a time, the new values from values
// (PlainValues, or StepValues for a kVarstep payload, whose positions are varints): each live
// value saved to undo, the new one stored, both summed; stored counts the positions stored to,
// as undo() walks them.
template <int ES, class Values>
ApplyResult apply_es(uint8_t* l, uint64_t n, Values values, uint32_t kind, uint64_t count, const uint8_t* pos,
                     uint64_t pos_bytes, uint8_t* undo) {
  ApplyResult r{kOk, 0, 0, 0};
  const bool sparse = sparse_changes(n, count);
  r.refusal = walk_positions(
      pos, pos_bytes, kind, n, count,
      [&](uint64_t k, uint64_t p) {
        if (values.bad) return;
        if (!sparse) __builtin_prefetch(l + p * ES + kPrefetch / 2, 1);
        uint8_t* dst = l + p * ES;
        const uint32_t old = load_es<ES>(dst);
        uint32_t now = 0;
        if (!values.next(k, old, &now)) return;
        store_es<ES>(undo + k * ES, old);
        store_es<ES>(dst, now);
        r.sum_old += mix(old, p);
        r.sum_new += mix(now, p);
        r.stored = k + 1;
      },
      [&](uint64_t p) { __builtin_prefetch(l + p * ES, 1); });
  if (r.refusal == kOk) r.refusal = values.refusal();
  return r;
}

// Whether kind is a sparse kind elements of es bytes can take (kVarstep: 2-byte ones only).
inline bool sparse_kind(uint32_t kind, int es) {
  return kind == kVarint || kind == kBitmask || (kind == kVarstep && es == 2);
}

template <int ES>
void undo_es(uint8_t* l, uint64_t n, uint32_t kind, const uint8_t* pos, uint64_t pos_bytes, uint64_t stored,
             const uint8_t* undo) {
  walk_positions(pos, pos_bytes, kind, n, stored, [&](uint64_t k, uint64_t p) {
    std::memcpy(l + p * ES, undo + k * ES, ES);
  });
}

}  // namespace

ScatterResult scatter(void* live, uint64_t n, int es, const void* payload, uint64_t payload_len, uint32_t kind,
                      uint64_t count, uint64_t pos_bytes, bool write) {
  // scatter takes no isa: it runs on the default's (so TRANSPORT_DELTA_ISA holds here too).
  [[maybe_unused]] const int isa = resolve(kAuto);
  ScatterResult r{kOk, 0, 0};
  if (es != 2 && es != 4) return {kBadElemSize, 0, 0};
  if (!sparse_kind(kind, es)) return {kBadKind, 0, 0};
  if (count == 0 || count > n || n > (UINT64_MAX >> 3)) return {kBadSize, 0, 0};
  if (kind == kVarstep) {
    uint64_t escapes = 0;
    const int layout = steps_layout(static_cast<const uint8_t*>(payload), payload_len, count, pos_bytes, &escapes);
    if (layout != kOk) return {layout, 0, 0};
    if (live == nullptr) return {kBadSize, 0, 0};  // its new values are steps from the live ones
    const auto* steps = static_cast<const uint8_t*>(payload);
    return scatter_es<2>(static_cast<uint8_t*>(live), n, StepValues{steps + 8, steps + 8 + count, escapes}, kVarint,
                         count, steps + (payload_len - pos_bytes), pos_bytes, write);
  }
  const uint64_t vbytes = align8(count * es);
  if (pos_bytes > payload_len || payload_len - pos_bytes != vbytes) return {kBadSize, 0, 0};
  auto* l = static_cast<uint8_t*>(live);
  const auto* vals = static_cast<const uint8_t*>(payload);
  const auto* pos = vals + vbytes;
  if (write && l == nullptr) return {kBadSize, 0, 0};
  if (kind == kBitmask) {
    const int refusal = check_bitmask(pos, pos_bytes, n, count);
    if (refusal != kOk) return {refusal, 0, 0};
#ifdef TRANSPORT_DELTA_X86
    if ((write || l == nullptr) && (isa == kAvx512 || isa == kAvx2)) {
      const uint8_t* end = vals + vbytes;  // (vals_end: the positions follow in the payload)
      const int vector = isa == kAvx512
                             ? (es == 2 ? scatter_mask_avx512<2>(l, n, vals, count, pos, write, &r.sum_new)
                                        : scatter_mask_avx512<4>(l, n, vals, count, pos, write, &r.sum_new))
                             : (es == 2 ? scatter_mask_avx2<2>(l, n, vals, end, count, pos, write, &r.sum_new)
                                        : scatter_mask_avx2<4>(l, n, vals, end, count, pos, write, &r.sum_new));
      if (vector != kOk) return {vector, 0, 0};
      return r;
    }
#endif
  }
  return es == 2 ? scatter_es<2>(l, n, PlainValues<2>{vals}, kind, count, pos, pos_bytes, write)
                 : scatter_es<4>(l, n, PlainValues<4>{vals}, kind, count, pos, pos_bytes, write);
}

ApplyResult apply(void* live, uint64_t n, int es, const void* payload, uint64_t payload_len, uint32_t kind,
                  uint64_t count, uint64_t pos_bytes, const void* pos, void* undo, int isa) {
  if (es != 2 && es != 4) return {kBadElemSize, 0, 0, 0};
  if (!sparse_kind(kind, es)) return {kBadKind, 0, 0, 0};
  if (count == 0 || count > n || n > (UINT64_MAX >> 3)) return {kBadSize, 0, 0, 0};
  uint64_t escapes = 0;
  if (kind == kVarstep) {
    const int layout = steps_layout(static_cast<const uint8_t*>(payload), payload_len, count, pos_bytes, &escapes);
    if (layout != kOk) return {layout, 0, 0, 0};
  } else if (pos_bytes > payload_len || payload_len - pos_bytes != align8(count * es)) {
    return {kBadSize, 0, 0, 0};
  }
  if (live == nullptr || pos == nullptr || undo == nullptr) return {kBadSize, 0, 0, 0};
  if (kind == kBitmask) {
    const int refusal = check_bitmask(static_cast<const uint8_t*>(pos), pos_bytes, n, count);
    if (refusal != kOk) return {refusal, 0, 0, 0};
  }
  auto* l = static_cast<uint8_t*>(live);
  const auto* vals = static_cast<const uint8_t*>(payload);
  const auto* p = static_cast<const uint8_t*>(pos);
  auto* u = static_cast<uint8_t*>(undo);
  if (kind == kVarstep) {
    return apply_es<2>(l, n, StepValues{vals + 8, vals + 8 + count, escapes}, kVarint, count, p, pos_bytes, u);
  }
#ifdef TRANSPORT_DELTA_X86
  if (kind == kBitmask) {
    const int vector = resolve(isa);
    if (vector == kAvx512)
      return es == 2 ? apply_mask_avx512<2>(l, n, vals, count, p, u) : apply_mask_avx512<4>(l, n, vals, count, p, u);
    const uint8_t* end = vals + align8(count * es);  // the values' end (the positions may lie elsewhere)
    if (vector == kAvx2)
      return es == 2 ? apply_mask_avx2<2>(l, n, vals, end, count, p, u)
                     : apply_mask_avx2<4>(l, n, vals, end, count, p, u);
  }
#else
  (void)isa;
#endif
  return es == 2 ? apply_es<2>(l, n, PlainValues<2>{vals}, kind, count, p, pos_bytes, u)
                 : apply_es<4>(l, n, PlainValues<4>{vals}, kind, count, p, pos_bytes, u);
}

void undo(void* live, uint64_t n, int es, uint32_t kind, const void* pos, uint64_t pos_bytes, uint64_t stored,
          const void* saved) {
  if ((es != 2 && es != 4) || !sparse_kind(kind, es) || stored == 0) return;
  if (kind == kVarstep) kind = kVarint;  // (its positions)
  auto* l = static_cast<uint8_t*>(live);
  const auto* p = static_cast<const uint8_t*>(pos);
  const auto* u = static_cast<const uint8_t*>(saved);
  if (es == 2) {
    undo_es<2>(l, n, kind, p, pos_bytes, stored, u);
  } else {
    undo_es<4>(l, n, kind, p, pos_bytes, stored, u);
  }
}

uint64_t apply_many(const uint64_t* rows, uint64_t count, uint64_t* results, uint64_t* next, uint64_t* taken, int isa) {
  uint64_t k = 0;
  for (;;) {
    const uint64_t i = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED);  // each row is claimed once
    if (i >= count) break;
    const uint64_t* r = rows + kApplyRow * i;
    const auto* payload = reinterpret_cast<const uint8_t*>(r[3]);
    const uint64_t payload_len = r[4], pos_bytes = r[7];
    auto* pos = reinterpret_cast<void*>(r[8]);
    ApplyResult a{kBadSize, 0, 0, 0};
    if (pos_bytes <= payload_len && pos != nullptr) {
      std::memcpy(pos, payload + (payload_len - pos_bytes), pos_bytes);  // the positions, private from here on
      a = apply(reinterpret_cast<void*>(r[0]), r[1], static_cast<int>(r[2]), payload, payload_len,
                static_cast<uint32_t>(r[5]), r[6], pos_bytes, pos, reinterpret_cast<void*>(r[9]), isa);
    }
    uint64_t* out = results + kApplyResult * i;
    out[0] = static_cast<uint64_t>(a.refusal);
    out[1] = a.sum_old;
    out[2] = a.sum_new;
    out[3] = a.stored;
    taken[k++] = i;
  }
  return k;
}

}  // namespace transport::delta
