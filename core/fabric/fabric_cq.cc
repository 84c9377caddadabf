// Completion queue and operation-context pool of one NIC.
#include "core/fabric/fabric_cq.h"

#include "core/fabric/fabric_domain.h"

namespace ponte::fabric {

void OpContextPool::init(uint32_t tx_count, uint32_t rx_count) {
  tx_count_ = tx_count;
  rx_count_ = rx_count;
  slots_ = std::make_unique<OpContext[]>(total());
  tx_free_ = std::make_unique<uint32_t[]>(tx_count);
  rx_free_ = std::make_unique<uint32_t[]>(rx_count);
  // Lowest index on top, so that a quiet NIC keeps reusing the same few (cache-warm) contexts.
  tx_top_ = 0;
  for (uint32_t i = tx_count; i > 0; --i) tx_free_[tx_top_++] = i - 1;
  rx_top_ = 0;
  for (uint32_t i = rx_count; i > 0; --i) rx_free_[rx_top_++] = tx_count + i - 1;
}

FabricCq::~FabricCq() {
  if (lib_ != nullptr) close_fid(*lib_, cq_ ? &cq_->fid : nullptr, "completion queue");
}

Status FabricCq::open(const FabricLibrary& lib, struct fid_domain* domain, size_t size) {
  lib_ = &lib;
  struct fi_cq_attr attr = {};
  attr.size = size;
  attr.format = FI_CQ_FORMAT_DATA;
  attr.wait_obj = FI_WAIT_NONE;
  int rc = fi_cq_open(domain, &attr, &cq_, nullptr);
  if (rc != 0) {
    cq_ = nullptr;
    return Status(Code::kTransport, "fi_cq_open(%zu entries): %s", size, lib.error_text(rc));
  }
  return Status::Ok();
}

}  // namespace ponte::fabric
