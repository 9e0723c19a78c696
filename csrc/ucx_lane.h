// One UCX lane: a UCP worker driven by its own native progress thread.
//
// The worker is UCS_THREAD_MODE_SERIALIZED (UCX takes no locks): whoever holds the lane's drive
// lock drives it. That is the lane's thread, except during a synchronous transfer
// (transfer_now), which the calling thread runs itself: handing a few-microsecond transfer to
// another thread costs a wake-up, and on a busy or single core the caller's wait starves the
// thread it waits for. Other threads hand the lane work through a command queue and wake it
// with an eventfd; control calls (endpoint creation, rkey unpacking) wait for their result,
// transfers do not. A transfer is split into chunks issued round-robin across jobs, with a bounded window per
// job, so one large transfer never holds the thread for long. A put is reported complete only
// after ucp_ep_flush_nbx completes: ucp_put_nbx completion is local, the flush makes it remote
// ("awaited put == bytes in target memory").
//
// When idle the thread sleeps in epoll on the worker's event fd (ucp_worker_arm), so a process
// whose Python is blocked still serves wire-up and transports that need target progress.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ucx_api.h"

namespace transport::ucx {

enum class Op : int { kPut = 0, kGet = 1 };
enum class Status : int { kOk = 0, kFailed = 1, kAborted = 2 };  // same values as CopyStatus

// One range of a list job: local and remote addresses, bytes (none of them empty).
struct Piece {
  uint64_t local;
  uint64_t remote;
  uint64_t len;
};

struct Completion {
  uint64_t id;
  Status status;
  int ucs_status;  // the first UCX failure (0: none)
  uint64_t bytes;  // bytes whose chunks completed
};

// Where a lane reports finished jobs (called on the lane's thread).
class CompletionSink {
 public:
  virtual ~CompletionSink() = default;
  virtual void report(const Completion& c) = 0;
};

class Lane {
 public:
  // Creates the worker on `context` (which must allow workers on several threads) and starts
  // the progress thread. Throws std::runtime_error.
  Lane(const Api& api, ucp_context_h context, uint64_t chunk_bytes, int window, CompletionSink* sink);
  ~Lane();
  Lane(const Lane&) = delete;
  Lane& operator=(const Lane&) = delete;

  const std::string& address() const { return address_; }

  // An endpoint to a peer's worker address, without UCX peer error handling (failure detection
  // is the control plane's job). Non-blocking in UCX: wire-up finishes in the background.
  uint64_t ep_create(const std::string& address);
  // Closes an endpoint (queued). `force`: do not wait for the peer (it is gone); outstanding
  // requests complete with UCS_ERR_CANCELED and their jobs fail. Its rkeys are destroyed.
  void ep_close(uint64_t ep, bool force);
  uint64_t rkey_unpack(uint64_t ep, const std::string& packed);
  // Queued; the rkey is destroyed once no job uses it.
  void rkey_destroy(uint64_t rkey);
  // Queues job `id`: `nbytes` between local memory and [remote, remote + nbytes) of the region
  // of `rkey` (unpacked on `ep`). The local memory must stay valid until it is reported.
  void submit(uint64_t id, Op op, uint64_t ep, uint64_t rkey, uint64_t local, uint64_t remote, uint64_t nbytes);
  // As submit, for many ranges of one region with one completion (and, for a put, one flush).
  void submit_many(uint64_t id, Op op, uint64_t ep, uint64_t rkey, std::vector<Piece> pieces);
  // Stops issuing the job's chunks; it is reported (aborted) once its requests in flight are done.
  void cancel(uint64_t id);
  // Reads the 8-byte word at `remote` (region of `rkey`) and waits for it, at most `timeout_ms`:
  // returns 0 and fills `value`, else a ucs status (UCS_ERR_TIMED_OUT on timeout; the read then
  // finishes in the background into memory of its own).
  int read_word(uint64_t ep, uint64_t rkey, uint64_t remote, int timeout_ms, uint64_t* value);
  // Moves `nbytes` between local memory and [remote, remote + nbytes) of `rkey`'s region, the
  // calling thread driving the lane itself (under the drive lock), and returns once the job has
  // ended: 0 when
  // every byte is in place (a put: flushed), else a ucs status. Not done within `timeout_us`:
  // the job is cancelled and still driven until it has ended (after 1 s more, its endpoint is
  // force-closed, which ends it), and UCS_ERR_TIMED_OUT is returned; either way the local
  // memory is no longer in use when this returns. `*moved`: bytes of completed chunks.
  int transfer_now(uint64_t ep, uint64_t rkey, Op op, uint64_t local, uint64_t remote, uint64_t nbytes,
                   int timeout_us, uint64_t* moved);
  // Asks the thread to stop without waiting (stop() waits).
  void request_stop();
  // Aborts every job, closes every endpoint (bounded wait), destroys the worker and joins the
  // thread; afterwards UCX touches no memory through this lane. Idempotent.
  void stop();

