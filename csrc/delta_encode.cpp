// The publisher's pass (see delta.h): a streaming compare of two tensors that also copies the
// fresh one into the publisher's snapshot and checksums it, so a delta costs one pass over memory
// the dense snapshot pass touches anyway. Without a base the same pass is the checksum (with its
// copy) of delta_checksum.cpp. The vector paths (AVX2, AVX-512BW) are compiled with target
// attributes and picked at run time, so the extension runs on any x86-64 (and elsewhere, on the
// scalar path).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "delta.h"
#include "delta_detail.h"
#include "stream_copy.h"

namespace transport::delta {
using namespace detail;

namespace {

constexpr uint64_t kStreamMin = 1 << 20;  // bytes of snapshot from which stores stream
constexpr uint64_t kCheckEvery = 1 << 16;  // elements between two looks at the running density
constexpr uint64_t kModeEvery = 1 << 12;  // elements between two choices of how AVX2 packs (run_avx2)

// The varint positions and the bitmask of a diff are made in scratch (the payload's layout puts
// them after the values, whose count is known only at the end). Its buffers grow and are kept
// for the process, in a pool that a call leases for its duration: the publisher's copy threads
// are new for each pass, and scratch kept per thread was new with them, its pages faulted in
// again by the diff (1,800 faults for the 100M model at 3% changed, and in the benchmark's
// trainer process the diffs that faulted took 28-38 ms against 22).
struct Scratch {
  // Its buffers: the varints, the bitmask, and the steps form's base values of the changes, steps
  // and escapes.
  enum Buf : int { kVarints, kMask, kBaseValues, kSteps, kEscapes, kBufs };
  std::unique_ptr<uint8_t[]> bufs[kBufs];
  uint64_t caps[kBufs] = {};

  uint8_t* get(Buf which, uint64_t nbytes) {
    if (caps[which] < nbytes) {
      bufs[which].reset(new uint8_t[nbytes]);
      caps[which] = nbytes;
    }
    return bufs[which].get();
  }
};

std::mutex scratch_mu;
std::vector<std::unique_ptr<Scratch>>& scratch_pool() {
  static auto* pool = new std::vector<std::unique_ptr<Scratch>>();  // (never destroyed: no exit-order hazard)
  return *pool;
}

// The scratch of a diff of n elements whose payload holds at most cap bytes: its varints stop at
// the bitmask's size (both vector paths stop making them there, and longer ones are never sent),
// with a vector's slack past that for the stores of varints16; the bitmask, with 8 bytes of tail.
inline uint64_t varcap_of(uint64_t n, uint64_t cap) { return std::min(cap, (n + 7) / 8 + 64); }
// With steps the varints go on past the bitmask's size by up to a byte a change (what the steps
// save against values: see Emitter::room16), so their scratch may hold that much more.
inline uint64_t steps_varcap_of(uint64_t n, uint64_t cap, int es) {
  return std::min(cap, (n + 7) / 8 + 64 + cap / static_cast<uint64_t>(es));
}
constexpr uint64_t kVarTail = 16;
inline uint64_t mask_scratch_of(uint64_t n) { return (n + 7) / 8 + 8; }

// A Scratch taken from the pool (a new one when none is free) and given back at the end of scope.
class ScratchLease {
 public:
  ScratchLease() {
    std::lock_guard<std::mutex> lock(scratch_mu);
    auto& pool = scratch_pool();
    if (pool.empty()) {
      s_ = std::make_unique<Scratch>();
    } else {
      s_ = std::move(pool.back());
      pool.pop_back();
    }
  }
  ~ScratchLease() {
    std::lock_guard<std::mutex> lock(scratch_mu);
    scratch_pool().push_back(std::move(s_));
  }
  ScratchLease(const ScratchLease&) = delete;
  ScratchLease& operator=(const ScratchLease&) = delete;
  Scratch& operator*() { return *s_; }

 private:
  std::unique_ptr<Scratch> s_;
};

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
  // With steps (2-byte elements): the base values of the changes, packed, while varints are made
  // (each change has a varint byte or more, so they number at most varcap: bcap).
  uint8_t* bvals = nullptr;
  uint64_t bcap = 0;
  bool bover = false;  // a base value was not kept: no steps
  uint64_t count = 0;
  uint64_t sum_old = 0;  // mix() of the base values at the changed positions (all of them)
  uint64_t sum_new = 0;  // mix() of the fresh values there: new checksum = base's - old + new
  uint64_t next_check = kCheckEvery;  // where the vector loops' check() starts
  uint64_t varlen = 0;
  uint64_t last = 0;  // the previous position + 1
  bool vover = false;
  bool varover = false;

