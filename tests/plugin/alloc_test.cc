// The plugin's data path allocates nothing once warm: isend / irecv / test (and iflush) in a steady
// state make no C++ heap allocation on any thread of the process (the proxy thread that calls
// them, the engine's worker, its watchdog), counted by tests/common/all_threads_alloc_counter.h,
// which the dlopen'ed plugin's operator new binds to. libfabric's own malloc calls are the
// provider's business and not counted.
#include <gtest/gtest.h>

#include "tests/common/all_threads_alloc_counter.h"
#include "tests/plugin/harness.h"

namespace ponte::plugin_test {
namespace {

using CountAllocs = ponte::test::AllThreadsAllocCounter;

struct AllocFixture : ::testing::Test {
  static void SetUpTestSuite() {
    set_test_environment();
    setenv("PONTE_FLUSH_HOST", "1", 1);  // iflush then runs on host memory too
    // Keep-alives (a PING after a quarter of this without a control message, its PONG) come
    // every 500 ms: the idle phase below sees several.
    setenv("PONTE_TIMEOUT_MS", "2000", 1);
  }
};

// One message through one pair: the receive posted, the send, both tested to the end; the
// receiver's sizes and the data's first and last byte checked (a fresh seed per round).
void round_trip(const Net& net, const Pair& p, Buffer& src, Buffer& dst, size_t posted, size_t sent,
                uint32_t seed, bool flush) {
  src.data()[0] = static_cast<uint8_t>(seed);
  src.data()[sent - 1] = static_cast<uint8_t>(seed >> 8);
  void* data[1] = {dst.data()};
  size_t sizes[1] = {posted};
  int tags[1] = {7};
  void* mhs[1] = {dst.mh()};
  void* rreq = nullptr;
  void* sreq = nullptr;
  ASSERT_EQ(post_recv(net, p.recv, 1, data, sizes, tags, mhs, &rreq), kSuccess);
  ASSERT_EQ(post_send(net, p.send, src.data(), sent, 7, src.mh(), &sreq), kSuccess);
  ASSERT_EQ(wait_request(net, sreq, nullptr), kSuccess);
  int got[1] = {-1};
  ASSERT_EQ(wait_request(net, rreq, got), kSuccess);
  ASSERT_EQ(got[0], static_cast<int>(sent));
  ASSERT_EQ(dst.data()[0], static_cast<uint8_t>(seed));
  ASSERT_EQ(dst.data()[sent - 1], static_cast<uint8_t>(seed >> 8));
  if (flush) {
    int fsizes[1] = {static_cast<int>(sent)};
    void* freq = nullptr;
    ASSERT_EQ(net->iflush(p.recv, 1, data, fsizes, mhs, &freq), kSuccess);
    ASSERT_NE(freq, nullptr) << "iflush of host memory with PONTE_FLUSH_HOST=1 returned no request";
    ASSERT_EQ(wait_request(net, freq, nullptr), kSuccess);
  }
}

// A grouped receive (two buffers, two tags) filled by two sends in the other order.
void grouped_round(const Net& net, const Pair& p, Buffer& src, Buffer& dst, size_t each, uint32_t seed) {
  src.data()[0] = static_cast<uint8_t>(seed);
  src.data()[each] = static_cast<uint8_t>(seed + 1);
  void* data[2] = {dst.data(), dst.data() + each};
  size_t sizes[2] = {each, each};
  int tags[2] = {1, 2};
  void* mhs[2] = {dst.mh(), dst.mh()};
  void* rreq = nullptr;
  void* s2 = nullptr;
  void* s1 = nullptr;
  ASSERT_EQ(post_recv(net, p.recv, 2, data, sizes, tags, mhs, &rreq), kSuccess);
  ASSERT_EQ(post_send(net, p.send, src.data() + each, each, 2, src.mh(), &s2), kSuccess);
  ASSERT_EQ(post_send(net, p.send, src.data(), each, 1, src.mh(), &s1), kSuccess);
  ASSERT_EQ(wait_request(net, s2, nullptr), kSuccess);
  ASSERT_EQ(wait_request(net, s1, nullptr), kSuccess);
  int got[2] = {-1, -1};
  ASSERT_EQ(wait_request(net, rreq, got), kSuccess);
  ASSERT_EQ(got[0], static_cast<int>(each));
  ASSERT_EQ(got[1], static_cast<int>(each));
  ASSERT_EQ(dst.data()[0], static_cast<uint8_t>(seed));
  ASSERT_EQ(dst.data()[each], static_cast<uint8_t>(seed + 1));
}

struct Shape {
  const char* name;
  size_t posted, sent;
  bool flush;
};

// Every message shape of the protocol: inline (8 B, 4 KiB), a whole buffer in one write (64 KiB,
// 1 MiB), a partial buffer with its size record (300 KiB into 1 MiB), and the flush after it.
const Shape kShapes[] = {
    {"inline 8 B", 1 << 20, 8, false},
    {"inline 4 KiB", 1 << 20, 4096, false},
    {"whole 64 KiB", 64 << 10, 64 << 10, false},
    {"whole 1 MiB", 1 << 20, 1 << 20, false},
    {"record 300 KiB of 1 MiB", 1 << 20, 300 << 10, false},
    {"record + iflush", 1 << 20, 300 << 10, true},
};

TEST_F(AllocFixture, DataPathAllocatesNothingOnceWarm) {
  Net net;
  ASSERT_EQ(net.init_result, kSuccess);
  ASSERT_GT(net.devices(), 0) << "no device: the provider " << getenv("PONTE_FABRIC_PROVIDER")
                              << " offers no NIC here";
  Pair p;
  {
    // Setting up a pair allocates inside the plugin (its comms, the engine's peer state): seen
    // here, so the plugin's operator new is the counted one and a zero below means something.
    CountAllocs setup;
    ASSERT_EQ(connect_pair(net, 0, 0, &p), kSuccess);
    EXPECT_GT(setup.stop(/*trace=*/false), 0) << "the plugin's allocations are not seen by this counter";
  }
  {
    Buffer src(net, p.send, 2 << 20);
    Buffer dst(net, p.recv, 2 << 20);
    ASSERT_EQ(src.result, kSuccess);
    ASSERT_EQ(dst.result, kSuccess);
    constexpr int kWarm = 100, kCounted = 300;
    for (const Shape& s : kShapes) {
      SCOPED_TRACE(s.name);
      for (int i = 0; i < kWarm; ++i) {
        round_trip(net, p, src, dst, s.posted, s.sent, static_cast<uint32_t>(i), s.flush);
        if (HasFatalFailure()) return;
      }
      CountAllocs count;
      for (int i = 0; i < kCounted; ++i) {
        round_trip(net, p, src, dst, s.posted, s.sent, static_cast<uint32_t>(i + 1000), s.flush);
        if (HasFatalFailure()) return;
      }
      EXPECT_EQ(count.stop(), 0) << "C++ heap allocations in " << kCounted << " warm round trips";
    }
    SCOPED_TRACE("grouped receive, 2 x 64 KiB");
    for (int i = 0; i < kWarm; ++i) {
      grouped_round(net, p, src, dst, 64 << 10, static_cast<uint32_t>(i));
      if (HasFatalFailure()) return;
    }
    CountAllocs count;
    for (int i = 0; i < kCounted; ++i) {
      grouped_round(net, p, src, dst, 64 << 10, static_cast<uint32_t>(i + 7));
      if (HasFatalFailure()) return;
    }
    EXPECT_EQ(count.stop(), 0) << "C++ heap allocations in " << kCounted << " warm grouped rounds";
  }
  {
    // A receive posted and polled while its sender computes (as NCCL's proxy polls a step that has
    // not come): 1.5 s, three keep-alive intervals, with the workers' PINGs and PONGs on both
    // ends' control connections; then the message comes and the receive ends.
    SCOPED_TRACE("a receive polled for 1.5 s, then its message");
    Buffer src(net, p.send, 4096);
    Buffer dst(net, p.recv, 4096);
    ASSERT_EQ(src.result, kSuccess);
    ASSERT_EQ(dst.result, kSuccess);
    round_trip(net, p, src, dst, 4096, 64, 1, false);  // this pair's buffers, warm
    if (HasFatalFailure()) return;
    void* data[1] = {dst.data()};
    size_t sizes[1] = {4096};
    int tags[1] = {7};
    void* mhs[1] = {dst.mh()};
    CountAllocs count;
    void* rreq = nullptr;
    ASSERT_EQ(post_recv(net, p.recv, 1, data, sizes, tags, mhs, &rreq), kSuccess);
    const auto until = Clock::now() + std::chrono::milliseconds(1500);
    long polls = 0;
    int done = 0;
    while (Clock::now() < until) {
      ASSERT_EQ(net->test(rreq, &done, nullptr), kSuccess);
      ASSERT_EQ(done, 0) << "a receive ended with no message sent";
      ++polls;
      std::this_thread::yield();
    }
    src.data()[63] = 0x5a;
    void* sreq = nullptr;
    ASSERT_EQ(post_send(net, p.send, src.data(), 64, 7, src.mh(), &sreq), kSuccess);
    ASSERT_EQ(wait_request(net, sreq, nullptr), kSuccess);
    int got[1] = {-1};
    ASSERT_EQ(wait_request(net, rreq, got), kSuccess);
    EXPECT_EQ(got[0], 64);
    EXPECT_EQ(dst.data()[63], 0x5a);
    EXPECT_EQ(count.stop(), 0) << "C++ heap allocations while a receive was polled " << polls << " times";
  }
  close_pair(net, &p);
}

}  // namespace
}  // namespace ponte::plugin_test
