// NicGroup's lifecycle and submission: construction, start (listen socket, receive buffers, the
// worker thread), stop (also of a wedged group), and submit / run_on_worker from any thread.
#include "core/nic_group.h"
#include "core/watchdog.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>

#include "core/log.h"
#include "core/nic_group_internal.h"

namespace ponte {

NicGroup::NicGroup(int index, const Config& cfg, std::vector<std::unique_ptr<Nic>> nics,
                   BackendKind backend, uint64_t engine_nonce, uint32_t dense_imm_values)
    : index_(index),
      cfg_(cfg),
      nics_(std::move(nics)),
      backend_(backend),
      engine_nonce_(engine_nonce),
      queue_(cfg.queue_depth),
      slots_(cfg.max_inflight),
      peers_(kMaxPeers),
      imm_(kImmTableSize, cfg.max_inflight, dense_imm_values),
      ping_after_(std::max<uint32_t>(cfg.timeout_ms / 4, 1)),
      silence_limit_(cfg.timeout_ms) {
  // Every provider call is marked for the watchdog (core/watchdog.h), and, where a polling thread
  // stuck in one can be let go (pollers only reap there), for the rescue's signal handler too.
  pollers_post_ = pollers_may_post(nics_);
  rescue_ = !pollers_post_ && poller_rescue::install();
  for (auto& n : nics_) n = std::make_unique<WatchedNic>(std::move(n), &guard_, rescue_);
  fault_drops_left_ = cfg.fault_drop_recvs;
  fault_connects_left_ = cfg.fault_failed_connects;
  free_slots_.reserve(slots_.size());
  for (uint32_t i = static_cast<uint32_t>(slots_.size()); i-- > 0;) free_slots_.push_back(i);
}

NicGroup::~NicGroup() { stop(); }

Status NicGroup::start(const std::vector<int>& cores) {
  auto key = AuthKey::create(cfg_.job_key);
  if (!key.ok()) return key.status();
  auth_ = *key;
  auto lf = control_listen(cfg_, &ctrl_);
  if (!lf.ok()) return lf.status();
  listen_fd_ = *lf;
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (epoll_fd_ < 0 || wake_fd_ < 0) return Status(Code::kResource, "epoll/eventfd: %s", strerror(errno));
  epoll_add(listen_fd_, kListenTag);
  epoll_add(wake_fd_, kWakeTag);


  // Engine-owned receive buffers for two-sided messages, registered on their NIC.
  size_t bytes = static_cast<size_t>(cfg_.recv_buf_size) * cfg_.recv_buf_count;
  for (size_t i = 0; i < nics_.size(); i++) {
    recv_bufs_.emplace_back(new (std::nothrow) uint8_t[bytes]);
    if (!recv_bufs_.back()) return Status(Code::kResource, "receive buffers: %zu bytes", bytes);
    MemoryDesc md;
    md.addr = recv_bufs_.back().get();
    md.len = bytes;
    auto mr = nics_[i]->register_memory(md);
    if (!mr.ok()) return mr.status();
    MemoryRegion r;
    r.addr = md.addr;
    r.len = bytes;
    r.group = index_;
    r.nic_mrs.assign(nics_.size(), NicMr{});
    r.nic_mrs[i] = *mr;
    recv_mrs_.push_back(std::move(r));
  }
  post_recv_buffers();

  GroupAddress a;
  a.engine_nonce = engine_nonce_;
  a.group = static_cast<uint8_t>(index_);
  a.backend = backend_;
  a.ip_family = ctrl_.family;
  memcpy(a.ip, ctrl_.ip, 16);
  a.port = ctrl_.port;
  for (auto& n : nics_)
    if (n->info().max_msg_size) max_msg_ = std::min<uint64_t>(max_msg_, n->info().max_msg_size);
  a.max_msg = max_msg_;
  a.auth_kind = auth_.kind;
  a.auth_secret = auth_.secret;
  for (size_t i = 0; i < nics_.size(); i++) {
    auto b = nics_[i]->address();
    a.nic_addrs.emplace_back(b.begin(), b.end());
    a.imm_rkey.push_back(recv_mrs_[i].nic_mrs[i].rkey);
    a.imm_base.push_back(recv_mrs_[i].nic_mrs[i].remote_base);
  }
  address_bytes_ = a.encode();

  last_activity_ = Clock::now();
  last_timeout_scan_ = last_activity_;
  now_ = last_activity_;
  watching_.store(true, std::memory_order_seq_cst);
  worker_ = std::thread([this, cores] {
    // Named for top -H, perf and gdb: "ponte-g<group>" (15 characters at most).
    char name[16];
    snprintf(name, sizeof(name), "ponte-g%d", index_);
    pthread_setname_np(pthread_self(), name);
    if (!cores.empty()) {
      cpu_set_t set;
      CPU_ZERO(&set);
      for (int c : cores) CPU_SET(c, &set);
      int rc = pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
      if (rc != 0) PONTE_LOG_WARN("group %d: pinning the worker failed: %s", index_, strerror(rc));
    }
    worker_main();
  });
  return Status::Ok();
}

void NicGroup::post_recv_buffers() {
  for (size_t i = 0; i < nics_.size(); i++) {
    for (uint32_t b = 0; b < cfg_.recv_buf_count; b++) {
      uint8_t* p = recv_bufs_[i].get() + static_cast<size_t>(b) * cfg_.recv_buf_size;
      Status st = nics_[i]->post_recv(p, cfg_.recv_buf_size, recv_mrs_[i].nic_mrs[i].desc, b);
      if (!st.ok()) {
        PONTE_LOG_WARN("group %d NIC %zu: posting receive %u: %s", index_, i, b, st.message());
        break;
      }
    }
  }
}

void NicGroup::stop() {
  if (abandoned_) return;  // wedged: see below
  if (worker_.joinable()) {
    stop_.store(true, std::memory_order_release);
    uint64_t one = 1;
    if (write(wake_fd_, &one, sizeof(one)) < 0) { /* the worker also wakes on its own */ }
    // The worker lingers, then exits holding the progress token (pollers are shut out from here
    // on); or a provider call it is in never returns and the watchdog takes the group over.
    while (!worker_exited_.load(std::memory_order_acquire) && !taken_over_.load(std::memory_order_acquire))
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    // A worker that left through a claimed call: the watchdog may still be taking over.
    while (CallGuard::claimed(guard_.peek()) && !taken_over_.load(std::memory_order_acquire))
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    // From here this thread's own provider calls (below) are not the watchdog's to claim.
    watching_.store(false, std::memory_order_seq_cst);
    if (taken_over_.load(std::memory_order_acquire)) {
      // Wedged: the watchdog ended what the group held. A thread may still be inside one of its
      // NICs, so nothing of it is closed or freed (the engine keeps it; see abandoned()).
      if (worker_exited_.load(std::memory_order_acquire)) worker_.join();
      else worker_.detach();
      abandoned_ = true;
      PONTE_LOG_WARN("group %d: shut down wedged: its NICs and their provider resources stay open", index_);
      return;
    }
    worker_.join();
  }
  // Everything still queued or in flight ends with kCancelled.
  Status cancelled(Code::kCancelled, "the engine was shut down");
  while (Op* op = queue_.front()) {
    Notify d = op->done;
    Op::Type type = op->type;
    queue_.pop();
    if (type != Op::kConnect) d(cancelled);
  }
  while (active_head_ != kNoSlot) fail_slot(active_head_, Code::kCancelled, "the engine was shut down");
  imm_.fail_all(cancelled);
  for (auto& p : peers_)  // linger() said goodbye to those that were ready
    for (auto& sock : p.sock) sock.close();
  pending_.clear();
  if (uninvited_ > 1)
    PONTE_LOG_INFO("group %d: dropped %llu control connections that did not prove they were invited", index_,
                   static_cast<unsigned long long>(uninvited_));
  for (size_t i = 0; i < recv_mrs_.size(); i++) nics_[i]->deregister(recv_mrs_[i].nic_mrs[i]);
  recv_mrs_.clear();
  if (listen_fd_ >= 0) close(listen_fd_);
  if (epoll_fd_ >= 0) close(epoll_fd_);
  if (wake_fd_ >= 0) close(wake_fd_);
  listen_fd_ = epoll_fd_ = wake_fd_ = -1;
}

void NicGroup::epoll_add(int fd, uint64_t tag) {
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP;
  ev.data.u64 = tag;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev);
}

