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

Status FabricCq::open(const FabricLibrary& lib, struct fid_domain* domain, size_t size, bool want_wait) {
  lib_ = &lib;
  struct fi_cq_attr attr = {};
  attr.size = size;
  attr.format = FI_CQ_FORMAT_DATA;
  attr.wait_obj = want_wait ? FI_WAIT_FD : FI_WAIT_NONE;
  int rc = fi_cq_open(domain, &attr, &cq_, nullptr);
  if (rc != 0 && want_wait) return open(lib, domain, size, false);  // none to give: sleep blind
  if (rc != 0) {
    cq_ = nullptr;
    return Status(Code::kTransport, "fi_cq_open(%zu entries): %s", size, lib.error_text(rc));
  }
  if (want_wait) {
    int fd = -1;
    if (fi_control(&cq_->fid, FI_GETWAIT, &fd) == 0 && fd >= 0) {
      wait_fd_ = fd;
    } else {
      // A wait object nobody can sleep on (udp;ofi_rxd gives no descriptor) would only cost its
      // signal after every completion.
      close_fid(lib, &cq_->fid, "completion queue");
      cq_ = nullptr;
      return open(lib, domain, size, false);
    }
  }
  return Status::Ok();
}

}  // namespace ponte::fabric
