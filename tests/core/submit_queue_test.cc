// SubmitQueue: bounded, many producers one consumer, nothing lost or duplicated (run under TSan).
#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "core/submit_queue.h"

using namespace ponte;

struct Item {
  uint32_t producer = 0;
  uint32_t seq = 0;
  uint8_t pad[56] = {};
};

TEST(SubmitQueue, FullIsReportedNotOverwritten) {
  SubmitQueue<Item> q(4);
  for (uint32_t i = 0; i < 4; i++) EXPECT_TRUE(q.push(Item{0, i, {}}));
  EXPECT_FALSE(q.push(Item{0, 99, {}}));
  for (uint32_t i = 0; i < 4; i++) {
    Item* it = q.front();
    ASSERT_NE(it, nullptr);
    EXPECT_EQ(it->seq, i);
    q.pop();
  }
  EXPECT_EQ(q.front(), nullptr);
  EXPECT_TRUE(q.push(Item{0, 5, {}}));
}

TEST(SubmitQueue, ManyProducersOneConsumer) {
  constexpr uint32_t kProducers = 4, kEach = 50000;
  SubmitQueue<Item> q(256);
  std::vector<std::thread> producers;
  for (uint32_t p = 0; p < kProducers; p++) {
    producers.emplace_back([&q, p] {
      for (uint32_t i = 0; i < kEach; i++) {
        Item it{p, i, {}};
        while (!q.push(it)) std::this_thread::yield();
      }
    });
  }
  std::vector<uint32_t> next(kProducers, 0);
  uint64_t got = 0;
  while (got < uint64_t{kProducers} * kEach) {
    Item* it = q.front();
    if (!it) {
      std::this_thread::yield();
      continue;
    }
    ASSERT_LT(it->producer, kProducers);
    // Per producer, items come out in the order they went in.
    ASSERT_EQ(it->seq, next[it->producer]);
    next[it->producer]++;
    q.pop();
    got++;
  }
  for (auto& t : producers) t.join();
  for (uint32_t p = 0; p < kProducers; p++) EXPECT_EQ(next[p], kEach);
  EXPECT_EQ(q.front(), nullptr);
}
