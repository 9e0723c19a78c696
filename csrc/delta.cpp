// Delta sync on the CPU (see delta.h): the diff is a streaming compare of two tensors that also
// copies the fresh one into the publisher's snapshot and checksums it, so a delta costs one pass
// over memory the dense snapshot pass touches anyway. The vector paths (AVX2, AVX-512BW) are
// compiled with target attributes and picked at run time, so the extension runs on any x86-64
// (and elsewhere, on the scalar path).
#include "delta.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <stdexcept>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TRANSPORT_DELTA_X86 1
#endif

namespace transport::delta {
namespace {

constexpr uint32_t kIndexMul = 0x9E3779B9u;
constexpr uint32_t kMix = 0x85EBCA6Bu;
constexpr uint64_t kStreamMin = 1 << 20;  // bytes of snapshot from which stores stream
constexpr uint64_t kCheckEvery = 1 << 16;  // elements between two looks at the running density
// Bytes ahead of the compare loops to prefetch both streams: one core alone does not keep enough
// loads in flight to read two streams at memory speed (a core's diff of 200 MB against 200 MB
// took a fifth less with it; a prefetch past the end of a buffer is harmless).
constexpr uint64_t kPrefetch = 2048;

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

// Scratch that grows and is kept per thread: the encoders run on the publisher's copy threads.
uint8_t* scratch(int which, uint64_t nbytes) {
  thread_local std::unique_ptr<uint8_t[]> bufs[2];
  thread_local uint64_t caps[2] = {0, 0};
  if (caps[which] < nbytes) {
    bufs[which].reset(new uint8_t[nbytes]);
    caps[which] = nbytes;
  }
  return bufs[which].get();
}

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

// Collects the changed elements: values straight into the output (up to its capacity), the
// varint positions and the bitmask into scratch. Past the capacity only the count goes on.
struct Emitter {
  int es;
  uint8_t* vals;
  uint64_t vcap;
  uint8_t* var;
  uint64_t varcap;
  uint8_t* mask;
  uint64_t vmax;  // values that fit vcap
  const uint8_t* base;
  uint64_t n;
  uint64_t count = 0;
  uint64_t sum_old = 0;  // mix() of the base values at the changed positions (all of them)
  uint64_t sum_new = 0;  // mix() of the fresh values there: new checksum = base's - old + new
  uint64_t next_check = kCheckEvery;
  uint64_t varlen = 0;
  uint64_t last = 0;  // the previous position + 1
  bool vover = false;
  bool varover = false;

  inline void one(uint64_t pos, const uint8_t* elem) {
    sum_old += mix(load_elem(base + pos * es, es), pos);
    sum_new += mix(load_elem(elem, es), pos);
    if (count < vmax && !vover) {
      std::memcpy(vals + count * es, elem, es == 2 ? 2 : 4);
    } else {
      vover = true;
    }
    ++count;
    if (varover) return;
    gap(pos);
  }

  inline void gap(uint64_t pos) {
    if (varlen + 10 > varcap) {
      varover = true;
      return;
    }
    varlen += put_varint(var + varlen, pos - last);
    last = pos + 1;
  }

