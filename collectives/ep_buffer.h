// EpBuffer: MoE expert-parallel dispatch and combine over a Communicator: one registered arena per
// rank, split phases (send returns after posting, recv waits and unpacks), two live handles at most.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "collectives/communicator.h"
#include "collectives/ep_device.h"
#include "collectives/ep_layout.h"
#include "core/status.h"

namespace ponte {

struct EpConfig {
  int num_experts = 0;  // E: a multiple of the world size; expert e lives on rank e / (E / W)
  int max_tokens = 0;   // most tokens one rank dispatches in one call (T <= max_tokens, T may be 0)
  int hidden = 0;       // H: elements per row of x and y
  int topk = 0;         // K: experts per token (topk_idx[t, k] == -1: none)
  DType dtype = DType::kBFloat16;  // of x and y (bf16 as raw 16-bit values on the host)
  // Bytes carried with each dispatched row besides its H elements (fp8's per-128-column scales, later).
  // Must be 0 today: kept apart from the row bytes in every size computation (ep_layout.h).
  size_t extra_bytes_per_row = 0;
  // Where x, recv_x, y and out live: nullptr, host memory; else that device's memory (for CUDA,
  // ponte::cuda::make_ep_device, collectives/cuda/ep_device_cuda.h), packed and unpacked by its
  // kernels into and out of an arena it maps (collectives/ep_device.h). topk_idx, topk_weights and
  // recv_count stay in host memory either way. The device outlives the buffer.
  EpDevice* device = nullptr;
};

// A [rows, hidden] row-major matrix of dtype owned by the caller.
struct EpRows {
  void* data = nullptr;
  size_t rows = 0;
  size_t hidden = 0;
  DType dtype = DType::kBFloat16;
};

class EpBuffer;

// One dispatch/combine in flight. Valid from dispatch_send until its combine_recv returns (or any of
// its calls fails). Copies refer to the same state.
class EpHandle {
 public:
  bool valid() const;
  int slot() const { return slot_; }
  // Per received row of recv_x, int32 pairs (source rank, token index at the source):
  // [L, W * max_tokens, 2]; rows of expert l past recv_count[l] are -1. Valid after dispatch_recv.
  std::span<const int32_t> src_info() const;
  // Per local expert and source rank, int32 pairs (begin, count) of that source's rows inside the
  // expert's block of recv_x: [L, W, 2]. The ranges tile the block from row 0, this rank's own
  // rows first (unpacked while the others' are in flight), then the other ranks' in rank order.
  // Valid after dispatch_recv.
  std::span<const int32_t> layout_range() const;
  int num_tokens() const;  // T of the dispatch that made this handle

 private:
  friend class EpBuffer;
  EpBuffer* buf_ = nullptr;
  int slot_ = -1;
  uint64_t seq_ = 0;
};

// Not thread-safe (one thread per EpBuffer). Collective: create and every dispatch/combine call are
// made by all ranks in the same order. Bad input (an expert index >= E or < -1, T > max_tokens, H or
// dtype not the buffer's, an output too small, more than max_tokens rows of one rank to one expert)
// fails before anything is sent and leaves the buffer usable. A dead peer or timeout fails the call
// with the rank named, and every later call. Destroy an EpBuffer before its Communicator (its
// destructor waits for its own writes still in flight on the communicator's engine).
class EpBuffer {
 public:
  static Result<std::unique_ptr<EpBuffer>> create(Communicator& comm, const EpConfig& cfg);
  ~EpBuffer();
  EpBuffer(const EpBuffer&) = delete;
  EpBuffer& operator=(const EpBuffer&) = delete;

  const EpConfig& config() const;
  int local_experts() const;          // L = E / W
  size_t recv_rows_per_expert() const;  // W * max_tokens: recv_x has L blocks of this many rows

  // x: [T, H]; topk_idx: T * K int64. Packs one block per destination rank and posts the writes;
  // returns at once, and x may then change. A third live handle is refused (kResource).
  Result<EpHandle> dispatch_send(const EpRows& x, std::span<const int64_t> topk_idx);
  // Waits for every rank's block and unpacks: recv_x [L * W * max_tokens, H] (expert l's rows at
  // l * W * max_tokens, recv_count[l] of them, in any order), recv_count [L] int32.
  Status dispatch_recv(EpHandle& h, const EpRows& recv_x, std::span<int32_t> recv_count);
  // y: the experts' outputs in recv_x's layout. Sends each row back to its source; returns at once,
  // and y may then change (its rows were copied out, this rank's own too).
  Status combine_send(EpHandle& h, const EpRows& y);
  // out [T, H]: out[t] = sum over valid k of topk_weights[t, k] * y_row(t, k), summed in float32,
  // in the original token order; tokens with no valid expert get zeros, or, with accumulate, the sum
  // is added to out (tokens with no valid expert untouched). Releases the handle.
  Status combine_recv(EpHandle& h, std::span<const float> topk_weights, const EpRows& out, bool accumulate = false);

  // Both phases of each in one call. dispatch unpacks this rank's own rows from x, combine reads
  // them from y, in place (one copy of them fewer than the split calls, whose x and y may change
  // once their send returns).
  Result<EpHandle> dispatch(const EpRows& x, std::span<const int64_t> topk_idx, const EpRows& recv_x,
                            std::span<int32_t> recv_count);
  Status combine(EpHandle& h, const EpRows& y, std::span<const float> topk_weights, const EpRows& out,
                 bool accumulate = false);

  int live_handles() const;

  struct Impl;

 private:
  friend class EpHandle;
  EpBuffer();
  Result<EpHandle> dispatch_send_impl(const EpRows& x, std::span<const int64_t> topk_idx, bool x_stays);
  Status combine_send_impl(EpHandle& h, const EpRows& y, bool y_stays);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ponte
