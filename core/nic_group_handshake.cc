// NicGroup's peers and their handshake: control connections (outbound, accepted, pending), HELLO
// exchange, and the reconnect rounds (epochs) that rebuild a failed connection.
#include "core/nic_group.h"

#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>

#include "core/log.h"
#include "core/wire.h"
#include "core/nic_group_internal.h"

namespace ponte {

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

}  // namespace ponte
