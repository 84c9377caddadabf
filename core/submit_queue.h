// SubmitQueue: a bounded lock-free queue of fixed-size entries, many producers (any thread that
// submits) and one consumer (a group's worker). Push and pop never allocate and never block.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>

namespace ponte {

template <typename T>
class SubmitQueue {
 public:
  // capacity is rounded up to a power of two.
  explicit SubmitQueue(size_t capacity) {
    size_t cap = 2;
    while (cap < capacity) cap <<= 1;
    mask_ = cap - 1;
    cells_ = std::make_unique<Cell[]>(cap);
    for (size_t i = 0; i < cap; i++) cells_[i].seq.store(i, std::memory_order_relaxed);
  }
  size_t capacity() const { return mask_ + 1; }

  // False when the queue is full (back-pressure: the caller reports kAgain).
  bool push(const T& v) {
    size_t pos = tail_.load(std::memory_order_relaxed);
    for (;;) {
      Cell& c = cells_[pos & mask_];
      size_t seq = c.seq.load(std::memory_order_acquire);
      intptr_t diff = static_cast<intptr_t>(seq) - static_cast<intptr_t>(pos);
      if (diff == 0) {
        if (tail_.compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed)) {
          c.value = v;
          c.seq.store(pos + 1, std::memory_order_release);
          return true;
        }
      } else if (diff < 0) {
        return false;  // full
      } else {
        pos = tail_.load(std::memory_order_relaxed);
      }
    }
  }

  // Consumer only. Returns a pointer to the head entry, or nullptr when empty; pop() releases it.
  T* front() {
    Cell& c = cells_[head_ & mask_];
    size_t seq = c.seq.load(std::memory_order_acquire);
    if (static_cast<intptr_t>(seq) - static_cast<intptr_t>(head_ + 1) < 0) return nullptr;
    return &c.value;
  }
  void pop() {
    Cell& c = cells_[head_ & mask_];
    c.seq.store(head_ + mask_ + 1, std::memory_order_release);
    head_++;
  }

 private:
  struct alignas(64) Cell {
    std::atomic<size_t> seq{0};
    T value{};
  };
  std::unique_ptr<Cell[]> cells_;
  size_t mask_ = 0;
  alignas(64) std::atomic<size_t> tail_{0};
  alignas(64) size_t head_ = 0;  // consumer-owned
};

}  // namespace ponte
