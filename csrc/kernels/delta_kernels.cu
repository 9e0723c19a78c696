// The delta-sync diff on the GPU: the same compare, copy and checksum as csrc/delta_encode.cpp's
// pass, for a tensor that lives in device memory, with the changed positions as a bitmask (the
// bitmask encoding of delta.h, bit for bit) and a second kernel that gathers the changed values.
//
// Compiled into the same fatbin as transport_kernels.cu (CMakeLists.txt includes both in one
// translation unit) and launched by name through the CUDA driver; the conventions of that file
// hold here too (extern "C", pointer / 64-bit parameters, grid-stride loops, a fixed block
// size). tests/weights/test_delta_sync.py holds the kernels against the CPU encoder on a GPU.
#include <stdint.h>

namespace delta_kernels {

constexpr unsigned kDeltaBlockThreads = 256;
constexpr uint32_t kIndexMul = 0x9E3779B9u;
constexpr uint32_t kMix = 0x85EBCA6Bu;

__device__ __forceinline__ uint32_t mix(uint32_t x, unsigned long long i) {
  uint32_t y = (x ^ (static_cast<uint32_t>(i) * kIndexMul)) * kMix;
  return y ^ (y >> 15);
}

// One warp takes 32 consecutive elements at a time, so a ballot is one 32-bit bitmask word.
template <typename T>
__device__ __forceinline__ void diff(const T* __restrict__ fresh, const T* __restrict__ base, T* __restrict__ snap,
                                     unsigned long long n, uint32_t* __restrict__ mask,
                                     unsigned long long* __restrict__ count,
                                     unsigned long long* __restrict__ checksum) {
  const unsigned lane = threadIdx.x & 31u;
  const unsigned long long warp = (static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const unsigned long long warps = (static_cast<unsigned long long>(gridDim.x) * blockDim.x) >> 5;
  unsigned long long sum = 0, changed = 0;
  for (unsigned long long w = warp; w * 32 < n; w += warps) {
    const unsigned long long i = w * 32 + lane;
    bool ne = false;
    if (i < n) {
      const T x = fresh[i];
      if (snap != nullptr) snap[i] = x;
      sum += mix(static_cast<uint32_t>(x), i);
      ne = base != nullptr && x != base[i];
    }
    const unsigned bits = __ballot_sync(0xffffffffu, ne);
    if (lane == 0) {
      mask[w] = bits;
      changed += __popc(bits);
    }
  }
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, off);
  if (lane == 0) {
    atomicAdd(checksum, sum);
    atomicAdd(count, changed);
  }
}

// One thread per bitmask word: its changed values go to values[offsets[w]...] in order
// (offsets: the exclusive prefix sum of the words' popcounts).
template <typename T>
__device__ __forceinline__ void gather(const T* __restrict__ fresh, const uint32_t* __restrict__ mask,
                                       const unsigned long long* __restrict__ offsets, unsigned long long nwords,
                                       T* __restrict__ values) {
  const unsigned long long stride = static_cast<unsigned long long>(gridDim.x) * blockDim.x;
  for (unsigned long long w = static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x; w < nwords;
       w += stride) {
    unsigned bits = mask[w];
    unsigned long long at = offsets[w];
    while (bits) {
      const int t = __ffs(bits) - 1;
      values[at++] = fresh[w * 32 + t];
      bits &= bits - 1;
    }
  }
}

}  // namespace delta_kernels

extern "C" {

// fresh/base/snap: n elements (base or snap may be null: no diff / no copy); mask: ceil(n / 32)
// words; count and checksum: zeroed by the caller, added to here.
__global__ void __launch_bounds__(delta_kernels::kDeltaBlockThreads)
transport_delta_diff_u16(const uint16_t* fresh, const uint16_t* base, uint16_t* snap, unsigned long long n,
                         uint32_t* mask, unsigned long long* count, unsigned long long* checksum) {
  delta_kernels::diff(fresh, base, snap, n, mask, count, checksum);
}

__global__ void __launch_bounds__(delta_kernels::kDeltaBlockThreads)
transport_delta_diff_u32(const uint32_t* fresh, const uint32_t* base, uint32_t* snap, unsigned long long n,
                         uint32_t* mask, unsigned long long* count, unsigned long long* checksum) {
  delta_kernels::diff(fresh, base, snap, n, mask, count, checksum);
}

__global__ void __launch_bounds__(delta_kernels::kDeltaBlockThreads)
transport_delta_gather_u16(const uint16_t* fresh, const uint32_t* mask, const unsigned long long* offsets,
                           unsigned long long nwords, uint16_t* values) {
  delta_kernels::gather(fresh, mask, offsets, nwords, values);
}

__global__ void __launch_bounds__(delta_kernels::kDeltaBlockThreads)
transport_delta_gather_u32(const uint32_t* fresh, const uint32_t* mask, const unsigned long long* offsets,
                           unsigned long long nwords, uint32_t* values) {
  delta_kernels::gather(fresh, mask, offsets, nwords, values);
}

}  // extern "C"
