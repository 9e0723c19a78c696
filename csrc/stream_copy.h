// Copies with non-temporal (streaming) stores, for large host-to-host copies.
//
// A plain memcpy of a piece that fits the cache writes through it: each destination line is
// first read (read-for-ownership), so a large copy moves three bytes over the memory bus per
// byte copied. glibc's memcpy streams only single calls above a threshold far larger than the
// pieces the copy engine hands its threads, so a 1 GiB job cut into 8 MiB pieces ran at about
// 60% of one large memcpy. Streaming stores skip the read and the cache: right for data that is
// not read again soon (weights pushed to a peer), wrong for small or soon-read copies.
#pragma once

#include <cstddef>

namespace transport {

// Copies `n` bytes from `src` to `dst` (not overlapping) with streaming stores where the CPU has
// them (x86-64: AVX2 when present, else SSE2), ending with a store fence: the bytes are visible
// to other threads and processes like those of a memcpy followed by a release. Elsewhere memcpy.
void stream_copy(void* dst, const void* src, size_t n);

}  // namespace transport
