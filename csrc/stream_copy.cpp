#include "stream_copy.h"

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace transport {

#if defined(__x86_64__)
namespace {

// The head up to the first `Align`-aligned destination byte and the tail are plain memcpy.
template <size_t Align>
size_t head_bytes(const void* dst, size_t n) {
  size_t head = (Align - (reinterpret_cast<uintptr_t>(dst) & (Align - 1))) & (Align - 1);
  return head < n ? head : n;
}

__attribute__((target("avx2"))) void stream_avx2(char* d, const char* s, size_t n) {
  size_t head = head_bytes<32>(d, n);
  std::memcpy(d, s, head);
  d += head, s += head, n -= head;
  size_t i = 0;
  for (; i + 128 <= n; i += 128) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 32));
    __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 64));
    __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 96), e);
  }
  std::memcpy(d + i, s + i, n - i);
  _mm_sfence();
}

void stream_sse2(char* d, const char* s, size_t n) {
  size_t head = head_bytes<16>(d, n);
  std::memcpy(d, s, head);
  d += head, s += head, n -= head;
  size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
  std::memcpy(d + i, s + i, n - i);
  _mm_sfence();
}

const bool kHasAvx2 = [] {
  __builtin_cpu_init();  // this may run before libgcc's own constructor has
  return __builtin_cpu_supports("avx2") != 0;
}();

}  // namespace

void stream_copy(void* dst, const void* src, size_t n) {
  if (kHasAvx2)
    stream_avx2(static_cast<char*>(dst), static_cast<const char*>(src), n);
  else
    stream_sse2(static_cast<char*>(dst), static_cast<const char*>(src), n);
}

#else

void stream_copy(void* dst, const void* src, size_t n) { std::memcpy(dst, src, n); }

#endif

}  // namespace transport
