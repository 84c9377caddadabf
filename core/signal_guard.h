// Keeps the application's signal handlers through the loading of a library (libfabric, libibverbs):
// what a dependency's constructor installs while the library loads is put back when the guard ends.
#pragma once

#include <csignal>
#include <string>

namespace ponte {

// The loaders (core/fabric/fabric_loader.cc, core/verbs/verbs_loader.cc) wrap dlopen, and dlclose
// on a failed load, in one. Why: Debian's libfabric links PSM's libinfinipath, whose constructor
// installs its own handlers for SIGINT, SIGTERM, SIGSEGV, SIGBUS, SIGILL and SIGABRT; they call
// exit(1). Ctrl-C then ended a Python program with status 1 and no KeyboardInterrupt, SIGTERM
// skipped the application's handler, and a crash left neither a core dump nor the sanitizer's
// report. A handler left by a library that is then closed again would point into unmapped code.
//
// At the guard's end, each standard signal (1..31) whose handler the load replaced by a handler
// function is given back the disposition it had when the guard began. A change to SIG_IGN or
// SIG_DFL is left alone (not code of the library; a library may ignore SIGPIPE on purpose).
// Realtime signals are not touched (glibc's own live there). The restore is logged at INFO.
class SignalGuard {
 public:
  explicit SignalGuard(std::string what);  // what: the library, for the log line
  ~SignalGuard();
  SignalGuard(const SignalGuard&) = delete;
  SignalGuard& operator=(const SignalGuard&) = delete;

  // Restores now (the destructor does nothing after it); returns the names of the signals put
  // back, space-separated ("" when the load changed none).
  std::string restore();

 private:
  static constexpr int kSignals = 32;  // 1..31
  std::string what_;
  struct sigaction saved_[kSignals];
  bool have_[kSignals] = {};
  bool restored_ = false;
};

}  // namespace ponte
