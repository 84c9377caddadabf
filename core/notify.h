// Notify: how an asynchronous operation reports its end (a function pointer and an argument, so
// submitting one never allocates); Flag: a pollable Notify target for threads that poll.
#pragma once

#include <atomic>
#include <chrono>
#include <thread>

#include "core/status.h"

namespace ponte {

struct Notify {
  void (*fn)(void* arg, const Status& st) = nullptr;
  void* arg = nullptr;
  void operator()(const Status& st) const {
    if (fn) fn(arg, st);
  }
};

// A one-shot completion flag: pass flag.notify() to an operation, then poll done() or wait().
class Flag {
 public:
  Notify notify() { return Notify{&Flag::fire, this}; }
  bool done() const { return state_.load(std::memory_order_acquire) != 0; }
  const Status& status() const { return status_; }  // valid once done()
  void reset() { state_.store(0, std::memory_order_relaxed); }
  // Waits at most timeout; returns kTimeout if the flag did not fire by then.
  Status wait(std::chrono::milliseconds timeout = std::chrono::milliseconds(60000)) const {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!done()) {
      if (std::chrono::steady_clock::now() > deadline)
        return Status(Code::kTimeout, "Flag::wait: not done after %lld ms",
                      static_cast<long long>(timeout.count()));
      std::this_thread::yield();
    }
    return status_;
  }

 private:
  static void fire(void* arg, const Status& st) {
    auto* f = static_cast<Flag*>(arg);
    f->status_ = st;
    f->state_.store(1, std::memory_order_release);
  }
  std::atomic<int> state_{0};
  Status status_;
};

}  // namespace ponte
