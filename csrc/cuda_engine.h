// The CUDA copy engine: device copies enqueued on the calling thread, completions reaped natively.
//
// A job is a list of copies (device or host addresses, unified addressing) that `submit` enqueues
// with cuMemcpyAsync on a transport-owned stream, right on the calling thread, after making that
// stream wait for the work queued so far on the caller's streams; an event of the engine's pool is
// recorded after the copies. Nothing blocks and no thread is handed the copy.
//
// How a job's end is learnt, by whoever sees it first:
//  * `submit` itself: the calling thread polls the job's event for a short budget (a small copy
//    ends in microseconds; waking another thread would cost more). A job it sees end is *claimed*:
//    it is not reported again;
//  * the reaper, one native thread per engine: while jobs are in flight it polls the event of the
//    oldest job of each stream (a stream runs its jobs in order), spinning for `kSpinNs` after the
//    last progress and then napping with backoff up to `kNapMaxNs`; it queues the results of
//    unclaimed jobs and announces them through an eventfd that the Python event loop waits on (as
//    the host copy engine does, copy_engine.h). With nothing in flight it sleeps on a condition.
//
// A job's copies cannot be recalled once enqueued: a caller that stops waiting must still learn
// the job's end before it frees or reuses the memory. A failed enqueue (the driver refuses a copy)
// still records the event after the copies already enqueued, and the job then ends failed, with
// the driver's message, once those have run.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cuda_driver.h"

namespace transport::cuda {

// A stream of another party (e.g. the application's current stream) and the device it is on.
struct StreamRef {
  int device;
  uint64_t stream;
};

enum class JobStatus : int { kOk = 0, kFailed = 1 };

struct JobResult {
  uint64_t id = 0;
  JobStatus status = JobStatus::kOk;
  CUresult code = CUDA_SUCCESS;  // the driver's error (kFailed)
  std::string message;           // what failed, for the error raised in Python (kFailed)
};

class Engine {
 public:
  Engine();
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  int event_fd() const { return efd_; }

  // `stream` (of `device`) waits for the work queued so far on each stream of `after` (an event
  // of the engine recorded there now) and for the last recording of each event in `events`.
  // Throws Error when the driver refuses (some waits may be enqueued: harmless).
  void order(int device, uint64_t stream, const std::vector<StreamRef>& after, const std::vector<uint64_t>& events);

  // order(...), then the `count` copies (`triples`: dst, src, nbytes; zero-byte ones skipped),
  // then the job's event; then polls that event on the calling thread for up to `spin_ns`. True
  // when the job ended within it: `*out` holds its result and it is claimed (never reported
  // through drain). False: its result comes through drain. `id` is the caller's, unique among
  // the jobs in flight. Throws Error when nothing was enqueued (a refused order, event or engine
  // shut down); once a copy is enqueued the job exists and reports any later failure.
  bool submit(uint64_t id, int device, uint64_t stream, const std::vector<StreamRef>& after,
              const std::vector<uint64_t>& events, const uint64_t* triples, size_t count, uint64_t spin_ns,
              JobResult* out);

  // The results of ended, unclaimed jobs since the last call (also clears the eventfd).
  std::vector<JobResult> drain();

  size_t inflight();

  // Stops the reaper (jobs still in flight are no longer reported) and frees the event pool.
  // Idempotent. The eventfd stays open until the engine is destroyed.
  void shutdown();

 private:
  struct Job;
  using StreamKey = std::pair<int, uint64_t>;  // (device, stream)

  CUevent take_event(int device);
  void give_event(int device, CUevent e);
  void order_locked(const Api& a, CUstream s, const std::vector<StreamRef>& after, const std::vector<uint64_t>& events);
  bool poll(const std::shared_ptr<Job>& job, const Api& a, uint64_t spin_ns, JobResult* out);
  void reap();
  // Reports (or, if claimed, drops) an ended job; false while its submitter polls it.
  bool finish(const std::shared_ptr<Job>& job, CUresult r);

  int efd_ = -1;
  std::mutex mu_;  // jobs, queues, results, stopping_
  std::condition_variable cv_;
  std::unordered_map<uint64_t, std::shared_ptr<Job>> live_;
  std::map<StreamKey, std::deque<std::shared_ptr<Job>>> queues_;  // per stream, in enqueue order
  std::vector<JobResult> done_;
  bool stopping_ = false;
  std::thread reaper_;

  std::mutex pool_mu_;  // never held while taking mu_
  std::map<int, std::vector<CUevent>> pool_;  // device -> free events
  std::map<int, CUevent> marks_;              // device -> the event recorded on others' streams
  std::mutex mark_mu_;                        // one mark in use at a time (record, then wait)
};

}  // namespace transport::cuda
