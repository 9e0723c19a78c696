#include "ucx_lane.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <ratio>
#include <stdexcept>
#include <type_traits>

namespace transport::ucx {

namespace {

using Clock = std::chrono::steady_clock;

// How long shutdown waits for requests in flight and for endpoint closes before it destroys the
// worker anyway (which releases whatever is left): a dead peer must not hang a close.
constexpr auto kTeardownGrace = std::chrono::seconds(2);
// Sleep bounds of the progress thread. Wake-ups come from the worker's event fd and the command
// eventfd; the timeouts are only a safety net against a transport that misses an event.
constexpr int kIdleWaitMs = 1000;
constexpr int kBusyWaitMs = 100;
constexpr int kSpinUs = 100;  // a lane (and a caller waiting on it) polls this long before sleeping

[[noreturn]] void throw_status(const Api& api, const std::string& what, ucs_status_t st) {
  throw std::runtime_error(what + " failed: " + api.describe(st));
}

void signal_fd(int fd) {
  uint64_t one = 1;
  (void)!write(fd, &one, sizeof(one));
}

}  // namespace

struct Lane::Rkey {
  uint64_t id = 0;
  ucp_rkey_h h = nullptr;
  std::weak_ptr<Ep> ep;
  uint64_t users = 0;   // unfinished jobs that use it
  bool doomed = false;  // destroy once no job uses it
};

struct Lane::Ep {
  uint64_t id = 0;
  ucp_ep_h h = nullptr;
  bool closed = false;
  uint64_t inflight = 0;
  std::vector<std::shared_ptr<Rkey>> rkeys;  // must be destroyed before the endpoint goes
};

struct Lane::Job {
  uint64_t id = 0;
  Op op = Op::kPut;
  std::shared_ptr<Ep> ep;
  std::shared_ptr<Rkey> rkey;
  uint64_t local = 0, remote = 0, len = 0;
  std::vector<Piece> pieces;  // a list job (submit_many): its pieces, and where issuing is in them
  size_t piece = 0;
  uint64_t piece_off = 0;
  uint64_t next = 0;  // bytes issued (the offset of the next chunk of a single-range job)
  uint64_t done = 0;  // bytes of completed chunks
  int inflight = 0;   // requests (chunks, flush) not yet completed
  ucs_status_t status = UCS_OK;
  bool cancelled = false, flushed = false, finished = false;
  bool internal = false;                 // read_word: not reported to the sink
  Status result = Status::kAborted;      // set when finished
  std::unique_ptr<uint64_t> scratch;     // read_word: the local word, owned by the job

  bool can_issue() const { return !cancelled && status == UCS_OK && !ep->closed && next < len; }
};

// user_data of one UCX request.
struct Lane::Req {
  Lane* lane;
  std::shared_ptr<Job> job;
  uint64_t len;
  bool flush;
};

Lane::Lane(const Api& api, ucp_context_h context, uint64_t chunk_bytes, int window, CompletionSink* sink)
    : api_(api), chunk_bytes_(chunk_bytes == 0 ? (8ull << 20) : chunk_bytes), window_(std::max(1, window)), sink_(sink) {
  auto cleanup = [this] {
    if (epoll_fd_ >= 0) close(epoll_fd_);
    if (cmd_efd_ >= 0) close(cmd_efd_);
    if (worker_ != nullptr) api_.worker_destroy(worker_);
  };
  try {
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;  // the drive lock serializes
    ucs_status_t st = api_.worker_create(context, &wp, &worker_);
    if (st != UCS_OK) throw_status(api_, "ucp_worker_create", st);

    ucp_address_t* addr = nullptr;
    size_t addr_len = 0;
    st = api_.worker_get_address(worker_, &addr, &addr_len);
    if (st != UCS_OK) throw_status(api_, "ucp_worker_get_address", st);
    address_.assign(reinterpret_cast<const char*>(addr), addr_len);
    api_.worker_release_address(worker_, addr);

    st = api_.worker_get_efd(worker_, &worker_efd_);
    if (st != UCS_OK) throw_status(api_, "ucp_worker_get_efd", st);
    cmd_efd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
    if (cmd_efd_ < 0 || epoll_fd_ < 0) throw std::runtime_error(std::string("eventfd/epoll: ") + std::strerror(errno));
    for (int fd : {worker_efd_, cmd_efd_}) {
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.fd = fd;
      if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) throw std::runtime_error(std::string("epoll_ctl: ") + std::strerror(errno));
    }
  } catch (...) {
    cleanup();
    throw;
  }
  thread_ = std::thread([this] { loop(); });
}

