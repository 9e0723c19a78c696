// The CUDA operations the library needs, on top of the run-time-loaded driver (cuda_driver.h).
//
// Handles (streams, events, modules, functions) cross the boundary as integers. Every call that
// takes a `device` makes that device's primary context (the one PyTorch uses) current on the
// calling thread first, so they can run on any thread. All throw cuda::Unavailable without a
// driver and cuda::Error when the driver refuses.
#pragma once

#include <cstdint>
#include <string>
#include <tuple>

namespace transport::cuda {

int driver_version();
int device_count();
std::string device_uuid(int device);  // "GPU-xxxxxxxx-xxxx-..." as nvidia-smi prints it
std::string device_name(int device);

// The allocation `ptr` lies in: (base, size, device ordinal, legacy-IPC-capable); `device` (-1:
// unknown) is made current for the queries. Not IPC-capable: (ptr, 0, ordinal, false).
std::tuple<uint64_t, uint64_t, int, bool> allocation(uint64_t ptr, int device = -1);

// Legacy CUDA IPC: a 64-byte handle for the allocation starting at `base`; its mapping in this
// process (on `device`); and closing it.
std::string ipc_export(uint64_t base, int device);
uint64_t ipc_open(const std::string& handle, int device);
void ipc_close(uint64_t ptr, int device);

uint64_t stream_create(int device);  // non-blocking w.r.t. the legacy default stream
void stream_destroy(uint64_t stream, int device);
// Blocks until the work queued on `stream` so far has run.
void stream_synchronize(uint64_t stream, int device);
// Page-locks host memory for DMA (portable to every context) and undoes it. `read_only` for
// memory mapped without write permission (the device then only reads it).
void host_register(uint64_t ptr, uint64_t nbytes, bool read_only, int device);
void host_unregister(uint64_t ptr, int device);

uint64_t module_load(const std::string& image, int device);
uint64_t module_function(uint64_t module, const std::string& name, int device);
// Launches `function` with its parameters packed as the C ABI lays them out in `params`.
void launch(uint64_t function, std::tuple<unsigned, unsigned, unsigned> grid, std::tuple<unsigned, unsigned, unsigned> block,
            unsigned shared_bytes, uint64_t stream, const std::string& params, int device);

}  // namespace transport::cuda