  // The scalar tail's form: one changed element at pos (its fresh value at elem).
  inline void one(uint64_t pos, const uint8_t* elem) {
    sum_old += mix(load_elem(base + pos * es, es), pos);
    sum_new += mix(load_elem(elem, es), pos);
    if (count < vmax && !vover) {
      std::memcpy(vals + count * es, elem, es == 2 ? 2 : 4);
      keep_base(base + pos * 2, 1);
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

  // The batched paths' look at the running density, at element i with so_far changes before it,
  // once every kCheckEvery elements (*next: when next). Far past the crossover already (a quarter
  // more changes than the budget allows at this point), the tensor goes dense: stop encoding and
  // only count (and hash) from here.
  inline void check(uint64_t i, uint64_t so_far, uint64_t* next) {
    if (i < *next || vover) return;
    *next = i + kCheckEvery;
    const double budget = 1.25 * static_cast<double>(vmax) * static_cast<double>(i) / static_cast<double>(n);
    if (i >= n / 16 && static_cast<double>(so_far) > budget) vover = true;
  }

  // With steps, the base values of the next k changes (packed 2-byte values at b), while
  // varints are made.
  inline void keep_base(const uint8_t* b, uint64_t k) {
    if (bvals == nullptr || varover || bover) return;
    if (count + k > bcap) {
      bover = true;
      return;
    }
    std::memcpy(bvals + count * 2, b, k * 2);
  }

  // The batched paths' values: the k packed fresh values of a batch into the payload while they
  // fit (and, with steps, their packed base values at based).
  template <int ES>
  inline void take(const uint8_t* fresh, const uint8_t* based, uint64_t k) {
    if (!vover && count + k <= vmax) {
      std::memcpy(vals + count * ES, fresh, k * ES);
      if constexpr (ES == 2) keep_base(based, k);
    } else {
      vover = true;
    }
    count += k;
  }

  // Whether the varints of a group of up to 16 positions have room for a vector form (which
  // stores up to 32 bytes past varlen); gives them up (varover) when not, or once they are
  // longer than the bitmask would be, or, while steps can be made (base values kept), than the
  // bitmask and the byte a change the steps save against values (varint positions with steps
  // take about 2 bytes a change, a bitmask with values 2 a change and n / 8: the steps form is
  // the smaller at every density while its escapes are few). The rule is per group, as both
  // batched paths apply it.
  inline bool room16() {
    if (varover) return false;
    const uint64_t most = n / 8 + (bvals != nullptr && !bover ? count : 0);
    if (varlen + 2 * 16 + 10 > varcap || varlen > most) {
      varover = true;
      return false;
    }
    return true;
  }

  // The varints of ``lanes`` packed positions (p, relative to start) one by one: a group whose
  // gaps the vector forms do not take.
  inline void gaps(const uint32_t* p, unsigned lanes, uint64_t start) {
    for (unsigned j = 0; j < lanes; ++j) gap(start + p[j]);
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

// The elements [from, n) after a vector loop whose checksum so far is sum: with first 0 (a diff,
// or a tensor's checksum from its first element) through tail(); else copied and checksummed with
// indices from first (a piece of a tensor).
uint64_t rest(const uint8_t* f, const uint8_t* b, uint8_t* s, uint64_t from, uint64_t n, int es, uint64_t first,
              Emitter* em, uint64_t sum) {
  if (first == 0) return sum + tail(f, b, s, from, n, es, em);
  for (uint64_t i = from; i < n; ++i) {
    const uint8_t* e = f + i * es;
    if (s != nullptr) std::memcpy(s + i * es, e, es);
    sum += mix(load_elem(e, es), first + i);
  }
  return sum;
}

uint64_t run_scalar(const uint8_t* f, const uint8_t* b, uint8_t* s, uint64_t n, int es, uint64_t first, Emitter* em) {
  // Indices in the checksum are first-based; positions and bitmask bits are 0-based.
  return rest(f, b, s, 0, n, es, first, em, 0);
}

#ifdef TRANSPORT_DELTA_X86

// The changed elements of a run of steps, packed by a batched vector path: fresh and base values
// and their indices (from the batch's first step, at ``start``), with a vector's slack past kCap
// for the full-width stores (AVX2 packs 16-bit elements as (fresh, base) pairs into ``base``, and
// its flush packs their fresh halves into ``fresh``). A flush hashes them and makes their varints
// a group of 16 at a time, so that work costs per changed element, not per step; the compare
// loops pack them without a branch on whether a step changed: at the densities deltas pay (a
// few percent) about half the steps hold a change, at random, so a branch would mispredict
// every other step (AVX2 takes one where changes are far sparser; see run_avx2).
struct Batch {
  static constexpr uint64_t kCap = 4096;
  alignas(64) uint8_t fresh[(kCap + 32) * 4];
  alignas(64) uint8_t base[(kCap + 32) * 4];
  alignas(64) uint32_t index[kCap + 32];
  uint64_t fill = 0;
  uint64_t start = 0;
};

// Elements a batched path steps: 64 bytes on both, so that they check the density, flush and
// group the varints at the same elements, and their outputs agree even where the capacity runs
// out mid-tensor.
template <int ES>
constexpr uint64_t kStep = 64 / ES;

// Whether the batch is flushed after the step at i (holding fill changes from start): full, or
// its indices (from start, 32 bits) about to run out: a tensor past 2**31 elements.
template <int ES>
inline bool flush_due(uint64_t fill, uint64_t i, uint64_t start) {
  return fill + kStep<ES> > Batch::kCap || i + kStep<ES> - start >= (uint64_t{1} << 31);
}

// After the step at i: when the batch (fill changes from start) is due, hands it to flush, the
// vector path's (rare: every few thousand changes, so through a pointer), and begins the next
// batch after that step.
template <int ES, class V>
inline void flush_when_due(Batch& batch, uint64_t& fill, uint64_t& start, uint64_t i, Emitter* em, V* acc, V* old,
                           void (*flush)(Batch&, Emitter*, V*, V*)) {
  if (!flush_due<ES>(fill, i, start)) return;
  batch.fill = fill;
  batch.start = start;
  flush(batch, em, acc, old);
  fill = 0;
  start = i + kStep<ES>;
}

// AVX2 has no compress: its packs look up, by an 8-bit mask of lanes, the kept lanes' indices
// (kLaneTables.kept) and the pshufb operand that packs the varints of 8 gaps (kLaneTables.varint).

// Packs the changed lanes among 8 (bits m) into the batch at fill: 32-bit values x (fresh, or
// for 16-bit elements fresh | base << 16) at vals, base values y at base (unless null) and the
// indices (rel: the first lane's index from the batch's start, in every lane). Full-width
// stores into the slack; returns the new fill.
__attribute__((target("avx2"))) inline uint64_t pack8(uint32_t* index, uint32_t* vals, uint32_t* base, uint64_t fill,
                                                      unsigned m, __m256i rel, __m256i x, __m256i y) {
  const __m256i lanes = _mm256_load_si256(reinterpret_cast<const __m256i*>(kLaneTables.kept[m]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(vals + fill), _mm256_permutevar8x32_epi32(x, lanes));
  if (base != nullptr) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(base + fill), _mm256_permutevar8x32_epi32(y, lanes));
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(index + fill), _mm256_add_epi32(rel, lanes));
  return fill + static_cast<uint64_t>(__builtin_popcount(m));
}

// Appends the LEB128 gaps of a group of packed positions (p, relative to start; ``lanes`` of
// them, live0/live1 flag them in pos0/pos1, the group's first and last 8) to the emitter's
// varints: varints16's form for AVX2. Gaps under 2**14 are built as two bytes in the lanes and
// packed 8 at a time by one table pshufb; a group with a longer gap goes one by one.
__attribute__((target("avx2"))) inline void varints16_avx2(Emitter* em, const uint32_t* p, unsigned lanes,
                                                           uint64_t start, __m256i pos0, __m256i pos1, __m256i live0,
                                                           __m256i live1) {
  if (!em->room16()) return;
  // Lane j's predecessor is lane j - 1; lane 0's is the last position emitted (as an index from
  // start: mod 2**32, exact whenever the gap itself is below 2**32, checked below).
  const __m256i up = _mm256_setr_epi32(7, 0, 1, 2, 3, 4, 5, 6);
  const __m256i last = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(em->last - 1 - start)));
  const __m256i prev0 = _mm256_blend_epi32(_mm256_permutevar8x32_epi32(pos0, up), last, 1);
  const __m256i prev1 = _mm256_blend_epi32(_mm256_permutevar8x32_epi32(pos1, up),
                                           _mm256_permutevar8x32_epi32(pos0, _mm256_set1_epi32(7)), 1);
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i gap0 = _mm256_sub_epi32(_mm256_sub_epi32(pos0, prev0), one);
  const __m256i gap1 = _mm256_sub_epi32(_mm256_sub_epi32(pos1, prev1), one);
  const __m256i zero = _mm256_setzero_si256();
  const __m256i small0 = _mm256_cmpeq_epi32(_mm256_srli_epi32(gap0, 14), zero);
  const __m256i small1 = _mm256_cmpeq_epi32(_mm256_srli_epi32(gap1, 14), zero);
  const __m256i big = _mm256_or_si256(_mm256_andnot_si256(small0, live0), _mm256_andnot_si256(small1, live1));
  if (start + p[0] - em->last >= (uint64_t{1} << 14) || !_mm256_testz_si256(big, big)) {
    em->gaps(p, lanes, start);
    return;
  }
  // Under 2**14 now (a signed compare is exact): the low byte with its continuation bit, the
  // high one (zero for a one-byte gap) above it, in 16 bits.
  const __m256i two0 = _mm256_and_si256(_mm256_cmpgt_epi32(gap0, _mm256_set1_epi32(0x7f)), live0);
  const __m256i two1 = _mm256_and_si256(_mm256_cmpgt_epi32(gap1, _mm256_set1_epi32(0x7f)), live1);
  const __m256i lo7 = _mm256_set1_epi32(0x7f), hi7 = _mm256_set1_epi32(0x7f00), cont = _mm256_set1_epi32(0x80);
  const __m256i w0 = _mm256_or_si256(_mm256_or_si256(_mm256_and_si256(gap0, lo7),
                                                     _mm256_and_si256(_mm256_slli_epi32(gap0, 1), hi7)),
                                     _mm256_and_si256(two0, cont));
  const __m256i w1 = _mm256_or_si256(_mm256_or_si256(_mm256_and_si256(gap1, lo7),
                                                     _mm256_and_si256(_mm256_slli_epi32(gap1, 1), hi7)),
                                     _mm256_and_si256(two1, cont));
  const unsigned t0 = static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(two0)));
  const unsigned t1 = static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(two1)));
  // Dead lanes (past ``lanes``) pack to one byte each after the live ones, into room16's room.
  uint8_t* out = em->var + em->varlen;
  const unsigned n0 = std::min(lanes, 8u) + static_cast<unsigned>(__builtin_popcount(t0));
  const unsigned n1 = (lanes > 8 ? lanes - 8 : 0) + static_cast<unsigned>(__builtin_popcount(t1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                   _mm_shuffle_epi8(_mm_packus_epi32(_mm256_castsi256_si128(w0), _mm256_extracti128_si256(w0, 1)),
                                    _mm_load_si128(reinterpret_cast<const __m128i*>(kLaneTables.varint[t0]))));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + n0),
                   _mm_shuffle_epi8(_mm_packus_epi32(_mm256_castsi256_si128(w1), _mm256_extracti128_si256(w1, 1)),
                                    _mm_load_si128(reinterpret_cast<const __m128i*>(kLaneTables.varint[t1]))));
  em->varlen += n0 + n1;
  em->last = start + p[lanes - 1] + 1;
}

