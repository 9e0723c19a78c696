// Delta sync on the CPU: the fused diff + copy + encode of one tensor against its previous
// version (publisher), the checksum both sides compute, and the bounds-checked scatter of an
// encoded delta into a live tensor (subscriber).
//
// Elements are compared as raw bit patterns (2 or 4 bytes: bf16/fp16 or fp32), so -0.0 vs 0.0
// and NaN payloads count as changed and an applied delta is bit-exact.
//
// Checksum of a tensor: sum over i of mix(bits_i, i) mod 2^64, where
//   mix(x, i) = y ^ (y >> 15), y = (x ^ (u32)(i * 0x9E3779B9)) * 0x85EBCA6B   (u32 arithmetic).
// A sum, so a subscriber updates it in O(changed elements): old - mix(old values) + mix(new).
//
// Encoded payload of a sparse tensor (all of it bytes from a peer until checked):
//   [count values, es bytes each][zero pad to 8][positions: pos_bytes]
// positions are either LEB128 varints of the gaps (p0, then p_k - p_{k-1} - 1), or a bitmask of
// ceil(n / 8) bytes (bit i of byte i / 8 set: element 8 * (i / 8) + i % 8 changed).
//
// The steps form (kVarstep: 2-byte elements, varint positions) writes each changed value as its
// step from the value it replaces, where a signed byte holds it:
//   [escapes: uint64][count steps, 1 byte each][escapes values, 2 bytes each][zero pad to 8][positions]
// step k is (int8) (new - old) of the bit patterns (mod 2**16) when that lies in [-127, 127]; else
// it is kEscape (-128) and the value itself is the next of the escapes. Of a bf16 weight that an
// optimizer step moves, 80-90% of the changes are one ulp and 99.8% within 127: a change costs
// about 1 + its position's byte instead of 2 + 1.
#pragma once

#include <cstdint>
#include <string>

