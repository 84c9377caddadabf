// CompletionCounter: counts the completions of many engine operations (OK and failed, and the
// first failure's code) through one Notify, without allocating; tests wait for a total.
#pragma once

#include <atomic>
#include <chrono>
#include <thread>

#include "core/notify.h"
#include "core/status.h"

namespace ponte::test {

struct CompletionCounter {
  std::atomic<int> ok{0}, failed{0};
  std::atomic<Code> first_error{Code::kOk};

  static void fire(void* arg, const Status& st) {
    auto* c = static_cast<CompletionCounter*>(arg);
    if (st.ok()) {
      c->ok++;
      return;
    }
    Code none = Code::kOk;
    c->first_error.compare_exchange_strong(none, st.code());
    c->failed++;
  }
  Notify notify() { return Notify{&CompletionCounter::fire, this}; }
  int total() const { return ok + failed; }
  // Waits (sleeping 100 us between looks) until n completions or t; whether n came.
  bool wait_total(int n, std::chrono::milliseconds t) const {
    const auto deadline = std::chrono::steady_clock::now() + t;
    while (total() < n && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    return total() >= n;
  }
};

}  // namespace ponte::test