// Hashes the batch into the running sums (fresh terms into acc, base terms into old), moves its
// fresh values into the payload while they fit and its positions into the varints, then empties
// it: flush_avx512's form for AVX2, 16 a group in two vectors of 8 (lanes past the fill, stale
// slack, masked off).
template <int ES>
__attribute__((target("avx2"))) void flush_avx2(Batch& batch, Emitter* em, __m256i* acc, __m256i* old) {
  const uint64_t k = batch.fill;
  if (k == 0) return;
  const __m256i at = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(batch.start)));
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i mul = _mm256_set1_epi32(static_cast<int>(kIndexMul));
  for (uint64_t j = 0; j < k; j += 16) {
    const unsigned lanes = static_cast<unsigned>(std::min<uint64_t>(16, k - j));
    __m256i pos[2], live[2];
    for (unsigned h = 0; h < 2; ++h) {
      const uint64_t o = j + 8 * h;
      pos[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(batch.index + o));
      live[h] = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(lanes) - static_cast<int>(8 * h)), lane);
      const __m256i key = _mm256_mullo_epi32(_mm256_add_epi32(pos[h], at), mul);
      __m256i x, y;
      if constexpr (ES == 2) {  // pairs (see run_avx2); take() wants the fresh values packed
        const __m256i pair = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(batch.base + o * 4));
        x = _mm256_and_si256(pair, _mm256_set1_epi32(0xFFFF));
        y = _mm256_srli_epi32(pair, 16);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(batch.fresh + o * 2),
                         _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1)));
        // The base halves packed in place, behind the pairs still to be read (o * 2 + 16 <= the
        // next group's o * 4).
        _mm_storeu_si128(reinterpret_cast<__m128i*>(batch.base + o * 2),
                         _mm_packus_epi32(_mm256_castsi256_si128(y), _mm256_extracti128_si256(y, 1)));
      } else {
        x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(batch.fresh + o * 4));
        y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(batch.base + o * 4));
      }
      *acc = add8_avx2(*acc, _mm256_and_si256(mix8_avx2(x, key), live[h]));
      *old = add8_avx2(*old, _mm256_and_si256(mix8_avx2(y, key), live[h]));
    }
    varints16_avx2(em, batch.index + j, lanes, batch.start, pos[0], pos[1], live[0], live[1]);
  }
  em->take<ES>(batch.fresh, batch.base, k);
  batch.fill = 0;
}