  // ``bits`` flags the changed elements among the ``lanes`` at index ``i`` (elements at fresh).
  inline void many(uint64_t bits, uint64_t i, const uint8_t* fresh) {
    if (i >= next_check && !vover) {
      // Far past the crossover already (a quarter more changes than the budget allows at this
      // point): the tensor goes dense, so stop encoding and only count.
      next_check = i + kCheckEvery;
      if (i >= n / 16 && static_cast<double>(count) > 1.25 * static_cast<double>(vmax) * static_cast<double>(i) /
                                                          static_cast<double>(n))
        vover = true;
    }
    while (bits) {
      int t = __builtin_ctzll(bits);
      one(i + t, fresh + (i + t) * es);
      bits &= bits - 1;
    }
  }
};

// The elements [from, n) one by one: compare, copy, checksum, bitmask bits (from is a
// multiple of 8, so the tail starts on a bitmask byte of its own).
uint64_t tail(const uint8_t* f, const uint8_t* b, uint8_t* s, uint64_t from, uint64_t n, int es, Emitter* em) {
  uint64_t sum = 0;
  if (em != nullptr && from < n) std::memset(em->mask + from / 8, 0, (n - from + 7) / 8);
  for (uint64_t i = from; i < n; ++i) {
    const uint8_t* e = f + i * es;
    uint32_t x = load_elem(e, es);
    if (s != nullptr) std::memcpy(s + i * es, e, es);
    if (em == nullptr) sum += mix(x, i);
    if (em != nullptr && x != load_elem(b + i * es, es)) {
      em->mask[i / 8] |= static_cast<uint8_t>(1u << (i % 8));
      em->one(i, e);
    }
  }
  return sum;
}

uint64_t run_scalar(const uint8_t* f, const uint8_t* b, uint8_t* s, uint64_t n, int es, uint64_t first, Emitter* em) {
  // Indices in the checksum are first-based; positions and bitmask bits are 0-based.
  if (first == 0) return tail(f, b, s, 0, n, es, em);
  uint64_t sum = 0;
  for (uint64_t i = 0; i < n; ++i) {
    const uint8_t* e = f + i * es;
    if (s != nullptr) std::memcpy(s + i * es, e, es);
    sum += mix(load_elem(e, es), first + i);
  }
  return sum;
}

#ifdef TRANSPORT_DELTA_X86

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

// 32 bytes a step: 16 bf16/fp16 or 8 fp32 elements.
template <int ES>
__attribute__((target("avx2"))) uint64_t run_avx2(const uint8_t* f, const uint8_t* b, uint8_t* s, uint64_t n,
                                                  uint64_t first, Emitter* em) {
  constexpr uint64_t kLanes = 32 / ES;
  const uint64_t body = n / kLanes * kLanes;
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i step8 = _mm256_set1_epi32(static_cast<int>(8u * kIndexMul));
  const __m256i stepk = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(kLanes) * kIndexMul));
  __m256i h0 = _mm256_mullo_epi32(_mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(first))),
                                                   lane),
                                  _mm256_set1_epi32(static_cast<int>(kIndexMul)));
  __m256i acc = _mm256_setzero_si256();
  const bool stream = s != nullptr && reinterpret_cast<uintptr_t>(s) % 32 == 0 && n * ES >= kStreamMin;
  for (uint64_t i = 0; i < body; i += kLanes) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(f + i * ES));
    if (s != nullptr) {
      if (stream) {
        _mm256_stream_si256(reinterpret_cast<__m256i*>(s + i * ES), a);
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(s + i * ES), a);
      }
    }
    if (em == nullptr) {  // with a base, only the changes are hashed (by the emitter)
      if constexpr (ES == 2) {
        __m256i h1 = _mm256_add_epi32(h0, step8);
        acc = add8_avx2(acc, mix8_avx2(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(a)), h0));
        acc = add8_avx2(acc, mix8_avx2(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(a, 1)), h1));
      } else {
        acc = add8_avx2(acc, mix8_avx2(a, h0));
      }
      h0 = _mm256_add_epi32(h0, stepk);
    }
    if (em != nullptr) {
      __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + i * ES));
      uint32_t ne;
      if constexpr (ES == 2) {
        __m256i eq = _mm256_cmpeq_epi16(a, c);
        ne = ~static_cast<uint32_t>(_mm_movemask_epi8(
                 _mm_packs_epi16(_mm256_castsi256_si128(eq), _mm256_extracti128_si256(eq, 1)))) & 0xFFFFu;
        uint16_t m16 = static_cast<uint16_t>(ne);
        std::memcpy(em->mask + i / 8, &m16, 2);
      } else {
        ne = ~static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(a, c)))) & 0xFFu;
        em->mask[i / 8] = static_cast<uint8_t>(ne);
      }
      if (ne) em->many(ne, i, f);
    }
  }
  if (stream) _mm_sfence();
  uint64_t sum = hsum_avx2(acc);
  if (first == 0) return sum + tail(f, b, s, body, n, ES, em);
  for (uint64_t i = body; i < n; ++i) {
    if (s != nullptr) std::memcpy(s + i * ES, f + i * ES, ES);
    sum += mix(load_elem(f + i * ES, ES), first + i);
  }
  return sum;
}

