// The CUDA driver API, loaded at run time.
//
// libcuda.so.1 is dlopen'ed on first use: building needs no CUDA headers or libraries, and the
// extension imports on machines without a GPU. The few driver types and constants used here are
// declared below with the values of cuda.h (they are part of the driver's stable ABI).
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace transport::cuda {

using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CUcontext = struct CUctx_st*;
using CUstream = struct CUstream_st*;
using CUevent = struct CUevent_st*;
using CUmodule = struct CUmod_st*;
using CUfunction = struct CUfunc_st*;

struct CUipcMemHandle {
  char reserved[64];
};
struct CUuuid {
  unsigned char bytes[16];
};

constexpr CUresult CUDA_SUCCESS = 0;
constexpr CUresult CUDA_ERROR_NOT_READY = 600;
constexpr CUresult CUDA_ERROR_UNKNOWN = 999;
constexpr int CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2;
constexpr int CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9;
constexpr int CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10;  // (18 is MAPPING_SIZE, a size_t)
constexpr unsigned CU_MEMORYTYPE_DEVICE = 2;
constexpr unsigned CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1;
constexpr unsigned CU_STREAM_NON_BLOCKING = 1;
constexpr unsigned CU_EVENT_DISABLE_TIMING = 2;
constexpr unsigned CU_MEMHOSTREGISTER_PORTABLE = 1;
constexpr unsigned CU_MEMHOSTREGISTER_READ_ONLY = 8;

// Every driver entry point this library calls.
struct Api {
  CUresult (*cuInit)(unsigned);
  CUresult (*cuDriverGetVersion)(int*);
  CUresult (*cuGetErrorName)(CUresult, const char**);
  CUresult (*cuGetErrorString)(CUresult, const char**);
  CUresult (*cuDeviceGetCount)(int*);
  CUresult (*cuDeviceGet)(CUdevice*, int);
  CUresult (*cuDeviceGetUuid)(CUuuid*, CUdevice);
  CUresult (*cuDeviceGetName)(char*, int, CUdevice);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*cuCtxGetCurrent)(CUcontext*);
  CUresult (*cuCtxSetCurrent)(CUcontext);
  CUresult (*cuPointerGetAttribute)(void*, int, CUdeviceptr);
  CUresult (*cuMemGetAddressRange)(CUdeviceptr*, size_t*, CUdeviceptr);
  CUresult (*cuIpcGetMemHandle)(CUipcMemHandle*, CUdeviceptr);
  CUresult (*cuIpcOpenMemHandle)(CUdeviceptr*, CUipcMemHandle, unsigned);
  CUresult (*cuIpcCloseMemHandle)(CUdeviceptr);
  CUresult (*cuStreamCreate)(CUstream*, unsigned);
  CUresult (*cuStreamDestroy)(CUstream);
  CUresult (*cuStreamWaitEvent)(CUstream, CUevent, unsigned);
  CUresult (*cuStreamSynchronize)(CUstream);
  CUresult (*cuEventCreate)(CUevent*, unsigned);
  CUresult (*cuEventDestroy)(CUevent);
  CUresult (*cuEventRecord)(CUevent, CUstream);
  CUresult (*cuEventQuery)(CUevent);
  CUresult (*cuEventSynchronize)(CUevent);
  CUresult (*cuMemcpyAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
  CUresult (*cuMemHostRegister)(void*, size_t, unsigned);
  CUresult (*cuMemHostUnregister)(void*);
  CUresult (*cuModuleLoadData)(CUmodule*, const void*);
  CUresult (*cuModuleGetFunction)(CUfunction*, CUmodule, const char*);
  CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             CUstream, void**, void**);
};

// No usable driver: the message says why (library missing, cuInit failed, no device).
class Unavailable : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A driver call failed: the message names the call and the driver's error name and text.
class Error : public std::runtime_error {
 public:
  Error(const std::string& msg, CUresult code) : std::runtime_error(msg), code(code) {}
  CUresult code;
};

// Loads the driver once (thread-safe; later calls return the first outcome). `path` overrides
// the library searched for ("" = $TRANSPORT_CUDA_LIB or libcuda.so.1). Returns "" when the
// driver is usable, else why not.
const std::string& load(const std::string& path = "");

// The loaded driver; throws Unavailable with load()'s reason when there is none.
const Api& api();

// Throws Error unless `r` is CUDA_SUCCESS; `what` names the call and its arguments.
void check(CUresult r, const std::string& what);

// Driver handles (streams, events, modules, functions) cross the Python boundary as integers.
template <typename T>
T* as(uint64_t handle) {
  return reinterpret_cast<T*>(static_cast<uintptr_t>(handle));
}

template <typename T>
uint64_t handle(T* p) {
  return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p));
}

// "0x1f00" (for messages).
std::string hex(uint64_t v);

// The driver's name and text for `r`: "CUDA_ERROR_X (n): text".
std::string describe(CUresult r);

// `device`'s primary context (the one PyTorch uses), retained on first use and kept for the
// process. Throws as api() does, and Error when the driver refuses.
CUcontext primary_context(int device);

// Makes `device`'s primary context (the one PyTorch uses, retained once for the process) current
// on the calling thread for the guard's lifetime, then restores the caller's: the application's
// current device (torch.cuda.current_device) never changes under it. Throws Unavailable without
// a driver, Error when the driver refuses.
class OnDevice {
 public:
  explicit OnDevice(int device);
  ~OnDevice();
  OnDevice(const OnDevice&) = delete;
  OnDevice& operator=(const OnDevice&) = delete;
  const Api& a;

 private:
  CUcontext prev_ = nullptr;
  bool restore_ = false;
};

}  // namespace transport::cuda
