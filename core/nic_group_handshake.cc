// NicGroup's peers and their handshake: control connections (outbound, accepted, pending), HELLO
// exchange, and the reconnect rounds (epochs) that rebuild a failed connection.
#include "core/nic_group.h"

#include <errno.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>

#include "core/log.h"
#include "core/nic_group_internal.h"

namespace ponte {

Result<PeerId> NicGroup::new_outbound_peer(const GroupAddress& addr, int traffic_class, bool* existing) {
  *existing = false;
  auto key = AuthKey::for_peer(addr.auth_kind, addr.auth_secret, cfg_.job_key);
  if (!key.ok()) return key.status();
  std::lock_guard<std::mutex> lock(peers_mu_);
  // A group connected to itself is two peers (see adopt_pending); any other group is one, however
  // many times and from whichever end it was connected: the other end folds every connection
  // from us into one peer too.
  const bool self = addr.engine_nonce == engine_nonce_ && addr.group == index_;
  if (!self) {
    PeerId found = find_peer(addr.engine_nonce, addr.group, traffic_class);
    if (found != kAnyPeer) {
      *existing = true;
      return found;
    }
  }
  PeerId id = next_peer_.fetch_add(1, std::memory_order_relaxed);
  if (id >= kMaxPeers) {
    next_peer_.store(kMaxPeers, std::memory_order_relaxed);
    return Status(Code::kResource, "group %d: more than %u peers", index_, kMaxPeers);
  }
  // Written before the peer is published (the state store below, then the kConnect op through
  // the queue): the worker sees all of it and no thread writes it again concurrently.
  Peer& p = peers_[id];
  learn_address(p, addr);
  p.auth = *key;
  p.traffic_class = traffic_class;
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
uint32_t NicGroup::peer_epoch(PeerId p) const {
  return p < kMaxPeers ? peers_[p].rebuilds.load(std::memory_order_acquire) : 0;
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

PeerId NicGroup::find_peer(uint64_t nonce, uint8_t group, int traffic_class) const {
  uint32_t n = std::min(next_peer_.load(std::memory_order_acquire), kMaxPeers);
  for (PeerId i = 0; i < n; i++) {
    const Peer& p = peers_[i];
    uint8_t st = p.state.load(std::memory_order_acquire);
    if ((st == kConnecting || st == kReady) && p.addr_known && p.addr.engine_nonce == nonce &&
        p.addr.group == group && p.traffic_class == traffic_class)
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
    if (p.traffic_class >= 0) PONTE_RETURN_IF_ERROR(nics_[k]->set_traffic_class(*np, static_cast<uint8_t>(p.traffic_class)));
  }
  p.nics_added = true;
  return Status::Ok();
}

Status NicGroup::send_hello(PeerId id, int which) {
  Peer& p = peers_[id];
  PONTE_RETURN_IF_ERROR(attach_backend(id));
  HelloMsg m;
  m.id_for_receiver = id;  // the id we gave the peer: its sends to us carry it
  m.epoch = p.epoch;
  m.traffic_class = p.traffic_class;
  m.address = address_bytes_;
  int n = p.nics.load(std::memory_order_relaxed);
  for (int k = 0; k < n; k++) {
    auto blob = nics_[k]->connect_blob(p.nic_peer[k]);
    if (!blob.ok()) return blob.status();
    m.blobs.push_back(std::move(*blob));
  }
  auto msg = encode_hello(m);
  if (!msg.ok()) return msg.status();
  PONTE_RETURN_IF_ERROR(p.sock[which].send_message(*msg));
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

// Answers the challenge on an outbound connection (the first message the acceptor sends), then
// says hello.
Status NicGroup::answer_challenge(PeerId id) {
  Peer& p = peers_[id];
  auto challenge = decode_challenge(msg_);
  if (!challenge.ok())
    return Status(Code::kPeerDead, "the peer did not challenge this connection (%s): not a ponte of this version",
                  challenge.status().message());
  auto proof = auth_proof(p.auth, *challenge, p.addr.engine_nonce, p.addr.group);
  PONTE_RETURN_IF_ERROR(p.sock[0].send_message(encode_auth(proof)));
  p.out_authed = true;
  return send_hello(id, 0);
}

Status NicGroup::handle_hello(PeerId id, int which, const HelloMsg& msg) {
  Peer& p = peers_[id];
  const uint32_t their_id_for_us = msg.id_for_receiver;
  const uint32_t epoch = msg.epoch;
  auto addr = GroupAddress::decode(msg.address);
  if (!addr.ok()) return addr.status();
  if (addr->backend != backend_)
    return Status(Code::kInvalidArgument, "peer runs the %s backend, this group %s", backend_name(addr->backend), backend_name(backend_));
  int n = p.nics.load(std::memory_order_relaxed);  // its address is known: adopt_pending or connect
  const size_t nblobs = msg.blobs.size();
  if (nblobs < static_cast<size_t>(n))
    return Status(Code::kInvalidArgument, "handshake: %zu connect blobs for %d NICs", nblobs, n);
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
    p.rebuilds.fetch_add(1, std::memory_order_release);  // after the state: see Engine::peer_epoch
    p.handshake_deadline = Clock::now() + std::chrono::milliseconds(cfg_.timeout_ms);
    PONTE_LOG_INFO("group %d: peer %u rebuilds its connection (round %u)", index_, id, epoch);
    PONTE_RETURN_IF_ERROR(send_hello(id, which));
    answered = true;
  }
  if (!p.sock_hello_sent[which] && !answered) PONTE_RETURN_IF_ERROR(send_hello(id, which));
  if (!first && epoch < p.epoch) return Status::Ok();  // stale round: ours supersedes it
  if (!p.backend_connected) {
    for (int k = 0; k < n; k++) {
      Status st = nics_[k]->complete_connect(p.nic_peer[k], msg.blobs[k]);
      if (st.ok() && k == 0 && fault_connects_left_ > 0) [[unlikely]] {
        fault_connects_left_--;  // injected: as if the NIC refused the connection (a QP in ERR)
        st = Status(Code::kTransport, "the connection failed on NIC 0 (PONTE_FAULT_FAILED_CONNECTS)");
      }
      if (st.ok()) continue;
      // Our side of this round did not connect (on SoftRoCE with 4 QPs per connection, a new QP
      // was seen in ERR between RTR and RTS in the first round of some runs of the bad-key test).
      // The peer's side may well have: a fresh round replaces both, as for a transfer that
      // failed; after kMaxFailedRounds in a row, the peer is dead.
      if (++p.failed_rounds > kMaxFailedRounds) return st;
      PONTE_LOG_WARN("group %d: peer %u: round %u did not connect (%s; on the peer's hello of round %u, control "
                     "connection %d); trying round %u", index_, id, p.epoch, st.message(), epoch, which,
                     std::max(p.epoch, p.remote_epoch) + 1);
      return propose_round(id);
    }
    p.backend_connected = true;
  }
  if (p.hello_sent && p.backend_connected && p.state.load(std::memory_order_relaxed) == kConnecting) {
    p.failed_rounds = 0;
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
  PONTE_LOG_WARN("group %d: peer %u: %s; rebuilding the connection", index_, id, why);
  p.state.store(kConnecting, std::memory_order_release);
  Status st = propose_round(id);
  if (!st.ok()) peer_died(id, Code::kPeerDead, st.message());
}

// The peer is kConnecting. Counts a rebuild (Engine::peer_epoch), then new backend peers (on
// verbs, new QPs) and our hello for the next round on a control connection that is open; the peer
// answers with its own (handle_hello).
Status NicGroup::propose_round(PeerId id) {
  Peer& p = peers_[id];
  p.rebuilds.fetch_add(1, std::memory_order_release);  // after the state: see Engine::peer_epoch
  int which = p.sock[0].open() ? 0 : (p.sock[1].open() ? 1 : -1);
  if (which < 0) return Status(Code::kPeerDead, "no control connection left");
  p.epoch = std::max(p.epoch, p.remote_epoch) + 1;  // the next round both ends will share
  reset_backend_peer(id);
  p.backend_connected = false;
  p.hello_received = false;
  p.handshake_deadline = Clock::now() + std::chrono::milliseconds(cfg_.timeout_ms);
  return send_hello(id, which);
}


// ---------------------------------------------------------------- accepted connections
// Each is challenged at once and must answer in one small frame within the auth window (see
// control_auth.h); until then it holds a descriptor and a challenge, nothing else, and costs the
// worker a read only when it sends something.

void NicGroup::note_uninvited(const char* why) {
  if (uninvited_++ == 0)
    PONTE_LOG_WARN("group %d: dropped a control connection that did not prove it was invited: %s "
                   "(later ones are counted, not logged)", index_, why);
}

void NicGroup::drop_pending(size_t i, const char* uninvited_why) {
  if (uninvited_why) note_uninvited(uninvited_why);
  if (pending_[i].sock->open()) epoll_del(pending_[i].sock->fd());
  pending_.erase(pending_.begin() + static_cast<long>(i));  // closes the socket
}

void NicGroup::accept_new(Clock::time_point now) {
  for (;;) {
    int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        // The port stays readable while the connection waits in the backlog: rest it rather than
        // spin on it, and let the pending ones expire meanwhile.
        PONTE_LOG_WARN("group %d: cannot accept a control connection: %s (ulimit -n?); retrying in %u ms",
                       index_, strerror(errno), kListenPauseMs);
        epoll_del(listen_fd_);
        listen_paused_ = true;
        listen_resume_ = now + std::chrono::milliseconds(kListenPauseMs);
      }
      return;
    }
    if (pending_.size() >= kMaxPending) {
      ::close(fd);
      note_uninvited("too many connections waiting to authenticate");
      continue;
    }
    PendingSocket ps;
    ps.sock = std::make_unique<ControlSocket>();
    ps.sock->adopt(fd);
    ps.sock->set_max_message(kMaxAuthMessage);
    ps.deadline = now + std::chrono::milliseconds(std::min(cfg_.timeout_ms, kAuthWindowMs));
    Status st = random_bytes(ps.challenge);
    if (st.ok()) st = ps.sock->send_message(encode_challenge(ps.challenge));
    if (!st.ok()) {
      note_uninvited(st.message());
      continue;  // ps closes the socket
    }
    epoll_add(fd, kPendingBit | static_cast<uint64_t>(fd));
    pending_.push_back(std::move(ps));
  }
}

void NicGroup::service_pending(size_t i, Clock::time_point now) {
  for (;;) {
    PendingSocket& ps = pending_[i];
    auto got = ps.sock->recv_message(&msg_);
    if (!got.ok()) return drop_pending(i, ps.authed ? nullptr : got.status().message());
    if (!*got) return;
    if (!ps.authed) {
      auto proof = decode_auth(msg_);
      if (!proof.ok()) return drop_pending(i, proof.status().message());
      if (!constant_time_equal(*proof, auth_proof(auth_, ps.challenge, engine_nonce_, static_cast<uint8_t>(index_))))
        return drop_pending(i, "wrong proof (another job's key, a stale address or a replay)");
      ps.authed = true;
      ps.sock->set_max_message(kMaxControlMessage);
      ps.deadline = now + std::chrono::milliseconds(cfg_.timeout_ms);
      continue;  // its hello may have arrived with the proof
    }
    auto hello = decode_hello(msg_);
    if (!hello.ok()) {
      PONTE_LOG_WARN("group %d: dropping a control connection: %s", index_, hello.status().message());
      return drop_pending(i, nullptr);
    }
    return adopt_pending(i, *hello, now);
  }
}

// The first hello names the peer: find it (we may have connected to it too) or add it, and move
// the connection to it.
void NicGroup::adopt_pending(size_t i, const HelloMsg& hello, Clock::time_point now) {
  auto addr = GroupAddress::decode(hello.address);
  if (!addr.ok()) {
    PONTE_LOG_WARN("group %d: dropping a control connection: %s", index_, addr.status().message());
    return drop_pending(i, nullptr);
  }
  // A group connected to itself (the plugin's flush reads) is two peers, its outbound and its
  // inbound end: never fold the inbound connection into the outbound peer that made it. Any other
  // group is one peer per traffic class, at both ends: a connection asking for another class than
  // our peer's is a peer of its own (folded in, its QPs would go unanswered: the other end
  // connects them, we never would).
  const bool self = addr->engine_nonce == engine_nonce_ && addr->group == index_;
  PeerId id = kAnyPeer;
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    if (!self) id = find_peer(addr->engine_nonce, addr->group, hello.traffic_class);
    if (id == kAnyPeer) {
      id = next_peer_.fetch_add(1, std::memory_order_relaxed);
      if (id < kMaxPeers) {
        Peer& p = peers_[id];
        p.inbound = true;
        p.traffic_class = hello.traffic_class;  // our connect() with that class finds this peer
        learn_address(p, *addr);  // before it is published: connect() may find it from now on
        p.handshake_deadline = now + std::chrono::milliseconds(cfg_.timeout_ms);
        p.state.store(kConnecting, std::memory_order_release);
      }
    }
  }
  if (id >= kMaxPeers) {
    PONTE_LOG_WARN("group %d: refusing a peer: more than %u peers", index_, kMaxPeers);
    return drop_pending(i, nullptr);
  }
  Peer& p = peers_[id];
  // An outbound peer's sock[0] is its own connection, even before the kConnect op (still in the
  // queue) opens it: a connection from the peer goes to sock[1], never where our connect would
  // close it (the peer then saw its connection closed and declared us dead).
  int which = p.inbound && !p.sock[0].open() ? 0 : 1;
  if (p.sock[which].open()) return drop_pending(i, nullptr);  // a third connection from the same peer: not ours
  int fd = pending_[i].sock->fd();
  epoll_del(fd);
  p.sock[which].adopt(dup(fd));
  p.sock[which].take_input(*pending_[i].sock);  // read with the hello: a ping, a goodbye
  pending_.erase(pending_.begin() + static_cast<long>(i));
  epoll_add(p.sock[which].fd(), (static_cast<uint64_t>(id) << 1) | static_cast<uint64_t>(which));
  Status st = handle_hello(id, which, hello);
  if (!st.ok()) return peer_died(id, Code::kPeerDead, st.message());
  if (p.sock[which].has_input()) service_peer(id, which);
}

void NicGroup::expire_pending(Clock::time_point now) {
  if (listen_paused_ && now >= listen_resume_) {
    listen_paused_ = false;
    epoll_add(listen_fd_, kListenTag);
  }
  for (size_t i = 0; i < pending_.size();) {
    if (now <= pending_[i].deadline) {
      i++;
      continue;
    }
    if (pending_[i].authed) PONTE_LOG_WARN("group %d: dropping a control connection: no hello within PONTE_TIMEOUT_MS", index_);
    drop_pending(i, pending_[i].authed ? nullptr : "no proof within the authentication window");
  }
}

// ---------------------------------------------------------------- peers' connections

void NicGroup::service_peer(PeerId id, int which) {
  Peer& p = peers_[id];
  if (p.state.load(std::memory_order_relaxed) == kDead || !p.sock[which].open()) return;
  auto conn = p.sock[which].poll_connected();
  if (!conn.ok()) return peer_died(id, Code::kPeerDead, conn.status().message());
  if (!*conn) return;
  const bool outbound = !p.inbound && which == 0;
  if (outbound && !p.out_connected) {
    // Connected: the acceptor speaks first (its challenge). Stop watching for writability
    // (level-triggered, it would never let us sleep).
    p.out_connected = true;
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP;
    ev.data.u64 = static_cast<uint64_t>(id) << 1;
    epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, p.sock[0].fd(), &ev);
  }
  Status fl = p.sock[which].flush();
  if (!fl.ok()) return peer_died(id, Code::kPeerDead, fl.message());
  for (;;) {
    auto got = p.sock[which].recv_message(&msg_);
    if (!got.ok()) {
      if (outbound && !p.hello_received && got.status().code() == Code::kPeerDead)
        return peer_died(id, Code::kPeerDead,
                         "the peer closed the control connection before its hello: its process ended, or a "
                         "PONTE_JOB_KEY that differs, an engine that has restarted, or another ponte version");
      return peer_died(id, Code::kPeerDead, got.status().message());
    }
    if (!*got) return;
    p.last_heard = now_;  // any message: the peer's worker runs (keep_alive)
    if (outbound && !p.out_authed) {
      Status st = answer_challenge(id);
      if (!st.ok()) return peer_died(id, Code::kPeerDead, st.message());
      continue;
    }
    if (liveness_message(id, which)) continue;  // a PING (answered) or a PONG
    if (decode_bye(msg_).ok()) {
      p.orderly_close = true;
      return peer_died(id, Code::kPeerDead, "the peer shut its engine down");
    }
    auto hello = decode_hello(msg_);
    if (!hello.ok()) return peer_died(id, Code::kPeerDead, hello.status().message());
    Status st = handle_hello(id, which, *hello);
    if (!st.ok()) return peer_died(id, Code::kPeerDead, st.message());
  }
}

void NicGroup::poll_control(Clock::time_point now) {
  epoll_event evs[64];
  int n = epoll_wait(epoll_fd_, evs, 64, 0);
  for (int i = 0; i < n; i++) {
    uint64_t tag = evs[i].data.u64;
    if (tag == kWakeTag) {
      uint64_t v;
      if (read(wake_fd_, &v, sizeof(v)) < 0) { /* nothing to drain */ }
    } else if (tag == kListenTag) {
      accept_new(now);
    } else if (tag & kPendingBit) {
      const int fd = static_cast<int>(tag & 0xffffffffu);
      for (size_t k = 0; k < pending_.size(); k++)
        if (pending_[k].sock->fd() == fd) {
          service_pending(k, now);
          break;
        }
    } else {
      service_peer(static_cast<PeerId>(tag >> 1), static_cast<int>(tag & 1));
    }
  }
  if ((!pending_.empty() || listen_paused_) && now - last_pending_scan_ >= std::chrono::milliseconds(kPendingScanMs)) {
    last_pending_scan_ = now;
    expire_pending(now);
  }
}

}  // namespace ponte
