#include "ucx_engine.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <exception>
#include <stdexcept>

namespace transport::ucx {

namespace {

[[noreturn]] void throw_status(const Api& api, const std::string& what, ucs_status_t st) {
  throw std::runtime_error(what + " failed: " + api.describe(st));
}

}  // namespace

Engine::Engine(const std::string& library, const std::string& name, int lanes, uint64_t chunk_bytes, int window)
    : api_(load_api(library)) {
  if (lanes < 1) throw std::invalid_argument("a ucx engine needs at least one lane");
  try {
    done_efd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (done_efd_ < 0) throw std::runtime_error(std::string("eventfd: ") + std::strerror(errno));
    ucp_config_t* config = nullptr;
    ucs_status_t st = api_.config_read(nullptr, nullptr, &config);
    if (st != UCS_OK) throw_status(api_, "ucp_config_read", st);
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED | UCP_PARAM_FIELD_NAME;
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
    // Lanes' workers run on their own threads and mem_map runs on the caller's: the context
    // (memory registrations, caches) must be thread-safe. The workers themselves are not shared.
    params.mt_workers_shared = 1;
    params.name = name.c_str();
    // Ask for the API level both the headers and the loaded library know.
    unsigned minor = (api_.major == UCP_API_MAJOR && api_.minor < UCP_API_MINOR) ? api_.minor : UCP_API_MINOR;
    st = api_.init_version(UCP_API_MAJOR, minor, &params, config, &context_);
    api_.config_release(config);
    if (st != UCS_OK) throw_status(api_, "ucp_init", st);
    for (int i = 0; i < lanes; ++i) lanes_.push_back(std::make_unique<Lane>(api_, context_, chunk_bytes, window, this));
  } catch (...) {
    lanes_.clear();  // stops their threads
    if (context_ != nullptr) api_.cleanup(context_);
    if (done_efd_ >= 0) close(done_efd_);
    throw;
  }
}

Engine::~Engine() {
  shutdown();
  if (done_efd_ >= 0) close(done_efd_);
}

Lane& Engine::at(int lane) const {
  if (lane < 0 || lane >= static_cast<int>(lanes_.size()))
    throw std::out_of_range("no ucx lane " + std::to_string(lane));
  return *lanes_[static_cast<size_t>(lane)];
}

uint64_t Engine::mem_map(uint64_t address, uint64_t nbytes, bool remote_write, bool local_write,
                         std::string* rkey) {
  std::lock_guard<std::mutex> lock(mem_mu_);
  if (context_ == nullptr) throw std::runtime_error("the ucx engine is shut down");
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
  mp.address = reinterpret_cast<void*>(address);
  mp.length = nbytes;
  mp.memory_type = UCS_MEMORY_TYPE_HOST;
  if (!remote_write || !local_write) {  // else UCX's default: every access
    mp.field_mask |= UCP_MEM_MAP_PARAM_FIELD_PROT;
    mp.prot = UCP_MEM_MAP_PROT_LOCAL_READ | UCP_MEM_MAP_PROT_REMOTE_READ |
              (local_write ? UCP_MEM_MAP_PROT_LOCAL_WRITE : 0) | (remote_write ? UCP_MEM_MAP_PROT_REMOTE_WRITE : 0);
  }
  ucp_mem_h h = nullptr;
  ucs_status_t st = api_.mem_map(context_, &mp, &h);
  if (st != UCS_OK) throw_status(api_, "ucp_mem_map of " + std::to_string(nbytes) + " bytes", st);
  void* buf = nullptr;
  size_t len = 0;
  st = api_.rkey_pack(context_, h, &buf, &len);
  if (st != UCS_OK) {
    api_.mem_unmap(context_, h);
    throw_status(api_, "ucp_rkey_pack", st);
  }
  rkey->assign(static_cast<const char*>(buf), len);
  api_.rkey_buffer_release(buf);
  uint64_t id = next_mem_++;
  mems_[id] = h;
  return id;
}

void Engine::mem_unmap(uint64_t mem) {
  std::lock_guard<std::mutex> lock(mem_mu_);
  auto it = mems_.find(mem);
  if (it == mems_.end() || context_ == nullptr) return;
  api_.mem_unmap(context_, it->second);
  mems_.erase(it);
}

uint64_t Engine::submit(int lane, Op op, uint64_t ep, uint64_t rkey, uint64_t local, uint64_t remote, uint64_t nbytes) {
  Lane& l = at(lane);
  uint64_t id = next_job_++;
  l.submit(id, op, ep, rkey, local, remote, nbytes);
  return id;
}

void Engine::report(const Completion& c) {
  {
    std::lock_guard<std::mutex> lock(done_mu_);
    done_.push_back(c);
  }
  uint64_t one = 1;
  (void)!write(done_efd_, &one, sizeof(one));
}

std::vector<Completion> Engine::drain() {
  uint64_t counter;
  (void)!read(done_efd_, &counter, sizeof(counter));
  std::lock_guard<std::mutex> lock(done_mu_);
  std::vector<Completion> out;
  out.swap(done_);
  return out;
}

namespace {
using SteadyClock = std::chrono::steady_clock;
constexpr auto kAssistPoll = std::chrono::microseconds(200);  // the assistant polls this long, then sleeps
}  // namespace

int Engine::run_part(Op op, const NowPart& p, int timeout_us, uint64_t* moved) {
  try {
    return at(p.lane).transfer_now(p.ep, p.rkey, op, p.local, p.remote, p.nbytes, timeout_us, moved);
  } catch (const std::exception&) {
    return UCS_ERR_NO_RESOURCE;  // the lane was shut down under us
  }
}

int Engine::transfer_now_pair(Op op, const NowPart& first, const NowPart& second, int timeout_us, uint64_t* moved) {
  std::lock_guard<std::mutex> pair(pair_mu_);
  {
    std::lock_guard<std::mutex> lock(assist_mu_);
    if (assist_stop_) throw std::runtime_error("the ucx engine is shut down");
    if (!assistant_.joinable()) assistant_ = std::thread([this] { assist(); });
    assist_op_ = op;
    assist_part_ = second;
    assist_timeout_us_ = timeout_us;
    assist_state_.store(1, std::memory_order_release);
  }
  assist_cv_.notify_one();
  uint64_t mine = 0;
  const int status = run_part(op, first, timeout_us, &mine);  // the assistant's part still ends below
  // The assistant's part ends within its own bound (Lane::transfer_now); the local memory is
  // free only then.
  for (int spins = 0; assist_state_.load(std::memory_order_acquire) != 2; ++spins)
    if (spins > 1000) std::this_thread::yield();
  assist_state_.store(0, std::memory_order_relaxed);
  *moved = mine + assist_moved_;
  return status != 0 ? status : assist_status_;
}

void Engine::assist() {
  for (;;) {
    const auto until = SteadyClock::now() + kAssistPoll;
    while (assist_state_.load(std::memory_order_acquire) != 1 && SteadyClock::now() < until) {
    }
    if (assist_state_.load(std::memory_order_acquire) != 1) {
      std::unique_lock<std::mutex> lock(assist_mu_);
      assist_cv_.wait(lock, [this] { return assist_stop_ || assist_state_.load(std::memory_order_acquire) == 1; });
      if (assist_state_.load(std::memory_order_acquire) != 1) return;  // stopping, nothing posted
    }
    uint64_t moved = 0;
    const int status = run_part(assist_op_, assist_part_, assist_timeout_us_, &moved);
    assist_moved_ = moved;
    assist_status_ = status;
    assist_state_.store(2, std::memory_order_release);
  }
}

void Engine::shutdown() {
  std::call_once(shutdown_once_, [this] {
    {
      std::lock_guard<std::mutex> pair(pair_mu_);  // no pair is running from here on
      std::lock_guard<std::mutex> lock(assist_mu_);
      assist_stop_ = true;
    }
    assist_cv_.notify_all();
    if (assistant_.joinable()) assistant_.join();
    for (auto& lane : lanes_) lane->request_stop();  // tear down in parallel
    for (auto& lane : lanes_) lane->stop();
    std::lock_guard<std::mutex> lock(mem_mu_);
    for (auto& kv : mems_) api_.mem_unmap(context_, kv.second);
    mems_.clear();
    if (context_ != nullptr) api_.cleanup(context_);
    context_ = nullptr;
  });
}

}  // namespace transport::ucx
