// The transfer kernels: batched byte copy (bucket gather/scatter) and bf16 <-> fp8 e4m3.
//
// nvcc compiles this file into a fatbin (CMakeLists.txt, "transfer kernels" block) that is
// embedded in transport._C; transport/_cuda.py loads it through the CUDA driver and
// transport/_tensor_kernels.py launches the kernels by name. The CPU references with the same
// semantics are in transport/_tensor_kernels.py and tests/gpu/test_kernels.py holds the two
// against each other.
//
// Conventions every kernel here keeps, because the host side relies on them:
// * extern "C": the host looks kernels up by their plain name.
// * Parameters are only pointers, 64-bit counts, ints and floats: the host packs them into one
//   buffer at their natural C alignment (CU_LAUNCH_PARAM_BUFFER_POINTER).
// * Launched with kBlockThreads threads per block (a multiple of the warp size) and any grid:
//   every loop strides over the grid, so the grid size only tunes load balance.
// * No fast-math: division is IEEE round-to-nearest and subnormals are kept (nvcc's defaults,
//   also pinned by -prec-div=true -ftz=false in CMakeLists.txt), so results match the CPU
//   reference bit for bit.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

namespace {

constexpr unsigned kBlockThreads = 256;
constexpr float kFp8Max = 448.0f;  // largest finite float8 e4m3fn value

// -- batched copy --------------------------------------------------------------------------------

// Copies [src, src + nbytes) to dst with the whole block, V-sized words where possible.
// src and dst must be congruent modulo sizeof(V): the head (bytes before the first V-aligned
// address) and the tail (bytes after the last whole word) go byte by byte; both are shorter
// than sizeof(V).
template <typename V>
__device__ __forceinline__ void copy_congruent(const unsigned char* __restrict__ src, unsigned char* __restrict__ dst,
                                               unsigned long long nbytes) {
  constexpr unsigned long long kW = sizeof(V);
  const unsigned long long misalign = reinterpret_cast<uintptr_t>(src) & (kW - 1);
  const unsigned long long head = misalign ? (kW - misalign < nbytes ? kW - misalign : nbytes) : 0;
  const unsigned long long nwords = (nbytes - head) / kW;
  const unsigned long long body_end = head + nwords * kW;
  for (unsigned long long i = threadIdx.x; i < head; i += blockDim.x) dst[i] = src[i];
  for (unsigned long long i = body_end + threadIdx.x; i < nbytes; i += blockDim.x) dst[i] = src[i];

  const V* __restrict__ s = reinterpret_cast<const V*>(src + head);
  V* __restrict__ d = reinterpret_cast<V*>(dst + head);
  const unsigned long long stride = blockDim.x;
  unsigned long long i = threadIdx.x;
  // Four loads in flight per thread before the stores: one outstanding load per thread cannot
  // cover DRAM latency.
  for (; i + 3 * stride < nwords; i += 4 * stride) {
    const V a = s[i];
    const V b = s[i + stride];
    const V c = s[i + 2 * stride];
    const V e = s[i + 3 * stride];
    d[i] = a;
    d[i + stride] = b;
    d[i + 2 * stride] = c;
    d[i + 3 * stride] = e;
  }
  for (; i < nwords; i += stride) d[i] = s[i];
}

// -- bf16 / fp8 ----------------------------------------------------------------------------------

// The bit pattern of |float(x)| for the bf16 in the low (lo) or high (hi) half of a 32-bit word
// (little endian: element 2k is the low half). bf16 -> float is a 16-bit shift, so this is exact,
// and non-negative floats (NaN included, whose pattern lies above +inf's) order like their bits:
// an unsigned max over these patterns is a float max in which NaN wins, like torch's max().
__device__ __forceinline__ unsigned abs_bits_lo(unsigned w) { return (w << 16) & 0x7FFF0000u; }
__device__ __forceinline__ unsigned abs_bits_hi(unsigned w) { return w & 0x7FFF0000u; }

__device__ __forceinline__ unsigned abs_bits(__nv_bfloat16 x) {
  return abs_bits_lo(static_cast<unsigned>(__bfloat16_as_ushort(x)));
}

__device__ __forceinline__ unsigned warp_max(unsigned v) {
  for (int off = 16; off > 0; off >>= 1) v = max(v, __shfl_xor_sync(0xFFFFFFFFu, v, off));
  return v;
}

// The maximum of v over the block (valid in thread 0).
__device__ __forceinline__ unsigned block_max(unsigned v) {
  __shared__ unsigned partial[kBlockThreads / 32];
  v = warp_max(v);
  const unsigned warp = threadIdx.x / 32;
  const unsigned lane = threadIdx.x % 32;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < blockDim.x / 32 ? partial[lane] : 0u;
    v = warp_max(v);
  }
  return v;
}

