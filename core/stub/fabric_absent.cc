// Built when ponte is configured without the libfabric backend (no rdma/fabric.h at build time).
#include "core/nic.h"

namespace ponte {
Result<std::unique_ptr<Backend>> open_fabric_backend(const Config&) {
  return Status(Code::kUnavailable, "ponte was built without the libfabric backend");
}
}  // namespace ponte
