// The watchdog on a NicGroup whose NIC (a fake) blocks inside a provider call on command: a call
// that never returns turns the group wedged within PONTE_TIMEOUT_MS, every operation, counter and
// queued call it held ends exactly once with an error, later calls are refused at once, and when
// the stuck call does return (late) its thread leaves without touching the group again. A call
// that returns in time changes nothing. Deterministic: no provider, no second process.
#include <gtest/gtest.h>

#include <pthread.h>

#include <atomic>
#include <csignal>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "core/group_address.h"
#include "core/nic_group.h"
#include "core/watchdog.h"

using namespace ponte;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

constexpr uint32_t kTimeoutMs = 1000;

// A NIC that accepts everything, completes nothing, and blocks in register_memory while told to:
// the stand-in for shm's fi_writedata spinning on a lock a stopped peer holds.
class FakeNic final : public Nic {
 public:
  struct Gate {
    std::mutex mu;
    std::condition_variable cv;
    bool block = false;  // register_memory waits while set
    std::atomic<int> blocked{0};  // threads waiting in it
    std::chrono::milliseconds hold{0};  // with block: return after this long (0: until released)
    // poll() from this thread spins (sleeping 1 ms at a time) while block_poll is set: shm's
    // fi_cq_read on a lock a stopped peer holds. Other threads' polls go through.
    std::atomic<bool> block_poll{false};
    std::atomic<std::thread::id> poll_thread{};
    std::atomic<int> poll_blocked{0};
    void release() {
      std::lock_guard<std::mutex> l(mu);
      block = false;
      cv.notify_all();
    }
  };
  explicit FakeNic(Gate* gate, bool may_block_on_peer = false) : gate_(gate) {
    info_.name = "fake";
    info_.provider = "fake";
    info_.post_may_block_on_peer = may_block_on_peer;  // as shm: pollers only reap
  }
  const NicInfo& info() const override { return info_; }
  std::span<const uint8_t> address() const override { return addr_; }
  Result<NicPeer> add_peer(std::span<const uint8_t>) override { return next_peer_++; }
  Result<std::vector<uint8_t>> connect_blob(NicPeer) override { return std::vector<uint8_t>{}; }
  Status complete_connect(NicPeer, std::span<const uint8_t>) override { return Status::Ok(); }
  void remove_peer(NicPeer) override {}
  Result<NicMr> register_memory(const MemoryDesc&) override {
    std::unique_lock<std::mutex> l(gate_->mu);
    if (gate_->block) {
      gate_->blocked++;
      if (gate_->hold.count() > 0) gate_->cv.wait_for(l, gate_->hold, [&] { return !gate_->block; });
      else gate_->cv.wait(l, [&] { return !gate_->block; });
      gate_->blocked--;
    }
    return NicMr{};
  }
  void deregister(const NicMr&) override {}
  Status post_write(const WriteWr&) override { return Status::Ok(); }
  Status post_read(NicPeer, void*, size_t, void*, uint64_t, uint64_t, uint64_t) override { return Status::Ok(); }
  Status post_send(NicPeer, const void*, size_t, void*, uint32_t, uint64_t, bool) override { return Status::Ok(); }
  Status post_recv(void*, size_t, void*, uint64_t) override { return Status::Ok(); }
  int poll(Completion* out, int max) override {
    if (gate_->block_poll && gate_->poll_thread.load() == std::this_thread::get_id()) {
      gate_->poll_blocked++;
      while (gate_->block_poll) std::this_thread::sleep_for(1ms);
      gate_->poll_blocked--;
    }
    uint32_t imm = inject_.exchange(0);
    if (imm == 0 || max < 1) return 0;
    out[0] = Completion{0, imm, 0, CompletionKind::kRemoteWrite, Code::kOk};
    return 1;
  }
  std::atomic<uint32_t> inject_{0};  // an immediate to report as arrived at the next poll

 private:
  Gate* gate_;
  NicInfo info_;
  std::vector<uint8_t> addr_{1, 2, 3, 4};
  NicPeer next_peer_ = 0;
};

// Counts each operation's Notify by index: exactly once is checked, not assumed.
struct Fires {
  explicit Fires(int n) : count(n), code(n) {}
  std::vector<std::atomic<int>> count;
  std::vector<std::atomic<int>> code;
  struct Arg {
    Fires* f;
    int i;
  };
  std::vector<Arg> args;
  static void fire(void* a, const Status& st) {
    auto* arg = static_cast<Arg*>(a);
    arg->f->code[arg->i] = static_cast<int>(st.code());
    arg->f->count[arg->i]++;
  }
  Notify notify(int i) {
    if (args.empty()) args.reserve(count.size());
    args.push_back(Arg{this, i});
    return Notify{&Fires::fire, &args.back()};
  }
  bool all_once() const {
    for (auto& c : count)
      if (c != 1) return false;
    return true;
  }
  int fired() const {
    int n = 0;
    for (auto& c : count) n += c > 0;
    return n;
  }
};