// 64 bytes a step (kStep): 32 bf16/fp16 or 16 fp32 elements, in two vectors.
template <int ES>
__attribute__((target("avx2"))) uint64_t run_avx2(const uint8_t* f, const uint8_t* b, uint8_t* s, uint64_t n,
                                                  uint64_t first, Emitter* em) {
  constexpr uint64_t kLanes = kStep<ES>;
  constexpr uint64_t kHalf = 32 / ES;  // elements in one vector
  const uint64_t body = n / kLanes * kLanes;
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i step8 = _mm256_set1_epi32(static_cast<int>(8u * kIndexMul));
  const __m256i stepk = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(kHalf) * kIndexMul));
  __m256i h0 = _mm256_mullo_epi32(_mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(first))),
                                                   lane),
                                  _mm256_set1_epi32(static_cast<int>(kIndexMul)));
  __m256i acc = _mm256_setzero_si256();
  __m256i old = _mm256_setzero_si256();  // checksum terms of the base values at the changes
  Batch batch;  // on the stack (40 KB): a thread_local costs a call per access in a shared library
  uint64_t fill = 0, start = 0;  // start: the index of the batch's first step
  uint8_t* const mask = em != nullptr ? em->mask : nullptr;
  uint64_t next_check = em != nullptr ? em->next_check : 0;
  uint32_t every = ~0u;  // all ones: every step packs; 0: a branch skips unchanged ones (below)
  uint64_t next_mode = 0, seen = 0;  // the next look at the changes, and their count at the last
  const bool stream = s != nullptr && reinterpret_cast<uintptr_t>(s) % 32 == 0 && n * ES >= kStreamMin;
  for (uint64_t i = 0; i < body; i += kLanes) {
    const __m256i a[2] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(f + i * ES)),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(f + i * ES + 32))};
    if (em != nullptr) {
      _mm_prefetch(reinterpret_cast<const char*>(f + i * ES + kPrefetch), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(b + i * ES + kPrefetch), _MM_HINT_T0);
    }
    if (s != nullptr) {
      for (unsigned h = 0; h < 2; ++h) {
        if (stream) {
          _mm256_stream_si256(reinterpret_cast<__m256i*>(s + i * ES + 32 * h), a[h]);
        } else {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(s + i * ES + 32 * h), a[h]);
        }
      }
    }
    if (em == nullptr) {  // with a base, only the changes are hashed (in the flushes)
      for (unsigned h = 0; h < 2; ++h) {
        if constexpr (ES == 2) {
          __m256i h1 = _mm256_add_epi32(h0, step8);
          acc = add8_avx2(acc, mix8_avx2(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(a[h])), h0));
          acc = add8_avx2(acc, mix8_avx2(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(a[h], 1)), h1));
        } else {
          acc = add8_avx2(acc, mix8_avx2(a[h], h0));
        }
        h0 = _mm256_add_epi32(h0, stepk);
      }
      continue;
    }
    const __m256i c[2] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + i * ES)),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + i * ES + 32))};
    uint32_t ne;
    if constexpr (ES == 2) {
      // The 16-bit compares narrowed to bytes: packs interleaves the two vectors' 128-bit
      // halves, the 64-bit permute puts them back in element order.
      const __m256i eq = _mm256_permute4x64_epi64(
          _mm256_packs_epi16(_mm256_cmpeq_epi16(a[0], c[0]), _mm256_cmpeq_epi16(a[1], c[1])), 0xD8);
      ne = ~static_cast<uint32_t>(_mm256_movemask_epi8(eq));
      std::memcpy(mask + i / 8, &ne, 4);
    } else {
      const __m256 eq0 = _mm256_castsi256_ps(_mm256_cmpeq_epi32(a[0], c[0]));
      const __m256 eq1 = _mm256_castsi256_ps(_mm256_cmpeq_epi32(a[1], c[1]));
      ne = ~static_cast<uint32_t>(_mm256_movemask_ps(eq0) | _mm256_movemask_ps(eq1) << 8) & 0xFFFFu;
      const uint16_t m16 = static_cast<uint16_t>(ne);
      std::memcpy(mask + i / 8, &m16, 2);
    }
    em->check(i, em->count + fill, &next_check);
    // Where a quarter or less of the steps changed over the last kModeEvery elements (and over
    // the first ones), a branch skips the packs of an unchanged step: it mispredicts seldom
    // there, and the packs (longer than the compare) would only write slack. Elsewhere every
    // step packs, without a branch (see Batch): out of cache, a branch that mispredicts about
    // every other step costs more than the packs it saves (in cache, less: measure out of it).
    if (i >= next_mode) {
      const uint64_t now = em->count + fill;
      every = (now - seen) * 4 * kLanes <= kModeEvery ? 0 : ~0u;  // changes bound the changed steps
      seen = now;
      next_mode = i + kModeEvery;
    }
    // The changed lanes, 8 at a time, packed into the batch. 16-bit elements go as (fresh, base)
    // pairs in 32 bits, into the base array: one vpermd packs both.
    if ((ne | every) != 0) {  // one branch: written as two, the compiler tests ne first
      uint32_t* const index = batch.index;
      uint32_t* const vals = reinterpret_cast<uint32_t*>(ES == 2 ? batch.base : batch.fresh);
      uint32_t* const base = ES == 2 ? nullptr : reinterpret_cast<uint32_t*>(batch.base);
      for (unsigned g = 0; g < kLanes / 8; ++g) {
        const unsigned m = ne >> (8 * g) & 0xFFu;
        const __m256i at = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(i - start + 8 * g)));
        if constexpr (ES == 2) {
          // The unpacks pair elements 0-3 and 8-11 (lo), 4-7 and 12-15 (hi), a 128-bit half
          // each; the 128-bit permutes gather 0-7 (g even) or 8-15.
          const __m256i lo = _mm256_unpacklo_epi16(a[g / 2], c[g / 2]);
          const __m256i hi = _mm256_unpackhi_epi16(a[g / 2], c[g / 2]);
          const __m256i pairs = g % 2 == 0 ? _mm256_permute2x128_si256(lo, hi, 0x20)
                                           : _mm256_permute2x128_si256(lo, hi, 0x31);
          fill = pack8(index, vals, base, fill, m, at, pairs, pairs);
        } else {
          fill = pack8(index, vals, base, fill, m, at, a[g], c[g]);
        }
      }
    }
    flush_when_due<ES>(batch, fill, start, i, em, &acc, &old, &flush_avx2<ES>);
  }
  if (stream) _mm_sfence();
  if (em == nullptr) return rest(f, b, s, body, n, ES, first, em, hsum_avx2(acc));
  batch.fill = fill;  // with a base: acc holds the fresh terms of the changed lanes
  batch.start = start;
  flush_avx2<ES>(batch, em, &acc, &old);
  em->sum_old += hsum_avx2(old);
  em->sum_new += hsum_avx2(acc);
  return rest(f, b, s, body, n, ES, first, em, 0);
}

