// The replaced global operator new/delete behind AllocCounter (alloc_counter.h). In a file of its
// own: GCC's -Wmismatched-new-delete misreads malloc/free pairs inlined beside their callers.
#include "tests/collectives/alloc_counter.h"

#include <cstdlib>
#include <new>

namespace {
thread_local bool tls_counting = false;
thread_local long tls_count = 0;
}  // namespace

void* operator new(std::size_t n) {
  if (tls_counting) tls_count++;
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

namespace ponte::test {

AllocCounter::AllocCounter(bool on) {
  tls_count = 0;
  tls_counting = on;
}
AllocCounter::~AllocCounter() { tls_counting = false; }
long AllocCounter::stop() {
  tls_counting = false;
  return tls_count;
}

}  // namespace ponte::test
