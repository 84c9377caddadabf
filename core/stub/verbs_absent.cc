// Built when ponte is configured without the libibverbs backend (no infiniband/verbs.h).
#include "core/nic.h"

namespace ponte {
Result<std::unique_ptr<Backend>> open_verbs_backend(const Config&) {
  return Status(Code::kUnavailable, "ponte was built without the libibverbs backend");
}
}  // namespace ponte