#define TRANSPORT_AVX512 "avx512f,avx512bw,avx512vl,avx512vbmi2,avx2,bmi2"
// GCC 12 flags the self-initialised placeholder inside its own _mm512_undefined_*() (used by the
// unmasked AVX-512 intrinsics) as maybe uninitialised: a false positive in its headers.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

__attribute__((target(TRANSPORT_AVX512))) inline __m512i mix16_avx512(__m512i x, __m512i h) {
  __m512i y = _mm512_mullo_epi32(_mm512_xor_si512(x, h), _mm512_set1_epi32(static_cast<int>(kMix)));
  return _mm512_xor_si512(y, _mm512_srli_epi32(y, 15));
}

__attribute__((target(TRANSPORT_AVX512))) inline __m512i add16_avx512(__m512i acc, __m512i y) {
  acc = _mm512_add_epi64(acc, _mm512_cvtepu32_epi64(_mm512_castsi512_si256(y)));
  return _mm512_add_epi64(acc, _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(y, 1)));
}

// The changed elements of a run of blocks, packed: fresh and base values and their indices
// (from the batch's first block, at ``start``), with a vector's slack past kCap for the
// full-width stores.
struct Batch {
  static constexpr uint64_t kCap = 4096;
  alignas(64) uint8_t fresh[(kCap + 32) * 4];
  alignas(64) uint8_t base[(kCap + 32) * 4];
  alignas(64) uint32_t index[kCap + 32];
  uint64_t fill = 0;
  uint64_t start = 0;
};

// Appends the LEB128 gaps of 16 changed positions (``live`` lanes of ``pos``, relative to
// ``start``) to the emitter's varints. Gaps under 2**14 (one or two bytes) are built in the
// lanes and packed by one byte compress; a group with a longer gap goes one by one.
__attribute__((target(TRANSPORT_AVX512))) inline void varints16(Emitter* em, __m512i pos, __mmask16 live,
                                                               uint64_t start) {
  if (em->varover) return;
  const uint64_t first = start + static_cast<uint32_t>(_mm_cvtsi128_si32(_mm512_castsi512_si128(pos)));
  const unsigned lanes = static_cast<unsigned>(__builtin_popcount(live));
  if (em->varlen + 2 * 16 + 10 > em->varcap || em->varlen > em->n / 8) {  // or past the bitmask's size
    em->varover = true;
    return;
  }
  // Lane j's predecessor is lane j - 1; lane 0's is the last position emitted (as an index
  // from start: mod 2**32, exact whenever the gap itself is below 2**32, checked below).
  const __m512i prev = _mm512_alignr_epi32(pos, _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(
                                                     em->last - 1 - start))), 15);
  const __m512i gap = _mm512_maskz_sub_epi32(live, _mm512_sub_epi32(pos, prev), _mm512_set1_epi32(1));
  if (first - em->last >= (uint64_t{1} << 14) || _mm512_mask_cmpge_epu32_mask(live, gap, _mm512_set1_epi32(1 << 14))) {
    alignas(64) uint32_t p[16];
    _mm512_store_si512(p, pos);
    for (unsigned j = 0; j < lanes; ++j) em->gap(start + p[j]);
    return;
  }
  const __mmask16 two = _mm512_mask_cmpge_epu32_mask(live, gap, _mm512_set1_epi32(0x80));
  const __m512i lo = _mm512_or_si512(_mm512_and_si512(gap, _mm512_set1_epi32(0x7f)),
                                     _mm512_maskz_mov_epi32(two, _mm512_set1_epi32(0x80)));
  const __m256i words = _mm512_cvtepi32_epi16(_mm512_or_si512(lo, _mm512_slli_epi32(_mm512_srli_epi32(gap, 7), 8)));
  // Byte 2j (the low one) of every live lane, byte 2j + 1 where the gap takes two.
  const uint32_t keep = static_cast<uint32_t>(_pdep_u32(live, 0x55555555u) | _pdep_u32(two, 0xAAAAAAAAu));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(em->var + em->varlen), _mm256_maskz_compress_epi8(keep, words));
  em->varlen += static_cast<uint64_t>(__builtin_popcount(keep));
  alignas(64) uint32_t p[16];
  _mm512_store_si512(p, pos);
  em->last = start + p[lanes - 1] + 1;
}

