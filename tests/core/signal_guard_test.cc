// SignalGuard (core/signal_guard.h): handlers a library installs while it loads are given back, and
// ponte's loaders use it, so that loading libfabric (whose PSM dependency takes six signals on
// Debian) leaves the application's Ctrl-C, SIGTERM and crash handling as they were.
#include "core/signal_guard.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <string>
#include <vector>

#if PONTE_TEST_FABRIC
#include "core/fabric/fabric_loader.h"
#endif
#if PONTE_TEST_VERBS
#include "core/verbs/verbs_loader.h"
#endif

namespace ponte {
namespace {

std::atomic<int> g_caught{0};
void count_signal(int) { g_caught.fetch_add(1); }
void other_handler(int, siginfo_t*, void*) {}

void* handler_of(int sig) {
  struct sigaction a;
  EXPECT_EQ(sigaction(sig, nullptr, &a), 0);
  return (a.sa_flags & SA_SIGINFO) ? reinterpret_cast<void*>(a.sa_sigaction) : reinterpret_cast<void*>(a.sa_handler);
}
void set_handler(int sig, void (*fn)(int)) {
  struct sigaction a = {};
  a.sa_handler = fn;
  sigemptyset(&a.sa_mask);
  ASSERT_EQ(sigaction(sig, &a, nullptr), 0);
}

// Each test sets its signals to count_signal (or leaves them) and puts the process's dispositions
// back when it ends (the sanitizers install handlers of their own at start-up).
class SignalGuardTest : public ::testing::Test {
 protected:
  static constexpr int kSignals[] = {SIGINT, SIGTERM, SIGSEGV, SIGBUS, SIGILL, SIGABRT, SIGPIPE, SIGUSR1};
  void SetUp() override {
    for (int s : kSignals) sigaction(s, nullptr, &saved_[s]);
    g_caught = 0;
  }
  void TearDown() override {
    for (int s : kSignals) sigaction(s, &saved_[s], nullptr);
  }
  // Raises sig and waits (bounded) for count_signal to have run: under TSan a signal is handled at
  // the next safe point, not inside raise().
  static bool raised_and_caught(int sig) {
    const int before = g_caught.load();
    raise(sig);
    for (int i = 0; i < 1000 && g_caught.load() == before; i++) usleep(1000);
    return g_caught.load() == before + 1;
  }
  struct sigaction saved_[65];
};

TEST_F(SignalGuardTest, GivesBackHandlersInstalledInItsScopeAndLeavesIgnoresAlone) {
  set_handler(SIGINT, count_signal);
  set_handler(SIGPIPE, SIG_DFL);
  set_handler(SIGUSR1, SIG_DFL);
  std::string put_back;
  {
    SignalGuard guard("a test library");
    struct sigaction a = {};
    a.sa_sigaction = other_handler;
    a.sa_flags = SA_SIGINFO;
    sigemptyset(&a.sa_mask);
    ASSERT_EQ(sigaction(SIGINT, &a, nullptr), 0);
    ASSERT_EQ(sigaction(SIGUSR1, &a, nullptr), 0);
    set_handler(SIGPIPE, SIG_IGN);  // not code: left as the library set it
    put_back = guard.restore();
  }
  EXPECT_EQ(put_back, "SIGINT SIGUSR1");
  EXPECT_EQ(handler_of(SIGINT), reinterpret_cast<void*>(count_signal));
  EXPECT_EQ(handler_of(SIGUSR1), reinterpret_cast<void*>(SIG_DFL));
  EXPECT_EQ(handler_of(SIGPIPE), reinterpret_cast<void*>(SIG_IGN));
  EXPECT_TRUE(raised_and_caught(SIGINT));
  // Nothing changed in scope: nothing put back.
  SignalGuard quiet("nothing");
  EXPECT_EQ(quiet.restore(), "");
}

#if PONTE_TEST_FABRIC
// The library is not a libfabric: the loader closes it again, and a handler left pointing into it
// would run unmapped code on the next Ctrl-C.
TEST_F(SignalGuardTest, FabricLoaderGivesBackWhatALibraryTookAndClosedAgain) {
  set_handler(SIGINT, count_signal);
  set_handler(SIGTERM, count_signal);
  auto lib = fabric::load_fabric_library({PONTE_SIGNAL_TAKER_SO}, false);
  ASSERT_FALSE(lib.ok());  // no fi_getinfo in it (the message names the path, cut to fit: not checked)
  EXPECT_EQ(lib.status().code(), Code::kUnavailable) << lib.status().message();
  EXPECT_EQ(handler_of(SIGINT), reinterpret_cast<void*>(count_signal));
  EXPECT_EQ(handler_of(SIGTERM), reinterpret_cast<void*>(count_signal));
  EXPECT_TRUE(raised_and_caught(SIGINT));
  EXPECT_TRUE(raised_and_caught(SIGTERM));
}

// The real thing: Debian's libfabric loads PSM's libinfinipath, whose constructor takes these six
// (a libfabric without that dependency takes none, and the test holds as well).
TEST_F(SignalGuardTest, LoadingLibfabricLeavesTheApplicationsHandlers) {
  const int six[] = {SIGINT, SIGTERM, SIGSEGV, SIGBUS, SIGILL, SIGABRT};
  for (int s : six) set_handler(s, count_signal);
  auto lib = fabric::load_fabric_library(fabric::fabric_library_candidates(""), false);
  ASSERT_TRUE(lib.ok()) << lib.status().message();
  for (int s : six) EXPECT_EQ(handler_of(s), reinterpret_cast<void*>(count_signal)) << sigabbrev_np(s);
  EXPECT_TRUE(raised_and_caught(SIGINT));
}
#endif

#if PONTE_TEST_VERBS
// libibverbs' loader keeps what it opens (provider state): the handler would stay the library's.
TEST_F(SignalGuardTest, VerbsLoaderGivesBackWhatALibraryTook) {
  set_handler(SIGINT, count_signal);
  auto api = verbs::load_verbs_api(PONTE_SIGNAL_TAKER_SO);
  ASSERT_FALSE(api.ok());  // it lacks every ibv_ entry point
  EXPECT_EQ(api.status().code(), Code::kUnavailable) << api.status().message();
  EXPECT_EQ(handler_of(SIGINT), reinterpret_cast<void*>(count_signal));
  EXPECT_TRUE(raised_and_caught(SIGINT));
}
#endif

}  // namespace
}  // namespace ponte