void NicGroup::epoll_del(int fd) { epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr); }

// ---------------------------------------------------------------- submission

Status NicGroup::submit(const Op& op) {
  if (wedged_.load(std::memory_order_acquire)) return wedge_status();
  if (stop_.load(std::memory_order_acquire))
    return Status(Code::kCancelled, "group %d: the engine is shutting down", index_);
  // From the worker itself (a completion callback chaining the next op): start it in place, no
  // queue round trip. Slot-less ops (expect, call, connect) always can; others need a free slot.
  if (on_worker() && (!op.needs_slot() || !free_slots_.empty())) {
    CallGuard::Nested nested;  // a wedge inside must not unwind through the callback's frames
    start_op(op);
    return Status::Ok();
  }
  if (!queue_.push(op)) return Status(Code::kAgain, "group %d: submission queue full (%zu)", index_, queue_.capacity());
  // A thread that polls this group (progress() within PONTE_POLLER_HOLD_US) starts its own
  // submissions in its next progress() call, where pollers may post: no wake-up. Any other
  // submission wakes a sleeping worker (which sleeps up to PONTE_POLLER_SLEEP_US while somebody polls).
  if (sleeping_.load(std::memory_order_acquire) && (!pollers_post_ || !polled_here()) &&
      sleeping_.exchange(false, std::memory_order_acq_rel)) {
    uint64_t one = 1;  // once per sleep, not per submission
    if (write(wake_fd_, &one, sizeof(one)) < 0) { /* already signalled */ }
  }
  return Status::Ok();
}

