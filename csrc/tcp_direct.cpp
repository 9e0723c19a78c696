#include "tcp_direct.h"

#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <ratio>
#include <stdexcept>

namespace transport::tcp {

namespace {

using Clock = std::chrono::steady_clock;

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now().time_since_epoch()).count();
}

// Milliseconds left until `deadline` (a now_ms() value; -1: none), for poll().
int left_ms(int64_t deadline) {
  if (deadline < 0) return -1;
  return static_cast<int>(std::max<int64_t>(0, deadline - now_ms()));
}

// How long a waiting thread polls before it sleeps. On a VM, waking a sleeping thread on an idle
// vCPU can cost 50-100 us; a request-reply round trip is a few microseconds of work.
constexpr int64_t kSpinNs = 100'000;

// Waits until `fd` has `events`, first polling without sleeping for up to kSpinNs (when `spin`);
// 0, ETIMEDOUT, or an errno value.
int wait_fd(int fd, short events, int64_t deadline, bool spin = false) {
  if (spin) {
    const auto until = Clock::now() + std::chrono::nanoseconds(kSpinNs);
    do {
      pollfd p{fd, events, 0};
      int r = ::poll(&p, 1, 0);
      if (r > 0) return 0;
      if (r < 0 && errno != EINTR) return errno;
    } while (Clock::now() < until);
  }
  for (;;) {
    pollfd p{fd, events, 0};
    int r = ::poll(&p, 1, left_ms(deadline));
    if (r > 0) return 0;  // readable, writable, or an error / hang-up the next call reports
    if (r == 0) return ETIMEDOUT;
    if (errno != EINTR) return errno;
  }
}

// Receives exactly `n` bytes by `deadline`: 0, ETIMEDOUT, ECONNRESET (end of stream) or errno.
int recv_exact(int fd, void* buf, uint64_t n, int64_t deadline) {
  auto* p = static_cast<char*>(buf);
  while (n > 0) {
    ssize_t r = ::recv(fd, p, static_cast<size_t>(std::min<uint64_t>(n, 1ull << 30)), MSG_DONTWAIT);
    if (r > 0) {
      p += r;
      n -= static_cast<uint64_t>(r);
    } else if (r == 0) {
      return ECONNRESET;
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (int e = wait_fd(fd, POLLIN, deadline)) return e;
    } else if (errno != EINTR) {
      return errno;
    }
  }
  return 0;
}

// Reads and drops `n` bytes by `deadline`.
int discard(int fd, uint64_t n, int64_t deadline) {
  char sink[64 << 10];
  while (n > 0) {
    uint64_t part = std::min<uint64_t>(n, sizeof sink);
    if (int e = recv_exact(fd, sink, part, deadline)) return e;
    n -= part;
  }
  return 0;
}

// Sends every byte of `iov` (modified) by `deadline`: 0, ETIMEDOUT or an errno value.
int send_all(int fd, iovec* iov, int count, int64_t deadline) {
  while (count > 0) {
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(count);
    ssize_t r = ::sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (r < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        if (int e = wait_fd(fd, POLLOUT, deadline)) return e;
        continue;
      }
      if (errno == EINTR) continue;
      return errno;
    }
    auto sent = static_cast<size_t>(r);
    while (count > 0 && sent >= iov->iov_len) {
      sent -= iov->iov_len;
      ++iov;
      --count;
    }
    if (count > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + sent;
      iov->iov_len -= sent;
    }
  }
  return 0;
}

int send_reply(int fd, uint64_t rid, uint16_t status, const std::string& msg, const void* payload, uint64_t nbytes,
               int64_t deadline) {
  Reply r{kReplyMagic, status, static_cast<uint16_t>(std::min(msg.size(), kMaxMessage)), rid, nbytes};
  iovec iov[3] = {{&r, sizeof r}, {const_cast<char*>(msg.data()), r.msg_len}, {const_cast<void*>(payload), nbytes}};
  return send_all(fd, iov, 3, deadline);
}

}  // namespace

// -- the mirror --------------------------------------------------------------------------------

