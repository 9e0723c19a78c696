// libucp, loaded at run time.
//
// The extension is compiled against UCX headers but never linked to libucp: every ucp_*
// function the engine uses is resolved with dlsym into one table, once per process. This keeps
// `import transport._C` working on machines without UCX, and lets a user pick the library at run
// time (the libucx-cu12 wheel by default, or a system UCX with InfiniBand support).
#pragma once

#include <ucp/api/ucp.h>

#include <string>

namespace transport::ucx {

// The subset of libucp (and libucs, reached through libucp's dependencies) the engine calls.
struct Api {
  std::string path;     // what was dlopen'ed
  unsigned major = 0;   // runtime library version
  unsigned minor = 0;
  unsigned release = 0;

  decltype(&ucp_get_version) get_version = nullptr;
  decltype(&ucp_config_read) config_read = nullptr;
  decltype(&ucp_config_release) config_release = nullptr;
  decltype(&ucp_init_version) init_version = nullptr;
  decltype(&ucp_cleanup) cleanup = nullptr;
  decltype(&ucp_worker_create) worker_create = nullptr;
  decltype(&ucp_worker_destroy) worker_destroy = nullptr;
  decltype(&ucp_worker_get_address) worker_get_address = nullptr;
  decltype(&ucp_worker_release_address) worker_release_address = nullptr;
  decltype(&ucp_worker_get_efd) worker_get_efd = nullptr;
  decltype(&ucp_worker_arm) worker_arm = nullptr;
  decltype(&ucp_worker_progress) worker_progress = nullptr;
  decltype(&ucp_ep_create) ep_create = nullptr;
  decltype(&ucp_ep_close_nbx) ep_close_nbx = nullptr;
  decltype(&ucp_ep_flush_nbx) ep_flush_nbx = nullptr;
  decltype(&ucp_mem_map) mem_map = nullptr;
  decltype(&ucp_mem_unmap) mem_unmap = nullptr;
  decltype(&ucp_rkey_pack) rkey_pack = nullptr;
  decltype(&ucp_rkey_buffer_release) rkey_buffer_release = nullptr;
  decltype(&ucp_ep_rkey_unpack) ep_rkey_unpack = nullptr;
  decltype(&ucp_rkey_destroy) rkey_destroy = nullptr;
  decltype(&ucp_put_nbx) put_nbx = nullptr;
  decltype(&ucp_get_nbx) get_nbx = nullptr;
  decltype(&ucp_request_check_status) request_check_status = nullptr;
  decltype(&ucp_request_free) request_free = nullptr;
  decltype(&ucs_status_string) status_string = nullptr;

  std::string version() const;
  std::string describe(ucs_status_t status) const;  // "UCS_ERR_...: text"
};

// dlopens `path` (a file path, or a soname for the system loader) the first time and resolves
// every symbol; later calls return the same table whatever path they pass (a process can hold
// only one libucp). Throws std::runtime_error saying what is missing.
const Api& load_api(const std::string& path);

// The table if load_api succeeded before, else nullptr.
const Api* loaded_api();

}  // namespace transport::ucx
