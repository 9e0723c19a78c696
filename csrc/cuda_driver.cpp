#include "cuda_driver.h"

#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <map>
#include <mutex>
#include <utility>

namespace transport::cuda {

namespace {

Api g_api{};
std::string g_reason = "the CUDA driver was not loaded yet";
std::once_flag g_once;

// Versioned names first: the unversioned symbols of these calls keep pre-CUDA-11 ABIs.
template <typename F>
bool resolve(void* lib, F*& slot, std::initializer_list<const char*> names, std::string& missing) {
  for (const char* n : names) {
    if (void* p = dlsym(lib, n)) {
      slot = reinterpret_cast<F*>(p);
      return true;
    }
  }
  missing = *names.begin();
  return false;
}

std::string do_load(const std::string& path) {
  std::string lib_name = path;
  if (lib_name.empty()) {
    const char* env = std::getenv("TRANSPORT_CUDA_LIB");
    lib_name = env && *env ? env : "libcuda.so.1";
  }
  void* lib = dlopen(lib_name.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* err = dlerror();
    return "no CUDA driver: cannot load " + lib_name + " (" + (err ? err : "not found") +
           "); CUDA tensors need an NVIDIA driver (set $TRANSPORT_CUDA_LIB to its libcuda.so.1 if it is elsewhere)";
  }
  Api a{};
  std::string missing;
  bool ok = resolve(lib, a.cuInit, {"cuInit"}, missing) &&
            resolve(lib, a.cuDriverGetVersion, {"cuDriverGetVersion"}, missing) &&
            resolve(lib, a.cuGetErrorName, {"cuGetErrorName"}, missing) &&
            resolve(lib, a.cuGetErrorString, {"cuGetErrorString"}, missing) &&
            resolve(lib, a.cuDeviceGetCount, {"cuDeviceGetCount"}, missing) &&
            resolve(lib, a.cuDeviceGet, {"cuDeviceGet"}, missing) &&
            resolve(lib, a.cuDeviceGetUuid, {"cuDeviceGetUuid_v2", "cuDeviceGetUuid"}, missing) &&
            resolve(lib, a.cuDeviceGetName, {"cuDeviceGetName"}, missing) &&
            resolve(lib, a.cuDevicePrimaryCtxRetain, {"cuDevicePrimaryCtxRetain"}, missing) &&
            resolve(lib, a.cuCtxGetCurrent, {"cuCtxGetCurrent"}, missing) &&
            resolve(lib, a.cuCtxSetCurrent, {"cuCtxSetCurrent"}, missing) &&
            resolve(lib, a.cuPointerGetAttribute, {"cuPointerGetAttribute"}, missing) &&
            resolve(lib, a.cuMemGetAddressRange, {"cuMemGetAddressRange_v2"}, missing) &&
            resolve(lib, a.cuIpcGetMemHandle, {"cuIpcGetMemHandle"}, missing) &&
            resolve(lib, a.cuIpcOpenMemHandle, {"cuIpcOpenMemHandle_v2"}, missing) &&
            resolve(lib, a.cuIpcCloseMemHandle, {"cuIpcCloseMemHandle"}, missing) &&
            resolve(lib, a.cuStreamCreate, {"cuStreamCreate"}, missing) &&
            resolve(lib, a.cuStreamDestroy, {"cuStreamDestroy_v2"}, missing) &&
            resolve(lib, a.cuStreamWaitEvent, {"cuStreamWaitEvent"}, missing) &&
            resolve(lib, a.cuStreamSynchronize, {"cuStreamSynchronize"}, missing) &&
            resolve(lib, a.cuEventCreate, {"cuEventCreate"}, missing) &&
            resolve(lib, a.cuEventDestroy, {"cuEventDestroy_v2"}, missing) &&
            resolve(lib, a.cuEventRecord, {"cuEventRecord"}, missing) &&
            resolve(lib, a.cuEventQuery, {"cuEventQuery"}, missing) &&
            resolve(lib, a.cuEventSynchronize, {"cuEventSynchronize"}, missing) &&
            resolve(lib, a.cuMemcpyAsync, {"cuMemcpyAsync"}, missing) &&
            resolve(lib, a.cuMemHostRegister, {"cuMemHostRegister_v2"}, missing) &&
            resolve(lib, a.cuMemHostUnregister, {"cuMemHostUnregister"}, missing) &&
            resolve(lib, a.cuModuleLoadData, {"cuModuleLoadData"}, missing) &&
            resolve(lib, a.cuModuleGetFunction, {"cuModuleGetFunction"}, missing) &&
            resolve(lib, a.cuLaunchKernel, {"cuLaunchKernel"}, missing);
  if (!ok) {
    dlclose(lib);
    return "the CUDA driver " + lib_name + " lacks " + missing + " (driver too old: CUDA 11.4 or newer is needed)";
  }
  g_api = a;  // describe() may use the error-name functions from here on
  CUresult r = a.cuInit(0);
  if (r != CUDA_SUCCESS) {
    std::string why = "cuInit failed: " + describe(r);
    g_api = Api{};
    return why;
  }
  int count = 0;
  r = a.cuDeviceGetCount(&count);
  if (r != CUDA_SUCCESS || count == 0) {
    std::string why = r != CUDA_SUCCESS ? "cuDeviceGetCount failed: " + describe(r) : "the CUDA driver sees no device";
    g_api = Api{};
    return why;
  }
  return "";
}

}  // namespace

std::string describe(CUresult r) {
  const char* name = nullptr;
  const char* text = nullptr;
  if (g_api.cuGetErrorName) g_api.cuGetErrorName(r, &name);
  if (g_api.cuGetErrorString) g_api.cuGetErrorString(r, &text);
  return std::string(name ? name : "CUDA_ERROR_?") + " (" + std::to_string(r) + "): " + (text ? text : "unknown error");
}

std::string hex(uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

const std::string& load(const std::string& path) {
  std::call_once(g_once, [&] { g_reason = do_load(path); });
  return g_reason;
}

const Api& api() {
  if (!load().empty()) throw Unavailable(g_reason);
  return g_api;
}

void check(CUresult r, const std::string& what) {
  if (r != CUDA_SUCCESS) throw Error(what + " failed: " + describe(r), r);
}

namespace {

std::mutex g_ctx_mu;
std::map<int, CUcontext> g_ctx;  // device -> retained primary context (kept for the process)

}  // namespace

CUcontext primary_context(int device) {
  const Api& a = api();
  std::lock_guard<std::mutex> lock(g_ctx_mu);
  auto it = g_ctx.find(device);
  if (it != g_ctx.end()) return it->second;
  CUdevice dev = 0;
  check(a.cuDeviceGet(&dev, device), "cuDeviceGet(" + std::to_string(device) + ")");
  CUcontext ctx = nullptr;
  check(a.cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain(device " + std::to_string(device) + ")");
  g_ctx[device] = ctx;
  return ctx;
}

OnDevice::OnDevice(int device) : a(api()) {
  CUcontext ctx = primary_context(device);
  check(a.cuCtxGetCurrent(&prev_), "cuCtxGetCurrent");
  if (prev_ != ctx) {
    check(a.cuCtxSetCurrent(ctx), "cuCtxSetCurrent(device " + std::to_string(device) + ")");
    restore_ = true;
  }
}

OnDevice::~OnDevice() {
  if (restore_) a.cuCtxSetCurrent(prev_);
}

}  // namespace transport::cuda
