// StripePlan: shard counts both ends agree on, shards that cover the write exactly once.
#include <gtest/gtest.h>

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
      EXPECT_EQ(p.shard_bytes % 64, 0u);
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
  auto odd = StripePlan::make(1000, 1, 0, 100);  // rounded down to 64
  EXPECT_EQ(odd.shards, 16u);
  expect_covers(odd, 1000);
}