// The reference's per-tensor scale: amax / 448, or 1 where that is not positive: amax 0, NaN
// (torch.where(s > 0, ...) takes the 1 branch for NaN) or so small that the division underflows
// (impossible for bf16 inputs, whose smallest positive value is 2^-133). amax = +inf gives +inf.
__device__ __forceinline__ float scale_of(float amax) {
  const float s = amax / kFp8Max;
  return s > 0.0f ? s : 1.0f;
}

// q = e4m3(x / scale), round to nearest even, saturating finite values (and +-inf) to +-448.
// NaN gives the canonical NaN 0x7F whatever its sign; torch gives 0x7F or 0xFF (it keeps the sign).
__device__ __forceinline__ unsigned char quantize_one(float x, float scale) {
  return static_cast<unsigned char>(__nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE, __NV_E4M3));
}

__device__ __forceinline__ unsigned quantize_word(unsigned w, float scale) {
  const float lo = __uint_as_float(w << 16);
  const float hi = __uint_as_float(w & 0xFFFF0000u);
  return static_cast<unsigned>(quantize_one(lo, scale)) | (static_cast<unsigned>(quantize_one(hi, scale)) << 8);
}

// float(q) for a float8 e4m3fn byte: exact (every e4m3 value is a half value).
__device__ __forceinline__ float fp8_to_float(unsigned char q) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(q), __NV_E4M3)));
}

// bf16(float(q) * scale), rounded to nearest even. A NaN result is bf16's canonical NaN (0x7FFF);
// torch writes 0x7FC0 (also a NaN).
__device__ __forceinline__ unsigned short dequantize_one(unsigned char q, float scale) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(fp8_to_float(q) * scale));
}

__device__ __forceinline__ unsigned dequantize_pair(unsigned two_q, float scale) {
  return static_cast<unsigned>(dequantize_one(static_cast<unsigned char>(two_q & 0xFF), scale)) |
         (static_cast<unsigned>(dequantize_one(static_cast<unsigned char>(two_q >> 8), scale)) << 16);
}

__device__ __forceinline__ unsigned long long grid_thread() {
  return static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ unsigned long long grid_threads() {
  return static_cast<unsigned long long>(gridDim.x) * blockDim.x;
}

__device__ __forceinline__ bool aligned(const void* p, uintptr_t n) { return (reinterpret_cast<uintptr_t>(p) & (n - 1)) == 0; }

}  // namespace

// One byte range, nbytes from src to dst; the host sends an array of them (24 bytes each, as
// three little-endian uint64). Fields in the copy engine's order (csrc/copy_engine.h Segment),
// so that the host has one segment type, transport._native.copy.Segment. Ranges must not overlap
// each other's destinations, nor a destination a source: blocks run in any order.
struct Segment {
  unsigned long long dst;
  unsigned long long src;
  unsigned long long nbytes;
};
static_assert(sizeof(Segment) == 24, "transport/_native/kernels.py packs 24-byte segments");

