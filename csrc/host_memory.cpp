#include "host_memory.h"

#include <algorithm>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

namespace transport {

namespace {

size_t page_round(size_t n) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  size_t r = (n + page - 1) / page * page;
  return r == 0 ? page : r;  // mmap refuses length 0; a 0-byte region still gets one page
}

[[noreturn]] void throw_errno(const std::string& what, int err) {
  throw std::runtime_error(what + ": " + std::strerror(err) + " [errno " + std::to_string(err) + "]");
}

volatile const unsigned char kProbeByte = 0x5a;

// Newer than some build hosts' headers; the kernel decides at run time.
#ifdef F_SEAL_FUTURE_WRITE
constexpr int kSealFutureWrite = F_SEAL_FUTURE_WRITE;
#else
constexpr int kSealFutureWrite = 0x0010;
#endif
#ifdef MADV_POPULATE_WRITE
constexpr int kMadvPopulateWrite = MADV_POPULATE_WRITE;
constexpr int kMadvPopulateRead = MADV_POPULATE_READ;
#else
constexpr int kMadvPopulateWrite = 23;
constexpr int kMadvPopulateRead = 22;
#endif

}  // namespace

SharedBuffer::SharedBuffer(size_t nbytes, const std::string& name, bool read_only) : nbytes_(nbytes) {
  mapped_ = page_round(nbytes);
  fd_ = memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd_ < 0) throw_errno("memfd_create", errno);
  // Cleans up and throws; `err` is read before anything else can change errno.
  auto fail = [this](int err, const std::string& what) {
    if (addr_ != nullptr) munmap(addr_, mapped_);
    addr_ = nullptr;
    close(fd_);
    fd_ = -1;
    throw_errno(what, err);
  };
  if (ftruncate(fd_, static_cast<off_t>(mapped_)) != 0)
    fail(errno, "ftruncate of memfd to " + std::to_string(mapped_) + " bytes");
  if (fcntl(fd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) fail(errno, "sealing the size of a memfd");
  struct stat st;
  if (fstat(fd_, &st) != 0) fail(errno, "fstat of a memfd");
  inode_ = static_cast<uint64_t>(st.st_ino);
  // MAP_POPULATE pre-faults: a never-touched destination copies at a third of memcpy speed. A
  // read-only buffer is sealed first and populated afterwards (through this writable mapping,
  // which the seal leaves alone), so that no other process can map it writable meanwhile.
  addr_ = mmap(nullptr, mapped_, PROT_READ | PROT_WRITE, MAP_SHARED | (read_only ? 0 : MAP_POPULATE), fd_, 0);
  if (addr_ == MAP_FAILED) {
    int err = errno;
    addr_ = nullptr;
    fail(err, "mmap of memfd (" + std::to_string(mapped_) + " bytes)");
  }
  if (read_only) {
    int err = seal_writes();
    if (err != 0) fail(err, "sealing a memfd against writes (F_SEAL_FUTURE_WRITE needs Linux >= 5.1)");
    if (madvise(addr_, mapped_, kMadvPopulateWrite) != 0) {  // before Linux 5.14: one write per page
      const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
      for (size_t off = 0; off < mapped_; off += page) static_cast<volatile unsigned char*>(addr_)[off] = 0;
    }
  }
}

SharedBuffer::~SharedBuffer() {
  if (ro_addr_) munmap(ro_addr_, mapped_);
  if (addr_) munmap(addr_, mapped_);
  if (fd_ >= 0) close(fd_);
}

bool SharedBuffer::sealed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return sealed_;
}

int SharedBuffer::seal_writes() {
  std::lock_guard<std::mutex> lock(mu_);
  if (sealed_) return 0;
  // F_SEAL_SEAL too: nothing may be added afterwards (the seals we need are all there).
  if (fcntl(fd_, F_ADD_SEALS, kSealFutureWrite | F_SEAL_SEAL) != 0) return errno;
  sealed_ = true;
  return 0;
}

uint64_t SharedBuffer::read_only_address() {
  std::lock_guard<std::mutex> lock(mu_);
  if (ro_addr_ == nullptr) {
    // Not populated: its page-table entries count in this process's RSS a second time (the
    // pages themselves are shared), so only what peers actually read through it is mapped.
    void* p = mmap(nullptr, mapped_, PROT_READ, MAP_SHARED, fd_, 0);
    if (p == MAP_FAILED) {
      int err = errno;
      throw_errno("read-only mmap of memfd (" + std::to_string(mapped_) + " bytes)", err);
    }
    ro_addr_ = p;
  }
  return reinterpret_cast<uint64_t>(ro_addr_);
}

