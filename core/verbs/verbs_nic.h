// One verbs NIC (a device port): its own context, PD, CQ and SRQ, and per peer one RC connection of
// PONTE_IB_QPS_PER_CONNECTION queue pairs, connected lazily through connect blobs the engine
// exchanges. Implements ponte::Nic.
#pragma once

#include <array>
#include <memory>
#include <vector>

#include "core/nic.h"
#include "core/verbs/verbs_cq.h"
#include "core/verbs/verbs_device.h"
#include "core/verbs/verbs_mr.h"
#include "core/verbs/verbs_qp.h"
#include "core/verbs/verbs_srq.h"

namespace ponte::verbs {

// Queue sizes of one NIC, from the config and the device limits.
struct NicLimits {
  int cq_depth = 0;         // completion queue entries
  int srq_depth = 0;        // receives the engine may keep posted
  uint32_t sq_depth = 0;    // send WRs per QP
  uint32_t nic_sends = 0;   // send WRs in flight over all QPs, so the CQ never overflows
};

// Connection protocol: the engine calls connect_blob(peer) on both sides and carries each side's
// blob to the other over its own per-peer TCP control socket (a side-socket handshake, as NCCL does:
// no RDMA CM, no daemon, no UD QP; nothing here blocks on the network), then calls complete_connect.
// Until then posts to that peer return kAgain. connect_blob on a connection that waits for its
// peer's blob or is still connected returns the same blob (a handshake may be sent twice); on a
// failed one (an error completion on any of its QPs, or a device state of ERR, as after the peer
// wrote with a bad rkey) it builds all of its QPs anew. A failed connection answers posts with
// kTransport until then, and every work request still on it comes back as an error completion
// (kTransport), never lost.
//
// Several QPs per connection (NCCL_IB_QPS_PER_CONNECTION's job): each QP is its own flow, with its
// own UDP source port on RoCE v2, so ECMP spreads them over the fabric's paths. Writes and reads go
// round-robin over the connection's QPs, one work request each (so a write's bytes still land in
// order within it, and each write-with-immediate still carries its own immediate); sends stay on
// QP 0, in order.
//
// Sends: post_write/post_read/post_send stage their work request; flush_posts() (the engine's, after
// each posting pass, and poll() first) posts each QP's staged requests as one chain with one
// ibv_post_send (one doorbell), only the chain's last request and every kSignalEvery-th signaled:
// RC completes a QP's requests in order, so one completion reports every earlier one (translate).
// A request that fails is always reported, signaled or not; after it the QP flushes the rest.
//
// Receives: post_recv stages a receive; what is staged reaches the shared receive queue with one
// ibv_post_srq_recv at the next poll() (or once VerbsSrq::kBatch are waiting), as do the receives
// that write-with-immediates consumed, which poll() gives back itself.
class VerbsNic final : public Nic {
 public:
  static Result<std::unique_ptr<VerbsNic>> open(const VerbsApi& api, const VerbsPort& port,
                                                const Config& cfg);
  ~VerbsNic() override;

  const NicInfo& info() const override { return info_; }
  std::span<const uint8_t> address() const override { return address_; }

  Result<NicPeer> add_peer(std::span<const uint8_t> peer_address) override;
  Result<std::vector<uint8_t>> connect_blob(NicPeer peer) override;
  Status complete_connect(NicPeer peer, std::span<const uint8_t> peer_blob) override;
  void remove_peer(NicPeer peer) override;
  Status set_traffic_class(NicPeer peer, uint8_t traffic_class) override;

  Result<NicMr> register_memory(const MemoryDesc& mem) override;
  void deregister(const NicMr& mr) override;

  Status post_write(const WriteWr& wr) override;
  Status post_read(NicPeer peer, void* local, size_t len, void* desc, uint64_t remote_addr,
                   uint64_t rkey, uint64_t ctx) override;
  Status post_send(NicPeer peer, const void* buf, size_t len, void* desc, uint32_t imm,
                   uint64_t ctx, bool inline_ok) override;
  Status post_recv(void* buf, size_t len, void* desc, uint64_t ctx) override;
  void flush_posts() override;
  int poll(Completion* out, int max) override;

  static constexpr int kMaxStagedSends = 32;  // staged beyond this, the stage is flushed first
  static constexpr int kSignalEvery = 16;     // in a longer chain, every 16th request is signaled

