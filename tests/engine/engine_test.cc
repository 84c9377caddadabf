// Engine integration tests: real processes, real providers (tcp;ofi_rxm and shm here; verbs in the
// SoftRoCE guest with PONTE_TEST_BACKEND=verbs), every operation verified byte for byte.
#include <dirent.h>
#include <gtest/gtest.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <thread>

#include "core/config.h"
#include "core/engine.h"
#include "core/group_address.h"
#include "tests/common/child_exit.h"
#include "tests/common/completion_counter.h"
#include "tests/common/loopback.h"
#include "tests/common/peer_process.h"
#include "tests/common/region_peer.h"
#include "tests/common/setups.h"

using namespace ponte;
using namespace ponte::test;
using namespace std::chrono_literals;

namespace {

constexpr size_t kRegion = (64u << 20) + 4096;

uint8_t pattern(uint32_t seed, size_t i) { return static_cast<uint8_t>(seed * 131 + i * 7 + (i >> 9)); }
void fill(uint8_t* p, size_t len, uint32_t seed, size_t pat_off = 0) {
  for (size_t i = 0; i < len; i++) p[i] = pattern(seed, pat_off + i);
}
// Returns the first mismatching index, or SIZE_MAX. It reads memory that the NIC (here a software
// provider's thread) writes; for plain writes the test polls it until the bytes land, which is
// unsynchronized by nature, as with a real NIC: TSan is told not to instrument it.
__attribute__((no_sanitize("thread"))) size_t check(const uint8_t* p, size_t len, uint32_t seed, size_t pat_off = 0) {
  for (size_t i = 0; i < len; i++)
    if (p[i] != pattern(seed, pat_off + i)) return i;
  return SIZE_MAX;
}

Config test_config(const Setup& s) {
  Config c = global_config();
  c.backend = s.backend;
  if (!s.provider.empty()) c.fabric_provider = s.provider;
  c.timeout_ms = 5000;
  c.ctrl_addr = "127.0.0.1";
  return c;
}

// Devices for side 'A' (the test) or 'B' (peers): PONTE_TEST_DEVS_A/B name them (the SoftRoCE guest:
// rxe0,rxe2 / rxe1,rxe3); otherwise device 0, opened once per NIC.
std::vector<size_t> pick_devices(const Config& cfg, char side, int nics) {
  const char* names = getenv(side == 'A' ? "PONTE_TEST_DEVS_A" : "PONTE_TEST_DEVS_B");
  if (!names) names = getenv(side == 'A' ? "PONTE_RXE_DEVS_A" : "PONTE_RXE_DEVS_B");  // the SoftRoCE guest
  std::vector<size_t> out;
  if (names && *names) {
    auto be = cfg.backend == BackendChoice::kVerbs ? open_verbs_backend(cfg) : open_fabric_backend(cfg);
    if (be.ok()) {
      std::vector<size_t> named;
      std::stringstream ss(names);
      std::string n;
      while (std::getline(ss, n, ','))
        for (size_t i = 0; i < (*be)->devices().size(); i++)
          if ((*be)->devices()[i].name.rfind(n, 0) == 0) named.push_back(i);
      for (int k = 0; k < nics && !named.empty(); k++) out.push_back(named[k % named.size()]);
    }
  }
  while (static_cast<int>(out.size()) < nics) out.push_back(0);
  return out;
}

Result<std::unique_ptr<Engine>> make_engine(const Setup& s, char side, int nics, uint32_t timeout_ms = 5000,
                                            uint32_t poller_sleep_us = 0, bool idle_wake = false) {
  EngineOptions o;
  o.config = test_config(s);
  if (poller_sleep_us) o.config.poller_sleep_us = poller_sleep_us;
  o.config.idle_wake_on_data = idle_wake;
  // SoftRoCE under QEMU moves tens of MB/s: a 64 MiB write needs more than 5 s there.
  o.config.timeout_ms = s.backend == BackendChoice::kVerbs ? 6 * timeout_ms : timeout_ms;
  o.groups = {pick_devices(o.config, side, nics)};
  return Engine::create(o);
}

// Two engines of one setup, one NIC each, and A's connect() to B (returned at once; the connection
// completes in the background).
struct ConnectedPair {
  std::unique_ptr<Engine> a, b;
  PeerId a_to_b = 0;
};
void open_pair(const Setup& s, ConnectedPair* p, bool idle_wake = false) {
  auto a = make_engine(s, 'A', 1, 5000, 0, idle_wake);
  auto b = make_engine(s, 'B', 1, 5000, 0, idle_wake);
  ASSERT_TRUE(a.ok() && b.ok());
  p->a = std::move(a).value();
  p->b = std::move(b).value();
  auto c = p->a->connect(0, p->b->address(0));
  ASSERT_TRUE(c.ok()) << c.status().message();
  p->a_to_b = *c;
}

// ---------------------------------------------------------------- the peer process
// Commands (text lines over the channel), each answered "ok" or an error text:
//   expect V N       wait for N immediates of value V        expectw V LEN N: N writes of LEN
//   arm V LEN N      as expectw, answered once armed           wait: the armed counter's verdict
//   check OFF LEN SEED PATOFF   verify the buffer (retries until a deadline: plain writes)
//   fill OFF LEN SEED           write a pattern into the buffer
//   recv N                      wait for N two-sided messages (each verified by its seed)
//   exit

struct RecvState {
  std::atomic<int> good{0};
  std::atomic<int> bad{0};
};

void on_recv(void* arg, PeerId, std::span<const uint8_t> data) {
  auto* st = static_cast<RecvState*>(arg);
  if (data.size() < 4) {
    st->bad++;
    return;
  }
  uint32_t seed;
  memcpy(&seed, data.data(), 4);
  if (check(data.data() + 4, data.size() - 4, seed) == SIZE_MAX) st->good++;
  else st->bad++;
}

int run_peer(int argc, char** argv) {
  Channel ch(3);
  if (argc < 4) return 2;
  Setup s = setup_by_name(argv[2]);
  int nics = atoi(argv[3]);
  auto eng = make_engine(s, 'B', nics);
  if (!eng.ok()) {
    ch.send_str(std::string("engine: ") + eng.status().message());
    return 3;
  }
  Engine& e = **eng;
  static uint8_t* buf = static_cast<uint8_t*>(aligned_alloc(4096, kRegion));
  memset(buf, 0, kRegion);
  auto mr = e.register_memory(0, buf, kRegion);
  if (!mr.ok()) {
    ch.send_str(std::string("register: ") + mr.status().message());
    return 4;
  }
  RecvState rs;
  e.set_recv_handler(0, on_recv, &rs);
  ch.send(e.address(0));
  ch.send(mr->remote().encode());
  auto peer_of_parent = [&]() -> PeerId {
    for (int i = 0; i < 5000; i++) {
      auto ps = e.peers(0);
      for (PeerId p : ps)
        if (e.peer_ready(0, p)) return p;
      std::this_thread::sleep_for(1ms);
    }
    return kAnyPeer;
  };
  std::unique_ptr<Flag> armed;
  std::string cmd;
  while (ch.recv_str(&cmd, 120000)) {
    std::istringstream in(cmd);
    std::string op;
    in >> op;
    if (op == "exit") return e.deregister(*mr).ok() ? 0 : 5;
    if (op == "expect" || op == "expectw") {
      uint32_t v = 0, n = 0;
      size_t len = 0;
      in >> v;
      if (op == "expectw") in >> len;
      in >> n;
      PeerId from = peer_of_parent();
      if (op == "expectw") n *= e.imms_per_write(0, from, len);
      Flag f;
      Status st = e.expect_imm(0, v, n, from == kAnyPeer ? kAnyPeer : from, f.notify());
      if (st.ok()) st = f.wait(30s);
      ch.send_str(st.ok() ? "ok" : std::string("expect: ") + st.message());
    } else if (op == "arm") {
      uint32_t v = 0, n = 0;
      size_t len = 0;
      in >> v >> len >> n;
      PeerId from = peer_of_parent();
      if (from == kAnyPeer) {
        ch.send_str("arm: the parent is not connected");
        continue;
      }
      armed = std::make_unique<Flag>();
      Status st = e.expect_imm(0, v, n * e.imms_per_write(0, from, len), from, armed->notify());
      ch.send_str(st.ok() ? "ok" : std::string("arm: ") + st.message());
    } else if (op == "wait") {
      Status st = armed ? armed->wait(30s) : Status(Code::kInvalidArgument, "nothing armed");
      ch.send_str(st.ok() ? "ok" : std::string("wait: ") + st.message());
    } else if (op == "check") {
      size_t off, len, patoff;
      uint32_t seed;
      in >> off >> len >> seed >> patoff;
      size_t bad = SIZE_MAX;
      for (int tries = 0; tries < 2000; tries++) {
        bad = check(buf + off, len, seed, patoff);
        if (bad == SIZE_MAX) break;
        std::this_thread::sleep_for(5ms);
      }
      ch.send_str(bad == SIZE_MAX ? "ok" : "mismatch at byte " + std::to_string(bad) + " of " + std::to_string(len));
    } else if (op == "fill") {
      size_t off, len;
      uint32_t seed;
      in >> off >> len >> seed;
      fill(buf + off, len, seed);
      ch.send_str("ok");
    } else if (op == "recv") {
      int n = 0;
      in >> n;
      auto deadline = std::chrono::steady_clock::now() + 30s;
      while (rs.good + rs.bad < n && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
      ch.send_str(rs.bad == 0 && rs.good == n ? "ok"
                                               : "recv: good " + std::to_string(rs.good) + " bad " + std::to_string(rs.bad));
      rs.good = 0;
    } else {
      ch.send_str("unknown command " + op);
    }
  }
  return 0;
}

// ---------------------------------------------------------------- the test side

// The peer process of these tests: its address and region, then commands (tests/common/region_peer.h).
class Peer : public RegionPeer {
 public:
  Peer(const Setup& s, int nics, const std::vector<std::string>& env = {})
      : RegionPeer({s.name, std::to_string(nics)}, env) {}
};

class EngineTest : public ::testing::TestWithParam<Setup> {
 protected:
  // Starts `peers` peer processes and this side's engine with `nics` NICs, connected to each.
  void start(int peers = 1, int nics = 1) {
    for (int i = 0; i < peers; i++) peers_.push_back(std::make_unique<Peer>(GetParam(), nics));
    start_engine(nics);
    if (HasFatalFailure()) return;
    for (auto& p : peers_) {
      std::string err;
      ASSERT_TRUE(p->start(&err)) << err;
      auto id = eng_->connect(0, p->address());
      ASSERT_TRUE(id.ok()) << id.status().message();
      ids_.push_back(*id);
    }
    for (PeerId id : ids_) {
      auto deadline = std::chrono::steady_clock::now() + 10s;
      while (!eng_->peer_ready(0, id) && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
      ASSERT_TRUE(eng_->peer_ready(0, id)) << "handshake with peer " << id << " did not complete";
    }
  }
  // This side alone: its engine with `nics` NICs and the registered source region.
  void start_engine(int nics) {
    auto e = make_engine(GetParam(), 'A', nics, 5000, poller_sleep_us_);
    ASSERT_TRUE(e.ok()) << e.status().message();
    eng_ = std::move(e.value());
    src_ = static_cast<uint8_t*>(aligned_alloc(4096, kRegion));
    ASSERT_NE(src_, nullptr);
    auto mr = eng_->register_memory(0, src_, kRegion);
    ASSERT_TRUE(mr.ok()) << mr.status().message();
    mr_ = std::move(mr.value());
  }
  void TearDown() override {
    for (auto& p : peers_) p->cmd("exit", 5000);
    if (eng_ && mr_.id) {
      EXPECT_TRUE(eng_->deregister(mr_).ok());
    }
    eng_.reset();
    peers_.clear();
    free(src_);
  }
  std::unique_ptr<Engine> eng_;
  std::vector<std::unique_ptr<Peer>> peers_;
  std::vector<PeerId> ids_;
  uint8_t* src_ = nullptr;
  MemoryRegion mr_;
  uint32_t poller_sleep_us_ = 0;  // this side's PONTE_POLLER_SLEEP_US (0: the default)
};

using Counter = CompletionCounter;

TEST_P(EngineTest, WriteWithImmediateAllSizesVerified) {
  start();
  const size_t sizes[] = {0, 1, 4093, 64 << 10, 1 << 20, 16 << 20, 64 << 20};
  uint32_t v = 100;
  for (size_t len : sizes) {
    uint32_t seed = static_cast<uint32_t>(len + 3);
    fill(src_ + 4096, len, seed);
    Flag f;
    ASSERT_TRUE(eng_->write_imm(0, ids_[0], LocalSlice{&mr_, 4096, len}, peers_[0]->region(), 0, v, f.notify()).ok());
    EXPECT_EQ(peers_[0]->cmd("expectw " + std::to_string(v) + " " + std::to_string(len) + " 1"), "ok") << len;
    ASSERT_TRUE(f.wait(30s).ok()) << f.status().message();
    EXPECT_EQ(peers_[0]->cmd("check 0 " + std::to_string(len) + " " + std::to_string(seed) + " 0"), "ok") << len;
    v++;
  }
}

TEST_P(EngineTest, PlainWriteThenImmediateAlone) {
  start();
  fill(src_, 1 << 20, 9);
  Flag w, i;
  ASSERT_TRUE(eng_->write(0, ids_[0], LocalSlice{&mr_, 0, 1 << 20}, peers_[0]->region(), 8192, w.notify()).ok());
  ASSERT_TRUE(w.wait(30s).ok()) << w.status().message();
  ASSERT_TRUE(eng_->imm(0, ids_[0], 4242, i.notify()).ok());
  EXPECT_EQ(peers_[0]->cmd("expect 4242 1"), "ok");
  EXPECT_TRUE(i.wait(30s).ok());
  EXPECT_EQ(peers_[0]->cmd("check 8192 1048576 9 0"), "ok");
}

TEST_P(EngineTest, ThousandsInFlight) {
  start();
  constexpr int kOps = 4000;
  constexpr size_t kLen = 4096;
  fill(src_, kOps * kLen, 21);
  Counter c;
  for (int k = 0; k < kOps; k++) {
    Status st;
    do {
      st = eng_->write_imm(0, ids_[0], LocalSlice{&mr_, k * kLen, kLen}, peers_[0]->region(), k * kLen, 5, c.notify());
      if (st.code() == Code::kAgain) std::this_thread::sleep_for(10us);
    } while (st.code() == Code::kAgain);
    ASSERT_TRUE(st.ok()) << st.message();
  }
  EXPECT_EQ(peers_[0]->cmd("expectw 5 4096 " + std::to_string(kOps)), "ok");
  ASSERT_TRUE(c.wait_total(kOps, 30s));
  EXPECT_EQ(c.failed, 0);
  EXPECT_EQ(peers_[0]->cmd("check 0 " + std::to_string(kOps * kLen) + " 21 0"), "ok");
}

TEST_P(EngineTest, StripesOverTwoNics) {
  start(1, 2);
  EXPECT_EQ(eng_->nics_in_group(0), 2);
  EXPECT_EQ(eng_->peer_nics(0, ids_[0]), 2);
  EXPECT_EQ(eng_->imms_per_write(0, ids_[0], 8 << 20), 2u);
  EXPECT_EQ(eng_->imms_per_write(0, ids_[0], 4096), 1u);
  for (size_t len : {size_t{8 << 20} + 100, size_t{64 << 20}}) {
    uint32_t seed = static_cast<uint32_t>(len);
    fill(src_, len, seed);
    Flag f;
    ASSERT_TRUE(eng_->write_imm(0, ids_[0], LocalSlice{&mr_, 0, len}, peers_[0]->region(), 0, 77, f.notify()).ok());
    EXPECT_EQ(peers_[0]->cmd("expectw 77 " + std::to_string(len) + " 1"), "ok");
    ASSERT_TRUE(f.wait(30s).ok()) << f.status().message();
    EXPECT_EQ(peers_[0]->cmd("check 0 " + std::to_string(len) + " " + std::to_string(seed) + " 0"), "ok");
  }
}

TEST_P(EngineTest, SendReceivesIntoEngineBuffers) {
  start();
  constexpr int kMsgs = 200;
  Counter c;
  size_t off = 0;
  for (int k = 0; k < kMsgs; k++) {
    size_t len = 4 + (static_cast<size_t>(k) * 997) % (64 * 1024 - 4);
    uint32_t seed = 1000 + k;
    memcpy(src_ + off, &seed, 4);
    fill(src_ + off + 4, len - 4, seed);
    Status st;
    do {
      st = eng_->send(0, ids_[0], LocalSlice{&mr_, off, len}, c.notify());
    } while (st.code() == Code::kAgain);
    ASSERT_TRUE(st.ok()) << st.message();
    off += len;
  }
  ASSERT_TRUE(c.wait_total(kMsgs, 30s));
  EXPECT_EQ(c.failed, 0);
  EXPECT_EQ(peers_[0]->cmd("recv " + std::to_string(kMsgs)), "ok");
  // Larger than a receive buffer: refused up front.
  Flag f;
  EXPECT_EQ(eng_->send(0, ids_[0], LocalSlice{&mr_, 0, 1 << 20}, f.notify()).code(), Code::kInvalidArgument);
}

TEST_P(EngineTest, ReadFetchesRemoteBytes) {
  start();
  EXPECT_EQ(peers_[0]->cmd("fill 4096 1048576 55"), "ok");
  memset(src_, 0, 1 << 20);
  Flag f;
  ASSERT_TRUE(eng_->read(0, ids_[0], LocalSlice{&mr_, 0, 1 << 20}, peers_[0]->region(), 4096, f.notify()).ok());
  ASSERT_TRUE(f.wait(30s).ok()) << f.status().message();
  EXPECT_EQ(check(src_, 1 << 20, 55), SIZE_MAX);
}

TEST_P(EngineTest, PagedWriteMovesEachPage) {
  start();
  constexpr size_t kPage = 16384;
  fill(src_, 64 * kPage, 31);
  std::vector<uint32_t> src_pages = {5, 1, 9, 63, 0, 17, 2, 40};
  std::vector<uint32_t> dst_pages = {0, 3, 6, 9, 12, 15, 18, 21};
  uint32_t imm = 808;
  Flag f;
  ASSERT_TRUE(eng_->paged_write(0, ids_[0], mr_, src_pages, peers_[0]->region(), dst_pages, kPage, &imm, f.notify()).ok());
  EXPECT_EQ(peers_[0]->cmd("expect 808 " + std::to_string(src_pages.size())), "ok");
  ASSERT_TRUE(f.wait(30s).ok());
  for (size_t i = 0; i < src_pages.size(); i++)
    EXPECT_EQ(peers_[0]->cmd("check " + std::to_string(dst_pages[i] * kPage) + " " + std::to_string(kPage) + " 31 " +
                             std::to_string(src_pages[i] * kPage)),
              "ok")
        << "page " << i;
  // A page past either region is refused before anything moves.
  std::vector<uint32_t> bad = {100000};
  std::vector<uint32_t> one = {0};
  EXPECT_EQ(eng_->paged_write(0, ids_[0], mr_, bad, peers_[0]->region(), one, kPage, &imm, f.notify()).code(),
            Code::kInvalidArgument);
  EXPECT_EQ(eng_->paged_write(0, ids_[0], mr_, one, peers_[0]->region(), bad, kPage, &imm, f.notify()).code(),
            Code::kInvalidArgument);
}

TEST_P(EngineTest, ScatterAndBarrierReachEveryPeer) {
  start(2);
  fill(src_, 3 << 20, 44);
  std::vector<ScatterTarget> targets = {
      {ids_[0], 0, 1 << 20, &peers_[0]->region(), 0},
      {ids_[1], 1 << 20, 1 << 20, &peers_[1]->region(), 4096},
      {ids_[0], 2 << 20, 1000, &peers_[0]->region(), 2 << 20},
  };
  uint32_t imm = 606;
  Flag f;
  ASSERT_TRUE(eng_->scatter(0, mr_, targets, &imm, f.notify()).ok());
  EXPECT_EQ(peers_[0]->cmd("expect 606 2"), "ok");
  EXPECT_EQ(peers_[1]->cmd("expect 606 1"), "ok");
  ASSERT_TRUE(f.wait(30s).ok());
  EXPECT_EQ(peers_[0]->cmd("check 0 1048576 44 0"), "ok");
  EXPECT_EQ(peers_[1]->cmd("check 4096 1048576 44 1048576"), "ok");
  EXPECT_EQ(peers_[0]->cmd("check 2097152 1000 44 2097152"), "ok");
  Flag b;
  ASSERT_TRUE(eng_->barrier(0, ids_, 707, b.notify()).ok());
  EXPECT_EQ(peers_[0]->cmd("expect 707 1"), "ok");
  EXPECT_EQ(peers_[1]->cmd("expect 707 1"), "ok");
  EXPECT_TRUE(b.wait(30s).ok());
}

// A worker core the caller names that this process may not run on is refused at create(), naming
// the setting; pinned to it, the worker would run unpinned with a log line only.
TEST_P(EngineTest, ACoreTheProcessMayNotRunOnIsRefused) {
  EngineOptions o;
  o.config = test_config(GetParam());
  o.groups = {pick_devices(o.config, 'A', 1)};
  o.config.progress_cores = {CPU_SETSIZE};
  auto e = Engine::create(o);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), Code::kInvalidArgument);
  EXPECT_NE(std::string(e.status().message()).find("PONTE_PROGRESS_CORES: this process may not run on core"),
            std::string::npos)
      << e.status().message();
  o.config.progress_cores.clear();
  o.group_cores = {{-1}};
  e = Engine::create(o);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(std::string(e.status().message()).find("group_cores: this process may not run on core -1"),
            std::string::npos)
      << e.status().message();
  cpu_set_t allowed;
  ASSERT_EQ(sched_getaffinity(0, sizeof(allowed), &allowed), 0);
  int usable = 0;
  while (!CPU_ISSET(usable, &allowed)) ++usable;
  o.group_cores = {{usable}};
  e = Engine::create(o);
  EXPECT_TRUE(e.ok()) << e.status().message();
}

TEST_P(EngineTest, ConnectsToItself) {
  auto e = make_engine(GetParam(), 'A', 1);
  ASSERT_TRUE(e.ok()) << e.status().message();
  Engine& eng = **e;
  std::vector<uint8_t> a(1 << 20), b(1 << 20, 0);
  auto ma = eng.register_memory(0, a.data(), a.size());
  auto mb = eng.register_memory(0, b.data(), b.size());
  ASSERT_TRUE(ma.ok() && mb.ok());
  auto self = eng.connect(0, eng.address(0));
  ASSERT_TRUE(self.ok()) << self.status().message();
  fill(a.data(), a.size(), 3);
  Flag arrived, written;
  ASSERT_TRUE(eng.expect_imm(0, 11, eng.imms_per_write(0, *self, a.size()), kAnyPeer, arrived.notify()).ok());
  ASSERT_TRUE(eng.write_imm(0, *self, LocalSlice{&*ma, 0, a.size()}, mb->remote(), 0, 11, written.notify()).ok());
  ASSERT_TRUE(written.wait(30s).ok()) << written.status().message();
  ASSERT_TRUE(arrived.wait(30s).ok()) << arrived.status().message();
  EXPECT_EQ(check(b.data(), b.size(), 3), SIZE_MAX);
  EXPECT_TRUE(eng.deregister(*ma).ok());
  EXPECT_TRUE(eng.deregister(*mb).ok());
}

// cancel_expectations ends the expectations waiting at the call with kCancelled, well before their
// timeout, and leaves the counters working: one submitted after it is met by the next immediate.
TEST_P(EngineTest, CancelledExpectationsEndAtOnceAndLaterOnesStillCount) {
  auto e = make_engine(GetParam(), 'A', 1, 60000);
  ASSERT_TRUE(e.ok()) << e.status().message();
  Engine& eng = **e;
  auto self = eng.connect(0, eng.address(0));
  ASSERT_TRUE(self.ok()) << self.status().message();
  Flag a, b, later, sent;
  ASSERT_TRUE(eng.expect_imm(0, 21, 1, kAnyPeer, a.notify()).ok());
  ASSERT_TRUE(eng.expect_imm(0, 22, 3, *self, b.notify()).ok());
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(eng.cancel_expectations(0).ok());
  ASSERT_TRUE(a.wait(10s).code() == Code::kCancelled) << a.status().message();
  ASSERT_TRUE(b.wait(10s).code() == Code::kCancelled) << b.status().message();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
  ASSERT_TRUE(eng.expect_imm(0, 21, 1, kAnyPeer, later.notify()).ok());
  ASSERT_TRUE(eng.imm(0, *self, 21, sent.notify()).ok());
  ASSERT_TRUE(sent.wait(30s).ok()) << sent.status().message();
  ASSERT_TRUE(later.wait(30s).ok()) << later.status().message();
  EXPECT_EQ(eng.cancel_expectations(99).code(), Code::kInvalidArgument);
}

// A 4 KiB write each way between engines[0] (to its peer ids[0]) and engines[1] (ids[1]) lands,
// verified; neither peer dies. The wait is the engine's verbs timeout and more: an RC write
// whose packets are lost is retried, not failed, until then.
void expect_write_each_way(Engine* const engines[2], const PeerId ids[2], uint32_t seed, const std::string& what) {
  for (int me = 0; me < 2; me++) {
    Engine& e = *engines[me];
    std::vector<uint8_t> src(4096), dst(4096, 0);
    fill(src.data(), src.size(), seed);
    auto ms = e.register_memory(0, src.data(), src.size());
    auto md = engines[1 - me]->register_memory(0, dst.data(), dst.size());
    ASSERT_TRUE(ms.ok() && md.ok());
    ASSERT_FALSE(e.peer_dead(0, ids[me])) << what << ": side " << me << "'s peer died after the handshake";
    Flag written;
    ASSERT_TRUE(e.write(0, ids[me], LocalSlice{&*ms, 0, src.size()}, md->remote(), 0, written.notify()).ok());
    ASSERT_TRUE(written.wait(40s).ok()) << what << " side " << me << ": " << written.status().message();
    const auto deadline = std::chrono::steady_clock::now() + 5s;
    while (check(dst.data(), dst.size(), seed) != SIZE_MAX && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(1ms);
    EXPECT_EQ(check(dst.data(), dst.size(), seed), SIZE_MAX) << what << " side " << me;
    EXPECT_FALSE(engines[1 - me]->peer_dead(0, ids[1 - me])) << what;
    EXPECT_TRUE(e.deregister(*ms).ok());
    EXPECT_TRUE(engines[1 - me]->deregister(*md).ok());
  }
}

// Two groups connect to each other at once, each from a thread that polls (NCCL's proxy connects
// both ways of a ring this way): the other side's connection may arrive while our own connect
// still waits in the queue, and must then be taken as the second control connection, never
// closed (it was, and the other side's peer died: "peer closed its control connection").
TEST_P(EngineTest, CrossConnectFromPollingThreadsKeepsBothConnections) {
  constexpr int kRounds = 12;
  for (int round = 0; round < kRounds; round++) {
    auto a = make_engine(GetParam(), 'A', 1);
    auto b = make_engine(GetParam(), 'B', 1);
    ASSERT_TRUE(a.ok() && b.ok());
    Engine* engines[2] = {a->get(), b->get()};
    std::atomic<int> go{0};
    Result<PeerId> ids[2] = {Status(Code::kInternal, "not run"), Status(Code::kInternal, "not run")};
    bool ready[2] = {false, false};
    auto side = [&](int me) {
      Engine& e = *engines[me];
      const std::vector<uint8_t> theirs = engines[1 - me]->address(0);
      go.fetch_add(1);
      while (go.load() < 2) e.progress(0);
      // Stagger the two connects by up to ~2 ms so the other's connection lands in every phase
      // of ours: before it is queued, while it waits in the queue, after it started.
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(me ? round * 170 : 0);
      while (std::chrono::steady_clock::now() < until) e.progress(0);
      ids[me] = e.connect(0, theirs);
      if (!ids[me].ok()) return;
      const auto deadline = std::chrono::steady_clock::now() + 10s;
      while (std::chrono::steady_clock::now() < deadline && !e.peer_dead(0, *ids[me])) {
        e.progress(0);
        if (e.peer_ready(0, *ids[me])) {
          ready[me] = true;
          break;
        }
        std::this_thread::yield();
      }
    };
    std::thread ta(side, 0), tb(side, 1);
    ta.join();
    tb.join();
    for (int me = 0; me < 2; me++) {
      ASSERT_TRUE(ids[me].ok()) << ids[me].status().message();
      ASSERT_TRUE(ready[me]) << "round " << round << ": side " << me << "'s peer "
                             << (engines[me]->peer_dead(0, *ids[me]) ? "died" : "never became ready");
    }
    // Both connections stay up: a write each way lands.
    const PeerId peer_ids[2] = {*ids[0], *ids[1]};
    ASSERT_NO_FATAL_FAILURE(expect_write_each_way(engines, peer_ids, 40 + round, "round " + std::to_string(round)));
  }
}

// The other end's connection arrived before our own connect(): connect() returns that peer. It
// used to make a second peer for the same group, whose QP the other end never connected to (it
// folds every connection from one group into one peer): on verbs that peer's writes were never
// answered (CrossConnectFromPollingThreadsKeepsBothConnections failed 3 rounds in about 400 in
// the SoftRoCE guest, when one side's connect came late).
TEST_P(EngineTest, ConnectAfterThePeerConnectedReturnsThatPeer) {
  ConnectedPair pair;
  ASSERT_NO_FATAL_FAILURE(open_pair(GetParam(), &pair));
  Engine* engines[2] = {pair.a.get(), pair.b.get()};
  const PeerId a_to_b = pair.a_to_b;
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  while (engines[1]->peers(0).empty() && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(1ms);
  ASSERT_EQ(engines[1]->peers(0).size(), 1u) << "A's connection never reached B";
  const PeerId inbound = engines[1]->peers(0)[0];
  auto b_to_a = engines[1]->connect(0, engines[0]->address(0));
  ASSERT_TRUE(b_to_a.ok()) << b_to_a.status().message();
  EXPECT_EQ(*b_to_a, inbound) << "B made a second peer for A";
  auto again = engines[0]->connect(0, engines[1]->address(0));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, a_to_b) << "A made a second peer for B";
  const PeerId ids[2] = {a_to_b, *b_to_a};
  for (int me = 0; me < 2; me++) {
    while (!engines[me]->peer_ready(0, ids[me]) && !engines[me]->peer_dead(0, ids[me]) &&
           std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(1ms);
    ASSERT_TRUE(engines[me]->peer_ready(0, ids[me])) << "side " << me << "'s peer never became ready";
  }
  ASSERT_NO_FATAL_FAILURE(expect_write_each_way(engines, ids, 77, "after the late connect"));
  EXPECT_EQ(engines[1]->peers(0).size(), 1u);
}

// Waits until engine e has n inbound peers (connections from other groups) and returns them.
std::vector<PeerId> wait_inbound(Engine& e, size_t n) {
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  while (e.peers(0).size() < n && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
  return e.peers(0);
}

// How often this process's workers ("ponte-g<N>" threads) went to sleep so far: the sum of their
// voluntary context switches, how many there are, and the CPU time they used (clock ticks). A worker
// whose sleeps end at once (a wait object that stays readable) sleeps seldom too, but spins.
struct WorkerStats {
  uint64_t sleeps = 0;
  int workers = 0;
  uint64_t cpu_ticks = 0;
};
WorkerStats worker_sleeps() {
  uint64_t sleeps = 0, cpu_ticks = 0;
  int workers = 0;
  std::unique_ptr<DIR, int (*)(DIR*)> dir(opendir("/proc/self/task"), closedir);
  if (!dir) return {0, 0};
  while (dirent* d = readdir(dir.get())) {
    if (d->d_name[0] == '.') continue;
    const std::string task = std::string("/proc/self/task/") + d->d_name;
    std::string comm;
    std::ifstream(task + "/comm") >> comm;
    if (comm.rfind("ponte-g", 0) != 0) continue;
    workers++;
    std::ifstream st(task + "/status");
    for (std::string line; std::getline(st, line);)
      if (line.rfind("voluntary_ctxt_switches:", 0) == 0) sleeps += std::stoull(line.substr(24));
    // /proc/<pid>/task/<tid>/stat: utime and stime are the 14th and 15th fields; the 2nd, (comm),
    // holds no space here ("ponte-g0").
    std::ifstream stat(task + "/stat");
    std::string field;
    uint64_t utime = 0, stime = 0;
    for (int i = 1; i <= 15 && stat >> field; i++) {
      if (i == 14) utime = std::stoull(field);
      if (i == 15) stime = std::stoull(field);
    }
    cpu_ticks += utime + stime;
  }
  return {sleeps, workers, cpu_ticks};
}

// A group with nothing to do (connected, nothing submitted, in flight or waited for) polls its
// NICs 50 us apart at first, then, 10 ms into the silence, sleeps longer (up to
// PONTE_IDLE_SLEEP_US, 1 ms): at about 8,000 wake-ups a second two idle engines took a quarter of
// a core here. Load only lengthens sleeps, so a busy host cannot push the count over the bound:
// over half a second a worker slept 458 times here, 3,978 with PONTE_IDLE_SLEEP_US=50 (the old
// bound). And the quiet costs no correctness: a write after the silence wakes both sides and
// lands. The same with PONTE_IDLE_WAKE (Config::idle_wake_on_data), where the worker sleeps on
// the provider's wait object too (tcp;ofi_rxm): an object that stayed signalled would wake it at
// once, every time.
void idle_worker_sleeps_long(const Setup& setup, bool idle_wake);
TEST_P(EngineTest, AnIdleWorkerSleepsLongAndWakesForTheNextWrite) {
  for (bool idle_wake : {false, true}) {
    SCOPED_TRACE(idle_wake ? "PONTE_IDLE_WAKE=1" : "PONTE_IDLE_WAKE=0");
    ASSERT_NO_FATAL_FAILURE(idle_worker_sleeps_long(GetParam(), idle_wake));
  }
}

void idle_worker_sleeps_long(const Setup& setup, bool idle_wake) {
  ConnectedPair pair;
  ASSERT_NO_FATAL_FAILURE(open_pair(setup, &pair, idle_wake));
  Engine* engines[2] = {pair.a.get(), pair.b.get()};
  const auto inbound = wait_inbound(*engines[1], 1);
  ASSERT_EQ(inbound.size(), 1u) << "A's connection never reached B";
  const PeerId ids[2] = {pair.a_to_b, inbound[0]};
  ASSERT_NO_FATAL_FAILURE(expect_write_each_way(engines, ids, 31, "before the silence"));
  std::this_thread::sleep_for(100ms);  // past kDeepIdleAfterUs and the ramp to the long sleep
  const auto before = worker_sleeps();
  ASSERT_GE(before.workers, 2) << "no ponte-g* worker threads found in /proc/self/task";
  std::this_thread::sleep_for(500ms);
  const auto after = worker_sleeps();
  ASSERT_EQ(after.workers, before.workers);
  const uint64_t per_worker = (after.sleeps - before.sleeps) / static_cast<uint64_t>(after.workers);
  EXPECT_LT(per_worker, 2000u) << "an idle worker went to sleep " << per_worker
                               << " times in 500 ms: it polls as if busy";
  // CPU: 1-2 % of a core per idle worker here; a spinning one takes most of a core it can get.
  const double cpu_ms = static_cast<double>(after.cpu_ticks - before.cpu_ticks) * 1000.0 /
                        static_cast<double>(sysconf(_SC_CLK_TCK)) / after.workers;
  EXPECT_LT(cpu_ms, 100.0) << "an idle worker used " << cpu_ms << " ms of CPU in 500 ms: it spins";
  ASSERT_NO_FATAL_FAILURE(expect_write_each_way(engines, ids, 32, "after the silence"));
}

// A remote group is one peer per traffic class, at both ends: the other end's connection of class
// 5 is the peer our connect() of class 5 returns; a connection of class 7 is a peer of its own
// there and here. The acceptor used to fold every connection from a group into its first peer
// whatever its class (the hello did not say it), and a connect() with a class found no inbound
// peer (those had none): a second peer whose QPs, on verbs, the other end never connected.
TEST_P(EngineTest, EachTrafficClassIsAPeerOfItsOwnAtBothEnds) {
  auto a = make_engine(GetParam(), 'A', 1);
  auto b = make_engine(GetParam(), 'B', 1);
  ASSERT_TRUE(a.ok() && b.ok());
  Engine* engines[2] = {a->get(), b->get()};
  ConnectOptions tc5, tc7;
  tc5.traffic_class = 5;
  tc7.traffic_class = 7;
  auto a5 = engines[0]->connect(0, engines[1]->address(0), tc5);
  ASSERT_TRUE(a5.ok()) << a5.status().message();
  auto b_inbound = wait_inbound(*engines[1], 1);
  ASSERT_EQ(b_inbound.size(), 1u) << "A's connection never reached B";
  auto b5 = engines[1]->connect(0, engines[0]->address(0), tc5);
  ASSERT_TRUE(b5.ok()) << b5.status().message();
  EXPECT_EQ(*b5, b_inbound[0]) << "B made a second class-5 peer for A";
  auto b7 = engines[1]->connect(0, engines[0]->address(0), tc7);
  ASSERT_TRUE(b7.ok()) << b7.status().message();
  EXPECT_NE(*b7, *b5) << "B's class-7 connection reused its class-5 peer";
  auto a_inbound = wait_inbound(*engines[0], 1);
  ASSERT_EQ(a_inbound.size(), 1u) << "A folded B's class-7 connection into its class-5 peer";
  auto a7 = engines[0]->connect(0, engines[1]->address(0), tc7);
  ASSERT_TRUE(a7.ok()) << a7.status().message();
  EXPECT_EQ(*a7, a_inbound[0]) << "A made a second class-7 peer for B";
  EXPECT_NE(*a7, *a5);
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  const PeerId pairs[2][2] = {{*a5, *b5}, {*a7, *b7}};
  for (const auto& ids : pairs)
    for (int me = 0; me < 2; me++) {
      while (!engines[me]->peer_ready(0, ids[me]) && !engines[me]->peer_dead(0, ids[me]) &&
             std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(1ms);
      ASSERT_TRUE(engines[me]->peer_ready(0, ids[me])) << "side " << me << "'s peer never became ready";
    }
  ASSERT_NO_FATAL_FAILURE(expect_write_each_way(engines, pairs[0], 55, "class 5"));
  ASSERT_NO_FATAL_FAILURE(expect_write_each_way(engines, pairs[1], 57, "class 7"));
  EXPECT_EQ(engines[0]->peers(0).size(), 1u);
  EXPECT_EQ(engines[1]->peers(0).size(), 1u);
}

// fork() with a live engine (a Python program, a pre-forking server): the child has none of the
// engine's threads. Every call there fails at once, naming fork(); the engine's destructor returns
// (it joined worker threads the child does not have, and the child hung at its exit); and the
// parent's engine and connection go on as before (the child closed none of the shared endpoints).
TEST_P(EngineTest, AForkChildRefusesTheParentsEngineAndLeavesItWorking) {
  start();
  fill(src_, 4096, 5);
  Flag before;
  ASSERT_TRUE(eng_->write(0, ids_[0], LocalSlice{&mr_, 0, 4096}, peers_[0]->region(), 0, before.notify()).ok());
  ASSERT_TRUE(before.wait(30s).ok()) << before.status().message();
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // no gtest here: the exit status says what failed
    int bad = 0;
    Flag f;
    Status st = eng_->write(0, ids_[0], LocalSlice{&mr_, 0, 4096}, peers_[0]->region(), 0, f.notify());
    if (st.ok() || st.code() != Code::kUnavailable || std::strstr(st.message(), "fork()") == nullptr) bad |= 1;
    if (eng_->progress(0) || eng_->peer_ready(0, ids_[0])) bad |= 2;
    if (eng_->deregister(mr_).ok()) bad |= 4;
    eng_.reset();
    _exit(bad == 0 ? 0 : 10 + bad);
  }
  const int code = test::wait_child_exit(child, 10s);
  ASSERT_NE(code, test::kChildHung) << "the child did not exit within 10 s (it destroyed the parent's engine)";
  EXPECT_EQ(code, 0) << "10 + bits: 1 the write was not refused naming fork(), 2 progress or peer_ready "
                        "answered, 4 deregister succeeded (-1: killed by a signal)";
  fill(src_, 4096, 6);
  Flag after;
  ASSERT_TRUE(eng_->write_imm(0, ids_[0], LocalSlice{&mr_, 0, 4096}, peers_[0]->region(), 0, 77, after.notify()).ok());
  EXPECT_EQ(peers_[0]->cmd("expectw 77 4096 1"), "ok");
  ASSERT_TRUE(after.wait(30s).ok()) << after.status().message();
  EXPECT_EQ(peers_[0]->cmd("check 0 4096 6 0"), "ok");
}

TEST_P(EngineTest, PeerKilledMidTransferFailsNotHangs) {
  start();
  fill(src_, 64 << 20, 1);
  Counter writes;
  Flag expect;
  ASSERT_TRUE(eng_->expect_imm(0, 999, 1, ids_[0], expect.notify(), 60000).ok());
  int posted = 0;
  for (int k = 0; k < 64; k++) {
    Status st = eng_->write_imm(0, ids_[0], LocalSlice{&mr_, 0, 64 << 20}, peers_[0]->region(), 0, 1, writes.notify());
    if (st.ok()) posted++;
  }
  peers_[0]->process().kill();
  EXPECT_EQ(peers_[0]->process().wait_exit(5000), -1);  // killed, not exited
  auto t0 = std::chrono::steady_clock::now();
  // Everything ends within the timeout (5 s) plus slack: the dead peer's writes fail, its counter fails.
  ASSERT_TRUE(writes.wait_total(posted, 20s)) << "writes to a dead peer hung";
  ASSERT_TRUE(expect.wait(20s).code() != Code::kTimeout || expect.done()) << "counter on a dead peer hung";
  EXPECT_TRUE(expect.done());
  EXPECT_EQ(expect.status().code(), Code::kPeerDead) << expect.status().message();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 20s);
  EXPECT_TRUE(eng_->peer_dead(0, ids_[0]));
  Flag after;
  EXPECT_EQ(eng_->write_imm(0, ids_[0], LocalSlice{&mr_, 0, 8}, peers_[0]->region(), 0, 1, after.notify()).code(),
            Code::kPeerDead);
  peers_.clear();
  // The engine still serves other peers.
  peers_.push_back(std::make_unique<Peer>(GetParam(), 1));
  std::string err;
  ASSERT_TRUE(peers_[0]->start(&err)) << err;
  auto id = eng_->connect(0, peers_[0]->address());
  ASSERT_TRUE(id.ok());
  fill(src_, 4096, 8);
  Flag f;
  ASSERT_TRUE(eng_->write_imm(0, *id, LocalSlice{&mr_, 0, 4096}, peers_[0]->region(), 0, 12, f.notify()).ok());
  EXPECT_EQ(peers_[0]->cmd("expectw 12 4096 1"), "ok");
  EXPECT_TRUE(f.wait(30s).ok()) << f.status().message();
  EXPECT_EQ(peers_[0]->cmd("check 0 4096 8 0"), "ok");
}

// A thread that polls (as NCCL's proxy does in test()) moves the data through progress() itself:
// the callbacks run on it, the bytes and immediates arrive intact. The worker keeps what it gives
// every user: a peer killed while the poller spins is declared dead and its counter fails.
TEST_P(EngineTest, PollingThreadProgressesAndWorkerKeepsLiveness) {
  start();
  constexpr int kOps = 2000;
  constexpr size_t kLen = 16 << 10;
  fill(src_, kOps * kLen, 23);
  struct Seen {
    std::atomic<int> ok{0}, failed{0}, on_poller{0};
    std::thread::id poller = std::this_thread::get_id();
    static void fire(void* arg, const Status& st) {
      auto* s = static_cast<Seen*>(arg);
      if (std::this_thread::get_id() == s->poller) s->on_poller++;
      if (st.ok()) s->ok++;
      else s->failed++;
    }
  } seen;
  int posted = 0, passes = 0;
  auto deadline = std::chrono::steady_clock::now() + 30s;
  while (seen.ok + seen.failed < kOps && std::chrono::steady_clock::now() < deadline) {
    while (posted < kOps && posted - (seen.ok + seen.failed) < 16) {
      Status st = eng_->write_imm(0, ids_[0], LocalSlice{&mr_, posted * kLen, kLen}, peers_[0]->region(),
                                  posted * kLen, 6, Notify{&Seen::fire, &seen});
      if (st.code() == Code::kAgain) break;
      ASSERT_TRUE(st.ok()) << st.message();
      posted++;
    }
    if (eng_->progress(0)) passes++;
  }
  ASSERT_EQ(seen.ok + seen.failed, kOps) << "writes driven by a polling thread hung";
  EXPECT_EQ(seen.failed, 0);
  EXPECT_GT(passes, 0) << "progress() never ran a pass for the polling thread";
  EXPECT_GT(seen.on_poller, 0) << "no callback ran on the polling thread";
  EXPECT_EQ(peers_[0]->cmd("expectw 6 " + std::to_string(kLen) + " " + std::to_string(kOps)), "ok");
  EXPECT_EQ(peers_[0]->cmd("check 0 " + std::to_string(kOps * kLen) + " 23 0"), "ok");

  Flag expect;
  ASSERT_TRUE(eng_->expect_imm(0, 998, 1, ids_[0], expect.notify(), 60000).ok());
  peers_[0]->process().kill();
  EXPECT_EQ(peers_[0]->process().wait_exit(5000), -1);
  deadline = std::chrono::steady_clock::now() + 20s;
  while (!expect.done() && std::chrono::steady_clock::now() < deadline) eng_->progress(0);
  ASSERT_TRUE(expect.done()) << "a dead peer went unnoticed while a thread polled";
  EXPECT_EQ(expect.status().code(), Code::kPeerDead) << expect.status().message();
  EXPECT_TRUE(eng_->peer_dead(0, ids_[0]));
  peers_.clear();
}

// PONTE_POLLER_HOLD_US is how long a thread stays the group's poller after its last progress():
// with 50 ms, still the poller 5 ms after its call; no longer once the 50 ms have passed.
TEST_P(EngineTest, APollerStaysThePollerForTheConfiguredHold) {
  EngineOptions o;
  o.config = test_config(GetParam());
  o.config.poller_hold_us = 50'000;
  o.groups = {pick_devices(o.config, 'A', 1)};
  auto eng = Engine::create(o);
  ASSERT_TRUE(eng.ok()) << eng.status().message();
  Engine& e = **eng;
  e.progress(0);
  // Read after the call returns, so that the hold (counted from inside it) ends before
  // polled_at + 50 ms however long the first pass took.
  const auto polled_at = std::chrono::steady_clock::now();
  std::this_thread::sleep_for(5ms);
  EXPECT_TRUE(e.polled_here(0)) << "5 ms after progress(), with a 50 ms hold";
  std::this_thread::sleep_until(polled_at + 51ms);
  EXPECT_FALSE(e.polled_here(0)) << "51 ms after progress(), with a 50 ms hold";
}

// A thread that polled and then stops (Engine::stop_polling) hands the data path back to the
// worker at once. While somebody polls, the worker sleeps longer and longer between its passes (up
// to PONTE_POLLER_SLEEP_US, 2 s here), and a poller's own submissions wait for its next progress()
// call: without the hand-back a read submitted last would be posted at the worker's next wake-up,
// up to 205 ms away after 300 ms of polling (its sleeps: 50 us doubling). What is timed is the post (reads_posted), on this side
// alone, this thread sleeping meanwhile; its median over the trials must stay under 25 ms (an
// eventfd wake-up, even in the SoftRoCE guest under QEMU or under TSan). Where pollers never post
// (shm: a post may block on a stopped peer) the submission itself must wake the worker, with no
// stop_polling: the same bound holds.
TEST_P(EngineTest, StopPollingHandsTheDataPathBack) {
  poller_sleep_us_ = 2'000'000;
  start();
  const bool pollers_post = !eng_->nic_info(0, 0).post_may_block_on_peer;
  // What waiters ask before they poll (Python's waits skip polling where it would only reap).
  EXPECT_EQ(eng_->polling_posts(0), pollers_post);
  EXPECT_FALSE(eng_->polling_posts(99)) << "an unknown group";
  // Who is the poller (what a waiter asks before it polls again for a finished operation): a
  // thread that called progress() moments ago, until it stops or PONTE_POLLER_HOLD_US pass; never
  // another.
  EXPECT_FALSE(eng_->polled_here(0)) << "before any progress() call";
  bool after = false;  // a pass may outlast the hold on a loaded host (TSan, the QEMU guest): tries
  for (int i = 0; i < 100 && !after; i++) {
    eng_->progress(0);
    after = eng_->polled_here(0);
  }
  EXPECT_TRUE(after) << "right after progress()";
  bool elsewhere = true;
  std::thread([&] { elsewhere = eng_->polled_here(0); }).join();
  EXPECT_FALSE(elsewhere) << "another thread is not the poller";
  EXPECT_FALSE(eng_->polled_here(99)) << "an unknown group";
  auto cfg = Config::from_env();
  ASSERT_TRUE(cfg.ok()) << cfg.status().message();
  std::this_thread::sleep_for(std::chrono::microseconds(cfg->poller_hold_us) + 1ms);
  EXPECT_FALSE(eng_->polled_here(0)) << "1 ms after the hold (" << cfg->poller_hold_us << " us) ran out";
  eng_->progress(0);
  eng_->stop_polling(0);
  EXPECT_FALSE(eng_->polled_here(0)) << "after stop_polling";
  constexpr size_t kLen = 4096;
  constexpr int kTrials = 5;
  EXPECT_EQ(peers_[0]->cmd("fill 0 4096 37"), "ok");
  Flag first;  // the provider's first transfer to the peer sets up its connection (rxm: tens of ms)
  ASSERT_TRUE(eng_->read(0, ids_[0], LocalSlice{&mr_, 0, kLen}, peers_[0]->region(), 0, first.notify()).ok());
  ASSERT_TRUE(first.wait(10s).ok()) << first.status().message();
  std::vector<double> ms;
  for (int t = 0; t < kTrials; t++) {
    memset(src_, 0, kLen);
    const auto until = std::chrono::steady_clock::now() + 300ms;  // the worker backs off meanwhile
    while (std::chrono::steady_clock::now() < until) eng_->progress(0);
    Flag f;
    const uint64_t posted = eng_->reads_posted(0, 0);
    const auto t0 = std::chrono::steady_clock::now();
    ASSERT_TRUE(eng_->read(0, ids_[0], LocalSlice{&mr_, 0, kLen}, peers_[0]->region(), 0, f.notify()).ok());
    if (pollers_post) eng_->stop_polling(0);
    const auto deadline = t0 + 10s;  // this thread polls no more
    while (eng_->reads_posted(0, 0) == posted && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(10us);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    ASSERT_TRUE(f.wait(10s).ok()) << f.status().message();
    EXPECT_EQ(check(src_, kLen, 37), SIZE_MAX);
  }
  std::printf("  read posted%s, ms:", pollers_post ? " after stop_polling" : " (submission alone)");
  for (double m : ms) std::printf(" %.3f", m);
  std::printf("\n");
  std::sort(ms.begin(), ms.end());
  EXPECT_LT(ms[kTrials / 2], 25.0) << "the worker did not take the data path back when the poller stopped";
}

// Destroying the engine is an orderly shutdown: writes already posted finish (their callbacks
// report success, before the destructor returns) and their bytes land; nothing is cancelled
// while it is on the wire. The peer's counter, armed for them before, is satisfied: our goodbye
// may overtake the last writes, and the peer keeps counting them for a grace period.
TEST_P(EngineTest, ShutdownLetsPostedWritesFinish) {
  start();
  constexpr int kWrites = 16;
  constexpr size_t kLen = 256 << 10;
  fill(src_, kWrites * kLen, 21);
  ASSERT_EQ(peers_[0]->cmd("arm 77 " + std::to_string(kLen) + " " + std::to_string(kWrites)), "ok");
  Counter writes;
  for (int k = 0; k < kWrites; k++) {
    ASSERT_TRUE(eng_->write_imm(0, ids_[0], LocalSlice{&mr_, k * kLen, kLen}, peers_[0]->region(), k * kLen, 77,
                                writes.notify())
                    .ok());
  }
  eng_.reset();  // the registration goes with it
  EXPECT_EQ(writes.ok + writes.failed, kWrites) << "a callback did not run before the engine was gone";
  EXPECT_EQ(writes.ok, kWrites) << writes.failed << " posted writes were cancelled instead of finishing";
  EXPECT_EQ(peers_[0]->cmd("wait"), "ok");
  EXPECT_EQ(peers_[0]->cmd("check 0 " + std::to_string(kWrites * kLen) + " 21 0"), "ok");
}

// A `behind` write (Engine::write_imm_whole: NCCL's clear-to-send in the plugin) lets a small write
// that starts after it go out first, and not a large one. The three writes (behind X, small Y,
// large Z) are submitted from one completion callback on the worker, so that they start in the
// same pass; on one ordered connection (tcp, shm, an RC QP) the one posted first completes first.
// Without `behind` (the control) the order is the submission order.
TEST_P(EngineTest, ABehindWriteLetsASmallWriteStartedBesideItGoFirst) {
  start();
  constexpr size_t kX = 144, kY = 64, kZ = 256 << 10;  // a one-buffer CTS, a small message, a large one
  constexpr size_t kZoff = 1 << 20;
  struct Seen {  // when one write completed, in the order of the pair's completions
    std::atomic<int>* seq;
    std::atomic<int>* failed;
    std::atomic<int> at{-1};
    static void fire(void* a, const Status& st) {
      auto* s = static_cast<Seen*>(a);
      if (!st.ok()) (*s->failed)++;
      s->at = (*s->seq)++;
    }
  };
  struct Pair {
    Engine* eng;
    PeerId peer;
    const MemoryRegion* mr;
    RemoteRegion dst;
    bool behind;
    size_t base;
    std::atomic<int> seq{0}, failed{0};
    Seen x{&seq, &failed}, y{&seq, &failed}, z{&seq, &failed};
    std::atomic<bool> submitted{false};
    static void start_all(void* a, const Status& st) {  // on the worker: all three start in place
      auto* p = static_cast<Pair*>(a);
      Status x = st;
      if (x.ok())
        x = p->eng->write_imm_whole(0, p->peer, LocalSlice{p->mr, p->base, kX}, p->dst, p->base, 7001,
                                    Notify{&Seen::fire, &p->x}, p->behind);
      Status y = x.ok() ? p->eng->write_imm(0, p->peer, LocalSlice{p->mr, p->base + kX, kY}, p->dst, p->base + kX,
                                            7002, Notify{&Seen::fire, &p->y})
                        : x;
      Status z = y.ok() ? p->eng->write(0, p->peer, LocalSlice{p->mr, kZoff, kZ}, p->dst, kZoff,
                                        Notify{&Seen::fire, &p->z})
                        : y;
      if (!z.ok()) p->failed += 10;
      p->submitted = true;
    }
  };
  fill(src_ + kZoff, kZ, 39);
  for (bool behind : {false, true}) {
    for (int round = 0; round < 10; round++) {
      const size_t base = (behind ? 64 << 10 : 0) + round * 4096;
      fill(src_ + base, kX + kY, 40 + round);
      Pair pair{eng_.get(), ids_[0], &mr_, peers_[0]->region(), behind, base};
      ASSERT_TRUE(eng_->imm(0, ids_[0], 7000, Notify{&Pair::start_all, &pair}).ok());
      auto deadline = std::chrono::steady_clock::now() + 20s;
      while ((pair.x.at < 0 || pair.y.at < 0 || pair.z.at < 0) && pair.failed == 0 &&
             std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(100us);
      ASSERT_TRUE(pair.submitted) << "the completion callback did not run";
      ASSERT_EQ(pair.failed, 0) << (behind ? "behind" : "control") << " round " << round;
      ASSERT_GE(pair.x.at, 0);
      ASSERT_GE(pair.y.at, 0);
      ASSERT_GE(pair.z.at, 0);
      if (behind) {
        EXPECT_LT(pair.y.at, pair.x.at) << "round " << round << ": the behind write went out first";
      } else {
        EXPECT_LT(pair.x.at, pair.y.at) << "control round " << round << ": the writes did not keep their order";
      }
      EXPECT_LT(pair.x.at, pair.z.at) << "round " << round << ": a large write went out ahead of the "
                                      << (behind ? "behind " : "") << "write started before it";
      EXPECT_EQ(peers_[0]->cmd("check " + std::to_string(base) + " " + std::to_string(kX + kY) + " " +
                               std::to_string(40 + round) + " 0"),
                "ok");
    }
  }
  EXPECT_EQ(peers_[0]->cmd("check " + std::to_string(kZoff) + " " + std::to_string(kZ) + " 39 0"), "ok");
}

TEST_P(EngineTest, BadInputIsRefusedClearly) {
  start();
  Flag f;
  auto addr = peers_[0]->address();
  // Addresses: truncated, foreign, zeros, another backend's.
  EXPECT_EQ(eng_->connect(0, std::span<const uint8_t>(addr.data(), addr.size() - 1)).status().code(), Code::kInvalidArgument);
  auto region_bytes = peers_[0]->region().encode();
  EXPECT_EQ(eng_->connect(0, region_bytes).status().code(), Code::kInvalidArgument);
  std::vector<uint8_t> zeros(64, 0);
  EXPECT_EQ(eng_->connect(0, zeros).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(eng_->connect(7, addr).status().code(), Code::kInvalidArgument);
  // Descriptors and ranges.
  EXPECT_FALSE(RemoteRegion::decode(std::span<const uint8_t>(region_bytes.data(), 10)).ok());
  RemoteRegion r = peers_[0]->region();
  EXPECT_EQ(eng_->write(0, ids_[0], LocalSlice{&mr_, 0, 4096}, r, r.len - 100, f.notify()).code(), Code::kInvalidArgument);
  EXPECT_EQ(eng_->write(0, ids_[0], LocalSlice{&mr_, kRegion - 10, 4096}, r, 0, f.notify()).code(), Code::kInvalidArgument);
  EXPECT_EQ(eng_->write(0, ids_[0], LocalSlice{&mr_, SIZE_MAX - 5, 10}, r, 0, f.notify()).code(), Code::kInvalidArgument);
  RemoteRegion nokeys;
  EXPECT_EQ(eng_->write(0, ids_[0], LocalSlice{&mr_, 0, 0}, nokeys, 0, f.notify()).code(), Code::kInvalidArgument);
  // Unregistered memory, unknown peer, unknown group.
  MemoryRegion unregistered;
  EXPECT_EQ(eng_->write(0, ids_[0], LocalSlice{&unregistered, 0, 8}, r, 0, f.notify()).code(), Code::kInvalidArgument);
  EXPECT_EQ(eng_->write(0, 4000, LocalSlice{&mr_, 0, 8}, r, 0, f.notify()).code(), Code::kInvalidArgument);
  EXPECT_EQ(eng_->write(3, ids_[0], LocalSlice{&mr_, 0, 8}, r, 0, f.notify()).code(), Code::kInvalidArgument);
  EXPECT_EQ(eng_->expect_imm(0, 1, 0, kAnyPeer, f.notify()).code(), Code::kInvalidArgument);
  EXPECT_FALSE(eng_->register_memory(0, nullptr, 10).ok());
  EXPECT_FALSE(f.done());  // nothing refused fired its Notify
  // A peer that does not listen: the connection fails, operations to it end with an error.
  GroupAddress dead_addr = GroupAddress::decode(addr).value();
  dead_addr.port = 1;  // nothing listens on port 1
  dead_addr.engine_nonce ^= 1;
  auto dead = eng_->connect(0, dead_addr.encode());
  ASSERT_TRUE(dead.ok());
  Flag w;
  Status st = eng_->write(0, *dead, LocalSlice{&mr_, 0, 8}, r, 0, w.notify());
  if (st.ok()) {
    ASSERT_TRUE(w.wait(20s).code() != Code::kTimeout || w.done());
    EXPECT_FALSE(w.status().ok());
  } else {
    EXPECT_EQ(st.code(), Code::kPeerDead);
  }
  // And the good peer still works.
  fill(src_, 4096, 77);
  Flag ok;
  ASSERT_TRUE(eng_->write_imm(0, ids_[0], LocalSlice{&mr_, 0, 4096}, r, 0, 3, ok.notify()).ok());
  EXPECT_EQ(peers_[0]->cmd("expectw 3 4096 1"), "ok");
  EXPECT_TRUE(ok.wait(30s).ok());
}

TEST_P(EngineTest, BadKeyEndsTheWriteAndVerbsRecovers) {
  start();
  fill(src_, 4096, 90);
  RemoteRegion bad = peers_[0]->region();
  bad.rkey[0] ^= 0x5a5a5a;
  Flag f;
  ASSERT_TRUE(eng_->write(0, ids_[0], LocalSlice{&mr_, 0, 4096}, bad, 0, f.notify()).ok());
  ASSERT_TRUE(f.wait(30s).code() != Code::kTimeout || f.done()) << "a write with a bad key hung";
  // RC QPs report a rejected key to the writer; libfabric's tcp/shm report it only at the target
  // (the writer's completion means "sent"), so there the write must just end, not hang.
  if (GetParam().backend == BackendChoice::kVerbs) {
    EXPECT_EQ(f.status().code(), Code::kTransport) << f.status().message();
  }
  // On verbs the QP is rebuilt through a new handshake round and the peer stays usable. libfabric's
  // tcp provider may drop the connection a rejected key arrived on (seen on 1.17: later writes are
  // lost while the writer sees success); the engine cannot see that, so over libfabric this test
  // only asks that the bad write end and nothing crash.
  if (GetParam().backend != BackendChoice::kVerbs) return;
  Flag ok;
  ASSERT_TRUE(eng_->write_imm(0, ids_[0], LocalSlice{&mr_, 0, 4096}, peers_[0]->region(), 0, 31, ok.notify()).ok());
  EXPECT_EQ(peers_[0]->cmd("expectw 31 4096 1"), "ok");
  EXPECT_TRUE(ok.wait(30s).ok()) << ok.status().message();
  EXPECT_EQ(peers_[0]->cmd("check 0 4096 90 0"), "ok");
}

// A handshake round whose backend connect fails on one side (on verbs: a new QP found in ERR
// between RTR and RTS, seen on SoftRoCE) is followed by a fresh round; more than 3 failed rounds
// in a row make the peer dead, with the reason, never a hang. PONTE_FAULT_FAILED_CONNECTS=N fails
// the peer's first N rounds.
TEST_P(EngineTest, ARoundThatFailsToConnectIsFollowedByAFreshOne) {
  start_engine(1);
  // Three failed rounds: the fourth connects, and data moves both ways.
  peers_.push_back(std::make_unique<Peer>(GetParam(), 1, std::vector<std::string>{"PONTE_FAULT_FAILED_CONNECTS=3"}));
  std::string err;
  ASSERT_TRUE(peers_[0]->start(&err)) << err;
  auto id = eng_->connect(0, peers_[0]->address());
  ASSERT_TRUE(id.ok()) << id.status().message();
  auto deadline = std::chrono::steady_clock::now() + 20s;
  while (!(eng_->peer_ready(0, *id) && eng_->peer_epoch(0, *id) >= 3) && !eng_->peer_dead(0, *id) &&
         std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(1ms);
  ASSERT_FALSE(eng_->peer_dead(0, *id)) << "three failed rounds made the peer dead";
  ASSERT_TRUE(eng_->peer_ready(0, *id)) << "not ready after the failed rounds";
  EXPECT_EQ(eng_->peer_epoch(0, *id), 3u) << "one rebuild per failed round";
  fill(src_, 4096, 44);
  Flag f;
  ASSERT_TRUE(eng_->write_imm(0, *id, LocalSlice{&mr_, 0, 4096}, peers_[0]->region(), 0, 17, f.notify()).ok());
  EXPECT_EQ(peers_[0]->cmd("expectw 17 4096 1"), "ok");
  EXPECT_TRUE(f.wait(30s).ok()) << f.status().message();
  EXPECT_EQ(peers_[0]->cmd("check 0 4096 44 0"), "ok");
  peers_[0]->cmd("exit", 5000);
  peers_.clear();
  // Four: the peer gives up and closes; this side learns it is dead within the timeout. A write
  // submitted meanwhile ends: it may land (the fault fails rounds whose connection did come up,
  // and this side may have written over one), or fail with kPeerDead, or with the round it went
  // out on: on verbs kTransport (a QP the peer had already replaced), on libfabric kCancelled
  // (the round's peer address removed under it; seen on udp;ofi_rxd, which posts at once).
  peers_.push_back(std::make_unique<Peer>(GetParam(), 1, std::vector<std::string>{"PONTE_FAULT_FAILED_CONNECTS=4"}));
  ASSERT_TRUE(peers_[0]->start(&err)) << err;
  auto dead = eng_->connect(0, peers_[0]->address());
  ASSERT_TRUE(dead.ok()) << dead.status().message();
  Flag w;
  Status st = eng_->write(0, *dead, LocalSlice{&mr_, 0, 8}, peers_[0]->region(), 0, w.notify());
  if (st.ok()) {
    ASSERT_TRUE(w.wait(20s).code() != Code::kTimeout || w.done()) << "a write to a peer that gave up hung";
    st = w.status();
  }
  const Code torn_down = GetParam().backend == BackendChoice::kVerbs ? Code::kTransport : Code::kCancelled;
  EXPECT_TRUE(st.ok() || st.code() == Code::kPeerDead || st.code() == torn_down)
      << "a write to a peer that gave up: " << code_name(st.code()) << ": " << st.message();
  if (st.code() == torn_down)
    std::cout << "[ NOTE     ] the write ended with its round: " << st.message() << "\n";
  deadline = std::chrono::steady_clock::now() + 20s;
  while (!eng_->peer_dead(0, *dead) && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
  EXPECT_TRUE(eng_->peer_dead(0, *dead)) << "four failed rounds did not end the peer";
  Flag after;
  EXPECT_EQ(eng_->write(0, *dead, LocalSlice{&mr_, 0, 8}, peers_[0]->region(), 0, after.notify()).code(), Code::kPeerDead);
}

INSTANTIATE_TEST_SUITE_P(Backends, EngineTest, ::testing::ValuesIn(setups()),
                         [](const ::testing::TestParamInfo<Setup>& i) { return i.param.name; });

}  // namespace

int main(int argc, char** argv) {
  ponte::test::keep_test_traffic_on_loopback();
  if (argc >= 2 && std::string(argv[1]) == "--ponte-peer") return run_peer(argc, argv);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
