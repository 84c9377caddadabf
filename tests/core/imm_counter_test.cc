// ImmCounterTable: counts regardless of order, fires waiters once, fails them on peer death and
// timeout, and lets another thread poll while the worker counts.
#include <gtest/gtest.h>

#include <thread>

#include "core/imm_counter.h"

using namespace ponte;
using Clock = std::chrono::steady_clock;

static auto far() { return Clock::now() + std::chrono::hours(1); }

TEST(ImmCounter, ArrivalsBeforeAndAfterExpect) {
  ImmCounterTable t(64, 16);
  EXPECT_TRUE(t.arrive(7));
  EXPECT_TRUE(t.arrive(7));
  Flag f;
  ASSERT_TRUE(t.expect(7, 3, 0, far(), f.notify()).ok());
  EXPECT_FALSE(f.done());
  EXPECT_TRUE(t.arrive(9));  // other values do not count
  EXPECT_FALSE(f.done());
  EXPECT_TRUE(t.arrive(7));
  ASSERT_TRUE(f.done());
  EXPECT_TRUE(f.status().ok());
  EXPECT_EQ(t.arrived(7), 0u);  // consumed by the waiter
  EXPECT_EQ(t.arrived(9), 1u);
  EXPECT_EQ(t.waiting(), 0u);
}

TEST(ImmCounter, WaitersOnOneValueFireInOrder) {
  ImmCounterTable t(64, 16);
  Flag a, b;
  ASSERT_TRUE(t.expect(1, 2, 0, far(), a.notify()).ok());
  ASSERT_TRUE(t.expect(1, 1, 0, far(), b.notify()).ok());
  t.arrive(1);
  EXPECT_FALSE(a.done());
  EXPECT_FALSE(b.done());
  t.arrive(1);
  EXPECT_TRUE(a.done());
  EXPECT_FALSE(b.done());
  t.arrive(1);
  EXPECT_TRUE(b.done());
}

TEST(ImmCounter, PeerDeathAndTimeoutFailWaiters) {
  ImmCounterTable t(64, 16);
  Flag from5, from6, any;
  ASSERT_TRUE(t.expect(1, 1, 5, far(), from5.notify()).ok());
  ASSERT_TRUE(t.expect(2, 1, 6, far(), from6.notify()).ok());
  ASSERT_TRUE(t.expect(3, 1, 0xffffffffu, Clock::now() - std::chrono::seconds(1), any.notify()).ok());
  t.fail_from(5, Status(Code::kPeerDead, "peer 5 died"));
  ASSERT_TRUE(from5.done());
  EXPECT_EQ(from5.status().code(), Code::kPeerDead);
  EXPECT_FALSE(from6.done());
  t.expire(Clock::now());
  ASSERT_TRUE(any.done());
  EXPECT_EQ(any.status().code(), Code::kTimeout);
  EXPECT_FALSE(from6.done());
  t.arrive(2);
  EXPECT_TRUE(from6.done());
  EXPECT_TRUE(from6.status().ok());
}

TEST(ImmCounter, FullTableAndWaiterPoolAreReported) {
  ImmCounterTable t(16, 1);
  int accepted = 0;
  for (uint32_t v = 0; v < 100; v++) accepted += t.arrive(v) ? 1 : 0;
  EXPECT_LT(accepted, 100);
  EXPECT_GE(accepted, 8);
  Flag a, b;
  ASSERT_TRUE(t.expect(0, 5, 0, far(), a.notify()).ok());
  Status st = t.expect(1, 5, 0, far(), b.notify());
  EXPECT_EQ(st.code(), Code::kResource);
}

TEST(ImmCounter, PollerThreadSeesWorkerArrivals) {
  ImmCounterTable t(1024, 16);
  constexpr uint32_t kValues = 64, kEach = 500;
  std::atomic<bool> done{false};
  uint32_t consumed = 0;
  std::thread poller([&] {
    while (!done.load() || consumed < kValues * kEach) {
      for (uint32_t v = 0; v < kValues; v++) {
        uint32_t n = t.arrived(v);
        if (n) {
          t.consume(v, n);
          consumed += n;
        }
      }
      if (done.load() && consumed >= kValues * kEach) break;
    }
  });
  for (uint32_t i = 0; i < kEach; i++)
    for (uint32_t v = 0; v < kValues; v++) ASSERT_TRUE(t.arrive(v));
  done = true;
  poller.join();
  EXPECT_EQ(consumed, kValues * kEach);
  for (uint32_t v = 0; v < kValues; v++) EXPECT_EQ(t.arrived(v), 0u);
}

TEST(ImmCounter, DenseValuesNeverFillTheTable) {
  // A table of 16 hashed entries, values below 100000 counted densely: every one of those fits.
  ImmCounterTable t(16, 1, 100000);
  for (uint32_t v = 0; v < 100000; v += 7) EXPECT_TRUE(t.arrive(v));
  EXPECT_EQ(t.arrived(99995), 1u);
  t.consume(99995, 1);
  EXPECT_EQ(t.arrived(99995), 0u);
  EXPECT_EQ(t.arrived(1), 0u);
  // Dense values are for pollers: a waiter on one is refused, hashed values still take waiters.
  Flag f;
  EXPECT_EQ(t.expect(7, 1, 0, far(), f.notify()).code(), Code::kInvalidArgument);
  EXPECT_TRUE(t.expect(100000, 1, 0, far(), f.notify()).ok());
  EXPECT_TRUE(t.arrive(100000));
  EXPECT_TRUE(f.done());
}
