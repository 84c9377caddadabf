// The watchdog thread and what a claimed provider call does on its way out (see watchdog.h).
#include "core/watchdog.h"

#include <pthread.h>

#include <csetjmp>
#include <csignal>

#include <algorithm>

#include "core/log.h"
#include "core/nic_group.h"

namespace ponte {

namespace {
thread_local int tls_nested = 0;  // engine calls made from a callback, on this thread

void rescue_handler(int) {
  using poller_rescue::tls_escape;
  using poller_rescue::tls_in_call;
  // Only a thread inside a provider call of a pass, not inside a callback's engine call: anywhere
  // else the jump would cross frames that own something. Elsewhere the signal does nothing (a
  // call that returned just now leaves through GroupWedged instead).
  if (tls_escape && tls_in_call && tls_nested == 0) {
    sigjmp_buf* to = tls_escape;
    tls_escape = nullptr;
    tls_in_call = 0;
    siglongjmp(*to, 1);
  }
}
}  // namespace

namespace poller_rescue {
int signal_number() { return SIGRTMAX - 3; }
bool install() {
  static const bool ok = [] {
    struct sigaction old{};
    if (sigaction(signal_number(), nullptr, &old) != 0) return false;
    const bool taken = (old.sa_flags & SA_SIGINFO) ? old.sa_sigaction != nullptr : old.sa_handler != SIG_DFL;
    if (taken) {
      PONTE_LOG_WARN("signal %d has a handler already: a polling thread stuck in a provider call cannot be "
                     "let go (the watchdog still ends its group's operations)", signal_number());
      return false;
    }
    struct sigaction sa{};
    sa.sa_handler = rescue_handler;
    sigemptyset(&sa.sa_mask);
    // SA_NODEFER: the signal is not blocked while the handler runs, so the jump (which saves and
    // restores no mask: sigsetjmp(..., 0) costs no system call per pass) leaves no mask behind.
    sa.sa_flags = SA_NODEFER;
    return sigaction(signal_number(), &sa, nullptr) == 0;
  }();
  return ok;
}
}  // namespace poller_rescue

CallGuard::Nested::Nested() { tls_nested++; }
CallGuard::Nested::~Nested() { tls_nested--; }

const char* CallGuard::name(uint64_t word) {
  switch (static_cast<Call>((word >> kCallShift) & 0x3f)) {
    case kAddPeer: return "add_peer (fi_av_insert, QP creation)";
    case kConnectBlob: return "connect_blob";
    case kCompleteConnect: return "complete_connect";
    case kRemovePeer: return "remove_peer (fi_av_remove, QP destruction)";
    case kTrafficClass: return "set_traffic_class";
    case kRegister: return "a registration (fi_mr_reg, ibv_reg_mr)";
    case kDeregister: return "a deregistration (fi_close, ibv_dereg_mr)";
    case kPostWrite: return "a write post (fi_writedata, ibv_post_send)";
    case kPostRead: return "a read post (fi_read, ibv_post_send)";
    case kPostSend: return "a send post (fi_senddata, ibv_post_send)";
    case kPostRecv: return "a receive post (fi_recv, ibv_post_srq_recv)";
    case kPoll: return "a completion poll (fi_cq_read, ibv_poll_cq)";
    case kFlushPosts: return "a chain of posts (ibv_post_send)";
    case kArmWait: return "a wait object's arming (fi_trywait)";
    case kNone: break;
  }
  return "a provider call";
}

// The watchdog claimed the call this thread was in: the group is not this thread's any more.
void CallGuard::on_claimed() {
  if (tls_nested > 0) {
    // Inside a callback's engine call: unwinding would cross the application's frames. This
    // thread stays here; the group it came from is wedged and its state is the watchdog's.
    for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
  }
  throw GroupWedged{};
}

Watchdog::Watchdog(std::vector<NicGroup*> groups) : groups_(std::move(groups)) {
  // A sixteenth of the shortest timeout, within 5..250 ms: the verdict comes at most that late.
  uint32_t ms = 250 * 16;
  for (NicGroup* g : groups_) ms = std::min(ms, g->config().timeout_ms);
  period_ = std::chrono::milliseconds(std::clamp<uint32_t>(ms / 16, 5, 250));
}

void Watchdog::start() {
  if (!thread_.joinable() && !groups_.empty()) thread_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "ponte-watchdog");
    run();
  });
}

void Watchdog::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Watchdog::run() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!cv_.wait_for(lock, period_, [this] { return stop_; })) {
    lock.unlock();
    const auto now = std::chrono::steady_clock::now();
    for (NicGroup* g : groups_) g->watchdog_check(now);
    lock.lock();
  }
}

}  // namespace ponte