// Hashes the batch into the running sums (fresh terms into acc, base terms into old), moves
// its fresh values into the payload while they fit and its positions into the varints, then
// empties it.
template <int ES>
__attribute__((target(TRANSPORT_AVX512))) void flush_avx512(Batch& batch, Emitter* em, __m512i* acc, __m512i* old) {
  const uint64_t k = batch.fill;
  if (k == 0) return;
  const __m512i at = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(batch.start)));
  for (uint64_t j = 0; j < k; j += 16) {
    const __mmask16 live = j + 16 <= k ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (k - j)) - 1);
    const __m512i pos = _mm512_maskz_loadu_epi32(live, batch.index + j);
    const __m512i key = _mm512_mullo_epi32(_mm512_add_epi32(pos, at), _mm512_set1_epi32(static_cast<int>(kIndexMul)));
    __m512i x, y;
    if constexpr (ES == 2) {
      x = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, batch.fresh + j * 2));
      y = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, batch.base + j * 2));
    } else {
      x = _mm512_maskz_loadu_epi32(live, batch.fresh + j * 4);
      y = _mm512_maskz_loadu_epi32(live, batch.base + j * 4);
    }
    *acc = add16_avx512(*acc, _mm512_maskz_mov_epi32(live, mix16_avx512(x, key)));
    *old = add16_avx512(*old, _mm512_maskz_mov_epi32(live, mix16_avx512(y, key)));
    varints16(em, pos, live, batch.start);
  }
  if (!em->vover && em->count + k <= em->vmax) {
    std::memcpy(em->vals + em->count * ES, batch.fresh, k * ES);
  } else {
    em->vover = true;
  }
  em->count += k;
  batch.fill = 0;
}

