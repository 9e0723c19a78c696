// The tcp backend's direct lane: single-range puts and gets served by native threads.
//
// After the Python agent has authenticated a connection (HELLO with lane "direct"), it hands
// the socket to a DirectServer. The server's thread for that connection reads fixed-size binary
// requests, checks each one against a RegionMirror (the host regions this endpoint registered,
// kept current by Python's RegionTable) and moves the bytes straight between the socket and the
// region, with no Python on the path. The initiator's DirectLane carries one request at a time
// and drives it on the calling thread for at most a short bound; past it, the event loop drives
// the rest (sending when the socket is writable, reading the reply when it is readable).
//
// Every request byte is hostile until checked: field sizes are fixed or bounded, ranges are
// checked without overflow, and a malformed request closes that connection only.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace transport::tcp {

constexpr uint32_t kRequestMagic = 0x31524454;  // "TDR1"
constexpr uint32_t kReplyMagic = 0x31414454;    // "TDA1"
constexpr uint8_t kPut = 1;
constexpr uint8_t kGet = 2;
constexpr size_t kMaxKey = 255;
constexpr size_t kMaxDtype = 32;
constexpr size_t kMaxMessage = 1024;
// A refused put's payload up to this size is read and dropped (the stream stays in step); a
// larger one closes the connection after the refusal is sent.
constexpr uint64_t kMaxDiscard = 64ull << 20;

#pragma pack(push, 1)
struct Request {  // followed by key_len key bytes, dtype_len dtype bytes, then a put's payload
  uint32_t magic;
  uint8_t op;
  uint8_t key_len;
  uint8_t dtype_len;
  uint8_t pad;
  uint64_t rid;
  uint64_t offset;
  uint64_t nbytes;
};
struct Reply {  // followed by msg_len message bytes, then a get's payload (nbytes)
  uint32_t magic;
  uint16_t status;  // Refusal
  uint16_t msg_len;
  uint64_t rid;
  uint64_t nbytes;
};
#pragma pack(pop)

// Why a request was refused (the codes travel on the wire).
enum Refusal : uint16_t {
  kOk = 0,
  kNoRegion = 1,
  kDtype = 2,
  kBounds = 3,
  kReadOnly = 4,
  kMoved = 5,
  kBadRequest = 6,
};

// The host regions one endpoint has registered, as the direct lane's threads see them.
class RegionMirror {
 public:
  struct Entry {
    uint64_t address = 0;
    uint64_t nbytes = 0;
    uint32_t itemsize = 1;
    bool writable = false;
    std::string dtype;
    std::atomic<bool> moved{false};  // the tensor was given new storage since: refuse
    std::atomic<int> busy{0};  // requests moving bytes of this region right now
    uint64_t token = 0;        // Python's handle for a withdrawn entry
  };
  // A region in use by one request: keeps the entry (and, through Python, its memory) alive.
  class Use {
   public:
    // Takes over one `busy` count that acquire() added under the mirror's lock.
    explicit Use(std::shared_ptr<Entry> e) : e_(std::move(e)) {}
    ~Use() { if (e_) e_->busy.fetch_sub(1); }
    Use(const Use&) = delete;
    Use& operator=(const Use&) = delete;
    const Entry* operator->() const { return e_.get(); }
    explicit operator bool() const { return e_ != nullptr; }

   private:
    std::shared_ptr<Entry> e_;
  };

  void set(const std::string& key, uint64_t address, uint64_t nbytes, uint32_t itemsize, bool writable,
           const std::string& dtype);
  // Withdraws `key`. Returns true when a request still moves its bytes: the entry is then kept
  // as `token` until released() reports it (Python keeps the memory alive until then).
  bool remove(const std::string& key, uint64_t token);
  void mark_moved(const std::string& key);
  // Tokens of withdrawn entries no request uses any more (each reported once).
  std::vector<uint64_t> released();
  void clear();
  // The live entry for `key` with its `busy` count raised (hand it to a Use), or null.
  std::shared_ptr<Entry> acquire(const std::string& key);
  size_t size();

