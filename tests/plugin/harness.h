// The plugin harness: loads libnccl-net-ponte.so with dlopen and drives its tables the way NCCL's
// proxy thread does (non-blocking connect/accept loops, isend/irecv/test polling), with deadlines.
#pragma once

#include <dlfcn.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "plugin/nccl_net_abi.h"

#include "tests/common/loopback.h"
#include "tests/common/peer_process.h"

namespace ponte::plugin_test {

using namespace ponte::nccl_abi;
using Clock = std::chrono::steady_clock;

// Defaults for running on this machine: tcp;ofi_rxm over loopback. Anything already set in the
// environment wins (the SoftRoCE run sets PONTE_BACKEND=verbs).
inline void set_test_environment() {
  setenv("PONTE_BACKEND", "fabric", 0);
  setenv("PONTE_FABRIC_PROVIDER", "tcp;ofi_rxm", 0);
  ponte::test::keep_test_traffic_on_loopback();
  setenv("PONTE_CTRL_ADDR", "127.0.0.1", 0);
  setenv("PONTE_TIMEOUT_MS", "5000", 0);
}

inline std::string plugin_path() {
  const char* p = getenv("PONTE_PLUGIN_SO");
  return p && *p ? p : PONTE_PLUGIN_SO;
}

// ---- NCCL's logger, recorded --------------------------------------------------------------------

struct LogRecord {
  std::mutex mu;
  std::vector<std::string> lines;
  bool echo = getenv("PONTE_TEST_ECHO_LOG") != nullptr;
  // Whether a line logged (since line `from`) contains s.
  bool contains(const std::string& s, size_t from = 0) {
    std::lock_guard<std::mutex> lock(mu);
    for (size_t i = from; i < lines.size(); i++)
      if (lines[i].find(s) != std::string::npos) return true;
    return false;
  }
  size_t size() {
    std::lock_guard<std::mutex> lock(mu);
    return lines.size();
  }
  std::string first() {
    std::lock_guard<std::mutex> lock(mu);
    return lines.empty() ? std::string() : lines.front();
  }
};
inline LogRecord& log_record() {
  static LogRecord r;
  return r;
}
inline void test_logger(LogLevel level, unsigned long /*flags*/, const char* /*file*/, int /*line*/,
                        const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  auto& r = log_record();
  std::lock_guard<std::mutex> lock(r.mu);
  r.lines.emplace_back(buf);
  if (r.echo || level == kLogWarn) fprintf(stderr, "[nccl-log %d] %s\n", level, buf);
}

// ---- the loaded library -----------------------------------------------------------------------

struct Library {
  void* handle = nullptr;
  NetV11* v11 = nullptr;
  NetV10* v10 = nullptr;
  NetV9* v9 = nullptr;
  NetV8* v8 = nullptr;
  std::string error;

  Library() {
    // RTLD_NOW | RTLD_LOCAL, as NCCL opens it: every symbol must resolve now.
    handle = dlopen(plugin_path().c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!handle) {
      error = dlerror();
      return;
    }
    v11 = static_cast<NetV11*>(dlsym(handle, "ncclNetPlugin_v11"));
    v10 = static_cast<NetV10*>(dlsym(handle, "ncclNetPlugin_v10"));
    v9 = static_cast<NetV9*>(dlsym(handle, "ncclNetPlugin_v9"));
    v8 = static_cast<NetV8*>(dlsym(handle, "ncclNetPlugin_v8"));
  }
  ~Library() {
    if (handle) dlclose(handle);
  }
};

// One process-wide load, as NCCL keeps it (and as NCCL_NET_PLUGIN_REF_COUNT=1 makes 2.28.9 keep it).
inline Library& lib() {
  static Library* l = new Library;
  return *l;
}

// ---- driving the v11 table --------------------------------------------------------------------

constexpr auto kDeadline = std::chrono::seconds(60);

struct Handle {
  uint8_t bytes[kHandleMaxSize] = {};
};

// A v11 context (one "communicator").
class Net {
 public:
  explicit Net(NetV11* t = lib().v11, int traffic_class = kTrafficClassUndef) : t_(t) {
    config_.traffic_class = traffic_class;
    init_result = t_->init(&ctx_, 0x1234, &config_, &test_logger, nullptr);
  }
  ~Net() { t_->finalize(ctx_); }
  Net(const Net&) = delete;
  Net& operator=(const Net&) = delete;
  NetV11* operator->() const { return t_; }
  NetV11* table() const { return t_; }
  void* ctx() const { return ctx_; }
  int devices() const {
    int n = -1;
    return t_->devices(&n) == kSuccess ? n : -1;
  }
  NcclResult init_result = kInternalError;