void RegionMirror::set(const std::string& key, uint64_t address, uint64_t nbytes, uint32_t itemsize, bool writable,
                       const std::string& dtype) {
  auto e = std::make_shared<Entry>();
  e->address = address;
  e->nbytes = nbytes;
  e->itemsize = std::max<uint32_t>(itemsize, 1);
  e->writable = writable;
  e->dtype = dtype;
  std::lock_guard<std::mutex> lock(mu_);
  live_[key] = std::move(e);
}

bool RegionMirror::remove(const std::string& key, uint64_t token) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(key);
  if (it == live_.end()) return false;
  std::shared_ptr<Entry> e = std::move(it->second);
  live_.erase(it);
  if (e->busy.load() == 0) return false;
  e->token = token;
  retired_.push_back(std::move(e));
  return true;
}

void RegionMirror::mark_moved(const std::string& key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(key);
  if (it != live_.end()) it->second->moved.store(true);
}

std::vector<uint64_t> RegionMirror::released() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<uint64_t> out;
  auto keep = std::remove_if(retired_.begin(), retired_.end(), [&](const std::shared_ptr<Entry>& e) {
    if (e->busy.load() != 0) return false;
    out.push_back(e->token);
    return true;
  });
  retired_.erase(keep, retired_.end());
  return out;
}

void RegionMirror::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  live_.clear();
}

std::shared_ptr<RegionMirror::Entry> RegionMirror::acquire(const std::string& key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(key);
  if (it == live_.end()) return nullptr;
  it->second->busy.fetch_add(1);
  return it->second;
}

size_t RegionMirror::size() {
  std::lock_guard<std::mutex> lock(mu_);
  return live_.size();
}

// -- the server --------------------------------------------------------------------------------

DirectServer::DirectServer(std::shared_ptr<RegionMirror> mirror, std::string owner, double io_timeout_s, int max_conns)
    : mirror_(std::move(mirror)),
      owner_(std::move(owner)),
      io_timeout_ms_(static_cast<int>(std::clamp(io_timeout_s, 0.001, 86400.0) * 1000)),
      max_conns_(std::max(max_conns, 1)) {}

DirectServer::~DirectServer() { close(); }

void DirectServer::reap_locked() {
  auto keep = std::remove_if(conns_.begin(), conns_.end(), [](std::unique_ptr<Conn>& c) {
    if (!c->done.load()) return false;
    c->thread.join();
    return true;
  });
  conns_.erase(keep, conns_.end());
}

bool DirectServer::adopt(int fd) {
  std::lock_guard<std::mutex> lock(mu_);
  reap_locked();
  if (closed_ || static_cast<int>(conns_.size()) >= max_conns_) {
    ::close(fd);
    return false;
  }
  auto c = std::make_unique<Conn>();
  c->fd = fd;
  Conn* raw = c.get();
  conns_.push_back(std::move(c));
  raw->thread = std::thread([this, raw] { serve(raw); });
  return true;
}

int DirectServer::connections() {
  std::lock_guard<std::mutex> lock(mu_);
  reap_locked();
  return static_cast<int>(conns_.size());
}

void DirectServer::close() {
  std::vector<std::unique_ptr<Conn>> conns;
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    for (auto& c : conns_)
      if (!c->done.load()) ::shutdown(c->fd, SHUT_RDWR);  // its thread closes the fd, under mu_
    conns.swap(conns_);
  }
  for (auto& c : conns) c->thread.join();
}

