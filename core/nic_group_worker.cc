// NicGroup's worker loop: drain submissions, post, poll the NICs, housekeeping every 100 us, idle
// back-off into epoll, the orderly shutdown (linger) after the loop ends, the progress token that
// lets a polling thread run the data path's passes itself (progress()), and the way out of both
// for a thread whose provider call the watchdog claimed (core/watchdog.h).
#include "core/nic_group.h"

#include <pthread.h>

#include <csetjmp>
#include <csignal>

#include <sys/epoll.h>

#include <algorithm>
#include <thread>

#include "core/nic_group_internal.h"

namespace ponte {

// The caller has set sleeping_ (and looked at the queue under the token): us = 0 does not sleep.
void NicGroup::sleep_idle(uint32_t us, bool on_nics) {
  if (us > 0 && !stop_.load(std::memory_order_acquire)) {
    // The NICs' wait objects join the epoll set for this sleep only: signalled after every
    // completion and reset only by the next arming, they would end every other sleep at once.
    if (on_nics)
      for (auto& nic : nics_)
        if (nic->wait_fd() >= 0) epoll_add(nic->wait_fd(), kNicWaitTag);
    epoll_event ev;
    timespec ts{static_cast<time_t>(us / 1000000), static_cast<long>(us % 1000000) * 1000};
    int n = epoll_pwait2(epoll_fd_, &ev, 1, &ts, nullptr);
    if (on_nics)
      for (auto& nic : nics_)
        if (nic->wait_fd() >= 0) epoll_del(nic->wait_fd());
    // A submission's wake-up is drained here, not at the next housekeeping pass (up to 100 us
    // away): the eventfd, level-triggered, would end every sleep until then at once, a spin in
    // disguise. Whatever else woke us is serviced by the next housekeeping pass.
    if (n == 1 && ev.data.u64 == kWakeTag) {
      uint64_t v;
      if (read(wake_fd_, &v, sizeof(v)) < 0) { /* drained already */ }
    } else if (n == 1) {
      // A control socket: a peer is handshaking or talking; its fabric traffic follows. Or a NIC's
      // wait object: its traffic is here. Either way the worker leaves deep idle
      // (kDeepIdleAfterUs) and polls at most kIdlePollUs apart again.
      last_activity_ = Clock::now();
    }
  }
  sleeping_.store(false, std::memory_order_relaxed);
}

bool NicGroup::arm_nic_waits() {
  bool any = false;
  for (auto& nic : nics_) {
    if (nic->wait_fd() < 0) continue;
    if (!nic->arm_wait()) return false;  // something is pending: a blind sleep, then a poll
    any = true;
  }
  return any;
}

// Orderly shutdown, on the worker once stop_ is set: what this group already posted finishes,
// counters still waiting end with kCancelled, ready peers hear goodbye, and the NICs keep
// progressing until those peers have closed their side. Then nothing is normally mid-flight
// toward this group when its endpoints close (libfabric 1.17's rxm crashes closing an endpoint
// that holds a half-received write). The posted work is waited for until kLingerIdleMs (or
// PONTE_TIMEOUT_MS if shorter) pass without a completion (a peer that stopped answering), and
// PONTE_TIMEOUT_MS in all; the goodbyes, kLingerMs. On two cores under two busy loops and a test
// suite, 16 posted writes of 256 KiB over tcp;ofi_rxm went 250-305 ms without a completion, and a
// single 250 ms bound cancelled them on the wire. A pass that moved nothing yields the core (the
// peer may need it to take the data).
void NicGroup::linger() {
  if (wedged_.load(std::memory_order_acquire)) return;  // the watchdog's now
  const auto start = Clock::now();
  const auto idle_bound = std::chrono::milliseconds(std::min(cfg_.timeout_ms, kLingerIdleMs));
  const auto hard_deadline = start + std::chrono::milliseconds(std::max(cfg_.timeout_ms, kLingerMs));
  Status cancelled(Code::kCancelled, "the engine was shut down");
  imm_.fail_all(cancelled);
  // What was submitted before the shutdown runs to its end; submit() refuses anything newer
  // (callbacks included) with kCancelled.
  auto last_progress = start;
  for (auto now = start; (queue_.front() != nullptr || active_count_ > 0) && now - last_progress < idle_bound &&
                         now < hard_deadline;
       now = Clock::now()) {
    now_ = now;
    in_drain_ = true;
    bool did = drain_queue();
    in_drain_ = false;
    if (run_head_ != kNoSlot) did |= post_runnable();
    flush_nic_posts();
    did |= poll_nics();
    poll_control(now);  // handshakes still under way, peers that close meanwhile
    if (did) last_progress = now;
    else std::this_thread::yield();
  }
  while (active_head_ != kNoSlot) fail_slot(active_head_, Code::kCancelled, "the engine was shut down");
  // The goodbyes: as long as before when the drain was quick, a fifth of the bound after a slow one.
  const auto bye_bound = std::chrono::milliseconds(std::min(cfg_.timeout_ms, kLingerMs));
  const auto deadline = std::min(hard_deadline, std::max(start + bye_bound, Clock::now() + bye_bound / 5));
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

void NicGroup::flush_nic_posts() {
  for (auto& nic : nics_) nic->flush_posts();
}

// Polls every NIC once and handles what completed; whether anything did.
bool NicGroup::poll_nics() {
  bool any = false;
  for (size_t k = 0; k < nics_.size(); k++) {
    int n = nics_[k]->poll(comps_, kPollBatch);
    for (int c = 0; c < n; c++) on_completion(static_cast<int>(k), comps_[c]);
    any |= n > 0;
  }
  // What the completions' callbacks started (the next op of a chain) goes out now, not at the
  // next pass: a poller may not come back, and the worker may sleep first.
  if (any) flush_nic_posts();
  return any;
}

// ---- the progress token

// Whether a thread that polls may post on these NICs. Where a post can wait on the peer process
// itself (NicInfo::post_may_block_on_peer: shm takes a lock in the peer's shared memory, which a
// stopped peer may hold for good), a post may never return, nor the thread making it. The worker
// may be that thread (the watchdog turns it into errors); a poller, the application's own thread
// (NCCL's proxy inside test()), must not be: there it only reaps completions, and the worker
// starts and posts what is submitted.
bool NicGroup::pollers_may_post(const std::vector<std::unique_ptr<Nic>>& nics) {
  for (const auto& n : nics)
    if (n->info().post_may_block_on_peer) return false;
  return true;
}

namespace {
thread_local const NicGroup* tls_holder = nullptr;  // the group whose token this thread holds
thread_local const NicGroup* tls_poller = nullptr;  // the group this thread last polled
thread_local Clock::time_point tls_polled_at;        // and when
}  // namespace

bool NicGroup::on_worker() const { return tls_holder == this; }
// This thread polls this group: it called progress() on it last, within PONTE_POLLER_HOLD_US.
bool NicGroup::polled_here() const {
  return tls_poller == this && Clock::now() - tls_polled_at < std::chrono::microseconds(cfg_.poller_hold_us);
}

bool NicGroup::take_token() {
  if (token_.load(std::memory_order_relaxed) || token_.exchange(true, std::memory_order_acquire))
    return false;
  tls_holder = this;
  return true;
}

bool NicGroup::hold_token() {
  while (!take_token()) {  // a poller holds it for one pass at most, unless it is stuck in a provider
    if (wedged_.load(std::memory_order_acquire)) return false;
    std::this_thread::yield();
  }
  return true;
}

void NicGroup::release_token() {
  tls_holder = nullptr;
  token_.store(false, std::memory_order_release);
}

bool NicGroup::progress() {
  if (tls_holder != nullptr) return false;  // from a callback: its thread is mid-pass already
  tls_poller = this;
  tls_polled_at = Clock::now();
  last_poll_.store(tls_polled_at.time_since_epoch().count(), std::memory_order_relaxed);
  poll_calls_.store(poll_calls_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  // Only when the worker sleeps, or ran no pass since the last call (it is not getting the CPU):
  // a worker that runs anyway does the work, without two threads bouncing its state.
  const uint64_t passes = passes_.load(std::memory_order_relaxed);
  if (!sleeping_.load(std::memory_order_relaxed) &&
      passes_seen_.exchange(passes, std::memory_order_relaxed) != passes)
    return false;
  return poller_pass(true);
}

// One pass of the data path on a polling thread, under the token: posts what is submitted (where
// pollers may post) and, with reap, reaps completions and immediates and runs their callbacks.
bool NicGroup::poller_pass(bool reap) {
  if (stop_.load(std::memory_order_relaxed) || wedged_.load(std::memory_order_relaxed)) return false;
  if (!take_token()) {
    // Another thread is mid-pass (a second poller, or a worker that lost the CPU mid-pass): it
    // moves our data too. A poller that spins on (NCCL's proxy threads, aws-ofi-nccl's tests:
    // four per rank) would take the CPU it needs, so give it up once here.
    if (reap) std::this_thread::yield();
    return false;
  }
  if (!rescue_) return pass_holding_token(reap);
  // Where a provider call may never return (shm), the watchdog can send this thread back here
  // from a call it claimed (core/watchdog.h, poller_rescue): the group is wedged then, its token
  // taken for good, as after GroupWedged.
  sigjmp_buf escape;
  if (sigsetjmp(escape, 0) != 0) {
    tls_holder = nullptr;
    disarm_escape();
    return false;
  }
  escape_thread_ = pthread_self();
  escape_state_.store(kEscapeArmed, std::memory_order_release);
  poller_rescue::set_escape(&escape);
  const bool did = pass_holding_token(reap);
  disarm_escape();
  return did;
}

void NicGroup::disarm_escape() {
  poller_rescue::set_escape(nullptr);
  uint8_t armed = kEscapeArmed;
  if (escape_state_.compare_exchange_strong(armed, kEscapeIdle, std::memory_order_acq_rel)) return;
  // The watchdog is sending the signal: this thread stays until it has (it must not be gone).
  while (escape_state_.load(std::memory_order_acquire) == kEscapeSignalling) std::this_thread::yield();
  escape_state_.store(kEscapeIdle, std::memory_order_relaxed);
}

// The watchdog, having claimed a call: lets a polling thread in it go (the signal's handler jumps
// back into poller_pass when the thread is inside the claimed provider call).
void NicGroup::rescue_poller() {
  uint8_t armed = kEscapeArmed;
  if (!rescue_ || !escape_state_.compare_exchange_strong(armed, kEscapeSignalling, std::memory_order_acq_rel)) return;
  pthread_kill(escape_thread_, poller_rescue::signal_number());
  escape_state_.store(kEscapeSignalled, std::memory_order_release);
}

bool NicGroup::pass_holding_token(bool reap) {
  bool did = false;
  try {
    if (!stop_.load(std::memory_order_acquire) && !wedged_.load(std::memory_order_acquire)) {
      if (pollers_post_) {
        in_drain_ = true;
        did = drain_queue();
        in_drain_ = false;
        if (run_head_ != kNoSlot) did |= post_runnable();
        flush_nic_posts();
      }
      if (reap) did |= poll_nics();
    }
  } catch (const GroupWedged&) {
    // The watchdog claimed our provider call: the group is its own now, token included (taken
    // for good, so nobody enters again). Nothing of the group may be written on the way out.
    tls_holder = nullptr;
    return false;
  }
  release_token();
  return did;
}

bool NicGroup::start_submitted() {
  if (!pollers_post_ || tls_holder != nullptr) return false;
  return poller_pass(false);  // (no rescue needed: where a call may not return, pollers do not post)
}

void NicGroup::stop_polling() {
  if (tls_poller != this) return;  // this thread is not polling us
  tls_poller = nullptr;            // its submissions wake the worker again (submit)
  // Stored before sleeping_ is read, as the worker stores sleeping_ before it reads this (both
  // sequentially consistent): it sees the flag before it sleeps, or we see it asleep and wake it.
  poller_left_.store(true, std::memory_order_seq_cst);
  if (sleeping_.load(std::memory_order_seq_cst) && sleeping_.exchange(false, std::memory_order_acq_rel)) {
    uint64_t one = 1;
    if (write(wake_fd_, &one, sizeof(one)) < 0) { /* already signalled */ }
  }
}

// ---- the worker loop

void NicGroup::worker_main() {
  try {
    run();
    linger();
  } catch (const GroupWedged&) {
    // The watchdog claimed the provider call this thread was in (core/watchdog.h): it returned,
    // late, into nothing of the group's. The token stays taken for good.
    tls_holder = nullptr;
  }
  worker_exited_.store(true, std::memory_order_release);
}

void NicGroup::run() {
  PassState st;
  st.last_house = Clock::now();
  while (!stop_.load(std::memory_order_acquire) && !wedged_.load(std::memory_order_relaxed)) {
    // Counted before taking the token: a poller that sees the count move steps aside on its next
    // call, so the worker is never starved of the token, and never waits for one either.
    passes_.store(passes_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
    if (!take_token()) {
      // A poller is mid-pass: it moves the data, the worker leaves it the CPU, with the same
      // growing sleep as between its own passes while somebody polls (worker_pass).
      sleeping_.store(true, std::memory_order_seq_cst);
      sleep_idle(poller_left_.load(std::memory_order_seq_cst) ? 0 : poller_sleep(st));
      continue;
    }
    uint32_t sleep_us = worker_pass(st);
    const bool sleep = sleep_us > 0;
    if (sleep) {
      // Announced before the last look at the queue: a submission after it sees sleeping_ and
      // wakes us (a poller's own is started by its next progress() call).
      sleeping_.store(true, std::memory_order_seq_cst);
      // Work queued meanwhile: no sleep, unless a poller that may post starts it. A poller that
      // left meanwhile (stop_polling saw no sleeper to wake): no sleep either.
      if (queue_.front() != nullptr && (!st.poller_active || !pollers_post_)) sleep_us = 0;
      if (poller_left_.load(std::memory_order_seq_cst)) sleep_us = 0;
    }
    // With PONTE_IDLE_WAKE (the NICs have wait objects), a long idle sleep (no poller, nothing in
    // flight) also ends when traffic arrives: a manual-progress provider moves a peer's writes
    // into this engine only inside a poll, and the writer waits for that (on tcp;ofi_rxm, 32 KiB
    // writes into an engine that waited for nothing took 0.96-1.2 ms each without it, the sleep).
    const bool on_nics = sleep_us > kIdlePollUs && !st.poller_active && arm_nic_waits();
    release_token();
    if (sleep) {
      sleep_idle(sleep_us, on_nics);
    } else if (st.yield_now) {
      st.yield_now = false;
      std::this_thread::yield();  // see worker_pass
    }
  }
  // linger, then stop(), own the group from here on; unless it is wedged (a poller stuck inside a
  // provider call holds the token): then the watchdog does.
  if (!hold_token()) tls_holder = nullptr;
}

// kPollerBackoffUs, doubling on each call up to PONTE_POLLER_SLEEP_US (nic_group_internal.h); a pass
// that found work resets it (idle_us = 0).
uint32_t NicGroup::poller_sleep(PassState& st) const {
  const uint32_t first = std::min(kPollerBackoffUs, cfg_.poller_sleep_us);
  st.idle_us = st.idle_us >= first ? std::min(st.idle_us * 2, cfg_.poller_sleep_us) : first;
  return st.idle_us;
}

uint32_t NicGroup::worker_pass(PassState& st) {
  // A thread polling this group (progress() within the last PONTE_POLLER_HOLD_US) moves the data
  // itself, as NCCL's proxy does inside test(): the worker leaves it the data path (one thread
  // driving the provider, not two taking turns at the token and the cores) and keeps only what the
  // poller does not do: control sockets, liveness and timeouts, with growing sleeps in between
  // (poller_sleep). It takes the data path back once the polling has stopped for
  // PONTE_POLLER_HOLD_US (2 ms): a yielding poller on a host whose cores are all taken waits a
  // scheduler slice (ms) for its core, and a worker that takes the data path meanwhile spins beside
  // it for the cores (at 200 us, the plugin's 8-byte ping-pong in the SoftRoCE guest took 151-184 us
  // a half round trip, at 2 ms 95-137 us). Where pollers only reap (shm), the worker still starts
  // and posts what is submitted, but leaves the reaping to the poller and sleeps once nothing is
  // left to post: each submission wakes it at once (NicGroup::submit), and a worker spinning beside
  // the poller takes the core the poller needs to submit (three busy threads on two cores: a Python
  // wait paid 60 us per 64 KiB write on shm, where the worker's own chain of writes costs 7 us).
  if (poller_left_.load(std::memory_order_relaxed) && poller_left_.exchange(false, std::memory_order_acq_rel)) {
    // The poller said it stops (stop_polling): its calls so far no longer hold the data path.
    st.poll_calls_seen = poll_calls_.load(std::memory_order_relaxed);
    st.poller_active = false;
    st.idle_us = 0;
  }
  const uint64_t calls = poll_calls_.load(std::memory_order_relaxed);
  if (calls != st.poll_calls_seen) {
    // Held from the last call, not from now: a poller that stopped during a long sleep hands the
    // data path back at this wake-up, not at the next one.
    st.poll_calls_seen = calls;
    st.poller_until = Clock::time_point(Clock::duration(last_poll_.load(std::memory_order_relaxed))) +
                      std::chrono::microseconds(cfg_.poller_hold_us);
    st.poller_active = true;
  }
  if (st.poller_active) {
    const auto now = Clock::now();
    if (now < st.poller_until) {
      now_ = now;
      bool posted = false;
      if (!pollers_post_) {
        in_drain_ = true;
        posted = drain_queue();
        in_drain_ = false;
        if (run_head_ != kNoSlot) posted |= post_runnable();
        flush_nic_posts();
      }
      if (now - st.last_house >= std::chrono::microseconds(100)) {
        housekeeping(now);
        st.last_house = now;
      }
      if (posted) {
        last_activity_ = now;
        st.idle_us = 0;
        return 0;
      }
      return poller_sleep(st);
    }
    st.poller_active = false;  // the polling stopped: the worker moves the data again
    st.idle_us = 0;
  }
  in_drain_ = true;
  bool did = drain_queue();
  in_drain_ = false;
  if (run_head_ != kNoSlot) did |= post_runnable();
  flush_nic_posts();
  did |= poll_nics();
  st.worked |= did;
  if (did) st.idle_us = 0;
  // The clock is read every 64th pass while working and every 8th while spinning idle: a
  // clock read costs as much as an idle poll. Backing off, every pass reads it (and sleeps).
  if (st.idle_us == 0 && (++st.iter & (did ? 63u : 7u)) != 0) return 0;
  auto now = Clock::now();
  now_ = now;
  if (st.worked) last_activity_ = now;  // the spin window starts at the last work, however brief
  st.worked = false;
  // Control sockets and timeouts every 100 us, busy or not: a syscall per pass would cost the
  // spin window its latency. An idle worker sleeps in epoll below and wakes for them anyway.
  if (now - st.last_house >= std::chrono::microseconds(100)) {
    housekeeping(now);
    st.last_house = now;
  }
  const bool busy = active_count_ > 0 || imm_.waiting() > 0 ||
                    now - last_activity_ < std::chrono::microseconds(cfg_.spin_us);
  if (did || busy) {
    st.idle_us = 0;
    // Spinning with nothing to do for kSpinYieldAfterUs (waiting on a peer, or a rank that
    // computes): yield the core every 8th pass (this one, which reads the clock), so that a
    // thread sharing it (the application's, another process's worker) runs now rather than at
    // the scheduler's next tick; alone on its core the yield returns at once. Not sooner: a
    // yield costs a syscall (1-2 us on a VM) and an arrival during it waits, which a ping-pong
    // pays on every message. On two cores with two ranks, MoE dispatch+combine (ep-bench's small
    // shape) went from about 1,150-1,350 us to 70-290 us with it and collectives' waits that
    // run the data path themselves.
    st.yield_now = !did && now - last_activity_ >= std::chrono::microseconds(kSpinYieldAfterUs);
    return 0;
  }
  // Idle: back off from 1 us to kIdlePollUs between polls (manual-progress providers need polls
  // to move incoming data), waking at once for a submission or a control message; after
  // kDeepIdleAfterUs of nothing, on up to PONTE_IDLE_SLEEP_US (nic_group_internal.h).
  const uint32_t cap =
      now - last_activity_ >= std::chrono::microseconds(kDeepIdleAfterUs) ? cfg_.idle_sleep_us : kIdlePollUs;
  st.idle_us = st.idle_us ? std::min<uint32_t>(st.idle_us * 2, cap) : 1;
  return st.idle_us;
}

}  // namespace ponte