 private:
  NetV11* t_;
  void* ctx_ = nullptr;
  CommConfig config_{kTrafficClassUndef};
};

// A connected pair: a send comm and a recv comm (possibly in one process, over one device).
struct Pair {
  void* send = nullptr;
  void* recv = nullptr;
  void* listen = nullptr;
};

// Listens on listen_dev and connects from connect_dev, calling connect and accept alternately
// (never blocking) as NCCL's proxy does. Returns the first failing result, or kSuccess.
inline NcclResult connect_pair(const Net& net, int listen_dev, int connect_dev, Pair* p,
                               bool keep_listen = false) {
  Handle h;
  NcclResult r = net->listen(net.ctx(), listen_dev, h.bytes, &p->listen);
  if (r != kSuccess) return r;
  DeviceHandle* dh = nullptr;
  const auto deadline = Clock::now() + kDeadline;
  while ((!p->send || !p->recv) && Clock::now() < deadline) {
    if (!p->send && (r = net->connect(net.ctx(), connect_dev, h.bytes, &p->send, &dh)) != kSuccess)
      break;
    if (!p->recv && (r = net->accept(p->listen, &p->recv, &dh)) != kSuccess) break;
    std::this_thread::yield();
  }
  if (!keep_listen) {
    net->close_listen(p->listen);
    p->listen = nullptr;
  }
  if (r != kSuccess) return r;
  return p->send && p->recv ? kSuccess : kInternalError;
}

// One side of a two-process pair: calls connect (or accept) until NCCL's non-blocking handshake
// yields the comm, an error, or the deadline (kInternalError: counts as a hang).
inline NcclResult connect_comm(const Net& net, int dev, void* handle, void** send) {
  DeviceHandle* dh = nullptr;
  const auto deadline = Clock::now() + kDeadline;
  *send = nullptr;
  while (!*send && Clock::now() < deadline) {
    NcclResult r = net->connect(net.ctx(), dev, handle, send, &dh);
    if (r != kSuccess) return r;
  }
  return *send ? kSuccess : kInternalError;
}
inline NcclResult accept_comm(const Net& net, void* listen, void** recv) {
  DeviceHandle* dh = nullptr;
  const auto deadline = Clock::now() + kDeadline;
  *recv = nullptr;
  while (!*recv && Clock::now() < deadline) {
    NcclResult r = net->accept(listen, recv, &dh);
    if (r != kSuccess) return r;
  }
  return *recv ? kSuccess : kInternalError;
}

inline void close_pair(const Net& net, Pair* p) {
  if (p->send) net->close_send(p->send);
  if (p->recv) net->close_recv(p->recv);
  if (p->listen) net->close_listen(p->listen);
  *p = Pair{};
}

// Polls test() until done, an error, or the deadline. sizes gets n entries.
inline NcclResult wait_request(const Net& net, void* req, int* sizes,
                               std::chrono::milliseconds limit = std::chrono::seconds(60)) {
  const auto deadline = Clock::now() + limit;
  int done = 0;
  while (Clock::now() < deadline) {
    NcclResult r = net->test(req, &done, sizes);
    if (r != kSuccess) return r;
    if (done) return kSuccess;
    std::this_thread::yield();
  }
  return kInternalError;  // the harness's own deadline: counts as a hang
}

// Whether a post on a comm the other end aborted was refused without being written: isend failed,
// or it handed out a request already failed (the plugin reports a broken comm at test(), as NCCL's
// own transports do) whose first test() fails. A request still in flight at its first test() was
// written.
inline bool refused_at_once(const Net& net, NcclResult posted, void* req) {
  if (posted != kSuccess) return true;
  if (!req) return false;
  int done = 0;
  return net->test(req, &done, nullptr) != kSuccess;
}

// Calls isend until it returns a request (the receiver has posted), an error or the deadline.
inline NcclResult post_send(const Net& net, void* comm, void* data, size_t size, int tag,
                            void* mh, void** req) {
  const auto deadline = Clock::now() + kDeadline;
  *req = nullptr;
  while (!*req && Clock::now() < deadline) {
    NcclResult r = net->isend(comm, data, size, tag, mh, nullptr, req);
    if (r != kSuccess) return r;
    if (!*req) std::this_thread::yield();
  }
  return *req ? kSuccess : kInternalError;
}

inline NcclResult post_recv(const Net& net, void* comm, int n, void** data, size_t* sizes,
                            int* tags, void** mhs, void** req) {
  const auto deadline = Clock::now() + kDeadline;
  *req = nullptr;
  while (!*req && Clock::now() < deadline) {
    NcclResult r = net->irecv(comm, n, data, sizes, tags, mhs, nullptr, req);
    if (r != kSuccess) return r;
    if (!*req) std::this_thread::yield();
  }
  return *req ? kSuccess : kInternalError;
}

// ---- data patterns ----------------------------------------------------------------------------

inline uint8_t pattern_byte(uint32_t seed, size_t i) {
  return static_cast<uint8_t>((seed * 2654435761u) >> 24 ^ (i * 131) ^ (i >> 11));
}
inline void fill(uint8_t* p, size_t n, uint32_t seed) {
  for (size_t i = 0; i < n; ++i) p[i] = pattern_byte(seed, i);
}
// First mismatching index, or SIZE_MAX when p holds the pattern.
inline size_t mismatch(const uint8_t* p, size_t n, uint32_t seed) {
  for (size_t i = 0; i < n; ++i)
    if (p[i] != pattern_byte(seed, i)) return i;
  return SIZE_MAX;
}

// Page-aligned host buffer registered with a comm for its lifetime.
class Buffer {
 public:
  Buffer(const Net& net, void* comm, size_t size, size_t slack = 64)
      : net_(net), comm_(comm), size_(size) {
    const size_t len = (size + slack + 4095) / 4096 * 4096;
    ptr_ = static_cast<uint8_t*>(std::aligned_alloc(4096, len));
    std::memset(ptr_, 0, len);
    result = net_->reg_mr(comm_, ptr_, size ? size : 1, kPtrHost, &mh_);
  }
  ~Buffer() {
    if (mh_) net_->dereg_mr(comm_, mh_);
    std::free(ptr_);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  uint8_t* data() const { return ptr_; }
  void* mh() const { return mh_; }
  size_t size() const { return size_; }
  NcclResult result = kInternalError;

 private:
  const Net& net_;
  void* comm_;
  size_t size_;
  uint8_t* ptr_ = nullptr;
  void* mh_ = nullptr;
};

// ---- a second process -------------------------------------------------------------------------

// A second process and the channel to it: tests/common/peer_process.h, shared with tests/engine.
using Channel = ponte::test::Channel;
using Peer = ponte::test::PeerProcess;

}  // namespace ponte::plugin_test
