// The verbs NIC: queue sizing, peers and their QPs, posting and polling.
//
// Every send-side work request is signaled, so each one yields exactly one completion, including
// when its QP fails (the provider flushes the rest with IBV_WC_WR_FLUSH_ERR). Selective signaling
// is not used because the Nic interface has no "end of batch" point: an unsignaled request at the
// tail of a burst would never be reported to the engine. The completion path below still accepts
// a completion that covers earlier, unsignaled requests of its QP, in posting order.
#include "core/verbs/verbs_nic.h"

#include <arpa/inet.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <random>

#include "core/config.h"
#include "core/log.h"

namespace ponte::verbs {

namespace {

uint8_t clamp_u8(int v, int lo, int hi) { return static_cast<uint8_t>(std::clamp(v, lo, hi)); }

}  // namespace

Result<std::unique_ptr<VerbsNic>> VerbsNic::open(const VerbsApi& api, const VerbsPort& port,
                                                 const Config& cfg) {
  std::unique_ptr<VerbsNic> n(new VerbsNic(api, port));
  n->info_ = port.info;
  PONTE_ASSIGN_OR_RETURN(n->device_, DeviceContext::open(api, port.device, port.info.name));

  // Queue sizes. The CQ must hold every completion that can be pending at once: one per send WR
  // in flight plus one per posted receive, so sends are capped at (CQ entries - SRQ entries).
  // The SRQ holds exactly the engine's receive buffers (PONTE_RECV_COUNT), so the engine keeps it
  // full: every write-with-immediate in flight toward this NIC consumes one of them until the
  // worker's next poll gives it back, and a slot the engine cannot fill is depth an incast lacks.
  NicLimits& l = n->limits_;
  l.srq_depth = std::clamp(static_cast<int>(cfg.recv_buf_count), 16, 65536);
  if (port.max_srq_wr > 0) l.srq_depth = std::min(l.srq_depth, port.max_srq_wr - 1);
  int want_sends = static_cast<int>(std::clamp<uint32_t>(cfg.max_inflight, 1024, 1u << 20));
  int want_cq = want_sends + l.srq_depth;
  if (port.max_cqe > 0) want_cq = std::min(want_cq, port.max_cqe);
  if (want_cq <= l.srq_depth + 16) {
    return Status(Code::kResource, "%s: CQ limit %d too small for %d receives", port.info.name.c_str(),
                  port.max_cqe, l.srq_depth);
  }
  PONTE_ASSIGN_OR_RETURN(n->cq_, VerbsCq::create(api, n->device_->context(), want_cq, port.info.name));
  l.cq_depth = std::min(want_cq, n->cq_->depth());
  l.nic_sends = static_cast<uint32_t>(l.cq_depth - l.srq_depth);
  l.sq_depth = std::min<uint32_t>(1024, l.nic_sends);
  if (port.max_qp_wr > 0) l.sq_depth = std::min<uint32_t>(l.sq_depth, static_cast<uint32_t>(port.max_qp_wr));
  PONTE_ASSIGN_OR_RETURN(n->srq_, VerbsSrq::create(api, n->device_->pd(), l.srq_depth, port.info.name));
  n->memory_ = std::make_unique<VerbsMemory>(api, n->device_->pd());

  QpParams& q = n->qp_params_;
  q.port = port.port;
  q.gid_index = port.gid_index;
  q.link_layer = port.link_layer;
  q.lid = port.lid;
  q.active_mtu = port.active_mtu;
  q.gid = port.gid;
  q.sq_depth = l.sq_depth;
  q.max_inline = static_cast<uint32_t>(port.info.max_inline);
  q.max_rd_atomic = clamp_u8(port.max_qp_rd_atom, 1, 16);
  q.traffic_class = clamp_u8(cfg.ib_traffic_class, 0, 255);
  q.service_level = clamp_u8(cfg.ib_service_level, 0, 15);
  q.timeout = clamp_u8(cfg.ib_timeout, 0, 31);
  q.retry_count = clamp_u8(cfg.ib_retry_count, 0, 7);
  n->qps_per_connection_ = static_cast<uint32_t>(
      std::clamp<int>(cfg.ib_qps_per_connection, 1, static_cast<int>(ConnectBlob::kMaxQps)));

  n->pending_.resize(l.nic_sends + 2 * static_cast<size_t>(l.srq_depth));

  VerbsAddress a;
  a.link_layer = port.link_layer;
  a.port = port.port;
  a.lid = port.lid;
  a.mtu = port.active_mtu;
  a.gid_index = static_cast<uint8_t>(port.gid_index);
  memcpy(a.gid.data(), port.gid.raw, 16);
  auto bytes = a.encode();
  n->address_.assign(bytes.begin(), bytes.end());

  std::random_device rd;
  n->psn_seed_ = rd() | 1;
  return n;
}

VerbsNic::~VerbsNic() {
  peers_.clear();  // QPs before the SRQ, CQ and PD they use (members die in reverse order)
}

// ---------------------------------------------------------------------------------------- peers

Result<NicPeer> VerbsNic::add_peer(std::span<const uint8_t> peer_address) {
  PONTE_ASSIGN_OR_RETURN(VerbsAddress a, VerbsAddress::decode(peer_address));
  if (a.link_layer != port_.link_layer) {
    return Status(Code::kInvalidArgument, "peer NIC is %s, %s is %s",
                  a.link_layer == LinkLayer::kEthernet ? "RoCE" : "InfiniBand", info_.name.c_str(),
                  port_.link_layer == LinkLayer::kEthernet ? "RoCE" : "InfiniBand");
  }
  if (peers_.size() >= wrid::kMaxPeers) {
    return Status(Code::kResource, "%s: too many peers (%zu)", info_.name.c_str(), peers_.size());
  }
  auto p = std::make_unique<Peer>();
  p->address = a;
  peers_.push_back(std::move(p));
  return static_cast<NicPeer>(peers_.size() - 1);
}

void VerbsNic::retire(Peer& p) {
  flush_posts();  // nothing staged stays behind for a QP leaving service
  for (auto& q : p.qps) {
    q->force_error();  // the provider flushes what is still queued; poll() reports it
    if (q->outstanding() > 0) p.retired.push_back(std::move(q));
  }
  p.qps.clear();
  p.active = 0;
  p.failed = false;
}

void VerbsNic::reap_retired(Peer& p) {
  std::erase_if(p.retired, [](const std::unique_ptr<VerbsQp>& q) { return q->outstanding() == 0; });
}

namespace {

// The blob of a connection: what every one of its QPs shares, then their QPNs.
ConnectBlob describe(const QpParams& params, uint32_t psn, const std::vector<std::unique_ptr<VerbsQp>>& qps,
                     int traffic_class) {
  ConnectBlob b;
  b.psn = psn;
  b.lid = params.lid;
  b.mtu = params.active_mtu;
  b.link_layer = params.link_layer;
  memcpy(b.gid.data(), params.gid.raw, 16);
  b.has_traffic_class = traffic_class >= 0;
  b.traffic_class = traffic_class >= 0 ? static_cast<uint8_t>(traffic_class) : 0;
  b.qp_count = static_cast<uint8_t>(qps.size());
  for (size_t i = 0; i < qps.size(); ++i) b.qpn[i] = qps[i]->qpn();
  return b;
}

}  // namespace

Result<std::vector<uint8_t>> VerbsNic::connect_blob(NicPeer peer) {
  if (peer >= peers_.size() || peers_[peer]->removed) {
    return Status(Code::kInvalidArgument, "%s: connect_blob for unknown peer %u", info_.name.c_str(), peer);
  }
  Peer& p = *peers_[peer];
  reap_retired(p);
  // A connection waiting for its peer's blob, or one still connected, is described again unchanged
  // (the engine may send its handshake on two sockets at once). A failed one is replaced, all of
  // its QPs: the peer rebuilds its side of every one of them in the same round.
  bool reuse = !p.qps.empty() && !p.failed;
  for (uint32_t i = 0; reuse && i < p.active; ++i) reuse = p.qps[i]->still_connected();
  if (!reuse) {
    retire(p);
    psn_seed_ ^= psn_seed_ << 13;
    psn_seed_ ^= psn_seed_ >> 17;
    psn_seed_ ^= psn_seed_ << 5;
    p.gen_base = p.next_generation;
    p.next_generation = static_cast<uint16_t>(p.next_generation + qps_per_connection_);
    for (uint32_t i = 0; i < qps_per_connection_; ++i) {
      auto q = VerbsQp::create(api_, device_->pd(), cq_->cq(), srq_->srq(), qp_params_,
                               static_cast<uint16_t>(p.gen_base + i), psn_seed_);
      if (!q.ok()) {
        retire(p);
        return q.status();
      }
      p.qps.push_back(std::move(q).value());
    }
  }
  return describe(qp_params_, p.qps[0]->psn(), p.qps, p.traffic_class).encode();
}

Status VerbsNic::complete_connect(NicPeer peer, std::span<const uint8_t> peer_blob) {
  PONTE_ASSIGN_OR_RETURN(ConnectBlob b, ConnectBlob::decode(peer_blob));
  if (peer >= peers_.size() || peers_[peer]->removed) {
    return Status(Code::kInvalidArgument, "%s: complete_connect for unknown peer %u", info_.name.c_str(), peer);
  }
  Peer& p = *peers_[peer];
  if (p.qps.empty()) {
    return Status(Code::kInvalidArgument, "%s: complete_connect(peer %u) before connect_blob",
                  info_.name.c_str(), peer);
  }
  if (p.active > 0 && !p.failed && b == p.remote) return Status::Ok();  // the same handshake seen twice
  if (p.active > 0 || p.failed) {
    return Status(Code::kInvalidArgument,
                  "%s: peer %u's connection is already %s; call connect_blob to start a new one",
                  info_.name.c_str(), peer, p.failed ? "failed" : "connected");
  }
  if (b.link_layer != port_.link_layer) {
    return Status(Code::kInvalidArgument, "%s: peer %u's blob is for another link layer",
                  info_.name.c_str(), peer);
  }
  // This side's own class for the peer, else the one the peer's side asked for (it opened the
  // connection with a class of its own), else PONTE_IB_TC.
  const uint8_t tc = p.traffic_class >= 0 ? static_cast<uint8_t>(p.traffic_class)
                     : b.has_traffic_class ? b.traffic_class
                                           : qp_params_.traffic_class;
  const uint32_t n = std::min<uint32_t>(static_cast<uint32_t>(p.qps.size()), b.qp_count);
  for (uint32_t i = 0; i < n; ++i) {
    Status st = p.qps[i]->connect(b, i, tc);
    if (!st.ok()) {
      p.failed = true;
      return st;
    }
  }
  p.active = n;
  p.next = 0;
  p.remote = b;
  return Status::Ok();
}

void VerbsNic::remove_peer(NicPeer peer) {
  if (peer >= peers_.size() || peers_[peer]->removed) return;
  Peer& p = *peers_[peer];
  retire(p);
  reap_retired(p);
  p.removed = true;
}

Status VerbsNic::set_traffic_class(NicPeer peer, uint8_t traffic_class) {
  if (peer >= peers_.size() || peers_[peer]->removed) {
    return Status(Code::kInvalidArgument, "%s: set_traffic_class for unknown peer %u", info_.name.c_str(), peer);
  }
  Peer& p = *peers_[peer];
  if (!p.qps.empty()) {
    return Status(Code::kInvalidArgument, "%s: peer %u's traffic class is set before its connect_blob",
                  info_.name.c_str(), peer);
  }
  p.traffic_class = traffic_class;
  return Status::Ok();
}

uint32_t VerbsNic::connected_qps(NicPeer peer) const {
  return peer < peers_.size() ? peers_[peer]->active : 0;
}

std::vector<uint32_t> VerbsNic::posts_per_qp(NicPeer peer) const {
  std::vector<uint32_t> out;
  if (peer >= peers_.size()) return out;
  for (const auto& q : peers_[peer]->qps) out.push_back(q->tail());
  return out;
}

Status VerbsNic::query_qp(NicPeer peer, size_t index, int attr_mask, ibv_qp_attr* attr) const {
  if (peer >= peers_.size() || index >= peers_[peer]->qps.size()) {
    return Status(Code::kInvalidArgument, "%s: no QP %zu toward peer %u", info_.name.c_str(), index, peer);
  }
  ibv_qp_init_attr init{};
  int rc = api_.query_qp(peers_[peer]->qps[index]->qp(), attr, attr_mask, &init);
  if (rc != 0) return Status(Code::kTransport, "ibv_query_qp failed: %s", strerror(rc));
  return Status::Ok();
}

// --------------------------------------------------------------------------------------- memory

Result<NicMr> VerbsNic::register_memory(const MemoryDesc& mem) { return memory_->register_memory(mem); }

void VerbsNic::deregister(const NicMr& mr) { memory_->deregister(mr); }

// -------------------------------------------------------------------------------------- posting

Status VerbsNic::sendable(NicPeer peer, size_t len, bool spread, VerbsQp** qp) {
  if (peer >= peers_.size() || peers_[peer]->removed) {
    return Status(Code::kInvalidArgument, "%s: unknown peer %u", info_.name.c_str(), peer);
  }
  Peer& p = *peers_[peer];
  if (p.failed) {
    ibv_wc_status why = IBV_WC_GENERAL_ERR;
    for (const auto& q : p.qps)
      if (q->state() == VerbsQp::State::kError) why = q->first_error();
    return Status(Code::kTransport, "%s: connection to peer %u failed (%s); connect_blob rebuilds it",
                  info_.name.c_str(), peer, api_.status_str(why));
  }
  if (p.active == 0) return Status(Code::kAgain, "peer not connected yet");
  if (len > info_.max_msg_size) {
    return Status(Code::kInvalidArgument, "%s: %zu bytes exceed max_msg_size %zu",
                  info_.name.c_str(), len, info_.max_msg_size);
  }
  if (nic_sends_ >= limits_.nic_sends) return Status(Code::kAgain, "send queue full");
  if (!spread) {
    if (p.qps[0]->full()) return Status(Code::kAgain, "send queue full");
    *qp = p.qps[0].get();
    return Status::Ok();
  }
  for (uint32_t tries = 0; tries < p.active; ++tries) {
    VerbsQp* q = p.qps[p.next].get();
    p.next = p.next + 1 == p.active ? 0 : p.next + 1;
    if (!q->full()) {
      *qp = q;
      return Status::Ok();
    }
  }
  return Status(Code::kAgain, "send queues full");
}

Status VerbsNic::post(NicPeer peer, VerbsQp* qp, ibv_send_wr* wr, uint64_t ctx) {
  if (staged_count_ == kMaxStagedSends) {
    flush_posts();
    if (peers_[peer]->failed) return sendable(peer, 0, false, &qp);  // the flush failed it: why
  }
  StagedSend& s = staged_[static_cast<size_t>(staged_count_++)];
  s.wr = *wr;
  s.wr.next = nullptr;
  if (wr->num_sge > 0) {
    s.sge = *wr->sg_list;
    s.wr.sg_list = &s.sge;
  }
  s.wr.wr_id = wrid::send(peer, qp->generation(), qp->tail());
  s.wr.send_flags &= ~static_cast<unsigned>(IBV_SEND_SIGNALED);  // flush_posts signals
  s.qp = qp;
  s.peer = peer;
  s.linked = false;
  qp->push(ctx);
  ++nic_sends_;
  return Status::Ok();
}

void VerbsNic::flush_posts() {
  for (int i = 0; i < staged_count_; ++i) {
    StagedSend& head = staged_[static_cast<size_t>(i)];
    if (head.linked) continue;
    // This QP's staged requests, in order, linked into one chain.
    ibv_send_wr* last = &head.wr;
    int n = 1;
    for (int j = i + 1; j < staged_count_; ++j) {
      StagedSend& s = staged_[static_cast<size_t>(j)];
      if (s.linked || s.qp != head.qp) continue;
      if (n % kSignalEvery == 0) last->send_flags |= IBV_SEND_SIGNALED;
      last->next = &s.wr;
      last = &s.wr;
      s.linked = true;
      ++n;
    }
    last->send_flags |= IBV_SEND_SIGNALED;  // every request of the chain is reported by now
    ibv_send_wr* bad = nullptr;
    int rc = ibv_post_send(head.qp->qp(), &head.wr, &bad);
    ++send_doorbells_;
    if (rc != 0) refused_chain(head.peer, head.qp, bad != nullptr ? bad : &head.wr, rc);
  }
  staged_count_ = 0;
}

void VerbsNic::refused_chain(NicPeer peer, VerbsQp* qp, ibv_send_wr* bad, int rc) {
  PONTE_LOG_WARN("%s: ibv_post_send to peer %u refused a work request: %s; the connection is rebuilt",
                 info_.name.c_str(), peer, strerror(rc));
  // The refused requests are the QP's last ones (a chain holds all that were staged for it):
  // taken back from the ring's end, reported in posting order.
  int m = 0;
  for (ibv_send_wr* w = bad; w != nullptr; w = w->next) ++m;
  uint64_t ctxs[kMaxStagedSends];
  for (int k = m - 1; k >= 0; --k) ctxs[k] = qp->take_last();
  for (int k = 0; k < m; ++k) {
    Completion c;
    c.ctx = ctxs[k];
    c.error = Code::kTransport;
    --nic_sends_;
    push_pending(c);
  }
  qp->force_error();  // flushes what went ahead of them, signaled or not
  Peer& p = *peers_[peer];
  for (const auto& q : p.qps)
    if (q.get() == qp) p.failed = true;
}

namespace {

// Fills sge for a local buffer; inline payloads need no registration.
Status local_sge(const void* buf, size_t len, void* desc, bool inline_ok, ibv_send_wr* wr, ibv_sge* sge) {
  if (len == 0) {
    wr->sg_list = nullptr;
    wr->num_sge = 0;
    return Status::Ok();
  }
  if (inline_ok) {
    wr->send_flags |= IBV_SEND_INLINE;
    sge->lkey = desc != nullptr ? static_cast<ibv_mr*>(desc)->lkey : 0;
  } else {
    if (desc == nullptr) return Status(Code::kInvalidArgument, "no registration (desc) for %zu bytes", len);
    sge->lkey = static_cast<ibv_mr*>(desc)->lkey;
  }
  sge->addr = reinterpret_cast<uintptr_t>(buf);
  sge->length = static_cast<uint32_t>(len);
  wr->sg_list = sge;
  wr->num_sge = 1;
  return Status::Ok();
}

Status check_rkey(uint64_t rkey) {
  if (rkey > UINT32_MAX) return Status(Code::kInvalidArgument, "rkey 0x%llx is not a verbs rkey",
                                       static_cast<unsigned long long>(rkey));
  return Status::Ok();
}

}  // namespace

Status VerbsNic::post_write(const WriteWr& w) {
  VerbsQp* qp = nullptr;
  PONTE_RETURN_IF_ERROR(sendable(w.peer, w.len, true, &qp));
  PONTE_RETURN_IF_ERROR(check_rkey(w.rkey));
  ibv_sge sge{};
  ibv_send_wr wr{};
  wr.opcode = w.has_imm ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE;
  if (w.has_imm) wr.imm_data = htonl(w.imm);
  wr.wr.rdma.remote_addr = w.remote_addr;
  wr.wr.rdma.rkey = static_cast<uint32_t>(w.rkey);
  // Inline only from host memory: the provider memcpy's the payload on this CPU.
  PONTE_RETURN_IF_ERROR(local_sge(w.local, w.len, w.desc, w.inline_ok && w.len <= qp->max_inline(), &wr, &sge));
  return post(w.peer, qp, &wr, w.ctx);
}

Status VerbsNic::post_read(NicPeer peer, void* local, size_t len, void* desc, uint64_t remote_addr,
                           uint64_t rkey, uint64_t ctx) {
  VerbsQp* qp = nullptr;
  PONTE_RETURN_IF_ERROR(sendable(peer, len, true, &qp));
  PONTE_RETURN_IF_ERROR(check_rkey(rkey));
  ibv_sge sge{};
  ibv_send_wr wr{};
  wr.opcode = IBV_WR_RDMA_READ;
  wr.wr.rdma.remote_addr = remote_addr;
  wr.wr.rdma.rkey = static_cast<uint32_t>(rkey);
  PONTE_RETURN_IF_ERROR(local_sge(local, len, desc, false, &wr, &sge));
  return post(peer, qp, &wr, ctx);
}

Status VerbsNic::post_send(NicPeer peer, const void* buf, size_t len, void* desc, uint32_t imm,
                           uint64_t ctx, bool inline_ok) {
  VerbsQp* qp = nullptr;
  PONTE_RETURN_IF_ERROR(sendable(peer, len, false, &qp));  // sends stay in order on QP 0
  ibv_sge sge{};
  ibv_send_wr wr{};
  wr.opcode = IBV_WR_SEND_WITH_IMM;
  wr.imm_data = htonl(imm);
  PONTE_RETURN_IF_ERROR(local_sge(buf, len, desc, inline_ok && len <= qp->max_inline(), &wr, &sge));
  return post(peer, qp, &wr, ctx);
}

Status VerbsNic::post_recv(void* buf, size_t len, void* desc, uint64_t ctx) {
  if (len > 0 && desc == nullptr) {
    return Status(Code::kInvalidArgument, "post_recv: no registration (desc) for %zu bytes", len);
  }
  uint32_t lkey = desc != nullptr ? static_cast<ibv_mr*>(desc)->lkey : 0;
  if (srq_->batch_full()) flush_receives();
  return srq_->stage(buf, len, lkey, ctx);
}

void VerbsNic::flush_receives() {
  int rc = srq_->flush([this](uint64_t ctx) {
    Completion c;
    c.ctx = ctx;
    c.kind = CompletionKind::kRecv;
    c.error = Code::kResource;  // the buffer returns to the engine as a failed receive
    push_pending(c);
  });
  if (rc != 0) PONTE_LOG_WARN("%s: ibv_post_srq_recv failed: %s", info_.name.c_str(), strerror(rc));
}

// -------------------------------------------------------------------------------------- polling

VerbsQp* VerbsNic::find_qp(uint32_t peer, uint16_t gen) {
  if (peer >= peers_.size()) return nullptr;
  Peer& p = *peers_[peer];
  uint16_t i = static_cast<uint16_t>(gen - p.gen_base);
  if (i < p.qps.size() && p.qps[i]->generation() == gen) return p.qps[i].get();
  for (auto& q : p.retired) {
    if (q->generation() == gen) return q.get();
  }
  return nullptr;
}

void VerbsNic::push_pending(const Completion& c) {
  // Capacity covers every send in flight plus two per receive slot, so this never overflows.
  size_t cap = pending_.size();
  if (pending_count_ == cap) return;
  pending_[(pending_head_ + pending_count_) % cap] = c;
  ++pending_count_;
}

void VerbsNic::translate(const ibv_wc& wc, Completion* out, int max, int* n) {
  auto emit = [&](const Completion& c) {
    if (*n < max) {
      out[(*n)++] = c;
    } else {
      push_pending(c);
    }
  };
  if (wrid::is_recv(wc.wr_id)) {
    uint32_t slot = wrid::slot(wc.wr_id);
    if (!srq_->valid(slot)) return;
    Completion c;
    c.ctx = srq_->ctx(slot);
    c.len = wc.status == IBV_WC_SUCCESS ? wc.byte_len : 0;
    c.kind = CompletionKind::kRecv;
    if (wc.status != IBV_WC_SUCCESS) {
      c.error = Code::kTransport;
      srq_->release(slot);
      emit(c);
    } else if (wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
      // A peer's write-with-imm consumed one of the engine's receives: it goes back with the
      // others of this poll pass, in one post (flush_receives).
      Completion r;
      r.kind = CompletionKind::kRemoteWrite;
      r.imm = ntohl(wc.imm_data);
      r.len = wc.byte_len;
      emit(r);
      if (srq_->batch_full()) flush_receives();
      srq_->restage(slot);
    } else {
      c.imm = (wc.wc_flags & IBV_WC_WITH_IMM) != 0 ? ntohl(wc.imm_data) : 0;
      srq_->release(slot);
      emit(c);
    }
    return;
  }
  VerbsQp* qp = find_qp(wrid::peer(wc.wr_id), wrid::gen(wc.wr_id));
  if (qp == nullptr) return;
  uint32_t behind = (wrid::seq(wc.wr_id) - qp->head()) & wrid::kSeqMask;
  if (behind >= qp->outstanding()) return;  // not one of ours (already reported)
  ++send_completions_;
  // Earlier unsignaled requests ended before this one: well, unless the QP had failed before this
  // completion (then they were flushed; the first failure is always reported, signaled or not).
  const Code earlier = qp->state() == VerbsQp::State::kError ? Code::kTransport : Code::kOk;
  for (uint32_t i = 0; i < behind; ++i) {
    Completion c;
    c.ctx = qp->pop();
    c.error = earlier;
    --nic_sends_;
    emit(c);
  }
  Completion c;
  c.ctx = qp->pop();
  --nic_sends_;
  if (wc.status == IBV_WC_SUCCESS) {
    c.len = wc.byte_len;
  } else {
    c.error = Code::kTransport;
    qp->set_error(wc.status);
    // One QP of the connection failed: the connection is rebuilt whole (a retired QP's errors
    // are its flush, and concern a connection already replaced).
    Peer& p = *peers_[wrid::peer(wc.wr_id)];
    for (const auto& q : p.qps)
      if (q.get() == qp) p.failed = true;
  }
  emit(c);
}

int VerbsNic::poll(Completion* out, int max) {
  flush_posts();
  flush_receives();  // what the engine posted since the last pass
  int n = 0;
  while (n < max && pending_count_ > 0) {
    out[n++] = pending_[pending_head_];
    pending_head_ = (pending_head_ + 1) % pending_.size();
    --pending_count_;
  }
  if (n >= max) return n;
  constexpr int kBatch = 32;
  ibv_wc wc[kBatch];
  int got = ibv_poll_cq(cq_->cq(), std::min(max - n, kBatch), wc);
  for (int i = 0; i < got; ++i) translate(wc[i], out, max, &n);
  flush_receives();  // the receives this pass's write-with-immediates consumed, in one post
  return n;
}

}  // namespace ponte::verbs
