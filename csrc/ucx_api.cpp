#include "ucx_api.h"

#include <dlfcn.h>

#include <memory>
#include <mutex>
#include <stdexcept>
#include <utility>

namespace transport::ucx {

namespace {

std::mutex g_mu;
std::unique_ptr<Api> g_api;  // never unloaded: UCX installs memory hooks that outlive any user

// UCX 1.10 introduced the *_nbx calls used here.
constexpr unsigned kMinMajor = 1, kMinMinor = 10;

template <typename F>
void resolve(void* handle, const char* name, F& slot, const std::string& path) {
  dlerror();
  void* sym = dlsym(handle, name);
  if (sym == nullptr) {
    throw std::runtime_error(path + " has no symbol " + name + " (UCX >= " + std::to_string(kMinMajor) + "." +
                             std::to_string(kMinMinor) + " is needed)");
  }
  slot = reinterpret_cast<F>(sym);
}

}  // namespace

std::string Api::version() const {
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(release);
}

std::string Api::describe(ucs_status_t status) const {
  std::string text = status_string != nullptr ? status_string(status) : "unknown";
  return "ucs status " + std::to_string(static_cast<int>(status)) + " (" + text + ")";
}

const Api* loaded_api() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_api.get();
}

const Api& load_api(const std::string& path) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_api) return *g_api;
  // RTLD_LOCAL: UCX's symbols stay out of the global namespace (no clash with another UCX that
  // some other library may load); libucp finds libucs/libuct through its own RPATH.
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* err = dlerror();
    throw std::runtime_error("cannot load " + path + ": " + (err ? err : "dlopen failed"));
  }
  auto api = std::make_unique<Api>();
  api->path = path;
  try {
    resolve(handle, "ucp_get_version", api->get_version, path);
    resolve(handle, "ucp_config_read", api->config_read, path);
    resolve(handle, "ucp_config_release", api->config_release, path);
    resolve(handle, "ucp_init_version", api->init_version, path);
    resolve(handle, "ucp_cleanup", api->cleanup, path);
    resolve(handle, "ucp_worker_create", api->worker_create, path);
    resolve(handle, "ucp_worker_destroy", api->worker_destroy, path);
    resolve(handle, "ucp_worker_get_address", api->worker_get_address, path);
    resolve(handle, "ucp_worker_release_address", api->worker_release_address, path);
    resolve(handle, "ucp_worker_get_efd", api->worker_get_efd, path);
    resolve(handle, "ucp_worker_arm", api->worker_arm, path);
    resolve(handle, "ucp_worker_progress", api->worker_progress, path);
    resolve(handle, "ucp_ep_create", api->ep_create, path);
    resolve(handle, "ucp_ep_close_nbx", api->ep_close_nbx, path);
    resolve(handle, "ucp_ep_flush_nbx", api->ep_flush_nbx, path);
    resolve(handle, "ucp_mem_map", api->mem_map, path);
    resolve(handle, "ucp_mem_unmap", api->mem_unmap, path);
    resolve(handle, "ucp_rkey_pack", api->rkey_pack, path);
    resolve(handle, "ucp_rkey_buffer_release", api->rkey_buffer_release, path);
    resolve(handle, "ucp_ep_rkey_unpack", api->ep_rkey_unpack, path);
    resolve(handle, "ucp_rkey_destroy", api->rkey_destroy, path);
    resolve(handle, "ucp_put_nbx", api->put_nbx, path);
    resolve(handle, "ucp_get_nbx", api->get_nbx, path);
    resolve(handle, "ucp_request_check_status", api->request_check_status, path);
    resolve(handle, "ucp_request_free", api->request_free, path);
    resolve(handle, "ucs_status_string", api->status_string, path);
  } catch (...) {
    dlclose(handle);
    throw;
  }
  api->get_version(&api->major, &api->minor, &api->release);
  if (api->major < kMinMajor || (api->major == kMinMajor && api->minor < kMinMinor)) {
    std::string v = api->version();
    dlclose(handle);
    throw std::runtime_error(path + " is UCX " + v + "; UCX >= " + std::to_string(kMinMajor) + "." +
                             std::to_string(kMinMinor) + " is needed");
  }
  g_api = std::move(api);
  return *g_api;
}

}  // namespace transport::ucx
