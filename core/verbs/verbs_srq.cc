// Shared receive queue with a fixed slot table and batched posting.
#include "core/verbs/verbs_srq.h"

#include <cerrno>
#include <cstring>

#include "core/verbs/verbs_cq.h"

namespace ponte::verbs {

Result<std::unique_ptr<VerbsSrq>> VerbsSrq::create(const VerbsApi& api, ibv_pd* pd, int depth,
                                                   const std::string& name) {
  std::unique_ptr<VerbsSrq> s(new VerbsSrq(api));
  ibv_srq_init_attr attr{};
  attr.attr.max_wr = static_cast<uint32_t>(depth);
  attr.attr.max_sge = 1;
  s->srq_ = api.create_srq(pd, &attr);
  if (s->srq_ == nullptr) {
    return Status(Code::kResource, "ibv_create_srq(%s, %d entries) failed: %s", name.c_str(), depth,
                  strerror(errno));
  }
  // Never post more than asked for, even when the provider granted more.
  s->slots_.resize(static_cast<size_t>(depth));
  s->free_.resize(static_cast<size_t>(depth));
  for (size_t i = 0; i < s->free_.size(); ++i) s->free_[i] = static_cast<uint32_t>(depth - 1 - i);
  s->free_count_ = s->free_.size();
  return s;
}

VerbsSrq::~VerbsSrq() {
  if (srq_ != nullptr) api_.destroy_srq(srq_);
}

ibv_recv_wr* VerbsSrq::chain() {
  for (int i = 0; i < staged_count_; ++i) {
    const Slot& s = slots_[staged_[static_cast<size_t>(i)]];
    ibv_sge& sge = sges_[static_cast<size_t>(i)];
    sge.addr = s.addr;
    sge.length = s.len;
    sge.lkey = s.lkey;
    ibv_recv_wr& wr = wrs_[static_cast<size_t>(i)];
    wr.wr_id = wrid::recv(staged_[static_cast<size_t>(i)]);
    wr.sg_list = s.len > 0 ? &sge : nullptr;
    wr.num_sge = s.len > 0 ? 1 : 0;
    wr.next = i + 1 < staged_count_ ? &wrs_[static_cast<size_t>(i) + 1] : nullptr;
  }
  return staged_count_ > 0 ? &wrs_[0] : nullptr;
}

Status VerbsSrq::stage(void* buf, size_t len, uint32_t lkey, uint64_t ctx) {
  if (len > UINT32_MAX) {
    return Status(Code::kInvalidArgument, "receive buffer of %zu bytes is too large", len);
  }
  if (free_count_ == 0) return Status(Code::kAgain, "shared receive queue full (%d)", depth());
  if (batch_full()) return Status(Code::kAgain, "receive batch full: flush first");
  uint32_t slot = free_[--free_count_];
  Slot& s = slots_[slot];
  s.ctx = ctx;
  s.addr = reinterpret_cast<uintptr_t>(buf);
  s.len = static_cast<uint32_t>(len);
  s.lkey = lkey;
  s.posted = true;
  staged_[static_cast<size_t>(staged_count_++)] = slot;
  return Status::Ok();
}

bool VerbsSrq::restage(uint32_t slot) {
  if (batch_full()) return false;  // never overrun the batch
  staged_[static_cast<size_t>(staged_count_++)] = slot;
  return true;
}

void VerbsSrq::release(uint32_t slot) {
  if (!slots_[slot].posted) return;
  slots_[slot].posted = false;
  free_[free_count_++] = slot;
}

}  // namespace ponte::verbs
