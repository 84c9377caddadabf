// StripePlan: shard counts both ends agree on, shards that cover the write exactly once.
#include <gtest/gtest.h>

#include <algorithm>

#include "core/stripe_plan.h"

using namespace ponte;

static void expect_covers(const StripePlan& p, size_t len) {
  size_t covered = 0;
  for (uint32_t j = 0; j < p.shards; j++) {
    size_t off = p.shard_offset(j), l = p.shard_len(j, len);
    if (l) {
      EXPECT_EQ(off, covered) << "shard " << j << " leaves a gap or overlaps";
      EXPECT_LE(l, kMaxShardBytes);
    }
    covered += l;
  }
  EXPECT_EQ(covered, len);
}

TEST(StripePlan, BelowThresholdUsesOneNic) {
  auto p = StripePlan::make(4096, 4, 256 * 1024);
  EXPECT_EQ(p.shards, 1u);
  EXPECT_EQ(p.nics, 1);
  expect_covers(p, 4096);
}

TEST(StripePlan, ZeroBytesIsOneShard) {
  auto p = StripePlan::make(0, 4, 0);
  EXPECT_EQ(p.shards, 4u);  // threshold 0: even empty writes stripe, every shard still posted
  expect_covers(p, 0);
  EXPECT_EQ(StripePlan::make(0, 4, 1).shards, 1u);
}

TEST(StripePlan, AboveThresholdStripesOverEveryNic) {
  for (int nics : {2, 3, 4, 8}) {
    for (size_t len : {size_t{256 * 1024}, size_t{1 << 20} + 7, size_t{64 << 20}}) {
      auto p = StripePlan::make(len, nics, 256 * 1024);
      EXPECT_EQ(p.shards, static_cast<uint32_t>(nics));
      EXPECT_EQ(p.nics, nics);
      EXPECT_EQ(p.shard_bytes % kShardAlignBytes, 0u);
      expect_covers(p, len);
    }
  }
}

TEST(StripePlan, HugeWritesSplitBelowMaxShard) {
  size_t len = (size_t{5} << 30) + 12345;
  auto one = StripePlan::make(len, 1, 256 * 1024);
  EXPECT_EQ(one.shards, 6u);
  expect_covers(one, len);
  auto two = StripePlan::make(len, 2, 256 * 1024);
  EXPECT_EQ(two.shards % 2, 0u);
  expect_covers(two, len);
}

TEST(StripePlan, ShardsRespectTheNicsLargestMessage) {
  size_t max = 8 << 20;  // rxe's max_msg_size
  auto one = StripePlan::make((16 << 20) + 1, 1, 256 * 1024, max);
  EXPECT_EQ(one.shards, 3u);
  EXPECT_LE(one.shard_bytes, max);
  expect_covers(one, (16 << 20) + 1);
  auto two = StripePlan::make(64 << 20, 2, 256 * 1024, max);
  EXPECT_EQ(two.shards, 8u);
  EXPECT_LE(two.shard_bytes, max);
  expect_covers(two, 64 << 20);
  auto odd = StripePlan::make(1000, 1, 0, 100);  // raised to one 128-byte line
  EXPECT_EQ(odd.shards, 8u);
  expect_covers(odd, 1000);
}

// NCCL's LL128 protocol needs every 128-byte line to arrive whole: a line split over two NICs can
// land half old, half new, with its flag already set. Every shard must therefore start on a
// 128-byte boundary (issue 10, item 5; shards used to be aligned to 64 bytes only).
TEST(StripePlan, EveryShardBoundaryIsALl128LineBoundary) {
  EXPECT_EQ(kShardAlignBytes % 128, 0u);
  const size_t maxes[] = {kMaxShardBytes, size_t{8} << 20, 4096 + 64, 1000};
  for (int nics = 1; nics <= 8; ++nics) {
    for (size_t max : maxes) {
      for (size_t len = 0; len < (size_t{3} << 20); len = len * 3 + 1 + len / 7) {
        auto p = StripePlan::make(len, nics, 0, max);
        for (uint32_t j = 0; j < p.shards; ++j) {
          if (p.shard_len(j, len) == 0) continue;
          ASSERT_EQ(p.shard_offset(j) % 128, 0u)
              << "shard " << j << " of " << p.shards << ", len " << len << ", nics " << nics << ", max " << max;
        }
        ASSERT_LE(p.shard_bytes, std::max<size_t>(max & ~size_t{127}, 128)) << len << " over " << nics;
        expect_covers(p, len);
      }
    }
  }
}