Lane::~Lane() {
  stop();
  for (int fd : {epoll_fd_, cmd_efd_})
    if (fd >= 0) close(fd);
}

// -- commands (any thread -> progress thread) ------------------------------------------------

void Lane::call(std::function<void()> fn) {
  auto done = std::make_shared<std::promise<void>>();
  std::future<void> result = done->get_future();
  {
    std::lock_guard<std::mutex> lock(cmd_mu_);
    if (stopping_) throw std::runtime_error("the ucx lane is shut down");
    commands_.push_back({std::move(fn), done});
  }
  has_commands_.store(true, std::memory_order_release);
  signal_fd(cmd_efd_);
  // The lane answers small calls within microseconds while it spins (see loop()): poll before
  // sleeping on the future, whose wake-up costs more than the call.
  auto spin_until = Clock::now() + std::chrono::microseconds(kSpinUs);
  while (result.wait_for(std::chrono::seconds(0)) != std::future_status::ready && Clock::now() < spin_until) {
  }
  result.get();  // rethrows what the command threw
}

void Lane::post(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(cmd_mu_);
    if (stopping_) throw std::runtime_error("the ucx lane is shut down");
    commands_.push_back({std::move(fn), nullptr});
  }
  has_commands_.store(true, std::memory_order_release);
  signal_fd(cmd_efd_);
}

bool Lane::run_commands() {
  std::deque<Command> batch;
  {
    std::lock_guard<std::mutex> lock(cmd_mu_);
    batch.swap(commands_);
    has_commands_.store(false, std::memory_order_relaxed);
  }
  for (Command& c : batch) {
    try {
      c.fn();
      if (c.done) c.done->set_value();
    } catch (...) {
      if (c.done) c.done->set_exception(std::current_exception());
    }
  }
  return !batch.empty();
}

uint64_t Lane::ep_create(const std::string& address) {
  uint64_t id = 0;
  call([&] {
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    ep.address = reinterpret_cast<const ucp_address_t*>(address.data());
    // No UCX peer error handling: it forces slow emulated protocols (and keepalive traffic).
    // Peer failure is detected by the Transport's control plane instead.
    ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
    ucp_ep_h h = nullptr;
    ucs_status_t st = api_.ep_create(worker_, &ep, &h);
    if (st != UCS_OK) throw_status(api_, "ucp_ep_create", st);
    auto e = std::make_shared<Ep>();
    e->id = next_id_++;
    e->h = h;
    eps_[e->id] = e;
    id = e->id;
  });
  return id;
}

void Lane::ep_close(uint64_t ep, bool force) {
  post([this, ep, force] {
    auto it = eps_.find(ep);
    if (it != eps_.end()) close_ep(it->second, force);
  });
}

uint64_t Lane::rkey_unpack(uint64_t ep, const std::string& packed) {
  uint64_t id = 0;
  call([&] {
    auto it = eps_.find(ep);
    if (it == eps_.end() || it->second->closed) throw std::runtime_error("the endpoint is closed");
    ucp_rkey_h h = nullptr;
    ucs_status_t st = api_.ep_rkey_unpack(it->second->h, packed.data(), &h);
    if (st != UCS_OK) throw_status(api_, "ucp_ep_rkey_unpack", st);
    auto rk = std::make_shared<Rkey>();
    rk->id = next_id_++;
    rk->h = h;
    rk->ep = it->second;
    it->second->rkeys.push_back(rk);
    rkeys_[rk->id] = rk;
    id = rk->id;
  });
  return id;
}

void Lane::rkey_destroy(uint64_t rkey) {
  post([this, rkey] {
    auto it = rkeys_.find(rkey);
    if (it == rkeys_.end()) return;
    std::shared_ptr<Rkey> rk = it->second;
    rkeys_.erase(it);
    rk->doomed = true;
    if (rk->users == 0) release_rkey(rk);
  });
}

void Lane::submit(uint64_t id, Op op, uint64_t ep, uint64_t rkey, uint64_t local, uint64_t remote, uint64_t nbytes) {
  post([=] {
    auto job = std::make_shared<Job>();
    job->id = id;
    job->op = op;
    job->local = local;
    job->remote = remote;
    job->len = nbytes;
    enqueue(job, ep, rkey);
  });
}

