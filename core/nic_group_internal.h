// NicGroup's private constants, shared by its parts (lifecycle, handshake, scheduling, liveness,
// worker loop). Internal to core/nic_group*.cc.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>

namespace ponte {

using Clock = std::chrono::steady_clock;

inline constexpr uint32_t kMaxPeers = 4096;
// epoll tags: a peer's socket is (id << 1) | which; a pending one kPendingBit | fd.
inline constexpr uint64_t kWakeTag = ~uint64_t{0};
inline constexpr uint64_t kListenTag = ~uint64_t{0} - 1;
inline constexpr uint64_t kNicWaitTag = ~uint64_t{0} - 2;  // a NIC's wait object (Nic::wait_fd)
inline constexpr uint64_t kPendingBit = uint64_t{1} << 62;
// Accepted connections that have not named their peer yet: at most this many (more are closed at
// once), each given at most kAuthWindowMs (and PONTE_TIMEOUT_MS) to prove it was invited, checked
// for deadlines every kPendingScanMs.
inline constexpr size_t kMaxPending = 256;
inline constexpr uint32_t kAuthWindowMs = 5000;
inline constexpr uint32_t kPendingScanMs = 10;
inline constexpr uint32_t kListenPauseMs = 100;  // out of descriptors: the port rests this long
inline constexpr size_t kImmTableSize = 1 << 16;
// How long the worker sleeps between passes while a thread polls the group (Engine::progress):
// the poller moves the data, the worker keeps control sockets, liveness and timeouts going. The
// sleep starts at kPollerBackoffUs and doubles while the polling goes on, up to
// PONTE_POLLER_SLEEP_US (Config::poller_sleep_us, default 5 ms: the period of the timeout scan in
// housekeeping): each wake-up takes the poller's core for tens of microseconds on a host where
// the pollers fill the cores (the plugin's 8-byte ping-pong on two
// cores: 47 us a half round trip at 50 us sleeps, 35 us at 500; against 500, a 5 ms bound took the
// plugin's ping-pong from 28-33 us to 24-27 us and its 4 MiB stream from 3.5-3.9 GB/s to 3.9-5.1).
// Control sockets wake it at once; so does a submission from a thread that is not polling
// (NicGroup::submit), and a poller that says it stops (Engine::stop_polling).
inline constexpr uint32_t kPollerBackoffUs = 50;
// An idle worker (nothing submitted, in flight or waited for) polls its NICs at most kIdlePollUs
// apart: a manual-progress provider (tcp;ofi_rxm) moves incoming data only when polled. Once the
// group has done nothing for kDeepIdleAfterUs, the sleeps go on doubling up to
// PONTE_IDLE_SLEEP_US (Config::idle_sleep_us, 1 ms): about 8,000 wake-ups a second cost an idle
// engine 11-13 % of a core on this project's 2-core host (1-1.7 % now), and an NCCL rank keeps
// one idle engine (device 0's, from the probe) beside the one it uses. Submissions and control
// messages still wake it at once; what waits is only incoming data nobody waits for, up to that
// sleep, after 10 ms of silence. With PONTE_IDLE_WAKE, sleeps longer than kIdlePollUs end when
// such data arrives too, where the NICs give a wait object (Nic::wait_fd; NicInfo::cq_wait_resets
// says where: tcp;ofi_rxm on this host's libfabric 1.17).
inline constexpr uint32_t kIdlePollUs = 50;
inline constexpr uint32_t kDeepIdleAfterUs = 10000;
// How long a spinning worker with nothing to do keeps its core before it starts yielding it.
inline constexpr uint32_t kSpinYieldAfterUs = 20;
// A round whose backend connection fails on this side (on verbs: a new QP refused RTR or RTS) is
// followed by a fresh round, at most this many in a row; then the peer is dead.
inline constexpr uint32_t kMaxFailedRounds = 3;
inline constexpr uint32_t kLingerMs = 250;  // orderly shutdown's bound (and PONTE_TIMEOUT_MS's)
inline constexpr uint32_t kLingerIdleMs = 2000;  // orderly shutdown: posted work may go this long without a completion

}  // namespace ponte
