// The completion queue of one NIC and the pool of operation contexts posted with every operation:
// each holds the provider's fi_context2 scratch space and maps a completion back to ponte's ctx.
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_eq.h>

#include <cstdint>
#include <memory>

#include "core/fabric/fabric_loader.h"
#include "core/nic.h"
#include "core/status.h"

namespace ponte::fabric {

// Posted as the op_context of every operation. FI_CONTEXT / FI_CONTEXT2 providers write into fi,
// so it must stay put until the completion: contexts live in one preallocated array.
struct OpContext {
  struct fi_context2 fi;  // first member: op_context == &fi == this
  uint64_t ctx = 0;       // the engine's 64-bit context
  NicPeer peer = 0;       // transmit operations: the peer they go to
  // Receives only: what to repost when a remote write with data consumed it (FI_RX_CQ_DATA).
  void* buf = nullptr;
  size_t len = 0;
  void* desc = nullptr;
  CompletionKind kind = CompletionKind::kLocal;
  bool in_use = false;
  // Already reported to the engine as cancelled (its peer was removed): when the provider does
  // complete it after all, the context is only taken back.
  bool orphaned = false;
};

// Free lists of transmit and receive contexts over one array. Single-threaded, allocation-free
// after init: take() is O(1), a full pool answers nullptr (the caller reports kAgain).
class OpContextPool {
 public:
  void init(uint32_t tx_count, uint32_t rx_count);

  OpContext* take_tx() { return take(tx_free_.get(), &tx_top_, CompletionKind::kLocal); }
  OpContext* take_rx() { return take(rx_free_.get(), &rx_top_, CompletionKind::kRecv); }
  void give(OpContext* op) {
    op->in_use = false;
    op->orphaned = false;
    uint32_t index = static_cast<uint32_t>(op - slots_.get());
    if (index < tx_count_) {
      tx_free_[tx_top_++] = index;
    } else {
      rx_free_[rx_top_++] = index;
    }
  }
  // The context a completion's op_context names, or nullptr when it is not one of ours (a
  // provider-generated completion, or a remote write's target completion).
  OpContext* find(const void* op_context) const {
    uintptr_t base = reinterpret_cast<uintptr_t>(slots_.get());
    uintptr_t p = reinterpret_cast<uintptr_t>(op_context);
    if (p < base) return nullptr;
    uintptr_t off = p - base;
    if (off >= total() * sizeof(OpContext) || off % sizeof(OpContext) != 0) return nullptr;
    OpContext* op = slots_.get() + off / sizeof(OpContext);
    return op->in_use ? op : nullptr;
  }
  OpContext* slot(uint32_t index) { return &slots_[index]; }
  uint32_t tx_count() const { return tx_count_; }
  uint32_t rx_count() const { return rx_count_; }
  uint32_t total() const { return tx_count_ + rx_count_; }

 private:
  OpContext* take(uint32_t* stack, uint32_t* top, CompletionKind kind) {
    if (*top == 0) return nullptr;
    OpContext* op = &slots_[stack[--*top]];
    op->in_use = true;
    op->kind = kind;
    return op;
  }

  std::unique_ptr<OpContext[]> slots_;
  std::unique_ptr<uint32_t[]> tx_free_;
  std::unique_ptr<uint32_t[]> rx_free_;
  uint32_t tx_count_ = 0;
  uint32_t rx_count_ = 0;
  uint32_t tx_top_ = 0;
  uint32_t rx_top_ = 0;
};

class FabricCq {
 public:
  FabricCq() = default;
  FabricCq(const FabricCq&) = delete;
  FabricCq& operator=(const FabricCq&) = delete;
  ~FabricCq();

  // FI_CQ_FORMAT_DATA. With want_wait, asks for an FI_WAIT_FD wait object (for an idle worker to
  // sleep on: Nic::wait_fd) and falls back to none where the provider has none to give.
  Status open(const FabricLibrary& lib, struct fid_domain* domain, size_t size, bool want_wait);
  struct fid_cq* cq() const {
    return cq_;
  }
  // The wait object's descriptor, or -1.
  int wait_fd() const {
    return wait_fd_;
  }

 private:
  const FabricLibrary* lib_ = nullptr;
  struct fid_cq* cq_ = nullptr;
  int wait_fd_ = -1;
};

}  // namespace ponte::fabric
