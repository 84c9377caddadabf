// The shared receive queue of one verbs NIC: the engine's posted receive buffers, kept in a fixed
// slot table so that a completion finds its buffer and a write-with-imm's receive can be reposted.
#pragma once

#include <memory>
#include <vector>

#include "core/verbs/verbs_loader.h"

namespace ponte::verbs {

class VerbsSrq {
 public:
  static Result<std::unique_ptr<VerbsSrq>> create(const VerbsApi& api, ibv_pd* pd, int depth,
                                                  const std::string& name);
  ~VerbsSrq();
  VerbsSrq(const VerbsSrq&) = delete;
  VerbsSrq& operator=(const VerbsSrq&) = delete;

  ibv_srq* srq() const { return srq_; }
  int depth() const { return static_cast<int>(slots_.size()); }

  // Posts one receive; kAgain when every slot holds a posted buffer. No allocation, no lock.
  Status post(void* buf, size_t len, uint32_t lkey, uint64_t ctx);
  // Puts the receive of a slot whose completion was a write-with-immediate back on the queue.
  // Returns 0 or the provider's errno value (the slot is then released).
  int repost(uint32_t slot);
  // The engine's ctx of a slot, and giving the slot back once its buffer returned to the engine.
  uint64_t ctx(uint32_t slot) const { return slots_[slot].ctx; }
  bool valid(uint32_t slot) const { return slot < slots_.size() && slots_[slot].posted; }
  void release(uint32_t slot);
  int posted() const { return depth() - static_cast<int>(free_count_); }

 private:
  struct Slot {
    uint64_t ctx = 0;
    uint64_t addr = 0;
    uint32_t len = 0;
    uint32_t lkey = 0;
    bool posted = false;
  };
  explicit VerbsSrq(const VerbsApi& api) : api_(api) {}
  int post_slot(uint32_t slot);

  const VerbsApi& api_;
  ibv_srq* srq_ = nullptr;
  std::vector<Slot> slots_;
  std::vector<uint32_t> free_;  // stack of free slot indexes
  size_t free_count_ = 0;
};

}  // namespace ponte::verbs