extern "C" {

// Copies every segment. Blocks stride over the segments (the host splits long ranges into
// pieces so that they balance); each segment is copied with the widest word size its source and
// destination share an alignment for (16, 8, 4, 2 or 1 bytes), with byte-wise heads and tails.
__global__ void __launch_bounds__(kBlockThreads) transport_batched_copy(const Segment* __restrict__ segs, int nsegs) {
  for (int k = blockIdx.x; k < nsegs; k += gridDim.x) {
    const Segment seg = segs[k];
    const auto* src = reinterpret_cast<const unsigned char*>(seg.src);
    auto* dst = reinterpret_cast<unsigned char*>(seg.dst);
    const unsigned long long congruence = seg.src ^ seg.dst;
    if ((congruence & 15) == 0) {
      copy_congruent<uint4>(src, dst, seg.nbytes);
    } else if ((congruence & 7) == 0) {
      copy_congruent<uint2>(src, dst, seg.nbytes);
    } else if ((congruence & 3) == 0) {
      copy_congruent<unsigned>(src, dst, seg.nbytes);
    } else if ((congruence & 1) == 0) {
      copy_congruent<unsigned short>(src, dst, seg.nbytes);
    } else {
      copy_congruent<unsigned char>(src, dst, seg.nbytes);
    }
  }
}

// *amax = max(*amax, max |float(x[i])|), as float bits (NaN wins over every number). The host
// zeroes *amax before the launch; x needs only bf16 (2-byte) alignment.
__global__ void __launch_bounds__(kBlockThreads)
    transport_amax_bf16(const __nv_bfloat16* __restrict__ x, unsigned long long n, float* amax) {
  unsigned m = 0;
  unsigned long long done = 0;
  if (aligned(x, 16)) {
    const uint4* __restrict__ xv = reinterpret_cast<const uint4*>(x);
    const unsigned long long nvec = n / 8;
    for (unsigned long long i = grid_thread(); i < nvec; i += grid_threads()) {
      const uint4 w = xv[i];
      m = max(m, max(max(abs_bits_lo(w.x), abs_bits_hi(w.x)), max(abs_bits_lo(w.y), abs_bits_hi(w.y))));
      m = max(m, max(max(abs_bits_lo(w.z), abs_bits_hi(w.z)), max(abs_bits_lo(w.w), abs_bits_hi(w.w))));
    }
    done = nvec * 8;
  }
  for (unsigned long long i = done + grid_thread(); i < n; i += grid_threads()) m = max(m, abs_bits(x[i]));
  m = block_max(m);
  if (threadIdx.x == 0 && m != 0) atomicMax(reinterpret_cast<unsigned*>(amax), m);
}

// q[i] = e4m3(float(x[i]) / scale) with scale = scale_of(*amax) (1 when *amax is 0 or NaN), the
// scale also written to *scale_out (by thread 0 of block 0). Run after transport_amax_bf16 on the
// same stream. Infinite inputs: with amax = +inf the scale is +inf, finite values become +-0 and
// +-inf become NaN (inf / inf), as in the reference.
__global__ void __launch_bounds__(kBlockThreads)
    transport_quantize_bf16_fp8(const __nv_bfloat16* __restrict__ x, unsigned long long n, const float* amax,
                                unsigned char* __restrict__ q, float* scale_out) {
  const float scale = scale_of(*amax);
  if (blockIdx.x == 0 && threadIdx.x == 0) *scale_out = scale;
  unsigned long long done = 0;
  if (aligned(x, 16) && aligned(q, 8)) {
    const uint4* __restrict__ xv = reinterpret_cast<const uint4*>(x);
    uint2* __restrict__ qv = reinterpret_cast<uint2*>(q);
    const unsigned long long nvec = n / 8;
    for (unsigned long long i = grid_thread(); i < nvec; i += grid_threads()) {
      const uint4 w = xv[i];
      uint2 out;
      out.x = quantize_word(w.x, scale) | (quantize_word(w.y, scale) << 16);
      out.y = quantize_word(w.z, scale) | (quantize_word(w.w, scale) << 16);
      qv[i] = out;
    }
    done = nvec * 8;
  }
  for (unsigned long long i = done + grid_thread(); i < n; i += grid_threads()) {
    q[i] = quantize_one(__bfloat162float(x[i]), scale);
  }
}

// out[i] = bf16(float(q[i]) * *scale), round to nearest even.
__global__ void __launch_bounds__(kBlockThreads)
    transport_dequantize_fp8_bf16(const unsigned char* __restrict__ q, unsigned long long n, const float* scale,
                                  __nv_bfloat16* __restrict__ out) {
  const float s = *scale;
  unsigned long long done = 0;
  if (aligned(q, 8) && aligned(out, 16)) {
    const uint2* __restrict__ qv = reinterpret_cast<const uint2*>(q);
    uint4* __restrict__ ov = reinterpret_cast<uint4*>(out);
    const unsigned long long nvec = n / 8;
    for (unsigned long long i = grid_thread(); i < nvec; i += grid_threads()) {
      const uint2 w = qv[i];
      uint4 o;
      o.x = dequantize_pair(w.x & 0xFFFF, s);
      o.y = dequantize_pair(w.x >> 16, s);
      o.z = dequantize_pair(w.y & 0xFFFF, s);
      o.w = dequantize_pair(w.y >> 16, s);
      ov[i] = o;
    }
    done = nvec * 8;
  }
  for (unsigned long long i = done + grid_thread(); i < n; i += grid_threads()) {
    out[i] = __ushort_as_bfloat16(dequantize_one(q[i], s));
  }
}

}  // extern "C"
