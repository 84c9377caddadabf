// The watchdog: what enforces a group's deadlines when its worker cannot. A provider call that
// never returns (shm spinning on a lock in shared memory held by a stopped peer) stops the very
// thread that runs the group's timeouts and liveness; one watchdog thread per engine sees it from
// outside and turns the group "wedged": its operations end with errors, its callers are refused at
// once, its peers are told. Internal to core/.
//
// How a provider call is seen: every NIC of a group is wrapped in a WatchedNic, which marks each
// call in the group's CallGuard word (the calling thread holds the progress token, so one thread
// at a time writes it): on entry a new sequence number with the "in call" bit (a release store),
// on exit a compare-and-swap clearing that bit. The watchdog samples the word; the same call seen
// in progress for PONTE_TIMEOUT_MS is claimed by a compare-and-swap that sets the "claimed" bit.
//
// Exactly once, and nothing used after it is freed. Exactly one of the two CASes on the word wins:
//  - the caller's exit: the call returned in time and the caller goes on as usual; the watchdog's
//    claim fails and it tries again later (a later call has a new sequence number);
//  - the watchdog's claim: from then on the group's worker-only state (slots, counters, the
//    queue's consumer side, peers' sockets) belongs to the watchdog thread, and the thread inside
//    the provider call never touches it again: when (if ever) the call returns, its exit CAS
//    fails and it leaves at once without returning into the group's code: by an exception that
//    unwinds to the worker loop or to progress() (nothing between them is noexcept, and no
//    destructor on that path writes group state), or, when the call was made on behalf of a
//    callback (an engine call from inside a Notify or RecvHandler, where unwinding would cross
//    the user's frames), by parking the thread for good.
// The claim's acquire pairs with the caller's release on entry, so the watchdog sees every write
// the caller made before the call. At every provider call the state is whole (no slot, counter or
// queue entry half-updated: callbacks fire after their entry is unlinked), except the queue's
// head while the worker is starting it: drain_queue marks that, and the watchdog then drops that
// entry without firing it (it is a call, a connect, or an entry whose Notify is running on the
// stuck thread already). So the watchdog fires every other Notify exactly once: in-flight slots,
// waiting counters, queued operations. Calls for the worker (run_on_worker) live in a reference-
// counted box of their own, so a caller that stops waiting never leaves the stuck thread writing
// into its stack. A wedged group's NICs, provider objects and memory are never freed (the stuck
// thread may still be inside them): Engine keeps them for the life of the process.
//
// What stays: a thread that is inside the stuck call itself stays there until the provider lets
// it go. That is why, on shm, a thread inside progress() (NCCL's proxy in test()) only reaps
// completions and leaves posting to the worker (NicGroup::pollers_may_post). And a memory region
// of an operation that was being posted by the stuck call may still be read by the provider if
// that call ever completes.
//
// A polling thread stuck while reaping is let go (poller_rescue): on shm a peer stopped while it
// wrote into this endpoint's region holds this endpoint's lock, and fi_cq_read spins on it too
// (NCCL's proxy thread hung in test() there, its requests never ending: about one run in 12 of
// PluginStopped.ReceiverStoppedTheSendersRequestsErrorInTime/shm). Where pollers only reap, each
// pass of a polling thread marks where it may be sent back to (sigsetjmp, no signal mask saved);
// the watchdog, having claimed a call made on such a pass, sends that thread poller_rescue's signal,
// and the handler, on a thread that is inside the claimed provider call (WatchedNic marks each
// call) and not inside a callback's engine call, jumps back: progress() returns false, the group
// wedged. What the jump leaves behind is the provider's: locks it held for the call stay held, and
// the wedged group never enters that provider object again (Engine keeps it, never frees it). The
// C++ frames jumped over (WatchedNic, the backend's poll, NicGroup::poll_nics) own nothing that
// needs destroying on that path. The signal is SIGRTMAX - 3, taken only when its disposition is
// SIG_DFL (an application's own use of it turns the rescue off, logged once).
#pragma once

#include <csetjmp>
#include <csignal>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "core/nic.h"

namespace ponte {

class NicGroup;

// Thrown by a WatchedNic into a thread whose provider call was claimed; caught by the worker loop
// and progress(). Deliberately not a std::exception.
struct GroupWedged {};

// Letting a polling thread out of a claimed provider call (see above).
namespace poller_rescue {
// Installs the signal handler once per process; false when the signal is not free.
bool install();
// The signal the watchdog sends.
int signal_number();
// A polling thread's pass: where the handler jumps back to (nullptr: nowhere, outside a pass).
inline thread_local sigjmp_buf* tls_escape = nullptr;
// Inside a provider call, on this thread (WatchedNic marks each one).
inline thread_local volatile sig_atomic_t tls_in_call = 0;
inline void set_escape(sigjmp_buf* target) { tls_escape = target; }
inline void set_in_call(bool in) { tls_in_call = in ? 1 : 0; }
}  // namespace poller_rescue

class CallGuard {
 public:
  enum Call : uint8_t {
    kNone = 0, kAddPeer, kConnectBlob, kCompleteConnect, kRemovePeer, kTrafficClass, kRegister,
    kDeregister, kPostWrite, kPostRead, kPostSend, kPostRecv, kPoll, kFlushPosts, kArmWait
  };
  static const char* name(uint64_t word);  // "a write post (fi_writedata, ibv_post_send)", ...

  // The caller's side, around each provider call.
  uint64_t enter(Call c) {
    const uint64_t seq = (word_.load(std::memory_order_relaxed) >> kSeqShift) + 1;
    const uint64_t e = (seq << kSeqShift) | (uint64_t{c} << kCallShift) | kInCall;
    word_.store(e, std::memory_order_release);
    return e;
  }
  void leave(uint64_t e) {
    if (!word_.compare_exchange_strong(e, e & ~kInCall, std::memory_order_acq_rel, std::memory_order_relaxed))
      on_claimed();
  }

