// The libfabric Backend: asks fi_getinfo for FI_EP_RDM endpoints of one provider with RMA and
// remote CQ data, lists one NIC per domain it offers, and opens them.
#pragma once

#include <rdma/fabric.h>

#include <memory>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/fabric/fabric_loader.h"
#include "core/nic.h"

namespace ponte::fabric {

class FabricBackend final : public Backend {
 public:
  // Loads libfabric (see fabric_loader.h) and queries cfg.fabric_provider.
  static Result<std::unique_ptr<FabricBackend>> open(const Config& cfg);
  ~FabricBackend() override;

  BackendKind kind() const override { return BackendKind::kFabric; }
  const std::vector<NicInfo>& devices() const override { return devices_; }
  Result<std::unique_ptr<Nic>> open_nic(size_t device_index) override;

  const FabricLibrary& library() const { return lib_; }

 private:
  FabricBackend(const FabricLibrary& lib, const Config& cfg)
      : lib_(lib), max_inflight_(cfg.max_inflight), wake_on_data_(cfg.idle_wake_on_data),
        wake_unchecked_(cfg.idle_wake_unchecked) {}

  const FabricLibrary& lib_;
  uint32_t max_inflight_;
  bool wake_on_data_;    // Config::idle_wake_on_data
  bool wake_unchecked_;  // Config::idle_wake_unchecked
  std::vector<struct fi_info*> infos_;  // one fi_dupinfo copy per device, same order as devices_
  std::vector<NicInfo> devices_;
};

}  // namespace ponte::fabric
