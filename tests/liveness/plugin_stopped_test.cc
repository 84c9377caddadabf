// The NCCL plugin with a stopped peer (issue 12, "Faults"), as a new user tried it: two processes,
// each the plugin driven through its C ABI as NCCL's proxy drives it (dlopen, isend/irecv/test),
// 8 x 16 MiB in flight over tcp;ofi_rxm and shm. One side is stopped (SIGSTOP) mid-stream: the
// other side's requests end (received ones verified byte for byte, the rest with errors) within
// PONTE_TIMEOUT_MS, and its deregMr and close return at once; the stopped side, run again, ends
// its own requests with errors too. This process only orchestrates: the plugins run in children,
// so whatever hangs, the test stops by itself.
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>

#include <sstream>

#include "tests/liveness/timing.h"
#include "tests/plugin/harness.h"

using namespace ponte::plugin_test;
using ponte::test::kSlack;
using ponte::test::kTimeoutMs;
using namespace std::chrono_literals;

namespace {

constexpr size_t kChunk = 16u << 20;
constexpr int kReqs = 8;

int64_t now_ns() {  // CLOCK_MONOTONIC: the same clock in every process of this host
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

// ---------------------------------------------------------------- the plugin side (children)

// 8 buffers of 16 MiB registered with comm, pattern seed i + 1 in buffer i.
struct Buffers {
  const Net& net;
  void* comm;
  uint8_t* ptr[kReqs] = {};
  void* mh[kReqs] = {};
  Buffers(const Net& n, void* c, bool fill_them) : net(n), comm(c) {
    for (int i = 0; i < kReqs; i++) {
      ptr[i] = static_cast<uint8_t*>(std::aligned_alloc(4096, kChunk));
      if (fill_them) fill(ptr[i], kChunk, i + 1);
      else memset(ptr[i], 0, kChunk);
      if (net->reg_mr(comm, ptr[i], kChunk, kPtrHost, &mh[i]) != kSuccess) mh[i] = nullptr;
    }
  }
  // deregMr of every buffer: how long it took, and how many failed.
  long long dereg(int* failed) {
    const auto t = Clock::now();
    *failed = 0;
    for (int i = 0; i < kReqs; i++) {
      if (mh[i] && net->dereg_mr(comm, mh[i]) != kSuccess) ++*failed;
      mh[i] = nullptr;
    }
    return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t).count();
  }
  ~Buffers() {
    for (auto* p : ptr) std::free(p);
  }
};

// Tests the first `posted` requests until each is done or failed (60 s at most); those never
// posted count as failed. Returns "ok=K err=M bad=B last_end_ns=T last_err_ns=E": bad counts
// received buffers whose size or bytes differ (checked once all ended, so as not to delay them).
std::string finish_all(const Net& net, void* reqs[kReqs], int posted, const Buffers* verify) {
  int state[kReqs] = {};  // 0 pending, 1 done, 2 failed
  int size[kReqs] = {};
  int64_t last_end = posted < kReqs ? now_ns() : 0, last_err = last_end;
  int ok = 0, err = kReqs - posted, bad = 0;
  for (int i = posted; i < kReqs; i++) state[i] = 2;
  const auto deadline = Clock::now() + 60s;
  while (ok + err < kReqs && Clock::now() < deadline) {
    for (int i = 0; i < kReqs; i++) {
      if (state[i] != 0) continue;
      int done = 0, sizes[8] = {0};
      NcclResult r = net->test(reqs[i], &done, sizes);
      if (r != kSuccess || done) {
        state[i] = r == kSuccess ? 1 : 2;
        size[i] = sizes[0];
        last_end = now_ns();
        if (r == kSuccess) {
          ok++;
        } else {
          err++;
          last_err = last_end;
        }
      }
    }
    std::this_thread::yield();
  }
  for (int i = 0; verify && i < kReqs; i++)
    if (state[i] == 1 && (size[i] != static_cast<int>(kChunk) || mismatch(verify->ptr[i], kChunk, i + 1) != SIZE_MAX)) bad++;
  std::ostringstream o;
  o << "ok=" << ok << " err=" << err << " bad=" << bad << " last_end_ns=" << last_end << " last_err_ns=" << last_err;
  return o.str();
}

int plugin_peer(int argc, char** argv) {
  Channel ch(3);
  const std::string role = argc > 2 ? argv[2] : "";
  auto fail = [&](const char* why) {
    ch.send_str(why);
    return 1;
  };
  Net net;
  if (net.init_result != kSuccess) return fail("init failed");
  void* comm = nullptr;
  void* listen = nullptr;
  if (role == "recv") {
    Handle h;
    if (net->listen(net.ctx(), 0, h.bytes, &listen) != kSuccess) return fail("listen failed");
    ch.send(h.bytes, sizeof(h.bytes));
    if (accept_comm(net, listen, &comm) != kSuccess) return fail("accept failed");
  } else {
    std::vector<uint8_t> handle;
    if (!ch.recv(&handle, 30000) || connect_comm(net, 0, handle.data(), &comm) != kSuccess)
      return fail("connect failed");
  }
  Buffers bufs(net, comm, role == "send");
  void* reqs[kReqs] = {};
  pid_t stop_after_first = 0;  // the sender stops this process once its first send is posted
  int64_t stopped_ns = 0;       // when it did
  auto post_all = [&] {  // how many were posted (the rest failed)
    for (int i = 0; i < kReqs; i++) {
      if (i == 1 && stop_after_first > 0) {
        if (::kill(stop_after_first, SIGSTOP) != 0) return -1;
        stopped_ns = now_ns();
      }
      NcclResult r;
      if (role == "recv") {
        memset(bufs.ptr[i], 0, kChunk);
        void* data[1] = {bufs.ptr[i]};
        size_t cap[1] = {kChunk};
        int tags[1] = {i};
        void* mhs[1] = {bufs.mh[i]};
        r = post_recv(net, comm, 1, data, cap, tags, mhs, &reqs[i]);
      } else {
        r = post_send(net, comm, bufs.ptr[i], kChunk, i, bufs.mh[i], &reqs[i]);  // returns once its CTS came
      }
      if (r != kSuccess) return i;
    }
    return kReqs;
  };
  // Round 1 runs to its end, verified; round 2 is the one a stop interrupts. The sender posts
  // round 2 when told ("post"): stopped before, it leaves the receiver's 8 receives waiting.
  int posted = post_all();
  ch.send_str("round1 " + finish_all(net, reqs, posted, role == "recv" ? &bufs : nullptr));
  std::string go;
  if (!ch.recv_str(&go, 60000) || go != "round2") return fail("no round 2");
  // "post stop PID": the sender stops the receiver itself the moment its first send is posted, so
  // that at least 7 x 16 MiB (far more than the sockets buffer) are still to move. Stopped once all
  // 8 were posted (by the test process on hearing "posted 8", then by the sender itself), the
  // receiver had sometimes taken all 128 MiB already: a scheduler delay on two busy cores, and on
  // CI's machine three tries in a row. Sends after the stop are posted or fail (peer dead).
  if (role == "send") {
    if (!ch.recv_str(&go, 120000) || go.rfind("post", 0) != 0) return fail("no post");
    if (go.rfind("post stop ", 0) == 0) stop_after_first = static_cast<pid_t>(std::atoll(go.c_str() + 10));
  }
  posted = post_all();
  if (posted < 0) return fail("could not stop the receiver");
  ch.send_str("posted " + std::to_string(posted) + (stopped_ns ? " stopped_ns=" + std::to_string(stopped_ns) : ""));
  std::string report = finish_all(net, reqs, posted, role == "recv" ? &bufs : nullptr);
  int dereg_failed = 0;
  const long long dereg_ms = bufs.dereg(&dereg_failed);
  const auto t = Clock::now();
  if (role == "recv") {
    net->close_recv(comm);
    net->close_listen(listen);
  } else {
    net->close_send(comm);
  }
  const long long close_ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t).count();
  report += " dereg_ms=" + std::to_string(dereg_ms) + " dereg_failed=" + std::to_string(dereg_failed) +
            " close_ms=" + std::to_string(close_ms);
  ch.send_str(report);
  std::string bye;
  ch.recv_str(&bye, 60000);
  return 0;
}

