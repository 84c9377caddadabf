// The libibverbs backend: lists every ACTIVE port that PONTE_IB_HCA keeps (one NicInfo per port)
// and opens VerbsNics on them. Built by open_verbs_backend() (core/nic.h).
#pragma once

#include <memory>
#include <vector>

#include "core/config.h"
#include "core/nic.h"
#include "core/verbs/verbs_device.h"

namespace ponte::verbs {

class VerbsBackend final : public Backend {
 public:
  static Result<std::unique_ptr<VerbsBackend>> open(const Config& cfg);
  ~VerbsBackend() override;

  BackendKind kind() const override { return BackendKind::kVerbs; }
  const std::vector<NicInfo>& devices() const override { return infos_; }
  Result<std::unique_ptr<Nic>> open_nic(size_t device_index) override;

  const std::vector<VerbsPort>& ports() const { return ports_; }

 private:
  VerbsBackend(const VerbsApi& api, const Config& cfg) : api_(api), cfg_(cfg) {}

  const VerbsApi& api_;
  Config cfg_;
  ibv_device** list_ = nullptr;  // kept: ports_ point into it
  std::vector<VerbsPort> ports_;
  std::vector<NicInfo> infos_;
};

}  // namespace ponte::verbs
