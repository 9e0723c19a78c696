#include "copy_engine.h"

#include <sys/eventfd.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

namespace transport {

struct CopyEngine::Job {
  uint64_t id;
  CopyKind kind;
  int pid;
  std::vector<Segment> chunks;
  size_t next = 0;                 // next chunk to hand out (guarded by mu_)
  std::atomic<size_t> remaining;   // chunks not yet finished
  std::atomic<uint64_t> bytes{0};
  std::atomic<int> err{0};
  std::atomic<bool> cancelled{false};
};

namespace {

// Copies one chunk; returns 0 or an errno value. Partial CMA transfers are continued:
// the kernel may stop at a page boundary it could not fault in.
int copy_chunk(CopyKind kind, int pid, const Segment& s) {
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

}  // namespace

int copy_now(CopyKind kind, int pid, const Segment& s) {
  int err = copy_chunk(kind, pid, s);
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

uint64_t CopyEngine::submit(CopyKind kind, int pid, const std::vector<Segment>& segments) {
  auto job = std::make_shared<Job>();
  job->kind = kind;
  job->pid = pid;
  for (const Segment& s : segments) {
    for (uint64_t off = 0; off < s.len; off += chunk_bytes_) {
      uint64_t len = std::min(chunk_bytes_, s.len - off);
      job->chunks.push_back({s.dst + off, s.src + off, len});
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_) throw std::runtime_error("copy engine is shut down");
  job->id = next_id_++;
  job->remaining.store(job->chunks.size());
  if (job->chunks.empty()) {
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
      if (job->next < job->chunks.size()) queue_.push_back(job);  // round-robin across jobs
    }
    if (job->cancelled.load() || job->err.load() != 0) {
      finish_chunk(job, 0, 0);
      continue;
    }
    int err = copy_chunk(job->kind, job->pid, job->chunks[idx]);
    finish_chunk(job, err == 0 ? job->chunks[idx].len : 0, err);
  }
}

void CopyEngine::finish_chunk(const std::shared_ptr<Job>& job, uint64_t bytes, int err) {
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
