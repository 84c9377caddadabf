// Waiting, bounded, for a fork()ed child of a test to exit: its exit status, or why there is none.
// A child that does not end in time is killed, so a hang fails the test instead of stalling it.
#pragma once

#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <thread>

namespace ponte::test {

constexpr int kChildKilledBySignal = -1;
constexpr int kChildHung = -2;  // still running at the deadline; killed and reaped

// The child's exit status (0..255), kChildKilledBySignal, or kChildHung.
inline int wait_child_exit(pid_t child, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  for (;;) {
    const pid_t got = waitpid(child, &status, WNOHANG);
    if (got == child) return WIFEXITED(status) ? WEXITSTATUS(status) : kChildKilledBySignal;
    if (got < 0) return kChildKilledBySignal;  // not our child, or reaped elsewhere
    if (std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  kill(child, SIGKILL);
  waitpid(child, &status, 0);
  return kChildHung;
}

}  // namespace ponte::test
