// The timing every liveness test runs with.
#pragma once

#include <chrono>
#include <cstdint>

namespace ponte::test {

// PONTE_TIMEOUT_MS of every engine here: short, but not so short that a loaded two-core machine
// under a sanitizer keeps a live worker from answering for that long.
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
constexpr uint32_t kTimeoutMs = 5000;
#else
constexpr uint32_t kTimeoutMs = 2000;
#endif
// How late after the timeout an error may come: the liveness scan runs every 5 ms, the watchdog
// looks every PONTE_TIMEOUT_MS / 16; the rest is a loaded two-core machine under a sanitizer.
constexpr auto kSlack = std::chrono::milliseconds(2000);

}  // namespace ponte::test
