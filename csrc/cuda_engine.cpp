#include "cuda_engine.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <exception>
#include <stdexcept>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace transport::cuda {

namespace {

// The reaper spins this long after the last job it saw end (a device copy of up to a few hundred
// MiB ends within it), then naps, doubling from kNapMinNs up to kNapMaxNs: a long job (a GiB from
// pageable memory, a copy queued behind a long kernel of the application) costs a wake-up every
// kNapMaxNs, and ends at most that late.
constexpr uint64_t kSpinNs = 2'000'000;
constexpr uint64_t kNapMinNs = 10'000;
constexpr uint64_t kNapMaxNs = 200'000;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

uint64_t now_ns() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count());
}

}  // namespace

struct Engine::Job {
  Job(Engine* engine, uint64_t id, int device, StreamKey key, CUevent event)
      : engine(engine), id(id), device(device), key(key), event(event) {}
  ~Job() { engine->give_event(device, event); }
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;

  Engine* engine;
  uint64_t id;
  int device;
  StreamKey key;
  CUevent event;  // recorded after the copies; back to the pool when the last holder lets go
  CUresult enqueue_error = CUDA_SUCCESS;  // a copy the driver refused (those before it still run)
  std::string enqueue_message;
  bool waiting = false;   // its submitter polls it now: the reaper leaves it alone (guarded by mu_)
  bool claimed = false;   // its submitter saw it end (guarded by mu_)
  bool reported = false;  // the reaper queued its result (guarded by mu_)
};

namespace {

// How a job that ended with `r` (its event's query) is reported.
template <class J>
JobResult result_of(const J& job, CUresult r) {
  JobResult res;
  res.id = job.id;
  if (job.enqueue_error != CUDA_SUCCESS) {
    res.status = JobStatus::kFailed;
    res.code = job.enqueue_error;
    res.message = job.enqueue_message;
  } else if (r != CUDA_SUCCESS) {
    res.status = JobStatus::kFailed;
    res.code = r;
    res.message = "the copies failed on the device: " + describe(r);
  }
  return res;
}

}  // namespace

Engine::Engine() {
  efd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (efd_ < 0) throw std::runtime_error(std::string("eventfd: ") + std::strerror(errno));
}

Engine::~Engine() {
  shutdown();
  if (efd_ >= 0) close(efd_);
}

CUevent Engine::take_event(int device) {
  {
    std::lock_guard<std::mutex> lock(pool_mu_);
    auto& free = pool_[device];
    if (!free.empty()) {
      CUevent e = free.back();
      free.pop_back();
      return e;
    }
  }
  OnDevice on(device);
  CUevent e = nullptr;
  check(on.a.cuEventCreate(&e, CU_EVENT_DISABLE_TIMING), "cuEventCreate(device " + std::to_string(device) + ")");
  return e;
}

void Engine::give_event(int device, CUevent e) {
  std::lock_guard<std::mutex> lock(pool_mu_);
  pool_[device].push_back(e);
}

void Engine::order_locked(const Api& a, CUstream s, const std::vector<StreamRef>& after,
                          const std::vector<uint64_t>& events) {
  for (const StreamRef& other : after) {
    // The mark is made in, and recorded on a stream of, the other stream's device (an event
    // and the stream it is recorded on share a context); the wait takes the recording's state
    // at the call, so the same mark serves the next caller as soon as this one has waited.
    std::lock_guard<std::mutex> lock(mark_mu_);
    CUevent& mark = marks_[other.device];
    {
      OnDevice there(other.device);
      if (mark == nullptr) {
        check(a.cuEventCreate(&mark, CU_EVENT_DISABLE_TIMING), "cuEventCreate (mark)");
      }
      check(a.cuEventRecord(mark, as<CUstream_st>(other.stream)),
            "cuEventRecord on stream " + hex(other.stream) + " of device " + std::to_string(other.device));
    }
    check(a.cuStreamWaitEvent(s, mark, 0), "cuStreamWaitEvent (the caller's stream " + hex(other.stream) + ")");
  }
  for (uint64_t e : events) {
    check(a.cuStreamWaitEvent(s, as<CUevent_st>(e), 0), "cuStreamWaitEvent (event " + hex(e) + ")");
  }
}

void Engine::order(int device, uint64_t stream, const std::vector<StreamRef>& after,
                   const std::vector<uint64_t>& events) {
  OnDevice on(device);
  order_locked(on.a, as<CUstream_st>(stream), after, events);
}

