#include "copy_engine.h"

#include "stream_copy.h"

#include <sys/eventfd.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

namespace transport {

struct CopyEngine::Job {
  uint64_t id;
  std::shared_ptr<const CopyPlan> plan;  // what to copy: shared by every job over the same plan
  size_t next = 0;                 // next unit to hand out (guarded by mu_)
  std::atomic<size_t> remaining;   // units not yet finished
  std::atomic<uint64_t> bytes{0};
  std::atomic<int> err{0};
  std::atomic<bool> cancelled{false};
};

namespace {

// A local job of at least this many bytes is copied with streaming stores (stream_copy.h): far
// larger than a cache, so its destination is not read back from cache anyway. Smaller jobs (one
// 1 MiB put after another into the same memory) keep memcpy, which stays in the cache.
constexpr uint64_t kStreamMinJobBytes = 16ull << 20;
constexpr uint64_t kStreamMinSegmentBytes = 4096;  // smaller pieces of such a job: memcpy

int copy_local_streaming(const Segment* segs, size_t count, uint64_t* copied) {
  for (size_t i = 0; i < count; ++i) {
    void* dst = reinterpret_cast<void*>(segs[i].dst);
    const void* src = reinterpret_cast<const void*>(segs[i].src);
    if (segs[i].len >= kStreamMinSegmentBytes)
      stream_copy(dst, src, segs[i].len);
    else
      std::memcpy(dst, src, segs[i].len);
    *copied += segs[i].len;
  }
  return 0;
}

// Copies one segment; returns 0 or an errno value. Partial CMA transfers are continued:
// the kernel may stop at a page boundary it could not fault in.
int copy_one(CopyKind kind, int pid, const Segment& s) {
  if (kind == CopyKind::kLocal) {
    std::memcpy(reinterpret_cast<void*>(s.dst), reinterpret_cast<const void*>(s.src), s.len);
    return 0;
  }
  uint64_t done = 0;
  while (done < s.len) {
    struct iovec local, remote;
    ssize_t n;
    if (kind == CopyKind::kCmaWrite) {
      local = {reinterpret_cast<void*>(s.src + done), s.len - done};
      remote = {reinterpret_cast<void*>(s.dst + done), s.len - done};
      n = process_vm_writev(pid, &local, 1, &remote, 1, 0);
    } else {
      local = {reinterpret_cast<void*>(s.dst + done), s.len - done};
      remote = {reinterpret_cast<void*>(s.src + done), s.len - done};
      n = process_vm_readv(pid, &local, 1, &remote, 1, 0);
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) return EFAULT;
    done += static_cast<uint64_t>(n);
  }
  return 0;
}

// Up to kMaxUnitSegments CMA segments with one system call. When the kernel stops early (a
// page it could not fault in, a signal), the rest is finished segment by segment from the exact
// byte where it stopped, which also finds the precise error.
int cma_vector(CopyKind kind, int pid, const Segment* segs, size_t count, uint64_t* copied) {
  struct iovec local[kMaxUnitSegments], remote[kMaxUnitSegments];
  uint64_t total = 0;
  for (size_t i = 0; i < count; ++i) {
    const Segment& s = segs[i];
    void* here = reinterpret_cast<void*>(kind == CopyKind::kCmaWrite ? s.src : s.dst);
    void* there = reinterpret_cast<void*>(kind == CopyKind::kCmaWrite ? s.dst : s.src);
    local[i] = {here, s.len};
    remote[i] = {there, s.len};
    total += s.len;
  }
  ssize_t n = kind == CopyKind::kCmaWrite ? process_vm_writev(pid, local, count, remote, count, 0)
                                          : process_vm_readv(pid, local, count, remote, count, 0);
  uint64_t done = n > 0 ? static_cast<uint64_t>(n) : 0;
  if (done == total) {
    *copied += total;
    return 0;
  }
  if (n < 0 && errno != EINTR && errno != EFAULT) return errno;  // e.g. ESRCH, EPERM: all fail alike
  // Finish from where it stopped, one segment at a time.
  size_t i = 0;
  while (i < count && done >= segs[i].len) {
    done -= segs[i].len;
    *copied += segs[i].len;
    ++i;
  }
  for (; i < count; ++i) {
    Segment rest = {segs[i].dst + done, segs[i].src + done, segs[i].len - done};
    *copied += done;
    done = 0;
    int err = copy_one(kind, pid, rest);
    if (err != 0) return err;
    *copied += rest.len;
  }
  return 0;
}

}  // namespace

int copy_segments(CopyKind kind, int pid, const Segment* segs, size_t count, uint64_t* copied) {
  if (kind == CopyKind::kLocal) {
    for (size_t i = 0; i < count; ++i) {
      std::memcpy(reinterpret_cast<void*>(segs[i].dst), reinterpret_cast<const void*>(segs[i].src), segs[i].len);
      *copied += segs[i].len;
    }
    return 0;
  }
  for (size_t i = 0; i < count; i += kMaxUnitSegments) {
    int err = cma_vector(kind, pid, segs + i, std::min(kMaxUnitSegments, count - i), copied);
    if (err != 0) return err;
  }
  return 0;
}

int copy_now(CopyKind kind, int pid, const Segment& s) {
  int err = copy_one(kind, pid, s);
  // Inline copies run on the event-loop thread; callers use them for flag handshakes with
  // other processes, so the copy must not be reordered with the thread's next load.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  return err;
}

CopyEngine::CopyEngine(int threads, uint64_t chunk_bytes)
    : chunk_bytes_(chunk_bytes == 0 ? (8ull << 20) : chunk_bytes) {
  efd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (efd_ < 0) throw std::runtime_error(std::string("eventfd: ") + std::strerror(errno));
  if (threads < 1) threads = 1;
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { worker(); });
}

