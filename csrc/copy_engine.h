// Copy engine: a small pool of native threads that moves bytes for the `ipc` backend.
//
// A job is a list of segments. It is cut into units: a large segment into pieces of at most
// `chunk_bytes`, runs of small ones into units of up to kMaxUnitSegments segments (one
// process_vm_writev/readv call per IOV_MAX of them, or a memcpy loop). Units are served
// round-robin across jobs, so one 1 GiB put cannot starve a small one queued behind it, and a
// cancelled job stops at the next unit. Large local jobs are copied with streaming stores
// (stream_copy.h).
// Completions are queued and announced through an eventfd that the Python event loop waits on;
// no Python runs on these threads and no thread polls.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace transport {

// Which address space each side of a segment lives in.
enum class CopyKind : int {
  kLocal = 0,     // dst and src both mapped in this process (memcpy; e.g. a peer's memfd mapping)
  kCmaWrite = 1,  // dst is in process `pid`, src is local (process_vm_writev)
  kCmaRead = 2,   // dst is local, src is in process `pid` (process_vm_readv)
};

enum class CopyStatus : int { kOk = 0, kFailed = 1, kAborted = 2 };

struct Segment {
  uint64_t dst;
  uint64_t src;
  uint64_t len;
};

// The most segments one unit of work holds (one CMA call each: the kernel's IOV_MAX).
constexpr size_t kMaxUnitSegments = 1024;

struct Completion {
  uint64_t id;
  CopyStatus status;
  int err;         // errno of the first failing unit, 0 otherwise
  uint64_t bytes;  // bytes actually copied
};

// Copies one segment on the calling thread; returns 0 or an errno value. For small copies,
// where handing off to a worker costs more than the copy.
int copy_now(CopyKind kind, int pid, const Segment& s);
// Copies `count` segments on the calling thread (CMA: one system call per kMaxUnitSegments);
// returns 0 or the errno of the first failure, and adds the bytes copied to `*copied`.
int copy_segments(CopyKind kind, int pid, const Segment* segs, size_t count, uint64_t* copied);

// A job's segments, cut and grouped into units once (CopyEngine::plan): immutable, so one plan
// may be submitted again and again, and by several jobs at once. A prepared transfer keeps one
// per copy kind and peer and submits it by handle at every start.
struct CopyPlan {
  CopyKind kind = CopyKind::kLocal;
  int pid = 0;
  std::vector<Segment> segs;                     // large segments already cut at chunk_bytes
  std::vector<std::pair<size_t, size_t>> units;  // [begin, end) ranges of segs
  uint64_t total = 0;                            // bytes in all
  bool stream = false;  // local copies with streaming stores (see kStreamMinJobBytes)
};

class CopyEngine {
 public:
  CopyEngine(int threads, uint64_t chunk_bytes);
  ~CopyEngine();
  CopyEngine(const CopyEngine&) = delete;
  CopyEngine& operator=(const CopyEngine&) = delete;

  int event_fd() const { return efd_; }
  // Queues a job; returns its id. Throws std::runtime_error once shut down.
  uint64_t submit(CopyKind kind, int pid, const Segment* segments, size_t count);
  uint64_t submit(CopyKind kind, int pid, const std::vector<Segment>& segments) {
    return submit(kind, pid, segments.data(), segments.size());
  }
  // Cuts and groups `count` segments into a plan for this engine (its chunk size and threads).
  std::shared_ptr<const CopyPlan> plan(CopyKind kind, int pid, const Segment* segments, size_t count) const;
  // Queues a job over `plan` (kept alive until the job ends); returns its id. Throws
  // std::runtime_error once shut down.
  uint64_t submit(std::shared_ptr<const CopyPlan> plan);
  int threads() const { return static_cast<int>(threads_.size()); }
  // Requests that a job stop at its next unit boundary. Returns false if it already finished.
  bool cancel(uint64_t id);
  // Completed jobs since the last call (also clears the eventfd counter).
  std::vector<Completion> drain();
  // Aborts queued work, joins the threads. Idempotent.
  void shutdown();

 private:
  struct Job;
  void worker();
  void finish_unit(const std::shared_ptr<Job>& job, uint64_t bytes, int err);

  const uint64_t chunk_bytes_;
  int efd_ = -1;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  std::unordered_map<uint64_t, std::shared_ptr<Job>> live_;
  std::vector<Completion> done_;
  std::vector<std::thread> threads_;
  uint64_t next_id_ = 1;
  bool stopping_ = false;
};

}  // namespace transport
