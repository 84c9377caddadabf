// One libfabric fabric + domain for one opened NIC: every other per-NIC object (AV, CQ, endpoint,
// memory registrations) is opened from it. Closed last.
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_domain.h>

#include "core/fabric/fabric_loader.h"
#include "core/status.h"

namespace ponte::fabric {

class FabricDomain {
 public:
  FabricDomain() = default;
  FabricDomain(const FabricDomain&) = delete;
  FabricDomain& operator=(const FabricDomain&) = delete;
  ~FabricDomain();

  // Opens the fabric and the domain that info names.
  Status open(const FabricLibrary& lib, struct fi_info* info);

  struct fid_fabric* fabric() const {
    return fabric_;
  }
  struct fid_domain* domain() const {
    return domain_;
  }

 private:
  const FabricLibrary* lib_ = nullptr;
  struct fid_fabric* fabric_ = nullptr;
  struct fid_domain* domain_ = nullptr;
};

// Closes a libfabric object, warning (never failing) when the provider refuses.
void close_fid(const FabricLibrary& lib, struct fid* fid, const char* what);

}  // namespace ponte::fabric
