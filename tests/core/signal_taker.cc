// A library whose constructor takes signals, as PSM's libinfinipath (linked by Debian's libfabric)
// does: SIGINT and SIGTERM get a handler that ends the process with status 3, SIGPIPE is ignored.
// tests/core/signal_guard_test.cc loads it through ponte's loaders, which must give the handlers back.
#include <signal.h>
#include <unistd.h>

namespace {

void end_process(int) { _exit(3); }

__attribute__((constructor)) void take_signals() {
  struct sigaction a = {};
  a.sa_handler = end_process;
  sigemptyset(&a.sa_mask);
  sigaction(SIGINT, &a, nullptr);
  sigaction(SIGTERM, &a, nullptr);
  a.sa_handler = SIG_IGN;
  sigaction(SIGPIPE, &a, nullptr);
}

}  // namespace
