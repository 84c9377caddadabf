// A worker that was off the CPU (a loaded host, a slow completion callback) must not hand the work
// submitted meanwhile a deadline that has already passed: an operation or a counter gets
// PONTE_TIMEOUT_MS from when the engine starts it. Seen under load: a 64 MiB striped write failed with kTimeout half a
// second after it was posted with a 5 s timeout, and its target's counter likewise, because the
// deadlines were taken from the loop's clock as it was before the stall. The stall here is
// deterministic: a completion callback that keeps the worker for longer than the timeout, then
// submits (callbacks may submit), as a thread preempted for that long would find its queue.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "core/engine.h"
#include "tests/common/loopback.h"
#include "tests/common/pattern.h"

using namespace ponte;
using namespace ponte::test;
using namespace std::chrono_literals;

namespace {

constexpr uint32_t kTimeoutMs = 1500;
constexpr size_t kLen = 1 << 20;

struct Stall {
  Engine* eng = nullptr;
  uint32_t count = 0;
  Flag first;    // the operation whose callback stalls the worker
  Flag arrived;  // a counter armed from that callback, after the stall
  Status submit_expect;
  std::chrono::steady_clock::time_point armed;
  static void on_first(void* arg, const Status& st) {
    auto* s = static_cast<Stall*>(arg);
    std::this_thread::sleep_for(std::chrono::milliseconds(2 * kTimeoutMs));  // the worker is away
    s->armed = std::chrono::steady_clock::now();
    s->submit_expect = s->eng->expect_imm(0, 88, s->count, kAnyPeer, s->arrived.notify());
    s->first.notify()(st);
  }
};

TEST(WorkerStall, WorkSubmittedAfterAStallGetsItsWholeTimeout) {
  EngineOptions o;
  o.config = global_config();
  o.config.backend = BackendChoice::kFabric;
  o.config.fabric_provider = "tcp;ofi_rxm";
  o.config.ctrl_addr = "127.0.0.1";
  o.config.timeout_ms = kTimeoutMs;
  o.groups = {{0}};
  auto e = Engine::create(o);
  ASSERT_TRUE(e.ok()) << e.status().message();
  Engine& eng = **e;
  std::vector<uint8_t> a(kLen), b(kLen, 0);
  fill(a.data(), kLen, 17);
  auto ma = eng.register_memory(0, a.data(), kLen);
  auto mb = eng.register_memory(0, b.data(), kLen);
  ASSERT_TRUE(ma.ok() && mb.ok());
  auto self = eng.connect(0, eng.address(0));
  ASSERT_TRUE(self.ok()) << self.status().message();
  auto deadline = std::chrono::steady_clock::now() + 10s;
  while (!eng.peer_ready(0, *self) && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
  ASSERT_TRUE(eng.peer_ready(0, *self));

  // Several rounds: the worker reads its clock only every few passes, a stall may fall anywhere.
  for (int round = 0; round < 2; round++) {
    SCOPED_TRACE("round " + std::to_string(round));
    memset(b.data(), 0, kLen);
    Stall s;
    s.eng = &eng;
    s.count = eng.imms_per_write(0, *self, kLen);
    ASSERT_TRUE(eng.imm(0, *self, 87, Notify{&Stall::on_first, &s}).ok());
    ASSERT_TRUE(s.first.wait(30s).ok()) << s.first.status().message();
    ASSERT_TRUE(s.submit_expect.ok()) << s.submit_expect.message();
    // The counter was armed a moment ago with PONTE_TIMEOUT_MS to go: what it waits for comes
    // well within that.
    std::this_thread::sleep_for(std::chrono::milliseconds(kTimeoutMs / 5));
    Flag written;
    ASSERT_TRUE(eng.write_imm(0, *self, LocalSlice{&*ma, 0, kLen}, mb->remote(), 0, 88, written.notify()).ok());
    EXPECT_TRUE(written.wait(30s).ok()) << written.status().message();
    Status r = s.arrived.wait(30s);
    auto took = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - s.armed);
    EXPECT_TRUE(r.ok()) << "the counter armed after the stall: " << r.message() << " (" << took.count()
                        << " ms after it was armed, PONTE_TIMEOUT_MS " << kTimeoutMs << ")";
    if (r.ok()) {
      EXPECT_EQ(check(b.data(), kLen, 17), SIZE_MAX);
    } else {
      Flag late;  // count the write's immediates off, for the next round
      ASSERT_TRUE(eng.expect_imm(0, 88, s.count, kAnyPeer, late.notify()).ok());
      EXPECT_TRUE(late.wait(30s).ok());
    }
    Flag drain;  // the stalling operation's own immediate 87 arrived too
    ASSERT_TRUE(eng.expect_imm(0, 87, 1, kAnyPeer, drain.notify()).ok());
    EXPECT_TRUE(drain.wait(30s).ok()) << drain.status().message();
  }
  EXPECT_TRUE(eng.deregister(*ma).ok());
  EXPECT_TRUE(eng.deregister(*mb).ok());
}

}  // namespace

int main(int argc, char** argv) {
  ponte::test::keep_test_traffic_on_loopback();
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