// ---------------------------------------------------------------- the test side

struct Report {
  int ok = -1, err = -1, bad = -1, dereg_failed = -1;
  int64_t last_end_ns = 0, last_err_ns = 0;
  long long dereg_ms = -1, close_ms = -1;
  std::string text;
};
Report parse(const std::string& s) {
  Report r;
  r.text = s;
  std::istringstream in(s);
  std::string kv;
  while (in >> kv) {
    auto eq = kv.find('=');
    if (eq == std::string::npos) continue;
    const std::string k = kv.substr(0, eq);
    const long long v = std::atoll(kv.c_str() + eq + 1);
    if (k == "ok") r.ok = static_cast<int>(v);
    else if (k == "err") r.err = static_cast<int>(v);
    else if (k == "bad") r.bad = static_cast<int>(v);
    else if (k == "last_end_ns") r.last_end_ns = v;
    else if (k == "last_err_ns") r.last_err_ns = v;
    else if (k == "dereg_ms") r.dereg_ms = v;
    else if (k == "dereg_failed") r.dereg_failed = static_cast<int>(v);
    else if (k == "close_ms") r.close_ms = v;
  }
  return r;
}

long long ms_after(int64_t ns, Clock::time_point t) {
  return (ns - std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count()) / 1000000;
}

struct Provider {
  std::string name, fabric;
};
void PrintTo(const Provider& p, std::ostream* os) { *os << p.name; }

