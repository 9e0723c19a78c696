// UCX engine: one UCP context per Transport and its lanes (a worker + progress thread each).
//
// A lane is what one CPU can push: a single worker copies serially (with shared-memory transports
// the copy runs inside ucp_put_nbx under the worker's lock), so large transfers are split across
// lanes by the caller to use more than one core. All lanes share the context, hence one memory
// registration and one rkey per region serve every lane (and, on RDMA, one protection domain).
// Finished jobs of every lane are queued here and announced through one eventfd.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ucx_lane.h"

namespace transport::ucx {

class Engine : public CompletionSink {
 public:
  // Loads libucp from `library` (see load_api), creates the context and `lanes` lanes. UCX_*
  // variables of the environment configure it (read, never written). Throws std::runtime_error.
  Engine(const std::string& library, const std::string& name, int lanes, uint64_t chunk_bytes, int window);
  ~Engine() override;
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  int event_fd() const { return done_efd_; }
  int lanes() const { return static_cast<int>(lanes_.size()); }
  const std::string& worker_address(int lane) const { return at(lane).address(); }

  // Registration (ucp_mem_map) of [address, address + nbytes); returns an id and fills the packed
  // rkey peers need. Without `remote_write` the registration grants remote read access only;
  // without `local_write` the memory is not locally writable either (a PROT_READ mapping). Only
  // transports that check rkeys in hardware (RDMA) enforce this: UCX's cma and tcp transports
  // let any rkey write anywhere (see transport/backends/ucx.py).
  uint64_t mem_map(uint64_t address, uint64_t nbytes, bool remote_write, bool local_write, std::string* rkey);
  void mem_unmap(uint64_t mem);

  uint64_t ep_create(int lane, const std::string& address) { return at(lane).ep_create(address); }
  void ep_close(int lane, uint64_t ep, bool force) { at(lane).ep_close(ep, force); }
  uint64_t rkey_unpack(int lane, uint64_t ep, const std::string& packed) { return at(lane).rkey_unpack(ep, packed); }
  void rkey_destroy(int lane, uint64_t rkey) { at(lane).rkey_destroy(rkey); }
  // Queues a transfer on `lane`; returns its id (unique across lanes).
  uint64_t submit(int lane, Op op, uint64_t ep, uint64_t rkey, uint64_t local, uint64_t remote, uint64_t nbytes);
  uint64_t submit_many(int lane, Op op, uint64_t ep, uint64_t rkey, std::vector<Piece> pieces) {
    uint64_t id = next_job_++;
    at(lane).submit_many(id, op, ep, rkey, std::move(pieces));
    return id;
  }
  void cancel(int lane, uint64_t job) { at(lane).cancel(job); }
  int read_word(int lane, uint64_t ep, uint64_t rkey, uint64_t remote, int timeout_ms, uint64_t* value) {
    return at(lane).read_word(ep, rkey, remote, timeout_ms, value);
  }

  int transfer_now(int lane, Op op, uint64_t ep, uint64_t rkey, uint64_t local, uint64_t remote, uint64_t nbytes,
                   int timeout_us, uint64_t* moved) {
    return at(lane).transfer_now(ep, rkey, op, local, remote, nbytes, timeout_us, moved);
  }
  // One synchronous transfer in two parts moved at once: `second` by the engine's assistant
  // thread (Lane::transfer_now on its lane), `first` by the calling thread. Returns when both
  // have ended (each bounded as Lane::transfer_now): 0 when every byte is in place, else the
  // first failing ucs status; `*moved`: bytes of completed chunks of both.
  struct NowPart {
    int lane;
    uint64_t ep, rkey, local, remote, nbytes;
  };
  int transfer_now_pair(Op op, const NowPart& first, const NowPart& second, int timeout_us, uint64_t* moved);

  // Finished jobs of every lane since the last call (also clears the eventfd counter).
  std::vector<Completion> drain();
  void report(const Completion& c) override;
  // Stops every lane (they tear down in parallel, each bounded), then releases the memory
  // registrations and the context. Afterwards UCX touches no memory of this process. Idempotent.
  void shutdown();

 private:
  Lane& at(int lane) const;

  const Api& api_;
  ucp_context_h context_ = nullptr;
  std::vector<std::unique_ptr<Lane>> lanes_;
  int done_efd_ = -1;
  std::mutex done_mu_;
  std::vector<Completion> done_;
  std::atomic<uint64_t> next_job_{1};

  // The assistant of transfer_now_pair: a thread started on first use. It polls for its next
  // part for a while after each one (a wake-up from sleep costs more than the copy on a VM),
  // then sleeps on the condition variable. One pair at a time (pair_mu_).
  void assist();
  // Lane::transfer_now of one part; a lane shut down under it is UCS_ERR_NO_RESOURCE.
  int run_part(Op op, const NowPart& p, int timeout_us, uint64_t* moved);
  std::mutex pair_mu_;
  std::mutex assist_mu_;
  std::condition_variable assist_cv_;
  std::thread assistant_;
  bool assist_stop_ = false;
  std::atomic<int> assist_state_{0};  // 0 idle, 1 a part is posted, 2 it ended
  Op assist_op_ = Op::kPut;
  NowPart assist_part_{};
  int assist_timeout_us_ = 0;
  int assist_status_ = 0;
  uint64_t assist_moved_ = 0;
  std::mutex mem_mu_;
  std::unordered_map<uint64_t, ucp_mem_h> mems_;
  uint64_t next_mem_ = 1;
  std::once_flag shutdown_once_;
};

}  // namespace transport::ucx
