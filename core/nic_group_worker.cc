// NicGroup's worker loop: drain submissions, post, poll the NICs, housekeeping every 100 us, idle
// back-off into epoll, and the orderly shutdown (linger) after the loop ends.
#include "core/nic_group.h"

#include <sys/epoll.h>

#include <algorithm>
#include "core/nic_group_internal.h"

namespace ponte {

void NicGroup::sleep_idle(uint32_t us) {
  sleeping_.store(true, std::memory_order_seq_cst);
  if (queue_.front() == nullptr && !stop_.load(std::memory_order_acquire)) {
    epoll_event ev;
    timespec ts{0, static_cast<long>(us) * 1000};
    int n = epoll_pwait2(epoll_fd_, &ev, 1, &ts, nullptr);
    (void)n;  // whatever woke us is serviced by the next housekeeping pass
  }
  sleeping_.store(false, std::memory_order_relaxed);
}

// Orderly shutdown, on the worker once stop_ is set: what this group already posted finishes,
// counters still waiting end with kCancelled, ready peers hear goodbye, and the NICs keep
// progressing until those peers have closed their side. Then nothing is normally mid-flight
// toward this group when its endpoints close (libfabric 1.17's rxm crashes closing an endpoint
// that holds a half-received write). Bounded: kLingerMs (or PONTE_TIMEOUT_MS if shorter).
void NicGroup::linger() {
  const auto deadline = Clock::now() + std::chrono::milliseconds(std::min(cfg_.timeout_ms, kLingerMs));
  Status cancelled(Code::kCancelled, "the engine was shut down");
  imm_.fail_all(cancelled);
  // What was submitted before the shutdown runs to its end; submit() refuses anything newer
  // (callbacks included) with kCancelled.
  for (auto now = Clock::now(); (queue_.front() != nullptr || active_count_ > 0) && now < deadline;
       now = Clock::now()) {
    now_ = now;
    drain_queue();
    if (run_head_ != kNoSlot) post_runnable();
    poll_nics();
    poll_control(now);  // handshakes still under way, peers that close meanwhile
  }
  while (active_head_ != kNoSlot) fail_slot(active_head_, Code::kCancelled, "the engine was shut down");
  const std::vector<uint8_t> bye = encode_bye();
  const uint32_t n = std::min(next_peer_.load(std::memory_order_acquire), kMaxPeers);
  for (PeerId i = 0; i < n; i++) {
    Peer& p = peers_[i];
    if (p.state.load(std::memory_order_relaxed) != kReady) continue;
    p.orderly_close = true;
    for (auto& sock : p.sock)
      if (sock.open()) (void)sock.send_message(bye);
  }
  for (;;) {
    bool waiting = false;
    for (PeerId i = 0; i < n && !waiting; i++)
      waiting = peers_[i].orderly_close && peers_[i].state.load(std::memory_order_relaxed) == kReady;
    auto now = Clock::now();
    if (!waiting || now >= deadline) break;
    poll_nics();
    poll_control(now);  // the peer's goodbye or its closed socket ends its wait
  }
}

// Polls every NIC once and handles what completed; whether anything did.
bool NicGroup::poll_nics() {
  bool any = false;
  for (size_t k = 0; k < nics_.size(); k++) {
    int n = nics_[k]->poll(comps_, kPollBatch);
    for (int c = 0; c < n; c++) on_completion(static_cast<int>(k), comps_[c]);
    any |= n > 0;
  }
  return any;
}

void NicGroup::run() {
  uint32_t idle_us = 0;
  uint32_t iter = 0;
  bool worked = false;  // since the clock was last read
  auto last_house = Clock::now();
  while (!stop_.load(std::memory_order_acquire)) {
    bool did = drain_queue();
    if (run_head_ != kNoSlot) did |= post_runnable();
    did |= poll_nics();
    worked |= did;
    if (did) idle_us = 0;
    // The clock is read every 64th pass while working and every 8th while spinning idle: a
    // clock read costs as much as an idle poll. Backing off, every pass reads it (and sleeps).
    if (idle_us == 0 && (++iter & (did ? 63u : 7u)) != 0) continue;
    auto now = Clock::now();
    now_ = now;
    if (worked) last_activity_ = now;  // the spin window starts at the last work, however brief
    worked = false;
    // Control sockets and timeouts every 100 us, busy or not: a syscall per pass would cost the
    // spin window its latency. An idle worker sleeps in epoll below and wakes for them anyway.
    if (now - last_house >= std::chrono::microseconds(100)) {
      housekeeping(now);
      last_house = now;
    }
    bool busy = active_count_ > 0 || imm_.waiting() > 0 ||
                now - last_activity_ < std::chrono::microseconds(cfg_.spin_us);
    if (did || busy) {
      idle_us = 0;
      continue;
    }
    // Idle: back off from 1 us to 50 us between polls (manual-progress providers need polls to
    // move incoming data), waking at once for a submission or a control message.
    idle_us = idle_us ? std::min<uint32_t>(idle_us * 2, 50) : 1;
    sleep_idle(idle_us);
  }
}

}  // namespace ponte
