#include "cuda_ops.h"

#include <cstdio>
#include <cstring>
#include <optional>
#include <utility>

#include "cuda_driver.h"

namespace transport::cuda {


int driver_version() {
  int v = 0;
  check(api().cuDriverGetVersion(&v), "cuDriverGetVersion");
  return v;
}

int device_count() {
  int n = 0;
  check(api().cuDeviceGetCount(&n), "cuDeviceGetCount");
  return n;
}

std::string device_uuid(int device) {
  const Api& a = api();
  CUdevice dev = 0;
  check(a.cuDeviceGet(&dev, device), "cuDeviceGet(" + std::to_string(device) + ")");
  CUuuid u{};
  check(a.cuDeviceGetUuid(&u, dev), "cuDeviceGetUuid(" + std::to_string(device) + ")");
  const unsigned char* b = u.bytes;
  char buf[64];
  std::snprintf(buf, sizeof(buf), "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1],
                b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
  return buf;
}

std::string device_name(int device) {
  const Api& a = api();
  CUdevice dev = 0;
  check(a.cuDeviceGet(&dev, device), "cuDeviceGet(" + std::to_string(device) + ")");
  char name[256] = {0};
  check(a.cuDeviceGetName(name, sizeof(name) - 1, dev), "cuDeviceGetName");
  return name;
}

std::tuple<uint64_t, uint64_t, int, bool> allocation(uint64_t ptr, int device) {
  const Api& a = api();
  // Pointer queries can fail with CUDA_ERROR_INVALID_CONTEXT on a thread with no current
  // context: make the caller's guess of the device (the tensor's) current for them.
  std::optional<OnDevice> hint;
  if (device >= 0) hint.emplace(device);
  unsigned mem_type = 0;  // a CUmemorytype
  check(a.cuPointerGetAttribute(&mem_type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr),
        "cuPointerGetAttribute(MEMORY_TYPE, " + hex(ptr) + ")");
  if (mem_type != CU_MEMORYTYPE_DEVICE) {
    throw Error("address " + hex(ptr) + " is not device memory (memory type " + std::to_string(mem_type) + ")", 1);
  }
  int ordinal = -1;
  check(a.cuPointerGetAttribute(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr),
        "cuPointerGetAttribute(DEVICE_ORDINAL, " + hex(ptr) + ")");
  OnDevice on(ordinal);
  int ipc_capable = 0;  // a boolean: an int holds it whether the driver writes 1 or 4 bytes
  // Older drivers do not know the attribute: then assume a legacy (cuMemAlloc) allocation.
  if (a.cuPointerGetAttribute(&ipc_capable, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, ptr) != CUDA_SUCCESS) {
    ipc_capable = 1;
  }
  // A VMM allocation (e.g. PyTorch's expandable segments) cannot be exported with legacy IPC;
  // its range is not needed, and the caller refuses it with a message that says why.
  if (!ipc_capable) return {ptr, 0, ordinal, false};
  CUdeviceptr base = 0;
  size_t size = 0;
  check(a.cuMemGetAddressRange(&base, &size, ptr), "cuMemGetAddressRange(" + hex(ptr) + ")");
  return {base, size, ordinal, true};
}

std::string ipc_export(uint64_t base, int device) {
  OnDevice on(device);
  const Api& a = on.a;
  CUipcMemHandle h{};
  check(a.cuIpcGetMemHandle(&h, base), "cuIpcGetMemHandle(" + hex(base) + ")");
  return std::string(h.reserved, sizeof(h.reserved));
}

uint64_t ipc_open(const std::string& handle_bytes, int device) {
  if (handle_bytes.size() != sizeof(CUipcMemHandle)) {
    throw Error("a CUDA IPC handle has 64 bytes, got " + std::to_string(handle_bytes.size()), 1);
  }
  OnDevice on(device);
  const Api& a = on.a;
  CUipcMemHandle h{};
  std::memcpy(h.reserved, handle_bytes.data(), sizeof(h.reserved));
  CUdeviceptr ptr = 0;
  check(a.cuIpcOpenMemHandle(&ptr, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle");
  return ptr;
}

void ipc_close(uint64_t ptr, int device) {
  OnDevice on(device);
  check(on.a.cuIpcCloseMemHandle(ptr), "cuIpcCloseMemHandle(" + hex(ptr) + ")");
}

uint64_t stream_create(int device) {
  CUstream s = nullptr;
  OnDevice on(device);
  check(on.a.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  return handle(s);
}

void stream_destroy(uint64_t stream, int device) {
  OnDevice on(device);
  check(on.a.cuStreamDestroy(as<CUstream_st>(stream)), "cuStreamDestroy");
}

void stream_synchronize(uint64_t stream, int device) {
  OnDevice on(device);
  check(on.a.cuStreamSynchronize(as<CUstream_st>(stream)), "cuStreamSynchronize");
}

void host_register(uint64_t ptr, uint64_t nbytes, bool read_only, int device) {
  unsigned flags = CU_MEMHOSTREGISTER_PORTABLE | (read_only ? CU_MEMHOSTREGISTER_READ_ONLY : 0u);
  OnDevice on(device);
  check(on.a.cuMemHostRegister(as<void>(ptr), nbytes, flags),
        "cuMemHostRegister(" + hex(ptr) + ", " + std::to_string(nbytes) + " bytes)");
}

void host_unregister(uint64_t ptr, int device) {
  OnDevice on(device);
  check(on.a.cuMemHostUnregister(as<void>(ptr)), "cuMemHostUnregister(" + hex(ptr) + ")");
}

uint64_t module_load(const std::string& image, int device) {
  CUmodule m = nullptr;
  OnDevice on(device);
  check(on.a.cuModuleLoadData(&m, image.data()), "cuModuleLoadData (" + std::to_string(image.size()) + "-byte image)");
  return handle(m);
}

uint64_t module_function(uint64_t module, const std::string& name, int device) {
  CUfunction f = nullptr;
  OnDevice on(device);
  check(on.a.cuModuleGetFunction(&f, as<CUmod_st>(module), name.c_str()), "cuModuleGetFunction(" + name + ")");
  return handle(f);
}

void launch(uint64_t function, std::tuple<unsigned, unsigned, unsigned> grid, std::tuple<unsigned, unsigned, unsigned> block,
            unsigned shared_bytes, uint64_t stream, const std::string& params, int device) {
  OnDevice on(device);
  const Api& a = on.a;
  std::string buf = params;  // the driver reads it during the call only
  size_t size = buf.size();
  void* extra[] = {reinterpret_cast<void*>(1), buf.data(),  // CU_LAUNCH_PARAM_BUFFER_POINTER
                   reinterpret_cast<void*>(2), &size,       // CU_LAUNCH_PARAM_BUFFER_SIZE
                   reinterpret_cast<void*>(0)};             // CU_LAUNCH_PARAM_END
  auto [gx, gy, gz] = grid;
  auto [bx, by, bz] = block;
  check(a.cuLaunchKernel(as<CUfunc_st>(function), gx, gy, gz, bx, by, bz, shared_bytes, as<CUstream_st>(stream), nullptr,
                         size ? extra : nullptr),
        "cuLaunchKernel");
}

}  // namespace transport::cuda
