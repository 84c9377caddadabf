// Memory registration on one NIC's domain, obeying the mr_mode the provider granted: ponte hands
// out unique requested keys itself unless the provider chose them (FI_MR_PROV_KEY, as on EFA).
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/fabric/fabric_loader.h"
#include "core/nic.h"
#include "core/status.h"

namespace ponte::fabric {

class FabricMrTable {
 public:
  // mr_mode, key size and caps as fi_getinfo granted them for this domain.
  void init(const FabricLibrary& lib, const struct fi_info& info);

  // ep is bound and enabled to each registration when the provider asks for FI_MR_ENDPOINT.
  Result<NicMr> register_memory(struct fid_domain* domain, struct fid_ep* ep,
                                const MemoryDesc& mem);
  void deregister(const NicMr& mr);

  size_t live() const { return open_.size(); }
  // Closes what is still registered (the endpoint is closed, the domain goes next); returns how many.
  size_t close_all();
  bool virt_addr() const { return (mr_mode_ & FI_MR_VIRT_ADDR) != 0; }
  bool device_memory() const { return device_memory_; }
  bool dmabuf() const { return dmabuf_; }

 private:
  uint64_t next_key();

  const FabricLibrary* lib_ = nullptr;
  uint64_t mr_mode_ = 0;
  uint64_t key_mask_ = ~0ull;  // keys fit in domain_attr->mr_key_size bytes
  uint64_t key_counter_ = 0;   // last requested key handed out (ponte-chosen keys only)
  bool device_memory_ = false;
  bool dmabuf_ = false;
  std::vector<struct fid_mr*> open_;  // registration is not a hot path: a plain list
};

}  // namespace ponte::fabric
