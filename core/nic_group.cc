// NicGroup: the worker loop (drain submissions, post shards, poll NICs, housekeeping), the peer
// handshake state machine over ControlSocket, liveness and timeouts.
#include "core/nic_group.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>

#include "core/log.h"
#include "core/wire.h"

namespace ponte {

using Clock = std::chrono::steady_clock;

static constexpr uint32_t kMaxPeers = 4096;
static constexpr uint8_t kHelloVersion = 1;
static constexpr uint8_t kHelloType = 1;
static constexpr uint8_t kByeType = 2;  // u8 version, u8 type: the peer's engine is shutting down
// HELLO: u8 version, u8 type, u16 0, u32 id we gave the peer, u32 epoch | u16 address length,
// address, u8 NIC count, NIC count x (u16 length, connect blob).
static constexpr size_t kHelloHeaderBytes = 12;
static constexpr uint64_t kWakeTag = ~uint64_t{0};
static constexpr uint64_t kListenTag = ~uint64_t{0} - 1;
static constexpr uint64_t kPendingTag = ~uint64_t{0} - 2;
static constexpr size_t kImmTableSize = 1 << 16;
static constexpr uint32_t kLingerMs = 250;  // orderly shutdown's bound (and PONTE_TIMEOUT_MS's)

NicGroup::NicGroup(int index, const Config& cfg, std::vector<std::unique_ptr<Nic>> nics,
                   BackendKind backend, uint64_t engine_nonce)
    : index_(index),
      cfg_(cfg),
      nics_(std::move(nics)),
      backend_(backend),
      engine_nonce_(engine_nonce),
      queue_(cfg.queue_depth),
      slots_(cfg.max_inflight),
      peers_(kMaxPeers),
      imm_(kImmTableSize, cfg.max_inflight) {
  free_slots_.reserve(slots_.size());
  for (uint32_t i = static_cast<uint32_t>(slots_.size()); i-- > 0;) free_slots_.push_back(i);
}

NicGroup::~NicGroup() { stop(); }

Status NicGroup::start(const std::vector<int>& cores) {
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
    worker_id_.store(std::this_thread::get_id(), std::memory_order_release);
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
  if (sleeping_.load(std::memory_order_acquire) && sleeping_.exchange(false, std::memory_order_acq_rel)) {
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

// ---------------------------------------------------------------- peers

Result<PeerId> NicGroup::new_outbound_peer(const GroupAddress& addr) {
  PeerId id = next_peer_.fetch_add(1, std::memory_order_relaxed);
  if (id >= kMaxPeers) {
    next_peer_.store(kMaxPeers, std::memory_order_relaxed);
    return Status(Code::kResource, "group %d: more than %u peers", index_, kMaxPeers);
  }
  // Written before the peer is published (the state store below, then the kConnect op through
  // the queue): the worker sees all of it and no thread writes it again concurrently.
  Peer& p = peers_[id];
  learn_address(p, addr);
  p.handshake_deadline = Clock::now() + std::chrono::milliseconds(cfg_.timeout_ms);
  p.state.store(kConnecting, std::memory_order_release);
  return id;
}

bool NicGroup::peer_exists(PeerId p) const {
  return p < kMaxPeers && peers_[p].state.load(std::memory_order_acquire) != kUnused;
}
bool NicGroup::peer_ready(PeerId p) const {
  return p < kMaxPeers && peers_[p].state.load(std::memory_order_acquire) == kReady;
}
bool NicGroup::peer_dead(PeerId p) const {
  return p < kMaxPeers && peers_[p].state.load(std::memory_order_acquire) == kDead &&
         !peers_[p].draining.load(std::memory_order_acquire);
}
bool NicGroup::peer_closed(PeerId p) const {
  return p < kMaxPeers && peers_[p].state.load(std::memory_order_acquire) == kDead;
}
size_t NicGroup::peer_max_shard(PeerId p) const {
  return p < kMaxPeers ? peers_[p].max_shard.load(std::memory_order_acquire) : kMaxShardBytes;
}
int NicGroup::peer_nics(PeerId p) const {
  return p < kMaxPeers ? peers_[p].nics.load(std::memory_order_acquire) : 0;
}
std::vector<PeerId> NicGroup::inbound_peers() const {
  std::vector<PeerId> out;
  uint32_t n = std::min(next_peer_.load(std::memory_order_acquire), kMaxPeers);
  for (PeerId i = 0; i < n; i++) {
    uint8_t st = peers_[i].state.load(std::memory_order_acquire);
    // inbound is written before the state leaves kUnused (release), read after (acquire).
    if (st != kUnused && peers_[i].inbound) out.push_back(i);
  }
  return out;
}

PeerId NicGroup::find_peer(uint64_t nonce, uint8_t group) const {
  uint32_t n = std::min(next_peer_.load(std::memory_order_acquire), kMaxPeers);
  for (PeerId i = 0; i < n; i++) {
    const Peer& p = peers_[i];
    uint8_t st = p.state.load(std::memory_order_acquire);
    if ((st == kConnecting || st == kReady) && p.addr_known && p.addr.engine_nonce == nonce && p.addr.group == group)
      return i;
  }
  return kAnyPeer;
}

Status NicGroup::attach_backend(PeerId id) {
  Peer& p = peers_[id];
  if (p.nics_added) return Status::Ok();
  int n = p.nics.load(std::memory_order_relaxed);
  for (int k = 0; k < n; k++) {
    auto np = nics_[k]->add_peer(p.addr.nic_addrs[k]);
    if (!np.ok()) return np.status();
    p.nic_peer[k] = *np;
  }
  p.nics_added = true;
  return Status::Ok();
}

Status NicGroup::send_hello(PeerId id, int which) {
  Peer& p = peers_[id];
  PONTE_RETURN_IF_ERROR(attach_backend(id));
  std::vector<uint8_t> msg;
  WireWriter w(msg);
  w.u8(kHelloVersion);
  w.u8(kHelloType);
  w.u16(0);
  w.u32(id);  // the id we gave the peer: its sends to us carry it
  w.u32(p.epoch);
  w.u16(static_cast<uint16_t>(address_bytes_.size()));
  w.bytes(address_bytes_);
  int n = p.nics.load(std::memory_order_relaxed);
  w.u8(static_cast<uint8_t>(n));
  for (int k = 0; k < n; k++) {
    auto blob = nics_[k]->connect_blob(p.nic_peer[k]);
    if (!blob.ok()) return blob.status();
    w.u16(static_cast<uint16_t>(blob->size()));
    w.bytes(*blob);
  }
  PONTE_RETURN_IF_ERROR(p.sock[which].send_message(msg));
  p.sock_hello_sent[which] = true;
  p.hello_sent = true;
  return Status::Ok();
}

void NicGroup::learn_address(Peer& p, const GroupAddress& addr) {
  p.addr = addr;
  p.addr_known = true;
  uint64_t remote_max = p.addr.max_msg ? p.addr.max_msg : kMaxShardBytes;
  p.max_shard.store(std::min<uint64_t>(max_msg_, remote_max), std::memory_order_release);
  p.nics.store(std::min<int>(static_cast<int>(nics_.size()), static_cast<int>(p.addr.nic_addrs.size())),
               std::memory_order_release);
}

Status NicGroup::handle_hello(PeerId id, int which, std::span<const uint8_t> msg) {
  Peer& p = peers_[id];
  WireReader r(msg);
  uint8_t version = r.u8();
  uint8_t type = r.u8();
  r.u16();
  uint32_t their_id_for_us = r.u32();
  uint32_t epoch = r.u32();
  uint16_t alen = r.u16();
  auto abytes = r.bytes(alen);
  if (!r.ok() || version != kHelloVersion || type != kHelloType)
    return Status(Code::kInvalidArgument, "bad handshake message (version %u type %u)", version, type);
  auto addr = GroupAddress::decode(abytes);
  if (!addr.ok()) return addr.status();
  if (addr->backend != backend_)
    return Status(Code::kInvalidArgument, "peer runs the %s backend, this group %s", backend_name(addr->backend), backend_name(backend_));
  if (!p.addr_known) learn_address(p, *addr);
  int n = p.nics.load(std::memory_order_relaxed);
  uint8_t nblobs = r.u8();
  if (!r.ok() || nblobs < n) return Status(Code::kInvalidArgument, "handshake: %u connect blobs for %d NICs", nblobs, n);
  PONTE_RETURN_IF_ERROR(attach_backend(id));
  p.remote_tag = their_id_for_us;
  p.hello_received = true;
  // Rounds: both ends count them alike. A side that sees its connection fail proposes the next
  // round (start_reconnect); a hello of a round this side has not started starts it here too,
  // with a fresh backend peer (on verbs: new QPs, an RC QP cannot be re-pointed), and answers.
  // Two ends proposing the same round at once each reset once and connect to the other's blobs;
  // a hello of an older round than ours carries blobs that are already gone and is skipped.
  const bool first = p.remote_epoch == 0;
  const bool new_round = !first && epoch > p.remote_epoch;
  if (epoch > p.remote_epoch) p.remote_epoch = epoch;
  bool answered = false;
  if (new_round && epoch > p.epoch) {
    p.epoch = epoch;
    reset_backend_peer(id);
    PONTE_RETURN_IF_ERROR(attach_backend(id));
    p.backend_connected = false;
    if (p.state.load(std::memory_order_relaxed) == kReady) p.state.store(kConnecting, std::memory_order_release);
    p.handshake_deadline = Clock::now() + std::chrono::milliseconds(cfg_.timeout_ms);
    PONTE_LOG_INFO("group %d: peer %u rebuilds its connection (round %u)", index_, id, epoch);
    PONTE_RETURN_IF_ERROR(send_hello(id, which));
    answered = true;
  }
  if (!p.sock_hello_sent[which] && !answered) PONTE_RETURN_IF_ERROR(send_hello(id, which));
  if (!first && epoch < p.epoch) return Status::Ok();  // stale round: ours supersedes it
  if (!p.backend_connected) {
    for (int k = 0; k < nblobs; k++) {
      uint16_t blen = r.u16();
      auto blob = r.bytes(blen);
      if (!r.ok()) return Status(Code::kInvalidArgument, "handshake: truncated connect blob %d", k);
      if (k < n) PONTE_RETURN_IF_ERROR(nics_[k]->complete_connect(p.nic_peer[k], blob));
    }
    p.backend_connected = true;
  }
  if (p.hello_sent && p.backend_connected && p.state.load(std::memory_order_relaxed) == kConnecting) {
    p.state.store(kReady, std::memory_order_release);
    PONTE_LOG_INFO("group %d: peer %u ready (%d NICs)", index_, id, n);
  }
  return Status::Ok();
}

void NicGroup::reset_backend_peer(PeerId id) {
  Peer& p = peers_[id];
  if (!p.nics_added) return;
  for (int k = 0; k < p.nics.load(std::memory_order_relaxed); k++) nics_[k]->remove_peer(p.nic_peer[k]);
  p.nics_added = false;
}

void NicGroup::start_reconnect(PeerId id, const char* why) {
  Peer& p = peers_[id];
  if (p.state.load(std::memory_order_relaxed) != kReady) return;
  int which = p.sock[0].open() ? 0 : (p.sock[1].open() ? 1 : -1);
  if (which < 0) return peer_died(id, Code::kPeerDead, "no control connection left");
  PONTE_LOG_WARN("group %d: peer %u: %s; rebuilding the connection", index_, id, why);
  p.state.store(kConnecting, std::memory_order_release);
  p.epoch = std::max(p.epoch, p.remote_epoch) + 1;  // the next round both ends will share
  reset_backend_peer(id);
  p.backend_connected = false;
  p.hello_received = false;
  p.handshake_deadline = Clock::now() + std::chrono::milliseconds(cfg_.timeout_ms);
  Status st = send_hello(id, which);
  if (!st.ok()) peer_died(id, Code::kPeerDead, st.message());
}

void NicGroup::peer_died(PeerId id, Code code, const char* why) {
  Peer& p = peers_[id];
  if (p.state.load(std::memory_order_relaxed) == kDead) return;
  p.state.store(kDead, std::memory_order_release);
  if (p.orderly_close) PONTE_LOG_INFO("group %d: peer %u closed: %s", index_, id, why);
  else PONTE_LOG_WARN("group %d: peer %u is dead: %s", index_, id, why);
  for (auto& s : p.sock) {
    if (s.open()) epoll_del(s.fd());
    s.close();
  }
  // Every operation toward the peer ends through its error path.
  for (uint32_t s = active_head_; s != kNoSlot;) {
    uint32_t next = slots_[s].next;
    if (slot_uses_peer(slots_[s], id)) fail_slot(s, code, why);
    s = next;
  }
  if (p.orderly_close && code == Code::kPeerDead) {
    // Its goodbye travels on the control socket and can overtake its last writes (completed at
    // the peer, still on the wire): keep its connection and counters a grace period longer.
    p.draining.store(true, std::memory_order_release);
    p.drain_deadline = Clock::now() + std::chrono::milliseconds(std::min(cfg_.timeout_ms, kLingerMs));
    draining_++;
    return;
  }
  reset_backend_peer(id);
  imm_.fail_from(id, Status(code, "peer %u: %s", id, why));
}

void NicGroup::end_drains(Clock::time_point now) {
  const uint32_t n = std::min(next_peer_.load(std::memory_order_acquire), kMaxPeers);
  for (PeerId i = 0; i < n && draining_ > 0; i++) {
    Peer& p = peers_[i];
    if (!p.draining.load(std::memory_order_relaxed) || now < p.drain_deadline) continue;
    draining_--;
    reset_backend_peer(i);
    imm_.fail_from(i, Status(Code::kPeerDead, "peer %u closed its engine before these arrived", i));
    p.draining.store(false, std::memory_order_release);  // now peer_dead() says so
  }
}

bool NicGroup::slot_uses_peer(const Slot& s, PeerId id) const {
  switch (s.op.type) {
    case Op::kScatter:
      for (uint32_t i = 0; i < s.op.count; i++)
        if (s.op.targets[i].peer == id) return true;
      return false;
    case Op::kBarrier:
      for (uint32_t i = 0; i < s.op.count; i++)
        if (s.op.peers[i] == id) return true;
      return false;
    default:
      return s.op.peer == id;
  }
}

void NicGroup::accept_new() {
  for (;;) {
    int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return;
    PendingSocket ps;
    ps.sock = std::make_unique<ControlSocket>();
    ps.sock->adopt(fd);
    ps.deadline = Clock::now() + std::chrono::milliseconds(cfg_.timeout_ms);
    epoll_add(fd, kPendingTag);
    pending_.push_back(std::move(ps));
  }
}

void NicGroup::service_pending(Clock::time_point now) {
  for (size_t i = 0; i < pending_.size();) {
    PendingSocket& ps = pending_[i];
    auto got = ps.sock->recv_message(&msg_);
    bool drop = !got.ok() || now > ps.deadline;
    if (!drop && *got) {
      // The first message names the peer: find it (we may have connected to it too) or add it.
      WireReader r(msg_);
      r.skip(kHelloHeaderBytes);
      uint16_t alen = r.u16();
      auto abytes = r.bytes(alen);
      auto addr = r.ok() ? GroupAddress::decode(abytes) : Result<GroupAddress>(Status(Code::kInvalidArgument, "short hello"));
      if (!addr.ok()) {
        PONTE_LOG_WARN("group %d: dropping a control connection: %s", index_, addr.status().message());
        drop = true;
      } else {
        PeerId id = find_peer(addr->engine_nonce, addr->group);
        if (id == kAnyPeer) {
          id = next_peer_.fetch_add(1, std::memory_order_relaxed);
          if (id >= kMaxPeers) {
            PONTE_LOG_WARN("group %d: refusing a peer: more than %u peers", index_, kMaxPeers);
            drop = true;
          } else {
            Peer& p = peers_[id];
            p.inbound = true;
            p.handshake_deadline = now + std::chrono::milliseconds(cfg_.timeout_ms);
            p.state.store(kConnecting, std::memory_order_release);
          }
        }
        if (!drop) {
          Peer& p = peers_[id];
          int which = p.sock[0].open() ? 1 : 0;
          if (p.sock[which].open()) {
            drop = true;  // a third connection from the same peer: not ours
          } else {
            int fd = ps.sock->fd();
            epoll_del(fd);
            p.sock[which].adopt(dup(fd));
            ps.sock->close();
            epoll_add(p.sock[which].fd(), (static_cast<uint64_t>(id) << 1) | static_cast<uint64_t>(which));
            Status st = handle_hello(id, which, msg_);
            if (!st.ok()) peer_died(id, Code::kPeerDead, st.message());
            pending_.erase(pending_.begin() + static_cast<long>(i));
            continue;
          }
        }
      }
    }
    if (drop) {
      if (ps.sock->open()) epoll_del(ps.sock->fd());
      pending_.erase(pending_.begin() + static_cast<long>(i));
      continue;
    }
    i++;
  }
}

void NicGroup::service_peer(PeerId id, int which) {
  Peer& p = peers_[id];
  if (p.state.load(std::memory_order_relaxed) == kDead || !p.sock[which].open()) return;
  auto conn = p.sock[which].poll_connected();
  if (!conn.ok()) return peer_died(id, Code::kPeerDead, conn.status().message());
  if (!*conn) return;
  if (!p.sock_hello_sent[which] && !p.inbound && which == 0) {
    Status st = send_hello(id, which);
    if (!st.ok()) return peer_died(id, Code::kPeerDead, st.message());
    // Connected: stop watching for writability (level-triggered, it would never let us sleep).
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP;
    ev.data.u64 = static_cast<uint64_t>(id) << 1;
    epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, p.sock[0].fd(), &ev);
  }
  Status fl = p.sock[which].flush();
  if (!fl.ok()) return peer_died(id, Code::kPeerDead, fl.message());
  for (;;) {
    auto got = p.sock[which].recv_message(&msg_);
    if (!got.ok()) return peer_died(id, Code::kPeerDead, got.status().message());
    if (!*got) return;
    if (msg_.size() >= 2 && msg_[0] == kHelloVersion && msg_[1] == kByeType) {
      p.orderly_close = true;
      return peer_died(id, Code::kPeerDead, "the peer shut its engine down");
    }
    Status st = handle_hello(id, which, msg_);
    if (!st.ok()) return peer_died(id, Code::kPeerDead, st.message());
  }
}

void NicGroup::poll_control(Clock::time_point now) {
  epoll_event evs[64];
  int n = epoll_wait(epoll_fd_, evs, 64, 0);
  bool pending_ready = false;
  for (int i = 0; i < n; i++) {
    uint64_t tag = evs[i].data.u64;
    if (tag == kWakeTag) {
      uint64_t v;
      if (read(wake_fd_, &v, sizeof(v)) < 0) { /* nothing to drain */ }
    } else if (tag == kListenTag) {
      accept_new();
      pending_ready = true;
    } else if (tag == kPendingTag) {
      pending_ready = true;
    } else {
      service_peer(static_cast<PeerId>(tag >> 1), static_cast<int>(tag & 1));
    }
  }
  if (pending_ready || !pending_.empty()) service_pending(now);
}

// ---------------------------------------------------------------- slots and posting

uint32_t NicGroup::alloc_slot() {
  if (free_slots_.empty()) return kNoSlot;
  uint32_t i = free_slots_.back();
  free_slots_.pop_back();
  Slot& s = slots_[i];
  s.used = true;
  s.error = Code::kOk;
  s.error_msg[0] = 0;
  s.next_shard = s.shards = s.outstanding = 0;
  s.prev = kNoSlot;
  s.next = active_head_;
  if (active_head_ != kNoSlot) slots_[active_head_].prev = i;
  active_head_ = i;
  active_count_++;
  return i;
}

void NicGroup::finish(uint32_t i) {
  Slot& s = slots_[i];
  Notify done = s.op.done;
  Code code = s.error;
  char msg[96];
  memcpy(msg, s.error_msg, sizeof(msg));
  // Release before notifying: the callback may submit again.
  s.used = false;
  s.runnable = false;
  s.gen++;
  if (s.prev != kNoSlot) slots_[s.prev].next = s.next; else active_head_ = s.next;
  if (s.next != kNoSlot) slots_[s.next].prev = s.prev;
  free_slots_.push_back(i);
  active_count_--;
  if (code == Code::kOk) done(Status::Ok());
  else done(Status(code, "%s", msg));
}

void NicGroup::fail_slot(uint32_t i, Code code, const char* why) {
  Slot& s = slots_[i];
  if (s.error == Code::kOk) {
    s.error = code;
    snprintf(s.error_msg, sizeof(s.error_msg), "%s", why);
  }
  if (s.runnable) {
    // Unlink from the runnable FIFO.
    uint32_t prev = kNoSlot;
    for (uint32_t r = run_head_; r != kNoSlot; prev = r, r = slots_[r].run_next) {
      if (r != i) continue;
      if (prev == kNoSlot) run_head_ = slots_[r].run_next; else slots_[prev].run_next = slots_[r].run_next;
      if (run_tail_ == r) run_tail_ = prev;
      break;
    }
    s.runnable = false;
  }
  // Shards still on the NIC complete later with a stale generation and are ignored.
  finish(i);
}

bool NicGroup::drain_queue() {
  bool did = false;
  for (int n = 0; n < 256; n++) {
    Op* op = queue_.front();
    if (!op) break;
    if (op->needs_slot() && free_slots_.empty())
      break;  // back-pressure: leave it queued until a slot frees
    start_op(*op);  // reads the entry in place; it stays ours until pop()
    queue_.pop();
    did = true;
  }
  return did;
}

void NicGroup::start_op(const Op& op) {
  const auto now = now_;  // the loop's clock (at most 64 passes old): deadlines are in ms
  switch (op.type) {
    case Op::kCall:
      op.call(op.call_arg);
      op.done(Status::Ok());
      return;
    case Op::kExpect: {
      uint32_t t = op.timeout_ms ? op.timeout_ms : cfg_.timeout_ms;
      if (op.peer != kAnyPeer && peer_dead(op.peer)) {  // a draining peer's counters still count
        op.done(Status(Code::kPeerDead, "expect_imm: peer %u is dead", op.peer));
        return;
      }
      Status st = imm_.expect(op.imm, op.count, op.peer, now + std::chrono::milliseconds(t), op.done);
      if (!st.ok()) op.done(st);
      return;
    }
    case Op::kConnect: {
      Peer& p = peers_[op.peer];  // new_outbound_peer recorded its address
      p.handshake_deadline = now + std::chrono::milliseconds(cfg_.timeout_ms);
      ControlEndpoint ep;
      ep.family = p.addr.ip_family;
      memcpy(ep.ip, p.addr.ip, 16);
      ep.port = p.addr.port;
      Status st = attach_backend(op.peer);
      if (st.ok()) st = p.sock[0].connect(ep);
      if (!st.ok()) return peer_died(op.peer, Code::kPeerDead, st.message());
      epoll_event ev{};
      ev.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP;
      ev.data.u64 = static_cast<uint64_t>(op.peer) << 1;
      epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, p.sock[0].fd(), &ev);
      service_peer(op.peer, 0);
      return;
    }
    default:
      break;
  }
  uint32_t i = alloc_slot();  // drain_queue made sure one is free
  Slot& s = slots_[i];
  s.op = op;
  s.deadline = now + std::chrono::milliseconds(cfg_.timeout_ms);
  s.first_nic = first_nic_++;
  switch (op.type) {
    case Op::kWrite: {
      int n = std::min<int>(peer_nics(op.peer), op.remote.nics);
      s.plan = StripePlan::make(op.len, n, cfg_.stripe_min_bytes, peer_max_shard(op.peer));
      s.shards = s.plan.shards;
      break;
    }
    case Op::kPaged:
    case Op::kScatter:
    case Op::kBarrier:
      s.shards = op.count;
      break;
    default:
      s.shards = 1;
      break;
  }
  if (s.shards == 0) return finish(i);
  s.runnable = true;
  s.run_next = kNoSlot;
  if (run_tail_ == kNoSlot) run_head_ = i; else slots_[run_tail_].run_next = i;
  run_tail_ = i;
}

NicGroup::PostResult NicGroup::post_shard(Slot& s, uint32_t si) {
  const Op& op = s.op;
  const uint32_t j = s.next_shard;
  PeerId peer = op.peer;
  if (op.type == Op::kScatter) peer = op.targets[j].peer;
  else if (op.type == Op::kBarrier) peer = op.peers[j];
  uint8_t st = peers_[peer].state.load(std::memory_order_acquire);
  if (st == kDead) {
    fail_slot(si, Code::kPeerDead, "peer is dead");
    return PostResult::kFailed;
  }
  if (st != kReady) return PostResult::kWait;
  Peer& p = peers_[peer];
  int pn = p.nics.load(std::memory_order_relaxed);
  uint64_t ctx = (static_cast<uint64_t>(s.gen) << 32) | si;
  Status rc;
  const uint8_t* base = op.mr ? static_cast<const uint8_t*>(op.mr->addr) : nullptr;
  // Every write-type operation comes down to one write: NIC k, local bytes, remote address and key.
  auto write_on = [&](int k, const uint8_t* local, size_t len, void* desc, uint64_t raddr, uint64_t rkey) {
    WriteWr wr;
    wr.peer = p.nic_peer[k];
    wr.local = local;
    wr.len = len;
    wr.desc = desc;
    wr.remote_addr = raddr;
    wr.rkey = rkey;
    wr.imm = op.imm;
    wr.has_imm = op.has_imm;
    wr.ctx = ctx;
    return nics_[k]->post_write(wr);
  };
  switch (op.type) {
    case Op::kWrite: {
      int k = static_cast<int>((s.first_nic + j) % static_cast<uint32_t>(s.plan.nics));
      size_t len = s.plan.shard_len(j, op.len);
      size_t off = len ? s.plan.shard_offset(j) : 0;
      rc = write_on(k, base + op.offset + off, len, op.mr->nic_mrs[k].desc,
                    op.remote.remote_base[k] + op.remote_offset + off, op.remote.rkey[k]);
      break;
    }
    case Op::kRead: {
      int k = static_cast<int>(s.first_nic % static_cast<uint32_t>(std::min<int>(pn, op.remote.nics)));
      rc = nics_[k]->post_read(p.nic_peer[k], static_cast<uint8_t*>(op.mr->addr) + op.offset, op.len,
                               op.mr->nic_mrs[k].desc, op.remote.remote_base[k] + op.remote_offset,
                               op.remote.rkey[k], ctx);
      break;
    }
    case Op::kPaged: {
      int k = static_cast<int>((s.first_nic + j) % static_cast<uint32_t>(std::min<int>(pn, op.remote.nics)));
      rc = write_on(k, base + static_cast<size_t>(op.src_pages[j]) * op.page_size, op.page_size,
                    op.mr->nic_mrs[k].desc,
                    op.remote.remote_base[k] + static_cast<size_t>(op.dst_pages[j]) * op.page_size, op.remote.rkey[k]);
      break;
    }
    case Op::kScatter: {
      const ScatterTarget& t = op.targets[j];
      int k = static_cast<int>((s.first_nic + j) % static_cast<uint32_t>(std::min<int>(pn, t.dst->nics)));
      rc = write_on(k, base + t.src_offset, t.len, op.mr->nic_mrs[k].desc, t.dst->remote_base[k] + t.dst_offset,
                    t.dst->rkey[k]);
      break;
    }
    case Op::kImm:
    case Op::kBarrier: {
      // No payload, but a real local buffer and remote key: the peer's receive-buffer region,
      // which a 0-byte write leaves untouched.
      int k = static_cast<int>((s.first_nic + j) % static_cast<uint32_t>(pn));
      rc = write_on(k, recv_bufs_[k].get(), 0, recv_mrs_[k].nic_mrs[k].desc, p.addr.imm_base[k], p.addr.imm_rkey[k]);
      break;
    }
    case Op::kSend: {
      int k = static_cast<int>(s.first_nic % static_cast<uint32_t>(pn));
      rc = nics_[k]->post_send(p.nic_peer[k], static_cast<const uint8_t*>(op.mr->addr) + op.offset, op.len,
                               op.mr->nic_mrs[k].desc, p.remote_tag, ctx);
      break;
    }
    default:
      fail_slot(si, Code::kInternal, "unknown operation");
      return PostResult::kFailed;
  }
  if (rc.ok()) {
    s.next_shard++;
    s.outstanding++;
    return PostResult::kPosted;
  }
  if (rc.code() == Code::kAgain) return PostResult::kWait;
  fail_slot(si, rc.code(), rc.message());
  return PostResult::kFailed;
}

bool NicGroup::post_runnable() {
  bool did = false;
  uint32_t prev = kNoSlot;
  for (uint32_t i = run_head_; i != kNoSlot;) {
    Slot& s = slots_[i];
    uint32_t next = s.run_next;
    PostResult r = PostResult::kPosted;
    while (s.next_shard < s.shards) {
      r = post_shard(s, i);
      if (r != PostResult::kPosted) break;
      did = true;
    }
    if (r == PostResult::kFailed) {
      // fail_slot unlinked it; prev stays.
      i = next;
      continue;
    }
    if (s.next_shard == s.shards) {
      // Fully posted: leave the runnable FIFO.
      if (prev == kNoSlot) run_head_ = next; else slots_[prev].run_next = next;
      if (run_tail_ == i) run_tail_ = prev;
      s.runnable = false;
    } else {
      prev = i;
    }
    i = next;
  }
  return did;
}

void NicGroup::on_completion(int nic, const Completion& c) {
  switch (c.kind) {
    case CompletionKind::kRemoteWrite:
      if (c.error != Code::kOk) return;
      if (!imm_.arrive(c.imm) && (dropped_imms_++ % 1024) == 0)
        PONTE_LOG_ERROR("group %d: immediate counter table full: dropped immediate 0x%x", index_, c.imm);
      return;
    case CompletionKind::kRecv: {
      uint32_t b = static_cast<uint32_t>(c.ctx);
      if (b >= cfg_.recv_buf_count) return;
      uint8_t* buf = recv_bufs_[nic].get() + static_cast<size_t>(b) * cfg_.recv_buf_size;
      if (c.error == Code::kOk && recv_fn_) recv_fn_(recv_arg_, c.imm, std::span<const uint8_t>(buf, c.len));
      if (stop_.load(std::memory_order_relaxed)) return;
      Status st = nics_[nic]->post_recv(buf, cfg_.recv_buf_size, recv_mrs_[nic].nic_mrs[nic].desc, b);
      if (!st.ok()) PONTE_LOG_WARN("group %d: reposting a receive: %s", index_, st.message());
      return;
    }
    case CompletionKind::kLocal: {
      uint32_t i = static_cast<uint32_t>(c.ctx);
      uint32_t gen = static_cast<uint32_t>(c.ctx >> 32);
      if (i >= slots_.size()) return;
      Slot& s = slots_[i];
      if (!s.used || s.gen != gen) return;  // a shard of an op that already failed
      s.outstanding--;
      if (c.error != Code::kOk) {
        // A transport error breaks the connection on connection-oriented backends (an RC QP goes to
        // error): rebuild it through a new handshake round; the failed op ends with the error.
        PeerId peer = (s.op.type == Op::kScatter || s.op.type == Op::kBarrier) ? kAnyPeer : s.op.peer;
        fail_slot(i, c.error, "the NIC reported a failed completion");
        if (c.error == Code::kTransport && peer != kAnyPeer && peer < kMaxPeers) start_reconnect(peer, "a transfer failed");
        return;
      }
      if (s.outstanding == 0 && s.next_shard == s.shards) finish(i);
      return;
    }
  }
}

void NicGroup::housekeeping(Clock::time_point now) {
  poll_control(now);
  if (now - last_timeout_scan_ < std::chrono::milliseconds(5)) return;
  last_timeout_scan_ = now;
  for (uint32_t s = active_head_; s != kNoSlot;) {
    uint32_t next = slots_[s].next;
    if (slots_[s].deadline <= now) fail_slot(s, Code::kTimeout, "no completion within PONTE_TIMEOUT_MS");
    s = next;
  }
  imm_.expire(now);
  if (draining_ > 0) end_drains(now);
  uint32_t n = std::min(next_peer_.load(std::memory_order_acquire), kMaxPeers);
  for (PeerId i = 0; i < n; i++) {
    Peer& p = peers_[i];
    if (p.state.load(std::memory_order_acquire) == kConnecting && p.addr_known && now > p.handshake_deadline)
      peer_died(i, Code::kTimeout, "handshake did not complete within PONTE_TIMEOUT_MS");
  }
}

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
  const uint8_t bye[2] = {kHelloVersion, kByeType};
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
    bool busy = active_count_ > 0 || imm_.waiting() > 0 || !pending_.empty() ||
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