void Lane::submit_many(uint64_t id, Op op, uint64_t ep, uint64_t rkey, std::vector<Piece> pieces) {
  post([=, pieces = std::move(pieces)]() mutable {
    auto job = std::make_shared<Job>();
    job->id = id;
    job->op = op;
    for (const Piece& pc : pieces) job->len += pc.len;
    job->pieces = std::move(pieces);
    enqueue(job, ep, rkey);
  });
}

void Lane::enqueue(const std::shared_ptr<Job>& job, uint64_t ep, uint64_t rkey) {
  jobs_[job->id] = job;
  auto e = eps_.find(ep);
  auto k = rkeys_.find(rkey);
  if (e == eps_.end() || k == rkeys_.end() || e->second->closed) {
    job->status = UCS_ERR_NOT_CONNECTED;  // closed under us (the peer was dropped)
    complete(job, Status::kFailed);
    return;
  }
  job->ep = e->second;
  job->rkey = k->second;
  ++job->rkey->users;
  if (job->len == 0) {
    complete(job, Status::kOk);
    return;
  }
  ready_.push_back(job);
}

void Lane::cancel(uint64_t id) {
  post([this, id] {
    auto it = jobs_.find(id);
    if (it == jobs_.end()) return;
    std::shared_ptr<Job> j = it->second;
    j->cancelled = true;
    maybe_finish(j);
  });
}

std::shared_ptr<Lane::Job> Lane::internal_job(uint64_t ep, uint64_t rkey, Op op, uint64_t local, uint64_t remote,
                                              uint64_t nbytes) {
  auto e = eps_.find(ep);
  auto k = rkeys_.find(rkey);
  if (e == eps_.end() || k == rkeys_.end() || e->second->closed) return nullptr;
  auto job = std::make_shared<Job>();
  job->id = (1ull << 63) | next_internal_++;
  job->internal = true;
  job->op = op;
  job->local = local;
  job->remote = remote;
  job->len = nbytes;
  job->ep = e->second;
  job->rkey = k->second;
  ++job->rkey->users;
  jobs_[job->id] = job;
  ready_.push_back(job);
  return job;
}

int Lane::read_word(uint64_t ep, uint64_t rkey, uint64_t remote, int timeout_ms, uint64_t* value) {
  int result = 0;
  call([&] {
    auto scratch = std::make_unique<uint64_t>(0);  // outlives a timeout: the job owns it
    auto local = reinterpret_cast<uint64_t>(scratch.get());
    std::shared_ptr<Job> job = internal_job(ep, rkey, Op::kGet, local, remote, sizeof(uint64_t));
    if (!job) {
      result = UCS_ERR_NOT_CONNECTED;
      return;
    }
    job->scratch = std::move(scratch);
    // Drive this lane right here until the word arrives (other jobs progress meanwhile).
    auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
    while (!job->finished && Clock::now() < deadline) {
      if (issue_round() || api_.worker_progress(worker_) != 0) continue;
      if (api_.worker_arm(worker_) == UCS_OK) {
        epoll_event events[4];
        (void)epoll_wait(epoll_fd_, events, 4, 1);
      }
    }
    if (!job->finished) {
      job->cancelled = true;
      result = UCS_ERR_TIMED_OUT;
    } else if (job->result != Status::kOk) {
      result = job->status != UCS_OK ? job->status : UCS_ERR_CANCELED;
    } else {
      *value = *job->scratch;
    }
  });
  return result;
}