TRANSPORT_AVX512_BEGIN

// Appends the LEB128 gaps of 16 changed positions (``live`` lanes of ``pos``, packed at p,
// relative to ``start``) to the emitter's varints. Gaps under 2**14 (one or two bytes) are built
// in the lanes and packed by one byte compress; a group with a longer gap goes one by one.
__attribute__((target(TRANSPORT_AVX512))) inline void varints16(Emitter* em, const uint32_t* p, __m512i pos,
                                                               __mmask16 live, uint64_t start) {
  if (!em->room16()) return;
  const unsigned lanes = static_cast<unsigned>(__builtin_popcount(live));
  // Lane j's predecessor is lane j - 1; lane 0's is the last position emitted (as an index
  // from start: mod 2**32, exact whenever the gap itself is below 2**32, checked below).
  const __m512i prev = _mm512_alignr_epi32(pos, _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(
                                                     em->last - 1 - start))), 15);
  const __m512i gap = _mm512_maskz_sub_epi32(live, _mm512_sub_epi32(pos, prev), _mm512_set1_epi32(1));
  if (start + p[0] - em->last >= (uint64_t{1} << 14) ||
      _mm512_mask_cmpge_epu32_mask(live, gap, _mm512_set1_epi32(1 << 14))) {
    em->gaps(p, lanes, start);
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
    varints16(em, batch.index + j, pos, live, batch.start);
  }
  em->take<ES>(batch.fresh, batch.base, k);
  batch.fill = 0;
}

