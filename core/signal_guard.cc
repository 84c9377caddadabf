// SignalGuard: the application's signal handlers, saved before a library loads and given back after.
#include "core/signal_guard.h"

#include <cstring>

#include "core/log.h"

namespace ponte {
namespace {

// The handler a disposition runs, or nullptr for SIG_DFL / SIG_IGN.
void* handler_function(const struct sigaction& a) {
  void* fn = (a.sa_flags & SA_SIGINFO) != 0 ? reinterpret_cast<void*>(a.sa_sigaction)
                                            : reinterpret_cast<void*>(a.sa_handler);
  if (fn == reinterpret_cast<void*>(SIG_DFL) || fn == reinterpret_cast<void*>(SIG_IGN)) return nullptr;
  return fn;
}

}  // namespace

SignalGuard::SignalGuard(std::string what) : what_(std::move(what)) {
  for (int s = 1; s < kSignals; s++) {
    if (s == SIGKILL || s == SIGSTOP) continue;
    have_[s] = sigaction(s, nullptr, &saved_[s]) == 0;
  }
}

SignalGuard::~SignalGuard() {
  if (!restored_) restore();
}

std::string SignalGuard::restore() {
  restored_ = true;
  std::string names;
  for (int s = 1; s < kSignals; s++) {
    if (!have_[s]) continue;
    struct sigaction now;
    if (sigaction(s, nullptr, &now) != 0) continue;
    void* fn = handler_function(now);
    if (fn == nullptr || fn == handler_function(saved_[s])) continue;
    if (sigaction(s, &saved_[s], nullptr) != 0) continue;
    if (!names.empty()) names += ' ';
    const char* abbrev = sigabbrev_np(s);
    names += abbrev != nullptr ? std::string("SIG") + abbrev : "signal " + std::to_string(s);
  }
  if (!names.empty()) {
    PONTE_LOG_INFO("loading %s installed handlers for %s (a dependency's constructor); the process's own "
                   "are back", what_.c_str(), names.c_str());
  }
  return names;
}

}  // namespace ponte
