// ponte-soak's plugin half (see soak_plugin.h).
#include "tests/soak/soak_plugin.h"

#include <atomic>
#include <thread>

#include "tests/plugin/harness.h"

namespace ponte::soak {

using namespace ponte::nccl_abi;
using plugin_test::Handle;

namespace {

std::atomic<long> g_warnings{0};

// NCCL's logger: warnings are printed and counted, the rest dropped (a soak must not grow a log
// in memory; PONTE_SOAK_ECHO_LOG=1 prints everything).
void soak_logger(LogLevel level, unsigned long, const char*, int, const char* fmt, ...) {
  static const bool echo = getenv("PONTE_SOAK_ECHO_LOG") != nullptr;
  if (level != kLogWarn && !echo) return;
  if (level == kLogWarn) g_warnings.fetch_add(1);
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  std::fprintf(stderr, "[nccl-log %d pid %d] %s\n", level, static_cast<int>(getpid()), buf);
}

NetV11* net(void* t) { return static_cast<NetV11*>(t); }

uint8_t* alloc_pages(size_t n) {
  auto* p = static_cast<uint8_t*>(std::aligned_alloc(4096, (n + 4095) / 4096 * 4096));
  if (!p) die("out of memory (%zu bytes)", n);
  std::memset(p, 0, n);
  return p;
}

}  // namespace

PluginSoak::PluginSoak(const Options& o, const Channel& ch) : o_(o), ch_(ch) {
  plugin_test::Library& l = plugin_test::lib();
  if (!l.v11) die("cannot load the plugin %s: %s", plugin_test::plugin_path().c_str(), l.error.c_str());
  table_ = l.v11;
  CommConfig config{kTrafficClassUndef};
  check(net(table_)->init(&ctx_, 0x50a4, &config, &soak_logger, nullptr), "init");
  int ndev = 0;
  check(net(table_)->devices(&ndev), "devices");
  if (ndev < 1) die("the plugin offers no device");
  if (o_.nics > 1) {
    VDeviceProps vp{};
    vp.ndevs = o_.nics;  // device 0 fused o_.nics times, as on a loopback host
    check(net(table_)->make_vdevice(&dev_, &vp), "makeVDevice");
  }
}

PluginSoak::~PluginSoak() {
  if (ctx_) net(table_)->finalize(ctx_);
}

long PluginSoak::warnings() const { return g_warnings.load(); }

void PluginSoak::check(int result, const char* what) const {
  if (result != kSuccess) die("plugin %s failed: ncclResult %d", what, result);
}

PluginSoak::Comms PluginSoak::open() {
  NetV11* t = net(table_);
  Comms c;
  Handle mine, theirs;
  check(t->listen(ctx_, dev_, mine.bytes, &c.listen), "listen");
  auto got = trade(ch_, std::vector<uint8_t>(mine.bytes, mine.bytes + sizeof(mine.bytes)), o_.timeout_s,
                   "listen handle");
  if (got.size() != sizeof(theirs.bytes)) die("bad listen handle from the peer");
  std::memcpy(theirs.bytes, got.data(), got.size());
  DeviceHandle* dh = nullptr;
  Watchdog wd(o_.timeout_s);
  while (!c.send || !c.recv) {  // never blocking, as NCCL's proxy connects
    if (!c.send) check(t->connect(ctx_, dev_, theirs.bytes, &c.send, &dh), "connect");
    if (!c.recv) check(t->accept(c.listen, &c.recv, &dh), "accept");
    if (wd.expired()) die("connect/accept did not complete in %d s", o_.timeout_s);
    std::this_thread::yield();
  }
  return c;
}

void PluginSoak::close(Comms& c) {
  NetV11* t = net(table_);
  check(t->close_send(c.send), "closeSend");
  check(t->close_recv(c.recv), "closeRecv");
  check(t->close_listen(c.listen), "closeListen");
  c = Comms{};
}

StreamResult PluginSoak::stream(uint64_t bytes_each_way, uint64_t out, uint64_t in) {
  NetV11* t = net(table_);
  Comms c = open();
  const int w = o_.window;
  const size_t slot = (o_.max_msg + 4095) / 4096 * 4096;
  uint8_t* sbuf = alloc_pages(slot * static_cast<size_t>(w));
  uint8_t* rbuf = alloc_pages(slot * static_cast<size_t>(w));
  void *smh = nullptr, *rmh = nullptr;
  check(t->reg_mr(c.send, sbuf, slot * static_cast<size_t>(w), kPtrHost, &smh), "regMr(send)");
  check(t->reg_mr(c.recv, rbuf, slot * static_cast<size_t>(w), kPtrHost, &rmh), "regMr(recv)");

  StreamResult res;
  uint64_t out_bytes = 0;
  const uint64_t n_out = stream_messages(out, bytes_each_way, o_.max_msg, &out_bytes);
  res.expected_messages = stream_messages(in, bytes_each_way, o_.max_msg, &res.expected_bytes);
  const uint64_t n_in = res.expected_messages;

  struct SendSlot {
    void* req = nullptr;
    uint64_t seq = 0;
    uint32_t len = 0;
    bool filled = false;
  };
  struct RecvSlot {
    void* req = nullptr;
    uint64_t seq = 0;
  };
  std::vector<SendSlot> ss(static_cast<size_t>(w));
  std::vector<RecvSlot> rs(static_cast<size_t>(w));
  uint64_t next_seq = 0, sent = 0, posted = 0;
  int pending = -1;  // the filled slot whose isend has not been taken yet: sends go in seq order
  Watchdog wd(o_.timeout_s);
  const auto t0 = Clock::now();
  while (sent < n_out || res.messages + res.failures < n_in) {
    bool progress = false;
    // Sends: fill the next message into a free slot, post it; test what is in flight.
    for (;;) {
      if (pending < 0 && next_seq < n_out) {
        for (int i = 0; i < w; ++i) {
          if (!ss[i].req && !ss[i].filled) {
            SendSlot& s = ss[i];
            s.seq = next_seq++;
            s.len = message_len(out, s.seq, o_.max_msg);
            fill_message(sbuf + slot * i, s.len, out, s.seq);
            s.filled = true;
            pending = i;
            break;
          }
        }
      }
      if (pending < 0) break;
      SendSlot& s = ss[pending];
      check(t->isend(c.send, sbuf + slot * pending, s.len, 0, smh, nullptr, &s.req), "isend");
      if (!s.req) break;  // no clear-to-send yet
      pending = -1;
      progress = true;
    }
    for (int i = 0; i < w; ++i) {
      SendSlot& s = ss[i];
      if (!s.req) continue;
      int done = 0, size = 0;
      check(t->test(s.req, &done, &size), "test(send)");
      if (done) {
        s.req = nullptr, s.filled = false, ++sent, progress = true;
      }
    }
    // Receives: keep every slot posted; verify what completes (matched in posting order).
    for (int i = 0; i < w; ++i) {
      RecvSlot& r = rs[i];
      if (!r.req && posted < n_in) {
        void* data[1] = {rbuf + slot * i};
        size_t sizes[1] = {slot};
        int tags[1] = {0};
        void* mhs[1] = {rmh};
        check(t->irecv(c.recv, 1, data, sizes, tags, mhs, nullptr, &r.req), "irecv");
        if (r.req) r.seq = posted++, progress = true;
      }
      if (!r.req) continue;
      int done = 0, sizes[1] = {0};
      check(t->test(r.req, &done, sizes), "test(recv)");
      if (!done) continue;
      r.req = nullptr, progress = true;
      const uint32_t len = message_len(in, r.seq, o_.max_msg);
      const Verdict v = check_message(rbuf + slot * i, static_cast<size_t>(sizes[0]), r.seq, len);
      if (v == Verdict::kOk) {
        ++res.messages, res.bytes += len;
      } else {
        if (++res.failures <= 5)
          std::fprintf(stderr, "ponte-soak: plugin message %llu (%u B, got %d B): %s\n",
                       static_cast<unsigned long long>(r.seq), len, sizes[0], verdict_name(v));
      }
    }
    if (progress) {
      wd.progressed();
    } else {
      if (wd.expired())
        die("plugin stream stalled for %d s: sent %llu/%llu, received %llu/%llu", o_.timeout_s,
            static_cast<unsigned long long>(sent), static_cast<unsigned long long>(n_out),
            static_cast<unsigned long long>(res.messages + res.failures),
            static_cast<unsigned long long>(n_in));
      std::this_thread::yield();  // NCCL's proxy: a pass without progress yields
    }
  }
  res.secs = std::chrono::duration<double>(Clock::now() - t0).count();
  sync(ch_, "plugin-stream-done", o_.timeout_s);  // both ends finished before either closes
  check(t->dereg_mr(c.send, smh), "deregMr(send)");
  check(t->dereg_mr(c.recv, rmh), "deregMr(recv)");
  close(c);
  std::free(sbuf);
  std::free(rbuf);
  return res;
}

void PluginSoak::quiesce() {
  NetV11* t = net(table_);
  for (int round = 0; round < 2; ++round) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // last operations and close acks end
    Handle h;
    void* listen = nullptr;
    check(t->listen(ctx_, dev_, h.bytes, &listen), "listen");  // frees the closed comms that may go
    check(t->close_listen(listen), "closeListen");
  }
  sync(ch_, "plugin-quiet", o_.timeout_s);
}

