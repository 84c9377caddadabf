// Opening and closing the fabric and domain of one NIC.
#include "core/fabric/fabric_domain.h"

#include "core/log.h"

namespace ponte::fabric {

void close_fid(const FabricLibrary& lib, struct fid* fid, const char* what) {
  if (fid == nullptr) return;
  int rc = fi_close(fid);
  if (rc != 0)
    PONTE_LOG_WARN("fabric: closing the %s failed: %s (%d)", what, lib.error_text(rc), rc);
}

FabricDomain::~FabricDomain() {
  if (lib_ == nullptr) return;
  close_fid(*lib_, domain_ ? &domain_->fid : nullptr, "domain");
  close_fid(*lib_, fabric_ ? &fabric_->fid : nullptr, "fabric");
}

Status FabricDomain::open(const FabricLibrary& lib, struct fi_info* info) {
  lib_ = &lib;
  int rc = lib.fabric(info->fabric_attr, &fabric_, nullptr);
  if (rc != 0) {
    fabric_ = nullptr;
    return Status(Code::kTransport, "fi_fabric(%s): %s", info->fabric_attr->name,
                  lib.error_text(rc));
  }
  rc = fi_domain(fabric_, info, &domain_, nullptr);
  if (rc != 0) {
    domain_ = nullptr;
    return Status(Code::kTransport, "fi_domain(%s): %s", info->domain_attr->name,
                  lib.error_text(rc));
  }
  return Status::Ok();
}

}  // namespace ponte::fabric