// 64 bytes a step (kStep): 32 bf16/fp16 or 16 fp32 elements.
template <int ES>
__attribute__((target(TRANSPORT_AVX512))) uint64_t run_avx512(const uint8_t* f, const uint8_t* b, uint8_t* s,
                                                               uint64_t n, uint64_t first, Emitter* em) {
  constexpr uint64_t kLanes = kStep<ES>;
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
    // No branch on whether the step changed (see Batch): the compresses below pack nothing for
    // an unchanged one.
    const uint64_t k = static_cast<uint64_t>(__builtin_popcountll(ne));
    em->check(i, em->count + fill, &next_check);
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
    flush_when_due<ES>(batch, fill, start, i, em, &acc, &old, &flush_avx512<ES>);
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
  return rest(f, b, s, body, n, ES, first, em, sum);
}

TRANSPORT_AVX512_END
#endif  // TRANSPORT_DELTA_X86

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

// Here, beside run(), so that the compiler specialises the pass for no base and no emitter.
uint64_t detail::checksum_pass(const uint8_t* p, uint8_t* dst, uint64_t n, int es, uint64_t first, int isa) {
  return run(p, nullptr, dst, n, es, first, nullptr, isa);
}

namespace {

// The steps form (delta.h) of count changed 2-byte values, fresh at f and base at b (packed):
// the steps at steps, the escaped values at esc (with 64 bytes of slack for the vector
// stores). Returns how many were escaped. Every ISA's form writes the same bytes.
uint64_t to_steps_scalar(const uint8_t* f, const uint8_t* b, uint64_t count, uint8_t* steps, uint8_t* esc) {
  uint64_t e = 0;
  for (uint64_t k = 0; k < count; ++k) {
    uint16_t x, y;
    std::memcpy(&x, f + 2 * k, 2);
    std::memcpy(&y, b + 2 * k, 2);
    const auto d = static_cast<int16_t>(static_cast<uint16_t>(x - y));
    if (d >= -kStepMax && d <= kStepMax) {
      steps[k] = static_cast<uint8_t>(static_cast<int8_t>(d));
    } else {
      steps[k] = kEscape;
      std::memcpy(esc + 2 * e++, &x, 2);
    }
  }
  return e;
}

#ifdef TRANSPORT_DELTA_X86

// to_steps_scalar 16 values a vector; a vector with an escape (a few in a thousand) goes one by
// one.
__attribute__((target("avx2"))) uint64_t to_steps_avx2(const uint8_t* f, const uint8_t* b, uint64_t count,
                                                       uint8_t* steps, uint8_t* esc) {
  const __m256i lo = _mm256_set1_epi16(-kStepMax), hi = _mm256_set1_epi16(kStepMax);
  uint64_t e = 0, k = 0;
  for (; k + 16 <= count; k += 16) {
    const __m256i d = _mm256_sub_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(f + 2 * k)),
                                       _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2 * k)));
    const __m256i far = _mm256_or_si256(_mm256_cmpgt_epi16(d, hi), _mm256_cmpgt_epi16(lo, d));
    if (!_mm256_testz_si256(far, far)) {
      e += to_steps_scalar(f + 2 * k, b + 2 * k, 16, steps + k, esc + 2 * e);
      continue;
    }
    // In [-127, 127]: the saturating pack is exact.
    _mm_storeu_si128(reinterpret_cast<__m128i*>(steps + k),
                     _mm_packs_epi16(_mm256_castsi256_si128(d), _mm256_extracti128_si256(d, 1)));
  }
  return e + to_steps_scalar(f + 2 * k, b + 2 * k, count - k, steps + k, esc + 2 * e);
}

TRANSPORT_AVX512_BEGIN

