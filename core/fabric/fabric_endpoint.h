// One opened libfabric NIC: fabric, domain, AV, CQ and an FI_EP_RDM endpoint behind ponte's Nic
// interface. Posts and polls allocate nothing and lock nothing.
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_endpoint.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "core/fabric/fabric_av.h"
#include "core/fabric/fabric_cq.h"
#include "core/fabric/fabric_domain.h"
#include "core/fabric/fabric_loader.h"
#include "core/fabric/fabric_mr.h"
#include "core/nic.h"

namespace ponte::fabric {

// Provider peculiarities handled here, behind the Nic interface:
// - every operation carries an OpContext (fi_context2 room for FI_CONTEXT/FI_CONTEXT2 providers);
//   completions are told apart by it, never by their flags; a context-less completion with
//   FI_REMOTE_CQ_DATA is a peer's write-with-immediate (kRemoteWrite, len always reported 0);
// - FI_RX_CQ_DATA (EFA may set it): a peer's write with data consumes a posted receive; that
//   receive is posted again here and only the kRemoteWrite is reported. Such a provider needs
//   receives posted for writes-with-immediate to land: the engine always posts some;
// - remove_peer() ends the operations still outstanding toward that peer as kCancelled (no
//   provider here fails them by itself when the peer dies);
// - 0-byte writes with immediate go to the provider as they are: tcp;ofi_rxm, shm, net and
//   udp;ofi_rxd all accept them (tested), with or without a local buffer.
// Whether an error completion's errno (fi_cq_err_entry::err) refuses that operation alone and
// leaves the connection intact (Completion::op_only): a bad key, address or length. Anything else
// counts as a broken connection, which the engine rebuilds.
bool refuses_one_operation(int err);

class FabricNic final : public Nic {
 public:
  // info: the device's fi_info (copied; the backend may go away first). max_inflight caps the
  // transmit contexts (the provider's tx queue size is the other cap). cq_wait: give the CQ a wait
  // object (Config::idle_wake_on_data where NicInfo::cq_wait_resets; Nic::wait_fd).
  static Result<std::unique_ptr<Nic>> open(const FabricLibrary& lib, const struct fi_info& info,
                                           const NicInfo& nic_info, uint32_t max_inflight, bool cq_wait);
  ~FabricNic() override;

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
                   uint64_t ctx, bool inline_ok) override;  // never inlines: inline_ok unused
  Status post_recv(void* buf, size_t len, void* desc, uint64_t ctx) override;
  int poll(Completion* out, int max) override;
  int wait_fd() const override { return cq_.wait_fd(); }
  bool arm_wait() override;

 private:
  FabricNic(const FabricLibrary& lib, const NicInfo& nic_info) : lib_(lib), info_(nic_info) {}
  Status init(const struct fi_info& info, uint32_t max_inflight, bool cq_wait);
  Status create_endpoint(struct fi_info* fi);
  static constexpr int kShmNameTries = 16;  // endpoint indices tried past a dead process's regions
  Status post_failed(ssize_t rc, const char* what, OpContext* op);
  OpContext* begin_tx(size_t len, NicPeer peer, uint64_t ctx, Status* st);
  Status check_length(size_t len) const;
  int read_error(Completion* out);
  bool classify(const struct fi_cq_data_entry& entry, Completion* out);
  void repost_consumed_receives(Completion* out, int max, int* n);
  int report_cancelled(Completion* out, int max);
  void warn_limited(const char* fmt, ...) __attribute__((format(printf, 2, 3)));

  // Owns a copy of the device's fi_info for as long as the objects opened from it live.
  struct InfoCopy {
    const FabricLibrary* lib = nullptr;
    struct fi_info* info = nullptr;
    ~InfoCopy() {
      if (info != nullptr) lib->freeinfo(info);
    }
  };

  const FabricLibrary& lib_;
  NicInfo info_;
  InfoCopy fi_;  // declared first: freed last
  // Declaration order is closing order reversed: the endpoint closes first, the domain last.
  FabricDomain domain_;
  FabricMrTable mrs_;
  FabricAv av_;
  FabricCq cq_;
  struct fid_ep* ep_ = nullptr;
  OpContextPool ops_;
  std::vector<uint8_t> address_;
  // Receives consumed by a remote write with data (FI_RX_CQ_DATA) waiting to be posted again.
  std::unique_ptr<OpContext*[]> repost_;
  uint32_t repost_count_ = 0;
  // Transmit contexts toward removed peers, to be reported as kCancelled by the next polls.
  std::unique_ptr<OpContext*[]> cancelled_;
  uint32_t cancelled_count_ = 0;
  uint64_t warnings_ = 0;
};

}  // namespace ponte::fabric
