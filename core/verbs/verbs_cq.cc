// Completion queue creation and teardown.
#include "core/verbs/verbs_cq.h"

#include <cerrno>
#include <cstring>

namespace ponte::verbs {

Result<std::unique_ptr<VerbsCq>> VerbsCq::create(const VerbsApi& api, ibv_context* ctx, int depth,
                                                 const std::string& name) {
  std::unique_ptr<VerbsCq> c(new VerbsCq(api));
  c->cq_ = api.create_cq(ctx, depth, nullptr, nullptr, 0);
  if (c->cq_ == nullptr) {
    return Status(Code::kResource, "ibv_create_cq(%s, %d entries) failed: %s", name.c_str(), depth,
                  strerror(errno));
  }
  c->depth_ = c->cq_->cqe;
  return c;
}

VerbsCq::~VerbsCq() {
  if (cq_ != nullptr) api_.destroy_cq(cq_);
}

}  // namespace ponte::verbs