// to_steps_scalar 32 values a vector, the escaped values compressed out of it.
__attribute__((target(TRANSPORT_AVX512))) uint64_t to_steps_avx512(const uint8_t* f, const uint8_t* b,
                                                                   uint64_t count, uint8_t* steps, uint8_t* esc) {
  const __m512i lo = _mm512_set1_epi16(-kStepMax), hi = _mm512_set1_epi16(kStepMax);
  uint64_t e = 0, k = 0;
  for (; k + 32 <= count; k += 32) {
    const __m512i x = _mm512_loadu_si512(f + 2 * k);
    const __m512i d = _mm512_sub_epi16(x, _mm512_loadu_si512(b + 2 * k));
    const __mmask32 far = _mm512_cmplt_epi16_mask(d, lo) | _mm512_cmpgt_epi16_mask(d, hi);
    // Truncated to bytes (exact in range), kEscape where not.
    const __m256i st = _mm256_mask_mov_epi8(_mm512_cvtepi16_epi8(d), far, _mm256_set1_epi8(static_cast<char>(kEscape)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(steps + k), st);
    if (far != 0) {  // (a register compress and a full-width store into the slack)
      _mm512_storeu_si512(esc + 2 * e, _mm512_maskz_compress_epi16(far, x));
      e += static_cast<uint64_t>(__builtin_popcount(far));
    }
  }
  return e + to_steps_scalar(f + 2 * k, b + 2 * k, count - k, steps + k, esc + 2 * e);
}

TRANSPORT_AVX512_END
#endif  // TRANSPORT_DELTA_X86

uint64_t to_steps(const uint8_t* f, const uint8_t* b, uint64_t count, uint8_t* steps, uint8_t* esc, int isa) {
  switch (resolve(isa)) {
#ifdef TRANSPORT_DELTA_X86
    case kAvx512:
      return to_steps_avx512(f, b, count, steps, esc);
    case kAvx2:
      return to_steps_avx2(f, b, count, steps, esc);
#endif
    default:
      return to_steps_scalar(f, b, count, steps, esc);
  }
}

// Rewrites a payload of count 2-byte values (at o) in the steps form, its varint positions
// (pos bytes at em.var) after them, when that makes fewer than ``under`` bytes in all (the
// smaller of the values forms, and at most the output's capacity); returns its payload bytes
// then, else 0 (o untouched).
uint64_t as_steps(uint8_t* o, const Emitter& em, uint64_t pos, uint64_t under, Scratch& sc, int isa) {
  const uint64_t count = em.count;
  uint8_t* steps = sc.get(Scratch::kSteps, count);
  uint8_t* esc = sc.get(Scratch::kEscapes, 2 * count + 64);
  const uint64_t e = to_steps(o, em.bvals, count, steps, esc, isa);
  const uint64_t used = 8 + count + 2 * e, vbytes = align8(used);
  if (vbytes + pos >= under) return 0;  // (escapes on about half of them or more)
  std::memcpy(o, &e, 8);
  std::memcpy(o + 8, steps, count);
  std::memcpy(o + 8 + count, esc, 2 * e);
  std::memset(o + used, 0, vbytes - used);
  std::memcpy(o + vbytes, em.var, pos);
  return vbytes + pos;
}

// encode(), with the varint positions made (varints) or not (the bitmask alone), and with steps
// the steps form where it is smaller.
EncodeResult encode_positions_as(const void* fresh, const void* base, void* snap, uint64_t n, int es, void* out,
                                 uint64_t cap, int isa, bool varints, bool steps, Scratch& sc) {
  check_es(es);
  const auto* f = static_cast<const uint8_t*>(fresh);
  auto* s = static_cast<uint8_t*>(snap);
  EncodeResult r{kDense, n, 0, 0, 0, 0, 0};
  if (base == nullptr) {
    r.checksum = run(f, nullptr, s, n, es, 0, nullptr, isa);
    return r;
  }
  const uint64_t mask_bytes = (n + 7) / 8;
  const bool with_steps = steps && es == 2 && varints;
  const uint64_t varcap = with_steps ? steps_varcap_of(n, cap, es) : varcap_of(n, cap);
  Emitter em{es, static_cast<uint8_t*>(out), cap, sc.get(Scratch::kVarints, varcap + kVarTail),
             varcap, sc.get(Scratch::kMask, mask_scratch_of(n)), cap / es, static_cast<const uint8_t*>(base), n};
  em.varover = !varints;  // (every path checks it before it makes a varint)
  if (with_steps) {
    em.bvals = sc.get(Scratch::kBaseValues, 2 * varcap);
    em.bcap = varcap;
  }
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
  auto* o = static_cast<uint8_t*>(out);
  if (!em.varover && em.bvals != nullptr && !em.bover) {
    // Steps with the varint positions, where smaller than values with either position form.
    const uint64_t payload = as_steps(o, em, em.varlen, std::min(vbytes + pos, cap + 1), sc, isa);
    if (payload != 0) {
      r.kind = kVarstep;
      r.payload_bytes = payload;
      r.pos_bytes = em.varlen;
      return r;
    }
  }
  if (vbytes + pos > cap) return r;  // dense
  std::memset(o + em.count * es, 0, vbytes - em.count * es);
  std::memcpy(o + vbytes, use_mask ? em.mask : em.var, pos);
  r.kind = use_mask ? kBitmask : kVarint;
  r.payload_bytes = vbytes + pos;
  r.pos_bytes = pos;
  return r;
}

}  // namespace

EncodeResult encode(const void* fresh, const void* base, void* snap, uint64_t n, int es, void* out, uint64_t cap,
                    int isa, bool steps) {
  ScratchLease sc;
  return encode_positions_as(fresh, base, snap, n, es, out, cap, isa, true, steps, *sc);
}

namespace {

// The elements of es bytes that differ between f and b, n of them, one at a time.
uint64_t count_changed_scalar(const uint8_t* f, const uint8_t* b, uint64_t n, int es) {
  uint64_t changed = 0;
  for (uint64_t i = 0; i < n; ++i) changed += load_elem(f + i * es, es) != load_elem(b + i * es, es);
  return changed;
}

#ifdef TRANSPORT_DELTA_X86
// count_changed_scalar 32 bytes a vector (each element's bytes compared as 16- or 32-bit lanes).
__attribute__((target("avx2"))) uint64_t count_changed_avx2(const uint8_t* f, const uint8_t* b, uint64_t n,
                                                            int es) {
  const uint64_t per = 32 / static_cast<uint64_t>(es);
  uint64_t changed = 0, i = 0;
  for (; i + per <= n; i += per) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(f + i * es));
    const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + i * es));
    const __m256i eq = es == 2 ? _mm256_cmpeq_epi16(x, y) : _mm256_cmpeq_epi32(x, y);
    // Each equal element sets es bits of the byte mask.
    changed += per - static_cast<uint64_t>(__builtin_popcount(static_cast<uint32_t>(_mm256_movemask_epi8(eq)))) /
                         static_cast<uint64_t>(es);
  }
  return changed + count_changed_scalar(f + i * es, b + i * es, n - i, es);
}

