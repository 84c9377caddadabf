// Connection setup: listen handles, the CONNECT / ACCEPT / REJECT exchange over engine messages
// (its handler runs on the engine worker), comm ids and the engine peers comms share.
#include "plugin/transport_internal.h"

#include <bit>
#include <random>
#include <thread>

#include "core/log.h"
#include "plugin/log.h"

namespace ponte::plugin {

namespace {

uint64_t random_u64() {
  static std::mutex mu;
  static std::mt19937_64 gen{std::random_device{}()};
  std::lock_guard<std::mutex> lock(mu);
  uint64_t v = 0;
  while (v == 0) v = gen();
  return v;
}

void ctrl_done(void* arg, const Status& st) {
  auto* s = static_cast<CtrlSlot*>(arg);
  const uint64_t token = s->connect_token.exchange(0, std::memory_order_acq_rel);
  if (!st.ok()) {
    PONTE_NET_INFO("control message on device %d failed: %s", s->dev->index, st.message());
    if (token != 0) {  // a CONNECT that did not get out: connect() sends it again
      Inbox& ib = inbox();
      std::lock_guard<std::mutex> lock(ib.mu);
      auto it = ib.pending.find(token);
      if (it != ib.pending.end() && it->second->state == ConnectState::kWaiting)
        it->second->state = ConnectState::kSending;
    }
  }
  s->dev->ctrl_free.fetch_or(1ull << s->index, std::memory_order_acq_rel);
}

// A NOTICE for one end of a pair (engine worker). What must be sent back is sent after Inbox::mu
// is released: an engine call may run a completion callback that takes it.
void on_notice(Device* d, PeerId from, const NoticeMsg& m) {
  bool reply = false;
  bool for_comm = false;  // the ACK answers for a comm of ours (its ack_sent is set)
  bool reply_to_send = !m.to_send;
  {
    Inbox& ib = inbox();
    std::lock_guard<std::mutex> lock(ib.mu);
    auto& pairs = ib.pairs[m.to_send ? 1 : 0];
    auto it = pairs.find(m.token);
    if (it == pairs.end()) {
      // This end is gone already: it writes nothing more, so a BROKEN or CLOSED is answered now.
      if (m.what == NoticeWhat::kAck) return;
      reply = true;
    } else {
      CommBase* c = it->second;
      if (m.what == NoticeWhat::kAck) {
        c->acked.store(true, std::memory_order_release);
        return;
      }
      if (m.what == NoticeWhat::kBroken) {
        uint8_t none = 0;
        c->broken.compare_exchange_strong(none, static_cast<uint8_t>(Code::kTransport));
      } else {
        c->peer_clean = m.clean;
        c->peer_count = m.count;
        c->peer_closed_at = Clock::now();
        c->peer_closed.store(true);
      }
      // Posting paths raise inflight, then look at peer_stop (start_op); this sets peer_stop,
      // then looks at inflight (both sequentially consistent): when it sees none, no write toward
      // the other end can start any more and the ACK may go now. Else the thread that drives c
      // sends it once its operations have ended (answer_stop).
      c->peer_stop.store(true);
      if (c->inflight.load() != 0 || c->ack_sent.exchange(true)) return;
      reply = true;  // answered the way it came (c's peer field is its driving thread's)
      for_comm = true;
    }
  }
  if (!reply) return;
  Status st = send_ack(d, from, m.token, reply_to_send);
  if (st.ok()) return;
  if (for_comm) {
    // Not sent (no control buffer free: a deregMr from several threads at once retells BROKEN to
    // many comms): the ACK is owed again, so the other end's next BROKEN, or answer_stop, sends
    // it. Left marked sent, every retell was ignored and the other end's deregMr waited out
    // PONTE_TIMEOUT_MS (the likely cause of such waits on SoftRoCE, four threads aborting 32
    // sends each).
    Inbox& ib = inbox();
    std::lock_guard<std::mutex> lock(ib.mu);
    auto& pairs = ib.pairs[m.to_send ? 1 : 0];
    if (auto it = pairs.find(m.token); it != pairs.end()) it->second->ack_sent.store(false);
  }
  PONTE_NET_INFO("device %d: could not answer a close or failure notice yet (%s): it is answered "
                 "again later", d->index, st.message());
}

// Lowest free comm id (keeps the set of immediate values small), skipping quarantined ones.
// Counts left on its values by an earlier owner are consumed first. Call with d->mu held.
Result<uint32_t> alloc_comm_id(Device* d) {
  const auto now = Clock::now();
  for (uint32_t id = 1; id <= kMaxCommId; ++id) {
    if (d->comm_id_used[id] || now < d->comm_id_quarantine[id]) continue;
    d->comm_id_used[id] = 1;
    for (uint32_t slot = 0; slot < static_cast<uint32_t>(kMaxRequests); ++slot) {
      for (bool record : {false, true}) {
        const uint32_t v = imm_value(record, id, slot);
        const uint32_t left = d->engine->imm_arrived(d->group, v);
        if (left) d->engine->consume_imm(d->group, v, left);
      }
    }
    return id;
  }
  return Status(Code::kResource, "device %d: all %u comm ids in use (or waiting after a close "
                "with work outstanding)", d->index, kMaxCommId);
}

Status register_own(Device* d, CommBase* c, HostBuffer& buf) {
  if (!buf.ptr) return Status(Code::kResource, "out of memory for protocol buffers");
  auto mr = d->engine->register_memory(d->group, buf.ptr, buf.len);
  if (!mr.ok()) return mr.status();
  c->mrs.push_back(mr.value());
  return Status::Ok();
}

// The engine peer for a remote group address and traffic class: one per remote group and class,
// shared by every comm of that class.
Result<PeerId> peer_for(Device* d, std::span<const uint8_t> address, int traffic_class = -1) {
  std::string key(reinterpret_cast<const char*>(address.data()), address.size());
  if (traffic_class >= 0) key += "/tc" + std::to_string(traffic_class);
  auto it = d->peers.find(key);
  if (it != d->peers.end() && !d->engine->peer_dead(d->group, it->second)) return it->second;
  ConnectOptions options;
  options.traffic_class = traffic_class;
  auto peer = d->engine->connect(d->group, address, options);
  if (!peer.ok()) return peer.status();
  d->peers[key] = peer.value();
  return peer.value();
}

// Deletes a pending connect and its not-yet-returned comm. Call with d->mu held.
void drop_pending(Device* d, PendingConnect* pc) {
  {
    Inbox& ib = inbox();
    std::lock_guard<std::mutex> lock(ib.mu);
    ib.pending.erase(pc->token);
  }
  d->pending_connects.erase(pc);
  if (pc->comm) retire_comm(d, pc->comm);
  delete pc;
}

}  // namespace

Inbox& inbox() {
  static Inbox* i = new Inbox;  // never destroyed: handlers may run during unload
  return *i;
}

void pair_comm(CommBase* c) {
  Inbox& ib = inbox();
  std::lock_guard<std::mutex> lock(ib.mu);
  ib.pairs[c->is_send ? 1 : 0][c->token] = c;
  c->paired = true;
}

void unpair_comm(CommBase* c) {
  if (c->token == 0) return;
  Inbox& ib = inbox();
  std::lock_guard<std::mutex> lock(ib.mu);
  auto& m = ib.pairs[c->is_send ? 1 : 0];
  auto it = m.find(c->token);
  if (it != m.end() && it->second == c) m.erase(it);
}

Status send_notice(CommBase* c, NoticeWhat what, bool clean, uint64_t count) {
  uint8_t buf[kNoticeBytes];
  encode_notice(NoticeMsg{c->token, !c->is_send, what, clean, count}, buf);
  return send_ctrl(c->dev, c->peer, buf, kNoticeBytes);
}

Status send_ack(Device* d, PeerId peer, uint64_t token, bool to_send) {
  // PONTE_FAULT_BUSY_ACKS (tests): the first N ACKs of the process are refused as if the 64
  // control buffers were in flight, which a deregMr from several threads at once can cause.
  static std::atomic<uint32_t> busy_left{global_config().fault_busy_acks};
  uint32_t left = busy_left.load(std::memory_order_relaxed);
  while (left > 0 && !busy_left.compare_exchange_weak(left, left - 1, std::memory_order_relaxed)) {
  }
  if (left > 0) return Status(Code::kAgain, "no control buffer free on device %d (PONTE_FAULT_BUSY_ACKS)", d->index);
  uint8_t buf[kNoticeBytes];
  encode_notice(NoticeMsg{token, to_send, NoticeWhat::kAck, false, 0}, buf);
  return send_ctrl(d, peer, buf, kNoticeBytes);
}

void break_comm(CommBase* c, Code code) {
  uint8_t none = 0;
  c->broken.compare_exchange_strong(none, static_cast<uint8_t>(code), std::memory_order_acq_rel);
  c->failed_any.store(true, std::memory_order_relaxed);
  if (!c->paired || c->broken_told.exchange(true)) return;
  Status st = send_notice(c, NoticeWhat::kBroken);
  if (st.code() == Code::kAgain) c->broken_told.store(false);  // no control buffer: next call
}

// Sends a control message (copied into a registered buffer) to peer. kAgain: no buffer free.
Status send_ctrl(Device* d, PeerId peer, const uint8_t* msg, size_t len, uint64_t connect_token) {
  uint64_t mask = d->ctrl_free.load(std::memory_order_acquire);
  int slot = -1;
  while (mask != 0) {
    const int i = std::countr_zero(mask);
    if (d->ctrl_free.compare_exchange_weak(mask, mask & ~(1ull << i), std::memory_order_acq_rel)) {
      slot = i;
      break;
    }
  }
  if (slot < 0) return Status(Code::kAgain, "no control buffer free on device %d", d->index);
  std::memcpy(d->ctrl_buf.ptr + slot * kMaxMsgSize, msg, len);
  d->ctrl_slots[slot].connect_token.store(connect_token, std::memory_order_release);
  LocalSlice src{&d->ctrl_mr, static_cast<size_t>(slot) * kMaxMsgSize, len};
  Status st = d->engine->send(d->group, peer, src, Notify{&ctrl_done, &d->ctrl_slots[slot]});
  if (!st.ok()) {
    d->ctrl_slots[slot].connect_token.store(0, std::memory_order_release);
    d->ctrl_free.fetch_or(1ull << slot, std::memory_order_acq_rel);
  }
  return st;
}

void reject(Device* d, PeerId to, uint64_t token, RejectReason why) {
  uint8_t buf[kMaxMsgSize];
  const size_t len = encode_reject(RejectMsg{token, why}, buf);
  Status st = send_ctrl(d, to, buf, len);
  if (!st.ok()) PONTE_NET_WARN("device %d: could not send REJECT: %s", d->index, st.message());
}

// ---- the message handler (engine worker thread) -------------------------------------------------

void on_message(void* arg, PeerId from, std::span<const uint8_t> data) {
  auto* d = static_cast<Device*>(arg);
  try {
    auto kind = peek_kind(data);
    if (!kind.ok()) {
      PONTE_NET_WARN("device %d: dropped a message from peer %u: %s", d->index, from,
                     kind.status().message());
      return;
    }
    switch (kind.value()) {
      case MsgKind::kConnect: {
        auto m = decode_connect(data);
        if (!m.ok()) {
          PONTE_NET_WARN("device %d: bad CONNECT from peer %u: %s", d->index, from,
                         m.status().message());
          return;
        }
        bool queued = false;
        Device* again_dev = nullptr;  // a repeat of an accepted CONNECT: its ACCEPT goes again
        PeerId again_to = 0;
        uint8_t again_msg[kMaxMsgSize];
        size_t again_len = 0;
        {
          Inbox& ib = inbox();
          std::lock_guard<std::mutex> lock(ib.mu);
          auto acc = ib.pairs[0].find(m->token);
          auto it = ib.listeners.find(m->listen_id);
          if (acc != ib.pairs[0].end()) {
            auto* rc = static_cast<RecvComm*>(acc->second);
            again_dev = rc->dev;
            again_to = rc->peer;
            again_len = rc->accept_len;
            std::memcpy(again_msg, rc->accept_msg, again_len);
            queued = true;
          } else if (it != ib.listeners.end() && it->second->nonce == m->listen_nonce) {
            // A repeat while the first waits in the queue (or is being accepted) is dropped.
            if (it->second->seen.insert(m->token).second)
              it->second->queue.push_back(Incoming{d, from, std::move(m).value()});
            queued = true;
          }
        }
        if (again_dev && again_len > 0) {
          Status st = send_ctrl(again_dev, again_to, again_msg, again_len);
          if (!st.ok()) PONTE_NET_INFO("device %d: could not send an ACCEPT again: %s", again_dev->index, st.message());
        }
        if (!queued) reject(d, from, m->token, RejectReason::kNoListener);
        return;
      }
      case MsgKind::kAccept: {
        auto m = decode_accept(data);
        if (!m.ok()) {
          PONTE_NET_WARN("device %d: bad ACCEPT from peer %u: %s", d->index, from,
                         m.status().message());
          return;
        }
        Inbox& ib = inbox();
        std::lock_guard<std::mutex> lock(ib.mu);
        auto it = ib.pending.find(m->token);
        // The answer must come to the connecting device's own engine. A repeated ACCEPT may come
        // while connect() hands the accepted comm over (comm null, under this lock): state first.
        if (it != ib.pending.end() && it->second->state != ConnectState::kRejected &&
            it->second->state != ConnectState::kAccepted && it->second->comm &&
            it->second->comm->dev == d) {
          PendingConnect* pc = it->second;
          pc->accept = m.value();
          pc->accept_from = from;
          pc->state = ConnectState::kAccepted;
          // Paired from now on: the other end may already post, break or close. (The comm's
          // peer and remote fields are the connecting thread's to fill in, in connect().)
          SendComm* c = pc->comm;
          c->token = pc->token;
          ib.pairs[1][c->token] = c;
          c->paired = true;
        }
        return;
      }
      case MsgKind::kNotice: {
        auto m = decode_notice(data);
        if (!m.ok()) {
          PONTE_NET_WARN("device %d: bad NOTICE from peer %u: %s", d->index, from, m.status().message());
          return;
        }
        on_notice(d, from, m.value());
        return;
      }
      case MsgKind::kReject: {
        auto m = decode_reject(data);
        if (!m.ok()) return;
        Inbox& ib = inbox();
        std::lock_guard<std::mutex> lock(ib.mu);
        auto it = ib.pending.find(m->token);
        if (it != ib.pending.end() && it->second->state != ConnectState::kAccepted) {
          it->second->reason = m->reason;
          it->second->state = ConnectState::kRejected;
        }
        return;
      }
    }
  } catch (...) {
    PONTE_NET_WARN("device %d: exception while handling a message from peer %u", d->index, from);
  }
}

// ---- listen / connect / accept ----------------------------------------------------------------

Status listen(int dev, void* handle, void** listen_comm) {
  if (!handle || !listen_comm) return bad("listen: NULL argument");
  *listen_comm = nullptr;
  PONTE_ASSIGN_OR_RETURN(Device * d, device_at(dev));
  std::lock_guard<std::mutex> lock(d->mu);
  PONTE_RETURN_IF_ERROR(ensure_engine(d));
  reap_graveyard(d);
  std::vector<uint8_t> address = d->engine->address(d->group);
  bool bootstrap = false;
  if (address.size() > kHandleMaxAddress) {
    // Too long for NCCL's handle: hand out the address of the first NIC's own device (a one-NIC
    // group of this process) instead; connections are set up through it and then answered from
    // this device's group (see wire.h).
    const int first = d->vprops.devs[0];
    if (d->vprops.ndevs < 2 || first == d->index)
      return Status(Code::kInvalidArgument,
                    "listen: device %d's engine address is %zu bytes, more than the %zu a handle "
                    "holds",
                    d->index, address.size(), kHandleMaxAddress);
    PONTE_ASSIGN_OR_RETURN(Device * boot, device_at(first));
    std::lock_guard<std::mutex> block(boot->mu);  // lock order: virtual device, then physical
    PONTE_RETURN_IF_ERROR(ensure_engine(boot));
    address = boot->engine->address(boot->group);
    bootstrap = true;
  }
  auto l = std::make_unique<ListenComm>();
  l->dev = d;
  l->nonce = random_u64();
  {
    Inbox& ib = inbox();
    std::lock_guard<std::mutex> ilock(ib.mu);
    l->id = ib.next_listen_id++;
    if (ib.next_listen_id == 0) ib.next_listen_id = 1;
  }
  ListenHandle h{l->id, l->nonce, bootstrap, address};
  PONTE_RETURN_IF_ERROR(encode_handle(h, static_cast<uint8_t*>(handle)));
  {
    Inbox& ib = inbox();
    std::lock_guard<std::mutex> ilock(ib.mu);
    ib.listeners[l->id] = l.get();
  }
  d->listen_comms.insert(l.get());
  *listen_comm = l.release();
  return Status::Ok();
}

namespace {

// One step of connect (see connect below), under the device's lock.
Status connect_step(int dev, void* handle, void** send_comm, int traffic_class) {
  if (traffic_class < -1 || traffic_class > 255)
    return Status(Code::kInvalidArgument, "connect: traffic class %d is not 0..255", traffic_class);
  if (!handle || !send_comm) return bad("connect: NULL argument");
  *send_comm = nullptr;
  auto* hb = static_cast<uint8_t*>(handle);
  PONTE_ASSIGN_OR_RETURN(Device * d, device_at(dev));
  std::lock_guard<std::mutex> lock(d->mu);
  PONTE_RETURN_IF_ERROR(ensure_engine(d));
  reap_graveyard(d);
  Engine& e = *d->engine;
  const uint64_t token = handle_stage(hb);

  if (token == 0) {  // first call with this handle: start connecting
    PONTE_ASSIGN_OR_RETURN(ListenHandle h, decode_handle(hb));
    PONTE_ASSIGN_OR_RETURN(PeerId peer, peer_for(d, h.address, traffic_class));
    PONTE_ASSIGN_OR_RETURN(uint32_t id, alloc_comm_id(d));
    auto* c = new SendComm;
    c->magic = kMagicSend;
    c->is_send = true;
    c->dev = d;
    c->peer = peer;
    c->comm_id = id;
    d->comms.insert(c);
    auto pc = std::make_unique<PendingConnect>();
    pc->comm = c;
    Status st = register_own(d, c, c->fifo);
    if (st.ok()) st = register_own(d, c, c->outbox);
    if (!st.ok()) {
      retire_comm(d, c);
      return st;
    }
    for (int i = 0; i < kSendRequests; ++i) {
      c->reqs[i].type = ReqType::kSend;
      c->reqs[i].comm = c;
      c->reqs[i].index = i;
      c->free_list[i] = kSendRequests - 1 - i;
    }
    c->free_count = kSendRequests;
    for (int& u : c->inline_user) u = -1;
    pc->token = random_u64();
    ConnectMsg m;
    m.listen_id = h.listen_id;
    m.listen_nonce = h.nonce;
    m.token = pc->token;
    m.sender_comm_id = id;
    m.fifo = c->mrs[0].remote();
    m.traffic_class = traffic_class;  // through a bootstrap handle, the listener's data peer takes it
    pc->bootstrap = h.bootstrap;
    if (h.bootstrap) m.reply_address = e.address(d->group);  // the listener connects back here
    auto len = encode_connect(m, pc->msg);
    if (!len.ok()) {
      retire_comm(d, c);
      return len.status();
    }
    pc->msg_len = len.value();
    {
      Inbox& ib = inbox();
      std::lock_guard<std::mutex> ilock(ib.mu);
      ib.pending[pc->token] = pc.get();
    }
    d->pending_connects.insert(pc.get());
    set_handle_stage(hb, pc->token);
    pc.release();
  }

  PendingConnect* pc = nullptr;
  ConnectState state;
  {
    Inbox& ib = inbox();
    std::lock_guard<std::mutex> ilock(ib.mu);
    auto it = ib.pending.find(handle_stage(hb));
    if (it == ib.pending.end() || !it->second->comm || it->second->comm->dev != d)
      return bad("connect: the handle belongs to a connection that already completed or failed");
    pc = it->second;
    state = pc->state;
  }
  SendComm* c = pc->comm;
  const auto now = Clock::now();
  if (state == ConnectState::kWaiting && now >= pc->resend_at) {
    // No answer yet: the CONNECT (or its ACCEPT) may have been lost in a connection rebuild.
    // The listener drops repeats and answers an accepted one again.
    std::lock_guard<std::mutex> ilock(inbox().mu);
    if (pc->state == ConnectState::kWaiting) pc->state = ConnectState::kSending;
    state = pc->state;
  }
  if (state == ConnectState::kSending) {
    Status st = send_ctrl(d, c->peer, pc->msg, pc->msg_len, pc->token);
    if (st.ok()) {
      pc->resend_at = now + std::chrono::milliseconds(pc->resend_ms);
      pc->resend_ms = std::min(pc->resend_ms * 2, kConnectResendMaxMs);
      std::lock_guard<std::mutex> ilock(inbox().mu);
      if (pc->state == ConnectState::kSending) pc->state = ConnectState::kWaiting;
      state = pc->state;
    } else if (st.code() != Code::kAgain) {
      drop_pending(d, pc);
      return st;
    }
  }
  if (state == ConnectState::kRejected) {
    const auto why = pc->reason;
    drop_pending(d, pc);
    return Status(Code::kInvalidArgument,
                  "connect: the listener refused (%s)",
                  why == RejectReason::kNoListener ? "no such listener: closed or a stale handle"
                  : why == RejectReason::kClosed   ? "listener closed"
                                                   : "no resources");
  }
  if (state == ConnectState::kAccepted) {
    // Through a bootstrap group, the listener answered from its own group: that peer carries the
    // data; the bootstrap peer only carried the CONNECT.
    if (pc->bootstrap) c->peer = pc->accept_from;
    c->remote_comm_id = pc->accept.receiver_comm_id;
    c->records = pc->accept.records;
    {
      // The worker's ACCEPT handler reads pc->comm under the inbox lock (a repeated ACCEPT).
      std::lock_guard<std::mutex> ilock(inbox().mu);
      pc->comm = nullptr;
    }
    drop_pending(d, pc);
    *send_comm = c;
    return Status::Ok();
  }
  if (e.peer_dead(d->group, c->peer)) {
    drop_pending(d, pc);
    return Status(Code::kPeerDead, "connect: the listening peer is dead or unreachable");
  }
  // A live listener that has not accepted yet is no error (NCCL accepts when it gets there); an
  // unreachable or dead one is, once the engine says so (its handshake has PONTE_TIMEOUT_MS).
  return Status::Ok();  // not yet: NCCL calls again
}

// One step of accept (see accept below), under the device's lock.
Status accept_step(void* listen_comm, void** recv_comm) {
  auto* l = static_cast<ListenComm*>(listen_comm);
  if (tag_at(l) != kMagicListen || !recv_comm) return bad("accept: not a listen comm");
  *recv_comm = nullptr;
  Device* d = l->dev;
  std::lock_guard<std::mutex> lock(d->mu);
  reap_graveyard(d);

  if (l->accepting) {  // the ACCEPT message of an earlier call still has to go out
    Status st = send_ctrl(d, l->accepting->peer, l->accept_msg, l->accept_len);
    if (st.code() == Code::kAgain) return Status::Ok();
    RecvComm* c = l->accepting;
    l->accepting = nullptr;
    if (!st.ok()) {
      retire_comm(d, c);
      return st;
    }
    *recv_comm = c;
    return Status::Ok();
  }

  Incoming in;
  {
    std::lock_guard<std::mutex> ilock(inbox().mu);
    if (l->queue.empty()) return Status::Ok();
    in = std::move(l->queue.front());
    l->queue.pop_front();
  }
  // The peer data moves with: the sender itself when its CONNECT came to this device's engine
  // (its hello gave that peer the sender's traffic class); through a bootstrap handle, a
  // connection from this device to the address the sender gave, in the class the sender asked for
  // (the sender's data peer is the one this connection makes there: it takes the class too).
  PeerId peer = in.from;
  if (!in.msg.reply_address.empty()) {
    if (in.msg.traffic_class >= 0)
      PONTE_NET_INFO("accept: a CONNECT through a bootstrap group: connecting back to the sender's device in "
                     "traffic class %d", in.msg.traffic_class);
    else
      PONTE_NET_INFO("accept: a CONNECT through a bootstrap group: connecting back to the sender's device");
    auto p = peer_for(d, in.msg.reply_address, in.msg.traffic_class);
    if (!p.ok()) {
      reject(in.via, in.from, in.msg.token, RejectReason::kNoResources);
      return p.status();
    }
    peer = p.value();
  } else if (in.via != d) {
    reject(in.via, in.from, in.msg.token, RejectReason::kNoListener);
    return bad("accept: a CONNECT without a reply address came through another device");
  }
  auto id = alloc_comm_id(d);
  if (!id.ok()) {
    reject(in.via, in.from, in.msg.token, RejectReason::kNoResources);
    return id.status();
  }
  auto* c = new RecvComm;
  c->magic = kMagicRecv;
  c->dev = d;
  c->peer = peer;
  c->comm_id = id.value();
  c->remote_comm_id = in.msg.sender_comm_id;
  c->fifo = in.msg.fifo;
  d->comms.insert(c);
  for (int i = 0; i < kMaxRequests; ++i) {
    c->reqs[i].type = ReqType::kRecv;
    c->reqs[i].comm = c;
    c->flushes[i].type = ReqType::kFlush;
    c->flushes[i].comm = c;
  }
  Status st = register_own(d, c, c->records);
  if (st.ok()) st = register_own(d, c, c->cts);
  if (st.ok()) st = register_own(d, c, c->flush_buf);
  if (!st.ok()) {
    retire_comm(d, c);
    reject(in.via, in.from, in.msg.token, RejectReason::kNoResources);
    return st;
  }
  AcceptMsg m;
  m.token = in.msg.token;
  m.receiver_comm_id = id.value();
  m.records = c->mrs[0].remote();
  auto len = encode_accept(m, l->accept_msg);
  if (!len.ok()) {
    retire_comm(d, c);
    return len.status();
  }
  l->accept_len = len.value();
  std::memcpy(c->accept_msg, l->accept_msg, l->accept_len);
  c->accept_len = l->accept_len;
  c->token = in.msg.token;
  pair_comm(c);  // a repeated CONNECT finds it and gets the ACCEPT again
  st = send_ctrl(d, c->peer, l->accept_msg, l->accept_len);
  if (st.code() == Code::kAgain) {
    l->accepting = c;
    return Status::Ok();
  }
  if (!st.ok()) {
    retire_comm(d, c);
    return st;
  }
  *recv_comm = c;
  return Status::Ok();
}

}  // namespace

// "Not yet" waits on the other end and on this engine's worker (it carries the CONNECT and
// ACCEPT): a caller that calls again at once (NCCL's proxy; aws-ofi-nccl's tests, four threads a
// rank) would take the CPU the worker needs, so "not yet" gives the CPU up once, after the
// device's lock is released. Measured on udp;ofi_rxd, aws-ofi-nccl's inflight_close (it connects
// 40 times from 4 threads a rank): see bench/README.md.
Status connect(int dev, void* handle, void** send_comm, int traffic_class) {
  Status st = connect_step(dev, handle, send_comm, traffic_class);
  if (st.ok() && *send_comm == nullptr) std::this_thread::yield();
  return st;
}

Status accept(void* listen_comm, void** recv_comm) {
  Status st = accept_step(listen_comm, recv_comm);
  if (st.ok() && recv_comm && *recv_comm == nullptr) std::this_thread::yield();
  return st;
}

}  // namespace ponte::plugin