namespace transport::delta {

enum Kind : uint32_t { kUnchanged = 0, kDense = 1, kVarint = 2, kBitmask = 3, kVarstep = 4 };

// kAuto (every caller's default) is the best ISA this CPU has, or the one $TRANSPORT_DELTA_ISA
// (avx512, avx2, scalar or auto; read once per process) forces, for benchmarks. Every call that
// runs on kAuto (scatter() always does) throws std::invalid_argument when that variable names
// an ISA this CPU lacks or no ISA at all.
enum Isa : int { kAuto = 0, kScalar = 1, kAvx2 = 2, kAvx512 = 3 };

// Why a payload was refused (scatter); 0 is success.
enum Refusal : int {
  kOk = 0,
  kBadKind = 1,       // not kVarint / kBitmask / kVarstep, or kVarstep of elements not 2 bytes
  kBadSize = 2,       // the payload's length does not match count, es and pos_bytes, or count > n
  kOutOfRange = 3,    // a position at or past n
  kBadVarint = 4,     // a truncated or overlong varint, or a gap that overflows
  kCountMismatch = 5, // the positions do not number exactly count, or bytes follow them
  kBadBitmask = 6,    // bits set past n, or a bitmask of the wrong size
  kBadElemSize = 7,   // es is not 2 or 4
  kBadSteps = 8,      // more escape steps than the payload's escape count
};

struct EncodeResult {
  uint32_t kind;          // Kind
  uint64_t changed;       // elements that differ from base (all of them when there is no base)
  uint64_t payload_bytes; // bytes written at out (sparse kinds only)
  uint64_t pos_bytes;     // of which positions
  uint64_t checksum;      // without a base: the checksum of fresh (with one: 0, see below)
  uint64_t sum_old;       // with a base: the sum of mix() over the base values at the changed positions
  uint64_t sum_new;       // and over the fresh values there; fresh's checksum is base's - sum_old + sum_new
};

struct ScatterResult {
  int refusal;       // Refusal
  uint64_t sum_old;  // without write and with live not null: the sum of mix() over the live values at
                     // the positions (live null: only the payload is read; 0)
  uint64_t sum_new;  // sum of mix() over the new values at the positions
};

// Copies n elements of es bytes from fresh to snap (when snap is not null), compares them with
// base (when base is not null) and, when the changed elements encode into at most cap bytes,
// writes their encoding at out. With a base only the changed elements are hashed (the caller
// knows the base's checksum), so the pass costs little more than reading both. kind is
// kUnchanged (nothing differs), kVarint / kBitmask (the smaller of the two), kVarstep (with
// steps, for 2-byte elements: varint positions, and the steps form smaller than the values
// with either positions; the varints then go on past a bitmask's size, by up to a byte a
// change, since the steps save that against values), or kDense (no base, or the encoding does
// not fit cap).
// Nothing is written past out + cap. Throws std::invalid_argument for es not 2 or 4, or an ISA
// this CPU lacks.
EncodeResult encode(const void* fresh, const void* base, void* snap, uint64_t n, int es, void* out, uint64_t cap,
                    int isa, bool steps = false);

// Elements that differ between fresh and base (n elements of es bytes) in runs ranges of run
// elements spread evenly over them: range j starts at (n - run) * j / (runs - 1) (one range at 0
// when runs is 1). run is clamped to n. The publisher's sample of a tensor's change.
uint64_t sample_changed(const void* fresh, const void* base, uint64_t n, int es, uint64_t runs, uint64_t run,
                        int isa);

// sample_changed of count tensors in one call: row i of rows is (fresh, base, n, es, runs, run),
// its result goes to changed[i]. The publisher's sample of a whole version, so that its thread
// takes the GIL once, not once a tensor.
void sample_changed_many(const uint64_t* rows, uint64_t count, uint64_t* changed, int isa);

// Readies count of the scratch buffers the diffs lease (each call of encode, encode_many or
// sample_changed takes one for its duration, and gives it back), each written once, for tensors
// of up to n elements: the first diffs then fault none of their pages in. Not needed for
// correctness; the scratch grows as diffs need.
void reserve_scratch(uint64_t count, uint64_t n);

// encode() of many tensors, on as many threads as call it with the same rows, results and next:
// each call claims row next++ (atomically) until every row is claimed or it has diffed budget
// bytes or more, and returns how many it claimed, their indices at taken (room for count). Row i
// (kEncodeRow uint64s) is (fresh, base, snap, n, es, out, cap, dense_above, stream, varints, steps), its
// result (kEncodeResult uint64s at results + kEncodeResult * i) the EncodeResult's fields in
// order. Without a base, snap is written in the pass (as encode()). With one, a sparse encoding
// of more than dense_above changed elements becomes kDense (the crossover), and a kDense tensor
// is then copied to snap when snap is not null (with streaming stores when stream is not 0).
// With varints 0 the positions are a bitmask whatever the density: no varints are made (where
// changes are dense enough that the bitmask is about as small, making them costs the pass more
// than their bytes save). With steps not 0, as encode() with steps. So a version's diff takes
// each thread's GIL once, not once a tensor. Throws as encode().
constexpr uint64_t kEncodeRow = 11;
constexpr uint64_t kEncodeResult = 7;
uint64_t encode_many(const uint64_t* rows, uint64_t count, uint64_t* results, uint64_t* next, uint64_t budget,
                     uint64_t* taken, int isa);

// The checksum of n elements of es bytes at p, their indices starting at first (so a tensor's
// checksum is the sum of its pieces'). When dst is not null the elements are also copied there.
uint64_t checksum(const void* p, uint64_t n, int es, uint64_t first, void* dst, int isa);

// Checks payload (payload_len bytes) as the encoding of count changed elements of a tensor of n
// elements (es bytes each) and, without write, computes the sums over live and payload values at
// its positions. With write, stores the new values into live instead (the sums are then not
// computed, except by the vector bitmask path): every position is checked against n before
// its store, so live is never written out of bounds whatever the payload holds (a payload that
// fails a check part-way leaves earlier stores made: check without write first, with live null
// to read the payload alone). A kVarstep payload's values are steps from the live ones: it is
// refused (kBadSize) with live null, and without write its sums are over the live values and
// the values the steps make of them.
ScatterResult scatter(void* live, uint64_t n, int es, const void* payload, uint64_t payload_len, uint32_t kind,
                      uint64_t count, uint64_t pos_bytes, bool write);

struct ApplyResult {
  int refusal;       // Refusal
  uint64_t sum_old;  // sum of mix() over the live values the stores replaced
  uint64_t sum_new;  // sum of mix() over the values stored
  uint64_t stored;   // positions stored to (all count of them when refusal is kOk)
};

// The checked apply of a sparse payload in one pass (the subscriber's; scatter() checks first
// and stores second): for each position, checked against n before its store, saves the live
// value at undo (count * es bytes), stores the payload's new value and adds both to the sums.
// pos holds the payload's pos_bytes position bytes in memory nobody else writes (a copy), so
// that undo() walks the same positions; the values (or a kVarstep payload's steps and escapes)
// are read from payload once each (a peer's memory: the sums are over what was stored). On a
// refusal the first `stored` positions were written: undo() them. The caller compares the sums with the checksums it expects, and
// undoes on a mismatch too.
ApplyResult apply(void* live, uint64_t n, int es, const void* payload, uint64_t payload_len, uint32_t kind,
                  uint64_t count, uint64_t pos_bytes, const void* pos, void* undo, int isa = 0);

// apply() of many payloads, on as many threads as call it with the same rows, results and next
// (as encode_many, with no budget: each call claims rows until none is left). Row i (kApplyRow
// uint64s) is (live, n, es, payload, payload_len, kind, count, pos_bytes, pos, undo): its
// pos_bytes position bytes are first copied from the payload's end to pos (a refusal, kBadSize,
// when they are more than the payload), then apply() runs on that copy. Its result
// (kApplyResult uint64s) is the ApplyResult's fields in order. Returns how many rows this call
// claimed, their indices at taken.
constexpr uint64_t kApplyRow = 10;
constexpr uint64_t kApplyResult = 4;
uint64_t apply_many(const uint64_t* rows, uint64_t count, uint64_t* results, uint64_t* next, uint64_t* taken,
                    int isa);

// Restores the live values apply() saved at the first `stored` positions of pos.
void undo(void* live, uint64_t n, int es, uint32_t kind, const void* pos, uint64_t pos_bytes, uint64_t stored,
          const void* saved);

// -- Deltas cut along byte runs (mesh sync) -----------------------------------------------
// A mesh trainer rank diffs its snapshot in place (the snapshot holds the version it last wrote
// there, the base) and cuts the change along each generator rank's byte runs; positions there
// are 2-byte units of the generator's slot, whatever the element type, so one payload per
// (trainer rank, generator rank) scatters with scatter(..., es = 2).

// Compares the n elements (es bytes) at fresh with those at snap, records the byte offset
// (offset + index * es) and the old value of each changed one while fewer than cap are
// recorded, and copies fresh into snap. Returns how many changed (cap or not).
uint64_t diff_in_place(const void* fresh, void* snap, uint64_t n, int es, uint64_t offset, uint64_t* positions,
                       void* old, uint64_t cap, int isa);

// diff_in_place of n fp32 elements at fresh against their bf16 cast at snap (2-byte elements):
// each is cast as c10::BFloat16 rounds (to nearest even; every NaN to 0x7FC0, where torch's
// vector loops give 0xFFFF) on the way, so a trainer's
// fp32 weights are packed and diffed in one pass, without a cast copy.
uint64_t diff_bf16_in_place(const void* fresh, void* snap, uint64_t n, uint64_t offset, uint64_t* positions,
                            void* old, uint64_t cap, int isa);

// The changes (count sorted unit positions of a snapshot, with their old and new 2-byte values)
// that fall in runs (nruns int64 rows of (snapshot offset, slot offset, nbytes), sorted by
// snapshot offset and not overlapping there), as slot unit positions with their values, in the
// order of the changes. Returns how many were written (at most count).
uint64_t cut_runs(const uint64_t* units, const uint16_t* old_vals, const uint16_t* new_vals, uint64_t count,
                  const int64_t* runs, uint64_t nruns, uint64_t* out_units, uint16_t* out_old, uint16_t* out_new);

// LEB128 gaps of count strictly increasing positions (as in a kVarint payload) at out; returns
// the bytes written, or UINT64_MAX when they do not fit cap or the positions do not increase.
uint64_t encode_positions(const uint64_t* positions, uint64_t count, void* out, uint64_t cap);

// The sum of mix() over count values (es bytes each, packed) at the given positions.
uint64_t terms(const void* values, const uint64_t* positions, uint64_t count, int es);

// The checksum (es = 2 units) of the bytes of count runs (int64 rows of (a, b, nbytes)) at
// base + row[addr_col], each unit indexed from row[pos_col] / 2. Throws std::invalid_argument
// for a column outside {0, 1}, or an odd offset or length.
uint64_t checksum_runs(const void* base, const int64_t* runs, uint64_t count, int addr_col, int pos_col, int isa);

// The ISA that kAuto picks in this process: "avx512", "avx2" or "scalar".
std::string best_isa();

// Whether this CPU runs isa.
bool supports(int isa);

}  // namespace transport::delta