int Lane::transfer_now(uint64_t ep, uint64_t rkey, Op op, uint64_t local, uint64_t remote, uint64_t nbytes,
                       int timeout_us, uint64_t* moved) {
  drivers_.fetch_add(1, std::memory_order_acq_rel);  // the lane's thread steps aside
  std::unique_lock<std::mutex> lock(drive_mu_);
  // Hands the lane back: wakes its thread when work is left that it must drive.
  struct Release {
    Lane* lane;
    std::unique_lock<std::mutex>& lock;
    ~Release() {
      bool wake = lane->worker_ != nullptr && (!lane->ready_.empty() || lane->inflight_ > 0 || !lane->closing_.empty());
      lane->drivers_.fetch_sub(1, std::memory_order_acq_rel);
      lock.unlock();
      lane->drive_cv_.notify_all();
      if (wake) signal_fd(lane->cmd_efd_);
    }
  } release{this, lock};
  if (worker_ == nullptr) throw std::runtime_error("the ucx lane is shut down");
  std::shared_ptr<Job> job = internal_job(ep, rkey, op, local, remote, nbytes);
  if (!job) return UCS_ERR_NOT_CONNECTED;
  auto drive_until = [&](Clock::time_point deadline) {
    while (!job->finished && Clock::now() < deadline) {
      if (!issue_round()) api_.worker_progress(worker_);
    }
  };
  drive_until(Clock::now() + std::chrono::microseconds(timeout_us));
  bool late = !job->finished;
  if (late) {
    job->cancelled = true;
    maybe_finish(job);
    drive_until(Clock::now() + std::chrono::seconds(1));
  }
  if (!job->finished) {  // requests still in flight: forcing the endpoint closed ends them
    close_ep(job->ep, /*force=*/true);
    drive_until(Clock::now() + std::chrono::seconds(1));
  }
  *moved = job->done;
  if (late || !job->finished) return UCS_ERR_TIMED_OUT;
  if (job->result != Status::kOk) return job->status != UCS_OK ? job->status : UCS_ERR_CANCELED;
  return 0;
}

void Lane::request_stop() {
  {
    std::lock_guard<std::mutex> lock(cmd_mu_);
    stopping_ = true;
  }
  signal_fd(cmd_efd_);
}

void Lane::stop() {
  std::call_once(stop_once_, [this] {
    request_stop();
    if (thread_.joinable()) thread_.join();
  });
}

// -- the progress thread ---------------------------------------------------------------------

bool Lane::yield_to_drivers(std::unique_lock<std::mutex>& lock) {
  if (drivers_.load(std::memory_order_acquire) == 0) return false;
  drive_cv_.wait(lock, [this] { return drivers_.load(std::memory_order_acquire) == 0; });
  return true;
}

void Lane::loop() {
  std::unique_lock<std::mutex> lock(drive_mu_);  // released while sleeping and for drivers
  Clock::time_point last_busy{};
  for (;;) {
    // A driver drove the worker itself and wakes this thread (cmd_efd_) when it left work
    // behind: no spinning after it. A spinning lane thread would take a core from the next
    // synchronous transfer (two vCPUs: the caller and the pair's assistant).
    if (yield_to_drivers(lock)) last_busy = Clock::time_point{};
    bool busy = run_commands();
    {
      std::lock_guard<std::mutex> stop_lock(cmd_mu_);
      if (stopping_) break;
    }
    busy |= issue_round();
    while (api_.worker_progress(worker_) != 0) busy = true;
    if (!closing_.empty()) reap_closing();
    if (busy) {
      last_busy = Clock::now();
      continue;
    }
    // Spin a little after activity before sleeping: the next small transfer usually follows at
    // once, and waking a sleeping thread costs more than it does.
    if (Clock::now() - last_busy < std::chrono::microseconds(kSpinUs)) {
      while (!has_commands_.load(std::memory_order_acquire) && drivers_.load(std::memory_order_acquire) == 0 &&
             Clock::now() - last_busy < std::chrono::microseconds(kSpinUs) && api_.worker_progress(worker_) == 0) {
      }
      continue;
    }
    // Nothing to do until an event: arm the worker's fd and sleep on it and on the commands.
    ucs_status_t st = api_.worker_arm(worker_);
    if (st == UCS_ERR_BUSY) continue;
    int timeout = (inflight_ > 0 || !closing_.empty()) ? kBusyWaitMs : kIdleWaitMs;
    if (st != UCS_OK) timeout = 1;  // cannot sleep on the worker: poll gently instead
    lock.unlock();
    epoll_event events[4];
    (void)epoll_wait(epoll_fd_, events, 4, timeout);
    uint64_t counter;
    (void)!read(cmd_efd_, &counter, sizeof(counter));
    lock.lock();
  }
  teardown();
}