// 64 bytes a step: 32 bf16/fp16 or 16 fp32 elements.
template <int ES>
__attribute__((target(TRANSPORT_AVX512))) uint64_t run_avx512(const uint8_t* f, const uint8_t* b, uint8_t* s,
                                                               uint64_t n, uint64_t first, Emitter* em) {
  constexpr uint64_t kLanes = 64 / ES;
  const uint64_t body = n / kLanes * kLanes;
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step16 = _mm512_set1_epi32(static_cast<int>(16u * kIndexMul));
  const __m512i stepk = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(kLanes) * kIndexMul));
  __m512i h0 = _mm512_mullo_epi32(_mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(first))),
                                                   lane),
                                  _mm512_set1_epi32(static_cast<int>(kIndexMul)));
  __m512i acc = _mm512_setzero_si512();
  __m512i old = _mm512_setzero_si512();  // checksum terms of the base values at the changes
  Batch batch;  // on the stack (40 KB): a thread_local costs a call per access in a shared library
  uint8_t* const bfresh = batch.fresh;  // locals: stores through byte pointers alias everything
  uint8_t* const bbase = batch.base;
  uint32_t* const bindex = batch.index;
  uint64_t fill = 0, start = 0;  // start: the index of the batch's first block
  uint8_t* const mask = em != nullptr ? em->mask : nullptr;
  uint64_t next_check = em != nullptr ? em->next_check : 0;
  // The snapshot is far larger than the cache and written whole: streaming stores skip reading
  // each line before writing it (an aligned destination only).
  const bool stream = s != nullptr && reinterpret_cast<uintptr_t>(s) % 64 == 0 && n * ES >= kStreamMin;
  for (uint64_t i = 0; i < body; i += kLanes) {
    __m512i a = _mm512_loadu_si512(f + i * ES);
    if (em != nullptr) {
      _mm_prefetch(reinterpret_cast<const char*>(f + i * ES + kPrefetch), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(b + i * ES + kPrefetch), _MM_HINT_T0);
    }
    if (s != nullptr) {
      if (stream) {
        _mm512_stream_si512(reinterpret_cast<__m512i*>(s + i * ES), a);
      } else {
        _mm512_storeu_si512(s + i * ES, a);
      }
    }
    if (em == nullptr) {
      const __m512i hb = h0;  // the checksum keys of this block's elements
      h0 = _mm512_add_epi32(h0, stepk);
      if constexpr (ES == 2) {
        acc = add16_avx512(acc, mix16_avx512(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(a)), hb));
        acc = add16_avx512(acc, mix16_avx512(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(a, 1)),
                                             _mm512_add_epi32(hb, step16)));
      } else {
        acc = add16_avx512(acc, mix16_avx512(a, hb));
      }
      continue;
    }
    __m512i c = _mm512_loadu_si512(b + i * ES);
    uint64_t ne;
    if constexpr (ES == 2) {
      uint32_t m = _mm512_cmpneq_epi16_mask(a, c);
      std::memcpy(mask + i / 8, &m, 4);
      ne = m;
    } else {
      uint16_t m = _mm512_cmpneq_epi32_mask(a, c);
      std::memcpy(mask + i / 8, &m, 2);
      ne = m;
    }
    // No branch on whether the block changed: at the densities deltas pay (a few percent)
    // about half the blocks hold a change, at random, so a branch would mispredict every other
    // block; the compresses below pack nothing for an unchanged one.
    const uint64_t k = static_cast<uint64_t>(__builtin_popcountll(ne));
    if (i >= next_check && !em->vover) {
      next_check = i + kCheckEvery;
      if (i >= n / 16 && static_cast<double>(em->count + fill) >
                             1.25 * static_cast<double>(em->vmax) * static_cast<double>(i) / static_cast<double>(n))
        em->vover = true;  // far past the crossover: dense; only count and hash from here
    }
    // The changed lanes' fresh and base values and indices are packed into the batch
    // (register compresses, full-width stores into slack); they are hashed and their varints
    // made 16 at a time when it fills, so that work costs per changed element, not per block.
    const __m512i ib = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(i - start))), lane);
    if constexpr (ES == 2) {
      const __mmask16 m0 = static_cast<__mmask16>(ne), m1 = static_cast<__mmask16>(ne >> 16);
      _mm512_storeu_si512(bfresh + fill * 2, _mm512_maskz_compress_epi16(static_cast<__mmask32>(ne), a));
      _mm512_storeu_si512(bbase + fill * 2, _mm512_maskz_compress_epi16(static_cast<__mmask32>(ne), c));
      _mm512_storeu_si512(bindex + fill, _mm512_maskz_compress_epi32(m0, ib));
      _mm512_storeu_si512(bindex + fill + __builtin_popcount(m0),
                          _mm512_maskz_compress_epi32(m1, _mm512_add_epi32(ib, _mm512_set1_epi32(16))));
    } else {
      const __mmask16 m0 = static_cast<__mmask16>(ne);
      _mm512_storeu_si512(bfresh + fill * 4, _mm512_maskz_compress_epi32(m0, a));
      _mm512_storeu_si512(bbase + fill * 4, _mm512_maskz_compress_epi32(m0, c));
      _mm512_storeu_si512(bindex + fill, _mm512_maskz_compress_epi32(m0, ib));
    }
    fill += k;
    // Full, or its indices (from start, 32 bits) about to run out: a tensor past 2**31 elements.
    if (fill + kLanes > Batch::kCap || i + kLanes - start >= (uint64_t{1} << 31)) {
      batch.fill = fill;
      batch.start = start;
      flush_avx512<ES>(batch, em, &acc, &old);
      fill = 0;
      start = i + kLanes;
    }
  }
  batch.fill = fill;
  batch.start = start;
  if (em != nullptr) flush_avx512<ES>(batch, em, &acc, &old);
  if (stream) _mm_sfence();
  uint64_t sum = static_cast<uint64_t>(_mm512_reduce_add_epi64(acc));
  if (em != nullptr) {  // with a base: acc holds the fresh terms of the changed lanes
    em->sum_old += static_cast<uint64_t>(_mm512_reduce_add_epi64(old));
    em->sum_new += sum;
    sum = 0;
  }
  if (first == 0) return sum + tail(f, b, s, body, n, ES, em);
  for (uint64_t i = body; i < n; ++i) {
    if (s != nullptr) std::memcpy(s + i * ES, f + i * ES, ES);
    sum += mix(load_elem(f + i * ES, ES), first + i);
  }
  return sum;
}