TRANSPORT_AVX512_BEGIN

// count_changed_scalar 64 bytes a vector.
__attribute__((target(TRANSPORT_AVX512))) uint64_t count_changed_avx512(const uint8_t* f, const uint8_t* b,
                                                                        uint64_t n, int es) {
  const uint64_t per = 64 / static_cast<uint64_t>(es);
  uint64_t changed = 0, i = 0;
  for (; i + per <= n; i += per) {
    const __m512i x = _mm512_loadu_si512(f + i * es);
    const __m512i y = _mm512_loadu_si512(b + i * es);
    changed += es == 2 ? static_cast<uint64_t>(__builtin_popcount(_mm512_cmpneq_epi16_mask(x, y)))
                       : static_cast<uint64_t>(__builtin_popcount(_mm512_cmpneq_epi32_mask(x, y)));
  }
  return changed + count_changed_scalar(f + i * es, b + i * es, n - i, es);
}

TRANSPORT_AVX512_END
#endif  // TRANSPORT_DELTA_X86

uint64_t count_changed(const uint8_t* f, const uint8_t* b, uint64_t n, int es, int isa) {
  switch (resolve(isa)) {
#ifdef TRANSPORT_DELTA_X86
    case kAvx512:
      return count_changed_avx512(f, b, n, es);
    case kAvx2:
      return count_changed_avx2(f, b, n, es);
#endif
    default:
      return count_changed_scalar(f, b, n, es);
  }
}

}  // namespace

// The sample counts only: a compare and a count, 32 or 64 bytes a vector (it went through the
// diff's passes, which also make positions and checksum terms: 2-4 ms a version of the
// benchmark's 100M model, against about 0.2 ms for the bytes it reads).
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
    changed += count_changed(f + at * es, b + at * es, run, es, isa);
  }
  return changed;
}

void sample_changed_many(const uint64_t* rows, uint64_t count, uint64_t* changed, int isa) {
  for (uint64_t i = 0; i < count; ++i) {
    const uint64_t* r = rows + 6 * i;
    changed[i] = sample_changed(reinterpret_cast<const void*>(r[0]), reinterpret_cast<const void*>(r[1]), r[2],
                                static_cast<int>(r[3]), r[4], r[5], isa);
  }
}

void reserve_scratch(uint64_t count, uint64_t n) {
  // The varints and the bitmask, which every diff writes whole. The varints are allocated at the
  // most a diff with steps asks (past the bitmask's size: steps_varcap_of, a payload at most
  // the dense bytes), so that no diff allocates them anew, and written up to the bitmask's size,
  // what a diff without steps uses. The steps form's buffers are left to grow (the diffs touch
  // only what their changes need: written whole here, they would hold up to 5/8 of the largest
  // tensor's elements in bytes per copy thread).
  const uint64_t var_bytes = varcap_of(n, UINT64_MAX) + kVarTail, mask_bytes = mask_scratch_of(n);
  const uint64_t var_most = std::max(var_bytes, steps_varcap_of(n, 2 * n, 2) + kVarTail);
  std::vector<std::unique_ptr<ScratchLease>> leases;  // all at once: count distinct ones
  for (uint64_t i = 0; i < count; ++i) {
    leases.push_back(std::make_unique<ScratchLease>());
    Scratch& sc = **leases.back();
    std::memset(sc.get(Scratch::kVarints, var_most), 0, var_bytes);
    std::memset(sc.get(Scratch::kMask, mask_bytes), 0, mask_bytes);
  }
}

uint64_t encode_many(const uint64_t* rows, uint64_t count, uint64_t* results, uint64_t* next, uint64_t budget,
                     uint64_t* taken, int isa) {
  uint64_t k = 0;
  ScratchLease sc;
  for (uint64_t done = 0; done < budget;) {
    const uint64_t i = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED);  // each row is claimed once
    if (i >= count) break;
    const uint64_t* r = rows + kEncodeRow * i;
    const auto* fresh = reinterpret_cast<const void*>(r[0]);
    const auto* base = reinterpret_cast<const void*>(r[1]);
    auto* snap = reinterpret_cast<void*>(r[2]);
    const uint64_t n = r[3];
    const int es = static_cast<int>(r[4]);
    EncodeResult e = encode_positions_as(fresh, base, base == nullptr ? snap : nullptr, n, es,
                                         reinterpret_cast<void*>(r[5]), r[6], isa, r[9] != 0, r[10] != 0, *sc);
    if (base != nullptr) {
      if (e.kind >= kVarint && e.changed > r[7]) e.kind = kDense;  // a sparse kind past the crossover
      if (e.kind == kDense && snap != nullptr) {
        if (r[8] != 0) {
          stream_copy(snap, fresh, n * es);
        } else {
          std::memcpy(snap, fresh, n * es);
        }
      }
    }
    uint64_t* out = results + kEncodeResult * i;
    out[0] = e.kind;
    out[1] = e.changed;
    out[2] = e.payload_bytes;
    out[3] = e.pos_bytes;
    out[4] = e.checksum;
    out[5] = e.sum_old;
    out[6] = e.sum_new;
    taken[k++] = i;
    done += n * static_cast<uint64_t>(es);
  }
  return k;
}

}  // namespace transport::delta