void DirectServer::serve(Conn* c) {
  const int fd = c->fd;
  std::string key, dtype, why;
  for (;;) {
    if (wait_fd(fd, POLLIN, -1, true) != 0) break;  // idle between requests: no deadline
    const int64_t deadline = now_ms() + io_timeout_ms_;
    Request rq;
    if (recv_exact(fd, &rq, sizeof rq, deadline) != 0) break;
    // A malformed request ends this connection: we cannot know where the next one starts.
    if (rq.magic != kRequestMagic || (rq.op != kPut && rq.op != kGet) || rq.key_len == 0 || rq.dtype_len == 0 ||
        rq.dtype_len > kMaxDtype)
      break;
    key.resize(rq.key_len);
    dtype.resize(rq.dtype_len);
    if (recv_exact(fd, key.data(), key.size(), deadline) != 0 || recv_exact(fd, dtype.data(), dtype.size(), deadline) != 0)
      break;
    const bool put = rq.op == kPut;
    RegionMirror::Use region(mirror_->acquire(key));
    uint16_t status = kOk;
    if (!region) {
      status = kNoRegion;
      why = owner_ + " has no region '" + key + "'";
    } else if (dtype != region->dtype) {
      status = kDtype;
      why = "the data is " + dtype + " but the region is " + region->dtype;
    } else if (rq.offset > region->nbytes || rq.nbytes > region->nbytes - rq.offset) {
      status = kBounds;
      why = "exceeds its " + std::to_string(region->nbytes) + " bytes";
    } else if (rq.offset % region->itemsize) {
      status = kBounds;
      why = "offset is not a multiple of the " + region->dtype + " element size " + std::to_string(region->itemsize);
    } else if (put && !region->writable) {
      status = kReadOnly;
      why = owner_ + ":'" + key + "' is read-only";
    } else if (region->moved.load()) {
      status = kMoved;
      why = "the tensor registered as '" + key + "' was given new storage after registration: register it again";
    }
    if (status != kOk) {
      std::string msg = std::string(put ? "put" : "get") + " of " + std::to_string(rq.nbytes) + " bytes at offset " +
                        std::to_string(rq.offset) + " of " + owner_ + ":'" + key + "': " + why;
      if (put && rq.nbytes > kMaxDiscard) {  // refuse, then end: dropping it would take too long
        send_reply(fd, rq.rid, status, msg, nullptr, 0, deadline);
        break;
      }
      if (put && discard(fd, rq.nbytes, deadline) != 0) break;
      if (send_reply(fd, rq.rid, status, msg, nullptr, 0, deadline) != 0) break;
      continue;
    }
    char* bytes = reinterpret_cast<char*>(region->address) + rq.offset;
    if (put) {
      if (recv_exact(fd, bytes, rq.nbytes, deadline) != 0) break;
      if (send_reply(fd, rq.rid, kOk, "", nullptr, 0, deadline) != 0) break;
    } else if (send_reply(fd, rq.rid, kOk, "", bytes, rq.nbytes, deadline) != 0) {
      break;
    }
    served_.fetch_add(1);
  }
  std::lock_guard<std::mutex> lock(mu_);
  ::close(fd);
  c->done.store(true);
}

// -- the initiator's lane ----------------------------------------------------------------------

DirectLane::DirectLane(int fd) : fd_(fd) {}

DirectLane::~DirectLane() { close(); }

void DirectLane::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  state_ = kIdle;
}

int DirectLane::broken(const std::string& what) {
  message_ = what;
  close();
  return kBroken;
}

int DirectLane::start(uint8_t op, const std::string& key, const std::string& dtype, uint64_t offset, uint64_t nbytes,
                      uint64_t local, double wait_s) {
  if (fd_ < 0) return broken("the direct lane is closed");
  if (state_ != kIdle) return broken("a request is still pending on the direct lane");
  if ((op != kPut && op != kGet) || key.empty() || key.size() > kMaxKey || dtype.empty() || dtype.size() > kMaxDtype)
    throw std::invalid_argument("bad direct-lane request");
  key_ = key;
  dtype_ = dtype;
  rq_ = Request{kRequestMagic, op, static_cast<uint8_t>(key_.size()), static_cast<uint8_t>(dtype_.size()), 0,
                next_rid_++, offset, nbytes};
  iov_[0] = {&rq_, sizeof rq_};
  iov_[1] = {key_.data(), key_.size()};
  iov_[2] = {dtype_.data(), dtype_.size()};
  iov_[3] = {reinterpret_cast<void*>(local), op == kPut ? nbytes : 0};
  iov_first_ = 0;
  op_ = op;
  rid_ = rq_.rid;
  nbytes_ = nbytes;
  local_ = local;
  state_ = kSending;
  const int wait_ms = static_cast<int>(std::clamp(wait_s, 0.0, 86400.0) * 1000);
  return advance(now_ms() + wait_ms, wait_ms > 0);
}