CopyEngine::~CopyEngine() {
  shutdown();
  if (efd_ >= 0) close(efd_);
}

std::shared_ptr<const CopyPlan> CopyEngine::plan(CopyKind kind, int pid, const Segment* segments,
                                                 size_t count) const {
  auto plan = std::make_shared<CopyPlan>();
  plan->kind = kind;
  plan->pid = pid;
  plan->segs.reserve(count);
  uint64_t total = 0;
  for (size_t i = 0; i < count; ++i) {
    const Segment& s = segments[i];
    for (uint64_t off = 0; off < s.len; off += chunk_bytes_) {
      plan->segs.push_back({s.dst + off, s.src + off, std::min(chunk_bytes_, s.len - off)});
    }
    total += s.len;
  }
  plan->total = total;
  plan->stream = kind == CopyKind::kLocal && total >= kStreamMinJobBytes;
  // Units: at most kMaxUnitSegments segments and about chunk_bytes each, and at least as many
  // units as threads when there are enough segments (so that every thread has work).
  size_t nthreads = threads_.empty() ? 1 : threads_.size();
  uint64_t unit_bytes = std::max<uint64_t>(1, std::min<uint64_t>(chunk_bytes_, total / nthreads + 1));
  size_t begin = 0;
  uint64_t bytes = 0;
  for (size_t i = 0; i < plan->segs.size(); ++i) {
    bytes += plan->segs[i].len;
    if (i + 1 - begin >= kMaxUnitSegments || bytes >= unit_bytes || i + 1 == plan->segs.size()) {
      plan->units.emplace_back(begin, i + 1);
      begin = i + 1;
      bytes = 0;
    }
  }
  return plan;
}

uint64_t CopyEngine::submit(CopyKind kind, int pid, const Segment* segments, size_t count) {
  return submit(plan(kind, pid, segments, count));
}

uint64_t CopyEngine::submit(std::shared_ptr<const CopyPlan> plan) {
  auto job = std::make_shared<Job>();
  job->plan = std::move(plan);
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_) throw std::runtime_error("copy engine is shut down");
  job->id = next_id_++;
  job->remaining.store(job->plan->units.size());
  if (job->plan->units.empty()) {
    done_.push_back({job->id, CopyStatus::kOk, 0, 0});
    uint64_t one = 1;
    (void)!write(efd_, &one, sizeof(one));
    return job->id;
  }
  live_[job->id] = job;
  queue_.push_back(job);
  cv_.notify_all();
  return job->id;
}

bool CopyEngine::cancel(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(id);
  if (it == live_.end()) return false;
  it->second->cancelled.store(true);
  return true;
}

std::vector<Completion> CopyEngine::drain() {
  uint64_t counter;
  (void)!read(efd_, &counter, sizeof(counter));
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Completion> out;
  out.swap(done_);
  return out;
}

void CopyEngine::worker() {
  for (;;) {
    std::shared_ptr<Job> job;
    size_t idx;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping and nothing left
      job = queue_.front();
      queue_.pop_front();
      idx = job->next++;
      if (job->next < job->plan->units.size()) queue_.push_back(job);  // round-robin across jobs
    }
    if (job->cancelled.load() || job->err.load() != 0) {
      finish_unit(job, 0, 0);
      continue;
    }
    const CopyPlan& plan = *job->plan;
    auto [begin, end] = plan.units[idx];
    uint64_t copied = 0;
    const Segment* segs = plan.segs.data() + begin;
    int err = plan.stream ? copy_local_streaming(segs, end - begin, &copied)
                          : copy_segments(plan.kind, plan.pid, segs, end - begin, &copied);
    finish_unit(job, copied, err);
  }
}

void CopyEngine::finish_unit(const std::shared_ptr<Job>& job, uint64_t bytes, int err) {
  job->bytes.fetch_add(bytes);
  if (err != 0) {
    int expected = 0;
    job->err.compare_exchange_strong(expected, err);
  }
  if (job->remaining.fetch_sub(1) != 1) return;
  CopyStatus status = job->err.load() != 0   ? CopyStatus::kFailed
                      : job->cancelled.load() ? CopyStatus::kAborted
                                              : CopyStatus::kOk;
  {
    std::lock_guard<std::mutex> lock(mu_);
    live_.erase(job->id);
    done_.push_back({job->id, status, job->err.load(), job->bytes.load()});
  }
  uint64_t one = 1;
  (void)!write(efd_, &one, sizeof(one));
}

void CopyEngine::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ && threads_.empty()) return;
    stopping_ = true;
    for (auto& kv : live_) kv.second->cancelled.store(true);
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
  threads_.clear();
}

}  // namespace transport
