// The replaced global operator new/delete behind AllThreadsAllocCounter. A dlopen'ed library binds
// to them too: its operator new is an undefined libstdc++ symbol, found in the executable first.
#include "tests/common/all_threads_alloc_counter.h"

#include <execinfo.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <new>

namespace {

std::atomic<bool> g_counting{false};
std::atomic<long> g_allocs{0};

// Where the first counted allocations came from (backtrace() neither allocates nor locks once
// warmed up).
constexpr int kTraces = 4, kDepth = 24;
void* g_trace[kTraces][kDepth];
int g_trace_len[kTraces];

void note() {
  const long k = g_allocs.fetch_add(1, std::memory_order_relaxed);
  if (k < kTraces) g_trace_len[k] = backtrace(g_trace[k], kDepth);
}

void* counted(std::size_t n) {
  if (g_counting.load(std::memory_order_relaxed)) note();
  return std::malloc(n ? n : 1);
}

void* counted_aligned(std::size_t n, std::align_val_t a) {
  if (g_counting.load(std::memory_order_relaxed)) note();
  const std::size_t al = static_cast<std::size_t>(a);
  return std::aligned_alloc(al, (n + al - 1) / al * al);
}

}  // namespace

void* operator new(std::size_t n) {
  if (void* p = counted(n)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) {
  if (void* p = counted(n)) return p;
  throw std::bad_alloc();
}
void* operator new(std::size_t n, const std::nothrow_t&) noexcept { return counted(n); }
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept { return counted(n); }
void* operator new(std::size_t n, std::align_val_t a) {
  if (void* p = counted_aligned(n, a)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n, std::align_val_t a) {
  if (void* p = counted_aligned(n, a)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }

namespace ponte::test {

AllThreadsAllocCounter::AllThreadsAllocCounter() {
  void* warm[2];
  backtrace(warm, 2);  // its first call loads libgcc (and allocates): before counting
  g_allocs.store(0);
  g_counting.store(true);
}

AllThreadsAllocCounter::~AllThreadsAllocCounter() { g_counting.store(false); }

long AllThreadsAllocCounter::stop(bool trace) {
  g_counting.store(false);
  const long n = g_allocs.load();
  for (long k = 0; trace && k < n && k < kTraces; ++k) {
    std::fprintf(stderr, "allocation %ld of %ld, from:\n", k + 1, n);
    backtrace_symbols_fd(g_trace[k], g_trace_len[k], 2);
  }
  return n;
}

}  // namespace ponte::test
