// NicGroup's liveness: a peer's death (its operations and counters fail), the drain of a peer
// that closed in order, and the periodic timeout scan of operations and handshakes.
#include "core/nic_group.h"

#include <algorithm>

#include "core/log.h"
#include "core/nic_group_internal.h"

namespace ponte {

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

}  // namespace ponte