// A job for run_on_worker that registers on the fake NIC (blocking while the gate says so) and
// marks what it got to.
struct BlockingJob {
  NicGroup* g;
  std::atomic<int>* entered;
  std::atomic<int>* finished;
  Status st;
  void run() {
    entered->fetch_add(1);
    auto r = g->nic(0).register_memory(MemoryDesc{});
    st = r.status();
    finished->fetch_add(1);  // never reached when the watchdog claimed the call
  }
};

struct Rig {
  FakeNic::Gate gate;
  FakeNic* nic = nullptr;
  std::unique_ptr<NicGroup> group;
  std::unique_ptr<Watchdog> watchdog;
  PeerId peer = 0;  // our own address, never connected: its operations wait, in flight
  MemoryRegion mr;
  RemoteRegion remote;
  std::vector<uint8_t> buf = std::vector<uint8_t>(1 << 16);

  bool may_block_on_peer = false;  // the fake NIC says so (shm's case)

  void start() {
    Config cfg = global_config();
    cfg.timeout_ms = kTimeoutMs;
    cfg.ctrl_addr = "127.0.0.1";
    cfg.recv_buf_count = 2;
    std::vector<std::unique_ptr<Nic>> nics;
    auto n = std::make_unique<FakeNic>(&gate, may_block_on_peer);
    nic = n.get();
    nics.push_back(std::move(n));
    group = std::make_unique<NicGroup>(0, cfg, std::move(nics), BackendKind::kFabric, 0x1234);
    ASSERT_TRUE(group->start({}).ok());
    auto addr = GroupAddress::decode(group->address());
    ASSERT_TRUE(addr.ok());
    bool existing = false;
    auto id = group->new_outbound_peer(*addr, -1, &existing);  // no kConnect: it stays connecting
    ASSERT_TRUE(id.ok());
    peer = *id;
    mr.addr = buf.data();
    mr.len = buf.size();
    mr.group = 0;
    mr.id = 1;
    mr.nic_mrs.assign(1, NicMr{});
    remote.len = buf.size();
    remote.nics = 1;
    watchdog = std::make_unique<Watchdog>(std::vector<NicGroup*>{group.get()});
    watchdog->start();
  }
  Op write(Notify done) const {
    Op op;
    op.type = Op::kWrite;
    op.peer = peer;
    op.mr = &mr;
    op.len = 4096;
    op.remote = remote;
    op.has_imm = true;
    op.imm = 5;
    op.done = done;
    return op;
  }
  Op expect(uint32_t imm, Notify done) const {
    Op op;
    op.type = Op::kExpect;
    op.imm = imm;
    op.count = 1;
    op.peer = kAnyPeer;
    op.timeout_ms = 60000;
    op.done = done;
    return op;
  }
  // Stops watching and the group; a wedged group is kept, as Engine keeps it.
  void finish() {
    if (group) group->stop();
    if (watchdog) watchdog->stop();
    if (group && group->abandoned()) {
      group->refuse_queued();
      static auto* kept = new std::vector<NicGroup*>;  // never destroyed, not even at exit
      kept->push_back(group.release());
    }
    group.reset();
  }
};

bool wait_until(const std::function<bool()>& pred, std::chrono::milliseconds limit) {
  auto deadline = Clock::now() + limit;
  while (!pred() && Clock::now() < deadline) std::this_thread::sleep_for(1ms);
  return pred();
}