bool Engine::submit(uint64_t id, int device, uint64_t stream, const std::vector<StreamRef>& after,
                    const std::vector<uint64_t>& events, const uint64_t* triples, size_t count, uint64_t spin_ns,
                    JobResult* out) {
  OnDevice on(device);
  const Api& a = on.a;
  CUstream s = as<CUstream_st>(stream);
  order_locked(a, s, after, events);  // throws: no copy enqueued yet
  auto job = std::make_shared<Job>(this, id, device, StreamKey{device, stream}, take_event(device));
  for (size_t i = 0; i < count; ++i) {
    const uint64_t dst = triples[3 * i], src = triples[3 * i + 1], nbytes = triples[3 * i + 2];
    if (nbytes == 0) continue;
    CUresult r = a.cuMemcpyAsync(dst, src, nbytes, s);
    if (r != CUDA_SUCCESS) {
      // The copies before it still run: the job ends, failed, once they have.
      job->enqueue_error = r;
      job->enqueue_message = "cuMemcpyAsync(dst " + hex(dst) + ", src " + hex(src) + ", " + std::to_string(nbytes) +
                             " bytes; copy " + std::to_string(i) + " of " + std::to_string(count) +
                             ") failed: " + describe(r);
      break;
    }
  }
  CUresult r = a.cuEventRecord(job->event, s);
  if (r != CUDA_SUCCESS) {
    // Without the event the end cannot be observed: wait for the stream here, so that no copy
    // outlives this call, and fail.
    (void)a.cuStreamSynchronize(s);
    std::string why = "cuEventRecord after the copies failed: " + describe(r);
    if (job->enqueue_error != CUDA_SUCCESS) why = job->enqueue_message + "; " + why;
    throw Error(why, r);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    bool refused = stopping_ || live_.count(id) != 0;
    if (!refused) {
      job->waiting = spin_ns > 0;  // before the reaper can see it: this caller polls it first
      live_.emplace(id, job);
      queues_[job->key].push_back(job);
      if (!reaper_.joinable()) reaper_ = std::thread([this] { reap(); });
      cv_.notify_one();
    }
    if (refused) {
      (void)a.cuStreamSynchronize(s);  // no copy may outlive a refused job
      if (stopping_) throw Error("the CUDA copy engine is shut down", 0);
      throw std::invalid_argument("job id " + std::to_string(id) + " is already in flight");
    }
  }
  return spin_ns > 0 && poll(job, a, spin_ns, out);
}

bool Engine::poll(const std::shared_ptr<Job>& job, const Api& a, uint64_t spin_ns, JobResult* out) {
  // job->waiting is set: the reaper leaves it alone until it is cleared below.
  const uint64_t deadline = now_ns() + spin_ns;
  CUresult r;
  while ((r = a.cuEventQuery(job->event)) == CUDA_ERROR_NOT_READY && now_ns() < deadline) cpu_relax();
  std::lock_guard<std::mutex> lock(mu_);
  job->waiting = false;
  if (r == CUDA_ERROR_NOT_READY) return false;  // the reaper reports it
  job->claimed = true;
  *out = result_of(*job, r);
  return true;
}

bool Engine::finish(const std::shared_ptr<Job>& job, CUresult r) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (job->waiting) return false;  // its waiter claims it (or gives it back) in a moment
    auto q = queues_.find(job->key);
    if (q != queues_.end() && !q->second.empty() && q->second.front() == job) {
      q->second.pop_front();
      if (q->second.empty()) queues_.erase(q);
    }
    live_.erase(job->id);
    if (job->claimed) return true;
    job->reported = true;
    done_.push_back(result_of(*job, r));
  }
  uint64_t one = 1;
  (void)!write(efd_, &one, sizeof(one));
  return true;
}

void Engine::reap() {
  uint64_t progress_at = now_ns();
  uint64_t nap = 0;
  std::vector<std::shared_ptr<Job>> heads;
  int current = -1;  // the device whose context is current on this thread (kept, never restored)
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (stopping_) return;
    if (live_.empty()) {
      cv_.wait(lock, [this] { return stopping_ || !live_.empty(); });
      progress_at = now_ns();
      nap = 0;
      continue;
    }
    for (auto& [key, q] : queues_) heads.push_back(q.front());
    lock.unlock();
    size_t ended = 0;
    for (const auto& job : heads) {
      CUresult r;
      try {
        const Api& a = api();
        if (job->device != current) {
          check(a.cuCtxSetCurrent(primary_context(job->device)), "cuCtxSetCurrent");
          current = job->device;
        }
        r = a.cuEventQuery(job->event);
      } catch (const Error& e) {
        r = e.code;
      } catch (const std::exception&) {
        r = CUDA_ERROR_UNKNOWN;  // cannot happen once a job exists (the driver is loaded)
      }
      if (r != CUDA_ERROR_NOT_READY && finish(job, r)) ++ended;
    }
    heads.clear();  // the last reference of an ended job may go here: not under mu_ (give_event)
    uint64_t now = now_ns();
    if (ended) {
      progress_at = now;
      nap = 0;
    } else if (now - progress_at < kSpinNs) {
      cpu_relax();
    } else {
      nap = std::min(std::max(nap * 2, kNapMinNs), kNapMaxNs);
      std::this_thread::sleep_for(std::chrono::nanoseconds(nap));
    }
    lock.lock();
  }
}

std::vector<JobResult> Engine::drain() {
  uint64_t counter;
  (void)!read(efd_, &counter, sizeof(counter));
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<JobResult> out;
  out.swap(done_);
  return out;
}

size_t Engine::inflight() {
  std::lock_guard<std::mutex> lock(mu_);
  return live_.size();
}

void Engine::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (reaper_.joinable()) reaper_.join();
  std::vector<std::shared_ptr<Job>> jobs;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, job] : live_) jobs.push_back(job);
    live_.clear();
    queues_.clear();
  }
  jobs.clear();  // their events back to the pool (a recording still pending is destroyed below)
  std::map<int, std::vector<CUevent>> pool;
  std::map<int, CUevent> marks;
  {
    std::lock_guard<std::mutex> lock(pool_mu_);
    pool.swap(pool_);
  }
  {
    std::lock_guard<std::mutex> lock(mark_mu_);
    marks.swap(marks_);
  }
  // cuEventDestroy of an event whose recording has not completed returns at once; the driver
  // releases it when the work ends.
  try {
    for (auto& [device, events] : pool) {
      OnDevice on(device);
      for (CUevent e : events) (void)on.a.cuEventDestroy(e);
    }
    for (auto& [device, e] : marks) {
      OnDevice on(device);
      if (e) (void)on.a.cuEventDestroy(e);
    }
  } catch (const std::exception&) {
    // No driver (nothing was ever created), or a context gone at process exit: nothing to free.
  }
}

}  // namespace transport::cuda
