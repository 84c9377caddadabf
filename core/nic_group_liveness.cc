// NicGroup's liveness: a peer's death (its operations and counters fail), the drain of a peer
// that closed in order, the periodic timeout scan of operations and handshakes, the keepalives
// that tell a stopped peer from a slow one, and the watchdog's side of a wedged group (see
// core/watchdog.h).
#include "core/nic_group.h"

#include <algorithm>

#include "core/log.h"
#include "core/nic_group_internal.h"

namespace ponte {

void NicGroup::peer_died(PeerId id, Code code, const char* why) {
  Peer& p = peers_[id];
  if (p.state.load(std::memory_order_relaxed) == kDead) return;
  // Draining is set before the state: a poller that reads kDead must also read draining, or it
  // would take a peer that closed in order for dead (peer_dead) while its last writes land.
  const bool orderly = p.orderly_close && code == Code::kPeerDead;
  if (orderly) p.draining.store(true, std::memory_order_release);
  p.state.store(kDead, std::memory_order_release);
  if (p.orderly_close) PONTE_LOG_INFO("group %d: peer %u closed: %s", index_, id, why);
  else PONTE_LOG_WARN("group %d: peer %u is dead: %s", index_, id, why);
  for (auto& s : p.sock) {
    if (s.open()) epoll_del(s.fd());
    s.close();
  }
  // Every operation toward the peer ends through its error path. After an orderly close, only
  // those not yet wholly on the wire: a peer says goodbye once it has what it waited for, so
  // writes it received may still be completing here (shm and rxm report them after the peer's
  // side has moved them; the goodbye, on the control socket, can come first). Those keep the
  // grace period below to complete, and fail at its end if they did not (end_drains).
  fail_ops_toward(id, code, why, orderly);
  if (orderly) {
    // Its goodbye travels on the control socket and can overtake its last writes (completed at
    // the peer, still on the wire): keep its connection and counters a grace period longer.
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
    fail_ops_toward(i, Code::kPeerDead, "the peer closed its engine before this completed", false);
    reset_backend_peer(i);
    imm_.fail_from(i, Status(Code::kPeerDead, "peer %u closed its engine before these arrived", i));
    p.draining.store(false, std::memory_order_release);  // now peer_dead() says so
  }
}

void NicGroup::fail_ops_toward(PeerId id, Code code, const char* why, bool keep_on_wire) {
  for (uint32_t s = active_head_; s != kNoSlot;) {
    uint32_t next = slots_[s].next;
    const Slot& sl = slots_[s];
    const bool on_wire = !sl.runnable && sl.next_shard >= sl.shards && sl.outstanding > 0;
    if (slot_uses_peer(sl, id) && !(keep_on_wire && on_wire)) fail_slot(s, code, why);
    s = next;
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

void NicGroup::housekeeping(Clock::time_point now) {
  poll_control(now);
  if (now - last_timeout_scan_ < std::chrono::milliseconds(5)) return;
  // Time this worker was away (off the CPU, stopped, kept in a callback) is no peer's silence: it
  // could neither ask nor hear. Such a gap pauses every peer's silence clock (keep_alive).
  const auto away = now - last_timeout_scan_ > ping_after_ ? now - last_timeout_scan_ : Clock::duration::zero();
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
    const uint8_t st = p.state.load(std::memory_order_acquire);
    if (st == kConnecting && p.addr_known && now > p.handshake_deadline)
      peer_died(i, Code::kTimeout, "handshake did not complete within PONTE_TIMEOUT_MS");
    else if ((st == kReady || st == kConnecting) && p.hello_sent)
      keep_alive(i, now, away);
  }
}

// A stopped process keeps its TCP connections (the kernel answers for it, TCP keepalives too) but
// sends nothing; a busy one's worker still answers. So: after a quarter of PONTE_TIMEOUT_MS without
// a word from a peer, a PING (again every quarter while that lasts) on a connection that carried
// our hello, which its worker answers at once (liveness_message); a ready peer heard nothing from
// for PONTE_TIMEOUT_MS of this worker's own running time is dead. Both messages are built once:
// nothing is allocated.
void NicGroup::keep_alive(PeerId id, Clock::time_point now, Clock::duration away) {
  Peer& p = peers_[id];
  if (p.last_heard == Clock::time_point{}) p.last_heard = now;  // the handshake's messages came unseen
  if (away > Clock::duration::zero()) {
    p.last_heard = std::min(p.last_heard + away, now);
    p.last_ping = Clock::time_point{};  // ask again at once if it was quiet before
  }
  if (now - p.last_heard >= silence_limit_ && p.state.load(std::memory_order_relaxed) == kReady) {
    // What already arrived counts: a pass this late (this worker kept off the CPU) must not take
    // its own delay for the peer's silence.
    for (int w = 0; w < 2; w++)
      if (p.sock[w].open()) service_peer(id, w);
    if (p.state.load(std::memory_order_relaxed) == kDead) return;
    if (now - p.last_heard >= silence_limit_)
      return peer_died(id, Code::kPeerDead, "silent on its control connection for PONTE_TIMEOUT_MS (stopped, or its host wedged)");
  }
  if (now - p.last_heard < ping_after_ || now - p.last_ping < ping_after_) return;
  for (int w = 0; w < 2; w++) {
    if (!p.sock[w].open() || !p.sock_hello_sent[w]) continue;
    Status st = p.sock[w].send_message(ping_message());
    if (!st.ok()) return peer_died(id, Code::kPeerDead, st.message());
    p.last_ping = now;
    return;
  }
}

// A PING (answered with a PONG on the same connection) or a PONG in msg_: whether it was one.
bool NicGroup::liveness_message(PeerId id, int which) {
  if (decode_pong(msg_).ok()) return true;
  if (!decode_ping(msg_).ok()) return false;
  Status st = peers_[id].sock[which].send_message(pong_message());
  if (!st.ok()) peer_died(id, Code::kPeerDead, st.message());
  return true;
}

// ---------------------------------------------------------------- the watchdog's side

Status NicGroup::wedge_status() const {
  if (!wedged()) return Status::Ok();
  return Status(Code::kUnavailable, "%s", wedge_why_);
}

void NicGroup::watchdog_check(Clock::time_point now) {
  if (taken_over_.load(std::memory_order_acquire)) return refuse_queued();  // raced the verdict
  if (!watching_.load(std::memory_order_seq_cst)) return;
  const auto limit = std::chrono::milliseconds(cfg_.timeout_ms);
  const uint64_t w = guard_.peek();
  if (!CallGuard::in_call(w)) {
    watch_word_ = 0;
  } else if (w != watch_word_) {
    watch_word_ = w;
    watch_since_ = now;
  } else if (now - watch_since_ >= limit) {
    const long long ms = std::chrono::duration_cast<std::chrono::milliseconds>(now - watch_since_).count();
    if (guard_.claim(w)) return take_over(w, ms);  // else it just returned
  }
  // A worker inside one pass this long without being in a provider call (a callback that blocks,
  // say) cannot be taken over safely: said once.
  const uint64_t passes = passes_.load(std::memory_order_relaxed);
  if (passes != watch_passes_ || sleeping_.load(std::memory_order_relaxed)) {
    watch_passes_ = passes;
    passes_since_ = now;
  } else if (now - passes_since_ >= limit && !CallGuard::in_call(w) && !warned_stall_) {
    warned_stall_ = true;
    PONTE_LOG_WARN("group %d: the worker has made no pass for PONTE_TIMEOUT_MS, outside any provider call "
                   "(a callback that blocks?): its timeouts and liveness wait for it", index_);
  }
}

// The watchdog thread, once it claimed the call the token's holder is stuck in: that thread never
// touches the group again (watchdog.h), so everything below is this thread's alone.
void NicGroup::take_over(uint64_t call_word, long long stuck_ms) {
  snprintf(wedge_why_, sizeof(wedge_why_), "group %d wedged: %s stuck for PONTE_TIMEOUT_MS", index_,
           CallGuard::name(call_word));
  wedged_.store(true, std::memory_order_seq_cst);  // submissions, registrations, pollers: refused
  PONTE_LOG_ERROR("group %d: %s has not returned for %lld ms: the group is wedged; its operations and counters end "
                  "with errors, its peers are told, and it takes no more work", index_, CallGuard::name(call_word),
                  stuck_ms);
  while (active_head_ != kNoSlot) fail_slot(active_head_, Code::kTimeout, wedge_why_);
  imm_.fail_all(Status(Code::kTimeout, "%s", wedge_why_));
  // Inside drain_queue the head may be mid-start: a call (its box is its caller's business), a
  // connect (no Notify) or an op whose Notify is running on the stuck thread. Dropped unfired.
  if (in_drain_ && queue_.front() != nullptr) queue_.pop();
  refuse_queued();
  // Its peers hear it now (the connection closes) rather than after their own silence limit.
  const uint32_t n = std::min(next_peer_.load(std::memory_order_acquire), kMaxPeers);
  for (PeerId i = 0; i < n; i++)
    for (auto& sock : peers_[i].sock) sock.close();
  for (auto& ps : pending_) ps.sock->close();
  taken_over_.store(true, std::memory_order_release);
  rescue_poller();  // a polling thread (NCCL's proxy in test()) in the claimed call goes back
}

void NicGroup::refuse_queued() {
  const Status st = wedge_status();
  while (Op* op = queue_.front()) {
    Notify d = op->done;
    const Op::Type type = op->type;
    queue_.pop();
    if (type != Op::kConnect) d(st);
  }
}

}  // namespace ponte