// The worker is stuck inside a provider call made for run_on_worker (the head of the queue):
// everything in flight, waiting and queued behind it ends exactly once; the stuck caller and a
// queued one return errors promptly; later calls are refused at once. Released, the call returns
// into nothing: the job's code after it never runs and nothing fires again.
TEST(Watchdog, StuckProviderCallWedgesTheGroupAndEverythingEndsOnce) {
  Rig s;
  ASSERT_NO_FATAL_FAILURE(s.start());
  NicGroup& g = *s.group;
  constexpr int kInFlight = 16, kQueued = 8;
  Fires fires(kInFlight + kQueued + 1);
  for (int i = 0; i < kInFlight; i++) ASSERT_TRUE(g.submit(s.write(fires.notify(i))).ok());
  ASSERT_TRUE(g.submit(s.expect(77, fires.notify(kInFlight + kQueued))).ok());

  std::atomic<int> entered{0}, finished{0};
  {
    std::lock_guard<std::mutex> l(s.gate.mu);
    s.gate.block = true;
  }
  Status stuck_st, queued_st;
  std::atomic<long long> stuck_ms{-1}, queued_ms{-1};
  const auto t0 = Clock::now();
  std::thread stuck([&] {
    BlockingJob job{&g, &entered, &finished, Status::Ok()};
    stuck_st = g.run_on_worker(job);
    stuck_ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
  });
  ASSERT_TRUE(wait_until([&] { return s.gate.blocked == 1; }, 5s)) << "the worker never entered the call";
  for (int i = 0; i < kQueued; i++) ASSERT_TRUE(g.submit(s.write(fires.notify(kInFlight + i))).ok());
  std::thread queued([&] {
    BlockingJob job{&g, &entered, &finished, Status::Ok()};
    queued_st = g.run_on_worker(job);
    queued_ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
  });

  ASSERT_TRUE(wait_until([&] { return fires.fired() == kInFlight + kQueued + 1; }, 3 * std::chrono::milliseconds(kTimeoutMs)))
      << fires.fired() << " of " << kInFlight + kQueued + 1 << " ended";
  const long long ended_ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
  EXPECT_GE(ended_ms, kTimeoutMs - 50) << "wedged before the timeout";
  EXPECT_LT(ended_ms, kTimeoutMs + 1000);
  for (int i = 0; i < kInFlight + kQueued; i++) EXPECT_EQ(fires.code[i], static_cast<int>(i < kInFlight ? Code::kTimeout : Code::kUnavailable)) << i;
  EXPECT_EQ(fires.code[kInFlight + kQueued], static_cast<int>(Code::kTimeout));
  stuck.join();
  queued.join();
  EXPECT_EQ(stuck_st.code(), Code::kUnavailable) << stuck_st.message();
  EXPECT_EQ(queued_st.code(), Code::kUnavailable) << queued_st.message();
  EXPECT_LT(stuck_ms, kTimeoutMs + 1000);
  EXPECT_LT(queued_ms, kTimeoutMs + 1000);
  EXPECT_NE(std::string(stuck_st.message()).find("registration"), std::string::npos) << stuck_st.message();
  EXPECT_FALSE(g.wedge_status().ok());
  EXPECT_EQ(g.submit(s.write(Notify{})).code(), Code::kUnavailable);
  EXPECT_FALSE(g.progress());
  BlockingJob late{&g, &entered, &finished, Status::Ok()};
  auto t1 = Clock::now();
  EXPECT_EQ(g.run_on_worker(late).code(), Code::kUnavailable);
  EXPECT_LT(Clock::now() - t1, 100ms);
  EXPECT_EQ(entered, 1) << "a call queued behind the stuck one ran";

  // The provider lets go: the call returns into nothing of the group's.
  s.gate.release();
  std::this_thread::sleep_for(200ms);
  EXPECT_EQ(finished, 0) << "code after the claimed call ran";
  EXPECT_TRUE(fires.all_once()) << "a Notify fired twice";
  auto t2 = Clock::now();
  s.finish();
  EXPECT_LT(Clock::now() - t2, 1s) << "stopping a wedged group took that long";
}

// A polling thread (NCCL's proxy in test()) stuck in a provider call where calls may block on a
// peer (shm: fi_cq_read spinning on a lock a stopped peer holds) is let go: once the watchdog
// claimed the call, progress() returns false on that thread, within the timeout, and later calls
// return at once. Without it the thread stayed in the call for good (core/watchdog.h).
TEST(Watchdog, PollerStuckInAProviderCallIsLetGo) {
  Rig s;
  s.may_block_on_peer = true;
  ASSERT_NO_FATAL_FAILURE(s.start());
  NicGroup& g = *s.group;
  Fires fires(4);
  for (int i = 0; i < 4; i++) ASSERT_TRUE(g.submit(s.write(fires.notify(i))).ok());
  // Started (waiting for their peer) before the poll blocks: writes still queued when the group
  // wedges are refused (kUnavailable), not timed out. A job queued behind them runs once they are.
  struct Nop {
    void run() {}
  } nop;
  ASSERT_TRUE(g.run_on_worker(nop).ok());
  std::atomic<bool> returned{false};
  std::atomic<long long> stuck_for_ms{-1};
  std::atomic<bool> later_at_once{false};
  std::atomic<bool> signal_left_blocked{true};
  std::thread poller([&] {
    s.gate.poll_thread = std::this_thread::get_id();
    s.gate.block_poll = true;
    const auto give_up = Clock::now() + 5s;
    Clock::time_point entered;
    for (;;) {  // until a pass of this thread enters the (blocking) poll, then until it returns
      const auto before = Clock::now();
      g.progress();
      if (s.gate.poll_blocked.load() > 0 || Clock::now() - before > 500ms) {
        entered = before;
        break;
      }
      if (Clock::now() > give_up) return;
      std::this_thread::yield();
    }
    stuck_for_ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - entered).count();
    sigset_t mask;
    pthread_sigmask(SIG_BLOCK, nullptr, &mask);
    signal_left_blocked = sigismember(&mask, poller_rescue::signal_number()) == 1;  // a second rescue would not come
    returned = true;
    const auto t = Clock::now();
    const bool again = g.progress();
    later_at_once = !again && Clock::now() - t < 100ms;
  });
  const bool back = wait_until([&] { return returned.load(); }, 3 * std::chrono::milliseconds(kTimeoutMs));
  if (!back) s.gate.block_poll = false;  // let it out by the provider's own return, then fail
  poller.join();
  ASSERT_TRUE(back) << "the polling thread stayed in the provider call";
  EXPECT_GE(stuck_for_ms, kTimeoutMs - 50) << "let go before the call was claimed";
  EXPECT_LT(stuck_for_ms, kTimeoutMs + 1000);
  EXPECT_TRUE(later_at_once);