  // The watchdog's side.
  uint64_t peek() const { return word_.load(std::memory_order_acquire); }
  static bool in_call(uint64_t w) { return (w & kInCall) != 0; }
  static bool claimed(uint64_t w) { return (w & kClaimed) != 0; }
  bool claim(uint64_t seen) {
    return word_.compare_exchange_strong(seen, seen | kClaimed, std::memory_order_acq_rel, std::memory_order_relaxed);
  }

  // Marks the calling thread as inside an engine call made from a callback (submit's in-place
  // start, run_on_worker's direct call): a claimed call there parks instead of unwinding.
  struct Nested {
    Nested();
    ~Nested();
    Nested(const Nested&) = delete;
    Nested& operator=(const Nested&) = delete;
  };

 private:
  [[noreturn]] static void on_claimed();
  static constexpr uint64_t kInCall = 1, kClaimed = 2;
  static constexpr int kCallShift = 2, kSeqShift = 8;
  std::atomic<uint64_t> word_{0};
};

// A Nic whose every provider call is marked in a CallGuard. Forwards everything: a method added to
// Nic must be forwarded here too (a defaulted virtual would otherwise bypass the backend).
class WatchedNic final : public Nic {
 public:
  // mark_calls: each call is also marked for poller_rescue's handler (a thread-local store on each
  // side); only where a polling thread can be let go.
  WatchedNic(std::unique_ptr<Nic> inner, CallGuard* guard, bool mark_calls = false)
      : inner_(std::move(inner)), guard_(guard), mark_calls_(mark_calls) {}

 private:
  template <typename F>
  auto call(CallGuard::Call c, F&& f) -> decltype(f()) {
    const uint64_t e = guard_->enter(c);
    if (mark_calls_) poller_rescue::set_in_call(true);
    auto r = f();
    if (mark_calls_) poller_rescue::set_in_call(false);
    guard_->leave(e);
    return r;
  }

 public:
  const NicInfo& info() const override { return inner_->info(); }
  std::span<const uint8_t> address() const override { return inner_->address(); }
  Result<NicPeer> add_peer(std::span<const uint8_t> peer_address) override {
    return call(CallGuard::kAddPeer, [&] { return inner_->add_peer(peer_address); });
  }
  Result<std::vector<uint8_t>> connect_blob(NicPeer peer) override {
    return call(CallGuard::kConnectBlob, [&] { return inner_->connect_blob(peer); });
  }
  Status complete_connect(NicPeer peer, std::span<const uint8_t> blob) override {
    return call(CallGuard::kCompleteConnect, [&] { return inner_->complete_connect(peer, blob); });
  }
  void remove_peer(NicPeer peer) override {
    const uint64_t e = guard_->enter(CallGuard::kRemovePeer);
    inner_->remove_peer(peer);
    guard_->leave(e);
  }
  Status set_traffic_class(NicPeer peer, uint8_t tc) override {
    return call(CallGuard::kTrafficClass, [&] { return inner_->set_traffic_class(peer, tc); });
  }
  Result<NicMr> register_memory(const MemoryDesc& mem) override {
    return call(CallGuard::kRegister, [&] { return inner_->register_memory(mem); });
  }
  void deregister(const NicMr& mr) override {
    const uint64_t e = guard_->enter(CallGuard::kDeregister);
    inner_->deregister(mr);
    guard_->leave(e);
  }
  Status post_write(const WriteWr& wr) override {
    return call(CallGuard::kPostWrite, [&] { return inner_->post_write(wr); });
  }
  Status post_read(NicPeer peer, void* local, size_t len, void* desc, uint64_t remote_addr, uint64_t rkey,
                   uint64_t ctx) override {
    return call(CallGuard::kPostRead,
                [&] { return inner_->post_read(peer, local, len, desc, remote_addr, rkey, ctx); });
  }
  Status post_send(NicPeer peer, const void* buf, size_t len, void* desc, uint32_t imm, uint64_t ctx,
                   bool inline_ok) override {
    return call(CallGuard::kPostSend, [&] { return inner_->post_send(peer, buf, len, desc, imm, ctx, inline_ok); });
  }
  Status post_recv(void* buf, size_t len, void* desc, uint64_t ctx) override {
    return call(CallGuard::kPostRecv, [&] { return inner_->post_recv(buf, len, desc, ctx); });
  }
  void flush_posts() override {
    const uint64_t e = guard_->enter(CallGuard::kFlushPosts);
    inner_->flush_posts();
    guard_->leave(e);
  }
  int poll(Completion* out, int max) override {
    return call(CallGuard::kPoll, [&] { return inner_->poll(out, max); });
  }
  int wait_fd() const override { return inner_->wait_fd(); }
  bool arm_wait() override {
    return call(CallGuard::kArmWait, [&] { return inner_->arm_wait(); });
  }

 private:
  std::unique_ptr<Nic> inner_;
  CallGuard* guard_;
  bool mark_calls_;
};

// One thread per engine: every period it looks at each group (NicGroup::watchdog_check). It owns
// nothing of theirs; the engine stops it after stopping the groups (a group stuck while shutting
// down is still seen) and before freeing them.
class Watchdog {
 public:
  explicit Watchdog(std::vector<NicGroup*> groups);
  ~Watchdog() { stop(); }
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;
  void start();
  void stop();
  std::chrono::milliseconds period() const { return period_; }

 private:
  void run();
  std::vector<NicGroup*> groups_;
  std::chrono::milliseconds period_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace ponte