int PluginSoak::cycles(int first, int n, uint64_t out, uint64_t in) {
  NetV11* t = net(table_);
  constexpr uint32_t kCycleMax = 64u << 10;
  int ok = 0;
  for (int k = first; k < first + n; ++k) {
    Comms c = open();
    // Fresh buffers every cycle: a registration the plugin kept past deregMr would now name memory
    // that was freed and handed out again.
    uint8_t* tx = alloc_pages(kCycleMax);
    uint8_t* rx = alloc_pages(kCycleMax);
    void *smh = nullptr, *rmh = nullptr;
    check(t->reg_mr(c.send, tx, kCycleMax, kPtrHost, &smh), "regMr(send)");
    check(t->reg_mr(c.recv, rx, kCycleMax, kPtrHost, &rmh), "regMr(recv)");
    const uint32_t len = message_len(out, static_cast<uint64_t>(k), kCycleMax);
    const uint32_t rlen = message_len(in, static_cast<uint64_t>(k), kCycleMax);
    fill_message(tx, len, out, static_cast<uint64_t>(k));
    void *sreq = nullptr, *rreq = nullptr;
    bool sdone = false, rdone = false;
    int got = 0;
    Watchdog wd(o_.timeout_s);
    while (!sdone || !rdone) {
      bool progress = false;
      if (!rreq && !rdone) {
        void* data[1] = {rx};
        size_t sizes[1] = {kCycleMax};
        int tags[1] = {0};
        void* mhs[1] = {rmh};
        check(t->irecv(c.recv, 1, data, sizes, tags, mhs, nullptr, &rreq), "irecv");
        progress |= rreq != nullptr;
      }
      if (!sreq && !sdone) {
        check(t->isend(c.send, tx, len, 0, smh, nullptr, &sreq), "isend");
        progress |= sreq != nullptr;
      }
      int done = 0, size = 0;
      if (sreq) {
        check(t->test(sreq, &done, &size), "test(send)");
        if (done) sreq = nullptr, sdone = true, progress = true;
      }
      if (rreq) {
        int sizes[1] = {0};
        check(t->test(rreq, &done, sizes), "test(recv)");
        if (done) rreq = nullptr, rdone = true, got = sizes[0], progress = true;
      }
      if (progress) {
        wd.progressed();
      } else {
        if (wd.expired()) die("plugin cycle %d stalled for %d s", k, o_.timeout_s);
        std::this_thread::yield();
      }
    }
    const Verdict v = check_message(rx, static_cast<size_t>(got), static_cast<uint64_t>(k), rlen);
    if (v == Verdict::kOk) ++ok;
    else std::fprintf(stderr, "ponte-soak: plugin cycle %d: %s\n", k, verdict_name(v));
    check(t->dereg_mr(c.send, smh), "deregMr(send)");
    check(t->dereg_mr(c.recv, rmh), "deregMr(recv)");
    close(c);
    std::free(tx);
    std::free(rx);
  }
  sync(ch_, "plugin-cycles-done", o_.timeout_s);
  return ok;
}

}  // namespace ponte::soak
