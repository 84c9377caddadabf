// The shared receive queue of one verbs NIC: the engine's posted receive buffers, kept in a fixed
// slot table so that a completion finds its buffer and a write-with-imm's receive can be reposted.
// Receives are staged and reach the queue in batches: one ibv_post_srq_recv with a chained list
// (one doorbell) for everything staged since the last flush, not one call per receive.
#pragma once

#include <array>
#include <memory>
#include <vector>

#include "core/verbs/verbs_loader.h"

namespace ponte::verbs {

class VerbsSrq {
 public:
  static constexpr int kBatch = 64;  // receives staged at most before they must be flushed

  static Result<std::unique_ptr<VerbsSrq>> create(const VerbsApi& api, ibv_pd* pd, int depth,
                                                  const std::string& name);
  ~VerbsSrq();
  VerbsSrq(const VerbsSrq&) = delete;
  VerbsSrq& operator=(const VerbsSrq&) = delete;

  ibv_srq* srq() const { return srq_; }
  int depth() const { return static_cast<int>(slots_.size()); }

  // Takes a free slot for one receive and stages it; kAgain when every slot holds a receive.
  // Call flush() first when batch_full(). No allocation, no lock.
  Status stage(void* buf, size_t len, uint32_t lkey, uint64_t ctx);
  // Stages the receive of a slot whose completion was a write-with-immediate again (its buffer
  // was not touched). Call flush() first when batch_full(); false (nothing staged) if not.
  bool restage(uint32_t slot);
  bool batch_full() const { return staged_count_ == kBatch; }
  int staged() const { return staged_count_; }
  // Posts every staged receive with one ibv_post_srq_recv. The provider posts a prefix of the
  // list; the receives it refused are released and handed to refused(ctx) each, for the caller
  // to give their buffers back. Returns 0 or the provider's errno value.
  template <typename F>
  int flush(F&& refused);

  // The engine's ctx of a slot, and giving the slot back once its buffer returned to the engine.
  uint64_t ctx(uint32_t slot) const { return slots_[slot].ctx; }
  bool valid(uint32_t slot) const { return slot < slots_.size() && slots_[slot].posted; }
  void release(uint32_t slot);
  // Receives held (on the queue or staged for it).
  int posted() const { return depth() - static_cast<int>(free_count_); }
  // ibv_post_srq_recv calls so far (diagnostics: how well reposts are batched).
  uint64_t doorbells() const { return doorbells_; }

 private:
  struct Slot {
    uint64_t ctx = 0;
    uint64_t addr = 0;
    uint32_t len = 0;
    uint32_t lkey = 0;
    bool posted = false;
  };
  explicit VerbsSrq(const VerbsApi& api) : api_(api) {}
  // Chains the staged receives' work requests; returns the head (null when none is staged).
  ibv_recv_wr* chain();

  const VerbsApi& api_;
  ibv_srq* srq_ = nullptr;
  std::vector<Slot> slots_;
  std::vector<uint32_t> free_;  // stack of free slot indexes
  size_t free_count_ = 0;
  std::array<uint32_t, kBatch> staged_{};  // slots waiting for the next flush, in staging order
  int staged_count_ = 0;
  std::array<ibv_recv_wr, kBatch> wrs_{};
  std::array<ibv_sge, kBatch> sges_{};
  uint64_t doorbells_ = 0;
};

template <typename F>
int VerbsSrq::flush(F&& refused) {
  ibv_recv_wr* head = chain();
  if (head == nullptr) return 0;
  const int n = staged_count_;
  staged_count_ = 0;
  ++doorbells_;
  ibv_recv_wr* bad = nullptr;
  int rc = ibv_post_srq_recv(srq_, head, &bad);
  if (rc == 0) return 0;
  // wrs_[i] is staged_[i]: everything from the refused request on was not posted.
  int first = bad != nullptr ? static_cast<int>(bad - wrs_.data()) : 0;
  if (first < 0 || first > n) first = 0;
  for (int i = first; i < n; ++i) {
    uint32_t slot = staged_[static_cast<size_t>(i)];
    uint64_t c = slots_[slot].ctx;
    release(slot);
    refused(c);
  }
  return rc;
}

}  // namespace ponte::verbs