bool Lane::issue_round() {
  // One chunk per job per round: jobs share the thread fairly and none waits behind a big one.
  bool issued = false;
  for (size_t n = ready_.size(); n > 0; --n) {
    std::shared_ptr<Job> job = std::move(ready_.front());
    ready_.pop_front();
    if (job->finished) continue;
    if (!job->can_issue()) {
      maybe_finish(job);
      continue;
    }
    if (job->inflight >= window_) {
      ready_.push_back(std::move(job));
      continue;
    }
    // Up to about one chunk's worth per round: one chunk of a large range, or many pieces.
    uint64_t bytes = 0;
    do {
      bytes += issue_chunk(job);
    } while (bytes < chunk_bytes_ && job->can_issue() && job->inflight < window_);
    issued = true;
    if (job->can_issue())
      ready_.push_back(std::move(job));
    else
      maybe_finish(job);
  }
  return issued;
}

uint64_t Lane::issue_chunk(const std::shared_ptr<Job>& job) {
  uint64_t n, local, remote;
  if (job->pieces.empty()) {
    n = std::min(chunk_bytes_, job->len - job->next);
    local = job->local + job->next;
    remote = job->remote + job->next;
  } else {
    const Piece& pc = job->pieces[job->piece];
    n = std::min(chunk_bytes_, pc.len - job->piece_off);
    local = pc.local + job->piece_off;
    remote = pc.remote + job->piece_off;
    job->piece_off += n;
    if (job->piece_off == pc.len) {
      ++job->piece;
      job->piece_off = 0;
    }
  }
  job->next += n;
  Req* req = new Req{this, job, n, false};
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMORY_TYPE;
  p.cb.send = &Lane::on_request_done;
  p.user_data = req;
  p.memory_type = UCS_MEMORY_TYPE_HOST;
  ++job->inflight;
  ++job->ep->inflight;
  ++inflight_;
  void* buf = reinterpret_cast<void*>(local);
  ucs_status_ptr_t r = job->op == Op::kPut ? api_.put_nbx(job->ep->h, buf, n, remote, job->rkey->h, &p)
                                           : api_.get_nbx(job->ep->h, buf, n, remote, job->rkey->h, &p);
  // Completed in place (e.g. cma copies synchronously): no callback follows.
  if (r == nullptr) {
    request_done(req, UCS_OK);
  } else if (UCS_PTR_IS_ERR(r)) {
    request_done(req, UCS_PTR_STATUS(r));
  }
  return n;
}

void Lane::issue_flush(const std::shared_ptr<Job>& job) {
  Req* req = new Req{this, job, 0, true};
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.send = &Lane::on_request_done;
  p.user_data = req;
  ++job->inflight;
  ++job->ep->inflight;
  ++inflight_;
  ucs_status_ptr_t r = api_.ep_flush_nbx(job->ep->h, &p);
  if (r == nullptr) {
    request_done(req, UCS_OK);
  } else if (UCS_PTR_IS_ERR(r)) {
    request_done(req, UCS_PTR_STATUS(r));
  }
}

void Lane::on_request_done(void* request, ucs_status_t status, void* user_data) {
  Req* req = static_cast<Req*>(user_data);
  Lane* self = req->lane;
  self->request_done(req, status);
  self->api_.request_free(request);
}

void Lane::request_done(Req* req, ucs_status_t status) {
  std::shared_ptr<Job> job = std::move(req->job);
  const bool flush = req->flush;
  const uint64_t len = req->len;
  delete req;
  --job->inflight;
  --job->ep->inflight;
  --inflight_;
  if (status == UCS_OK) {
    if (flush)
      job->flushed = true;
    else
      job->done += len;
  } else if (job->status == UCS_OK) {
    job->status = status;
  }
  if (job->ep->closed && job->ep->inflight == 0) {
    auto rkeys = job->ep->rkeys;  // release_rkey edits the list
    for (auto& rk : rkeys) release_rkey(rk);
  }
  maybe_finish(job);
}

void Lane::maybe_finish(const std::shared_ptr<Job>& job) {
  if (job->finished || job->inflight > 0 || job->can_issue()) return;
  if (job->status == UCS_OK && job->done == job->len) {
    if (job->op == Op::kGet || job->flushed) {
      complete(job, Status::kOk);
      return;
    }
    if (!job->ep->closed) {
      issue_flush(job);  // remote completion of the puts
      return;
    }
    job->status = UCS_ERR_CANCELED;
  }
  complete(job, job->status != UCS_OK ? Status::kFailed : Status::kAborted);
}

