// NicGroup's lifecycle and submission: construction, start (listen socket, receive buffers, the
// worker thread), stop, and submit / run_on_worker from any thread.
#include "core/nic_group.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
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
      imm_(kImmTableSize, cfg.max_inflight, dense_imm_values) {
  fault_drops_left_ = cfg.fault_drop_recvs;
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
  worker_ = std::thread([this, cores] {
    if (!cores.empty()) {
      cpu_set_t set;
      CPU_ZERO(&set);
      for (int c : cores) CPU_SET(c, &set);
      int rc = pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
      if (rc != 0) PONTE_LOG_WARN("group %d: pinning the worker failed: %s", index_, strerror(rc));
    }
    run();
    linger();
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
  if (worker_.joinable()) {
    stop_.store(true, std::memory_order_release);
    uint64_t one = 1;
    if (write(wake_fd_, &one, sizeof(one)) < 0) { /* the worker also wakes on its own */ }
    worker_.join();  // it exits holding the progress token: pollers are shut out from here on
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
  if (stop_.load(std::memory_order_acquire))
    return Status(Code::kCancelled, "group %d: the engine is shutting down", index_);
  // From the worker itself (a completion callback chaining the next op): start it in place, no
  // queue round trip. Slot-less ops (expect, call, connect) always can; others need a free slot.
  if (on_worker() && (!op.needs_slot() || !free_slots_.empty())) {
    start_op(op);
    return Status::Ok();
  }
  if (!queue_.push(op)) return Status(Code::kAgain, "group %d: submission queue full (%zu)", index_, queue_.capacity());
  // A thread that polls this group starts its own submissions in its next progress() call; the
  // sleeping worker would find them anyway within its idle backoff (at most 50 us).
  if (!polled_here() && sleeping_.load(std::memory_order_acquire) &&
      sleeping_.exchange(false, std::memory_order_acq_rel)) {
    uint64_t one = 1;  // once per sleep, not per submission
    if (write(wake_fd_, &one, sizeof(one)) < 0) { /* already signalled */ }
  }
  return Status::Ok();
}

namespace {
struct CallBox {
  void (*fn)(void*);
  void* arg;
};
void run_call(void* p) {
  auto* box = static_cast<CallBox*>(p);
  box->fn(box->arg);
}
}  // namespace

Status NicGroup::run_on_worker(void (*fn)(void*), void* arg) {
  if (on_worker() || !worker_.joinable()) {
    fn(arg);
    return Status::Ok();
  }
  CallBox box{fn, arg};
  Flag flag;
  Op op;
  op.type = Op::kCall;
  op.call = run_call;
  op.call_arg = &box;
  op.done = flag.notify();
  auto deadline = Clock::now() + std::chrono::milliseconds(cfg_.timeout_ms);
  for (;;) {
    Status st = submit(op);
    if (st.ok()) break;
    if (st.code() != Code::kAgain || Clock::now() > deadline) return st;
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  // The worker always runs (or cancels) a queued call: wait without a deadline would be safe, but
  // a wedged NIC call must not hang the caller forever.
  return flag.wait(std::chrono::milliseconds(cfg_.timeout_ms) + std::chrono::seconds(5));
}

}  // namespace ponte