// The bitmask scatter, 64 bytes of the tensor a step: one expand-load of the block's new values
// and one masked store; the new values' checksum terms by masked lanes. The bitmask's size, tail
// and popcount are checked by the caller; the running count is checked again here before every
// load (the payload is a peer's memory), and stores never leave [0, n).
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
  uint64_t sum = static_cast<uint64_t>(_mm512_reduce_add_epi64(acc));
  for (uint64_t i = body; i < n; ++i) {
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
  for (i = r.refusal == kOk ? body : n; i < n; ++i) {
    if (!((mask[i / 8] >> (i % 8)) & 1)) continue;
    if (k >= count) {
      r.refusal = kCountMismatch;
      break;
    }
    apply_at<ES>(l, i, vals, k, undo, &r);
    ++k;
  }
  if (r.refusal == kOk && k != count) r.refusal = kCountMismatch;
  r.stored = k;
  return r;
}

#pragma GCC diagnostic pop
#endif  // TRANSPORT_DELTA_X86

// Reads the LEB128 gap at pos + *at (pos_bytes in all, a peer's bytes) and moves *at past it.
// One- and two-byte gaps (nearly all of them) take a short path while ten bytes are left.
inline int next_gap(const uint8_t* pos, uint64_t pos_bytes, uint64_t* at, uint64_t* gap) {
  uint64_t a = *at;
  if (a + 10 <= pos_bytes) {
    const uint8_t b0 = pos[a];
    if (b0 < 0x80) {
      *gap = b0;
      *at = a + 1;
      return kOk;
    }
    const uint8_t b1 = pos[a + 1];
    if (b1 < 0x80) {
      *gap = (b0 & 0x7fu) | static_cast<uint64_t>(b1) << 7;
      *at = a + 2;
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

// Walks the positions of a sparse payload (pos: its position bytes, in memory nobody else
// writes), each checked against n before visit(k, p) is called for the k-th. Returns the
// refusal; the positions visited before a refusal are the first ones, in order, whoever walks
// the same bytes again (undo relies on that).
template <typename Visit>
int walk_positions(const uint8_t* pos, uint64_t pos_bytes, uint32_t kind, uint64_t n, uint64_t count, Visit&& visit) {
  if (kind == kVarint) {
    uint64_t at = 0, next = 0;  // next: the smallest position the next gap may name
    for (uint64_t k = 0; k < count; ++k) {
      uint64_t gap = 0;
      const int refusal = next_gap(pos, pos_bytes, &at, &gap);
      if (refusal != kOk) return refusal;
      if (gap >= n || next > n - 1 - gap) return kOutOfRange;  // next + gap would be >= n
      const uint64_t p = next + gap;
      visit(k, p);
      next = p + 1;
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

// The bitmask's own checks, before any position is visited: its size, no bit past n, exactly
// count bits set.
int check_bitmask(const uint8_t* pos, uint64_t pos_bytes, uint64_t n, uint64_t count) {
  if (pos_bytes != (n + 7) / 8) return kBadBitmask;
  if (n % 8 != 0 && (pos[pos_bytes - 1] >> (n % 8)) != 0) return kBadBitmask;
  uint64_t total = 0;
  for (uint64_t i = 0; i < pos_bytes; ++i) total += static_cast<uint64_t>(__builtin_popcount(pos[i]));
  return total == count ? kOk : kCountMismatch;
}

// The stores of a payload into live (n elements), every position checked before its store.
template <int ES>
int store_all(uint8_t* l, uint64_t n, const uint8_t* vals, uint32_t kind, uint64_t count, const uint8_t* pos,
              uint64_t pos_bytes) {
  return walk_positions(pos, pos_bytes, kind, n, count, [&](uint64_t k, uint64_t p) {
    // The positions ascend: the line a little ahead in the tensor is about to be stored to.
    __builtin_prefetch(l + p * ES + kPrefetch / 2, 1);
    std::memcpy(l + p * ES, vals + k * ES, ES);
  });
}

int resolve(int isa) {
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

void check_es(int es) {
  if (es != 2 && es != 4) throw std::invalid_argument("delta: element size must be 2 or 4, not " + std::to_string(es));
}

uint64_t run(const uint8_t* f, const uint8_t* b, uint8_t* s, uint64_t n, int es, uint64_t first, Emitter* em,
             int isa) {
  switch (resolve(isa)) {
#ifdef TRANSPORT_DELTA_X86
    case kAvx512:
      return es == 2 ? run_avx512<2>(f, b, s, n, first, em) : run_avx512<4>(f, b, s, n, first, em);
    case kAvx2:
      return es == 2 ? run_avx2<2>(f, b, s, n, first, em) : run_avx2<4>(f, b, s, n, first, em);
#endif
    default:
      return run_scalar(f, b, s, n, es, first, em);
  }
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

std::string best_isa() {
  switch (resolve(kAuto)) {
    case kAvx512:
      return "avx512";
    case kAvx2:
      return "avx2";
    default:
      return "scalar";
  }
}

uint64_t checksum(const void* p, uint64_t n, int es, uint64_t first, void* dst, int isa) {
  check_es(es);
  return run(static_cast<const uint8_t*>(p), nullptr, static_cast<uint8_t*>(dst), n, es, first, nullptr, isa);
}

EncodeResult encode(const void* fresh, const void* base, void* snap, uint64_t n, int es, void* out, uint64_t cap,
                    int isa) {
  check_es(es);
  const auto* f = static_cast<const uint8_t*>(fresh);
  auto* s = static_cast<uint8_t*>(snap);
  EncodeResult r{kDense, n, 0, 0, 0, 0, 0};
  if (base == nullptr) {
    r.checksum = run(f, nullptr, s, n, es, 0, nullptr, isa);
    return r;
  }
  const uint64_t mask_bytes = (n + 7) / 8;
  Emitter em{es, static_cast<uint8_t*>(out), cap, scratch(0, cap + 16), cap, scratch(1, mask_bytes + 8), cap / es,
             static_cast<const uint8_t*>(base), n};
  run(f, static_cast<const uint8_t*>(base), s, n, es, 0, &em, isa);
  r.changed = em.count;
  r.sum_old = em.sum_old;
  r.sum_new = em.sum_new;
  if (em.count == 0) {
    r.kind = kUnchanged;
    return r;
  }
  if (em.vover) return r;  // dense
  const uint64_t vbytes = align8(em.count * es);
  bool use_mask = em.varover || mask_bytes < em.varlen;
  uint64_t pos = use_mask ? mask_bytes : em.varlen;
  if (vbytes + pos > cap) return r;  // dense
  auto* o = static_cast<uint8_t*>(out);
  std::memset(o + em.count * es, 0, vbytes - em.count * es);
  std::memcpy(o + vbytes, use_mask ? em.mask : em.var, pos);
  r.kind = use_mask ? kBitmask : kVarint;
  r.payload_bytes = vbytes + pos;
  r.pos_bytes = pos;
  return r;
}

uint64_t sample_changed(const void* fresh, const void* base, uint64_t n, int es, uint64_t runs, uint64_t run,
                        int isa) {
  check_es(es);
  run = std::min(run, n);
  if (runs == 0 || run == 0) return 0;
  const auto* f = static_cast<const uint8_t*>(fresh);
  const auto* b = static_cast<const uint8_t*>(base);
  uint64_t changed = 0;
  for (uint64_t j = 0; j < runs; ++j) {
    const uint64_t at = runs == 1 ? 0 : (n - run) / (runs - 1) * j + (n - run) % (runs - 1) * j / (runs - 1);
    changed += encode(f + at * es, b + at * es, nullptr, run, es, nullptr, 0, isa).changed;
  }
  return changed;
}

ScatterResult scatter(void* live, uint64_t n, int es, const void* payload, uint64_t payload_len, uint32_t kind,
                      uint64_t count, uint64_t pos_bytes, bool write) {
  ScatterResult r{kOk, 0, 0};
  if (es != 2 && es != 4) return {kBadElemSize, 0, 0};
  if (kind != kVarint && kind != kBitmask) return {kBadKind, 0, 0};
  if (count == 0 || count > n || n > (UINT64_MAX >> 3)) return {kBadSize, 0, 0};
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
    if ((write || l == nullptr) && supports(kAvx512)) {
      const int vector = es == 2 ? scatter_mask_avx512<2>(l, n, vals, count, pos, write, &r.sum_new)
                                 : scatter_mask_avx512<4>(l, n, vals, count, pos, write, &r.sum_new);
      if (vector != kOk) return {vector, 0, 0};
      return r;
    }
#endif
  }
  if (write) {  // checked before: only the stores (the sums were taken by the check)
    const int refusal = es == 2 ? store_all<2>(l, n, vals, kind, count, pos, pos_bytes)
                                : store_all<4>(l, n, vals, kind, count, pos, pos_bytes);
    return {refusal, 0, 0};
  }
  const int refusal = walk_positions(pos, pos_bytes, kind, n, count, [&](uint64_t k, uint64_t p) {
    r.sum_new += mix(load_elem(vals + k * es, es), p);
    if (l != nullptr) r.sum_old += mix(load_elem(l + p * es, es), p);
  });
  if (refusal != kOk) return {refusal, 0, 0};
  return r;
}

namespace {

template <int ES>
ApplyResult apply_es(uint8_t* l, uint64_t n, const uint8_t* vals, uint32_t kind, uint64_t count, const uint8_t* pos,
                     uint64_t pos_bytes, uint8_t* undo) {
  ApplyResult r{kOk, 0, 0, 0};
  r.refusal = walk_positions(pos, pos_bytes, kind, n, count, [&](uint64_t k, uint64_t p) {
    __builtin_prefetch(l + p * ES + kPrefetch / 2, 1);  // the positions ascend
    apply_at<ES>(l, p, vals, k, undo, &r);
    r.stored = k + 1;
  });
  return r;
}

template <int ES>
void undo_es(uint8_t* l, uint64_t n, uint32_t kind, const uint8_t* pos, uint64_t pos_bytes, uint64_t stored,
             const uint8_t* undo) {
  walk_positions(pos, pos_bytes, kind, n, stored, [&](uint64_t k, uint64_t p) {
    std::memcpy(l + p * ES, undo + k * ES, ES);
  });
}

}  // namespace

ApplyResult apply(void* live, uint64_t n, int es, const void* payload, uint64_t payload_len, uint32_t kind,
                  uint64_t count, uint64_t pos_bytes, const void* pos, void* undo, int isa) {
  if (es != 2 && es != 4) return {kBadElemSize, 0, 0, 0};
  if (kind != kVarint && kind != kBitmask) return {kBadKind, 0, 0, 0};
  if (count == 0 || count > n || n > (UINT64_MAX >> 3)) return {kBadSize, 0, 0, 0};
  if (pos_bytes > payload_len || payload_len - pos_bytes != align8(count * es)) return {kBadSize, 0, 0, 0};
  if (live == nullptr || pos == nullptr || undo == nullptr) return {kBadSize, 0, 0, 0};
  if (kind == kBitmask) {
    const int refusal = check_bitmask(static_cast<const uint8_t*>(pos), pos_bytes, n, count);
    if (refusal != kOk) return {refusal, 0, 0, 0};
  }
  auto* l = static_cast<uint8_t*>(live);
  const auto* vals = static_cast<const uint8_t*>(payload);
  const auto* p = static_cast<const uint8_t*>(pos);
  auto* u = static_cast<uint8_t*>(undo);
#ifdef TRANSPORT_DELTA_X86
  if (kind == kBitmask && resolve(isa) == kAvx512)
    return es == 2 ? apply_mask_avx512<2>(l, n, vals, count, p, u) : apply_mask_avx512<4>(l, n, vals, count, p, u);
#else
  (void)isa;
#endif
  return es == 2 ? apply_es<2>(l, n, vals, kind, count, p, pos_bytes, u)
                 : apply_es<4>(l, n, vals, kind, count, p, pos_bytes, u);
}

void undo(void* live, uint64_t n, int es, uint32_t kind, const void* pos, uint64_t pos_bytes, uint64_t stored,
          const void* saved) {
  if ((es != 2 && es != 4) || (kind != kVarint && kind != kBitmask) || stored == 0) return;
  auto* l = static_cast<uint8_t*>(live);
  const auto* p = static_cast<const uint8_t*>(pos);
  const auto* u = static_cast<const uint8_t*>(saved);
  if (es == 2) {
    undo_es<2>(l, n, kind, p, pos_bytes, stored, u);
  } else {
    undo_es<4>(l, n, kind, p, pos_bytes, stored, u);
  }
}

// -- Deltas cut along byte runs (mesh sync) -----------------------------------------------

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
    sum += run(b + r[addr_col], nullptr, nullptr, static_cast<uint64_t>(r[2]) / 2, 2,
               static_cast<uint64_t>(r[pos_col]) / 2, nullptr, isa);
  }
  return sum;
}

}  // namespace transport::delta
