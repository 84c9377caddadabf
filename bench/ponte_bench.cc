// ponte-bench: moves data through ponte's Engine between two processes (forked on loopback, or two
// hosts), verifies it byte for byte, then prints a perftest-style bandwidth / latency / CPU table.
//
// The client drives every test over an out-of-band channel (a socketpair on loopback, a TCP socket
// across hosts); the target only arms immediate counters and answers. Transfers run callback-driven
// on the engine's worker (each completion submits the next write), so the measuring threads sleep.
// Every wait is bounded (--timeout); a dead peer or a failed verification ends with exit status 1.
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/config.h"
#include "core/engine.h"
#include "core/notify.h"
#include "core/remote_region.h"
#include "core/status.h"
#include "ponte_version.h"

namespace {

using ponte::Code;
using ponte::Engine;
using ponte::LocalSlice;
using ponte::MemoryRegion;
using ponte::Notify;
using ponte::PeerId;
using ponte::RemoteRegion;
using ponte::Status;

enum OpKind : uint32_t { kOpWrite = 0, kOpWriteImm = 1, kOpSend = 2, kOpLat = 3 };
const char* const kOpNames[] = {"write", "write-imm", "send", "lat"};

constexpr uint32_t kMagic = 0x706f6e74;  // "pont"
constexpr uint32_t kProtocolVersion = 2;
constexpr int kDefaultPort = 18515;

// Immediate values: 0xB5 in the top byte, what the immediate is for, then the test's number.
constexpr uint32_t kImmVerify = 0xB5010000u;
constexpr uint32_t kImmData = 0xB5020000u;
constexpr uint32_t kImmDone = 0xB5030000u;
constexpr uint32_t kImmPing = 0xB5040000u;
constexpr uint32_t kImmPong = 0xB5050000u;

struct Options {
  std::string backend;   // empty: PONTE_BACKEND / auto
  std::string provider;  // empty: PONTE_FABRIC_PROVIDER, or tcp;ofi_rxm on loopback
  std::vector<OpKind> ops{kOpWriteImm, kOpLat};
  std::vector<size_t> sizes{64, 64 << 10, 1 << 20, 8 << 20};
  bool sizes_given = false;
  int window = 16;
  int slots = 1;  // bandwidth rows: operation k uses slot k % slots of both buffers (--slots)
  int nics = 1;
  long iters = 0;  // 0: chosen per size
  bool json = false;
  int timeout_s = 60;
  enum Mode { kLoopback, kServer, kClient } mode = kLoopback;
  std::string host;
  int port = kDefaultPort;
  int initiator_core = -1, target_core = -1;  // --worker-cores: each end's engine worker; -1: not pinned
};

struct Row {
  OpKind op;
  size_t size;
  long iters;
  int window;
  double gbps = 0, mops = 0, lat_us = 0;
  double cpu_ns_per_op = -1;   // the submitting thread's CPU time inside submit calls, per op
  double proc_ns_per_op = -1;  // the process's CPU (worker + provider + submit) per op
};

// ---------------------------------------------------------------------------------------------
// Errors, time.

const char* g_role = "ponte-bench";
int g_timeout_s = 60;
pid_t g_child = -1;

// Describes how the forked target ended, when it did.
std::string child_state() {
  if (g_child <= 0) return "";
  int status = 0;
  pid_t r = 0;
  for (int i = 0; i < 50 && (r = waitpid(g_child, &status, WNOHANG)) == 0; i++) usleep(10 * 1000);
  if (r != g_child) return "";
  g_child = -1;
  char text[96];
  if (WIFSIGNALED(status))
    snprintf(text, sizeof(text), " (the target process was killed by signal %d)", WTERMSIG(status));
  else
    snprintf(text, sizeof(text), " (the target process exited with status %d)", WEXITSTATUS(status));
  return text;
}

// Ends the process at once: outstanding transfers may still point at this thread's stack, so no
// destructors run.
[[noreturn]] __attribute__((format(printf, 1, 2))) void die(const char* fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  fprintf(stderr, "%s: %s%s\n", g_role, msg, child_state().c_str());
  fflush(stdout);
  fflush(stderr);
  if (g_child > 0) kill(g_child, SIGKILL);
  _exit(1);
}

// The last line of defence: a call into the engine that never returns. Every wait of ours is
// bounded by --timeout; the watchdog, re-armed per test, allows several of them.
extern "C" void on_watchdog(int) {
  static const char msg[] = "ponte-bench: watchdog: a test made no progress for 4 timeouts; giving up\n";
  ssize_t n = write(2, msg, sizeof(msg) - 1);
  (void)n;
  if (g_child > 0) kill(g_child, SIGKILL);
  _exit(1);
}

void arm_watchdog() { alarm(static_cast<unsigned>(4 * g_timeout_s + 30)); }

void check(const Status& st, const char* what) {
  if (!st.ok()) die("%s: %s: %s", what, ponte::code_name(st.code()), st.message());
}

int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

int64_t cpu_ns(clockid_t clk) {
  timespec ts;
  clock_gettime(clk, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

void nap(long us = 100) {
  timespec ts{0, us * 1000};
  nanosleep(&ts, nullptr);
}

// Naps that grow from 20 us to 1 ms: a waiting main thread must not keep waking on the core a
// worker is measuring on (rows are timed by the worker's callbacks, not by these waits).
struct Backoff {
  long us = 20;
  void operator()() {
    nap(us);
    us = us < 1000 ? us * 2 : 1000;
  }
  void reset() { us = 20; }
};

// Sleeps until pred() holds; dies naming `what` after the timeout.
template <typename Pred>
void wait_until(Pred pred, const char* what) {
  const int64_t deadline = now_ns() + int64_t{g_timeout_s} * 1000000000;
  Backoff backoff;
  while (!pred()) {
    if (now_ns() > deadline) die("timed out after %d s waiting for %s", g_timeout_s, what);
    backoff();
  }
}

// The verification pattern: depends on the byte's offset and the test, so misplaced or stale
// bytes are caught. The same function as fabric-ref's.
inline uint8_t pattern_byte(size_t i, uint64_t seed) {
  uint64_t x = uint64_t{i} * 0x9E3779B97F4A7C15ull + seed * 0xD1B54A32D192ED03ull;
  return static_cast<uint8_t>(x >> 56);
}

// ---------------------------------------------------------------------------------------------
// The out-of-band channel: fixed control messages and length-prefixed blobs.

struct Ctrl {
  uint32_t kind = 0;  // 'H' hello, 'V' verify, 'M' measure, 'C' cpu, 'L' latency, 'Q' quit,
                      // 'R' ready, 'D' done, 'E' error
  uint32_t op = 0;
  uint64_t size = 0;
  uint64_t count = 0;  // operations
  uint64_t imms = 0;   // immediates the target should expect
  uint64_t seed = 0;
  uint32_t imm = 0;
  uint32_t pad = 0;
  uint64_t offset = 0;  // 'V' of a write: where in both buffers (the last slot with --slots)
  char text[128] = {};
};

class Channel {
 public:
  explicit Channel(int fd) : fd_(fd) {}
  ~Channel() {
    if (fd_ >= 0) close(fd_);
  }
  void write_all(const void* data, size_t len) {
    auto* p = static_cast<const char*>(data);
    while (len > 0) {
      ssize_t n = send(fd_, p, len, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) die("out-of-band send failed: %s", strerror(errno));
      p += n;
      len -= static_cast<size_t>(n);
    }
  }
  void read_all(void* data, size_t len, const char* what) {
    auto* p = static_cast<char*>(data);
    const int64_t deadline = now_ns() + int64_t{g_timeout_s} * 1000000000;
    while (len > 0) {
      int64_t left_ms = (deadline - now_ns()) / 1000000;
      if (left_ms <= 0) die("timed out after %d s waiting for the peer's %s", g_timeout_s, what);
      pollfd pfd{fd_, POLLIN, 0};
      int r = poll(&pfd, 1, static_cast<int>(left_ms < 200 ? left_ms : 200));
      if (r < 0 && errno != EINTR) die("poll: %s", strerror(errno));
      if (r <= 0) continue;
      ssize_t n = recv(fd_, p, len, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n == 0) die("the peer closed the out-of-band channel while we waited for its %s", what);
      if (n < 0) die("out-of-band recv failed: %s", strerror(errno));
      p += n;
      len -= static_cast<size_t>(n);
    }
  }
  void send_ctrl(const Ctrl& c) { write_all(&c, sizeof(c)); }
  Ctrl recv_ctrl(const char* what) {
    Ctrl c;
    read_all(&c, sizeof(c), what);
    c.text[sizeof(c.text) - 1] = 0;
    return c;
  }
  void send_reply(uint32_t kind, const char* text = "") {
    Ctrl c;
    c.kind = kind;
    snprintf(c.text, sizeof(c.text), "%s", text);
    send_ctrl(c);
  }
  void send_blob(const std::vector<uint8_t>& b) {
    uint32_t n = static_cast<uint32_t>(b.size());
    write_all(&n, sizeof(n));
    write_all(b.data(), b.size());
  }
  std::vector<uint8_t> recv_blob(const char* what) {
    uint32_t n = 0;
    read_all(&n, sizeof(n), what);
    if (n > (1u << 20)) die("the peer's %s is %u bytes long: not a ponte-bench peer?", what, n);
    std::vector<uint8_t> b(n);
    read_all(b.data(), n, what);
    return b;
  }

 private:
  int fd_;
};

// ---------------------------------------------------------------------------------------------
// The engine side of both roles.

struct Bench {
  std::unique_ptr<Engine> engine;
  MemoryRegion mr;
  uint8_t* buf = nullptr;
  size_t buf_len = 0;
  PeerId peer = 0;
  RemoteRegion peer_region;
};

// target: the end that is written to (the forked peer, or --server).
std::unique_ptr<Engine> make_engine(const Options& o, bool target) {
  auto cfg = ponte::Config::from_env();
  check(cfg.status(), "configuration");
  ponte::EngineOptions eo;
  eo.config = cfg.value();
  if (const int core = target ? o.target_core : o.initiator_core; core >= 0) eo.group_cores = {{core}};
  if (o.mode == Options::kLoopback) {
    // One process per end on one host: the same device opened `nics` times stands for N NICs.
    eo.groups = {std::vector<size_t>(static_cast<size_t>(o.nics), 0)};
  } else {
    eo.config.nics_per_group = o.nics;
  }
  auto e = Engine::create(eo);
  check(e.status(), "Engine::create");
  if (e.value()->nics_in_group(0) != o.nics)
    die("the group has %d NICs, --nics asked for %d", e.value()->nics_in_group(0), o.nics);
  return std::move(e).value();
}

void setup_memory(Bench& b, size_t max_size) {
  b.buf_len = max_size < 4096 ? 4096 : max_size;
  size_t alloc = (b.buf_len + 4095) / 4096 * 4096;
  b.buf = static_cast<uint8_t*>(aligned_alloc(4096, alloc));
  if (!b.buf) die("cannot allocate %zu bytes", alloc);
  memset(b.buf, 0, alloc);
  auto mr = b.engine->register_memory(0, b.buf, b.buf_len);
  check(mr.status(), "register_memory");
  b.mr = std::move(mr).value();
}

// Addresses and memory descriptors both ways.
void exchange(Bench& b, Channel& ch, std::vector<uint8_t>* peer_address) {
  ch.send_blob(b.engine->address(0));
  ch.send_blob(b.mr.remote().encode());
  *peer_address = ch.recv_blob("engine address");
  auto region_bytes = ch.recv_blob("memory descriptor");
  auto region = RemoteRegion::decode(region_bytes);
  check(region.status(), "decoding the peer's memory descriptor");
  b.peer_region = region.value();
}

// An operation's completion, counted; errors remembered (first one wins).
struct Counter {
  std::atomic<uint64_t> done{0};
  std::atomic<int> failed{0};
  void record(const Status& st) {
    if (!st.ok() && failed.fetch_add(1) == 0) {
      snprintf(error_, sizeof(error_), "%s: %s", ponte::code_name(st.code()), st.message());
      error_set_.store(true, std::memory_order_release);
    }
  }
  // The first error's text (call once failed != 0; waits the moment it takes to be written).
  const char* error() const {
    for (int i = 0; i < 1000 && !error_set_.load(std::memory_order_acquire); i++) usleep(1000);
    return error_set_.load(std::memory_order_acquire) ? error_ : "(error text not available)";
  }
  static void fire(void* arg, const Status& st) {
    auto* c = static_cast<Counter*>(arg);
    c->record(st);
    c->done.fetch_add(1, std::memory_order_release);
  }
  Notify notify() { return Notify{&Counter::fire, this}; }

 private:
  char error_[160] = {};
  std::atomic<bool> error_set_{false};
};

// ---------------------------------------------------------------------------------------------
// Target.

struct RecvState {
  std::atomic<uint64_t> count{0};
  std::atomic<uint64_t> verify_size{0};  // nonzero: check messages against the pattern
  std::atomic<uint64_t> verify_seed{0};
  std::atomic<int> bad{0};
  char bad_text[128] = {};
};

void on_recv(void* arg, PeerId, std::span<const uint8_t> data) {
  auto* r = static_cast<RecvState*>(arg);
  uint64_t vsize = r->verify_size.load(std::memory_order_acquire);
  if (vsize) {
    uint64_t seed = r->verify_seed.load(std::memory_order_relaxed);
    if (data.size() != vsize && r->bad.fetch_add(1) == 0)
      snprintf(r->bad_text, sizeof(r->bad_text), "message of %zu bytes, expected %" PRIu64, data.size(), vsize);
    for (size_t i = 0; i < data.size() && i < vsize; i++) {
      if (data[i] != pattern_byte(i, seed)) {
        if (r->bad.fetch_add(1) == 0)
          snprintf(r->bad_text, sizeof(r->bad_text), "byte %zu of %" PRIu64 " is 0x%02x, expected 0x%02x", i,
                   vsize, data[i], pattern_byte(i, seed));
        break;
      }
    }
  }
  r->count.fetch_add(1, std::memory_order_release);
}

// The latency test's answering side: every ping's immediate re-arms the counter and writes back.
struct PingPong {
  Engine* engine = nullptr;
  PeerId peer = 0;
  LocalSlice src;
  const RemoteRegion* dst = nullptr;
  uint32_t wait_value = 0;   // the immediate we wait for
  uint32_t send_value = 0;   // the immediate we answer with
  uint64_t total = 0;        // round trips
  uint64_t warmup = 0;       // round trips before the clock starts (client)
  bool client = false;
  std::atomic<uint64_t> seen{0};
  std::atomic<int64_t> t_start{0}, t_end{0};
  std::atomic<bool> finished{false};
  Counter writes;
  std::atomic<int> failed{0};
  char error[160] = {};
  uint32_t timeout_ms = 0;
  uint32_t imms = 1;         // immediates per write of this size: a striped write carries one per shard

  void fail(const char* what, const Status& st) {
    if (failed.fetch_add(1) == 0)
      snprintf(error, sizeof(error), "%s: %s: %s", what, ponte::code_name(st.code()), st.message());
    finished.store(true, std::memory_order_release);
  }
  Status arm() {
    return engine->expect_imm(0, wait_value, imms, peer, Notify{&PingPong::on_imm, this}, timeout_ms);
  }
  Status shoot() { return engine->write_imm(0, peer, src, *dst, 0, send_value, writes.notify()); }
  static void on_imm(void* arg, const Status& st) {
    auto* p = static_cast<PingPong*>(arg);
    if (!st.ok()) return p->fail("waiting for the peer's immediate", st);
    uint64_t n = p->seen.fetch_add(1, std::memory_order_relaxed) + 1;
    if (p->client && n == p->warmup) p->t_start.store(now_ns(), std::memory_order_relaxed);
    const bool more = n < p->total;
    if (more) {
      Status a = p->arm();
      if (!a.ok()) return p->fail("expect_imm", a);
    }
    if (!p->client || more) {
      Status w = p->shoot();
      if (!w.ok()) return p->fail("write_imm", w);
    }
    if (!more) {
      p->t_end.store(now_ns(), std::memory_order_relaxed);
      p->finished.store(true, std::memory_order_release);
    }
  }
};

void run_target(Channel& ch, const Options& o) {
  Ctrl hello = ch.recv_ctrl("hello");
  if (hello.kind != 'H' || hello.count != kMagic || hello.imm != kProtocolVersion)
    die("the client is not a ponte-bench of this version");
  Bench b;
  b.engine = make_engine(o, /*target=*/true);
  setup_memory(b, hello.size);
  std::vector<uint8_t> client_address;
  exchange(b, ch, &client_address);
  // The client connects; it shows up here as an inbound peer once its handshake is done.
  wait_until([&] { return !b.engine->peers(0).empty(); }, "the client to connect");
  b.peer = b.engine->peers(0).front();
  wait_until([&] { return b.engine->peer_ready(0, b.peer) || b.engine->peer_dead(0, b.peer); },
             "the client's handshake");
  if (b.engine->peer_dead(0, b.peer)) die("the client died during the handshake");
  RecvState recv;
  b.engine->set_recv_handler(0, &on_recv, &recv);
  ch.send_reply('R');
  const uint32_t timeout_ms = static_cast<uint32_t>(g_timeout_s) * 1000;

  for (;;) {
    Ctrl c = ch.recv_ctrl("next command");
    arm_watchdog();
    if (c.kind == 'Q') break;
    if (c.size > b.buf_len || c.offset > b.buf_len - c.size)
      die("the client asked for %" PRIu64 " bytes at %" PRIu64 ", the buffer holds %zu", c.size, c.offset, b.buf_len);
    uint8_t* const at = b.buf + c.offset;
    if (c.kind == 'V') {
      // Verify: clear, wait for the write's immediates (or the message), check every byte.
      memset(at, 0, c.size);
      ponte::Flag flag;
      if (c.op == kOpSend) {
        recv.bad.store(0);
        recv.verify_seed.store(c.seed);
        recv.verify_size.store(c.size, std::memory_order_release);
      } else {
        check(b.engine->expect_imm(0, c.imm, static_cast<uint32_t>(c.imms), b.peer, flag.notify(), timeout_ms),
              "expect_imm");
      }
      uint64_t recv_before = recv.count.load();
      ch.send_reply('R');
      char text[128] = "";
      if (c.op == kOpSend) {
        wait_until([&] { return recv.count.load(std::memory_order_acquire) >= recv_before + 1; },
                   "the verification message");
        recv.verify_size.store(0, std::memory_order_release);
        if (recv.bad.load()) snprintf(text, sizeof(text), "%s", recv.bad_text);
      } else {
        wait_until([&] { return flag.done(); }, "the verification write's immediates");
        check(flag.status(), "waiting for the verification write");
        for (size_t i = 0; i < c.size; i++) {
          if (at[i] != pattern_byte(i, c.seed)) {
            snprintf(text, sizeof(text), "byte %zu of %" PRIu64 " at %" PRIu64 " is 0x%02x, expected 0x%02x", i, c.size,
                     c.offset, at[i], pattern_byte(i, c.seed));
            break;
          }
        }
      }
      ch.send_reply(text[0] ? 'E' : 'D', text);
    } else if (c.kind == 'M' || c.kind == 'C') {
      // Bandwidth: the counter expects every immediate (write-imm) or the closing one (write);
      // sends are counted by the receive handler.
      ponte::Flag flag;
      uint64_t recv_before = recv.count.load();
      if (c.op != kOpSend)
        check(b.engine->expect_imm(0, c.imm, static_cast<uint32_t>(c.imms), b.peer, flag.notify(), timeout_ms),
              "expect_imm");
      ch.send_reply('R');
      if (c.op == kOpSend) {
        wait_until([&] { return recv.count.load(std::memory_order_acquire) >= recv_before + c.count; },
                   "the messages");
      } else {
        wait_until([&] { return flag.done(); }, "the writes' immediates");
        check(flag.status(), "waiting for the writes' immediates");
      }
      ch.send_reply('D');
    } else if (c.kind == 'L') {
      PingPong pp;
      pp.engine = b.engine.get();
      pp.peer = b.peer;
      pp.src = LocalSlice{&b.mr, 0, c.size};
      pp.dst = &b.peer_region;
      pp.wait_value = kImmPing | c.imm;
      pp.send_value = kImmPong | c.imm;
      pp.total = c.count;
      pp.timeout_ms = timeout_ms;
      pp.imms = b.engine->imms_per_write(0, b.peer, c.size);
      check(pp.arm(), "expect_imm");
      ch.send_reply('R');
      wait_until([&] { return pp.finished.load(std::memory_order_acquire); }, "the pings");
      wait_until([&] { return pp.writes.done.load(std::memory_order_acquire) >= pp.seen.load(); },
                 "the pongs' completions");
      if (pp.failed.load()) die("latency test: %s", pp.error);
      if (pp.writes.failed.load()) die("latency test: %s", pp.writes.error());
      ch.send_reply('D');
    } else {
      die("unknown command %u", c.kind);
    }
  }
  check(b.engine->deregister(b.mr), "deregister");
  b.engine.reset();
  free(b.buf);
}

// ---------------------------------------------------------------------------------------------
// Client.

// Keeps `window` operations in flight until `total` have completed: each completion, on the
// worker, submits the next one.
struct Stream {
  Engine* engine = nullptr;
  PeerId peer = 0;
  OpKind op = kOpWrite;
  LocalSlice src;
  const RemoteRegion* dst = nullptr;
  uint32_t imm = 0;
  uint64_t total = 0;
  uint64_t slots = 1;                 // operation k: src and dst at slot k % slots (stride src.len)
  std::atomic<uint64_t> posted{0};    // submissions so far: the next one's slot
  std::atomic<uint64_t> claimed{0};   // operations handed out to submitters
  std::atomic<uint64_t> deferred{0};  // claimed but refused with kAgain: the main thread retries
  std::atomic<uint64_t> completed{0};
  std::atomic<int64_t> t_end{0};
  std::atomic<bool> finished{false};  // set after t_end, the last thing a callback touches
  Counter errors;

  Status submit() {
    Notify n{&Stream::on_done, this};
    const size_t off = slots > 1 ? posted.fetch_add(1, std::memory_order_relaxed) % slots * src.len : 0;
    const LocalSlice from{src.mr, src.offset + off, src.len};
    switch (op) {
      case kOpWrite: return engine->write(0, peer, from, *dst, off, n);
      case kOpWriteImm: return engine->write_imm(0, peer, from, *dst, off, imm, n);
      case kOpSend: return engine->send(0, peer, from, n);
      default: return Status(Code::kInternal, "bad op");
    }
  }
  // Claims and submits one operation if any is left.
  void next() {
    if (claimed.fetch_add(1, std::memory_order_relaxed) >= total) return;
    Status st = submit();
    if (st.code() == Code::kAgain) {
      deferred.fetch_add(1, std::memory_order_release);
    } else if (!st.ok()) {
      errors.record(st);
      finish_one();
    }
  }
  void finish_one() {
    if (completed.fetch_add(1, std::memory_order_acq_rel) + 1 == total) {
      t_end.store(now_ns(), std::memory_order_relaxed);
      finished.store(true, std::memory_order_release);
    }
  }
  static void on_done(void* arg, const Status& st) {
    auto* s = static_cast<Stream*>(arg);
    s->errors.record(st);
    s->next();  // before counting this one: once all are counted, the stream may go away
    s->finish_one();
  }
  // Runs the stream; returns its duration in seconds.
  double run(int window) {
    claimed = 0;
    deferred = 0;
    completed = 0;
    t_end = 0;
    finished = false;
    int64_t t0 = now_ns();
    for (int i = 0; i < window; i++) next();
    const int64_t deadline = t0 + int64_t{g_timeout_s} * 1000000000;
    Backoff backoff;
    while (!finished.load(std::memory_order_acquire)) {
      uint64_t d = deferred.load(std::memory_order_acquire);
      if (d > 0) backoff.reset();  // refused submissions to retry: stay close
      while (d > 0) {
        if (!deferred.compare_exchange_weak(d, d - 1)) continue;
        Status st = submit();
        if (st.code() == Code::kAgain) {
          deferred.fetch_add(1);
          break;
        }
        if (!st.ok()) {
          errors.record(st);
          finish_one();
        }
        d = deferred.load(std::memory_order_acquire);
      }
      if (errors.failed.load()) die("%s: %s", kOpNames[op], errors.error());
      if (now_ns() > deadline)
        die("timed out after %d s: %" PRIu64 " of %" PRIu64 " %s operations completed", g_timeout_s,
            completed.load(), total, kOpNames[op]);
      backoff();
    }
    if (errors.failed.load()) die("%s: %s", kOpNames[op], errors.error());
    return static_cast<double>(t_end.load() - t0) * 1e-9;
  }
};

long default_iters(OpKind op, size_t size) {
  if (op == kOpLat) return 2000;
  long n = static_cast<long>((2ull << 30) / (size ? size : 1));
  if (n > 20000) n = 20000;
  if (n < 200) n = 200;
  return n;
}

class Client {
 public:
  Client(Channel& ch, const Options& o, Bench& b) : ch_(ch), o_(o), b_(b) {}

  Row measure(OpKind op, size_t size) {
    Row r{op, size, o_.iters > 0 ? o_.iters : default_iters(op, size), op == kOpLat ? 1 : o_.window};
    test_id_++;
    arm_watchdog();
    if (op == kOpLat) {
      latency(r);
      return r;
    }
    verify(op, size);
    bandwidth(r);
    cpu_cost(r);
    return r;
  }

 private:
  Ctrl command(uint32_t kind, OpKind op, size_t size, uint64_t count, uint64_t imms, uint32_t imm,
               uint64_t seed = 0, uint64_t offset = 0) {
    Ctrl c;
    c.kind = kind;
    c.offset = offset;
    c.op = op;
    c.size = size;
    c.count = count;
    c.imms = imms;
    c.imm = imm;
    c.seed = seed;
    ch_.send_ctrl(c);
    Ctrl reply = ch_.recv_ctrl("answer");
    if (reply.kind != 'R') die("the target refused a test: %s", reply.text);
    return reply;
  }
  void wait_done(const char* what) {
    Ctrl c = ch_.recv_ctrl(what);
    if (c.kind != 'D') die("%s: %s", what, c.text);
  }
  // An immediate alone: it follows a write that has completed.
  Status lone_imm(uint32_t value, Notify done) { return b_.engine->imm(0, b_.peer, value, done); }
  uint32_t ipw(size_t size) const { return b_.engine->imms_per_write(0, b_.peer, size); }
  LocalSlice src(size_t size) const { return LocalSlice{&b_.mr, 0, size}; }

  // A pattern written once, then checked byte for byte at the target after an immediate. A write
  // with --slots goes to the last slot of both buffers: the stream's offsets are checked too.
  void verify(OpKind op, size_t size) {
    const uint64_t seed = 1000 + test_id_;
    const size_t off = op == kOpSend ? 0 : static_cast<size_t>(o_.slots - 1) * size;
    for (size_t i = 0; i < size; i++) b_.buf[off + i] = pattern_byte(i, seed);
    const uint32_t value = kImmVerify | test_id_;
    // write: the data, then an immediate alone once the write completed. write-imm: every shard
    // carries the immediate. send: the message itself.
    const uint64_t imms = op == kOpWriteImm ? ipw(size) : 1;
    command('V', op, size, 1, imms, value, seed, off);
    Counter c;
    const LocalSlice from{&b_.mr, off, size};
    if (op == kOpSend) {
      check(b_.engine->send(0, b_.peer, from, c.notify()), "send");
    } else if (op == kOpWriteImm) {
      check(b_.engine->write_imm(0, b_.peer, from, b_.peer_region, off, value, c.notify()), "write_imm");
    } else {
      check(b_.engine->write(0, b_.peer, from, b_.peer_region, off, c.notify()), "write");
      wait_until([&] { return c.done.load(std::memory_order_acquire) == 1; }, "the verification write");
      if (c.failed.load()) die("verification write: %s", c.error());
      check(lone_imm(value, c.notify()), "imm");
    }
    const uint64_t expect = op == kOpWrite ? 2 : 1;
    wait_until([&] { return c.done.load(std::memory_order_acquire) == expect; }, "the verification transfer");
    if (c.failed.load()) die("verification %s: %s", kOpNames[op], c.error());
    Ctrl reply = ch_.recv_ctrl("verification result");
    if (reply.kind != 'D') die("VERIFY FAILED: %s of %zu bytes: %s", kOpNames[op], size, reply.text);
  }

  void setup_stream(Stream& s, OpKind op, size_t size, uint64_t total, uint32_t value) {
    s.engine = b_.engine.get();
    s.peer = b_.peer;
    s.op = op;
    s.src = src(size);
    s.dst = &b_.peer_region;
    s.imm = value;
    s.total = total;
    s.slots = static_cast<uint64_t>(o_.slots);
  }
  // The plain write's closing immediate (it follows every completed write).
  void close_writes(OpKind op, uint32_t done_value) {
    if (op != kOpWrite) return;
    Counter c;
    check(lone_imm(done_value, c.notify()), "imm");
    wait_until([&] { return c.done.load(std::memory_order_acquire) == 1; }, "the closing immediate");
    if (c.failed.load()) die("closing immediate: %s", c.error());
  }
  uint64_t target_imms(OpKind op, size_t size, uint64_t ops) const {
    return op == kOpWriteImm ? ops * ipw(size) : op == kOpWrite ? 1 : 0;
  }
  uint32_t stream_value(OpKind op) const { return (op == kOpWriteImm ? kImmData : kImmDone) | test_id_; }

  void bandwidth(Row& r) {
    const uint64_t warm = static_cast<uint64_t>(r.iters / 10 < 64 ? r.iters / 10 : 64);
    const uint64_t total = warm + static_cast<uint64_t>(r.iters);
    const uint32_t value = stream_value(r.op);
    command('M', r.op, r.size, total, target_imms(r.op, r.size, total), value);
    Stream s;
    setup_stream(s, r.op, r.size, warm, value);
    if (warm) s.run(o_.window);
    s.total = static_cast<uint64_t>(r.iters);
    double dt = s.run(o_.window);
    close_writes(r.op, value);
    wait_done("the target's count of arrivals");
    r.gbps = static_cast<double>(r.size) * static_cast<double>(r.iters) / dt / 1e9;
    r.mops = static_cast<double>(r.iters) / dt / 1e6;
    r.lat_us = dt / static_cast<double>(r.iters) * o_.window * 1e6;  // time in flight (Little)
  }

  // CPU per posted operation, in a steady stream: bursts of window/2 submits back to back from
  // this thread, each once no more than window/2 are in flight (so the worker is busy, as in a
  // stream, and never asleep); the submit calls alone give ns/op(cpu); the process's CPU
  // (worker, provider threads and the submits, without this thread's waiting) gives ns/op(proc).
  void cpu_cost(Row& r) {
    uint64_t n = (256ull << 20) / (r.size ? r.size : 1);
    if (n > 4000) n = 4000;
    if (n > static_cast<uint64_t>(r.iters)) n = static_cast<uint64_t>(r.iters);
    const uint64_t burst = o_.window > 1 ? static_cast<uint64_t>(o_.window) / 2 : 1;
    const uint64_t window = static_cast<uint64_t>(o_.window);
    if (n < burst) n = burst;
    n = n / burst * burst;
    const uint32_t value = (r.op == kOpWriteImm ? kImmData : kImmDone) | 0x8000u | test_id_;
    command('C', r.op, r.size, n, target_imms(r.op, r.size, n), value);
    Stream s;
    setup_stream(s, r.op, r.size, n, value);
    int64_t clock_cost = cpu_ns(CLOCK_THREAD_CPUTIME_ID);
    clock_cost = cpu_ns(CLOCK_THREAD_CPUTIME_ID) - clock_cost;
    int64_t submit_ns = 0;
    std::vector<int64_t> burst_ns;  // per burst: the median is the figure (a preempted or
    burst_ns.reserve(n / burst);     // interrupted burst must not stand for the submit path)
    const int64_t proc0 = cpu_ns(CLOCK_PROCESS_CPUTIME_ID), self0 = cpu_ns(CLOCK_THREAD_CPUTIME_ID);
    const int64_t deadline = now_ns() + int64_t{g_timeout_s} * 1000000000;
    Counter c;
    const Notify counted = c.notify();
    uint64_t slot = 0;
    for (uint64_t done = 0; done < n; done += burst) {
      // Room for this burst: at most window - burst still in flight.
      while (done - static_cast<uint64_t>(c.done.load(std::memory_order_acquire)) + burst > window) {
        if (now_ns() > deadline)
          die("timed out after %d s: %" PRIu64 " of %" PRIu64 " operations completed", g_timeout_s,
              static_cast<uint64_t>(c.done.load()), n);
        sched_yield();
      }
      const int64_t t0 = cpu_ns(CLOCK_THREAD_CPUTIME_ID);
      for (uint64_t i = 0; i < burst; i++) {
        const size_t off = slot * r.size;
        const LocalSlice from{s.src.mr, off, r.size};
        slot = slot + 1 == s.slots ? 0 : slot + 1;
        for (;;) {
          Status st = r.op == kOpSend        ? b_.engine->send(0, b_.peer, from, counted)
                      : r.op == kOpWriteImm  ? b_.engine->write_imm(0, b_.peer, from, b_.peer_region, off, value, counted)
                                             : b_.engine->write(0, b_.peer, from, b_.peer_region, off, counted);
          if (st.ok()) break;
          if (st.code() != Code::kAgain) check(st, kOpNames[r.op]);
          if (now_ns() > deadline) die("timed out submitting (queue full for %d s)", g_timeout_s);
        }
      }
      const int64_t spent = cpu_ns(CLOCK_THREAD_CPUTIME_ID) - t0 - clock_cost;
      submit_ns += spent;
      burst_ns.push_back(spent);
    }
    while (static_cast<uint64_t>(c.done.load(std::memory_order_acquire)) < n) {
      if (now_ns() > deadline)
        die("timed out after %d s: %" PRIu64 " of %" PRIu64 " operations completed", g_timeout_s,
            static_cast<uint64_t>(c.done.load()), n);
      sched_yield();
    }
    const int64_t proc1 = cpu_ns(CLOCK_PROCESS_CPUTIME_ID), self1 = cpu_ns(CLOCK_THREAD_CPUTIME_ID);
    if (c.failed.load()) die("%s: %s", kOpNames[r.op], c.error());
    close_writes(r.op, value);
    wait_done("the target's count of arrivals");
    std::nth_element(burst_ns.begin(), burst_ns.begin() + burst_ns.size() / 2, burst_ns.end());
    r.cpu_ns_per_op = static_cast<double>(burst_ns[burst_ns.size() / 2]) / static_cast<double>(burst);
    r.proc_ns_per_op =
        static_cast<double>((proc1 - proc0) - (self1 - self0) + submit_ns) / static_cast<double>(n);
  }

  // Ping-pong of write-imm: each side's counter callback writes back; half a round trip.
  void latency(Row& r) {
    const uint64_t warm = static_cast<uint64_t>(r.iters / 10 < 100 ? r.iters / 10 : 100);
    const uint64_t total = warm + static_cast<uint64_t>(r.iters);
    command('L', kOpLat, r.size, total, total, test_id_);
    PingPong pp;
    pp.engine = b_.engine.get();
    pp.peer = b_.peer;
    pp.src = src(r.size);
    pp.dst = &b_.peer_region;
    pp.wait_value = kImmPong | test_id_;
    pp.send_value = kImmPing | test_id_;
    pp.total = total;
    pp.warmup = warm;
    pp.client = true;
    pp.timeout_ms = static_cast<uint32_t>(g_timeout_s) * 1000;
    pp.imms = ipw(r.size);
    if (warm == 0) pp.t_start.store(now_ns());
    check(pp.arm(), "expect_imm");
    check(pp.shoot(), "write_imm");
    wait_until([&] { return pp.finished.load(std::memory_order_acquire); }, "the pongs");
    if (pp.failed.load()) die("latency test: %s", pp.error);
    wait_until([&] { return pp.writes.done.load(std::memory_order_acquire) >= total; }, "the pings' completions");
    if (pp.writes.failed.load()) die("latency test: %s", pp.writes.error());
    wait_done("the target's end of the latency test");
    // One pong per ping: a surplus means the two ends disagree on immediates per write.
    if (uint32_t extra = b_.engine->imm_arrived(0, pp.wait_value))
      die("latency test: %u immediates arrived beyond the %" PRIu64 " pongs", extra, total);
    double dt = static_cast<double>(pp.t_end.load() - pp.t_start.load()) * 1e-9;
    r.lat_us = dt / static_cast<double>(r.iters) / 2 * 1e6;
    r.mops = static_cast<double>(r.iters) / dt / 1e6;
    r.gbps = static_cast<double>(r.size) * static_cast<double>(r.iters) / dt / 1e9;
  }

  Channel& ch_;
  const Options& o_;
  Bench& b_;
  uint32_t test_id_ = 0;
};

void print_rows(const Options& o, const Bench& b, const std::vector<Row>& rows) {
  const char* backend = ponte::backend_name(b.engine->backend());
  const std::string provider = b.engine->nic_info(0, 0).provider;
  if (o.json) {
    printf("{\"tool\":\"ponte-bench\",\"backend\":\"%s\",\"provider\":\"%s\",\"results\":[", backend,
           provider.c_str());
    for (size_t i = 0; i < rows.size(); i++) {
      const Row& r = rows[i];
      printf("%s{\"op\":\"%s\",\"size\":%zu,\"window\":%d,\"slots\":%d,\"nics\":%d,\"iters\":%ld,\"GBps\":%.4f,\"Mops\":%.4f,"
             "\"lat_us\":%.3f,\"cpu_ns_per_op\":%.1f,\"proc_ns_per_op\":%.1f}",
             i ? "," : "", kOpNames[r.op], r.size, r.window, o.slots, o.nics, r.iters, r.gbps, r.mops, r.lat_us,
             r.cpu_ns_per_op, r.proc_ns_per_op);
    }
    printf("]}\n");
    return;
  }
  char slots[32] = "";
  if (o.slots > 1) snprintf(slots, sizeof(slots), ", %d slots", o.slots);
  printf("ponte-bench: backend %s, provider %s, %d NIC(s), window %d%s, %s; data verified byte for byte\n",
         backend, provider.c_str(), o.nics, o.window, slots,
         o.mode == Options::kLoopback ? "loopback (two processes)" : "two hosts");
  printf("%-10s %10s %11s %10s %12s %10s %11s %12s\n", "op", "#bytes", "#iterations", "BW[GB/s]", "Mops",
         "lat[us]", "ns/op(cpu)", "ns/op(proc)");
  for (const Row& r : rows) {
    char cpu[32] = "-", proc[32] = "-";
    if (r.cpu_ns_per_op >= 0) snprintf(cpu, sizeof(cpu), "%.0f", r.cpu_ns_per_op);
    if (r.proc_ns_per_op >= 0) snprintf(proc, sizeof(proc), "%.0f", r.proc_ns_per_op);
    printf("%-10s %10zu %11ld %10.3f %12.4f %10.2f %11s %12s\n", kOpNames[r.op], r.size, r.iters, r.gbps, r.mops,
           r.lat_us, cpu, proc);
  }
  printf("lat[us]: lat = half a round trip of write-imm ping-pong; bandwidth rows = time in flight (window/rate).\n"
         "ns/op(cpu): this thread's CPU per submitted op (median burst, worker busy); ns/op(proc): the process's CPU per op (worker+provider).\n");
  fflush(stdout);
}

int run_client(Channel& ch, const Options& o) {
  size_t max_size = 8;
  for (size_t s : o.sizes) max_size = s > max_size ? s : max_size;
  Ctrl hello;
  hello.kind = 'H';
  hello.count = kMagic;
  hello.imm = kProtocolVersion;
  max_size *= static_cast<size_t>(o.slots);  // both ends hold every slot
  hello.size = max_size;
  ch.send_ctrl(hello);
  Bench b;
  b.engine = make_engine(o, /*target=*/false);
  setup_memory(b, max_size);
  std::vector<uint8_t> target_address;
  exchange(b, ch, &target_address);
  auto peer = b.engine->connect(0, target_address);
  check(peer.status(), "connect");
  b.peer = peer.value();
  wait_until([&] { return b.engine->peer_ready(0, b.peer) || b.engine->peer_dead(0, b.peer); },
             "the handshake with the target");
  if (b.engine->peer_dead(0, b.peer)) die("the target is dead (handshake failed)");
  Ctrl ready = ch.recv_ctrl("readiness");
  if (ready.kind != 'R') die("the target failed to start: %s", ready.text);

  const uint32_t recv_size = ponte::global_config().recv_buf_size;
  Client client(ch, o, b);
  std::vector<Row> rows;
  for (OpKind op : o.ops) {
    std::vector<size_t> sizes = o.sizes;
    if (op == kOpLat && !o.sizes_given) sizes = {8};
    for (size_t size : sizes) {
      if (op == kOpSend && size > recv_size) {
        fprintf(stderr, "ponte-bench: send of %zu bytes skipped: over PONTE_RECV_SIZE (%u)\n", size, recv_size);
        continue;
      }
      rows.push_back(client.measure(op, size));
    }
  }
  arm_watchdog();  // and the teardown
  Ctrl quit;
  quit.kind = 'Q';
  ch.send_ctrl(quit);
  print_rows(o, b, rows);
  check(b.engine->deregister(b.mr), "deregister");
  b.engine.reset();
  free(b.buf);
  return 0;
}

// ---------------------------------------------------------------------------------------------
// Command line and process setup.

[[noreturn]] void usage(int code) {
  fprintf(code ? stderr : stdout,
          "usage: ponte-bench [--backend fabric|verbs] [--provider P] [--op write|write-imm|send|lat[,...]]\n"
          "                   [--sizes 8,64k,1m,...] [--window N] [--slots N] [--nics N] [--iters N] [--timeout S]\n"
          "                   [--worker-cores I[,T]] [--json] [--server | --client HOST] [--port P] [--version]\n"
          "Moves data through ponte's engine between two processes, verifies it, then prints bandwidth,\n"
          "latency and CPU per operation. Default: both ends on this host over loopback (the peer is\n"
          "forked), provider tcp;ofi_rxm, op write-imm,lat, sizes 64,64k,1m,8m (lat: 8 bytes), window 16,\n"
          "1 NIC. --slots N: bandwidth operation k moves slot k %% N of both buffers (N x the largest\n"
          "size each; default 1: every operation the same bytes, as ib_write_bw).\n"
          "--worker-cores I[,T]: pins the initiator's engine worker to core I and the target's to T\n"
          "(default I), as PONTE_PROGRESS_CORES does for one end; unpinned by default.\n"
          "--server / --client HOST run the two ends on two hosts (TCP port %d for the setup).\n"
          "Environment: PONTE_BACKEND, PONTE_FABRIC_PROVIDER and every other PONTE_* variable.\n",
          kDefaultPort);
  exit(code);
}

bool parse_size_arg(const std::string& text, size_t* out) {
  auto r = ponte::parse_size(text);
  if (!r.ok()) return false;
  *out = r.value();
  return true;
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t comma = s.find(',', start);
    if (comma == std::string::npos) comma = s.size();
    if (comma > start) out.push_back(s.substr(start, comma - start));
    start = comma + 1;
  }
  return out;
}

long parse_long(const char* flag, const char* v, long lo, long hi) {
  char* end = nullptr;
  errno = 0;
  long n = strtol(v, &end, 10);
  if (errno || end == v || *end || n < lo || n > hi) {
    fprintf(stderr, "ponte-bench: %s wants a number in %ld..%ld, got '%s'\n", flag, lo, hi, v);
    usage(2);
  }
  return n;
}

Options parse_args(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; i++) {
    std::string a = argv[i];
    if (a == "-h" || a == "--help") usage(0);
    if (a == "--version") {
      printf("ponte-bench %s\n", PONTE_VERSION_STRING);
      exit(0);
    }
    if (a == "--json") {
      o.json = true;
      continue;
    }
    if (a == "--server") {
      o.mode = Options::kServer;
      continue;
    }
    if (i + 1 >= argc) {
      fprintf(stderr, "ponte-bench: %s needs a value\n", a.c_str());
      usage(2);
    }
    const char* v = argv[++i];
    if (a == "--backend") {
      o.backend = v;
      if (o.backend != "fabric" && o.backend != "verbs" && o.backend != "auto") {
        fprintf(stderr, "ponte-bench: --backend is fabric, verbs or auto\n");
        usage(2);
      }
    } else if (a == "--provider") {
      o.provider = v;
    } else if (a == "--op") {
      o.ops.clear();
      for (const std::string& t : split(v)) {
        int k = -1;
        for (int j = 0; j < 4; j++)
          if (t == kOpNames[j]) k = j;
        if (k < 0) {
          fprintf(stderr, "ponte-bench: bad --op '%s' (write, write-imm, send, lat)\n", t.c_str());
          usage(2);
        }
        o.ops.push_back(static_cast<OpKind>(k));
      }
      if (o.ops.empty()) usage(2);
    } else if (a == "--sizes") {
      o.sizes.clear();
      o.sizes_given = true;
      for (const std::string& t : split(v)) {
        size_t s = 0;
        if (!parse_size_arg(t, &s) || s == 0 || s > (1ull << 30)) {
          fprintf(stderr, "ponte-bench: bad size '%s' (1 byte .. 1g)\n", t.c_str());
          usage(2);
        }
        o.sizes.push_back(s);
      }
      if (o.sizes.empty()) usage(2);
    } else if (a == "--window") {
      o.window = static_cast<int>(parse_long("--window", v, 1, 4096));
    } else if (a == "--slots") {
      o.slots = static_cast<int>(parse_long("--slots", v, 1, 4096));
    } else if (a == "--worker-cores") {
      const std::vector<std::string> cores = split(v);
      if (cores.empty() || cores.size() > 2) {
        fprintf(stderr, "ponte-bench: --worker-cores wants I or I,T (core numbers), got '%s'\n", v);
        usage(2);
      }
      o.initiator_core = static_cast<int>(parse_long("--worker-cores", cores[0].c_str(), 0, CPU_SETSIZE - 1));
      o.target_core = cores.size() == 2
                          ? static_cast<int>(parse_long("--worker-cores", cores[1].c_str(), 0, CPU_SETSIZE - 1))
                          : o.initiator_core;
      if (Status st = ponte::check_cores_usable({o.initiator_core, o.target_core}, "--worker-cores"); !st.ok()) {
        fprintf(stderr, "ponte-bench: %s\n", st.message());  // Engine::create would refuse it after the fork
        usage(2);
      }
    } else if (a == "--nics") {
      o.nics = static_cast<int>(parse_long("--nics", v, 1, ponte::kMaxNicsPerGroup));
    } else if (a == "--iters") {
      o.iters = parse_long("--iters", v, 1, 100000000);
    } else if (a == "--timeout") {
      o.timeout_s = static_cast<int>(parse_long("--timeout", v, 1, 3600));
    } else if (a == "--client") {
      o.mode = Options::kClient;
      o.host = v;
    } else if (a == "--port") {
      o.port = static_cast<int>(parse_long("--port", v, 1, 65535));
    } else {
      fprintf(stderr, "ponte-bench: unknown option %s\n", a.c_str());
      usage(2);
    }
  }
  return o;
}

// Across hosts: the server accepts one client on --port, both within the timeout.
int tcp_server(int port) {
  int lfd = socket(AF_INET, SOCK_STREAM, 0);
  if (lfd < 0) die("socket: %s", strerror(errno));
  int one = 1;
  setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  sa.sin_addr.s_addr = htonl(INADDR_ANY);
  if (bind(lfd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) || listen(lfd, 1))
    die("cannot listen on TCP port %d: %s", port, strerror(errno));
  fprintf(stderr, "ponte-bench: server waiting for a client on TCP port %d (for %d s)\n", port, g_timeout_s);
  pollfd pfd{lfd, POLLIN, 0};
  int r = poll(&pfd, 1, g_timeout_s * 1000);
  if (r <= 0) die("no client connected to port %d within %d s", port, g_timeout_s);
  int fd = accept(lfd, nullptr, nullptr);
  close(lfd);
  if (fd < 0) die("accept: %s", strerror(errno));
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

int tcp_client(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  std::string port_text = std::to_string(port);
  int rc = getaddrinfo(host.c_str(), port_text.c_str(), &hints, &res);
  if (rc) die("cannot resolve %s: %s", host.c_str(), gai_strerror(rc));
  const int64_t deadline = now_ns() + int64_t{g_timeout_s} * 1000000000;
  for (;;) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) die("socket: %s", strerror(errno));
    if (connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
      freeaddrinfo(res);
      int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
      return fd;
    }
    int err = errno;
    close(fd);
    if (now_ns() > deadline) die("cannot reach the server %s:%d within %d s: %s", host.c_str(), port, g_timeout_s, strerror(err));
    usleep(200 * 1000);  // the server may not be listening yet
  }
}

}  // namespace