#if !defined(__SANITIZE_THREAD__)  // TSan runs handlers from its own, its mask its business
  EXPECT_FALSE(signal_left_blocked) << "the rescue left its signal blocked on the thread";
#endif
  EXPECT_FALSE(g.wedge_status().ok());
  EXPECT_TRUE(wait_until([&] { return fires.fired() == 4; }, 1s));
  for (int i = 0; i < 4; i++) EXPECT_EQ(fires.code[i], static_cast<int>(Code::kTimeout)) << i;
  EXPECT_TRUE(fires.all_once());
  s.gate.block_poll = false;
  s.finish();
}

// A call that returns within the timeout is not a wedge: the work behind it goes on.
TEST(Watchdog, SlowProviderCallIsNotAWedge) {
  Rig s;
  ASSERT_NO_FATAL_FAILURE(s.start());
  NicGroup& g = *s.group;
  std::atomic<int> entered{0}, finished{0};
  {
    std::lock_guard<std::mutex> l(s.gate.mu);
    s.gate.block = true;
    s.gate.hold = std::chrono::milliseconds(kTimeoutMs / 2);
  }
  BlockingJob job{&g, &entered, &finished, Status::Ok()};
  EXPECT_TRUE(g.run_on_worker(job).ok());
  EXPECT_EQ(finished, 1);
  s.gate.release();
  Fires fires(1);
  ASSERT_TRUE(g.submit(s.expect(9, fires.notify(0))).ok());
  s.nic->inject_ = 9;  // the immediate arrives: the counter is satisfied by the worker, once
  EXPECT_TRUE(wait_until([&] { return fires.fired() == 1; }, 5s));
  EXPECT_EQ(fires.code[0], static_cast<int>(Code::kOk));
  std::this_thread::sleep_for(std::chrono::milliseconds(kTimeoutMs + 300));
  EXPECT_TRUE(g.wedge_status().ok()) << g.wedge_status().message();
  EXPECT_TRUE(fires.all_once());
  s.finish();
}

// The stuck call was made from a callback (an expect_imm's Notify calling run_on_worker): the
// group is taken over all the same, and the thread, released, never returns into the callback.
TEST(Watchdog, StuckCallInsideACallbackParksItsThread) {
  Rig s;
  ASSERT_NO_FATAL_FAILURE(s.start());
  NicGroup& g = *s.group;
  static std::atomic<int> entered{0}, finished{0}, callback_done{0};
  {
    std::lock_guard<std::mutex> l(s.gate.mu);
    s.gate.block = true;
  }
  struct Ctx {
    NicGroup* g;
  } ctx{&g};
  auto cb = [](void* arg, const Status&) {
    BlockingJob job{static_cast<Ctx*>(arg)->g, &entered, &finished, Status::Ok()};
    (void)static_cast<Ctx*>(arg)->g->run_on_worker(job);  // on the worker: runs in place, blocks
    callback_done++;
  };
  Fires fires(4);
  for (int i = 0; i < 3; i++) ASSERT_TRUE(g.submit(s.write(fires.notify(i))).ok());
  ASSERT_TRUE(g.submit(s.expect(11, fires.notify(3))).ok());
  ASSERT_TRUE(g.submit(s.expect(12, Notify{cb, &ctx})).ok());
  s.nic->inject_ = 12;
  ASSERT_TRUE(wait_until([&] { return s.gate.blocked == 1; }, 5s));
  ASSERT_TRUE(wait_until([&] { return fires.fired() == 4; }, 3 * std::chrono::milliseconds(kTimeoutMs)));
  EXPECT_FALSE(g.wedge_status().ok());
  s.gate.release();
  std::this_thread::sleep_for(200ms);
  EXPECT_EQ(finished, 0);
  EXPECT_EQ(callback_done, 0) << "the parked thread returned into the callback";
  EXPECT_TRUE(fires.all_once());
  s.finish();  // the parked worker is left behind, detached
}

}  // namespace
