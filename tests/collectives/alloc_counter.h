// AllocCounter: counts the C++ heap allocations (operator new) the calling thread makes while it
// lives, for tests that a steady state allocates nothing. Replaces the global operator new/delete.
#pragma once

namespace ponte::test {

class AllocCounter {
 public:
  explicit AllocCounter(bool on = true);  // counts from here when on
  ~AllocCounter();
  long stop();  // stops counting; the count so far
  AllocCounter(const AllocCounter&) = delete;
  AllocCounter& operator=(const AllocCounter&) = delete;
};

}  // namespace ponte::test
