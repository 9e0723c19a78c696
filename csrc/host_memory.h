// Host memory that other processes on this host can reach without the owner's help:
// shareable memfd allocations, mappings of a peer's memfd, and the CMA permission probe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace transport {

// A page-aligned, pre-faulted MAP_SHARED allocation backed by a memfd. Same-host peers map it
// through /proc/<pid>/fd/<fd> and copy into it directly. Unmapped and closed on destruction.
class SharedBuffer {
 public:
  SharedBuffer(size_t nbytes, const std::string& name);
  ~SharedBuffer();
  SharedBuffer(const SharedBuffer&) = delete;
  SharedBuffer& operator=(const SharedBuffer&) = delete;

  uint64_t address() const { return reinterpret_cast<uint64_t>(addr_); }
  size_t nbytes() const { return nbytes_; }
  int fd() const { return fd_; }

 private:
  void* addr_ = nullptr;
  size_t nbytes_ = 0;
  size_t mapped_ = 0;
  int fd_ = -1;
};

// This process's mapping of a memfd owned by process `pid`. Throws std::system_error-like
// std::runtime_error carrying errno in `PeerMapping::last_errno` semantics via the message.
class PeerMapping {
 public:
  PeerMapping(int pid, int fd, size_t nbytes, bool writable);
  ~PeerMapping();
  PeerMapping(const PeerMapping&) = delete;
  PeerMapping& operator=(const PeerMapping&) = delete;

  uint64_t address() const { return reinterpret_cast<uint64_t>(addr_); }
  size_t nbytes() const { return nbytes_; }

 private:
  void* addr_ = nullptr;
  size_t nbytes_ = 0;
  size_t mapped_ = 0;
};

// 0 when this process may read `nbytes` at `addr` in process `pid` with process_vm_readv,
// otherwise the errno (EPERM: ptrace policy or another user; ESRCH: no such process).
int cma_probe(int pid, uint64_t addr, size_t nbytes);

// Address of a readable byte in this process, published so peers can probe CMA permission.
uint64_t probe_address();

// Lets any process of the same user attach with CMA under Yama ptrace_scope=1 (PR_SET_PTRACER).
// Returns 0 or errno (EINVAL where Yama is absent, which means it is not needed).
int allow_ptrace_from_any();

}  // namespace transport