 private:
  std::mutex mu_;
  std::unordered_map<std::string, std::shared_ptr<Entry>> live_;
  std::vector<std::shared_ptr<Entry>> retired_;
};

// Serves direct-lane connections, one thread each.
class DirectServer {
 public:
  DirectServer(std::shared_ptr<RegionMirror> mirror, std::string owner, double io_timeout_s, int max_conns);
  ~DirectServer();
  DirectServer(const DirectServer&) = delete;
  DirectServer& operator=(const DirectServer&) = delete;

  // Takes ownership of the connected socket `fd` and serves it. Returns false (and closes it)
  // when closed or at `max_conns`.
  bool adopt(int fd);
  int connections();
  uint64_t served() const { return served_.load(); }
  // Ends every connection and joins the threads. Idempotent.
  void close();

 private:
  struct Conn {
    int fd;
    std::thread thread;
    std::atomic<bool> done{false};
  };
  void serve(Conn* c);
  void reap_locked();

  std::shared_ptr<RegionMirror> mirror_;
  const std::string owner_;
  const int io_timeout_ms_;
  const int max_conns_;
  std::mutex mu_;
  std::vector<std::unique_ptr<Conn>> conns_;
  std::atomic<uint64_t> served_{0};
  bool closed_ = false;
};

// The initiator's end of one direct-lane connection. Not thread-safe: one request at a time,
// from the event loop's thread. Every call does only what the socket takes or has ready without
// blocking, waiting at most the `wait_s` it is given: a stalled or slow peer never holds the
// calling thread longer than that (the caller then waits for the socket in its event loop, as
// writing() says, and calls finish() again).
class DirectLane {
 public:
  enum Result : int {
    kDone = 0,      // the bytes are in place (a put: in the peer's region; a get: here)
    kPending = 1,   // not finished within the wait: call finish() when the socket is ready
    kRefused = 2,   // the peer refused it (message()); nothing was written
    kBroken = 3,    // the connection failed (message()); the lane is closed
  };
  explicit DirectLane(int fd);
  ~DirectLane();
  DirectLane(const DirectLane&) = delete;
  DirectLane& operator=(const DirectLane&) = delete;

  // Starts one request (a put's payload read from `local`; a get's reply lands at `local`, and
  // both must stay valid until it is done) and drives it for up to `wait_s`.
  int start(uint8_t op, const std::string& key, const std::string& dtype, uint64_t offset, uint64_t nbytes,
            uint64_t local, double wait_s);
  // Drives the pending request for up to `wait_s` more.
  int finish(double wait_s);
  bool pending() const { return state_ != kIdle; }
  // Whether the pending request still has bytes to send (wait for writable), else it waits for
  // its reply (wait for readable).
  bool writing() const { return state_ == kSending; }
  bool closed() const { return fd_ < 0; }
  int fd() const { return fd_; }
  const std::string& message() const { return message_; }
  void close();

 private:
  enum State { kIdle, kSending, kHead, kMessage, kData };
  int broken(const std::string& what);
  int advance(int64_t deadline_ms, bool spin);
  int send_step();                           // 0: all sent; EAGAIN; or an errno value
  int recv_step(char* buf, uint64_t n);      // 0: `n` bytes in (progress in got_); EAGAIN; errno
  int reply_head();                          // the reply header is in: check it, go on

  int fd_;
  uint64_t next_rid_ = 1;
  State state_ = kIdle;
  uint8_t op_ = 0;
  uint64_t rid_ = 0, nbytes_ = 0, local_ = 0;
  Request rq_{};
  std::string key_, dtype_;
  iovec iov_[4]{};
  int iov_first_ = 0;  // the first iov_ entry with bytes left to send
  Reply reply_{};
  uint64_t got_ = 0;  // bytes of the current piece received
  std::string message_;
};

}  // namespace transport::tcp