class PluginStopped : public ::testing::TestWithParam<Provider> {
 protected:
  bool retry_if_nothing_in_flight_ = false;  // run(): nothing in flight at the stop ends the try
  bool nothing_in_flight_ = false;           // and says so here
  std::vector<std::string> env() const {
    return {"PONTE_BACKEND=fabric", "PONTE_FABRIC_PROVIDER=" + GetParam().fabric, "FI_TCP_IFACE=lo",
            "PONTE_CTRL_ADDR=127.0.0.1", "PONTE_TIMEOUT_MS=" + std::to_string(kTimeoutMs)};
  }
  // Both sides started and connected, a first round of 8 moved and verified, the receiver's
  // second 8 posted; then `victim` ("recv" or "send") is stopped, or with "none" the sender's
  // application merely sleeps twice the timeout before it sends.
  void run(const std::string& victim) {
    if (getenv("PONTE_TEST_BACKEND") && std::string(getenv("PONTE_TEST_BACKEND")) == "verbs")
      GTEST_SKIP() << "runs over libfabric's tcp;ofi_rxm and shm only";
    Peer recv({"recv"}, env()), send({"send"}, env());
    ASSERT_TRUE(recv.started() && send.started());
    std::vector<uint8_t> handle;
    ASSERT_TRUE(recv.channel().recv(&handle, 30000) && handle.size() == kHandleMaxSize) << "no handle";
    ASSERT_TRUE(send.channel().send(handle));
    for (Peer* p : {&recv, &send}) {
      std::string round1;
      ASSERT_TRUE(p->channel().recv_str(&round1, 60000)) << "round 1 did not end";
      const Report r = parse(round1.substr(round1.find(' ') + 1));
      EXPECT_EQ(r.ok, kReqs) << round1;
      EXPECT_EQ(r.bad, 0) << "received bytes differ: " << round1;
    }
    ASSERT_TRUE(recv.channel().send_str("round2") && send.channel().send_str("round2"));
    std::string posted;
    ASSERT_TRUE(recv.channel().recv_str(&posted, 30000) && posted == "posted 8") << posted;
    if (victim == "none") {
      std::this_thread::sleep_for(std::chrono::milliseconds(2 * kTimeoutMs));  // its worker runs on
      ASSERT_TRUE(send.channel().send_str("post"));
      for (Peer* p : {&send, &recv}) {
        std::string text;
        ASSERT_TRUE(p->channel().recv_str(&text, 60000)) << "no report";
        if (text.rfind("posted", 0) == 0) {
          ASSERT_TRUE(p->channel().recv_str(&text, 60000)) << "no report";
        }
        const Report r = parse(text);
        printf("[ sender slept ] %s: %s: %s\n", GetParam().name.c_str(), p == &send ? "sender" : "receiver",
               text.c_str());
        EXPECT_EQ(r.ok, kReqs) << "a request of a slow (not stopped) peer failed: " << text;
        EXPECT_EQ(r.bad, 0) << text;
        p->channel().send_str("bye");
      }
      return;
    }
    Peer& stopped = victim == "recv" ? recv : send;
    Peer& live = victim == "recv" ? send : recv;
    if (victim == "send") {  // stopped with the receiver's 8 receives posted, before it sends any
      ASSERT_TRUE(stopped.signal(SIGSTOP));
      ASSERT_TRUE(send.channel().send_str("post"));  // read once it runs again
    } else {  // stopped by the sender once its first send is posted (again here: a no-op)
      ASSERT_TRUE(send.channel().send_str("post stop " + std::to_string(recv.pid())));
      ASSERT_TRUE(send.channel().recv_str(&posted, static_cast<int>(kTimeoutMs) + 60000) &&
                  posted.rfind("posted ", 0) == 0 && std::atoi(posted.c_str() + 7) >= 1)
          << "the sender did not post its first send, or could not stop the receiver: " << posted;
      printf("[ recv stopped ] %s: sender: %s before the stop was seen\n", GetParam().name.c_str(), posted.c_str());
      ASSERT_TRUE(stopped.signal(SIGSTOP));
    }
    auto t0 = Clock::now();
    if (const auto at = posted.find("stopped_ns="); at != std::string::npos)  // the sender's stop
      t0 = Clock::time_point(std::chrono::nanoseconds(std::atoll(posted.c_str() + at + 11)));

    std::string text;
    ASSERT_TRUE(live.channel().recv_str(&text, static_cast<int>(kTimeoutMs) + 30000))
        << "the live side's requests did not end (a hang)";
    const Report r = parse(text);
    const long long ended_ms = ms_after(r.err > 0 ? r.last_err_ns : r.last_end_ns, t0);
    printf("[ %s stopped ] %s: live side: %s (last request ended %lld ms after the stop)\n", victim.c_str(),
           GetParam().name.c_str(), text.c_str(), ended_ms);
    if (r.err == 0 && r.ok == kReqs && r.bad == 0 && retry_if_nothing_in_flight_) {
      // Everything arrived before the stop (two busy cores can delay the sender's posting that
      // long): the scenario did not happen. The caller runs it again; the last try is strict.
      nothing_in_flight_ = true;
      EXPECT_TRUE(stopped.signal(SIGCONT));
      EXPECT_TRUE(stopped.channel().recv_str(&text, static_cast<int>(kTimeoutMs) + 30000)) << "no report";
      live.channel().send_str("bye");
      stopped.channel().send_str("bye");
      return;
    }
    EXPECT_EQ(r.ok + r.err, kReqs) << text;
    EXPECT_GE(r.err, 1) << "nothing was in flight when the peer stopped: " << text;
    EXPECT_EQ(r.bad, 0) << "received bytes differ: " << text;
    EXPECT_LT(ended_ms, kTimeoutMs + kSlack.count()) << text;
    EXPECT_LT(r.dereg_ms, 1000) << text;
    EXPECT_LT(r.close_ms, 1000) << text;

    // The stopped side runs again: its requests end too (with errors: its peer is gone for it).
    ASSERT_TRUE(stopped.signal(SIGCONT));
    const auto t1 = Clock::now();
    if (victim == "send") {
      ASSERT_TRUE(send.channel().recv_str(&posted, 30000)) << "no word from the resumed sender";
      printf("[ send stopped ] %s: resumed sender: %s (its peer is dead to it)\n", GetParam().name.c_str(),
             posted.c_str());
    }
    ASSERT_TRUE(stopped.channel().recv_str(&text, static_cast<int>(kTimeoutMs) + 30000))
        << "the resumed side's requests did not end";
    const Report s = parse(text);
    printf("[ %s stopped ] %s: resumed side: %s (last ended %lld ms after SIGCONT)\n", victim.c_str(),
           GetParam().name.c_str(), text.c_str(), ms_after(s.last_end_ns, t1));
    EXPECT_EQ(s.ok + s.err, kReqs) << text;
    EXPECT_EQ(s.bad, 0) << text;
    if (s.err > 0) {  // what failed failed in time (what arrived meanwhile is verified above)
      EXPECT_LT(ms_after(s.last_err_ns, t1),
                kTimeoutMs + kSlack.count()) << text;
    }
    live.channel().send_str("bye");
    stopped.channel().send_str("bye");
  }
};

TEST_P(PluginStopped, ReceiverStoppedTheSendersRequestsErrorInTime) {
  // Up to three tries for the sender's requests to be in flight when the receiver stops; the
  // third asserts that they were.
  for (int attempt = 0; attempt < 3; ++attempt) {
    retry_if_nothing_in_flight_ = attempt < 2;
    nothing_in_flight_ = false;
    run("recv");
    if (!nothing_in_flight_ || HasFailure()) return;
    printf("[ recv stopped ] %s: nothing was in flight at the stop; again\n", GetParam().name.c_str());
  }
}
TEST_P(PluginStopped, SenderStoppedTheReceiversRequestsErrorInTime) { run("send"); }
TEST_P(PluginStopped, SenderSleepingTwiceTheTimeoutIsWaitedFor) { run("none"); }

INSTANTIATE_TEST_SUITE_P(Providers, PluginStopped,
                         ::testing::Values(Provider{"tcp_rxm", "tcp;ofi_rxm"}, Provider{"shm", "shm"}),
                         [](const ::testing::TestParamInfo<Provider>& i) { return i.param.name; });

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "--ponte-peer") return plugin_peer(argc, argv);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
