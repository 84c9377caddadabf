// The address vector of one NIC (FI_AV_TABLE) and its peer table: ponte's dense NicPeer indexes
// mapped to libfabric fi_addr_t. Peer addresses are checked against this NIC's own format first.
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_domain.h>

#include <cstdint>
#include <span>
#include <vector>

#include "core/fabric/fabric_loader.h"
#include "core/nic.h"
#include "core/status.h"

namespace ponte::fabric {

class FabricAv {
 public:
  FabricAv() = default;
  FabricAv(const FabricAv&) = delete;
  FabricAv& operator=(const FabricAv&) = delete;
  ~FabricAv();

  Status open(const FabricLibrary& lib, struct fid_domain* domain, uint32_t addr_format);
  struct fid_av* av() const {
    return av_;
  }

  // own_address: this NIC's fi_getname bytes, the model a peer address must match.
  Result<NicPeer> insert(std::span<const uint8_t> peer_address,
                         std::span<const uint8_t> own_address);
  void remove(NicPeer peer);

  // FI_ADDR_NOTAVAIL for an unknown or removed peer. Hot path: no allocation, no lock.
  fi_addr_t lookup(NicPeer peer) const {
    return peer < peers_.size() ? peers_[peer] : FI_ADDR_NOTAVAIL;
  }

 private:
  Status check_address(std::span<const uint8_t> peer, std::span<const uint8_t> own) const;

  const FabricLibrary* lib_ = nullptr;
  struct fid_av* av_ = nullptr;
  uint32_t addr_format_ = FI_FORMAT_UNSPEC;
  std::vector<fi_addr_t> peers_;  // NicPeer -> fi_addr_t; removed peers stay FI_ADDR_NOTAVAIL
};

}  // namespace ponte::fabric
