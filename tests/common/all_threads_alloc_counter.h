// AllThreadsAllocCounter: counts the C++ heap allocations (every global operator new) that any
// thread of the process makes while it counts, and where the first few came from. For tests that
// a steady state allocates nothing, workers and dlopen'ed libraries included.
#pragma once

namespace ponte::test {

// The executable that links all_threads_alloc_counter.cc replaces the global operator new and
// delete. One counter at a time.
class AllThreadsAllocCounter {
 public:
  AllThreadsAllocCounter();  // counts from here
  ~AllThreadsAllocCounter();
  // Stops counting; the count. With `trace` and a nonzero count, prints the backtraces of the
  // first allocations to stderr (a dlopen'ed library's frames as offsets: addr2line -e LIB).
  long stop(bool trace = true);
  AllThreadsAllocCounter(const AllThreadsAllocCounter&) = delete;
  AllThreadsAllocCounter& operator=(const AllThreadsAllocCounter&) = delete;
};

}  // namespace ponte::test