void Lane::complete(const std::shared_ptr<Job>& job, Status status) {
  job->finished = true;
  jobs_.erase(job->id);
  if (job->rkey && --job->rkey->users == 0 && job->rkey->doomed) release_rkey(job->rkey);
  job->result = status;
  if (!job->internal) sink_->report({job->id, status, static_cast<int>(job->status), job->done});
}

void Lane::release_rkey(std::shared_ptr<Rkey> rk) {
  if (rk->h != nullptr) {
    api_.rkey_destroy(rk->h);
    rk->h = nullptr;
  }
  rkeys_.erase(rk->id);
  if (auto ep = rk->ep.lock()) {
    auto& v = ep->rkeys;
    v.erase(std::remove(v.begin(), v.end(), rk), v.end());
  }
}

void Lane::close_ep(std::shared_ptr<Ep> ep, bool force) {
  if (ep->closed) return;
  ep->closed = true;
  eps_.erase(ep->id);
  std::vector<std::shared_ptr<Job>> affected;
  for (auto& kv : jobs_) {
    const std::shared_ptr<Job>& job = kv.second;
    if (job->ep != ep || job->finished) continue;
    // Chunks not yet issued can never be: the job fails. With force, the requests in flight are
    // cancelled by UCX too; a graceful close lets them (and their bytes) complete.
    if (job->status == UCS_OK && (force || job->next < job->len)) job->status = UCS_ERR_CANCELED;
    affected.push_back(job);
  }
  // rkeys go before their endpoint (UCX's rule); with requests in flight, once they are done.
  if (ep->inflight == 0) {
    auto rkeys = ep->rkeys;
    for (auto& rk : rkeys) release_rkey(rk);
  }
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ucs_status_ptr_t r = api_.ep_close_nbx(ep->h, &p);
  if (r != nullptr && !UCS_PTR_IS_ERR(r)) closing_.emplace_back(ep, r);
  for (auto& job : affected) maybe_finish(job);
}

void Lane::reap_closing() {
  for (auto it = closing_.begin(); it != closing_.end();) {
    if (api_.request_check_status(it->second) == UCS_INPROGRESS) {
      ++it;
      continue;
    }
    api_.request_free(it->second);
    it = closing_.erase(it);
  }
}

void Lane::teardown() {
  auto deadline = Clock::now() + kTeardownGrace;
  auto progress_until = [&](auto&& done) {
    while (!done() && Clock::now() < deadline) {
      if (api_.worker_progress(worker_) != 0) continue;
      reap_closing();
      if (api_.worker_arm(worker_) == UCS_OK) {
        epoll_event events[4];
        (void)epoll_wait(epoll_fd_, events, 4, 10);
      }
    }
  };
  for (auto& kv : jobs_) kv.second->cancelled = true;
  progress_until([&] { return inflight_ == 0; });
  std::vector<std::shared_ptr<Ep>> eps;
  for (auto& kv : eps_) eps.push_back(kv.second);
  for (auto& ep : eps) close_ep(ep, /*force=*/ep->inflight > 0);
  progress_until([&] {
    reap_closing();
    return closing_.empty() && inflight_ == 0;
  });
  // Whatever is still unfinished is aborted; destroying the worker releases its requests.
  std::vector<std::shared_ptr<Job>> left;
  for (auto& kv : jobs_) left.push_back(kv.second);
  for (auto& job : left) complete(job, job->status != UCS_OK ? Status::kFailed : Status::kAborted);
  ready_.clear();
  for (auto& kv : closing_) api_.request_free(kv.second);
  closing_.clear();
  // With requests still in flight (a dead peer) the rkeys are left to the worker's destruction.
  if (inflight_ == 0) {
    std::vector<std::shared_ptr<Rkey>> rkeys;
    for (auto& kv : rkeys_) rkeys.push_back(kv.second);
    for (auto& rk : rkeys) release_rkey(rk);
  }
  api_.worker_destroy(worker_);
  worker_ = nullptr;
  // Commands that raced with the shutdown fail instead of waiting forever.
  std::deque<Command> rest;
  {
    std::lock_guard<std::mutex> lock(cmd_mu_);
    rest.swap(commands_);
  }
  for (Command& c : rest)
    if (c.done) c.done->set_exception(std::make_exception_ptr(std::runtime_error("the ucx lane is shut down")));
}

}  // namespace transport::ucx