  // For tests and diagnostics.
  const NicLimits& limits() const { return limits_; }
  uint32_t sends_in_flight() const { return nic_sends_; }
  int receives_posted() const { return srq_->posted(); }
  uint64_t receive_doorbells() const { return srq_->doorbells(); }
  uint64_t send_doorbells() const { return send_doorbells_; }      // ibv_post_send calls
  uint64_t send_completions() const { return send_completions_; }  // send-queue CQEs polled
  int gid_index() const { return port_.gid_index; }
  uint32_t qps_per_connection() const { return qps_per_connection_; }
  // QPs of the peer's current connection in use (0 until complete_connect), and the work requests
  // posted to each of them so far.
  uint32_t connected_qps(NicPeer peer) const;
  std::vector<uint32_t> posts_per_qp(NicPeer peer) const;
  // ibv_query_qp on QP `index` of the peer's current connection (attr_mask as ibv_query_qp's).
  Status query_qp(NicPeer peer, size_t index, int attr_mask, ibv_qp_attr* attr) const;

 private:
  // One RC connection: its QPs (qps[i] has generation gen_base + i), created by connect_blob.
  struct Peer {
    VerbsAddress address;
    std::vector<std::unique_ptr<VerbsQp>> qps;
    uint32_t active = 0;     // QPs connected: min of both sides' counts; 0 until complete_connect
    uint32_t next = 0;       // round-robin cursor of writes and reads over the active QPs
    bool failed = false;     // one of its QPs failed: the whole connection is rebuilt
    uint16_t gen_base = 0;
    ConnectBlob remote;      // the peer's blob the QPs were connected with (valid once active)
    int traffic_class = -1;  // set_traffic_class; -1: the peer's request, else PONTE_IB_TC
    std::vector<std::unique_ptr<VerbsQp>> retired;  // in ERR, still owed completions
    uint16_t next_generation = 0;
    bool removed = false;
  };

  VerbsNic(const VerbsApi& api, const VerbsPort& port) : api_(api), port_(port) {}
  // A QP of the peer's connection that can take a send WR now (QP 0 when spread is false, else the
  // next of the active ones in turn, skipping full ones); else the reason (kAgain / kTransport).
  Status sendable(NicPeer peer, size_t len, bool spread, VerbsQp** qp);
  // Stages wr (its one sge copied) for qp; flush_posts() posts it.
  Status post(NicPeer peer, VerbsQp* qp, ibv_send_wr* wr, uint64_t ctx);
  // A chain ibv_post_send refused from `bad` on: those requests come back as failed completions,
  // and the connection fails (what was posted ahead of them may have no signaled request after it:
  // the QP's flush reports it).
  void refused_chain(NicPeer peer, VerbsQp* qp, ibv_send_wr* bad, int rc);
  void retire(Peer& p);
  void reap_retired(Peer& p);
  VerbsQp* find_qp(uint32_t peer, uint16_t gen);
  void push_pending(const Completion& c);
  // Posts the staged receives (one doorbell); those the provider refuses return to the engine as
  // failed receives (pending_).
  void flush_receives();
  // Turns one work completion into engine completions (out first, overflow to pending_).
  void translate(const ibv_wc& wc, Completion* out, int max, int* n);

  const VerbsApi& api_;
  VerbsPort port_;
  NicInfo info_;
  std::vector<uint8_t> address_;
  NicLimits limits_;
  QpParams qp_params_;
  uint32_t psn_seed_ = 0;
  uint32_t qps_per_connection_ = 1;

  std::unique_ptr<DeviceContext> device_;
  std::unique_ptr<VerbsCq> cq_;
  std::unique_ptr<VerbsSrq> srq_;
  std::unique_ptr<VerbsMemory> memory_;
  std::vector<std::unique_ptr<Peer>> peers_;

  uint32_t nic_sends_ = 0;  // send WRs posted (or staged) whose completion has not been polled yet
  // Send WRs staged since the last flush_posts(), in posting order.
  struct StagedSend {
    ibv_send_wr wr;
    ibv_sge sge;
    VerbsQp* qp;
    NicPeer peer;
    bool linked;  // taken into its QP's chain by the running flush
  };
  std::array<StagedSend, kMaxStagedSends> staged_{};
  int staged_count_ = 0;
  uint64_t send_doorbells_ = 0;
  uint64_t send_completions_ = 0;
  // Completions produced beyond what a poll() call could return; fixed capacity (see open()).
  std::vector<Completion> pending_;
  size_t pending_head_ = 0;
  size_t pending_count_ = 0;
};

}  // namespace ponte::verbs
