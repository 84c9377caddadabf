// ImmCounterTable: per-group counters of arrived immediates, keyed by the 32-bit value, with
// waiters ("call me when N carrying X arrived") and a lock-free poller view. Never relies on order.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/notify.h"

namespace ponte {

class ImmCounterTable {
 public:
  // capacity: number of distinct immediate values the table can hold (rounded up to a power of 2);
  // max_waiters: expectations pending at once; values below dense are counted in a flat array
  // instead (never full, poller view only: expect refuses them).
  ImmCounterTable(size_t capacity, size_t max_waiters, uint32_t dense = 0);

  // ---- Worker thread only.
  // Counts one arrival of value; fires the waiters it satisfies. False when the table is full
  // (the arrival is dropped: the caller logs it).
  bool arrive(uint32_t value);
  // Registers a waiter; fires at once if enough already arrived. kResource when full.
  Status expect(uint32_t value, uint32_t count, uint32_t from_peer,
                std::chrono::steady_clock::time_point deadline, Notify done);
  // Fails every waiter that waits on from_peer (its death) with st.
  void fail_from(uint32_t from_peer, const Status& st);
  // Fails waiters whose deadline passed.
  void expire(std::chrono::steady_clock::time_point now);
  // Fails every waiter (engine shutdown).
  void fail_all(const Status& st);
  size_t waiting() const { return waiting_; }

  // ---- Any thread.
  uint32_t arrived(uint32_t value) const;
  void consume(uint32_t value, uint32_t n);

 private:
  static constexpr uint32_t kNone = 0xffffffffu;
  struct Entry {
    std::atomic<uint64_t> key{0};  // (1 << 32) | value, 0 = empty
    std::atomic<uint32_t> count{0};
    uint32_t waiter_head = kNone;  // worker-only FIFO of waiters
    uint32_t waiter_tail = kNone;
  };
  struct Waiter {
    uint32_t value = 0;
    uint32_t count = 0;
    uint32_t from = 0;
    uint32_t next = kNone;  // next in the entry's FIFO, or in the free list
    bool live = false;
    std::chrono::steady_clock::time_point deadline;
    Notify done;
  };
  Entry* find(uint32_t value) const;
  Entry* find_or_insert(uint32_t value);
  void satisfy(Entry* e);
  void unlink(Entry* e, uint32_t w);
  template <typename Pred>
  void fail_if(Pred pred, const Status& st);

  std::unique_ptr<std::atomic<uint32_t>[]> dense_;  // counts of values below dense_n_
  uint32_t dense_n_ = 0;
  std::unique_ptr<Entry[]> entries_;
  size_t mask_ = 0;
  size_t used_ = 0;
  std::vector<Waiter> waiters_;
  uint32_t free_waiter_ = kNone;
  size_t waiting_ = 0;
};

}  // namespace ponte