int main(int argc, char** argv) {
  Options o = parse_args(argc, argv);
  g_timeout_s = o.timeout_s;
  signal(SIGPIPE, SIG_IGN);
  signal(SIGALRM, on_watchdog);
  arm_watchdog();  // covers engine creation and the setup exchange
  setvbuf(stdout, nullptr, _IOLBF, 0);
  if (!o.backend.empty()) setenv("PONTE_BACKEND", o.backend.c_str(), 1);
  if (!o.provider.empty()) setenv("PONTE_FABRIC_PROVIDER", o.provider.c_str(), 1);

  if (o.mode == Options::kServer || o.mode == Options::kClient) {
    g_role = o.mode == Options::kServer ? "ponte-bench server" : "ponte-bench client";
    Channel ch(o.mode == Options::kServer ? tcp_server(o.port) : tcp_client(o.host, o.port));
    if (o.mode == Options::kServer) {
      run_target(ch, o);
      return 0;
    }
    return run_client(ch, o);
  }

  // Loopback: both ends here, and nothing leaves the host. tcp;ofi_rxm unless told otherwise;
  // the tcp provider binds lo and the engine's peer socket 127.0.0.1.
  setenv("PONTE_FABRIC_PROVIDER", "tcp;ofi_rxm", 0);
  setenv("FI_TCP_IFACE", "lo", 0);
  setenv("PONTE_CTRL_ADDR", "127.0.0.1", 0);
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv)) die("socketpair: %s", strerror(errno));
  fflush(nullptr);
  pid_t pid = fork();  // before any engine thread exists
  if (pid < 0) die("fork: %s", strerror(errno));
  if (pid == 0) {
    g_role = "ponte-bench target";
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() == 1) _exit(1);
    close(sv[0]);
    {
      Channel ch(sv[1]);
      run_target(ch, o);
    }
    fflush(nullptr);
    _exit(0);
  }
  g_child = pid;
  close(sv[1]);
  g_role = "ponte-bench client";
  int rc = 0;
  {
    Channel ch(sv[0]);
    rc = run_client(ch, o);
  }
  // The target must end cleanly, within bounds.
  int status = 0;
  const int64_t deadline = now_ns() + 15 * int64_t{1000000000};
  pid_t r = 0;
  while ((r = waitpid(pid, &status, WNOHANG)) == 0 && now_ns() < deadline) nap();
  g_child = -1;
  if (r == 0) {
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    fprintf(stderr, "ponte-bench: the target process did not exit within 15 s\n");
    return 1;
  }
  if (r < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    fprintf(stderr, "ponte-bench: the target process failed (status 0x%x)\n", status);
    return 1;
  }
  return rc;
}
