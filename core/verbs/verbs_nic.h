// One verbs NIC (a device port): its own context, PD, CQ and SRQ, and one RC QP per peer, connected
// lazily through connect blobs the engine exchanges. Implements ponte::Nic.
#pragma once

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
// Until then posts to that peer return kAgain. connect_blob on a QP that waits for its peer's blob
// or is still connected returns the same blob (a handshake may be sent twice); on a failed QP (an
// error completion here, or a device state of ERR, as after the peer wrote with a bad rkey) it
// builds a new QP. A failed QP answers posts with kTransport until then, and every work request
// still on it comes back as an error completion (kTransport), never lost.
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

  Result<NicMr> register_memory(const MemoryDesc& mem) override;
  void deregister(const NicMr& mr) override;

  Status post_write(const WriteWr& wr) override;
  Status post_read(NicPeer peer, void* local, size_t len, void* desc, uint64_t remote_addr,
                   uint64_t rkey, uint64_t ctx) override;
  Status post_send(NicPeer peer, const void* buf, size_t len, void* desc, uint32_t imm,
                   uint64_t ctx) override;
  Status post_recv(void* buf, size_t len, void* desc, uint64_t ctx) override;
  int poll(Completion* out, int max) override;

  // For tests and diagnostics.
  const NicLimits& limits() const { return limits_; }
  uint32_t sends_in_flight() const { return nic_sends_; }
  int receives_posted() const { return srq_->posted(); }
  int gid_index() const { return port_.gid_index; }

 private:
  struct Peer {
    VerbsAddress address;
    std::unique_ptr<VerbsQp> qp;
    std::vector<std::unique_ptr<VerbsQp>> retired;  // in ERR, still owed completions
    uint16_t next_generation = 0;
    bool removed = false;
  };

  VerbsNic(const VerbsApi& api, const VerbsPort& port) : api_(api), port_(port) {}
  // The peer's QP when it can take a send WR now; else the reason (kAgain / kTransport / ...).
  Status sendable(NicPeer peer, size_t len, VerbsQp** qp);
  Status post(NicPeer peer, VerbsQp* qp, ibv_send_wr* wr, uint64_t ctx);
  void retire(Peer& p);
  void reap_retired(Peer& p);
  VerbsQp* find_qp(uint32_t peer, uint16_t gen);
  void push_pending(const Completion& c);
  // Turns one work completion into engine completions (out first, overflow to pending_).
  void translate(const ibv_wc& wc, Completion* out, int max, int* n);

  const VerbsApi& api_;
  VerbsPort port_;
  NicInfo info_;
  std::vector<uint8_t> address_;
  NicLimits limits_;
  QpParams qp_params_;
  uint32_t psn_seed_ = 0;

  std::unique_ptr<DeviceContext> device_;
  std::unique_ptr<VerbsCq> cq_;
  std::unique_ptr<VerbsSrq> srq_;
  std::unique_ptr<VerbsMemory> memory_;
  std::vector<std::unique_ptr<Peer>> peers_;

  uint32_t nic_sends_ = 0;  // send WRs posted whose completion has not been polled yet
  // Completions produced beyond what a poll() call could return; fixed capacity (see open()).
  std::vector<Completion> pending_;
  size_t pending_head_ = 0;
  size_t pending_count_ = 0;
};

}  // namespace ponte::verbs
