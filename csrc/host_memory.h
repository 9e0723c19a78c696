// Host memory that other processes on this host can reach without the owner's help:
// shareable memfd allocations, mappings of a peer's memfd, and the CMA permission probe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>

namespace transport {

// A page-aligned, pre-faulted MAP_SHARED allocation backed by a memfd. Same-host peers map it
// through /proc/<pid>/fd/<fd> and copy into it directly. Unmapped and closed on destruction.
//
// Its size is sealed (F_SEAL_SHRINK | F_SEAL_GROW) at creation: any process that can open the
// memfd through /proc could otherwise truncate it and make our own mapping raise SIGBUS.
// seal_writes() makes it read-only for everyone else for good (F_SEAL_FUTURE_WRITE, Linux >= 5.1):
// this object's own mapping stays writable, but no new writable shared mapping and no write(2)
// or hole punching of the memfd is allowed any more, whoever asks (root included).
class SharedBuffer {
 public:
  // `read_only`: seal writes before the memory is populated (see seal_writes), so that the
  // memfd is never writable by others past the few microseconds after its creation.
  SharedBuffer(size_t nbytes, const std::string& name, bool read_only = false);
  ~SharedBuffer();
  SharedBuffer(const SharedBuffer&) = delete;
  SharedBuffer& operator=(const SharedBuffer&) = delete;

  uint64_t address() const { return reinterpret_cast<uint64_t>(addr_); }
  size_t nbytes() const { return nbytes_; }
  int fd() const { return fd_; }
  // The memfd's inode number: tells this memfd from a later one under the same fd number.
  uint64_t inode() const { return inode_; }
  bool sealed() const;

  // Adds F_SEAL_FUTURE_WRITE | F_SEAL_SEAL (idempotent). Returns 0 or errno (EINVAL: a kernel
  // before 5.1; EPERM: someone sealed the seals first, so writes can no longer be sealed).
  int seal_writes();

  // A second, PROT_READ mapping of the same memfd (made on first use, unmapped on destruction):
  // the same bytes, at an address where no process can write them through process_vm_writev
  // (EFAULT: the kernel does not force writes into a read-only shared mapping). Throws
  // std::runtime_error when it cannot be mapped.
  uint64_t read_only_address();

 private:
  void* addr_ = nullptr;
  void* ro_addr_ = nullptr;
  size_t nbytes_ = 0;
  size_t mapped_ = 0;
  int fd_ = -1;
  uint64_t inode_ = 0;
  mutable std::mutex mu_;
  bool sealed_ = false;
};

// This process's mapping of a memfd owned by process `pid`. Throws std::runtime_error (the
// message ends with the errno). `inode` (0: unchecked) is the inode the owner published: a file
// behind /proc/<pid>/fd/<fd> with another inode is refused (the fd number was reused).
class PeerMapping {
 public:
  PeerMapping(int pid, int fd, size_t nbytes, bool writable, uint64_t inode = 0);
  ~PeerMapping();
  PeerMapping(const PeerMapping&) = delete;
  PeerMapping& operator=(const PeerMapping&) = delete;

  uint64_t address() const { return reinterpret_cast<uint64_t>(addr_); }
  size_t nbytes() const { return nbytes_; }
  // Fills this mapping's page tables for the pages of `count` byte ranges (`ranges`: address,
  // length pairs, each inside the mapping), for writing or for reading
  // (MADV_POPULATE_WRITE / _READ): the owner's pages, already there or allocated as a write
  // into them would. Returns 0, or the errno of the first refusal (EINVAL before Linux 5.14;
  // ERANGE for a range outside the mapping, before any page is touched).
  int populate(const uint64_t* ranges, size_t count, bool write) const;

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