int DirectLane::finish(double wait_s) {
  if (fd_ < 0) return broken("the direct lane is closed");
  if (state_ == kIdle) return broken("no request is pending on the direct lane");
  const int wait_ms = static_cast<int>(std::clamp(wait_s, 0.0, 86400.0) * 1000);
  return advance(now_ms() + wait_ms, wait_ms > 0);
}

int DirectLane::send_step() {
  while (iov_first_ < 4) {
    msghdr msg{};
    msg.msg_iov = iov_ + iov_first_;
    msg.msg_iovlen = static_cast<size_t>(4 - iov_first_);
    ssize_t r = ::sendmsg(fd_, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (r < 0) {
      if (errno == EINTR) continue;
      return errno == EWOULDBLOCK ? EAGAIN : errno;
    }
    auto sent = static_cast<size_t>(r);
    while (iov_first_ < 4 && sent >= iov_[iov_first_].iov_len) {
      sent -= iov_[iov_first_].iov_len;
      iov_[iov_first_++].iov_len = 0;
    }
    if (iov_first_ < 4) {
      iov_[iov_first_].iov_base = static_cast<char*>(iov_[iov_first_].iov_base) + sent;
      iov_[iov_first_].iov_len -= sent;
    }
  }
  return 0;
}

int DirectLane::recv_step(char* buf, uint64_t n) {
  while (got_ < n) {
    ssize_t r = ::recv(fd_, buf + got_, static_cast<size_t>(std::min<uint64_t>(n - got_, 1ull << 30)), MSG_DONTWAIT);
    if (r > 0) {
      got_ += static_cast<uint64_t>(r);
    } else if (r == 0) {
      return ECONNRESET;
    } else if (errno != EINTR) {
      return errno == EWOULDBLOCK ? EAGAIN : errno;
    }
  }
  got_ = 0;
  return 0;
}

int DirectLane::reply_head() {
  const Reply& r = reply_;
  if (r.magic != kReplyMagic || r.rid != rid_ || r.msg_len > kMaxMessage ||
      (r.status == kOk && r.nbytes != (op_ == kGet ? nbytes_ : 0)) || (r.status != kOk && r.nbytes != 0))
    return broken("the peer sent a malformed reply");
  message_.assign(r.msg_len, '\0');
  state_ = kMessage;
  return -1;  // go on
}

int DirectLane::advance(int64_t deadline_ms, bool spin) {
  for (;;) {
    int e = 0;
    short want = POLLIN;
    switch (state_) {
      case kIdle:
        return kDone;
      case kSending:
        want = POLLOUT;
        if ((e = send_step()) == 0) state_ = kHead;
        break;
      case kHead:
        if ((e = recv_step(reinterpret_cast<char*>(&reply_), sizeof reply_)) == 0) {
          if (int r = reply_head(); r >= 0) return r;
        }
        break;
      case kMessage:
        if ((e = recv_step(message_.data(), message_.size())) == 0)
          state_ = reply_.status == kOk && reply_.nbytes ? kData : kIdle;
        if (e == 0 && state_ == kIdle) return reply_.status == kOk ? kDone : kRefused;
        break;
      case kData:
        if ((e = recv_step(reinterpret_cast<char*>(local_), reply_.nbytes)) == 0) {
          state_ = kIdle;
          return kDone;
        }
        break;
    }
    if (e == 0) continue;
    if (e != EAGAIN) {
      const bool sending = state_ == kSending;
      if (e == ECONNRESET && !sending) return broken("the peer closed the connection");
      return broken(std::string(sending ? "sending the request failed: " : "reading the reply failed: ") +
                    std::strerror(e));
    }
    if (int w = wait_fd(fd_, want, deadline_ms, spin)) {
      if (w == ETIMEDOUT) return kPending;
      return broken(std::string("waiting on the direct lane failed: ") + std::strerror(w));
    }
  }
}

}  // namespace transport::tcp