 private:
  struct Ep;
  struct Rkey;
  struct Job;
  struct Req;
  struct Command {
    std::function<void()> fn;
    std::shared_ptr<std::promise<void>> done;  // null: fire and forget
  };

  void call(std::function<void()> fn);  // run on the progress thread and wait
  // The lane's thread, holding `lock` (the drive lock): lets callers that wait for it drive.
  bool yield_to_drivers(std::unique_lock<std::mutex>& lock);  // true when it waited
  void post(std::function<void()> fn);  // run on the progress thread
  void loop();
  // On the lane's thread: binds a new job to its endpoint and rkey and queues it (or ends it
  // at once: no such endpoint or rkey any more, or nothing to move).
  void enqueue(const std::shared_ptr<Job>& job, uint64_t ep, uint64_t rkey);
  // On the lane's thread: a queued job nobody outside awaits (read_word, transfer_now drive it
  // themselves), or null when the endpoint or rkey is gone.
  std::shared_ptr<Job> internal_job(uint64_t ep, uint64_t rkey, Op op, uint64_t local, uint64_t remote,
                                    uint64_t nbytes);
  bool run_commands();
  bool issue_round();
  uint64_t issue_chunk(const std::shared_ptr<Job>& job);  // returns the bytes issued
  void issue_flush(const std::shared_ptr<Job>& job);
  static void on_request_done(void* request, ucs_status_t status, void* user_data);
  void request_done(Req* req, ucs_status_t status);
  void maybe_finish(const std::shared_ptr<Job>& job);
  void complete(const std::shared_ptr<Job>& job, Status status);
  void release_rkey(std::shared_ptr<Rkey> rkey);
  void close_ep(std::shared_ptr<Ep> ep, bool force);  // by value: it erases the map entry
  void reap_closing();
  void teardown();

  const Api& api_;
  const uint64_t chunk_bytes_;
  const int window_;
  CompletionSink* const sink_;
  ucp_worker_h worker_ = nullptr;
  std::string address_;
  int worker_efd_ = -1;
  int cmd_efd_ = -1;
  int epoll_fd_ = -1;

  std::mutex cmd_mu_;
  std::deque<Command> commands_;
  bool stopping_ = false;  // guarded by cmd_mu_
  std::atomic<bool> has_commands_{false};  // commands_ is not empty (read while spinning)

  // Held by whoever drives the worker and touches the state below: the lane's thread (released
  // while it sleeps) or a caller of transfer_now. `drivers_` counts callers waiting for or holding
  // it (the thread steps aside for them): incremented before a caller takes the lock, decremented
  // under it (so the thread, which checks it under the lock, cannot miss the wake-up).
  std::mutex drive_mu_;
  std::condition_variable drive_cv_;
  std::atomic<int> drivers_{0};

  // Driver state (touched only under drive_mu_).
  uint64_t next_id_ = 1;
  uint64_t next_internal_ = 1;  // ids of jobs nobody outside awaits (read_word): not reported
  std::unordered_map<uint64_t, std::shared_ptr<Ep>> eps_;
  std::unordered_map<uint64_t, std::shared_ptr<Rkey>> rkeys_;
  std::unordered_map<uint64_t, std::shared_ptr<Job>> jobs_;
  std::deque<std::shared_ptr<Job>> ready_;  // jobs with chunks left to issue
  std::vector<std::pair<std::shared_ptr<Ep>, void*>> closing_;  // endpoints with a close request
  uint64_t inflight_ = 0;                                       // requests of all jobs

  std::thread thread_;
  std::once_flag stop_once_;
};

}  // namespace transport::ucx