int PeerMapping::populate(const uint64_t* ranges, size_t count, bool write) const {
  const uint64_t lo = address(), hi = lo + mapped_;
  for (size_t i = 0; i < count; ++i) {
    const uint64_t a = ranges[2 * i], n = ranges[2 * i + 1];
    if (a < lo || n > hi - lo || a - lo > hi - lo - n) return ERANGE;
  }
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  uint64_t start = 0, end = 0;  // the pending page span: overlapping or adjacent ranges become one call
  auto flush = [&]() -> int {
    if (end > start && madvise(reinterpret_cast<void*>(start), end - start,
                               write ? kMadvPopulateWrite : kMadvPopulateRead) != 0)
      return errno;
    return 0;
  };
  for (size_t i = 0; i < count; ++i) {
    const uint64_t n = ranges[2 * i + 1];
    if (n == 0) continue;
    const uint64_t a = ranges[2 * i] & ~(page - 1), b = (ranges[2 * i] + n + page - 1) & ~(page - 1);
    if (end > start && a <= end && b >= start) {
      start = std::min(start, a);
      end = std::max(end, b);
      continue;
    }
    if (int err = flush()) return err;
    start = a;
    end = b;
  }
  return flush();
}

PeerMapping::PeerMapping(int pid, int fd, size_t nbytes, bool writable, uint64_t inode) : nbytes_(nbytes) {
  std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  // Every argument comes from a peer's record. A size past what any file can hold would wrap the
  // page rounding below (and map less than the caller then reads).
  if (pid <= 0 || fd < 0 || nbytes > (static_cast<size_t>(1) << 62)) {
    throw_errno(path + ": no memfd of " + std::to_string(nbytes) + " bytes can be mapped from that record", EINVAL);
  }
  mapped_ = page_round(nbytes);
  // The peer chose the descriptor: it may name a FIFO (whose open would wait for a writer
  // forever), a device or a socket. Only a memfd is opened, without blocking and without
  // becoming a controlling terminal; the link is read first (readlink never touches the file),
  // and the opened file is checked again (the peer may swap the descriptor in between).
  char link[64] = {0};
  const ssize_t n = readlink(path.c_str(), link, sizeof(link) - 1);
  if (n < 0) throw_errno("readlink " + path, errno);
  if (std::strncmp(link, "/memfd:", 7) != 0) throw_errno(path + " is not a memfd", EINVAL);
  int local = open(path.c_str(), (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (local < 0) throw_errno("open " + path, errno);
  struct stat st;
  if (fstat(local, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(local);
    throw_errno(path + " is not a memfd", EINVAL);
  }
  if (inode != 0 && (fstat(local, &st) != 0 || static_cast<uint64_t>(st.st_ino) != inode)) {
    close(local);
    throw_errno(path + " is not the memfd that was published (inode " + std::to_string(inode) +
                    "): the region was re-registered or its memory freed",
                ESTALE);
  }
  // The owner may be hostile: a file shorter than the mapping, or one it can still shrink, would
  // turn our reads of the mapping into SIGBUS. Only a memfd whose size is sealed is mapped.
  const int seals = fcntl(local, F_GET_SEALS);
  if (fstat(local, &st) != 0 || static_cast<uint64_t>(st.st_size) < mapped_ || seals < 0 || !(seals & F_SEAL_SHRINK)) {
    close(local);
    throw_errno(path + " is not a size-sealed memfd of at least " + std::to_string(mapped_) + " bytes", EINVAL);
  }
  int prot = PROT_READ | (writable ? PROT_WRITE : 0);
  addr_ = mmap(nullptr, mapped_, prot, MAP_SHARED, local, 0);
  int err = errno;
  close(local);
  if (addr_ == MAP_FAILED) {
    addr_ = nullptr;
    throw_errno("mmap " + path, err);
  }
}

PeerMapping::~PeerMapping() {
  if (addr_) munmap(addr_, mapped_);
}

int cma_probe(int pid, uint64_t addr, size_t nbytes) {
  unsigned char buf[64];
  if (nbytes > sizeof(buf)) nbytes = sizeof(buf);
  if (nbytes == 0) nbytes = 1;
  struct iovec local = {buf, nbytes};
  struct iovec remote = {reinterpret_cast<void*>(addr), nbytes};
  ssize_t n = process_vm_readv(pid, &local, 1, &remote, 1, 0);
  if (n < 0) return errno;
  return n == static_cast<ssize_t>(nbytes) ? 0 : EFAULT;
}

uint64_t probe_address() { return reinterpret_cast<uint64_t>(&kProbeByte); }

int allow_ptrace_from_any() {
  if (prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0) != 0) return errno;
  return 0;
}

}  // namespace transport