namespace {
// The queued op's half of a WorkerCall: run it unless its caller gave up (box_done lets go of it
// after). A run the watchdog cut short (a provider call inside it was claimed) unwinds through
// here: the op's reference goes with it, the box being its caller's and no part of the group.
void run_box(void* p) {
  auto* call = static_cast<WorkerCall*>(p);
  uint8_t queued = WorkerCall::kQueued;
  if (!call->state.compare_exchange_strong(queued, WorkerCall::kRunning, std::memory_order_acq_rel)) return;
  struct CutShort {
    WorkerCall* call;
    bool ran = false;
    ~CutShort() {
      if (!ran) call->unref();
    }
  } guard{call};
  call->run();
  guard.ran = true;
  call->state.store(WorkerCall::kDone, std::memory_order_release);
}
// The op's Notify: OK after run_box (ran, or found it abandoned); an error when the op was
// refused without running (shutdown, a wedge): its caller hears so.
void box_done(void* p, const Status& st) {
  auto* call = static_cast<WorkerCall*>(p);
  if (!st.ok()) {
    uint8_t queued = WorkerCall::kQueued;
    call->state.compare_exchange_strong(queued, WorkerCall::kCancelled, std::memory_order_acq_rel);
  }
  call->unref();
}
}  // namespace

Status NicGroup::run_call(WorkerCall* call) {
  Op op;
  op.type = Op::kCall;
  op.call = run_box;
  op.call_arg = call;
  op.done = Notify{&box_done, call};
  auto deadline = Clock::now() + std::chrono::milliseconds(cfg_.timeout_ms);
  for (;;) {
    Status st = submit(op);
    if (st.ok()) break;
    if (st.code() != Code::kAgain || Clock::now() > deadline) {
      call->unref();  // the op's reference: it was never queued
      return st;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  // The worker runs the call or refuses it; a wedged worker may do neither, and a call that never
  // runs must not hang its caller: either way the box outlives this wait if it must.
  deadline = Clock::now() + std::chrono::milliseconds(cfg_.timeout_ms) + std::chrono::seconds(5);
  for (uint32_t spins = 0;; spins++) {
    uint8_t s = call->state.load(std::memory_order_acquire);
    if (s == WorkerCall::kDone) return Status::Ok();
    if (s == WorkerCall::kCancelled) return wedged() ? wedge_status() : Status(Code::kCancelled, "group %d: the engine was shut down", index_);
    const bool wedge = wedged();
    if (wedge || Clock::now() > deadline) {
      uint8_t queued = WorkerCall::kQueued;
      if (!call->state.compare_exchange_strong(queued, WorkerCall::kAbandoned, std::memory_order_acq_rel) &&
          queued == WorkerCall::kDone)
        return Status::Ok();
      if (wedge) return wedge_status();
      PONTE_LOG_WARN("group %d: a call for the worker (a registration?) did not %s within PONTE_TIMEOUT_MS + 5 s",
                     index_, queued == WorkerCall::kRunning ? "finish" : "start");
      return Status(Code::kTimeout, "group %d: the worker did not run the call within PONTE_TIMEOUT_MS + 5 s", index_);
    }
    if (spins < 1000) std::this_thread::yield();
    else std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

}  // namespace ponte
